"""Launchers of ``kernels/softmax.cu``: the (causal) softmax of attention, forward and backward.

One op, four places:

* CUDA source: ``kernels/softmax.cu``;
* these launchers (argument checks, launch shapes);
* NumPy/CuPy reference: ``cutp/ops/softmax.py`` (``softmax_forward``, ``softmax_backward``),
  which calls these launchers through ``cutp.kernels.dispatch``;
* tests: ``tests/kernels/test_softmax.py``; benchmark cases ``softmax_fwd`` and ``softmax_bwd``
  of ``python -m cutp bench kernels`` (declared below, with the family).
"""
from __future__ import annotations

import math

import numpy as np

from .family import BenchCase, KernelFamily, Target, Traffic
from .runtime import KernelArgumentError, LauncherBase, ceil_div, check_array, dtype_suffix, int32_arg

SOFTMAX_WARP_ROW_MAX = 1024  # rows up to this length: a warp per row; longer: a block per row


class SoftmaxLaunchers(LauncherBase):
    """softmax_forward, softmax_backward."""

    def softmax_forward(self, x, scale: float = 1.0, causal: bool = False):
        """y = softmax(scale * x) over the last axis of x [..., Tq, Tk] (1-D: one row); with
        causal, query row i (position Tk - Tq + i) sees keys 0 .. Tk - Tq + i, the rest are 0.

        One warp per row for Tk <= 1024 (four rows per block), one block of up to 512 threads per
        row beyond; both loop over the row, so any length works."""
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        if x.ndim < 1:
            raise KernelArgumentError("softmax needs at least one axis")
        if causal and x.ndim < 2:
            raise ValueError("causal softmax needs x of shape [..., Tq, Tk]")
        Tk = x.shape[-1]
        Tq = x.shape[-2] if x.ndim >= 2 else 1
        if causal and Tq > Tk:
            raise ValueError(f"causal softmax needs Tq <= Tk, got Tq={Tq}, Tk={Tk}")
        n_rows = math.prod(x.shape[:-1])
        y = xp.empty(x.shape, dtype=x.dtype)
        rows_per_block, block, block_per_row = self._row_shape(Tk, x.dtype, SOFTMAX_WARP_ROW_MAX, max_threads=512)
        self._launch("softmax", f"softmax_forward_{dtype_suffix(x.dtype)}", (ceil_div(n_rows, rows_per_block),),
                     block, (y, x, np.int64(n_rows), int32_arg("Tq", Tq), int32_arg("Tk", Tk), np.float32(scale),
                             np.int32(bool(causal)), block_per_row))
        return y

    def softmax_backward(self, dy, y, scale: float = 1.0):
        """dx = scale * y * (dy - sum(dy * y)) over the last axis, in y's dtype."""
        xp = self.xp
        check_array(xp, "y", y, float_data=True)
        if y.ndim < 1:
            raise KernelArgumentError("softmax needs at least one axis")
        check_array(xp, "dy", dy, dtype=y.dtype, shape=y.shape)
        Tk = y.shape[-1]
        n_rows = math.prod(y.shape[:-1])
        dx = xp.empty(y.shape, dtype=y.dtype)
        rows_per_block, block, block_per_row = self._row_shape(Tk, y.dtype, SOFTMAX_WARP_ROW_MAX, max_threads=512)
        self._launch("softmax", f"softmax_backward_{dtype_suffix(y.dtype)}", (ceil_div(n_rows, rows_per_block),),
                     block, (dx, dy, y, np.int64(n_rows), int32_arg("Tk", Tk), np.float32(scale), block_per_row))
        return dx


def _bench_cases(sz):
    T = sz["seq"]
    return [dict(B=max(1, n // T), heads=max(1, c // 64), T=T) for c in sz["widths"] for n in sz["rows"]]


def _bench_setup(backward):
    def setup(ops, normal, xp, s, dt, rng):
        shape = (s["B"], s["heads"], s["T"], s["T"])
        d = dict(x=normal(xp, rng, shape, dt), scale=1.0 / 8.0)
        if backward:
            _, d["ctx"] = ops.softmax_forward(d["x"], d["scale"], causal=True)
            d["dy"] = normal(xp, rng, shape, dt)
        return d

    return setup


def _bench_fwd(k, d, ops):
    y = k.softmax_forward(d["x"], d["scale"], True)
    return y, ops.SoftmaxCtx(y, d["scale"])


def _bench_label(s):
    return f"{s['B']}x{s['heads']}x{s['T']}x{s['T']}"


BENCH = (
    BenchCase("softmax_fwd", "causal softmax(scale * x) over [B, heads, T, T]",
              "read x, write y over the full T x T square: 2*B*heads*T*T*s", _bench_cases, _bench_setup(False),
              lambda ops, d: (lambda: ops.softmax_forward(d["x"], d["scale"], causal=True)), _bench_fwd,
              lambda s, it: 2 * s["B"] * s["heads"] * s["T"] ** 2 * it, outputs=lambda d, r: (r[0],),
              label=_bench_label),
    BenchCase("softmax_bwd", "dx = scale * y * (dy - sum(dy * y))", "read y, dy; write dx: 3*B*heads*T*T*s",
              _bench_cases, _bench_setup(True), lambda ops, d: (lambda: ops.softmax_backward(d["dy"], d["ctx"])),
              lambda k, d, ops: k.softmax_backward(d["dy"], d["ctx"].y, d["ctx"].scale),
              lambda s, it: 3 * s["B"] * s["heads"] * s["T"] ** 2 * it, label=_bench_label),
)


FAMILY = KernelFamily(
    "softmax", ("softmax",), SoftmaxLaunchers,
    targets={
        "softmax_forward": Target(512, 3, "bf16 online max/sum over 8 floats per chunk: 75%"),
        "softmax_backward": Target(512, 3, "bf16 2 x 8 floats per chunk: 75%"),
    },
    traffic={
        "softmax_forward": Traffic(3, ops=12, what="read x twice (2 passes), write y"),
        "softmax_backward": Traffic(5, ops=5, what="read dy, y twice (2 passes), write dx"),
    },
    tests=("test_softmax.py",), mutation_classes=("fastmath",), bench=BENCH)
