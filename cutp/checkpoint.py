"""Checkpoints: safetensors shards plus JSON metadata; atomic, checksummed, reshardable.

Layout of a run directory (`--out DIR`):

    DIR/step-00000100/meta.json                     config, step, mesh, data position, RNG
                                                    offsets, optimizer hyperparameters, a
                                                    sha256 per file, each parameter's sharding
    DIR/step-00000100/model-tp00-of-02.safetensors  TP rank 0's parameter shards
    DIR/step-00000100/optim-tp00-of-02.safetensors  its AdamW moments (exp_avg., exp_avg_sq.) and,
                                                    for 16-bit models, fp32 master weights (master.)
    DIR/latest                                      JSON naming the newest complete checkpoint

A checkpoint is written into `DIR/.tmp-step-...` and renamed when complete, so a crash during a
save leaves the previous checkpoint intact; older ones are removed only after a newer one is
complete (`keep`). Loading verifies every needed file's size and sha256 before reading any
tensor, on every rank, and all ranks agree before anything is loaded. Loading at another TP
size reassembles each full tensor from the saved shards (one tensor at a time) and keeps this
rank's slice. The optimizer state is saved per parameter whatever the optimizer's layout (the
distributed optimizer gathers its DP shards first), so a checkpoint resumes at any DP size, with
or without the distributed optimizer. Only safetensors and JSON are read: loading never executes
code.

`python -m cutp.checkpoint export SRC DST [--dtype D]` writes a single-shard (TP=1) copy of a
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
from .checkpoint_files import fsync_dir, sha256_file, write_json_atomic, write_safetensors
from .model import DTYPES, GPT, GPTConfig
from .runtime.errors import ConfigError
from .runtime.failure import agree_on_error
from .tensor_parallel.sharding import assemble_full, pad_rows, sharding_from_spec, take_shard

FORMAT = "cutp-checkpoint"
VERSION = 1
# GPTConfig fields that change the parameters' shapes or meaning: a checkpoint loads only into
# a model with the same values (dropout, label smoothing and vocabulary padding may differ).
ARCH_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "vocab_size", "block_size", "bias",
               "tie_embeddings", "ln_eps", "gelu")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; names the file and what is wrong with it."""


def _model_file(r, tp):
    return f"model-tp{r:02d}-of-{tp:02d}.safetensors"


