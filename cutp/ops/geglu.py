"""GeGLU on a fused gate/up projection: ``y = gelu(gate) * up`` (Gemma's MLP activation, with
tanh GeLU: transformers' ``gelu_pytorch_tanh``).

The layout is SwiGLU's (``cutp.ops.swiglu``): the last axis of ``gate_up`` [..., 2F] holds this
rank's F gate columns, then its F up columns. Rounding as transformers' ``act_fn(gate_proj(x)) *
up_proj(x)``: the GeLU is rounded to the input's dtype, then the product is rounded once; backward
is autograd's through those two steps (``d_up = dy * gelu(gate)``, ``d_gate = gelu'(gate) * (dy *
up)``). The GeLU itself is `cutp.ops.gelu` (its CUDA kernel on a GPU); the products are array code.
"""
from __future__ import annotations

from cutp.runtime.backend import get_array_module

from .common import as_dtype, compute_dtype
from .gelu import GeluCtx, gelu_backward, gelu_forward
from .swiglu import gate_up_halves


class GeGLUCtx:
    """The fused pre-activation ``gate_up`` (a reference), the GeLU's approximation and its
    rounded output: what the backward needs."""

    __slots__ = ("gate_up", "approximate", "act")

    def __init__(self, gate_up, approximate, act):
        self.gate_up, self.approximate, self.act = gate_up, approximate, act


def _product(xp, a, b, dtype):
    """a * b computed in the compute dtype and rounded once to `dtype`."""
    cdt = compute_dtype(dtype)
    return as_dtype(xp.multiply(as_dtype(a, cdt), as_dtype(b, cdt)), dtype)


def geglu_forward(gate_up, approximate: str = "tanh"):
    """``y = gelu(gate) * up`` with ``gate, up = gate_up[..., :F], gate_up[..., F:]``.

    Returns ``(y, ctx)``: ``y`` [..., F] in ``gate_up``'s dtype (16-bit computed in float32)."""
    F = gate_up_halves(gate_up, "geglu_forward")
    xp = get_array_module(gate_up)
    act, _ = gelu_forward(xp.ascontiguousarray(gate_up[..., :F]), approximate)
    return _product(xp, act, gate_up[..., F:], gate_up.dtype), GeGLUCtx(gate_up, approximate, act)


def geglu_backward(dy, ctx: GeGLUCtx):
    """``d_gate_up`` [..., 2F] in the forward's layout and dtype."""
    gate_up = ctx.gate_up
    F = gate_up.shape[-1] // 2
    if tuple(dy.shape) != tuple(gate_up.shape[:-1]) + (F,):
        raise ValueError(f"geglu_backward: dy shape {tuple(dy.shape)} != output shape "
                         f"{tuple(gate_up.shape[:-1]) + (F,)}")
    xp = get_array_module(dy, gate_up)
    d = xp.empty(gate_up.shape, dtype=gate_up.dtype)
    d[..., F:] = _product(xp, dy, ctx.act, gate_up.dtype)
    dact = _product(xp, dy, gate_up[..., F:], gate_up.dtype)
    d[..., :F] = gelu_backward(dact, GeluCtx(xp.ascontiguousarray(gate_up[..., :F]), ctx.approximate))
    return d
