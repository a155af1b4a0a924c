"""Attention of one block of queries against one block of keys, with the rows' log-sum-exp, and
the merge of such partial results: the pieces of context parallelism's ring attention
(`cutp.tensor_parallel.context_parallel`), which meets every query block with the key blocks
of the other ranks one at a time.

Layout as in :mod:`cutp.ops.attention`: q [B, nkv, g, Tq, hd], k and v [B, nkv, Tk, hd]. A tile
is either "full" (every query sees every key: the keys lie before the queries) or "causal"
(the same positions on both sides, the diagonal block: key j > query i masked).

Forward of a tile: s = scale q k^T (masked), m = max s, l = sum exp(s - m), o = (exp(s - m) / l)
(times the dropout factors) v, lse = m + log l. Two partial results of the same queries merge
exactly (`merge`): lse = log(e^lse1 + e^lse2), o = e^(lse1 - lse) o1 + e^(lse2 - lse) o2, in the
compute dtype (float32 for 16-bit inputs and float32, float64 for float64): with dropout applied
after the normalisation, as the one-rank attention does, the merge of all of a row's tiles is
that row's attention exactly (up to rounding).

Backward of a tile takes the merged o's row dot D = rowsum(do * o) and the merged lse (not the
tile's): P = exp(s - lse) is then the tile's part of the whole row's softmax, and dv = (P F)^T do,
dS = P (F (do v^T) - D), dq = scale dS k, dk = scale dS^T q (F the dropout factors; dk and dv
summed over the g query heads of each KV head): FlashAttention-2's backward, per tile.
"""
from __future__ import annotations

from cutp.runtime.backend import get_array_module

from .common import as_dtype, compute_dtype


def _scores(q, k, scale, causal, xp):
    s = (q @ k[:, :, None].swapaxes(-1, -2)) * scale  # [B, nkv, g, Tq, Tk]
    if causal:
        tq, tk = s.shape[-2], s.shape[-1]
        later = xp.arange(tk)[None, :] > xp.arange(tq)[:, None]
        s = xp.where(later, -xp.inf, s)
    return s


def tile_forward(q, k, v, scale: float, causal: bool, keep=None, keep_scale: float = 1.0):
    """(o, lse) of queries q against keys k, v (module docstring), in the compute dtype; keep:
    the dropout keep-mask [B, nkv, g, Tq, Tk] (None: no dropout), keep_scale 1 / (1 - p)."""
    xp = get_array_module(q, k, v)
    cdt = compute_dtype(q.dtype)
    qc, kc, vc = (as_dtype(a, cdt) for a in (q, k, v))
    s = _scores(qc, kc, scale, causal, xp)
    m = s.max(axis=-1, keepdims=True)
    p = xp.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    p /= total
    if keep is not None:
        p *= keep
        p *= keep_scale
    o = p @ vc[:, :, None]
    return o, (m + xp.log(total))[..., 0]


def merge(o, lse, o_tile, lse_tile):
    """The partial results (o, lse) and (o_tile, lse_tile) of the same queries merged: a new
    (o, lse) (module docstring). o None: the tile's."""
    if o is None:
        return o_tile, lse_tile
    xp = get_array_module(o)
    new = xp.logaddexp(lse, lse_tile)
    return o * xp.exp(lse - new)[..., None] + o_tile * xp.exp(lse_tile - new)[..., None], new


def tile_backward(do, q, k, v, rowdot, lse, scale: float, causal: bool, keep=None, keep_scale: float = 1.0):
    """(dq, dk, dv) of one tile, in the compute dtype: do [B, nkv, g, Tq, hd] the output's
    gradient, rowdot [B, nkv, g, Tq] = rowsum(do * o) and lse [B, nkv, g, Tq] of the merged
    result; dk and dv [B, nkv, Tk, hd] summed over the g query heads."""
    xp = get_array_module(q, k, v)
    cdt = compute_dtype(q.dtype)
    qc, kc, vc, doc = (as_dtype(a, cdt) for a in (q, k, v, do))
    p = xp.exp(_scores(qc, kc, scale, causal, xp) - lse[..., None])  # masked scores: exp(-inf) = 0
    dp = doc @ vc[:, :, None].swapaxes(-1, -2)
    if keep is not None:
        pf = p * keep
        pf *= keep_scale
        dp *= keep
        dp *= keep_scale
    else:
        pf = p
    dv = (pf.swapaxes(-1, -2) @ doc).sum(axis=2)
    ds = p * (dp - rowdot[..., None])
    dq = (ds @ kc[:, :, None]) * scale
    dk = (ds.swapaxes(-1, -2) @ qc).sum(axis=2) * scale
    return dq, dk, dv
