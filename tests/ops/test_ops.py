"""Tests of cutp.ops: backward vs central differences (float64), forward vs plain formulas,
float32/bfloat16 vs float64, inputs never modified, dropout RNG, vocab-parallel CE pieces."""
import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from cutp import ops
from cutp.ops import (
    GeluCtx,
    common as _common,
    bias_gelu_backward,
    bias_gelu_forward,
    ce_shard_backward,
    ce_rescale_sum,
    ce_shard_forward,
    cross_entropy_backward,
    cross_entropy_forward,
    dropout_backward,
    dropout_forward,
    dropout_mask,
    embedding_backward,
    embedding_forward,
    gelu_backward,
    gelu_forward,
    keep_threshold,
    layernorm_backward,
    layernorm_forward,
    linear_backward,
    linear_forward,
    random_bits,
    softmax_backward,
    softmax_forward,
    splitmix64_reference,
)
from cutp.ops.erf import erf, erfc
from tests.gradcheck import check_gradients, numeric_grad, relative_error

BF16 = ml_dtypes.bfloat16
TOL = 1e-6


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(params=["default", "tiny"])
def blocks(request, monkeypatch):
    """Run a test with the default block sizes and with tiny ones (every blocked loop then
    takes many iterations, with ragged last blocks)."""
    if request.param == "tiny":
        monkeypatch.setattr(_common, "BLOCK_ELEMS", 23)
        monkeypatch.setattr(_common, "ELEMENTWISE_BLOCK", 17)
    return request.param


def snapshot(*arrays):
    return [(a, a.copy()) for a in arrays if isinstance(a, np.ndarray)]


def assert_unchanged(snap):
    for a, before in snap:
        assert a.dtype == before.dtype and a.tobytes() == before.tobytes(), "input was modified"


def f64(a):
    return np.asarray(a, dtype=np.float64)


# ---------------------------------------------------------------------------------------
# gradcheck helper itself
# ---------------------------------------------------------------------------------------
def test_gradcheck_helpers(rng):
    x = rng.standard_normal((3, 4))
    g = numeric_grad(lambda: float((x ** 3).sum()), x)
    assert relative_error(3 * x ** 2, g) < 1e-9
    before = x.copy()
    numeric_grad(lambda: float(np.sin(x).sum()), x, indices=[0, 5])
    assert np.array_equal(x, before)  # restored bit-exactly

    def fwd(x):
        return x ** 2, x

    with pytest.raises(AssertionError):
        check_gradients(fwd, {"x": x}, lambda dy, xs: {"x": 3 * xs * dy})
    rep = check_gradients(fwd, {"x": x}, lambda dy, xs: {"x": 2 * xs * dy}, metric="max")
    assert rep["x"] < TOL


# ---------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
def test_linear_grad_and_forward(rng, bias):
    x = rng.standard_normal((2, 3, 5))
    w = rng.standard_normal((5, 4))
    b = rng.standard_normal(4) if bias else None
    inputs = {"x": x, "w": w} if not bias else {"x": x, "w": w, "b": b}
    snap = snapshot(x, w, b)
    y, ctx = linear_forward(x, w, b)
    ref = np.einsum("bti,io->bto", x, w) + (b if bias else 0)
    np.testing.assert_allclose(y, ref, rtol=1e-13, atol=1e-13)

    def fwd(x, w, b=None):
        return linear_forward(x, w, b)

    def bwd(dy, ctx):
        dx, dw, db = linear_backward(dy, ctx)
        return {"x": dx, "w": dw, "b": db}

    check_gradients(fwd, inputs, bwd, tol=TOL)
    dx, dw, db = linear_backward(np.ones_like(y), ctx, need_dx=False)
    assert dx is None and (db is None) == (not bias)
    assert_unchanged(snap)


def test_linear_precisions(rng):
    x = rng.standard_normal((4, 6, 32))
    w = rng.standard_normal((32, 16)) / 6
    b = rng.standard_normal(16)
    dy = rng.standard_normal((4, 6, 16))
    y64, c64 = linear_forward(x, w, b)
    g64 = linear_backward(dy, c64)
    y32, c32 = linear_forward(*(a.astype(np.float32) for a in (x, w, b)))
    g32 = linear_backward(dy.astype(np.float32), c32)
    assert y32.dtype == np.float32 and all(g.dtype == np.float32 for g in g32)
    np.testing.assert_allclose(y32, y64, rtol=1e-4, atol=1e-5)
    for a, r in zip(g32, g64):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)
    xb, wb, bb, dyb = (a.astype(BF16) for a in (x, w, b, dy))
    snap = snapshot(xb, wb, bb, dyb)
    yb, cb = linear_forward(xb, wb, bb)
    gb = linear_backward(dyb, cb)
    assert yb.dtype == BF16 and all(g.dtype == BF16 for g in gb)
    # reference: the float32 op on the same (bf16-rounded) inputs
    yr, cr = linear_forward(*(a.astype(np.float32) for a in (xb, wb, bb)))
    gr = linear_backward(dyb.astype(np.float32), cr)
    np.testing.assert_allclose(yb.astype(np.float32), yr, rtol=1e-2, atol=1e-2)
    for a, r in zip(gb, gr):
        np.testing.assert_allclose(a.astype(np.float32), r, rtol=1e-2, atol=2e-2)
    assert_unchanged(snap)


