"""Token shards: the files `python -m cutp prepare-data` writes, memory-mapped by the loader.

A shard is llm.c's `.bin` layout: a header of 256 little-endian int32 (1 KiB), then the tokens.
header[0] is the magic and header[1] the version, which together give the token type (llm.c's
values: 20240520 / 1 for uint16 tokens, 20240801 / 7 for uint32), header[2] the number of
tokens, header[3] the bytes per token (2 or 4; 0 in llm.c's own files, whose magic says it). So
llm.c's GPT-2 and Llama 3 shards load here, and these load in llm.c. Tokens are uint16 when
every id of the vocabulary fits (vocab_size <= 65,536), else uint32.

A prepared directory (`load_prepared`) holds meta.json (the tokenizer's identity, the vocabulary
size, token and document counts, the shards of each split with their blake2b digests) and the
shards `train_000000.bin`, ..., `val_000000.bin`, .... Each split is the concatenation of its
shards, memory-mapped (nothing is read into memory until a batch reads its windows), so a
corpus of any size opens in the time it takes to map its files. A window of the sampler may
cross a shard boundary: the shards of a split are one token stream cut at fixed sizes, and
documents end with EOS, so such a window is like one crossing a document boundary inside a
shard.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from ..runtime.errors import ConfigError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAGIC_VERSION = {np.dtype(np.uint16): (20240520, 1), np.dtype(np.uint32): (20240801, 7)}  # llm.c's
META_FILE = "meta.json"
FORMAT = "cutp-token-shards"
FORMAT_VERSION = 2  # 2: document lengths (.docs) and, for chat data, target masks (.mask) beside the shards
READABLE_VERSIONS = (1, 2)
SPLITS = ("train", "val")
# the streams beside the token shards (version 2): a cutp header (its own magic, so that no llm.c
# reader takes them for tokens) over uint8 target flags / uint32 document lengths
MASK_EXT, DOCS_EXT = ".mask", ".docs"
SIDE_MAGIC = {MASK_EXT: (20261205, 1), DOCS_EXT: (20261205, 2)}
SIDE_DTYPE = {MASK_EXT: np.dtype(np.uint8), DOCS_EXT: np.dtype(np.uint32)}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of the vocabulary fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_name(split: str, index: int, ext: str = ".bin") -> str:
    return f"{split}_{index:06d}{ext}"


def write_shard(path: str, tokens: np.ndarray) -> str:
    """Writes `tokens` (uint16 or uint32) as a shard at `path`: first under a temporary name, then
    renamed, so that `path` exists only complete. Returns the blake2b digest of the tokens."""
    tokens = np.ascontiguousarray(tokens)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_header_bytes(tokens.dtype, tokens.size))
        f.write(tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.blake2b(tokens.tobytes(), digest_size=16).hexdigest()


def _header_bytes(dtype: np.dtype, count: int, ext: str = ".bin") -> bytes:
    magic, version = SIDE_MAGIC[ext] if ext in SIDE_MAGIC else MAGIC_VERSION[np.dtype(dtype)]
    header = np.zeros(HEADER_INTS, "<i4")
    header[:4] = magic, version, count, np.dtype(dtype).itemsize
    return header.tobytes()


class ShardWriter:
    """One split's stream of tokens into shards of `shard_tokens`: appended to the next shard's
    temporary file (`<split>_NNNNNN.bin.tmp`, its header zero until the end), which becomes the
    shard (header written, fsync, rename) when full. `state()` is what a rerun needs to go on
    from the last `sync()`: the finished shards and the tokens in the temporary file (a rerun
    cuts it back to those, or takes back a shard renamed after the sync, and deletes later ones).
    `ext`: ".bin" for tokens, MASK_EXT / DOCS_EXT for the streams beside them (their dtype)."""

    def __init__(self, directory: str, split: str, dtype: np.dtype, shard_tokens: int, state: dict | None = None,
                 ext: str = ".bin"):
        self.ext = ext
        dtype = SIDE_DTYPE.get(ext, dtype)
        self.directory, self.split, self.dtype = directory, split, np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens
        state = state or {"shards": [], "tmp_tokens": 0}
        self.shards, self.count = list(state["shards"]), int(state["tmp_tokens"])
        self._file, self._hash = None, hashlib.blake2b(digest_size=16)
        self._delete_after(len(self.shards) + (1 if self.count else 0))
        if self.count:  # resume: the temporary file as it was at the sync
            path = self._path()
            if not os.path.exists(path + ".tmp") and os.path.exists(path):
                os.replace(path, path + ".tmp")  # renamed after the last sync: continue it
            size = HEADER_BYTES + self.count * self.dtype.itemsize
            if not os.path.isfile(path + ".tmp") or os.path.getsize(path + ".tmp") < size:
                raise ConfigError(f"{path}.tmp is missing or shorter than progress.json says; start again with "
                                  "`overwrite`")
            self._file = open(path + ".tmp", "r+b")
            self._file.truncate(size)
            self._file.seek(HEADER_BYTES)
            for block in iter(lambda: self._file.read(1 << 24), b""):
                self._hash.update(block)

    def _path(self, index: int | None = None) -> str:
        return os.path.join(self.directory, shard_name(self.split, len(self.shards) if index is None else index,
                                                       self.ext))

    def _delete_after(self, first: int) -> None:
        """Removes this split's shard and temporary files from index `first` on (a killed run's)."""
        n = len(self.ext)
        for name in os.listdir(self.directory):
            stem = name[:-4] if name.endswith(".tmp") else name
            if stem.startswith(self.split + "_") and stem.endswith(self.ext) and stem[len(self.split) + 1:-n].isdigit() \
                    and int(stem[len(self.split) + 1:-n]) >= first:
                os.remove(os.path.join(self.directory, name))

    def write(self, tokens: np.ndarray) -> list:
        """Appends tokens; returns the names of the shards this finished."""
        done = []
        while len(tokens):
            if self._file is None:
                self._file = open(self._path() + ".tmp", "wb")
                self._file.write(bytes(HEADER_BYTES))
            part = np.ascontiguousarray(tokens[:self.shard_tokens - self.count], dtype=self.dtype).tobytes()
            self._file.write(part)
            self._hash.update(part)
            self.count += len(part) // self.dtype.itemsize
            tokens = tokens[len(part) // self.dtype.itemsize:]
            if self.count == self.shard_tokens:
                done.append(self._finish_shard())
        return done

    def _finish_shard(self) -> str:
        f, path = self._file, self._path()
        f.seek(0)
        f.write(_header_bytes(self.dtype, self.count, self.ext))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(path + ".tmp", path)
        self.shards.append({"file": os.path.basename(path), "tokens": self.count, "blake2b": self._hash.hexdigest()})
        self._file, self._hash, self.count = None, hashlib.blake2b(digest_size=16), 0
        return os.path.basename(path)

    def close(self) -> list:
        """Finishes the last, shorter shard; returns its name (or nothing)."""
        return [self._finish_shard()] if self.count else []

    def sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self.count

    def state(self) -> dict:
        return {"shards": self.shards, "tmp_tokens": self.count}


def is_shard(path: str) -> bool:
    """Whether the file starts with a shard header whose count matches its size."""
    try:
        return shard_header(path) is not None
    except OSError:
        return False


def shard_header(path: str):
    """(dtype, count) of a shard, or None when the file is not one."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        return None
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(16), "<i4")
    for dtype, (magic, version) in MAGIC_VERSION.items():
        if header[0] == magic and header[1] == version and header[3] in (0, dtype.itemsize) \
                and size == HEADER_BYTES + int(header[2]) * dtype.itemsize:
            return dtype, int(header[2])
    return None


