"""The Llama-family ops (RMSNorm, RoPE with none/linear/llama3 scaling, SwiGLU): each against a
plain loop or formula written beside it, backward against central differences in float64,
16-bit paths against float32, RMSNorm's 16-bit rounding order bit for bit against HF's order, the
llama3 inv_freq bit for bit against transcriptions of HF's and Meta's functions. The comparisons
with transformers itself are in test_llama_ops_hf.py."""
import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from cutp.ops import (
    SwiGLUCtx,
    RopeScaling,
    common as _common,
    rmsnorm_backward,
    rmsnorm_forward,
    rope_inv_freq,
    rope_tables,
    rotary_backward,
    rotary_forward,
    swiglu_backward,
    swiglu_forward,
)
from cutp.runtime.errors import ConfigError
from tests.gradcheck import check_gradients

BF16 = ml_dtypes.bfloat16
LOW = [BF16, np.float16]
TOL = 1e-7
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
LLAMA32 = dict(LLAMA31, factor=32.0)


@pytest.fixture
def rng():
    return np.random.default_rng(27)


@pytest.fixture(params=["one block", "many blocks"])
def blocks(request, monkeypatch):
    """The row-blocked loops with their default blocks, and cut into blocks of a few rows (ragged last)."""
    if request.param == "many blocks":
        monkeypatch.setattr(_common, "BLOCK_ELEMS", 23)
        monkeypatch.setattr(_common, "MIN_SPLIT_ELEMS", 1)
        assert len(_common.row_blocks(np, 30, 7)) > 3
    return request.param


def snapshot(*arrays):
    return [(a, a.copy()) for a in arrays if isinstance(a, np.ndarray)]


def assert_unchanged(snap):
    for a, before in snap:
        assert a.tobytes() == before.tobytes(), "an input was modified"


def bits(a):
    return np.ascontiguousarray(a).view(np.uint16 if a.itemsize == 2 else np.uint32)


# ---------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------
def rmsnorm_loop(x, w, eps):
    """One row at a time: y = w * x / sqrt(mean of squares + eps)."""
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    for r, row in enumerate(rows):
        ms = sum(v * v for v in row) / len(row)
        for j, v in enumerate(row):
            out[r, j] = (1.0 if w is None else w[j]) * v / math.sqrt(ms + eps)
    return out.reshape(x.shape)


