"""Training data without downloads, and batches that do not depend on the mesh.

Sources:
- the embedded default: byte-level tokens (vocabulary 256) of the Python standard library's own
  source files on this machine, found from the running interpreter; files are split into train
  and validation deterministically by a hash of their relative path;
- `--data DIR`: a directory written by `python -m cutp prepare-data` (`shards`: its shards
  memory-mapped, the tokenizer's identity and vocabulary from its meta.json);
- `--data PATH`: any text file (byte-level tokens), a nanoGPT-style `.bin` of uint16 tokens, or
  one llm.c shard (`.bin` with llm.c's header, uint16 or uint32); for a `.bin` a sibling
  `val.bin` is the validation split if present, else the last 10%.

Batches: the global batch of optimizer step s is a pure function of (seed, s, split): B random
windows of seq_len+1 tokens. DP rank d takes its contiguous share of those windows, and each
micro-batch a contiguous part of that share. So the same step reads the same sequences whatever
tp, dp and the micro-batch size are (the math does not change with the mesh), every TP rank of a
group reads the same batch, and resuming at step s needs nothing but s.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass, field

import numpy as np

from ..runtime.errors import ConfigError
from .packing import IGNORE, PackedSplit
from .shards import ShardedTokens, is_shard, load_side, load_split, read_meta, read_shard
from .tokenizer import ByteTokenizer

_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
DEFAULT_CORPUS_BYTES = 16 << 20  # cap, so start-up stays fast on any Python
FULL_HASH_BYTES = 256 << 20  # Dataset.fingerprint hashes a split this large whole


@dataclass
class Dataset:
    train: np.ndarray | ShardedTokens  # 1-D integer tokens
    val: np.ndarray | ShardedTokens
    vocab_size: int
    description: str
    tokenizer: dict | None = None  # its tokenizer's identity (cutp.data.tokenizer): prepared data's, or bytes; None: unknown (a .bin)
    # prepared data (format version 2): each split's target flags (uint8 per token; chat data only)
    # and document lengths, and how its records were made (meta.json's "records": format, train_on, ...)
    masks: dict | None = None
    doc_lengths: dict | None = None
    records: dict | None = None
    _fingerprint: str | None = field(default=None, repr=False, compare=False)

    def fingerprint(self) -> str:
        """A blake2b digest of the tokens (train and validation), computed once: ranks that read
        the same path compare it, so different files under one name are found. Up to
        FULL_HASH_BYTES per split every byte is hashed; beyond, 1024 blocks of 64 KiB spread over
        it and its length (a few ms, whatever the size); of sharded data, meta.json's digests and
        the ends of each shard (ShardedTokens.fingerprint_bytes)."""
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=16)
            side = [self.masks[s] for s in ("train", "val")] if self.masks else []
            for a in [self.train, self.val] + side:
                if isinstance(a, ShardedTokens):
                    h.update(a.fingerprint_bytes())
                    continue
                a = np.asarray(a)
                h.update(f"{a.dtype.str}:{a.size};".encode())
                flat = a.reshape(-1)
                if a.nbytes <= FULL_HASH_BYTES:
                    h.update(np.ascontiguousarray(flat).tobytes())
                else:
                    block = (64 << 10) // a.itemsize
                    for start in np.linspace(0, flat.size - block, 1024).astype(np.int64):
                        h.update(np.ascontiguousarray(flat[start:start + block]).tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def split(self, name: str) -> np.ndarray:
        if name not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {name!r}")
        return self.train if name == "train" else self.val


def stdlib_source_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in sorted(filenames):
            if f.endswith(".py"):
                out.append(os.path.join(dirpath, f))
    return out


def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> Dataset:
    root = sysconfig.get_paths()["stdlib"]
    train, val, total = [], [], 0
    for path in stdlib_source_files():
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        rel = os.path.relpath(path, root)
        (val if zlib.crc32(rel.encode()) % 10 == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not train or not val:
        raise RuntimeError(f"the Python standard library at {root} has too few source files for a corpus; "
                           "pass a text file as data")
    tr = np.frombuffer(b"\n".join(train), np.uint8)
    va = np.frombuffer(b"\n".join(val), np.uint8)
    return Dataset(tr, va, 256, f"Python {sysconfig.get_python_version()} standard library sources "
                               f"({len(train) + len(val)} files, {total / 2**20:.1f} MiB, byte-level)",
                   tokenizer=ByteTokenizer().identity())


def load_dataset(path: str | None) -> Dataset:
    """The default corpus (None), a prepared directory (`load_prepared`), a `.bin` of token ids
    (nanoGPT's uint16 without a header, or an llm.c shard; a `val.bin` beside it is the
    validation split, else the last 10%), or any other file as bytes. The vocab_size of a `.bin`
    is the largest id in either split + 1 (the smallest vocabulary that fits the data), of bytes
    256. Raises ConfigError naming the file for what cannot be used."""
    if path is None:
        return default_corpus()
    if os.path.isdir(path):
        return load_prepared(path)
    if not os.path.isfile(path):
        raise ConfigError(f"`data` {path}: no such file or directory")
    if path.endswith(".bin"):
        tokens = _token_file(path)
        sibling = os.path.join(os.path.dirname(path), "val.bin")
        if os.path.basename(path) != "val.bin" and os.path.exists(sibling):
            val = _token_file(sibling)
            train = tokens
        else:
            cut = int(len(tokens) * 0.9)
            train, val = tokens[:cut], tokens[cut:]
        vocab = max(_largest(train), _largest(val)) + 1  # the validation split's ids too: not found at eval only
        return Dataset(train, val, vocab, f"{path} ({tokens.dtype.name} tokens, {len(tokens):,} tokens)")
    with open(path, "rb") as f:
        data = f.read()
    tokens = np.frombuffer(data, np.uint8)
    cut = int(len(tokens) * 0.9)
    return Dataset(tokens[:cut], tokens[cut:], 256, f"{path} (byte-level, {len(tokens):,} bytes)",
                   tokenizer=ByteTokenizer().identity())


def load_prepared(directory: str) -> Dataset:
    """The train and val shards of a prepare-data directory, memory-mapped; vocab_size and the
    tokenizer's identity from its meta.json."""
    meta = read_meta(directory)
    train, val = (load_split(directory, meta, s) for s in ("train", "val"))
    masks = {s: load_side(directory, meta, s, "masks") for s in ("train", "val")}
    lengths = {s: load_side(directory, meta, s, "docs") for s in ("train", "val")}
    tok = meta["tokenizer"]
    sizes = ", ".join(f"{s} {meta['splits'][s]['tokens']:,} tokens in {len(meta['splits'][s]['shards'])} shard(s)"
                      for s in ("train", "val"))
    records = meta.get("records")
    kind = f"{records['format']} records, targets: {records['train_on']}, " if records and records["format"] != "text" \
        else ""
    return Dataset(train, val, int(meta["vocab_size"]), f"{directory} ({kind}{tok['name']} {train.dtype.name} "
                                                        f"tokens: {sizes})", tokenizer=tok,
                   masks=masks if masks["train"] is not None else None,
                   doc_lengths=lengths if lengths["train"] is not None else None, records=records)


