"""kernels/rotary.cu through its launchers (kernels/rotary.py) against cutp/ops/rotary.py, on each backend.

The rotation of q and k heads in place in a fused QKV buffer (the attention's use: a strided view
[B, T, nq + nkv, hd]) at head dims 64 and 128 and GQA groups 1, 2, 4, 8, from global position ids
[T] and [B, T] into llama3-scaled tables; per-token tables; partial rotary with out= (the tail
copied); the backward (R^T) undoing the forward; tables whose two halves differ (the launch
contract takes c1/c2 and s1/s2 separately) at half widths that take each vector path; float32
within 1e-5, bfloat16 within 2e-2.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops

from .helpers import BF16, DT_IDS, DTYPES, F32, close, randn, rng

LLAMA3 = ops.RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=64)


def _qkv(B, T, nq, nkv, hd, dtype, seed):
    return randn((B, T, (nq + 2 * nkv) * hd), dtype, seed=seed, scale=2.0)


def _heads(qkv, nq, nkv, hd):
    B, T, _ = qkv.shape
    return qkv[..., :(nq + nkv) * hd].reshape(B, T, nq + nkv, hd)


# (nq, nkv): GQA groups 1, 2, 4, 8; head dims 64 and 128 (one case); positions [T] and [B, T]
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("nq,nkv,hd,batched", [(2, 2, 64, False), (4, 2, 64, True), (4, 1, 64, False),
                                                (8, 1, 64, True), (2, 1, 128, True)])
def test_rotary_in_place_on_the_qk_heads_of_a_fused_qkv_buffer(backend, k, dtype, nq, nkv, hd, batched):
    B, T, L = 2, 5, 300
    cos, sin = ops.rope_tables(hd, L, theta=500000.0, scaling=LLAMA3)
    positions = (rng(83).integers(0, L, (B, T)) if batched else np.arange(250, 250 + T)).astype(np.int64)
    qkv = _qkv(B, T, nq, nkv, hd, dtype, seed=84)
    want = qkv.copy()
    h_ref = _heads(want, nq, nkv, hd)
    _, rctx = ops.rotary_forward(h_ref, cos, sin, positions, out=h_ref)

    got = backend.to_device(qkv)
    heads = _heads(got, nq, nkv, hd)
    assert not heads.flags.c_contiguous  # the view goes in as it is
    assert k.rotary(heads, backend.to_device(cos), backend.to_device(sin), backend.to_device(positions),
                    out=heads) is heads
    close(got, want, dtype, atol=1e-5 if dtype == F32 else None)  # V columns untouched, Q and K turned
    assert k.launches[f"rotary_{'f32' if dtype == F32 else 'bf16'}"] == 1

    dy = randn(h_ref.shape, dtype, seed=85)
    dx_ref = ops.rotary_backward(dy, rctx)
    dyd = backend.to_device(dy)
    dx = k.rotary(dyd, backend.to_device(cos), backend.to_device(sin), backend.to_device(positions), out=dyd,
                  transpose=True)
    close(dx, dx_ref, dtype, atol=1e-5 if dtype == F32 else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
def test_rotary_partial_per_token_tables(backend, k, dtype, in_place):
    """rotary_dim 30 of head dim 64: 15 pairs, a last chunk one short of a whole 128-bit chunk
    (4 floats, 8 bf16); per-token tables [B, T, rd]; the 34 elements past rd copied into a new
    out, or left alone in place."""
    B, T, H, hd, rd = 2, 3, 3, 64, 30
    cos, sin = ops.rope_tables(hd, rng(86).integers(0, 1000, (B, T)), rotary_dim=rd)
    x = randn((B, T, H, hd), dtype, seed=87)
    y_ref, _ = ops.rotary_forward(x, cos, sin)
    xd = backend.to_device(x)
    out = xd if in_place else backend.xp.empty(x.shape, dtype)
    y = k.rotary(xd, backend.to_device(cos), backend.to_device(sin), out=out)
    assert y is out
    close(y, y_ref, dtype, atol=1e-5 if dtype == F32 else None)


def test_rotary_backward_undoes_the_forward(backend, k):
    B, T, H, hd = 1, 4, 2, 64
    cos, sin = ops.rope_tables(hd, 16)
    c, s = backend.to_device(cos), backend.to_device(sin)
    pos = backend.to_device(np.array([3, 9, 0, 15], np.int64))
    x = randn((B, T, H, hd), F32, seed=88)
    y = k.rotary(backend.to_device(x), c, s, pos)
    close(k.rotary(y, c, s, pos, transpose=True), x, F32, atol=1e-6)


def test_rotary_refuses_what_it_cannot_take(backend, k):
    from cutp.kernels import KernelArgumentError

    x = backend.xp.zeros((1, 4, 2, 8), np.float32)
    cos, sin = (backend.xp.zeros((4, 8), np.float32),) * 2
    with pytest.raises(KernelArgumentError, match="seq_axis 1"):
        k.rotary(x.reshape(1, 4, 16), cos, sin)
    with pytest.raises(KernelArgumentError, match="float32 tables"):
        k.rotary(x, cos.astype(np.float64), sin)
    with pytest.raises(KernelArgumentError, match="do not match"):
        k.rotary(x, cos, sin, backend.xp.zeros(3, np.int64))
    assert BF16 in DTYPES and DT_IDS


# cos/sin tables whose two halves differ (random: HF's are equal, so a kernel reading one half for
# both passes every test built from rope_tables), forward and backward, from positions [T], [B, T]
# and per-token tables [B, T, rd]; half widths 12, 20 (4 mod 8: a half 128-bit chunk in bf16) and
# 13 (odd: the element path), the last with 6 elements past rd.
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("positions", ["T", "BT", "tables"])
@pytest.mark.parametrize("hd,rd", [(24, 24), (40, 40), (32, 26)])
def test_rotary_tables_with_different_halves(backend, k, dtype, positions, hd, rd):
    B, T, H, L = 2, 3, 2, 16
    g = rng(101)
    shape = (B, T, rd) if positions == "tables" else (L, rd)
    cos, sin = (g.uniform(-1.0, 1.0, shape).astype(np.float32) for _ in range(2))
    h = rd // 2
    assert (cos[..., :h] != cos[..., h:]).all() and (sin[..., :h] != sin[..., h:]).all()
    pos = {"T": np.array([5, 0, 11], np.int64), "BT": g.integers(0, L, (B, T)), "tables": None}[positions]
    x = randn((B, T, H, hd), dtype, seed=102)
    dy = randn((B, T, H, hd), dtype, seed=103)
    y_ref, rctx = ops.rotary_forward(x, cos, sin, pos)
    dx_ref = ops.rotary_backward(dy, rctx)
    dev = backend.to_device
    c, s, p = dev(cos), dev(sin), None if pos is None else dev(pos.astype(np.int64))
    tol = dict(atol=1e-5) if dtype == F32 else {}
    close(k.rotary(dev(x), c, s, p), y_ref, dtype, **tol)
    close(k.rotary(dev(dy), c, s, p, transpose=True), dx_ref, dtype, **tol)
