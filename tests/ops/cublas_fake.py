"""A stand-in for CuPy and its cuBLAS binding, for cutp.ops.gemm's contract tests on the CPU.

`FakeCupyArray` is a NumPy array that cutp takes for a CuPy array (its type's module is cupy's);
`fake_cupy()` is the `cupy` module such arrays come from (its allocations are tracked: `Memory`).
`FakeCublas.gemmEx` has CuPy 14's signature (cupy_backends/cuda/libs/cublas.pyx):

    gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
           ldc, computeType, algo)

and does what cuBLAS does with it, from the raw pointers: reads the column-major matrices at the
given leading dimensions out of the live buffers (a read or write past a buffer fails, as a GPU
faults or reads garbage), checks the enums (operand types against the buffers' dtypes, a float32
compute type for 16-bit operands, alpha and beta as host float32), computes
``C = alpha op(A) op(B) + beta C`` in float32 with NumPy and rounds it to C's type. Its enum values
are cuBLAS's and CUDA's (cublas_api.h, library_types.h), written here independently of cutp's.
"""
from __future__ import annotations

import ctypes
import importlib
import sys
import types
import weakref

import ml_dtypes
import numpy as np

GEMM = importlib.import_module("cutp.ops.gemm")  # (the module; cutp.ops.gemm names its function)
OP_N, OP_T = 0, 1
COMPUTE_16F, COMPUTE_32F, COMPUTE_32F_PEDANTIC, COMPUTE_32F_FAST_TF32 = 64, 68, 69, 77
R_32F, R_16F, R_16BF = 0, 2, 14
DTYPE_OF = {R_32F: np.dtype(np.float32), R_16F: np.dtype(np.float16), R_16BF: np.dtype(ml_dtypes.bfloat16)}
HANDLE = 0xC0B1A5
POOL_ROUND = 512  # CuPy's pool rounds every allocation up to this


class CublasContractError(AssertionError):
    """cutp handed cuBLAS something it would reject, misread or fault on."""


