"""Scaled, optionally causal softmax over the last axis (attention scores)."""
from __future__ import annotations

import numpy as np

from cutp.runtime.backend import get_array_module, on_host
from cutp.kernels import dispatch as _kernels

from . import common
from .common import as_dtype, compute_dtype


class SoftmaxCtx:
    """The probabilities ``y`` (in the input dtype) and the ``scale``."""

    __slots__ = ("y", "scale")

    def __init__(self, y, scale):
        self.y = y
        self.scale = scale


def causal_mask(xp, tq: int, tk: int):
    """Bool [tq, tk], True where key j is masked for query i: ``j > tk - tq + i``.

    Query row i sits at absolute position ``tk - tq + i`` (the last ``tq`` positions of a
    length-``tk`` sequence, as with a KV cache), and may attend keys ``0 .. tk - tq + i``.
    """
    i = xp.arange(tq).reshape(tq, 1)
    j = xp.arange(tk).reshape(1, tk)
    return j > i + (tk - tq)


def _blocks(xp, m: int, tq: int, tk: int):
    """(matrix slice, query-row slice) pairs covering an [m, tq, tk] array in blocks of about
    ``BLOCK_ELEMS`` elements on NumPy (whole matrices when they are small, row chunks of
    one matrix when they are large); a single block on other array modules."""
    full = slice(0, tq)
    BLOCK_ELEMS = common.BLOCK_ELEMS
    if not on_host(xp) or m * tq * tk <= BLOCK_ELEMS:
        return [(slice(0, m), full)]
    per = tq * tk
    if per <= BLOCK_ELEMS:
        nb = BLOCK_ELEMS // per
        return [(slice(i, min(i + nb, m)), full) for i in range(0, m, nb)]
    rb = max(1, BLOCK_ELEMS // tk)
    return [(slice(i, i + 1), slice(r, min(r + rb, tq))) for i in range(m) for r in range(0, tq, rb)]


def softmax_forward(x, scale: float = 1.0, causal: bool = False, out=None):
    """``y = softmax(scale * x)`` over the last axis of ``x`` [..., Tq, Tk].

    When ``causal``, query row i (absolute position ``Tk - Tq + i``) masks keys
    ``j > Tk - Tq + i``; masked probabilities are exactly 0. ``Tq <= Tk`` is required then
    (otherwise some rows would have no key at all). Numerically stable (the row max is
    subtracted). Float32/64 in their own precision, bfloat16 in float32 with a bfloat16 ``y``.
    A 1-D ``x`` is treated as one row.

    ``out``: NumPy only, a C-contiguous array of ``x``'s shape and dtype that receives ``y``:
    ``x`` itself (the scores' own buffer, no second [Tq, Tk] array; with ``scale == 1`` the pass
    that copied the scaled scores is skipped) or an array not overlapping ``x``.

    Returns ``(y, ctx)``; ``ctx`` (:class:`SoftmaxCtx`) saves ``y`` and ``scale``.
    """
    xp = get_array_module(x)
    cdt = compute_dtype(x.dtype)
    scale = float(scale)
    if causal and x.ndim < 2:
        raise ValueError("causal softmax needs x of shape [..., Tq, Tk]")
    tk = x.shape[-1]
    tq = x.shape[-2] if x.ndim >= 2 else 1
    if causal and tq > tk:
        raise ValueError(f"causal softmax needs Tq <= Tk, got Tq={tq}, Tk={tk}")
    k = _kernels(x)  # CuPy float32/bfloat16: the CUDA kernel (kernels/softmax.cu)
    if k is not None:
        y = k.softmax_forward(x, scale, causal)
        return y, SoftmaxCtx(y, scale)
    bias = None
    if causal and tq > 1:  # with tq == 1 the single query sees every key
        # only the last tq keys are hidden from any row: the -inf bias covers those columns
        # (keys [0, tk - tq) are seen by every row; adding zeros there was a pass for nothing)
        bias = xp.zeros((tq, tq), dtype=cdt)
        bias[causal_mask(xp, tq, tq)] = -xp.inf
    x3 = x.reshape(-1, tq, tk)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous
                            or not on_host(xp)):
        raise ValueError("softmax_forward: out must be a C-contiguous NumPy array of x's shape and dtype")
    y = xp.empty(x3.shape, dtype=x.dtype) if out is None else out.reshape(x3.shape)
    direct = y.dtype == cdt
    in_place = out is x

    def block(b):
        mi, ri = b
        xb = x3[mi, ri]
        if direct:
            s = y[mi, ri]
            if not (in_place and scale == 1.0):
                xp.multiply(xb, scale, out=s)
        else:
            s = xb.astype(cdt)
            if scale != 1.0:
                s *= scale
        if bias is not None:
            s[..., tk - tq:] += bias[ri]
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        s /= common.row_sums(xp, s)
        if not direct:
            y[mi, ri] = s

    common.parallel_map(xp, block, _blocks(xp, x3.shape[0], tq, tk))
    y = y.reshape(x.shape)
    return y, SoftmaxCtx(y, scale)


def softmax_backward(dy, ctx: SoftmaxCtx):
    """``dx = scale * y * (dy - sum(dy * y, axis=-1))`` in the input dtype (masked entries 0)."""
    y = ctx.y
    xp = get_array_module(dy, y)
    cdt = compute_dtype(y.dtype)
    if dy.shape != y.shape:
        raise ValueError(f"softmax_backward: dy shape {dy.shape} != y shape {y.shape}")
    k = _kernels(dy, y)
    if k is not None:
        return k.softmax_backward(dy, y, ctx.scale)
    tk = y.shape[-1]
    tq = y.shape[-2] if y.ndim >= 2 else 1
    y3 = y.reshape(-1, tq, tk)
    dy3 = dy.reshape(-1, tq, tk)
    dx = xp.empty(y3.shape, dtype=y.dtype)
    direct = dx.dtype == cdt

    def block(b):
        mi, ri = b
        yb = as_dtype(y3[mi, ri], cdt)
        dyb = as_dtype(dy3[mi, ri], cdt)
        t = xp.multiply(dyb, yb, out=dx[mi, ri] if direct else None)
        s = common.row_sums(xp, t)
        xp.subtract(dyb, s, out=t)
        t *= yb
        if ctx.scale != 1.0:
            t *= ctx.scale
        if not direct:
            dx[mi, ri] = t

    common.parallel_map(xp, block, _blocks(xp, y3.shape[0], tq, tk))
    return dx.reshape(y.shape)
