"""Small helpers shared by the ops: dtype policy and row blocking.

Dtype policy (every op follows it):

* float32 and float64 inputs are computed in their own precision;
* low-precision inputs (bfloat16 from ``ml_dtypes``, float16) are computed in float32 and the
  op's main outputs are cast back to the input dtype; statistics (means, rstd, row maxima,
  sums of exponentials, losses) stay in the compute dtype (float32).
"""
from __future__ import annotations

import numpy as np

from ..runtime.backend import on_host
from ..runtime.threads import parallel_map  # noqa: F401  (the ops' thread pool, re-exported for them)

_LOW_PRECISION = ("bfloat16", "float16")
_FULL_PRECISION = ("float32", "float64")

# Row-blocked NumPy loops (cross-entropy, layernorm, softmax, fused bias+GeLU) keep each
# temporary near this many elements (1 MiB of float32), so the chain of passes over a block
# runs in the CPU's L2 cache and no [N, V]-sized temporary is ever allocated. Measured on
# 1024 x 50304 cross-entropy and 4096 x 768 layernorm: 2^16..2^20 are within noise of each
# other and 10-40% faster than whole-array passes.
BLOCK_ELEMS = 1 << 18


# compute_dtype's answers by the dtype asked about: NumPy computes ``dtype.name`` in Python (~2 us,
# more under load), and the ops ask a few hundred times per step (measured: the tiny preset's step
# spent ~1% of its time in it); a dict lookup is ~0.1 us.
_COMPUTE_DTYPES: dict = {}


def compute_dtype(dtype) -> np.dtype:
    """The dtype an op computes in for inputs of ``dtype``."""
    try:
        return _COMPUTE_DTYPES[dtype]
    except (KeyError, TypeError):  # (TypeError: an unhashable dtype-like, answered below)
        pass
    key, dtype = dtype, np.dtype(dtype)
    if dtype.name in _FULL_PRECISION:
        cdt = dtype
    elif dtype.name in _LOW_PRECISION:
        cdt = np.dtype(np.float32)
    else:
        raise TypeError(f"cutp.ops: unsupported floating dtype {dtype} (use float32, float64, bfloat16 or float16)")
    try:
        _COMPUTE_DTYPES[key] = cdt
    except TypeError:
        pass
    return cdt


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
    if not on_host(xp) or total < 2 * MIN_SPLIT_ELEMS or n_rows < 2:
        return [slice(0, n_rows)]
    rb = max(1, BLOCK_ELEMS // width)
    want = min(MIN_BLOCKS, total // MIN_SPLIT_ELEMS)
    if -(-n_rows // rb) < want:
        rb = max(1, -(-n_rows // want))
    return [slice(r, min(r + rb, n_rows)) for r in range(0, n_rows, rb)]


def even_row_blocks(xp, n_rows: int, width: int):
    """:func:`row_blocks`' count of blocks made even (when there are rows for it) and the rows
    shared out equally, for ops whose results do not depend on the split (each row or element
    computed alone, no sum across blocks): the pool's threads then get equal work. (row_blocks'
    own split stays as it is where blocks' partial sums are added, to keep their bits: e.g. 3
    blocks of [16, 24576] q/k heads gave two threads 10 and 6 rows; 4 blocks of 1024 x 768 rows
    341, 341, 341 and 1.)"""
    n = len(row_blocks(xp, n_rows, width))
    if n < 2:
        return [slice(0, n_rows)]
    n = min(n_rows, n + n % 2)
    rb, extra = divmod(n_rows, n)
    bounds = [i * rb + min(i, extra) for i in range(n + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(n)]


# Elementwise NumPy ops walk the flattened arrays in blocks of this many elements, so their
# chains of in-place passes run in cache (measured ~25% faster than whole-array passes for
# GeLU on 6M elements) and bfloat16 casts need only block-sized float32 temporaries.
# (Measured: 2^16..2^18 equivalent.)
ELEMENTWISE_BLOCK = 1 << 17


def flat_blocks(xp, n: int, block: int = ELEMENTWISE_BLOCK):
    """Slices of ``block`` elements covering ``range(n)`` for blocked elementwise loops (one
    slice off NumPy)."""
    if not on_host(xp) or n <= block:
        return [slice(0, n)]
    return [slice(s, min(s + block, n)) for s in range(0, n, block)]


def leading_dimension(x) -> int:
    """The row stride in elements of a 2-D operand whose rows are contiguous (a BLAS's lda, or a
    compiled kernel's row stride; a single row: its width, at least 1)."""
    rows, cols = x.shape
    return max(1, cols) if rows <= 1 else x.strides[0] // x.itemsize


def row_sums(xp, a):
    """``a.sum(axis=-1, keepdims=True)``; on NumPy, for a C-contiguous float32/float64 array, one
    GEMV ``a2 @ ones`` over the rows (4-5x faster than NumPy's reduction for rows of 128-768)."""
    if on_host(xp) and a.flags.c_contiguous and a.dtype in (np.float32, np.float64) and a.ndim >= 1:
        width = a.shape[-1]
        return (a.reshape(-1, width) @ xp.ones(width, a.dtype)).reshape(a.shape[:-1] + (1,))
    return a.sum(axis=-1, keepdims=True)


def col_sum(xp, a):
    """Column sums of a 2-D array as one GEMV ``ones @ a`` (about 2x faster than
    ``a.sum(axis=0)`` on NumPy float32, and accumulated by BLAS rather than row by row)."""
    return xp.ones(a.shape[0], dtype=a.dtype) @ a
