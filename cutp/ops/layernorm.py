"""LayerNorm over the last axis, optionally affine."""
from __future__ import annotations

from cutp.runtime.backend import get_array_module
from cutp.kernels import dispatch as _kernels

import numpy as np

from . import compiled
from .common import as_dtype, col_sum, compute_dtype, parallel_map, row_blocks, row_sums

# The compiled CPU path (kernels/cpu/norms.c): a row's statistics and output in two passes, for
# C-contiguous float32 / float64 host arrays whose weight and bias have x's dtype; the same buffers
# as the NumPy code below (its reference). The parameter gradients: each row block's part, added in
# block order as below.
NORM_SYMBOLS = tuple(f"{op}_{d}" for op in ("layernorm_forward", "layernorm_backward", "rmsnorm_forward",
                                            "rmsnorm_backward") for d in ("f32", "f64"))


def norm_library(*arrays):
    """The compiled norms' library for these arrays (None entries: absent parameters), or None."""
    return compiled.host_library("norms", NORM_SYMBOLS, *(a for a in arrays if a is not None))


class LayerNormCtx:
    """What ``layernorm_backward`` needs: the input ``x`` (a reference), the ``weight`` (None
    when non-affine), the bias dtype (None: no bias), and the per-row statistics ``mean`` and
    ``rstd = 1 / sqrt(var + eps)`` (shape ``x.shape[:-1]``, float32 for float32/bfloat16
    inputs, float64 for float64), exactly what the fused GPU kernel saves."""

    __slots__ = ("x", "weight", "bias_dtype", "mean", "rstd")

    def __init__(self, x, weight, bias_dtype, mean, rstd):
        self.x = x
        self.weight = weight
        self.bias_dtype = bias_dtype
        self.mean = mean
        self.rstd = rstd


def layernorm_forward(x, weight=None, bias=None, eps: float = 1e-5):
    """``y = (x - mean) * rstd * weight + bias`` over the last axis of ``x`` [..., C].

    ``mean`` and the biased variance ``var`` are taken over the last axis and
    ``rstd = 1 / sqrt(var + eps)``; ``weight`` and ``bias`` ([C]) may each be None (no scale /
    no shift). float32/float64 are computed in their own precision, bfloat16 in float32 with
    a bfloat16 ``y``.

    Returns ``(y, ctx)``; ``ctx`` (:class:`LayerNormCtx`) exposes ``ctx.mean`` and
    ``ctx.rstd``.
    """
    k = _kernels(x, weight, bias)  # CuPy float32/bfloat16: the CUDA kernel (kernels/layernorm.cu)
    if k is not None:
        y, mean, rstd = k.layernorm_forward(x, weight, bias, eps)
        lead = x.shape[:-1]
        ctx = LayerNormCtx(x, weight, None if bias is None else bias.dtype, mean.reshape(lead), rstd.reshape(lead))
        return y, ctx
    xp = get_array_module(x, weight, bias)
    cdt = compute_dtype(x.dtype)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    N = x2.shape[0]
    w = None if weight is None else as_dtype(weight, cdt)
    b = None if bias is None else as_dtype(bias, cdt)
    y = xp.empty((N, C), dtype=x.dtype)
    mean = xp.empty(N, dtype=cdt)
    rstd = xp.empty(N, dtype=cdt)
    direct = y.dtype == cdt
    lib = norm_library(x, weight, bias)
    if lib is not None:
        compiled.run_rows(xp, lib, "layernorm_forward", cdt, (x2, weight, bias, y, mean, rstd), (eps,), N, C)
        lead = x.shape[:-1]
        ctx = LayerNormCtx(x, weight, None if bias is None else bias.dtype, mean.reshape(lead), rstd.reshape(lead))
        return y.reshape(x.shape), ctx

    def block(sl):
        xb = as_dtype(x2[sl], cdt)
        m = row_sums(xp, xb)[:, 0]
        m *= 1.0 / C
        h = xp.subtract(xb, m[:, None], out=y[sl] if direct else None)
        var = xp.einsum("ij,ij->i", h, h)
        var *= 1.0 / C
        var += eps
        r = xp.sqrt(var, out=var)
        xp.divide(1.0, r, out=r)
        h *= r[:, None]
        if w is not None:
            h *= w
        if b is not None:
            h += b
        if not direct:
            y[sl] = h
        mean[sl] = m
        rstd[sl] = r

    parallel_map(xp, block, row_blocks(xp, N, C))
    lead = x.shape[:-1]
    ctx = LayerNormCtx(x, weight, None if bias is None else bias.dtype,
                       mean.reshape(lead), rstd.reshape(lead))
    return y.reshape(x.shape), ctx


