"""Causal scaled-dot-product attention with grouped query heads (GQA), forward and backward.

    o = dropout(softmax(scale * q k^T, causal)) @ v

Layout: q [B, nkv, g, Tq, hd] holds the g query heads of each of the nkv KV heads grouped
under it; k and v are [B, nkv, Tk, hd]. A KV head meets its g query heads by broadcasting
(``k[:, :, None]``), never by a copy. Query row i sits at absolute position ``Tk - Tq + i``
(the last Tq positions, as with a KV cache) and attends keys ``0 .. Tk - Tq + i``; training
has ``Tq == Tk``. o and the gradients have q's, k's and v's shapes.

The whole mask rule (:class:`AttentionMask`, the same on every path: the ring's tiles, the KV
cache, the fused kernels): query row i sits at global index ``p = q_first + i`` and key j at
``s = k_first + j`` (defaults ``Tk - Tq`` and 0: the rule above); the key is visible iff
``s <= p``, and with ``window`` ``s > p - window`` (transformers' sliding window), and with
``documents = (q_docs [B, Tq], k_docs [B, Tk])`` both carry the same document id (packed
sequences). ``softcap``: the scores are ``softcap * tanh(scale * q.k / softcap)`` before the mask
and the softmax (Gemma 2's order). A query row that sees no key outputs zeros.

Two implementations of one formula, chosen per call:

* the plain composition, on any array module and with or without attention dropout: whole
  score matrices [B, nkv, g, Tq, Tk] through :func:`softmax_forward` and :func:`dropout_forward`
  (the dropout mask is drawn for the whole probability tensor: on the CPU dropout needs this path);
* the blocked NumPy path, without dropout (see "Blocked NumPy path" below);
* on a GPU with kernels on, the fused kernels (``kernels/attention.cu``, FlashAttention-2):
  CuPy arrays of float32 or bfloat16, head dims 64 or 128, or MLA's q/k 192 and v 128
  (another head dim: the plain composition, with a warning once), attention dropout included (the same masks as the plain
  path, evaluated from the counter hash in the kernels). The context then keeps q, k, v, o and
  the rows' log-sum-exp: O(T) memory, nothing T x T, so selective recomputation has nothing left
  to recompute.

:func:`flash_attention_forward` / :func:`flash_attention_backward` are the fused kernels'
algorithm in array code (tiles, online softmax, log-sum-exp, recomputation in the backward): the
kernels' reference. :func:`causal_attention_reference` is the formula written out in the simplest
way, for tests.

(It runs over 500 lines on purpose: the op's paths, the mask rule they share and the fused
kernels' array mirrors stay side by side, so that one reading checks they compute one formula.)
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from cutp.kernels import dispatch_views as _attention_kernels
from cutp.kernels.attention import fused_attention_supported, kernel_layout
from cutp.runtime.backend import get_array_module, on_host

from . import compiled
from .common import as_dtype, compute_dtype, parallel_map
from .dropout import dropout_backward, dropout_forward_rows, dropout_mask
from .softmax import SoftmaxCtx, softmax_backward, softmax_forward

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
      with soft-capping, ``tanh`` (the capped scores over the cap);
    * the blocked path: the pieces ((batch rows, KV heads) slice pairs) and, per piece, its
      query blocks as ``(r0, r1, lo, hi, softmax ctx, tanh)`` (keys [lo, hi); softmax ctx None:
      the block sees no key);
    * ``rule``: None (the plain causal rule) or (:class:`AttentionMask`, softcap);
    * the fused kernels: o, the rows' log-sum-exp ``lse`` [B, nkv, g, Tq] (float32), the scale,
      the dropout's (p, seed, offsets), the mask's keywords and the kernels' launchers.
    """

    __slots__ = ("q", "k", "v", "softmax", "dropout", "probs", "pieces", "piece_blocks", "o", "lse", "scale",
                 "kernels", "dropout_args", "rule", "tanh", "fused_mask", "packed")

    def __init__(self, q, k, v, *, softmax=None, dropout=None, probs=None, pieces=None, piece_blocks=None, o=None,
                 lse=None, scale=None, kernels=None, dropout_args=None, rule=None, tanh=None, fused_mask=None,
                 packed=None):
        self.q, self.k, self.v = q, k, v
        self.packed = packed  # the compiled path's probabilities (packed causal rows)
        self.rule, self.tanh = rule, tanh
        self.softmax, self.dropout, self.probs = softmax, dropout, probs
        self.pieces, self.piece_blocks = pieces, piece_blocks
        self.o, self.lse, self.scale, self.kernels = o, lse, scale, kernels
        self.dropout_args = dropout_args  # the fused path's (dropout_p, seed, offsets)
        self.fused_mask = fused_mask  # and its mask keywords (window, softcap, q_first, k_first, documents)

    @property
    def fused(self) -> bool:
        """Whether the forward ran the fused kernels (the context holds O(T) memory)."""
        return self.lse is not None

    @property
    def compiled(self) -> bool:
        """Whether the forward ran the compiled CPU kernels (kernels/cpu/attention.c)."""
        return self.packed is not None

    @property
    def blocked(self) -> bool:
        """Whether the forward took the blocked NumPy path."""
        return self.pieces is not None


