"""Small helpers shared by the ops: dtype policy and row blocking.

Dtype policy (every op follows it):

* float32 and float64 inputs are computed in their own precision;
* low-precision inputs (bfloat16 from ``ml_dtypes``, float16) are computed in float32 and the
  op's main outputs are cast back to the input dtype; statistics (means, rstd, row maxima,
  sums of exponentials, losses) stay in the compute dtype (float32).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_LOW_PRECISION = ("bfloat16", "float16")
_FULL_PRECISION = ("float32", "float64")

# Row-blocked NumPy loops (cross-entropy, layernorm, softmax, fused bias+GeLU) keep each
# temporary near this many elements (1 MiB of float32), so the chain of passes over a block
# runs in the CPU's L2 cache and no [N, V]-sized temporary is ever allocated. Measured on
# 1024 x 50304 cross-entropy and 4096 x 768 layernorm: 2^16..2^20 are within noise of each
# other and 10-40% faster than whole-array passes.
BLOCK_ELEMS = 1 << 18


def compute_dtype(dtype) -> np.dtype:
    """The dtype an op computes in for inputs of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype.name in _FULL_PRECISION:
        return dtype
    if dtype.name in _LOW_PRECISION:
        return np.dtype(np.float32)
    raise TypeError(f"cutp.ops: unsupported floating dtype {dtype} (use float32, float64 or bfloat16)")


def is_low_precision(dtype) -> bool:
    return np.dtype(dtype).name in _LOW_PRECISION


def as_dtype(a, dtype):
    """``a`` itself when it already has ``dtype``, else a converted copy."""
    return a if a.dtype == dtype else a.astype(dtype)


# Arrays of at least 2 * MIN_SPLIT_ELEMS elements are cut into up to MIN_BLOCKS blocks (of at
# least MIN_SPLIT_ELEMS each), so that mid-sized arrays also spread over the ops' threads
# (measured on 2 cores: a [2048, 512] LayerNorm backward 2.3 -> 1.3 ms; with blocks below 2**17
# elements the threads' overhead ate the gain). The split depends on the shape only, never on the
# thread count, so results do not depend on it either.
MIN_SPLIT_ELEMS = 1 << 17
MIN_BLOCKS = 4


def row_blocks(xp, n_rows: int, width: int):
    """Slices covering ``range(n_rows)``: blocks of about ``BLOCK_ELEMS`` elements on NumPy
    (at least ``MIN_BLOCKS`` of them when each still has ``MIN_SPLIT_ELEMS``), a single block on
    other array modules (the GPU prefers one big launch)."""
    width = max(width, 1)
    total = n_rows * width
    if xp is not np or total < 2 * MIN_SPLIT_ELEMS or n_rows < 2:
        return [slice(0, n_rows)]
    rb = max(1, BLOCK_ELEMS // width)
    want = min(MIN_BLOCKS, total // MIN_SPLIT_ELEMS)
    if -(-n_rows // rb) < want:
        rb = max(1, -(-n_rows // want))
    return [slice(r, min(r + rb, n_rows)) for r in range(0, n_rows, rb)]


# Elementwise NumPy ops walk the flattened arrays in blocks of this many elements, so their
# chains of in-place passes run in cache (measured ~25% faster than whole-array passes for
# GeLU on 6M elements) and bfloat16 casts need only block-sized float32 temporaries.
# (Measured: 2^16..2^18 equivalent.)
ELEMENTWISE_BLOCK = 1 << 17


def flat_blocks(xp, n: int):
    """Slices covering ``range(n)`` for blocked elementwise loops (one slice off NumPy)."""
    if xp is not np or n <= ELEMENTWISE_BLOCK:
        return [slice(0, n)]
    b = ELEMENTWISE_BLOCK
    return [slice(s, min(s + b, n)) for s in range(0, n, b)]


def row_sums(xp, a):
    """``a.sum(axis=-1, keepdims=True)``; on NumPy, for a C-contiguous float32/float64 array, one
    GEMV ``a2 @ ones`` over the rows (4-5x faster than NumPy's reduction for rows of 128-768)."""
    if xp is np and a.flags.c_contiguous and a.dtype in (np.float32, np.float64) and a.ndim >= 1:
        width = a.shape[-1]
        return (a.reshape(-1, width) @ np.ones(width, a.dtype)).reshape(a.shape[:-1] + (1,))
    return a.sum(axis=-1, keepdims=True)


def col_sum(xp, a):
    """Column sums of a 2-D array as one GEMV ``ones @ a`` (about 2x faster than
    ``a.sum(axis=0)`` on NumPy float32, and accumulated by BLAS rather than row by row)."""
    return xp.ones(a.shape[0], dtype=a.dtype) @ a


# ---------------------------------------------------------------------------------------------
# Host threads for the NumPy row-blocked loops. NumPy's ufuncs and reductions run on one core
# (only the BLAS is threaded), so the ops hand their independent row blocks to a small thread
# pool; NumPy releases the GIL inside each ufunc, so the blocks really run in parallel (measured
# 1.7x on 2 cores for the causal softmax). One setting governs the BLAS and the ops: the pool
# has as many threads as the loaded BLAS library is set to (cutp.threads.set_blas_threads), or
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
    from cutp.threads import blas_library

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
        from cutp.threads import blas_library

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


def _run_items(fn, items):
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
        futures = [pool.submit(_run_items, fn, c) for c in chunks[1:]]
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
