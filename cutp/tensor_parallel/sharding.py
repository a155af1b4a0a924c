"""Which slice of a full tensor each TP rank holds, and how to cut and reassemble it.

Every sharded parameter is described by a `Sharding`: an axis and, for each TP rank, the
indices along that axis (into the full, unsharded tensor) that the rank holds, in the order
the rank stores them. That one description covers contiguous column/row splits, the vocabulary
split, and the attention QKV projection, whose shard is this rank's heads' Q, K and V columns
(not a contiguous third of a fused [q|k|v] matrix), with KV heads replicated under GQA when
TP > n_kv_head, and the SwiGLU MLP's fused [gate | up] projection, whose shard is this rank's
gate columns then its up columns ([gate_r ; up_r], never a slice of [gate ; up]: Megatron-LM
#360). Initialisation, gathering, checkpoints and resharding all go through it, so TP=1 and
TP=N always hold the same model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.backend import get_array_module
from ..runtime.errors import ConfigError


@dataclass(frozen=True, eq=False)  # identity equality: the index arrays do not compare as a bool
class Sharding:
    axis: int
    full_shape: tuple
    # indices[r] = positions along `axis` of the full tensor held by TP rank r, in storage order
    indices: tuple
    # how the indices were made (JSON-able), so a checkpoint can rebuild them at its TP size
    spec: dict | None = None

    @property
    def tp(self) -> int:
        return len(self.indices)

    def shard_shape(self, rank: int) -> tuple:
        s = list(self.full_shape)
        s[self.axis] = len(self.indices[rank])
        return tuple(s)

    def owned_mask(self, rank: int) -> np.ndarray:
        """True where this rank is the lowest rank holding that full index (count it once)."""
        mine = np.asarray(self.indices[rank])
        if rank == 0:
            return np.ones(len(mine), bool)
        return ~np.isin(mine, np.concatenate(self.indices[:rank]))


def contiguous(full_shape, axis: int, tp: int) -> Sharding:
    n = full_shape[axis]
    if n % tp:
        fits = [d for d in range(1, min(n, 64) + 1) if n % d == 0]  # bounded: n may come from a file
        raise ConfigError(f"cannot split a dimension of {n} evenly over tp={tp}; use a tp in {fits} "
                          f"or make the dimension a multiple of {tp}")
    k = n // tp
    return Sharding(axis, tuple(full_shape), tuple(np.arange(r * k, (r + 1) * k) for r in range(tp)),
                    {"kind": "contiguous", "axis": axis, "tp": tp})


def kv_heads_of_rank(n_head: int, n_kv_head: int, tp: int, rank: int) -> range:
    """The KV heads TP rank `rank` needs: its own share, or the one its query heads use."""
    if tp <= n_kv_head:
        k = n_kv_head // tp
        return range(rank * k, (rank + 1) * k)
    return range(rank // (tp // n_kv_head), rank // (tp // n_kv_head) + 1)


def qkv_columns(n_head: int, n_kv_head: int, head_dim: int, tp: int) -> tuple:
    """Column indices of each rank's QKV shard in the full [q | k | v] projection.

    Full layout: columns [0, n_head*hd) are Q (head-major), then n_kv_head*hd of K, then of V,
    as in GPT-2's c_attn, cutp's attn.qkv (where n_kv_head == n_head). Rank r's shard is [q_r | k_r | v_r].
    """
    q_per = n_head // tp
    k_off = n_head * head_dim
    v_off = k_off + n_kv_head * head_dim
    out = []
    for r in range(tp):
        q = np.arange(r * q_per * head_dim, (r + 1) * q_per * head_dim)
        kv = kv_heads_of_rank(n_head, n_kv_head, tp, r)
        kcols = np.concatenate([np.arange(h * head_dim, (h + 1) * head_dim) for h in kv])
        out.append(np.concatenate([q, k_off + kcols, v_off + kcols]))
    return tuple(out)


def qkv_sharding(full_shape, axis, n_head, n_kv_head, head_dim, tp) -> Sharding:
    return Sharding(axis, tuple(full_shape), qkv_columns(n_head, n_kv_head, head_dim, tp),
                    {"kind": "qkv", "axis": axis, "n_head": n_head, "n_kv_head": n_kv_head, "head_dim": head_dim,
                     "tp": tp})


def gate_up_columns(width: int, tp: int) -> tuple:
    """Column indices of each rank's shard of a fused [gate | up] projection of 2 * width columns
    (gate [0, width), up [width, 2 width)): rank r holds gate_r then up_r, each width / tp wide."""
    if width % tp:
        raise ConfigError(f"tp={tp} does not divide the SwiGLU MLP width {width}; use a width that is a multiple "
                          f"of {tp}")
    k = width // tp
    return tuple(np.concatenate([np.arange(r * k, (r + 1) * k), width + np.arange(r * k, (r + 1) * k)])
                 for r in range(tp))


def gate_up_sharding(full_shape, axis: int, tp: int) -> Sharding:
    return Sharding(axis, tuple(full_shape), gate_up_columns(full_shape[axis] // 2, tp),
                    {"kind": "gate_up", "axis": axis, "tp": tp})


def part_sharding(base: Sharding, start: int, stop: int, rows: int) -> Sharding:
    """The sharding of a [rows, stop - start] matrix whose columns are the base's output columns
    [start, stop) (a LoRA B of one projection of a fused qkv or gate_up linear): each rank holds
    those of its base columns, in the base's order."""
    indices = tuple(np.asarray(i)[(np.asarray(i) >= start) & (np.asarray(i) < stop)] - start for i in base.indices)
    spec = {"kind": "part", "axis": 1, "tp": base.tp, "of": base.spec, "base_shape": list(base.full_shape), "start": int(start),
            "stop": int(stop)}
    return Sharding(1, (rows, stop - start), indices, spec)


