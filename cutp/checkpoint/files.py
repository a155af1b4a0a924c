"""A checkpoint's files: their names, durable writes (each file fsynced before it counts, JSON
written to a temporary name and renamed: a crash leaves the old file or the new one, never half
of one), sha256 digests, and the validation of meta.json before anything in it is used.
`cutp.checkpoint` saves and loads with them.

meta.json is covered by its own checksum (`meta_sha256`: the sha256 of its canonical JSON without
that field), so an edited step, learning rate, config or mesh, or a removed file entry, is found.
Before any number in it is used, every field is checked: types, ranges (mesh sizes up to
`MAX_MESH`, dimensions up to `MAX_DIM`), the config by `GPTConfig.validate` at the saved TP size,
each parameter's sharding against the config, mesh.pp_layers against n_layer and each
parameter's stage against them, the files listed against the mesh (exactly the shard files its
TP x PP ranks imply), and each file's bytes against the tensors meta.json says it holds: no
allocation can exceed what lies on disk. Every path is a plain file name inside the checkpoint
directory (a symlink may not lead out of it) and only regular files are opened. A checkpoint of an
older cutp without `meta_sha256` is accepted with a warning (its fields are still checked
against the files); saving it again (resume, save) protects it. A checkpoint written before cutp
named its parameters neutrally (GPT-2's wte, h.{i}.attn.c_attn, ...; `cutp.models.names`) is read
under today's names: `read_meta` renames its parameters and keeps the names its files use in
`meta["stored_names"]`, through which every tensor is looked up (`cutp.checkpoint.names`).
(It runs over 500 lines: every field of meta.json, LoRA's column shardings included, is checked
here, in one place, before any is used.)
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys

import numpy as np
from safetensors.numpy import save_file

from ..models import GPTConfig, stage_layers
from ..models.names import from_gpt2
from .names import neutral_key, stored_names_view
from ..runtime.errors import ConfigError, UserError
from ..tensor_parallel.sharding import sharding_from_spec

FORMAT = "cutp-checkpoint"
VERSION = 1
META_CHECKSUM = "meta_sha256"
MAX_META_BYTES = 64 << 20  # a larger meta.json is not one cutp wrote
MAX_MESH = 1 << 16  # tp, dp and DP shards of a checkpoint
MAX_DIM = (1 << 31) - 1  # a parameter's dimension
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (as the safetensors library limits it)
# numpy dtype name -> (safetensors dtype, bytes per element)
TENSOR_DTYPES = {"float32": ("F32", 4), "float64": ("F64", 8), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}
_FILE_RE = re.compile(r"(?P<kind>model|optim)(?:-pp(?P<s>\d{2,})-of-\d{2,})?-tp\d{2,}-of-\d{2,}"
                      r"(?:-dp(?P<d>\d{2,})-of-\d{2,})?\.safetensors")
_warned = set()


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded; names the file and what is wrong with it."""


def _stage_part(s, pp):
    return f"-pp{s:02d}-of-{pp:02d}" if pp > 1 else ""  # at pp 1 the names of checkpoints before pipelines


def model_file(r, tp, s=0, pp=1):
    """Pipeline stage s's TP rank r's parameters."""
    return f"model{_stage_part(s, pp)}-tp{r:02d}-of-{tp:02d}.safetensors"


def optim_file(r, tp, d=0, dp=1, s=0, pp=1):
    """Stage s's TP rank r's optimizer state; with dp > 1, DP rank d's shard of it (distributed optimizer)."""
    return (f"optim{_stage_part(s, pp)}-tp{r:02d}-of-{tp:02d}" + (f"-dp{d:02d}-of-{dp:02d}" if dp > 1 else "")
            + ".safetensors")


def mesh_pp(meta: dict) -> int:
    """The checkpoint's pipeline stages (1 for checkpoints without mesh.pp)."""
    return meta["mesh"].get("pp", 1)


