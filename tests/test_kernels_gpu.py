"""cutp's CUDA kernels on a real GPU (CuPy + NVRTC): each kernel against the NumPy reference,
the kernel path of each op against its CuPy reference path, int64 offsets at a realistic size,
determinism, and one GPT training step against the CPU float64 step.

Skipped without a GPU; the same kernels and the same host launchers run on the CPU under the
CUDA emulation in tests/test_kernels_emulated.py (every CI run). `make gpu-check` runs this file
on a lent GPU machine.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cutp import kernels as cuda_kernels, ops
from cutp.runtime import backend

SKIP_REASON = ("needs an NVIDIA GPU and CuPy; the same kernels run on the CPU under tests/cuda_emu in "
               "test_kernels_emulated.py")
HAVE_GPU = backend.cuda_device_count() > 0
pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=SKIP_REASON)

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def _bf16_on_gpu() -> bool:
    if not HAVE_GPU:
        return False
    import cupy

    try:
        return bool((cupy.asarray(np.ones(3, BF16)) * 2).get().astype(np.float32).sum() == 6)
    except Exception:
        return False


DTYPES = [F32, pytest.param(BF16, marks=pytest.mark.skipif(not _bf16_on_gpu(), reason=(
    "this CuPy has no bfloat16 arrays (CuPy >= 14 with ml_dtypes has); bf16 kernels are covered by the "
    "emulated tests")))]
DT_IDS = ["f32", "bf16"]


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.fixture(scope="module")
def k(cp):
    return cuda_kernels.cupy_launchers()


def host(a):
    import cupy

    return cupy.asnumpy(a) if a is not None else None


def randn(shape, dtype, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def close(got, want, dtype, rtol=None, atol=None):
    got = host(got) if not isinstance(got, np.ndarray) else got
    want = np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if dtype == BF16:
        rtol, atol = (2e-2 if rtol is None else rtol), (1e-3 if atol is None else atol)
    else:
        rtol, atol = (1e-5 if rtol is None else rtol), (1e-6 if atol is None else atol)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------------
# Each kernel against the NumPy reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", [(1,), (255,), (8, 257), (64, 3072), (3, 5, 1031)])
def test_gelu(cp, k, dtype, shape):
    x, dy = randn(shape, dtype, 1, 2.0), randn(shape, dtype, 2)
    for approximate in ("tanh", "none"):
        y_ref, gctx = ops.gelu_forward(x, approximate)
        close(k.gelu_forward(cp.asarray(x), approximate), y_ref, dtype)
        close(k.gelu_backward(cp.asarray(dy), cp.asarray(x), approximate), ops.gelu_backward(dy, gctx), dtype,
              atol=1e-5 if dtype == F32 else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (33, 64), (512, 3072), (4, 129, 771)])
def test_bias_gelu(cp, k, dtype, shape):
    x, b, dy = randn(shape, dtype, 3, 2.0), randn(shape[-1:], dtype, 4), randn(shape, dtype, 5)
    y_ref, gctx = ops.bias_gelu_forward(x, b)
    y, pre = k.bias_gelu_forward(cp.asarray(x), cp.asarray(b))
    close(y, y_ref, dtype)
    close(pre, gctx.x, dtype)
    dx, db = k.bias_gelu_backward(cp.asarray(dy), pre)
    dx_ref, db_ref = ops.bias_gelu_backward(dy, gctx)
    close(dx, dx_ref, dtype, atol=1e-5 if dtype == F32 else None)
    rows = int(np.prod(shape[:-1]))
    close(db, db_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 * rows ** 0.5 * 10)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,causal", [((1, 1), False), ((17,), False), ((2, 3, 5, 9), True), ((4, 12, 64, 64), True),
                                          ((2, 4, 7, 1024), True), ((2, 1, 1025), False), ((1, 2, 3, 8192), True),
                                          ((1, 1, 2, 20000), False)])
def test_softmax(cp, k, dtype, shape, causal):
    x, dy = randn(shape, dtype, 6, 3.0), randn(shape, dtype, 7)
    scale = 0.125
    y_ref, sctx = ops.softmax_forward(x, scale, causal)
    y = k.softmax_forward(cp.asarray(x), scale, causal)
    close(y, y_ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)
    close(k.softmax_backward(cp.asarray(dy), cp.asarray(y_ref), scale), ops.softmax_backward(dy, sctx), dtype,
          atol=1e-6 if dtype == F32 else 1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (8, 768), (1024, 768), (5, 1600), (3, 2049), (2, 8192), (2, 7000)])
def test_layernorm(cp, k, dtype, shape):
    C = shape[-1]
    x, w, b, dy = randn(shape, dtype, 8, 2.0), randn((C,), dtype, 9), randn((C,), dtype, 10), randn(shape, dtype, 11)
    y_ref, lctx = ops.layernorm_forward(x, w, b)
    y, mean, rstd = k.layernorm_forward(cp.asarray(x), cp.asarray(w), cp.asarray(b))
    close(y, y_ref, dtype, atol=1e-5 if dtype == F32 else None)
    close(mean, lctx.mean.reshape(-1), F32, atol=1e-6)
    close(rstd, lctx.rstd.reshape(-1), F32)
    dx, dw, db = k.layernorm_backward(cp.asarray(dy), cp.asarray(x), cp.asarray(w), mean, rstd, b.dtype)
    dx_ref, dw_ref, db_ref = ops.layernorm_backward(dy, lctx)
    close(dx, dx_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 if dtype == F32 else None)
    rows = x.size // C
    close(dw, dw_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 * rows)
    close(db, db_ref, dtype, rtol=1e-4 if dtype == F32 else None, atol=1e-5 * rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("N,W,n_valid", [(1, 1, 1), (5, 50, 45), (64, 25152, 25129), (3, 50304, 50257), (7, 16, 0)])
def test_cross_entropy_pieces(cp, k, dtype, N, W, n_valid):
    logits = randn((N, W), dtype, 12, 4.0)
    t = np.random.default_rng(13).integers(0, max(n_valid, 1), N).astype(np.int64)
    t[::3] = -1
    if not n_valid:
        t[:] = -1
    m_ref = ops.ce_shard_max(logits, n_valid)
    np.testing.assert_array_equal(host(k.ce_shard_max(cp.asarray(logits), n_valid)), m_ref)
    se, tl, sl = k.ce_shard_stats(cp.asarray(logits), cp.asarray(m_ref), cp.asarray(t), n_valid)
    se_ref, tl_ref, sl_ref = ops.ce_shard_stats(logits, m_ref, t, n_valid)
    close(se, se_ref, F32, rtol=2e-5)
    np.testing.assert_array_equal(host(tl), tl_ref)
    close(sl, sl_ref, F32, rtol=1e-4, atol=1e-3 * max(1, n_valid) ** 0.5)
    scale = np.linspace(0, 1, N).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ref = ops.ce_shard_backward(logits, m_ref, se_ref, t, n_valid, scale, 0.1, max(n_valid, 1))
    buf = cp.asarray(logits)
    out = k.ce_shard_backward(buf, cp.asarray(m_ref), cp.asarray(se_ref), cp.asarray(t), n_valid, cp.asarray(scale),
                              0.1, max(n_valid, 1), out=buf)
    assert out is buf
    close(out, ref, dtype, atol=1e-7 if dtype == F32 else 1e-4)


def test_cross_entropy_offsets_beyond_2_31_elements(cp, k):
    """rows x vocabulary > 2^31: the kernels' 64-bit offsets (bf16 logits, ~4.3 GB)."""
    N, W, n_valid = 42_800, 50_304, 50_257  # 2.153e9 elements
    free, _ = cp.cuda.runtime.memGetInfo()
    dtype = BF16 if _bf16_on_gpu() else F32
    need = N * W * (8 + 2 * dtype.itemsize)  # two float32 temporaries while drawing, the logits
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    logits = (cp.random.default_rng(0).random((N, W), dtype=cp.float32) * 8 - 4).astype(dtype)
    t = cp.asarray(np.random.default_rng(1).integers(0, n_valid, N))
    m = k.ce_shard_max(logits, n_valid)
    se, tl, _ = k.ce_shard_stats(logits, m, t, n_valid, need_sum_logits=False)
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


