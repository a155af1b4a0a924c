"""Causal scaled-dot-product attention with grouped query heads (GQA), forward and backward.

    o = dropout(softmax(scale * q k^T, causal)) @ v

Layout: q [B, nkv, g, Tq, hd] holds the g query heads of each of the nkv KV heads grouped
under it; k and v are [B, nkv, Tk, hd]. A KV head meets its g query heads by broadcasting
(``k[:, :, None]``), never by a copy. Query row i sits at absolute position ``Tk - Tq + i``
(the last Tq positions, as with a KV cache) and attends keys ``0 .. Tk - Tq + i``; training
has ``Tq == Tk``. o and the gradients have q's, k's and v's shapes.

Two implementations of one formula, chosen per call:

* the plain composition, on any array module and with or without attention dropout: whole
  score matrices [B, nkv, g, Tq, Tk] through :func:`softmax_forward` and :func:`dropout_forward`
  (the dropout mask is drawn for the whole probability tensor: on the CPU dropout needs this path);
* the blocked NumPy path, without dropout (see "Blocked NumPy path" below);
* on a GPU with kernels on, the fused kernels (``kernels/attention.cu``, FlashAttention-2):
  CuPy arrays of float32 or bfloat16, head dims 64 or 128 (another head dim: the plain
  composition, with a warning once), attention dropout included (the same masks as the plain
  path, evaluated from the counter hash in the kernels). The context then keeps q, k, v, o and
  the rows' log-sum-exp: O(T) memory, nothing T x T, so selective recomputation has nothing left
  to recompute.

:func:`flash_attention_forward` / :func:`flash_attention_backward` are the fused kernels'
algorithm in array code (tiles, online softmax, log-sum-exp, recomputation in the backward): the
kernels' reference. :func:`causal_attention_reference` is the formula written out in the simplest
way, for tests.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from cutp.kernels import dispatch_views as _attention_kernels
from cutp.kernels.attention import fused_attention_supported, kernel_layout
from cutp.runtime.backend import get_array_module, on_host

from .common import as_dtype, compute_dtype, parallel_map
from .dropout import dropout_backward, dropout_forward_rows, dropout_mask
from .softmax import softmax_backward, softmax_forward

# ---- Blocked NumPy path ------------------------------------------------------------------------
# The attention runs in pieces of (batch rows, KV heads), and each piece in blocks of query rows:
# block [r0, r1) only needs keys [0, Tk - Tq + r1) (causal), so the masked upper part of the score
# matrix is never computed (2 blocks: 3/4 of the work, 4: 5/8), and a block's scores stay in cache
# from the QK^T product through the softmax to the PV product. The pieces run on the ops' thread
# pool (NumPy's batched matmul and ufuncs use one core). Each block is softmax_forward over its
# [r1 - r0, keys = Tk - Tq + r1] scores, whose own causal rule (row i at position
# keys - (r1 - r0) + i = Tk - Tq + r0 + i) is exactly the block's. Measured on 2 cores: tiny (B=16, T=128) and gpt2 (B=4, T=256) attention forward
# 20-25% faster than unblocked pieces. The split depends on the shapes only (never on the thread
# count), and the backward sums a piece's blocks in order, so results are deterministic.
# Read at call time, so tests can shrink them to force many pieces and blocks.
PIECE_ELEMS = 1 << 20  # score elements (full Tq x Tk) per piece
QBLOCK_ELEMS = 1 << 18  # score elements per query block, about


class AttentionCtx:
    """What :func:`causal_attention_backward` needs: q, k, v, and

    * the plain path: the softmax ctx (its probabilities), the dropout ctx, and the
      probabilities after dropout (``probs``; the softmax's own when nothing was dropped);
    * the blocked path: the pieces ((batch rows, KV heads) slice pairs) and, per piece, its
      query blocks as ``(r0, r1, softmax ctx)``;
    * the fused kernels: o, the rows' log-sum-exp ``lse`` [B, nkv, g, Tq] (float32), the scale,
      the dropout's (p, seed, offsets) and the kernels' launchers.
    """

    __slots__ = ("q", "k", "v", "softmax", "dropout", "probs", "pieces", "piece_blocks", "o", "lse", "scale",
                 "kernels", "dropout_args")

    def __init__(self, q, k, v, *, softmax=None, dropout=None, probs=None, pieces=None, piece_blocks=None, o=None,
                 lse=None, scale=None, kernels=None, dropout_args=None):
        self.q, self.k, self.v = q, k, v
        self.softmax, self.dropout, self.probs = softmax, dropout, probs
        self.pieces, self.piece_blocks = pieces, piece_blocks
        self.o, self.lse, self.scale, self.kernels = o, lse, scale, kernels
        self.dropout_args = dropout_args  # the fused path's (dropout_p, seed, offsets)

    @property
    def fused(self) -> bool:
        """Whether the forward ran the fused kernels (the context holds O(T) memory)."""
        return self.lse is not None

    @property
    def blocked(self) -> bool:
        """Whether the forward took the blocked NumPy path."""
        return self.pieces is not None


def _check_shapes(q, k, v):
    if q.ndim != 5 or k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:  # (v's head dim may differ: MLA)
        raise ValueError(f"causal attention needs q [B, nkv, g, Tq, hd] and k, v [B, nkv, Tk, hd]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {q.shape} does not match k, v {k.shape} in batch, KV heads or head size")
    if q.shape[3] > k.shape[2]:
        raise ValueError(f"causal attention needs Tq <= Tk, got Tq={q.shape[3]}, Tk={k.shape[2]}")


def causal_attention_forward(q, k, v, *, scale=None, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                             blocked=None, fused=None):
    """``o = dropout(softmax(scale * q k^T, causal)) @ v`` per query head and its KV head.

    Args:
        q: [B, nkv, g, Tq, hd]; k, v: [B, nkv, Tk, hd] with ``Tq <= Tk`` (any strides: e.g.
            views of a fused QKV projection's output).
        scale: the scores' factor (default ``1 / sqrt(hd)``).
        dropout_p, seed, offset: attention dropout on the probabilities [B, nkv, g, Tq, Tk],
            by ``dropout_forward(probs, dropout_p, seed, offset)``: the caller owns the RNG
            stream and advances it by ``B * nkv * g * Tq * Tk``. ``dropout_p == 0``: none.
            ``offset`` may also be a sequence of B offsets, one per batch row (each row's mask
            drawn at its own place: ``dropout_forward_rows``).
        blocked: ``None`` picks the blocked path for NumPy arrays without dropout, the plain
            one otherwise; ``False`` forces the plain path; ``True`` the blocked one (NumPy,
            no dropout, else ``ValueError``).
        fused: ``None`` runs the fused kernels where they apply (CuPy arrays, kernels on,
            float32/bfloat16, head dim 64 or 128; otherwise a warning once per reason, then the
            other paths); ``False`` never (a ``blocked`` of True or False implies it); ``True``
            requires them (``ValueError`` with the reason).

    Returns ``(o, ctx)``: o [B, nkv, g, Tq, hd] in q's dtype. The blocked path writes o's memory
    token-major, [B, Tq, nkv, g, hd], so merging the heads afterwards,
    ``o.transpose(0, 3, 1, 2, 4).reshape(B, Tq, nkv * g * hd)``, is a view there (a copy after
    the plain path). ``ctx`` (:class:`AttentionCtx`) keeps q, k, v and the probabilities.
    """
    _check_shapes(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if fused and blocked is not None:
        raise ValueError(f"fused=True excludes blocked={blocked}")
    if fused or (fused is None and blocked is None):
        kernels, why = fused_attention_kernels(q, k, v, warn=not fused)
        if kernels is not None:
            drop = (float(dropout_p), seed, offset)
            o, lse = kernels.attention_forward(q, k, v, scale, *drop)
            return o, AttentionCtx(q, k, v, o=o, lse=lse, scale=scale, kernels=kernels, dropout_args=drop)
        if fused:
            raise ValueError(why)
    xp = get_array_module(q, k, v)
    can_block = on_host(xp) and float(dropout_p) == 0.0
    if blocked is None:
        blocked = can_block
    elif blocked and not can_block:
        raise ValueError("the blocked attention needs NumPy arrays and no dropout")
    if blocked:
        return _forward_blocked(q, k, v, scale)
    return _forward_plain(q, k, v, scale, dropout_p, seed, offset)


def causal_attention_backward(do, ctx: AttentionCtx, *, out=None):
    """Gradients ``(dq, dk, dv)`` of the forward that made ``ctx``, for ``do`` shaped like o.

    ``do`` may have any strides (e.g. a view of the output projection's input gradient). dk
    and dv sum the contributions of the g query heads sharing each KV head. ``out``: optional
    ``(dq, dk, dv)`` arrays of q's, k's and v's shapes to write the gradients into, of any
    strides (e.g. views of one packed QKV gradient buffer); they are returned. The blocked path
    then writes each query block straight into them.
    """
    if ctx.fused:
        xp = get_array_module(ctx.q)
        do = as_dtype(do, ctx.q.dtype)
        if not kernel_layout(do):
            do = xp.ascontiguousarray(do)
        direct = out is None or all(kernel_layout(a, output=True) and a.dtype == like.dtype
                                    for a, like in zip(out, (ctx.q, ctx.k, ctx.v)))
        grads = ctx.kernels.attention_backward(do, ctx.q, ctx.k, ctx.v, ctx.o, ctx.lse, ctx.scale,
                                               out if direct else None, *ctx.dropout_args)
        if direct:
            return grads
        for dst, grad in zip(out, grads):  # like the plain path: any strides, any dtype
            dst[...] = grad
        return out
    if ctx.blocked:
        return _backward_blocked(do, ctx, out)
    return _backward_plain(do, ctx, out)


_UNFUSED_WARNED: set = set()


def fused_attention_kernels(q, k, v, warn: bool = True):
    """(the launchers, None) when the fused kernels take q, k, v (CuPy arrays, kernels on,
    `fused_attention_supported`), else (None, why not). On a GPU an unfused attention warns once
    per reason (warn; the one-rank attention's and the ring's tiles alike; the planner's
    shape-only arrays stay quiet)."""
    kernels = _attention_kernels(q, k, v)
    if kernels is None:
        return None, "the fused attention needs CuPy arrays with kernels on"
    why = fused_attention_supported(q, k, v)
    if why is None:
        return kernels, None
    if warn and why not in _UNFUSED_WARNED and not getattr(kernels.xp, "shape_only", False):
        _UNFUSED_WARNED.add(why)
        warnings.warn(f"cutp: {why}; attention runs unfused (its T x T probabilities in memory)", stacklevel=3)
    return None, why


# ---- plain path --------------------------------------------------------------------------------
def _forward_plain(q, k, v, scale, dropout_p, seed, offset):
    cdt = compute_dtype(q.dtype)  # 16-bit inputs: scores, softmax and products in float32
    qc, kc, vc = (as_dtype(a, cdt) for a in (q, k, v))
    scores = qc @ kc[:, :, None].swapaxes(-1, -2)  # [B, nkv, g, Tq, Tk]
    probs, softmax_ctx = softmax_forward(scores, scale=scale, causal=True)
    dropped, dropout_ctx = dropout_forward_rows(probs, dropout_p, seed, _row_offsets(offset, probs.shape))
    o = as_dtype(dropped @ vc[:, :, None], q.dtype)  # [B, nkv, g, Tq, hd]
    return o, AttentionCtx(q, k, v, softmax=softmax_ctx, dropout=dropout_ctx, probs=dropped)


def _backward_plain(do, ctx, out):
    cdt = compute_dtype(ctx.q.dtype)
    q, k, v, do = (as_dtype(a, cdt) for a in (ctx.q, ctx.k, ctx.v, do))
    dv = (ctx.probs.swapaxes(-1, -2) @ do).sum(axis=2)  # [B, nkv, Tk, hd]
    dp = do @ v[:, :, None].swapaxes(-1, -2)  # [B, nkv, g, Tq, Tk]
    dp = dropout_backward(dp, ctx.dropout)
    ds = softmax_backward(dp, ctx.softmax)  # includes the scale
    dq = ds @ k[:, :, None]  # [B, nkv, g, Tq, hd]
    dk = (ds.swapaxes(-1, -2) @ q).sum(axis=2)  # [B, nkv, Tk, hd]
    if out is None:
        return tuple(as_dtype(a, ctx.q.dtype) for a in (dq, dk, dv))
    for dst, grad in zip(out, (dq, dk, dv)):
        dst[...] = grad
    return out


# ---- blocked NumPy path ------------------------------------------------------------------------
def _pieces(B, nkv, g, Tq, Tk):
    """(batch rows, KV heads) slice pairs of about PIECE_ELEMS score elements: whole KV heads of
    several batch rows when a row's heads fit, else groups of heads of one row."""
    per_head = g * Tq * Tk
    target = PIECE_ELEMS
    hc = max(1, min(nkv, target // max(per_head, 1)))
    bc = max(1, target // (nkv * per_head)) if hc == nkv else 1
    return [(slice(b, min(b + bc, B)), slice(h, min(h + hc, nkv)))
            for b in range(0, B, bc) for h in range(0, nkv, hc)]


def _query_blocks(piece_elems, Tq, Tk):
    """Query row ranges [r0, r1) of a piece: for a full causal matrix (Tq == Tk) of 32+ rows,
    about piece_elems / QBLOCK_ELEMS blocks (at least 2) of at least 16 rows but the last; one
    block otherwise (with Tq < Tk every query sees most keys, so there is little to skip)."""
    if Tq != Tk or Tq < 32:
        return [(0, Tq)]
    n = max(2, -(-piece_elems // QBLOCK_ELEMS))
    rows = max(16, -(-Tq // n))
    return [(r, min(r + rows, Tq)) for r in range(0, Tq, rows)]


def _forward_blocked(q, k, v, scale):
    B, nkv, g, Tq, hd = q.shape
    Tk = k.shape[2]
    xp = get_array_module(q)  # NumPy (or the planner's shape-only stand-in of it)
    o_tokens = xp.empty((B, Tq, nkv, g, hd), q.dtype)  # token-major: see causal_attention_forward
    pieces = _pieces(B, nkv, g, Tq, Tk)

    cdt = compute_dtype(q.dtype)  # 16-bit inputs: each piece is multiplied in float32

    def run(piece):
        bs, hs = piece
        qp, kp, vp = (as_dtype(a, cdt) for a in (q[bs, hs], k[bs, hs, None], v[bs, hs, None]))
        blocks = []
        for r0, r1 in _query_blocks(qp.shape[0] * qp.shape[1] * g * Tq * Tk, Tq, Tk):
            keys = Tk - Tq + r1  # the block's last query sees keys [0, keys)
            s = qp[..., r0:r1, :] @ kp[..., :keys, :].swapaxes(-1, -2)  # [b, h, g, r1 - r0, keys]
            p, softmax_ctx = softmax_forward(s, scale=scale, causal=True)
            o_block = p @ vp[..., :keys, :]  # [b, h, g, r1 - r0, hd]
            o_tokens[bs, r0:r1, hs] = o_block.transpose(0, 3, 1, 2, 4)
            blocks.append((r0, r1, softmax_ctx))
        return blocks

    piece_blocks = parallel_map(xp, run, pieces)
    o = o_tokens.transpose(0, 2, 3, 1, 4)  # [B, nkv, g, Tq, hd]
    return o, AttentionCtx(q, k, v, pieces=pieces, piece_blocks=piece_blocks)


def _backward_blocked(do, ctx, out):
    q, k, v = ctx.q, ctx.k, ctx.v
    B, nkv, g, Tq, hd = q.shape
    Tk = k.shape[2]
    xp = get_array_module(q)
    if out is None:
        out = (xp.empty(q.shape, do.dtype), xp.empty(k.shape, do.dtype), xp.empty(v.shape, do.dtype))
    dq_out, dk_out, dv_out = out

    cdt = compute_dtype(q.dtype)

    def run(i):
        bs, hs = ctx.pieces[i]
        qp, kp, vp, dop = (as_dtype(a, cdt) for a in (q[bs, hs], k[bs, hs, None], v[bs, hs, None], do[bs, hs]))
        b, h = qp.shape[:2]
        dk = xp.zeros((b, h, Tk, hd), cdt)
        dv = xp.zeros((b, h, Tk, hd), cdt)
        for r0, r1, softmax_ctx in ctx.piece_blocks[i]:  # in order: dk, dv sum the blocks deterministically
            keys = Tk - Tq + r1
            do_block = dop[..., r0:r1, :]  # [b, h, g, r1 - r0, hd]
            part = softmax_ctx.y.swapaxes(-1, -2) @ do_block  # [b, h, g, keys, hd]
            dv[:, :, :keys] += part[:, :, 0] if g == 1 else part.sum(axis=2)
            ds = softmax_backward(do_block @ vp[..., :keys, :].swapaxes(-1, -2), softmax_ctx)  # incl. the scale
            dq_out[bs, hs, :, r0:r1] = ds @ kp[..., :keys, :]  # [b, h, g, r1 - r0, hd]
            part = ds.swapaxes(-1, -2) @ qp[..., r0:r1, :]  # [b, h, g, keys, hd]
            dk[:, :, :keys] += part[:, :, 0] if g == 1 else part.sum(axis=2)
        dk_out[bs, hs] = dk
        dv_out[bs, hs] = dv

    parallel_map(xp, run, range(len(ctx.pieces)))
    return out


# ---- the fused kernels' algorithm in array code (FlashAttention-2) -------------------------------
FLASH_TILE = 64  # query and key rows per tile (the kernels' forward tile)


def _row_offsets(offset, shape):
    """The dropout counters' start of each batch row of the probabilities (shape [B, ...]):
    ``offset`` itself when it is a sequence of B offsets, else rows that follow each other."""
    if isinstance(offset, (list, tuple)):
        return offset
    return [offset + b * math.prod(shape[1:]) for b in range(shape[0])]


def _dropout_factors(xp, shape, dropout_p, seed, offset):
    """The keep-mask times 1 / (1 - p) of the probabilities [B, nkv, g, Tq, Tk] (the plain path's
    masks, per batch row), or None without dropout. The references' luxury: a T x T array."""
    if not dropout_p:
        return None
    keep_scale = 0.0 if dropout_p == 1.0 else 1.0 / (1.0 - dropout_p)
    return xp.stack([dropout_mask(xp, shape[1:], dropout_p, seed, o) for o in _row_offsets(offset, shape)]) * keep_scale


def flash_attention_forward(q, k, v, scale=None, tile: int = FLASH_TILE, dropout_p: float = 0.0, seed: int = 0,
                            offset=0):
    """``(o, lse)`` by kernels/attention.cu's forward algorithm, on any array module: per query
    tile, the key tiles up to the causal diagonal with an online softmax (running max m, sum l,
    the output rescaled by exp(m_old - m_new)), then o = acc / l and lse = m + log(l) (natural
    log of the scaled scores' sum of exps). No T x T array: tile x tile scores at a time (but the
    dropout mask, when there is one). Dropout as in :func:`causal_attention_forward`, applied to
    the probabilities after the row sum. Shapes as there; o in q's dtype, lse [B, nkv, g, Tq] in
    the compute dtype (float32 for 16-bit inputs)."""
    _check_shapes(q, k, v)
    xp = get_array_module(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cdt = compute_dtype(q.dtype)
    Tq, Tk, off = q.shape[3], k.shape[2], k.shape[2] - q.shape[3]
    drop = _dropout_factors(xp, q.shape[:4] + (Tk,), dropout_p, seed, offset)
    o = xp.empty(q.shape, cdt)
    lse = xp.empty(q.shape[:4], cdt)
    for q0 in range(0, Tq, tile):
        q1 = min(q0 + tile, Tq)
        qt = as_dtype(q[..., q0:q1, :], cdt)
        qpos = xp.arange(off + q0, off + q1)[:, None]
        m = xp.full(qt.shape[:4], -xp.inf, cdt)
        l_sum = xp.zeros(qt.shape[:4], cdt)
        acc = xp.zeros(qt.shape, cdt)
        for k0 in range(0, off + q1, tile):  # key tiles up to the last query's position
            k1 = min(k0 + tile, Tk)
            s = (qt @ as_dtype(k[:, :, None, k0:k1], cdt).swapaxes(-1, -2)) * scale
            s = xp.where(xp.arange(k0, k1)[None, :] > qpos, -xp.inf, s)
            m_new = xp.maximum(m, s.max(axis=-1))
            p = xp.exp(s - m_new[..., None])
            alpha = xp.exp(m - m_new)
            l_sum = l_sum * alpha + p.sum(axis=-1)
            if drop is not None:
                p = p * drop[..., q0:q1, k0:k1]
            acc = acc * alpha[..., None] + p @ as_dtype(v[:, :, None, k0:k1], cdt)
            m = m_new
        o[..., q0:q1, :] = acc / l_sum[..., None]
        lse[..., q0:q1] = m + xp.log(l_sum)
    return as_dtype(o, q.dtype), lse


def flash_attention_backward(do, q, k, v, o, lse, scale=None, tile: int = FLASH_TILE, dropout_p: float = 0.0,
                             seed: int = 0, offset=0):
    """``(dq, dk, dv)`` by kernels/attention.cu's backward algorithm: D = rowsum(do * o); per key
    tile and query tile at or below the diagonal, P = exp(scale q k^T - lse) recomputed,
    dv += P^T do, dS = P (do v^T - D), dq += scale dS k, dk += scale dS^T q (dk, dv summed over
    the g query heads of each KV head); with dropout's factors F (mask / (1 - p)), dv += (P F)^T do
    and dS = P (F do v^T - D). Shapes as in :func:`causal_attention_backward`; results in q's
    dtype."""
    xp = get_array_module(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cdt = compute_dtype(q.dtype)
    Tq, Tk, off = q.shape[3], k.shape[2], k.shape[2] - q.shape[3]
    qc, kc, vc, doc = (as_dtype(a, cdt) for a in (q, k, v, do))
    rowdot = (doc * as_dtype(o, cdt)).sum(axis=-1)  # [B, nkv, g, Tq]
    drop = _dropout_factors(xp, q.shape[:4] + (Tk,), dropout_p, seed, offset)
    dq = xp.zeros(q.shape, cdt)
    dk = xp.zeros(k.shape, cdt)
    dv = xp.zeros(v.shape, cdt)
    for k0 in range(0, Tk, tile):
        k1 = min(k0 + tile, Tk)
        kt, vt = kc[:, :, None, k0:k1], vc[:, :, None, k0:k1]
        first = max(0, k0 - off)  # queries before it see none of these keys
        for q0 in range(first - first % tile, Tq, tile):
            q1 = min(q0 + tile, Tq)
            s = (qc[..., q0:q1, :] @ kt.swapaxes(-1, -2)) * scale
            later = xp.arange(k0, k1)[None, :] > xp.arange(off + q0, off + q1)[:, None]
            p = xp.where(later, 0.0, xp.exp(s - lse[..., q0:q1, None]))
            f = 1.0 if drop is None else drop[..., q0:q1, k0:k1]
            dv[:, :, k0:k1] += ((p * f).swapaxes(-1, -2) @ doc[..., q0:q1, :]).sum(axis=2)
            ds = p * ((doc[..., q0:q1, :] @ vt.swapaxes(-1, -2)) * f - rowdot[..., q0:q1, None])
            dq[..., q0:q1, :] += (ds @ kt) * scale
            dk[:, :, k0:k1] += (ds.swapaxes(-1, -2) @ qc[..., q0:q1, :]).sum(axis=2) * scale
    return tuple(as_dtype(a, q.dtype) for a in (dq, dk, dv))


# ---- reference -----------------------------------------------------------------------------------
def causal_attention_reference(q, k, v, scale=None, dropout_p: float = 0.0, seed: int = 0, offset: int = 0):
    """The forward's formula written out in the simplest way, for tests (float64 friendly): every
    query head against its KV head by einsum, masked scores set to -inf, a max-subtracted softmax,
    and with ``dropout_p`` the probabilities times the keep-mask ``dropout_mask`` draws for them
    under ``(seed, offset)``, over ``1 - dropout_p``. Shapes as in :func:`causal_attention_forward`."""
    xp = get_array_module(q, k, v)
    Tq, Tk = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = xp.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    later_key = xp.arange(Tk)[None, :] > xp.arange(Tq)[:, None] + (Tk - Tq)
    scores = xp.where(later_key, -xp.inf, scores)
    probs = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = probs / probs.sum(axis=-1, keepdims=True)
    if dropout_p:
        probs = probs * _dropout_factors(xp, probs.shape, dropout_p, seed, offset)
    return xp.einsum("bhgqk,bhkd->bhgqd", probs, v)
