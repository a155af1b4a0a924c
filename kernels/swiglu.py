"""Launchers of ``kernels/swiglu.cu``: SwiGLU on the fused ``[gate_r ; up_r]`` layout, forward and backward.

One op, four places:

* CUDA source: ``kernels/swiglu.cu``;
* these launchers (argument checks, launch shapes);
* NumPy/CuPy reference: ``cutp/ops/swiglu.py`` (``swiglu_forward``, ``swiglu_backward``), which
  calls these launchers through ``cutp.kernels.dispatch``;
* tests: ``tests/kernels/test_swiglu.py``; benchmark cases ``swiglu_fwd`` and ``swiglu_bwd`` of
  ``python -m cutp bench kernels`` (declared below, with the family).
"""
from __future__ import annotations

import math

import numpy as np

from .family import BenchCase, KernelFamily, Target, Traffic
from .runtime import KernelArgumentError, LauncherBase, check_array, dtype_suffix, int32_arg


def _width(gate_up) -> int:
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
        raise KernelArgumentError(f"gate_up {tuple(gate_up.shape)} must have an even last axis ([gate ; up] "
                                  "columns of equal width)")
    return gate_up.shape[-1] // 2


class SwiGLULaunchers(LauncherBase):
    """swiglu_forward, swiglu_backward."""

    def swiglu_forward(self, gate_up):
        """y [..., F] = silu(gate_up[..., :F]) * gate_up[..., F:] in gate_up's dtype.
        Elementwise: one 128-bit chunk of y per thread."""
        xp = self.xp
        check_array(xp, "gate_up", gate_up, float_data=True)
        F = _width(gate_up)
        n_rows = math.prod(gate_up.shape[:-1])
        y = xp.empty(gate_up.shape[:-1] + (F,), dtype=gate_up.dtype)
        grid, block = self._elementwise_grid(y.size, y.dtype)
        self._launch("swiglu", f"swiglu_forward_{dtype_suffix(y.dtype)}", grid, block,
                     (y, gate_up, np.int64(n_rows), int32_arg("F", F)))
        return y

    def swiglu_backward(self, dy, gate_up):
        """d_gate_up [..., 2F] of swiglu_forward for dy [..., F], in gate_up's layout and dtype."""
        xp = self.xp
        check_array(xp, "gate_up", gate_up, float_data=True)
        F = _width(gate_up)
        check_array(xp, "dy", dy, dtype=gate_up.dtype, shape=gate_up.shape[:-1] + (F,))
        n_rows = math.prod(gate_up.shape[:-1])
        d = xp.empty(gate_up.shape, dtype=gate_up.dtype)
        grid, block = self._elementwise_grid(dy.size, dy.dtype)
        self._launch("swiglu", f"swiglu_backward_{dtype_suffix(dy.dtype)}", grid, block,
                     (d, dy, gate_up, np.int64(n_rows), int32_arg("F", F)))
        return d


def _bench_cases(sz):
    """[N, 2F] gate_up: F = 4C at GPT-2's widths (tiny, cpu) / Llama's hidden widths (gpu: 8192, 14336)."""
    hidden = {2048: 8192, 4096: 14336}
    return [dict(N=n, F=4 * c) for c in sz["widths"][:2] for n in sz["rows"]] + [
        dict(N=sz["rows"][-1], F=hidden[c]) for c in sz.get("llama_widths", ())]


def _bench_setup(backward):
    def setup(ops, normal, xp, s, dt, rng):
        d = dict(gate_up=normal(xp, rng, (s["N"], 2 * s["F"]), dt, 2.0))
        if backward:
            d["dy"] = normal(xp, rng, (s["N"], s["F"]), dt)
        return d

    return setup


def _bench_label(s):
    return f"{s['N']}x2x{s['F']}"


BENCH = (
    BenchCase("swiglu_fwd", "y = silu(gate) * up on [gate ; up]", "read gate_up; write y: 3*N*F*s",
              _bench_cases, _bench_setup(False), lambda ops, d: (lambda: ops.swiglu_forward(d["gate_up"])),
              lambda k, d, ops: (k.swiglu_forward(d["gate_up"]), ops.SwiGLUCtx(d["gate_up"])),
              lambda s, it: 3 * s["N"] * s["F"] * it, outputs=lambda d, r: (r[0],), label=_bench_label),
    BenchCase("swiglu_bwd", "d[gate ; up] of y = silu(gate) * up", "read gate_up, dy; write d_gate_up: 5*N*F*s",
              _bench_cases, _bench_setup(True),
              lambda ops, d: (lambda: ops.swiglu_backward(d["dy"], ops.SwiGLUCtx(d["gate_up"]))),
              lambda k, d, ops: k.swiglu_backward(d["dy"], d["gate_up"]),
              lambda s, it: 5 * s["N"] * s["F"] * it, outputs=lambda d, r: (r,), label=_bench_label),
)

FAMILY = KernelFamily(
    "swiglu", ("swiglu",), SwiGLULaunchers,
    targets={
        "swiglu_forward": Target(256, 6, "elementwise, 3 arrays; bf16 holds 3 x 8 floats and the exp: 75%"),
        "swiglu_backward": Target(256, 5, "elementwise, 5 arrays; bf16 holds 5 x 8 floats: 62%"),
    },
    traffic={
        "swiglu_forward": Traffic(3, ops=12, what="read gate, up; write y (per output element)"),
        "swiglu_backward": Traffic(5, ops=18, what="read gate, up, dy; write d_gate, d_up (per output element)"),
    },
    tests=("test_swiglu.py",), mutation_classes=("fastmath",), bench=BENCH)
