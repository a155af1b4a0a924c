"""common.cuh's block reductions documented as safe back to back, called twice in one kernel.

block_reduce_sum2 (cross_entropy.cu calls it once per kernel) and block_reduce_sum / _max reuse
their shared buffers on the next call; the trailing barrier keeps a warp that runs ahead from
overwriting a buffer another warp has not read yet. Each is called twice back to back on
different values, under the schedules that let a warp run ahead, at block sizes of 1 to 32
warps; a copy of block_reduce_sum2 without its trailing barrier is reported as a race (so the
test can tell the difference) and gives a wrong second result when a warp runs ahead.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_emu import EmulatedModule, SharedMemoryRaceError

CODE = r'''#include "common.cuh"

// block_reduce_sum2 without its trailing barrier (the bug the trailing barrier prevents)
__device__ void sum2_no_trailing_barrier(float& a, float& b) {
    __shared__ float part[2][WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, nw = blockDim.x / WARP_SIZE;
    a = warp_reduce_sum(a);
    b = warp_reduce_sum(b);
    if (lane == 0) {
        part[0][warp] = a;
        part[1][warp] = b;
    }
    __syncthreads();
    a = warp_reduce_sum(lane < nw ? part[0][lane] : 0.0f);
    b = warp_reduce_sum(lane < nw ? part[1][lane] : 0.0f);
}

// out[block] = {sum(x), sum(x^2), sum(2x), sum(-x), sum(x) again, max(x), max(-x)}: two
// block_reduce_sum2, then two block_reduce_sum, then two block_reduce_max, all back to back
extern "C" __global__ void reductions_twice(float* out, const float* x, int broken) {
    const float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    float a = v, b = v * v;
    if (broken) sum2_no_trailing_barrier(a, b); else block_reduce_sum2(a, b);
    float c = 2.0f * v, d = -v;
    if (broken) sum2_no_trailing_barrier(c, d); else block_reduce_sum2(c, d);
    const float e = block_reduce_sum(v);
    const float f = block_reduce_sum(-v);
    const float m1 = block_reduce_max(v);
    const float m2 = block_reduce_max(-v);
    if (threadIdx.x == 0) {
        float* o = out + blockIdx.x * 8;
        o[0] = a; o[1] = b; o[2] = c; o[3] = d; o[4] = e; o[5] = f; o[6] = m1; o[7] = m2;
    }
}
'''


@pytest.fixture(scope="module")
def checked():
    return EmulatedModule(code=CODE)


@pytest.fixture(scope="module")
def unchecked():
    return EmulatedModule(code=CODE, checks=False)


def _inputs(block, blocks=2):
    # small integers: every sum is exact in float32, whatever the order
    return np.random.default_rng(block).integers(-8, 9, blocks * block).astype(np.float32)


def _want(x, block):
    r = x.reshape(-1, block).astype(np.float64)
    return np.stack([r.sum(1), (r * r).sum(1), (2 * r).sum(1), (-r).sum(1), r.sum(1), (-r).sum(1), r.max(1),
                     (-r).max(1)], axis=1).astype(np.float32)


@pytest.mark.parametrize("schedule", ["warp-reverse", "warp-random", "random"])
@pytest.mark.parametrize("block", [32, 96, 1024])
def test_the_block_reductions_back_to_back(checked, schedule, block):
    x = _inputs(block)
    out = np.full((2, 8), np.nan, np.float32)
    checked.with_schedule(schedule, 3).get_function("reductions_twice")((2,), (block,), (out, x, np.int32(0)))
    np.testing.assert_array_equal(out, _want(x, block))


def test_without_the_trailing_barrier_the_second_call_races(checked, unchecked):
    block = 96
    x = _inputs(block)
    out = np.full((2, 8), np.nan, np.float32)
    with pytest.raises(SharedMemoryRaceError):
        checked.with_schedule("warp-reverse", 0).get_function("reductions_twice")((2,), (block,), (out, x, np.int32(1)))
    # what a GPU could compute: a warp that runs ahead overwrites the first call's partial sums
    wrong = False
    for schedule in ("warp-reverse", "warp-forward", "warp-random"):
        out = np.full((2, 8), np.nan, np.float32)
        unchecked.with_schedule(schedule, 1).get_function("reductions_twice")((2,), (block,), (out, x, np.int32(1)))
        wrong |= not np.array_equal(out[:, :4], _want(x, block)[:, :4])
    assert wrong
