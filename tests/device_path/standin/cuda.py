"""``cupy.cuda`` of the stand-in (devices, runtime, NVRTC version) and ``cupy.RawModule``.

RawModule: a module whose code is one of cutp's kernel sources (kernels/runtime.kernel_source)
runs in the CUDA emulator (tests/cuda_emu), all sources as one build (the one the kernel tests
share, cached on disk); other code is compiled by the emulator on its own. A launch takes the
stand-in's device arrays (a host array is refused, as a GPU would fault on it) and records reads
of ``const`` pointer arguments and writes of the others on its stream.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from . import tracking
from .array import ndarray

N_DEVICES = int(os.environ.get("CUTP_STANDIN_GPUS", "8"))
_current = threading.local()


class CUDARuntimeError(RuntimeError):
    pass


class Device:
    def __init__(self, device=None):
        self.id = getDevice() if device is None else int(device)
        if not 0 <= self.id < N_DEVICES:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: device {self.id} (the stand-in has {N_DEVICES})")

    def use(self):
        setDevice(self.id)

    def __enter__(self):
        self._prev = getDevice()
        setDevice(self.id)
        return self

    def __exit__(self, *exc):
        setDevice(self._prev)
        return False

    def synchronize(self):
        tracking.device_synchronize()

    @property
    def pci_bus_id(self):
        return f"0000:{self.id + 0x18:02X}:00.0"

    @property
    def compute_capability(self):
        return "90"

    @property
    def attributes(self):
        return {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448,
                "MaxThreadsPerBlock": 1024, "WarpSize": 32}

    @property
    def cublas_handle(self):
        from . import cublas

        h = getattr(_current, "cublas", None)
        if h is None:
            h = _current.cublas = cublas.create()
        # CuPy sets the handle's stream to the current stream each time it hands the handle out
        cublas._handles[h] = tracking.get_current_stream()
        return h

    @property
    def mem_info(self):
        return (80 * 2**30 - tracking.DEFAULT_POOL.used_bytes(), 80 * 2**30)

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __int__(self):
        return self.id


class runtime:
    """cupy.cuda.runtime (the functions cutp calls)."""

    CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14  # (the data types gemmEx takes)
    CUDARuntimeError = CUDARuntimeError

    @staticmethod
    def getDeviceCount():
        return N_DEVICES

    @staticmethod
    def getDevice():
        return getDevice()

    @staticmethod
    def setDevice(device):
        setDevice(device)

    @staticmethod
    def deviceSynchronize():
        tracking.device_synchronize()

    @staticmethod
    def runtimeGetVersion():
        return 12040

    @staticmethod
    def driverGetVersion():
        return 12040

    @staticmethod
    def memGetInfo():
        return Device().mem_info

    @staticmethod
    def getDeviceProperties(device):
        return {"name": b"CuPy stand-in (NumPy on the CPU)", "totalGlobalMem": 80 * 2**30, "multiProcessorCount": 132,
                "major": 9, "minor": 0, "sharedMemPerBlockOptin": 232448, "clockRate": 1980000,
                "memoryClockRate": 2619000, "memoryBusWidth": 5120, "pciBusID": 0x18 + int(device)}


def getDevice():
    return getattr(_current, "device", 0)


def setDevice(device):
    if not 0 <= int(device) < N_DEVICES:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: device {device}")
    _current.device = int(device)


class nvrtc:
    @staticmethod
    def getVersion():
        return (12, 4)


# ------------------------------------------------------------------------------------------------
# Kernels in the emulator
# ------------------------------------------------------------------------------------------------
_shared = {}
_shared_lock = threading.Lock()


def _kernels_module():
    """One emulated build of every cutp kernel source (the kernel tests' session build)."""
    with _shared_lock:
        if "all" not in _shared:
            from cutp.kernels import SOURCES
            from tests.cuda_emu import KERNELS_DIR, EmulatedModule

            _shared["all"] = EmulatedModule(path=[KERNELS_DIR / f"{s}.cu" for s in SOURCES])
        return _shared["all"]


def _source_name(code: str) -> str | None:
    from cutp.kernels import SOURCES
    from cutp.kernels.runtime import kernel_source

    with _shared_lock:
        if "texts" not in _shared:
            _shared["texts"] = {kernel_source(s): s for s in SOURCES}
    return _shared["texts"].get(code)


class RawKernel:
    def __init__(self, emulated, name):
        self._k = emulated
        self.name = name
        self._kinds = ["r" if p.is_const else "w" for p in emulated.params]

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._k.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, v):
        self._k.max_dynamic_shared_size_bytes = v

    @property
    def shared_size_bytes(self):
        return self._k.shared_size_bytes

    @property
    def max_threads_per_block(self):
        return self._k.max_threads_per_block

    @property
    def attributes(self):
        return {"max_threads_per_block": self.max_threads_per_block, "shared_size_bytes": self.shared_size_bytes}

    def __call__(self, grid, block, args, shared_mem=0, stream=None, enable_cooperative_groups=False):
        where = tracking.place()
        host = [i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.ndim > 0]
        if host:
            raise TypeError(f"kernel {self.name} launched at {where} with a host array as argument {host[0]} "
                            "(a GPU would fault on the host pointer)")
        views = [a._a if isinstance(a, ndarray) else a for a in args]
        s = tracking.get_current_stream() if stream is None else stream
        arrays = [(v, k) for v, k in zip(views, self._kinds) if isinstance(v, np.ndarray)]
        tracking.access([v for v, _ in arrays], "r", s, where)
        self._k(grid, block, tuple(views), shared_mem=shared_mem)
        tracking.CALLS[f"kernel {self.name}"] += 1
        tracking.access([v for v, k in arrays if k == "w"], "w", s, where)


class RawModule:
    def __init__(self, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        name = _source_name(code) if code is not None else None
        if name is not None:
            self._mod = _kernels_module()
        else:
            from tests.cuda_emu import EmulatedModule

            self._mod = EmulatedModule(code=code, path=path, options=options, name_expressions=name_expressions)
        self._functions = {}

    def get_function(self, name):
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = RawKernel(self._mod.get_function(name), name)
        return fn
