"""Saving a checkpoint: every rank writes its shards into a temporary directory, rank 0 seals
meta.json and renames the directory when every file is complete (cutp.checkpoint's docstring)."""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np

from .. import __version__
from ..runtime.failure import agree_on_error
from .experts import gather_experts, in_model_order, with_experts
from .files import (FORMAT, VERSION, CheckpointError, StreamedSafetensors, fsync_dir, model_file, optim_file,
                    sha256_file, write_json_atomic, write_meta, write_safetensors)
from .run_dir import prune_checkpoints


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(out_root: str, step: int, model, optimizer=None, *, rng_state=None, data_state=None,
                    train_args=None, keep: int | None = None, loss_scaler=None, by_unit: bool = False) -> str:
    """Collective over the model's context. Returns the checkpoint directory. `by_unit` (zero 3,
    its parameters sharded): the model files written from each unit gathered in turn
    (`ShardedAdamW.whole_parameters`; at ep > 1 the other EP ranks' experts handed to the writer
    one parameter at a time: `with_experts`), no rank holding the whole model: the same bytes."""
    ctx = model.ctx
    world = ctx.world.mpi_comm
    name = checkpoint_name(step)
    final = os.path.join(out_root, name)
    tmp = os.path.join(out_root, f".tmp-{name}")

    # DP replicas hold identical parameters: DP rank 0 writes them. The optimizer state: DP rank 0
    # writes it per parameter, or (distributed optimizer) every DP rank writes its own shard's
    # pieces of each parameter, with their offsets, into a file of its own (nothing is gathered)
    # Pipeline stages write their own parameters' files; the last stage's copy of a tied token
    # embedding (bit-identical to the first stage's, and so is its optimizer state) is written
    # only by the first stage.
    # (context parallelism: the CP ranks are replicas too, and the optimizer shards over DP x CP,
    # so "DP" below is the DP x CP group: dp_cp_rank, dp_cp_size; the DP group itself at cp 1)
    sharded = optimizer is not None and optimizer.distributed and ctx.dp_cp_size > 1
    s, pp = ctx.pp_rank, ctx.pp_size
    params = [p for p in model.parameters() if not (p.name == "tok_embed.weight" and not model.first_stage)]
    # frozen parameters (--freeze, LoRA's base) are not saved: resuming re-reads them from the
    # run's init_from (train_args), or draws them from its seed; buffers (changed by their module,
    # the MoE correction bias) are, as the weights
    trainable_only = any(not (p.trainable or p.buffer) for p in model.parameters())
    params = [p for p in params if p.trainable or p.buffer]
    kept = {p.name for p in params}
    mine = []  # (file name, tensors, offsets or None) this rank writes
    param_info = {p.name: {"full_shape": list(p.full_shape), "dtype": str(p.data.dtype),
                           "sharding": p.sharding.spec if p.sharding is not None else None, "real_rows": p.real_rows,
                           **({"stage": s} if pp > 1 else {}), **({"buffer": True} if p.buffer else {})}
                  for p in params}  # (a buffer: no optimizer state)
    # expert parallelism: the other EP ranks' experts, written by DP rank 0 too (cutp.checkpoint.experts)
    e_model, e_optim, e_info = gather_experts(ctx, params, optimizer, param_info, streamed=by_unit)
    param_info = in_model_order(param_info, e_info, [p.name for p in params if p.expert_parallel])
    kept |= set(e_info)
    streamed = {p.name for p in params if not p.buffer} if by_unit else set()  # (a buffer: whole, in no unit)
    later = e_model if by_unit else {}  # (the other EP ranks' experts: (shape, dtype), values streamed)
    if ctx.dp_cp_rank == 0:
        mine.append((model_file(ctx.tp_rank, ctx.tp_size, s, pp),
                     {**{p.name: ctx.to_numpy(p.data) for p in params if p.name not in streamed},
                      **({} if by_unit else e_model)}, None))
    if sharded:
        pieces, offsets = optimizer.state_pieces()
        mine.append((optim_file(ctx.tp_rank, ctx.tp_size, ctx.dp_cp_rank, ctx.dp_cp_size, s, pp),
                     {k: ctx.to_numpy(v) for k, v in pieces.items() if k.split(".", 1)[1] in kept},
                     {k: v for k, v in offsets.items() if k in kept}))
    elif optimizer is not None and ctx.dp_cp_rank == 0:
        mine.append((optim_file(ctx.tp_rank, ctx.tp_size, 0, 1, s, pp),
                     {**{k: ctx.to_numpy(v) for k, v in optimizer.state_dict().items() if k.split(".", 1)[1] in kept},
                      **e_optim}, None))
    # never a checkpoint of non-finite weights (it would replace, and --keep prune, a healthy one)
    bad = next((k for _, tensors, _ in mine for k, v in tensors.items() if not np.isfinite(v).all()), None)
    bad = bad or (optimizer.nonfinite_parameter(streamed) if streamed else None)
    error = None if bad is None else (
        f"step {step}: {'optimizer tensor' if bad.startswith(('exp_avg.', 'exp_avg_sq.', 'master.')) else 'parameter'} "
        f"{bad} holds NaN or Inf values (rank {ctx.rank}): the weights diverged, so no checkpoint was written; "
        f"the newest healthy checkpoint in {out_root} is kept: resume from it with a lower `lr`")
    if streamed and ctx.dp_cp_rank == 0 and not (optimizer.leads_its_groups() and ctx.ep_rank == 0):
        error = f"rank {ctx.rank} writes the model file but is not rank 0 of the groups ZeRO-3 shards over (a bug)"
    if ctx.rank == 0 and error is None:
        try:
            os.makedirs(out_root, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except Exception as e:  # OSError, and anything else: every rank must hear of it
            error = f"cannot create checkpoint directory {tmp}: {type(e).__name__}: {e}"
    agree_on_error(world, error, CheckpointError, what="the checkpoint save agreement")
    digests, sizes, error, writer = np.zeros((2, 64), np.uint8), np.zeros(2, np.int64), None, None
    try:
        for i, (fname, tensors, offsets) in enumerate(mine):
            path = os.path.join(tmp, fname)
            metadata = {"format": FORMAT, **({"offsets": json.dumps(offsets)} if offsets else {})}
            if streamed and i == 0 and ctx.dp_cp_rank == 0:  # (the model file: its streamed tensors come next)
                head = {p.name: (p.data.shape, str(p.data.dtype)) for p in params if p.name in streamed}
                head.update({k: (v.shape, str(v.dtype)) for k, v in tensors.items()})
                head.update(later)
                writer = StreamedSafetensors(path, head, metadata)
                for k, v in tensors.items():
                    writer.put(k, v)
                continue
            write_safetensors(path, tensors, metadata)
            digests[i] = np.frombuffer(sha256_file(path).encode(), np.uint8)
            sizes[i] = os.path.getsize(path)
    except Exception as e:  # safetensors raises its own SafetensorError for I/O failures
        error = f"writing checkpoint shards into {tmp} failed on rank {ctx.rank}: {type(e).__name__}: {e}"
    if streamed:  # every rank in the gathers, the model file's writer taking each parameter
        experts = {p.name for p in params if p.expert_parallel}
        for param_name, values in with_experts(ctx, optimizer.whole_parameters(streamed), experts):
            if writer is not None and error is None:
                try:
                    writer.put(param_name, ctx.to_numpy(values))
                except Exception as e:
                    error = f"writing checkpoint shards into {tmp} failed on rank {ctx.rank}: {type(e).__name__}: {e}"
            del values  # (a view of its unit, which would stay whole while the next one is gathered)
        if writer is not None and error is not None:
            writer.f.close()
        elif writer is not None:
            try:
                writer.close()
                path = os.path.join(tmp, mine[0][0])
                digests[0] = np.frombuffer(sha256_file(path).encode(), np.uint8)
                sizes[0] = os.path.getsize(path)
            except Exception as e:
                error = f"writing checkpoint shards into {tmp} failed on rank {ctx.rank}: {type(e).__name__}: {e}"
    agree_on_error(world, error, CheckpointError, what="the checkpoint save agreement")
    names = [fname for fname, _, _ in mine] + [""] * (2 - len(mine))
    with ctx.watchdog.guard("checkpoint checksum exchange (host all-gather on the world)"):
        every = world.allgather(([(n, bytes(d).decode(), int(b)) for n, d, b in zip(names, digests, sizes) if n],
                                 param_info if ctx.tp_rank == ctx.dp_cp_rank == 0 else {}, rng_state,
                                 [len(chunk) for chunk in model.chunks]))

    error = None
    if ctx.rank == 0:
        try:
            file_info = {n: {"sha256": d, "bytes": b} for files, _, _, _ in every for n, d, b in files}
            all_params = {name: info for _, stage_params, _, _ in every for name, info in stage_params.items()}
            firsts = [every[k * ctx.dp_cp_size * ctx.tp_size] for k in range(pp)]  # each stage's first rank
            mesh = {"tp": ctx.tp_size, "dp": ctx.dp_size}
            if pp > 1:  # (a pp 1 checkpoint's meta.json is that of cutp before pipelines)
                V = model.pp_virtual  # the layers of each model chunk, in the model's order (chunk c of stage s
                # is virtual stage c * pp + s)
                mesh.update(pp=pp, pp_layers=[firsts[k % pp][3][k // pp] for k in range(pp * V)],
                            **({"pp_virtual": V} if V > 1 else {}))
                if rng_state is not None:  # each stage's RNG stream offsets
                    rng_state = dict(rng_state, stages=[first[2]["offsets"] for first in firsts])
            meta = {
                "format": FORMAT, "version": VERSION, "cutp_version": __version__, "created": time.time(),
                "step": int(step), "config": model.config.to_dict(), "seed": model.seed,
                "mesh": mesh, "padded_vocab": model.padded_vocab,
                "params": all_params,  # in the model's order: the stages' in turn
                "optimizer": (dict(optimizer.hyperparameters(), dp_shards=ctx.dp_cp_size if sharded else 1)
                              if optimizer is not None else None),
                "rng": rng_state, "data": data_state, "train_args": train_args, "files": file_info,
                "loss_scaler": loss_scaler,
                **({"trainable_only": True} if trainable_only else {}),
            }
            write_meta(os.path.join(tmp, "meta.json"), meta)
            fsync_dir(tmp)
            if os.path.exists(final):  # re-saving a step: move the old one aside first
                old = os.path.join(out_root, f".old-{name}")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(out_root)
            write_json_atomic(os.path.join(out_root, "latest"), {"step": int(step), "path": name})
            prune_checkpoints(out_root, keep, newest_step=int(step))
        except Exception as e:
            error = f"finishing checkpoint {final} failed: {type(e).__name__}: {e}"
    agree_on_error(world, error, CheckpointError, what="the checkpoint save agreement")
    return final