def read_shard(path: str) -> np.ndarray:
    """The tokens of a shard, memory-mapped read-only. Raises ConfigError naming the file when
    it is not a complete shard."""
    found = shard_header(path) if os.path.isfile(path) else None
    if found is None:
        raise ConfigError(f"{path} is not a complete token shard (a 1 KiB llm.c header whose count matches the "
                          "file's size); prepare the data again with python -m cutp prepare-data")
    dtype, count = found
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=HEADER_BYTES, shape=(count,))


class ShardedTokens:
    """The shards of one split as one read-only token sequence: len() and slices (`tokens[a:b]`,
    an array copied from the shards it spans), as the batch sampler reads a 1-D array."""

    def __init__(self, shards: list, digests: list | None = None, paths: list | None = None):
        self.shards = list(shards)
        self.digests = list(digests) if digests is not None else [""] * len(self.shards)  # meta.json's
        self.paths = list(paths) if paths is not None else None  # the shards' files (fingerprint_bytes reads them)
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.dtype = self.shards[0].dtype if self.shards else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"token {key} of a split of {len(self)}")
            k = int(np.searchsorted(self.starts, i, side="right")) - 1
            return self.shards[k][i - self.starts[k]]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ShardedTokens takes an index or a contiguous slice")
        a, b, _ = key.indices(len(self))
        if b <= a:
            return np.zeros(0, self.dtype)
        first = int(np.searchsorted(self.starts, a, side="right")) - 1
        last = int(np.searchsorted(self.starts, b - 1, side="right")) - 1
        parts = [self.shards[k][max(a - self.starts[k], 0):min(b - self.starts[k], len(self.shards[k]))]
                 for k in range(first, last + 1)]
        return np.asarray(parts[0]) if len(parts) == 1 else np.concatenate(parts)

    def describe_bad_id(self, i: int, vocab: int, split: str) -> str:
        """What to say of token i, an id outside the vocabulary: its shard, offset and the fix."""
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        at = i - int(self.starts[k])
        where = self.paths[k] if self.paths is not None else f"{split} shard {k}"
        directory = os.path.dirname(where) if self.paths is not None else "DIR"
        return (f"{where}: token {at:,} (byte {HEADER_BYTES + at * self.dtype.itemsize:,}) is id "
                f"{int(self[i])}, outside the data's vocabulary of {vocab:,}: the shard is damaged; check the "
                f"data with python -m cutp verify-data {directory} and prepare it again with python -m cutp "
                "prepare-data")

    def fingerprint_bytes(self) -> bytes:
        """What Dataset.fingerprint hashes for sharded data, read in milliseconds whatever the
        size: meta.json's digest of each shard, each shard's length and its first and last 64 KiB."""
        out = [f"{self.dtype.str}:{len(self)};".encode()]
        block = (64 << 10) // self.dtype.itemsize
        for k, (digest, s) in enumerate(zip(self.digests, self.shards)):
            out.append(f"{digest}:{len(s)};".encode())
            if self.paths is None:
                out += [np.ascontiguousarray(s[:block]).tobytes(), np.ascontiguousarray(s[-block:]).tobytes()]
                continue
            # read, not through the map: a page fault per shard costs far more than a read
            n = min(block, len(s)) * self.dtype.itemsize
            with open(self.paths[k], "rb") as f:
                out.append(os.pread(f.fileno(), n, HEADER_BYTES))
                out.append(os.pread(f.fileno(), n, HEADER_BYTES + len(s) * self.dtype.itemsize - n))
        return b"".join(out)


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META_FILE)
    if not os.path.isfile(path):
        hint = (" (an unfinished preparation: run the same prepare-data command again to complete it)"
                if os.path.isfile(os.path.join(directory, "progress.json")) else "")
        raise ConfigError(f"`data` {directory}: a directory without {META_FILE}{hint}; give a directory written "
                          "by python -m cutp prepare-data, a text file or a .bin")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"`data` {directory}: {META_FILE} is not readable JSON ({e}); prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"`data` {directory}: {META_FILE} is not prepare-data's (no \"format\": \"{FORMAT}\")")
    if meta.get("version") not in READABLE_VERSIONS:
        raise ConfigError(f"`data` {directory}: format version {meta.get('version')!r}, this cutp reads "
                          f"{' and '.join(map(str, READABLE_VERSIONS))}; prepare the data again with this version")
    return meta