def param_stage(info: dict) -> int:
    """The pipeline stage whose files hold a parameter (0 without a stage entry)."""
    return info.get("stage", 0)


def stage_of_name(name: str, layers: list) -> int | None:
    """The stage that holds parameter `name` of a model cut into stages of `layers` (each stage's
    layer indices, `stage_layers`):
    a block's stage, the embeddings on the first, the final LayerNorm and the head on the last."""
    if name.startswith("layers."):
        i = name.split(".")[1]
        return next((s for s, r in enumerate(layers) if i.isdigit() and int(i) in r), None)
    return 0 if name.startswith(("tok_embed.", "pos_embed.")) else len(layers) - 1


def safe_path(directory: str, name, what: str = "file") -> str:
    """directory/name for a plain file name (no separator, not '.' or '..'); a symlink there must
    stay inside `directory`. Raises CheckpointError otherwise."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or os.sep in name \
            or "\0" in name or (os.altsep and os.altsep in name):
        raise CheckpointError(f"{directory}: {what} name {name!r} is not a plain file name inside the checkpoint "
                              "directory; the metadata was edited or damaged: use another checkpoint")
    path = os.path.join(directory, name)
    if os.path.islink(path):
        inside = os.path.realpath(directory)
        if os.path.commonpath([inside, os.path.realpath(path)]) != inside:
            raise CheckpointError(f"{path} is a symlink leading out of {directory} (to {os.path.realpath(path)}); "
                                  "cutp reads only files inside a checkpoint: copy the file in instead")
    return path


def open_regular(path: str, max_bytes: int | None = None):
    """A binary file object of `path` if it is a regular file (a FIFO, device or directory is
    refused without blocking), at most `max_bytes` long."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path} cannot be opened ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file; a checkpoint holds only regular files")
    if max_bytes is not None and st.st_size > max_bytes:
        os.close(fd)
        raise CheckpointError(f"{path} is {st.st_size} bytes, more than the {max_bytes} cutp writes; "
                              "it is not cutp's: use another checkpoint")
    return os.fdopen(fd, "rb")


def sha256_file(path: str) -> str:
    with open_regular(path) as f:
        return _sha256_of(f)


def _sha256_of(f, chunk: int = 1 << 16) -> str:
    """The sha256 of a binary file object's rest, read into one reused buffer of `chunk` bytes (so
    verifying a checkpoint holds 64 KiB, not a 4 MiB read each time: a ZeRO-3 load's peak stays
    near the one parameter it reads)."""
    h, buf = hashlib.sha256(), bytearray(chunk)
    view = memoryview(buf)
    while True:
        n = f.readinto(buf)
        if not n:
            return h.hexdigest()
        h.update(view[:n])


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path, tensors: dict, metadata=None):
    """The file `safetensors.numpy.save_file` writes, fsynced, its metadata's keys in the order
    given (save_file writes them in hash order, so two saves of the same state differed in their
    bytes): through StreamedSafetensors, but for tensors of other dtypes or no metadata."""
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if metadata is None or any(str(v.dtype) not in TENSOR_DTYPES for v in tensors.values()):
        save_file(tensors, path, metadata=metadata)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        return
    writer = StreamedSafetensors(path, {k: (v.shape, str(v.dtype)) for k, v in tensors.items()}, metadata)
    for k, v in tensors.items():
        writer.put(k, v)
    writer.close()


_ALIGNMENT = {"F64": 3, "F32": 2, "BF16": 1, "F16": 0}  # (safetensors writes the larger dtypes first)


