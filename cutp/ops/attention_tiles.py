"""Attention of one block of queries against one block of keys, with the rows' log-sum-exp, and
the merge of such partial results: the pieces of context parallelism's ring attention
(`cutp.tensor_parallel.context_parallel`), which meets every query block with the key blocks
of the other ranks one at a time.

Layout as in :mod:`cutp.ops.attention`: q [B, nkv, g, Tq, hd], k and v [B, nkv, Tk, hd]. A tile
has `positions` (q_pos, k_pos): query row i sits at global position q_pos + i, key j at k_pos + j,
and a key after the query is masked. The ring's tiles are "full" (q_pos >= k_pos + Tk: every
query sees every key) or "causal" (q_pos == k_pos, the diagonal block: key j > query i masked).
Every query must see a key (q_pos >= k_pos). The rest of the attention mask rule (cutp.ops.attention):
`window` (a key at s is seen from a query at p only if s > p - window), `documents` (q_docs
[B, Tq], k_docs [B, Tk] int32 ids of the tile's queries and keys: a key is seen only from a
query of its document) and `softcap` (scores softcap * tanh(s / softcap) before the mask); a row
of a tile that sees none of its keys has o = 0 and lse = -inf, which `merge` takes as "nothing".

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

Dropout (`dropout`: None or (p, seed, offsets, T)): probability (h, i, j) of batch row b has
counter offsets[b] + h T^2 + (q_pos + i) T + k_pos + j, the counter the one-rank attention over
the whole T-token sequence gives it (offsets[b]: that of this rank's first head in batch row b).

Two implementations, chosen per call as `causal_attention_forward` chooses: on a GPU with kernels
on, CuPy arrays of float32 or bfloat16 and head dim 64 or 128, the fused kernels
(kernels/attention.cu: the tile's positions are their diagonal shift, the dropout counters their
global strides; o, dq, dk, dv come out in float32, the gradients added straight into the ring's
float32 accumulators): nothing Tq x Tk in memory. Otherwise (the CPU, float64, other head dims)
the array code below, which holds the tile's scores.
"""
from __future__ import annotations

import numpy as np

from cutp.kernels.attention import kernel_layout
from cutp.runtime.backend import get_array_module

from .attention import fused_attention_kernels
from .common import as_dtype, compute_dtype
from .dropout import dropout_mask_at


def _kernel_dropout(dropout):
    """The launchers' dropout arguments ((p, seed, offsets), drop_strides) of a tile's dropout."""
    if dropout is None or not dropout[0]:
        return (0.0, 0, 0), None
    p, seed, offsets, T = dropout
    return (float(p), seed, [int(o) for o in offsets]), (T * T, T)


def _scores(q, k, scale, positions, xp, window=None, softcap=None, documents=None):
    """(the tile's scaled, capped, masked scores [B, nkv, g, Tq, Tk], the cap's derivative
    1 - tanh^2 or 1)."""
    s = (q @ k[:, :, None].swapaxes(-1, -2)) * scale  # [B, nkv, g, Tq, Tk]
    dcap = 1.0
    if softcap is not None:
        t = xp.tanh(s / softcap)
        s, dcap = softcap * t, 1.0 - t * t
    (q_pos, k_pos), (tq, tk) = positions, s.shape[-2:]
    key, query = (k_pos + xp.arange(tk))[None, :], (q_pos + xp.arange(tq))[:, None]
    if k_pos + tk - 1 > q_pos:  # some key after some query
        s = xp.where(key > query, -xp.inf, s)
    if window is not None and k_pos <= q_pos + tq - 1 - window:  # some key before some query's window
        s = xp.where(key <= query - window, -xp.inf, s)
    if documents is not None:
        q_docs, k_docs = (xp.asarray(d) for d in documents)
        s = xp.where(q_docs[:, None, None, :, None] != k_docs[:, None, None, None, :], -xp.inf, s)
    return s, dcap


def _keep(xp, dropout, positions, shape):
    """(keep-mask, 1 / (1 - p)) of the tile's probabilities [B, nkv, g, Tq, Tk] at their global
    (head, query, key) places (module docstring); (None, 1) without dropout."""
    if dropout is None or not dropout[0]:
        return None, 1.0
    p, seed, offsets, T = dropout
    B, nkv, g, tq, tk = shape
    q_pos, k_pos = positions
    u = np.uint64
    counters = (xp.asarray(np.asarray(offsets, dtype=u)).reshape(B, 1, 1, 1, 1)
                + (xp.arange(nkv * g, dtype=u) * u(T * T)).reshape(1, nkv, g, 1, 1)
                + (xp.arange(q_pos, q_pos + tq, dtype=u) * u(T)).reshape(tq, 1)
                + xp.arange(k_pos, k_pos + tk, dtype=u))
    return dropout_mask_at(xp, counters, p, seed), (0.0 if p == 1.0 else 1.0 / (1.0 - p))


def _check_positions(positions, tq):
    if tq and positions[0] < positions[1]:
        raise ValueError(f"a tile's query row 0 at position {positions[0]} sees none of the keys from position "
                         f"{positions[1]}: every query needs a visible key (q_pos >= k_pos)")


def _fused_mask(kernels, window, softcap, documents) -> dict:
    docs = None if documents is None else tuple(kernels.xp.ascontiguousarray(d, dtype=np.int32) for d in documents)
    return dict(window=window, softcap=softcap, documents=docs)


