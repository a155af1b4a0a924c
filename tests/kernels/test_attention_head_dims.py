"""kernels/attention.cu with a value head dim other than the query/key one (MLA: DeepSeek-V3's
q, k of 128 + 64 rotary = 192 and v of 128; entry points *_d192v128), against the float64
reference of test_attention_mask.py (the mask rule's formula with v's own head dim), on each
backend.

Entry points (each launched by the tests below): attention_forward_f32_d192v128,
attention_forward_bf16_d192v128, attention_backward_dq_f32_d192v128,
attention_backward_dq_bf16_d192v128, attention_backward_dkdv_f32_d192v128,
attention_backward_dkdv_bf16_d192v128 (their rowdot: attention_backward_rowdot_*_d128).

* Two query tiles and two key tiles of 32 rows, GQA, the mask rule (window, documents, soft cap,
  Tq < Tk), dropout, float32 and bfloat16 (the emulated tensor cores), on the checked build
  (races, bounds of every access: a tile of D columns where DV belong overruns).
* A ring tile's launch (float32 outputs added to, rowdot of the merged o) at these head dims.
* The array-code mirrors (flash_attention_forward / _backward) with v's head dim smaller and
  larger than q's, in float64 against the reference.
* The op: (192, 128) runs fused; a pair without kernels runs unfused with the reason, and the
  launchers refuse it.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops
from cutp.kernels import KernelArgumentError
from cutp.kernels.attention import fused_attention_supported
from cutp.ops import attention_tiles as tiles

from .helpers import BF16, DT_IDS, DTYPES, F32, gpu_sized, randn
from .test_attention import TOL, fused_attention, normwise_error  # noqa: F401 (a fixture)
from .test_attention_mask import docs_from_starts, reference, reference_mask, run_kernels

f64 = np.float64


def mla_inputs(B, Hkv, G, Tq, Tk, D, DV, dtype, seed=0):
    """q [B, Hkv, G, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, DV], do [B, Hkv, G, Tq, DV]."""
    return (randn((B, Hkv, G, Tq, D), dtype, seed=seed), randn((B, Hkv, Tk, D), dtype, seed=seed + 1),
            randn((B, Hkv, Tk, DV), dtype, seed=seed + 2), randn((B, Hkv, G, Tq, DV), dtype, seed=seed + 3))


DOCS_70 = docs_from_starts(70, [0, 20, 21, 32, 50])[None]
CASES = {  # name: ((B, Hkv, G, Tq, Tk), mask keywords, dropout); D, DV = 192, 128
    "gqa-T40": ((1, 1, 2, 40, 40), {}, (0.0, 0, 0)),
    "window-documents-dropout-T70": ((1, 1, 1, 70, 70), dict(window=37, documents=(DOCS_70, DOCS_70)),
                                     (0.2, 7, [100])),
    "softcap-kvcache-20x50": ((2, 1, 1, 20, 50), dict(softcap=2.0), (0.0, 0, 0)),
}
# MLA's own layout (a KV head per query head: Hkv = H, G = 1) at a GPU's size: the cuda backend only
CASES["mla-16-heads-T1024"] = ((1, 16, 1, 1024, 1024), dict(window=700), (0.1, 3, [5]))
_RUNS = [(name, F32) for name in CASES if name != "mla-16-heads-T1024"] + [
    ("gqa-T40", BF16), ("window-documents-dropout-T70", BF16), ("mla-16-heads-T1024", F32), ("mla-16-heads-T1024", BF16)]
KERNEL_CASES = [(gpu_sized if n == "mla-16-heads-T1024" else pytest.param)(n, d, id=f"{n}-{DT_IDS[DTYPES.index(d)]}")
                for n, d in _RUNS]


def run_case(kern, backend, name, dtype, D=192, DV=128):
    shape, mask_kw, drop = CASES[name]
    B, Hkv, G, Tq, Tk = shape
    q, k_, v, do = mla_inputs(*shape, D, DV, dtype, seed=Tq + Tk)
    scale = 1.0 / np.sqrt(D)
    o, lse, grads = run_kernels(kern, backend, q, k_, v, do, scale, mask_kw, drop)
    assert o.shape == (B, Hkv, G, Tq, DV)
    mask = reference_mask(B, Tq, Tk, window=mask_kw.get("window"), documents=mask_kw.get("documents"))
    o_ref, lse_ref, grads_ref = reference(q, k_, v, do, scale, mask, mask_kw.get("softcap"), drop)
    assert normwise_error(backend.host(o), o_ref) <= TOL[dtype], "o"
    assert normwise_error(backend.host(lse), lse_ref) <= 1e-6, "lse"
    for gname, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        err = normwise_error(backend.host(got), want)
        assert err <= TOL[dtype], f"{gname}: normwise error {err:.2e}"


@pytest.mark.parametrize("name,dtype", KERNEL_CASES)
def test_mla_head_dims_on_the_kernels(backend, k, dtype, name):
    run_case(k, backend, name, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_mla_head_dims_under_each_schedule(backend, ks, dtype):
    """The checked build under each thread schedule (races on the V / dO tiles of DV columns)."""
    run_case(ks, backend, "softcap-kvcache-20x50", dtype)


def test_a_ring_tile_at_mla_head_dims(backend, k):
    """One full ring tile of bf16 inputs: float32 o, then the backward adding float32 dq, dk, dv
    (dv of v's head dim) to the accumulators, with the merged result's rowdot and the sequence's
    dropout counters."""
    B, Hkv, G, c, D, DV = 1, 1, 2, 24, 192, 128
    T, pos, scale = 3 * c, (2 * c, 0), 0.1
    q, kk, v, do = mla_inputs(B, Hkv, G, c, c, D, DV, BF16, seed=8)
    dropout, drop, strides = (0.25, 5, [11], T), (0.25, 5, [11]), (T * T, T)
    dev = backend.to_device
    o, lse = k.attention_forward(dev(q), dev(kk), dev(v), scale, *drop, q_first=pos[0], k_first=pos[1],
                                 drop_strides=strides, out_dtype=np.float32)
    q64, k64, v64, do64 = (np.asarray(a, f64) for a in (q, kk, v, do))
    o_ref, lse_ref = tiles.tile_forward(q64, k64, v64, scale, pos, dropout)
    assert o.dtype == np.float32 and normwise_error(backend.host(o), o_ref) <= TOL[BF16]
    rowdot = (np.asarray(do, np.float32) * backend.host(o)).sum(axis=-1)
    start = [randn(a.shape, F32, seed=30 + i) for i, a in enumerate((q, kk, v))]
    out = tuple(dev(s.copy()) for s in start)
    k.attention_backward(dev(do), dev(q), dev(kk), dev(v), None, lse, scale, out, *drop, rowdot=dev(rowdot),
                         q_first=pos[0], k_first=pos[1], drop_strides=strides, accumulate=True)
    want = tiles.tile_backward(do64, q64, k64, v64, rowdot.astype(f64), lse_ref, scale, pos, dropout)
    for name, got, s, w in zip(("dq", "dk", "dv"), out, start, want):
        assert normwise_error(backend.host(got) - s, w) <= TOL[BF16], name


# ---- the array-code mirrors, the op, the launchers' refusals ------------------------------------------
@pytest.mark.parametrize("D,DV", [(24, 16), (16, 24)], ids=["dv<d", "dv>d"])
def test_the_flash_mirrors_with_another_value_head_dim(D, DV):
    """flash_attention_forward / _backward (the kernels' algorithm in array code) equal the
    reference in float64 with v's head dim below and above q's (deepseek-tiny's 24 and 16), at
    tile 16 under a window, documents and dropout."""
    shape, mask_kw, drop = CASES["window-documents-dropout-T70"]
    B, Hkv, G, Tq, Tk = shape
    q, k, v, do = (a.astype(f64) for a in mla_inputs(*shape, D, DV, F32, seed=3))
    kw = dict(mask_kw, dropout_p=drop[0], seed=drop[1], offset=drop[2], softcap=1.5)
    o, lse = ops.flash_attention_forward(q, k, v, 0.3, tile=16, **kw)
    grads = ops.flash_attention_backward(do, q, k, v, o, lse, 0.3, tile=16, **kw)
    mask = reference_mask(B, Tq, Tk, window=mask_kw["window"], documents=mask_kw["documents"])
    o_ref, lse_ref, grads_ref = reference(q, k, v, do, 0.3, mask, 1.5, drop)
    assert o.shape == (B, Hkv, G, Tq, DV)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, grads_ref):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_the_op_runs_mla_head_dims_fused(backend, fused_attention):
    """causal_attention_forward / _backward at (192, 128) run the fused kernels (o of v's head
    dim); (128, 64), which no entry point takes, runs unfused, saying why, and equals the
    reference too; the launchers refuse it by name."""
    q, k_, v, do = mla_inputs(1, 1, 1, 33, 33, 192, 128, F32, seed=4)
    dev = [backend.to_device(a) for a in (q, k_, v, do)]
    o, ctx = ops.causal_attention_forward(*dev[:3], window=20)
    assert ctx.fused and o.shape == (1, 1, 1, 33, 128)
    grads = ops.causal_attention_backward(dev[3], ctx)
    mask = reference_mask(1, 33, 33, window=20)
    o_ref, _, grads_ref = reference(q, k_, v, do, 1.0 / np.sqrt(192), mask)
    assert normwise_error(backend.host(o), o_ref) <= TOL[F32]
    for got, want in zip(grads, grads_ref):
        assert normwise_error(backend.host(got), want) <= TOL[F32]

    q2, k2, v2, do2 = mla_inputs(1, 1, 1, 8, 8, 128, 64, F32, seed=5)
    dev2 = [backend.to_device(a) for a in (q2, k2, v2, do2)]
    assert "(128, 64)" in fused_attention_supported(q2, k2, v2)
    with pytest.warns(UserWarning, match=r"head dims .*got \(128, 64\)"):
        o2, ctx2 = ops.causal_attention_forward(*dev2[:3])
    assert not ctx2.fused
    o_ref2, _, grads_ref2 = reference(q2, k2, v2, do2, 1.0 / np.sqrt(128), reference_mask(1, 8, 8))
    assert normwise_error(backend.host(o2), o_ref2) <= 1e-6
    for got, want in zip(ops.causal_attention_backward(dev2[3], ctx2), grads_ref2):
        assert normwise_error(backend.host(got), want) <= 1e-6
    if fused_attention is not None:
        with pytest.raises(KernelArgumentError, match=r"got \(128, 64\)"):
            fused_attention.attention_forward(*dev2[:3], 0.1)


def test_mla_launcher_refusals(backend, k):
    q, k_, v, do = (backend.to_device(a) for a in mla_inputs(1, 1, 1, 8, 8, 192, 128, F32))
    with pytest.raises(KernelArgumentError, match=r"v \[B, Hkv, Tk, DV\]"):
        k.attention_forward(q, k_, backend.to_device(randn((1, 1, 7, 128), F32)), 0.1)
    o, lse = k.attention_forward(q, k_, v, 0.1)
    with pytest.raises(KernelArgumentError, match=r"do must be .* o's shape \(1, 1, 1, 8, 128\)"):
        k.attention_backward(q, q, k_, v, o, lse, 0.1)

