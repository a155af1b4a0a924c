"""Tests of cutp.ops.attention: the causal GQA attention op against its plain reference and central
differences (float64), the blocked NumPy path against the plain composition (bitwise where the
arithmetic is the same, else to rounding), attention dropout, KV-cache shapes (Tq < Tk), the
packed-gradient `out=` and the free head merge of the blocked output."""
import numpy as np
import pytest

import cutp.ops.attention as attention_op
from cutp.ops import (
    causal_attention_backward,
    causal_attention_forward,
    causal_attention_reference,
    dropout_mask,
)
from tests.gradcheck import check_gradients

# (B, nkv, g, Tq, Tk, hd): GQA g > 1 and g = 1, T not a multiple of the query blocks, and KV-cache
# shapes (Tq < Tk: one query block, keys up to Tk)
SHAPES = [(2, 2, 2, 40, 40, 8), (3, 2, 1, 50, 50, 4), (1, 1, 3, 37, 37, 4), (2, 3, 2, 33, 33, 5),
          (2, 2, 2, 5, 23, 8), (1, 2, 1, 1, 9, 4)]
SHAPE_IDS = [f"B{b}-nkv{h}-g{g}-Tq{tq}-Tk{tk}-hd{d}" for b, h, g, tq, tk, d in SHAPES]


@pytest.fixture(params=["one piece", "batch rows", "single heads"])
def pieces(request, monkeypatch):
    """Block sizes giving one piece and default query blocks; pieces of several batch rows with
    all KV heads; single-head pieces cut into many query blocks (ragged last block)."""
    if request.param == "batch rows":
        monkeypatch.setattr(attention_op, "PIECE_ELEMS", 2 * 3 * 2 * 50 * 50)
        monkeypatch.setattr(attention_op, "QBLOCK_ELEMS", 1 << 12)
    elif request.param == "single heads":
        monkeypatch.setattr(attention_op, "PIECE_ELEMS", 1 << 8)
        monkeypatch.setattr(attention_op, "QBLOCK_ELEMS", 1 << 8)
    return request.param


def qkv(shape, dtype=np.float64, seed=0):
    B, nkv, g, Tq, Tk, hd = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, nkv, g, Tq, hd)).astype(dtype)
    k = rng.standard_normal((B, nkv, Tk, hd)).astype(dtype)
    v = rng.standard_normal((B, nkv, Tk, hd)).astype(dtype)
    return q, k, v


def loop_reference(q, k, v, scale):
    """The attention one query row at a time, in Python loops: checks the reference itself."""
    B, nkv, g, Tq, hd = q.shape
    Tk = k.shape[2]
    o = np.zeros_like(q)
    for b in range(B):
        for h in range(nkv):
            for j in range(g):
                for i in range(Tq):
                    seen = Tk - Tq + i + 1
                    s = np.array([q[b, h, j, i] @ k[b, h, t] for t in range(seen)]) * scale
                    w = np.exp(s - s.max())
                    o[b, h, j, i] = (w / w.sum()) @ v[b, h, :seen]
    return o


