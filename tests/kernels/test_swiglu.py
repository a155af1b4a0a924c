"""kernels/swiglu.cu through its launchers (kernels/swiglu.py) against cutp/ops/swiglu.py, on each backend.

swiglu_forward / swiglu_backward on the [gate_r ; up_r] layout: widths that are and are not a
multiple of the 128-bit chunk (a chunk straddling two rows), inputs past the exp clamp, float32
within 1e-5, bfloat16 within 2e-2 (and at F = 12, 20, 13: each bf16 vector path); the backward
writes every element of both halves; float32 element by element within the error bounds of its
operations over gates in [-100, 100] (a fast-math exp does not pass).
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops

from .helpers import (
    CUDA_ULPS,
    DT_IDS,
    DTYPES,
    F32,
    assert_within_float32_bound,
    close,
    float32_formula_bound,
    gpu_sized,
    randn,
    wide_range,
)


# F = 1, 3, 5 (not a multiple of 4 or 8: the element path, chunks across rows); 8, 64 (the
# 128-bit path); 392 (llama-tiny's hidden); rows 1, 7; 12 and 20 (4 mod 8: float32's 128-bit path,
# bf16's element path) and 13 (odd)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", [(1, 2), (7, 6), (3, 10), (5, 16), (2, 3, 128), (3, 784), (3, 24), (2, 40), (3, 26),
                                   gpu_sized((2048, 8192))])
def test_swiglu_forward_backward(backend, k, dtype, shape):
    gate_up = randn(shape, dtype, seed=80, scale=3.0)
    gate_up.reshape(-1)[:2] = np.array([-100.0, 95.0], np.float32).astype(dtype)  # past the clamp; exp(95) overflows
    F = shape[-1] // 2
    dy = randn(shape[:-1] + (F,), dtype, seed=81)
    y = k.swiglu_forward(backend.to_device(gate_up))
    y_ref, sctx = ops.swiglu_forward(gate_up)
    close(y, y_ref, dtype, atol=1e-6 if dtype == F32 else None)
    d = k.swiglu_backward(backend.to_device(dy), backend.to_device(gate_up))
    close(d, ops.swiglu_backward(dy, sctx), dtype, atol=1e-6 if dtype == F32 else None)


def test_swiglu_unaligned_view_takes_the_scalar_path(backend, k):
    base = backend.to_device(randn(1 + 4 * 16, F32, seed=82))
    gate_up = base[1:].reshape(4, 16)  # contiguous, 4 bytes past a 16-byte boundary
    assert gate_up.flags.c_contiguous and backend.address(gate_up) % 16 != 0
    host = backend.host(gate_up)
    close(k.swiglu_forward(gate_up), ops.swiglu_forward(host)[0], F32)


def _swiglu(r, g, u):
    """The kernel's float32 formula, every operation marked (tests/kernels/helpers.float32_formula_bound)."""
    e = r(np.exp(np.minimum(-g, 80.0)), CUDA_ULPS["expf"])
    return r(r(g / r(e + 1.0)) * u)


def _swiglu_grad(r, g, u, dy):
    e = r(np.exp(np.minimum(-g, 80.0)), CUDA_ULPS["expf"])
    sig = r(1.0 / r(e + 1.0))
    dg = r(r(r(r(r(r(e * sig) * g) + 1.0) * sig) * u) * dy)
    return dg, r(r(sig * g) * dy)


# Gates over [-100, 100] (past the exp clamp at 80; exp(-g) up to 5.5e34), F = 48 (the 128-bit path)
# and 25 (the element path): y and both halves of the gradient within the first-order error bound of
# their float32 operations (expf 2 ulp, the rest correctly rounded), element by element; __expf
# (2 + 1.16 |x| ulp) is off by tens of ulps wherever exp(-g) dominates.
@pytest.mark.parametrize("F", [48, 25])
def test_float32_swiglu_within_its_operations_error_bounds(backend, k, F):
    g = wide_range(lo=-100.0, hi=100.0).reshape(-1, F)
    u = randn(g.shape, F32, seed=104, scale=2.0)
    dy = randn(g.shape, F32, seed=105)
    gate_up = np.concatenate([g, u], axis=1)
    g64, u64, dy64 = (a.astype(np.float64) for a in (g, u, dy))
    y_exact, y_bound = float32_formula_bound(_swiglu, g64, u64)
    assert_within_float32_bound(k.swiglu_forward(backend.to_device(gate_up)), y_exact, y_bound, "swiglu y")
    (dg, du), (dg_bound, du_bound) = float32_formula_bound(_swiglu_grad, g64, u64, dy64)
    d = backend.host(k.swiglu_backward(backend.to_device(dy), backend.to_device(gate_up)))
    assert_within_float32_bound(d[:, :F], dg, dg_bound, "swiglu d_gate")
    assert_within_float32_bound(d[:, F:], du, du_bound, "swiglu d_up")