def hf_llama_rmsnorm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward, line by line, in NumPy + ml_dtypes."""
    input_dtype = x.dtype
    hidden_states = x.astype(np.float32)
    variance = np.mean(hidden_states ** 2, axis=-1, keepdims=True)
    hidden_states = hidden_states * (1.0 / np.sqrt(variance + eps))  # torch.rsqrt: 1/sqrt in float32
    return weight * hidden_states.astype(input_dtype)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rmsnorm_is_the_plain_formula_and_its_gradient(rng, with_weight, blocks):
    x = rng.standard_normal((3, 4, 9)) * 2 + 0.3
    w = 1 + 0.3 * rng.standard_normal(9) if with_weight else None
    snap = snapshot(x, w)
    y, ctx = rmsnorm_forward(x, w, eps=1e-5)
    np.testing.assert_allclose(y, rmsnorm_loop(x, w, 1e-5), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(ctx.rstd, 1 / np.sqrt((x * x).mean(-1) + 1e-5), rtol=1e-14)
    assert ctx.rstd.shape == (3, 4) and ctx.rstd.dtype == np.float64
    assert_unchanged(snap)

    def fwd(x, weight=None):
        return rmsnorm_forward(x, weight, 1e-5)

    def bwd(dy, ctx):
        dx, dw = rmsnorm_backward(dy, ctx)
        assert (dw is None) == (not with_weight)
        return {"x": dx, "weight": dw}

    inputs = {"x": x, "weight": w} if with_weight else {"x": x}
    check_gradients(fwd, inputs, bwd, tol=TOL, max_elements=None)


def test_rmsnorm_eps_sits_inside_the_square_root(rng):
    x = np.full((1, 4), 1e-3)
    y, _ = rmsnorm_forward(x, None, eps=1e-6)
    np.testing.assert_allclose(y, 1e-3 / np.sqrt(1e-6 + 1e-6), rtol=1e-14)  # not 1e-3 / (1e-3 + eps)


@pytest.mark.parametrize("dtype", LOW, ids=["bfloat16", "float16"])
def test_rmsnorm_16bit_rounds_as_hf_does_bit_for_bit(rng, dtype, blocks):
    x = (rng.standard_normal((6, 5, 64)) * 3).astype(dtype)
    w = (1 + 0.5 * rng.standard_normal(64)).astype(dtype)
    y, ctx = rmsnorm_forward(x, w, eps=1e-5)
    ref = hf_llama_rmsnorm(x, w, 1e-5)
    assert y.dtype == ref.dtype == dtype and ctx.rstd.dtype == np.float32
    assert np.array_equal(bits(y), bits(ref))
    # the other order (multiply in float32, round once: Qwen3-style) differs: the test can tell them apart
    x32 = x.astype(np.float32)
    other = (w.astype(np.float32) * (x32 / np.sqrt(np.mean(x32 ** 2, -1, keepdims=True) + 1e-5))).astype(dtype)
    assert not np.array_equal(bits(y), bits(other))


def test_rmsnorm_precisions_agree_with_float32(rng, blocks):
    x = rng.standard_normal((4, 7, 48)) * 2 + 0.5
    w = 1 + 0.2 * rng.standard_normal(48)
    dy = rng.standard_normal(x.shape)
    y32, c32 = rmsnorm_forward(x.astype(np.float32), w.astype(np.float32), 1e-6)
    g32 = rmsnorm_backward(dy.astype(np.float32), c32)
    y64, c64 = rmsnorm_forward(x, w, 1e-6)
    g64 = rmsnorm_backward(dy, c64)
    assert y32.dtype == c32.rstd.dtype == np.float32 and all(g.dtype == np.float32 for g in g32)
    np.testing.assert_allclose(y32, y64, rtol=1e-5, atol=1e-5)
    for a, r in zip(g32, g64):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)
    for dtype in LOW:
        xl, wl, dyl = (a.astype(dtype) for a in (x, w, dy))
        snap = snapshot(xl, wl, dyl)
        yl, cl = rmsnorm_forward(xl, wl, 1e-6)
        gl = rmsnorm_backward(dyl, cl)
        assert yl.dtype == dtype and cl.rstd.dtype == np.float32
        assert gl[0].dtype == gl[1].dtype == dtype
        yr, cr = rmsnorm_forward(*(a.astype(np.float32) for a in (xl, wl)), 1e-6)
        gr = rmsnorm_backward(dyl.astype(np.float32), cr)
        np.testing.assert_allclose(cl.rstd, cr.rstd, rtol=1e-6)
        np.testing.assert_allclose(yl.astype(np.float32), yr, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(gl[0].astype(np.float32), gr[0], rtol=2e-2, atol=2e-2)
        scale = np.abs(gr[1]).max()  # a sum over 28 rows: compare relative to its size
        np.testing.assert_allclose(gl[1].astype(np.float32) / scale, gr[1] / scale, atol=2e-2)
        assert_unchanged(snap)


def test_rmsnorm_bad_shapes_name_the_problem(rng):
    with pytest.raises(ValueError, match=r"weight has shape \(5,\), expected \(4,\)"):
        rmsnorm_forward(np.ones((2, 4)), np.ones(5))
    _, ctx = rmsnorm_forward(np.ones((2, 4)), np.ones(4))
    with pytest.raises(ValueError, match="dy shape"):
        rmsnorm_backward(np.ones((2, 3)), ctx)


# ---------------------------------------------------------------------------------------
# RoPE: inv_freq and tables
# ---------------------------------------------------------------------------------------
def pow_rounded(base, exponents):
    """``base ** exponents`` in the exponents' dtype, as a correctly rounded pow would give it (the
    double result rounded once; torch's float32 pow, within an ulp of that, is what HF runs)."""
    return (base ** exponents.astype(np.float64)).astype(exponents.dtype)