@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[4:5], ids=SHAPE_IDS[:2] + SHAPE_IDS[4:5])
def test_reference_equals_row_by_row_attention(shape):
    q, k, v = qkv(shape)
    np.testing.assert_allclose(causal_attention_reference(q, k, v), loop_reference(q, k, v, 1 / np.sqrt(q.shape[-1])),
                               rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("blocked", [True, False], ids=["blocked", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_forward_equals_the_reference(shape, blocked, pieces):
    q, k, v = qkv(shape)
    snap = [a.copy() for a in (q, k, v)]
    o, ctx = causal_attention_forward(q, k, v, scale=0.3, blocked=blocked)
    assert ctx.blocked == blocked and o.shape == q.shape and o.dtype == q.dtype
    np.testing.assert_allclose(o, causal_attention_reference(q, k, v, 0.3), rtol=1e-12, atol=1e-13)
    for a, b in zip((q, k, v), snap):
        np.testing.assert_array_equal(a, b)  # inputs untouched
    default, _ = causal_attention_forward(q, k, v, blocked=blocked)  # scale 1 / sqrt(hd)
    np.testing.assert_allclose(default, causal_attention_reference(q, k, v), rtol=1e-12, atol=1e-13)


def test_blocked_path_really_is_blocked(monkeypatch):
    """With small block sizes the forward runs several pieces of several query blocks, the last
    one ragged, and each block only sees its keys."""
    monkeypatch.setattr(attention_op, "PIECE_ELEMS", 1 << 8)
    monkeypatch.setattr(attention_op, "QBLOCK_ELEMS", 1 << 8)
    q, k, v = qkv((2, 2, 2, 40, 40, 8))
    _, ctx = causal_attention_forward(q, k, v, blocked=True)  # (blocked=None: the compiled kernels where built)
    assert ctx.blocked and len(ctx.pieces) == 4
    for blocks in ctx.piece_blocks:
        assert [(r0, r1) for r0, r1, *_ in blocks] == [(0, 16), (16, 32), (32, 40)]
        assert [b[4].y.shape[-2:] for b in blocks] == [(16, 16), (16, 32), (8, 40)]


@pytest.mark.parametrize("blocked", [True, False], ids=["blocked", "plain"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[4]], ids=[SHAPE_IDS[0], SHAPE_IDS[1], SHAPE_IDS[4]])
def test_backward_against_central_differences(shape, blocked, monkeypatch):
    monkeypatch.setattr(attention_op, "PIECE_ELEMS", 1 << 9)  # several pieces and query blocks
    monkeypatch.setattr(attention_op, "QBLOCK_ELEMS", 1 << 8)
    q, k, v = qkv(shape)

    def backward(do, ctx):
        return dict(zip("qkv", causal_attention_backward(do, ctx)))

    check_gradients(lambda q, k, v: causal_attention_forward(q, k, v, blocked=blocked), dict(q=q, k=k, v=v),
                    backward, tol=1e-7, max_elements=48)
    # the op's gradients are those of the reference formula too
    check_gradients(lambda q, k, v: (causal_attention_reference(q, k, v),
                                     causal_attention_forward(q, k, v, blocked=blocked)[1]),
                    dict(q=q, k=k, v=v), backward, tol=1e-7, max_elements=48, seed=1)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_blocked_equals_plain(shape, pieces):
    """Bitwise when the blocked path runs the plain arithmetic (one piece, one query block),
    else to rounding; dq, dk, dv too."""
    q, k, v = qkv(shape)
    do = np.random.default_rng(9).standard_normal(q.shape)
    o_b, ctx_b = causal_attention_forward(q, k, v, blocked=True)
    o_p, ctx_p = causal_attention_forward(q, k, v, blocked=False)
    grads_b = causal_attention_backward(do, ctx_b)
    grads_p = causal_attention_backward(do, ctx_p)
    same_arithmetic = len(ctx_b.pieces) == 1 and len(ctx_b.piece_blocks[0]) == 1
    for what, a, b in zip(("o", "dq", "dk", "dv"), (o_b,) + tuple(grads_b), (o_p,) + tuple(grads_p)):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        if same_arithmetic:
            np.testing.assert_array_equal(a, b, err_msg=what)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13, err_msg=what)
    if pieces == "one piece" and (shape[3] < 32 or shape[3] != shape[4]):
        assert same_arithmetic  # the bitwise comparison does run
    if pieces == "single heads" and shape[3] == shape[4] >= 32:
        assert not same_arithmetic


@pytest.mark.parametrize("blocked", [True, False], ids=["blocked", "plain"])
def test_gradients_into_a_packed_buffer(blocked, monkeypatch):
    """out= views of one [B, T, (nq + 2 nkv) hd] buffer (as ParallelAttention packs its QKV
    gradient) receive exactly the gradients the op returns on its own."""
    monkeypatch.setattr(attention_op, "PIECE_ELEMS", 1 << 10)
    B, nkv, g, T, hd = 2, 2, 3, 36, 4
    q, k, v = qkv((B, nkv, g, T, T, hd))
    do = np.random.default_rng(2).standard_normal(q.shape)
    _, ctx = causal_attention_forward(q, k, v, blocked=blocked)
    dq, dk, dv = causal_attention_backward(do, ctx)
    nq = nkv * g
    packed = np.full((B, T, (nq + 2 * nkv) * hd), np.nan)
    views = (packed[..., :nq * hd].reshape(B, T, nkv, g, hd).transpose(0, 2, 3, 1, 4),
             packed[..., nq * hd:(nq + nkv) * hd].reshape(B, T, nkv, hd).transpose(0, 2, 1, 3),
             packed[..., (nq + nkv) * hd:].reshape(B, T, nkv, hd).transpose(0, 2, 1, 3))
    assert all(np.shares_memory(view, packed) for view in views)
    got = causal_attention_backward(do, ctx, out=views)
    assert all(a is b for a, b in zip(got, views))
    assert not np.isnan(packed).any()  # every element written
    for what, a, b in zip("qkv", views, (dq, dk, dv)):
        np.testing.assert_array_equal(a, b, err_msg=f"d{what}")


def test_blocked_output_merges_heads_without_a_copy():
    q, k, v = qkv((2, 2, 3, 40, 40, 4))
    o, _ = causal_attention_forward(q, k, v, blocked=True)
    merged = o.transpose(0, 3, 1, 2, 4).reshape(2, 40, 2 * 3 * 4)
    assert np.shares_memory(merged, o) and merged.flags.c_contiguous


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]], ids=[SHAPE_IDS[0], SHAPE_IDS[2]])
def test_dropout(shape):
    """The probabilities [B, nkv, g, Tq, Tk] times dropout_mask(their shape, p, seed, offset) over
    1 - p, as the reference; gradients by central differences; only the plain path drops."""
    q, k, v = qkv(shape)
    p, seed, offset = 0.3, 11, 1000
    o, ctx = causal_attention_forward(q, k, v, dropout_p=p, seed=seed, offset=offset)
    assert not ctx.blocked
    B, nkv, g, Tq, Tk, _ = shape
    np.testing.assert_array_equal(ctx.dropout.mask, dropout_mask(np, (B, nkv, g, Tq, Tk), p, seed, offset))
    np.testing.assert_allclose(o, causal_attention_reference(q, k, v, dropout_p=p, seed=seed, offset=offset),
                               rtol=1e-12, atol=1e-13)
    assert not np.allclose(o, causal_attention_reference(q, k, v))
    other, _ = causal_attention_forward(q, k, v, dropout_p=p, seed=seed, offset=offset + q.size)
    assert not np.array_equal(o, other)  # the offset selects the mask

    def backward(do, ctx):
        return dict(zip("qkv", causal_attention_backward(do, ctx)))

    check_gradients(lambda q, k, v: causal_attention_forward(q, k, v, dropout_p=p, seed=seed, offset=offset),
                    dict(q=q, k=k, v=v), backward, tol=1e-7, max_elements=48)
    with pytest.raises(ValueError, match="needs NumPy arrays and no dropout"):
        causal_attention_forward(q, k, v, dropout_p=p, blocked=True)


