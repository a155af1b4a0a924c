"""A CuPy stand-in for tests: plays ``cupy`` for cutp on the CPU, NumPy arrays underneath.

Never imported by a user's run: ``install()`` registers the modules ``cupy``, ``cupy.cuda``,
``cupy.cuda.nccl``, ``cupy.cuda.cublas``, ... and ``cupyx.scipy.special`` in ``sys.modules``;
tests/device_path/shim/sitecustomize.py calls it in every process (MPI ranks included) when
``$CUTP_CUPY_STANDIN=1``, which only the device-path tests and ``make test-device`` set. Then
``examples/train_gpt.py --device cuda`` runs unchanged:

* arrays (array.py): NumPy views of device allocations from a counting pool (tracking.py);
* kernels (cuda.py): every ``RawModule`` launch in the CUDA emulator (tests/cuda_emu), with the
  launchers' own grids and blocks;
* cuBLAS (cublas.py): gemmEx from pointers, leading dimensions, types, transposes, alpha/beta;
* NCCL (nccl.py): communicators over MPI, group calls, dtypes;
* streams and events (tracking.py): ordering modelled by vector clocks; unordered accesses of
  two streams, or host reads of unsynchronized device memory, raise RaceError/HostSyncError
  naming both places; host synchronizations are counted per step (``SYNCS``).

``$CUTP_STANDIN_REPORT=path`` writes, at exit, the host syncs per step, the pool's peak and the
array routines run with their operands' dtypes as JSON (path gets ``.<world rank>`` appended).
"""
from __future__ import annotations

import atexit
import json
import math
import os
import sys
import types

import numpy as np

from . import array as _array
from . import cublas, cuda, nccl, tracking
from .array import FUNCTIONS, DTYPE_NAMES, ndarray, to_device, wrap, _call

ndarray.__module__ = "cupy"  # what cutp.runtime.backend.is_cupy_array looks at
ndarray.__qualname__ = ndarray.__name__ = "ndarray"
__version__ = "14.0.0"


class ufunc:
    """A NumPy ufunc run on device arrays (cupy.ufunc: __call__, at, reduce, outer, accumulate)."""

    def __init__(self, np_ufunc):
        self._u = np_ufunc
        self.__name__ = np_ufunc.__name__
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def __call__(self, *args, **kwargs):
        return _call(self._u, self.__name__, args, kwargs)

    def at(self, a, indices, b=None):
        if a.dtype.name == "bfloat16":
            raise TypeError(f"stand-in (as CuPy 14): {self.__name__}.at has no bfloat16 atomics")
        args = (a, indices) if b is None else (a, indices, b)
        return _call(self._u.at, f"{self.__name__}.at", args, {}, in_place_first=True)

    def reduce(self, *args, **kwargs):
        return _call(self._u.reduce, f"{self.__name__}.reduce", args, kwargs)

    def outer(self, *args, **kwargs):
        return _call(self._u.outer, f"{self.__name__}.outer", args, kwargs)

    def accumulate(self, *args, **kwargs):
        return _call(self._u.accumulate, f"{self.__name__}.accumulate", args, kwargs)


def _function(name):
    np_fn = getattr(np, name)
    if isinstance(np_fn, np.ufunc):
        return ufunc(np_fn)

    def f(*args, **kwargs):
        return _call(np_fn, name, args, kwargs)

    f.__name__ = name
    return f


# ---- creation and transfer ------------------------------------------------------------------
def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype, order=order)


def zeros(shape, dtype=float, order="C"):
    a = ndarray(shape, dtype, order=order)
    tracking.access([a._a], "w")
    a._a.fill(0)
    return a


def ones(shape, dtype=float, order="C"):
    a = ndarray(shape, dtype, order=order)
    tracking.access([a._a], "w")
    a._a.fill(1)
    return a


def full(shape, fill_value, dtype=None, order="C"):
    dtype = np.asarray(fill_value).dtype if dtype is None else dtype
    a = ndarray(shape, dtype, order=order)
    tracking.access([a._a], "w")
    a._a.fill(fill_value)
    return a


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    return empty(prototype.shape if shape is None else shape, prototype.dtype if dtype is None else dtype)


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    return zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    return ones(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None):
    return full(a.shape if shape is None else shape, fill_value, a.dtype if dtype is None else dtype)


