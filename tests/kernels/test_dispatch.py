"""cutp.ops routed through the kernels (cutp.kernels.dispatch), on each backend.

The dispatch rule and the use_kernels switch; the ops' kernel path against their reference path
(same shapes, dtypes, contexts, values to float32 rounding), float64 always on the reference
path; a GPT training step through the kernels against the reference path, and on a GPU against
the CPU's float64 step. Under the emulator, NumPy arrays stand in for CuPy arrays: the ops'
dispatch is replaced by the GPU's rule applied to NumPy arrays (``RoutedOps``).
"""
from __future__ import annotations

import importlib
from collections import Counter

import numpy as np
import pytest
from mpi4py import MPI

import cutp
from cutp import kernels, ops
from cutp.models import GPT, GPTConfig
from cutp.optim import AdamW, FlatParameters
from cutp.runtime.backend import to_numpy

from .helpers import BF16, DT_IDS, DTYPES, F32, close, randn, rng

OP_MODULES = ["cutp.ops.gelu", "cutp.ops.softmax", "cutp.ops.layernorm", "cutp.ops.cross_entropy",
              "cutp.ops.adamw", "cutp.ops.dropout"]


def test_dispatch_rule():
    is_np = lambda a: isinstance(a, np.ndarray)  # noqa: E731
    x = np.zeros((4, 8), np.float32)
    assert kernels.eligible((x, None, x[0]), is_np)
    assert kernels.eligible((x.astype(BF16),), is_np)
    assert not kernels.eligible((x.astype(np.float64),), is_np)  # float64: reference composition
    assert not kernels.eligible((x, x.astype(BF16)), is_np)  # mixed dtypes
    assert not kernels.eligible((x[:, ::2],), is_np)  # strided view
    assert not kernels.eligible((None,), is_np)
    assert not kernels.eligible((x,))  # NumPy is not a device array: CPU ops never dispatch
    assert kernels.dispatch(x) is None and kernels.dispatch_xp(np) is None


def test_use_kernels_switch(monkeypatch):
    monkeypatch.delenv("CUTP_KERNELS", raising=False)
    assert kernels.kernels_enabled()
    with kernels.use_kernels(False):
        assert not kernels.kernels_enabled()
        with kernels.use_kernels(True):
            assert kernels.kernels_enabled()
        assert not kernels.kernels_enabled()
    assert kernels.kernels_enabled()
    monkeypatch.setenv("CUTP_KERNELS", "0")
    assert not kernels.kernels_enabled()
    with kernels.use_kernels(True):
        assert kernels.kernels_enabled()
    assert not kernels.kernels_enabled()
    monkeypatch.setenv("CUTP_KERNELS", "1")
    kernels.use_kernels(False)  # the plain call sets it for the rest of the process...
    try:
        assert not kernels.kernels_enabled()
    finally:
        kernels.use_kernels(None)  # ...until set again; None: back to $CUTP_KERNELS
    assert kernels.kernels_enabled()


# ================================================================================================
# The ops through the kernels
# ================================================================================================
class RoutedOps:
    """cutp.ops on a backend's arrays, dispatching to its kernels: ``dispatch`` is the rule the
    ops apply, ``launched()`` the kernel launches since the fixture was set up."""

    def __init__(self, dispatch, launched):
        self.dispatch = dispatch
        self.launched = launched


@pytest.fixture
def routed(backend, monkeypatch) -> RoutedOps:
    if not backend.emulated:  # the real dispatch, to the device's launchers
        before = kernels.launch_counts()
        return RoutedOps(kernels.dispatch, lambda: kernels.launch_counts() - before)
    emulated = backend.launchers("random", 3)

    def dispatch(*arrays):
        ok = kernels.eligible(arrays, lambda a: isinstance(a, np.ndarray))
        return emulated if ok and kernels.kernels_enabled() else None

    def dispatch_xp(xp):
        return emulated if xp is np and kernels.kernels_enabled() else None

    for name in OP_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "_kernels", dispatch)
    monkeypatch.setattr(importlib.import_module("cutp.ops.dropout"), "_kernels_xp", dispatch_xp)
    return RoutedOps(dispatch, lambda: Counter(emulated.launches))


