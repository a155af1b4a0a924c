"""`python -m cutp.checkpoint export SRC DST [--dtype D] | verify CKPT`: a single-shard copy of a
checkpoint (offline, one process), and the check of every file."""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys

import numpy as np

from ..models import DTYPES, GPTConfig
from .files import FORMAT, CheckpointError, mesh_pp, model_file, optim_file, read_meta, sha256_file, write_meta, \
    write_safetensors
from .load import ShardReader, full_from_shards, verify_checkpoint
from .run_dir import resolve_checkpoint


def _verified(src: str, dtype: str | None):
    """(checkpoint directory, meta, config, dtype: the asked one or the run's) of a checkpoint or
    run directory whose every file was verified."""
    src = resolve_checkpoint(src)
    meta = read_meta(src)
    problems = verify_checkpoint(src, meta)
    if problems:
        raise CheckpointError("; ".join(problems))
    config = GPTConfig.from_dict(meta["config"])
    dtype = dtype or config.dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"export --dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return src, meta, config, dtype


def export_full(src: str, dst: str, dtype: str | None = None) -> str:
    """Writes a TP=1 copy of checkpoint `src` (model and optimizer state) into directory `dst`,
    with parameters in `dtype` (default: the checkpoint's), taken from the fp32 master weights
    when the checkpoint has them (a bfloat16 run exported as float32 loses nothing)."""
    src, meta, config, dtype = _verified(src, dtype)
    if os.path.exists(dst):  # (before the work; checked again before the rename)
        raise CheckpointError(f"{dst} exists; export refuses to overwrite it")
    saved_tp = int(meta["mesh"]["tp"])
    padded = config.padded_vocab(1)
    tmp = dst.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    new_params = {}
    files = {}
    has_optim = meta.get("optimizer") is not None
    saved_master = has_optim and bool(meta["optimizer"].get("master_weights"))
    want_master = has_optim and dtype in ("bfloat16", "float16")
    readers = {kind: ShardReader(src, meta, kind) for kind in ["model"] + (["optim"] if has_optim else [])}
    for kind in readers:
        tensors = {}
        for name, info in meta["params"].items():
            rows = padded if info.get("real_rows") is not None else None
            best = most_precise(readers, saved_master, name, info, rows)
            kept = info["dtype"] if info.get("buffer") else dtype  # (a buffer keeps its float32)
            if kind == "model":
                tensors[name] = in_dtype(best, kept, name)
            elif not info.get("buffer"):  # (a buffer has no optimizer state)
                for key in ("exp_avg." + name, "exp_avg_sq." + name):
                    tensors[key] = full_from_shards(readers["optim"], key, info, rows)
                if want_master:
                    tensors["master." + name] = best.astype(np.float32)
            spec = info["sharding"]
            new_params[name] = {"full_shape": list(best.shape), "dtype": kept, "real_rows": info.get("real_rows"),
                                "sharding": None if spec is None else dict(spec, tp=1),  # (pp 1: no stage)
                                **({"buffer": True} if info.get("buffer") else {})}
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
    if os.path.exists(dst):  # made meanwhile: the copy is not left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{dst} exists; export refuses to overwrite it")
    os.replace(tmp, dst)
    return dst


def most_precise(readers: dict, saved_master: bool, name: str, info: dict, rows=None) -> np.ndarray:
    """A parameter's full tensor from its most precise copy: the fp32 master weight when the
    checkpoint has one (a bfloat16 run exported as float32 loses nothing), else the model's."""
    if saved_master and not info.get("buffer"):  # (a buffer: float32 in the model's file)
        return full_from_shards(readers["optim"], "master." + name, info, rows)
    return full_from_shards(readers["model"], name, info, rows)


def in_dtype(full: np.ndarray, dtype: str, name: str) -> np.ndarray:
    with np.errstate(over="ignore"):  # (an overflow is refused below, in one line; no NumPy warning first)
        out = full.astype(DTYPES[dtype])
    if not np.isfinite(out.astype(np.float32)).all() and np.isfinite(full).all():
        raise CheckpointError(f"export --dtype {dtype}: {name} has values beyond {dtype}'s range")
    return out


def model_tensors(src: str, dtype: str | None = None) -> tuple[GPTConfig, dict]:
    """(the model's config, {name: full tensor with its real rows, in `dtype`}) of checkpoint or
    run directory `src`, every file verified first; one process, no communication, any layout
    the run used (its TP, PP, DP, CP and EP shards joined)."""
    src, meta, config, dtype = _verified(src, dtype)
    has_optim = meta.get("optimizer") is not None
    saved_master = has_optim and bool(meta["optimizer"].get("master_weights"))
    readers = {kind: ShardReader(src, meta, kind) for kind in ["model"] + (["optim"] if saved_master else [])}
    tensors = {}
    for name, info in meta["params"].items():
        full = most_precise(readers, saved_master, name, info)
        real = info.get("real_rows")
        kept = info["dtype"] if info.get("buffer") else dtype  # (a buffer keeps its float32)
        tensors[name] = in_dtype(full[:real] if real is not None else full, kept, name)
    return dataclasses.replace(config, dtype=dtype), tensors


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
