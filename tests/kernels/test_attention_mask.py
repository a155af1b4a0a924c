"""kernels/attention.cu under the whole attention mask rule (issues 37 and 38): a query at global
index p sees a key at s iff s <= p, and with a window s > p - window, and with documents both
carry the same id; soft-capping scores = cap * tanh(scale q.k / cap) before the mask and the
softmax. Against a plain float64 reference written here from that rule (einsum, softmax, the
formula's gradients; the reference itself checked by finite differences), on each backend.

* Windows not a multiple of the tile, tails (T not a multiple of the tile), GQA, bf16, dropout,
  the KV-cache offset (Tq < Tk), ring tiles (q_first / k_first of two chunks; rows that see no key
  of the tile: o = 0, lse = -inf), documents with boundaries inside tiles and at tile edges and
  one-token documents, soft-capping with and without a window, head dims 64 and 128 (the
  backward's 32-row tiles).
* Tiles outside the window or the documents are skipped, not masked: NaN in keys, values or
  queries no row of a tile can meet leaves that tile's results finite and right.
* flash_attention_forward / _backward (the kernels' algorithm in array code) against the
  reference in float64; the launchers' (diag, window) normalisation against brute force; the
  op's dispatch with the mask; refusals.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cutp import ops
from cutp.kernels import KernelArgumentError
from cutp.kernels.attention import mask_band
from cutp.ops.dropout import dropout_mask

from .helpers import BF16, CUDA_ULPS, DT_IDS, DTYPES, F32, float32_formula_bound
from .test_attention import (TOL, assert_probes_within_ulps, attention_inputs, exp_probe_inputs,  # noqa: F401
                             fused_attention, normwise_error)  # (fused_attention: a fixture)

f64 = np.float64


# ---- the reference ---------------------------------------------------------------------------------
def reference_mask(B, Tq, Tk, q_first=None, k_first=None, window=None, documents=None):
    """visible [B, 1, 1, Tq, Tk] by the rule, from global indices: query row i at q_first + i
    (default Tk - Tq), key j at k_first + j (default 0)."""
    p = ((Tk - Tq if q_first is None else q_first) + np.arange(Tq))[:, None]
    s = ((0 if k_first is None else k_first) + np.arange(Tk))[None, :]
    vis = s <= p
    if window is not None:
        vis = vis & (s > p - window)
    vis = np.broadcast_to(vis, (B, 1, 1, Tq, Tk))
    if documents is not None:
        qd, kd = (np.asarray(d) for d in documents)
        vis = vis & (qd[:, None, None, :, None] == kd[:, None, None, None, :])
    return vis


def dropout_factors(shape, drop):
    """The probabilities' keep-mask / (1 - p) (dropout_forward_rows's masks, batch row b at
    counter offsets[b]); 1 without dropout."""
    p, seed, offsets = drop
    if not p:
        return 1.0
    rows = offsets if isinstance(offsets, (list, tuple)) else [offsets + b * int(np.prod(shape[1:]))
                                                               for b in range(shape[0])]
    return np.stack([dropout_mask(np, shape[1:], p, seed, o) for o in rows]) * (0.0 if p == 1 else 1.0 / (1.0 - p))


def reference(q, k, v, do, scale, mask, softcap=None, drop=(0.0, 0, 0)):
    """float64 (o, lse, (dq, dk, dv)) of softmax(masked capped scores) (times the dropout
    factors) v; a row that sees no key: o = 0, lse = -inf."""
    q, k, v, do = (np.asarray(a, f64) for a in (q, k, v, do))
    raw = np.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    t = np.tanh(raw / softcap) if softcap else None
    x = np.where(mask, softcap * t if softcap else raw, -np.inf)
    seen = mask.any(axis=-1, keepdims=True)
    m = np.where(seen, x.max(axis=-1, keepdims=True), 0.0)
    e = np.exp(x - m)
    total = np.where(seen, e.sum(axis=-1, keepdims=True), 1.0)
    P = e / total
    lse = np.where(seen, m + np.log(total), -np.inf)[..., 0]
    F = dropout_factors(P.shape, drop)
    o = np.einsum("bhgqk,bhkd->bhgqd", P * F, v)
    dv = np.einsum("bhgqk,bhgqd->bhkd", P * F, do)
    dpf = np.einsum("bhgqd,bhkd->bhgqk", do, v) * F
    dx = P * (dpf - (P * dpf).sum(axis=-1, keepdims=True))
    draw = dx * scale * ((1.0 - t * t) if softcap else 1.0)
    return o, lse, (np.einsum("bhgqk,bhkd->bhgqd", draw, k), np.einsum("bhgqk,bhgqd->bhkd", draw, q), dv)


def test_the_reference_gradients_are_the_derivatives():
    """The reference's formula gradients against central differences of sum(o * do), float64,
    with a window, documents and a soft cap (a row of one key, one-token documents)."""
    q, k, v, do = (a.astype(f64) for a in attention_inputs(1, 1, 2, 6, 6, 3, F32, seed=1, scale=2.0))
    docs = np.array([[0, 0, 1, 2, 2, 2]], np.int32)
    mask = reference_mask(1, 6, 6, window=2, documents=(docs, docs))
    kw = dict(scale=0.7, mask=mask, softcap=1.5)
    _, _, grads = reference(q, k, v, do, **kw)
    for name, a, g in zip("qkv", (q, k, v), grads):
        num = np.zeros_like(a)
        for idx in itertools.product(*map(range, a.shape)):
            saved = a[idx]
            a[idx] = saved + 1e-6
            hi = (reference(q, k, v, do, **kw)[0] * do).sum()
            a[idx] = saved - 1e-6
            lo = (reference(q, k, v, do, **kw)[0] * do).sum()
            a[idx] = saved
            num[idx] = (hi - lo) / 2e-6
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8, err_msg=f"d{name}")


# ---- cases ------------------------------------------------------------------------------------------
def docs_from_starts(T, starts):
    """int32 ids [T] of documents starting at the given indices (0 first)."""
    ids = np.zeros(T, np.int32)
    for s in starts[1:]:
        ids[s:] += 1
    return ids


def packed(B, T, *starts_per_row):
    d = np.stack([docs_from_starts(T, s) for s in starts_per_row])
    assert d.shape == (B, T)
    return d, d


# boundaries inside tiles, at the tile edges 64 and 128 (and 32, the backward's tile at head dim
# 128), one-token documents (5, 100, 128, 129; 63)
DOCS_130 = packed(2, 130, [0, 5, 6, 64, 100, 101, 128, 129], [0, 30, 63, 64, 127])
CASES = {  # name: ((B, Hkv, G, Tq, Tk, D), mask keywords, dropout)
    "window37-T70-gqa": ((1, 1, 2, 70, 70, 64), dict(window=37), (0.0, 0, 0)),
    "window70-softcap-T100": ((1, 2, 1, 100, 100, 64), dict(window=70, softcap=2.0), (0.0, 0, 0)),
    "softcap-T70-d128": ((1, 1, 2, 70, 70, 128), dict(softcap=1.5), (0.0, 0, 0)),
    "window30-dropout-kvcache-20x129": ((1, 1, 2, 20, 129, 64), dict(window=30), (0.2, 7, 100)),
    "ring-window-40x40": ((1, 1, 2, 40, 40, 64), dict(q_first=150, k_first=100, window=60), (0.0, 0, 0)),
    "ring-rows-see-nothing": ((1, 1, 1, 40, 40, 64), dict(q_first=200, k_first=100, window=70), (0.0, 0, 0)),
    "documents-T130": ((2, 1, 1, 130, 130, 64), dict(documents=DOCS_130), (0.0, 0, 0)),
    "documents-window-softcap-dropout-d128": ((2, 1, 1, 130, 130, 128), dict(documents=DOCS_130, window=40,
                                                                               softcap=3.0), (0.1, 3, [5, 10 ** 6])),
    "documents-ring-tile": ((1, 1, 2, 50, 60, 64), dict(q_first=80, k_first=40, documents=(
        docs_from_starts(130, [0, 45, 46, 100])[None, 80:], docs_from_starts(130, [0, 45, 46, 100])[None, 40:100])),
        (0.0, 0, 0)),
    # ids need not be non-negative: a full tile (every query after every key) of one document -1
    "documents-negative-ids-full-tile": ((1, 1, 2, 40, 40, 64), dict(q_first=100, k_first=40, documents=(
        np.full((1, 40), -1, np.int32), np.full((1, 40), -1, np.int32))), (0.0, 0, 0)),
}
BF16_CASES = ("window37-T70-gqa", "documents-T130", "window30-dropout-kvcache-20x129", "softcap-T70-d128")


def run_kernels(kern, backend, q, k, v, do, scale, mask_kw, drop):
    """The fused kernels' (o, lse, (dq, dk, dv)) on the device for host inputs and a case's mask
    keywords (its document ids moved to the device too)."""
    dev = [backend.to_device(a) for a in (q, k, v, do)]
    kw = dict(mask_kw)
    if "documents" in kw:
        kw["documents"] = tuple(backend.to_device(np.ascontiguousarray(d, np.int32)) for d in kw["documents"])
    o, lse = kern.attention_forward(*dev[:3], scale, *drop, **kw)
    return o, lse, kern.attention_backward(dev[3], *dev[:3], o, lse, scale, None, *drop, **kw)


def run_case(kern, backend, name, dtype, inputs=None, ref_inputs=None):
    """The kernels' (o, lse, grads) of case `name` and the reference's, checked."""
    shape, mask_kw, drop = CASES[name]
    B, Hkv, G, Tq, Tk, D = shape
    q, k_, v, do = inputs if inputs is not None else attention_inputs(*shape, dtype, seed=Tq + Tk + D)
    scale = 1.0 / np.sqrt(D)
    o, lse, grads = run_kernels(kern, backend, q, k_, v, do, scale, mask_kw, drop)
    rq, rk, rv, rdo = ref_inputs if ref_inputs is not None else (q, k_, v, do)
    mask = reference_mask(B, Tq, Tk, mask_kw.get("q_first"), mask_kw.get("k_first"), mask_kw.get("window"),
                          mask_kw.get("documents"))
    want = reference(rq, rk, rv, rdo, scale, mask, mask_kw.get("softcap"), drop)
    return (backend.host(o), backend.host(lse), [backend.host(g) for g in grads]), want


def assert_close(got, want, dtype, rows=slice(None), keys=slice(None)):
    (o, lse, grads), (o_ref, lse_ref, grads_ref) = got, want
    np.testing.assert_array_equal(np.isneginf(lse[..., rows]), np.isneginf(lse_ref[..., rows]),
                                  "lse = -inf exactly for the rows that see no key")
    fin = np.isfinite(lse_ref[..., rows])
    assert normwise_error(np.where(fin, lse[..., rows], 0.0), np.where(fin, lse_ref[..., rows], 0.0)) <= 1e-6
    assert normwise_error(o[..., rows, :], o_ref[..., rows, :]) <= TOL[dtype], "o"
    assert normwise_error(grads[0][..., rows, :], grads_ref[0][..., rows, :]) <= TOL[dtype], "dq"
    for name, g, w in zip(("dk", "dv"), grads[1:], grads_ref[1:]):
        assert normwise_error(g[..., keys, :], w[..., keys, :]) <= TOL[dtype], name


# every case in float32, a selection in bfloat16 (the emulated tensor cores are slow)
KERNEL_CASES = [(name, F32) for name in CASES] + [(name, BF16) for name in BF16_CASES]


@pytest.mark.parametrize("name,dtype", KERNEL_CASES, ids=[f"{n}-{DT_IDS[DTYPES.index(d)]}" for n, d in KERNEL_CASES])
def test_the_mask_rule_on_the_kernels(backend, k, dtype, name):
    got, want = run_case(k, backend, name, dtype)
    assert_close(got, want, dtype)
    if name == "ring-rows-see-nothing":
        assert np.isneginf(got[1][..., 9:]).all() and not got[0][..., 9:, :].any() and not got[2][0][..., 9:, :].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_the_mask_rule_under_each_schedule(backend, ks, dtype):
    """The checked build under each thread schedule (the documents' shared ids: races, bounds)."""
    assert_close(*run_case(ks, backend, "documents-ring-tile", dtype), dtype)


# ---- element by element (issue 42: float32 within ulps, as expf gives them) --------------------------
@pytest.mark.parametrize("mask_kw", [dict(window=26), dict(documents=(np.ones((1, 3), np.int32), np.repeat(
    np.array([[0, 1]], np.int32), [38, 28], axis=1)))], ids=["window", "documents"])
def test_masked_probabilities_within_ulps_of_expf(backend, k, mask_kw):
    """exp_probe_inputs with keys 0..37 as heavy as the row's max, hidden from the three query rows
    (63, 64, 65) by a window of 26 or by their document: o, dq, dk, dv element by element within 8
    ulps of the float64 rule (the hidden keys' dk, dv exactly 0), through the window's and the
    documents' code (first visible key, tile bounds, document ids in shared memory)."""
    q, k_, v, do = exp_probe_inputs(1, 1, 64, 64, hidden=38)
    mask = reference_mask(1, 3, 66, window=mask_kw.get("window"), documents=mask_kw.get("documents"))
    assert not mask[..., :38].any() and mask[..., 40:64].all()
    o, lse, grads = run_kernels(k, backend, q, k_, v, do, 1.0, mask_kw, (0.0, 0, 0))
    o_ref, _, want = reference(q, k_, v, do, 1.0, mask)
    assert o_ref[..., 2, 0].min() > 1e-12 and want[2][:, :, 40, 0].min() > 1e-12  # the probes are not 0
    assert_probes_within_ulps(backend, (o, *grads), (o_ref, *want))


def test_soft_capped_probabilities_within_their_float32_bound(backend, k):
    """Soft-capped scores x = cap tanhf(s / cap), cap 10, over one key tile (its max the row's, no
    rescale): each probability over its row's largest, exp(x_j - x_max) free of the row's sum,
    element by element within the first-order bound of its float32 evaluation (s / cap and cap t
    rounded, tanhf's and expf's 2 ulps, the two divisions by l). Scores q.k exact (dyadic, one
    dimension) from -32 to 31; v one-hot, so o[i, j] is p_ij. A fast tanh (__tanhf, ~2^-11
    relative) moves a capped score by up to ~5e-3, far past the bound."""
    T, cap = 64, 10.0
    c, s = 1.0 + np.arange(T) / 64.0, np.arange(T) / 2.0 - 16.0
    q, k_ = np.zeros((1, 1, 1, T, 64), F32), np.zeros((1, 1, T, 64), F32)
    q[..., 0], k_[..., 0] = c, s
    v = np.eye(T, dtype=F32)[None, None]
    o, _ = k.attention_forward(*(backend.to_device(a) for a in (q, k_, v)), 1.0, softcap=cap)
    o = backend.host(o)[0, 0, 0].astype(f64)
    assert not o[np.triu_indices(T, 1)].any()  # the causal mask: exact zeros
    rows, cols = np.tril_indices(T)
    raw = np.outer(c, s)  # exact in float32; the row's max at its diagonal key (s increases)

    def formula(r, raw_j, raw_max):
        def capped(x):
            return r(cap * r(np.tanh(r(x / cap)), CUDA_ULPS["tanhf"]))
        return r(r(np.exp(r(capped(raw_j) - capped(raw_max))), CUDA_ULPS["expf"]) / 3.0) / r(1.0 / 3.0)

    exact, bound = float32_formula_bound(formula, raw[rows, cols], raw[rows, rows])
    err, allowed = np.abs(o[rows, cols] / o[rows, rows] - exact), 1.25 * bound + 2.0 ** -140
    worst = int(np.argmax(err / allowed))
    assert err[worst] <= allowed[worst], (f"p / p_max of row {rows[worst]}, key {cols[worst]}: off by {err[worst]:.3g}, "
                                          f"allowed {allowed[worst]:.3g}")


# ---- skipped, not masked ----------------------------------------------------------------------------
def _poisoned_runs(k, backend, name, shape, mask_kw, runs):
    """Case `name` with NaN in the inputs' rows a tile skip must never read, one run per
    (inputs, their poisoned rows, [(query rows, keys) whose results must stay right])."""
    CASES[name] = (shape, mask_kw, (0.0, 0, 0))
    try:
        clean = attention_inputs(*shape, F32, seed=4)
        for inputs, poisoned_rows, checks in runs:
            poisoned = [a.copy() for a in clean]
            for i in inputs:
                poisoned[i][..., poisoned_rows, :] = np.nan
            got, want = run_case(k, backend, name, F32, inputs=poisoned, ref_inputs=clean)
            for rows, keys in checks:
                assert_close(got, want, F32, rows=rows, keys=keys)
    finally:
        del CASES[name]


Q, K, V, DO = range(4)
NONE = slice(0, 0)


def test_tiles_above_the_diagonal_are_skipped(backend, k):
    """150 tokens (tiles of 64): NaN in keys and values [64, 150) leaves o, lse and dq of queries
    [0, 64) finite and right (their key tiles end at the diagonal); NaN in queries and output
    gradients [0, 64) leaves dk, dv of keys [64, 150) right (their query tiles start at the
    diagonal). A tile masked instead of skipped would multiply 0 by NaN."""
    _poisoned_runs(k, backend, "causal-T150", (1, 1, 1, 150, 150, 64), {},
                   [((K, V), slice(64, 150), [(slice(0, 64), NONE)]),
                    ((Q, DO), slice(0, 64), [(NONE, slice(64, 150))])])


def test_tiles_outside_the_window_are_skipped(backend, k):
    """Window 65 over 150 tokens: query tile [128, 150) sees keys from 64 on, and key tile [0, 64)
    is seen by queries up to 127. NaN in keys and values [0, 64) leaves o, lse and dq of queries
    [128, 150) right (the forward and dq kernels skip key tile 0 for them); NaN in queries and
    output gradients [128, 150) leaves dk, dv of keys [0, 64) right (the dk/dv kernel skips that
    query tile). Both window edges fall on tile edges: one key or query row more is a tile more."""
    _poisoned_runs(k, backend, "window65-T150", (1, 1, 1, 150, 150, 64), dict(window=65),
                   [((K, V), slice(0, 64), [(slice(128, 150), NONE)]),
                    ((Q, DO), slice(128, 150), [(NONE, slice(0, 64))])])


def test_tiles_of_other_documents_are_skipped(backend, k):
    """Documents [0, 64), [64, 128), [128, 150): NaN in the second one's queries, keys, values and
    output gradients leaves the others' results finite and right (no tile of theirs meets it)."""
    _poisoned_runs(k, backend, "documents-T150", (1, 1, 1, 150, 150, 64), dict(documents=packed(1, 150, [0, 64, 128])),
                   [((Q, K, V, DO), slice(64, 128), [(slice(0, 64),) * 2, (slice(128, 150),) * 2])])


# ---- the array code, the launchers' arguments, the op -----------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_the_flash_reference_under_the_mask(name):
    """flash_attention_forward / _backward (the kernels' tiles, skips and online softmax in array
    code) equal the reference in float64, at tile 16 (windows and boundaries across tiles)."""
    shape, mask_kw, drop = CASES[name]
    B, Hkv, G, Tq, Tk, D = shape
    q, k, v, do = (a.astype(f64) for a in attention_inputs(B, Hkv, G, Tq, Tk, 16, F32, seed=Tq))
    kw = dict(mask_kw, dropout_p=drop[0], seed=drop[1], offset=drop[2])
    o, lse = ops.flash_attention_forward(q, k, v, 0.25, tile=16, **kw)
    grads = ops.flash_attention_backward(do, q, k, v, o, lse, 0.25, tile=16, **kw)
    mask = reference_mask(B, Tq, Tk, mask_kw.get("q_first"), mask_kw.get("k_first"), mask_kw.get("window"),
                          mask_kw.get("documents"))
    o_ref, lse_ref, grads_ref = reference(q, k, v, do, 0.25, mask, mask_kw.get("softcap"), drop)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, grads_ref):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_mask_band_keeps_the_visible_pairs():
    """The launchers' (diag, window) int32 normalisation keeps every visible pair, for positions
    far apart (no overflow), windows none, short and long, more queries than keys."""
    rng = np.random.default_rng(0)
    for _ in range(400):
        Tq, Tk = (int(x) for x in rng.integers(1, 12, 2))
        diag = int(rng.choice([rng.integers(-15, 30), rng.integers(-2 ** 40, 2 ** 40)]))
        window = [None, int(rng.integers(1, 30)), int(rng.integers(1, 2 ** 41))][rng.integers(3)]
        d, w = mask_band(Tq, Tk, diag, window)
        assert -Tq <= d <= Tk and 1 <= w <= Tk + Tq + 1, (Tq, Tk, diag, window, d, w)
        i, j = np.arange(Tq)[:, None], np.arange(Tk)[None, :]
        want = (j <= diag + i) & ((j > diag + i - window) if window is not None else True)
        np.testing.assert_array_equal((j <= d + i) & (j > d + i - w), want, err_msg=str((Tq, Tk, diag, window)))


