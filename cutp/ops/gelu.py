"""GeLU (tanh approximation as in GPT-2, or the exact erf form), plus a fused bias + GeLU.

The exact form evaluates ``erfc`` from :mod:`cutp.ops.erf` (NumPy has none).
"""
from __future__ import annotations

import math

import numpy as np

from cutp.runtime.backend import get_array_module, on_host
from cutp.kernels import dispatch as _kernels

from . import compiled
from .common import as_dtype, col_sum, compute_dtype, flat_blocks, parallel_map, row_blocks
from .erf import erfc

APPROXIMATIONS = ("tanh", "none")

_K = math.sqrt(2.0 / math.pi)  # tanh form: u = K * (x + C x^3)
_C = 0.044715
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


class GeluCtx:
    """The GeLU input (``x``, or the pre-activation ``x + b`` for the fused op), the form, and
    (the fused op's tanh form on the host, else None) ``tanh``: the forward's
    ``tanh(K (x + C x^3))``, so the backward does not evaluate it again."""

    __slots__ = ("x", "approximate", "tanh")

    def __init__(self, x, approximate, tanh=None):
        self.x = x
        self.approximate = approximate
        self.tanh = tanh


def _check_approximate(approximate):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")


def _gelu_tanh(x, xp, out, tanh_out=None):
    """out = 0.5 x (1 + tanh(K (x + C x^3))); x (compute dtype) is not modified. ``tanh_out``:
    where to keep the tanh for the backward (the same arithmetic, so the same bits)."""
    y = xp.multiply(x, x, out=out)
    y *= _C * _K
    y += _K
    y *= x
    if tanh_out is None:
        xp.tanh(y, out=y)
        y += 1.0
    else:
        xp.tanh(y, out=tanh_out)
        xp.add(tanh_out, 1.0, out=y)
    y *= x
    y *= 0.5
    return y


def _gelu_erf(x, xp, out):
    """out = x Phi(x) = 0.5 x erfc(-x / sqrt(2))."""
    y = erfc(x * -_INV_SQRT2)
    y *= 0.5
    return xp.multiply(y, x, out=out)


def _gelu_grad(x, dy, approximate, xp, out, tanh=None):
    """out = dy * gelu'(x); x and dy (compute dtype) are not modified. ``tanh``: the forward's
    tanh of x (tanh form), not modified; evaluated here when None."""
    if approximate == "tanh":
        # gelu'(x) = 0.5 (1 + t) + 0.5 x K (1 + 3 C x^2) (1 - t^2), t = tanh(K (x + C x^3))
        #          = (1 + t) * (0.5 + d (1 - t)),           d = 0.5 x K (1 + 3 C x^2)
        if tanh is None:
            t = x * x
            t *= _C * _K
            t += _K
            t *= x
            xp.tanh(t, out=t)
        else:
            t = tanh
        d = xp.multiply(x, x, out=out)
        d *= 1.5 * _C * _K
        d += 0.5 * _K
        d *= x
        t = xp.subtract(1.0, t, out=None if tanh is not None else t)  # 1 - t
        d *= t
        d += 0.5
        xp.subtract(2.0, t, out=t)  # 1 + t
        d *= t
    else:
        # gelu'(x) = Phi(x) + x phi(x)
        d = xp.multiply(x, x, out=out)
        d *= -0.5
        xp.exp(d, out=d)
        d *= _INV_SQRT_2PI
        d *= x
        p = erfc(x * -_INV_SQRT2)
        p *= 0.5
        d += p
    d *= dy
    return d


def _blocked(kernel, xp, out_dtype, shape, *arrays):
    """Apply ``kernel(*blocks_in_compute_dtype, xp, out_block)`` over flat blocks of the
    same-shaped ``arrays``; returns a new array of ``shape`` and ``out_dtype``."""
    cdt = compute_dtype(out_dtype)
    out = xp.empty(shape, dtype=out_dtype)
    of = out.reshape(-1)
    flats = [a.reshape(-1) for a in arrays]
    direct = out.dtype == cdt

    def block(sl):
        blocks = [as_dtype(f[sl], cdt) for f in flats]
        if direct:
            kernel(*blocks, xp, of[sl])
        else:
            of[sl] = kernel(*blocks, xp, None)

    parallel_map(xp, block, flat_blocks(xp, of.size))
    return out