# ---------------------------------------------------------------------------------------
# erf / GeLU
# ---------------------------------------------------------------------------------------
def test_erf_erfc_accuracy():
    x = np.concatenate([np.linspace(-9, 9, 4001), [0.0, 0.46875, -0.46875, 4.0, -4.0, 26.0, -26.0]])
    e = erf(x)
    c = erfc(x)
    re = np.array([math.erf(v) for v in x])
    rc = np.array([math.erfc(v) for v in x])
    assert np.max(np.abs(e - re) / np.maximum(np.abs(re), 1e-300)) < 2e-15
    assert np.max(np.abs(c - rc) / rc) < 2e-15  # relative, including the far tail
    assert erf(x.astype(np.float32)).dtype == np.float32
    np.testing.assert_allclose(erf(x.astype(np.float32)), re, atol=5e-7)
    special = erfc(np.array([np.inf, -np.inf, np.nan, 40.0]))
    assert special[0] == 0 and special[1] == 2 and np.isnan(special[2]) and special[3] == 0
    assert erf(np.float64(0.25)).shape == () and abs(erf(np.float64(0.25)) - math.erf(0.25)) < 1e-16
    assert ops.erf is erf and ops.erfc is erfc  # still exported by cutp.ops


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_forward_formula(rng, approximate, blocks):
    x = np.concatenate([rng.standard_normal(200) * 3, [-12.0, -7.0, 0.0, 7.0]])
    snap = snapshot(x)
    y, ctx = gelu_forward(x, approximate=approximate)
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        ref = 0.5 * x * (1 + np.tanh(k * (x + 0.044715 * x ** 3)))
    else:
        ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(y, ref, rtol=1e-14, atol=1e-15)
    assert ctx.x is x  # saves its input only
    assert_unchanged(snap)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_grad(rng, approximate, blocks):
    x = rng.standard_normal((3, 4, 5)) * 2

    def bwd(dy, ctx):
        return {"x": gelu_backward(dy, ctx)}

    check_gradients(lambda x: gelu_forward(x, approximate), {"x": x}, bwd, tol=TOL,
                    max_elements=None)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu(rng, approximate, blocks):
    x = rng.standard_normal((3, 4, 6)) * 2
    b = rng.standard_normal(6)
    snap = snapshot(x, b)
    y, ctx = bias_gelu_forward(x, b, approximate)
    np.testing.assert_allclose(y, gelu_forward(x + b, approximate)[0], rtol=1e-15, atol=1e-15)
    np.testing.assert_array_equal(ctx.x, x + b)

    def bwd(dy, ctx):
        dx, db = bias_gelu_backward(dy, ctx)
        return {"x": dx, "b": db}

    check_gradients(lambda x, b: bias_gelu_forward(x, b, approximate), {"x": x, "b": b}, bwd,
                    tol=TOL, max_elements=None)
    dy = rng.standard_normal(x.shape)
    dx, db = bias_gelu_backward(dy, ctx)
    np.testing.assert_allclose(db, dx.sum(axis=(0, 1)), rtol=1e-12)
    assert_unchanged(snap)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_precisions(rng, approximate, blocks):
    x = rng.standard_normal((8, 33)) * 2
    b = rng.standard_normal(33)
    dy = rng.standard_normal((8, 33))
    y64, c64 = gelu_forward(x, approximate)
    dx64 = gelu_backward(dy, c64)
    y32, c32 = gelu_forward(x.astype(np.float32), approximate)
    dx32 = gelu_backward(dy.astype(np.float32), c32)
    assert y32.dtype == dx32.dtype == np.float32
    np.testing.assert_allclose(y32, y64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx32, dx64, rtol=1e-5, atol=1e-6)
    xb, bb, dyb = x.astype(BF16), b.astype(BF16), dy.astype(BF16)
    snap = snapshot(xb, bb, dyb)
    yb, cb = gelu_forward(xb, approximate)
    dxb = gelu_backward(dyb, cb)
    assert yb.dtype == dxb.dtype == BF16
    yr, cr = gelu_forward(xb.astype(np.float32), approximate)
    np.testing.assert_allclose(yb.astype(np.float32), yr, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(dxb.astype(np.float32),
                               gelu_backward(dyb.astype(np.float32), cr), rtol=1e-2, atol=1e-2)
    ybg, cbg = bias_gelu_forward(xb, bb, approximate)
    dxbg, dbbg = bias_gelu_backward(dyb, cbg)
    assert ybg.dtype == dxbg.dtype == dbbg.dtype == cbg.x.dtype == BF16
    y32g, c32g = bias_gelu_forward(x.astype(np.float32), b.astype(np.float32), approximate)
    _, db32 = bias_gelu_backward(dy.astype(np.float32), c32g)
    np.testing.assert_allclose(ybg.astype(np.float32), y32g, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(dbbg.astype(np.float32), db32, rtol=3e-2, atol=6e-2)
    assert_unchanged(snap)


def test_gelu_bad_approximate():
    with pytest.raises(ValueError):
        gelu_forward(np.zeros(3), approximate="sigmoid")


# ---------------------------------------------------------------------------------------
# softmax
# ---------------------------------------------------------------------------------------
def _softmax_ref(x, scale, causal):
    s = f64(x) * scale
    tq, tk = x.shape[-2:]
    if causal:
        i = np.arange(tq)[:, None]
        j = np.arange(tk)[None, :]
        s = np.where(j > i + tk - tq, -np.inf, s)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("causal,tq,tk", [(False, 4, 6), (True, 5, 5), (True, 3, 7), (True, 1, 4)])
def test_softmax(rng, causal, tq, tk, blocks):
    x = rng.standard_normal((2, 3, tq, tk)) * 3
    scale = 0.7
    snap = snapshot(x)
    y, ctx = softmax_forward(x, scale=scale, causal=causal)
    ref = _softmax_ref(x, scale, causal)
    np.testing.assert_allclose(y, ref, rtol=1e-13, atol=1e-15)
    if causal:
        masked = np.arange(tk)[None, :] > np.arange(tq)[:, None] + tk - tq
        assert np.all(y[..., masked] == 0.0)  # exactly zero
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-14)

    def bwd(dy, ctx):
        return {"x": softmax_backward(dy, ctx)}

    check_gradients(lambda x: softmax_forward(x, scale, causal), {"x": x}, bwd, tol=TOL,
                    max_elements=None)
    dx = softmax_backward(rng.standard_normal(y.shape), ctx)
    if causal:
        assert np.all(dx[..., masked] == 0.0)
    assert_unchanged(snap)


def test_softmax_big_blocks(rng):
    # larger than one block: whole-matrix blocks and row-chunk blocks, vs the formula
    for shape in [(5, 40, 300), (2, 300, 300)]:
        x = rng.standard_normal(shape).astype(np.float32)
        y, ctx = softmax_forward(x, 0.3, causal=True)
        np.testing.assert_allclose(y, _softmax_ref(x, 0.3, True), rtol=2e-5, atol=1e-7)
        dy = rng.standard_normal(shape).astype(np.float32)
        dx = softmax_backward(dy, ctx)
        yr = _softmax_ref(x, 0.3, True)
        ref = 0.3 * yr * (dy - (dy * yr).sum(-1, keepdims=True))
        np.testing.assert_allclose(dx, ref, rtol=1e-4, atol=1e-6)


def test_softmax_in_place_equals_out_of_place(rng):
    """out=x (the scores' own buffer; scale 1 skips the scaling pass) and out= a separate array give
    the same bits as a new output, causal with Tq < Tk (the bias on the last Tq keys only)."""
    for scale in (1.0, 0.3):
        x = rng.standard_normal((3, 6, 11)).astype(np.float32)
        y, _ = softmax_forward(x, scale, causal=True)
        other = np.empty_like(x)
        assert softmax_forward(x, scale, causal=True, out=other)[0].base is other and np.array_equal(other, y)
        softmax_forward(x, scale, causal=True, out=x)
        assert np.array_equal(x, y) and np.all(x[:, 0, 7:] == 0) and np.all(x[:, 0, :6] > 0)
    with pytest.raises(ValueError, match="out must be"):
        softmax_forward(x, out=np.empty((3, 6, 11), np.float64))


def test_tanh_gelu_backward_from_the_kept_tanh_equals_recomputing_it(rng, monkeypatch):
    """The fused bias+GeLU keeps its tanh for the backward on the host; the backward from it and
    the backward recomputing it (a ctx without it) agree to the bit, in float32 and float64 (the
    NumPy path's property: the compiled kernels, whose tanh is their own, are off here;
    tests/ops/test_cpu_kernels.py compares them with this path)."""
    monkeypatch.setenv("CUTP_CPU_KERNELS", "0")
    for dtype in (np.float32, np.float64):
        x, b = (rng.standard_normal(s).astype(dtype) * 2 for s in ((300, 40), (40,)))
        dy = rng.standard_normal((300, 40)).astype(dtype)
        _, ctx = bias_gelu_forward(x, b, "tanh")
        assert ctx.tanh is not None and ctx.tanh.shape == x.shape
        kept = bias_gelu_backward(dy, ctx)
        again = bias_gelu_backward(dy, GeluCtx(ctx.x, "tanh"))
        assert all(np.array_equal(a, c) and a.dtype == dtype for a, c in zip(kept, again))
        assert np.array_equal(bias_gelu_backward(dy, ctx)[0], kept[0])  # the kept tanh is not consumed


def test_softmax_precisions_and_errors(rng):
    x = rng.standard_normal((2, 5, 7)) * 4
    dy = rng.standard_normal(x.shape)
    y64, c64 = softmax_forward(x, 0.5, True)
    dx64 = softmax_backward(dy, c64)
    y32, c32 = softmax_forward(x.astype(np.float32), np.float64(0.5), True)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, y64, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(softmax_backward(dy.astype(np.float32), c32), dx64, rtol=1e-4, atol=1e-6)
    xb, dyb = x.astype(BF16), dy.astype(BF16)
    snap = snapshot(xb, dyb)
    yb, cb = softmax_forward(xb, 0.5, True)
    dxb = softmax_backward(dyb, cb)
    assert yb.dtype == dxb.dtype == BF16
    yr, cr = softmax_forward(xb.astype(np.float32), 0.5, True)
    np.testing.assert_allclose(yb.astype(np.float32), yr, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(dxb.astype(np.float32),
                               softmax_backward(dyb.astype(np.float32), cr), rtol=2e-2, atol=1e-2)
    assert_unchanged(snap)
    with pytest.raises(ValueError):
        softmax_forward(np.zeros((4, 3)), causal=True)  # Tq > Tk
    # stability: huge logits
    big = np.array([[1000.0, 1001.0, 999.0]])
    np.testing.assert_allclose(softmax_forward(big)[0], _softmax_ref(big, 1.0, False), rtol=1e-14)


# ---------------------------------------------------------------------------------------
# layernorm
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("affine", ["both", "none", "weight", "bias"])
def test_layernorm(rng, affine, blocks):
    x = rng.standard_normal((2, 3, 7)) * 2 + 0.5
    w = rng.standard_normal(7) if affine in ("both", "weight") else None
    b = rng.standard_normal(7) if affine in ("both", "bias") else None
    snap = snapshot(x, w, b)
    y, ctx = layernorm_forward(x, w, b, eps=1e-5)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    ref = (x - mu) / np.sqrt(var + 1e-5)
    if w is not None:
        ref = ref * w
    if b is not None:
        ref = ref + b
    np.testing.assert_allclose(y, ref, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(ctx.mean, mu[..., 0], rtol=1e-14)
    np.testing.assert_allclose(ctx.rstd, 1 / np.sqrt(var[..., 0] + 1e-5), rtol=1e-14)
    assert ctx.mean.shape == ctx.rstd.shape == (2, 3)

    inputs = {"x": x}
    if w is not None:
        inputs["weight"] = w
    if b is not None:
        inputs["bias"] = b

    def fwd(x, weight=None, bias=None):
        return layernorm_forward(x, weight, bias)

    def bwd(dy, ctx):
        dx, dw, db = layernorm_backward(dy, ctx)
        assert (dw is None) == (w is None) and (db is None) == (b is None)
        return {"x": dx, "weight": dw, "bias": db}

    check_gradients(fwd, inputs, bwd, tol=TOL, max_elements=None)
    assert_unchanged(snap)


def test_layernorm_precisions(rng, blocks):
    x = rng.standard_normal((4, 5, 48)) * 3 + 1
    w = 1 + 0.1 * rng.standard_normal(48)
    b = 0.1 * rng.standard_normal(48)
    dy = rng.standard_normal(x.shape)
    y64, c64 = layernorm_forward(x, w, b)
    g64 = layernorm_backward(dy, c64)
    y32, c32 = layernorm_forward(*(a.astype(np.float32) for a in (x, w, b)))
    g32 = layernorm_backward(dy.astype(np.float32), c32)
    assert y32.dtype == c32.mean.dtype == c32.rstd.dtype == np.float32
    np.testing.assert_allclose(y32, y64, rtol=1e-4, atol=1e-5)
    for a, r in zip(g32, g64):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)
    xb, wb, bb, dyb = (a.astype(BF16) for a in (x, w, b, dy))
    snap = snapshot(xb, wb, bb, dyb)
    yb, cb = layernorm_forward(xb, wb, bb)
    gb = layernorm_backward(dyb, cb)
    assert yb.dtype == BF16 and cb.mean.dtype == cb.rstd.dtype == np.float32
    assert all(g.dtype == BF16 for g in gb)
    yr, cr = layernorm_forward(*(a.astype(np.float32) for a in (xb, wb, bb)))
    gr = layernorm_backward(dyb.astype(np.float32), cr)
    np.testing.assert_allclose(yb.astype(np.float32), yr, rtol=1e-2, atol=2e-2)
    np.testing.assert_allclose(cb.mean, cr.mean, rtol=1e-6)
    for a, r in zip(gb, gr):
        np.testing.assert_allclose(a.astype(np.float32), r, rtol=1e-2, atol=5e-2)
    assert_unchanged(snap)


# ---------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------
def test_dropout_hash_matches_python_reference(blocks):
    cases = [(0, 0), (1, 0), (12345, 678), (2**64 - 1, 2**64 - 3), (0xDEADBEEF, 2**40)]
    for seed, offset in cases:
        z = random_bits(np, 5, seed, offset)
        ref = [splitmix64_reference(seed, offset + i) for i in range(5)]
        assert z.tolist() == ref
    # SplitMix64 with seed 0: first output is the well-known 0xE220A8397B1DCDAF
    assert splitmix64_reference(0, 0) == 0xE220A8397B1DCDAF
    # the mask is exactly "top 24 bits >= ceil(p * 2^24)"
    p = 0.3
    m = dropout_mask(np, (4, 25), p, 99, 1000)
    z = np.array([splitmix64_reference(99, 1000 + i) for i in range(100)], dtype=np.uint64)
    u = (z >> np.uint64(40)).astype(np.float64) / 2**24
    np.testing.assert_array_equal(m.reshape(-1), u >= p)
    assert keep_threshold(0.0) == 0 and keep_threshold(1.0) == 2**24
    assert keep_threshold(0.5) == 2**23 and keep_threshold(0.1) == math.ceil(0.1 * 2**24)


def test_dropout_mask_properties():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no uint64 overflow warnings
        n = 200_000
        for p in (0.1, 0.5, 0.9):
            keep = dropout_mask(np, (n,), p, seed=7, offset=0)
            assert keep.dtype == bool
            sd = math.sqrt(p * (1 - p) / n)
            assert abs(keep.mean() - (1 - p)) < 6 * sd
        a = dropout_mask(np, (64, 50), 0.3, seed=3, offset=10)
        b = dropout_mask(np, (64, 50), 0.3, seed=3, offset=10)
        np.testing.assert_array_equal(a, b)  # deterministic
        c = dropout_mask(np, (64, 50), 0.3, seed=3, offset=10 + 64 * 50)
        d = dropout_mask(np, (64, 50), 0.3, seed=4, offset=10)
        assert (a != c).mean() > 0.3 and (a != d).mean() > 0.3
        # counter-based: a shifted offset is a shifted stream
        e = dropout_mask(np, (64 * 50,), 0.3, seed=3, offset=10 + 17)
        np.testing.assert_array_equal(a.reshape(-1)[17:], e[:-17])
        # consecutive elements are not correlated
        k = dropout_mask(np, (n,), 0.5, seed=11, offset=5).astype(np.float64)
        assert abs(np.corrcoef(k[1:], k[:-1])[0, 1]) < 0.02
        # seed and offset are taken modulo 2**64
        np.testing.assert_array_equal(dropout_mask(np, (9,), 0.5, seed=2**70 + 3, offset=-1),
                                      dropout_mask(np, (9,), 0.5, seed=3, offset=2**64 - 1))


def test_dropout_forward_backward(rng, blocks):
    x = rng.standard_normal((4, 5, 6))
    p, seed, off = 0.25, 42, 123
    snap = snapshot(x)
    y, ctx = dropout_forward(x, p, seed, off)
    mask = dropout_mask(np, x.shape, p, seed, off)
    np.testing.assert_array_equal(y, np.where(mask, x * (1 / (1 - p)), 0.0))
    dy = rng.standard_normal(x.shape)
    np.testing.assert_array_equal(dropout_backward(dy, ctx), np.where(mask, dy * (1 / (1 - p)), 0.0))

    def bwd(dy, ctx):
        return {"x": dropout_backward(dy, ctx)}

    check_gradients(lambda x: dropout_forward(x, p, seed, off), {"x": x}, bwd, tol=TOL,
                    max_elements=None)
    # p == 0: identity, nothing generated
    y0, c0 = dropout_forward(x, 0.0, seed, off)
    assert y0 is x and c0.mask is None and dropout_backward(dy, c0) is dy
    y1, c1 = dropout_forward(x, 1.0, seed, off)
    assert np.all(y1 == 0) and np.all(dropout_backward(dy, c1) == 0)
    with pytest.raises(ValueError):
        dropout_forward(x, 1.5, seed, off)
    # float32 / bf16 use the same mask
    y32, _ = dropout_forward(x.astype(np.float32), p, seed, off)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, y, rtol=1e-6)
    xb = x.astype(BF16)
    yb, cb = dropout_forward(xb, p, seed, off)
    assert yb.dtype == BF16 and dropout_backward(dy.astype(BF16), cb).dtype == BF16
    np.testing.assert_array_equal(yb.astype(np.float32) != 0, mask & (xb.astype(np.float32) != 0))
    np.testing.assert_allclose(yb.astype(np.float32), y, rtol=1e-2, atol=1e-2)
    assert_unchanged(snap)


# ---------------------------------------------------------------------------------------
# embedding
# ---------------------------------------------------------------------------------------
def _embedding_bwd_ref(dy, ids, mask, V):
    out = np.zeros((V, dy.shape[-1]))
    keep = np.ones(ids.shape, bool) if mask is None else mask
    np.add.at(out, ids[keep], f64(dy)[keep])
    return out


@pytest.mark.parametrize("with_mask", [False, True])
def test_embedding(rng, with_mask):
    V, h = 11, 4
    ids = rng.integers(0, V, size=(3, 6))
    ids[0, :4] = 2  # repeated ids
    ids[2, 5] = 2
    mask = rng.random(ids.shape) < 0.7 if with_mask else None
    if with_mask:
        mask[0, 0] = False  # a masked occurrence of a repeated id
    table = rng.standard_normal((V, h))
    snap = snapshot(ids, table, mask)
    y, ctx = embedding_forward(ids, table, mask)
    ref = table[ids]
    if with_mask:
        ref[~mask] = 0
    np.testing.assert_array_equal(y, ref)

    def fwd(table):
        return embedding_forward(ids, table, mask)

    def bwd(dy, ctx):
        return {"table": embedding_backward(dy, ctx, np.zeros((V, h)))}

    check_gradients(fwd, {"table": table}, bwd, tol=TOL, max_elements=None)
    dy = rng.standard_normal(y.shape)
    base = rng.standard_normal((V, h))
    out = base.copy()
    res = embedding_backward(dy, ctx, out)
    assert res is out  # accumulated in place
    np.testing.assert_allclose(out, base + _embedding_bwd_ref(dy, ids, mask, V), rtol=1e-13, atol=1e-13)
    assert_unchanged(snap)


@pytest.mark.parametrize("pattern", ["distinct", "same", "zipf", "all_masked"])
def test_embedding_backward_patterns(rng, pattern):
    V, h, n = 300, 8, 257
    mask = None
    if pattern == "distinct":
        ids = rng.permutation(V)[:n]
    elif pattern == "same":
        ids = np.full(n, 5)
    else:
        ids = np.minimum(rng.zipf(1.3, n), V) - 1
    if pattern == "all_masked":
        mask = np.zeros(n, bool)
    ids = ids.reshape(1, n)
    mask = None if mask is None else mask.reshape(1, n)
    dy = rng.standard_normal((1, n, h))
    _, ctx = embedding_forward(ids, np.zeros((V, h)), mask)
    out = embedding_backward(dy, ctx, np.zeros((V, h)))
    np.testing.assert_allclose(out, _embedding_bwd_ref(dy, ids, mask, V), rtol=1e-12, atol=1e-12)
    # float32 and bfloat16 gradients (accumulated in float32)
    out32 = embedding_backward(dy.astype(np.float32), ctx, np.zeros((V, h), np.float32))
    np.testing.assert_allclose(out32, out, rtol=1e-5, atol=1e-4)
    dyb = dy.astype(BF16)
    ref_b = _embedding_bwd_ref(dyb.astype(np.float32), ids, mask, V)
    outb32 = embedding_backward(dyb, ctx, np.zeros((V, h), np.float32))
    np.testing.assert_allclose(outb32, ref_b, rtol=1e-5, atol=1e-4)
    outb = embedding_backward(dyb, ctx, np.zeros((V, h), BF16))
    assert outb.dtype == BF16
    np.testing.assert_allclose(outb.astype(np.float32), ref_b, rtol=1e-2, atol=1e-2)


def test_embedding_bf16_forward(rng):
    table = rng.standard_normal((9, 3)).astype(BF16)
    ids = np.array([[1, 8, 1]])
    y, _ = embedding_forward(ids, table, np.array([[True, False, True]]))
    assert y.dtype == BF16
    np.testing.assert_array_equal(y[0, 0], table[1])
    assert np.all(y[0, 1].astype(np.float32) == 0)


# ---------------------------------------------------------------------------------------
# cross-entropy
# ---------------------------------------------------------------------------------------
def _ce_ref(logits, targets, ignore_index, eps, nc, reduction):
    L = f64(logits).reshape(-1, logits.shape[-1])[:, :nc]
    t = targets.reshape(-1)
    logp = L - L.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    valid = t != ignore_index
    tt = np.where(valid, t, 0)
    nll = -logp[np.arange(len(t)), tt]
    smooth = -logp.mean(1)
    loss = np.where(valid, (1 - eps) * nll + eps * smooth, 0.0)
    if reduction == "none":
        return loss.reshape(targets.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / max(valid.sum(), 1)


CE_CASES = [
    # (reduction, eps, n_classes or None, with ignored rows)
    ("mean", 0.0, None, False),
    ("mean", 0.0, None, True),
    ("mean", 0.1, None, True),
    ("mean", 0.2, 7, True),
    ("sum", 0.0, 7, False),
    ("sum", 0.3, None, True),
    ("none", 0.0, 8, True),
    ("none", 0.15, 6, True),
]


@pytest.mark.parametrize("reduction,eps,nc,ignore", CE_CASES)
def test_cross_entropy(rng, reduction, eps, nc, ignore, blocks):
    N, V = 10, 9
    ncl = V if nc is None else nc
    logits = rng.standard_normal((2, N // 2, V)) * 2
    targets = rng.integers(0, ncl, size=(2, N // 2))
    if ignore:
        targets[0, 1] = -100
        targets[1, 3] = -100
    snap = snapshot(logits, targets)
    loss, ctx = cross_entropy_forward(logits, targets, label_smoothing=eps, n_classes=nc,
                                      reduction=reduction)
    ref = _ce_ref(logits, targets, -100, eps, ncl, reduction)
    assert loss.dtype == np.float64 and np.shape(loss) == np.shape(ref)
    np.testing.assert_allclose(loss, ref, rtol=1e-13, atol=1e-14)

    def fwd(logits):
        return cross_entropy_forward(logits, targets, label_smoothing=eps, n_classes=nc,
                                     reduction=reduction)

    def bwd(dloss, ctx):
        return {"logits": cross_entropy_backward(dloss, ctx)}

    check_gradients(fwd, {"logits": logits}, bwd, tol=TOL, max_elements=None)
    dloss = rng.standard_normal(targets.shape) if reduction == "none" else 1.7
    d = cross_entropy_backward(dloss, ctx)
    assert d.shape == logits.shape and d.dtype == logits.dtype
    if ncl < V:
        assert np.all(d[..., ncl:] == 0.0)  # padded classes: exactly zero
    if ignore:
        assert np.all(d[0, 1] == 0.0) and np.all(d[1, 3] == 0.0)
    # in place into the logits gives the same
    lcopy = logits.copy()
    _, ctx2 = cross_entropy_forward(lcopy, targets, label_smoothing=eps, n_classes=nc,
                                    reduction=reduction)
    d2 = cross_entropy_backward(dloss, ctx2, out=lcopy)
    assert d2 is lcopy
    np.testing.assert_allclose(d2, d, rtol=1e-15, atol=1e-16)
    assert_unchanged(snap)


def test_cross_entropy_edge_cases(rng):
    logits = rng.standard_normal((4, 5))
    t = np.full(4, -1)
    loss, ctx = cross_entropy_forward(logits, t, ignore_index=-1)
    assert float(loss) == 0.0
    assert np.all(cross_entropy_backward(1.0, ctx) == 0.0)
    with pytest.raises(ValueError):
        cross_entropy_forward(logits, np.array([0, 1, 5, 2]))
    with pytest.raises(ValueError):
        cross_entropy_forward(logits, np.array([0, 1, 4, 2]), n_classes=4)  # 4 is padding
    # out of another dtype than the logits: logits untouched
    t = np.array([0, 1, 2, 3])
    loss, ctx = cross_entropy_forward(logits, t)
    snap = snapshot(logits)
    d32 = cross_entropy_backward(1.0, ctx, out=np.empty(logits.shape, np.float32))
    assert_unchanged(snap)
    np.testing.assert_allclose(d32, cross_entropy_backward(1.0, ctx), rtol=1e-6, atol=1e-7)
    # stability with huge logits, and a custom ignore_index
    big = np.array([[1000.0, 0.0, -1000.0], [5.0, 5.0, 5.0]])
    l, _ = cross_entropy_forward(big, np.array([1, 7]), ignore_index=7, reduction="none")
    np.testing.assert_allclose(l, [1000.0, 0.0], rtol=1e-14)


def test_cross_entropy_precisions(rng, blocks):
    N, V, nc = 12, 40, 37
    logits = rng.standard_normal((N, V)) * 3
    t = rng.integers(0, nc, N)
    t[3] = -100
    l64, c64 = cross_entropy_forward(logits, t, label_smoothing=0.1, n_classes=nc)
    d64 = cross_entropy_backward(1.0, c64)
    l32, c32 = cross_entropy_forward(logits.astype(np.float32), t, label_smoothing=0.1, n_classes=nc)
    d32 = cross_entropy_backward(np.float32(1.0), c32)
    assert l32.dtype == np.float32 and d32.dtype == np.float32
    np.testing.assert_allclose(l32, l64, rtol=1e-6)
    np.testing.assert_allclose(d32, d64, rtol=1e-5, atol=1e-7)
    lb = logits.astype(BF16)
    snap = snapshot(lb, t)
    lossb, cb = cross_entropy_forward(lb, t, label_smoothing=0.1, n_classes=nc)
    db = cross_entropy_backward(1.0, cb)
    assert lossb.dtype == np.float32 and db.dtype == BF16 and cb.row_max.dtype == np.float32
    lr, cr = cross_entropy_forward(lb.astype(np.float32), t, label_smoothing=0.1, n_classes=nc)
    np.testing.assert_allclose(lossb, lr, rtol=1e-6)
    np.testing.assert_allclose(db.astype(np.float32), cross_entropy_backward(1.0, cr), rtol=1e-2, atol=1e-4)
    assert_unchanged(snap)
    # bf16 in place
    lb2 = lb.copy()
    _, cb2 = cross_entropy_forward(lb2, t, label_smoothing=0.1, n_classes=nc)
    np.testing.assert_array_equal(cross_entropy_backward(1.0, cb2, out=lb2), db)


def _shard_bounds(V, n_shards):
    w = -(-V // n_shards)
    return [(k * w, min((k + 1) * w, V)) for k in range(n_shards)]


@pytest.mark.parametrize("n_shards", [1, 2, 3])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, BF16])
def test_vocab_parallel_pieces(rng, n_shards, eps, dtype, blocks):
    # 12 columns, 7 real classes: with 3 shards of 4 the last shard is all padding
    N, V, nc = 9, 12, 7
    logits = (rng.standard_normal((N, V)) * 2).astype(dtype)
    t = rng.integers(0, nc, N)
    t[[2, 6]] = -100
    cdt = np.float64 if dtype == np.float64 else np.float32
    loss_ref, ctx = cross_entropy_forward(logits, t, label_smoothing=eps, n_classes=nc)
    dref = cross_entropy_backward(1.0, ctx)
    valid = t != -100
    shards = []
    for lo, hi in _shard_bounds(V, n_shards):
        n_valid = int(np.clip(nc - lo, 0, hi - lo))
        lt = np.where(valid & (t >= lo) & (t < lo + n_valid), t - lo, -1)
        shards.append((logits[:, lo:hi].copy(), n_valid, lt))
    stats = [ce_shard_forward(L, lt, nv) for L, nv, lt in shards]  # one pass per shard
    for (m, se, _, _), (L, nv, _) in zip(stats, shards):
        assert m.dtype == cdt and se.dtype == cdt
        if nv == 0:  # a shard of padding only: (-inf, 0), which the merge turns into 0, not NaN
            assert np.all(m == -np.inf) and np.all(se == 0)
        else:  # the shard's own max, and its sum of exps relative to it
            np.testing.assert_array_equal(m, L[:, :nv].max(axis=1).astype(cdt))
            assert np.all(se >= 1)
    gmax = np.max([st[0] for st in stats], axis=0)
    s = sum(ce_rescale_sum(st[0], st[1], gmax) for st in stats)
    assert np.all(np.isfinite(s))
    tl = sum(st[2] for st in stats)
    z = sum(st[3] for st in stats)
    lse = gmax + np.log(s)
    li = np.where(valid, (1 - eps) * (lse - tl) + eps * (lse - z / nc), 0.0)
    loss = li.sum() / valid.sum()
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-12 if dtype == np.float64 else 1e-5)
    row_scale = valid / valid.sum()
    parts = []
    for L, nv, lt in shards:
        snap = snapshot(L, gmax, s, lt)
        d = ce_shard_backward(L, gmax, s, lt, nv, row_scale, eps, nc)
        assert d.dtype == L.dtype
        assert_unchanged(snap)
        d_inplace = ce_shard_backward(L, gmax, s, lt, nv, row_scale, eps, nc, out=L)
        assert d_inplace is L
        np.testing.assert_array_equal(d_inplace, d)
        parts.append(d)
    got = np.concatenate(parts, axis=1)
    if dtype == np.float64:
        np.testing.assert_allclose(got, dref, rtol=1e-13, atol=1e-15)
    else:
        np.testing.assert_allclose(got.astype(np.float32), dref.astype(np.float32), rtol=1e-2, atol=1e-3)
    assert np.all(got[:, nc:] == 0) and np.all(got[~valid] == 0)


def test_embedding_backward_float64_out_keeps_precision(rng):
    ids = np.array([[3, 3, 1]])
    _, ctx = embedding_forward(ids, np.zeros((5, 2)))
    out = np.full((5, 2), 1e8)
    dy = np.full((1, 3, 2), 1.0 + 2.0 ** -20, dtype=np.float32)
    embedding_backward(dy, ctx, out)
    np.testing.assert_array_equal(out[3], 1e8 + 2 * (1.0 + 2.0 ** -20))
