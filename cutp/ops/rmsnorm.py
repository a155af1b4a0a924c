"""RMSNorm over the last axis (Llama, Qwen2, Mistral), with HF ``LlamaRMSNorm``'s rounding order.

HF computes, for an input of dtype ``dt``::

    x32 = x.to(float32); variance = x32.pow(2).mean(-1)
    y = weight * (x32 * rsqrt(variance + eps)).to(dt)

so for bfloat16/float16 the normalised value is rounded to ``dt`` first and the weight multiply
happens in ``dt`` (the exact product of two 16-bit values, rounded once to ``dt``). This op does the
same: the multiply is done in float32 on the rounded value and rounded once, which is what a
16-bit multiply is (the product of two 16-bit values is exact in float32). float32/float64 inputs are computed in their own precision (no rounding step).
With ``round_first=False`` (Gemma's order: ``(x32 * rsqrt(...) * (1 + weight.float())).to(dt)``)
the normalised value is not rounded before the scale: the product is rounded once.
"""
from __future__ import annotations

import numpy as np

from cutp.kernels import dispatch as _kernels
from cutp.runtime.backend import get_array_module

from . import compiled
from .common import as_dtype, compute_dtype, is_low_precision, parallel_map, row_blocks
from .layernorm import norm_library  # (the compiled path: kernels/cpu/norms.c)


class RMSNormCtx:
    """What ``rmsnorm_backward`` needs: the input ``x`` (a reference), the ``weight`` (None when
    non-affine) and the per-row ``rstd = 1 / sqrt(mean(x^2) + eps)`` (shape ``x.shape[:-1]``,
    float32 for 16-bit and float32 inputs, float64 for float64)."""

    __slots__ = ("x", "weight", "rstd", "round_first")

    def __init__(self, x, weight, rstd, round_first=True):
        self.x = x
        self.weight = weight
        self.rstd = rstd
        self.round_first = round_first  # 16-bit: x * rstd rounded before the weight (HF's Llama order)


def _check_shapes(x, weight):
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"rmsnorm: x must have a non-empty last axis, got shape {x.shape}")
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rmsnorm: weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},) "
                         "(one scale per element of x's last axis)")


def rmsnorm_forward(x, weight=None, eps: float = 1e-6, round_first: bool = True):
    """``y = weight * (x * rstd)`` over the last axis of ``x`` [..., C], ``rstd = 1/sqrt(mean(x^2) + eps)``.

    ``weight`` [C] may be None (no scale). For bfloat16/float16 ``x * rstd`` is rounded to ``x``'s
    dtype before the weight multiply (HF's order, module docstring), and the product is rounded
    to ``x``'s dtype once: with a weight of ``x``'s dtype (the model's parameters; fp32 masters
    live in the optimizer) that is bit for bit HF's 16-bit multiply. An fp32 weight is not
    rounded first (HF would keep that product in fp32; here it is rounded to ``x``'s dtype).

    ``round_first=False``: not rounded before the weight (Gemma's order; module docstring).

    Returns ``(y, ctx)``: ``y`` in ``x``'s dtype; ``ctx`` (:class:`RMSNormCtx`) exposes ``ctx.rstd``.
    """
    _check_shapes(x, weight)
    low = is_low_precision(x.dtype)
    # CuPy float32/bfloat16: the CUDA kernel (kernels/rmsnorm.cu), which rounds first in 16 bits
    k = _kernels(x, weight) if round_first or not low else None
    if k is not None:
        y, rstd = k.rmsnorm_forward(x, weight, eps)
        return y, RMSNormCtx(x, weight, rstd.reshape(x.shape[:-1]))
    xp = get_array_module(x, weight)
    cdt = compute_dtype(x.dtype)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    N = x2.shape[0]
    w = None if weight is None else as_dtype(weight, cdt)
    y = xp.empty((N, C), dtype=x.dtype)
    rstd = xp.empty(N, dtype=cdt)
    lib = norm_library(x, weight)  # (float32 / float64 only: no rounding step to mirror)
    if lib is not None:
        compiled.run_rows(xp, lib, "rmsnorm_forward", cdt, (x2, weight, y, rstd), (eps,), N, C)
        return y.reshape(x.shape), RMSNormCtx(x, weight, rstd.reshape(x.shape[:-1]), round_first)

    def block(sl):
        xb = as_dtype(x2[sl], cdt)
        # mean(x*x) exactly as HF's (and a NumPy transcription's) `mean`, so the statistics agree bitwise
        r = xp.mean(xb * xb, axis=-1)
        r += eps
        xp.sqrt(r, out=r)
        xp.divide(1.0, r, out=r)
        # float32/float64: y's rows are written in place (one pass fewer, no temporary)
        h = xp.multiply(xb, r[:, None], out=None if low else y[sl])
        if low and round_first:
            h = h.astype(x.dtype).astype(cdt)  # HF's `.to(input_dtype)` before the weight
        if w is not None:
            h *= w
        if low:
            y[sl] = h
        rstd[sl] = r

    parallel_map(xp, block, row_blocks(xp, N, C))
    return y.reshape(x.shape), RMSNormCtx(x, weight, rstd.reshape(x.shape[:-1]), round_first)


