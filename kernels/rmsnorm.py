"""Launchers of ``kernels/rmsnorm.cu``: RMSNorm over the last axis, forward (plain, and fused with
the residual add before it) and backward.

One op, four places:

* CUDA source: ``kernels/rmsnorm.cu`` (its weight gradient's second pass is ``kernels/reduce.cu``);
* these launchers (argument checks, launch shapes, shared memory);
* NumPy/CuPy reference: ``cutp/ops/rmsnorm.py`` (``rmsnorm_forward``, ``residual_rmsnorm_forward``,
  ``rmsnorm_backward``), which calls these launchers through ``cutp.kernels.dispatch``;
* tests: ``tests/kernels/test_rmsnorm.py``; benchmark cases ``rmsnorm_fwd`` and ``rmsnorm_bwd`` of
  ``python -m cutp bench kernels`` (declared below, with the family).

The backward's launch shape is LayerNorm's (kernels/layernorm.py) with one accumulator per
column instead of two: R * C floats of shared memory per block.
"""
from __future__ import annotations

import math

import numpy as np

from .family import BenchCase, DynamicShared, KernelFamily, Target, Traffic
from .layernorm import LAYERNORM_BACKWARD_BLOCKS_PER_SM, STAT, bench_rows_width, layernorm_backward_threads
from .runtime import (
    DEFAULT_MAX_SHARED,
    KernelArgumentError,
    LauncherBase,
    ceil_div,
    check_array,
    clamp,
    dtype_suffix,
    int32_arg,
)

RMSNORM_WARP_ROW_MAX = 2048  # rows up to this length: a warp per row; longer: a block per row
RMSNORM_BACKWARD_THREADS = 512  # the backward's __launch_bounds__
RESIDUAL_RMSNORM_THREADS = 512  # the fused residual forward's __launch_bounds__ (1024 would spill in bf16)
# The widest row whose backward launch tests/kernel_build/test_resources.py checks against sm_80's
# and sm_90's shared-memory limits (C floats: 128 KiB at 32768; sm_80 allows 163 KiB with the opt-in).
RMSNORM_BACKWARD_MAX_C = 32768