def asarray(a, dtype=None, order=None, *, blocking=False):
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:  # another library's device array: CuPy views its memory, no copy
        alloc = tracking.find(cai["data"][0])
        if alloc is None:
            raise ValueError(f"stand-in: __cuda_array_interface__ at {cai['data'][0]:#x} is not in device memory")
        view = ndarray._view(np.ndarray(cai["shape"], np.dtype(cai["typestr"]), buffer=alloc.buf,
                                        offset=cai["data"][0] - alloc.ptr, strides=cai.get("strides")), alloc)
        return asarray(view, dtype)
    h = np.asarray(a, dtype=dtype)
    out = ndarray(h.shape, h.dtype)
    tracking.access([out._a], "w")  # a host-to-device copy on the current stream
    out._a[...] = h
    return out


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        r = obj.astype(dtype if dtype is not None else obj.dtype, copy=True) if copy else asarray(obj, dtype)
        return r
    return asarray(np.array(obj, dtype=dtype, ndmin=ndmin))


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"stand-in: cupy.ascontiguousarray takes a cupy.ndarray, got {type(a).__name__} at "
                        f"{tracking.place()}")
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _call(np.ascontiguousarray, "ascontiguousarray", (a,), {} if dtype is None else {"dtype": dtype})


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def copyto(dst, src, casting="same_kind", where=None):
    if not isinstance(dst, ndarray):
        raise TypeError("stand-in: cupy.copyto's destination must be a cupy.ndarray")
    if isinstance(src, np.ndarray) and src.ndim > 0:
        raise TypeError(f"Unsupported type <class 'numpy.ndarray'> (stand-in, as CuPy: cupy.copyto from a host array "
                        f"at {tracking.place()})")
    kw = {"casting": casting} if where is None else {"casting": casting, "where": where}
    _call(np.copyto, "copyto", (dst, src), kw, in_place_first=True)


def arange(start, stop=None, step=None, dtype=None):
    h = np.arange(start, stop, step, dtype) if stop is not None else np.arange(start, dtype=dtype)
    return asarray(h)


def get_array_module(*args):
    return sys.modules["cupy"] if any(isinstance(a, ndarray) for a in args) else np


def get_default_memory_pool():
    return tracking.DEFAULT_POOL


def get_default_pinned_memory_pool():
    return tracking.PINNED_POOL


def _as_strided(x, shape=None, strides=None):
    return ndarray._view(np.lib.stride_tricks.as_strided(x._a, shape, strides), x._mem)


class _Generator:
    """cupy.random.Generator: NumPy's draws copied to the device."""

    def __init__(self, seed=None):
        self._g = np.random.default_rng(seed)

    def __getattr__(self, name):
        fn = getattr(self._g, name)

        def draw(*args, **kwargs):
            return wrap(np.asarray(fn(*args, **kwargs)))

        return draw


_LEGACY = np.random.default_rng(0)  # (CuPy's module-level draws: its global RandomState)


def _standard_normal(size=None, dtype=float):
    """cupy.random.standard_normal: float32 and float64 only, as CuPy's generator refuses others."""
    if np.dtype(dtype) not in (np.float32, np.float64):
        raise TypeError("cupy.random only supports float32 and float64")
    return wrap(np.asarray(_LEGACY.standard_normal(size, dtype=np.dtype(dtype).type)))


def _erf(x):
    v = np.frompyfunc(math.erf, 1, 1)(x._a.astype(np.float64)).astype(x.dtype)
    tracking.access([x._a], "r")
    return to_device(v)


def _erfc(x):
    v = np.frompyfunc(math.erfc, 1, 1)(x._a.astype(np.float64)).astype(x.dtype)
    tracking.access([x._a], "r")
    return to_device(v)


# ---- the module tree ------------------------------------------------------------------------
def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    m.__file__ = __file__
    return m


