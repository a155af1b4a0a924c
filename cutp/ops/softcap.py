"""Soft-capping, ``y = cap * tanh(x / cap)`` (Gemma 2's final logits; transformers' order:
divide, tanh, multiply), and its backward ``dx = dy * (1 - tanh(x / cap)^2)``. Elementwise: on
vocabulary-parallel logits each rank caps its own columns, with no communication. 16-bit inputs
are computed in float32 and rounded once.
"""
from __future__ import annotations

from cutp.runtime.backend import get_array_module

from .common import as_dtype, compute_dtype


class SoftcapCtx:
    """``t = tanh(x / cap)`` in the compute dtype: all the backward needs."""

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
    return as_dtype(t * cdt.type(cap), x.dtype), SoftcapCtx(t)


def softcap_backward(dy, ctx: SoftcapCtx):
    """``dx = dy * (1 - t^2)`` in ``dy``'s dtype (written into ``dy`` when it is of the compute dtype)."""
    xp = get_array_module(dy)
    t = ctx.t
    if tuple(dy.shape) != tuple(t.shape):
        raise ValueError(f"softcap_backward: dy shape {tuple(dy.shape)} != x shape {tuple(t.shape)}")
    g = 1.0 - t * t
    if dy.dtype == t.dtype:
        return xp.multiply(dy, g, out=dy)
    return as_dtype(as_dtype(dy, t.dtype) * g, dy.dtype)
