"""NumPy's own BLAS called directly for the one product ``numpy.matmul`` cannot make:
``out += op(a) @ op(b)`` in the GEMM itself (beta = 1), the CPU's gradient_accumulation_fusion.

Why: a weight gradient is added into its main_grad buffer. Through NumPy that is a product into a
new [in, out] temporary and a second pass adding it (for GPT-2's tied 50,304 x 768 head, a 154 MB
temporary, fresh pages every step). ``cblas_?gemm`` with beta = 1 adds as it goes. Measured on
GPT-2's step (1 thread, CPU time, float32): the head's weight gradient 875 -> 843 ms, the layers'
1.5-2.5 % each; ~1.4 % of the step's GEMM time.

Which BLAS: the one NumPy loaded (cutp.runtime.threads.blas_library, the library whose thread
count cutp sets), only through its ILP64 CBLAS symbols whose integer width is known: NumPy's
bundled scipy-openblas (``scipy_cblas_sgemm64_``, 64-bit ints) or an OpenBLAS built with the
``64_`` suffix. Any other BLAS, ``CUTP_CPU_KERNELS=0``, or operands it cannot read as they are:
None from :func:`gemm_routine`, and the caller's NumPy code runs (the reference).

Bits: with beta = 1 OpenBLAS adds each K block's partial product into ``out`` (measured on this
Zen 3 machine's kernels: up to K = 320 (float32) / 256 (float64) the bits of ``out += a.T @ b``,
past that not), so the sum over a longer K rounds differently: the same math within float
rounding (relative 1e-7 / 2e-16 of the largest entry), not the same bits. Every call of a
shape rounds the same way, whatever the thread count (OpenBLAS splits M and N over threads, never
K).
"""
from __future__ import annotations

import ctypes

import numpy as np

from cutp.runtime.threads import blas_library

from . import compiled
from .common import leading_dimension

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # cblas.h's CBLAS_ORDER / CBLAS_TRANSPOSE
_NAMES = {np.dtype(np.float32): ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
          np.dtype(np.float64): ("scipy_cblas_dgemm64_", "cblas_dgemm64_")}
_REAL = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}
_found: dict = {}  # dtype -> the ctypes function, or None


def _routine(dtype):
    dtype = np.dtype(dtype)
    if dtype not in _found:
        blas, fn = blas_library(), None
        for name in _NAMES[dtype]:
            fn = None if blas is None else getattr(blas.lib, name, None)
            if fn is not None:
                i64, real = ctypes.c_int64, _REAL[dtype]
                fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, real, ctypes.c_void_p, i64,
                               ctypes.c_void_p, i64, real, ctypes.c_void_p, i64]
                fn.restype = None
                break
        _found[dtype] = fn
    return _found[dtype]


def found(dtype) -> bool:
    """Whether the loaded BLAS exports the cblas GEMM of `dtype` (`python -m cutp info` says)."""
    return np.dtype(dtype) in _NAMES and _routine(dtype) is not None


def _row_major(x) -> bool:
    """Whether a 2-D operand is row-major with unit column stride (its row stride the BLAS's
    leading dimension: any value >= its columns, in whole elements)."""
    rows, cols = x.shape
    return (cols <= 1 or x.strides[1] == x.itemsize) and (rows <= 1 or (
        x.strides[0] >= cols * x.itemsize and x.strides[0] % x.itemsize == 0))


def accumulates(a, b, out) -> bool:
    """Whether :func:`gemm_accumulate` takes these arrays: NumPy (or the planner's shape-only host
    arrays: the same branch, nothing computed) float32 / float64, one dtype, ``out`` C-contiguous
    and writable, not overlapping an operand, the operands row-major as they are, the BLAS routine
    found, the kernels on."""
    dtype = np.dtype(out.dtype)
    if dtype not in _NAMES or a.dtype != dtype or b.dtype != dtype or min(out.shape) == 0 or a.size == 0:
        return False
    if not (out.flags.c_contiguous and compiled.writable(out) and _row_major(a) and _row_major(b)):
        return False
    if type(out) is np.ndarray and (np.may_share_memory(out, a) or np.may_share_memory(out, b)):
        return False  # (the BLAS would read what it writes; NumPy's product is made first)
    return compiled.enabled() and _routine(dtype) is not None


def gemm_accumulate(a, b, trans_a: bool, trans_b: bool, out):
    """``out += op(a) @ op(b)`` in one BLAS call (beta = 1); :func:`accumulates` said yes. The
    shape-only arrays of the planner: nothing (no temporary booked, as none is made)."""
    if type(out) is not np.ndarray:
        return out
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    _routine(out.dtype)(ROW_MAJOR, TRANS if trans_a else NO_TRANS, TRANS if trans_b else NO_TRANS, m, n, k, 1.0,
                        a.ctypes.data, leading_dimension(a), b.ctypes.data, leading_dimension(b), 1.0, out.ctypes.data, n)
    return out
