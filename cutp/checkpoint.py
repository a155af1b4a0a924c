"""Checkpoints: safetensors shards plus JSON metadata; atomic, checksummed, reshardable.

Layout of a run directory (`--out DIR`):

    DIR/step-00000100/meta.json                     config, step, mesh, data position, RNG
                                                    offsets, optimizer hyperparameters, a
                                                    sha256 per file, each parameter's sharding
    DIR/step-00000100/model-tp00-of-02.safetensors  TP rank 0's parameter shards
    DIR/step-00000100/optim-tp00-of-02.safetensors  its AdamW moments (exp_avg., exp_avg_sq.) and,
                                                    for 16-bit models, fp32 master weights (master.)
    .../optim-tp00-of-02-dp01-of-04.safetensors     or, with the distributed optimizer, DP rank 1's
                                                    shard of them: the flat pieces [a, b) of each
                                                    parameter it owns, offsets in the file's metadata
    DIR/latest                                      JSON naming the newest complete checkpoint

Pipeline runs (pp > 1) name each stage's files: model-pp01-of-02-tp00-of-02.safetensors,
optim-pp01-of-02-tp00-of-02[-dp01-of-04].safetensors; meta.json's mesh adds pp and pp_layers,
each parameter its "stage" (the stage whose files hold it) and rng.stages each stage's RNG
stream offsets (dropout by position leaves them at 0; a draw without a position advances them).
The last stage's copy of a tied token embedding (bit-identical to the first stage's, and so is
its optimizer state) is written once, by the first stage, and loaded from there. At pp 1 names
and meta.json are as before pipelines. Loading reads each parameter from its
stage's files, so a checkpoint loads at any PP size and stage layout as at any TP size.

A checkpoint is written into `DIR/.tmp-step-...` and renamed when complete, so a crash during a
save leaves the previous checkpoint intact; older ones are removed only after a newer one is
complete (`keep`; cutp.run_dir: listing, `latest`, pruning, the run directory's lock). Weights
or optimizer state with a NaN or Inf are never saved. meta.json is sealed by its own sha256 and
every field of it is checked before use (cutp.checkpoint_files). Loading verifies every needed
file's size, sha256 and tensor shapes before reading any tensor, on every rank, and all ranks
agree before anything is loaded. Loading at another TP
size reassembles each full tensor from the saved shards (one tensor at a time) and keeps this
rank's slice. The optimizer state is saved by parameter: whole (plain optimizer) or as the DP
shards' pieces of each parameter (distributed optimizer: every DP rank writes its own file,
nothing is gathered), which loading puts back together one tensor at a time, keeping only what
this rank's optimizer owns. So a checkpoint resumes at any TP and DP size, with or without the
distributed optimizer. Only safetensors and JSON are read: loading never executes code.

`python -m cutp.checkpoint export SRC DST [--dtype D]` writes a single-shard (TP=1, PP=1) copy of a
checkpoint, its parameters in the precision asked for (from the fp32 master weights when saved).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

import numpy as np
from safetensors import safe_open

from . import __version__
from .checkpoint_experts import gather_experts, in_model_order
from .checkpoint_files import (FORMAT, VERSION, CheckpointError, fsync_dir, mesh_pp, model_file, optim_file,
                               param_stage, read_meta, sha256_file, shard_shape, unlisted_files, verify_file,
                               write_json_atomic, write_meta, write_safetensors)
from .model import DTYPES, GPT, GPTConfig
from .run_dir import list_checkpoints, prune_checkpoints, resolve_checkpoint  # noqa: F401 (cutp.checkpoint's API)
from .runtime.errors import ConfigError
from .runtime.failure import agree_on_error, config_errors_exit, errors_raised_on_every_rank
from .tensor_parallel.sharding import assemble_full, pad_rows, sharding_from_spec, take_shard

# GPTConfig fields that change the parameters' shapes or meaning: a checkpoint loads only into
# a model with the same values (dropout, label smoothing and vocabulary padding may differ).
ARCH_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "vocab_size", "block_size", "bias",
               "tie_embeddings", "ln_eps", "gelu")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# ---- save ------------------------------------------------------------------------------------
def save_checkpoint(out_root: str, step: int, model, optimizer=None, *, rng_state=None, data_state=None,
                    train_args=None, keep: int | None = None, loss_scaler=None) -> str:
    """Collective over the model's context. Returns the checkpoint directory."""
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
    sharded = optimizer is not None and optimizer.distributed and ctx.dp_size > 1
    s, pp = ctx.pp_rank, ctx.pp_size
    params = [p for p in model.parameters() if not (p.name == "wte.weight" and not model.first_stage)]
    kept = {p.name for p in params}
    mine = []  # (file name, tensors, offsets or None) this rank writes
    param_info = {p.name: {"full_shape": list(p.full_shape), "dtype": str(p.data.dtype),
                           "sharding": p.sharding.spec if p.sharding is not None else None, "real_rows": p.real_rows,
                           **({"stage": s} if pp > 1 else {})} for p in params}
    # expert parallelism: the other EP ranks' experts, written by DP rank 0 too (cutp.checkpoint_experts)
    e_model, e_optim, e_info = gather_experts(ctx, params, optimizer, param_info)
    param_info = in_model_order(param_info, e_info, [p.name for p in params if p.expert_parallel])
    kept |= set(e_info)
    if ctx.dp_rank == 0:
        mine.append((model_file(ctx.tp_rank, ctx.tp_size, s, pp),
                     {**{p.name: ctx.to_numpy(p.data) for p in params}, **e_model}, None))
    if sharded:
        pieces, offsets = optimizer.state_pieces()
        mine.append((optim_file(ctx.tp_rank, ctx.tp_size, ctx.dp_rank, ctx.dp_size, s, pp),
                     {k: ctx.to_numpy(v) for k, v in pieces.items() if k.split(".", 1)[1] in kept},
                     {k: v for k, v in offsets.items() if k in kept}))
    elif optimizer is not None and ctx.dp_rank == 0:
        mine.append((optim_file(ctx.tp_rank, ctx.tp_size, 0, 1, s, pp),
                     {**{k: ctx.to_numpy(v) for k, v in optimizer.state_dict().items() if k.split(".", 1)[1] in kept},
                      **e_optim}, None))
    # never a checkpoint of non-finite weights (it would replace, and --keep prune, a healthy one)
    bad = next((k for _, tensors, _ in mine for k, v in tensors.items() if not np.isfinite(v).all()), None)
    error = None if bad is None else (
        f"step {step}: {'optimizer tensor' if bad.startswith(('exp_avg.', 'exp_avg_sq.', 'master.')) else 'parameter'} "
        f"{bad} holds NaN or Inf values (rank {ctx.rank}): the weights diverged, so no checkpoint was written; "
        f"the newest healthy checkpoint in {out_root} is kept: resume from it with a lower --lr")
    if ctx.rank == 0 and error is None:
        try:
            os.makedirs(out_root, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except Exception as e:  # OSError, and anything else: every rank must hear of it
            error = f"cannot create checkpoint directory {tmp}: {type(e).__name__}: {e}"
    agree_on_error(world, error, CheckpointError, what="the checkpoint save agreement")
    digests, sizes, error = np.zeros((2, 64), np.uint8), np.zeros(2, np.int64), None
    try:
        for i, (fname, tensors, offsets) in enumerate(mine):
            path = os.path.join(tmp, fname)
            write_safetensors(path, tensors, {"format": FORMAT, **({"offsets": json.dumps(offsets)} if offsets else {})})
            digests[i] = np.frombuffer(sha256_file(path).encode(), np.uint8)
            sizes[i] = os.path.getsize(path)
    except Exception as e:  # safetensors raises its own SafetensorError for I/O failures
        error = f"writing checkpoint shards into {tmp} failed on rank {ctx.rank}: {type(e).__name__}: {e}"
    agree_on_error(world, error, CheckpointError, what="the checkpoint save agreement")
    names = [fname for fname, _, _ in mine] + [""] * (2 - len(mine))
    with ctx.watchdog.guard("checkpoint checksum exchange (host all-gather on the world)"):
        every = world.allgather(([(n, bytes(d).decode(), int(b)) for n, d, b in zip(names, digests, sizes) if n],
                                 param_info if ctx.tp_rank == ctx.dp_rank == 0 else {}, rng_state,
                                 [len(chunk) for chunk in model.chunks]))

    error = None
    if ctx.rank == 0:
        try:
            file_info = {n: {"sha256": d, "bytes": b} for files, _, _, _ in every for n, d, b in files}
            all_params = {name: info for _, stage_params, _, _ in every for name, info in stage_params.items()}
            firsts = [every[k * ctx.dp_size * ctx.tp_size] for k in range(pp)]  # each stage's first rank
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
                "optimizer": (dict(optimizer.hyperparameters(), dp_shards=ctx.dp_size if sharded else 1)
                              if optimizer is not None else None),
                "rng": rng_state, "data": data_state, "train_args": train_args, "files": file_info,
                "loss_scaler": loss_scaler,
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


# ---- load ------------------------------------------------------------------------------------
def check_config_matches(meta: dict, config) -> None:
    saved = meta["config"]
    now = config.to_dict()
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs model {now.get(k)!r}" for k in ARCH_FIELDS if saved.get(k) != now.get(k)]
    if diff:
        raise ConfigError("the checkpoint's model differs from this model: " + "; ".join(diff))


class _ShardReader:
    """Reads tensors from a checkpoint's shard files of one kind ('model' or 'optim'), each from
    the files of the pipeline stage that holds its parameter (meta.json says which). The
    distributed optimizer's state of TP rank r lies in `dp_shards` files, each holding the flat
    elements [a, b) of every parameter its DP rank owned (offsets in the file's metadata): `get`
    puts each tensor back together, checking that the pieces cover it."""

    def __init__(self, ckpt, meta, kind):
        self.ckpt, self.kind, self.meta = ckpt, kind, meta
        self.tp, self.pp = int(meta["mesh"]["tp"]), mesh_pp(meta)
        self.dp = int((meta.get("optimizer") or {}).get("dp_shards", 1)) if kind == "optim" else 1
        self._open = {}

    def fnames(self, r, name):
        """The files that hold TP rank r's tensors of parameter `name`."""
        s = param_stage(self.meta["params"][name])
        if self.kind == "model":
            return [model_file(r, self.tp, s, self.pp)]
        return [optim_file(r, self.tp, d, self.dp, s, self.pp) for d in range(self.dp)]

    def _file(self, fname):
        if fname not in self._open:
            f = safe_open(os.path.join(self.ckpt, fname), framework="numpy")
            self._open[fname] = (f, json.loads((f.metadata() or {}).get("offsets", "{}")))
        return self._open[fname]

    def get(self, r, key):
        name = key if self.kind == "model" else key.split(".", 1)[1]
        names = self.fnames(r, name)
        if len(names) == 1:
            f, _ = self._file(names[0])
            if key not in f.keys():
                raise CheckpointError(f"{names[0]} has no tensor {key!r}")
            return f.get_tensor(key)
        shape = shard_shape(self.meta["params"][name])
        size, out, covered = int(np.prod(shape)), None, 0
        for fname in names:
            f, offsets = self._file(fname)
            if name in offsets:
                a, b = offsets[name]
                piece = f.get_tensor(key) if key in f.keys() else None
                if piece is None or not 0 <= a < b <= size or piece.size != b - a:
                    raise CheckpointError(f"{fname}: the piece [{a}, {b}) of {key} is missing or does not fit")
                out = np.empty(size, piece.dtype) if out is None else out
                out[a:b] = piece.reshape(-1)
                covered += b - a
        if covered != size:
            raise CheckpointError(f"the optimizer shards of TP rank {r} hold {covered} of the {size} elements of {key}")
        return out.reshape(shape)


def read_shard(ckpt: str, kind: str, tp_rank: int = 0) -> dict:
    """TP rank `tp_rank`'s tensors of one kind ("model", or "optim": exp_avg., exp_avg_sq. and,
    with master weights, master. of each parameter), whole, whichever way they were saved (the
    distributed optimizer's per-DP-rank pieces are put back together). Checksums verified."""
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    reader = _ShardReader(ckpt, meta, kind)
    needed = sorted({f for name in meta["params"] for f in reader.fnames(tp_rank, name)})
    problems = unlisted_files(ckpt, meta) + [m for m in (verify_file(ckpt, meta, f) for f in needed) if m]
    if problems:
        raise CheckpointError("; ".join(problems))
    prefixes = [""] if kind == "model" else ["exp_avg.", "exp_avg_sq."] + (
        ["master."] if meta["optimizer"].get("master_weights") else [])
    return {p + name: reader.get(tp_rank, p + name) for name in meta["params"] for p in prefixes}


def _full_from_shards(reader, key, info, rows=None):
    """The full tensor of `key`; a vocabulary table is re-padded to `rows` rows (the padding depends
    on the TP size, its real rows do not)."""
    sharding = sharding_from_spec(info["sharding"], info["full_shape"])
    if sharding is None:
        return reader.get(0, key)
    full = assemble_full([reader.get(r, key) for r in range(reader.tp)], sharding)
    real = info.get("real_rows")
    if rows is not None and real is not None and full.shape[0] != rows:
        full = pad_rows(full[:real], rows)
    return full


def load_checkpoint(ckpt: str, model, optimizer=None, *, check_config=True) -> dict:
    """Collective over the model's context. Loads parameters (and optimizer state) into the
    model, resharding when the checkpoint's TP size differs. Returns the metadata."""
    ctx = model.ctx
    world = ctx.world.mpi_comm
    error, meta = None, None
    try:
        ckpt = resolve_checkpoint(ckpt)
        meta = read_meta(ckpt)
        if check_config:
            check_config_matches(meta, model.config)
        saved_tp = int(meta["mesh"]["tp"])
        params = model.parameters()
        missing = [p.name for p in params if p.name not in meta["params"]]
        if missing:
            raise CheckpointError(f"{ckpt}/meta.json lacks parameters {missing[:5]}")
        direct = saved_tp == ctx.tp_size and all(
            shard_shape(meta["params"][p.name]) == tuple(p.data.shape) for p in params)
        ranks = [ctx.tp_rank] if direct else list(range(saved_tp))
        kinds = ["model"]
        saved_master = bool((meta.get("optimizer") or {}).get("master_weights"))
        masters_as_weights = saved_master and model.config.dtype in ("float32", "float64")  # not their rounding
        if optimizer is not None or masters_as_weights:
            if meta.get("optimizer") is None:
                raise CheckpointError(f"{ckpt} has no optimizer state; it cannot resume training "
                                      "(load it for inference or fine-tuning without --resume)")
            kinds.append("optim")
        needed = sorted({f for kind in kinds for r in ranks for p in params  # this stage's parameters' files
                         for f in _ShardReader(ckpt, meta, kind).fnames(r, p.name)})
        problems = unlisted_files(ckpt, meta) + [m for m in (verify_file(ckpt, meta, f) for f in needed) if m]
        if problems:
            raise CheckpointError("; ".join(problems) + " -- nothing was loaded")
    except (CheckpointError, ConfigError) as e:
        error = f"{type(e).__name__}: {e}"
    except Exception as e:  # anything unexpected in the metadata: still a clear, agreed error
        error = f"CheckpointError: {ckpt}/meta.json cannot be used ({type(e).__name__}: {e}) -- nothing was loaded"
    agree_on_error(world, error, CheckpointError, what="the checkpoint load agreement")

    # Every rank has verified its files. Read everything this rank needs into host memory first,
    # and only then assign: a tensor missing from a shard (or any other surprise) leaves the
    # model and optimizer untouched on every rank.
    model_tensors, optim_tensors, error = {}, {}, None
    try:
        readers = {"model": _ShardReader(ckpt, meta, "model")}
        if optimizer is not None or masters_as_weights:
            readers["optim"] = _ShardReader(ckpt, meta, "optim")

        def fetch(kind, key, name, p):
            info = meta["params"][name]
            if direct:
                return readers[kind].get(ctx.tp_rank, key)
            full = _full_from_shards(readers[kind], key, info, p.full_shape[0])
            return np.ascontiguousarray(take_shard(full, p.sharding, ctx.tp_rank))

        for p in model.parameters():
            a = (fetch("optim", "master." + p.name, p.name, p) if masters_as_weights
                 else fetch("model", p.name, p.name, p))
            if tuple(a.shape) != tuple(p.data.shape):
                raise CheckpointError(f"{p.name}: the checkpoint holds shape {tuple(a.shape)} for this rank, "
                                      f"the model {tuple(p.data.shape)}")
            model_tensors[p.name] = a
            if optimizer is not None:  # only the part of each tensor this rank's optimizer holds
                lo, hi = optimizer.owned_part(p.name)
                for prefix in ("exp_avg.", "exp_avg_sq."):
                    optim_tensors[prefix + p.name] = fetch("optim", prefix + p.name, p.name, p).reshape(-1)[lo:hi].copy()
                if optimizer.master is not None:  # a checkpoint without master weights: its parameters
                    master = fetch("optim", "master." + p.name, p.name, p) if saved_master else a.astype(np.float32)
                    optim_tensors["master." + p.name] = master.reshape(-1)[lo:hi].copy()
    except Exception as e:
        error = f"CheckpointError: reading {ckpt} failed on rank {ctx.rank}: {type(e).__name__}: {e} -- nothing was loaded"
    agree_on_error(world, error, CheckpointError, what="the checkpoint load agreement")

    for p in model.parameters():
        p.data[...] = ctx.asarray(model_tensors.pop(p.name).astype(p.data.dtype, copy=False))
    if optimizer is not None:
        optimizer.load_state({k: ctx.asarray(v) for k, v in optim_tensors.items()}, int(meta["optimizer"]["step"]))
    return meta


def load_model(ckpt: str, ctx, seed: int | None = None, **config_overrides):
    """Builds a GPT from a checkpoint's config at ctx's TP size (the stage of ctx's pipeline rank,
    layers split evenly; at pp 1 the whole model, from every stage's files) and loads its weights."""
    with errors_raised_on_every_rank(ctx.world.mpi_comm):  # a bad checkpoint stops every rank alike
        ckpt = resolve_checkpoint(ckpt)
        meta = read_meta(ckpt)
        config = GPTConfig.from_dict({**meta["config"], **config_overrides})
    model = GPT(ctx, config, seed=meta.get("seed", 0) if seed is None else seed, init=False)
    load_checkpoint(ckpt, model)
    return model, meta


def verify_checkpoint(ckpt: str, meta: dict) -> list:
    """Every problem of a checkpoint whose meta.json has been read (and checked): files in the
    directory it does not list, and each listed file's (existence, size, sha256, tensors)."""
    return unlisted_files(ckpt, meta) + [m for m in (verify_file(ckpt, meta, f) for f in sorted(meta["files"])) if m]


# ---- export (offline, one process) --------------------------------------------------------------
def export_full(src: str, dst: str, dtype: str | None = None) -> str:
    """Writes a TP=1 copy of checkpoint `src` (model and optimizer state) into directory `dst`,
    with parameters in `dtype` (default: the checkpoint's), taken from the fp32 master weights
    when the checkpoint has them (a bfloat16 run exported as float32 loses nothing)."""
    src = resolve_checkpoint(src)
    meta = read_meta(src)
    saved_tp = int(meta["mesh"]["tp"])
    problems = verify_checkpoint(src, meta)
    if problems:
        raise CheckpointError("; ".join(problems))
    config = GPTConfig.from_dict(meta["config"])
    dtype = dtype or config.dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"export --dtype {dtype!r}: use one of {sorted(DTYPES)}")
    padded = config.padded_vocab(1)
    tmp = dst.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    new_params = {}
    files = {}
    has_optim = meta.get("optimizer") is not None
    saved_master = has_optim and bool(meta["optimizer"].get("master_weights"))
    want_master = has_optim and dtype in ("bfloat16", "float16")
    readers = {kind: _ShardReader(src, meta, kind) for kind in ["model"] + (["optim"] if has_optim else [])}
    for kind in readers:
        tensors = {}
        for name, info in meta["params"].items():
            rows = padded if info.get("real_rows") is not None else None
            best = (_full_from_shards(readers["optim"], "master." + name, info, rows) if saved_master
                    else _full_from_shards(readers["model"], name, info, rows))  # the most precise copy
            if kind == "model":
                tensors[name] = best.astype(DTYPES[dtype])
                if not np.isfinite(tensors[name].astype(np.float32)).all() and np.isfinite(best).all():
                    raise CheckpointError(f"export --dtype {dtype}: {name} has values beyond {dtype}'s range")
            else:
                for key in ("exp_avg." + name, "exp_avg_sq." + name):
                    tensors[key] = _full_from_shards(readers["optim"], key, info, rows)
                if want_master:
                    tensors["master." + name] = best.astype(np.float32)
            spec = info["sharding"]
            new_params[name] = {"full_shape": list(best.shape), "dtype": dtype, "real_rows": info.get("real_rows"),
                                "sharding": None if spec is None else dict(spec, tp=1)}  # (pp 1: no stage)
        fname = (model_file if kind == "model" else optim_file)(0, 1)
        path = os.path.join(tmp, fname)
        write_safetensors(path, tensors, {"format": FORMAT})
        files[fname] = {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
    if has_optim:
        meta = dict(meta, optimizer=dict(meta["optimizer"], master_weights=want_master, dp_shards=1))
    meta = dict(meta, config=dict(meta["config"], dtype=dtype))
    rng = meta.get("rng")
    if isinstance(rng, dict) and "stages" in rng:  # the stages' streams do not carry over to pp 1
        meta = dict(meta, rng={k: v for k, v in rng.items() if k != "stages"})
    out = dict(meta, mesh={"tp": 1, "dp": 1}, params=new_params, files=files, padded_vocab=padded,
               exported_from={"path": os.path.abspath(src), "tp": saved_tp, **({"pp": mesh_pp(meta)}
                                                                                 if mesh_pp(meta) > 1 else {})})
    write_meta(os.path.join(tmp, "meta.json"), out)
    if os.path.exists(dst):
        raise CheckpointError(f"{dst} exists; export refuses to overwrite it")
    os.replace(tmp, dst)
    return dst


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"] and len(argv) in (3, 5) and (len(argv) == 3 or argv[3] == "--dtype"):
        print(export_full(argv[1], argv[2], argv[4] if len(argv) == 5 else None))
        return 0
    if len(argv) == 2 and argv[0] == "verify":
        ckpt = resolve_checkpoint(argv[1])
        try:
            meta = read_meta(ckpt)
        except CheckpointError as e:
            print(f"{e}\n{ckpt}: DAMAGED")
            return 1
        problems = verify_checkpoint(ckpt, meta)
        for p in problems:
            print(p)
        print(f"{ckpt}: {'OK' if not problems else 'DAMAGED'} (step {meta['step']}, tp {meta['mesh']['tp']}"
              + (f", pp {mesh_pp(meta)})" if mesh_pp(meta) > 1 else ")"))
        return 1 if problems else 0
    print("usage: python -m cutp.checkpoint export SRC DST [--dtype float32|bfloat16|float16|float64] | verify CKPT",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    with config_errors_exit("python -m cutp.checkpoint"):  # a user error: one line, no traceback
        sys.exit(main())