@pytest.mark.parametrize("n", [1, 5, 1027, 124_439_808 // 64 + 3])
def test_adamw(cp, k, n):
    r = np.random.default_rng(n)
    p, g = r.standard_normal(n).astype(np.float32), r.standard_normal(n).astype(np.float32)
    m, v = (r.standard_normal(n) * 0.1).astype(np.float32), (r.random(n) * 0.01).astype(np.float32)
    mask = (r.random(n) < 0.5).astype(np.float32)
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7, grad_scale=0.5)
    gp, gm, gv = cp.asarray(p), cp.asarray(m), cp.asarray(v)
    k.adamw_update(gp, cp.asarray(g), gm, gv, cp.asarray(mask), **kw)
    ops.adamw_update(p, g, m, v, mask, **kw)
    close(gp, p, F32, rtol=1e-6, atol=1e-7)  # the same float ops in the same order (sqrt, div IEEE)
    close(gm, m, F32, rtol=1e-6, atol=0)
    close(gv, v, F32, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_dropout(cp, k, dtype):
    cases = [((1,), 0.1, 1, 0), ((3, 333), 0.5, 2**64 - 1, 2**64 - 5), ((64, 1024, 3), 0.2, 7, 99)]
    for shape, p, seed, offset in cases:
        np.testing.assert_array_equal(host(k.dropout_mask(shape, p, seed, offset)),
                                      ops.dropout_mask(np, shape, p, seed, offset))
        x = randn(shape, dtype, 14)
        y, mask = k.dropout_forward(cp.asarray(x), p, seed, offset)
        y_ref, dctx = ops.dropout_forward(x, p, seed, offset)
        np.testing.assert_array_equal(host(mask), dctx.mask)
        close(y, y_ref, dtype, rtol=1e-6 if dtype == F32 else None, atol=0)
        close(k.dropout_apply(cp.asarray(x), mask, dctx.scale), ops.dropout_backward(x, dctx), dtype,
              rtol=1e-6 if dtype == F32 else None, atol=0)


def test_reductions_are_deterministic(cp, k):
    x, dy, w = randn((8192, 768), F32, 15), randn((8192, 768), F32, 16), randn((768,), F32, 17)
    gx, gdy, gw = cp.asarray(x), cp.asarray(dy), cp.asarray(w)
    runs = []
    for _ in range(2):
        _, mean, rstd = k.layernorm_forward(gx, gw, gw)
        dx, dw, db = k.layernorm_backward(gdy, gx, gw, mean, rstd, F32)
        _, dbias = k.bias_gelu_backward(gdy, gx)
        runs.append([host(a) for a in (dx, dw, db, dbias)])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_argument_checks_on_cupy_arrays(cp, k):
    x = cp.zeros((4, 8), cp.float32)
    with pytest.raises(cuda_kernels.KernelArgumentError, match="not C-contiguous"):
        k.gelu_forward(x[:, ::2])
    with pytest.raises(cuda_kernels.KernelArgumentError, match="float64 through their reference composition"):
        k.softmax_forward(x.astype(cp.float64))
    with pytest.raises(cuda_kernels.KernelArgumentError, match="must be a cupy array"):
        k.gelu_forward(np.zeros(3, np.float32))
    with pytest.raises(cuda_kernels.KernelArgumentError, match="shape"):
        k.gelu_backward(cp.zeros((4, 7), cp.float32), x)


# ------------------------------------------------------------------------------------------------
# The ops: kernel path against the CuPy reference path
# ------------------------------------------------------------------------------------------------
def _run_ops(cp, dtype):
    """The ops on arrays of module `cp` (CuPy, or NumPy for the host reference)."""
    x = cp.asarray(randn((4, 64, 96), dtype, 20))
    b = cp.asarray(randn((96,), dtype, 21))
    dy = cp.asarray(randn((4, 64, 96), dtype, 22))
    s = cp.asarray(randn((4, 3, 64, 64), dtype, 23, 3.0))
    ds = cp.asarray(randn((4, 3, 64, 64), dtype, 24))
    out = {}
    y, c = ops.bias_gelu_forward(x, b)
    out["bias_gelu"] = (y, c.x, *ops.bias_gelu_backward(dy, c))
    y, c = ops.gelu_forward(x)
    out["gelu"] = (y, ops.gelu_backward(dy, c))
    y, c = ops.softmax_forward(s, 0.125, causal=True)
    out["softmax"] = (y, ops.softmax_backward(ds, c))
    y, c = ops.layernorm_forward(x, b, b)
    out["layernorm"] = (y, c.mean, c.rstd, *ops.layernorm_backward(dy, c))
    t = cp.asarray(np.random.default_rng(25).integers(0, 90, 4 * 64))
    t[::7] = -100
    loss, c = ops.cross_entropy_forward(x, t, label_smoothing=0.1, n_classes=90)
    out["ce"] = (loss, c.row_max, c.sum_exp, ops.cross_entropy_backward(np.float32(1.0), c))
    y, c = ops.dropout_forward(x, 0.2, 3, 4)
    out["dropout"] = (y, c.mask, ops.dropout_backward(dy, c))
    n = 10_001
    p, g = cp.asarray(randn(n, dtype, 26)), cp.asarray(randn(n, dtype, 27))
    m, v = cp.zeros(n, cp.float32), cp.zeros(n, cp.float32)
    mask = cp.asarray((np.arange(n) % 2).astype(np.float32).astype(dtype))
    ops.adamw_update(p, g, m, v, mask, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1,
                     grad_scale=0.7)
    out["adamw"] = (p, m, v)
    return {name: tuple(np.asarray(host(a)) if not isinstance(a, np.ndarray) else a for a in arrays)
            for name, arrays in out.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_ops_kernel_path_matches_reference_path(cp, dtype):
    before = cuda_kernels.launch_counts()
    with cuda_kernels.use_kernels(True):
        got = _run_ops(cp, dtype)
    launched = cuda_kernels.launch_counts() - before
    with cuda_kernels.use_kernels(False):
        assert cuda_kernels.dispatch(cp.zeros(3, cp.float32)) is None
        # float32: the CuPy reference composition. bfloat16: NumPy's (CuPy's bfloat16 support is
        # young and not every op of the composition may have a bf16 loop).
        want = _run_ops(cp if dtype == F32 else np, dtype)
    assert cuda_kernels.launch_counts() - before == launched, "use_kernels(False) must launch no kernel"
    suffix = "f32" if dtype == F32 else "bf16"
    for name in ("bias_gelu_forward", "bias_gelu_backward", "gelu_forward", "gelu_backward", "softmax_forward",
                 "softmax_backward", "layernorm_forward", "layernorm_backward", "ce_shard_max", "ce_shard_stats",
                 "ce_shard_backward", "dropout_forward", "dropout_apply", "adamw_update"):
        assert launched[f"{name}_{suffix}"] >= 1, name
    for name in got:
        for a, b in zip(got[name], want[name]):
            if a.dtype == bool:
                np.testing.assert_array_equal(a, b)
            else:
                close(a, b, dtype if a.dtype == dtype else F32, rtol=1e-4 if dtype == F32 else None,
                      atol=1e-5 if dtype == F32 else 2e-3)


def test_float64_on_the_gpu_uses_the_reference_composition(cp):
    before = cuda_kernels.launch_counts()
    x = cp.asarray(randn((4, 16), np.float64, 28))
    ops.gelu_forward(x)
    ops.softmax_forward(x, causal=True)
    ops.layernorm_forward(x, cp.ones(16), cp.zeros(16))
    assert cuda_kernels.launch_counts() == before


# ------------------------------------------------------------------------------------------------
# One GPT training step on the GPU (float32, kernels) against the CPU (float64)
# ------------------------------------------------------------------------------------------------
def _step(ctx, dtype, ids, targets, init, kernels=True):
    """(loss, grads, params after one AdamW step) of the tiny GPT, starting from `init` (host
    arrays by name: float32 and float64 models draw different initial values)."""
    from cutp.model import GPT, GPTConfig
    from cutp.optim import AdamW, FlatParameters

    cfg = GPTConfig.preset("tiny", dtype=dtype, label_smoothing=0.1)
    with cuda_kernels.use_kernels(kernels):
        model = GPT(ctx, cfg, seed=11)
        if not init:
            init.update({p.name: ctx.to_numpy(p.data).copy() for p in model.parameters()})
        for p in model.parameters():
            p.data[...] = ctx.asarray(init[p.name].astype(dtype))
        flat = FlatParameters(model.parameters())
        opt = AdamW(flat, lr=1e-3)
        loss = model.forward(ctx.asarray(ids), ctx.asarray(targets))
        model.backward()
        grads = {p.name: ctx.to_numpy(p.grad).astype(np.float64) for p in model.parameters()}
        opt.step(grad_scale=0.9)
        params = {p.name: ctx.to_numpy(p.data).astype(np.float64) for p in model.parameters()}
    return loss, grads, params


def test_gpt_training_step_on_gpu_matches_cpu_float64():
    from mpi4py import MPI

    import cutp

    rng = np.random.default_rng(30)
    ids = rng.integers(0, 256, (4, 128))
    targets = rng.integers(0, 256, (4, 128))
    targets[0, :10] = -100
    gpu = cutp.init(comm=MPI.COMM_SELF, tp=1, device="cuda")
    cpu = cutp.init(comm=MPI.COMM_SELF, tp=1, device="cpu")
    before = cuda_kernels.launch_counts()
    init = {}  # the float32 model's initial parameters, for all three
    loss_g, grads_g, params_g = _step(gpu, "float32", ids, targets, init)
    used = {name.rsplit("_", 1)[0] for name in cuda_kernels.launch_counts() - before}
    loss_r, grads_r, params_r = _step(gpu, "float32", ids, targets, init, kernels=False)
    loss_c, grads_c, params_c = _step(cpu, "float64", ids, targets, init)
    gpu.close()
    cpu.close()
    assert {"bias_gelu_forward", "bias_gelu_backward", "softmax_forward", "softmax_backward", "layernorm_forward",
            "layernorm_backward", "ce_shard_max", "ce_shard_stats", "ce_shard_backward", "adamw_update",
            "column_sum"} <= used, used
    assert abs(loss_g - loss_c) <= 1e-5 * abs(loss_c), (loss_g, loss_c)
    assert abs(loss_g - loss_r) <= 1e-5 * abs(loss_r), (loss_g, loss_r)
    for name, gc in grads_c.items():
        scale = np.abs(gc).max() + 1e-12
        np.testing.assert_allclose(grads_g[name], gc, rtol=5e-3, atol=2e-4 * scale, err_msg=name)  # fp32 vs fp64
        np.testing.assert_allclose(grads_g[name], grads_r[name], rtol=2e-3, atol=1e-4 * scale, err_msg=name)
    for name, pc in params_c.items():
        # One AdamW step moves each element by about lr * sign(grad) (lr 1e-3): where the gradient
        # is rounding noise the two precisions may step differently, so only compare elements
        # with a real gradient tightly.
        real = np.abs(grads_c[name]) > 1e-4 * (np.abs(grads_c[name]).max() + 1e-12)
        np.testing.assert_allclose(params_g[name][real], pc[real], rtol=1e-4, atol=2e-5, err_msg=name)
        np.testing.assert_allclose(params_g[name], pc, rtol=0, atol=2.1e-3, err_msg=name)