def build() -> dict[str, types.ModuleType]:
    memory = _module("cupy.cuda.memory", MemoryPool=tracking.MemoryPool, MemoryPointer=tracking.MemoryPointer,
                     alloc=tracking.alloc, set_allocator=tracking.set_allocator, get_allocator=tracking.get_allocator)
    nccl_m = _module("cupy.cuda.nccl", **{k: v for k, v in vars(nccl).items() if not k.startswith("_")})
    cublas_m = _module("cupy.cuda.cublas", **{k: v for k, v in vars(cublas).items()
                                              if not k.startswith("_") and k not in ("np", "ctypes", "tracking",
                                                                                     "ml_dtypes", "annotations")})
    runtime_m = _module("cupy.cuda.runtime", **{k: getattr(cuda.runtime, k) for k in dir(cuda.runtime)
                                                if not k.startswith("_")})
    nvrtc_m = _module("cupy.cuda.nvrtc", getVersion=cuda.nvrtc.getVersion)
    cuda_m = _module(
        "cupy.cuda", Device=cuda.Device, Stream=tracking.Stream, ExternalStream=tracking.Stream, Event=tracking.Event,
        get_current_stream=tracking.get_current_stream, get_elapsed_time=tracking.get_elapsed_time,
        MemoryPool=tracking.MemoryPool, MemoryPointer=tracking.MemoryPointer, PinnedMemoryPool=tracking.PinnedMemoryPool,
        alloc=tracking.alloc, set_allocator=tracking.set_allocator, get_allocator=tracking.get_allocator,
        using_allocator=tracking.using_allocator, runtime=runtime_m, nvrtc=nvrtc_m, nccl=nccl_m, cublas=cublas_m,
        memory=memory, is_available=lambda: True)
    random_m = _module("cupy.random", default_rng=_Generator, Generator=_Generator, standard_normal=_standard_normal)
    stride_m = _module("cupy.lib.stride_tricks", as_strided=_as_strided)
    lib_m = _module("cupy.lib", stride_tricks=stride_m)
    fns = {name: _function(name) for name in FUNCTIONS if hasattr(np, name)}
    cupy = _module("cupy", __version__=__version__, ndarray=ndarray, ufunc=ufunc, cuda=cuda_m, random=random_m,
                   lib=lib_m, RawModule=cuda.RawModule, RawKernel=None, **fns)
    del cupy.RawKernel
    for k in DTYPE_NAMES:
        if hasattr(np, k):
            setattr(cupy, k, getattr(np, k))
    cupy.__dict__.update(empty=empty, zeros=zeros, ones=ones, full=full, empty_like=empty_like, zeros_like=zeros_like,
                         ones_like=ones_like, full_like=full_like, asarray=asarray, array=array,
                         ascontiguousarray=ascontiguousarray, asnumpy=asnumpy, copyto=copyto, arange=arange,
                         get_array_module=get_array_module, get_default_memory_pool=get_default_memory_pool,
                         get_default_pinned_memory_pool=get_default_pinned_memory_pool)
    special = _module("cupyx.scipy.special", erf=_erf, erfc=_erfc)
    scipy_m = _module("cupyx.scipy", special=special)
    cupyx = _module("cupyx", scipy=scipy_m)
    return {"cupy": cupy, "cupy.cuda": cuda_m, "cupy.cuda.nccl": nccl_m, "cupy.cuda.cublas": cublas_m,
            "cupy.cuda.runtime": runtime_m, "cupy.cuda.nvrtc": nvrtc_m, "cupy.cuda.memory": memory,
            "cupy.random": random_m, "cupy.lib": lib_m, "cupy.lib.stride_tricks": stride_m, "cupyx": cupyx,
            "cupyx.scipy": scipy_m, "cupyx.scipy.special": special}


def install() -> types.ModuleType:
    """Registers the stand-in as ``cupy`` (and its submodules) in this process."""
    if getattr(sys.modules.get("cupy"), "__standin__", False):
        return sys.modules["cupy"]
    mods = build()
    mods["cupy"].__standin__ = True
    mods["cupy"].__standin_mark_step__ = mark_step
    sys.modules.update(mods)
    if os.environ.get("CUTP_STANDIN_REPORT"):
        atexit.register(_write_report, os.environ["CUTP_STANDIN_REPORT"])
    return mods["cupy"]


def mark_step():
    """Closes a training step of the host-sync count (SYNCS.steps)."""
    tracking.SYNCS.mark_step()


def _write_report(path):
    try:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else 0
    except Exception:
        rank = 0
    steps = [[{"reason": r, "place": p, "count": c} for (r, p), c in sorted(s.items())]
             for s in tracking.SYNCS.steps + [tracking.SYNCS.current]]
    with open(f"{path}.{rank}", "w") as f:
        json.dump({"host_syncs_per_step": steps, "pool_used_bytes": tracking.DEFAULT_POOL.used_bytes(),
                   "routines": sorted([n, list(d)] for n, d in tracking.ROUTINES)}, f, indent=1)
