"""Matrix products of the ops: cuBLAS with 16-bit operands and float32 accumulation on a GPU, the
upcast-and-round emulation of the same on the CPU (which is also its reference).

    c = gemm(a, b, trans_a=False, trans_b=False, out_dtype=None)   # op(a) @ op(b), 2-D, row-major
    gemm(x2, dy2, trans_a=True, out=main_grad, accumulate=True)    # main_grad += x2.T @ dy2

On CuPy arrays of bfloat16, float16 or float32 (kernels enabled, see below) it is one
``cublasGemmEx`` through CuPy's binding ``cupy.cuda.cublas.gemmEx``: the operands as they are (no
float32 copies), the output in the operands' dtype or in float32, CUBLAS_COMPUTE_32F (float32
accumulation: tensor cores for 16-bit operands on sm_80+), and with ``accumulate`` beta = 1 into
the caller's float32 buffer: Megatron's gradient_accumulation_fusion, no temporary of the weight
gradient. float32 operands use CUBLAS_COMPUTE_32F_FAST_TF32 only after :func:`allow_tf32`
(``--allow-tf32``): it changes results, so it is off by default.

Everywhere else (NumPy, float64, ``CUTP_KERNELS=0``) the operands are cast to the compute dtype
(cutp.ops.common: float32 for 16-bit), multiplied by the array module's matmul and the product
rounded once to the output dtype: what cuBLAS computes, up to the order of the float32
additions. Callers that reuse an operand pass :func:`operand` of it, which is that float32 copy on
the CPU (made once) and the array itself on a GPU, so the CPU's arithmetic, and its bits, are the
ones the ops had before this module. One exception: ``accumulate`` into a float32 / float64 NumPy
``out`` of its own dtype is one call of NumPy's BLAS with beta = 1 (cutp.ops.cblas: no temporary,
no second pass; the same math, rounded per K block), unless ``CUTP_CPU_KERNELS=0``.

Why here and not in ``kernels/``: there is no cutp CUDA source, no launcher, no emulated kernel,
only a library call; ``kernels/`` holds cutp's own CUDA kernels. The switch is the kernels' one
(``CUTP_KERNELS=0`` / ``cutp.kernels.use_kernels(False)`` gives the upcast composition on the GPU
too, the reference a GPU check compares with).

CuPy's own matmul (CuPy 14, ``cupy/_core/_routines_linalg.pyx``, ``tensordot_core_v11``) also
calls cublasGemmEx for bfloat16/float16 with CUBLAS_COMPUTE_32F (and
CUBLAS_GEMM_DEFAULT_TENSOR_OP on sm_80+), but always writes C in the operands' dtype with beta 0:
no float32 product of 16-bit operands, no accumulation into main_grad. Hence the direct call.

Row-major to cuBLAS's column-major: a row-major [r, c] array with row stride ld is, to cuBLAS, the
column-major [c, r] matrix (its transpose) with leading dimension ld. So the row-major
``C[m, n] = op(a) @ op(b)`` is the column-major ``C^T[n, m] = op(b)^T op(a)^T``: cuBLAS gets b
first (transb's op and lda = b's row stride), then a, m and n swapped, ldc = n.

The planner's shape-only GPU arrays (cutp.runtime.shape_only) take the same path with a binding
that computes nothing: what it books is what the GPU allocates (the outputs, no upcast copies).
"""
from __future__ import annotations

import types

import numpy as np

from cutp.kernels import kernels_enabled
from cutp.runtime.backend import get_array_module, is_device_array
from cutp.runtime.shape_only import ShapeArray

from .cblas import accumulates, gemm_accumulate
from .common import as_dtype, col_sum, compute_dtype, leading_dimension

# cuBLAS's and CUDA's enums (cublas_api.h: cublasOperation_t, cublasComputeType_t,
# cublasGemmAlgo_t; library_types.h: cudaDataType_t). ABI-stable values, written here so that the
# contract tests' fake checks them against its own copy.
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_GEMM_DEFAULT = -1  # since CUDA 11 the compute type, not the algorithm, selects tensor cores
CUDA_DATA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}  # CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF
INT_MAX = 2 ** 31 - 1  # gemmEx takes int dimensions and leading dimensions

