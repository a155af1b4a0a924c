"""cutp's CUDA kernels (kernels/*.cu) run on the CPU under the CUDA emulation (tests/cuda_emu).

Every kernel is launched through its host launcher in cutp/cuda_kernels.py (the same host code
that launches it on a GPU: argument checks, grid/block/shared-memory sizing, two-pass column
reductions) with an EmulatedModule standing in for cupy.RawModule and NumPy arrays for CuPy
arrays, and compared with the NumPy reference in cutp.ops: float32 within ~1e-5 relative,
bfloat16 against the reference computed on the same bf16 inputs within ~2e-2. Kernels with
barriers or shared memory run under several thread schedules, and their reductions must give
bit-identical results under every schedule (deterministic). The last tests route cutp.ops
through the emulated kernels (the GPU dispatch, with NumPy standing in for CuPy) and train a
tiny GPT step against the reference path.

kernels/README.md says what a passing emulated test does and does not establish.
"""
from __future__ import annotations

import importlib

import ml_dtypes
import numpy as np
import pytest

from cutp import kernels as cuda_kernels, ops
from cutp.bench import kernel_variants
from cutp.kernels import KernelArgumentError, Launchers
from tests.cuda_emu import KERNELS_DIR, EmulatedModule

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
DTYPES = [F32, BF16]
DT_IDS = ["f32", "bf16"]
SCHEDULES3 = [("forward", 0), ("reverse", 0), ("random", 7)]
SCHED_IDS = ["forward", "reverse", "random"]


@pytest.fixture(scope="module")
def emu() -> EmulatedModule:
    # All sources as one program (one g++ run, ~2 s); on a GPU each is its own RawModule.
    return EmulatedModule(path=[KERNELS_DIR / f"{s}.cu" for s in cuda_kernels.SOURCES])


def launchers(emu, schedule="forward", seed=0) -> Launchers:
    mod = emu.with_schedule(schedule, seed)
    return Launchers(lambda name: mod, np, description=f"emulated ({schedule})")


@pytest.fixture
def k(emu) -> Launchers:
    return launchers(emu)


@pytest.fixture(params=SCHEDULES3, ids=SCHED_IDS)
def ks(emu, request) -> Launchers:
    return launchers(emu, *request.param)


def rng(seed=0):
    return np.random.default_rng(seed)


def randn(shape, dtype, seed=0, scale=1.0):
    return (rng(seed).standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def close(got, want, dtype, rtol=None, atol=None):
    """float32: ~1e-5 relative; bf16: within ~2 bf16 ulps (the reference ran on the same bf16 inputs)."""
    if dtype == BF16:
        rtol = 2e-2 if rtol is None else rtol
        atol = 1e-3 if atol is None else atol
    else:
        rtol = 1e-5 if rtol is None else rtol
        atol = 1e-6 if atol is None else atol
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype == BF16 else np.uint32 if a.itemsize == 4 else np.uint8)


# ================================================================================================
# GeLU
# ================================================================================================
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", [(0,), (1,), (3,), (255,), (4, 257), (2, 3, 1029)])
def test_gelu_forward_backward(k, dtype, approximate, shape):
    x = randn(shape, dtype, seed=1, scale=2.0)
    dy = randn(shape, dtype, seed=2)
    y = k.gelu_forward(x, approximate)
    y_ref, gctx = ops.gelu_forward(x, approximate)
    close(y, y_ref, dtype)
    dx = k.gelu_backward(dy, x, approximate)
    # gelu' of the tanh form cancels for x < -4 (1 + tanh -> 0): ~1e-6 absolute either way
    close(dx, ops.gelu_backward(dy, gctx), dtype, atol=1e-5 if dtype == F32 else None)
    assert k.launches[f"gelu_forward_{'f32' if dtype == F32 else 'bf16'}"] == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_gelu_unaligned_view_takes_the_scalar_path(k, dtype):
    base = randn(1 + 8 * 40, dtype, seed=3)
    x = base[1:]  # contiguous, but 2 or 4 bytes past a 16-byte boundary: no 128-bit access allowed
    assert x.flags.c_contiguous and x.ctypes.data % 16 != 0
    close(k.gelu_forward(x), ops.gelu_forward(x)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
# (5, 1): several rows of one column (bias of one element, a 1-column reduction); (1, 3001): one
# row over several blocks of column chunks (gx > 1), ending in a partial 128-bit chunk
@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (3, 5), (7, 8), (2, 3, 37), (33, 64), (0, 16), (600, 9), (1, 3001)])
def test_bias_gelu_forward_backward(ks, dtype, shape):
    k = ks
    x = randn(shape, dtype, seed=4, scale=2.0)
    b = randn(shape[-1:], dtype, seed=5)
    dy = randn(shape, dtype, seed=6)
    y, pre = k.bias_gelu_forward(x, b)
    y_ref, gctx = ops.bias_gelu_forward(x, b)
    close(pre, gctx.x, dtype)
    close(y, y_ref, dtype)
    dx, db = k.bias_gelu_backward(dy, pre)
    dx_ref, db_ref = ops.bias_gelu_backward(dy, gctx)
    close(dx, dx_ref, dtype, atol=1e-5 if dtype == F32 else None)
    close(db, db_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-4 * max(1, shape[0]) ** 0.5)
    if dtype == F32:  # the same pre-activation bits as the reference (x + b rounded once)
        np.testing.assert_array_equal(bits(pre), bits(gctx.x))


