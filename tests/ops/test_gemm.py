"""cutp.ops.gemm: what the linear layers, the LM head and the bias gradients hand cuBLAS, checked
without a GPU by a fake of CuPy's binding that computes from the raw pointers, leading dimensions
and enums (tests/ops/cublas_fake.py), against the CPU's upcast-and-round path; and that each
mistake in those arguments (a transposed operand, a wrong leading dimension, a compute type
without float32 accumulation for 16-bit operands, beta 0 where the main_grad accumulates) fails."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cutp import ops
from cutp.kernels import use_kernels
from tests.ops import cublas_fake as fake
from tests.ops.cublas_fake import CublasContractError, FakeCublas, device, host

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
# rows, in, out: no two equal, so a transposed operand or a swapped dimension cannot pass unseen
ROWS, N_IN, N_OUT, VOCAB = (3, 5), 24, 40, 56


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(ROWS + (N_IN,)).astype(dtype)
    w = (0.2 * rng.standard_normal((N_IN, N_OUT))).astype(dtype)
    b = rng.standard_normal(N_OUT).astype(dtype)
    dy = rng.standard_normal(ROWS + (N_OUT,)).astype(dtype)
    main_grad = rng.standard_normal((N_IN, N_OUT)).astype(F32)  # earlier micro-batches' sum: must be kept
    table = (0.2 * rng.standard_normal((VOCAB, N_IN))).astype(dtype)
    dlogits = rng.standard_normal((np.prod(ROWS), VOCAB)).astype(dtype)
    return x, w, b, dy, main_grad, table, dlogits


def _close(got, want, dtype, what):
    got, want = host(got).astype(np.float64), np.asarray(want).astype(np.float64)
    rtol = 1e-5 if dtype == F32 else 2 ** -7  # 16-bit outputs: one rounding apart at most
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5 * max(1.0, np.abs(want).max()), err_msg=what)


def _step(dtype, bias=True):
    """A linear layer's forward and backward (its weight gradient into a float32 main_grad), the
    tied LM head's three products and a row layer's bias gradient into its main_grad, on fake
    device arrays through cuBLAS and on NumPy: every result compared."""
    x, w, b, dy, main_grad, table, dlogits = _inputs(dtype)
    y, ctx = ops.linear_forward(x, w, b if bias else None)
    yd, ctxd = ops.linear_forward(device(x), device(w), device(b) if bias else None)
    _close(yd, y, dtype, "linear forward")
    g, gd = main_grad.copy(), device(main_grad)
    dx, _, db = ops.linear_backward(dy, ctx, wgrad_out=g)
    dxd, dwd, dbd = ops.linear_backward(device(dy), ctxd, wgrad_out=gd)
    assert dwd is gd
    _close(gd, g, F32, "weight gradient accumulated into main_grad")
    _close(dxd, dx, dtype, "dx")
    if bias:
        _close(dbd, db, dtype, "bias gradient")
    # the LM head: logits = x2 @ E^T, E.grad += d^T @ x2, dx = d @ E
    x2 = x.reshape(-1, N_IN)
    logits = ops.gemm(ops.gemm_operand(x2), ops.gemm_operand(table), trans_b=True, out_dtype=dtype)
    logits_d = ops.gemm(device(x2), device(table), trans_b=True, out_dtype=dtype)
    _close(logits_d, logits, dtype, "logits")
    eg, egd = np.ones((VOCAB, N_IN), F32), device(np.ones((VOCAB, N_IN), F32))
    ops.gemm(ops.gemm_operand(dlogits), ops.gemm_operand(x2), trans_a=True, out=eg, accumulate=True)
    ops.gemm(device(dlogits), device(x2), trans_a=True, out=egd, accumulate=True)
    _close(egd, eg, F32, "table gradient")
    hx = ops.gemm(ops.gemm_operand(dlogits), ops.gemm_operand(table), out_dtype=dtype)
    _close(ops.gemm(device(dlogits), device(table), out_dtype=dtype), hx, dtype, "LM head dx")
    bg, bgd = np.full(N_OUT, 0.5, F32), device(np.full(N_OUT, 0.5, F32))
    bg += ops.gemm_operand(dy.reshape(-1, N_OUT)).sum(axis=0)
    ops.column_sums(device(dy.reshape(-1, N_OUT)), out=bgd)
    _close(bgd, bg, F32, "row bias gradient into main_grad")


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_the_gpu_path_hands_cublas_what_computes_the_cpus_results(monkeypatch, dtype):
    cublas = FakeCublas()
    fake.install(monkeypatch, cublas)
    _step(dtype)
    calls = cublas.calls
    assert len(calls) == 8  # forward, dW, dx, logits, dE, dx, two bias sums: all on cuBLAS
    want_type = {BF16: fake.R_16BF, F16: fake.R_16F, F32: fake.R_32F}[dtype]
    assert {c["Atype"] for c in calls} == {c["Btype"] for c in calls} == {want_type}  # no float32 copies
    assert all(c["computeType"] == fake.COMPUTE_32F and c["alpha"] == 1.0 for c in calls)
    wgrads = [c for c in calls if c["beta"] == 1.0]
    assert len(wgrads) == 3 and all(c["Ctype"] == fake.R_32F for c in wgrads)  # into the fp32 main_grads
    assert [c["beta"] for c in calls].count(0.0) == 5


def test_the_forward_reads_the_callers_arrays_and_writes_one_output(monkeypatch):
    """No copy of x or W: cuBLAS reads their own buffers (b, then a: the row-major product as its
    transpose), and writes the 16-bit result straight into y."""
    cublas = FakeCublas()
    fake.install(monkeypatch, cublas)
    x, w = device(_inputs(BF16)[0]), device(_inputs(BF16)[1])
    y, _ = ops.linear_forward(x, w)
    (call,) = cublas.calls
    assert (call["B"], call["A"], call["C"]) == (x.data.ptr, w.data.ptr, y.data.ptr)
    assert (call["m"], call["n"], call["k"], call["lda"], call["ldb"], call["ldc"]) == (N_OUT, 15, N_IN, N_OUT, N_IN,
                                                                                      N_OUT)
    assert call["Ctype"] == fake.R_16BF and y.dtype == BF16


def test_tf32_only_when_allowed_and_only_for_float32(monkeypatch):
    x, w = _inputs(F32)[:2]
    fake.install(monkeypatch, FakeCublas(tf32=False))
    ops.linear_forward(device(x), device(w))
    monkeypatch.setattr(fake.GEMM, "_tf32", True)
    with pytest.raises(CublasContractError, match="TF32 allowed: False"):
        ops.linear_forward(device(x), device(w))
    cublas = FakeCublas(tf32=True)
    fake.install(monkeypatch, cublas)
    ops.linear_forward(device(x), device(w))
    ops.linear_forward(device(x.astype(BF16)), device(w.astype(BF16)))  # 16-bit: float32 accumulation still
    assert [c["computeType"] for c in cublas.calls] == [fake.COMPUTE_32F_FAST_TF32, fake.COMPUTE_32F]


def test_without_kernels_the_gpu_runs_the_upcast_composition(monkeypatch):
    cublas = FakeCublas()
    fake.install(monkeypatch, cublas)
    x, w = _inputs(BF16)[:2]
    with use_kernels(False):
        y, _ = ops.linear_forward(device(x), device(w))
    assert cublas.calls == [] and y.dtype == BF16
    _close(y, ops.linear_forward(x, w)[0], BF16, "reference composition")


def _flip(index):
    def change(args):
        args[index] = 1 - args[index]
    return change


def _plus_one(index):
    def change(args):
        args[index] += 1
    return change


def _compute_16f(args):
    args[17] = fake.COMPUTE_16F


_ZERO = np.zeros((), np.float32)


def _beta_zero(args):
    args[13] = _ZERO.ctypes.data


# gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, ...)
PLANTED = {
    "transposed first operand": _flip(1),
    "transposed second operand": _flip(2),
    "wrong lda": _plus_one(9),
    "wrong ldb": _plus_one(12),
    "16-bit compute type": _compute_16f,
    "beta 0 into the main_grad": _beta_zero,
}


@pytest.mark.parametrize("mistake", list(PLANTED))
def test_each_planted_mistake_in_the_gemm_arguments_fails(monkeypatch, mistake):
    fake.install(monkeypatch, fake.planted(FakeCublas(), PLANTED[mistake]))
    with pytest.raises(AssertionError):  # a CublasContractError, or results that differ from the CPU's
        _step(BF16)


def test_gemm_refuses_mismatched_shapes_and_a_missing_accumulator():
    a, b = np.ones((3, 4), F32), np.ones((5, 4), F32)
    with pytest.raises(ValueError, match="op\\(a\\) is 3 x 4, op\\(b\\) is 5 x 4"):
        ops.gemm(a, b)
    with pytest.raises(ValueError, match="give it"):
        ops.gemm(a, b, trans_b=True, accumulate=True)
    out = np.zeros((3, 5), F32)
    assert ops.gemm(a, b, trans_b=True, out=out, accumulate=True) is out and (out == 4).all()


@pytest.mark.parametrize("dtype,out_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)], ids=str)
def test_the_cpu_path_writes_a_given_out_as_it_returns_a_new_one(dtype, out_dtype):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)).astype(dtype), rng.standard_normal((5, 4)).astype(dtype)
    out = np.full((3, 5), 7.0, out_dtype)  # (overwritten, not added to)
    assert ops.gemm(a, b, trans_b=True, out=out) is out
    assert np.array_equal(out, ops.gemm(a, b, trans_b=True, out_dtype=out_dtype))


@pytest.mark.parametrize("dtype", [BF16, F16, F32, np.dtype(np.float64)], ids=str)
def test_the_cpu_path_computes_bit_for_bit_what_the_upcast_code_did(dtype):
    """The formulas the ops had before cutp.ops.gemm (float32 copies, one matmul, one rounding;
    the weight gradient rounded to the buffer's dtype, then added), written out: equal bits."""
    x, w, b, dy, main_grad, table, dlogits = _inputs(dtype)
    cdt = ops.gemm_operand(x).dtype
    up = lambda a: a.astype(cdt)  # noqa: E731
    x2, dy2 = x.reshape(-1, N_IN), dy.reshape(-1, N_OUT)
    for bias in (None, b):
        y, ctx = ops.linear_forward(x, w, bias)
        old = up(x2) @ up(w)
        if bias is not None:
            old += up(bias)
        assert np.array_equal(y.reshape(-1, N_OUT), old.astype(dtype))
    g = main_grad.astype(np.float64) if dtype == np.float64 else main_grad.copy()
    want = g + (up(x2).T @ up(dy2)).astype(g.dtype)
    dx, dw, db = ops.linear_backward(dy, ctx, wgrad_out=g)
    assert dw is g and np.array_equal(g, want)
    assert np.array_equal(dx.reshape(-1, N_IN), (up(dy2) @ up(w).T).astype(dtype))
    assert np.array_equal(db, (np.ones(dy2.shape[0], cdt) @ up(dy2)).astype(dtype))
    logits = ops.gemm(ops.gemm_operand(x2), ops.gemm_operand(table), trans_b=True, out_dtype=dtype)
    assert np.array_equal(logits, (up(x2) @ up(table).T).astype(dtype))


def test_a_transposed_square_operand_reads_inside_its_buffer_and_fails_on_the_values(monkeypatch):
    """Square operands: a flipped transpose stays in bounds; the product's values catch it."""
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((32, 32)).astype(BF16) for _ in range(2))
    want = ops.gemm(ops.gemm_operand(a), ops.gemm_operand(b), out_dtype=BF16)
    fake.install(monkeypatch, FakeCublas())
    _close(ops.gemm(device(a), device(b), out_dtype=BF16), want, BF16, "square product")
    for index in (1, 2):
        fake.install(monkeypatch, fake.planted(FakeCublas(), _flip(index)))
        with pytest.raises(AssertionError, match="Not equal to tolerance"):
            _close(ops.gemm(device(a), device(b), out_dtype=BF16), want, BF16, "square product")
