"""How close each float32 kernel is to its NumPy reference (cutp.ops), pinned: which outputs are
bit-identical and which are within a stated number of ulps.

The emulated builds model what makes a GPU's float32 results differ from a plain C++ build:
nvcc's contraction of a*b+c into FMAs and the documented error of the fast intrinsics
(tests/cuda_emu, "Checked builds" and cuda_emu.h). So an emulated pass here says the kernel's
accuracy does not rest on the emulator computing more exactly than the GPU. The bound is in ulps
of the output's largest magnitude (|got - want| / spacing(max |want|)): an elementwise ulp
count is meaningless where the reference itself cancels (gelu of large negative x, LayerNorm's
x - mean, softmax's backward). On a GPU (make gpu-check) each bound gets CUDA_LIBM_ULPS more:
CUDA's expf/tanhf/erfcf are not glibc's (up to 2-4 ulps, CUDA programming guide), and NumPy's
reference uses neither.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops

from .helpers import ADAMW_KW, F32, bits, randn, rng

CUDA_LIBM_ULPS = 4


def ulps_of_max(got, want) -> float:
    """max |got - want| in ulps of max |want| (0 for an empty array)."""
    want = np.asarray(want, np.float32)
    if want.size == 0:
        return 0.0
    unit = np.float64(np.spacing(np.float32(max(np.abs(want).max(), np.finfo(np.float32).tiny))))
    return float(np.max(np.abs(np.asarray(got, np.float64) - want.astype(np.float64))) / unit)


def _gelu(k, dev, approximate):
    x, dy = randn((64, 1000), F32, seed=1, scale=2), randn((64, 1000), F32, seed=2)
    y_ref, ctx = ops.gelu_forward(x, approximate)
    return {f"gelu_forward ({approximate})": (k.gelu_forward(dev(x), approximate), y_ref),
            f"gelu_backward ({approximate})": (k.gelu_backward(dev(dy), dev(x), approximate), ops.gelu_backward(dy, ctx))}


def _bias_gelu(k, dev):
    x, dy, b = randn((64, 1000), F32, seed=1, scale=2), randn((64, 1000), F32, seed=2), randn((1000,), F32, seed=3)
    y, pre = k.bias_gelu_forward(dev(x), dev(b))
    y_ref, ctx = ops.bias_gelu_forward(x, b)
    dx, db = k.bias_gelu_backward(dev(dy), pre)
    dx_ref, db_ref = ops.bias_gelu_backward(dy, ctx)
    return {"bias_gelu_forward": (y, y_ref), "bias_gelu_backward dx": (dx, dx_ref),
            "bias_gelu_backward dbias": (db, db_ref)}


def _softmax(k, dev):
    s, d = randn((4, 4, 64, 64), F32, seed=4, scale=3), randn((4, 4, 64, 64), F32, seed=5)
    out = {}
    for causal in (False, True):
        y_ref, ctx = ops.softmax_forward(s, 0.125, causal)
        out[f"softmax_forward (causal={causal})"] = (k.softmax_forward(dev(s), 0.125, causal), y_ref)
        out[f"softmax_backward (causal={causal})"] = (k.softmax_backward(dev(d), dev(y_ref), 0.125),
                                                      ops.softmax_backward(d, ctx))
    return out


def _layernorm(k, dev):
    x, dy = randn((64, 1000), F32, seed=1, scale=2), randn((64, 1000), F32, seed=2)
    w, b = randn((1000,), F32, seed=6), randn((1000,), F32, seed=3)
    y, mean, rstd = k.layernorm_forward(dev(x), dev(w), dev(b))
    y_ref, ctx = ops.layernorm_forward(x, w, b)
    dx, dw, db = k.layernorm_backward(dev(dy), dev(x), dev(w), mean, rstd, b.dtype)
    dx_ref, dw_ref, db_ref = ops.layernorm_backward(dy, ctx)
    return {"layernorm_forward y": (y, y_ref), "layernorm_backward dx": (dx, dx_ref),
            "layernorm_backward dweight": (dw, dw_ref), "layernorm_backward dbias": (db, db_ref)}


def _cross_entropy(k, dev):
    logits, n_valid = randn((16, 3000), F32, seed=7, scale=3), 2900
    t = rng(8).integers(0, n_valid, 16)
    m, se, tl, sl = k.ce_shard_forward(dev(logits), dev(t), n_valid)
    m_ref, se_ref, tl_ref, sl_ref = ops.ce_shard_forward(logits, t, n_valid)
    scale = np.full(16, 1 / 16, np.float32)
    out = k.ce_shard_backward(dev(logits), dev(m_ref), dev(se_ref), dev(t), n_valid, dev(scale), 0.1, n_valid)
    out_ref = ops.ce_shard_backward(logits, m_ref, se_ref, t, n_valid, scale, 0.1, n_valid)
    return {"ce_shard_forward row_max": (m, m_ref), "ce_shard_forward target_logit": (tl, tl_ref),
            "ce_shard_forward sum_exp": (se, se_ref), "ce_shard_forward sum_logits": (sl, sl_ref),
            "ce_shard_backward": (out, out_ref)}


def _adamw(k, dev):
    r = rng(9)
    n = 10_003
    p, g = r.standard_normal(n).astype(np.float32), r.standard_normal(n).astype(np.float32)
    m, v = (r.standard_normal(n) * 0.1).astype(np.float32), (r.random(n) * 0.01).astype(np.float32)
    mask = (r.random(n) < 0.5).astype(np.float32)
    gp, gm, gv = dev(p), dev(m), dev(v)
    k.adamw_update(gp, dev(g), gm, gv, dev(mask), **ADAMW_KW)
    ops.adamw_update(p, g, m, v, mask, **ADAMW_KW)
    return {"adamw_update p": (gp, p), "adamw_update m": (gm, m), "adamw_update v": (gv, v)}


def _dropout(k, dev):
    x = randn((64, 1000), F32, seed=10)
    y, mask = k.dropout_forward(dev(x), 0.1, 1234, 0)
    y_ref, ctx = ops.dropout_forward(x, 0.1, 1234, 0)
    return {"dropout_forward": (y, y_ref), "dropout_apply": (k.dropout_apply(dev(x), mask, ctx.scale), y_ref)}


# Output: its bound in ulps of its largest magnitude under the emulator; 0 = bit-identical.
# Bit-identical by construction: AdamW (the reference's float32 operations in its order, the _rn
# intrinsics keep nvcc from contracting them), dropout (exact scalings), a row max, a gathered
# logit. The rest reduce in another order than NumPy, or call expf/tanhf/erfcf.
BOUNDS = {
    "adamw_update p": 0, "adamw_update m": 0, "adamw_update v": 0,
    "dropout_forward": 0, "dropout_apply": 0,
    "ce_shard_forward row_max": 0, "ce_shard_forward target_logit": 0,
    "gelu_forward (tanh)": 1, "gelu_forward (none)": 1,
    "gelu_backward (tanh)": 16, "gelu_backward (none)": 2,
    "bias_gelu_forward": 1, "bias_gelu_backward dx": 16, "bias_gelu_backward dbias": 8,
    "softmax_forward (causal=False)": 2, "softmax_forward (causal=True)": 2,
    "softmax_backward (causal=False)": 1, "softmax_backward (causal=True)": 1,
    "layernorm_forward y": 4, "layernorm_backward dx": 4, "layernorm_backward dweight": 4,
    "layernorm_backward dbias": 4,
    "ce_shard_forward sum_exp": 2, "ce_shard_forward sum_logits": 4, "ce_shard_backward": 1,
}
CASES = {"gelu (tanh)": lambda k, dev: _gelu(k, dev, "tanh"), "gelu (none)": lambda k, dev: _gelu(k, dev, "none"),
         "bias_gelu": _bias_gelu, "softmax": _softmax, "layernorm": _layernorm, "cross_entropy": _cross_entropy,
         "adamw": _adamw, "dropout": _dropout}


@pytest.mark.parametrize("case", list(CASES))
def test_float32_kernels_stay_within_their_pinned_ulps(backend, k, case):
    results = CASES[case](k, backend.to_device)
    assert set(results) <= set(BOUNDS), set(results) - set(BOUNDS)
    for name, (got, want) in results.items():
        got = backend.host(got)
        assert got.dtype == np.float32 and got.shape == np.shape(want), name
        if BOUNDS[name] == 0 and backend.emulated:
            np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{name} is no longer bit-identical")
            continue
        bound = BOUNDS[name] + (0 if backend.emulated else CUDA_LIBM_ULPS)
        err = ulps_of_max(got, want)
        assert err <= bound, f"{name}: {err:.2f} ulps of its largest magnitude, pinned at {bound}"

