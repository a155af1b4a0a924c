"""Launchers of ``kernels/gelu.cu``: GeLU, and the bias + GeLU of the MLP, forward and backward.

One op, four places:

* CUDA source: ``kernels/gelu.cu`` (its bias gradient's second pass is ``kernels/reduce.cu``);
* these launchers (argument checks, launch shapes);
* NumPy/CuPy reference: ``cutp/ops/gelu.py`` (``gelu_forward``, ``bias_gelu_forward``, ...),
  which calls these launchers through ``cutp.kernels.dispatch``;
* tests: ``tests/kernels/test_gelu.py``; benchmark cases ``bias_gelu_fwd`` and ``bias_gelu_bwd``
  of ``python -m cutp bench kernels`` (declared below, with the family).
"""
from __future__ import annotations

import math

import numpy as np

from .family import BenchCase, KernelFamily, Target, Traffic
from .runtime import (
    ELEMENTWISE_THREADS,
    WARP,
    KernelArgumentError,
    LauncherBase,
    ceil_div,
    check_array,
    clamp,
    dtype_suffix,
    elements_per_128bit,
    int32_arg,
    round_up,
)


class GeluLaunchers(LauncherBase):
    """gelu_forward, gelu_backward, bias_gelu_forward, bias_gelu_backward."""

    @staticmethod
    def _exact(approximate: str) -> np.int32:
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        return np.int32(approximate == "none")

    def gelu_forward(self, x, approximate: str = "tanh"):
        """y = gelu(x), any shape. Elementwise: one 128-bit chunk per thread."""
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        exact = self._exact(approximate)
        y = xp.empty(x.shape, dtype=x.dtype)
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("gelu", f"gelu_forward_{dtype_suffix(x.dtype)}", grid, block, (y, x, np.int64(x.size), exact))
        return y

    def gelu_backward(self, dy, x, approximate: str = "tanh"):
        """dx = dy * gelu'(x), in x's dtype."""
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        check_array(xp, "dy", dy, dtype=x.dtype, shape=x.shape)
        exact = self._exact(approximate)
        dx = xp.empty(x.shape, dtype=x.dtype)
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("gelu", f"gelu_backward_{dtype_suffix(x.dtype)}", grid, block,
                     (dx, dy, x, np.int64(x.size), exact))
        return dx

    def bias_gelu_forward(self, x, b, approximate: str = "tanh"):
        """(y, pre): y = gelu(x + b) and the pre-activation x + b (saved for the backward), both
        shaped like x [..., C] in x's dtype; b is [C]. Elementwise over the flattened x."""
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        if x.ndim < 1:
            raise KernelArgumentError("x must have a last (channel) axis")
        C = x.shape[-1]
        check_array(xp, "b", b, dtype=x.dtype, shape=(C,))
        exact = self._exact(approximate)
        y = xp.empty(x.shape, dtype=x.dtype)
        pre = xp.empty(x.shape, dtype=x.dtype)
        n_rows = math.prod(x.shape[:-1])
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("gelu", f"bias_gelu_forward_{dtype_suffix(x.dtype)}", grid, block,
                     (y, pre, x, b, np.int64(n_rows), int32_arg("C", C), exact))
        return y, pre

    def bias_gelu_backward(self, dy, pre, approximate: str = "tanh"):
        """(dx, db): dx = dy * gelu'(pre) shaped like pre [..., C], and db [C] = dx summed over
        the rows (from the unrounded float32 dx), both in pre's dtype.

        First pass: grid (column chunks, row chunks), each thread walks down its row chunk
        keeping the column sums of its 128-bit chunk of columns in registers (coalesced along
        the rows, no shared memory, no atomics) and writes them to partial [n_chunks, C];
        second pass: column_sum adds the chunks in a fixed order."""
        xp = self.xp
        check_array(xp, "pre", pre, float_data=True)
        if pre.ndim < 1:
            raise KernelArgumentError("pre must have a last (channel) axis")
        check_array(xp, "dy", dy, dtype=pre.dtype, shape=pre.shape)
        exact = self._exact(approximate)
        C = pre.shape[-1]
        n_rows = math.prod(pre.shape[:-1])
        P = elements_per_128bit(pre.dtype)
        col_chunks = ceil_div(C, P)
        threads = clamp(round_up(col_chunks, WARP), WARP, ELEMENTWISE_THREADS)
        gx = max(1, ceil_div(col_chunks, threads))
        n_chunks, rows_per_chunk = self._row_chunks(n_rows, gx)
        dx = xp.empty(pre.shape, dtype=pre.dtype)
        partial = xp.empty((n_chunks, C), dtype=np.float32)
        self._launch("gelu", f"bias_gelu_backward_{dtype_suffix(pre.dtype)}", (gx, n_chunks), (threads,),
                     (dx, partial, dy, pre, np.int64(n_rows), int32_arg("C", C),
                      int32_arg("rows per chunk", rows_per_chunk), exact))
        return dx, self._column_sum(partial, pre.dtype)


