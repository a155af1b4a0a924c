"""cutp's CUDA kernels: loading (NVRTC through ``cupy.RawModule``), host-side launchers, dispatch.

The kernel sources are ``kernels/*.cu``, installed as the package ``cutp.kernels``. Each source
becomes one ``cupy.RawModule``, compiled by NVRTC the first time one of its kernels is launched
on a device and cached by CuPy on disk (``$CUPY_CACHE_DIR``). ``common.cuh`` is inlined into
the source text before compiling, so CuPy's cache key (the source text and the options) changes
whenever the shared header does; the CUDA runtime headers (``cuda_bf16.h``) come from the
``nvidia-cuda-runtime`` wheel or a CUDA toolkit (:func:`find_cuda_include`).

Three layers:

* :class:`Launchers` -- one Python function per operation that checks its arrays on the host
  (array module, dtype float32/bfloat16, C-contiguity, shapes: a mismatch raises
  :class:`KernelArgumentError`, never a silent wrong answer), allocates the outputs with the
  array module of the inputs, computes grid, block and shared memory, and launches. It is
  written against an abstract *module* (anything with ``get_function(name)`` returning a
  callable with ``cupy.RawKernel``'s signature) and an array module ``xp``: on a GPU that is
  ``cupy.RawModule`` and CuPy; in the tests it is ``tests.cuda_emu.EmulatedModule`` and NumPy,
  so this same host code (grid sizing, argument checks, two-pass reductions) runs in CI.
* :func:`dispatch` -- what ``cutp.ops`` calls first: the :class:`Launchers` of the current
  device when the op's arrays are CuPy arrays of one dtype (float32 or bfloat16), C-contiguous,
  and kernels are enabled; otherwise ``None``, and the op runs its array-module generic
  reference (NumPy on the CPU, the CuPy composition on the GPU; float64 always takes that path).
* The switch: ``CUTP_KERNELS=0`` in the environment, or :func:`use_kernels` (a function and a
  context manager), forces the reference composition on the GPU, for tests and benchmarks.

The kernels compute in float32 whatever the storage type; their results agree with the
references to float32 rounding (the reductions add in another order) and are deterministic run
to run: no float atomics anywhere (column sums go through per-block partials and a fixed-order
second pass).
"""
from __future__ import annotations

import glob
import importlib.resources
import math
import os
import re
import threading
from collections import Counter
from typing import Any, Callable

import numpy as np

from .runtime.backend import is_cupy_array
from .runtime.errors import BackendError

__all__ = [
    "Launchers",
    "eligible",
    "KernelArgumentError",
    "KernelLoadError",
    "SOURCES",
    "dispatch",
    "dispatch_xp",
    "kernels_enabled",
    "use_kernels",
    "launch_counts",
    "kernel_source",
    "nvrtc_options",
    "find_cuda_include",
    "cupy_launchers",
    "register_bench_variants",
]

# One RawModule per source file (kernels/<name>.cu).
SOURCES = ("adamw", "cross_entropy", "dropout", "gelu", "layernorm", "reduce", "softmax")

ENV_SWITCH = "CUTP_KERNELS"

# Launch shapes (see each method for the reasoning).
WARP = 32
ELEMENTWISE_THREADS = 256
SOFTMAX_WARP_ROW_MAX = 1024  # rows up to this length: a warp per row; longer: a block per row
LAYERNORM_WARP_ROW_MAX = 2048
ROWS_PER_WARP_BLOCK = 4  # warp-per-row kernels: 4 warps (rows) per block
# Column reductions (bias and LayerNorm parameter gradients) split the rows into chunks so that
# about this many blocks run the first pass. A fixed number (not the device's SM count), so the
# partial sums, and with them the rounding of the result, do not depend on the GPU model.
COLUMN_REDUCTION_BLOCKS = 1024
DEFAULT_MAX_DYNAMIC_SHARED = 48 * 1024


class KernelArgumentError(ValueError):
    """An array handed to a kernel launcher has the wrong type, dtype, layout or shape."""


class KernelLoadError(BackendError):
    """The kernels cannot be compiled on this machine (missing CUDA headers, NVRTC failure)."""


# ------------------------------------------------------------------------------------------------
# The switch
# ------------------------------------------------------------------------------------------------
_setting: bool | None = None  # set by use_kernels(); None: the environment decides
_lock = threading.Lock()


def kernels_enabled() -> bool:
    """Whether ops on CuPy arrays use the CUDA kernels (default yes; ``CUTP_KERNELS=0`` or
    :func:`use_kernels` ``(False)`` select the CuPy reference composition)."""
    if _setting is not None:
        return _setting
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


