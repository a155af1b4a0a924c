"""kernels/swiglu.cu through its launchers (kernels/swiglu.py) against cutp/ops/swiglu.py, on each backend.

swiglu_forward / swiglu_backward on the [gate_r ; up_r] layout: widths that are and are not a
multiple of the 128-bit chunk (a chunk straddling two rows), inputs past the exp clamp, float32
within 1e-5, bfloat16 within 2e-2; the backward writes every element of both halves.
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops

from .helpers import DT_IDS, DTYPES, F32, close, gpu_sized, randn


# F = 1, 3, 5 (not a multiple of 4 or 8: the element path, chunks across rows); 8, 64 (the
# 128-bit path); 392 (llama-tiny's hidden); rows 1, 7
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", [(1, 2), (7, 6), (3, 10), (5, 16), (2, 3, 128), (3, 784), gpu_sized((2048, 8192))])
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