def sharding_from_spec(spec: dict | None, full_shape) -> Sharding | None:
    """Rebuilds a Sharding from its spec (as stored in a checkpoint's metadata)."""
    if spec is None:
        return None
    kind = spec.get("kind")
    if kind == "contiguous":
        return contiguous(tuple(full_shape), int(spec["axis"]), int(spec["tp"]))
    if kind == "qkv":
        return qkv_sharding(tuple(full_shape), int(spec["axis"]), int(spec["n_head"]), int(spec["n_kv_head"]),
                            int(spec["head_dim"]), int(spec["tp"]))
    if kind == "gate_up":
        return gate_up_sharding(tuple(full_shape), int(spec["axis"]), int(spec["tp"]))
    if kind == "part":
        base = sharding_from_spec(spec["of"], tuple(spec["base_shape"]))
        return part_sharding(base, int(spec["start"]), int(spec["stop"]), int(full_shape[0]))
    raise ValueError(f"unknown sharding kind {kind!r}")


def assemble_full(shards: list, sharding: Sharding | None):
    """The full host array from every rank's shard (list in rank order). No communication."""
    if sharding is None:
        return shards[0]
    first = np.moveaxis(shards[0], sharding.axis, 0)
    full = np.zeros((sharding.full_shape[sharding.axis],) + first.shape[1:], first.dtype)
    for idx, shard in zip(sharding.indices, shards):
        full[idx] = np.moveaxis(shard, sharding.axis, 0)
    return np.moveaxis(full, 0, sharding.axis)


def pad_vocab(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary padded to a multiple of multiple*tp (Megatron's make-vocab-size-divisible-by)."""
    step = max(1, multiple) * tp
    return -(-vocab_size // step) * step


def pad_rows(a, rows: int):
    """`a` with zero rows appended up to `rows` (vocabulary padding)."""
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.zeros((rows - a.shape[0],) + a.shape[1:], a.dtype)])


def take_shard(full, sharding: Sharding | None, rank: int):
    """This rank's shard of a full (host) array; the array itself when replicated."""
    if sharding is None:
        return full
    return np.take(full, sharding.indices[rank], axis=sharding.axis)


def gather_full(comm, shard, sharding: Sharding | None):
    """Reassembles the full tensor on every rank of the TP group `comm` (a collective)."""
    if sharding is None:
        return shard
    xp = get_array_module(shard)
    moved = xp.ascontiguousarray(xp.moveaxis(shard, sharding.axis, 0))
    gathered = comm.all_gather(moved)  # [tp * len, ...] in rank order
    n = moved.shape[0]
    full_moved = xp.zeros((sharding.full_shape[sharding.axis],) + moved.shape[1:], shard.dtype)
    for r, idx in enumerate(sharding.indices):
        full_moved[xp.asarray(idx)] = gathered[r * n:(r + 1) * n]
    return xp.moveaxis(full_moved, 0, sharding.axis)
