"""A checkpoint's files: their names, durable writes (each file fsynced before it counts, JSON
written to a temporary name and renamed: a crash leaves the old file or the new one, never half
of one), sha256 digests, and the validation of meta.json before anything in it is used.
`cutp.checkpoint` saves and loads with them."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from safetensors.numpy import save_file

from .runtime.errors import UserError

FORMAT = "cutp-checkpoint"
VERSION = 1


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded; names the file and what is wrong with it."""


def model_file(r, tp):
    return f"model-tp{r:02d}-of-{tp:02d}.safetensors"


def optim_file(r, tp, d=0, dp=1):
    """TP rank r's optimizer state; with dp > 1, DP rank d's shard of it (distributed optimizer)."""
    return f"optim-tp{r:02d}-of-{tp:02d}" + (f"-dp{d:02d}-of-{dp:02d}" if dp > 1 else "") + ".safetensors"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path, tensors: dict, metadata=None):
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path, metadata=metadata)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_json_atomic(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_cutp_checkpoint(path: str) -> bool:
    """A cutp checkpoint (meta.json) or run directory (`latest`, step-*/meta.json); else (e.g. a
    Hugging Face directory) False."""
    if os.path.isfile(os.path.join(path, "meta.json")) or os.path.isfile(os.path.join(path, "latest")):
        return True
    try:
        steps = [d for d in os.listdir(path) if d.startswith("step-")]
    except OSError:
        return False
    return any(os.path.isfile(os.path.join(path, d, "meta.json")) for d in steps)


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
