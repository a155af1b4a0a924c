"""kernels/dropout.cu through its launchers (kernels/dropout.py) against cutp/ops/dropout.py, on each backend.

dropout_mask bit-identical to the reference's masks (integer hashing and an integer threshold:
kernels/dropout.py's contract), dropout_forward / dropout_apply one or two exact roundings as the
reference's (bit for bit under the emulator; within 1e-6 relative on a GPU).
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops
from cutp.kernels import dropout as dropout_kernels
from cutp.ops import dropout as dropout_reference

from .helpers import DT_IDS, DTYPES, F32, bits, close, randn


@pytest.mark.parametrize("p,seed,offset", [(0.1, 1337, 0), (0.5, 2**64 - 1, 2**64 - 5), (1.0, 3, 9), (0.0, 4, 100),
                                           (1 / 3, 123456789, 987654321)])
def test_dropout_mask_is_bit_identical(backend, k, p, seed, offset):
    for shape in [(1,), (3, 333), (0, 4)]:
        np.testing.assert_array_equal(backend.host(k.dropout_mask(shape, p, seed, offset)),
                                      ops.dropout_mask(np, shape, p, seed, offset))


DROPOUT_CASES = [
    # shape, p, seed, offset
    ((1,), 0.3, 77, 1000),
    ((5, 7), 0.3, 77, 1000),
    ((4, 1003), 0.3, 77, 1000),
    ((0,), 0.3, 77, 1000),
    ((1,), 0.1, 1, 0),
    ((3, 333), 0.5, 2**64 - 1, 2**64 - 5),  # seed and offset wrap around 2**64
    ((64, 1024, 3), 0.2, 7, 99),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,p,seed,offset", DROPOUT_CASES)
def test_dropout_forward_and_backward(backend, k, dtype, shape, p, seed, offset):
    x = randn(shape, dtype, seed=29)
    np.testing.assert_array_equal(backend.host(k.dropout_mask(shape, p, seed, offset)),
                                  ops.dropout_mask(np, shape, p, seed, offset))
    y, mask = k.dropout_forward(backend.to_device(x), p, seed, offset)
    y_ref, dctx = ops.dropout_forward(x, p, seed, offset)
    np.testing.assert_array_equal(backend.host(mask), dctx.mask)
    dx = k.dropout_apply(backend.to_device(x), mask, dctx.scale)
    dx_ref = ops.dropout_backward(x, dctx)
    if backend.emulated:  # one or two exact roundings, as the reference
        np.testing.assert_array_equal(bits(y), bits(y_ref))
        np.testing.assert_array_equal(bits(dx), bits(dx_ref))
    else:
        close(y, y_ref, dtype, rtol=1e-6 if dtype == F32 else None, atol=0)
        close(dx, dx_ref, dtype, rtol=1e-6 if dtype == F32 else None, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_dropout_keeps_an_element_whose_draw_equals_the_threshold(backend, k, dtype):
    """The boundary of ``u >= threshold``: p is chosen so that the threshold ceil(p * 2^24) is exactly
    the 24-bit draw u of one element (kept), and of another element plus one (dropped)."""
    seed, offset, n = 98765, 4321, 3 * 333
    u = [dropout_reference.splitmix64_reference(seed, offset + i) >> 40 for i in range(n)]
    at, below = 357, 711  # the element on the threshold, and one just below it
    thr = u[at]
    p = thr / 2**24
    assert dropout_kernels.keep_threshold(p) == thr and 0 < thr < 2**24
    p2 = (u[below] + 1) / 2**24
    assert dropout_kernels.keep_threshold(p2) == u[below] + 1
    x = randn((3, 333), dtype, seed=30)
    for prob, i, kept in ((p, at, True), (p2, below, False)):
        mask = backend.host(k.dropout_mask((3, 333), prob, seed, offset)).reshape(-1)
        assert bool(mask[i]) is kept, (prob, i)
        np.testing.assert_array_equal(mask, ops.dropout_mask(np, (n,), prob, seed, offset))
        y, fmask = k.dropout_forward(backend.to_device(x), prob, seed, offset)
        fmask = backend.host(fmask).reshape(-1)
        assert bool(fmask[i]) is kept
        np.testing.assert_array_equal(fmask, mask)
        y = backend.host(y).reshape(-1).astype(np.float32)
        assert (y[i] != 0) == (kept and x.reshape(-1)[i] != 0)


def test_the_reference_uses_the_kernels_threshold_rule():
    """cutp.ops.dropout takes MASK64 and keep_threshold from the kernel's module: one contract."""
    assert dropout_reference.keep_threshold is dropout_kernels.keep_threshold is ops.keep_threshold
    assert dropout_reference.MASK64 == dropout_kernels.MASK64 == 2**64 - 1
    assert dropout_kernels.keep_threshold(0.5) == 1 << 23 and dropout_kernels.keep_threshold(1.0) == 1 << 24
    with pytest.raises(ValueError, match="dropout probability"):
        dropout_kernels.keep_threshold(1.5)
