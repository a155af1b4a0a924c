"""The two-pass cross-entropy kernels (kernels/cross_entropy.cu) at Llama 3's vocabulary: 128,256
classes at tp=1 and its tp=8 shard of 16,032, forward (row max, sum of exp, target logit, sum
of logits) and backward against cutp/ops; on a GPU, rows x 128,256 past 2^31 elements (the
kernels' 64-bit offsets; the source-level audit of those offsets is tests/kernels/test_index_width.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops

from .helpers import BF16, DT_IDS, DTYPES, F32, close, randn, rng

LLAMA3_VOCAB = 128_256


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("N,W", [(2, LLAMA3_VOCAB), (3, LLAMA3_VOCAB // 8)], ids=["tp1", "tp8-shard"])
def test_ce_at_llama3_vocabulary(backend, k, dtype, N, W):
    dev = backend.to_device
    logits = randn((N, W), dtype, seed=95, scale=4.0)
    t = rng(96).integers(0, W, N).astype(np.int64)
    t[0] = W - 1  # the last class: the tail of the last chunk
    if N > 2:
        t[2] = -1  # a target in another shard
    m, se, tl, sl = k.ce_shard_forward(dev(logits), dev(t), W)
    m_ref, se_ref, tl_ref, sl_ref = ops.ce_shard_forward(logits, t, W)
    np.testing.assert_array_equal(backend.host(m), m_ref)
    close(se, se_ref, F32, rtol=backend.tolerance(emulated=1e-5, cuda=2e-5))
    np.testing.assert_array_equal(backend.host(tl), tl_ref)
    close(sl, sl_ref, F32, rtol=1e-4, atol=1e-3 * W ** 0.5)
    scale = np.full(N, 1.0 / N, np.float32)
    want = ops.ce_shard_backward(logits, m_ref, se_ref, t, W, scale, 0.1, W)
    got = k.ce_shard_backward(dev(logits), dev(m_ref), dev(se_ref), dev(t), W, dev(scale), 0.1, W)
    close(got, want, dtype, atol=1e-9 if dtype == F32 else 1e-6)


@pytest.mark.cuda_only("the emulator has neither the memory nor the time for a 4.3 GB logits array")
def test_ce_at_llama3_vocabulary_beyond_2_31_elements(backend, k):
    """16,800 rows x 128,256 classes = 2.155e9 elements (bf16 logits, ~4.3 GB): the rows past
    2^31 elements against the reference."""
    cp = backend.xp
    N, W = 16_800, LLAMA3_VOCAB
    assert N * W > 2**31
    dtype = F32 if backend.bf16_reason else BF16
    need = N * W * (8 + 2 * dtype.itemsize)
    free, _ = cp.cuda.runtime.memGetInfo()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    logits = (cp.random.default_rng(0).random((N, W), dtype=cp.float32) * 8 - 4).astype(dtype)
    t = cp.asarray(np.random.default_rng(1).integers(0, W, N))
    m, se, tl, _ = k.ce_shard_forward(logits, t, W, need_sum_logits=False)
    host = backend.host
    tail, t_tail = host(logits[-3:]), host(t[-3:])
    m_ref, se_ref, tl_ref, _ = ops.ce_shard_forward(tail, t_tail, W, need_sum_logits=False)
    np.testing.assert_array_equal(host(m[-3:]), m_ref)
    close(se[-3:], se_ref, F32, rtol=2e-5)
    np.testing.assert_array_equal(host(tl[-3:]), tl_ref)
    scale = cp.full(N, 1.0 / N, dtype=cp.float32)
    k.ce_shard_backward(logits, m, se, t, W, scale, out=logits)
    ref = ops.ce_shard_backward(tail, host(m[-3:]), se_ref, t_tail, W, np.full(3, 1.0 / N, np.float32))
    close(logits[-3:], ref, dtype, atol=1e-12 if dtype == F32 else 1e-7)
    del logits, m, se, tl, t, scale
    cp.get_default_memory_pool().free_all_blocks()