class AttentionMask:
    """Contract 1's mask of one call (module docstring): query row i at global index
    ``q_first + i``, key j at ``k_first + j``; ``window`` None or >= 1; ``documents`` None or
    ``(q_docs [B, Tq], k_docs [B, Tk])`` of integer document ids."""

    __slots__ = ("q_first", "k_first", "window", "documents")

    def __init__(self, Tq: int, Tk: int, q_first=None, k_first=None, window=None, documents=None):
        self.k_first = 0 if k_first is None else int(k_first)
        self.q_first = Tk - Tq + self.k_first if q_first is None else int(q_first)
        if window is not None and not (int(window) == window and window >= 1):
            raise ValueError(f"the attention window must be an integer >= 1 or None, got {window!r}")
        self.window = None if window is None else int(window)
        self.documents = documents

    def causal_only(self, Tq: int, Tk: int) -> bool:
        """Whether this is the plain rule (query row i sees keys 0 .. Tk - Tq + i) and nothing else."""
        return self.window is None and self.documents is None and self.q_first - self.k_first == Tk - Tq

    def key_range(self, r0: int, r1: int, Tk: int, batch=slice(None)) -> tuple[int, int]:
        """Keys [lo, hi) that query rows [r0, r1) (of batch rows `batch`) may see by their
        positions and, for host arrays of documents, their documents (lo >= hi: none)."""
        shift = self.q_first - self.k_first  # query row i's own index among the keys
        hi = min(Tk, shift + r1)
        lo = 0 if self.window is None else max(0, shift + r0 - self.window + 1)
        if self.documents is not None and isinstance(self.documents[1], np.ndarray) and r1 > r0:
            q_docs, k_docs = self.documents[0][batch], self.documents[1][batch]
            # ids are non-decreasing: no row's queries see a key before its first row's document
            lo = max(lo, min(int(np.searchsorted(kd, qd[r0])) for qd, kd in zip(q_docs, k_docs)))
        return lo, hi

    def hidden(self, xp, rows: tuple[int, int], keys: tuple[int, int], batch=slice(None)):
        """Bool [b or 1, 1, 1, r1 - r0, k1 - k0]: True where key j of keys [k0, k1) is hidden from
        query row i of rows [r0, r1) (of batch rows `batch` where documents are given)."""
        (r0, r1), (k0, k1) = rows, keys
        p = xp.arange(self.q_first + r0, self.q_first + r1).reshape(-1, 1)
        s = xp.arange(self.k_first + k0, self.k_first + k1).reshape(1, -1)
        h = s > p
        if self.window is not None:
            h = h | (s <= p - self.window)
        h = h.reshape((1, 1, 1) + h.shape)
        if self.documents is not None:
            q_docs, k_docs = self.documents
            other = q_docs[batch, r0:r1, None] != k_docs[batch, None, k0:k1]  # [b, rows, keys]
            h = h | other[:, None, None]
        return h


# masked scores before the softmax: exp(NEG * scale - max) is exactly 0 beside any visible score,
# and a row with none stays finite (its probabilities are then zeroed)
NEG = -1e30


def _check_shapes(q, k, v):
    if q.ndim != 5 or k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:  # (v's head dim may differ: MLA)
        raise ValueError(f"causal attention needs q [B, nkv, g, Tq, hd] and k, v [B, nkv, Tk, hd]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {q.shape} does not match k, v {k.shape} in batch, KV heads or head size")
    if q.shape[3] > k.shape[2]:
        raise ValueError(f"causal attention needs Tq <= Tk, got Tq={q.shape[3]}, Tk={k.shape[2]}")