# ---- compiled CPU path (kernels/cpu/activations.c) ------------------------------------------------
# The tanh form in one pass per element (the NumPy code above: ~10 passes), for C-contiguous
# float32 / float64 host arrays; it keeps the tanh for the backward as the fused NumPy path does
# (the same buffers: planned memory equals measured). The erf form, other dtypes and layouts: NumPy.
_GELU_SYMBOLS = ("gelu_tanh_forward_f32", "gelu_tanh_backward_f32", "gelu_tanh_forward_f64", "gelu_tanh_backward_f64")


def _compiled_gelu(approximate, *arrays):
    return compiled.host_library("activations", _GELU_SYMBOLS, *arrays) if approximate == "tanh" else None


def _gelu_compiled_forward(lib, x2, b):
    """(y, pre, tanh) [N, C] of x2 [N, C] (+ b [C], or None: pre is x2)."""
    xp = get_array_module(x2)
    N, C = x2.shape
    y, t = xp.empty(x2.shape, x2.dtype), xp.empty(x2.shape, x2.dtype)
    pre = x2 if b is None else xp.empty(x2.shape, x2.dtype)
    compiled.run_rows(xp, lib, "gelu_tanh_forward", x2.dtype, (x2, b, None if b is None else pre, t, y), (), N, C)
    return y, pre, t


def _gelu_compiled_backward(lib, pre2, t2, dy2, with_bias: bool):
    """(dx [N, C], db [C] or None): db the blocks' column sums added in block order."""
    xp = get_array_module(pre2)
    N, C = pre2.shape
    dx = xp.empty(pre2.shape, pre2.dtype)
    (db,) = compiled.run_rows(xp, lib, "gelu_tanh_backward", pre2.dtype, (pre2, t2, dy2, dx), (), N, C,
                              parts=(with_bias,))
    return dx, db


def gelu_forward(x, approximate: str = "tanh"):
    """GeLU.

    ``approximate="tanh"`` (GPT-2): ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``;
    ``approximate="none"``: ``0.5 x (1 + erf(x / sqrt(2)))``, evaluated as
    ``0.5 x erfc(-x / sqrt(2))`` to stay accurate for negative x.

    Returns ``(y, ctx)``: ``y`` has ``x``'s shape and dtype (bfloat16 computed in float32);
    ``ctx`` (:class:`GeluCtx`) saves a reference to the input ``x`` only.
    """
    _check_approximate(approximate)
    k = _kernels(x)  # CuPy float32/bfloat16: the CUDA kernel (kernels/gelu.cu)
    if k is not None:
        return k.gelu_forward(x, approximate), GeluCtx(x, approximate)
    xp = get_array_module(x)
    lib = _compiled_gelu(approximate, x) if x.ndim >= 1 else None
    if lib is not None:
        y, _, t = _gelu_compiled_forward(lib, x.reshape(-1, x.shape[-1]), None)
        return y.reshape(x.shape), GeluCtx(x, approximate, t.reshape(x.shape))
    kernel = _gelu_tanh if approximate == "tanh" else _gelu_erf
    y = _blocked(kernel, xp, x.dtype, x.shape, x)
    return y, GeluCtx(x, approximate)


def gelu_backward(dy, ctx: GeluCtx):
    """``dx = dy * gelu'(x)`` in ``x``'s dtype."""
    x = ctx.x
    xp = get_array_module(dy, x)
    if dy.shape != x.shape:
        raise ValueError(f"gelu_backward: dy shape {dy.shape} != x shape {x.shape}")
    k = _kernels(dy, x)
    if k is not None:
        return k.gelu_backward(dy, x, ctx.approximate)
    if ctx.tanh is not None and _compiled_gelu(ctx.approximate, x, ctx.tanh, dy) is not None:
        C = x.shape[-1]
        lib = _compiled_gelu(ctx.approximate, x)
        dx, _ = _gelu_compiled_backward(lib, x.reshape(-1, C), ctx.tanh.reshape(-1, C), dy.reshape(-1, C), False)
        return dx.reshape(x.shape)

    def kernel(xb, dyb, xp, out):
        return _gelu_grad(xb, dyb, ctx.approximate, xp, out)

    return _blocked(kernel, xp, x.dtype, x.shape, x, dy)