def tile_forward(q, k, v, scale: float, positions, dropout=None, *, window=None, softcap=None, documents=None):
    """(o, lse) of queries q against keys k, v at `positions` (q_pos, k_pos), in the compute
    dtype; dropout: None or (p, seed, offsets, T); window, softcap, documents: the mask (module
    docstring)."""
    _check_positions(positions, q.shape[3])
    kernels, _ = fused_attention_kernels(q, k, v)
    if kernels is not None:
        drop, strides = _kernel_dropout(dropout)
        return kernels.attention_forward(q, k, v, scale, *drop, q_first=positions[0], k_first=positions[1],
                                         drop_strides=strides, out_dtype=np.float32,
                                         **_fused_mask(kernels, window, softcap, documents))
    xp = get_array_module(q, k, v)
    cdt = compute_dtype(q.dtype)
    qc, kc, vc = (as_dtype(a, cdt) for a in (q, k, v))
    s, _ = _scores(qc, kc, scale, positions, xp, window, softcap, documents)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(m == -xp.inf, 0.0, m)  # a row that sees none of the tile's keys: p = 0
    p = xp.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    seen = total > 0
    p /= xp.where(seen, total, 1.0)
    keep, keep_scale = _keep(xp, dropout, positions, s.shape)
    if keep is not None:
        p *= keep
        p *= keep_scale
    o = p @ vc[:, :, None]
    return o, xp.where(seen, m + xp.log(xp.where(seen, total, 1.0)), -xp.inf)[..., 0]


def merge(o, lse, o_tile, lse_tile):
    """The partial results (o, lse) and (o_tile, lse_tile) of the same queries merged: a new
    (o, lse) (module docstring). o None: the tile's."""
    if o is None:
        return o_tile, lse_tile
    xp = get_array_module(o)
    new = xp.logaddexp(lse, lse_tile)
    ref = xp.where(new == -xp.inf, 0.0, new)  # rows neither part sees a key of: o = 0, lse = -inf
    return o * xp.exp(lse - ref)[..., None] + o_tile * xp.exp(lse_tile - ref)[..., None], new


def tile_backward(do, q, k, v, rowdot, lse, scale: float, positions, dropout=None, out=None, *, window=None,
                  softcap=None, documents=None):
    """(dq, dk, dv) of one tile, in the compute dtype: do [B, nkv, g, Tq, hd] the output's
    gradient (any dtype and strides), rowdot [B, nkv, g, Tq] = rowsum(do * o) and lse
    [B, nkv, g, Tq] of the merged result (compute dtype); dk and dv [B, nkv, Tk, hd] summed over
    the g query heads. out: optional (dq, dk, dv) arrays (compute dtype, any strides) the
    gradients are added to, and returned. window, softcap, documents: the forward's mask."""
    _check_positions(positions, q.shape[3])
    kernels, _ = fused_attention_kernels(q, k, v)
    if kernels is not None:
        xp = kernels.xp
        do = as_dtype(do, q.dtype)
        if not kernel_layout(do):
            do = xp.ascontiguousarray(do)
        drop, strides = _kernel_dropout(dropout)
        args = dict(rowdot=xp.ascontiguousarray(rowdot), q_first=positions[0], k_first=positions[1],
                    drop_strides=strides, **_fused_mask(kernels, window, softcap, documents))
        lse = xp.ascontiguousarray(lse)
        if out is not None and all(kernel_layout(a, output=True) and a.dtype == np.float32 for a in out):
            return kernels.attention_backward(do, q, k, v, None, lse, scale, out, *drop, accumulate=True, **args)
        grads = tuple(xp.empty(a.shape, np.float32) for a in (q, k, v))
        grads = kernels.attention_backward(do, q, k, v, None, lse, scale, grads, *drop, **args)
    else:
        grads = _tile_backward_array(do, q, k, v, rowdot, lse, scale, positions, dropout, window, softcap, documents)
    if out is None:
        return grads
    for dst, grad in zip(out, grads):
        dst += grad
    return out


def _tile_backward_array(do, q, k, v, rowdot, lse, scale, positions, dropout, window=None, softcap=None,
                         documents=None):
    xp = get_array_module(q, k, v)
    cdt = compute_dtype(q.dtype)
    qc, kc, vc, doc = (as_dtype(a, cdt) for a in (q, k, v, do))
    s, dcap = _scores(qc, kc, scale, positions, xp, window, softcap, documents)
    p = xp.exp(s - xp.where(lse == -xp.inf, 0.0, lse)[..., None])  # masked scores: exp(-inf) = 0
    dp = doc @ vc[:, :, None].swapaxes(-1, -2)
    keep, keep_scale = _keep(xp, dropout, positions, p.shape)
    if keep is not None:
        pf = p * keep
        pf *= keep_scale
        dp *= keep
        dp *= keep_scale
    else:
        pf = p
    dv = (pf.swapaxes(-1, -2) @ doc).sum(axis=2)
    ds = p * (dp - rowdot[..., None]) * dcap
    dq = (ds @ kc[:, :, None]) * scale
    dk = (ds.swapaxes(-1, -2) @ qc).sum(axis=2) * scale
    return dq, dk, dv