def causal_attention_forward(q, k, v, *, scale=None, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                             blocked=None, fused=None, window=None, softcap=None, q_first=None, k_first=None,
                             documents=None):
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
        blocked: ``None`` picks the blocked path for NumPy arrays without dropout (and v's
            head dim q's), the plain one otherwise; ``False`` forces the plain path; ``True``
            the blocked one (NumPy, no dropout, one head dim, else ``ValueError``).
        fused: ``None`` runs the fused kernels where they apply (CuPy arrays, kernels on,
            float32/bfloat16, head dims 64 or 128, or q/k 192 with v 128 (MLA); otherwise a
            warning once per reason, then the
            other paths); ``False`` never (a ``blocked`` of True or False implies it); ``True``
            requires them (``ValueError`` with the reason).
        window, softcap, q_first, k_first, documents: the mask rule and the soft-capping of the
            module docstring (:class:`AttentionMask`); defaults: the plain causal rule, no cap.

    Returns ``(o, ctx)``: o [B, nkv, g, Tq, hd of v] in q's dtype. The blocked path writes o's memory
    token-major, [B, Tq, nkv, g, hd], so merging the heads afterwards,
    ``o.transpose(0, 3, 1, 2, 4).reshape(B, Tq, nkv * g * hd)``, is a view there (a copy after
    the plain path). ``ctx`` (:class:`AttentionCtx`) keeps q, k, v and the probabilities.
    """
    _check_shapes(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if fused and blocked is not None:
        raise ValueError(f"fused=True excludes blocked={blocked}")
    Tq, Tk = q.shape[3], k.shape[2]
    mask = AttentionMask(Tq, Tk, q_first, k_first, window, documents)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"the attention softcap must be a positive number or None, got {softcap!r}")
    plain_rule = softcap is None and mask.causal_only(Tq, Tk)
    if fused or (fused is None and blocked is None):
        kernels, why = fused_attention_kernels(q, k, v, warn=not fused)
        if kernels is not None:
            drop = (float(dropout_p), seed, offset)
            mask = _fused_mask(kernels.xp, window, softcap, q_first, k_first, documents)
            o, lse = kernels.attention_forward(q, k, v, scale, *drop, **mask)
            return o, AttentionCtx(q, k, v, o=o, lse=lse, scale=scale, kernels=kernels, dropout_args=drop,
                                   fused_mask=mask)
        if fused:
            raise ValueError(why)
    xp = get_array_module(q, k, v)
    can_block = on_host(xp) and float(dropout_p) == 0.0 and v.shape[-1] == q.shape[-1]  # (MLA's v: plain)
    blocked_default = blocked is None
    if blocked is None:
        blocked = can_block
    elif blocked and not can_block:
        raise ValueError("the blocked attention needs NumPy arrays and no dropout (and v's head dim equal to q's)")
    rule = None if plain_rule else (mask, softcap)
    if blocked and plain_rule and blocked_default and _compiled_library(q, k, v) is not None:
        return _forward_compiled(q, k, v, scale)
    if blocked:
        return _forward_blocked(q, k, v, scale, rule)
    return _forward_plain(q, k, v, scale, dropout_p, seed, offset, rule)


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
                                               out if direct else None, *ctx.dropout_args, **ctx.fused_mask)
        if direct:
            return grads
        for dst, grad in zip(out, grads):  # like the plain path: any strides, any dtype
            dst[...] = grad
        return out
    if ctx.compiled:
        return _backward_compiled(do, ctx, out)
    if ctx.blocked:
        return _backward_blocked(do, ctx, out)
    return _backward_plain(do, ctx, out)


_UNFUSED_WARNED: set = set()


def _fused_mask(xp, window, softcap, q_first, k_first, documents) -> dict:
    """The fused launchers' mask keywords (contract 1's rule; kernels/attention.py): documents as
    contiguous int32 arrays of the kernels' array module."""
    if documents is not None:
        documents = tuple(xp.ascontiguousarray(xp.asarray(d), dtype=np.int32) for d in documents)
    return dict(window=window, softcap=softcap, q_first=q_first, k_first=k_first, documents=documents)


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
def _masked_softmax(s, scale, rule, hidden):
    """``(probs, softmax ctx, tanh)`` of raw scores s (compute dtype) under rule = (mask, softcap):
    soft-capped (tanh kept for the backward), hidden keys NEG, rows that see nothing zeroed."""
    xp = get_array_module(s)
    _, softcap = rule
    t = None
    if softcap is not None:
        t = xp.tanh(s * (scale / softcap))
        s, scale = t * softcap, 1.0
    p, _ = softmax_forward(xp.where(hidden, NEG, s), scale=scale)
    p = xp.where(hidden, 0.0, p).astype(p.dtype, copy=False)
    return p, SoftmaxCtx(p, scale), t


def _scores_grad(dp, softmax_ctx, t, scale):
    """The raw scores' gradient from the probabilities' (softmax, then the soft-cap's tanh')."""
    ds = softmax_backward(dp, softmax_ctx)  # includes the softmax's scale (1 under a soft-cap)
    if t is not None:
        ds *= (1.0 - t * t) * scale
    return ds


