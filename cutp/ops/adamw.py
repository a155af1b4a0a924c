"""AdamW update (decoupled weight decay, PyTorch's formulation) over flat buffers.

    g  = grad * grad_scale                  (grad_scale folds in clipping and loss scaling)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p  = p * (1 - lr * wd * decay_mask)     (decay_mask: 1 for weights, 0 for biases/LN/embeddings;
                                             None: every element decays, as cutp.optim uses it on
                                             the range of decayed parameters)
    p -= lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)

All arrays are flat and of equal length; m and v are float32 (float64 for float64 params).
Updates p, m and v in place. The CUDA kernel `adamw_*` computes exactly this per element; on the
CPU, float32 / float64 arrays of one dtype take kernels/cpu/adamw.c, one pass that rounds as the
NumPy passes below do (their bits; CUTP_CPU_KERNELS=0: the NumPy passes). Measured on GPT-2's
124M float32 parameters, one thread, CPU time: 340 -> 90 ms a step.
"""
from __future__ import annotations

import ctypes

import numpy as np

from cutp.runtime.backend import get_array_module
from cutp.kernels import dispatch as _kernels

from . import compiled
from .common import flat_blocks, parallel_map

_SYMBOLS = ("adamw_f32", "adamw_f64", "sum_squares_f32", "sum_squares_f64")
ADAMW_BLOCK = 1 << 20  # the compiled kernel's share of the pool: each element alone, any split gives the same bits


def adamw_update(p, g, m, v, decay_mask, *, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0):
    xp = get_array_module(p, g, m, v)
    if not (p.shape == g.shape == m.shape == v.shape) or p.ndim != 1 or (
            decay_mask is not None and decay_mask.shape != p.shape):
        raise ValueError("adamw_update takes flat arrays of equal length")
    # CuPy float32/bfloat16 with float32 m, v: one fused kernel (kernels/adamw.cu)
    k = _kernels(*(a for a in (p, g, decay_mask) if a is not None))
    if k is not None and m.dtype == np.float32 and v.dtype == np.float32:
        k.adamw_update(p, g, m, v, decay_mask, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                       step=step, grad_scale=grad_scale)
        return
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    step_size = lr / bc1
    inv_sqrt_bc2 = 1.0 / np.sqrt(bc2)
    n = p.size
    blocks = flat_blocks(xp, n)
    dt = m.dtype.type
    lib = compiled.host_library("adamw", _SYMBOLS, p, g, m, v) if decay_mask is None else None
    if lib is not None and compiled.writable(p, m, v):
        # kernels/cpu/adamw.c: one pass, the block's passes below in the same order (the same bits);
        # the constants rounded to m's dtype here as the passes below round them
        if xp is np:
            fn = compiled.entry(lib, "adamw", m.dtype)
            consts = [dt(grad_scale), int(grad_scale != 1.0), dt(beta1), dt(1.0 - beta1), dt(beta2), dt(1.0 - beta2),
                      dt(1.0) - dt(lr * weight_decay), int(bool(weight_decay)), dt(inv_sqrt_bc2), dt(eps),
                      dt(step_size)]
            args = compiled.pointers(p, g, m, v) + [c if isinstance(c, int) else compiled.real(m.dtype, c)
                                                    for c in consts]
            parallel_map(xp, lambda s: fn(*args, *compiled.int64s(s.start, s.stop)), flat_blocks(xp, n, ADAMW_BLOCK))
        return

    # Each block makes one pass after another over block-sized arrays that stay in cache, in the
    # order of the formula above (each NumPy pass rounds once, so the order is the bits): g (its
    # copy, or its scaled copy in one pass) and one scratch array t carrying (1 - beta1) g, then
    # (1 - beta2) g^2, then the update. (Two block-sized arrays whatever grad_scale is: the
    # planner books the step's memory from the shapes, never from values.)
    def block(s):
        if grad_scale != 1.0:
            gb = xp.multiply(g[s], dt(grad_scale), dtype=m.dtype)
        else:
            gb = g[s].astype(m.dtype, copy=True)
        mb, vb, pb = m[s], v[s], p[s]
        t = xp.multiply(gb, dt(1.0 - beta1))
        mb *= dt(beta1)
        mb += t
        vb *= dt(beta2)
        xp.multiply(gb, gb, out=t)
        t *= dt(1.0 - beta2)
        vb += t
        if weight_decay and decay_mask is None:
            pb *= p.dtype.type(1.0) - p.dtype.type(lr * weight_decay)  # the mask path's rounding (x 1)
        elif weight_decay:
            pb *= 1.0 - (lr * weight_decay) * decay_mask[s]
        # denominator sqrt(v_hat) + eps, then the step
        xp.sqrt(vb, out=t)
        t *= dt(inv_sqrt_bc2)
        t += dt(eps)
        xp.divide(mb, t, out=t)
        t *= dt(step_size)
        pb -= t.astype(p.dtype, copy=False)

    parallel_map(xp, block, blocks)


def sum_of_squares(g):
    """``sum(g**2)`` of a float32 / float64 host array in float64 through kernels/cpu/adamw.c (one
    pass; blocks of ADAMW_BLOCK elements on the ops' pool, their sums added in block order: the
    same bits at any thread count), or None where the kernel does not take ``g`` (the caller's
    NumPy code runs). The planner's shape-only arrays: 0.0, nothing booked (nothing allocated)."""
    flat = g.reshape(-1)
    lib = compiled.host_library("adamw", _SYMBOLS, flat)
    if lib is None:
        return None
    if type(flat) is not np.ndarray:
        return np.float64(0.0)
    fn = compiled.entry(lib, "sum_squares", flat.dtype)
    fn.restype = ctypes.c_double
    data = compiled.ptr(flat)
    parts = parallel_map(np, lambda s: fn(data, *compiled.int64s(s.start, s.stop)), flat_blocks(np, flat.size, ADAMW_BLOCK))
    total = np.float64(0.0)
    for part in parts:  # in block order
        total += part
    return total
