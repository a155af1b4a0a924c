"""Which frozen base a run's checkpoints hold their trained tensors for (--freeze, LoRA).

A checkpoint saved with frozen parameters (`trainable_only`) holds only what trained; resuming
and exporting read the rest from the run's base. Its `train_args` record where that base was
(`init_from`, an absolute path) and what it held (`init_from_sha256`, `base_fingerprint`), so a
directory that now holds other weights (re-downloaded, re-exported, another model of the same
shapes put there) is refused instead of silently joined with adapters trained on another base:

    record = base_record("hf/llama")           # {"init_from": "/abs/hf/llama", "init_from_sha256": "..."}
    check_same_base("runs/a/step-00000100", meta["train_args"], "hf/llama", "`resume`")

Checkpoints of older cutp recorded the path as typed (maybe relative to where the run started)
and no fingerprint: their base is still found by that path, and not checked.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

from ..models.hf_files import files as hf_weight_files
from ..runtime.errors import ConfigError
from .files import is_cutp_checkpoint, read_meta
from .run_dir import resolve_checkpoint

BASE_SHA256 = "init_from_sha256"  # the train_args key of the base's fingerprint
# Weight files of a base up to this many bytes in all are hashed whole (~0.2 s). Beyond, each
# file's size, safetensors header and 1024 blocks of 64 KiB spread over it: a few milliseconds
# whatever the size, where hashing every byte of an 8B model's 16 GB costs every rank ~10 s at
# each start, resume and export. The header alone (names, dtypes, shapes) would not do: another
# model of the same shapes (the case to catch) has the same header; its weights differ nearly
# everywhere, so the blocks tell them apart. (A cutp checkpoint base: its meta.json's sha256 of
# each file, already computed, so its every byte counts at no cost.)
FULL_HASH_BYTES = 256 << 20
_BLOCK, _BLOCKS = 64 << 10, 1024


def base_fingerprint(path: str) -> str:
    """The sha256 fingerprint of the weights in `path`: a cutp checkpoint or run directory (its
    newest checkpoint), or a Hugging Face directory (its safetensors files; FULL_HASH_BYTES)."""
    h = hashlib.sha256()
    if is_cutp_checkpoint(path):
        files = read_meta(resolve_checkpoint(path))["files"]
        h.update(json.dumps({name: info["sha256"] for name, info in sorted(files.items())}).encode())
        return h.hexdigest()
    weights = hf_weight_files(path)[1]
    sizes = [os.path.getsize(w) for w in weights]
    whole = sum(sizes) <= FULL_HASH_BYTES
    for w, size in zip(weights, sizes):
        h.update(f"{os.path.basename(w)}:{size};".encode())
        with open(w, "rb") as f:
            if whole:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
                continue
            header = f.read(8)
            h.update(header)
            h.update(f.read(struct.unpack("<Q", header)[0]) if len(header) == 8 else b"")
            for k in range(_BLOCKS):
                f.seek(max(size - _BLOCK, 0) * k // (_BLOCKS - 1))
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def base_record(base: str) -> dict:
    """What a run's checkpoints record of its frozen base: its absolute path and fingerprint."""
    return {"init_from": os.path.abspath(base), BASE_SHA256: base_fingerprint(base)}


def check_same_base(ckpt: str, args: dict, base: str, fix: str) -> None:
    """ConfigError in one line naming both directories and `fix` when the checkpoint's run
    recorded a fingerprint of its base (`args`: its train_args) and `base` holds other weights."""
    recorded = args.get(BASE_SHA256)
    if recorded is None:  # (a checkpoint of older cutp: nothing to check against)
        return
    found = base_fingerprint(base)
    if found != recorded:
        where = args.get("init_from")
        now = (f"{base} now holds other weights" if where is not None and os.path.abspath(base) == where
               else f"{base} holds other weights")
        raise ConfigError(f"{ckpt} holds only what its run trained on the frozen base {where} (weights fingerprint "
                          f"{recorded[:12]}), but {now} ({found[:12]}): {fix}")