def layernorm_backward(dy, ctx: LayerNormCtx):
    """Gradients of :func:`layernorm_forward`.

    With ``xhat = (x - mean) * rstd`` and ``g = dy * weight`` (``g = dy`` when non-affine):
    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` (means over the last axis),
    ``dweight = sum(dy * xhat)``, ``dbias = sum(dy)``, summed over all leading dimensions.

    Returns ``(dx, dweight, dbias)``: ``dx`` in ``x``'s dtype; ``dweight`` / ``dbias`` in the
    parameters' dtypes, or None when the forward had no weight / no bias.
    """
    x, weight = ctx.x, ctx.weight
    k = _kernels(dy, x, weight)
    if k is not None and dy.shape == x.shape and ctx.bias_dtype in (None, x.dtype):
        return k.layernorm_backward(dy, x, weight, ctx.mean.reshape(-1), ctx.rstd.reshape(-1), ctx.bias_dtype)
    xp = get_array_module(dy, x)
    cdt = compute_dtype(x.dtype)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    dy2 = dy.reshape(-1, C)
    N = x2.shape[0]
    mean = ctx.mean.reshape(-1)
    rstd = ctx.rstd.reshape(-1)
    lib = norm_library(x, weight, dy, mean, rstd) if ctx.bias_dtype in (None, x.dtype) else None
    if lib is not None:
        dx = xp.empty((N, C), dtype=x.dtype)
        dw, db = compiled.run_rows(xp, lib, "layernorm_backward", cdt, (x2, weight, mean, rstd, dy2, dx), (), N, C,
                               parts=(weight is not None, ctx.bias_dtype is not None), part_dtype=np.float64)
        return dx.reshape(x.shape), dw, db
    w = None if weight is None else as_dtype(weight, cdt)
    has_bias = ctx.bias_dtype is not None
    dx = xp.empty((N, C), dtype=x.dtype)
    dw = xp.zeros(C, dtype=cdt) if w is not None else None
    db = xp.zeros(C, dtype=cdt) if has_bias else None
    direct = dx.dtype == cdt
    inv_c = 1.0 / C

    def block(sl):
        xb = as_dtype(x2[sl], cdt)
        dyb = as_dtype(dy2[sl], cdt)
        r = rstd[sl][:, None]
        xhat = xp.subtract(xb, mean[sl][:, None])
        xhat *= r
        db_part = col_sum(xp, dyb) if has_bias else None
        dw_part = None
        if w is not None:
            dw_part = xp.einsum("ij,ij->j", dyb, xhat)
            g = xp.multiply(dyb, w, out=dx[sl] if direct else None)
        else:
            g = dyb
        gm = row_sums(xp, g)[:, 0]
        gm *= inv_c
        gx = xp.einsum("ij,ij->i", g, xhat)
        gx *= inv_c
        xhat *= gx[:, None]
        if w is not None:
            d = g
            d -= xhat
        else:
            d = xp.subtract(g, xhat, out=dx[sl] if direct else xhat)
        d -= gm[:, None]
        d *= r
        if not direct:
            dx[sl] = d
        return dw_part, db_part

    # the blocks' parameter-gradient parts are summed in block order (thread-count independent)
    for dw_part, db_part in parallel_map(xp, block, row_blocks(xp, N, C)):
        if db_part is not None:
            db += db_part
        if dw_part is not None:
            dw += dw_part
    dweight = None if dw is None else as_dtype(dw, weight.dtype)
    dbias = None if db is None else as_dtype(db, ctx.bias_dtype)
    return dx.reshape(x.shape), dweight, dbias
