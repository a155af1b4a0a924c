"""Limit BLAS threads per rank, so ranks sharing a node's cores do not oversubscribe them.

Environment variables (OPENBLAS_NUM_THREADS, ...) only act before NumPy is imported; by the time
cutp knows how many ranks share the node, NumPy is loaded. So, like threadpoolctl, this finds
the BLAS library already loaded into the process and calls its own set-threads function.
"""
from __future__ import annotations

import ctypes
import os

_SETTERS = (
    "scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads_64_", "openblas_set_num_threads64_",
    "openblas_set_num_threads", "MKL_Set_Num_Threads",
)
_GETTERS = (
    "scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads_64_", "openblas_get_num_threads64_",
    "openblas_get_num_threads", "MKL_Get_Max_Threads",
)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _loaded_blas_paths():
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return []
    return sorted(p for p in paths if "blas" in os.path.basename(p).lower() or "mkl_rt" in p)


def _find(lib, names):
    for n in names:
        fn = getattr(lib, n, None)
        if fn is not None:
            return fn
    return None


class BlasLibrary:
    """The BLAS loaded into this process and its thread-count functions (found once)."""

    def __init__(self, path, lib, get, set_):
        self.path, self.lib, self.get, self.set = path, lib, get, set_


_blas: BlasLibrary | None | bool = False  # False: not looked up yet


def blas_library() -> BlasLibrary | None:
    """The loaded BLAS with both a get- and a set-threads function, or None. Cached: the ops ask
    for the thread count on every call."""
    global _blas
    if _blas is False:
        import numpy  # noqa: F401  (make sure NumPy's BLAS is loaded)

        _blas = None
        for path in _loaded_blas_paths():
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            get, set_ = _find(lib, _GETTERS), _find(lib, _SETTERS)
            if get is not None and set_ is not None:
                get.restype = ctypes.c_int
                _blas = BlasLibrary(path, lib, get, set_)
                break
    return _blas


def set_blas_threads(n: int) -> str:
    """Sets the loaded BLAS to n threads; returns a description for the start-up banner."""
    n = max(1, int(n))
    blas = blas_library()
    if blas is not None:
        blas.set(ctypes.c_int(n))
        return f"{blas.get()} BLAS thread(s) per rank ({os.path.basename(blas.path)})"
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    return f"BLAS library not found in the process; set OMP_NUM_THREADS={n} for child processes"


def get_blas_threads() -> int | None:
    blas = blas_library()
    return None if blas is None else int(blas.get())


def threads_per_rank(local_ranks: int) -> int:
    return max(1, available_cores() // max(1, local_ranks))