def test_bias_gradient_is_deterministic_over_schedules(emu):
    x = randn((301, 40), F32, seed=7)
    dy = randn((301, 40), F32, seed=8)
    results = [launchers(emu, s, seed).bias_gelu_backward(dy, x)[1] for s, seed in SCHEDULES3]
    for r in results[1:]:
        np.testing.assert_array_equal(bits(r), bits(results[0]))


def test_bias_gelu_backward_uses_several_row_chunks(k):
    x = randn((600, 9), F32, seed=9)
    k.bias_gelu_backward(x, x)
    n_chunks, rows = Launchers._row_chunks(600, 1)
    assert n_chunks > 1 and rows * n_chunks >= 600 and rows * (n_chunks - 1) < 600


# ================================================================================================
# Softmax
# ================================================================================================
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
]


SOFTMAX_IDS = [f"{s}-{'causal' if c else 'full'}" for s, c, _ in SOFTMAX_CASES]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,causal,scale", SOFTMAX_CASES, ids=SOFTMAX_IDS)
def test_softmax_forward_backward(ks, dtype, shape, causal, scale):
    k = ks
    x = randn(shape, dtype, seed=10, scale=3.0)
    dy = randn(shape, dtype, seed=11)
    y = k.softmax_forward(x, scale, causal)
    y_ref, sctx = ops.softmax_forward(x, scale, causal)
    close(y, y_ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)
    if causal and len(shape) >= 2 and x.size:
        masked = ops.causal_mask(np, shape[-2], shape[-1])
        assert not np.any(np.asarray(y, np.float32)[..., masked]), "masked probabilities must be exact zeros"
    dx = k.softmax_backward(dy, y_ref, scale)
    close(dx, ops.softmax_backward(dy, sctx), dtype, atol=1e-6 if dtype == F32 else 1e-3)


def test_softmax_extreme_values_stay_finite(k):
    x = np.array([[1e4, -1e4, 0.0, 3e4], [-np.inf, 0.0, 1.0, -np.inf]], np.float32)
    y = k.softmax_forward(x)
    np.testing.assert_allclose(y, ops.softmax_forward(x)[0], rtol=1e-6, atol=0)
    assert np.isfinite(y).all()


def test_softmax_is_deterministic_over_schedules(emu):
    x = randn((3, 1500), F32, seed=12)
    ys = [launchers(emu, s, seed).softmax_forward(x, 0.7) for s, seed in SCHEDULES3]
    for y in ys[1:]:
        np.testing.assert_array_equal(bits(y), bits(ys[0]))