_tf32 = False


def allow_tf32(enabled: bool = True) -> None:
    """Lets float32 GEMMs on a GPU round their operands to TF32 (CUBLAS_COMPUTE_32F_FAST_TF32;
    ``--allow-tf32``). For the rest of the process; the CPU always computes in full float32."""
    global _tf32
    _tf32 = bool(enabled)


def tf32_allowed() -> bool:
    return _tf32


def _cublas_dtype(dtype) -> bool:
    return np.dtype(dtype).name in CUDA_DATA_TYPES


def on_cublas(*arrays) -> bool:
    """Whether a product of these arrays (None entries skipped) runs on cuBLAS: all device arrays
    (CuPy's, or the planner's shape-only GPU arrays) of one dtype, bfloat16, float16 or float32,
    with the kernels enabled."""
    given = [a for a in arrays if a is not None]
    if not given or not all(is_device_array(a) for a in given):
        return False
    dtypes = {np.dtype(a.dtype) for a in given}
    return len(dtypes) == 1 and _cublas_dtype(dtypes.pop()) and kernels_enabled()


def operand(x):
    """What to hand :func:`gemm` for ``x``: on cuBLAS ``x`` itself, elsewhere its copy in the
    compute dtype (float32 for 16-bit ``x``), made once by a caller that uses it in several
    products, as the CPU always computed."""
    return x if on_cublas(x) else as_dtype(x, compute_dtype(x.dtype))


def cupy_cublas():
    """CuPy's cuBLAS binding and the current device's handle (the contract tests replace this)."""
    import cupy  # optional dependency: only a GPU machine has it
    from cupy.cuda import cublas  # optional dependency

    return types.SimpleNamespace(gemmEx=cublas.gemmEx, handle=lambda: cupy.cuda.Device().cublas_handle)


# What the planner's shape-only GPU arrays call: the same host code, no product.
SHAPE_ONLY_CUBLAS = types.SimpleNamespace(gemmEx=lambda *args: None, handle=lambda: 0)


def gemm(a, b, *, trans_a: bool = False, trans_b: bool = False, out=None, out_dtype=None, accumulate: bool = False):
    """``op(a) @ op(b)`` of 2-D row-major arrays, op(x) = x.T where ``trans_x``.

    Args:
        a, b: 2-D arrays of one dtype (on the CPU: any float dtype, computed in the compute
            dtype of ``a``).
        out: the [m, n] C-contiguous result buffer (default: a new array of ``out_dtype``).
        out_dtype: the result's dtype when ``out`` is not given (default ``a``'s); on cuBLAS the
            operands' dtype or float32.
        accumulate: ``out += op(a) @ op(b)`` (``out`` required). A float32 ``out`` of 16-bit or
            float32 operands on cuBLAS: one GEMM with beta = 1. Any other ``out`` (a 16-bit
            gradient buffer): the product rounded to ``out``'s dtype, then added, on every device.

    Returns:
        the result (``out`` when given).
    """
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != kb:
        raise ValueError(f"gemm: op(a) is {m} x {k}, op(b) is {kb} x {n}")
    if accumulate and out is None:
        raise ValueError("gemm: accumulate=True adds into `out`; give it")
    if out is not None and tuple(out.shape) != (m, n):
        raise ValueError(f"gemm: out has shape {tuple(out.shape)}, the product is {m} x {n}")
    if on_cublas(a, b):
        dtype = np.dtype(a.dtype)
        fused = out is None or out.dtype in (dtype, np.float32)
        if accumulate and out.dtype != np.float32:
            fused = False
        if fused:
            if out is None:
                out = get_array_module(a, b).empty((m, n), dtype if out_dtype is None else out_dtype)
            return _cublas_gemm(a, b, trans_a, trans_b, out, accumulate)
        c = _cublas_gemm(a, b, trans_a, trans_b, get_array_module(a, b).empty((m, n), out.dtype), False)
    elif accumulate and accumulates(a, b, out):  # NumPy float32/64: beta = 1 in NumPy's BLAS (cutp.ops.cblas)
        return gemm_accumulate(a, b, trans_a, trans_b, out)
    else:
        cdt, given_dtype = compute_dtype(a.dtype), a.dtype
        lhs, rhs = as_dtype(a, cdt), as_dtype(b, cdt)
        del a, b  # (the float32 copies go before the product is rounded, as they always went)
        c = (lhs.T if trans_a else lhs) @ (rhs.T if trans_b else rhs)
        del lhs, rhs
        if out is None:
            return as_dtype(c, given_dtype if out_dtype is None else out_dtype)
    if accumulate:
        out += as_dtype(c, out.dtype)
    else:
        out[...] = c
    return out


