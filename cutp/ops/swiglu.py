"""SwiGLU on a fused gate/up projection: ``y = silu(gate) * up`` (Llama's MLP activation).

Layout: the last axis of ``gate_up`` [..., 2F] holds this rank's F gate columns, then its F up
columns (Megatron's ``[gate_r ; up_r]`` per tensor-parallel rank, see anchors-llama §2.1; at one
rank ``cat(gate_proj, up_proj)``). The chunk is taken on the local tensor, so a TP shard of the
fused weight must be ``[gate_r ; up_r]``, not a slice of ``[gate ; up]``.

``silu(g) = g * sigmoid(g)`` with the sigmoid evaluated from ``e = exp(-|g|)`` (never overflows):
``sigmoid(g) = 1/(1+e)`` for ``g >= 0``, ``e/(1+e)`` below; ``1 - sigmoid(g)`` the other way round,
so the derivative's ``1 - sigmoid`` loses nothing to cancellation either.
"""
from __future__ import annotations

from cutp.runtime.backend import get_array_module

from ._common import as_dtype, compute_dtype, parallel_map, row_blocks


class SwiGLUCtx:
    """The fused pre-activation ``gate_up`` (a reference): all the backward needs."""

    __slots__ = ("gate_up",)

    def __init__(self, gate_up):
        self.gate_up = gate_up


def _sigmoid_pair(xp, g):
    """``(sigmoid(g), 1 - sigmoid(g))``, both without overflow or cancellation."""
    e = xp.exp(-xp.abs(g))
    den = e + 1.0
    pos = g >= 0
    sig = xp.where(pos, 1.0, e)
    sig /= den
    rest = xp.where(pos, e, 1.0)
    rest /= den
    return sig, rest


def _halves(gate_up, what):
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"{what}: the last axis of gate_up {tuple(gate_up.shape)} must be even "
                         "([gate columns ; up columns] of equal width)")
    return gate_up.shape[-1] // 2


def swiglu_forward(gate_up):
    """``y = silu(gate) * up`` with ``gate, up = gate_up[..., :F], gate_up[..., F:]``.

    Returns ``(y, ctx)``: ``y`` [..., F] in ``gate_up``'s dtype (16-bit computed in float32).
    """
    F = _halves(gate_up, "swiglu_forward")
    xp = get_array_module(gate_up)
    cdt = compute_dtype(gate_up.dtype)
    a2 = gate_up.reshape(-1, 2 * F)
    N = a2.shape[0]
    y = xp.empty((N, F), dtype=gate_up.dtype)

    def block(sl):
        g = as_dtype(a2[sl, :F], cdt)
        sig, _ = _sigmoid_pair(xp, g)
        sig *= g
        sig *= as_dtype(a2[sl, F:], cdt)
        y[sl] = sig

    parallel_map(xp, block, row_blocks(xp, N, 2 * F))
    return y.reshape(gate_up.shape[:-1] + (F,)), SwiGLUCtx(gate_up)


def swiglu_backward(dy, ctx: SwiGLUCtx):
    """``d_gate_up`` [..., 2F] in the forward's layout and dtype:
    ``d_gate = dy * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))`` and ``d_up = dy * silu(g)``."""
    gate_up = ctx.gate_up
    F = gate_up.shape[-1] // 2
    if tuple(dy.shape) != tuple(gate_up.shape[:-1]) + (F,):
        raise ValueError(f"swiglu_backward: dy shape {tuple(dy.shape)} != output shape "
                         f"{tuple(gate_up.shape[:-1]) + (F,)}")
    xp = get_array_module(dy, gate_up)
    cdt = compute_dtype(gate_up.dtype)
    a2 = gate_up.reshape(-1, 2 * F)
    dy2 = dy.reshape(-1, F)
    N = a2.shape[0]
    d = xp.empty((N, 2 * F), dtype=gate_up.dtype)

    def block(sl):
        g = as_dtype(a2[sl, :F], cdt)
        u = as_dtype(a2[sl, F:], cdt)
        dyb = as_dtype(dy2[sl], cdt)
        sig, rest = _sigmoid_pair(xp, g)
        rest *= g
        rest += 1.0
        rest *= sig  # silu'(g)
        rest *= u
        rest *= dyb
        d[sl, :F] = rest
        sig *= g  # silu(g)
        sig *= dyb
        d[sl, F:] = sig

    parallel_map(xp, block, row_blocks(xp, N, 2 * F))
    return d.reshape(gate_up.shape)