def test_dropout_off_is_the_plain_path_exactly():
    """dropout_p 0 draws nothing and drops nothing: the same numbers as without dropout."""
    q, k, v = qkv(SHAPES[0])
    do = np.random.default_rng(4).standard_normal(q.shape)
    o0, ctx0 = causal_attention_forward(q, k, v, blocked=False)
    o1, ctx1 = causal_attention_forward(q, k, v, dropout_p=0.0, seed=5, offset=7, blocked=False)
    assert ctx1.dropout.mask is None and ctx1.probs is ctx1.softmax.y
    np.testing.assert_array_equal(o0, o1)
    for a, b in zip(causal_attention_backward(do, ctx0), causal_attention_backward(do, ctx1)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("blocked", [True, False], ids=["blocked", "plain"])
def test_float32_follows_float64(blocked, monkeypatch):
    monkeypatch.setattr(attention_op, "PIECE_ELEMS", 1 << 10)
    q, k, v = qkv(SHAPES[0])
    do = np.random.default_rng(3).standard_normal(q.shape)
    o64, ctx64 = causal_attention_forward(q, k, v, blocked=blocked)
    o32, ctx32 = causal_attention_forward(*(a.astype(np.float32) for a in (q, k, v)), blocked=blocked)
    assert o32.dtype == np.float32
    np.testing.assert_allclose(o32, o64, rtol=1e-4, atol=1e-5)
    for a, b in zip(causal_attention_backward(do.astype(np.float32), ctx32), causal_attention_backward(do, ctx64)):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_shape_errors():
    q, k, v = qkv(SHAPES[0])
    with pytest.raises(ValueError, match=r"q \[B, nkv, g, Tq, hd\]"):
        causal_attention_forward(q[:, :, 0], k, v)
    with pytest.raises(ValueError, match="does not match"):
        causal_attention_forward(q[:, :1], k, v)
    with pytest.raises(ValueError, match="Tq <= Tk"):
        causal_attention_forward(q, k[:, :, :10], v[:, :, :10])


# ---- the mask rule: windows, soft-capping, the rows' global indices, documents (issues 37, 38) ----
def loop_masked(q, k, v, scale, q_first, k_first, window, softcap, documents):
    """Contract 1 one query row at a time: key s visible from query p iff s <= p, s > p - window,
    and the same document; scores soft-capped before the mask; a row seeing nothing: zeros."""
    B, nkv, g, Tq, hd = q.shape
    Tk = k.shape[2]
    o = np.zeros_like(q)
    for b, h, j, i in np.ndindex(B, nkv, g, Tq):
        p = q_first + i
        seen = [t for t in range(Tk) if k_first + t <= p and (window is None or k_first + t > p - window)
                and (documents is None or documents[0][b, i] == documents[1][b, t])]
        if seen:
            s = np.array([q[b, h, j, i] @ k[b, h, t] for t in seen]) * scale
            s = s if softcap is None else softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            o[b, h, j, i] = (w / w.sum()) @ v[b, h, seen]
    return o


def _docs(B, T, seed):
    """Non-decreasing document ids [B, T]: several documents a row, one-token ones among them."""
    rng = np.random.default_rng(seed)
    starts = rng.random((B, T)) < 0.3
    starts[:, 0] = False
    starts[0, 1] = starts[0, 2] = True  # a one-token document
    return np.cumsum(starts, axis=1).astype(np.int32)


# (window, softcap, q_first, k_first, documents?) on [B=2, nkv=2, g=2, Tq, Tk, hd=4]
MASKS = [dict(window=5), dict(window=1), dict(softcap=0.7), dict(window=7, softcap=0.5),
         dict(documents=True), dict(documents=True, window=4, softcap=1.5),
         dict(q_first=24, k_first=8, window=9),  # a ring tile: rows of chunk 3 against keys of chunk 1
         dict(q_first=13, k_first=10, window=6),  # keys after some queries: those rows see nothing
         dict(q_first=0, k_first=24, tile=48)]  # a whole query block (rows 0-15) before every key
MASK_IDS = ["w5", "w1", "cap", "w7-cap", "docs", "docs-w4-cap", "tile", "rows-seeing-nothing", "block-seeing-nothing"]


def _masked_case(kw, T=40):
    kw = dict(kw)
    tile = kw.pop("tile", 16)  # (a ring tile's rows and keys)
    Tq = T if "q_first" not in kw else tile
    Tk = T if "q_first" not in kw else tile
    q, k, v = qkv((2, 2, 2, Tq, Tk, 4), seed=5)
    if kw.pop("documents", False):
        docs = _docs(2, T, 1)
        kw["documents"] = (docs, docs)
    return q, k, v, kw


@pytest.mark.parametrize("kw", MASKS, ids=MASK_IDS)
def test_mask_rule_on_every_array_path(kw, monkeypatch):
    """The plain path, the blocked one (many pieces and query blocks) and the reference equal the
    row-by-row rule in float64, and the gradients of both paths are the reference's (central
    differences) and each other's."""
    monkeypatch.setattr(attention_op, "PIECE_ELEMS", 1 << 9)
    monkeypatch.setattr(attention_op, "QBLOCK_ELEMS", 1 << 8)
    q, k, v, kw = _masked_case(kw)
    Tq, Tk = q.shape[3], k.shape[2]
    rule = dict(q_first=kw.get("q_first", Tk - Tq), k_first=kw.get("k_first", 0), window=kw.get("window"),
                softcap=kw.get("softcap"), documents=kw.get("documents"))
    want = loop_masked(q, k, v, 0.5, **rule)
    np.testing.assert_allclose(causal_attention_reference(q, k, v, 0.5, **kw), want, rtol=1e-12, atol=1e-14)
    do = np.random.default_rng(2).standard_normal(q.shape)
    grads = []
    for blocked in (True, False):
        o, ctx = causal_attention_forward(q, k, v, scale=0.5, blocked=blocked, **kw)
        assert ctx.blocked == blocked
        np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-14, err_msg=str(blocked))
        grads.append(causal_attention_backward(do, ctx))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)
    assert not np.allclose(want, causal_attention_reference(q, k, v, 0.5))  # the rule changed something

    if kw.get("softcap") is None and kw.get("q_first") is None:
        return  # (the paths' gradients agree above; central differences where the soft-cap or a tile's rows change them)

    def backward(d, ctx):
        return dict(zip("qkv", causal_attention_backward(d, ctx)))

    check_gradients(lambda q, k, v: (causal_attention_reference(q, k, v, 0.5, **kw),
                                     causal_attention_forward(q, k, v, scale=0.5, **kw)[1]),
                    dict(q=q, k=k, v=v), backward, tol=1e-7, max_elements=12)