def _as_operand(x):
    """``x`` itself when cuBLAS can read it (unit stride along rows, row stride >= columns), else a
    C-contiguous copy (same dtype)."""
    rows, cols = x.shape
    if (cols <= 1 or x.strides[1] == x.itemsize) and (rows <= 1 or x.strides[0] >= cols * x.itemsize) \
            and (rows <= 1 or x.strides[0] % x.itemsize == 0):
        return x
    return x.copy()


def _cublas_gemm(a, b, trans_a, trans_b, out, accumulate):
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if out.dtype not in (a.dtype, np.float32) or not out.flags.c_contiguous:
        raise ValueError(f"gemm: out must be C-contiguous of {a.dtype} or float32, got {out.dtype}")
    if max(m, n, k, *a.shape, *b.shape) > INT_MAX:
        raise ValueError(f"gemm: {m} x {n} x {k} exceeds cublasGemmEx's 32-bit dimensions; split the product")
    if m == 0 or n == 0:
        return out
    if k == 0:
        if not accumulate:
            out[...] = 0
        return out
    a, b = _as_operand(a), _as_operand(b)
    lib = SHAPE_ONLY_CUBLAS if isinstance(a, ShapeArray) else cupy_cublas()
    compute = CUBLAS_COMPUTE_32F_FAST_TF32 if (a.dtype == np.float32 and _tf32) else CUBLAS_COMPUTE_32F
    # alpha and beta: host float32 scalars (the compute type's), read before gemmEx returns
    alpha = np.ones((), np.float32)
    beta = np.array(1.0 if accumulate else 0.0, np.float32)
    operand_type = CUDA_DATA_TYPES[np.dtype(a.dtype).name]
    lib.gemmEx(lib.handle(), CUBLAS_OP_T if trans_b else CUBLAS_OP_N, CUBLAS_OP_T if trans_a else CUBLAS_OP_N,
               n, m, k, alpha.ctypes.data, b.data.ptr, operand_type, leading_dimension(b),
               a.data.ptr, operand_type, leading_dimension(a), beta.ctypes.data,
               out.data.ptr, CUDA_DATA_TYPES[np.dtype(out.dtype).name], n, compute, CUBLAS_GEMM_DEFAULT)
    return out


def column_sums(a, out=None):
    """The sums over the rows of a 2-D ``a`` ([n] in the compute dtype), added into ``out`` when
    given. cuBLAS: a GEMM ``ones[1, rows] @ a`` with float32 output (beta = 1 into a float32
    ``out``), no float32 copy of ``a``. Elsewhere ``col_sum`` of ``a`` (pass :func:`operand` of it:
    the GEMV ``ones @ a`` in the compute dtype, as the ops always summed)."""
    if on_cublas(a):
        xp = get_array_module(a)
        ones = xp.ones((1, a.shape[0]), a.dtype)  # exact in every dtype: the sums are float32's
        if out is not None and out.dtype == np.float32 and out.flags.c_contiguous:
            gemm(ones, a, out=out.reshape(1, -1), accumulate=True)
            return out
        s = gemm(ones, a, out_dtype=np.float32).reshape(-1)
    else:
        s = col_sum(get_array_module(a), as_dtype(a, compute_dtype(a.dtype)))
    if out is None:
        return s
    out += s
    return out
