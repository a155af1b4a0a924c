"""SwiGLU on a fused gate/up projection: ``y = silu(gate) * up`` (Llama's MLP activation).

Layout: the last axis of ``gate_up`` [..., 2F] holds this rank's F gate columns, then its F up
columns (Megatron's ``[gate_r ; up_r]`` per tensor-parallel rank, see anchors-llama §2.1; at one
rank ``cat(gate_proj, up_proj)``). The chunk is taken on the local tensor, so a TP shard of the
fused weight must be ``[gate_r ; up_r]``, not a slice of ``[gate ; up]``.

``silu(g) = g / (1 + e)``, ``e = exp(-g)`` with ``-g`` clamped to 80 (float32; 700 in float64), so
``exp`` never overflows: below ``g = -80`` silu is below 1e-33 in size and the clamp changes it by
less than that. The derivative uses ``1 - sigmoid(g) = e / (1 + e)``, which has no cancellation.
"""
from __future__ import annotations

from cutp.kernels import dispatch as _kernels
from cutp.runtime.backend import get_array_module, on_host

import numpy as np

from . import compiled
from .common import as_dtype, compute_dtype, parallel_map, row_blocks

# The compiled CPU path (kernels/cpu/activations.c): forward and backward in one pass per element
# for C-contiguous float32 / float64 host arrays, keeping exp(-gate) as the NumPy path does (the
# same buffers); the NumPy code below is its reference.
_SYMBOLS = ("swiglu_forward_f32", "swiglu_backward_f32", "swiglu_forward_f64", "swiglu_backward_f64")


class SwiGLUCtx:
    """The fused pre-activation ``gate_up`` (a reference): all the backward needs; on the host in
    float32/64 also ``exp_neg``, the forward's ``exp(-gate)`` [..., F] (else None)."""

    __slots__ = ("gate_up", "exp_neg")

    def __init__(self, gate_up, exp_neg=None):
        self.gate_up = gate_up
        self.exp_neg = exp_neg


def _exp_neg(xp, g, out=None):
    """``exp(-g)``, its argument clamped where it would overflow (module docstring); a new array
    (or ``out``)."""
    t = xp.negative(g, out=out)
    xp.minimum(t, 80.0 if g.dtype.itemsize <= 4 else 700.0, out=t)
    return xp.exp(t, out=t)


def gate_up_halves(gate_up, what):
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"{what}: the last axis of gate_up {tuple(gate_up.shape)} must be even "
                         "([gate columns ; up columns] of equal width)")
    return gate_up.shape[-1] // 2


def swiglu_forward(gate_up):
    """``y = silu(gate) * up`` with ``gate, up = gate_up[..., :F], gate_up[..., F:]``.

    Returns ``(y, ctx)``: ``y`` [..., F] in ``gate_up``'s dtype (16-bit computed in float32).
    """
    F = gate_up_halves(gate_up, "swiglu_forward")
    k = _kernels(gate_up)  # CuPy float32/bfloat16: the CUDA kernel (kernels/swiglu.cu)
    if k is not None:
        return k.swiglu_forward(gate_up), SwiGLUCtx(gate_up)
    xp = get_array_module(gate_up)
    cdt = compute_dtype(gate_up.dtype)
    a2 = gate_up.reshape(-1, 2 * F)
    N = a2.shape[0]
    y = xp.empty((N, F), dtype=gate_up.dtype)
    lib = compiled.host_library("activations", _SYMBOLS, gate_up)
    if lib is not None:
        kept = xp.empty((N, F), dtype=cdt)
        compiled.run_rows(xp, lib, "swiglu_forward", cdt, (gate_up, y, kept), (), N, F, width=2 * F)
        return y.reshape(gate_up.shape[:-1] + (F,)), SwiGLUCtx(gate_up, kept)

    direct = y.dtype == cdt
    # Host float32/64: exp(-gate) is kept for the backward (one more array of y's size per layer),
    # which then skips its three costliest passes (NumPy's exp, ~8x a multiply); same bits.
    kept = xp.empty((N, F), dtype=cdt) if direct and on_host(xp) else None

    def block(sl):
        g = as_dtype(a2[sl, :F], cdt)
        if kept is None:
            t = _exp_neg(xp, g)
            t += 1.0
        else:
            t = xp.add(_exp_neg(xp, g, out=kept[sl]), 1.0)
        xp.divide(g, t, out=t)  # silu(g)
        xp.multiply(t, as_dtype(a2[sl, F:], cdt), out=y[sl] if direct else t)
        if not direct:
            y[sl] = t

    parallel_map(xp, block, row_blocks(xp, N, 2 * F))
    return y.reshape(gate_up.shape[:-1] + (F,)), SwiGLUCtx(gate_up, kept)


def swiglu_backward(dy, ctx: SwiGLUCtx):
    """``d_gate_up`` [..., 2F] in the forward's layout and dtype:
    ``d_gate = dy * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))`` and ``d_up = dy * silu(g)``."""
    gate_up = ctx.gate_up
    F = gate_up.shape[-1] // 2
    if tuple(dy.shape) != tuple(gate_up.shape[:-1]) + (F,):
        raise ValueError(f"swiglu_backward: dy shape {tuple(dy.shape)} != output shape "
                         f"{tuple(gate_up.shape[:-1]) + (F,)}")
    k = _kernels(dy, gate_up)
    if k is not None:
        return k.swiglu_backward(dy, gate_up)
    xp = get_array_module(dy, gate_up)
    cdt = compute_dtype(gate_up.dtype)
    a2 = gate_up.reshape(-1, 2 * F)
    dy2 = dy.reshape(-1, F)
    N = a2.shape[0]
    d = xp.empty((N, 2 * F), dtype=gate_up.dtype)
    lib = None if ctx.exp_neg is None else compiled.host_library("activations", _SYMBOLS, gate_up, ctx.exp_neg, dy)
    if lib is not None:
        compiled.run_rows(xp, lib, "swiglu_backward", cdt, (gate_up, ctx.exp_neg, dy, d), (), N, F,
                          width=2 * F)
        return d.reshape(gate_up.shape)
    direct = d.dtype == cdt  # float32/float64: the last products written into d's halves (no copies)

    kept = ctx.exp_neg

    def block(sl):
        g = as_dtype(a2[sl, :F], cdt)
        dyb = as_dtype(dy2[sl], cdt)
        e = _exp_neg(xp, g) if kept is None else kept[sl]
        sig = e + 1.0
        xp.divide(1.0, sig, out=sig)  # sigmoid(g)
        e = xp.multiply(e, sig, out=e if kept is None else None)  # 1 - sigmoid(g) (the kept one unchanged)
        e *= g
        e += 1.0
        e *= sig  # silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))
        e *= as_dtype(a2[sl, F:], cdt)
        xp.multiply(e, dyb, out=d[sl, :F] if direct else e)
        sig *= g  # silu(g)
        xp.multiply(sig, dyb, out=d[sl, F:] if direct else sig)
        if not direct:
            d[sl, :F] = e
            d[sl, F:] = sig

    parallel_map(xp, block, row_blocks(xp, N, 2 * F))
    return d.reshape(gate_up.shape)