class use_kernels:
    """Turns the CUDA kernels on or off for ops on CuPy arrays (``None``: back to the default,
    ``$CUTP_KERNELS``).

    As a function call it sets the switch for the rest of the process; as a context manager it
    restores the previous setting on exit::

        cutp.cuda_kernels.use_kernels(False)        # reference composition from now on
        with cutp.cuda_kernels.use_kernels(False):  # only inside the block
            ...
    """

    def __init__(self, enabled: bool | None = True):
        global _setting
        with _lock:
            self._previous = _setting
            _setting = None if enabled is None else bool(enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _setting
        with _lock:
            _setting = self._previous
        return False


# ------------------------------------------------------------------------------------------------
# dtypes
# ------------------------------------------------------------------------------------------------
def _suffix(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return "f32"
    if dtype.name == "bfloat16":
        return "bf16"
    raise KernelArgumentError(f"no kernel for dtype {dtype}")


def _pack(dtype) -> int:
    """Elements per 128-bit chunk: what one thread handles in the elementwise kernels."""
    return 16 // np.dtype(dtype).itemsize


def _is_kernel_dtype(dtype) -> bool:
    return dtype == np.float32 or getattr(dtype, "name", "") == "bfloat16"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, m: int) -> int:
    return _ceil(a, m) * m


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


# ------------------------------------------------------------------------------------------------
# Argument checks
# ------------------------------------------------------------------------------------------------
def _check(xp, what: str, a, *, dtype=None, float_data: bool = False, shape=None) -> None:
    """Raises KernelArgumentError unless `a` is a C-contiguous `xp` array of the given dtype
    (or float32/bfloat16 with float_data) and shape."""
    if not isinstance(a, xp.ndarray):
        raise KernelArgumentError(
            f"{what} must be a {xp.__name__} array (the kernels' array module), got {type(a).__module__}."
            f"{type(a).__name__}"
        )
    if float_data and not _is_kernel_dtype(a.dtype):
        hint = (" (cutp.ops run float64 through their reference composition, without kernels)"
                if a.dtype == np.float64 else "")
        raise KernelArgumentError(f"{what} has dtype {a.dtype}; the kernels take float32 or bfloat16.{hint}")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise KernelArgumentError(f"{what} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    if not a.flags.c_contiguous:
        raise KernelArgumentError(
            f"{what} is not C-contiguous (shape {a.shape}, strides {a.strides}): a kernel sees only the base "
            f"pointer and would read the wrong elements. Pass {xp.__name__}.ascontiguousarray(...)"
        )
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise KernelArgumentError(f"{what} has shape {tuple(a.shape)}, expected {tuple(shape)}")


def _row_vector(xp, what: str, a, n: int, dtype, kind: str):
    """A per-row vector (statistics, targets, scales) of n elements as a contiguous 1-D array of
    `dtype`, converted from any dtype of the right kind ('f' float, 'i' integer)."""
    if not isinstance(a, xp.ndarray):
        raise KernelArgumentError(f"{what} must be a {xp.__name__} array, got {type(a).__name__}")
    ok = (a.dtype.kind == "f" or _is_kernel_dtype(a.dtype)) if kind == "f" else a.dtype.kind in "iu"
    if not ok:
        want = "a float" if kind == "f" else "an integer"
        raise KernelArgumentError(f"{what} has dtype {a.dtype}; expected {want} dtype")
    if a.size != n:
        raise KernelArgumentError(f"{what} has {a.size} elements (shape {tuple(a.shape)}), expected one per row: {n}")
    return xp.ascontiguousarray(a.reshape(-1), dtype=dtype)


def _int32(what: str, v: int) -> np.int32:
    if not 0 <= v < 2**31:
        raise KernelArgumentError(f"{what} = {v} does not fit the kernel's 32-bit int")
    return np.int32(v)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
class Launchers:
    """Host-side launch functions of every kernel, bound to a module loader and an array module.

    load: ``load(source_name) -> module``, where ``module.get_function(kernel_name)`` returns a
        callable ``kernel(grid, block, args, shared_mem=0)`` (``cupy.RawModule`` /
        ``tests.cuda_emu.EmulatedModule``). Called once per source, lazily.
    xp: the array module of the arrays (cupy, or numpy under the emulator).

    ``launches`` counts the launches per kernel name (tests and benchmarks check that a code path
    really ran the kernels).
    """

    def __init__(self, load: Callable[[str], Any], xp, *, description: str = ""):
        self._load = load
        self.xp = xp
        self.description = description
        self._modules: dict[str, Any] = {}
        self._functions: dict[str, Any] = {}
        self._smem_opt_in: dict[str, int] = {}
        self.launches: Counter = Counter()

    def __repr__(self):
        return f"<cutp.cuda_kernels.Launchers {self.description or self.xp.__name__}>"

    # ---- plumbing ------------------------------------------------------------------------------
    def function(self, source: str, name: str):
        fn = self._functions.get(name)
        if fn is None:
            mod = self._modules.get(source)
            if mod is None:
                mod = self._modules[source] = self._load(source)
            fn = self._functions[name] = mod.get_function(name)
        return fn

    def _launch(self, source: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
        fn = self.function(source, name)
        if shared_mem > DEFAULT_MAX_DYNAMIC_SHARED and self._smem_opt_in.get(name, 0) < shared_mem:
            try:
                fn.max_dynamic_shared_size_bytes = int(shared_mem)
            except Exception as e:  # the device's limit (227 KiB on sm_90, 163 KiB on sm_80)
                raise KernelArgumentError(
                    f"{name} needs {shared_mem} bytes of shared memory, more than this device allows ({e})"
                ) from e
            self._smem_opt_in[name] = int(shared_mem)
        grid = tuple(max(1, int(g)) for g in grid)
        block = tuple(int(b) for b in block)
        fn(grid, block, tuple(args), shared_mem=int(shared_mem))
        self.launches[name] += 1

    def _elementwise_grid(self, n: int, dtype) -> tuple[tuple[int], tuple[int]]:
        """One 128-bit chunk per thread, 256 threads per block."""
        return (_ceil(_ceil(n, _pack(dtype)), ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,)

    def _column_sum(self, partial, out_dtype):
        """out[c] = sum over chunks of partial[k, c] (fixed order): the deterministic second pass.
        Block (32, 8): 32 columns per block, 8 threads splitting the chunks of each column."""
        n_chunks, C = partial.shape
        out = self.xp.empty(C, dtype=out_dtype)
        self._launch("reduce", f"column_sum_{_suffix(out_dtype)}", (_ceil(C, 32),), (32, 8),
                     (out, partial, _int32("chunks", n_chunks), _int32("C", C)))
        return out

    @staticmethod
    def _row_chunks(n_rows: int, blocks_per_chunk: int) -> tuple[int, int]:
        """(n_chunks, rows_per_chunk) for the first pass of a column reduction: about
        COLUMN_REDUCTION_BLOCKS blocks in all, every chunk non-empty (one empty chunk if n_rows
        is 0, so the partials, and the result, are zeros)."""
        if n_rows == 0:
            return 1, 1
        want = _clamp(_ceil(COLUMN_REDUCTION_BLOCKS, max(1, blocks_per_chunk)), 1, min(n_rows, 65535))
        rows_per_chunk = _ceil(n_rows, want)
        return _ceil(n_rows, rows_per_chunk), rows_per_chunk

    # ---- GeLU ----------------------------------------------------------------------------------
    @staticmethod
    def _exact(approximate: str) -> np.int32:
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        return np.int32(approximate == "none")

    def gelu_forward(self, x, approximate: str = "tanh"):
        """y = gelu(x), any shape. Elementwise: one 128-bit chunk per thread."""
        xp = self.xp
        _check(xp, "x", x, float_data=True)
        exact = self._exact(approximate)
        y = xp.empty(x.shape, dtype=x.dtype)
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("gelu", f"gelu_forward_{_suffix(x.dtype)}", grid, block, (y, x, np.int64(x.size), exact))
        return y

    def gelu_backward(self, dy, x, approximate: str = "tanh"):
        """dx = dy * gelu'(x), in x's dtype."""
        xp = self.xp
        _check(xp, "x", x, float_data=True)
        _check(xp, "dy", dy, dtype=x.dtype, shape=x.shape)
        exact = self._exact(approximate)
        dx = xp.empty(x.shape, dtype=x.dtype)
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("gelu", f"gelu_backward_{_suffix(x.dtype)}", grid, block,
                     (dx, dy, x, np.int64(x.size), exact))
        return dx

    def bias_gelu_forward(self, x, b, approximate: str = "tanh"):
        """(y, pre): y = gelu(x + b) and the pre-activation x + b (saved for the backward), both
        shaped like x [..., C] in x's dtype; b is [C]. Elementwise over the flattened x."""
        xp = self.xp
        _check(xp, "x", x, float_data=True)
        if x.ndim < 1:
            raise KernelArgumentError("x must have a last (channel) axis")
        C = x.shape[-1]
        _check(xp, "b", b, dtype=x.dtype, shape=(C,))
        exact = self._exact(approximate)
        y = xp.empty(x.shape, dtype=x.dtype)
        pre = xp.empty(x.shape, dtype=x.dtype)
        n_rows = math.prod(x.shape[:-1])
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("gelu", f"bias_gelu_forward_{_suffix(x.dtype)}", grid, block,
                     (y, pre, x, b, np.int64(n_rows), _int32("C", C), exact))
        return y, pre

    def bias_gelu_backward(self, dy, pre, approximate: str = "tanh"):
        """(dx, db): dx = dy * gelu'(pre) shaped like pre [..., C], and db [C] = dx summed over
        the rows (from the unrounded float32 dx), both in pre's dtype.

        First pass: grid (column chunks, row chunks), each thread walks down its row chunk
        keeping the column sums of its 128-bit chunk of columns in registers (coalesced along
        the rows, no shared memory, no atomics) and writes them to partial [n_chunks, C];
        second pass: column_sum adds the chunks in a fixed order."""
        xp = self.xp
        _check(xp, "pre", pre, float_data=True)
        if pre.ndim < 1:
            raise KernelArgumentError("pre must have a last (channel) axis")
        _check(xp, "dy", dy, dtype=pre.dtype, shape=pre.shape)
        exact = self._exact(approximate)
        C = pre.shape[-1]
        n_rows = math.prod(pre.shape[:-1])
        P = _pack(pre.dtype)
        col_chunks = _ceil(C, P)
        threads = _clamp(_round_up(col_chunks, WARP), WARP, ELEMENTWISE_THREADS)
        gx = max(1, _ceil(col_chunks, threads))
        n_chunks, rows_per_chunk = self._row_chunks(n_rows, gx)
        dx = xp.empty(pre.shape, dtype=pre.dtype)
        partial = xp.empty((n_chunks, C), dtype=np.float32)
        self._launch("gelu", f"bias_gelu_backward_{_suffix(pre.dtype)}", (gx, n_chunks), (threads,),
                     (dx, partial, dy, pre, np.int64(n_rows), _int32("C", C), _int32("rows per chunk", rows_per_chunk),
                      exact))
        return dx, self._column_sum(partial, pre.dtype)

    # ---- softmax -------------------------------------------------------------------------------
    def _row_shape(self, width: int, dtype, warp_max: int, work_per_thread: int = 4,
                   max_threads: int = 1024):
        """(grid_for_rows, block, block_per_row) for a row kernel: a warp per row (4 rows per
        block) up to warp_max columns, else a block per row sized to ~work_per_thread chunks
        per thread (at most max_threads, the kernel's __launch_bounds__)."""
        if width <= warp_max:
            return ROWS_PER_WARP_BLOCK, (WARP * ROWS_PER_WARP_BLOCK,), np.int32(0)
        threads = _clamp(_round_up(_ceil(width, _pack(dtype) * work_per_thread), WARP), WARP, max_threads)
        return 1, (threads,), np.int32(1)

    def softmax_forward(self, x, scale: float = 1.0, causal: bool = False):
        """y = softmax(scale * x) over the last axis of x [..., Tq, Tk] (1-D: one row); with
        causal, query row i (position Tk - Tq + i) sees keys 0 .. Tk - Tq + i, the rest are 0.

        One warp per row for Tk <= 1024 (four rows per block), one block of up to 512 threads per
        row beyond; both loop over the row, so any length works."""
        xp = self.xp
        _check(xp, "x", x, float_data=True)
        if x.ndim < 1:
            raise KernelArgumentError("softmax needs at least one axis")
        if causal and x.ndim < 2:
            raise ValueError("causal softmax needs x of shape [..., Tq, Tk]")
        Tk = x.shape[-1]
        Tq = x.shape[-2] if x.ndim >= 2 else 1
        if causal and Tq > Tk:
            raise ValueError(f"causal softmax needs Tq <= Tk, got Tq={Tq}, Tk={Tk}")
        n_rows = math.prod(x.shape[:-1])
        y = xp.empty(x.shape, dtype=x.dtype)
        rows_per_block, block, block_per_row = self._row_shape(Tk, x.dtype, SOFTMAX_WARP_ROW_MAX, max_threads=512)
        self._launch("softmax", f"softmax_forward_{_suffix(x.dtype)}", (_ceil(n_rows, rows_per_block),), block,
                     (y, x, np.int64(n_rows), _int32("Tq", Tq), _int32("Tk", Tk), np.float32(scale),
                      np.int32(bool(causal)), block_per_row))
        return y

    def softmax_backward(self, dy, y, scale: float = 1.0):
        """dx = scale * y * (dy - sum(dy * y)) over the last axis, in y's dtype."""
        xp = self.xp
        _check(xp, "y", y, float_data=True)
        if y.ndim < 1:
            raise KernelArgumentError("softmax needs at least one axis")
        _check(xp, "dy", dy, dtype=y.dtype, shape=y.shape)
        Tk = y.shape[-1]
        n_rows = math.prod(y.shape[:-1])
        dx = xp.empty(y.shape, dtype=y.dtype)
        rows_per_block, block, block_per_row = self._row_shape(Tk, y.dtype, SOFTMAX_WARP_ROW_MAX, max_threads=512)
        self._launch("softmax", f"softmax_backward_{_suffix(y.dtype)}", (_ceil(n_rows, rows_per_block),), block,
                     (dx, dy, y, np.int64(n_rows), _int32("Tk", Tk), np.float32(scale), block_per_row))
        return dx

    # ---- LayerNorm -----------------------------------------------------------------------------
    def layernorm_forward(self, x, weight=None, bias=None, eps: float = 1e-5):
        """(y, mean, rstd): y = (x - mean) * rstd * weight + bias over the last axis of x [..., C]
        in x's dtype; mean and rstd float32 [n_rows] (flat). weight / bias: [C] of x's dtype, or
        None. A warp per row up to C = 2048, a block per row beyond."""
        xp = self.xp
        _check(xp, "x", x, float_data=True)
        if x.ndim < 1:
            raise KernelArgumentError("x must have a last (channel) axis")
        C = x.shape[-1]
        for what, a in (("weight", weight), ("bias", bias)):
            if a is not None:
                _check(xp, what, a, dtype=x.dtype, shape=(C,))
        n_rows = math.prod(x.shape[:-1])
        y = xp.empty(x.shape, dtype=x.dtype)
        mean = xp.empty(n_rows, dtype=np.float32)
        rstd = xp.empty(n_rows, dtype=np.float32)
        rows_per_block, block, block_per_row = self._row_shape(C, x.dtype, LAYERNORM_WARP_ROW_MAX, 2)
        self._launch("layernorm", f"layernorm_forward_{_suffix(x.dtype)}", (_ceil(n_rows, rows_per_block),), block,
                     (y, mean, rstd, x, weight, bias, np.int64(n_rows), _int32("C", C), np.float32(eps),
                      block_per_row))
        return y, mean, rstd

    def layernorm_backward(self, dy, x, weight, mean, rstd, bias_dtype=None, need_dweight: bool | None = None):
        """(dx, dweight, dbias) of layernorm_forward: dx in x's dtype; dweight [C] in weight's dtype
        (None when weight is None, or need_dweight is False); dbias [C] in bias_dtype (None when
        bias_dtype is None). mean / rstd: float32 with one element per row.

        One block per chunk of rows: per row a block reduction of sum(g) and sum(g * xhat), and
        each thread accumulating dy * xhat and dy of its own columns in shared memory (2 * C
        floats; over 48 KiB the kernel's limit is raised); the partials [2, n_chunks, C] are then
        added by column_sum in a fixed order. No atomics: deterministic."""
        xp = self.xp
        _check(xp, "x", x, float_data=True)
        if x.ndim < 1:
            raise KernelArgumentError("x must have a last (channel) axis")
        _check(xp, "dy", dy, dtype=x.dtype, shape=x.shape)
        C = x.shape[-1]
        n_rows = math.prod(x.shape[:-1])
        if weight is not None:
            _check(xp, "weight", weight, dtype=x.dtype, shape=(C,))
        _check(xp, "mean", mean, dtype=np.float32)
        _check(xp, "rstd", rstd, dtype=np.float32)
        for what, a in (("mean", mean), ("rstd", rstd)):
            if a.size != n_rows:
                raise KernelArgumentError(f"{what} has {a.size} elements, expected one per row: {n_rows}")
        if bias_dtype is not None and not _is_kernel_dtype(np.dtype(bias_dtype)):
            raise KernelArgumentError(f"bias dtype {np.dtype(bias_dtype)}: the kernels take float32 or bfloat16")
        want_dw = weight is not None and need_dweight is not False
        want_params = want_dw or bias_dtype is not None
        P = _pack(x.dtype)
        threads = _clamp(_round_up(_ceil(C, P), WARP), WARP, 512)
        n_chunks, rows_per_chunk = self._row_chunks(n_rows, 1)
        dx = xp.empty(x.shape, dtype=x.dtype)
        partial = xp.empty((2, n_chunks, C), dtype=np.float32) if want_params else None
        smem = 2 * C * 4 if want_params else 0
        self._launch("layernorm", f"layernorm_backward_{_suffix(x.dtype)}", (n_chunks,), (threads,),
                     (dx, partial, dy, x, weight, mean, rstd, np.int64(n_rows), _int32("C", C),
                      _int32("rows per chunk", rows_per_chunk)), shared_mem=smem)
        dweight = self._column_sum(partial[0], weight.dtype) if want_dw else None
        dbias = self._column_sum(partial[1], np.dtype(bias_dtype)) if bias_dtype is not None else None
        return dx, dweight, dbias

    # ---- vocab-parallel cross-entropy ----------------------------------------------------------
    def _logits_2d(self, logits, n_valid: int):
        xp = self.xp
        _check(xp, "logits", logits, float_data=True)
        if logits.ndim < 1:
            raise KernelArgumentError("logits must have a last (vocabulary) axis")
        W = logits.shape[-1]
        if not 0 <= int(n_valid) <= W:
            raise ValueError(f"n_valid={n_valid} outside [0, {W}]")
        return logits.reshape(-1, W) if logits.ndim != 2 else logits, W

    def _row_block(self, width: int, dtype) -> int:
        """Threads of a block-per-row kernel over `width` columns: ~4 chunks per thread, 32..1024."""
        return _clamp(_round_up(_ceil(max(width, 1), _pack(dtype) * 4), WARP), WARP, 1024)

    def ce_shard_max(self, logits, n_valid: int):
        """float32 [N]: max over the first n_valid columns of each row of logits [..., W]
        (-inf when n_valid is 0). One block per row."""
        L, W = self._logits_2d(logits, n_valid)
        N = L.shape[0]
        out = self.xp.empty(N, dtype=np.float32)
        self._launch("cross_entropy", f"ce_shard_max_{_suffix(L.dtype)}", (N,), (self._row_block(n_valid, L.dtype),),
                     (out, L, np.int64(N), _int32("W", W), _int32("n_valid", int(n_valid))))
        return out

    def ce_shard_stats(self, logits, row_max, local_targets, n_valid: int, need_sum_logits: bool = True):
        """(sum_exp, target_logit, sum_logits), float32 [N] each (sum_logits None unless
        need_sum_logits): sum over the valid columns of exp(logit - row_max) and of the logits,
        and logits[i, local_targets[i]] (0 where the target is -1 or outside the shard).
        row_max: float [N]; local_targets: integer [N] (any shape with N elements). One block
        per row, both sums in one block reduction."""
        xp = self.xp
        L, W = self._logits_2d(logits, n_valid)
        N = L.shape[0]
        row_max = _row_vector(xp, "row_max", row_max, N, np.float32, "f")
        targets = _row_vector(xp, "local_targets", local_targets, N, np.int64, "i")
        sum_exp = xp.empty(N, dtype=np.float32)
        target_logit = xp.empty(N, dtype=np.float32)
        sum_logits = xp.empty(N, dtype=np.float32) if need_sum_logits else None
        self._launch("cross_entropy", f"ce_shard_stats_{_suffix(L.dtype)}", (N,),
                     (self._row_block(n_valid, L.dtype),),
                     (sum_exp, target_logit, sum_logits, L, row_max, targets, np.int64(N), _int32("W", W),
                      _int32("n_valid", int(n_valid))))
        return sum_exp, target_logit, sum_logits

    def ce_shard_backward(self, logits, row_max, sum_exp, local_targets, n_valid: int, row_scale,
                          label_smoothing: float = 0.0, n_classes=None, out=None):
        """The gradient of the cross-entropy w.r.t. a logits shard (cutp.ops.ce_shard_backward):
        row_scale * (softmax - (1 - eps) onehot - eps / n_classes) over the valid columns, 0 on
        padded columns and on rows with row_scale 0. Written into `out` (a new array in logits'
        dtype when None; out=logits works in place) and returned. row_scale: float with N
        elements or one (broadcast). One block per row, streaming 128-bit loads and stores."""
        xp = self.xp
        eps = float(label_smoothing)
        if eps != 0.0 and not n_classes:
            raise ValueError("label smoothing needs n_classes")
        L, W = self._logits_2d(logits, n_valid)
        N = L.shape[0]
        if out is None:
            out = xp.empty(logits.shape, dtype=logits.dtype)
        else:
            _check(xp, "out", out, dtype=logits.dtype, shape=logits.shape)
        O = out.reshape(N, W)
        row_max = _row_vector(xp, "row_max", row_max, N, np.float32, "f")
        sum_exp = _row_vector(xp, "sum_exp", sum_exp, N, np.float32, "f")
        targets = _row_vector(xp, "local_targets", local_targets, N, np.int64, "i")
        rs = xp.asarray(row_scale)
        if rs.size == 1:  # one scale for every row
            rs = xp.broadcast_to(rs.reshape(-1), (N,))
        row_scale = _row_vector(xp, "row_scale", rs, N, np.float32, "f")
        smooth = np.float32(eps / n_classes) if eps != 0.0 else np.float32(0.0)
        self._launch("cross_entropy", f"ce_shard_backward_{_suffix(L.dtype)}", (N,), (self._row_block(W, L.dtype),),
                     (O, L, row_max, sum_exp, targets, row_scale, np.int64(N), _int32("W", W),
                      _int32("n_valid", int(n_valid)), smooth, np.float32(1.0 - eps)))
        return out

    # ---- AdamW ---------------------------------------------------------------------------------
    def adamw_update(self, p, g, m, v, decay_mask, *, lr, beta1, beta2, eps, weight_decay, step,
                     grad_scale=1.0) -> None:
        """In-place AdamW over flat buffers (cutp.ops.adamw_update): p, g, decay_mask of one dtype
        (float32 or bfloat16), m and v float32, all 1-D of one length. One launch for the whole
        model; elementwise, one 128-bit chunk per thread per array."""
        xp = self.xp
        _check(xp, "p", p, float_data=True)
        if p.ndim != 1:
            raise KernelArgumentError(f"adamw_update takes flat arrays; p has shape {tuple(p.shape)}")
        _check(xp, "g", g, dtype=p.dtype, shape=p.shape)
        _check(xp, "m", m, dtype=np.float32, shape=p.shape)
        _check(xp, "v", v, dtype=np.float32, shape=p.shape)
        decay = bool(weight_decay)
        if decay_mask is not None or decay:
            _check(xp, "decay_mask", decay_mask, dtype=p.dtype, shape=p.shape)
        bc1 = 1.0 - beta1 ** step
        bc2 = 1.0 - beta2 ** step
        n = p.size
        grid, block = self._elementwise_grid(n, p.dtype)
        f = np.float32
        self._launch("adamw", f"adamw_update_{_suffix(p.dtype)}", grid, block,
                     (p, m, v, g, decay_mask if decay else None, np.int64(n), f(beta1), f(1.0 - beta1), f(beta2),
                      f(1.0 - beta2), f(lr * weight_decay), np.int32(decay), f(eps), f(lr / bc1),
                      f(1.0 / np.sqrt(bc2)), f(grad_scale)))

    # ---- dropout -------------------------------------------------------------------------------
    @staticmethod
    def _dropout_args(p: float, seed: int, offset: int):
        from .ops.dropout import MASK64, keep_threshold

        return np.uint64(int(seed) & MASK64), np.uint64(int(offset) & MASK64), np.uint32(keep_threshold(float(p)))

    def dropout_mask(self, shape, p: float, seed: int, offset: int):
        """Bool keep-mask of `shape`, bit-identical to cutp.ops.dropout_mask. One element per thread."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = math.prod(shape)
        mask = self.xp.empty(shape, dtype=bool)
        s, o, thr = self._dropout_args(p, seed, offset)
        self._launch("dropout", "dropout_mask_bool", (_ceil(n, ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,),
                     (mask, np.int64(n), s, o, thr))
        return mask

    def dropout_forward(self, x, p: float, seed: int, offset: int):
        """(y, mask): y = (x * mask) * scale with scale = 1 / (1 - p) (0 for p == 1), in x's dtype,
        and the bool keep-mask, in one pass (cutp.ops.dropout_forward for p > 0)."""
        xp = self.xp
        _check(xp, "x", x, float_data=True)
        s, o, thr = self._dropout_args(p, seed, offset)
        scale = 0.0 if float(p) == 1.0 else 1.0 / (1.0 - float(p))
        y = xp.empty(x.shape, dtype=x.dtype)
        mask = xp.empty(x.shape, dtype=bool)
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("dropout", f"dropout_forward_{_suffix(x.dtype)}", grid, block,
                     (y, mask, x, np.int64(x.size), s, o, thr, np.float32(scale)))
        return y, mask

    def dropout_apply(self, x, mask, scale: float):
        """(x * mask) * scale in x's dtype (the dropout backward with the saved mask)."""
        xp = self.xp
        _check(xp, "x", x, float_data=True)
        _check(xp, "mask", mask, dtype=bool, shape=x.shape)
        y = xp.empty(x.shape, dtype=x.dtype)
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("dropout", f"dropout_apply_{_suffix(x.dtype)}", grid, block,
                     (y, x, mask, np.int64(x.size), np.float32(scale)))
        return y


# ------------------------------------------------------------------------------------------------
# Sources and NVRTC
# ------------------------------------------------------------------------------------------------
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"common\.cuh"[ \t]*$', re.M)


def kernel_source(name: str) -> str:
    """The text NVRTC compiles for kernels/<name>.cu: common.cuh inlined in place of its
    ``#include`` (so CuPy's cache key, the source text, covers the header too), with ``#line``
    directives that keep compiler messages pointing at the original files and lines."""
    if name not in SOURCES:
        raise ValueError(f"unknown kernel source {name!r}; one of {SOURCES}")
    files = importlib.resources.files("cutp.kernels")
    try:
        src = (files / f"{name}.cu").read_text()
        common = (files / "common.cuh").read_text()
    except (FileNotFoundError, OSError) as e:
        raise KernelLoadError(
            f"the CUDA kernel sources are missing from the installed package cutp.kernels ({e}); "
            "reinstall cutp (its wheel ships kernels/*.cu and common.cuh)"
        ) from e
    common = re.sub(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", "", common, count=1, flags=re.M)
    m = _INCLUDE_RE.search(src)
    if m is None:
        raise KernelLoadError(f'{name}.cu does not #include "common.cuh" (kernels/README.md)')
    # The include line becomes a comment, so the lines of <name>.cu keep their numbers.
    return (f'#line 1 "common.cuh"\n{common}\n#line 1 "{name}.cu"\n'
            f'{src[:m.start()]}// common.cuh is inlined above{src[m.end():]}')


def _cuda_version_of(include_dir: str) -> int | None:
    """CUDART_VERSION // 1000 from cuda_runtime_api.h in include_dir (12, 13, ...), if there."""
    try:
        with open(os.path.join(include_dir, "cuda_runtime_api.h"), errors="replace") as f:
            m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read())
        return int(m.group(1)) // 1000 if m else None
    except OSError:
        return None


def _include_candidates(environ) -> list[tuple[str, str]]:
    """(directory, where it came from) in order of preference."""
    out: list[tuple[str, str]] = []
    if environ.get("CUTP_CUDA_INCLUDE"):
        out.append((environ["CUTP_CUDA_INCLUDE"], "$CUTP_CUDA_INCLUDE"))
    try:
        import nvidia  # namespace package of NVIDIA's wheels

        for base in list(nvidia.__path__):
            # nvidia-cuda-runtime (CUDA 13): nvidia/cu13/include; nvidia-cuda-runtime-cu12: nvidia/cuda_runtime/include
            for sub in ("cu13", "cu12", "cuda_runtime"):
                out.append((os.path.join(base, sub, "include"), f"the nvidia wheel {sub}"))
    except ImportError:
        pass
    for var in ("CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"):
        if environ.get(var):
            out.append((os.path.join(environ[var], "include"), f"${var}"))
    out.append(("/usr/local/cuda/include", "/usr/local/cuda"))
    out += [(d, d) for d in sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True)]
    return out


def find_cuda_include(nvrtc_major: int | None = None, candidates=None, environ=None) -> str:
    """The directory of ``cuda_bf16.h`` (and ``cuda_fp16.h``) for NVRTC.

    Looked for in ``$CUTP_CUDA_INCLUDE``, the ``nvidia-cuda-runtime`` (CUDA 13) or
    ``nvidia-cuda-runtime-cu12`` wheel, ``$CUDA_PATH``/``$CUDA_HOME``, then
    ``/usr/local/cuda*``; a directory whose CUDA major version matches NVRTC's (``nvrtc_major``)
    is preferred. Raises KernelLoadError naming the wheel to install when there is none."""
    environ = os.environ if environ is None else environ
    cands = _include_candidates(environ) if candidates is None else list(candidates)
    found = []
    for d, where in cands:
        if os.path.isfile(os.path.join(d, "cuda_bf16.h")) and os.path.isfile(os.path.join(d, "cuda_fp16.h")):
            found.append(d)
    if not found:
        wheel = "nvidia-cuda-runtime-cu12" if nvrtc_major == 12 else "nvidia-cuda-runtime"
        raise KernelLoadError(
            "cutp's CUDA kernels need the CUDA runtime headers (cuda_bf16.h) for NVRTC, and none were found. "
            f"Install the wheel {wheel} (pip install 'cutp[cuda13]' for CUDA 13, 'cutp[cuda12]' with "
            "nvidia-cuda-runtime-cu12 for CUDA 12), or point $CUDA_PATH or $CUTP_CUDA_INCLUDE at a CUDA toolkit. "
            "To run without the kernels set CUTP_KERNELS=0. Searched: " + ", ".join(d for d, _ in cands)
        )
    if nvrtc_major is not None:
        for d in found:
            if _cuda_version_of(d) == nvrtc_major:
                return d
    return found[0]


def nvrtc_options(include_dir: str) -> tuple[str, ...]:
    """NVRTC options of every kernel module (CuPy adds -arch for the current device)."""
    return ("--std=c++17", f"-I{include_dir}")


# ------------------------------------------------------------------------------------------------
# CuPy: per-device launchers and dispatch
# ------------------------------------------------------------------------------------------------
_cupy_launchers: dict[int, Launchers] = {}


def cupy_launchers(device: int | None = None) -> Launchers:
    """The Launchers of a CUDA device (default: the current one), building its RawModules lazily."""
    import cupy

    dev = cupy.cuda.runtime.getDevice() if device is None else int(device)
    k = _cupy_launchers.get(dev)
    if k is None:
        with _lock:
            k = _cupy_launchers.get(dev)
            if k is None:
                k = _cupy_launchers[dev] = Launchers(_cupy_loader(), cupy, description=f"cupy device {dev}")
    return k


def _cupy_loader() -> Callable[[str], Any]:
    options: list = []

    def load(name: str):
        import cupy

        if not options:
            try:
                major = cupy.cuda.nvrtc.getVersion()[0]
            except Exception:
                major = None
            options.extend(nvrtc_options(find_cuda_include(major)))
        return cupy.RawModule(code=kernel_source(name), options=tuple(options))

    return load


def launch_counts() -> Counter:
    """Kernel launches so far in this process (all devices), by kernel name."""
    total: Counter = Counter()
    for k in _cupy_launchers.values():
        total.update(k.launches)
    return total


def eligible(arrays, is_device_array=is_cupy_array) -> bool:
    """The dispatch rule: every array given (None entries skipped; at least one) is a device
    array, C-contiguous, and all have one dtype, float32 or bfloat16. Stops at the first array
    that is not a device array, so NumPy inputs cost one check and never import CuPy."""
    first = None
    for a in arrays:
        if a is None:
            continue
        if not is_device_array(a):
            return False
        if first is None:
            first = a
            if not _is_kernel_dtype(a.dtype):
                return False
        elif a.dtype != first.dtype:
            return False
        if not a.flags.c_contiguous:
            return False
    return first is not None


def dispatch(*arrays) -> Launchers | None:
    """The Launchers for an op's arrays, or None to run the reference composition.

    Not None when kernels are enabled and the arrays are :func:`eligible`: CuPy arrays of one
    dtype, float32 or bfloat16, C-contiguous (float64, NumPy arrays, mixed dtypes and strided
    views take the reference path)."""
    if not eligible(arrays) or not kernels_enabled():
        return None
    return cupy_launchers()


def dispatch_xp(xp) -> Launchers | None:
    """dispatch() for ops given an array module rather than arrays (dropout_mask)."""
    if xp is np or getattr(xp, "__name__", "") != "cupy" or not kernels_enabled():
        return None
    return cupy_launchers()


# ------------------------------------------------------------------------------------------------
# Benchmark plug-in (python -m cutp.bench kernels)
# ------------------------------------------------------------------------------------------------
def register_bench_variants(register) -> None:
    """Registers the kernels as variant "cuda_kernels" of each op of cutp.bench.kernels.

    Each factory ``make(inputs, xp)`` returns a zero-argument callable that runs the kernel once
    on the op's inputs through the current device's launchers (whatever the switch says) and
    returns what the op of cutp.ops returns (the same structure, ctx objects included; None for
    the in-place ops), so the benchmark reads and checks its outputs as the reference's.

    Note for the benchmark: on CuPy arrays cutp.ops itself dispatches to these kernels, so a
    baseline of "the CuPy composition" must run under ``use_kernels(False)``.
    """
    from .ops.gelu import GeluCtx
    from .ops.layernorm import LayerNormCtx
    from .ops.softmax import SoftmaxCtx

    def variant(op, run):
        def make(inputs, xp):
            k = cupy_launchers() if getattr(xp, "__name__", "") == "cupy" else _bench_launchers(xp)
            return lambda: run(k, inputs)

        register(op, "cuda_kernels", make)

    def gelu_fwd(k, d):
        y, pre = k.bias_gelu_forward(d["x"], d["b"])
        return y, GeluCtx(pre, "tanh")

    def softmax_fwd(k, d):
        y = k.softmax_forward(d["x"], d["scale"], True)
        return y, SoftmaxCtx(y, d["scale"])

    def ln_fwd(k, d):
        y, mean, rstd = k.layernorm_forward(d["x"], d["w"], d["b"])
        return y, LayerNormCtx(d["x"], d["w"], d["b"].dtype, mean, rstd)

    def ln_bwd(k, d):
        c = d["ctx"]
        return k.layernorm_backward(d["dy"], c.x, c.weight, c.mean.reshape(-1), c.rstd.reshape(-1), c.bias_dtype)

    def ce_bwd(k, d):
        k.ce_shard_backward(d["logits"], d["row_max"], d["sum_exp"], d["targets"], d["n_valid"], d["row_scale"],
                            out=d["logits"])

    def adamw(k, d):
        k.adamw_update(d["p"], d["g"], d["m"], d["v"], d["mask"], lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                       weight_decay=0.1, step=10)

    variant("bias_gelu_fwd", gelu_fwd)
    variant("bias_gelu_bwd", lambda k, d: k.bias_gelu_backward(d["dy"], d["ctx"].x, d["ctx"].approximate))
    variant("softmax_fwd", softmax_fwd)
    variant("softmax_bwd", lambda k, d: k.softmax_backward(d["dy"], d["ctx"].y, d["ctx"].scale))
    variant("layernorm_fwd", ln_fwd)
    variant("layernorm_bwd", ln_bwd)
    variant("ce_max", lambda k, d: k.ce_shard_max(d["logits"], d["n_valid"]))
    variant("ce_stats", lambda k, d: k.ce_shard_stats(d["logits"], d["row_max"], d["targets"], d["n_valid"]))
    variant("ce_bwd_fused", ce_bwd)
    variant("adamw", adamw)


def _bench_launchers(xp):  # replaced in tests (emulated kernels on NumPy arrays)
    raise BackendError(f"the CUDA kernels run on CuPy arrays, not {getattr(xp, '__name__', xp)}")
