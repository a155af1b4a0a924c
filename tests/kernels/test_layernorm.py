"""kernels/layernorm.cu through its launchers (kernels/layernorm.py) against cutp/ops/layernorm.py, on each backend.

layernorm_forward / layernorm_backward with and without weight and bias (and the column_sum of
kernels/reduce.cu, the parameter gradients' second pass): a warp per row up to C = 2048 and a
block per row beyond, more than 48 KiB of shared memory in the backward; float32 within ~1e-5
relative, bfloat16 against the reference on the same bf16 inputs; the gradients bit-identical
under every thread schedule and run to run.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops

from cutp.kernels import Launchers
from cutp.kernels.layernorm import LAYERNORM_WARP_ROW_MAX

from .helpers import DT_IDS, DTYPES, F32, bits, close, gpu_sized, randn

# (5, 1): rows of one column (xhat == 0: y == bias, dx == 0); (1, 4999): one row, a block per row
# whose threads loop over several 128-bit chunks, ending in a partial chunk, in the forward and
# (f32 and bf16: over 512 threads * pack) in the backward; GPT-2 widths (768, 1600); (3, 2049):
# the first block-per-row width; (2, 7000), (2, 8192): over 48 KiB of shared memory in the backward
LN_SHAPES = [(1, 1), (5, 1), (3, 5), (4, 32), (2, 3, 37), (5, 64), (0, 8), (2, 2500), (1, 4999),
             (8, 768), (5, 1600), (3, 2049), (2, 7000), (2, 8192), gpu_sized((1024, 768))]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm_forward_backward(backend, ks, dtype, affine, shape):
    k = ks
    dev = backend.to_device
    C = shape[-1]
    x = randn(shape, dtype, seed=13, scale=2.0) + np.asarray(0.5, dtype)
    w = randn((C,), dtype, seed=14) if affine in ("wb", "w") else None
    b = randn((C,), dtype, seed=15) if affine == "wb" else None
    dy = randn(shape, dtype, seed=16)
    y, mean, rstd = k.layernorm_forward(dev(x), None if w is None else dev(w), None if b is None else dev(b), 1e-5)
    y_ref, lctx = ops.layernorm_forward(x, w, b, 1e-5)
    close(y, y_ref, dtype, atol=1e-5 if dtype == F32 else None)
    close(mean, lctx.mean.reshape(-1), F32, atol=1e-6)
    close(rstd, lctx.rstd.reshape(-1), F32, rtol=1e-5)
    dx, dw, db = k.layernorm_backward(dev(dy), dev(x), None if w is None else dev(w), mean, rstd,
                                      None if b is None else b.dtype)
    dx_ref, dw_ref, db_ref = ops.layernorm_backward(dy, lctx)
    close(dx, dx_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 if dtype == F32 else None)
    for got, want in ((dw, dw_ref), (db, db_ref)):
        if want is None:
            assert got is None
        else:
            close(got, want, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 * max(1, x.size // C))


def _check_layernorm(backend, k, x, dtype, w_seed, params=True):
    """Forward and backward of LayerNorm with weight and bias on x against the reference."""
    dev = backend.to_device
    shape = x.shape
    C = shape[-1]
    w = randn((C,), dtype, seed=w_seed)
    b = randn((C,), dtype, seed=w_seed + 1)
    dy = randn(shape, dtype, seed=w_seed + 2)
    y, mean, rstd = k.layernorm_forward(dev(x), dev(w), dev(b), 1e-5)
    y_ref, lctx = ops.layernorm_forward(x, w, b, 1e-5)
    close(y, y_ref, dtype, atol=1e-5 if dtype == F32 else None)
    close(mean, lctx.mean.reshape(-1), F32, atol=1e-6)
    close(rstd, lctx.rstd.reshape(-1), F32, rtol=1e-5)
    if not params:
        return
    dx, dw, db = k.layernorm_backward(dev(dy), dev(x), dev(w), mean, rstd, b.dtype)
    dx_ref, dw_ref, db_ref = ops.layernorm_backward(dy, lctx)
    close(dx, dx_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 if dtype == F32 else None)
    atol = 1e-4 * max(1, x.size // C) ** 0.5
    close(dw, dw_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=atol if dtype == F32 else None)
    close(db, db_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=atol if dtype == F32 else None)


# the kernel tests' widths: 1, 31, 33 around a warp; 768 and 1024 (GPT-2) in warp-per-row mode;
# 6144 in block-per-row mode (48 KiB of shared memory in the backward); 50257 in the forward only
# (1024 threads; its backward would need 393 KiB of shared memory)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", [(3, 1), (3, 31), (4, 33), (5, 768), (3, 1024), (2, 6144), (1, 50257)])
def test_layernorm_widths(backend, ks, dtype, shape):
    assert 1024 <= LAYERNORM_WARP_ROW_MAX < 6144, "these widths no longer reach both row modes"
    x = randn(shape, dtype, seed=50, scale=2.0) + np.asarray(0.5, dtype)
    _check_layernorm(backend, ks, x, dtype, 51, params=shape[-1] <= 8192)


# rows 1 to 8192 over narrow columns: the parameter gradients' first pass gives each block a chunk
# of rows (COLUMN_REDUCTION_BLOCKS blocks in all), several rows per chunk beyond 1024 rows, with a
# partial last chunk at 1025 and 3001; the second pass adds up to 1024 chunks. (1025, 130): two
# warps per block and two rows in a chunk: the block reduction of one row must not overwrite its
# shared partial sums before every warp has read the last row's (block_reduce_sum2's barrier)
@pytest.mark.parametrize("rows,C", [(1, 8), (2, 24), (1023, 12), (1025, 8), (3001, 5), (8192, 4), (1025, 130)])
def test_layernorm_gradients_over_many_rows(backend, k, rows, C):
    n_chunks, per_chunk = Launchers._row_chunks(rows, 1)
    assert (per_chunk > 1) == (rows > 1024) and n_chunks * per_chunk >= rows
    # spread over the columns, so no row of a few columns has a near-zero variance (an ill-conditioned dx)
    x = randn((rows, C), F32, seed=52, scale=0.5) + np.linspace(-2, 2, C, dtype=np.float32)
    _check_layernorm(backend, k, x, F32, 53)


def test_layernorm_backward_over_48k_of_shared_memory(backend, k):
    """2 * C floats of shared memory above 48 KiB: the launcher raises the kernel's limit."""
    dev = backend.to_device
    C = 6200  # 49600 bytes
    x = randn((2, C), F32, seed=17)
    w = randn((C,), F32, seed=18)
    b = randn((C,), F32, seed=19)
    dy = randn((2, C), F32, seed=20)
    y, mean, rstd = k.layernorm_forward(dev(x), dev(w), dev(b))
    _, lctx = ops.layernorm_forward(x, w, b)
    dx, dw, db = k.layernorm_backward(dev(dy), dev(x), dev(w), mean, rstd, b.dtype)
    dx_ref, dw_ref, db_ref = ops.layernorm_backward(dy, lctx)
    close(dx, dx_ref, F32, rtol=1e-4, atol=1e-5)
    close(dw, dw_ref, F32, rtol=1e-4, atol=1e-5)
    close(db, db_ref, F32, rtol=1e-5, atol=1e-6)
    assert k.function("layernorm", "layernorm_backward_f32").max_dynamic_shared_size_bytes >= 2 * C * 4


@pytest.mark.parametrize("shape", [(700, 24), gpu_sized((8192, 768))])
def test_layernorm_gradients_are_deterministic(backend, shape):
    x = backend.to_device(randn(shape, F32, seed=21))
    dy = backend.to_device(randn(shape, F32, seed=22))
    w = backend.to_device(randn(shape[-1:], F32, seed=23))
    out = []
    for kk in backend.launchers_for_determinism():
        _, mean, rstd = kk.layernorm_forward(x, w, w)
        out.append(kk.layernorm_backward(dy, x, w, mean, rstd, F32))
    for dx, dw, db in out[1:]:
        for a, b in zip((dx, dw, db), out[0]):
            np.testing.assert_array_equal(bits(a), bits(b))
