"""Durable writes and checksums of checkpoint files: each file fsynced before it counts, JSON
written to a temporary name and renamed (a crash leaves the old file or the new one, never half
of one), sha256 digests for verification."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from safetensors.numpy import save_file


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
