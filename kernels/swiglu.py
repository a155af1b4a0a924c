"""Launchers of ``kernels/swiglu.cu``: SwiGLU on the fused ``[gate_r ; up_r]`` layout, forward and backward.

One op, four places:

* CUDA source: ``kernels/swiglu.cu``;
* these launchers (argument checks, launch shapes);
* NumPy/CuPy reference: ``cutp/ops/swiglu.py`` (``swiglu_forward``, ``swiglu_backward``), which
  calls these launchers through ``cutp.kernels.dispatch``;
* tests: ``tests/kernels/test_swiglu.py``; benchmark cases ``swiglu_fwd`` and ``swiglu_bwd`` of
  ``python -m cutp bench kernels`` (``cutp/bench/kernel_variants.py``).
"""
from __future__ import annotations

import math

import numpy as np

from .family import KernelFamily, Target, Traffic
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
    tests=("test_swiglu.py",), mutation_classes=("fastmath",))
