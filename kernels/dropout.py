"""Launchers of ``kernels/dropout.cu``, and the kernel's contract for its random numbers.

The keep-mask is a counter-based hash of ``(seed, offset, element index)`` (SplitMix64, spelled
out in ``cutp/ops/dropout.py``'s docstring), compared with an integer threshold: the rule for
that threshold (:func:`keep_threshold`) and the 64-bit wrap of seed and offset (:data:`MASK64`)
are defined here, with the kernel that depends on them, and ``cutp.ops.dropout`` imports them,
so the NumPy/CuPy reference and the kernel cannot drift apart and masks stay bit-identical.

One op, four places:

* CUDA source: ``kernels/dropout.cu``;
* these launchers (the host-side seed, offset and threshold; argument checks);
* NumPy/CuPy reference: ``cutp/ops/dropout.py`` (``dropout_mask``, ``dropout_forward``,
  ``dropout_backward``), which calls these launchers through ``cutp.kernels.dispatch``;
* tests: ``tests/kernels/test_dropout.py``. ``python -m cutp bench kernels`` has no dropout
  case.
"""
from __future__ import annotations

import math

import numpy as np

from .family import KernelFamily, Target, Traffic
from .runtime import ELEMENTWISE_THREADS, LauncherBase, ceil_div, check_array, dtype_suffix

MASK64 = (1 << 64) - 1  # seeds and offsets are taken modulo 2**64, as the kernel's uint64 arithmetic does


def keep_threshold(p: float) -> int:
    """The integer threshold ``ceil(p * 2**24)``: element kept iff its 24-bit ``u`` >= it.

    Computed on the host (``p * 2**24`` is exact in float64), so the kernel compares integers and
    never depends on float rounding."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return int(math.ceil(float(p) * (1 << 24)))


class DropoutLaunchers(LauncherBase):
    """dropout_mask, dropout_forward, dropout_apply."""

    @staticmethod
    def _dropout_args(p: float, seed: int, offset: int):
        return np.uint64(int(seed) & MASK64), np.uint64(int(offset) & MASK64), np.uint32(keep_threshold(float(p)))

    def dropout_mask(self, shape, p: float, seed: int, offset: int):
        """Bool keep-mask of `shape`, bit-identical to cutp.ops.dropout_mask. One element per thread."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = math.prod(shape)
        mask = self.xp.empty(shape, dtype=bool)
        s, o, thr = self._dropout_args(p, seed, offset)
        self._launch("dropout", "dropout_mask_bool", (ceil_div(n, ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,),
                     (mask, np.int64(n), s, o, thr))
        return mask

    def dropout_forward(self, x, p: float, seed: int, offset: int):
        """(y, mask): y = (x * mask) * scale with scale = 1 / (1 - p) (0 for p == 1), in x's dtype,
        and the bool keep-mask, in one pass (cutp.ops.dropout_forward for p > 0)."""
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        s, o, thr = self._dropout_args(p, seed, offset)
        scale = 0.0 if float(p) == 1.0 else 1.0 / (1.0 - float(p))
        y = xp.empty(x.shape, dtype=x.dtype)
        mask = xp.empty(x.shape, dtype=bool)
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("dropout", f"dropout_forward_{dtype_suffix(x.dtype)}", grid, block,
                     (y, mask, x, np.int64(x.size), s, o, thr, np.float32(scale)))
        return y, mask

    def dropout_apply(self, x, mask, scale: float):
        """(x * mask) * scale in x's dtype (the dropout backward with the saved mask)."""
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        check_array(xp, "mask", mask, dtype=bool, shape=x.shape)
        y = xp.empty(x.shape, dtype=x.dtype)
        grid, block = self._elementwise_grid(x.size, x.dtype)
        self._launch("dropout", f"dropout_apply_{dtype_suffix(x.dtype)}", grid, block,
                     (y, x, mask, np.int64(x.size), np.float32(scale)))
        return y


FAMILY = KernelFamily(
    "dropout", ("dropout",), DropoutLaunchers,
    targets={
        "dropout_mask_bool": Target(256, 8, "elementwise"),
        "dropout_forward": Target(256, 8, "elementwise"),
        "dropout_apply": Target(256, 8, "elementwise"),
    },
    traffic={
        "dropout_mask_bool": Traffic(0, u8=1, ops=28, int=True, what="write the mask (SplitMix64)"),
        "dropout_forward": Traffic(2, u8=1, ops=30, int=True, what="read x; write y, mask"),
        "dropout_apply": Traffic(2, u8=1, ops=2, what="read x, mask; write y"),
    },
    tests=("test_dropout.py",))