def residual_rmsnorm_forward(x, branch, weight=None, eps: float = 1e-6, round_first: bool = True):
    """``s = x + branch`` (the residual stream after a pre-norm block's branch, in ``x``'s dtype)
    and ``rmsnorm_forward(s, weight, eps)``: on the GPU one kernel that reads ``x`` and ``branch``
    once and writes ``s`` once (llm.c's fused_residual_forward); elsewhere the two ops.

    Returns ``(s, y, ctx)``; ``rmsnorm_backward(dy, ctx)`` is the norm's backward (the add's is
    the identity on both inputs).
    """
    if tuple(branch.shape) != tuple(x.shape):
        raise ValueError(f"residual_rmsnorm_forward: branch shape {tuple(branch.shape)} != x shape {tuple(x.shape)}")
    _check_shapes(x, weight)
    k = _kernels(x, branch, weight) if round_first or not is_low_precision(x.dtype) else None
    if k is not None:
        s, y, rstd = k.residual_rmsnorm_forward(x, branch, weight, eps)
        return s, y, RMSNormCtx(s, weight, rstd.reshape(x.shape[:-1]))
    s = x + branch
    y, ctx = rmsnorm_forward(s, weight, eps, round_first)
    return s, y, ctx


def rmsnorm_backward(dy, ctx: RMSNormCtx):
    """Gradients of :func:`rmsnorm_forward`.

    With ``xhat = x * rstd`` and ``g = dy * weight`` (``g = dy`` without weight):
    ``dx = rstd * (g - xhat * mean(g * xhat))`` (mean over the last axis) and
    ``dweight = sum(dy * xhat)`` over all leading dimensions. For 16-bit inputs ``dweight`` uses
    the rounded ``xhat`` the forward multiplied by (as autograd through HF's module would); the
    rounding itself is treated as the identity in ``dx``.

    Returns ``(dx, dweight)``: ``dx`` in ``x``'s dtype, ``dweight`` in the weight's dtype (None
    when the forward had no weight).
    """
    x, weight = ctx.x, ctx.weight
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"rmsnorm_backward: dy shape {tuple(dy.shape)} != x shape {tuple(x.shape)}")
    low = is_low_precision(x.dtype)
    k = _kernels(dy, x, weight) if ctx.round_first or not low else None
    if k is not None:
        dx, dweight = k.rmsnorm_backward(dy, x, weight, ctx.rstd.reshape(-1))
        return dx, dweight
    xp = get_array_module(dy, x, weight)
    cdt = compute_dtype(x.dtype)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    dy2 = dy.reshape(-1, C)
    N = x2.shape[0]
    rstd = ctx.rstd.reshape(-1)
    w = None if weight is None else as_dtype(weight, cdt)
    dx = xp.empty((N, C), dtype=x.dtype)
    lib = norm_library(x, weight, dy, rstd)
    if lib is not None:
        (dw,) = compiled.run_rows(xp, lib, "rmsnorm_backward", cdt, (x2, weight, rstd, dy2, dx), (), N, C,
                              parts=(weight is not None,), part_dtype=np.float64)
        return dx.reshape(x.shape), dw
    inv_c = 1.0 / C

    def block(sl):
        r = rstd[sl][:, None]
        xhat = as_dtype(x2[sl], cdt) * r
        dyb = as_dtype(dy2[sl], cdt)
        dw_part = None
        if w is not None:
            used = xhat.astype(x.dtype).astype(cdt) if low and ctx.round_first else xhat
            dw_part = xp.einsum("ij,ij->j", dyb, used)
            g = dyb * w
        else:
            g = dyb
        gx = xp.einsum("ij,ij->i", g, xhat)
        gx *= inv_c
        xhat *= gx[:, None]
        d = xp.subtract(g, xhat, out=None if low else dx[sl])  # float32/float64: in dx's rows, no copy
        d *= r
        if low:
            dx[sl] = d
        return dw_part

    dw = None if w is None else xp.zeros(C, dtype=cdt)
    for part in parallel_map(xp, block, row_blocks(xp, N, C)):  # summed in block order (thread-count independent)
        if part is not None:
            dw += part
    dweight = None if dw is None else as_dtype(dw, weight.dtype)
    return dx.reshape(x.shape), dweight
