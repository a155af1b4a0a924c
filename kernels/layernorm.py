"""Launchers of ``kernels/layernorm.cu``: LayerNorm over the last axis, forward and backward.

One op, four places:

* CUDA source: ``kernels/layernorm.cu`` (its parameter gradients' second pass is
  ``kernels/reduce.cu``);
* these launchers (argument checks, launch shapes, shared memory);
* NumPy/CuPy reference: ``cutp/ops/layernorm.py`` (``layernorm_forward``,
  ``layernorm_backward``), which calls these launchers through ``cutp.kernels.dispatch``;
* tests: ``tests/kernels/test_layernorm.py``; benchmark cases ``layernorm_fwd`` and
  ``layernorm_bwd`` of ``python -m cutp bench kernels`` (declared below, with the family).
"""
from __future__ import annotations

import math

import numpy as np

from .family import BenchCase, DynamicShared, KernelFamily, Target, Traffic
from .runtime import (
    DEFAULT_MAX_SHARED,
    WARP,
    KernelArgumentError,
    LauncherBase,
    ceil_div,
    check_array,
    clamp,
    dtype_suffix,
    elements_per_128bit,
    int32_arg,
    is_kernel_dtype,
    round_up,
)

LAYERNORM_WARP_ROW_MAX = 2048  # rows up to this length: a warp per row; longer: a block per row
LAYERNORM_BACKWARD_THREADS = 512  # the backward's __launch_bounds__
# The backward's grid: this many blocks per SM (its resources.TARGETS occupancy: 2 blocks of 512
# threads at 64 registers), each over an even share of the rows, so that one wave of blocks fills
# the GPU and the partial column sums are 2 x blocks x C floats whatever the number of rows.
LAYERNORM_BACKWARD_BLOCKS_PER_SM = 2
# The widest row whose backward launch tests/kernel_build/test_resources.py checks against sm_80's and
# sm_90's shared-memory limits (2 * C floats: 128 KiB; sm_80 allows 163 KiB with the opt-in).
LAYERNORM_BACKWARD_MAX_C = 16384


def layernorm_backward_threads(C: int, dtype) -> int:
    """Block size of layernorm_backward: about one 128-bit chunk of the row per thread, whole
    warps, at most LAYERNORM_BACKWARD_THREADS."""
    return clamp(round_up(ceil_div(C, elements_per_128bit(dtype)), WARP), WARP, LAYERNORM_BACKWARD_THREADS)


