"""kernels/cross_entropy.cu through its launchers (kernels/cross_entropy.py) against cutp/ops/cross_entropy.py.

The local pieces of the vocab-parallel cross-entropy, on each backend: ce_shard_forward (one
pass: the shard's row max exact, its sum of exps, target logit exact, sum of logits; shards merged
by the (max, sum) rule), ce_shard_backward (padded columns and ignored rows exact zeros, in place
over the logits), row vectors of other dtypes, on a GPU the 64-bit offsets of a logits array over
2^31 elements; and, counted by the emulator, that a training step reads the logits exactly twice.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops
from cutp.kernels import KernelArgumentError

from .helpers import (BF16, DT_IDS, DTYPES, F32, assert_within_float32_bound, assert_within_ulps, close, gpu_sized,
                      late_max_row, randn, rng)

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
    (3, 20, 13),  # bf16's vector paths: rows of 20 (4 mod 8: every other row half a pack off), 13 valid (odd)
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


def _check_forward(backend, got, ref, n_valid):
    """The kernel's (row_max, sum_exp, target_logit, sum_logits) against the reference's."""
    m, se, tl, sl = got
    m_ref, se_ref, tl_ref, sl_ref = ref
    np.testing.assert_array_equal(backend.host(m), m_ref)  # max is exact
    close(se, se_ref, F32, rtol=backend.tolerance(emulated=1e-5, cuda=2e-5))
    np.testing.assert_array_equal(backend.host(tl), tl_ref)
    if sl_ref is None:
        assert sl is None
    else:
        close(sl, sl_ref, F32, rtol=backend.tolerance(emulated=1e-5, cuda=1e-4),
              atol=backend.tolerance(emulated=1e-4, cuda=1e-3) * max(1, n_valid) ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("N,W,n_valid", CE_CASES)
def test_ce_shard_forward_backward(backend, ks, dtype, N, W, n_valid):
    k = ks
    dev = backend.to_device
    logits = randn((N, W), dtype, seed=24, scale=4.0)
    t = _targets(N, n_valid, 25)
    ref = ops.ce_shard_forward(logits, t, n_valid)
    _check_forward(backend, k.ce_shard_forward(dev(logits), dev(t), n_valid), ref, n_valid)
    _check_forward(backend, k.ce_shard_forward(dev(logits), dev(t), n_valid, need_sum_logits=False),
                   (*ref[:3], None), n_valid)
    if n_valid == 0:  # no class in the shard: (-inf, 0), never NaN
        assert np.all(ref[0] == -np.inf) and not np.any(ref[1])
    m_ref, se_ref = ref[0], ref[1]
    # row 0 has scale 0 (an ignored row), unless it is the only row
    row_scale = np.linspace(0.0, 1.0, N).astype(np.float32) if N > 1 else np.full(N, 0.75, np.float32)
    for eps in (0.0, 0.1):
        with np.errstate(divide="ignore", invalid="ignore"):  # n_valid == 0: sum_exp is 0 (the reference divides by it)
            want = ops.ce_shard_backward(logits, m_ref, se_ref, t, n_valid, row_scale, eps, max(n_valid, 1))
        out = k.ce_shard_backward(dev(logits), dev(m_ref), dev(se_ref), dev(t), n_valid, dev(row_scale), eps,
                                  max(n_valid, 1))
        buf = dev(logits)
        in_place = k.ce_shard_backward(buf, dev(m_ref), dev(se_ref), dev(t), n_valid, dev(row_scale), eps,
                                       max(n_valid, 1), out=buf)
        assert in_place is buf
        for got in (out, in_place):
            close(got, want, dtype, atol=1e-7 if dtype == F32 else 1e-4)
            got = backend.host(got).astype(np.float32)
            assert not np.any(got[:, n_valid:]), "padded columns get exact zeros"
            if N > 1:
                assert not np.any(got[0]), "a row with row_scale 0 is all zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("W,cut", [(33, 17), (768, 300), (6144, 6000), (50257, 25129)])
def test_ce_shards_merge_into_the_whole_row(backend, ks, dtype, W, cut):
    """Two shards' (max, sum) pairs, merged by ce_rescale_sum after the max, equal one pass over
    the whole row; one shard holds the row max, the other's sum is rescaled (rows 0-1), or the
    other way round (rows 2-3); row 4's second shard is all -inf: its (-inf, 0) merges to 0."""
    dev, host = backend.to_device, backend.host
    N = 5
    logits = randn((N, W), dtype, seed=30, scale=3.0).astype(np.float32)
    logits[:2, 5] = 40.0
    logits[2:4, cut + 3] = 40.0
    logits[4, cut:] = -np.inf
    logits = logits.astype(dtype)
    t = np.array([5, cut + 3, 0, W - 1, -1], np.int64)
    whole = ks.ce_shard_forward(dev(logits), dev(t), W)
    halves = []
    for lo, hi in ((0, cut), (cut, W)):
        lt = np.where((t >= lo) & (t < hi), t - lo, -1)
        halves.append([host(a) for a in ks.ce_shard_forward(dev(np.ascontiguousarray(logits[:, lo:hi])), dev(lt),
                                                            hi - lo)])
    assert halves[1][0][4] == -np.inf and halves[1][1][4] == 0
    M = np.maximum(halves[0][0], halves[1][0])
    np.testing.assert_array_equal(host(whole[0]), M)
    S = ops.ce_rescale_sum(halves[0][0], halves[0][1], M) + ops.ce_rescale_sum(halves[1][0], halves[1][1], M)
    assert np.all(np.isfinite(S))
    close(whole[1], S, F32, rtol=backend.tolerance(emulated=2e-6, cuda=2e-5))
    np.testing.assert_array_equal(host(whole[2]), halves[0][2] + halves[1][2])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("W", [1, 31, 33, 768, 6144, 20000])
