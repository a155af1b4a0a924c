"""What every kernel family's launchers share: loading, the switch, argument checks, launch plumbing.

* ``SOURCES``: the kernel sources, one ``cupy.RawModule`` each (every ``kernels/<name>.cu``).
* ``FAMILY``: the declaration of the column sum (``reduce.cu``) the parameter gradients share.
* :class:`KernelArgumentError`, :class:`KernelLoadError`.
* The switch: :func:`kernels_enabled`, :class:`use_kernels`, ``$CUTP_KERNELS``.
* The argument checks (:func:`check_array`, :func:`row_vector`, :func:`int32_arg`) and dtype
  helpers every launcher uses, so a mismatch raises the same :class:`KernelArgumentError` whatever
  the kernel.
* :class:`LauncherBase`: the module and function cache, ``_launch`` (with the opt-in when static
  + dynamic shared memory exceed 48 KiB), the launch counters, the elementwise grid, and the
  deterministic two-pass column reduction whose second pass is ``reduce.cu``. Each kernel
  family's launchers (``kernels/gelu.py``, ...) are a subclass of it; ``cutp.kernels.Launchers``
  combines them.
* :func:`kernel_source`, :func:`find_cuda_include`, :func:`nvrtc_options`,
  :func:`cupy_module_loader`: the text and options NVRTC compiles, and the loader that builds a
  ``cupy.RawModule`` from them.

Nothing here imports ``cutp.ops``: the ops call the kernels (``cutp.kernels.dispatch``), never
the other way round.
"""
from __future__ import annotations

import glob
import importlib.resources
import os
import re
import threading
from collections import Counter
from typing import Any, Callable

import numpy as np

from cutp.runtime.errors import BackendError

from .family import KernelFamily, Target, Traffic

# One RawModule per source file (kernels/<name>.cu): every .cu file of the package, in name order
# (each family's declaration, kernels/<op>.py FAMILY, says which of them it launches).
SOURCES = tuple(sorted(p.name[:-3] for p in importlib.resources.files(__package__).iterdir() if p.name.endswith(".cu")))

ENV_SWITCH = "CUTP_KERNELS"

# Launch shapes shared by several kernel families (each launcher says why it picks its shape).
WARP = 32
ELEMENTWISE_THREADS = 256
ROWS_PER_WARP_BLOCK = 4  # warp-per-row kernels: 4 warps (rows) per block
# The bias gradient's column reduction splits the rows into chunks so that about this many
# blocks run the first pass. A fixed number (not the device's SM count), so the partial sums, and
# with them the rounding of the result, do not depend on the GPU model. (LayerNorm's parameter
# gradients size their grid by the SM count instead: kernels/layernorm.py.)
COLUMN_REDUCTION_BLOCKS = 1024
DEFAULT_MAX_SHARED = 48 * 1024  # static + dynamic shared memory of a block without the opt-in
# Streaming multiprocessors of the target device (H100 SXM; H200 has the same 132): the grid of
# kernels sized to fill the GPU (layernorm_backward) on the emulator and wherever the device
# cannot be asked; on a GPU, LauncherBase.sm_count() reads the device's multiProcessorCount.
TARGET_SM_COUNT = 132


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

        cutp.kernels.use_kernels(False)        # reference composition from now on
        with cutp.kernels.use_kernels(False):  # only inside the block
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
# dtypes and sizes
# ------------------------------------------------------------------------------------------------
def dtype_suffix(dtype) -> str:
    """The suffix of a kernel's entry point for a storage dtype: ``_f32`` or ``_bf16``."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return "f32"
    if dtype.name == "bfloat16":
        return "bf16"
    raise KernelArgumentError(f"no kernel for dtype {dtype}")


def elements_per_128bit(dtype) -> int:
    """Elements per 128-bit chunk: what one thread handles in the elementwise kernels."""
    return 16 // np.dtype(dtype).itemsize


def is_kernel_dtype(dtype) -> bool:
    return dtype == np.float32 or getattr(dtype, "name", "") == "bfloat16"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, m: int) -> int:
    return ceil_div(a, m) * m


def clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


# ------------------------------------------------------------------------------------------------
# Argument checks
# ------------------------------------------------------------------------------------------------
def check_array(xp, what: str, a, *, dtype=None, float_data: bool = False, shape=None) -> None:
    """Raises KernelArgumentError unless `a` is a C-contiguous `xp` array of the given dtype
    (or float32/bfloat16 with float_data) and shape."""
    if not isinstance(a, xp.ndarray):
        raise KernelArgumentError(
            f"{what} must be a {xp.__name__} array (the kernels' array module), got {type(a).__module__}."
            f"{type(a).__name__}"
        )
    if float_data and not is_kernel_dtype(a.dtype):
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


def row_vector(xp, what: str, a, n: int, dtype, kind: str):
    """A per-row vector (statistics, targets, scales) of n elements as a contiguous 1-D array of
    `dtype`, converted from any dtype of the right kind ('f' float, 'i' integer)."""
    if not isinstance(a, xp.ndarray):
        raise KernelArgumentError(f"{what} must be a {xp.__name__} array, got {type(a).__name__}")
    ok = (a.dtype.kind == "f" or is_kernel_dtype(a.dtype)) if kind == "f" else a.dtype.kind in "iu"
    if not ok:
        want = "a float" if kind == "f" else "an integer"
        raise KernelArgumentError(f"{what} has dtype {a.dtype}; expected {want} dtype")
    if a.size != n:
        raise KernelArgumentError(f"{what} has {a.size} elements (shape {tuple(a.shape)}), expected one per row: {n}")
    return xp.ascontiguousarray(a.reshape(-1), dtype=dtype)


def int32_arg(what: str, v: int) -> np.int32:
    """`v` as the kernel's 32-bit ``int`` parameter, refused when it does not fit."""
    if not 0 <= v < 2**31:
        raise KernelArgumentError(f"{what} = {v} does not fit the kernel's 32-bit int")
    return np.int32(v)