class Memory:
    """The live buffers of fake device arrays: their bytes (CuPy's pool rounding) now and at peak,
    and the owner arrays, by address, for gemmEx to read and write."""

    def __init__(self):
        self.owners = {}  # id -> weakref of a buffer's owner array
        self.cur = self.peak = 0

    def track(self, a: np.ndarray) -> None:
        owner = a
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        if id(owner) in self.owners and self.owners[id(owner)]() is owner:
            return
        self.owners[id(owner)] = weakref.ref(owner)
        n = -(-owner.nbytes // POOL_ROUND) * POOL_ROUND
        self.cur += n
        self.peak = max(self.peak, self.cur)
        weakref.finalize(owner, self._release, id(owner), n)

    def _release(self, key, n):
        self.cur -= n
        self.owners.pop(key, None)

    def reset_peak(self) -> None:
        self.peak = self.cur

    def matrix(self, ptr: int, rows: int, cols: int, ld: int, dtype, what: str) -> np.ndarray:
        """The column-major rows x cols matrix at ptr with leading dimension ld, as a writable
        view of the buffer holding it; refused when it is not inside one live buffer of `dtype`."""
        if ld < max(1, rows):
            raise CublasContractError(f"{what}: leading dimension {ld} < rows {rows}")
        for ref in list(self.owners.values()):
            owner = ref()
            if owner is None:
                continue
            start = owner.__array_interface__["data"][0]
            if start <= ptr < start + max(owner.nbytes, 1):
                if owner.dtype != dtype:
                    raise CublasContractError(f"{what}: its type says {dtype}, the buffer holds {owner.dtype}")
                flat = np.asarray(owner).reshape(-1).view(np.uint8)
                try:
                    return np.ndarray((rows, cols), dtype, buffer=flat, offset=ptr - start,
                                      strides=(dtype.itemsize, ld * dtype.itemsize))
                except (TypeError, ValueError) as e:
                    raise CublasContractError(f"{what}: {rows} x {cols} at ld {ld} runs past its buffer of "
                                              f"{owner.nbytes} bytes ({e})") from None
        raise CublasContractError(f"{what}: pointer {ptr:#x} is in no live device buffer")


MEMORY = Memory()


class FakeCupyArray(np.ndarray):
    """A NumPy array cutp takes for CuPy's (`type(x).__module__` is cupy's); `.data.ptr` is its
    address, as on a GPU."""

    def __array_finalize__(self, obj):
        MEMORY.track(self)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def get(self):
        return np.array(self.view(np.ndarray))


FakeCupyArray.__module__ = "cupy._core.core"


def device(a) -> FakeCupyArray:
    """A device copy of a host array."""
    return np.array(a).view(FakeCupyArray)


def host(a) -> np.ndarray:
    return np.array(np.asarray(a).view(np.ndarray))


def fake_cupy() -> types.ModuleType:
    """The `cupy` module of FakeCupyArrays: its allocations make fake device arrays."""
    mod = types.ModuleType("cupy")
    for name in ("empty", "zeros", "ones", "full"):
        def make(*args, _fn=getattr(np, name), **kwargs):
            return _fn(*args, **kwargs).view(FakeCupyArray)
        setattr(mod, name, make)
    mod.asarray = lambda a, dtype=None: np.asarray(a, dtype).view(FakeCupyArray)
    mod.ascontiguousarray = lambda a, dtype=None: np.ascontiguousarray(a, dtype).view(FakeCupyArray)
    mod.ndarray = FakeCupyArray
    mod.__getattr__ = lambda name: getattr(np, name)
    return mod


class FakeCublas:
    """cuBLAS's gemmEx on fake device arrays (see the module docstring). `calls` records each
    call's arguments by name; `tf32` says whether CUBLAS_COMPUTE_32F_FAST_TF32 is expected."""

    def __init__(self, tf32: bool = False):
        self.calls = []
        self.tf32 = tf32

    def handle(self):
        return HANDLE

    def gemmEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
               computeType, algo):
        args = dict(transa=transa, transb=transb, m=m, n=n, k=k, A=A, Atype=Atype, lda=lda, B=B, Btype=Btype,
                    ldb=ldb, C=C, Ctype=Ctype, ldc=ldc, computeType=computeType, algo=algo)
        if handle != HANDLE:
            raise CublasContractError(f"handle {handle!r} is not the device's cuBLAS handle")
        for name, v in (("m", m), ("n", n), ("k", k), ("lda", lda), ("ldb", ldb), ("ldc", ldc)):
            if not isinstance(v, (int, np.integer)) or not 0 <= v < 2 ** 31:
                raise CublasContractError(f"{name} = {v!r} is not a 32-bit int")
        if transa not in (OP_N, OP_T) or transb not in (OP_N, OP_T):
            raise CublasContractError(f"transa {transa}, transb {transb}: CUBLAS_OP_N (0) or CUBLAS_OP_T (1)")
        if Atype != Btype or Atype not in DTYPE_OF:
            raise CublasContractError(f"Atype {Atype}, Btype {Btype}: one of {sorted(DTYPE_OF)} for both")
        if Ctype not in (Atype, R_32F):
            raise CublasContractError(f"Ctype {Ctype} with operands {Atype}: the operands' type or CUDA_R_32F")
        if Atype in (R_16F, R_16BF) and computeType not in (COMPUTE_32F, COMPUTE_32F_PEDANTIC):
            raise CublasContractError(f"16-bit operands with computeType {computeType}: float32 accumulation "
                                      f"(CUBLAS_COMPUTE_32F = {COMPUTE_32F}) wanted")
        if Atype == R_32F and computeType != (COMPUTE_32F_FAST_TF32 if self.tf32 else COMPUTE_32F):
            raise CublasContractError(f"float32 operands with computeType {computeType} (TF32 allowed: {self.tf32})")
        if algo not in (-1, 99):
            raise CublasContractError(f"algo {algo}: CUBLAS_GEMM_DEFAULT(_TENSOR_OP)")
        a_rows, a_cols = (m, k) if transa == OP_N else (k, m)
        b_rows, b_cols = (k, n) if transb == OP_N else (n, k)
        a = MEMORY.matrix(A, a_rows, a_cols, lda, DTYPE_OF[Atype], "A")
        b = MEMORY.matrix(B, b_rows, b_cols, ldb, DTYPE_OF[Btype], "B")
        c = MEMORY.matrix(C, m, n, ldc, DTYPE_OF[Ctype], "C")
        # alpha, beta: host float32 scalars for a float32 compute type
        args["alpha"] = ctypes.c_float.from_address(alpha).value
        args["beta"] = ctypes.c_float.from_address(beta).value
        self.calls.append(args)
        op_a = a.astype(np.float32) if transa == OP_N else a.astype(np.float32).T
        op_b = b.astype(np.float32) if transb == OP_N else b.astype(np.float32).T
        result = np.float32(args["alpha"]) * (op_a @ op_b)
        if args["beta"] != 0:
            result = result + np.float32(args["beta"]) * c.astype(np.float32)
        c[...] = result.astype(c.dtype)


def install(monkeypatch, cublas: FakeCublas) -> None:
    """cutp.ops.gemm calls `cublas`; `import cupy` gives the fake module."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(GEMM, "cupy_cublas", lambda: cublas)


def planted(cublas: FakeCublas, change) -> types.SimpleNamespace:
    """The binding cutp gets, with one argument of every gemmEx call changed by
    `change(args: list) -> None` (a planted mistake in what cutp hands cuBLAS)."""

    def gemm_ex(*args):
        args = list(args)
        change(args)
        return cublas.gemmEx(*args)

    return types.SimpleNamespace(gemmEx=gemm_ex, handle=cublas.handle, calls=cublas.calls)
