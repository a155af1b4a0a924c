"""The planner's GPU walk (shape-only CuPy arrays, cutp.runtime.shape_only) takes the cuBLAS GEMM
path of cutp.ops.gemm: what its heap books for a bf16 linear layer's forward and backward, the LM
head's products and a bias gradient is what that path allocates on (fake) CuPy arrays, measured
at the same shapes in CuPy's 512-byte pool granularity: the outputs and nothing else, no float32
copies of the operands, no temporary of the weight gradient."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cutp import ops
from cutp.runtime.shape_only import ShapeOnly
from tests.ops import cublas_fake as fake

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
ROWS, N_IN, N_OUT, VOCAB = 96, 64, 160, 200


def _phases(bias):
    """(name, inputs as (shape, dtype), the call) of each measured phase."""
    def forward(x, w, b):
        return ops.linear_forward(x, w, b if bias else None)

    def backward(x, w, b, dy, g):
        _, ctx = ops.linear_forward(x, w, b if bias else None)
        return ops.linear_backward(dy, ctx, wgrad_out=g)

    def lm_head(x, table, d, eg):
        logits = ops.gemm(ops.gemm_operand(x), ops.gemm_operand(table), trans_b=True, out_dtype=x.dtype)
        ops.gemm(ops.gemm_operand(d), ops.gemm_operand(x), trans_a=True, out=eg, accumulate=True)
        return logits, ops.gemm(ops.gemm_operand(d), ops.gemm_operand(table), out_dtype=x.dtype)

    def row_bias(dy, g):
        return ops.column_sums(dy, out=g)

    lin = [((ROWS, N_IN), BF16), ((N_IN, N_OUT), BF16), ((N_OUT,), BF16)]
    return [("forward", lin, forward),
            ("backward", lin + [((ROWS, N_OUT), BF16), ((N_IN, N_OUT), F32)], backward),
            ("lm_head", [((ROWS, N_IN), BF16), ((VOCAB, N_IN), BF16), ((ROWS, VOCAB), BF16), ((VOCAB, N_IN), F32)],
             lm_head),
            ("row_bias", [((ROWS, N_OUT), BF16), ((N_OUT,), F32)], row_bias)]


def _planned(inputs, call):
    xp = ShapeOnly("cuda")
    args = [xp.zeros(shape, dtype) for shape, dtype in inputs]
    start = xp.heap.cur
    xp.heap.reset_peak()
    result = call(*args)
    kept, peak = xp.heap.cur - start, xp.heap.peak - start
    del result
    return kept, peak


def _measured(inputs, call):
    args = [fake.device(np.ones(shape, dtype)) for shape, dtype in inputs]
    mem = fake.MEMORY
    start = mem.cur
    mem.reset_peak()
    result = call(*args)
    kept, peak = mem.cur - start, mem.peak - start
    del result
    return kept, peak


def _pool(nbytes):
    return -(-nbytes // fake.POOL_ROUND) * fake.POOL_ROUND


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_the_planner_books_what_the_cublas_gemms_allocate(monkeypatch, bias):
    cublas = fake.FakeCublas()
    fake.install(monkeypatch, cublas)
    for name, inputs, call in _phases(bias):
        planned, measured = _planned(inputs, call), _measured(inputs, call)
        assert planned == measured, (name, planned, measured)
    assert len(cublas.calls) > 0
    # the forward keeps y and no more; without a bias it allocates nothing else (no float32 copy
    # of x or W: 2 x 12 KiB + 20 KiB would show)
    kept, peak = _planned(*_phases(bias)[0][1:])
    assert kept == _pool(ROWS * N_OUT * 2)
    assert peak == kept + (_pool(ROWS * N_OUT * 4) if bias else 0)  # the float32 product the bias is added to
    # the backward (its forward included) adds dx (and the bias gradient) only: dW goes into main_grad
    kept, _ = _planned(*_phases(bias)[1][1:])
    assert kept == _pool(ROWS * N_IN * 2) + (_pool(N_OUT * 2) if bias else 0)
