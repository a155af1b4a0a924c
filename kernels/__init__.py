"""cutp's CUDA kernels: the sources, their host-side launchers, and the dispatch of ``cutp.ops``.

This directory (top-level ``kernels/``) is installed as the package ``cutp.kernels``. Each kernel
family is three files side by side, plus its NumPy reference and its tests::

    kernels/<op>.cu             the CUDA source (one cupy.RawModule)
    kernels/<op>.py             its launchers (<Op>Launchers) and its declaration (FAMILY:
                                cutp.kernels.family, which every registry iterates over)
    cutp/ops/<op>.py            the NumPy/CuPy reference, which dispatches to the launchers
    tests/kernels/test_<op>.py  the tests, emulated on the CPU and on a GPU

``kernels/runtime.py`` holds what they share: loading, the switch, argument checks, the launch
plumbing. Each source becomes one ``cupy.RawModule``, compiled by NVRTC the first time one of
its kernels is launched on a device and cached by CuPy on disk (``$CUPY_CACHE_DIR``).
``common.cuh`` is inlined into the source text before compiling, so CuPy's cache key (the source
text and the options) changes whenever the shared header does; the CUDA runtime headers
(``cuda_bf16.h``) come from the ``nvidia-cuda-runtime`` wheel or a CUDA toolkit
(:func:`find_cuda_include`).

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

Nothing in this package imports ``cutp.ops``: the benchmark ops each family declares
(``FAMILY.bench``) receive it as an argument from ``cutp/bench/kernel_ops.py`` and
``kernel_variants.py``.
"""
from __future__ import annotations

import threading
from collections import Counter

import numpy as np

from cutp.runtime.backend import is_cupy_array, is_device_array
from cutp.runtime.shape_only import ShapeArray, ShapeOnly

from .family import KernelFamily, families
from .runtime import (
    SOURCES,
    KernelArgumentError,
    KernelLoadError,
    cupy_module_loader,
    find_cuda_include,
    is_kernel_dtype,
    kernel_source,
    kernels_enabled,
    nvrtc_options,
    source_options,
    use_kernels,
)

__all__ = [
    "Launchers",
    "eligible",
    "KernelArgumentError",
    "KernelLoadError",
    "SOURCES",
    "dispatch",
    "dispatch_xp",
    "dispatch_views",
    "kernels_enabled",
    "use_kernels",
    "launch_counts",
    "kernel_source",
    "nvrtc_options",
    "source_options",
    "find_cuda_include",
    "cupy_launchers",
    "shape_only_launchers",
]


def _launcher_classes(declared: tuple[KernelFamily, ...]) -> tuple[type, ...]:
    """The families' launchers classes, less those another one derives from (LauncherBase, whose
    column sum the reduce family declares): the bases of :class:`Launchers`."""
    classes = list(dict.fromkeys(f.launchers for f in declared))
    return tuple(c for c in classes if not any(d is not c and issubclass(d, c) for d in classes))


class Launchers(*_launcher_classes(families())):
    """Host-side launch functions of every kernel, bound to a module loader and an array module.

    ``Launchers(load, xp)``: see :class:`cutp.kernels.runtime.LauncherBase` for ``load`` and
    ``launches``; the launch functions come from the kernel families' classes, each declared in
    its ``kernels/<op>.py`` (``FAMILY``, :mod:`cutp.kernels.family`).
    """


# ------------------------------------------------------------------------------------------------
# CuPy: per-device launchers and dispatch
# ------------------------------------------------------------------------------------------------
_cupy_launchers: dict[int, Launchers] = {}
_cupy_launchers_lock = threading.Lock()


def cupy_launchers(device: int | None = None) -> Launchers:
    """The Launchers of a CUDA device (default: the current one), building its RawModules lazily."""
    import cupy  # optional dependency: only a GPU machine has it

    dev = cupy.cuda.runtime.getDevice() if device is None else int(device)
    k = _cupy_launchers.get(dev)
    if k is None:
        with _cupy_launchers_lock:
            k = _cupy_launchers.get(dev)
            if k is None:
                k = _cupy_launchers[dev] = Launchers(cupy_module_loader(), cupy, description=f"cupy device {dev}")
    return k


class _NoKernel:
    """What a shape-only launch runs: nothing (the planner books the launchers' allocations)."""

    shared_size_bytes = 0
    max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        return None


class _NoKernels:
    def get_function(self, name):
        return _NoKernel()


def shape_only_launchers(xp: ShapeOnly) -> Launchers:
    """The Launchers of the planner's shape-only GPU arrays (cutp.runtime.shape_only): the same
    host code (checks, output allocations, grids) over kernels that do nothing."""
    k = getattr(xp, "_launchers", None)
    if k is None:
        k = xp._launchers = Launchers(lambda source: _NoKernels(), xp, description=repr(xp))
    return k


def _launchers_of(arrays) -> Launchers:
    first = next(a for a in arrays if a is not None)
    return shape_only_launchers(first.xp) if isinstance(first, ShapeArray) else cupy_launchers()


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
            if not is_kernel_dtype(a.dtype):
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
    if not eligible(arrays, is_device_array) or not kernels_enabled():
        return None
    return _launchers_of(arrays)


def dispatch_views(*arrays) -> Launchers | None:
    """dispatch() for kernels that take strided views (the fused attention, whose launchers pass
    strides): the device's Launchers when kernels are on and the arrays (at least one) are CuPy
    arrays, whatever their dtypes and layouts; the caller checks what its kernels take (for the
    attention, ``kernels.attention.fused_attention_supported``), so that it can say why not."""
    if not kernels_enabled():
        return None
    given = [a for a in arrays if a is not None]
    if not given or not all(is_device_array(a) for a in given):
        return None
    return _launchers_of(given)


def dispatch_xp(xp) -> Launchers | None:
    """dispatch() for ops given an array module rather than arrays (dropout_mask)."""
    if isinstance(xp, ShapeOnly) and xp.device == "cuda" and kernels_enabled():
        return shape_only_launchers(xp)
    if xp is np or getattr(xp, "__name__", "") != "cupy" or not kernels_enabled():
        return None
    return cupy_launchers()