def rdiv(number, tensor):
    """torch's ``number / tensor``: ``Tensor.__rdiv__`` is ``tensor.reciprocal() * number``."""
    return np.reciprocal(tensor) * number


def hf_llama3_inv_freq(head_dim, base, rope_scaling, dtype=np.float32):
    """transformers' _compute_default_rope_parameters + _compute_llama3_parameters, line by line
    (torch.arange(...).to(float) -> astype(float32); torch.where -> np.where; `~a * ~b` on bools;
    NumPy, like torch, casts a Python number to the array's dtype)."""
    dim = head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(dtype) / dim
    inv_freq = rdiv(1.0, pow_rounded(base, exponents))
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = rdiv(2 * math.pi, inv_freq)
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (rdiv(old_context_len, wavelen) - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def meta_apply_scaling(freqs, scale_factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's llama-models `apply_scaling`: one frequency at a time (0-d tensors there, scalars of
    freqs' dtype here; `number / tensor` is torch's reciprocal-then-multiply, as in HF)."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = rdiv(2 * math.pi, freq)
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (rdiv(old_context_len, wavelen) - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return np.array(new_freqs, dtype=freqs.dtype)


def test_default_inv_freq_is_one_over_theta_to_the_2i_over_d():
    inv = rope_inv_freq(64, 10000.0, None, np.float64)
    assert inv.dtype == np.float64 and inv.shape == (32,)
    np.testing.assert_allclose(inv, [1 / math.pow(10000.0, 2 * i / 64) for i in range(32)], rtol=1e-15)
    inv32 = rope_inv_freq(64, 10000.0, "none", np.float32)
    assert inv32.dtype == np.float32
    np.testing.assert_allclose(inv32, inv, rtol=2e-7)
    assert rope_inv_freq(64, 1e4, None, BF16).dtype == np.float32  # 16-bit models: float32 tables


@pytest.mark.parametrize("scaling", [LLAMA31, LLAMA32], ids=["llama3.1", "llama3.2"])
@pytest.mark.parametrize("head_dim,theta", [(128, 500000.0), (64, 500000.0), (64, 10000.0)])
def test_llama3_inv_freq_is_hfs_and_metas_bit_for_bit(scaling, head_dim, theta):
    ours = rope_inv_freq(head_dim, theta, scaling, np.float32)
    assert ours.dtype == np.float32
    assert np.array_equal(bits(ours), bits(hf_llama3_inv_freq(head_dim, theta, scaling)))
    default = rope_inv_freq(head_dim, theta, None, np.float32)
    meta = meta_apply_scaling(default, scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                              scaling["original_max_position_embeddings"])
    assert np.array_equal(bits(ours), bits(meta))
    # the three bands: short wavelengths kept, long ones divided by the factor, the middle blended
    wavelen = 2 * np.pi / default.astype(np.float64)
    short, long_ = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert short.any() and long_.any()
    assert np.array_equal(ours[short], default[short])
    np.testing.assert_allclose(ours[long_], default[long_] / scaling["factor"], rtol=1e-7)
    mid = ~short & ~long_
    assert np.all(ours[mid] < default[mid]) and np.all(ours[mid] > default[mid] / scaling["factor"])
    # float64 means float64 throughout: the same function in double precision
    ours64 = rope_inv_freq(head_dim, theta, scaling, np.float64)
    assert ours64.dtype == np.float64
    np.testing.assert_array_equal(ours64, hf_llama3_inv_freq(head_dim, theta, scaling, np.float64))
    np.testing.assert_allclose(ours64, ours, rtol=1e-6)


def test_linear_scaling_divides_inv_freq_by_the_factor():
    base = rope_inv_freq(32, 10000.0, None, np.float32)
    lin = rope_inv_freq(32, 10000.0, {"type": "linear", "factor": 4.0}, np.float32)  # the old key `type`
    assert np.array_equal(lin, base / np.float32(4.0))
    assert np.array_equal(rope_inv_freq(32, 10000.0, RopeScaling("linear", factor=4.0)), lin)


def test_yarn_keeps_the_fast_dims_interpolates_the_slow_ones_and_scales_the_tables():
    """YaRN (DeepSeek-V3's, issue 40): dims rotating more than beta_fast times over the original
    context keep their frequency, those under beta_slow are divided by the factor, the tables are
    multiplied by 0.1 ln(factor) + 1 (transformers checks the band between: tests/models/test_hf_moe.py)."""
    base = rope_inv_freq(64, 10000.0, None, np.float64)
    sc = RopeScaling.from_hf({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096})
    yarn = rope_inv_freq(64, 10000.0, sc, np.float64)
    turns = 4096 * base / (2 * np.pi)  # rotations over the original context
    assert np.array_equal(yarn[turns > 32 * 1.5], base[turns > 32 * 1.5])
    np.testing.assert_allclose(yarn[turns < 0.5], base[turns < 0.5] / 40.0, rtol=1e-15)
    assert sc.attention_factor == pytest.approx(0.1 * np.log(40.0) + 1)
    cos, _ = rope_tables(64, 8, 10000.0, sc, np.float64)
    assert np.abs(cos[0]).max() == pytest.approx(sc.attention_factor)


def test_rope_scaling_errors_are_config_errors_naming_the_fix():
    with pytest.raises(ConfigError, match="'dynamic' is not supported"):
        RopeScaling.from_hf({"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ConfigError, match=r"'yarn' lacks \['original_max_position_embeddings'\]"):
        RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match=r"lacks \['low_freq_factor', 'high_freq_factor'\]"):
        RopeScaling.from_hf({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})
    with pytest.raises(ConfigError, match="factor must be a number >= 1"):
        RopeScaling("linear", factor=0.5)
    with pytest.raises(ConfigError, match="high_freq_factor > low_freq_factor"):
        RopeScaling.from_hf(dict(LLAMA31, high_freq_factor=1.0))
    with pytest.raises(ConfigError, match="positive even integer"):
        rope_inv_freq(63, 10000.0)
    assert RopeScaling.from_hf(None) == RopeScaling() == RopeScaling.from_hf({"rope_type": "default"})


def test_rope_tables_are_cos_and_sin_of_position_times_inv_freq():
    cos, sin = rope_tables(16, 50, 10000.0, None, np.float64)
    assert cos.shape == sin.shape == (50, 16) and cos.dtype == np.float64
    inv = [1 / 10000.0 ** (2 * i / 16) for i in range(8)]
    for p in (0, 1, 7, 49):
        expect = [math.cos(p * f) for f in inv] * 2  # cat(freqs, freqs)
        np.testing.assert_allclose(cos[p], expect, rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(sin[p], [math.sin(p * f) for f in inv] * 2, rtol=1e-14, atol=1e-15)
    cos32, _ = rope_tables(16, 50, 10000.0, None, BF16)
    assert cos32.dtype == np.float32
    pos = np.array([[3, 4, 5], [40, 41, 42]])
    c_tok, s_tok = rope_tables(16, pos, 10000.0, None, np.float64)
    assert c_tok.shape == (2, 3, 16)
    assert np.array_equal(c_tok, cos[pos]) and np.array_equal(s_tok, sin[pos])
    c_part, _ = rope_tables(16, 50, 10000.0, None, np.float64, rotary_dim=8)
    assert c_part.shape == (50, 8)


# ---------------------------------------------------------------------------------------
# RoPE: the rotation
# ---------------------------------------------------------------------------------------
def rotary_loop(x, inv_freq, positions, seq_axis=1):
    """Every (token, head) vector by itself: element i and i + h turned by position * inv_freq[i];
    x moved to [B, T, rest..., hd] first; elements past 2 * len(inv_freq) unchanged."""
    xm = np.moveaxis(x, seq_axis, 1)
    B, T, hd = xm.shape[0], xm.shape[1], xm.shape[-1]
    h = len(inv_freq)
    flat = xm.reshape(B, T, -1, hd)
    out = flat.copy()
    pos = np.broadcast_to(positions, (B, T))
    for b in range(B):
        for t in range(T):
            for head in range(flat.shape[2]):
                v = flat[b, t, head]
                for i in range(h):
                    a = pos[b, t] * inv_freq[i]
                    out[b, t, head, i] = v[i] * math.cos(a) - v[i + h] * math.sin(a)
                    out[b, t, head, i + h] = v[i + h] * math.cos(a) + v[i] * math.sin(a)
    return np.moveaxis(out.reshape(xm.shape), 1, seq_axis)


@pytest.mark.parametrize("case", ["positions [T]", "positions [B,T]", "attention layout", "partial rotary"])
def test_rotary_is_the_plain_rotation_and_its_gradient(rng, case, blocks):
    hd, theta = 8, 10000.0
    rd = 4 if case == "partial rotary" else hd
    seq_axis = 3 if case == "attention layout" else 1
    shape = (2, 3, 2, 5, hd) if case == "attention layout" else (2, 5, 3, hd)  # [B, nkv, g, T, hd] / [B, T, H, hd]
    x = rng.standard_normal(shape)
    positions = np.array([[0, 3, 4, 9, 11], [2, 5, 6, 7, 30]]) if case == "positions [B,T]" else np.arange(7, 12)
    cos, sin = rope_tables(hd, 32, theta, LLAMA31, np.float64, rotary_dim=rd)
    snap = snapshot(x, cos, sin, positions)
    y, ctx = rotary_forward(x, cos, sin, positions, seq_axis=seq_axis)
    inv = rope_inv_freq(rd, theta, LLAMA31, np.float64)
    np.testing.assert_allclose(y, rotary_loop(x, inv, positions, seq_axis), rtol=1e-13, atol=1e-14)
    assert_unchanged(snap)

    def fwd(x):
        return rotary_forward(x, cos, sin, positions, seq_axis=seq_axis)

    check_gradients(fwd, {"x": x}, lambda dy, ctx: {"x": rotary_backward(dy, ctx)}, tol=TOL, max_elements=None)
    # a rotation: its transpose undoes it and it keeps every vector's length
    np.testing.assert_allclose(rotary_backward(y, ctx), x, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)


@pytest.mark.parametrize("positions", ["[T]", "[B, T]"])
def test_rotary_float32_is_the_pairwise_formula_to_the_bit(rng, blocks, positions):
    """The host path computes x * cos + swap(x) * (signed, swapped sin) over tiled tables: each
    element must be exactly the pairwise formula's two products and one sum (the bits the
    fused kernel and the earlier code gave), forward (R) and backward (R^T), in place on a
    fused QKV buffer as the attention layer calls it."""
    B, T, H, hd = 3, 7, 5, 16
    h = hd // 2
    qkv = rng.standard_normal((B, T, H + 2, hd)).astype(np.float32)
    pos = rng.integers(0, 40, (B, T)) if positions == "[B, T]" else np.arange(4, 4 + T)
    cos, sin = rope_tables(hd, 40, 10000.0, LLAMA31, np.float32)
    c, s = cos[pos], sin[pos]
    c, s = (c[:, :, None] if c.ndim == 3 else c[None, :, None]), (s[:, :, None] if s.ndim == 3 else s[None, :, None])
    x1, x2 = qkv[:, :, :H, :h], qkv[:, :, :H, h:]
    c1, c2, s1, s2 = c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    want_fwd = np.concatenate([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], axis=-1)
    want_bwd = np.concatenate([x1 * c1 + x2 * s2, x2 * c2 - x1 * s1], axis=-1)
    heads = qkv.copy()[:, :, :H]  # a strided view, as the layer's q/k heads of its fused buffer
    _, ctx = rotary_forward(heads, cos, sin, pos, out=heads)
    assert np.array_equal(heads, want_fwd)
    heads = qkv.copy()[:, :, :H]
    rotary_backward(heads, ctx, out=heads)
    assert np.array_equal(heads, want_bwd)


def test_even_row_blocks_share_the_rows_equally_in_an_even_number_of_blocks():
    for rows, width in ((16, 24576), (1024, 768), (4, 1 << 20), (3, 1 << 20), (2048, 128), (5, 10), (1, 1 << 22)):
        blocks = _common.even_row_blocks(np, rows, width)
        sizes = [b.stop - b.start for b in blocks]
        assert blocks[0].start == 0 and blocks[-1].stop == rows and all(
            a.stop == b.start for a, b in zip(blocks, blocks[1:])), (rows, width, blocks)
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1, (rows, width, sizes)
        n = len(_common.row_blocks(np, rows, width))
        assert len(blocks) == (1 if n == 1 else min(rows, n + n % 2)), (rows, width, sizes)
    assert [b.stop - b.start for b in _common.even_row_blocks(np, 16, 24576)] == [4, 4, 4, 4]  # row_blocks: 6, 6, 4


def test_rotary_scores_depend_only_on_the_distance_of_positions(rng):
    hd = 16
    cos, sin = rope_tables(hd, 200, 10000.0, None, np.float64)
    q, k = rng.standard_normal((2, 1, 1, 1, hd))

    def score(pq, pk):
        rq, _ = rotary_forward(q, cos, sin, np.array([pq]))
        rk, _ = rotary_forward(k, cos, sin, np.array([pk]))
        return float((rq * rk).sum())

    assert abs(score(10, 3) - score(110, 103)) < 1e-12
    assert abs(score(10, 3) - score(10, 4)) > 1e-3


def test_rotary_on_split_sequences_with_global_positions_equals_the_whole(rng, blocks):
    """Sequence parallelism, pipeline micro-batches, a KV cache's steps and context-parallel chunks
    all rotate a slice of the sequence with its global positions: the same numbers bit for bit."""
    B, T, H, hd = 2, 12, 3, 16
    x = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    cos, sin = rope_tables(hd, 64, 500000.0, LLAMA32, np.float32)
    pos = np.arange(T)
    whole, _ = rotary_forward(x, cos, sin, pos)
    halves = [rotary_forward(x[:, s], cos, sin, pos[s])[0] for s in (slice(0, T // 2), slice(T // 2, T))]
    assert np.array_equal(np.concatenate(halves, axis=1), whole)
    # context parallelism's load-balanced chunks [r, 2cp - r - 1] (cp = 2): chunks 0 and 3 on rank 0
    chunk = T // 4
    idx = np.r_[0:chunk, 3 * chunk:4 * chunk]
    cp0, _ = rotary_forward(x[:, idx], cos, sin, pos[idx])
    assert np.array_equal(cp0, whole[:, idx])
    # a KV cache's second step: positions n0..n0+tn with per-row tables [B, T] too
    step, _ = rotary_forward(x[:, 8:], cos, sin, np.tile(pos[8:], (B, 1)))
    assert np.array_equal(step, whole[:, 8:])
    # per-token tables (positions=None) and an in-place rotation give the same numbers
    c_tok, s_tok = rope_tables(hd, pos, 500000.0, LLAMA32, np.float32)
    assert np.array_equal(rotary_forward(x, c_tok, s_tok)[0], whole)
    inplace = x.copy()
    y, ctx = rotary_forward(inplace, cos, sin, pos, out=inplace)
    assert y is inplace and np.array_equal(inplace, whole)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx = rotary_backward(dy, ctx)
    dy_inplace = dy.copy()
    assert np.array_equal(rotary_backward(dy_inplace, ctx, out=dy_inplace), dx)
    assert np.array_equal(dy_inplace, dx)


@pytest.mark.parametrize("dtype", LOW, ids=["bfloat16", "float16"])
def test_rotary_16bit_agrees_with_float32(rng, dtype, blocks):
    x = rng.standard_normal((2, 6, 4, 32)) * 2
    cos, sin = rope_tables(32, 100, 10000.0, None, dtype)
    pos = np.arange(90, 96)
    xl, dyl = x.astype(dtype), rng.standard_normal(x.shape).astype(dtype)
    snap = snapshot(xl, dyl)
    yl, ctx = rotary_forward(xl, cos, sin, pos)
    dxl = rotary_backward(dyl, ctx)
    assert yl.dtype == dxl.dtype == dtype
    y32, ctx32 = rotary_forward(xl.astype(np.float32), cos, sin, pos)
    np.testing.assert_allclose(yl.astype(np.float32), y32, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(dxl.astype(np.float32), rotary_backward(dyl.astype(np.float32), ctx32),
                               rtol=2e-2, atol=2e-2)
    assert_unchanged(snap)


def test_rotary_bad_inputs_name_the_problem(rng):
    cos, sin = rope_tables(8, 10, 10000.0)
    x = np.ones((1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"positions lie in \[8, 11\] but the tables hold 10 positions"):
        rotary_forward(x, cos, sin, np.arange(8, 12))
    with pytest.raises(ValueError, match="must be integer position ids"):
        rotary_forward(x, cos, sin, np.arange(4.0))
    with pytest.raises(ValueError, match="do not match x"):
        rotary_forward(x, cos, sin, np.arange(5))
    with pytest.raises(ValueError, match="at most the head dim"):
        rotary_forward(np.ones((1, 4, 2, 4), np.float32), cos, sin, np.arange(4))


# ---------------------------------------------------------------------------------------
# SwiGLU
# ---------------------------------------------------------------------------------------
def swiglu_formula(gate_up):
    F = gate_up.shape[-1] // 2
    g, u = gate_up[..., :F], gate_up[..., F:]
    return g / (1 + np.exp(-g)) * u


def test_swiglu_is_silu_gate_times_up_and_its_gradient(rng, blocks):
    a = rng.standard_normal((3, 4, 10)) * 3
    snap = snapshot(a)
    y, ctx = swiglu_forward(a)
    assert y.shape == (3, 4, 5)
    np.testing.assert_allclose(y, swiglu_formula(a), rtol=1e-14, atol=1e-15)
    assert_unchanged(snap)
    check_gradients(swiglu_forward, {"gate_up": a}, lambda dy, ctx: {"gate_up": swiglu_backward(dy, ctx)},
                    tol=TOL, max_elements=None)


def test_swiglu_backward_from_the_kept_exp_equals_recomputing_it(rng, monkeypatch):
    """On the host the forward keeps exp(-gate) for the backward; the backward from it and the one
    recomputing it (a ctx without it) agree to the bit, and the kept array is left as it was (the
    NumPy path's property: the compiled kernels, whose exp is their own, are off here;
    tests/ops/test_cpu_kernels.py compares them with this path)."""
    monkeypatch.setenv("CUTP_CPU_KERNELS", "0")
    for dtype in (np.float32, np.float64):
        a = (rng.standard_normal((50, 12)) * 3).astype(dtype)
        dy = rng.standard_normal((50, 6)).astype(dtype)
        _, ctx = swiglu_forward(a)
        kept = ctx.exp_neg.copy()
        d = swiglu_backward(dy, ctx)
        assert np.array_equal(d, swiglu_backward(dy, SwiGLUCtx(a))) and d.dtype == dtype
        assert np.array_equal(ctx.exp_neg, kept)


def test_swiglu_is_stable_for_huge_gates():
    a = np.array([[-1000.0, -80.0, 0.0, 80.0, 1000.0, 2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow in exp
        y, ctx = swiglu_forward(a)
        d = swiglu_backward(np.ones_like(y), ctx)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(d))
    np.testing.assert_allclose(y[0], [0.0, -80.0 * 2 * math.exp(-80.0), 0.0, 160.0, 2000.0], rtol=1e-6, atol=1e-30)
    # d gate = up * silu'(g): silu'(0) = 1/2, silu'(large) = 1, silu'(very negative) = 0
    np.testing.assert_allclose(d[0, :5], [0.0, 0.0, 1.0, 2.0, 2.0], atol=1e-6)


@pytest.mark.parametrize("tp", [2, 4])
def test_swiglu_on_each_ranks_gate_and_up_columns_gives_its_slice_of_the_output(rng, tp):
    """A TP rank's fused shard is [gate_r ; up_r]: the op's local chunk then is the right pair."""
    F = 8
    gate, up = rng.standard_normal((2, 3, F)), rng.standard_normal((2, 3, F))
    whole, _ = swiglu_forward(np.concatenate([gate, up], -1))
    cols = F // tp
    parts = [swiglu_forward(np.concatenate([gate[..., r * cols:(r + 1) * cols], up[..., r * cols:(r + 1) * cols]],
                                           -1))[0] for r in range(tp)]
    assert np.array_equal(np.concatenate(parts, -1), whole)
    naive = np.concatenate([gate, up], -1)[..., : 2 * cols]  # a plain slice of [gate ; up]: wrong pairs
    assert not np.allclose(swiglu_forward(naive)[0], whole[..., :cols])


def test_swiglu_16bit_agrees_with_float32(rng, blocks):
    a = rng.standard_normal((5, 7, 24)) * 2
    dy = rng.standard_normal((5, 7, 12))
    for dtype in LOW:
        al, dyl = a.astype(dtype), dy.astype(dtype)
        yl, cl = swiglu_forward(al)
        dl = swiglu_backward(dyl, cl)
        assert yl.dtype == dl.dtype == dtype
        y32, c32 = swiglu_forward(al.astype(np.float32))
        np.testing.assert_allclose(yl.astype(np.float32), y32, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(dl.astype(np.float32), swiglu_backward(dyl.astype(np.float32), c32),
                                   rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="must be even"):
        swiglu_forward(np.ones((2, 5)))



def test_rotary_in_place_on_the_fused_qkv_buffer_equals_rotating_q_and_k_in_the_attention_layout(rng):
    """The attention layer's QKV output [B, T, (nq + 2 nkv) hd] keeps q's and k's columns side by
    side: one in-place call on that view rotates both (GQA: nq = 6 query heads, nkv = 2 KV heads),
    the same numbers as rotating q [B, nkv, g, T, hd] and k [B, nkv, T, hd] one by one."""
    B, T, nq, nkv, hd = 2, 5, 6, 2, 8
    qkv = rng.standard_normal((B, T, (nq + 2 * nkv) * hd))
    cos, sin = rope_tables(hd, 64, 10000.0, LLAMA31, np.float64)
    pos = np.arange(20, 20 + T)
    g = nq // nkv
    q = qkv[..., : nq * hd].reshape(B, T, nkv, g, hd).transpose(0, 2, 3, 1, 4)
    k = qkv[..., nq * hd:(nq + nkv) * hd].reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
    q_ref, _ = rotary_forward(q, cos, sin, pos, seq_axis=3)
    k_ref, _ = rotary_forward(k, cos, sin, pos, seq_axis=2)
    v_before = qkv[..., (nq + nkv) * hd:].copy()
    heads = qkv[..., : (nq + nkv) * hd].reshape(B, T, nq + nkv, hd)
    assert np.shares_memory(heads, qkv)  # a view: the call below writes the buffer
    rotary_forward(heads, cos, sin, pos, out=heads)
    assert np.array_equal(q, q_ref) and np.array_equal(k, k_ref)  # q, k: views of the rotated buffer
    assert np.array_equal(qkv[..., (nq + nkv) * hd:], v_before)  # V is not rotated