class StreamedSafetensors:
    """A safetensors file written a tensor at a time, in any order (`put`), each at its place:
    the bytes `safetensors.numpy.save_file` writes for the same tensors (its header: tensors by
    dtype, larger first, then by name; compact JSON padded with spaces to 8 bytes)."""

    def __init__(self, path: str, entries: dict, metadata: dict):
        """entries: {name: (shape, numpy dtype name)}."""
        order = sorted(entries, key=lambda k: (-_ALIGNMENT[TENSOR_DTYPES[entries[k][1]][0]], k))
        header, self.where, at = {"__metadata__": metadata}, {}, 0
        for k in order:
            shape, dtype = entries[k]
            code, size = TENSOR_DTYPES[dtype]
            n = int(np.prod(shape, dtype=np.int64)) * size
            header[k] = {"dtype": code, "shape": [int(d) for d in shape], "data_offsets": [at, at + n]}
            self.where[k] = (at, n, dtype)
            at += n
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        self.start, self.left = 8 + len(text), set(order)
        self.f = open(path, "wb")
        self.f.write(len(text).to_bytes(8, "little") + text)

    def put(self, name: str, array) -> None:
        at, n, dtype = self.where[name]
        data = np.ascontiguousarray(array)
        if str(data.dtype) != dtype or data.nbytes != n:
            raise ValueError(f"{name}: {data.dtype} of {data.nbytes} bytes, the header says {dtype} of {n}")
        self.f.seek(self.start + at)
        self.f.write(data.reshape(-1).view(np.uint8))  # its own bytes: tobytes() would copy them (2x peak)
        self.left.discard(name)

    def close(self) -> None:
        if self.left:
            raise ValueError(f"tensors never written: {sorted(self.left)[:3]}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def write_json_atomic(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def meta_checksum(meta: dict) -> str:
    """sha256 of meta's canonical JSON (sorted keys, no spaces) without its own checksum field."""
    body = {k: v for k, v in meta.items() if k != META_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_meta(path, meta: dict) -> None:
    """meta.json, durably, with its checksum."""
    write_json_atomic(path, {**meta, META_CHECKSUM: meta_checksum(meta)})


def read_json(path: str, max_bytes: int = MAX_META_BYTES):
    """The JSON in a regular file of at most max_bytes (FileNotFoundError when absent)."""
    with open_regular(path, max_bytes) as f:
        return json.loads(f.read().decode())


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
    """meta.json of checkpoint `ckpt`, every field checked (module docstring); CheckpointError
    naming the first problem. Reads no other file."""
    path = safe_path(ckpt, "meta.json")
    try:
        meta = read_json(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {ckpt} is not a complete checkpoint") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is malformed JSON ({e}); the checkpoint cannot be used") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not cutp checkpoint metadata (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {meta.get('version')!r}; this cutp reads version {VERSION}")
    stored = meta
    meta = stored_names_view(meta)
    problem = _meta_problem(meta)
    if problem:
        raise CheckpointError(f"{path} is malformed: {problem}")
    saved = meta.get(META_CHECKSUM)
    if saved is None:
        if path not in _warned:
            _warned.add(path)
            print(f"cutp checkpoint: warning: {path} has no checksum (written by an older cutp): its fields are "
                  "checked against the files, but an edit to it cannot be detected; a checkpoint saved by this "
                  "cutp (resume and save) is protected", file=sys.stderr, flush=True)
    elif saved != meta_checksum(stored):
        raise CheckpointError(f"{path} was modified after it was written: its checksum {str(saved)[:16]}... does "
                              f"not match its content {meta_checksum(stored)[:16]}...; the checkpoint cannot be "
                              "trusted: use another checkpoint (or restore the original meta.json)")
    return meta


def _int(v, low, high):
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _meta_problem(meta: dict) -> str | None:
    required = {"step": int, "config": dict, "mesh": dict, "params": dict, "files": dict}
    for key, typ in required.items():
        if not isinstance(meta.get(key), typ):
            return f"field {key!r} is missing or not a {typ.__name__}"
    if not _int(meta["step"], 0, 1 << 62):
        return f"step {meta['step']!r} is not an integer >= 0"
    if META_CHECKSUM in meta and not isinstance(meta[META_CHECKSUM], str):
        return f"{META_CHECKSUM} is not a string"
    for fname, info in meta["files"].items():
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str) or not _int(info.get("bytes"), 0, 1 << 60):
            return f"entry for file {fname!r} lacks sha256/bytes"
    mesh = meta["mesh"]
    for key in ("tp", "dp"):
        v = mesh.get(key)
        if not _int(v, 1, MAX_MESH):
            return f"mesh.{key} is {v!r}, not an integer >= 1 (and <= {MAX_MESH})"
    tp, pp = mesh["tp"], mesh.get("pp", 1)
    if not _int(pp, 1, MAX_MESH):
        return f"mesh.pp is {pp!r}, not an integer >= 1 (and <= {MAX_MESH})"
    counts, virtual = mesh.get("pp_layers"), mesh.get("pp_virtual", 1)
    if not (_int(virtual, 1, MAX_MESH) and (virtual == 1 or pp > 1)):
        return f"mesh.pp_virtual is {virtual!r}, not an integer >= 1 (and 1 without mesh.pp)"
    n_chunks = pp * virtual
    if pp > 1 and not (isinstance(counts, list) and len(counts) == n_chunks
                       and all(_int(n, 1, MAX_DIM) for n in counts)):
        return (f"mesh.pp_layers is {counts!r}, not a list of pp={pp}"
                + (f" x pp_virtual={virtual}" if virtual > 1 else "") + " layer counts >= 1")
    opt = meta.get("optimizer")
    if opt is not None and (not isinstance(opt, dict) or not _int(opt.get("step"), 0, 1 << 62)):
        return "optimizer must be null or an object with an integer step"
    shards = 1 if opt is None else opt.get("dp_shards", 1)
    if not _int(shards, 1, MAX_MESH):
        return f"optimizer.dp_shards is {shards!r}, not an integer in [1, {MAX_MESH}]"
    rng = meta.get("rng")
    if rng is not None and not (isinstance(rng, dict) and isinstance(rng.get("offsets"), dict)
                                and all(_int(v, 0, 1 << 64) for v in rng["offsets"].values())):
        return "rng must be null or hold integer offsets"
    stages = (rng or {}).get("stages")
    if stages is not None and not (isinstance(stages, list) and len(stages) == pp and all(
            isinstance(o, dict) and all(_int(v, 0, 1 << 64) for v in o.values()) for o in stages)):
        return f"rng.stages must hold integer offsets for each of the pp={pp} stages"
    try:
        config = GPTConfig.from_dict(meta["config"])
        config.validate(tp)
    except (ConfigError, TypeError, ValueError) as e:
        return f"config: {e}"
    try:
        layers = stage_layers(config.n_layer, pp, counts if pp > 1 else None, virtual)
    except ConfigError as e:
        return f"mesh.pp_layers: {e}"
    # the files: exactly the shard files the mesh implies (counted before any name is built)
    expected_count = pp * tp * (1 + (shards if opt is not None else 0))
    if len(meta["files"]) != expected_count:
        return (f"it lists {len(meta['files'])} files, but mesh.tp {tp}" + (f" x mesh.pp {pp}" if pp > 1 else "")
                + (f" with {shards} optimizer shard(s)" if opt is not None else " without optimizer state")
                + f" means {expected_count}")
    expected = set(expected_files(tp, shards if opt is not None else None, pp))
    if set(meta["files"]) != expected:
        wrong = sorted(set(meta["files"]) - expected)[:3]
        return f"files {wrong} are not the shard files of mesh.tp {tp}" + (f" x mesh.pp {pp}" if pp > 1 else "")
    total = 0
    for name, info in meta["params"].items():
        problem = _param_entry_problem(info, tp, config)
        stage = info.get("stage", 0) if isinstance(info, dict) else None
        if problem is None and not (_int(stage, 0, pp - 1) and stage == stage_of_name(name, layers)):
            problem = f"stage {stage!r} is not the stage that holds it at mesh.pp {pp} ({stage_of_name(name, layers)})"
        if problem:
            return f"parameter {name!r}: {problem}"
        real, shape = info.get("real_rows"), info["full_shape"]
        if real is not None and (real != config.vocab_size or shape[0] != config.padded_vocab(tp)):
            return (f"parameter {name!r}: {shape[0]} rows ({real} real) differ from the config's vocabulary "
                    f"({config.vocab_size}, padded to {config.padded_vocab(tp)} at tp {tp})")
        total += int(np.prod([real or shape[0]] + shape[1:], dtype=object))
    if total != config.num_stored_values() and meta.get("trainable_only") is not True:  # (frozen ones: not saved)
        return (f"its parameters' shapes hold {total} values, but its config describes a model of "
                f"{config.num_stored_values()}: the config and the shapes do not match")
    # every file must be large enough for the tensors meta.json says it holds (bounds every allocation)
    for s in range(pp):
        stage = [info for info in meta["params"].values() if param_stage(info) == s]
        model_bytes = sum(shard_numel(info) * TENSOR_DTYPES[info["dtype"]][1] for info in stage)
        optim_bytes = sum(2 * shard_numel(info) * 4 for info in stage)
        for r in range(tp):
            groups = [[model_file(r, tp, s, pp)],
                      [optim_file(r, tp, d, shards, s, pp) for d in range(shards)] if opt is not None else []]
            for names, need in zip(groups, (model_bytes, optim_bytes)):
                have = sum(meta["files"][n]["bytes"] for n in names)
                if names and have < need:
                    return (f"{', '.join(names[:2])} {'is' if len(names) == 1 else 'are'} listed with {have} bytes, "
                            f"less than the {need} the tensors meta.json names need: the shapes do not fit the files")
    return None


def expected_files(tp: int, optim_shards: int | None, pp: int = 1) -> list:
    """The shard files of a checkpoint saved at `tp` x `pp` (optimizer state in `optim_shards` DP
    shard files per stage and TP rank; None: no optimizer state)."""
    out = [model_file(r, tp, s, pp) for s in range(pp) for r in range(tp)]
    if optim_shards is not None:
        out += [optim_file(r, tp, d, optim_shards, s, pp) for s in range(pp) for r in range(tp)
                for d in range(optim_shards)]
    return out


_SPEC_KEYS = {"contiguous": ("axis", "tp"), "qkv": ("axis", "n_head", "n_kv_head", "head_dim", "tp"),
              "gate_up": ("axis", "tp"),  # (SwiGLU's fused [gate | up]: each rank [gate_r ; up_r])
              "part": ("axis", "tp", "start", "stop")}  # (a LoRA B: columns [start, stop) of a base's sharding)


def _param_entry_problem(info, tp=None, config=None) -> str | None:
    if not isinstance(info, dict):
        return "entry is not an object"
    shape = info.get("full_shape")
    if not (isinstance(shape, list) and 1 <= len(shape) <= 4 and all(_int(d, 1, MAX_DIM) for d in shape)):
        return f"full_shape {shape!r} is not a list of 1 to 4 integers in [1, {MAX_DIM}]"
    if info.get("dtype") not in TENSOR_DTYPES:
        return f"dtype {info.get('dtype')!r} is not one of {sorted(TENSOR_DTYPES)}"
    real = info.get("real_rows")
    if real is not None and not _int(real, 1, shape[0]):
        return f"real_rows {real!r} is not null or an integer in [1, {shape[0]}]"
    spec = info.get("sharding", "absent")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("kind") not in _SPEC_KEYS:
        return f"sharding {spec!r} is neither null nor a known kind ({sorted(_SPEC_KEYS)})"
    bad = [k for k in _SPEC_KEYS[spec["kind"]] if not _int(spec.get(k), 0, MAX_DIM)]
    if bad:
        return f"sharding lacks integer fields {bad}"
    if not 0 <= spec["axis"] < len(shape):
        return f"sharding axis {spec['axis']} is outside the shape {shape}"
    if tp is not None and spec["tp"] != tp:
        return f"sharding tp {spec['tp']} differs from mesh.tp {tp}"
    n = shape[spec["axis"]]
    if spec["kind"] == "part":
        base = spec.get("base_shape")
        problem = _param_entry_problem({"full_shape": base, "dtype": info["dtype"], "sharding": spec.get("of")}, tp,
                                       config)
        if problem or spec["axis"] != 1 or len(shape) != 2 or not spec["start"] < spec["stop"] <= base[1] \
                or spec["stop"] - spec["start"] != n or (spec.get("of") or {}).get("axis") != 1:
            return f"sharding {spec!r} is not columns of its base's sharding ({problem or 'they do not fit'})"
    if spec["kind"] == "contiguous" and n % spec["tp"]:
        return f"sharding splits a dimension of {n} over tp {spec['tp']}, which does not divide it"
    if spec["kind"] == "gate_up" and n % (2 * spec["tp"]):
        return f"sharding splits [gate | up] halves of {n} over tp {spec['tp']}, which does not divide them"
    if spec["kind"] == "qkv":
        if config is not None and (spec["n_head"], spec["n_kv_head"], spec["head_dim"]) != (
                config.n_head, config.kv_heads, config.head_size):
            return (f"sharding's heads (n_head {spec['n_head']}, n_kv_head {spec['n_kv_head']}, head_dim "
                    f"{spec['head_dim']}) differ from the config's")
        if spec["n_head"] < 1 or spec["n_kv_head"] < 1 or (spec["n_head"] + 2 * spec["n_kv_head"]) * spec["head_dim"] != n:
            return f"sharding's heads do not make up the dimension of {n}"
        if spec["n_head"] % spec["tp"] or (spec["n_kv_head"] % spec["tp"] and spec["tp"] % spec["n_kv_head"]):
            return f"sharding's heads cannot be split over tp {spec['tp']}"
    return None


def shard_shape(info: dict) -> tuple:
    """The shape of each TP rank's shard of a parameter (its meta.json entry, checked), by
    arithmetic alone (every rank's is the same)."""
    shape, spec = list(info["full_shape"]), info.get("sharding")
    if spec is None:
        return tuple(shape)
    tp = spec["tp"]
    if spec["kind"] == "part":
        return sharding_from_spec(spec, tuple(shape)).shard_shape(0)
    if spec["kind"] in ("contiguous", "gate_up"):  # (gate_up: half of each half per rank)
        shape[spec["axis"]] //= tp
    else:
        kv = spec["n_kv_head"] // tp if tp <= spec["n_kv_head"] else 1
        shape[spec["axis"]] = (spec["n_head"] // tp + 2 * kv) * spec["head_dim"]
    return tuple(shape)


def shard_numel(info: dict) -> int:
    return int(np.prod(shard_shape(info), dtype=object))


def safetensors_header(f, size: int) -> dict:
    """The JSON header of an open safetensors file of `size` bytes (tensors are not read)."""
    f.seek(0)
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"header length {n} does not fit the file")
    header = json.loads(f.read(n).decode())
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    return header


def _header_problem(header: dict, meta: dict, fname: str) -> str | None:
    """How the tensors of shard file `fname` (its header) differ from what meta.json says."""
    match = _FILE_RE.fullmatch(fname)
    kind, stage = match.group("kind"), int(match.group("s") or 0)
    params = {name: info for name, info in meta["params"].items() if param_stage(info) == stage}
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if "stored_names" in meta:  # an older checkpoint's GPT-2 names, seen under cutp's
        tensors = {neutral_key(k, kind): v for k, v in tensors.items()}
    for key, t in tensors.items():
        if not (isinstance(t, dict) and isinstance(t.get("shape"), list) and isinstance(t.get("dtype"), str)):
            return f"tensor {key!r} has a malformed header entry"
    if kind == "model":
        expected = {name: (shard_shape(info), TENSOR_DTYPES[info["dtype"]][0]) for name, info in params.items()}
        if set(tensors) != set(expected):
            extra, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
            return f"holds tensors {extra[:3]} meta.json does not list, lacks {missing[:3]}"
        for key, (shape, dtype) in expected.items():
            if tuple(tensors[key]["shape"]) != shape or tensors[key]["dtype"] != dtype:
                return (f"tensor {key!r} is {tensors[key]['dtype']} {tensors[key]['shape']}, meta.json says "
                        f"{dtype} {list(shape)}")
        return None
    sharded = match.group("d") is not None
    offsets = {}
    if sharded:
        try:
            offsets = json.loads((header.get("__metadata__") or {}).get("offsets", "{}"))
        except (ValueError, TypeError, AttributeError):
            return "its offsets metadata is malformed"
        if not isinstance(offsets, dict):
            return "its offsets metadata is malformed"
        if "stored_names" in meta:
            offsets = {from_gpt2(k): v for k, v in offsets.items()}
    for key, t in tensors.items():
        prefix, _, name = key.partition(".")
        if prefix not in ("exp_avg", "exp_avg_sq", "master") or name not in params:
            return f"holds tensor {key!r} of no parameter meta.json lists in this stage's files"
        if t["dtype"] not in ("F32", "F64"):
            return f"tensor {key!r} is {t['dtype']}, not float32 or float64"
        if not sharded:
            if tuple(t["shape"]) != shard_shape(params[name]):
                return f"tensor {key!r} has shape {t['shape']}, meta.json says {list(shard_shape(params[name]))}"
            continue
        piece = offsets.get(name)
        if not (isinstance(piece, list) and len(piece) == 2 and all(_int(x, 0, 1 << 62) for x in piece)
                and piece[0] < piece[1] <= shard_numel(params[name]) and t["shape"] == [piece[1] - piece[0]]):
            return f"the piece {piece!r} of {key!r} does not fit its shape {t['shape']} or its parameter"
    if not sharded:
        missing = [f"{p}.{n}" for n in params for p in ("exp_avg", "exp_avg_sq")
                   if f"{p}.{n}" not in tensors and not params[n].get("buffer")]  # (a buffer has no state)
        if missing:
            return f"lacks tensors {missing[:3]}"
    return None


def verify_file(ckpt: str, meta: dict, fname: str) -> str | None:
    """None if the file is intact (size, sha256, and its tensors' names, shapes and dtypes as
    meta.json says), else a message naming it and the problem."""
    info = meta["files"].get(fname)
    try:
        path = safe_path(ckpt, fname)
    except CheckpointError as e:
        return str(e)
    if info is None:
        return f"{path}: not listed in meta.json (the checkpoint's mesh does not have this shard)"
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return f"{path} is missing (meta.json lists it); the checkpoint is incomplete"
    except CheckpointError as e:
        return str(e)
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != info["bytes"]:
            return f"{path} is truncated or has the wrong size: {size} bytes, meta.json says {info['bytes']}"
        digest = _sha256_of(f)
        if digest != info["sha256"]:
            return (f"{path} is corrupted: sha256 {digest[:16]}... differs from meta.json's "
                    f"{info['sha256'][:16]}...")
        try:
            problem = _header_problem(safetensors_header(f, size), meta, fname)
        except (ValueError, UnicodeDecodeError) as e:
            problem = f"is not a readable safetensors file ({e})"
    return f"{path} {problem}" if problem else None


def unlisted_files(ckpt: str, meta: dict) -> list:
    """Problems with the directory itself: files in it that meta.json does not list."""
    try:
        present = os.listdir(ckpt)
    except OSError as e:
        return [f"{ckpt} cannot be listed ({e.strerror})"]
    extra = sorted(n for n in present if n != "meta.json" and not n.startswith(".") and n not in meta["files"])
    return [f"{os.path.join(ckpt, n)} is not listed in meta.json (a shard of another checkpoint, or meta.json "
            "lost its entry); the checkpoint is inconsistent" for n in extra]