def load_split(directory: str, meta: dict, split: str) -> ShardedTokens:
    """The split's shards, memory-mapped and checked against meta.json (count of each shard)."""
    info = meta["splits"][split]
    arrays, paths = [], []
    for shard in info["shards"]:
        path = os.path.join(directory, shard["file"])
        paths.append(path)
        tokens = read_shard(path)
        if len(tokens) != shard["tokens"]:
            raise ConfigError(f"{path} holds {len(tokens):,} tokens, meta.json says {shard['tokens']:,}; "
                              "prepare the data again")
        arrays.append(tokens)
    out = ShardedTokens(arrays, [s["blake2b"] for s in info["shards"]], paths)
    if len(out) != info["tokens"]:
        raise ConfigError(f"`data` {directory}: the {split} shards hold {len(out):,} tokens, meta.json says "
                          f"{info['tokens']:,}; prepare the data again")
    return out


def read_side(path: str, ext: str) -> np.ndarray:
    """A mask (MASK_EXT) or document-length (DOCS_EXT) file beside the shards, memory-mapped."""
    dtype = SIDE_DTYPE[ext]
    size = os.path.getsize(path) if os.path.isfile(path) else -1
    header = None
    if size >= HEADER_BYTES:
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(16), "<i4")
    if header is None or (int(header[0]), int(header[1])) != SIDE_MAGIC[ext] \
            or size != HEADER_BYTES + int(header[2]) * dtype.itemsize:
        raise ConfigError(f"{path} is not a complete {ext} file of prepare-data (header or size wrong); prepare the "
                          "data again with python -m cutp prepare-data")
    count = int(header[2])
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=HEADER_BYTES, shape=(count,))


def load_side(directory: str, meta: dict, split: str, key: str):
    """The split's target masks (key "masks": a ShardedTokens of uint8, aligned with its tokens) or
    document lengths (key "docs": an int64 array); None when the preparation has none."""
    entries = meta["splits"][split].get(key)
    if entries is None:
        return None
    ext = MASK_EXT if key == "masks" else DOCS_EXT
    arrays = [read_side(os.path.join(directory, e["file"]), ext) for e in entries]
    for e, a in zip(entries, arrays):
        if len(a) != e["tokens"]:
            raise ConfigError(f"{os.path.join(directory, e['file'])} holds {len(a):,} entries, meta.json says "
                              f"{e['tokens']:,}; prepare the data again")
    if key == "docs":
        return np.concatenate([np.asarray(a, np.int64) for a in arrays]) if arrays else np.zeros(0, np.int64)
    return ShardedTokens(arrays, [e["blake2b"] for e in entries])