def _token_file(path: str) -> np.ndarray:
    if is_shard(path):
        return read_shard(path)
    size = os.path.getsize(path)
    if size == 0:
        raise ConfigError(f"`data` {path} is empty; a .bin holds uint16 token ids (nanoGPT's format)")
    if size % 2:
        raise ConfigError(f"`data` {path} has {size} bytes, not a whole number of uint16 token ids; "
                          "a .bin holds uint16 token ids (nanoGPT's format)")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _largest(tokens: np.ndarray, block: int = 1 << 24) -> int:
    """The largest id, read in blocks (a memmap is not loaded whole); -1 for none."""
    return max((int(tokens[i:i + block].max()) for i in range(0, len(tokens), block)), default=-1)


def micro_batches(batch_size: int, dp: int, micro_batch_size: int) -> int:
    """Micro-batches per optimizer step on each DP rank: the global batch split equally over the
    DP ranks, each share into micro-batches. Raises ConfigError when it does not split."""
    if batch_size % dp:
        raise ConfigError(f"`batch_size` {batch_size} must be divisible by dp={dp} (each DP rank takes an equal "
                          f"share); use a multiple of {dp}")
    per_rank = batch_size // dp
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1 or per_rank % micro_batch_size:
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        raise ConfigError(f"`micro_batch_size` {micro_batch_size} must divide the per-DP-rank batch {per_rank} "
                          f"(= `batch_size` {batch_size} / dp {dp}); use one of {divisors}")
    return per_rank // micro_batch_size


class MicroBatch(tuple):
    """(x, y) int64 arrays [micro_batch, seq_len], unpacked as a pair; `documents`: with
    packing, the rows' document ids (int32 [micro_batch, seq_len], contract 2), else None."""

    documents = None

    def __new__(cls, x, y, documents=None):
        out = super().__new__(cls, (x, y))
        out.documents = documents
        return out


def model_kwargs(batch, asarray) -> dict:
    """The keywords the model's forward takes for a micro-batch beyond (x, y): {"documents": ...}
    for packed rows (a MicroBatch's, contract 2), else none; `asarray` moves the array to the device."""
    documents = getattr(batch, "documents", None)
    return {} if documents is None else {"documents": asarray(documents)}


