"""kernels/attention.cu on the tiles of context parallelism's ring attention, through its
launchers' tile arguments (q_first / k_first, drop_strides, out_dtype, rowdot, accumulate) and through
cutp.ops.attention_tiles, against attention_tiles' array code in float64 on the same inputs.

* A ring tile pair in miniature: queries of chunk 2 of a 4-chunk sequence against chunk 0 (a full
  tile) and chunk 2 (the diagonal), dropout at the whole sequence's counters, the partial
  results merged, the backward of each tile with the merged lse and rowdot added into float32
  buffers that already hold values (bfloat16 inputs: float32 outputs).
* Diagonal shifts the one-rank attention never has: keys after every query (their key tiles
  skipped: dk = dv = 0), a shift past the last key (every key seen), more queries than keys.
* The defaults are the one-rank attention's positions and counters, bit for bit.
* The planner's GPU walk (shape-only CuPy arrays) books the fused tiles' o and lse, not a tile's
  scores.
* The ring attention at cp 2 (two threads, one per CP rank, over an in-process ring) on the
  kernels equals the one-rank attention in float64, dropout included.
"""
from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from cutp import ops
from cutp.comm.base import Communicator
from cutp.kernels import KernelArgumentError
from cutp.ops import attention_tiles as tiles
from cutp.runtime.shape_only import ShapeOnly
from cutp.tensor_parallel import context_parallel as cpar

from .helpers import BF16, DT_IDS, DTYPES, F32, randn
from .test_attention import TOL, attention_inputs, normwise_error

f64 = np.float64


def _f64(*arrays):
    return tuple(np.asarray(a, f64) for a in arrays)


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_a_ring_tile_pair_on_the_kernels(backend, k, dtype, p):
    B, Hkv, G, c, D = 2, 1, 2, 24, 64
    T, scale = 4 * c, 0.125
    q, _, _, do = attention_inputs(B, Hkv, G, c, c, D, dtype, seed=3)
    kv = {j: (randn((B, Hkv, c, D), dtype, seed=10 + j), randn((B, Hkv, c, D), dtype, seed=20 + j)) for j in (0, 2)}
    dropout = (p, 5, [11, 10 ** 6], T) if p else None
    drop, strides = ((p, 5, [11, 10 ** 6]), (T * T, T)) if p else ((0.0, 0, 0), None)
    dev = backend.to_device
    acc, acc_ref = (None, None), (None, None)
    for j in (0, 2):  # the full tile, then the diagonal
        pos = (2 * c, j * c)
        o, lse = k.attention_forward(dev(q), dev(kv[j][0]), dev(kv[j][1]), scale, *drop, q_first=pos[0],
                                     k_first=pos[1], drop_strides=strides, out_dtype=np.float32)
        assert o.dtype == np.float32 and lse.dtype == np.float32
        o_ref, lse_ref = tiles.tile_forward(*_f64(q, *kv[j]), scale, pos, dropout)
        assert normwise_error(backend.host(o), o_ref) <= TOL[dtype]
        assert normwise_error(backend.host(lse), lse_ref) <= 1e-6
        acc = tiles.merge(*acc, backend.host(o), backend.host(lse))
        acc_ref = tiles.merge(*acc_ref, o_ref, lse_ref)
    rowdot = (np.asarray(do, np.float32) * acc[0]).sum(axis=-1)
    rowdot_ref = (do.astype(f64) * acc_ref[0]).sum(axis=-1)
    start = [randn(shape, F32, seed=30 + i) for i, shape in enumerate((q.shape, (B, Hkv, c, D), (B, Hkv, c, D)))]
    want = [start[0].astype(f64), None, None]
    got_kv = {}
    dq = dev(start[0])
    for j in (0, 2):
        pos = (2 * c, j * c)
        out = (dq, dev(start[1]), dev(start[2]))
        res = k.attention_backward(dev(do), dev(q), dev(kv[j][0]), dev(kv[j][1]), None, dev(acc[1]), scale, out,
                                   *drop, rowdot=dev(rowdot), q_first=pos[0], k_first=pos[1],
                                   drop_strides=strides, accumulate=True)
        assert all(r is o for r, o in zip(res, out))
        got_kv[j] = [backend.host(a) - s for a, s in zip(out[1:], start[1:])]
        ref = tiles.tile_backward(*_f64(do, q, *kv[j]), rowdot_ref, acc_ref[1], scale, pos, dropout)
        want[0] = want[0] + ref[0]
        for name, got, w in zip(("dk", "dv"), got_kv[j], ref[1:]):
            assert normwise_error(got, w) <= TOL[dtype], f"{name} of tile {pos}"
    assert normwise_error(backend.host(dq) - start[0], want[0] - start[0]) <= TOL[dtype], "dq summed over the tiles"


