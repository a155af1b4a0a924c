"""kernels/rmsnorm.cu through its launchers (kernels/rmsnorm.py) against cutp/ops/rmsnorm.py, on each backend.

rmsnorm_forward / residual_rmsnorm_forward / rmsnorm_backward (and column_sum, the weight
gradient's second pass): a warp per row up to C = 2048 and a block per row beyond, odd widths,
row counts that are not multiples of a block's rows, with and without a weight; float32 within
1e-5 normwise, bfloat16 within 2e-2 (HF's rounding order: xhat rounded before the weight); the
weight gradient over 2 x the SM count's blocks, bit-identical under every thread schedule, and
element by element the correctly rounded sum of its terms; bf16 at widths that take each vector path.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops
from cutp.kernels.layernorm import LAYERNORM_BACKWARD_BLOCKS_PER_SM
from cutp.kernels.rmsnorm import RMSNORM_WARP_ROW_MAX, rmsnorm_backward_grid, rmsnorm_backward_rows_per_block

from .helpers import BF16, BF16_PATH_WIDTHS, DT_IDS, DTYPES, F32, bits, close, gpu_sized, randn
from .helpers import assert_correctly_rounded_column_sums as assert_correctly_rounded


def normwise(got, want, bound):
    """||got - want|| <= bound * ||want|| (the acceptance's normwise relative error)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= bound * np.linalg.norm(want) + 1e-30, (
        np.linalg.norm(got - want) / np.linalg.norm(want))


def check_rmsnorm(backend, k, shape, dtype, weighted=True, seed=70):
    dev = backend.to_device
    C = shape[-1]
    x = randn(shape, dtype, seed=seed, scale=2.0)
    w = randn((C,), dtype, seed=seed + 1) if weighted else None
    dy = randn(shape, dtype, seed=seed + 2)
    y, rstd = k.rmsnorm_forward(dev(x), None if w is None else dev(w), 1e-6)
    y_ref, rctx = ops.rmsnorm_forward(x, w, 1e-6)
    bound = 1e-5 if dtype == F32 else 2e-2
    close(y, y_ref, dtype, rtol=1e-5 if dtype == F32 else None, atol=1e-5 if dtype == F32 else None)
    normwise(backend.host(y), y_ref, bound)
    close(rstd, rctx.rstd.reshape(-1), F32, rtol=1e-5)
    dx, dw = k.rmsnorm_backward(dev(dy), dev(x), None if w is None else dev(w), rstd)
    dx_ref, dw_ref = ops.rmsnorm_backward(dy, rctx)
    close(dx, dx_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 if dtype == F32 else None)
    if C > 1:  # one column: dx is 0 up to cancellation (xhat = +-1), no relative bound holds
        normwise(backend.host(dx), dx_ref, bound)
    if w is None:
        assert dw is None and dw_ref is None
    else:
        assert dw.dtype == dtype
        normwise(backend.host(dw), dw_ref, bound)


# (0, 8): no rows (one backward block with nothing to do: its zeroed accumulators are the weight
# gradient); (5, 1): one column; (3, 33), (2, 3, 37): odd widths around a warp, rows not a
# multiple of a block's 4 warp rows; (4, 768); (2, 2049): the first block-per-row width, a partial
# last chunk
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("weighted", [True, False], ids=["w", "none"])
@pytest.mark.parametrize("shape", [(0, 8), (5, 1), (3, 33), (2, 3, 37), (4, 768), (2, 2049),
                                   gpu_sized((4096, 4096))])
def test_rmsnorm_forward_backward(backend, ks, dtype, weighted, shape):
    assert RMSNORM_WARP_ROW_MAX < 2049
    check_rmsnorm(backend, ks, shape, dtype, weighted)