def layernorm_backward_rows_per_block(C: int, dtype=np.float32) -> int:
    """R, the rows a block of layernorm_backward works on at once (its row groups, threadIdx.y):
    as many groups of layernorm_backward_threads(C) threads as LAYERNORM_BACKWARD_THREADS hold,
    while their accumulators (R * 2 * C floats) stay within 47 KiB (one row's alone may be more:
    then R = 1 and the launcher opts in, as before). 2 at C = 768 in float32 (384 threads), 5 in
    bfloat16 (480 threads); 1 from C = 2048 (f32) / 4096 (bf16) up."""
    tx = layernorm_backward_threads(C, dtype)
    return max(1, min(LAYERNORM_BACKWARD_THREADS // tx, (DEFAULT_MAX_SHARED - 1024) // (8 * max(C, 1))))


def layernorm_backward_shared_bytes(C: int, params: bool = True, dtype=np.float32) -> int:
    """Dynamic shared memory of layernorm_backward: each row group's sums of dy * xhat and dy,
    R * 2 * C floats (R = layernorm_backward_rows_per_block), when it computes parameter
    gradients (none otherwise). Past 48 KiB with the static part, LauncherBase._launch raises the
    kernel's max_dynamic_shared_size_bytes."""
    return layernorm_backward_rows_per_block(C, dtype) * 2 * C * 4 if params else 0


def layernorm_backward_grid(n_rows: int, C: int, dtype, sm_count: int) -> int:
    """Blocks of layernorm_backward: LAYERNORM_BACKWARD_BLOCKS_PER_SM x sm_count, or fewer when
    there are not R rows for each (at least 1). At C = 768 and 8192 rows on H100 (132 SMs): 264."""
    R = layernorm_backward_rows_per_block(C, dtype)
    return clamp(ceil_div(n_rows, R), 1, LAYERNORM_BACKWARD_BLOCKS_PER_SM * sm_count)


class LayerNormLaunchers(LauncherBase):
    """layernorm_forward, layernorm_backward."""

    def layernorm_forward(self, x, weight=None, bias=None, eps: float = 1e-5):
        """(y, mean, rstd): y = (x - mean) * rstd * weight + bias over the last axis of x [..., C]
        in x's dtype; mean and rstd float32 [n_rows] (flat). weight / bias: [C] of x's dtype, or
        None. A warp per row up to C = 2048, a block per row beyond."""
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        if x.ndim < 1:
            raise KernelArgumentError("x must have a last (channel) axis")
        C = x.shape[-1]
        for what, a in (("weight", weight), ("bias", bias)):
            if a is not None:
                check_array(xp, what, a, dtype=x.dtype, shape=(C,))
        n_rows = math.prod(x.shape[:-1])
        y = xp.empty(x.shape, dtype=x.dtype)
        mean = xp.empty(n_rows, dtype=np.float32)
        rstd = xp.empty(n_rows, dtype=np.float32)
        rows_per_block, block, block_per_row = self._row_shape(C, x.dtype, LAYERNORM_WARP_ROW_MAX, 2)
        self._launch("layernorm", f"layernorm_forward_{dtype_suffix(x.dtype)}", (ceil_div(n_rows, rows_per_block),),
                     block, (y, mean, rstd, x, weight, bias, np.int64(n_rows), int32_arg("C", C), np.float32(eps),
                             block_per_row))
        return y, mean, rstd

    def layernorm_backward(self, dy, x, weight, mean, rstd, bias_dtype=None, need_dweight: bool | None = None):
        """(dx, dweight, dbias) of layernorm_forward: dx in x's dtype; dweight [C] in weight's dtype
        (None when weight is None, or need_dweight is False); dbias [C] in bias_dtype (None when
        bias_dtype is None). mean / rstd: float32 with one element per row.

        A grid of LAYERNORM_BACKWARD_BLOCKS_PER_SM x the SM count (layernorm_backward_grid), each
        block over an even share of the rows, R at a time (block (threads per row, R)): per row a
        reduction of sum(g) and sum(g * xhat) over its row group, and each thread accumulating
        dy * xhat and dy of its own columns in its group's shared memory (R * 2 * C floats; over
        48 KiB the kernel's limit is raised); the partials [2, blocks, C] are then added by
        column_sum in a fixed order. No atomics: deterministic."""
        xp = self.xp
        check_array(xp, "x", x, float_data=True)
        if x.ndim < 1:
            raise KernelArgumentError("x must have a last (channel) axis")
        check_array(xp, "dy", dy, dtype=x.dtype, shape=x.shape)
        C = x.shape[-1]
        n_rows = math.prod(x.shape[:-1])
        if weight is not None:
            check_array(xp, "weight", weight, dtype=x.dtype, shape=(C,))
        check_array(xp, "mean", mean, dtype=np.float32)
        check_array(xp, "rstd", rstd, dtype=np.float32)
        for what, a in (("mean", mean), ("rstd", rstd)):
            if a.size != n_rows:
                raise KernelArgumentError(f"{what} has {a.size} elements, expected one per row: {n_rows}")
        if bias_dtype is not None and not is_kernel_dtype(np.dtype(bias_dtype)):
            raise KernelArgumentError(f"bias dtype {np.dtype(bias_dtype)}: the kernels take float32 or bfloat16")
        want_dw = weight is not None and need_dweight is not False
        want_params = want_dw or bias_dtype is not None
        threads = layernorm_backward_threads(C, x.dtype)
        R = layernorm_backward_rows_per_block(C, x.dtype)
        n_blocks = layernorm_backward_grid(n_rows, C, x.dtype, self.sm_count())
        dx = xp.empty(x.shape, dtype=x.dtype)
        partial = xp.empty((2, n_blocks, C), dtype=np.float32) if want_params else None
        smem = layernorm_backward_shared_bytes(C, want_params, x.dtype)
        self._launch("layernorm", f"layernorm_backward_{dtype_suffix(x.dtype)}", (n_blocks,), (threads, R),
                     (dx, partial, dy, x, weight, mean, rstd, np.int64(n_rows), int32_arg("C", C)), shared_mem=smem)
        dweight = self._column_sum(partial[0], weight.dtype) if want_dw else None
        dbias = self._column_sum(partial[1], np.dtype(bias_dtype)) if bias_dtype is not None else None
        return dx, dweight, dbias


STAT = 4  # bytes of a float32 statistic (means, rstd) in the benchmark's byte counts


def bench_rows_width(sz):
    """The benchmark's row-kernel shapes: each of the size preset's widths at each row count."""
    return [dict(N=n, C=c) for c in sz["widths"] for n in sz["rows"]]


def _bench_setup(backward):
    def setup(ops, normal, xp, s, dt, rng):
        d = dict(x=normal(xp, rng, (s["N"], s["C"]), dt), w=normal(xp, rng, (s["C"],), dt, 0.1) + 1,
                 b=normal(xp, rng, (s["C"],), dt, 0.1))
        if backward:
            _, d["ctx"] = ops.layernorm_forward(d["x"], d["w"], d["b"])
            d["dy"] = normal(xp, rng, (s["N"], s["C"]), dt)
        return d

    return setup


def _bench_fwd(k, d, ops):
    y, mean, rstd = k.layernorm_forward(d["x"], d["w"], d["b"])
    return y, ops.LayerNormCtx(d["x"], d["w"], d["b"].dtype, mean, rstd)


def _bench_bwd(k, d, ops):
    c = d["ctx"]
    return k.layernorm_backward(d["dy"], c.x, c.weight, c.mean.reshape(-1), c.rstd.reshape(-1), c.bias_dtype)


BENCH = (
    BenchCase("layernorm_fwd", "y = (x - mean) * rstd * w + b, saves mean, rstd (fp32)",
              "read x, w, b; write y, mean, rstd: 2*N*C*s + 2*C*s + 2*N*4", bench_rows_width, _bench_setup(False),
              lambda ops, d: (lambda: ops.layernorm_forward(d["x"], d["w"], d["b"])), _bench_fwd,
              lambda s, it: 2 * s["N"] * s["C"] * it + 2 * s["C"] * it + 2 * s["N"] * STAT,
              outputs=lambda d, r: (r[0], r[1].mean, r[1].rstd)),
    BenchCase("layernorm_bwd", "dx, dw, db of the LayerNorm",
              "read dy, x, w, mean, rstd; write dx, dw, db: 3*N*C*s + 3*C*s + 2*N*4", bench_rows_width,
              _bench_setup(True), lambda ops, d: (lambda: ops.layernorm_backward(d["dy"], d["ctx"])), _bench_bwd,
              lambda s, it: 3 * s["N"] * s["C"] * it + 3 * s["C"] * it + 2 * s["N"] * STAT),
)


FAMILY = KernelFamily(
    "layernorm", ("layernorm", "reduce"), LayerNormLaunchers,
    targets={
        "layernorm_forward": Target(1024, 1, "a block of 1024 threads must fit (rows > 2048 columns)"),
        "layernorm_backward": Target(512, 2, "3 arrays x 128 bit in flight per thread; 50%"),
    },
    traffic={
        "layernorm_forward": Traffic(4, ops=8, what="read x 3 times (3 passes), write y"),
        "layernorm_backward": Traffic(5, ops=20, what="read dy, x twice (2 passes), write dx"),
    },
    dynamic_shared={"layernorm_backward": DynamicShared("R * 2 * C * 4", layernorm_backward_shared_bytes, 768,
                                                        LAYERNORM_BACKWARD_MAX_C)},
    tests=("test_layernorm.py",), mutation_classes=("round16",), bench=BENCH)
