"""Embedding lookup (optionally masked, for the vocab-parallel embedding) and its
scatter-add backward into a dense gradient."""
from __future__ import annotations

import numpy as np

from cutp.runtime.backend import get_array_module, on_host

from .common import as_dtype, compute_dtype, is_low_precision


class EmbeddingCtx:
    """The ids and the optional bool mask (same shape as ids)."""

    __slots__ = ("ids", "mask")

    def __init__(self, ids, mask):
        self.ids = ids
        self.mask = mask


def embedding_forward(ids, table, mask=None):
    """``y[...] = table[ids[...]]``, with rows where ``mask`` is False set to zero.

    Args:
        ids: integer array [...]; every id must be a valid row of ``table`` (the
            vocab-parallel caller clamps out-of-shard ids to a valid row and masks them).
        table: [V, h].
        mask: optional bool array shaped like ``ids``; False rows of ``y`` are exactly 0.

    Returns ``(y, ctx)`` with ``y`` [..., h] in ``table``'s dtype (a gather: no arithmetic);
    ``ctx`` (:class:`EmbeddingCtx`) saves ``ids`` and ``mask``.
    """
    xp = get_array_module(ids, table, mask)
    y = xp.take(table, ids, axis=0)
    if mask is not None:
        if mask.shape != ids.shape:
            raise ValueError(f"embedding mask shape {mask.shape} != ids shape {ids.shape}")
        y[~mask] = 0
    return y, EmbeddingCtx(ids, mask)


def _segment_sums_sorted(g, lens, starts):
    """In place: for rows of ``g`` grouped in consecutive segments (``starts``/``lens``),
    leave each segment's sum in its first row. Pairwise (tree) reduction, fully vectorised:
    step k adds row ``r + 2**k`` into row ``r`` for within-segment ranks r that are
    multiples of ``2**(k+1)``, so it takes ``ceil(log2(max(lens)))`` steps and is as
    accurate as pairwise summation."""
    n = g.shape[0]
    seg_start = np.repeat(starts, lens)
    rank = np.arange(n) - seg_start
    seg_len = np.repeat(lens, lens)
    maxlen = int(lens.max())
    stride = 1
    while stride < maxlen:
        a = np.flatnonzero(((rank & (2 * stride - 1)) == 0) & (rank + stride < seg_len))
        g[a] += g[a + stride]
        stride *= 2


def embedding_backward(dy, ctx: EmbeddingCtx, out):
    """Accumulate the embedding gradient into ``out`` [V, h] in place and return ``out``.

    ``out[ids[k]] += dy[k]`` for every position k with ``mask[k]`` True (all positions when
    there is no mask); repeated ids add up. No [V, h] temporary is allocated: only the rows
    that occur are touched.

    NumPy (measured on 8192 ids, h = 768, V = 50257, float32, one thread: ``np.add.at``
    ~55 ms; sorting + ``np.add.reduceat`` ~45-60 ms, as reduceat walks axis 0 column by
    column; this ~15-28 ms depending on the id distribution): the ids are stably sorted, the
    sorted ``dy`` rows are reduced per id with a vectorised pairwise tree
    (:func:`_segment_sums_sorted`) in the compute dtype (float32 for bfloat16), and each
    distinct id's row of ``out`` is updated once with a fancy-indexed
    add; when all ids are distinct the sort result is used directly. CuPy: ``xp.add.at``
    (atomic adds; the order of the additions, hence the last bits, is not deterministic).
    A bfloat16/float16 ``out`` is updated as on NumPy, once per distinct id from float32 sums
    (``cupy.add.at`` has no bfloat16 atomics: CuPy 14 raises TypeError for it).
    """
    ids, mask = ctx.ids, ctx.mask
    xp = get_array_module(dy, ids, out)
    h = out.shape[1]
    dy2 = dy.reshape(-1, h)
    ids_f = ids.reshape(-1)
    if not on_host(xp):
        if mask is not None:
            sel = xp.flatnonzero(mask.reshape(-1))
            ids_f, dy2 = ids_f[sel], dy2[sel]
        if is_low_precision(out.dtype):  # add in float32, round once (as the NumPy path)
            u, inv = xp.unique(ids_f, return_inverse=True)
            sums = xp.zeros((u.shape[0], h), dtype=np.float32)
            xp.add.at(sums, inv.reshape(-1), as_dtype(dy2, np.float32))
            out[u] = (out[u].astype(np.float32) + sums).astype(out.dtype)
            return out
        xp.add.at(out, ids_f, as_dtype(dy2, out.dtype))
        return out
    cdt = compute_dtype(dy.dtype)
    if mask is not None:
        rows = np.flatnonzero(mask.reshape(-1))
        ids_s = ids_f[rows]
    else:
        rows = None
        ids_s = ids_f
    n = ids_s.shape[0]
    if n == 0:
        return out
    order = np.argsort(ids_s, kind="stable")
    s = ids_s[order]
    new = xp.empty(n, dtype=bool)
    new[0] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    src = order if rows is None else rows[order]
    if starts.shape[0] == n:  # all ids distinct
        u = s
        sums = as_dtype(dy2.take(src, axis=0), cdt)
    else:
        g = dy2.take(src, axis=0)
        if g.dtype != cdt:
            g = g.astype(cdt)
        lens = np.diff(starts, append=n)
        _segment_sums_sorted(g, lens, starts)
        u = s[starts]
        sums = g.take(starts, axis=0)
    if is_low_precision(out.dtype):  # add in float32, round once
        out[u] = (out[u].astype(np.float32) + sums).astype(out.dtype)
    else:  # float32/float64 out: NumPy adds in the wider of the two dtypes
        out[u] += sums
    return out