def test_ce_rows_far_below_zero(backend, ks, dtype, W):
    """Logits all below -87 (the max is negative and exp underflows against 0): the row max starts
    at -inf, not 0. Rows of -inf but one valid logit: max that logit, sum_exp exactly 1, gradient
    exactly 0 at the target and everywhere else. A rising row (every chunk raises each thread's
    running max: a rescale per chunk) and a falling one; integer scores whose running maxima are
    exactly 0. W = 20000: a 1024-thread block."""
    dev = backend.to_device
    N = 3
    logits = (randn((N, W), dtype, seed=42, scale=4.0).astype(np.float32) - 250.0).astype(dtype)
    t = np.arange(N, dtype=np.int64) % W
    ref = ops.ce_shard_forward(logits, t, W)
    assert (ref[0] < -200).all()
    _check_forward(backend, ks.ce_shard_forward(dev(logits), dev(t), W), ref, W)

    ramp = np.arange(W, dtype=np.float32) * (8.0 / W)
    ints = (np.arange(W) % 7 - 6).astype(np.float32)  # maxima of exactly 0
    shaped = np.stack([ramp, ramp[::-1], ints]).astype(dtype)
    ref = ops.ce_shard_forward(shaped, t, W)
    _check_forward(backend, ks.ce_shard_forward(dev(shaped), dev(t), W), ref, W)

    one = np.full((N, W), -np.inf, np.float32)
    hot = np.array([0, W // 2, W - 1])
    one[np.arange(N), hot] = [-3.0, -100.0, 7.0]
    one = one.astype(dtype)
    m, se, tl, _ = ks.ce_shard_forward(dev(one), dev(hot), W, need_sum_logits=False)
    np.testing.assert_array_equal(backend.host(m), one[np.arange(N), hot].astype(np.float32))
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
    m, se, _, _ = ops.ce_shard_forward(logits, t, n_valid)
    ref = ops.ce_shard_backward(logits, m, se, t, n_valid, np.float32(0.25))
    buf = dev(logits)
    out = k.ce_shard_backward(buf, dev(m), dev(se), dev(t), n_valid, 0.25, out=buf)  # scalar row_scale broadcasts
    assert out is buf
    close(buf, ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)


def test_ce_targets_outside_the_shard_give_zero(backend, k):
    """The launcher's contract: a target outside [0, n_valid) has target logit 0 and no one-hot
    term. Target n_valid (the shard's first padding column, whose logit is not 0), the last padding
    column, past W, and 0 and n_valid - 1 at the edges of the valid range; outputs start as poison,
    so a bound that lets n_valid through leaves poison behind."""
    dev = backend.to_device
    W, n_valid = 72, 70
    t = np.array([n_valid, W - 1, W + 5, 0, n_valid - 1, -1], np.int64)
    logits = randn((len(t), W), F32, seed=31, scale=3.0)
    logits[:, n_valid:] = 5.0
    inside = (t >= 0) & (t < n_valid)
    lt = np.where(inside, t, -1)
    ref = ops.ce_shard_forward(logits, lt, n_valid, need_sum_logits=False)  # the reference takes -1 only
    assert np.count_nonzero(ref[2]) == 2
    _check_forward(backend, k.ce_shard_forward(dev(logits), dev(t), n_valid, need_sum_logits=False), ref, n_valid)
    g = k.ce_shard_backward(dev(logits), dev(ref[0]), dev(ref[1]), dev(t), n_valid, 1.0)
    close(g, ops.ce_shard_backward(logits, ref[0], ref[1], lt, n_valid, np.float32(1.0)), F32, atol=1e-7)


def test_ce_float32_gradient_within_ulps_of_expf(backend, k):
    """With sum_exp 1, row scale 1, no smoothing and no target in the shard, each gradient element
    is expf(logit - max) itself (the subtraction reproduced in float32): within expf's 2 ulps,
    element by element, for exponents down to -80, where __expf may be off by 94 ulps."""
    W, n_valid = 72, 70
    logits = rng(32).uniform(-80.0, 0.0, (3, W)).astype(np.float32)
    logits[:, 3] = 0.0
    m = logits[:, :n_valid].max(axis=1)
    one, none = np.ones(3, np.float32), np.full(3, -1, np.int64)
    dev = backend.to_device
    g = backend.host(k.ce_shard_backward(dev(logits), dev(m), dev(one), dev(none), n_valid, dev(one)))
    assert_within_ulps(g[:, :n_valid], np.exp((logits[:, :n_valid] - m[:, None]).astype(np.float64)), 2,
                       "dlogits")
    assert not g[:, n_valid:].any()


def test_ce_row_vectors_of_other_dtypes_are_converted(backend, k):
    dev = backend.to_device
    logits = randn((4, 10), F32, seed=28)
    t32 = np.array([1, -1, 9, 0], np.int32)
    got = k.ce_shard_forward(dev(logits), dev(t32), 10)
    ref = ops.ce_shard_forward(logits, t32.astype(np.int64), 10)
    _check_forward(backend, got, ref, 10)
    with pytest.raises(KernelArgumentError, match="local_targets has dtype float32"):
        k.ce_shard_forward(dev(logits), dev(t32.astype(np.float32)), 10)
    m64 = ref[0].astype(np.float64)
    g = k.ce_shard_backward(dev(logits), dev(m64), dev(ref[1]), dev(t32), 10, 1.0)
    close(g, ops.ce_shard_backward(logits, ref[0], ref[1], t32.astype(np.int64), 10, np.float32(1.0)), F32,
          atol=1e-7)
    with pytest.raises(KernelArgumentError, match="row_max has 3 elements"):
        k.ce_shard_backward(dev(logits), dev(m64[:3]), dev(ref[1]), dev(t32), 10, 1.0)


def _traffic_of(log, a):
    """{kernel: (bytes read, bytes written)} of the memory of `a` over the launches in `log`."""
    out = {}
    for rec in log:
        r, w = rec.of(a)
        pr, pw = out.get(rec.kernel, (0, 0))
        out[rec.kernel] = (pr + r, pw + w)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("N,W,n_valid,eps,ignored", [(6, 768, 768, 0.0, False), (5, 1000, 1000, 0.1, True),
                                                     (4, 6144, 6100, 0.1, True), (3, 50257, 50257, 0.0, False)])
def test_a_training_step_reads_the_logits_twice(backend, request, monkeypatch, dtype, N, W, n_valid, eps, ignored):
    """The vocab-parallel cross-entropy (tp=1) and the ops' single-device one, forward and backward
    through the emulated kernels, in place over the logits as in training: the emulator counts the
    bytes each launch moves per array. The logits are read exactly twice in all (the forward's one
    pass, the backward's) and written once (the gradient). W = 1000 has rows that end mid-pack
    (element loads); n_valid = 6100 of 6144: padded columns, never read, written as zeros; ignored
    rows: read by the forward only (their gradient is zeros, written without reading)."""
    if not backend.emulated:
        pytest.skip("traffic is counted by the emulator (a GPU has no per-access counters here)")
    from mpi4py import MPI

    import cutp
    import cutp.ops.cross_entropy as ce_ops
    from cutp.kernels import eligible
    from cutp.tensor_parallel import VocabParallelCrossEntropy
    from tests.cuda_emu import record_traffic

    if not request.getfixturevalue("emulated_module").checks:
        pytest.skip("traffic is counted by checked emulator builds only ($CUTP_EMU_CHECKS=0 turns the checks off)")
    k = backend.launchers()
    monkeypatch.setattr(ce_ops, "_kernels", lambda *a: k if eligible(a, lambda x: isinstance(x, np.ndarray)) else None)
    logits = randn((N, W), dtype, seed=33, scale=3.0)
    targets = _targets(N, n_valid, 34)
    targets[targets < 0] = -100
    if not ignored:
        targets[targets < 0] = 1
    valid_bytes = N * n_valid * logits.itemsize
    backward_bytes = int((targets >= 0).sum()) * n_valid * logits.itemsize  # the rows with a gradient
    if not ignored and n_valid == W:
        assert valid_bytes + backward_bytes == 2 * logits.nbytes  # the acceptance, literally
    ctx = cutp.init(comm=MPI.COMM_SELF, tp=1, device="cpu")
    try:
        ce = VocabParallelCrossEntropy(ctx, n_valid, W, label_smoothing=eps)
        buf = logits.copy()
        with record_traffic() as log:
            loss = ce.forward(buf, targets, inplace_backward=True)
            d = ce.backward(1.0)
        assert d.base is buf or d is buf or np.shares_memory(d, buf)
    finally:
        ctx.close()
    traffic = _traffic_of(log, buf)
    assert [r.kernel.rsplit("_", 1)[0] for r in log] == ["ce_shard_forward", "ce_shard_backward"]
    assert sum(r for r, _ in traffic.values()) == valid_bytes + backward_bytes, traffic
    assert sum(w for _, w in traffic.values()) == logits.nbytes, traffic
    assert traffic[log[0].kernel] == (valid_bytes, 0)  # the forward: one pass, no writes
    # the ops' single-device cross-entropy, the same two passes
    buf2 = logits.copy()
    t2 = np.where(targets >= 0, targets, -100)
    with record_traffic() as log2:
        loss2, cctx = ops.cross_entropy_forward(buf2, t2, label_smoothing=eps, n_classes=n_valid)
        ops.cross_entropy_backward(np.float32(1.0), cctx, out=buf2)
    traffic2 = _traffic_of(log2, buf2)
    assert len(log2) == 2
    assert sum(r for r, _ in traffic2.values()) == valid_bytes + backward_bytes, traffic2
    assert sum(w for _, w in traffic2.values()) == logits.nbytes, traffic2
    np.testing.assert_allclose(float(loss2), loss, rtol=1e-6)
    # and the counts mean what they say: the result equals the reference path's
    with np.errstate(all="ignore"):
        ref_loss, rctx = ops.cross_entropy_forward(logits.astype(np.float32), t2, label_smoothing=eps,
                                                   n_classes=n_valid)
    np.testing.assert_allclose(loss, float(ref_loss), rtol=1e-5)


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
    m, se, tl, _ = k.ce_shard_forward(logits, t, n_valid, need_sum_logits=False)
    host = backend.host
    tail = host(logits[-3:])  # rows whose offsets are past 2^31
    t_tail = host(t[-3:])
    m_ref, se_ref, tl_ref, _ = ops.ce_shard_forward(tail, t_tail, n_valid, need_sum_logits=False)
    np.testing.assert_array_equal(host(m[-3:]), m_ref)
    close(se[-3:], se_ref, F32, rtol=2e-5)
    np.testing.assert_array_equal(host(tl[-3:]), tl_ref)
    scale = cp.full(N, 1.0 / N, dtype=cp.float32)
    k.ce_shard_backward(logits, m, se, t, n_valid, scale, out=logits)
    ref = ops.ce_shard_backward(tail, host(m[-3:]), se_ref, t_tail, n_valid, np.full(3, 1.0 / N, np.float32))
    close(logits[-3:], ref, dtype, atol=1e-12 if dtype == F32 else 1e-7)
    del logits, m, se, tl, t, scale
    cp.get_default_memory_pool().free_all_blocks()


def test_ce_float32_sum_with_a_late_max_within_its_bound(backend, k):
    """The running sum's rescale: every one of a 1024-thread block's threads reads 1024 zero logits,
    then its row maximum a = 5.545 (helpers.late_max_row), and rescales its sum by expf(-a); sum_exp
    within the first-order bound of that float32 evaluation (expf's 2 ulps, the roundings' half
    ulps). A fast exp there (__expf: 8 ulps at this argument, its documented bound, which the
    emulator draws) moves it by ~13 x 2^-24, past the ~7 allowed."""
    row, s, bound = late_max_row(1024, 1024)
    assert k._row_block(row.size, F32) == 1024  # the layout assumed
    out = k.ce_shard_forward(backend.to_device(row[None]), backend.to_device(np.zeros(1, np.int64)), row.size)
    assert backend.host(out[0])[0] == row.max()
    assert_within_float32_bound(backend.host(out[1]), s, bound, "sum_exp")
