"""Soft-capping, ``y = cap * tanh(x / cap)`` (Gemma 2's final logits; transformers' order:
divide, tanh, multiply), and its backward ``dx = dy * (1 - tanh(x / cap)^2)``. Elementwise: on
vocabulary-parallel logits each rank caps its own columns, with no communication. 16-bit inputs
are computed in float32 and rounded once; the tanh kept for backward is rounded to the input's
dtype, as autograd keeps torch.tanh's output (half a float32 copy of the logits in memory).
"""
from __future__ import annotations

from cutp.runtime.backend import get_array_module

from .common import as_dtype, compute_dtype


class SoftcapCtx:
    """``t = tanh(x / cap)`` in the input's dtype: all the backward needs."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


def softcap_forward(x, cap: float):
    """Returns ``(y, ctx)``: ``y = cap * tanh(x / cap)`` in ``x``'s dtype (a new array)."""
    if not cap > 0:
        raise ValueError(f"softcap_forward: cap must be > 0, got {cap!r}")
    xp = get_array_module(x)
    cdt = compute_dtype(x.dtype)
    t = xp.tanh(as_dtype(x, cdt) / cdt.type(cap))
    return as_dtype(t * cdt.type(cap), x.dtype), SoftcapCtx(as_dtype(t, x.dtype))


def softcap_backward(dy, ctx: SoftcapCtx):
    """``dx = dy * (1 - t^2)`` in ``dy``'s dtype (written into ``dy`` when it is of the compute dtype)."""
    xp = get_array_module(dy)
    if tuple(dy.shape) != tuple(ctx.t.shape):
        raise ValueError(f"softcap_backward: dy shape {tuple(dy.shape)} != x shape {tuple(ctx.t.shape)}")
    cdt = compute_dtype(dy.dtype)
    t = as_dtype(ctx.t, cdt)
    g = 1.0 - t * t
    if dy.dtype == cdt:
        return xp.multiply(dy, g, out=dy)
    return as_dtype(as_dtype(dy, cdt) * g, dy.dtype)