def _forward_plain(q, k, v, scale, dropout_p, seed, offset, rule=None):
    cdt = compute_dtype(q.dtype)  # 16-bit inputs: scores, softmax and products in float32
    qc, kc, vc = (as_dtype(a, cdt) for a in (q, k, v))
    scores = qc @ kc[:, :, None].swapaxes(-1, -2)  # [B, nkv, g, Tq, Tk]
    t = None
    if rule is None:
        probs, softmax_ctx = softmax_forward(scores, scale=scale, causal=True)
    else:
        xp = get_array_module(scores)
        hidden = rule[0].hidden(xp, (0, scores.shape[-2]), (0, scores.shape[-1]))
        probs, softmax_ctx, t = _masked_softmax(scores, scale, rule, hidden)
    dropped, dropout_ctx = dropout_forward_rows(probs, dropout_p, seed, _row_offsets(offset, probs.shape))
    o = as_dtype(dropped @ vc[:, :, None], q.dtype)  # [B, nkv, g, Tq, hd]
    return o, AttentionCtx(q, k, v, softmax=softmax_ctx, dropout=dropout_ctx, probs=dropped, scale=scale, rule=rule,
                           tanh=t)


def _backward_plain(do, ctx, out):
    cdt = compute_dtype(ctx.q.dtype)
    q, k, v, do = (as_dtype(a, cdt) for a in (ctx.q, ctx.k, ctx.v, do))
    dv = (ctx.probs.swapaxes(-1, -2) @ do).sum(axis=2)  # [B, nkv, Tk, hd]
    dp = do @ v[:, :, None].swapaxes(-1, -2)  # [B, nkv, g, Tq, Tk]
    dp = dropout_backward(dp, ctx.dropout)
    ds = _scores_grad(dp, ctx.softmax, ctx.tanh, ctx.scale)  # includes the scale
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


def _folds_scale(xp, scale, rule) -> bool:
    """Whether the blocked path folds the (power-of-two) scale into q and k instead of passing
    over the scores with it (see _forward_blocked)."""
    return xp is np and math.frexp(scale)[0] == 0.5 and rule is None


def _forward_blocked(q, k, v, scale, rule=None):
    B, nkv, g, Tq, hd = q.shape
    Tk = k.shape[2]
    xp = get_array_module(q)  # NumPy (or the planner's shape-only stand-in of it)
    o_tokens = xp.empty((B, Tq, nkv, g, hd), q.dtype)  # token-major: see causal_attention_forward
    pieces = _pieces(B, nkv, g, Tq, Tk)
    mask = AttentionMask(Tq, Tk) if rule is None else rule[0]

    cdt = compute_dtype(q.dtype)  # 16-bit inputs: each piece is multiplied in float32
    # A power-of-two scale (head dims 4, 16, 64, 256, ...) is folded into q: scaling by 2^e is exact,
    # so q·k of the scaled q is the scaled q·k to the bit (barring subnormals), and the softmax then
    # runs in place on the product's own buffer with no scaling pass over the [r, keys] scores (a
    # [Tq, hd] copy of q instead; measured ~10% of the tiny preset's attention forward).
    fold = _folds_scale(xp, scale, rule)

    def run(piece):
        bs, hs = piece
        qp, kp, vp = (as_dtype(a, cdt) for a in (q[bs, hs], k[bs, hs, None], v[bs, hs, None]))
        if fold:
            qp = xp.multiply(qp, cdt.type(scale))
        blocks = []
        for r0, r1 in _query_blocks(qp.shape[0] * qp.shape[1] * g * Tq * Tk, Tq, Tk):
            lo, hi = mask.key_range(r0, r1, Tk, bs)  # the keys the block's queries may see
            if hi <= lo:  # none: zeros
                o_tokens[bs, r0:r1, hs] = 0
                blocks.append((r0, r1, lo, hi, None, None))
                continue
            s = qp[..., r0:r1, :] @ kp[..., lo:hi, :].swapaxes(-1, -2)  # [b, h, g, r1 - r0, hi - lo]
            t = None
            if fold:  # (lo = 0: the block's own causal rule is exactly the mask's)
                p, _ = softmax_forward(s, scale=1.0, causal=True, out=s)
                softmax_ctx = SoftmaxCtx(p, scale)  # the backward's scale is the true one
            elif rule is None:  # in place too: no second [r, keys] array
                p, softmax_ctx = softmax_forward(s, scale=scale, causal=True, out=s if xp is np else None)
            else:
                p, softmax_ctx, t = _masked_softmax(s, scale, rule, mask.hidden(xp, (r0, r1), (lo, hi), bs))
            o_block = p @ vp[..., lo:hi, :]  # [b, h, g, r1 - r0, hd]
            o_tokens[bs, r0:r1, hs] = o_block.transpose(0, 3, 1, 2, 4)
            blocks.append((r0, r1, lo, hi, softmax_ctx, t))
        return blocks

    piece_blocks = parallel_map(xp, run, pieces)
    o = o_tokens.transpose(0, 2, 3, 1, 4)  # [B, nkv, g, Tq, hd]
    return o, AttentionCtx(q, k, v, pieces=pieces, piece_blocks=piece_blocks, scale=scale, rule=rule)


