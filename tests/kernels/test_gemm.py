"""cutp.ops.gemm on a real GPU (skipped without one; `make gpu-check` runs tests/kernels there):
the cuBLAS path of a linear layer, forward, dx, the weight gradient accumulated into a float32
main_grad and the bias gradient, against the upcast composition on the same GPU
(CUTP_KERNELS=0), in bfloat16, float16 and float32, and with TF32 allowed; what the forward takes
from CuPy's pool is what the planner books (y only, no float32 copies). The same calls are pinned
without a GPU by tests/ops/test_gemm.py's fake of the binding."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cutp import ops
from cutp.kernels import use_kernels
from cutp.runtime.backend import cupy_status
from cutp.runtime.shape_only import ShapeOnly

usable, why = cupy_status()
pytestmark = pytest.mark.skipif(not usable, reason=f"no GPU through CuPy: {why}")
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}  # normwise: one rounding of the output apart


def _rel(a, b) -> float:
    a, b = (np.asarray(v.get() if hasattr(v, "get") else v, np.float64) for v in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _arrays(cupy, dtype, rows=509, n_in=320, n_out=704):  # rows not a multiple of any tile
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((rows, n_in)), 0.05 * rng.standard_normal((n_in, n_out)),
            rng.standard_normal(n_out), rng.standard_normal((rows, n_out))]
    return [cupy.asarray(a.astype(np.float32)).astype(dtype) for a in host], rng.standard_normal((n_in, n_out))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_cublas_linear_layer_agrees_with_the_upcast_composition(dtype):
    import cupy  # optional dependency: this test's GPU

    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    (x, w, b, dy), g0 = _arrays(cupy, dt)
    results = {}
    for kernels in (True, False):
        with use_kernels(kernels):
            y, ctx = ops.linear_forward(x, w, b)
            g = cupy.asarray(g0.astype(np.float32))
            dx, dw, db = ops.linear_backward(dy, ctx, wgrad_out=g)
            assert dw is g and y.dtype == dx.dtype == db.dtype == dt
            results[kernels] = (y, dx, db, g)
    for name, fast, ref in zip(("y", "dx", "db", "main_grad"), results[True], results[False]):
        assert _rel(fast, ref) <= TOL[dtype], (dtype, name, _rel(fast, ref))


def test_tf32_only_when_allowed():
    import cupy  # optional dependency: this test's GPU

    (x, w, _, _), _ = _arrays(cupy, np.dtype(np.float32))
    exact = x.get().astype(np.float64) @ w.get().astype(np.float64)
    try:
        y32 = ops.linear_forward(x, w)[0]
        ops.allow_tf32(True)
        y_tf32 = ops.linear_forward(x, w)[0]
    finally:
        ops.allow_tf32(False)
    assert _rel(y32, exact) <= 1e-5 and _rel(y_tf32, exact) <= 5e-3


def test_the_forward_takes_from_the_pool_what_the_planner_books():
    import cupy  # optional dependency: this test's GPU

    (x, w, _, _), _ = _arrays(cupy, BF16)
    pool = cupy.get_default_memory_pool()
    ops.linear_forward(x, w)  # (a first call may set up cuBLAS's workspace; its y is freed)
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    y, _ = ops.linear_forward(x, w)
    taken = pool.used_bytes() - before
    xp = ShapeOnly("cuda")
    xs, ws = xp.empty(x.shape, BF16), xp.empty(w.shape, BF16)
    start = xp.heap.cur
    ys, _ = ops.linear_forward(xs, ws)
    assert taken == xp.heap.cur - start == -(-y.nbytes // 512) * 512