# ------------------------------------------------------------------------------------------------
# The launch plumbing
# ------------------------------------------------------------------------------------------------
class LauncherBase:
    """The launch plumbing under every kernel family's launchers, bound to a module loader and an
    array module.

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
        self._smem_opt_in: dict[str, int] = {}  # max_dynamic_shared_size_bytes set, by kernel
        self._static_smem: dict[str, int] = {}  # static __shared__ bytes (the function's shared_size_bytes)
        self.launches: Counter = Counter()

    def __repr__(self):
        return f"<{type(self).__module__}.{type(self).__qualname__} {self.description or self.xp.__name__}>"

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
        if shared_mem and self._smem_opt_in.get(name, 0) < shared_mem:
            # Without the opt-in a block gets 48 KiB of static + dynamic shared memory in all
            # (the default maximum of dynamic shared memory is 48 KiB less the static part).
            static = self._static_smem.get(name)
            if static is None:
                static = self._static_smem[name] = int(getattr(fn, "shared_size_bytes", 0) or 0)
            if static + shared_mem > DEFAULT_MAX_SHARED:
                try:
                    fn.max_dynamic_shared_size_bytes = int(shared_mem)
                except Exception as e:  # the device's limit (227 KiB on sm_90, 163 KiB on sm_80)
                    raise KernelArgumentError(
                        f"{name} needs {shared_mem} bytes of dynamic shared memory and {static} static, more "
                        f"than this device allows ({e})"
                    ) from e
                self._smem_opt_in[name] = int(shared_mem)
        grid = tuple(max(1, int(g)) for g in grid)
        block = tuple(int(b) for b in block)
        fn(grid, block, tuple(args), shared_mem=int(shared_mem))
        self.launches[name] += 1

    def sm_count(self) -> int:
        """The SM count of the device the arrays live on: CuPy's current device's
        multiProcessorCount, TARGET_SM_COUNT under the emulator (NumPy arrays) or when the
        attribute cannot be read. Grids sized by it give the same results run to run on one GPU
        model; their partial sums (and the rounding) may differ between models."""
        n = getattr(self, "_sm_count", None)
        if n is None:
            n = TARGET_SM_COUNT
            if getattr(self.xp, "__name__", "") == "cupy":
                try:
                    n = int(self.xp.cuda.Device().attributes["MultiProcessorCount"])
                except Exception:  # noqa: BLE001 - any failure: the target device's count
                    n = TARGET_SM_COUNT
            self._sm_count = n
        return n

    def _elementwise_grid(self, n: int, dtype) -> tuple[tuple[int], tuple[int]]:
        """One 128-bit chunk per thread, 256 threads per block."""
        return (ceil_div(ceil_div(n, elements_per_128bit(dtype)), ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,)

    def _row_shape(self, width: int, dtype, warp_max: int, work_per_thread: int = 4,
                   max_threads: int = 1024):
        """(grid_for_rows, block, block_per_row) for a row kernel (softmax, LayerNorm): a warp per
        row (4 rows per block) up to warp_max columns, else a block per row sized to
        ~work_per_thread chunks per thread (at most max_threads, the kernel's __launch_bounds__)."""
        if width <= warp_max:
            return ROWS_PER_WARP_BLOCK, (WARP * ROWS_PER_WARP_BLOCK,), np.int32(0)
        threads = clamp(round_up(ceil_div(width, elements_per_128bit(dtype) * work_per_thread), WARP), WARP,
                        max_threads)
        return 1, (threads,), np.int32(1)

    def _column_sum(self, partial, out_dtype):
        """out[c] = sum over chunks of partial[k, c] (fixed order): the deterministic second pass.
        Block (32, 8): 32 columns per block, 8 threads splitting the chunks of each column."""
        n_chunks, C = partial.shape
        out = self.xp.empty(C, dtype=out_dtype)
        self._launch("reduce", f"column_sum_{dtype_suffix(out_dtype)}", (ceil_div(C, 32),), (32, 8),
                     (out, partial, int32_arg("chunks", n_chunks), int32_arg("C", C)))
        return out

    @staticmethod
    def _row_chunks(n_rows: int, blocks_per_chunk: int) -> tuple[int, int]:
        """(n_chunks, rows_per_chunk) for the first pass of a column reduction: about
        COLUMN_REDUCTION_BLOCKS blocks in all, every chunk non-empty (one empty chunk if n_rows
        is 0, so the partials, and the result, are zeros)."""
        if n_rows == 0:
            return 1, 1
        want = clamp(ceil_div(COLUMN_REDUCTION_BLOCKS, max(1, blocks_per_chunk)), 1, min(n_rows, 65535))
        rows_per_chunk = ceil_div(n_rows, want)
        return ceil_div(n_rows, rows_per_chunk), rows_per_chunk


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
    # In place of the include, as the preprocessor would (what precedes it, e.g. attention.cu's
    # #define CUTP_TENSOR_CORES, still comes first); #line keeps <name>.cu's line numbers.
    after = src[:m.end()].count("\n") + 1
    return (f'#line 1 "{name}.cu"\n{src[:m.start()]}#line 1 "common.cuh"\n{common}\n'
            f'#line {after} "{name}.cu"\n// common.cuh is inlined above{src[m.end():]}')


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
        import nvidia  # optional dependency: the namespace package of NVIDIA's wheels

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


# Sources that use the tensor cores (nvcuda::wmma): NVRTC also needs crt/mma.h.
TENSOR_CORE_SOURCES = ("attention",)


def find_mma_include(cuda_include: str, candidates=None, environ=None) -> str:
    """The directory holding ``crt/mma.h`` (what ``<mma.h>`` includes) for the tensor-core
    sources: ``cuda_include`` itself (a toolkit, or CUDA 13's wheels, where ``nvidia-cuda-crt``
    installs into the same ``nvidia/cu13/include``), else CUDA 12's ``nvidia-cuda-nvcc-cu12``
    (``nvidia/cuda_nvcc/include``). Raises KernelLoadError naming the wheel otherwise."""
    environ = os.environ if environ is None else environ
    cands = [cuda_include] + [d for d, _ in (_include_candidates(environ) if candidates is None else candidates)]
    try:
        import nvidia  # optional dependency: the namespace package of NVIDIA's wheels

        cands += [os.path.join(base, "cuda_nvcc", "include") for base in list(nvidia.__path__)]
    except ImportError:
        pass
    for d in cands:
        if os.path.isfile(os.path.join(d, "crt", "mma.h")):
            return d
    raise KernelLoadError(
        "cutp's fused attention kernels (tensor cores) need crt/mma.h for NVRTC, and none was found. Install "
        "nvidia-cuda-crt (CUDA 13; in cutp[cuda13]) or nvidia-cuda-nvcc-cu12 (CUDA 12; in cutp[cuda12]), or point "
        "$CUTP_CUDA_INCLUDE at a CUDA toolkit's include directory. To run attention unfused set CUTP_KERNELS=0. "
        "Searched: " + ", ".join(cands))


def nvrtc_options(include_dir: str) -> tuple[str, ...]:
    """NVRTC options of every kernel module (CuPy adds -arch for the current device)."""
    return ("--std=c++17", f"-I{include_dir}")


def source_options(name: str, include_dir: str) -> tuple[str, ...]:
    """NVRTC options of kernel module `name`: :func:`nvrtc_options`, and for the tensor-core sources
    the directory of crt/mma.h where it is not `include_dir` (:func:`find_mma_include`: a
    wheel's headers may lack it, a toolkit's then has it)."""
    options = nvrtc_options(include_dir)
    if name in TENSOR_CORE_SOURCES:
        mma = find_mma_include(include_dir)
        options += () if mma == include_dir else (f"-I{mma}",)
    return options


def cupy_module_loader() -> Callable[[str], Any]:
    """``load(source_name) -> cupy.RawModule`` for :class:`LauncherBase`: compiles
    :func:`kernel_source` with :func:`source_options`, looking the CUDA headers up once, at the
    first load (so a machine without them fails only when a kernel is first needed)."""
    include: list = []  # (the CUDA headers' directory, once found)

    def load(name: str):
        import cupy  # optional dependency: only a GPU machine has it

        if not include:
            try:
                major = cupy.cuda.nvrtc.getVersion()[0]
            except Exception:
                major = None
            include.append(find_cuda_include(major))
        return cupy.RawModule(code=kernel_source(name), options=source_options(name, include[0]))

    return load


# The column sum (reduce.cu) every parameter gradient's second pass launches (LauncherBase._column_sum):
# the families that launch it name "reduce" among their sources, and their tests are its stages.
FAMILY = KernelFamily(
    "reduce", ("reduce",), LauncherBase,
    targets={"column_sum": Target(256, 8, "block (32, 8)")},
    traffic={"column_sum": Traffic(0, f32=1, ops=1, what="read a partial")},
    mutation_classes=("round16",))
