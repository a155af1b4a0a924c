"""kernels/softmax.cu through its launchers (kernels/softmax.py) against cutp/ops/softmax.py, on each backend.

softmax_forward / softmax_backward, full and causal, a warp per row (Tk <= 1024) and a block per
row beyond: float32 within ~1e-5 relative, bfloat16 against the reference on the same bf16
inputs; masked probabilities exact zeros; results bit-identical under every thread schedule and
run to run.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops
from cutp.kernels.softmax import SOFTMAX_WARP_ROW_MAX

from .helpers import (DT_IDS, DTYPES, F32, assert_within_float32_bound, assert_within_ulps, bits, close, late_max_row,
                      randn, rng)

SOFTMAX_CASES = [
    # shape, causal, scale
    ((1, 1), False, 1.0),
    ((5, 1), False, 1.0),  # several rows of width 1: y == 1, dx == 0
    ((4, 1, 1), True, 0.5),
    ((17,), False, 0.5),
    ((2, 3, 5, 9), True, 0.125),
    ((2, 3, 5, 9), False, 0.125),
    ((1, 7, 7), True, 1.0),
    ((3, 1, 6), True, 2.0),
    ((2, 40, 40), True, 0.3),
    ((0, 3, 5), True, 1.0),
    ((2, 1100), True, 0.25),  # block per row (Tk > 1024), causal with Tq < Tk
    ((1, 3, 2500), False, 0.1),
    ((3001,), False, 0.5),  # one wide row: a block per row looping over its chunks, a partial last chunk
    # attention-sized rows: a warp per row at Tk = 1024, a block per row from 1025 on, long rows
    ((1, 1), False, 0.125),
    ((17,), False, 0.125),
    ((4, 12, 64, 64), True, 0.125),
    ((2, 4, 7, 1024), True, 0.125),
    ((2, 1, 1025), False, 0.125),
    ((1, 2, 3, 8192), True, 0.125),
    ((1, 1, 2, 20000), False, 0.125),
    # the kernel tests' widths (tests/kernels/README): 31 and 33 around a warp's 32 lanes, GPT-2's
    # 768 and 1024 in warp-per-row mode, 6144 and a GPT-2 vocabulary row (50257) in block-per-row mode
    ((3, 31), False, 1.0),
    # bf16's vector paths in a warp per row (tests/kernels/helpers.BF16_PATH_WIDTHS): 12 and 20 are
    # 4 mod 8 (every other bf16 row starts half a 128-bit pack off); odd widths are above
    ((3, 12), False, 1.0),
    ((2, 20, 20), True, 0.5),
    ((2, 33, 33), True, 0.5),
    ((5, 768), False, 0.125),
    ((2, 1, 3, 1024), False, 0.125),
    ((2, 6144), True, 0.125),
    ((1, 50257), False, 1.0),
]
SOFTMAX_IDS = [f"{s}-{'causal' if c else 'full'}-{scale}" for s, c, scale in SOFTMAX_CASES]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,causal,scale", SOFTMAX_CASES, ids=SOFTMAX_IDS)
def test_softmax_forward_backward(backend, ks, dtype, shape, causal, scale):
    k = ks
    x = randn(shape, dtype, seed=10, scale=3.0)
    dy = randn(shape, dtype, seed=11)
    y = k.softmax_forward(backend.to_device(x), scale, causal)
    y_ref, sctx = ops.softmax_forward(x, scale, causal)
    close(y, y_ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)
    if causal and len(shape) >= 2 and x.size:
        masked = ops.causal_mask(np, shape[-2], shape[-1])
        assert not np.any(backend.host(y).astype(np.float32)[..., masked]), "masked probabilities must be exact zeros"
    dx = k.softmax_backward(backend.to_device(dy), backend.to_device(y_ref), scale)
    close(dx, ops.softmax_backward(dy, sctx), dtype, atol=1e-6 if dtype == F32 else 1e-3)


# warp per row (1, 31, 33, 768, 1024) and block per row (6144)
EXTREME_WIDTHS = [1, 31, 33, 768, 1024, 6144]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("width", EXTREME_WIDTHS)
def test_softmax_rows_far_below_zero(backend, ks, dtype, width):
    """Every score of a row below -87 (exp underflows to 0 in float32): the running max must
    start at -inf, not 0. Rows of -inf except one key: that key gets probability exactly 1, at
    the first, a middle and the last position."""
    rows = 4
    x = (randn((rows, width), dtype, seed=40, scale=5.0).astype(np.float32) - 300.0).astype(dtype)
    y = ks.softmax_forward(backend.to_device(x), 1.0)
    y_ref, ctx = ops.softmax_forward(x, 1.0)
    close(y, y_ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)
    dy = randn((rows, width), dtype, seed=41)
    close(ks.softmax_backward(backend.to_device(dy), backend.to_device(y_ref), 1.0), ops.softmax_backward(dy, ctx),
          dtype, atol=1e-6 if dtype == F32 else 1e-3)

    one = np.full((rows, width), -np.inf, np.float32)
    hot = [0, width // 2, width - 1, (7 * width) // 9]
    one[np.arange(rows), hot] = [-5.0, 3.0, -200.0, 0.0]
    y = backend.host(ks.softmax_forward(backend.to_device(one.astype(dtype)), 0.5)).astype(np.float32)
    want = np.zeros((rows, width), np.float32)
    want[np.arange(rows), hot] = 1.0
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("width", [256, 6144])
def test_softmax_running_max_of_exactly_zero(backend, ks, dtype, width):
    """Integer scores <= 0 with exact zeros, then a larger score in a later chunk of the same
    thread: a running max of exactly 0 is an ordinary max (0 is not a marker for "no max yet")."""
    x = -(np.arange(2 * width).reshape(2, width) % 3).astype(np.float32)  # 0, -1, -2, 0, ...
    x[0, -5] = 2.0  # the last chunks of the row: a later chunk of a thread whose max was 0
    x[1, width // 2 + 3] = 1.0
    x = x.astype(dtype)
    close(ks.softmax_forward(backend.to_device(x), 1.0), ops.softmax_forward(x, 1.0)[0], dtype,
          atol=1e-7 if dtype == F32 else 1e-4)


@pytest.mark.parametrize("width", [131, 1100])  # a warp per row; a block per row
def test_float32_probabilities_within_ulps_of_expf(backend, k, width):
    """Each float32 probability over its row's largest, element by element: the quotient is
    exp(a) / exp(0), free of the row's sum, with a = x * scale - max rounded as the kernel rounds
    it, so within expf's 2 ulps and the two divisions' half ulps (4 allowed). Exponents down to
    -80, where __expf may be off by 94 ulps: a normwise bound lets a fast-math exp through."""
    scale = np.float32(0.5)
    x = rng(51).uniform(-150.0, 10.0, (3, width)).astype(np.float32)
    x[:, [5, width - 2, width // 2]] = 10.0  # the max: a = 0 exactly, y = 1 / S
    a = x * scale - x.max(axis=1, keepdims=True) * scale  # float32, as the kernel's __fmul_rn and subtraction
    y = backend.host(k.softmax_forward(backend.to_device(x), float(scale))).astype(np.float64)
    assert a.min() < -70
    assert_within_ulps(y / y[:, 5:6], np.exp(a.astype(np.float64)), 4, "p / p_max")


def test_softmax_extreme_values_stay_finite(backend, k):
    x = np.array([[1e4, -1e4, 0.0, 3e4], [-np.inf, 0.0, 1.0, -np.inf]], np.float32)
    y = backend.host(k.softmax_forward(backend.to_device(x)))
    np.testing.assert_allclose(y, ops.softmax_forward(x)[0], rtol=1e-6, atol=0)
    assert np.isfinite(y).all()


def test_softmax_is_deterministic(backend):
    x = backend.to_device(randn((3, 1500), F32, seed=12))
    ys = [kk.softmax_forward(x, 0.7) for kk in backend.launchers_for_determinism()]
    for y in ys[1:]:
        np.testing.assert_array_equal(bits(y), bits(ys[0]))


def test_float32_sum_with_a_late_max_within_its_bound(backend, k):
    """The running sum's rescale: every one of a 512-thread block's threads reads 1024 zeros, then
    its row maximum a = 5.545 (helpers.late_max_row), and rescales its sum by expf(-a); the maximum's
    probability 1 / S within the first-order bound of that float32 evaluation (expf's 2 ulps, the
    roundings' half ulps). A fast exp there (__expf: 8 ulps at this argument, its documented
    bound, which the emulator draws) moves S by ~13 x 2^-24, past the ~8 allowed."""
    row, p_max, bound = late_max_row(512, 1024, out=lambda r, s: r(1.0 / s))
    assert k._row_shape(row.size, F32, SOFTMAX_WARP_ROW_MAX, max_threads=512)[1] == (512,)  # the layout assumed
    y = backend.host(k.softmax_forward(backend.to_device(row[None])))[0]
    top = row == row.max()
    assert_within_float32_bound(y[top], np.full(int(top.sum()), p_max[0]), np.full(int(top.sum()), bound[0]),
                                "p of the row max")
    assert not y[row == -np.inf].any()