EDGES = [  # Tq, Tk, positions
    (20, 70, (0, 0)),  # keys 20..69 after every query: the second key tile is skipped, its dk, dv are 0
    (70, 70, (300, 0)),  # far past the last key: every key seen (the shift is clamped to Tk)
    (70, 20, (100, 90)),  # more queries than keys, shift 10
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("Tq,Tk,pos", EDGES, ids=[f"{e[0]}x{e[1]}-at{e[2][0]}-{e[2][1]}" for e in EDGES])
def test_diagonal_shifts(backend, k, dtype, Tq, Tk, pos):
    q, k_, v, do = attention_inputs(1, 1, 2, Tq, Tk, 64, dtype, seed=Tq + Tk)
    dev = [backend.to_device(a) for a in (q, k_, v, do)]
    o, lse = k.attention_forward(*dev[:3], 0.125, q_first=pos[0], k_first=pos[1])
    o_ref, lse_ref = tiles.tile_forward(*_f64(q, k_, v), 0.125, pos)
    assert normwise_error(backend.host(o), o_ref) <= TOL[dtype]
    assert normwise_error(backend.host(lse), lse_ref) <= 1e-6
    grads = k.attention_backward(dev[3], *dev[:3], o, lse, 0.125, q_first=pos[0], k_first=pos[1])
    rowdot = (do.astype(f64) * o_ref).sum(axis=-1)
    for name, got, want in zip(("dq", "dk", "dv"), grads, tiles.tile_backward(*_f64(do, q, k_, v), rowdot, lse_ref,
                                                                               0.125, pos)):
        assert normwise_error(backend.host(got), want) <= TOL[dtype], name
    if Tk > Tq + pos[0] - pos[1]:
        assert not np.asarray(backend.host(grads[1]), f64)[:, :, Tq:].any(), "keys no query sees: dk = 0"


def test_the_defaults_are_the_one_rank_attentions(backend, k):
    """positions (Tk - Tq, 0) and counters at the probabilities' own places (head stride Tq Tk,
    row stride Tk, the positions folded into the offsets) are the defaults, bit for bit."""
    Tq, Tk = 30, 50
    dev = [backend.to_device(a) for a in attention_inputs(2, 1, 2, Tq, Tk, 64, F32, seed=4)]
    offsets = [10 ** 5, 7 * 10 ** 6]
    o, lse = k.attention_forward(*dev[:3], 0.125, 0.3, 9, offsets)
    shifted = [x - (Tk - Tq) * Tk for x in offsets]
    kw = dict(q_first=Tk - Tq, k_first=0, drop_strides=(Tq * Tk, Tk))
    o2, lse2 = k.attention_forward(*dev[:3], 0.125, 0.3, 9, shifted, **kw)
    np.testing.assert_array_equal(backend.host(o), backend.host(o2))
    np.testing.assert_array_equal(backend.host(lse), backend.host(lse2))
    grads = k.attention_backward(dev[3], *dev[:3], o, lse, 0.125, None, 0.3, 9, offsets)
    rowdot = (backend.host(dev[3]) * backend.host(o)).sum(axis=-1, dtype=np.float32)
    grads2 = k.attention_backward(dev[3], *dev[:3], o, lse, 0.125, None, 0.3, 9, shifted, **kw)
    for a, b in zip(grads, grads2):
        np.testing.assert_array_equal(backend.host(a), backend.host(b))
    assert normwise_error(rowdot, (backend.host(dev[3]).astype(f64) * backend.host(o)).sum(-1)) <= 1e-6


def test_tile_refusals(backend, k):
    q, k_, v, do = (backend.to_device(a) for a in attention_inputs(1, 1, 1, 8, 8, 64, F32))
    with pytest.raises(KernelArgumentError, match="out_dtype"):
        k.attention_forward(q, k_, v, 0.1, out_dtype=np.float64)
    o, lse = k.attention_forward(q, k_, v, 0.1)
    with pytest.raises(KernelArgumentError, match="accumulate adds"):
        k.attention_backward(do, q, k_, v, o, lse, 0.1, accumulate=True)
    with pytest.raises(KernelArgumentError, match="rowdot must be a contiguous float32"):
        k.attention_backward(do, q, k_, v, None, lse, 0.1, rowdot=backend.xp.zeros((1, 1, 1, 7), np.float32))
    with pytest.raises(KernelArgumentError, match="or float32"):
        k.attention_backward(do, q, k_, v, o, lse, 0.1, out=tuple(backend.xp.zeros(a.shape, np.float64)
                                                                  for a in (q, k_, v)))
    with pytest.raises(ValueError, match="every query needs a visible key"):
        tiles.tile_forward(np.zeros((1, 1, 1, 4, 16)), np.zeros((1, 1, 4, 16)), np.zeros((1, 1, 4, 16)), 0.1, (0, 4))


# ---- the ring at cp 2 on the kernels -------------------------------------------------------------
class ThreadRing(Communicator):
    """An in-process CP group for one thread per rank: exchange's sends go into mailboxes, its
    receives wait on them (the ring posts every send of a step before any receive)."""

    def __init__(self, rank, size, boxes):
        super().__init__(rank, size, "cp")
        self.boxes = boxes

    def exchange(self, sends, recvs):
        for x, dest, tag in sends:
            self.boxes[(self.rank, dest, tag)].put(np.array(x, copy=True))
        for x, source, tag in recvs:
            x[...] = self.boxes[(source, self.rank, tag)].get(timeout=120)
        return [x for x, _, _ in recvs]


@pytest.fixture
def tile_kernels(backend, monkeypatch):
    """attention_tiles dispatching to the emulated kernels for NumPy arrays (the GPU's rule
    applied to them), one launch at a time (the ranks' threads share the launchers)."""
    if not backend.emulated:
        pytest.skip("the ring's NumPy stand-ins for CuPy arrays are the emulated backend's")
    launchers = backend.launchers()
    lock = threading.Lock()
    launch = launchers._launch

    def locked(*args, **kw):
        with lock:
            return launch(*args, **kw)

    launchers._launch = locked
    monkeypatch.setattr(ops.attention, "_attention_kernels", lambda *arrays: launchers)  # (the tiles' dispatch too)
    return launchers


@pytest.mark.parametrize("dtype,p", [(F32, 0.0), (F32, 0.2), (BF16, 0.2)], ids=["f32", "f32-p0.2", "bf16-p0.2"])
def test_the_ring_at_cp2_on_the_kernels_is_the_one_rank_attention(backend, tile_kernels, dtype, p):
    cp, B, Hkv, G, T, D = 2, 2, 1, 2, 32, 64
    q, k_, v, do = attention_inputs(B, Hkv, G, T, T, D, dtype, seed=8)
    offsets = [3, 10 ** 6]
    o_ref, ctx = ops.causal_attention_forward(*_f64(q, k_, v), dropout_p=p, seed=2, offset=offsets, fused=False)
    grads_ref = ops.causal_attention_backward(do.astype(f64), ctx)
    boxes = {(s, d, t): queue.Queue() for s in range(cp) for d in range(cp) for t in (cpar.TAG_KV, cpar.TAG_DKV)}
    results, errors = {}, []

    def rank(r):
        try:
            pos = cpar.zigzag_positions(T, cp, r)
            group = ThreadRing(r, cp, boxes)
            local = [np.ascontiguousarray(a[..., pos, :]) for a in (q, k_, v, do)]
            o, rctx = cpar.ring_attention_forward(group, *local[:3], 0.125, (p, 2, offsets, T) if p else None)
            results[r] = (pos, o, cpar.ring_attention_backward(group, local[3], rctx))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    launched, sfx = tile_kernels.launches, "f32" if dtype == F32 else "bf16"
    assert launched[f"attention_forward_{sfx}_d64"] == 10 == launched[f"attention_backward_dkdv_{sfx}_d64"]  # 5 a rank
    assert f"attention_backward_rowdot_{sfx}_d64" not in launched  # the ring's rowdot of the merged o
    for r, (pos, o, grads) in results.items():
        assert o.dtype == dtype
        assert normwise_error(o, o_ref[..., pos, :]) <= TOL[dtype], f"o of rank {r}"
        for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
            assert normwise_error(got, want[..., pos, :]) <= TOL[dtype], f"{name} of rank {r}"


def test_tiles_the_kernels_do_not_take_run_the_array_code(backend, tile_kernels, monkeypatch):
    """Head dim 32 (and float64) on a GPU: the array code, with the one-rank attention's warning
    once per reason."""
    monkeypatch.setattr(ops.attention, "_UNFUSED_WARNED", set())
    q, k_, v, _ = attention_inputs(1, 1, 2, 8, 8, 32, F32, seed=1)
    with pytest.warns(UserWarning, match="head dims"):
        o, lse = tiles.tile_forward(q, k_, v, 0.2, (8, 0))
    assert not tile_kernels.launches
    with pytest.warns(UserWarning, match="float32 or bfloat16"):  # float64 too
        o_ref, lse_ref = tiles.tile_forward(*_f64(q, k_, v), 0.2, (8, 0))
    assert not tile_kernels.launches
    assert normwise_error(o, o_ref) <= 1e-6 and normwise_error(lse, lse_ref) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_the_planners_gpu_walk_books_the_fused_tiles(dtype):
    """Shape-only CuPy arrays take the fused kernels' launchers: a tile's forward keeps o (float32)
    and the log-sum-exp, its backward into the ring's float32 buffers books only the dropout's B
    offsets; the array code would book the [B, nkv, g, c, c] scores (8 MiB here) and more."""
    B, Hkv, G, c, D = 2, 2, 2, 512, 64
    xp = ShapeOnly("cuda")
    heap = xp.heap
    q, do = (xp.empty((B, Hkv, G, c, D), dtype) for _ in range(2))
    k_, v = (xp.empty((B, Hkv, c, D), dtype) for _ in range(2))
    dropout = (0.1, 3, [0, 10 ** 6], 4 * c)
    offsets = heap.size(8 * B)
    start = heap.cur
    heap.reset_peak()
    o, lse = tiles.tile_forward(q, k_, v, 0.125, (2 * c, c), dropout)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    kept = heap.size(o.nbytes) + heap.size(lse.nbytes)
    assert heap.cur - start == kept and heap.peak - start == kept + offsets
    out = tuple(xp.zeros(a.shape, np.float32) for a in (q, k_, v))
    rowdot = xp.empty(lse.shape, np.float32)
    heap.reset_peak()
    got = tiles.tile_backward(do, q, k_, v, rowdot, lse, 0.125, (2 * c, c), dropout, out=out)
    assert all(g is a for g, a in zip(got, out))
    assert heap.peak - heap.cur == offsets


# ---- the mask rule on a ring's tiles ---------------------------------------------------------------
# Queries of chunk 2 of a 96-token sequence (3 chunks of 32) against each chunk's keys, window 50,
# soft cap 2, documents [0, 10), [10, 70), [70] (one token), [71, 96): against chunk 0 rows 64..69
# see keys, rows 70.. none (lse -inf, merged as nothing); the merge of the three tiles and the sum of
# their gradients are the reference attention of those queries against the whole sequence.
RING_MASK = dict(window=50, softcap=2.0)
RING_DOCS = np.searchsorted(np.array([10, 70, 71]), np.arange(96), side="right").astype(np.int32)[None]


def _ring_tiles_under_the_mask(dtype, run_tiles):
    from .test_attention_mask import reference, reference_mask

    B, Hkv, G, T, c, D = 1, 1, 2, 96, 32, 64
    q, k_, v, do = attention_inputs(B, Hkv, G, T, T, D, dtype, seed=12)
    rows = slice(2 * c, 3 * c)
    qc, doc = q[..., rows, :], do[..., rows, :]
    mask = reference_mask(B, c, T, 2 * c, 0, documents=(RING_DOCS[:, rows], RING_DOCS), window=RING_MASK["window"])
    o_ref, lse_ref, (dq_ref, dk_ref, dv_ref) = reference(qc, k_, v, doc, 0.125, mask, RING_MASK["softcap"])
    chunks = [slice(j * c, (j + 1) * c) for j in range(3)]
    kw = [dict(RING_MASK, documents=(RING_DOCS[:, rows], RING_DOCS[:, keys])) for keys in chunks]
    o, lse = None, None
    for j, keys in enumerate(chunks):
        o_t, lse_t = run_tiles.forward(qc, k_[..., keys, :], v[..., keys, :], (2 * c, j * c), kw[j])
        if j == 0:
            assert np.isneginf(np.asarray(lse_t)[..., 6:]).all() and np.isfinite(np.asarray(lse_t)[..., :6]).all()
        o, lse = tiles.merge(o, lse, np.asarray(o_t, f64), np.asarray(lse_t, f64))
    tol = 1e-12 if dtype == f64 else TOL[dtype]
    assert normwise_error(o, o_ref) <= tol and normwise_error(lse, lse_ref) <= tol
    rowdot = (np.asarray(doc, f64) * o).sum(axis=-1)
    dq = 0.0
    for j, keys in enumerate(chunks):
        dq_t, dk_t, dv_t = run_tiles.backward(doc, qc, k_[..., keys, :], v[..., keys, :], rowdot, lse,
                                              (2 * c, j * c), kw[j])
        dq = dq + np.asarray(dq_t, f64)
        assert normwise_error(dk_t, dk_ref[..., keys, :]) <= tol, f"dk of chunk {j}"
        assert normwise_error(dv_t, dv_ref[..., keys, :]) <= tol, f"dv of chunk {j}"
    assert normwise_error(dq, dq_ref) <= tol


class _Tiles:
    """attention_tiles' tile_forward / tile_backward at scale 0.125, in dtype."""

    def __init__(self, dtype):
        self.dtype = dtype

    def forward(self, q, k, v, pos, kw):
        return tiles.tile_forward(q, k, v, 0.125, pos, **kw)

    def backward(self, do, q, k, v, rowdot, lse, pos, kw):
        cast = (lambda a: np.asarray(a, f64)) if self.dtype == f64 else (lambda a: np.asarray(a, np.float32))
        return tiles.tile_backward(do, q, k, v, cast(rowdot), cast(lse), 0.125, pos, **kw)


def test_ring_tiles_under_the_mask_in_array_code():
    """attention_tiles' array code (the CPU's ring) with window, soft cap and documents, float64."""
    _ring_tiles_under_the_mask(f64, _Tiles(f64))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_ring_tiles_under_the_mask_on_the_kernels(backend, tile_kernels, dtype):
    """The same tiles through attention_tiles on the kernels (q_first / k_first of each chunk, the
    merged lse and rowdot in the backward)."""
    if not backend.emulated:
        pytest.skip("NumPy stand-ins")
    _ring_tiles_under_the_mask(dtype, _Tiles(dtype))
    assert tile_kernels.launches[f"attention_forward_{'f32' if dtype == F32 else 'bf16'}_d64"] == 3