def _backward_blocked(do, ctx, out):
    q, k, v = ctx.q, ctx.k, ctx.v
    B, nkv, g, Tq, hd = q.shape
    Tk = k.shape[2]
    xp = get_array_module(q)
    if out is None:
        out = (xp.empty(q.shape, do.dtype), xp.empty(k.shape, do.dtype), xp.empty(v.shape, do.dtype))
    dq_out, dk_out, dv_out = out

    cdt = compute_dtype(q.dtype)
    # as in the forward: a power-of-two scale multiplies q and k ([T, hd] copies), not the scores'
    # gradient ([r, keys]); ds @ (k s) and ds^T @ (q s) are (ds s) @ k and (ds s)^T @ q to the bit
    fold = _folds_scale(xp, ctx.scale, ctx.rule)

    def run(i):
        bs, hs = ctx.pieces[i]
        qp, kp, vp, dop = (as_dtype(a, cdt) for a in (q[bs, hs], k[bs, hs, None], v[bs, hs, None], do[bs, hs]))
        if fold:
            qp, kp = xp.multiply(qp, cdt.type(ctx.scale)), xp.multiply(kp, cdt.type(ctx.scale))
        b, h = qp.shape[:2]
        dk = xp.zeros((b, h, Tk, hd), cdt)
        dv = xp.zeros((b, h, Tk, hd), cdt)
        for r0, r1, lo, hi, softmax_ctx, t in ctx.piece_blocks[i]:  # in order: dk, dv sum the blocks deterministically
            if softmax_ctx is None:  # the block saw no key
                dq_out[bs, hs, :, r0:r1] = 0
                continue
            do_block = dop[..., r0:r1, :]  # [b, h, g, r1 - r0, hd]
            part = softmax_ctx.y.swapaxes(-1, -2) @ do_block  # [b, h, g, hi - lo, hd]
            dv[:, :, lo:hi] += part[:, :, 0] if g == 1 else part.sum(axis=2)
            if fold:
                ds = softmax_backward(do_block @ vp[..., lo:hi, :].swapaxes(-1, -2), SoftmaxCtx(softmax_ctx.y, 1.0))
            else:
                ds = _scores_grad(do_block @ vp[..., lo:hi, :].swapaxes(-1, -2), softmax_ctx, t, ctx.scale)
            dq_out[bs, hs, :, r0:r1] = ds @ kp[..., lo:hi, :]  # [b, h, g, r1 - r0, hd]
            part = ds.swapaxes(-1, -2) @ qp[..., r0:r1, :]  # [b, h, g, hi - lo, hd]
            dk[:, :, lo:hi] += part[:, :, 0] if g == 1 else part.sum(axis=2)
        dk_out[bs, hs] = dk
        dv_out[bs, hs] = dv

    parallel_map(xp, run, range(len(ctx.pieces)))
    return out


# ---- compiled CPU path ---------------------------------------------------------------------------
# kernels/cpu/attention.c: per KV head, each query row's scores, softmax and output in one pass,
# keeping the probabilities packed (row i of a head: its Tk - Tq + i + 1 visible keys, nothing
# above the diagonal) for the backward. Taken by default (blocked=None) for float32 / float64 host
# arrays whose head dim is contiguous, under the plain causal rule without dropout; the blocked
# NumPy path above is its reference (blocked=True forces it). The planner's shape-only arrays take
# this path too (the same buffers booked, no call made), so planned memory equals measured.
_ATTENTION_SYMBOLS = ("attention_forward_f32", "attention_backward_f32", "attention_forward_f64",
                      "attention_backward_f64")


def _compiled_library(q, k, v):
    """The compiled attention's library when it takes q, k, v, else None."""
    if (compiled.suffix(q.dtype) is None or not (q.dtype == k.dtype == v.dtype) or not compiled.rows_contiguous(q, k, v)
            or 0 in (q.size, k.size)):
        return None
    return compiled.library("attention", _ATTENTION_SYMBOLS)


