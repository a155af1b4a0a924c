"""Host threads: BLAS threads per rank, and the thread pool of the NumPy ops.

BLAS: ranks sharing a node's cores must not oversubscribe them. Environment variables
(OPENBLAS_NUM_THREADS, ...) only act before NumPy is imported; by the time cutp knows how many
ranks share the node, NumPy is loaded. So, like threadpoolctl, this finds the BLAS library
already loaded into the process and calls its own set-threads function.

The pool: `parallel_map` runs the ops' independent row blocks on a few threads (below).

The allocator: `keep_freed_host_memory` (glibc only) keeps the memory a step frees for the next
step instead of handing it back to the kernel (below).
"""
from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_SETTERS = (
    "scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads_64_", "openblas_set_num_threads64_",
    "openblas_set_num_threads", "MKL_Set_Num_Threads",
)
_GETTERS = (
    "scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads_64_", "openblas_get_num_threads64_",
    "openblas_get_num_threads", "MKL_Get_Max_Threads",
)


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's own ceiling for it on 64-bit machines


def keep_freed_host_memory() -> bool:
    """Asks glibc to serve host arrays up to 32 MiB from its heap and not to trim the heap.

    Backward frees each cached activation as soon as it has used it. With glibc's defaults the
    step's last frees leave the top of the heap empty, glibc returns it to the kernel, and the next
    forward faults every page in again: measured 0.26 -> 0.37 s per tiny step (tp=1, 2-core
    machine). With these two settings freed memory is reused as before (0.26 s). Process-wide
    (a host program embedding cutp on the CPU gets them too) and only on glibc; False when
    mallopt is unavailable or refuses."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


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
    if _blas is False:  # (NumPy, imported above, has loaded its BLAS)
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


# ---------------------------------------------------------------------------------------------
# Host threads for the NumPy row-blocked loops. NumPy's ufuncs and reductions run on one core
# (only the BLAS is threaded), so the ops hand their independent row blocks to a small thread
# pool; NumPy releases the GIL inside each ufunc, so the blocks really run in parallel (measured
# 1.7x on 2 cores for the causal softmax). One setting governs the BLAS and the ops: the pool
# has as many threads as the loaded BLAS library is set to (cutp.runtime.threads.set_blas_threads), or
# CUTP_OP_THREADS when set. The block split depends on the shapes only, every block is computed
# exactly as on one thread and cross-block partial results are summed in block order, so the
# threads add no rounding of their own (a BLAS call inside a block rounds as the BLAS does).
# ---------------------------------------------------------------------------------------------
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()
_local = threading.local()


def _find_blas_threads():
    """(get, set) thread-count functions of the loaded BLAS, or (None, None)."""
    blas = blas_library()
    return (None, None) if blas is None else (blas.get, blas.set)


def op_threads() -> int:
    """Threads the NumPy ops split their blocks over (1: serial)."""
    env = os.environ.get("CUTP_OP_THREADS")
    if env:
        return max(1, int(env))
    if _serial_depth:
        return _serial_saved
    get = _find_blas_threads()[0]
    return max(1, int(get())) if get is not None else 1


# The BLAS runs on one thread while a parallel_map is in flight (see there); nested or concurrent
# sections are counted so that the last one to end restores the caller's setting.
_serial_lock = threading.Lock()
_serial_depth = 0
_serial_saved = 1


def _blas_serial_enter():
    global _serial_depth, _serial_saved
    get, set_ = _find_blas_threads()
    if get is None:
        return
    with _serial_lock:
        if _serial_depth == 0:
            _serial_saved = max(1, int(get()))
            if _serial_saved > 1:
                set_(1)
        _serial_depth += 1


def _blas_serial_exit():
    global _serial_depth
    get, set_ = _find_blas_threads()
    if get is None:
        return
    with _serial_lock:
        _serial_depth -= 1
        if _serial_depth == 0 and _serial_saved > 1:
            set_(_serial_saved)


# OpenBLAS's idle workers busy-wait (a sched_yield loop) for 2**28 cycles, ~0.1 s, after every
# BLAS call: on a machine with as many threads as cores they would take the cores from the ops'
# pool threads for most of the step (measured: the 2-thread causal softmax became slower than
# the 1-thread one right after a GEMM). So when the pool starts, idle workers are set to sleep
# after 2**BLAS_THREAD_TIMEOUT cycles (some 20 microseconds: back-to-back GEMMs still find them
# awake; waking one costs microseconds, nothing next to a GEMM) unless the user chose a value
# with OPENBLAS_THREAD_TIMEOUT / GOTO_THREAD_TIMEOUT (OpenBLAS reads it at start-up; here it is
# set, re-read with openblas_read_env, and the idle workers restarted; measured on 2 cores: the
# tiny GPT's step 20% faster with the pool, 2**4 .. 2**20 equivalent).
BLAS_THREAD_TIMEOUT = 16
_blas_tuned = False


def _quiet_blas_workers():
    global _blas_tuned
    if _blas_tuned or threading.current_thread() is not threading.main_thread():
        return
    _blas_tuned = True
    if os.environ.get("OPENBLAS_THREAD_TIMEOUT") or os.environ.get("GOTO_THREAD_TIMEOUT"):
        return
    try:
        blas = blas_library()
        lib = None if blas is None else blas.lib
        if lib is not None and all(hasattr(lib, f) for f in ("openblas_read_env", "blas_thread_shutdown_",
                                                              "openblas_thread_timeout")):
            os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(BLAS_THREAD_TIMEOUT)
            try:
                lib.openblas_read_env()  # re-reads the environment, thread count unchanged
            finally:
                del os.environ["OPENBLAS_THREAD_TIMEOUT"]  # not inherited by child processes
            lib.blas_thread_shutdown_()  # the next BLAS call restarts the workers with it
    except Exception:  # a BLAS without these entry points: leave it as it is
        pass


def _pool_for(n):
    global _pool, _pool_size
    _quiet_blas_workers()
    with _pool_lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="cutp-ops", initializer=_mark_worker)
            _pool_size = n
        return _pool


def _mark_worker():
    _local.worker = True


def _run_items(fn, items, errors=None):
    if errors is None:
        return [fn(it) for it in items]
    with np.errstate(**errors):  # (NumPy's error state is the thread's own: the caller's, as if serial)
        return [fn(it) for it in items]


def parallel_map(xp, fn, items):
    """``[fn(item) for item in items]``, split over :func:`op_threads` threads on NumPy.

    ``fn`` must only write to its own item's part of the outputs. Runs serially off NumPy,
    for a single item, with one thread, or when nested in another parallel_map. Results come
    back in item order; an exception in any item is raised here. While the items run, the BLAS
    is set to one thread (restored afterwards): items may call BLAS (the attention's batched
    matmuls, GEMV column sums), and two threads each driving a multi-threaded OpenBLAS
    serialise on its single worker pool (measured 4x slower than either alone).
    """
    items = list(items)
    if getattr(xp, "shape_only", False):  # the planner's arrays: the blocks booked as threads would run them
        return xp.parallel_map(fn, items)
    if xp is not np or len(items) < 2 or getattr(_local, "worker", False):
        return [fn(it) for it in items]
    n = min(op_threads(), len(items))
    if n <= 1:
        return [fn(it) for it in items]
    pool = _pool_for(n - 1)
    chunks = [items[i::n] for i in range(n)]  # interleaved: the shorter last block spreads out
    _blas_serial_enter()
    _local.worker = True
    try:
        futures = [pool.submit(_run_items, fn, c, np.geterr()) for c in chunks[1:]]
        try:
            first = _run_items(fn, chunks[0])  # the calling thread takes a share too
        finally:
            for f in futures:  # every item has finished before the BLAS is reset
                f.exception()
        parts = [first] + [f.result() for f in futures]
    finally:
        _local.worker = False
        _blas_serial_exit()
    out = [None] * len(items)
    for i, part in enumerate(parts):
        out[i::n] = part
    return out
