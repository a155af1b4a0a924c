"""``cupy.cuda.cublas`` of the stand-in: gemmEx computed from pointers as cuBLAS defines it.

Column-major operands: op(A) is m x k, op(B) is k x n, C is m x n with leading dimensions lda,
ldb, ldc (elements between columns); C = alpha op(A) op(B) + beta C, C not read when beta is 0.
The arguments are checked as cuBLAS checks them (CUBLAS_STATUS_INVALID_VALUE: a leading
dimension below the rows of the stored matrix, a negative size), and every element read or
written must lie in one live device allocation (on a GPU an address outside reads another
buffer, or faults). Computed in float32 (CUBLAS_COMPUTE_32F; FAST_TF32 is computed in float32
too, not rounded to TF32), the result rounded to C's type.
"""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from . import tracking

CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_OP_C = 0, 1, 2
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
# the CUDA data types (cupy.cuda.runtime's CUDA_R_*: CuPy's cublas module has none)
_R_32F, _R_64F, _R_16F, _R_16BF = 0, 1, 2, 14
_TYPES = {_R_32F: np.dtype(np.float32), _R_64F: np.dtype(np.float64), _R_16F: np.dtype(np.float16),
          _R_16BF: np.dtype(ml_dtypes.bfloat16)}
_COMPUTE = {68: np.float32, 77: np.float32, 64: np.float16, 70: np.float64}
_handles: dict[int, object] = {}
_STATUS = {7: "INVALID_VALUE", 13: "EXECUTION_FAILED (an illegal address on a GPU)", 14: "INTERNAL_ERROR"}


class CUBLASError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"CUBLAS_STATUS_{_STATUS.get(status, status)}: {message}")
        self.status = status


def create() -> int:
    h = 0x5EED00 + len(_handles) + 1
    _handles[h] = tracking.get_current_stream()
    return h


def setStream(handle: int, stream: int) -> None:
    for s in list(tracking._streams.values()):
        if s.ptr == stream:
            _handles[handle] = s
            return
    raise CUBLASError(7, f"setStream: no stream with ptr {stream:#x}")


def getStream(handle: int) -> int:
    return _handles[handle].ptr


def _matrix(what, ptr, dtype, rows, cols, ld, where):
    """The column-major rows x cols matrix at ptr with leading dimension ld, as a NumPy view."""
    if ld < max(1, rows):
        raise CUBLASError(7, f"gemmEx at {where}: ld{what} = {ld} is less than the {rows} rows of {what} as stored "
                             "(column-major); cuBLAS refuses it")
    if rows == 0 or cols == 0:
        return np.zeros((rows, cols), dtype)
    alloc = tracking.find(ptr)
    item = dtype.itemsize
    last = ptr + ((rows - 1) + (cols - 1) * ld + 1) * item
    if alloc is None:
        raise CUBLASError(13, f"gemmEx at {where}: {what} = {ptr:#x} is not in device memory")
    if last > alloc.ptr + alloc.requested:
        raise CUBLASError(13, f"gemmEx at {where}: {what} ({rows} x {cols}, ld{what} = {ld}, {dtype}) reaches "
                              f"{last - alloc.ptr - alloc.requested} bytes past the end of its {alloc.requested}-byte "
                              "allocation (a wrong leading dimension or size)")
    if (ptr - alloc.ptr) % item:
        raise CUBLASError(7, f"gemmEx at {where}: {what} is not aligned to its {item}-byte type")
    return np.ndarray((rows, cols), dtype, buffer=alloc.buf, offset=ptr - alloc.ptr, strides=(item, ld * item))


def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
           computeType, algo):
    where = tracking.place()
    if min(m, n, k) < 0:
        raise CUBLASError(7, f"gemmEx at {where}: negative size m={m} n={n} k={k}")
    for what, t in (("Atype", Atype), ("Btype", Btype), ("Ctype", Ctype)):
        if t not in _TYPES:
            raise CUBLASError(7, f"gemmEx at {where}: {what} = {t} is not a CUDA data type the stand-in knows")
    if Atype != Btype:
        raise CUBLASError(7, f"gemmEx at {where}: Atype {Atype} != Btype {Btype} (not a supported combination)")
    if Ctype not in (Atype, _R_32F) or computeType not in _COMPUTE:
        raise CUBLASError(7, f"gemmEx at {where}: Ctype {Ctype} / computeType {computeType} not supported for Atype "
                             f"{Atype}")
    at, ct = _TYPES[Atype], _TYPES[Ctype]
    a_rows, a_cols = (m, k) if transa == CUBLAS_OP_N else (k, m)
    b_rows, b_cols = (k, n) if transb == CUBLAS_OP_N else (n, k)
    a = _matrix("A", A, at, a_rows, a_cols, lda, where)
    b = _matrix("B", B, at, b_rows, b_cols, ldb, where)
    c = _matrix("C", C, ct, m, n, ldc, where)
    al = ctypes.c_float.from_address(alpha).value  # host pointers (CUBLAS_POINTER_MODE_HOST)
    be = ctypes.c_float.from_address(beta).value
    stream = _handles.get(handle) or tracking.get_current_stream()
    tracking.access([a, b] + ([c] if be != 0 else []), "r", stream, where)
    opa = a.astype(np.float32) if transa == CUBLAS_OP_N else a.astype(np.float32).T
    opb = b.astype(np.float32) if transb == CUBLAS_OP_N else b.astype(np.float32).T
    r = np.float32(al) * (opa @ opb) if m and n else np.zeros((m, n), np.float32)
    if be != 0:
        r = r + np.float32(be) * c.astype(np.float32)
    tracking.access([c], "w", stream, where)
    c[...] = r.astype(ct)
    tracking.CALLS["cublas gemmEx"] += 1