def test_mask_rule_with_dropout_and_the_default_rule_spelled_out():
    """Dropout on the masked probabilities draws the plain path's masks; q_first / k_first spelling
    out the default rule give the default numbers bit for bit."""
    q, k, v, kw = _masked_case(dict(documents=True, window=6, softcap=2.0))
    o, ctx = causal_attention_forward(q, k, v, dropout_p=0.25, seed=3, offset=10, **kw)
    np.testing.assert_allclose(o, causal_attention_reference(q, k, v, dropout_p=0.25, seed=3, offset=10, **kw),
                               rtol=1e-12, atol=1e-14)

    def backward(d, ctx):
        return dict(zip("qkv", causal_attention_backward(d, ctx)))

    check_gradients(lambda q, k, v: causal_attention_forward(q, k, v, dropout_p=0.25, seed=3, offset=10, **kw),
                    dict(q=q, k=k, v=v), backward, tol=1e-7, max_elements=12)
    # float32 follows float64 on both paths
    do = np.random.default_rng(4).standard_normal(q.shape)
    for blocked in (True, False):
        o64, ctx64 = causal_attention_forward(q, k, v, blocked=blocked, **kw)
        o32, ctx32 = causal_attention_forward(*(a.astype(np.float32) for a in (q, k, v)), blocked=blocked, **kw)
        assert o32.dtype == np.float32
        np.testing.assert_allclose(o32, o64, rtol=1e-4, atol=1e-5)
        for a, b in zip(causal_attention_backward(do.astype(np.float32), ctx32), causal_attention_backward(do, ctx64)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    q, k, v = qkv(SHAPES[4])
    for blocked in (True, False):
        a, _ = causal_attention_forward(q, k, v, blocked=blocked)
        b, _ = causal_attention_forward(q, k, v, blocked=blocked, q_first=k.shape[2] - q.shape[3], k_first=0)
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        causal_attention_forward(q, k, v, window=0)
    with pytest.raises(ValueError, match="the fused attention needs CuPy arrays"):  # (NumPy: no kernels)
        causal_attention_forward(q, k, v, window=3, fused=True)


def test_a_blocked_query_block_of_packed_rows_skips_the_keys_before_its_documents(monkeypatch):
    """Query blocks start at their first row's document (the earliest over a piece's batch rows)."""
    monkeypatch.setattr(attention_op, "PIECE_ELEMS", 1 << 9)
    monkeypatch.setattr(attention_op, "QBLOCK_ELEMS", 1 << 8)
    q, k, v = qkv((2, 1, 1, 40, 40, 4))
    docs = np.repeat(np.arange(4, dtype=np.int32), 10)[None].repeat(2, axis=0)
    docs[1, 15:] += 1  # row 1: documents [0, 10), [10, 15), [15, 20), ...
    _, ctx = causal_attention_forward(q, k, v, documents=(docs, docs))
    starts = {(r0, lo) for blocks in ctx.piece_blocks for r0, _, lo, *_ in blocks}
    assert starts == {(0, 0), (16, 10), (16, 15), (32, 30)}, starts  # (pieces of one row: row 16 of row 1 from 15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_power_of_two_scale_folded_into_q_and_k_changes_no_bit(dtype, monkeypatch):
    """The blocked path multiplies q and k by a power-of-two scale (head dims 4, 16, 64) instead
    of passing over the scores and their gradient with it: outputs and gradients equal, bit for
    bit, those of the same path scaling the scores (a scale of 2^e is exact either way)."""
    monkeypatch.setattr(attention_op, "PIECE_ELEMS", 1 << 10)
    monkeypatch.setattr(attention_op, "QBLOCK_ELEMS", 1 << 8)
    q, k, v = qkv((2, 3, 2, 48, 48, 16), dtype)
    do = np.random.default_rng(1).standard_normal(q.shape).astype(dtype)
    runs = []
    for folds in (True, False):
        monkeypatch.setattr(attention_op, "_folds_scale", lambda xp, scale, rule, folds=folds: folds)
        o, ctx = causal_attention_forward(q, k, v, blocked=True)
        runs.append((o, *causal_attention_backward(do, ctx)))
    for a, b in zip(*runs):
        assert a.dtype == b.dtype == dtype and np.array_equal(a, b)
    assert not np.array_equal(runs[0][0], causal_attention_forward(q, k, v, scale=0.3, blocked=True)[0])  # (the scale is used)
