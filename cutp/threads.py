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


def set_blas_threads(n: int) -> str:
    """Sets the loaded BLAS to n threads; returns a description for the start-up banner."""
    import numpy  # noqa: F401  (make sure NumPy's BLAS is loaded)

    n = max(1, int(n))
    for path in _loaded_blas_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        setter = _find(lib, _SETTERS)
        if setter is None:
            continue
        setter(ctypes.c_int(n))
        getter = _find(lib, _GETTERS)
        now = getter() if getter is not None else n
        return f"{now} BLAS thread(s) per rank ({os.path.basename(path)})"
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    return f"BLAS library not found in the process; set OMP_NUM_THREADS={n} for child processes"


def get_blas_threads() -> int | None:
    for path in _loaded_blas_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        getter = _find(lib, _GETTERS)
        if getter is not None:
            return int(getter())
    return None


def threads_per_rank(local_ranks: int) -> int:
    return max(1, available_cores() // max(1, local_ranks))