# 1003 rows over 12 columns: R row groups per block, 264 blocks of 3-4 rows (idle groups in a
# block's last round); (5000, 130): two warps per row group, 3 rounds per block (the row group
# reduction called back to back: its trailing barrier)
@pytest.mark.parametrize("rows,C", [(1003, 12), (5000, 130)])
def test_rmsnorm_weight_gradient_over_many_rows(backend, k, rows, C):
    R = rmsnorm_backward_rows_per_block(C, F32)
    n_blocks = rmsnorm_backward_grid(rows, C, F32, k.sm_count())
    assert R > 1 and n_blocks == min(-(-rows // R), LAYERNORM_BACKWARD_BLOCKS_PER_SM * k.sm_count())
    rounds = -(-(-(-rows // n_blocks)) // R)  # of the block with the most rows
    assert (rounds > 1) == (rows == 5000), rounds
    check_rmsnorm(backend, k, (rows, C), F32, seed=71)


def test_rmsnorm_writes_each_output_once(backend, request):
    """Counted by the emulator: y and rstd (forward), dx and the partials [blocks, C] (backward)
    are written once each, x read twice per pass structure (forward 2, backward 2)."""
    if not backend.emulated or not request.getfixturevalue("emulated_module").checks:
        pytest.skip("traffic is counted by checked emulator builds only")
    from tests.cuda_emu import record_traffic

    k = backend.launchers()
    C = 300  # 96 threads per row group, 5 groups: each partial column written by one of 480 threads
    x = randn((1003, C), F32, seed=76)
    dy = randn((1003, C), F32, seed=77)
    w = randn((C,), F32, seed=78)
    with record_traffic() as log:
        y, rstd = k.rmsnorm_forward(x, w)
        k.rmsnorm_backward(dy, x, w, rstd)
    fwd, bwd, final = log
    assert fwd.kernel == "rmsnorm_forward_f32" and bwd.kernel == "rmsnorm_backward_f32"
    assert fwd.param(0).written == y.nbytes and fwd.param(1).written == rstd.nbytes
    assert fwd.param(3).read == 2 * x.nbytes
    partial = bwd.param(1)
    assert bwd.block == (96, 5, 1) and partial.written == partial.nbytes == bwd.grid[0] * C * 4 and bwd.param(0).written == x.nbytes
    assert bwd.param(3).read == 2 * x.nbytes and final.param(1).read == partial.nbytes


def test_rmsnorm_gradients_are_deterministic(backend):
    shape = (700, 24)
    x = backend.to_device(randn(shape, F32, seed=72))
    dy = backend.to_device(randn(shape, F32, seed=73))
    w = backend.to_device(randn(shape[-1:], F32, seed=74))
    out = []
    for kk in backend.launchers_for_determinism():
        _, rstd = kk.rmsnorm_forward(x, w)
        out.append(kk.rmsnorm_backward(dy, x, w, rstd))
    for dx, dw in out[1:]:
        for a, b in zip((dx, dw), out[0]):
            np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", [(3, 37), (2, 2100)])
def test_residual_rmsnorm_forward_is_the_add_then_the_norm(backend, ks, dtype, shape):
    """s = x + branch rounded to the storage type, written once; y and rstd those of rmsnorm(s)."""
    dev = backend.to_device
    x = randn(shape, dtype, seed=75)
    branch = randn(shape, dtype, seed=76)
    w = randn(shape[-1:], dtype, seed=77)
    s, y, rstd = ks.residual_rmsnorm_forward(dev(x), dev(branch), dev(w))
    s_ref, y_ref, rctx = ops.residual_rmsnorm_forward(x, branch, w)
    np.testing.assert_array_equal(bits(s), bits(s_ref))  # one rounding of the same float32 sum
    close(y, y_ref, dtype, atol=1e-5 if dtype == F32 else None)
    close(rstd, rctx.rstd.reshape(-1), F32, rtol=1e-5)


def test_bf16_rmsnorm_rounds_xhat_before_the_weight(backend, k):
    """HF's order, bit for bit on values where the two orders differ: y = round(round(x * rstd) * w)."""
    backend.require_bf16()
    x = randn((4, 40), BF16, seed=78, scale=3.0)
    w = randn((40,), BF16, seed=79, scale=3.0)
    y, rstd = k.rmsnorm_forward(backend.to_device(x), backend.to_device(w))
    r = backend.host(rstd)[:, None]
    hf = ((x.astype(np.float32) * r).astype(BF16).astype(np.float32) * w.astype(np.float32)).astype(BF16)
    once = (x.astype(np.float32) * r * w.astype(np.float32)).astype(BF16)
    assert (bits(hf) != bits(once)).any(), "these inputs no longer tell the two orders apart"
    np.testing.assert_array_equal(bits(y), bits(hf))


def test_bf16_residual_rmsnorm_is_computed_from_the_saved_sum(backend, k):
    backend.require_bf16()
    dev = backend.to_device
    x, branch = randn((3, 45), BF16, seed=43, scale=4.0), randn((3, 45), BF16, seed=44, scale=4.0)
    w = randn((45,), BF16, seed=45)
    s, y, rstd = k.residual_rmsnorm_forward(dev(x), dev(branch), dev(w))
    y_again, rstd_again = k.rmsnorm_forward(s, dev(w))
    assert (bits(y_again) == bits(y)).all() and (bits(rstd_again) == bits(rstd)).all()


# Widths 12, 20 (4 mod 8) and 13 (odd) over 600 rows (several rounds of several blocks): in bf16
# each column of the weight gradient is the correctly rounded sum of its terms dy * round(x * rstd),
# element by element (a sum kept or rounded in 16 bits anywhere on the way is not: a large first
# term, then ~2^-10 ones that a bf16 running sum drops); positive terms, so the float32
# accumulation's own error stays far below half a bf16 ulp. The same sums in
# float32, and the values of dx at these widths, with and without a weight.
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("C", BF16_PATH_WIDTHS)
def test_rmsnorm_weight_gradient_is_the_correctly_rounded_sum(backend, k, dtype, C):
    dev = backend.to_device
    rows = 600
    k.sm_count = lambda: 1  # 2 blocks: each row group adds ~19 rows (on 132 SMs, one row each)
    x = (np.abs(randn((rows, C), F32, seed=90)) + 0.25).astype(dtype)
    dy = (np.abs(randn((rows, C), F32, seed=91)) * 2.0 ** -10 + 2.0 ** -10).astype(dtype)
    dy[0] = 1.0  # a large first term in row group 0: a 16-bit running sum then drops the small ones
    w = randn((C,), dtype, seed=92)
    _, rstd = k.rmsnorm_forward(dev(x), dev(w), 1e-6)
    dx, dw = k.rmsnorm_backward(dev(dy), dev(x), dev(w), rstd)
    xhat = (x.astype(np.float32) * backend.host(rstd)[:, None]).astype(dtype).astype(np.float64)
    assert_correctly_rounded(dw, dy.astype(np.float64) * xhat, dtype)
    for weighted in (True, False):
        check_rmsnorm(backend, k, (5, C), dtype, weighted, seed=93)
