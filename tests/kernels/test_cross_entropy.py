"""kernels/cross_entropy.cu through its launchers (kernels/cross_entropy.py) against cutp/ops/cross_entropy.py.

The local pieces of the vocab-parallel cross-entropy, on each backend: ce_shard_max (exact),
ce_shard_stats, ce_shard_backward (padded columns and ignored rows exact zeros, in place over the
logits), row vectors of other dtypes, and on a GPU the 64-bit offsets of a logits array over 2^31
elements.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops
from cutp.kernels import KernelArgumentError

from .helpers import BF16, DT_IDS, DTYPES, F32, close, gpu_sized, randn, rng

CE_CASES = [
    # N, W, n_valid
    (1, 1, 1),
    (5, 1, 1),  # rows of width 1: max == the logit, sum_exp == 1
    (5, 1, 0),
    (5, 50, 45),
    (4, 37, 37),
    (6, 130, 128),
    (3, 3000, 2999),
    (1, 3001, 2997),  # one wide row: threads loop over chunks; n_valid and W both end mid-chunk
    (0, 16, 16),
    (3, 16, 0),
    (7, 16, 0),
    (3, 50304, 50257),  # GPT-2's vocabulary, padded to a multiple of 128
    # the kernel tests' widths: around a warp (31, 33), GPT-2's 768, 6144, and one unpadded row of
    # GPT-2's 50257 classes (a 1024-thread block reduction: 32 warps' partials)
    (4, 31, 31),
    (4, 33, 32),
    (3, 768, 768),
    (2, 6144, 6100),
    (1, 50257, 50257),
    gpu_sized(64, 25152, 25129),  # half of it per rank (tp=2)
]


def _targets(N, n_valid, seed):
    t = rng(seed).integers(0, max(n_valid, 1), N).astype(np.int64)
    t[::3] = -1  # target in another shard, or an ignored row
    if N > 1 and n_valid:
        t[1] = n_valid - 1
    elif N == 1 and n_valid:
        t[0] = n_valid - 1  # a lone row keeps a target (the last valid column)
    return t if n_valid else np.full(N, -1, np.int64)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("N,W,n_valid", CE_CASES)
def test_ce_shard_max_stats_backward(backend, ks, dtype, N, W, n_valid):
    k = ks
    dev = backend.to_device
    logits = randn((N, W), dtype, seed=24, scale=4.0)
    t = _targets(N, n_valid, 25)
    m = k.ce_shard_max(dev(logits), n_valid)
    m_ref = ops.ce_shard_max(logits, n_valid)
    np.testing.assert_array_equal(backend.host(m), m_ref)  # max is exact
    se, tl, sl = k.ce_shard_stats(dev(logits), dev(m_ref), dev(t), n_valid)
    se_ref, tl_ref, sl_ref = ops.ce_shard_stats(logits, m_ref, t, n_valid)
    close(se, se_ref, F32, rtol=backend.tolerance(emulated=1e-5, cuda=2e-5))
    np.testing.assert_array_equal(backend.host(tl), tl_ref)
    close(sl, sl_ref, F32, rtol=backend.tolerance(emulated=1e-5, cuda=1e-4),
          atol=backend.tolerance(emulated=1e-4, cuda=1e-3) * max(1, n_valid) ** 0.5)
    # row 0 has scale 0 (an ignored row), unless it is the only row
    row_scale = np.linspace(0.0, 1.0, N).astype(np.float32) if N > 1 else np.full(N, 0.75, np.float32)
    for eps in (0.0, 0.1):
        with np.errstate(divide="ignore", invalid="ignore"):  # n_valid == 0: sum_exp is 0 (the reference divides by it)
            ref = ops.ce_shard_backward(logits, m_ref, se_ref, t, n_valid, row_scale, eps, max(n_valid, 1))
        out = k.ce_shard_backward(dev(logits), dev(m_ref), dev(se_ref), dev(t), n_valid, dev(row_scale), eps,
                                  max(n_valid, 1))
        buf = dev(logits)
        in_place = k.ce_shard_backward(buf, dev(m_ref), dev(se_ref), dev(t), n_valid, dev(row_scale), eps,
                                       max(n_valid, 1), out=buf)
        assert in_place is buf
        for got in (out, in_place):
            close(got, ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)
            got = backend.host(got).astype(np.float32)
            assert not np.any(got[:, n_valid:]), "padded columns get exact zeros"
            if N > 1:
                assert not np.any(got[0]), "a row with row_scale 0 is all zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("W", [1, 31, 33, 768, 6144, 20000])
def test_ce_rows_far_below_zero(backend, ks, dtype, W):
    """Logits all below -87 (the max is negative and exp underflows against 0): the row max starts
    at -inf, not 0. Rows of -inf but one valid logit: max that logit, sum_exp exactly 1, gradient
    exactly 0 at the target and everywhere else. W = 20000: a 1024-thread block."""
    dev = backend.to_device
    N = 3
    logits = (randn((N, W), dtype, seed=42, scale=4.0).astype(np.float32) - 250.0).astype(dtype)
    t = np.arange(N, dtype=np.int64) % W
    m = ks.ce_shard_max(dev(logits), W)
    m_ref = ops.ce_shard_max(logits, W)
    np.testing.assert_array_equal(backend.host(m), m_ref)
    assert (m_ref < -200).all()
    se, tl, sl = ks.ce_shard_stats(dev(logits), m, dev(t), W)
    se_ref, tl_ref, sl_ref = ops.ce_shard_stats(logits, m_ref, t, W)
    close(se, se_ref, F32, rtol=backend.tolerance(emulated=1e-5, cuda=2e-5))
    np.testing.assert_array_equal(backend.host(tl), tl_ref)
    close(sl, sl_ref, F32, rtol=backend.tolerance(emulated=1e-5, cuda=1e-4))

    one = np.full((N, W), -np.inf, np.float32)
    hot = np.array([0, W // 2, W - 1])
    one[np.arange(N), hot] = [-3.0, -100.0, 7.0]
    one = one.astype(dtype)
    m = ks.ce_shard_max(dev(one), W)
    np.testing.assert_array_equal(backend.host(m), one[np.arange(N), hot].astype(np.float32))
    se, tl, _ = ks.ce_shard_stats(dev(one), m, dev(hot), W, need_sum_logits=False)
    np.testing.assert_array_equal(backend.host(se), np.ones(N, np.float32))
    np.testing.assert_array_equal(backend.host(tl), one[np.arange(N), hot].astype(np.float32))
    g = ks.ce_shard_backward(dev(one), m, se, dev(hot), W, dev(np.ones(N, np.float32)))
    np.testing.assert_array_equal(backend.host(g).astype(np.float32), np.zeros((N, W), np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_ce_backward_in_place_over_the_logits(backend, k, dtype):
    dev = backend.to_device
    N, W, n_valid = 7, 72, 70
    logits = randn((2, N // 1, W), dtype, seed=26, scale=3.0).reshape(2 * N, W)
    t = _targets(2 * N, n_valid, 27)
    m = ops.ce_shard_max(logits, n_valid)
    se, _, _ = ops.ce_shard_stats(logits, m, t, n_valid)
    ref = ops.ce_shard_backward(logits, m, se, t, n_valid, np.float32(0.25))
    buf = dev(logits)
    out = k.ce_shard_backward(buf, dev(m), dev(se), dev(t), n_valid, 0.25, out=buf)  # scalar row_scale broadcasts
    assert out is buf
    close(buf, ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)


def test_ce_row_vectors_of_other_dtypes_are_converted(backend, k):
    dev = backend.to_device
    logits = randn((4, 10), F32, seed=28)
    t32 = np.array([1, -1, 9, 0], np.int32)
    m64 = ops.ce_shard_max(logits, 10).astype(np.float64)
    se, tl, sl = k.ce_shard_stats(dev(logits), dev(m64), dev(t32), 10)
    se_ref, tl_ref, _ = ops.ce_shard_stats(logits, m64.astype(np.float32), t32.astype(np.int64), 10)
    close(se, se_ref, F32, rtol=backend.tolerance(emulated=1e-5, cuda=2e-5))
    np.testing.assert_array_equal(backend.host(tl), tl_ref)
    with pytest.raises(KernelArgumentError, match="local_targets has dtype float32"):
        k.ce_shard_stats(dev(logits), dev(m64), dev(t32.astype(np.float32)), 10)
    with pytest.raises(KernelArgumentError, match="row_max has 3 elements"):
        k.ce_shard_stats(dev(logits), dev(m64[:3]), dev(t32), 10)


@pytest.mark.cuda_only("the emulator has neither the memory nor the time for a 4.3 GB logits array")
def test_cross_entropy_offsets_beyond_2_31_elements(backend, k):
    """rows x vocabulary > 2^31: the kernels' 64-bit offsets (bf16 logits, ~4.3 GB)."""
    cp = backend.xp
    N, W, n_valid = 42_800, 50_304, 50_257  # 2.153e9 elements
    free, _ = cp.cuda.runtime.memGetInfo()
    dtype = F32 if backend.bf16_reason else BF16
    need = N * W * (8 + 2 * dtype.itemsize)  # two float32 temporaries while drawing, the logits
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    logits = (cp.random.default_rng(0).random((N, W), dtype=cp.float32) * 8 - 4).astype(dtype)
    t = cp.asarray(np.random.default_rng(1).integers(0, n_valid, N))
    m = k.ce_shard_max(logits, n_valid)
    se, tl, _ = k.ce_shard_stats(logits, m, t, n_valid, need_sum_logits=False)
    host = backend.host
    tail = host(logits[-3:])  # rows whose offsets are past 2^31
    t_tail = host(t[-3:])
    np.testing.assert_array_equal(host(m[-3:]), ops.ce_shard_max(tail, n_valid))
    se_ref, tl_ref, _ = ops.ce_shard_stats(tail, host(m[-3:]), t_tail, n_valid)
    close(se[-3:], se_ref, F32, rtol=2e-5)
    np.testing.assert_array_equal(host(tl[-3:]), tl_ref)
    scale = cp.full(N, 1.0 / N, dtype=cp.float32)
    k.ce_shard_backward(logits, m, se, t, n_valid, scale, out=logits)
    ref = ops.ce_shard_backward(tail, host(m[-3:]), se_ref, t_tail, n_valid, np.full(3, 1.0 / N, np.float32))
    close(logits[-3:], ref, dtype, atol=1e-12 if dtype == F32 else 1e-7)
    del logits, m, se, tl, t, scale
    cp.get_default_memory_pool().free_all_blocks()