def test_the_op_dispatches_the_mask_to_the_fused_kernels(backend, fused_attention):
    """causal_attention_forward / _backward with window, softcap, q_first, k_first and documents
    run the fused kernels, the context keeping the mask for the backward."""
    shape, mask_kw, drop = CASES["documents-ring-tile"]
    B, Hkv, G, Tq, Tk, D = shape
    q, k_, v, do = attention_inputs(*shape, F32, seed=2)
    dev = [backend.to_device(a) for a in (q, k_, v, do)]
    kw = dict(mask_kw, window=50, softcap=2.0)
    o, ctx = ops.causal_attention_forward(*dev[:3], dropout_p=0.1, seed=3, offset=[10], **kw)
    assert ctx.fused
    grads = ops.causal_attention_backward(dev[3], ctx)
    mask = reference_mask(B, Tq, Tk, kw["q_first"], kw["k_first"], kw["window"], kw["documents"])
    o_ref, _, grads_ref = reference(q, k_, v, do, 1.0 / np.sqrt(D), mask, 2.0, (0.1, 3, [10]))
    assert normwise_error(backend.host(o), o_ref) <= TOL[F32]
    for got, want in zip(grads, grads_ref):
        assert normwise_error(backend.host(got), want) <= TOL[F32]


def test_mask_refusals(backend, k):
    q, k_, v, _ = (backend.to_device(a) for a in attention_inputs(2, 1, 1, 8, 8, 64, F32))
    with pytest.raises(KernelArgumentError, match="window >= 1"):
        k.attention_forward(q, k_, v, 0.1, window=0)
    with pytest.raises(KernelArgumentError, match="softcap=-1"):
        k.attention_forward(q, k_, v, 0.1, softcap=-1.0)
    docs = backend.to_device(np.zeros((2, 8), np.int64))
    with pytest.raises(KernelArgumentError, match="q_docs must be a contiguous int32"):
        k.attention_forward(q, k_, v, 0.1, documents=(docs, docs))
    ok = backend.to_device(np.zeros((2, 8), np.int32))
    with pytest.raises(KernelArgumentError, match=r"k_docs must be .* shape \(2, 8\)"):
        k.attention_forward(q, k_, v, 0.1, documents=(ok, backend.to_device(np.zeros((2, 7), np.int32))))