class BatchSampler:
    """Deterministic global batches, sliced by micro-batch and DP rank (`first_row`). Targets
    that are not trained on (chat data's masks) are IGNORE (-100). With `pack`, each row is a
    window of whole documents (cutp.data.packing), its document ids in the batch's `documents`.
    `evaluate` False (a run with `eval_every` 0): the validation split is neither needed nor
    checked now (it may be empty: prepare-data dropped every record chosen for it); it is set
    up, or refused, when first asked for."""

    def __init__(self, dataset: Dataset, seq_len: int, global_batch: int, dp_size: int, dp_rank: int,
                 micro_batch: int, seed: int = 0, every_rank=None, pack: bool = False, evaluate: bool = True):
        accum_steps = micro_batches(global_batch, dp_size, micro_batch)
        if pack and dataset.doc_lengths is None:
            raise ConfigError("`pack` needs each document's length: give `data` a directory written by this "
                              "version's python -m cutp prepare-data (format version 2)")
        self.packed = {} if pack else None
        self.dataset = dataset
        self.seq_len = seq_len
        self._ready = set()
        for split in ("train", "val") if evaluate else ("train",):
            self._set_up(split)
        self.global_batch = global_batch
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.micro_batch = micro_batch
        self.per_rank = global_batch // dp_size
        self.accum_steps = accum_steps
        self.seed = seed
        # marks an error every rank reading these batches raises (cutp.runtime.failure's
        # mark_raised_on_every_rank): a damaged batch ends the job with one line
        self.every_rank = every_rank

    def _set_up(self, split: str) -> None:
        """Checks `split` holds a row (packed: its windows of documents), once; ConfigError naming the fix."""
        if split in self._ready:
            return
        without = ", or `eval_every` 0 to train without validation" if split == "val" else ""
        if self.packed is not None:
            lengths = self.dataset.doc_lengths[split]
            if split == "val" and not len(lengths):
                raise ConfigError(f"`pack`: the val split has no documents{without}; give more data "
                                  "(prepare-data --val-fraction)")
            self.packed[split] = PackedSplit(lengths, self.seq_len, split)
        else:
            n = len(self.dataset.split(split))
            if n < self.seq_len + 2:
                raise ConfigError(f"the {split} split has {n} tokens, fewer than seq_len+2 = {self.seq_len + 2}; "
                                  f"use a shorter `seq_len` or more data{without}")
        self._ready.add(split)

    def global_offsets(self, step: int, split: str = "train") -> np.ndarray:
        """The step's rows: offsets into the split's tokens (or, packed, window indices)."""
        self._set_up(split)
        rng = np.random.default_rng([self.seed, step, 0 if split == "train" else 1])
        if self.packed is not None:
            return rng.integers(0, len(self.packed[split]), self.global_batch)
        tokens = self.dataset.split(split)
        return rng.integers(0, len(tokens) - self.seq_len - 1, self.global_batch)

    def first_row(self, micro: int) -> int:
        """The first row of this DP rank's micro-batch `micro` in the step's global batch. The
        global batch is m micro-batches of dp x micro_batch rows, DP rank r taking rows
        [r * b, (r + 1) * b) of each: micro-batch k of one rank with dp x b rows is micro-batch k
        of every DP rank together (what is computed over a micro-batch of the whole DP group,
        an MoE router's load-balancing loss, is then the same at any DP size)."""
        return (micro * self.dp_size + self.dp_rank) * self.micro_batch

    def micro_batches(self, step: int, split: str = "train"):
        """Yields MicroBatch (x, y) int64 arrays [micro_batch, seq_len] of this DP rank for optimizer step `step`."""
        offs = self.global_offsets(step, split)
        tokens = self.dataset.split(split)
        masks = self.dataset.masks[split] if self.dataset.masks else None
        packed = self.packed[split] if self.packed is not None else None
        spans = [packed.span(int(w)) for w in offs] if packed is not None else [(int(o), int(o) + self.seq_len + 1)
                                                                              for o in offs]
        if isinstance(tokens, ShardedTokens):  # every rank checks the whole batch: all refuse it together
            self._check_ids(tokens, spans, split)
        for k in range(self.accum_steps):
            first = self.first_row(k)
            chunk = offs[first:first + self.micro_batch]
            if packed is not None:
                rows = [packed.row(tokens, masks, int(w)) for w in chunk]
                yield MicroBatch(*(np.stack(r) for r in zip(*rows)))
                continue
            window = np.stack([np.asarray(tokens[o:o + self.seq_len + 1], dtype=np.int64) for o in chunk])
            y = window[:, 1:]
            if masks is not None:
                flags = np.stack([np.asarray(masks[o + 1:o + self.seq_len + 1]) for o in chunk])
                y = np.where(flags == 0, IGNORE, y)
            yield MicroBatch(window[:, :-1], y)

    def _check_ids(self, tokens: ShardedTokens, spans: list, split: str) -> None:
        """Raises ConfigError naming the shard, the offset and the fix when a window of the global
        batch holds an id outside the data's vocabulary (a damaged shard; prepare-data writes none)."""
        vocab = self.dataset.vocab_size
        for a, b in sorted(spans):
            window = tokens[a:b]
            if window.size and int(window.max()) >= vocab:
                error = ConfigError(tokens.describe_bad_id(a + int(np.argmax(window >= vocab)), vocab, split))
                raise error if self.every_rank is None else self.every_rank(error)

    def state(self, next_step: int) -> dict:
        return {"sampler": "packed-windows" if self.packed is not None else "random-windows", "seed": self.seed,
                "next_step": int(next_step), "seq_len": self.seq_len, "global_batch": self.global_batch}
