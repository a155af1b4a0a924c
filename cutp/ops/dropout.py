"""Dropout with a counter-based RNG: bit-identical masks on NumPy, CuPy and in CUDA kernels.

The keep-mask of element ``i`` (its flat, C-order index in the tensor) under ``(seed, offset)``:

    c = (offset + i + 1) mod 2**64
    z = (seed + c * 0x9E3779B97F4A7C15) mod 2**64        # SplitMix64 state after c steps
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2**64
    z =   z ^ (z >> 31)                                   # SplitMix64 output
    u = z >> 40                                           # top 24 bits, u / 2**24 in [0, 1)
    keep = u >= ceil(p * 2**24)                           # i.e. u / 2**24 >= p, exactly

i.e. ``z`` is the ``(offset + i)``-th output (counting from 0) of SplitMix64 seeded with
``seed``: the same ``(seed, offset)`` always gives the same mask, and a caller that advances
``offset`` by the number of elements after each call never reuses random numbers. ``seed``
and ``offset`` are Python ints taken modulo 2**64. The threshold ``ceil(p * 2**24)`` is an
integer computed on the host (``p * 2**24`` is exact in float64), so a CUDA kernel compares
integers and never depends on float rounding:

    __device__ bool keep(uint64_t seed, uint64_t offset, uint64_t i, uint32_t thr) {
        uint64_t z = seed + (offset + i + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        return (uint32_t)(z >> 40) >= thr;
    }
"""
from __future__ import annotations

import math

import numpy as np

from cutp.runtime.backend import get_array_module
from cutp.kernels import dispatch as _kernels
from cutp.kernels import dispatch_xp as _kernels_xp
# The threshold rule and the 64-bit wrap are the kernel's contract (kernels/dropout.py): defined
# once there, so this reference and kernels/dropout.cu give the same masks bit for bit.
from cutp.kernels.dropout import MASK64, keep_threshold

from .common import compute_dtype, flat_blocks

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB

_U64 = np.uint64


