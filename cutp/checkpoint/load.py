"""Loading a checkpoint into a model (and optimizer) at any TP, DP and PP size, after every file
it needs is verified on every rank; reading one TP rank's shards whole."""
from __future__ import annotations

import functools
import json
import os

import numpy as np
from safetensors import safe_open

from ..models import GPT, GPTConfig
from ..models.hf import hf_shards, load_hf_into
from ..runtime.errors import ConfigError
from ..runtime.failure import agree_on_error, errors_raised_on_every_rank
from ..tensor_parallel.lora import set_up_trainable
from ..tensor_parallel.sharding import assemble_full, pad_rows, sharding_from_spec, take_shard
from .base_identity import check_same_base
from .files import (CheckpointError, is_cutp_checkpoint, mesh_pp, model_file, optim_file, param_stage, read_meta,
                    shard_shape, unlisted_files, verify_file)
from .names import stored_key
from .run_dir import resolve_checkpoint

# GPTConfig fields that change the parameters' shapes or meaning: a checkpoint loads only into
# a model with the same values (dropout, label smoothing and vocabulary padding may differ).
ARCH_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "vocab_size", "block_size", "bias",
               "tie_embeddings", "norm_eps", "gelu")



def check_config_matches(meta: dict, config) -> None:
    saved = type(config).from_dict(meta["config"]).to_dict()  # (fields under their earlier names read as today's)
    now = config.to_dict()
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs model {now.get(k)!r}" for k in ARCH_FIELDS if saved.get(k) != now.get(k)]
    if diff:
        raise ConfigError("the checkpoint's model differs from this model: " + "; ".join(diff))


class ShardReader:
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
        stored, stored_name = stored_key(self.meta, key, name), stored_key(self.meta, name, name)
        if len(names) == 1:
            f, _ = self._file(names[0])
            if stored not in f.keys():
                raise CheckpointError(f"{names[0]} has no tensor {stored!r}")
            return f.get_tensor(stored)
        shape = shard_shape(self.meta["params"][name])
        size, out, covered = int(np.prod(shape)), None, 0
        for fname in names:
            f, offsets = self._file(fname)
            if stored_name in offsets:
                a, b = offsets[stored_name]
                piece = f.get_tensor(stored) if stored in f.keys() else None
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
    reader = ShardReader(ckpt, meta, kind)
    needed = sorted({f for name in meta["params"] for f in reader.fnames(tp_rank, name)})
    problems = unlisted_files(ckpt, meta) + [m for m in (verify_file(ckpt, meta, f) for f in needed) if m]
    if problems:
        raise CheckpointError("; ".join(problems))
    prefixes = [""] if kind == "model" else ["exp_avg.", "exp_avg_sq."] + (
        ["master."] if meta["optimizer"].get("master_weights") else [])
    return {p + name: reader.get(tp_rank, p + name) for name, info in meta["params"].items() for p in prefixes
            if kind == "model" or not info.get("buffer")}  # (a buffer has no optimizer state)


def full_from_shards(reader, key, info, rows=None):
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


def loaded_parameters(model, meta: dict) -> list:
    """The model's parameters a checkpoint holds: all of them, or of a checkpoint saved with frozen
    parameters (`trainable_only`: --freeze, LoRA) the trainable ones (the frozen come from the
    run's base: its init_from, or its seed's initial weights)."""
    if meta.get("trainable_only"):
        return [p for p in model.parameters() if p.trainable or p.buffer]
    return model.parameters()


def _checked(ckpt: str, model, optimizer, check_config: bool):
    """(path, meta, the parameters loaded, whether this rank's shards are read as saved, whether the
    weights are the saved float32 masters): the metadata and every file this rank reads verified,
    agreed on every rank (CheckpointError everywhere, nothing loaded). Collective."""
    ctx = model.ctx
    error, out = None, None
    try:
        ckpt = resolve_checkpoint(ckpt)
        meta = read_meta(ckpt)
        if check_config:
            check_config_matches(meta, model.config)
        saved_tp = int(meta["mesh"]["tp"])
        params = loaded_parameters(model, meta)
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
                                      "(load it for inference or fine-tuning without `resume`)")
            kinds.append("optim")
        needed = sorted({f for kind in kinds for r in ranks for p in params  # this stage's parameters' files
                         for f in ShardReader(ckpt, meta, kind).fnames(r, p.name)})
        problems = unlisted_files(ckpt, meta) + [m for m in (verify_file(ckpt, meta, f) for f in needed) if m]
        if problems:
            raise CheckpointError("; ".join(problems) + " -- nothing was loaded")
        out = ckpt, meta, params, direct, masters_as_weights
    except (CheckpointError, ConfigError) as e:
        error = f"{type(e).__name__}: {e}"
    except Exception as e:  # anything unexpected in the metadata: still a clear, agreed error
        error = f"CheckpointError: {ckpt}/meta.json cannot be used ({type(e).__name__}: {e}) -- nothing was loaded"
    agree_on_error(ctx.world.mpi_comm, error, CheckpointError, what="the checkpoint load agreement")
    return out