def _optim_file(r, tp):
    return f"optim-tp{r:02d}-of-{tp:02d}.safetensors"


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
    error = None
    if ctx.rank == 0:
        try:
            os.makedirs(out_root, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except Exception as e:  # OSError, and anything else: every rank must hear of it
            error = f"cannot create checkpoint directory {tmp}: {type(e).__name__}: {e}"
    agree_on_error(world, error, CheckpointError, what="the checkpoint save agreement")

    digests = np.zeros((2, 64), np.uint8)
    sizes = np.zeros(2, np.int64)
    error = None
    # per parameter on DP rank 0 (collective over DP for the distributed optimizer)
    optim_state = optimizer.state_dict() if optimizer is not None else None
    if ctx.dp_rank == 0:  # DP replicas hold identical parameters (and the whole optimizer state now)
        try:
            files = [(_model_file(ctx.tp_rank, ctx.tp_size), {p.name: ctx.to_numpy(p.data) for p in model.parameters()})]
            if optimizer is not None:
                files.append((_optim_file(ctx.tp_rank, ctx.tp_size),
                              {k: ctx.to_numpy(v) for k, v in optim_state.items()}))
            for i, (fname, tensors) in enumerate(files):
                path = os.path.join(tmp, fname)
                write_safetensors(path, tensors, {"format": FORMAT})
                digests[i] = np.frombuffer(sha256_file(path).encode(), np.uint8)
                sizes[i] = os.path.getsize(path)
        except Exception as e:  # safetensors raises its own SafetensorError for I/O failures
            error = f"writing checkpoint shards into {tmp} failed on rank {ctx.rank}: {type(e).__name__}: {e}"
    agree_on_error(world, error, CheckpointError, what="the checkpoint save agreement")

    if ctx.dp_rank == 0:
        tp_mpi = ctx.tp.mpi_comm
        all_digests = np.zeros((ctx.tp_size, 2, 64), np.uint8)
        all_sizes = np.zeros((ctx.tp_size, 2), np.int64)
        with ctx.watchdog.guard("checkpoint checksum exchange (host all-gather on tp)"):
            tp_mpi.Allgather(digests, all_digests)
            tp_mpi.Allgather(sizes, all_sizes)

    error = None
    if ctx.rank == 0:
        try:
            file_info = {}
            for r in range(ctx.tp_size):
                names = [_model_file(r, ctx.tp_size)] + ([_optim_file(r, ctx.tp_size)] if optimizer is not None else [])
                for i, fname in enumerate(names):
                    file_info[fname] = {"sha256": bytes(all_digests[r, i]).decode(), "bytes": int(all_sizes[r, i])}
            meta = {
                "format": FORMAT, "version": VERSION, "cutp_version": __version__, "created": time.time(),
                "step": int(step), "config": model.config.to_dict(), "seed": model.seed,
                "mesh": {"tp": ctx.tp_size, "dp": ctx.dp_size},
                "padded_vocab": model.padded_vocab,
                "params": {p.name: {"full_shape": list(p.full_shape), "dtype": str(p.data.dtype),
                                    "sharding": p.sharding.spec if p.sharding is not None else None,
                                    "real_rows": p.real_rows}
                           for p in model.parameters()},
                "optimizer": optimizer.hyperparameters() if optimizer is not None else None,
                "rng": rng_state, "data": data_state, "train_args": train_args, "files": file_info,
                "loss_scaler": loss_scaler,
            }
            write_json_atomic(os.path.join(tmp, "meta.json"), meta)
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
            if keep:
                prune_checkpoints(out_root, keep, newest_step=int(step))
        except Exception as e:
            error = f"finishing checkpoint {final} failed: {type(e).__name__}: {e}"
    agree_on_error(world, error, CheckpointError, what="the checkpoint save agreement")
    return final


def list_checkpoints(out_root: str) -> list[tuple[int, str]]:
    """Complete checkpoints (they have meta.json) under a run directory, oldest first."""
    out = []
    if not os.path.isdir(out_root):
        return out
    for d in os.listdir(out_root):
        if d.startswith("step-") and os.path.exists(os.path.join(out_root, d, "meta.json")):
            try:
                out.append((int(d[5:]), os.path.join(out_root, d)))
            except ValueError:
                pass
    return sorted(out)


def prune_checkpoints(out_root: str, keep: int, newest_step: int | None = None) -> None:
    """Removes all but the `keep` newest checkpoints at or before `newest_step` (the one just
    written). Checkpoints of later steps (left by an abandoned run that went further) are never
    pruned in its favour: they are kept, and a warning names them."""
    found = list_checkpoints(out_root)
    if newest_step is not None:
        later = [path for step, path in found if step > newest_step]
        if later:
            print(f"cutp checkpoint: warning: {out_root} holds checkpoints of later steps than the one just "
                  f"written ({', '.join(os.path.basename(p) for p in later)}); 'latest' points to step "
                  f"{newest_step}. Remove them or use another --out.", file=sys.stderr)
        found = [(step, path) for step, path in found if step <= newest_step]
    for _, path in found[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


# ---- load ------------------------------------------------------------------------------------
def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, or a run directory whose `latest` (or newest step-*) is used."""
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.exists(latest):
        try:
            with open(latest) as f:
                target = os.path.join(path, json.load(f)["path"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{latest} is malformed ({e}); pass a step-* directory explicitly") from None
        if os.path.exists(os.path.join(target, "meta.json")):
            return target
    found = list_checkpoints(path)
    if found:
        return found[-1][1]
    raise CheckpointError(f"no checkpoint in {path}: it has no meta.json, no 'latest' and no complete step-* "
                          "directory")


def read_meta(ckpt: str) -> dict:
    path = os.path.join(ckpt, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {ckpt} is not a complete checkpoint") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is malformed JSON ({e}); the checkpoint cannot be used") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not cutp checkpoint metadata (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {meta.get('version')!r}; this cutp reads version {VERSION}")
    required = {"step": int, "config": dict, "mesh": dict, "params": dict, "files": dict}
    for key, typ in required.items():
        if not isinstance(meta.get(key), typ):
            raise CheckpointError(f"{path} is malformed: field {key!r} is missing or not a {typ.__name__}")
    for fname, info in meta["files"].items():
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str) or not isinstance(info.get("bytes"), int):
            raise CheckpointError(f"{path} is malformed: entry for file {fname!r} lacks sha256/bytes")
    for key in ("tp", "dp"):
        v = meta["mesh"].get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CheckpointError(f"{path} is malformed: mesh.{key} is {v!r}, not an integer >= 1")
    for name, info in meta["params"].items():
        problem = _param_entry_problem(info)
        if problem:
            raise CheckpointError(f"{path} is malformed: parameter {name!r}: {problem}")
    opt = meta.get("optimizer")
    if opt is not None and (not isinstance(opt, dict) or not isinstance(opt.get("step"), int)):
        raise CheckpointError(f"{path} is malformed: optimizer must be null or an object with an integer step")
    rng = meta.get("rng")
    if rng is not None and not (isinstance(rng, dict) and isinstance(rng.get("offsets"), dict)
                                and all(isinstance(v, int) for v in rng["offsets"].values())):
        raise CheckpointError(f"{path} is malformed: rng must be null or hold integer offsets")
    return meta


_SPEC_KEYS = {"contiguous": ("axis", "tp"), "qkv": ("axis", "n_head", "n_kv_head", "head_dim", "tp")}


def _param_entry_problem(info) -> str | None:
    if not isinstance(info, dict):
        return "entry is not an object"
    shape = info.get("full_shape")
    if not (isinstance(shape, list) and shape and all(isinstance(d, int) and d >= 1 for d in shape)):
        return f"full_shape {shape!r} is not a list of positive integers"
    real = info.get("real_rows")
    if real is not None and not (isinstance(real, int) and 1 <= real <= shape[0]):
        return f"real_rows {real!r} is not null or an integer in [1, {shape[0]}]"
    spec = info.get("sharding", "absent")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("kind") not in _SPEC_KEYS:
        return f"sharding {spec!r} is neither null nor a known kind ({sorted(_SPEC_KEYS)})"
    bad = [k for k in _SPEC_KEYS[spec["kind"]] if not isinstance(spec.get(k), int)]
    if bad:
        return f"sharding lacks integer fields {bad}"
    if not 0 <= spec["axis"] < len(shape):
        return f"sharding axis {spec['axis']} is outside the shape {shape}"
    return None


def verify_file(ckpt: str, meta: dict, fname: str) -> str | None:
    """None if the file is intact, else a message naming it and the problem."""
    info = meta["files"].get(fname)
    path = os.path.join(ckpt, fname)
    if info is None:
        return f"{path}: not listed in meta.json (the checkpoint's mesh does not have this shard)"
    if not os.path.exists(path):
        return f"{path} is missing (meta.json lists it); the checkpoint is incomplete"
    size = os.path.getsize(path)
    if size != info["bytes"]:
        return f"{path} is truncated or has the wrong size: {size} bytes, meta.json says {info['bytes']}"
    digest = sha256_file(path)
    if digest != info["sha256"]:
        return f"{path} is corrupted: sha256 {digest[:16]}... differs from meta.json's {info['sha256'][:16]}..."
    return None


def check_config_matches(meta: dict, config) -> None:
    saved = meta["config"]
    now = config.to_dict()
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs model {now.get(k)!r}" for k in ARCH_FIELDS if saved.get(k) != now.get(k)]
    if diff:
        raise ConfigError("the checkpoint's model differs from this model: " + "; ".join(diff))


class _ShardReader:
    """Reads tensors from a checkpoint's shard files of one kind ('model' or 'optim')."""

    def __init__(self, ckpt, meta, kind):
        self.ckpt, self.kind = ckpt, kind
        self.tp = int(meta["mesh"]["tp"])
        self._open = {}

    def fname(self, r):
        return (_model_file if self.kind == "model" else _optim_file)(r, self.tp)

    def get(self, r, key):
        if r not in self._open:
            self._open[r] = safe_open(os.path.join(self.ckpt, self.fname(r)), framework="numpy")
        f = self._open[r]
        if key not in f.keys():
            raise CheckpointError(f"{self.fname(r)} has no tensor {key!r}")
        return f.get_tensor(key)


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
            tuple(_shard_shape(meta["params"][p.name], ctx.tp_rank)) == tuple(p.data.shape) for p in params)
        ranks = [ctx.tp_rank] if direct else list(range(saved_tp))
        needed = [_model_file(r, saved_tp) for r in ranks]
        saved_master = bool((meta.get("optimizer") or {}).get("master_weights"))
        masters_as_weights = saved_master and model.config.dtype in ("float32", "float64")  # not their rounding
        if optimizer is not None or masters_as_weights:
            if meta.get("optimizer") is None:
                raise CheckpointError(f"{ckpt} has no optimizer state; it cannot resume training "
                                      "(load it for inference or fine-tuning without --resume)")
            needed += [_optim_file(r, saved_tp) for r in ranks]
        problems = [m for m in (verify_file(ckpt, meta, f) for f in needed) if m]
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


def _shard_shape(info, rank):
    s = sharding_from_spec(info["sharding"], info["full_shape"])
    return tuple(info["full_shape"]) if s is None else s.shard_shape(rank)


def load_model(ckpt: str, ctx, seed: int | None = None, **config_overrides):
    """Builds a GPT from a checkpoint's config at ctx's TP size and loads its weights."""
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    config = GPTConfig.from_dict({**meta["config"], **config_overrides})
    model = GPT(ctx, config, seed=meta.get("seed", 0) if seed is None else seed, init=False)
    load_checkpoint(ckpt, model)
    return model, meta


# ---- export (offline, one process) --------------------------------------------------------------
def export_full(src: str, dst: str, dtype: str | None = None) -> str:
    """Writes a TP=1 copy of checkpoint `src` (model and optimizer state) into directory `dst`,
    with parameters in `dtype` (default: the checkpoint's), taken from the fp32 master weights
    when the checkpoint has them (a bfloat16 run exported as float32 loses nothing)."""
    src = resolve_checkpoint(src)
    meta = read_meta(src)
    saved_tp = int(meta["mesh"]["tp"])
    problems = [m for m in (verify_file(src, meta, f) for f in meta["files"]) if m]
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
                                "sharding": None if spec is None else dict(spec, tp=1)}
        fname = (_model_file if kind == "model" else _optim_file)(0, 1)
        path = os.path.join(tmp, fname)
        write_safetensors(path, tensors, {"format": FORMAT})
        files[fname] = {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
    if has_optim:
        meta = dict(meta, optimizer=dict(meta["optimizer"], master_weights=want_master))
    meta = dict(meta, config=dict(meta["config"], dtype=dtype))
    out = dict(meta, mesh={"tp": 1, "dp": 1}, params=new_params, files=files, padded_vocab=padded,
               exported_from={"path": os.path.abspath(src), "tp": saved_tp})
    write_json_atomic(os.path.join(tmp, "meta.json"), out)
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
        meta = read_meta(ckpt)
        problems = [m for m in (verify_file(ckpt, meta, f) for f in meta["files"]) if m]
        for p in problems:
            print(p)
        print(f"{ckpt}: {'OK' if not problems else 'DAMAGED'} (step {meta['step']}, tp {meta['mesh']['tp']})")
        return 1 if problems else 0
    print("usage: python -m cutp.checkpoint export SRC DST [--dtype float32|bfloat16|float16|float64] | verify CKPT",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