def splitmix64_reference(seed: int, index: int) -> int:
    """Pure-Python-int reference of the hash: the 64-bit ``z`` for counter ``index`` (=offset+i)."""
    z = (seed + ((index + 1) & MASK64) * GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def random_bits(xp, n: int, seed: int, offset: int):
    """uint64 [n]: the SplitMix64 outputs for counters ``offset .. offset + n - 1``.

    Only uint64 array arithmetic, which wraps silently on NumPy and CuPy (all constants are
    ``np.uint64`` scalars, so nothing is done on Python ints or warns on overflow)."""
    z = xp.arange(n, dtype=xp.uint64)
    z += _U64((offset + 1) & MASK64)
    return _splitmix(xp, z, seed)


def _splitmix(xp, z, seed: int):
    """SplitMix64 of the counters + 1 in z (uint64, overwritten): the hash of the module docstring."""
    z *= _U64(GAMMA)
    z += _U64(seed & MASK64)
    t = xp.empty_like(z)
    xp.right_shift(z, _U64(30), out=t)
    z ^= t
    z *= _U64(MIX1)
    xp.right_shift(z, _U64(27), out=t)
    z ^= t
    z *= _U64(MIX2)
    xp.right_shift(z, _U64(31), out=t)
    z ^= t
    return z


def dropout_mask(xp, shape, p: float, seed: int, offset: int):
    """Bool keep-mask of ``shape``: element with flat C-order index i is kept (True) iff
    ``(splitmix64(seed, offset + i) >> 40) >= ceil(p * 2**24)``, i.e. with probability
    ``1 - p`` (see the module docstring for the exact function)."""
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    k = _kernels_xp(xp)  # CuPy: the CUDA kernel (kernels/dropout.cu), bit-identical
    if k is not None:
        return k.dropout_mask(shape, p, seed, offset)
    n = math.prod(shape)
    thr = _U64(keep_threshold(p))
    keep = xp.empty(n, dtype=bool)
    # NumPy: blocks of ELEMENTWISE_BLOCK counters keep the uint64 temporaries in cache
    for sl in flat_blocks(xp, n):
        z = random_bits(xp, sl.stop - sl.start, seed, offset + sl.start)
        xp.right_shift(z, _U64(40), out=z)
        xp.greater_equal(z, thr, out=keep[sl])
    return keep.reshape(shape)


def dropout_mask_at(xp, counters, p: float, seed: int):
    """The keep-mask of arbitrary counters (a uint64 array of any shape, each the ``offset + i``
    of the element it masks): the same bits `dropout_mask` gives those elements. For masks whose
    elements are not one contiguous run of counters (context parallelism's attention tiles: the
    probabilities of a block of queries against a block of keys, at their global positions)."""
    z = xp.array(counters, dtype=xp.uint64, copy=True)
    z += _U64(1)
    z = _splitmix(xp, z, seed)
    xp.right_shift(z, _U64(40), out=z)
    return z >= _U64(keep_threshold(p))


class DropoutCtx:
    """The keep-mask (None when nothing was dropped) and the scale ``1 / (1 - p)`` (0 for p == 1)."""

    __slots__ = ("mask", "scale")

    def __init__(self, mask, scale):
        self.mask = mask
        self.scale = scale


def _apply(x, mask, scale, xp):
    cdt = compute_dtype(x.dtype)
    if x.dtype == cdt:
        y = xp.multiply(x, mask)
    else:
        y = x.astype(cdt)
        y *= mask
    y *= scale
    return y if y.dtype == x.dtype else y.astype(x.dtype)


def dropout_forward(x, p: float, seed: int, offset: int):
    """``y = (x * mask) * scale`` with ``mask = dropout_mask(xp, x.shape, p, seed, offset)``
    and ``scale = 1 / (1 - p)`` (computed once in float64 and applied as a multiplication in
    the compute dtype; dropped elements are +-0).

    ``p == 0`` returns ``x`` itself (no copy, no random numbers) and a ctx with ``mask=None``;
    ``p == 1`` drops everything (``y`` zeros). ``y`` has ``x``'s dtype (bfloat16 is scaled in
    float32 and rounded once). Returns ``(y, ctx)``; ctx (:class:`DropoutCtx`) saves the bool
    mask and the scale. The caller advances ``offset`` (e.g. by ``x.size``) between calls.
    """
    xp = get_array_module(x)
    p = float(p)
    keep_threshold(p)  # validates p
    if p == 0.0:
        return x, DropoutCtx(None, 1.0)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    k = _kernels(x)
    if k is not None:
        y, mask = k.dropout_forward(x, p, seed, offset)
        return y, DropoutCtx(mask, scale)
    mask = dropout_mask(xp, x.shape, p, seed, offset)
    return _apply(x, mask, scale, xp), DropoutCtx(mask, scale)


def dropout_forward_rows(x, p: float, seed: int, row_offsets):
    """:func:`dropout_forward` with the mask of each row ``x[b]`` drawn at its own offset,
    ``row_offsets[b]`` (rows that are not contiguous in the counter space: the attention's
    probabilities of a rank's heads, at their global heads' places). Offsets that follow each
    other (``row_offsets[b] = row_offsets[0] + b * x[0].size``) give :func:`dropout_forward`'s
    mask exactly, and are drawn in one piece."""
    xp = get_array_module(x)
    offsets = [int(o) for o in row_offsets]
    if len(offsets) != x.shape[0]:
        raise ValueError(f"dropout_forward_rows: {len(offsets)} offsets for {x.shape[0]} rows")
    row = math.prod(x.shape[1:])
    if float(p) == 0.0 or all(o == offsets[0] + b * row for b, o in enumerate(offsets)):
        return dropout_forward(x, p, seed, offsets[0] if offsets else 0)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    mask = xp.stack([dropout_mask(xp, x.shape[1:], p, seed, o) for o in offsets])
    return _apply(x, mask, scale, xp), DropoutCtx(mask, scale)


def dropout_forward_mask(x, p: float, mask):
    """:func:`dropout_forward` with a keep-mask drawn by the caller (of x's shape; e.g. pieces
    of `dropout_mask` at the global positions of a context-parallel rank's tokens)."""
    xp = get_array_module(x)
    if float(p) == 0.0:
        return x, DropoutCtx(None, 1.0)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return _apply(x, mask, scale, xp), DropoutCtx(mask, scale)


def dropout_backward(dy, ctx: DropoutCtx):
    """``dx = (dy * mask) * scale`` in ``dy``'s dtype; with ``ctx.mask is None`` (p == 0)
    returns ``dy`` itself."""
    if ctx.mask is None:
        return dy
    k = _kernels(dy)
    if k is not None and ctx.mask.shape == dy.shape and ctx.mask.dtype == bool and ctx.mask.flags.c_contiguous:
        return k.dropout_apply(dy, ctx.mask, ctx.scale)
    return _apply(dy, ctx.mask, ctx.scale, get_array_module(dy))