# ================================================================================================
# LayerNorm
# ================================================================================================
# (5, 1): rows of one column (xhat == 0: y == bias, dx == 0); (1, 4999): one row, a block per row
# whose threads loop over several 128-bit chunks, ending in a partial chunk, in the forward and
# (f32 and bf16: over 512 threads * pack) in the backward
LN_SHAPES = [(1, 1), (5, 1), (3, 5), (4, 32), (2, 3, 37), (5, 64), (0, 8), (2, 2500), (1, 4999)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm_forward_backward(ks, dtype, affine, shape):
    k = ks
    C = shape[-1]
    x = randn(shape, dtype, seed=13, scale=2.0) + np.asarray(0.5, dtype)
    w = randn((C,), dtype, seed=14) if affine in ("wb", "w") else None
    b = randn((C,), dtype, seed=15) if affine == "wb" else None
    dy = randn(shape, dtype, seed=16)
    y, mean, rstd = k.layernorm_forward(x, w, b, 1e-5)
    y_ref, lctx = ops.layernorm_forward(x, w, b, 1e-5)
    close(y, y_ref, dtype, atol=1e-5 if dtype == F32 else None)
    close(mean, lctx.mean.reshape(-1), F32, atol=1e-6)
    close(rstd, lctx.rstd.reshape(-1), F32, rtol=1e-5)
    dx, dw, db = k.layernorm_backward(dy, x, w, mean, rstd, None if b is None else b.dtype)
    dx_ref, dw_ref, db_ref = ops.layernorm_backward(dy, lctx)
    close(dx, dx_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 if dtype == F32 else None)
    for got, want in ((dw, dw_ref), (db, db_ref)):
        if want is None:
            assert got is None
        else:
            close(got, want, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 * max(1, x.size // C))


def test_layernorm_backward_over_48k_of_shared_memory(k):
    """2 * C floats of shared memory above 48 KiB: the launcher raises the kernel's limit."""
    C = 6200  # 49600 bytes
    x = randn((2, C), F32, seed=17)
    w = randn((C,), F32, seed=18)
    b = randn((C,), F32, seed=19)
    dy = randn((2, C), F32, seed=20)
    y, mean, rstd = k.layernorm_forward(x, w, b)
    _, lctx = ops.layernorm_forward(x, w, b)
    dx, dw, db = k.layernorm_backward(dy, x, w, mean, rstd, b.dtype)
    dx_ref, dw_ref, db_ref = ops.layernorm_backward(dy, lctx)
    close(dx, dx_ref, F32, rtol=1e-4, atol=1e-5)
    close(dw, dw_ref, F32, rtol=1e-4, atol=1e-5)
    close(db, db_ref, F32, rtol=1e-5, atol=1e-6)
    assert k.function("layernorm", "layernorm_backward_f32").max_dynamic_shared_size_bytes >= 2 * C * 4


def test_layernorm_parameter_gradients_are_deterministic_over_schedules(emu):
    x = randn((700, 24), F32, seed=21)
    dy = randn((700, 24), F32, seed=22)
    w = randn((24,), F32, seed=23)
    out = []
    for s, seed in SCHEDULES3:
        kk = launchers(emu, s, seed)
        _, mean, rstd = kk.layernorm_forward(x, w, w)
        out.append(kk.layernorm_backward(dy, x, w, mean, rstd, F32))
    for dx, dw, db in out[1:]:
        for a, b in zip((dx, dw, db), out[0]):
            np.testing.assert_array_equal(bits(a), bits(b))


# ================================================================================================
# Vocab-parallel cross-entropy (the local pieces)
# ================================================================================================
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
def test_ce_shard_max_stats_backward(ks, dtype, N, W, n_valid):
    k = ks
    logits = randn((N, W), dtype, seed=24, scale=4.0)
    t = _targets(N, n_valid, 25)
    m = k.ce_shard_max(logits, n_valid)
    m_ref = ops.ce_shard_max(logits, n_valid)
    np.testing.assert_array_equal(m, m_ref)  # max is exact
    se, tl, sl = k.ce_shard_stats(logits, m_ref, t, n_valid)
    se_ref, tl_ref, sl_ref = ops.ce_shard_stats(logits, m_ref, t, n_valid)
    close(se, se_ref, F32, rtol=1e-5)
    np.testing.assert_array_equal(tl, tl_ref)
    close(sl, sl_ref, F32, rtol=1e-5, atol=1e-4 * max(1, n_valid) ** 0.5)
    # row 0 has scale 0 (an ignored row), unless it is the only row
    row_scale = np.linspace(0.0, 1.0, N).astype(np.float32) if N > 1 else np.full(N, 0.75, np.float32)
    for eps in (0.0, 0.1):
        out = k.ce_shard_backward(logits, m_ref, se_ref, t, n_valid, row_scale, eps, max(n_valid, 1))
        with np.errstate(divide="ignore"):  # n_valid == 0: sum_exp is 0 (the reference divides by it)
            ref = ops.ce_shard_backward(logits, m_ref, se_ref, t, n_valid, row_scale, eps, max(n_valid, 1))
        close(out, ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)
        assert not np.any(np.asarray(out, np.float32)[:, n_valid:]), "padded columns get exact zeros"
        if N > 1:
            assert not np.any(np.asarray(out, np.float32)[0]), "a row with row_scale 0 is all zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_ce_backward_in_place_over_the_logits(k, dtype):
    N, W, n_valid = 7, 72, 70
    logits = randn((2, N // 1, W), dtype, seed=26, scale=3.0).reshape(2 * N, W)
    t = _targets(2 * N, n_valid, 27)
    m = ops.ce_shard_max(logits, n_valid)
    se, _, _ = ops.ce_shard_stats(logits, m, t, n_valid)
    ref = ops.ce_shard_backward(logits, m, se, t, n_valid, np.float32(0.25))
    buf = logits.copy()
    out = k.ce_shard_backward(buf, m, se, t, n_valid, 0.25, out=buf)  # scalar row_scale broadcasts
    assert out is buf
    close(buf, ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)


def test_ce_row_vectors_of_other_dtypes_are_converted(k):
    logits = randn((4, 10), F32, seed=28)
    t32 = np.array([1, -1, 9, 0], np.int32)
    m64 = ops.ce_shard_max(logits, 10).astype(np.float64)
    se, tl, sl = k.ce_shard_stats(logits, m64, t32, 10)
    se_ref, tl_ref, _ = ops.ce_shard_stats(logits, m64.astype(np.float32), t32.astype(np.int64), 10)
    close(se, se_ref, F32)
    np.testing.assert_array_equal(tl, tl_ref)
    with pytest.raises(KernelArgumentError, match="local_targets has dtype float32"):
        k.ce_shard_stats(logits, m64, t32.astype(np.float32), 10)
    with pytest.raises(KernelArgumentError, match="row_max has 3 elements"):
        k.ce_shard_stats(logits, m64[:3], t32, 10)


# ================================================================================================
# AdamW
# ================================================================================================
ADAMW_KW = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7, grad_scale=0.5)


def _adamw_state(n, dtype, seed):
    r = rng(seed)
    p = r.standard_normal(n).astype(np.float32).astype(dtype)
    g = r.standard_normal(n).astype(np.float32).astype(dtype)
    m = (r.standard_normal(n) * 0.1).astype(np.float32)
    v = (r.random(n) * 0.01).astype(np.float32)
    mask = (r.random(n) < 0.5).astype(np.float32).astype(dtype)
    return p, g, m, v, mask


@pytest.mark.parametrize("n", [0, 1, 5, 1000, 1027])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_adamw_float32_matches_the_reference_bit_for_bit(k, n, weight_decay):
    kw = dict(ADAMW_KW, weight_decay=weight_decay)
    p, g, m, v, mask = _adamw_state(n, F32, n)
    p2, m2, v2 = p.copy(), m.copy(), v.copy()
    g0 = g.copy()
    k.adamw_update(p, g, m, v, mask, **kw)
    ops.adamw_update(p2, g, m2, v2, mask, **kw)
    for got, want in ((p, p2), (m, m2), (v, v2)):
        np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(g, g0)


# 2048 = 256 threads * 8 bf16: one block's worth; 2053 spills 5 elements into a second block's
# first thread (a partial chunk), 4099 ends mid-chunk in a third block
@pytest.mark.parametrize("n", [1, 31, 333, 2048, 2053, 4099])
def test_adamw_bf16_params(k, n):
    p, g, m, v, mask = _adamw_state(n, BF16, 5 + n)
    p_ref = p.astype(np.float32)
    m2, v2 = m.copy(), v.copy()
    g0 = g.copy()
    k.adamw_update(p, g, m, v, mask, **ADAMW_KW)
    ops.adamw_update(p_ref, g.astype(np.float32), m2, v2, mask.astype(np.float32), **ADAMW_KW)
    # the kernel computes in float32 from the exact bf16 values, as the float32 reference does on
    # them, and rounds p to bf16 once: m and v are bit-identical, p the reference rounded to bf16
    np.testing.assert_array_equal(bits(m), bits(m2))
    np.testing.assert_array_equal(bits(v), bits(v2))
    np.testing.assert_array_equal(bits(p), bits(p_ref.astype(BF16)))
    np.testing.assert_array_equal(bits(g), bits(g0))


def test_adamw_without_decay_takes_no_mask(k):
    p, g, m, v, _ = _adamw_state(50, F32, 6)
    p2, m2, v2 = p.copy(), m.copy(), v.copy()
    k.adamw_update(p, g, m, v, None, **dict(ADAMW_KW, weight_decay=0.0))
    ops.adamw_update(p2, g, m2, v2, np.zeros(50, np.float32), **dict(ADAMW_KW, weight_decay=0.0))
    np.testing.assert_array_equal(p, p2)
    with pytest.raises(KernelArgumentError, match="decay_mask"):
        k.adamw_update(p, g, m, v, None, **ADAMW_KW)


# ================================================================================================
# Dropout
# ================================================================================================
@pytest.mark.parametrize("p,seed,offset", [(0.1, 1337, 0), (0.5, 2**64 - 1, 2**64 - 5), (1.0, 3, 9), (0.0, 4, 100),
                                           (1 / 3, 123456789, 987654321)])
def test_dropout_mask_is_bit_identical(k, p, seed, offset):
    for shape in [(1,), (3, 333), (0, 4)]:
        np.testing.assert_array_equal(k.dropout_mask(shape, p, seed, offset), ops.dropout_mask(np, shape, p, seed, offset))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", [(1,), (5, 7), (4, 1003), (0,)])
def test_dropout_forward_and_backward(k, dtype, shape):
    x = randn(shape, dtype, seed=29)
    y, mask = k.dropout_forward(x, 0.3, 77, 1000)
    y_ref, dctx = ops.dropout_forward(x, 0.3, 77, 1000)
    np.testing.assert_array_equal(mask, dctx.mask)
    np.testing.assert_array_equal(bits(y), bits(y_ref))  # one or two exact roundings, as the reference
    dx = k.dropout_apply(x, mask, dctx.scale)
    np.testing.assert_array_equal(bits(dx), bits(ops.dropout_backward(x, dctx)))


# ================================================================================================
# Argument checks: a clear error, never a silent wrong answer
# ================================================================================================
def test_non_contiguous_arrays_are_refused(k):
    x = randn((6, 16), F32, seed=30)
    strided = x[:, ::2]
    cases = [
        lambda: k.gelu_forward(strided),
        lambda: k.gelu_backward(strided, np.ascontiguousarray(strided)),
        lambda: k.bias_gelu_forward(strided, np.zeros(8, np.float32)),
        lambda: k.bias_gelu_backward(strided, np.ascontiguousarray(strided)),
        lambda: k.softmax_forward(strided),
        lambda: k.softmax_backward(np.ascontiguousarray(strided), strided),
        lambda: k.layernorm_forward(strided),
        lambda: k.ce_shard_max(strided, 8),
        lambda: k.ce_shard_backward(x, np.zeros(6, np.float32), np.ones(6, np.float32), np.zeros(6, np.int64), 16,
                                    np.ones(6, np.float32), out=np.empty((16, 6), np.float32).T),
        lambda: k.dropout_forward(strided, 0.5, 1, 2),
        lambda: k.adamw_update(strided[0], strided[0].copy(), np.zeros(8, np.float32), np.zeros(8, np.float32),
                               np.ones(8, np.float32), **ADAMW_KW),
    ]
    for case in cases:
        with pytest.raises(KernelArgumentError, match="not C-contiguous"):
            case()


def test_wrong_dtypes_are_refused(k):
    x64 = np.zeros((4, 8))
    with pytest.raises(KernelArgumentError, match="float64 through their reference composition"):
        k.gelu_forward(x64)
    with pytest.raises(KernelArgumentError, match="dtype int32"):
        k.softmax_forward(np.zeros((2, 3), np.int32))
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(KernelArgumentError, match="dy has dtype bfloat16, expected float32"):
        k.gelu_backward(x.astype(BF16), x)
    with pytest.raises(KernelArgumentError, match="b has dtype bfloat16"):
        k.bias_gelu_forward(x, np.zeros(8, BF16))
    with pytest.raises(KernelArgumentError, match="weight has dtype float64"):
        k.layernorm_forward(x, np.ones(8))
    with pytest.raises(KernelArgumentError, match="mean has dtype float64"):
        k.layernorm_backward(x, x, None, np.zeros(4), np.ones(4, np.float32))
    with pytest.raises(KernelArgumentError, match="m has dtype float64"):
        k.adamw_update(x[0], x[0], np.zeros(8), np.zeros(8, np.float32), x[0], **ADAMW_KW)
    with pytest.raises(KernelArgumentError, match="mask has dtype float32, expected bool"):
        k.dropout_apply(x, x, 2.0)
    with pytest.raises(KernelArgumentError, match="out has dtype bfloat16"):
        k.ce_shard_backward(x, np.zeros(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.int64), 8,
                            np.ones(4, np.float32), out=x.astype(BF16))


def test_wrong_shapes_and_array_types_are_refused(k):
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(KernelArgumentError, match=r"dy has shape \(4, 7\), expected \(4, 8\)"):
        k.gelu_backward(np.zeros((4, 7), np.float32), x)
    with pytest.raises(KernelArgumentError, match=r"b has shape \(9,\), expected \(8,\)"):
        k.bias_gelu_forward(x, np.zeros(9, np.float32))
    with pytest.raises(KernelArgumentError, match=r"dy has shape"):
        k.softmax_backward(np.zeros((8, 4), np.float32), x)
    with pytest.raises(KernelArgumentError, match=r"bias has shape \(7,\)"):
        k.layernorm_forward(x, None, np.zeros(7, np.float32))
    with pytest.raises(KernelArgumentError, match="rstd has 3 elements, expected one per row: 4"):
        k.layernorm_backward(x, x, None, np.zeros(4, np.float32), np.ones(3, np.float32))
    with pytest.raises(KernelArgumentError, match="row_scale has 3 elements"):
        k.ce_shard_backward(x, np.zeros(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.int64), 8,
                            np.ones(3, np.float32))
    with pytest.raises(KernelArgumentError, match=r"g has shape \(7,\)"):
        k.adamw_update(x[0], x[0, :7], np.zeros(8, np.float32), np.zeros(8, np.float32), x[0], **ADAMW_KW)
    with pytest.raises(KernelArgumentError, match="takes flat arrays"):
        k.adamw_update(x, x, x, x, x, **ADAMW_KW)
    with pytest.raises(KernelArgumentError, match="must be a numpy array"):
        k.gelu_forward([1.0, 2.0])
    with pytest.raises(ValueError, match="causal softmax needs Tq <= Tk"):
        k.softmax_forward(np.zeros((5, 3), np.float32), causal=True)
    with pytest.raises(ValueError, match="n_valid=9 outside"):
        k.ce_shard_max(x, 9)


def test_kernels_reject_bad_launches_too(emu):
    """Below the launchers, the kernels themselves: an empty launch (CuPy runs grid (0,) as one
    block) is harmless, and the emulator rejects Python scalars as CuPy would mis-pass them."""
    from tests.cuda_emu import KernelArgumentError as EmuArgumentError

    gelu = emu.get_function("gelu_forward_f32")
    empty = np.zeros(0, np.float32)
    gelu((0,), (256,), (empty, empty, np.int64(0), np.int32(0)))
    softmax = emu.get_function("softmax_forward_bf16")
    e16 = np.zeros((0, 4), BF16)
    softmax((0,), (128,), (e16, e16, np.int64(0), np.int32(0), np.int32(4), np.float32(1), np.int32(1), np.int32(1)))
    with pytest.raises(EmuArgumentError, match="8-byte integer"):
        gelu((1,), (256,), (empty, empty, np.int32(0), np.int32(0)))  # an int32 for `long long n`
    with pytest.raises(EmuArgumentError, match="4-byte float"):
        softmax((1,), (128,), (e16, e16, np.int64(0), np.int32(0), np.int32(4), 1.0, np.int32(1), np.int32(1)))


# ================================================================================================
# The ops' dispatch, with NumPy standing in for CuPy and the emulator for the GPU
# ================================================================================================
OP_MODULES = ["cutp.ops.gelu", "cutp.ops.softmax", "cutp.ops.layernorm", "cutp.ops.cross_entropy",
              "cutp.ops.adamw", "cutp.ops.dropout"]


@pytest.fixture
def emulated_dispatch(emu, monkeypatch):
    """cutp.ops call the emulated kernels for NumPy arrays, by the GPU dispatch rule."""
    kk = launchers(emu, "random", 3)

    def fake_dispatch(*arrays):
        ok = cuda_kernels.eligible(arrays, lambda a: isinstance(a, np.ndarray))
        return kk if ok and cuda_kernels.kernels_enabled() else None

    def fake_dispatch_xp(xp):
        return kk if xp is np and cuda_kernels.kernels_enabled() else None

    for name in OP_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "_kernels", fake_dispatch)
    monkeypatch.setattr(importlib.import_module("cutp.ops.dropout"), "_kernels_xp", fake_dispatch_xp)
    return kk


def test_dispatch_rule():
    is_np = lambda a: isinstance(a, np.ndarray)  # noqa: E731
    x = np.zeros((4, 8), np.float32)
    assert cuda_kernels.eligible((x, None, x[0]), is_np)
    assert cuda_kernels.eligible((x.astype(BF16),), is_np)
    assert not cuda_kernels.eligible((x.astype(np.float64),), is_np)  # float64: reference composition
    assert not cuda_kernels.eligible((x, x.astype(BF16)), is_np)  # mixed dtypes
    assert not cuda_kernels.eligible((x[:, ::2],), is_np)  # strided view
    assert not cuda_kernels.eligible((None,), is_np)
    assert not cuda_kernels.eligible((x,))  # NumPy is not a device array: CPU ops never dispatch
    assert cuda_kernels.dispatch(x) is None and cuda_kernels.dispatch_xp(np) is None


def test_use_kernels_switch(monkeypatch):
    monkeypatch.delenv("CUTP_KERNELS", raising=False)
    assert cuda_kernels.kernels_enabled()
    with cuda_kernels.use_kernels(False):
        assert not cuda_kernels.kernels_enabled()
        with cuda_kernels.use_kernels(True):
            assert cuda_kernels.kernels_enabled()
        assert not cuda_kernels.kernels_enabled()
    assert cuda_kernels.kernels_enabled()
    monkeypatch.setenv("CUTP_KERNELS", "0")
    assert not cuda_kernels.kernels_enabled()
    with cuda_kernels.use_kernels(True):
        assert cuda_kernels.kernels_enabled()
    assert not cuda_kernels.kernels_enabled()
    monkeypatch.setenv("CUTP_KERNELS", "1")
    cuda_kernels.use_kernels(False)  # the plain call sets it for the rest of the process...
    try:
        assert not cuda_kernels.kernels_enabled()
    finally:
        cuda_kernels.use_kernels(None)  # ...until set again; None: back to $CUTP_KERNELS
    assert cuda_kernels.kernels_enabled()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_ops_dispatch_to_the_kernels_and_keep_their_contracts(emulated_dispatch, dtype):
    kk = emulated_dispatch
    x = randn((2, 3, 16), dtype, seed=31)
    b = randn((16,), dtype, seed=32)
    dy = randn((2, 3, 16), dtype, seed=33)
    results = {}
    for enabled in (True, False):
        with cuda_kernels.use_kernels(enabled):
            r = {}
            y, gctx = ops.bias_gelu_forward(x, b)
            r["bias_gelu"] = (y, gctx.x, *ops.bias_gelu_backward(dy, gctx))
            y, gctx = ops.gelu_forward(x, "none")
            r["gelu"] = (y, ops.gelu_backward(dy, gctx))
            y, sctx = ops.softmax_forward(x.reshape(2, 3, 4, 4), 0.5, causal=True)
            r["softmax"] = (y, sctx.y, ops.softmax_backward(dy.reshape(2, 3, 4, 4), sctx))
            y, lctx = ops.layernorm_forward(x, b, b)
            r["layernorm"] = (y, lctx.mean, lctx.rstd, *ops.layernorm_backward(dy, lctx))
            assert lctx.mean.shape == (2, 3) and lctx.mean.dtype == np.float32
            t = np.array([3, -100, 14, 0, 9, 2])
            loss, cctx = ops.cross_entropy_forward(x, t, label_smoothing=0.1, n_classes=15)
            r["ce"] = (loss, cctx.row_max, cctx.sum_exp, ops.cross_entropy_backward(np.float32(2.0), cctx))
            y, dctx = ops.dropout_forward(x, 0.25, 5, 6)
            r["dropout"] = (y, dctx.mask, ops.dropout_backward(dy, dctx), ops.dropout_mask(np, (3, 5), 0.5, 1, 2))
            results[enabled] = r
    for name, got in results[True].items():
        for a, want in zip(got, results[False][name]):
            a, want = np.asarray(a), np.asarray(want)
            assert a.shape == want.shape and a.dtype == want.dtype, (name, a.shape, want.shape, a.dtype, want.dtype)
            if a.dtype == bool:
                np.testing.assert_array_equal(a, want)
            else:
                close(a, want, dtype if a.dtype == dtype else F32, rtol=1e-4 if dtype == F32 else None,
                      atol=1e-5 if dtype == F32 else 2e-3)
    suffix = "f32" if dtype == F32 else "bf16"
    for name in ("bias_gelu_forward", "bias_gelu_backward", "gelu_forward", "gelu_backward", "softmax_forward",
                 "softmax_backward", "layernorm_forward", "layernorm_backward", "ce_shard_max", "ce_shard_stats",
                 "ce_shard_backward", "dropout_forward", "dropout_apply"):
        assert kk.launches[f"{name}_{suffix}"] >= 1, name
    assert kk.launches["dropout_mask_bool"] == 1 and kk.launches[f"column_sum_{suffix}"] >= 3


def test_float64_ops_take_the_reference_path(emulated_dispatch):
    x = randn((3, 8), np.float64, seed=34)
    ops.gelu_forward(x)
    ops.softmax_forward(x)
    ops.layernorm_forward(x, np.ones(8), np.zeros(8))
    assert not emulated_dispatch.launches


def test_gpt_training_step_through_the_kernels(emulated_dispatch):
    """forward + backward + AdamW of a tiny GPT (dropout and label smoothing on, padded vocabulary)
    through the emulated kernels equals the reference path to float32 rounding."""
    from mpi4py import MPI

    import cutp
    from cutp.model import GPT, GPTConfig
    from cutp.optim import AdamW, FlatParameters

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=8, dropout=0.1, label_smoothing=0.1)
    ctx = cutp.init(comm=MPI.COMM_SELF, tp=1, device="cpu")
    ids = rng(35).integers(0, 11, (2, 8))
    targets = rng(36).integers(0, 11, (2, 8))
    targets[0, :3] = -100
    out = {}
    for enabled in (True, False):
        with cuda_kernels.use_kernels(enabled):
            model = GPT(ctx, cfg, seed=3)
            flat = FlatParameters(model.parameters())
            opt = AdamW(flat, lr=1e-2)
            loss = model.forward(ids, targets)
            model.backward()
            grad = flat.grad.copy()
            opt.step(grad_scale=0.5)
            out[enabled] = (loss, grad, flat.data.copy())
    ctx.close()
    (l1, g1, p1), (l0, g0, p0) = out[True], out[False]
    assert abs(l1 - l0) <= 1e-5 * abs(l0)
    np.testing.assert_allclose(g1, g0, rtol=1e-3, atol=1e-6 * np.abs(g0).max())
    # AdamW's first step moves each parameter by about lr * sign(grad): where a gradient is rounding
    # noise (|g| ~ eps) the two paths may step differently, by a small fraction of lr
    np.testing.assert_allclose(p1, p0, rtol=1e-4, atol=2e-5)
    used = {name.rsplit("_", 1)[0] for name in emulated_dispatch.launches}
    assert {"bias_gelu_forward", "bias_gelu_backward", "softmax_forward", "softmax_backward", "layernorm_forward",
            "layernorm_backward", "ce_shard_max", "ce_shard_stats", "ce_shard_backward", "adamw_update",
            "dropout_forward", "dropout_apply", "column_sum"} <= used, used


# Every entry point of kernels/*.cu, by name (tests/test_cuda_emu.py's coverage check reads them
# here), and a test that each one is really launched by its host launcher.
ALL_KERNELS = [
    "gelu_forward_f32", "gelu_forward_bf16", "gelu_backward_f32", "gelu_backward_bf16",
    "bias_gelu_forward_f32", "bias_gelu_forward_bf16", "bias_gelu_backward_f32", "bias_gelu_backward_bf16",
    "column_sum_f32", "column_sum_bf16",
    "softmax_forward_f32", "softmax_forward_bf16", "softmax_backward_f32", "softmax_backward_bf16",
    "layernorm_forward_f32", "layernorm_forward_bf16", "layernorm_backward_f32", "layernorm_backward_bf16",
    "ce_shard_max_f32", "ce_shard_max_bf16", "ce_shard_stats_f32", "ce_shard_stats_bf16",
    "ce_shard_backward_f32", "ce_shard_backward_bf16",
    "adamw_update_f32", "adamw_update_bf16",
    "dropout_mask_bool", "dropout_forward_f32", "dropout_forward_bf16", "dropout_apply_f32", "dropout_apply_bf16",
]


def test_every_kernel_is_launched_by_its_launcher(emu):
    from tests.test_cuda_emu import kernel_entry_points

    defined = {n for s in cuda_kernels.SOURCES for n in kernel_entry_points(KERNELS_DIR / f"{s}.cu")}
    assert set(ALL_KERNELS) == defined
    k = launchers(emu)
    for dtype in DTYPES:
        x = randn((3, 40), dtype, seed=40)
        k.gelu_backward(x, k.gelu_forward(x))
        k.bias_gelu_backward(x, k.bias_gelu_forward(x, x[0])[1])
        k.softmax_backward(x, k.softmax_forward(x, 0.5, True), 0.5)
        _, mean, rstd = k.layernorm_forward(x, x[0], x[1])
        k.layernorm_backward(x, x, x[0], mean, rstd, dtype)
        m = k.ce_shard_max(x, 39)
        se, _, _ = k.ce_shard_stats(x, m, np.array([1, -1, 38]), 39)
        k.ce_shard_backward(x, m, se, np.array([1, -1, 38]), 39, 1.0, out=x)
        p = x.reshape(-1).copy()
        k.adamw_update(p, p.copy(), np.zeros(p.size, np.float32), np.zeros(p.size, np.float32), p.copy(), **ADAMW_KW)
        y, mask = k.dropout_forward(x, 0.5, 1, 2)
        k.dropout_apply(y, mask, 2.0)
    k.dropout_mask((5,), 0.5, 1, 2)
    assert set(k.launches) == defined, sorted(defined - set(k.launches))


def test_launch_shapes_stay_within_the_kernels_launch_bounds(emu, monkeypatch):
    """The block sizes the launchers pick for short and very long rows: whole warps, within each
    kernel's __launch_bounds__ (which also caps its registers so the launch fits on the GPU)."""
    seen = []
    monkeypatch.setattr(Launchers, "_launch", lambda self, src, name, grid, block, args, shared_mem=0:
                        seen.append((name, grid, block, shared_mem, args)))
    k = Launchers(lambda name: emu, np)
    for width in (1, 31, 1024, 1025, 4096, 50_257, 300_000):
        for dtype in DTYPES:
            x = np.zeros((2, width), dtype)
            w = np.zeros(width, dtype)
            m = np.zeros(2, np.float32)
            k.softmax_forward(x)
            k.softmax_backward(x, x)
            k.layernorm_forward(x, w, w)
            k.layernorm_backward(x, x, w, m, m, dtype)
            k.ce_shard_max(x, width)
            k.ce_shard_stats(x, m, np.zeros(2, np.int64), width)
            k.ce_shard_backward(x, m, m, np.zeros(2, np.int64), width, 1.0)
            k.bias_gelu_backward(x, x)
    assert len(seen) > 100
    for name, grid, block, smem, args in seen:
        threads = int(np.prod(block))
        bound = emu.get_function(name).launch_bounds
        assert threads % 32 == 0 and threads <= (bound or 1024), (name, block, bound)
        assert all(1 <= g < 2**31 for g in grid), (name, grid)
        if name.startswith("layernorm_backward"):
            assert smem == 2 * 4 * int(args[8]), (name, smem)  # 2 * C floats


def test_benchmark_variants_match_the_benchmark_references(emu, monkeypatch):
    """The "cuda_kernels" variants cutp.cuda_kernels registers with `python -m cutp.bench kernels`,
    run here on the emulator with the benchmark's own (tiny) inputs and output checks."""
    bench = pytest.importorskip("cutp.bench.kernels", reason="the kernel benchmark is not in this checkout")
    if not hasattr(bench, "OPS") or not hasattr(bench, "SIZES") or "tiny" not in bench.SIZES:
        pytest.skip("cutp.bench.kernels has changed shape (no OPS / SIZES['tiny'])")
    k = launchers(emu)
    monkeypatch.setattr(kernel_variants, "_bench_launchers", lambda xp: k)
    variants = {}
    kernel_variants.register_bench_variants(lambda op, name, make: variants.setdefault(op, make))
    assert set(variants) <= set(bench.OPS), sorted(set(variants) - set(bench.OPS))
    for op, make in variants.items():
        spec = bench.OPS[op]
        shape = spec.cases(bench.SIZES["tiny"])[0]
        for dt in (F32, BF16):
            with cuda_kernels.use_kernels(False):  # the references on NumPy run no kernel anyway
                ref_in = spec.setup(np, shape, dt, np.random.default_rng(0))
                want = bench._outputs(spec, ref_in, spec.reference(ref_in)())
            got_in = spec.setup(np, shape, dt, np.random.default_rng(0))
            got = bench._outputs(spec, got_in, make(got_in, np)())
            err = bench.max_rel_error(want, got)
            assert err <= (1e-4 if dt == F32 else 2e-2), (op, dt, err)