def _packed_rows(Tq, Tk) -> int:
    """Probabilities kept per query head: rows of Tk - Tq + 1, ..., Tk keys."""
    return Tq * (Tk - Tq + 1) + Tq * (Tq - 1) // 2


def _kv_head_chunks(n):
    """[first, last) ranges of the n = B x nkv KV heads for the pool (at most 16: few ctypes calls;
    the results do not depend on the split)."""
    step = max(1, -(-n // 16))
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _forward_compiled(q, k, v, scale):
    B, nkv, g, Tq, hd = q.shape
    Tk = k.shape[2]
    xp = get_array_module(q)
    o_tokens = xp.empty((B, Tq, nkv, g, hd), q.dtype)  # token-major, as the blocked path's
    o = o_tokens.transpose(0, 2, 3, 1, 4)
    packed = xp.empty((B, nkv, g, _packed_rows(Tq, Tk)), q.dtype)
    if xp is np:
        lib = _compiled_library(q, k, v)
        fn = compiled.entry(lib, "attention_forward", q.dtype)
        args = (compiled.ptr(q), compiled.strides(q), compiled.ptr(k), compiled.strides(k), compiled.ptr(v),
                compiled.strides(v), compiled.ptr(o), compiled.strides(o), compiled.ptr(packed),
                *compiled.int64s(B, nkv, g, Tq, Tk, hd), compiled.real(q.dtype, scale))

        def run(span):
            if fn(*args, *compiled.int64s(*span)):
                raise MemoryError("the compiled attention could not allocate its scratch rows")

        parallel_map(xp, run, _kv_head_chunks(B * nkv))
    return o, AttentionCtx(q, k, v, scale=scale, packed=packed)


def _backward_compiled(do, ctx, out):
    q, k, v = ctx.q, ctx.k, ctx.v
    B, nkv, g, Tq, hd = q.shape
    Tk = k.shape[2]
    xp = get_array_module(q)
    do = as_dtype(do, q.dtype)
    direct = (out is not None and all(a.dtype == q.dtype for a in out) and compiled.rows_contiguous(*out)
              and compiled.writable(*out))
    grads = out if direct else tuple(xp.empty(a.shape, q.dtype) for a in (q, k, v))
    if not compiled.rows_contiguous(do):
        do = xp.ascontiguousarray(do)
    if xp is np:
        fn = compiled.entry(_compiled_library(q, k, v), "attention_backward", q.dtype)
        dq, dk, dv = grads
        args = [compiled.ptr(do), compiled.strides(do)]
        for a in (q, k, v):
            args += [compiled.ptr(a), compiled.strides(a)]
        args.append(compiled.ptr(ctx.packed))
        for a in (dq, dk, dv):
            args += [compiled.ptr(a), compiled.strides(a)]
        args += [*compiled.int64s(B, nkv, g, Tq, Tk, hd), compiled.real(q.dtype, ctx.scale)]

        def run(span):
            if fn(*args, *compiled.int64s(*span)):
                raise MemoryError("the compiled attention could not allocate its scratch rows")

        parallel_map(xp, run, _kv_head_chunks(B * nkv))
    if out is None or direct:
        return grads
    for dst, grad in zip(out, grads):
        dst[...] = grad
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


def _flash_mask(xp, Tq, Tk, q_first, k_first, window, documents):
    """The fused kernels' mask and tile ranges in array code: (visible (q0, q1, k0, k1) -> the
    [B or 1, 1, 1, q1 - q0, k1 - k0] pairs of a tile that meet, key_range (q0, q1) -> the keys
    [lo, hi) some of those query rows see, query_range (k0, k1) -> the query rows [lo, hi) that
    see some of those keys, meet (q0, q1, k0, k1) -> whether the tile's documents can meet)."""
    q_first = Tk - Tq if q_first is None else int(q_first)
    k_first = 0 if k_first is None else int(k_first)
    diag = q_first - k_first  # query row i sees keys j <= diag + i (and j > diag + i - window)
    q_docs, k_docs = (None, None) if documents is None else (xp.asarray(d) for d in documents)

    def visible(q0, q1, k0, k1):
        i, j = xp.arange(q0, q1)[:, None], xp.arange(k0, k1)[None, :]
        vis = j <= diag + i
        if window is not None:
            vis = vis & (j > diag + i - window)
        vis = vis[None, None, None]
        if q_docs is not None:
            vis = vis & (q_docs[:, None, None, q0:q1, None] == k_docs[:, None, None, None, k0:k1])
        return vis

    def key_range(q0, q1):
        return max(0, diag + q0 - window + 1) if window is not None else 0, min(Tk, diag + q1)

    def query_range(k0, k1):
        return max(0, k0 - diag), min(Tq, k1 - 1 - diag + window) if window is not None else Tq

    def meet(q0, q1, k0, k1):  # ids are non-decreasing: a tile's documents are its first row's to its last's
        if q_docs is None:
            return True
        return bool(((k_docs[:, k1 - 1] >= q_docs[:, q0]) & (k_docs[:, k0] <= q_docs[:, q1 - 1])).any())

    return visible, key_range, query_range, meet


def _capped(xp, s, softcap):
    """(softcap tanh(s / softcap), its derivative 1 - tanh^2) of the scaled scores s; (s, 1)
    without a cap."""
    if softcap is None:
        return s, 1.0
    t = xp.tanh(s / softcap)
    return softcap * t, 1.0 - t * t


def flash_attention_forward(q, k, v, scale=None, tile: int = FLASH_TILE, dropout_p: float = 0.0, seed: int = 0,
                            offset=0, *, window=None, softcap=None, q_first=None, k_first=None, documents=None):
    """``(o, lse)`` by kernels/attention.cu's forward algorithm, on any array module: per query
    tile, the key tiles that hold a key one of its rows sees (causal band, window; tiles whose
    documents cannot meet skipped) with an online softmax (running max m, sum l, the output
    rescaled by exp(m_old - m_new)), then o = acc / l and lse = m + log(l) (natural log of the
    scaled, capped scores' sum of exps; a row that sees no key: o = 0, lse = -inf). No T x T
    array: tile x tile scores at a time (but the dropout mask, when there is one). Dropout as in
    :func:`causal_attention_forward`, applied to the probabilities after the row sum. The mask
    (window, softcap, q_first, k_first, documents) as the fused launchers take it
    (kernels/attention.py). Shapes as there; o in q's dtype, lse [B, nkv, g, Tq] in the compute
    dtype (float32 for 16-bit inputs)."""
    if q_first is None and k_first is None:
        _check_shapes(q, k, v)
    xp = get_array_module(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cdt = compute_dtype(q.dtype)
    Tq, Tk = q.shape[3], k.shape[2]
    visible, key_range, _, meet = _flash_mask(xp, Tq, Tk, q_first, k_first, window, documents)
    drop = _dropout_factors(xp, q.shape[:4] + (Tk,), dropout_p, seed, offset)
    o = xp.empty(q.shape[:4] + v.shape[-1:], cdt)  # v's head dim (MLA's differs from q's)
    lse = xp.empty(q.shape[:4], cdt)
    for q0 in range(0, Tq, tile):
        q1 = min(q0 + tile, Tq)
        qt = as_dtype(q[..., q0:q1, :], cdt)
        m = xp.full(qt.shape[:4], -xp.inf, cdt)
        l_sum = xp.zeros(qt.shape[:4], cdt)
        acc = xp.zeros(qt.shape[:4] + v.shape[-1:], cdt)
        lo, hi = key_range(q0, q1)
        for k0 in range(lo - lo % tile, hi, tile):
            k1 = min(k0 + tile, Tk)
            if not meet(q0, q1, k0, k1):
                continue
            s, _ = _capped(xp, (qt @ as_dtype(k[:, :, None, k0:k1], cdt).swapaxes(-1, -2)) * scale, softcap)
            s = xp.where(visible(q0, q1, k0, k1), s, -xp.inf)
            m_new = xp.maximum(m, s.max(axis=-1))
            m_ref = xp.where(m_new == -xp.inf, 0.0, m_new)  # a row that has seen no key yet: p = alpha = 0
            p = xp.exp(s - m_ref[..., None])
            alpha = xp.exp(m - m_ref)
            l_sum = l_sum * alpha + p.sum(axis=-1)
            if drop is not None:
                p = p * drop[..., q0:q1, k0:k1]
            acc = acc * alpha[..., None] + p @ as_dtype(v[:, :, None, k0:k1], cdt)
            m = m_new
        seen = l_sum > 0
        o[..., q0:q1, :] = acc / xp.where(seen, l_sum, 1.0)[..., None]
        lse[..., q0:q1] = xp.where(seen, m + xp.log(xp.where(seen, l_sum, 1.0)), -xp.inf)
    return as_dtype(o, q.dtype), lse


def flash_attention_backward(do, q, k, v, o, lse, scale=None, tile: int = FLASH_TILE, dropout_p: float = 0.0,
                             seed: int = 0, offset=0, *, window=None, softcap=None, q_first=None, k_first=None,
                             documents=None):
    """``(dq, dk, dv)`` by kernels/attention.cu's backward algorithm: D = rowsum(do * o); per key
    tile and the query tiles with a row that sees one of its keys (tiles whose documents cannot
    meet skipped), P = exp(x - lse) recomputed from the scaled, capped scores x, dv += P^T do,
    dS = P (do v^T - D) c (c = 1 - tanh^2 of the cap, 1 without), dq += scale dS k, dk += scale
    dS^T q (dk, dv summed over the g query heads of each KV head); with dropout's factors F
    (mask / (1 - p)), dv += (P F)^T do and dS = P (F do v^T - D) c. Shapes and mask as in
    :func:`flash_attention_forward`; results in q's dtype."""
    xp = get_array_module(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cdt = compute_dtype(q.dtype)
    Tq, Tk = q.shape[3], k.shape[2]
    visible, _, query_range, meet = _flash_mask(xp, Tq, Tk, q_first, k_first, window, documents)
    qc, kc, vc, doc = (as_dtype(a, cdt) for a in (q, k, v, do))
    rowdot = (doc * as_dtype(o, cdt)).sum(axis=-1)  # [B, nkv, g, Tq]
    drop = _dropout_factors(xp, q.shape[:4] + (Tk,), dropout_p, seed, offset)
    dq = xp.zeros(q.shape, cdt)
    dk = xp.zeros(k.shape, cdt)
    dv = xp.zeros(v.shape, cdt)
    for k0 in range(0, Tk, tile):
        k1 = min(k0 + tile, Tk)
        kt, vt = kc[:, :, None, k0:k1], vc[:, :, None, k0:k1]
        lo, hi = query_range(k0, k1)
        for q0 in range(lo - lo % tile, hi, tile):
            q1 = min(q0 + tile, Tq)
            if not meet(q0, q1, k0, k1):
                continue
            x, dcap = _capped(xp, (qc[..., q0:q1, :] @ kt.swapaxes(-1, -2)) * scale, softcap)
            vis = visible(q0, q1, k0, k1)  # (a row that sees no key has lse = -inf: never exp(x + inf))
            p = xp.exp(xp.where(vis, x - xp.where(vis, lse[..., q0:q1, None], 0.0), -xp.inf))
            f = 1.0 if drop is None else drop[..., q0:q1, k0:k1]
            dv[:, :, k0:k1] += ((p * f).swapaxes(-1, -2) @ doc[..., q0:q1, :]).sum(axis=2)
            ds = p * ((doc[..., q0:q1, :] @ vt.swapaxes(-1, -2)) * f - rowdot[..., q0:q1, None]) * dcap
            dq[..., q0:q1, :] += (ds @ kt) * scale
            dk[:, :, k0:k1] += (ds.swapaxes(-1, -2) @ qc[..., q0:q1, :]).sum(axis=2) * scale
    return tuple(as_dtype(a, q.dtype) for a in (dq, dk, dv))


# ---- reference -----------------------------------------------------------------------------------
def causal_attention_reference(q, k, v, scale=None, dropout_p: float = 0.0, seed: int = 0, offset: int = 0, *,
                               window=None, softcap=None, q_first=None, k_first=None, documents=None):
    """The forward's formula written out in the simplest way, for tests (float64 friendly): every
    query head against its KV head by einsum, soft-capped (``softcap``), hidden scores set to -inf
    by the mask rule of the module docstring, a max-subtracted softmax (a row that sees no key:
    zeros), and with ``dropout_p`` the probabilities times the keep-mask ``dropout_mask`` draws for
    them under ``(seed, offset)``, over ``1 - dropout_p``. Shapes as in :func:`causal_attention_forward`."""
    xp = get_array_module(q, k, v)
    Tq, Tk = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = xp.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if softcap is not None:
        scores = softcap * xp.tanh(scores / softcap)
    k_first = 0 if k_first is None else k_first
    q_first = Tk - Tq + k_first if q_first is None else q_first
    query = (q_first + xp.arange(Tq))[:, None]
    key = (k_first + xp.arange(Tk))[None, :]
    seen = key <= query
    if window is not None:
        seen = seen & (key > query - window)
    seen = seen[None, None, None]
    if documents is not None:
        seen = seen & (documents[0][:, None, None, :, None] == documents[1][:, None, None, None, :])
    scores = xp.where(seen, scores, -xp.inf)
    top = scores.max(axis=-1, keepdims=True)
    probs = xp.where(seen, xp.exp(scores - xp.where(xp.isfinite(top), top, 0.0)), 0.0)
    total = probs.sum(axis=-1, keepdims=True)
    probs = probs / xp.where(total > 0, total, 1.0)
    if dropout_p:
        probs = probs * _dropout_factors(xp, probs.shape, dropout_p, seed, offset)
    return xp.einsum("bhgqk,bhkd->bhgqd", probs, v)