def rmsnorm_backward_rows_per_block(C: int, dtype=np.float32) -> int:
    """R, the rows a block of rmsnorm_backward works on at once: as many groups of
    layernorm_backward_threads(C) threads as RMSNORM_BACKWARD_THREADS hold, while their
    accumulators (R * C floats) stay within 47 KiB (one row's alone may be more: then R = 1 and
    the launcher opts in)."""
    tx = layernorm_backward_threads(C, dtype)
    return max(1, min(RMSNORM_BACKWARD_THREADS // tx, (DEFAULT_MAX_SHARED - 1024) // (4 * max(C, 1))))


def rmsnorm_backward_shared_bytes(C: int, params: bool = True, dtype=np.float32) -> int:
    """Dynamic shared memory of rmsnorm_backward: R * C floats with a weight gradient, else 0."""
    return rmsnorm_backward_rows_per_block(C, dtype) * C * 4 if params else 0


def rmsnorm_backward_grid(n_rows: int, C: int, dtype, sm_count: int) -> int:
    """Blocks of rmsnorm_backward: LAYERNORM_BACKWARD_BLOCKS_PER_SM x sm_count (one wave), or
    fewer when there are not R rows for each (at least 1)."""
    R = rmsnorm_backward_rows_per_block(C, dtype)
    return clamp(ceil_div(n_rows, R), 1, LAYERNORM_BACKWARD_BLOCKS_PER_SM * sm_count)


class RMSNormLaunchers(LauncherBase):
    """rmsnorm_forward, residual_rmsnorm_forward, rmsnorm_backward."""

    def _rmsnorm_forward(self, x, branch, weight, eps):
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        if x.ndim < 1 or x.shape[-1] == 0:
            raise KernelArgumentError(f"x must have a non-empty last (channel) axis, got shape {tuple(x.shape)}")
        C = x.shape[-1]
        if branch is not None:
            check_array(xp, "branch", branch, dtype=x.dtype, shape=x.shape)
        if weight is not None:
            check_array(xp, "weight", weight, dtype=x.dtype, shape=(C,))
        n_rows = math.prod(x.shape[:-1])
        y = xp.empty(x.shape, dtype=x.dtype)
        s = xp.empty(x.shape, dtype=x.dtype) if branch is not None else None
        rstd = xp.empty(n_rows, dtype=np.float32)
        rows_per_block, block, block_per_row = self._row_shape(
            C, x.dtype, RMSNORM_WARP_ROW_MAX, 2, RESIDUAL_RMSNORM_THREADS if branch is not None else 1024)
        name = "residual_rmsnorm_forward" if branch is not None else "rmsnorm_forward"
        self._launch("rmsnorm", f"{name}_{dtype_suffix(x.dtype)}", (ceil_div(n_rows, rows_per_block),),
                     block, (y, rstd, s, x, branch, weight, np.int64(n_rows), int32_arg("C", C), np.float32(eps),
                             block_per_row))
        return y, rstd, s

    def rmsnorm_forward(self, x, weight=None, eps: float = 1e-6):
        """(y, rstd): y = round(x * rstd) * weight over the last axis of x [..., C] in x's dtype
        (HF's rounding order); rstd float32 [n_rows] (flat). weight: [C] of x's dtype, or None.
        A warp per row up to C = 2048, a block per row beyond."""
        y, rstd, _ = self._rmsnorm_forward(x, None, weight, eps)
        return y, rstd

    def residual_rmsnorm_forward(self, x, branch, weight=None, eps: float = 1e-6):
        """(s, y, rstd): s = x + branch rounded to x's dtype (the residual stream after a block's
        branch), y = rmsnorm(s), in one launch that reads x and branch once and writes s once."""
        y, rstd, s = self._rmsnorm_forward(x, branch, weight, eps)
        return s, y, rstd

    def rmsnorm_backward(self, dy, x, weight, rstd, need_dweight: bool | None = None):
        """(dx, dweight) of rmsnorm_forward: dx in x's dtype; dweight [C] in weight's dtype (None
        when weight is None or need_dweight is False). rstd: float32, one element per row.

        A grid of LAYERNORM_BACKWARD_BLOCKS_PER_SM x the SM count (rmsnorm_backward_grid), each
        block over an even share of the rows, R at a time; the partials [blocks, C] are added by
        column_sum in a fixed order. No atomics: deterministic."""
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        if x.ndim < 1 or x.shape[-1] == 0:
            raise KernelArgumentError(f"x must have a non-empty last (channel) axis, got shape {tuple(x.shape)}")
        check_array(xp, "dy", dy, dtype=x.dtype, shape=x.shape)
        C = x.shape[-1]
        n_rows = math.prod(x.shape[:-1])
        if weight is not None:
            check_array(xp, "weight", weight, dtype=x.dtype, shape=(C,))
        check_array(xp, "rstd", rstd, dtype=np.float32)
        if rstd.size != n_rows:
            raise KernelArgumentError(f"rstd has {rstd.size} elements, expected one per row: {n_rows}")
        want_dw = weight is not None and need_dweight is not False
        threads = layernorm_backward_threads(C, x.dtype)
        R = rmsnorm_backward_rows_per_block(C, x.dtype)
        n_blocks = rmsnorm_backward_grid(n_rows, C, x.dtype, self.sm_count())
        dx = xp.empty(x.shape, dtype=x.dtype)
        partial = xp.empty((n_blocks, C), dtype=np.float32) if want_dw else None
        smem = rmsnorm_backward_shared_bytes(C, want_dw, x.dtype)
        self._launch("rmsnorm", f"rmsnorm_backward_{dtype_suffix(x.dtype)}", (n_blocks,), (threads, R),
                     (dx, partial, dy, x, weight, rstd, np.int64(n_rows), int32_arg("C", C)), shared_mem=smem)
        dweight = self._column_sum(partial, weight.dtype) if want_dw else None
        return dx, dweight


def _bench_cases(sz):
    """RMSNorm's shapes: GPT-2's widths and (cpu, gpu) Llama's model widths."""
    return bench_rows_width(sz) + [dict(N=n, C=c) for c in sz.get("llama_widths", ()) for n in sz["rows"][-1:]]


def _bench_setup(backward=False, residual=False):
    def setup(ops, normal, xp, s, dt, rng):
        d = dict(x=normal(xp, rng, (s["N"], s["C"]), dt), w=normal(xp, rng, (s["C"],), dt, 0.1) + 1)
        if backward:
            _, d["ctx"] = ops.rmsnorm_forward(d["x"], d["w"])
            d["dy"] = normal(xp, rng, (s["N"], s["C"]), dt)
        if residual:
            d["branch"] = normal(xp, rng, (s["N"], s["C"]), dt)
        return d

    return setup


def _bench_fwd(k, d, ops):
    y, rstd = k.rmsnorm_forward(d["x"], d["w"])
    return y, ops.RMSNormCtx(d["x"], d["w"], rstd)


def _bench_residual_fwd(k, d, ops):
    s, y, rstd = k.residual_rmsnorm_forward(d["x"], d["branch"], d["w"])
    return s, y, ops.RMSNormCtx(s, d["w"], rstd)


def _bench_bwd(k, d, ops):
    c = d["ctx"]
    return k.rmsnorm_backward(d["dy"], c.x, c.weight, c.rstd.reshape(-1))


BENCH = (
    BenchCase("rmsnorm_fwd", "y = round(x * rstd) * w (HF's order), saves rstd (fp32)",
              "read x, w; write y, rstd: 2*N*C*s + C*s + N*4", _bench_cases, _bench_setup(),
              lambda ops, d: (lambda: ops.rmsnorm_forward(d["x"], d["w"])), _bench_fwd,
              lambda s, it: 2 * s["N"] * s["C"] * it + s["C"] * it + s["N"] * STAT,
              outputs=lambda d, r: (r[0], r[1].rstd)),
    BenchCase("residual_rmsnorm_fwd", "s = x + branch; y = rmsnorm(s) (one kernel on the GPU)",
              "read x, branch, w; write s, y, rstd: 4*N*C*s + C*s + N*4", _bench_cases, _bench_setup(residual=True),
              lambda ops, d: (lambda: ops.residual_rmsnorm_forward(d["x"], d["branch"], d["w"])), _bench_residual_fwd,
              lambda s, it: 4 * s["N"] * s["C"] * it + s["C"] * it + s["N"] * STAT,
              outputs=lambda d, r: (r[0], r[1], r[2].rstd)),
    BenchCase("rmsnorm_bwd", "dx, dw of the RMSNorm", "read dy, x, w, rstd; write dx, dw: 3*N*C*s + 2*C*s + N*4",
              _bench_cases, _bench_setup(backward=True),
              lambda ops, d: (lambda: ops.rmsnorm_backward(d["dy"], d["ctx"])), _bench_bwd,
              lambda s, it: 3 * s["N"] * s["C"] * it + 2 * s["C"] * it + s["N"] * STAT),
)


FAMILY = KernelFamily(
    "rmsnorm", ("rmsnorm", "reduce"), RMSNormLaunchers,
    targets={
        "rmsnorm_forward": Target(1024, 1, "a block of 1024 threads must fit (rows > 2048 columns)"),
        "residual_rmsnorm_forward": Target(512, 2, "a block of 512 threads per row beyond 2048 columns: 50%"),
        "rmsnorm_backward": Target(512, 2, "LayerNorm's backward layout: 3 arrays x 128 bit in flight; 50%"),
    },
    traffic={
        "rmsnorm_forward": Traffic(3, ops=5, what="read x twice (2 passes), write y"),
        "residual_rmsnorm_forward": Traffic(5, ops=6, what="read x, branch; write s; read s; write y"),
        "rmsnorm_backward": Traffic(5, ops=12, what="read dy, x twice (2 passes), write dx"),
    },
    dynamic_shared={"rmsnorm_backward": DynamicShared("R * C * 4", rmsnorm_backward_shared_bytes, 4096,
                                                      RMSNORM_BACKWARD_MAX_C)},
    tests=("test_rmsnorm.py",), mutation_classes=("round16",), bench=BENCH)