def _fetcher(ckpt: str, meta: dict, direct: bool, tp_rank: int, kinds=("model", "optim")):
    """fetch(kind, key, name, p): this TP rank's shard of tensor `key` (of parameter `name`, the
    model's `p`), read from the files of `kind`: as saved, or put together whole and cut again."""
    readers = {kind: ShardReader(ckpt, meta, kind) for kind in kinds}

    def fetch(kind, key, name, p):
        if direct:
            return readers[kind].get(tp_rank, key)
        full = full_from_shards(readers[kind], key, meta["params"][name], p.full_shape[0])
        return np.ascontiguousarray(take_shard(full, p.sharding, tp_rank))

    return fetch


def checkpoint_shards(ckpt: str, model):
    """The weights of `load_checkpoint(ckpt, model)` read one parameter at a time when asked: the
    checkpoint verified now (every rank, before any read), then shard(p) returns this rank's TP
    shard of p (the float32 masters of a 16-bit run into a float32/float64 model) in p's dtype, on
    the host. A ZeRO-3 run's deferred parameters draw so (`load_weights`)."""
    ckpt, meta, params, direct, masters = _checked(ckpt, model, None, True)
    fetch = _fetcher(ckpt, meta, direct, model.ctx.tp_rank, ("model", "optim") if masters else ("model",))
    loaded = {p.name for p in params}

    def shard(p):
        if p.name not in loaded:
            raise CheckpointError(f"{ckpt} does not hold {p.name}")
        a = fetch("optim", "master." + p.name, p.name, p) if masters and p.trainable else fetch("model", p.name,
                                                                                                 p.name, p)
        if tuple(a.shape) != tuple(p.data.shape):
            raise CheckpointError(f"{p.name}: the checkpoint holds shape {tuple(a.shape)} for this rank, "
                                  f"the model {tuple(p.data.shape)}")
        return np.ascontiguousarray(a, dtype=p.data.dtype)

    return shard


def load_checkpoint(ckpt: str, model, optimizer=None, *, check_config=True) -> dict:
    """Collective over the model's context. Loads parameters (and optimizer state) into the
    model, resharding when the checkpoint's TP size differs. Returns the metadata."""
    ctx = model.ctx
    world = ctx.world.mpi_comm
    ckpt, meta, params, direct, masters_as_weights = _checked(ckpt, model, optimizer, check_config)
    saved_master = bool((meta.get("optimizer") or {}).get("master_weights"))

    # Every rank has verified its files. Read everything this rank needs into host memory first,
    # and only then assign: a tensor missing from a shard (or any other surprise) leaves the
    # model and optimizer untouched on every rank.
    model_tensors, optim_tensors, pieced, error = {}, {}, {}, None
    # zero 3 with its parameters sharded: each rank keeps its pieces only (one parameter whole at a time)
    pieces = optimizer is not None and getattr(optimizer, "params_sharded", False)
    try:
        fetch = _fetcher(ckpt, meta, direct, ctx.tp_rank, ("model", "optim") if optimizer is not None or
                         masters_as_weights else ("model",))
        for p in params:
            a = (fetch("optim", "master." + p.name, p.name, p) if masters_as_weights and p.trainable
                 else fetch("model", p.name, p.name, p))  # (a buffer has no master: it is kept in float32)
            if tuple(a.shape) != tuple(p.data.shape):
                raise CheckpointError(f"{p.name}: the checkpoint holds shape {tuple(a.shape)} for this rank, "
                                      f"the model {tuple(p.data.shape)}")
            model_tensors[p.name] = a
            if optimizer is not None and p.trainable:  # only the part of each tensor this rank's optimizer holds
                lo, hi = optimizer.owned_part(p.name)
                for prefix in ("exp_avg.", "exp_avg_sq."):
                    optim_tensors[prefix + p.name] = fetch("optim", prefix + p.name, p.name, p).reshape(-1)[lo:hi].copy()
                if optimizer.master is not None:  # a checkpoint without master weights: its parameters
                    master = fetch("optim", "master." + p.name, p.name, p) if saved_master else a.astype(np.float32)
                    optim_tensors["master." + p.name] = master.reshape(-1)[lo:hi].copy()
            piece = optimizer.piece_of(p, a) if pieces else None
            if piece is not None:
                model_tensors[p.name], pieced[p.name] = None, piece
    except Exception as e:
        error = f"CheckpointError: reading {ckpt} failed on rank {ctx.rank}: {type(e).__name__}: {e} -- nothing was loaded"
    agree_on_error(world, error, CheckpointError, what="the checkpoint load agreement")

    for p in params:
        if p.name in pieced:
            optimizer.put_piece(p, ctx.asarray(pieced.pop(p.name).astype(p.data.dtype, copy=False)))
        else:
            p.data[...] = ctx.asarray(model_tensors.pop(p.name).astype(p.data.dtype, copy=False))
    if optimizer is not None:
        optimizer.load_state({k: ctx.asarray(v) for k, v in optim_tensors.items()}, int(meta["optimizer"]["step"]))
    return meta


