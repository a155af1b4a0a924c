"""kernels/attention.cu (fused causal attention, FlashAttention-2) through its launchers
(kernels/attention.py) against cutp.ops.flash_attention_forward / _backward (the same algorithm
in array code, float64 on the same inputs), on each backend.

Entry points (each launched by the tests below): attention_forward_f32_d64, attention_forward_f32_d128,
attention_forward_bf16_d64, attention_forward_bf16_d128, attention_backward_rowdot_f32_d64,
attention_backward_rowdot_f32_d128, attention_backward_rowdot_bf16_d64, attention_backward_rowdot_bf16_d128,
attention_backward_dq_f32_d64, attention_backward_dq_f32_d128, attention_backward_dq_bf16_d64,
attention_backward_dq_bf16_d128, attention_backward_dkdv_f32_d64, attention_backward_dkdv_f32_d128,
attention_backward_dkdv_bf16_d64, attention_backward_dkdv_bf16_d128.

* The issue's grid: T in {1, 17, 64, 200, 513} x head dims 64, 128 x GQA groups 1, 2, 4 x float32
  (within 1e-5, normwise relative) and bfloat16 (2e-2; the bf16 path multiplies on the emulated
  tensor cores, nvcuda::wmma), batch x heads up to 8, poisoned outputs. Under the emulator this
  grid runs on an unchecked build of attention.cu (no per-access instrumentation: 20x faster on
  the float path); the checked build (race detector, bounds) runs the kernels under each thread
  schedule at smaller shapes, with results bit-identical across schedules.
* Launchers: only o and the log-sum-exp are allocated by the forward; strided q, k, v (views of
  a fused QKV output) and gradients written into a packed buffer; Tq < Tk; scores far apart (the
  online softmax's rescaling); the probability dropout (the plain path's masks); refusals.
* The op and a GPT on the fused kernels equal the unfused attention (dropout included).
* The array-code reference itself against the plain formula in float64 (1e-12).
"""
from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import cutp
from cutp import kernels, ops
from cutp.kernels import KernelArgumentError, KernelLoadError, Launchers
from cutp.kernels.attention import ATTENTION_HEAD_DIMS, attention_shared_bytes, attention_tile_rows
from cutp.kernels.runtime import find_mma_include
from cutp.kernels import shape_only_launchers
from cutp.runtime.shape_only import ShapeOnly
from cutp.models import GPT, GPTConfig
from tests.cuda_emu import KERNELS_DIR, EmulatedModule

from .helpers import (BF16, DT_IDS, DTYPES, F32, PoisonedAllocations, RecordingAllocations, bits, is_poison, randn,
                      ulp)

TOL = {F32: 1e-5, BF16: 2e-2}
attention_op = importlib.import_module("cutp.ops.attention")


def attention_inputs(B, Hkv, G, Tq, Tk, D, dtype, seed=0, scale=1.0):
    q = randn((B, Hkv, G, Tq, D), dtype, seed=seed, scale=scale)
    k = randn((B, Hkv, Tk, D), dtype, seed=seed + 1, scale=scale)
    v = randn((B, Hkv, Tk, D), dtype, seed=seed + 2)
    do = randn((B, Hkv, G, Tq, D), dtype, seed=seed + 3)
    return q, k, v, do


def normwise_error(got, want) -> float:
    """||got - want|| / ||want|| over all elements (float64), after checking no element still
    holds the poison of an unwritten output. The denominator has a floor of 0.1 per element (rms;
    the inputs are standard normal): dq of a single key is exactly 0 in exact arithmetic, and in
    float32 the rounding of dS = P (dP - D), two sums of do * v in different orders, which no
    relative bound can hold."""
    got = np.asarray(got)
    assert not is_poison(got).any(), f"{int(is_poison(got).sum())} elements never written (poison)"
    g, w = got.astype(np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape, (g.shape, w.shape)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 0.1 * np.sqrt(max(w.size, 1))))


