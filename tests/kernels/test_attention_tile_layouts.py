"""cutp.ops.attention_tiles on the kernels with an output gradient the kernels cannot read as it
is (its head axis strided: a transposed view): copied once, the same gradients as from its
contiguous copy, bit for bit."""
from __future__ import annotations

import numpy as np

from cutp.ops import attention_tiles as tiles

from .helpers import F32
from .test_attention import attention_inputs
from .test_attention_tiles import tile_kernels  # noqa: F401 (the fixture)


def test_a_strided_output_gradient_is_copied_for_the_kernels(backend, tile_kernels):  # noqa: F811
    q, k, v, do = attention_inputs(1, 1, 2, 16, 16, 64, F32, seed=4)
    o, lse = tiles.tile_forward(q, k, v, 0.125, (0, 0))
    rowdot = (np.asarray(do, np.float32) * np.asarray(o)).sum(axis=-1)
    strided = np.ascontiguousarray(np.swapaxes(do, -1, -2)).swapaxes(-1, -2)  # (head axis stride 16 elements)
    assert strided.strides[-1] != strided.itemsize and np.array_equal(strided, do)
    got = tiles.tile_backward(strided, q, k, v, rowdot, np.asarray(lse), 0.125, (0, 0))
    want = tiles.tile_backward(np.ascontiguousarray(do), q, k, v, rowdot, np.asarray(lse), 0.125, (0, 0))
    assert tile_kernels.launches["attention_backward_dq_f32_d64"] == 2  # (the kernels ran, twice)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name
