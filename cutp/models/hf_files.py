"""Hugging Face directories: finding config.json and the safetensors files (single, or sharded
with model.safetensors.index.json), reading the config, opening the weights, and the dtypes a
save writes, and the atomic writing of a directory. Shared by every family (cutp.models.hf)."""
from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ..runtime.errors import ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # sharded weights: {"weight_map": {tensor: file}}
SAVE_DTYPES = ("float32", "float64", "float16", "bfloat16")


class HFFormatError(ConfigError):
    """A Hugging Face directory that cutp cannot read (missing file, wrong shape, unsupported option)."""


def files(path):
    """(config.json, [safetensors files], index): model.safetensors (index None), or the shards
    that model.safetensors.index.json names (index {tensor key: file})."""
    if not os.path.isdir(path):
        raise HFFormatError(f"{path!r} is not a directory; expected a Hugging Face model directory "
                            f"with {CONFIG_FILE} and {WEIGHTS_FILE}")
    cfg_file, w_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(cfg_file):
        raise HFFormatError(f"{cfg_file} not found: a Hugging Face model directory needs {CONFIG_FILE} and "
                            f"{WEIGHTS_FILE} (or {INDEX_FILE} and its shards)")
    if os.path.isfile(w_file):
        return cfg_file, [w_file], None
    if os.path.isfile(os.path.join(path, INDEX_FILE)):
        index = _read_index(path)
        return cfg_file, sorted(set(index.values())), index
    hint = ""
    if os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        hint = (" (only pytorch_model.bin is there: convert it once with transformers, "
                "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`)")
    raise HFFormatError(f"{w_file} not found: a Hugging Face model directory needs {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE} (or {INDEX_FILE} and its shards){hint}")


def _read_index(path: str) -> dict:
    """{tensor key: shard file path} from model.safetensors.index.json; every file named must be
    a relative path inside `path` (no absolute path, no '..') to an existing file (a symbolic
    link is followed: the Hugging Face cache links a snapshot's files to its blobs)."""
    index = os.path.join(path, INDEX_FILE)
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        raise HFFormatError(f"{index} is not a JSON object: {e}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HFFormatError(f"{index} has no \"weight_map\" object ({{tensor name: file name}})")
    out = {}
    for key, name in weight_map.items():
        parts = name.replace("\\", "/").split("/") if isinstance(name, str) else None
        if parts is None or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts):
            raise HFFormatError(f"{index}: {key} is mapped to {name!r}, which is not a file name inside {path}")
        full = os.path.join(path, *parts)
        if not os.path.isfile(full):
            raise HFFormatError(f"{index}: {key} is in {name!r}, but {os.path.join(path, name)} does not exist")
        out[key] = full
    return out


def read_hf_config(path: str) -> dict:
    cfg_file = files(path)[0]
    try:
        with open(cfg_file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{cfg_file} is not valid JSON: {e}") from None


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes that can be read


def open_weights(w_file):
    try:
        return safe_open(w_file, framework="numpy")
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise HFFormatError(f"{w_file} is not a readable safetensors file: {type(e).__name__}: {e}") from None


def to_save_dtype(a: np.ndarray, dtype):
    if dtype is None:
        return np.ascontiguousarray(a)
    if dtype == "bfloat16":
        return np.ascontiguousarray(a.astype(ml_dtypes.bfloat16))
    return np.ascontiguousarray(a.astype(np.dtype(dtype)))


def load_streaming(model, tensors) -> None:
    """Each full tensor of (name, array) pairs in turn -> this rank's shard of it: peak host memory
    is one full tensor. A pipeline stage keeps its own parameters' tensors (the last stage's tied
    embedding copy included); every parameter of the model must have been given."""
    params, loaded = model.named_parameters(), set()
    for name, a in tensors:
        if name in params:
            model.load_full_state_dict({name: a}, strict=False)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise HFFormatError(f"the checkpoint has no tensors for {missing[:8]}{'...' if len(missing) > 8 else ''}")


def check_same_fields(model, path: str, cfg, fields) -> None:
    """HFFormatError naming the `fields` on which the model's configuration and a directory's
    (`cfg`) differ."""
    diff = [f"{k}: model {getattr(model.config, k)!r} vs {path} {getattr(cfg, k)!r}"
            for k in fields if getattr(model.config, k) != getattr(cfg, k)]
    if diff:
        raise HFFormatError("the model's configuration differs from the checkpoint's: " + "; ".join(diff))


def load_checked(model, path: str, cfg, tensors, fields) -> None:
    """`load_streaming` of a directory's tensors into an existing model whose configuration must
    agree with the directory's (`cfg`) on `fields` (`check_same_fields`)."""
    check_same_fields(model, path, cfg, fields)
    load_streaming(model, tensors)


GENERATION_FILE = "generation_config.json"


def _write_json(obj: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_hf_dir(tensors: dict, hf_cfg: dict, path: str, generation: dict | None = None,
                 tokenizer_files: dict | None = None) -> None:
    """Writes model.safetensors (`tensors` under the HF names, as they are), config.json,
    generation_config.json (when given) and the tokenizer files ({name: source file}, copied)
    into `path`, each to a temporary name first, fsynced, and renamed when all are complete, so a
    failed save leaves no half-written file under the names transformers reads."""
    os.makedirs(path, exist_ok=True)
    pending = {}  # final name -> temporary path

    def tmp(name):
        pending[name] = os.path.join(path, f".{name}.tmp.{os.getpid()}")
        return pending[name]

    try:
        save_file(tensors, tmp(WEIGHTS_FILE), metadata={"format": "pt"})  # "pt": what transformers checks for
        _fsync(pending[WEIGHTS_FILE])
        _write_json(hf_cfg, tmp(CONFIG_FILE))
        if generation is not None:
            _write_json(generation, tmp(GENERATION_FILE))
        for name, src in (tokenizer_files or {}).items():
            with open(src, "rb") as f_in, open(tmp(name), "wb") as f_out:
                shutil.copyfileobj(f_in, f_out)
                f_out.flush()
                os.fsync(f_out.fileno())
        for name, t in pending.items():
            os.replace(t, os.path.join(path, name))
        _fsync(path)  # the renames themselves
    finally:
        for t in pending.values():
            if os.path.exists(t):
                os.remove(t)