def reference(q, k, v, do, scale, drop=(0.0, 0, 0)):
    """float64 forward and backward of the array-code FlashAttention on the same (rounded) inputs;
    drop: (dropout_p, seed, offsets)."""
    q64, k64, v64, do64 = (a.astype(np.float64) for a in (q, k, v, do))
    o, lse = ops.flash_attention_forward(q64, k64, v64, scale, dropout_p=drop[0], seed=drop[1], offset=drop[2])
    return o, lse, ops.flash_attention_backward(do64, q64, k64, v64, o, lse, scale, dropout_p=drop[0], seed=drop[1],
                                                offset=drop[2])


def check_against_reference(k, backend, q, k_, v, do, dtype, scale=None, drop=(0.0, 0, 0)):
    D = q.shape[-1]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    dev = [backend.to_device(a) for a in (q, k_, v, do)]
    o, lse = k.attention_forward(*dev[:3], scale, *drop)
    o_ref, lse_ref, grads_ref = reference(q, k_, v, do, scale, drop)
    assert normwise_error(backend.host(o), o_ref) <= TOL[dtype]
    assert normwise_error(backend.host(lse), lse_ref) <= 1e-6
    grads = k.attention_backward(dev[3], *dev[:3], o, lse, scale, None, *drop)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        err = normwise_error(backend.host(got), want)
        assert err <= TOL[dtype], f"{name}: normwise error {err:.2e}"
    return o, lse, grads


# ---- the grid, on an unchecked build -----------------------------------------------------
@pytest.fixture(scope="module")
def unchecked_module():
    return EmulatedModule(path=[KERNELS_DIR / "attention.cu"], checks=False)


@pytest.fixture
def fast(backend, request):
    """Launchers for the grid: the unchecked emulated build, or the GPU's."""
    if not backend.emulated:
        return backend.launchers()
    mod = request.getfixturevalue("unchecked_module")
    return Launchers(lambda name: mod, PoisonedAllocations(np), description="emulated (unchecked attention)")