def _bench_cases(sz):
    return [dict(N=n, H=4 * c) for c in sz["widths"] for n in sz["rows"]]


def _bench_setup(backward):
    def setup(ops, normal, xp, s, dt, rng):
        d = dict(x=normal(xp, rng, (s["N"], s["H"]), dt), b=normal(xp, rng, (s["H"],), dt, 0.1))
        if backward:
            _, d["ctx"] = ops.bias_gelu_forward(d["x"], d["b"])
            d["dy"] = normal(xp, rng, (s["N"], s["H"]), dt)
        return d

    return setup


def _bench_fwd(k, d, ops):
    y, pre = k.bias_gelu_forward(d["x"], d["b"])
    return y, ops.GeluCtx(pre, "tanh")


BENCH = (
    BenchCase("bias_gelu_fwd", "y = gelu_tanh(x + b), saves x + b", "read x, b; write y and x + b: 3*N*H*s + H*s",
              _bench_cases, _bench_setup(False), lambda ops, d: (lambda: ops.bias_gelu_forward(d["x"], d["b"])),
              _bench_fwd, lambda s, it: 3 * s["N"] * s["H"] * it + s["H"] * it,
              outputs=lambda d, r: (r[0], r[1].x), label=lambda s: f"{s['N']}x{s['H']}"),
    BenchCase("bias_gelu_bwd", "dx = dy * gelu'(x + b), db = sum(dx)", "read dy, x + b; write dx, db: 3*N*H*s + H*s",
              _bench_cases, _bench_setup(True), lambda ops, d: (lambda: ops.bias_gelu_backward(d["dy"], d["ctx"])),
              lambda k, d, ops: k.bias_gelu_backward(d["dy"], d["ctx"].x, d["ctx"].approximate),
              lambda s, it: 3 * s["N"] * s["H"] * it + s["H"] * it, label=lambda s: f"{s['N']}x{s['H']}"),
)


FAMILY = KernelFamily(
    "gelu", ("gelu", "reduce"), GeluLaunchers,
    targets={
        "gelu_forward": Target(256, 8, "elementwise, 2 arrays"),
        "gelu_backward": Target(256, 6, "elementwise; bf16 holds 2 x 8 floats and the tanh/erfc terms: 75%"),
        "bias_gelu_forward": Target(256, 8, "elementwise, 3 arrays"),
        "bias_gelu_backward": Target(256, 5, "bf16 holds 8 column sums + 2 x 8 floats per thread: 62%"),
    },
    traffic={
        "gelu_forward": Traffic(2, ops=20, what="read x, write y"),
        "gelu_backward": Traffic(3, ops=30, what="read x, dy; write dx"),
        "bias_gelu_forward": Traffic(3, ops=21, what="read x; write pre, y"),
        "bias_gelu_backward": Traffic(3, ops=31, what="read pre, dy; write dx"),
    },
    tests=("test_gelu.py",), mutation_classes=("fastmath", "round16"), bench=BENCH)