# small: a 16-wide model with 15 classes in 16 columns (a padded vocabulary); gpt: GPT-sized
# rows and heads (64 tokens, 3 heads of 64, 90 classes in 96 columns)
OPS_CASES = {
    "small": dict(x=(2, 3, 16), scores=(2, 3, 4, 4), scale=0.5, targets=np.array([3, -100, 14, 0, 9, 2]),
                  n_classes=15, dloss=2.0, dropout=(0.25, 5, 6), adamw=1001, seed=31),
    "gpt": dict(x=(4, 64, 96), scores=(4, 3, 64, 64), scale=0.125,
                targets=np.where(np.arange(256) % 7 == 0, -100, rng(25).integers(0, 90, 256)), n_classes=90,
                dloss=1.0, dropout=(0.2, 3, 4), adamw=10_001, seed=20),
}


def _run_ops(xp, dtype, case):
    """Every op with a kernel, forward and backward, on arrays of module `xp`: {op: outputs}."""
    c = OPS_CASES[case]
    seed = c["seed"]
    x = xp.asarray(randn(c["x"], dtype, seed))
    b = xp.asarray(randn(c["x"][-1:], dtype, seed + 1))
    dy = xp.asarray(randn(c["x"], dtype, seed + 2))
    s = xp.asarray(randn(c["scores"], dtype, seed + 3, 3.0))
    ds = xp.asarray(randn(c["scores"], dtype, seed + 4))
    out = {}
    y, gctx = ops.bias_gelu_forward(x, b)
    out["bias_gelu"] = (y, gctx.x, *ops.bias_gelu_backward(dy, gctx))
    for approximate in ("tanh", "none"):
        y, gctx = ops.gelu_forward(x, approximate)
        out[f"gelu {approximate}"] = (y, ops.gelu_backward(dy, gctx))
    y, sctx = ops.softmax_forward(s, c["scale"], causal=True)
    out["softmax"] = (y, sctx.y, ops.softmax_backward(ds, sctx))
    y, lctx = ops.layernorm_forward(x, b, b)
    out["layernorm"] = (y, lctx.mean, lctx.rstd, *ops.layernorm_backward(dy, lctx))
    assert lctx.mean.shape == c["x"][:-1] and lctx.mean.dtype == np.float32
    loss, cctx = ops.cross_entropy_forward(x, xp.asarray(c["targets"]), label_smoothing=0.1, n_classes=c["n_classes"])
    out["ce"] = (loss, cctx.row_max, cctx.sum_exp, ops.cross_entropy_backward(np.float32(c["dloss"]), cctx))
    y, dctx = ops.dropout_forward(x, *c["dropout"])
    out["dropout"] = (y, dctx.mask, ops.dropout_backward(dy, dctx), ops.dropout_mask(xp, (3, 5), 0.5, 1, 2))
    n = c["adamw"]
    p, g = xp.asarray(randn(n, dtype, seed + 5)), xp.asarray(randn(n, dtype, seed + 6))
    m, v = xp.zeros(n, np.float32), xp.zeros(n, np.float32)
    mask = xp.asarray((np.arange(n) % 2).astype(np.float32).astype(dtype))
    ops.adamw_update(p, g, m, v, mask, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1,
                     grad_scale=0.7)
    out["adamw"] = (p, m, v)
    return {name: tuple(to_numpy(a) for a in arrays) for name, arrays in out.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", list(OPS_CASES))
def test_ops_dispatch_to_the_kernels_and_keep_their_contracts(backend, routed, dtype, case):
    with kernels.use_kernels(True):
        got = _run_ops(backend.xp, dtype, case)
    launched = routed.launched()
    with kernels.use_kernels(False):
        assert routed.dispatch(backend.xp.zeros(3, np.float32)) is None
        # float32: the backend's reference composition. bfloat16 on a GPU: NumPy's (CuPy's
        # bfloat16 support is young and not every op of the composition may have a bf16 loop).
        want = _run_ops(np if dtype == BF16 else backend.xp, dtype, case)
    assert routed.launched() == launched, "use_kernels(False) must launch no kernel"
    for name in got:
        for a, want_a in zip(got[name], want[name], strict=True):
            assert a.shape == want_a.shape and a.dtype == want_a.dtype, (name, a.shape, want_a.shape, a.dtype,
                                                                          want_a.dtype)
            if a.dtype == bool:
                np.testing.assert_array_equal(a, want_a)
            else:
                close(a, want_a, dtype if a.dtype == dtype else F32, rtol=1e-4 if dtype == F32 else None,
                      atol=1e-5 if dtype == F32 else 2e-3)
    suffix = "f32" if dtype == F32 else "bf16"
    for name in ("bias_gelu_forward", "bias_gelu_backward", "gelu_forward", "gelu_backward", "softmax_forward",
                 "softmax_backward", "layernorm_forward", "layernorm_backward", "ce_shard_forward",
                 "ce_shard_backward", "dropout_forward", "dropout_apply", "adamw_update"):
        assert launched[f"{name}_{suffix}"] >= 1, name
    assert launched["dropout_mask_bool"] == 1 and launched[f"column_sum_{suffix}"] >= 3


@pytest.mark.parametrize("shape,causal", [((3, 8), False), ((4, 16), True)])
def test_float64_ops_take_the_reference_path(backend, routed, shape, causal):
    xp = backend.xp
    x = backend.to_device(randn(shape, np.float64, seed=34))
    ops.gelu_forward(x)
    ops.softmax_forward(x, causal=causal)
    ops.layernorm_forward(x, xp.ones(shape[-1]), xp.zeros(shape[-1]))
    assert not routed.launched()


# ================================================================================================
# A GPT training step through the kernels
# ================================================================================================
def test_gpt_training_step_through_the_kernels(backend, routed):
    """forward + backward + AdamW of a tiny GPT (dropout and label smoothing on, padded vocabulary)
    through the kernels equals the reference path to float32 rounding."""
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=8, dropout=0.1, label_smoothing=0.1)
    ctx = cutp.init(comm=MPI.COMM_SELF, tp=1, device=backend.device)
    ids = rng(35).integers(0, 11, (2, 8))
    targets = rng(36).integers(0, 11, (2, 8))
    targets[0, :3] = -100
    out = {}
    for enabled in (True, False):
        with kernels.use_kernels(enabled):
            model = GPT(ctx, cfg, seed=3)
            flat = FlatParameters(model.parameters())
            opt = AdamW(flat, lr=1e-2)
            loss = model.forward(ctx.asarray(ids), ctx.asarray(targets))
            model.backward()
            grad = to_numpy(flat.grad).copy()
            opt.step(grad_scale=0.5)
            out[enabled] = (loss, grad, to_numpy(flat.data).copy())
    ctx.close()
    (l1, g1, p1), (l0, g0, p0) = out[True], out[False]
    assert abs(l1 - l0) <= 1e-5 * abs(l0)
    np.testing.assert_allclose(g1, g0, rtol=1e-3, atol=1e-6 * np.abs(g0).max())
    # AdamW's first step moves each parameter by about lr * sign(grad): where a gradient is rounding
    # noise (|g| ~ eps) the two paths may step differently, by a small fraction of lr
    np.testing.assert_allclose(p1, p0, rtol=1e-4, atol=2e-5)
    used = {name.rsplit("_", 1)[0] for name in routed.launched()}
    assert {"bias_gelu_forward", "bias_gelu_backward", "softmax_forward", "softmax_backward", "layernorm_forward",
            "layernorm_backward", "ce_shard_forward", "ce_shard_backward", "adamw_update",
            "dropout_forward", "dropout_apply", "column_sum"} <= used, used