def _grid():
    cases = []
    for T in (1, 17, 64, 200, 513):
        for D in (64, 128):
            for G in (1, 2, 4):
                # batch x heads: 8 up to 64 keys, 4 at 200 (G 4: 8), one KV head at 513 (the
                # emulated tensor cores cost ~15 us per mma: 8 heads of 513 keys take ~5 s)
                B, Hkv = (2, max(1, 4 // G)) if T <= 64 else (1, max(1, 4 // G)) if T == 200 else (1, 1)
                cases.append((B, Hkv, G, T, D))
    return cases


GRID = _grid()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("B,Hkv,G,T,D", GRID, ids=[f"B{b}-kv{h}-g{g}-T{t}-d{d}" for b, h, g, t, d in GRID])
def test_attention_grid(backend, fast, dtype, B, Hkv, G, T, D):
    check_against_reference(fast, backend, *attention_inputs(B, Hkv, G, T, T, D, dtype, seed=T + G), dtype)


# ---- checked build: every schedule, races, bounds, determinism -----------------------------------
SCHEDULED = [(2, 1, 2, 17, 64), (1, 2, 1, 70, 64), (1, 1, 2, 33, 128), (1, 1, 1, 70, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("B,Hkv,G,T,D", SCHEDULED, ids=[f"B{b}-kv{h}-g{g}-T{t}-d{d}" for b, h, g, t, d in SCHEDULED])
def test_attention_under_each_schedule(backend, ks, dtype, B, Hkv, G, T, D):
    """The checked build (shared-memory race detector, bounds of every access) under the thread
    schedules: a race or an out-of-bounds access raises; the results match the reference."""
    check_against_reference(ks, backend, *attention_inputs(B, Hkv, G, T, T, D, dtype, seed=5), dtype)


DROPOUT_CASES = [  # (B, Hkv, G, Tq, Tk, D), (p, seed, offsets)
    ((2, 1, 2, 70, 70, 64), (0.1, 17, 1000)),
    ((2, 2, 1, 33, 33, 128), (0.5, 3, [5, 2 ** 40 + 7])),  # per-row offsets (a rank's heads' places)
    ((1, 1, 2, 20, 50, 64), (0.3, 9, 0)),  # Tq < Tk
    ((1, 1, 1, 24, 24, 64), (1.0, 1, 0)),  # everything dropped: o = 0, dq = dk = dv = 0
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,drop", DROPOUT_CASES, ids=[f"p{d[0]}-{s[3]}x{s[4]}-d{s[5]}" for s, d in DROPOUT_CASES])
def test_attention_dropout(backend, ks, dtype, shape, drop):
    """The probability dropout in the kernels: cutp.ops.dropout_forward_rows's masks (counter
    hash at offsets[b] + element of batch row b), recomputed in the backward."""
    check_against_reference(ks, backend, *attention_inputs(*shape, dtype, seed=shape[3]), dtype, drop=drop)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_attention_is_deterministic(backend, dtype):
    """No atomics: dq, dk, dv (and o, lse) are bit-identical under every schedule / run."""
    q, k_, v, do = attention_inputs(1, 1, 2, 90, 90, 64, dtype, seed=9)
    results = []
    for k in backend.launchers_for_determinism():
        dev = [backend.to_device(a) for a in (q, k_, v, do)]
        o, lse = k.attention_forward(*dev[:3], 0.125)
        grads = k.attention_backward(dev[3], *dev[:3], o, lse, 0.125)
        results.append([bits(backend.host(a)) for a in (o, lse, *grads)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


# ---- the launchers -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_forward_allocates_only_o_and_lse(backend, dtype):
    k = backend.launchers()
    q, k_, v, _ = attention_inputs(1, 2, 2, 40, 40, 64, dtype)
    dev = [backend.to_device(a) for a in (q, k_, v)]
    before = k.xp.allocated
    o, lse = k.attention_forward(*dev, 0.125)
    assert k.xp.allocated - before == 2, "the forward allocates o and the log-sum-exp, nothing else"
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:4] and lse.dtype == np.float32
    # o is a view of token-major memory: merging the heads is free
    assert o.transpose(0, 3, 1, 2, 4).reshape(1, 40, -1).base is not None or o.base is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_strided_operands_and_packed_gradients(backend, k, dtype):
    """q, k, v as views of one fused QKV output [B, T, (nq + 2 nkv) hd] (ParallelAttention's
    layout), do as a view of a token-major gradient; dq, dk, dv written into one packed buffer."""
    B, T, Hkv, G, D = 2, 37, 2, 2, 64
    nq = Hkv * G
    qkv = randn((B, T, (nq + 2 * Hkv) * D), dtype, seed=3)
    dtok = randn((B, T, nq * D), dtype, seed=4)

    def split(a):
        q = a[..., : nq * D].reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4)
        k_ = a[..., nq * D:(nq + Hkv) * D].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
        v = a[..., (nq + Hkv) * D:].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
        return q, k_, v

    q, k_, v = split(qkv)
    do = dtok.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4)
    dev_qkv, dev_tok = backend.to_device(qkv), backend.to_device(dtok)
    dq_, dk_, dv_ = split(dev_qkv)
    o, lse = k.attention_forward(dq_, dk_, dv_, 0.125)
    packed = k.xp.zeros(qkv.shape, qkv.dtype)
    out = split(packed)
    got = k.attention_backward(dev_tok.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4), dq_, dk_, dv_, o, lse,
                               0.125, out=out)
    assert all(a is b for a, b in zip(got, out))
    o_ref, _, grads_ref = reference(*(np.ascontiguousarray(a) for a in (q, k_, v, do)), 0.125)
    assert normwise_error(backend.host(o), o_ref) <= TOL[dtype]
    host = backend.host(packed)
    for got_part, want in zip(split(host), grads_ref):
        assert normwise_error(got_part, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("Tq,Tk", [(1, 70), (30, 100), (64, 65)])
def test_fewer_queries_than_keys(backend, k, dtype, Tq, Tk):
    """Query row i at position Tk - Tq + i (a KV cache's last rows): the kernels' causal rule."""
    check_against_reference(k, backend, *attention_inputs(1, 1, 2, Tq, Tk, 64, dtype, seed=Tq), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_scores_far_apart(backend, k, dtype):
    """Scores of hundreds, growing along the keys: each key tile raises the running max, and the
    first tiles' contributions underflow to zero after rescaling (m must start at -inf, alpha =
    exp(m_old - m_new))."""
    q, k_, v, do = attention_inputs(1, 1, 2, 150, 150, 64, dtype, seed=11)
    k_ = (k_.astype(np.float32) * np.linspace(0.5, 8.0, 150)[None, None, :, None]).astype(dtype)
    check_against_reference(k, backend, q * np.asarray(4.0, dtype), k_, v, do, dtype)


def test_refusals(backend, k):
    x = backend.to_device(randn((1, 1, 1, 8, 96), F32))
    kv = backend.to_device(randn((1, 1, 8, 96), F32))
    with pytest.raises(KernelArgumentError, match="head dims"):
        k.attention_forward(x, kv, kv, 0.1)
    q = backend.to_device(randn((1, 1, 1, 8, 64), F32))
    kk = backend.to_device(randn((1, 1, 8, 64), BF16))
    with pytest.raises(KernelArgumentError, match="one dtype"):
        k.attention_forward(q, kk, kk, 0.1)
    with pytest.raises(KernelArgumentError, match="Tq <= Tk"):
        k.attention_forward(backend.to_device(randn((1, 1, 1, 9, 64), F32)),
                            backend.to_device(randn((1, 1, 8, 64), F32)), backend.to_device(randn((1, 1, 8, 64), F32)),
                            0.1)
    with pytest.raises(KernelArgumentError, match="contiguous head dim"):
        q2 = backend.to_device(randn((1, 1, 1, 8, 128), F32))[..., ::2]
        kv2 = backend.to_device(randn((1, 1, 8, 64), F32))
        k.attention_forward(q2, kv2, kv2, 0.1)


def test_empty(backend, k):
    q = backend.to_device(np.zeros((0, 1, 2, 5, 64), np.float32))
    kv = backend.to_device(np.zeros((0, 1, 5, 64), np.float32))
    o, lse = k.attention_forward(q, kv, kv, 0.1)
    assert o.shape == q.shape and lse.shape == (0, 1, 2, 5)
    dq, dk, dv = k.attention_backward(q, q, kv, kv, o, lse, 0.1)
    assert dq.shape == q.shape and dk.shape == kv.shape


def test_shared_memory_fits_the_devices():
    """Every block's dynamic shared memory within sm_80's opt-in limit (163 KiB), and the tile
    rows a multiple of a warp's 16-row band."""
    for kernel in ("forward", "backward_dq", "backward_dkdv"):
        for D, DV in ATTENTION_HEAD_DIMS:  # (64, 64), (128, 128), MLA's (192, 128)
            assert attention_tile_rows(kernel, D) % 16 == 0
            for dtype in DTYPES:
                assert attention_shared_bytes(kernel, dtype, D, DV) <= 166_912, (kernel, D, DV, dtype)


# ---- the array-code reference ---------------------------------------------------------------------
@pytest.mark.parametrize("Tq,Tk,G,tile,p", [(1, 1, 1, 64, 0.0), (17, 17, 2, 64, 0.0), (130, 130, 4, 64, 0.0),
                                            (40, 90, 2, 16, 0.0), (65, 65, 1, 8, 0.0), (70, 70, 2, 16, 0.3),
                                            (30, 45, 1, 64, 0.5)])
def test_flash_reference_is_the_formula(Tq, Tk, G, tile, p):
    """flash_attention_forward/backward (tiles, online softmax, recomputation, dropout of the
    probabilities) equal the plain formula and the plain op's gradients in float64."""
    q, k, v, do = (a.astype(np.float64) for a in attention_inputs(2, 2, G, Tq, Tk, 16, F32, seed=Tq))
    drop = dict(dropout_p=p, seed=3, offset=[7, 10 ** 6])
    o, lse = ops.flash_attention_forward(q, k, v, tile=tile, **drop)
    np.testing.assert_allclose(o, ops.causal_attention_reference(q, k, v, **drop), rtol=1e-12, atol=1e-12)
    _, ctx = ops.causal_attention_forward(q, k, v, blocked=False, **drop)
    want = ops.causal_attention_backward(do, ctx)
    for got, w in zip(ops.flash_attention_backward(do, q, k, v, o, lse, tile=tile, **drop), want):
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)


# ---- the op and the model on the fused kernels ----------------------------------------------------
@pytest.fixture
def fused_attention(backend, monkeypatch):
    """cutp.ops.causal_attention_* dispatching to the fused kernels: under the emulator NumPy
    arrays stand in for CuPy arrays (the GPU's rule applied to them); returns the launchers."""
    if not backend.emulated:
        return None
    launchers = backend.launchers("random", 5)

    def dispatch(*arrays):  # kernels.dispatch_views's rule, NumPy standing in for CuPy
        arrays = [a for a in arrays if a is not None]
        ok = arrays and all(isinstance(a, np.ndarray) for a in arrays)
        return launchers if ok and kernels.kernels_enabled() else None

    monkeypatch.setattr(attention_op, "_attention_kernels", dispatch)
    monkeypatch.setattr(attention_op, "_UNFUSED_WARNED", set())
    return launchers


def _gpt_loss_and_grads(ctx, cfg, ids, targets, recompute="none"):
    model = GPT(ctx, cfg, seed=21)
    model.set_recompute(recompute)
    loss = model.forward(ctx.asarray(ids), ctx.asarray(targets))
    model.backward()
    return loss, {p.name: ctx.to_numpy(p.grad).astype(np.float64) for p in model.parameters()}, model


@pytest.mark.parametrize("recompute,dropout", [("none", 0.0), ("selective", 0.0), ("selective", 0.1)])
def test_gpt_forward_backward_with_the_fused_attention(backend, fused_attention, recompute, dropout):
    """A 2-layer GPT (head dim 64, 40 tokens: not a multiple of the tile; with and without
    dropout) through the fused kernels equals the unfused attention within float32's tolerance;
    with selective recomputation the fused context (o and the log-sum-exp) is kept instead of
    recomputing the attention."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=64, block_size=40, dropout=dropout)
    ctx = cutp.init(comm=MPI.COMM_SELF, tp=1, device=backend.device)
    ids = np.random.default_rng(1).integers(0, 64, (2, 40))
    targets = np.random.default_rng(2).integers(0, 64, (2, 40))
    try:
        loss_f, grads_f, model = _gpt_loss_and_grads(ctx, cfg, ids, targets, recompute)
        if fused_attention is not None:
            launched = {name.rsplit("_", 2)[0] for name in fused_attention.launches}
            assert {"attention_forward", "attention_backward_dq", "attention_backward_dkdv"} <= launched
            # selective recomputation ran no second forward: the fused context was kept
            assert fused_attention.launches["attention_forward_f32_d64"] == cfg.n_layer
        with kernels.use_kernels(False):
            loss_u, grads_u, _ = _gpt_loss_and_grads(ctx, cfg, ids, targets, recompute)
    finally:
        ctx.close()
    assert abs(loss_f - loss_u) <= 1e-5 * abs(loss_u)
    for name, g in grads_u.items():
        assert normwise_error(grads_f[name], g) <= 1e-5, name


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_the_op_on_the_fused_kernels_equals_the_plain_path(backend, fused_attention, dropout_p):
    """causal_attention_forward/backward dispatch to the fused kernels (nothing T x T in the
    context), with the plain path's dropout masks (per-row offsets as ParallelAttention draws)."""
    q, k_, v, do = (backend.to_device(a) for a in attention_inputs(2, 1, 2, 30, 30, 64, F32))
    drop = dict(dropout_p=dropout_p, seed=4, offset=[10, 50_000])
    o, ctx = ops.causal_attention_forward(q, k_, v, **drop)
    assert ctx.fused and ctx.probs is None and ctx.softmax is None
    o_u, ctx_u = ops.causal_attention_forward(q, k_, v, fused=False, **drop)
    assert not ctx_u.fused
    assert normwise_error(backend.host(o), backend.host(o_u)) <= 1e-5
    for got, want in zip(ops.causal_attention_backward(do, ctx), ops.causal_attention_backward(do, ctx_u)):
        assert normwise_error(backend.host(got), backend.host(want)) <= 1e-5


def test_other_head_dims_run_unfused_with_one_warning(backend, fused_attention):
    q2 = backend.to_device(randn((1, 1, 1, 8, 32), F32))
    kv2 = backend.to_device(randn((1, 1, 8, 32), F32))
    with pytest.warns(UserWarning, match="head dims"):
        o, ctx = ops.causal_attention_forward(q2, kv2, kv2)
    assert not ctx.fused and o.shape == q2.shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        ops.causal_attention_forward(q2, kv2, kv2)
    with pytest.raises(ValueError, match="head dims"):
        ops.causal_attention_forward(q2, kv2, kv2, fused=True)
    # float64 (and float16) on the device: the unfused path, saying why
    q3, kv3 = (backend.to_device(randn(shape, F32).astype(np.float64)) for shape in ((1, 1, 1, 8, 64), (1, 1, 8, 64)))
    with pytest.warns(UserWarning, match="float32 or bfloat16"):
        _, ctx = ops.causal_attention_forward(q3, kv3, kv3)
    assert not ctx.fused


def test_the_mma_header_is_found_or_named(tmp_path):
    """NVRTC's tensor-core sources need crt/mma.h: found in the CUDA include directory, else a
    KernelLoadError naming the wheels to install."""
    (tmp_path / "inc" / "crt").mkdir(parents=True)
    (tmp_path / "inc" / "crt" / "mma.h").write_text("")
    assert find_mma_include(str(tmp_path / "inc"), candidates=[]) == str(tmp_path / "inc")
    with pytest.raises(KernelLoadError, match="nvidia-cuda-crt"):
        find_mma_include(str(tmp_path / "none"), candidates=[(str(tmp_path), "x")])


# ---- review (attn-review): what a GPU would expose and the emulated launches above do not ----------
def _recording_launchers():
    """Launchers over a stand-in module that records (kernel, grid) and runs nothing: launch
    configurations at shapes far too large to emulate."""
    launches = []

    class Function:
        shared_size_bytes = 0

        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0):
            launches.append((self.name, tuple(grid)))

    class Module:
        def get_function(self, name):
            return Function(name)

    return Launchers(lambda name: Module(), np, description="recording"), launches


@pytest.mark.parametrize("B,Hkv,G", [(512, 128, 1), (256, 32, 8)])
def test_launch_grids_within_cudas_limits(B, Hkv, G):
    """CUDA caps gridDim.y (and z) at 65535: 512 sequences x 128 heads (65,536 blocks per query
    tile) must not put the heads on y, or every attention launch fails on a GPU
    (cudaErrorInvalidConfiguration). T = 1 keeps the arrays small; nothing runs."""
    from tests.cuda_emu import MAX_GRID_DIM

    k, launches = _recording_launchers()
    q = np.zeros((B, Hkv, G, 1, 64), np.float32)
    kv = np.zeros((B, Hkv, 1, 64), np.float32)
    o, lse = k.attention_forward(q, kv, kv, 0.125)
    k.attention_backward(q, q, kv, kv, o, lse, 0.125)
    assert {name.rsplit("_", 2)[0] for name, _ in launches} >= {"attention_forward", "attention_backward_dq",
                                                                "attention_backward_dkdv"}
    for name, grid in launches:
        for dim, (g, limit) in enumerate(zip(grid, MAX_GRID_DIM)):
            assert g <= limit, f"{name}: grid dimension {'xyz'[dim]} = {g} over CUDA's limit {limit}"


def test_the_op_takes_do_and_out_of_any_layout_on_the_fused_kernels(backend, fused_attention):
    """causal_attention_backward promises do and out of any strides (and writes out like the
    plain path, dst[...] = grad): the fused path must not refuse a do or an out whose head dim
    is not contiguous (KernelArgumentError), but lay them out for the kernels."""
    q, k_, v, _ = (backend.to_device(a) for a in attention_inputs(1, 1, 2, 20, 20, 64, F32, seed=2))
    do = backend.to_device(randn((1, 1, 2, 20, 128), F32, seed=8))[..., ::2]  # head dim stride 2
    _, ctx = ops.causal_attention_forward(q, k_, v)
    _, ctx_u = ops.causal_attention_forward(q, k_, v, fused=False)
    assert ctx.fused
    want = ops.causal_attention_backward(do, ctx_u)
    got = ops.causal_attention_backward(do, ctx)
    for g, w in zip(got, want):
        assert normwise_error(backend.host(g), backend.host(w)) <= 1e-5
    out = tuple(backend.xp.zeros(a.shape[:-1] + (128,), np.float32)[..., ::2] for a in (q, k_, v))
    res = ops.causal_attention_backward(do, ctx, out=out)
    assert all(r is o for r, o in zip(res, out))
    for g, w in zip(out, want):
        assert normwise_error(backend.host(g), backend.host(w)) <= 1e-5


# ---- mutation-testing gaps (tools/mutate_kernels.py --only attention.cu) -------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_scores_far_below_zero(backend, k, dtype):
    """Every score of every row near -128 (keys along one direction u, queries along -u; small
    dyadic values, so q k^T is exact in float32 and bfloat16): exp(s) underflows to 0 in float32,
    so the online softmax's max must start at -inf (m = 0 or a tile max of 0 gives l = 0: o and
    the log-sum-exp not finite). Two key tiles of the forward."""
    _, _, v, do = attention_inputs(1, 1, 1, 70, 70, 64, dtype, seed=13)
    rng = np.random.default_rng(14)
    u = rng.choice([-1.0, 1.0], 64)
    k_ = (u + rng.integers(-2, 3, (1, 1, 70, 64)) / 16.0).astype(dtype)  # scores -128 +- a few
    q = np.ascontiguousarray(np.broadcast_to(-16.0 * u, (1, 1, 1, 70, 64)), dtype=dtype)
    check_against_reference(k, backend, q, k_, v, do, dtype)


def exp_probe_inputs(Hkv, G, D, DV, hidden=0):
    """Scores whose probabilities come each from one exp of a large negative argument, in separate
    output columns (issue 42's element-wise class for the attention: float32 probabilities within
    a few ulps, as expf gives them, where a fast-math __expf is off by up to 2 + 1.16 |x| ulps).
    Three query rows at positions 63, 64, 65 of 66 keys (two key tiles): keys 1..63 at score
    -1000 c (probability exactly 0); key 0 at gap_a c, key 64 at 0, key 65 at gap_b c (gaps in
    [-24, -16], per KV head; c per query head). Row 65's running max grows from gap_a c to 0 in
    the second tile: its o = (alpha e0 + e1 + p65 e2) / l with alpha = exp(gap_a c) (the
    rescale's exp) and p65 = exp(gap_b c) (the probability's); the backward's recomputed
    probabilities exp(x - lse) reach dv of keys 0 and 65 (dO rows one-hot in their own columns)
    and dq, dk. Every product is exact (dyadic values), lse is below half an ulp of the scores.
    hidden > 0: keys 0..hidden-1 at score 0 (as heavy as key 64: a mask must hide them), key
    hidden + 2 in key 0's place (keys hidden, hidden + 1 at -1000 c: a window's edge)."""
    e = np.eye(max(D, DV))
    gap_a = -16.0 - np.arange(Hkv)
    gap_b = -16.5 - np.arange(Hkv)[::-1]
    probe = hidden + 2 if hidden else 0
    k = np.zeros((1, Hkv, 66, D))
    k[0, :, hidden:64] = -1000.0 * e[0, :D]
    k[0, :, probe] = gap_a[:, None] * e[0, :D]
    k[0, :, 65] = gap_b[:, None] * e[0, :D]
    c = 1.0 + 0.125 * np.arange(G)
    q = np.broadcast_to((c[:, None] * e[0, :D])[None, None, :, None, :], (1, Hkv, G, 3, D)).copy()
    v = np.zeros((1, Hkv, 66, DV))
    v[0, :, probe], v[0, :, 64], v[0, :, 65] = e[0, :DV], e[1, :DV], e[2, :DV]
    do = np.zeros((1, Hkv, G, 3, DV))
    do[..., 0, :], do[..., 1, :], do[..., 2, :] = e[3, :DV], e[4, :DV], e[0, :DV]
    return tuple(a.astype(F32) for a in (q, k, v, do))


def test_probabilities_within_ulps_of_expf(backend, fast):
    """o, dq, dk, dv element by element within 8 float32 ulps (+ 2^-140) of the float64 formula
    on exp_probe_inputs, in all three tile kernels (the forward's probabilities and rescale, the
    backward's recomputed probabilities; the kernels' templates are one code at every head dim:
    MLA's here; the unchecked build, as the grid's): a normwise bound lets a fast-math exp through."""
    q, k_, v, do = exp_probe_inputs(4, 2, 192, 128)
    dev = [backend.to_device(a) for a in (q, k_, v, do)]
    o, lse = fast.attention_forward(*dev[:3], 1.0)
    grads = fast.attention_backward(dev[3], *dev[:3], o, lse, 1.0)
    want_o = ops.causal_attention_reference(*(a.astype(np.float64) for a in (q, k_, v)), scale=1.0)
    _, ctx = ops.causal_attention_forward(*(a.astype(np.float64) for a in (q, k_, v)), scale=1.0, blocked=False)
    want = ops.causal_attention_backward(do.astype(np.float64), ctx)
    assert want_o[..., 2, 0].max() > 1e-12 and want[2][:, :, 0, 0].min() > 1e-12  # the probes are not 0
    assert_probes_within_ulps(backend, (o, *grads), (want_o, *want))


def assert_probes_within_ulps(backend, got, want):
    """o, dq, dk, dv (device) element by element within 8 float32 ulps (+ 2^-140) of the float64
    `want` on exp_probe_inputs."""
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        g = backend.host(g).astype(np.float64)
        bad = np.abs(g - w) > 8 * ulp(w, F32) + 2.0 ** -140
        assert not bad.any(), (f"{name}: {int(bad.sum())} elements off by more than 8 ulps, e.g. "
                               f"{g[bad][:3]} vs {w[bad][:3]}")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_planner_books_what_the_fused_attention_allocates(unchecked_module, dropout):
    """`cutp plan` runs the fused attention's launchers on shape-only GPU arrays: what their heap
    books is what the launchers allocate, measured on the emulated kernels at the same shapes (GQA,
    2 KV heads of 2 query heads of 64): the forward keeps o and the log-sum-exp (the dropout
    offsets are transient), the backward, writing into the caller's dqkv, only the rows' sum(do *
    o) (and the offsets), in CuPy's 512-byte pool granularity."""
    B, T, Hkv, G, D = 2, 48, 2, 2, 64
    drop = (dropout, 3, [0, 10 ** 6])
    xp = ShapeOnly("cuda")
    planned = shape_only_launchers(xp)
    q, k_, v, do = (xp.empty(a.shape, a.dtype) for a in attention_inputs(B, Hkv, G, T, T, D, F32))
    heap = xp.heap
    start = heap.cur
    heap.reset_peak()
    o, lse = planned.attention_forward(q, k_, v, 0.125, *drop)
    planned_kept, planned_fwd_peak = heap.cur - start, heap.peak - start
    grads = tuple(xp.empty_like(a) for a in (q, k_, v))
    heap.reset_peak()
    planned.attention_backward(do, q, k_, v, o, lse, 0.125, grads, *drop)
    planned_bwd_temp = heap.peak - heap.cur

    rec = RecordingAllocations()
    k = Launchers(lambda name: unchecked_module, rec)
    q, k_, v, do = attention_inputs(B, Hkv, G, T, T, D, F32)
    o, lse = k.attention_forward(q, k_, v, 0.125, *drop)
    size = heap.size
    assert planned_kept == size(o.nbytes) + size(lse.nbytes)
    assert planned_fwd_peak == sum(size(n) for n in rec.nbytes)
    rec.nbytes.clear()
    k.attention_backward(do, q, k_, v, o, lse, 0.125, (np.empty_like(q), np.empty_like(k_), np.empty_like(v)), *drop)
    assert planned_bwd_temp == sum(size(n) for n in rec.nbytes) > 0