def bias_gelu_forward(x, b, approximate: str = "tanh"):
    """Fused ``y = gelu(x + b)`` with ``x`` [..., C] and ``b`` [C].

    Returns ``(y, ctx)``; ``ctx`` saves the pre-activation ``x + b`` (in ``x``'s dtype, as a
    fused GPU kernel would store it; for bfloat16 the sum is rounded to bfloat16 first and
    the GeLU evaluated in float32 on that rounded value, so forward and backward agree).
    """
    _check_approximate(approximate)
    k = _kernels(x, b)
    if k is not None and x.ndim >= 1 and b.shape == x.shape[-1:]:
        y, pre = k.bias_gelu_forward(x, b, approximate)
        return y, GeluCtx(pre, approximate)
    xp = get_array_module(x, b)
    lib = _compiled_gelu(approximate, x, b) if x.ndim >= 1 and b.shape == x.shape[-1:] else None
    if lib is not None:
        y, pre, t = _gelu_compiled_forward(lib, x.reshape(-1, x.shape[-1]), b)
        return y.reshape(x.shape), GeluCtx(pre.reshape(x.shape), approximate, t.reshape(x.shape))
    cdt = compute_dtype(x.dtype)
    kernel = _gelu_tanh if approximate == "tanh" else _gelu_erf
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    bc = as_dtype(b, cdt)
    pre = xp.empty(x2.shape, dtype=x.dtype)
    y = xp.empty(x2.shape, dtype=x.dtype)
    direct = pre.dtype == cdt
    # Host, float32/64, tanh form: the tanh is kept for the backward (one more array of the
    # activation's size per layer, as torch's autograd keeps for its own tanh-GeLU composite):
    # the backward then skips its costliest pass (NumPy's tanh, ~10x a multiply) and four more.
    # Measured: the fused backward ~40% faster. Bit-identical: the same tanh of the same bits.
    tanh = xp.empty(x2.shape, dtype=x.dtype) if direct and approximate == "tanh" and on_host(xp) else None

    def block(sl):
        if tanh is not None:
            _gelu_tanh(xp.add(x2[sl], bc, out=pre[sl]), xp, y[sl], tanh[sl])
        elif direct:
            pb = xp.add(x2[sl], bc, out=pre[sl])
            kernel(pb, xp, y[sl])
        else:
            pre[sl] = as_dtype(x2[sl], cdt) + bc
            y[sl] = kernel(pre[sl].astype(cdt), xp, None)

    parallel_map(xp, block, row_blocks(xp, x2.shape[0], C))
    return y.reshape(x.shape), GeluCtx(pre.reshape(x.shape), approximate,
                                       None if tanh is None else tanh.reshape(x.shape))


def bias_gelu_backward(dy, ctx: GeluCtx):
    """Returns ``(dx, db)``: ``dx = dy * gelu'(x + b)`` in ``x``'s dtype and ``db`` = ``dx``
    summed over all leading dimensions (accumulated in the compute dtype from the unrounded
    ``dx``, then cast to ``x``'s dtype)."""
    pre = ctx.x
    k = _kernels(dy, pre)
    if k is not None and dy.shape == pre.shape:
        return k.bias_gelu_backward(dy, pre, ctx.approximate)
    if ctx.tanh is not None and dy.shape == pre.shape and _compiled_gelu(ctx.approximate, pre, ctx.tanh, dy) is not None:
        C = pre.shape[-1]
        lib = _compiled_gelu(ctx.approximate, pre)
        dx, db = _gelu_compiled_backward(lib, pre.reshape(-1, C), ctx.tanh.reshape(-1, C), dy.reshape(-1, C), True)
        return dx.reshape(pre.shape), db
    xp = get_array_module(dy, pre)
    cdt = compute_dtype(pre.dtype)
    C = pre.shape[-1]
    p2 = pre.reshape(-1, C)
    dy2 = dy.reshape(-1, C)
    dx = xp.empty(p2.shape, dtype=pre.dtype)
    db = xp.zeros(C, dtype=cdt)
    direct = dx.dtype == cdt

    t2 = None if ctx.tanh is None else ctx.tanh.reshape(-1, C)

    def block(sl):
        out = dx[sl] if direct else None
        g = _gelu_grad(as_dtype(p2[sl], cdt), as_dtype(dy2[sl], cdt), ctx.approximate, xp, out,
                       None if t2 is None else t2[sl])
        part = col_sum(xp, g)
        if not direct:
            dx[sl] = g
        return part

    for part in parallel_map(xp, block, row_blocks(xp, p2.shape[0], C)):  # summed in block order
        db += part
    return dx.reshape(pre.shape), as_dtype(db, pre.dtype)