def load_weights(model, path: str) -> None:
    """Loads the weights (only) of a Hugging Face directory or a cutp checkpoint into `model`, whose
    architecture must be theirs (a run's `init_from`). A parameter made inside `deferred_parameters`
    (ZeRO-3's model) is not loaded now: its `draw` reads this rank's TP shard of it from the files
    when the optimizer takes it (`checkpoint_shards`, `hf_shards`: one unit whole at a time, no rank
    holding the whole model); the others are loaded at once. Collective; errors on every rank."""
    world = model.ctx.world.mpi_comm
    cutp = is_cutp_checkpoint(path)
    if cutp:
        with errors_raised_on_every_rank(world):
            if read_meta(resolve_checkpoint(path)).get("trainable_only"):
                raise ConfigError(f"`init_from` {path} holds only what its run trained (frozen parameters or LoRA "
                                  "adapters, not its base): write it whole with `python -m cutp export-hf "
                                  f"{path} --out DIR --merge-lora` and give `init_from` DIR, or resume it")
    if not any(p.draw is not None for p in model.parameters()):
        if cutp:
            load_checkpoint(path, model)
        else:
            with errors_raised_on_every_rank(world):
                load_hf_into(model, path)
        return
    shard = checkpoint_shards(path, model) if cutp else hf_shards(model, path)
    ctx = model.ctx
    with errors_raised_on_every_rank(world):
        for p in model.parameters():
            if p.draw is not None:
                p.draw = functools.partial(lambda p: ctx.asarray(shard(p)), p)
            else:  # (a buffer: made whole at once)
                p.data[...] = ctx.asarray(shard(p))


def load_model(ckpt: str, ctx, seed: int | None = None, **config_overrides):
    """Builds a GPT from a checkpoint's config at ctx's TP size (the stage of ctx's pipeline rank,
    layers split evenly; at pp 1 the whole model, from every stage's files) and loads its weights.
    Returns (model, meta): the model and the checkpoint's meta.json dict.

        model, meta = load_model("out/run", ctx)      # a run directory: its newest checkpoint
        cutp.hf.save_hf(model, "out/hf")              # (or: python -m cutp export-hf out/run --out out/hf)
    """
    if isinstance(ctx, (str, os.PathLike)) and not isinstance(ckpt, (str, os.PathLike)):
        raise TypeError("load_model takes the checkpoint first, then the context: load_model(ckpt, ctx) "
                        "(cutp.hf.from_hf takes them the other way round, from_hf(ctx, dir))")
    with errors_raised_on_every_rank(ctx.world.mpi_comm):  # a bad checkpoint stops every rank alike
        ckpt = resolve_checkpoint(ckpt)
        meta = read_meta(ckpt)
        config = GPTConfig.from_dict({**meta["config"], **config_overrides})
    if meta.get("trainable_only"):  # the frozen base from the run's init_from or seed, then what trained
        return model_with_base(ckpt, meta, ctx, config), meta
    model = GPT(ctx, config, seed=meta.get("seed", 0) if seed is None else seed, init=False)
    load_checkpoint(ckpt, model)
    return model, meta


def model_with_base(ckpt: str, meta: dict, ctx, config=None):
    """The model of a checkpoint saved with frozen parameters (`trainable_only`: --freeze, LoRA) on
    `ctx`: its frozen base from the run's init_from (a Hugging Face directory or a cutp
    checkpoint), or without one its seed's initial weights; the run's adapters and frozen groups
    (its train_args); then the checkpoint's trainable tensors. Collective over ctx."""
    args = meta.get("train_args") or {}
    base = args.get("init_from")
    with errors_raised_on_every_rank(ctx.world.mpi_comm):
        if base is not None and not os.path.isdir(base):
            relative = ("" if os.path.isabs(base) else " (a relative path, found from the directory the run was "
                        "started in: load it from there)")
            raise ConfigError(f"{ckpt} holds only the trainable tensors; its frozen base, the run's init_from {base}, "
                              f"is gone{relative}: restore that directory to load the run")
        if base is not None:  # (its run's base, not whatever that directory holds now)
            check_same_base(ckpt, args, base, f"put the run's base back at {base} to load the run")
    model = GPT(ctx, config or GPTConfig.from_dict(meta["config"]), seed=meta.get("seed", 0), init=base is None)
    if base is not None:
        if is_cutp_checkpoint(base):
            load_checkpoint(base, model)
        else:
            with errors_raised_on_every_rank(ctx.world.mpi_comm):
                load_hf_into(model, base)
    set_up_trainable(model, args, seed=args.get("seed"))
    load_checkpoint(ckpt, model)
    return model


def verify_checkpoint(ckpt: str, meta: dict) -> list:
    """Every problem of a checkpoint whose meta.json has been read (and checked): files in the
    directory it does not list, and each listed file's (existence, size, sha256, tensors)."""
    return unlisted_files(ckpt, meta) + [m for m in (verify_file(ckpt, meta, f) for f in sorted(meta["files"])) if m]
