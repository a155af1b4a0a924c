"""kernels/layernorm.cu through its launchers (kernels/layernorm.py) against cutp/ops/layernorm.py, on each backend.

layernorm_forward / layernorm_backward with and without weight and bias (and the column_sum of
kernels/reduce.cu, the parameter gradients' second pass): a warp per row up to C = 2048 and a
block per row beyond, more than 48 KiB of shared memory in the backward; float32 within ~1e-5
relative, bfloat16 against the reference on the same bf16 inputs; the gradients bit-identical
under every thread schedule and run to run, and element by element the correctly rounded sums of
their terms; bf16 at widths that take each vector path.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops

from cutp.kernels import Launchers
from cutp.kernels.layernorm import (
    LAYERNORM_BACKWARD_BLOCKS_PER_SM,
    LAYERNORM_WARP_ROW_MAX,
    layernorm_backward_grid,
    layernorm_backward_rows_per_block,
)
from cutp.kernels.runtime import TARGET_SM_COUNT

from .helpers import BF16, BF16_PATH_WIDTHS, DT_IDS, DTYPES, F32, bits, close, gpu_sized, randn
from .helpers import assert_correctly_rounded_column_sums as assert_correctly_rounded

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


# rows 1 to 8192 over narrow columns: the backward's grid is 2 x the SM count (fewer blocks when
# there are not R rows for each), each block over an even share of the rows, R row groups at a
# time, with idle groups in a block's last round (1, 2, 1023, 1025, 3001 rows: one round); the
# second pass adds the blocks' partials. 8192 rows: 2 rounds per block. (5000, 130): two warps per
# row group and 3 rounds per block: one round's group reduction must not overwrite its shared
# partial sums before every warp has read the last round's (row_group_reduce_sum2's trailing
# barrier)
@pytest.mark.parametrize("rows,C", [(1, 8), (2, 24), (1023, 12), (1025, 8), (3001, 5), (8192, 4), (1025, 130),
                                    (5000, 130)])
def test_layernorm_gradients_over_many_rows(backend, k, rows, C):
    R = layernorm_backward_rows_per_block(C, F32)
    n_blocks = layernorm_backward_grid(rows, C, F32, k.sm_count())
    assert R > 1 and n_blocks == min(-(-rows // R), LAYERNORM_BACKWARD_BLOCKS_PER_SM * k.sm_count())
    rounds = -(-(-(-rows // n_blocks)) // R)  # of the block with the most rows
    assert (rounds > 1) == (rows >= 5000), rounds
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


def test_layernorm_backward_fills_the_gpu_with_a_small_final_reduction(backend, monkeypatch):
    """GPT-2's LayerNorm backward (C = 768, B * T = 8192 rows): the main launch has >= 2 x the SM
    count blocks (LAYERNORM_BACKWARD_BLOCKS_PER_SM per SM: one wave of 512-thread blocks), each
    over many rows, and the final reduction (column_sum) reads only [2, blocks, C] floats: 1.6 MB
    at 132 SMs (the former first pass wrote 1024 chunks: 6.3 MB). Recorded, not run (the emulator
    would take minutes); test_layernorm_backward_partials_are_what_the_final_reduction_reads runs
    a smaller case and counts the bytes."""
    seen = []
    k = backend.launchers()
    monkeypatch.setattr(k, "_launch", lambda src, name, grid, block, args, shared_mem=0:
                        seen.append((name, grid, block, args, shared_mem)))
    xp = backend.xp
    C, rows = 768, 8192
    sm = k.sm_count()
    assert not backend.emulated or sm == TARGET_SM_COUNT == 132
    # float32: 192 threads per row, 2 rows at a time (12 KiB of accumulators); bf16: 96 x 5 (30 KiB)
    for dtype, suffix, block_shape in ((F32, "f32", (192, 2)), (BF16, "bf16", (96, 5))):
        seen.clear()
        x = xp.zeros((rows, C), dtype)
        m = xp.zeros(rows, np.float32)
        k.layernorm_backward(x, x, x[0], m, m, dtype)
        (name, grid, block, args, smem), *reductions = seen
        assert name == f"layernorm_backward_{suffix}" and grid == (2 * sm,) and grid[0] >= 2 * sm
        assert block == block_shape and smem == block[1] * 2 * C * 4
        assert rows // grid[0] >= 31  # many rows per block
        partial = args[1]
        assert partial.shape == (2, grid[0], C) and partial.nbytes == 2 * 2 * sm * C * 4
        if sm == 132:
            assert partial.nbytes == 1_622_016
        assert [r[0] for r in reductions] == [f"column_sum_{suffix}"] * 2  # dweight, dbias: the final reduction
        assert all(r[3][1].nbytes == partial.nbytes // 2 for r in reductions)


def test_layernorm_backward_partials_are_what_the_final_reduction_reads(backend, request):
    """Counted by the emulator: the main launch writes partial [2, blocks, C] once, the final
    reduction reads each of its bytes once; x and dy are read twice (the backward's two passes)."""
    if not backend.emulated:
        pytest.skip("traffic is counted by the emulator")
    if not request.getfixturevalue("emulated_module").checks:
        pytest.skip("traffic is counted by checked emulator builds only ($CUTP_EMU_CHECKS=0)")
    from tests.cuda_emu import record_traffic

    k = backend.launchers()
    rows, C = 5000, 96  # R = 16 row groups of 32 threads; 2 x 132 blocks of 18-19 rows (2 rounds)
    x = randn((rows, C), F32, seed=60) + np.linspace(-1, 1, C, dtype=np.float32)
    dy = randn((rows, C), F32, seed=61)
    w = randn((C,), F32, seed=62)
    _, mean, rstd = k.layernorm_forward(x, w, w)
    with record_traffic() as log:
        dx, dw, db = k.layernorm_backward(dy, x, w, mean, rstd, F32)
    main, *final = log
    assert main.kernel == "layernorm_backward_f32" and main.grid == (2 * TARGET_SM_COUNT, 1, 1)
    assert main.block == (32, layernorm_backward_rows_per_block(C, F32), 1) == (32, 16, 1)
    partial = main.param(1)
    assert partial.nbytes == 2 * main.grid[0] * C * 4
    assert (partial.read, partial.written) == (0, partial.nbytes)
    assert [f.kernel for f in final] == ["column_sum_f32"] * 2
    assert sum(f.param(1).read for f in final) == partial.nbytes
    assert main.param(3).read == 2 * x.nbytes and main.param(2).read == 2 * dy.nbytes
    assert (main.param(0).read, main.param(0).written) == (0, dx.nbytes)
    _, lctx = ops.layernorm_forward(x, w, w)
    dx_ref, dw_ref, db_ref = ops.layernorm_backward(dy, lctx)
    close(dx, dx_ref, F32, rtol=1e-4, atol=1e-5)
    close(dw, dw_ref, F32, rtol=1e-4, atol=1e-5)
    close(db, db_ref, F32, rtol=1e-5, atol=1e-5)


# Widths 12, 20 (4 mod 8) and 13 (odd) over 600 rows: each column of dweight and dbias is the
# correctly rounded sum of its terms (dy * xhat, xhat = (x - mean) * rstd in float32; dy), element
# by element. dy takes xhat's sign for dweight (positive terms: the float32 additions' own error far
# below half a bf16 ulp) and is positive for dbias; a large first row, then ~2^-10 ones that a
# bf16 running sum drops. The values at these widths, with and without
# weight and bias, in float32 and bf16.
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("C", BF16_PATH_WIDTHS)
def test_layernorm_parameter_gradients_are_the_correctly_rounded_sums(backend, k, dtype, C):
    dev = backend.to_device
    rows = 600
    x = randn((rows, C), dtype, seed=94, scale=2.0)
    w, b = randn((C,), dtype, seed=95), randn((C,), dtype, seed=96)
    k.sm_count = lambda: 1  # 2 blocks: each row group adds ~19 rows (on 132 SMs, one row each)
    magnitude = np.abs(randn((rows, C), F32, seed=97)) * 2.0 ** -10 + 2.0 ** -10
    magnitude[0] = 1.0  # a large first term in row group 0: a 16-bit running sum then drops the small ones
    _, mean, rstd = k.layernorm_forward(dev(x), dev(w), dev(b), 1e-5)
    xf = x.astype(np.float32)
    xhat = ((xf - backend.host(mean)[:, None]).astype(np.float32) * backend.host(rstd)[:, None]).astype(np.float32)
    dy_w = (np.where(xhat < 0, -magnitude, magnitude)).astype(dtype)
    _, dw, _ = k.layernorm_backward(dev(dy_w), dev(x), dev(w), mean, rstd, b.dtype)
    assert_correctly_rounded(dw, dy_w.astype(np.float64) * xhat.astype(np.float64), dtype)
    dy_b = magnitude.astype(dtype)
    _, _, db = k.layernorm_backward(dev(dy_b), dev(x), dev(w), mean, rstd, b.dtype)
    assert_correctly_rounded(db, dy_b.astype(np.float64), dtype)
    xs = randn((5, C), dtype, seed=98, scale=2.0)
    _check_layernorm(backend, k, xs, dtype, 99)
    dys = randn((5, C), dtype, seed=100)
    y, mean, rstd = k.layernorm_forward(dev(xs), None, None, 1e-5)
    y_ref, lctx = ops.layernorm_forward(xs, None, None, 1e-5)
    close(y, y_ref, dtype, atol=1e-5 if dtype == F32 else None)
    dx, dw, db = k.layernorm_backward(dev(dys), dev(xs), None, mean, rstd, None)
    assert dw is None and db is None
    close(dx, ops.layernorm_backward(dys, lctx)[0], dtype, rtol=1e-4 if dtype == F32 else None,
          atol=1e-5 if dtype == F32 else None)