def _step(ctx, dtype, ids, targets, init, use_the_kernels=True):
    """(loss, grads, params after one AdamW step) of the tiny GPT, starting from `init` (host
    arrays by name: float32 and float64 models draw different initial values)."""
    cfg = GPTConfig.preset("tiny", dtype=dtype, label_smoothing=0.1)
    with kernels.use_kernels(use_the_kernels):
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


@pytest.mark.cuda_only("compares the GPU's float32 step with the CPU's float64 step")
def test_gpt_training_step_on_gpu_matches_cpu_float64(backend, routed):
    r = rng(30)
    ids = r.integers(0, 256, (4, 128))
    targets = r.integers(0, 256, (4, 128))
    targets[0, :10] = -100
    gpu = cutp.init(comm=MPI.COMM_SELF, tp=1, device="cuda")
    cpu = cutp.init(comm=MPI.COMM_SELF, tp=1, device="cpu")
    init = {}  # the float32 model's initial parameters, for all three
    loss_g, grads_g, params_g = _step(gpu, "float32", ids, targets, init)
    used = {name.rsplit("_", 1)[0] for name in routed.launched()}
    loss_r, grads_r, params_r = _step(gpu, "float32", ids, targets, init, use_the_kernels=False)
    loss_c, grads_c, params_c = _step(cpu, "float64", ids, targets, init)
    gpu.close()
    cpu.close()
    assert {"bias_gelu_forward", "bias_gelu_backward", "softmax_forward", "softmax_backward", "layernorm_forward",
            "layernorm_backward", "ce_shard_forward", "ce_shard_backward", "adamw_update",
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
