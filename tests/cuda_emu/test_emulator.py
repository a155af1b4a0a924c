"""Tests of the CUDA emulator (tests/cuda_emu) on the sample kernels in tests/emu_samples.

samples.cu holds correct kernels exercising every emulated feature; broken.cu holds kernels with
deliberate bugs that the emulator must report. Every kernel test runs under all schedules.
The last tests check that the samples (and kernels/*.cu) compile with the real NVCC / NVRTC, and
that every kernel in kernels/*.cu has an emulated test.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tests.cuda_emu as cuda_emu
from cutp.kernels import resources as kernel_resources
from cutp.kernels import runtime as kernel_runtime
from tests.cuda_emu import (
    SCHEDULES,
    BarrierError,
    CompileError,
    DeviceAssertError,
    EmulatedModule,
    EmulationError,
    EmulationTimeout,
    KernelArgumentError,
    KernelFault,
    LaunchConfigError,
    OutOfBoundsError,
    SharedMemoryRaceError,
)

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "tests" / "emu_samples" / "samples.cu"
BROKEN = ROOT / "tests" / "emu_samples" / "broken.cu"
BF16 = np.dtype(ml_dtypes.bfloat16)

# the round schedules (forward, reverse, random) and those that let a warp run ahead (warp-*)
ORDERS = [("forward", 0), ("reverse", 0), ("random", 1), ("warp-forward", 0), ("warp-reverse", 0), ("warp-random", 2)]
ORDER_IDS = [f"{s}{seed if s == 'random' else ''}" for s, seed in ORDERS]


@pytest.fixture(scope="module")
def samples_module() -> EmulatedModule:
    return EmulatedModule(path=SAMPLES)


@pytest.fixture(scope="module")
def broken_module() -> EmulatedModule:
    return EmulatedModule(path=BROKEN)


@pytest.fixture(scope="module")
def broken_unchecked() -> EmulatedModule:
    """broken.cu without the access checks: what the schedules alone make of its bugs."""
    return EmulatedModule(path=BROKEN, checks=False)


@pytest.fixture(params=ORDERS, ids=ORDER_IDS)
def samples(request, samples_module) -> EmulatedModule:
    schedule, seed = request.param
    return samples_module.with_schedule(schedule, seed)


def blocks(n: int, block: int) -> tuple[int]:
    return ((n + block - 1) // block,)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def fma32(a, b, c) -> np.ndarray:
    """float32 fma(a, b, c): the float32 product is exact in float64, so one float64 add and a
    rounding to float32 (double rounding aside, which these tests' values do not hit)."""
    return (np.float64(np.float32(a)) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


# ================================================================================================
# Correct kernels give the right answer under every schedule
# ================================================================================================
@pytest.mark.parametrize("n", [1, 31, 255, 256, 257, 1000, 4097])
def test_elementwise_tail(samples, n):
    x, y = rng(n).standard_normal((2, n), dtype=np.float32)
    out = np.full(n, np.nan, np.float32)
    samples.get_function("scale_add_f32")(blocks(n, 256), (256,), (out, x, y, np.float32(1.5), np.int64(n)))
    # a * x + y is one FMA, as nvcc contracts it (when the host has FMA): rounded once
    expect = np.float32(1.5) * x + y if cuda_emu._fp_flags() == ("-ffp-contract=off",) else fma32(1.5, x, y)
    np.testing.assert_array_equal(out, expect)


def test_elementwise_bf16(samples):
    n = 1000
    x, y = rng(1).standard_normal((2, n), dtype=np.float32).astype(BF16)
    out = np.zeros(n, BF16)
    samples.get_function("scale_add_bf16")(blocks(n, 128), (128,), (out, x, y, np.float32(-2.0), np.int64(n)))
    expect = (np.float32(-2.0) * x.astype(np.float32) + y.astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(out.view(np.uint16), expect.view(np.uint16))


def test_grid_stride_loop_and_zero_grid(samples):
    x = np.arange(10_000, dtype=np.float32)
    samples.get_function("scale_inplace_f32")((7,), (64,), (x, np.float32(2.0), np.int64(x.size)))
    np.testing.assert_array_equal(x, 2 * np.arange(10_000, dtype=np.float32))
    # n = 0 gives grid (0,), which CuPy launches as one block: the tail check must hold.
    empty = np.zeros(0, np.float32)
    samples.get_function("scale_add_f32")(blocks(0, 256), (256,), (empty, empty, empty, np.float32(1), np.int64(0)))


def test_null_pointer_argument(samples):
    x = np.arange(100, dtype=np.float32)
    bias = np.ones(100, np.float32)
    out = np.zeros(100, np.float32)
    add_bias = samples.get_function("add_bias_f32")
    add_bias((1,), (128,), (out, x, None, np.int32(100)))
    np.testing.assert_array_equal(out, x)
    add_bias((1,), (128,), (out, x, bias, np.int32(100)))
    np.testing.assert_array_equal(out, x + 1)


@pytest.mark.parametrize("n", [1, 256, 1000, 5000])
def test_shared_memory_tree_reduction(samples, n):
    x = rng(n).standard_normal(n, dtype=np.float32)
    nb = blocks(n, 256)[0]
    partial = np.zeros(nb, np.float32)
    samples.get_function("tree_sum_f32")((nb,), (256,), (partial, x, np.int32(n)))
    padded = np.zeros(nb * 256, np.float32)
    padded[:n] = x
    np.testing.assert_allclose(partial, padded.reshape(nb, 256).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [32, 128, 1024])
@pytest.mark.parametrize("width", [1, 37, 1000])
def test_block_reduce_sum_and_max(samples, block, width):
    rows = 5
    x = rng(width).standard_normal((rows, width), dtype=np.float32)
    sums, maxs = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    samples.get_function("row_sum_max_f32")((rows,), (block,), (sums, maxs, x, np.int32(width)))
    np.testing.assert_allclose(sums, x.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(maxs, x.max(1))


def test_rows_over_2d_grid(samples):
    rows, width = 23, 300
    x = rng(3).standard_normal((rows, width), dtype=np.float32) * 3 + 1
    mean, rstd = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    # 4 x 7 = 28 blocks for 23 rows: the last 5 blocks exit at once
    samples.get_function("row_stats_f32")((4, 7), (128,), (mean, rstd, x, np.int32(rows), np.int32(width), np.float32(1e-5)))
    np.testing.assert_allclose(mean, x.mean(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x.var(1) + 1e-5), rtol=1e-4)


@pytest.mark.parametrize("width", [1, 100, 2048])
def test_dynamic_shared_memory_softmax(samples, width):
    rows = 4
    x = rng(width).standard_normal((rows, width), dtype=np.float32) * 4
    out = np.zeros_like(x)
    samples.get_function("softmax_smem_f32")((rows,), (256,), (out, x, np.int32(width)), shared_mem=width * 4)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_shared_memory_limit_counts_static_and_dynamic(samples_module):
    """As a device: static + dynamic shared memory above 48 KiB fails unless the kernel opts in
    (max_dynamic_shared_size_bytes, as with cupy.RawKernel), and never above 227 KiB (sm_90)."""
    softmax = samples_module.with_schedule("forward").get_function("softmax_smem_f32")  # a fresh kernel object
    static = softmax.shared_size_bytes
    assert static == 2 * 32 * 4  # block_reduce's partial[32], for the max and for the sum
    assert softmax.max_dynamic_shared_size_bytes == 48 * 1024 - static  # as CUDA reports it before opting in

    def launch(nbytes):
        width = nbytes // 4
        x = rng(4).standard_normal((1, width), dtype=np.float32)
        out = np.zeros_like(x)
        softmax((1,), (256,), (out, x, np.int32(width)), shared_mem=nbytes)
        e = np.exp(x - x.max())
        np.testing.assert_allclose(out, e / e.sum(), rtol=1e-5, atol=1e-9)

    launch(48 * 1024 - static)  # exactly 48 KiB in all
    with pytest.raises(LaunchConfigError, match=r"shared_mem=49152 bytes .* exceed the 48896 bytes allowed; the "
                                                r"kernel also has 256 bytes of static __shared__ variables .*48 KiB"):
        launch(48 * 1024)
    softmax.max_dynamic_shared_size_bytes = 48 * 1024  # opt in, as the launchers do
    launch(48 * 1024)
    with pytest.raises(LaunchConfigError, match="exceed the 49152 bytes allowed"):
        launch(48 * 1024 + 16)
    with pytest.raises(LaunchConfigError, match=r"outside \[0, 232192\].*232448 bytes .* 256 bytes of static"):
        softmax.max_dynamic_shared_size_bytes = 227 * 1024 - static + 4
    softmax.max_dynamic_shared_size_bytes = 227 * 1024 - static  # the most an sm_90 device allows
    launch(227 * 1024 - static)
    with pytest.raises(LaunchConfigError):
        launch(227 * 1024)
    # a kernel without static shared memory gets all 48 KiB, and the static size is per kernel
    reverse = samples_module.with_schedule("forward").get_function("reverse_chunks_i32")
    assert reverse.shared_size_bytes == 0 and reverse.max_dynamic_shared_size_bytes == 48 * 1024
    assert samples_module.get_function("tree_sum_f32").shared_size_bytes == 256 * 4


def test_dynamic_shared_memory_other_type(samples):
    x = np.arange(3 * 64, dtype=np.int32)
    out = np.zeros_like(x)
    samples.get_function("reverse_chunks_i32")((3,), (64,), (out, x), shared_mem=64 * 4)
    np.testing.assert_array_equal(out, x.reshape(3, 64)[:, ::-1].ravel())


@pytest.mark.parametrize("n", [32, 100, 1024])
def test_warp_shuffle_reduction(samples, n):
    x = rng(n).standard_normal(n, dtype=np.float32)
    nwarps = (n + 31) // 32
    out = np.zeros(nwarps, np.float32)
    samples.get_function("warp_sum_f32")(blocks(n, 128), (128,), (out, x, np.int64(n)))
    padded = np.zeros(nwarps * 32, np.float32)
    padded[:n] = x
    np.testing.assert_allclose(out, padded.reshape(nwarps, 32).sum(1), rtol=1e-5, atol=1e-5)


def _warp_ops_reference(x: np.ndarray, width: int) -> np.ndarray:
    n = x.size
    out = np.zeros((n, 12), np.int64)
    for w in range(n // 32):
        v = x[32 * w : 32 * w + 32].astype(np.int64)
        ballot = sum(1 << i for i in range(32) if v[i] % 3 == 0)
        for lane in range(32):
            o = out[32 * w + lane]
            seg = lane & ~(width - 1)
            o[0] = v[(lane * 7 + 3) % 32]
            o[1] = v[seg + (5 & (width - 1))]
            o[2] = v[lane - 3] if lane - 3 >= seg else v[lane]
            o[3] = v[lane + 5] if lane + 5 < seg + width else v[lane]
            o[4] = v[lane ^ 9] if (lane ^ 9) < seg + width else v[lane]
            o[5] = np.uint32(ballot).view(np.int32)
            o[6] = int((v == 7).any())
            o[7] = int((v < 45).all())
            o[8] = v.sum()
            o[9] = v.max()
            hseg = lane & ~15
            o[10] = v[lane + 1] if lane + 1 < hseg + 16 else v[lane]
    out[:, 11] = int((x % 2 == 1).sum())
    return out


@pytest.mark.parametrize("width", [32, 16, 8, 2])
def test_warp_primitives(samples, width):
    x = rng(width).integers(0, 50, 96).astype(np.int32)
    x[:32] = rng(7).integers(0, 45, 32)  # warp 0: __all_sync true
    x[40] = 7
    out = np.zeros(96 * 12, np.int32)
    samples.get_function("warp_ops_probe")((1,), (96,), (out, x, np.int32(width)))
    np.testing.assert_array_equal(out.reshape(96, 12), _warp_ops_reference(x, width))


def test_atomics(samples):
    n = 100_000
    x = rng(5).random(n, dtype=np.float32)
    total = np.zeros(1, np.float32)
    samples.get_function("atomic_sum_f32")(blocks(n, 256), (256,), (total, x, np.int64(n)))
    np.testing.assert_allclose(total[0], x.sum(dtype=np.float64), rtol=1e-4)

    keys = rng(6).integers(-1000, 1000, 5000).astype(np.int32)
    nbins = 17
    hist, count, kmax = np.zeros(nbins, np.int32), np.zeros(1, np.uint64), np.array([-(2**31)], np.int32)
    samples.get_function("histogram_i32")(blocks(keys.size, 128), (128,),
                                          (hist, count, kmax, keys, np.int64(keys.size), np.int32(nbins)))
    np.testing.assert_array_equal(hist, np.bincount(keys % nbins, minlength=nbins))
    assert count[0] == keys.size and kmax[0] == keys.max()


@pytest.mark.parametrize("grid,block", [((3, 2, 2), (4, 3, 2)), ((5,), (64,)), ((1, 4), (8, 8))])
def test_builtin_coordinates_2d_3d(samples, grid, block):
    g = (grid + (1, 1))[:3]
    b = (block + (1, 1))[:3]
    nthreads = np.prod(g) * np.prod(b)
    out = np.full(nthreads * 12, -1, np.int32)
    samples.get_function("index_probe")(grid, block, (out,))
    # expected: blocks linear in x, y, z; threads linear in x, y, z within a block
    bz, by, bx = np.meshgrid(*(np.arange(k) for k in g[::-1]), indexing="ij")
    tz, ty, tx = np.meshgrid(*(np.arange(k) for k in b[::-1]), indexing="ij")
    rows = []
    for blk in zip(bx.ravel(), by.ravel(), bz.ravel()):
        for thr in zip(tx.ravel(), ty.ravel(), tz.ravel()):
            rows.append([*thr, *blk, *b, *g])
    np.testing.assert_array_equal(out.reshape(-1, 12), np.array(rows))


def test_3d_grid_bias_add(samples):
    B, T, C = 3, 13, 70
    x = rng(8).standard_normal((B, T, C), dtype=np.float32)
    bias = rng(9).standard_normal(C, dtype=np.float32)
    out = np.zeros_like(x)
    grid = ((C + 31) // 32, (T + 7) // 8, B)
    samples.get_function("add_bias_btc_f32")(grid, (32, 8), (out, x, bias, np.int32(B), np.int32(T), np.int32(C)))
    np.testing.assert_array_equal(out, x + bias)


def test_128bit_loads_and_stores(samples):
    n = 8 * 100
    x = rng(10).standard_normal(n, dtype=np.float32)
    out = np.zeros(n, BF16)
    samples.get_function("scale128_bf16")(blocks(n // 8, 32), (32,), (out, x.astype(BF16), np.float32(0.5), np.int64(n)))
    np.testing.assert_array_equal(out.view(np.uint16), (x.astype(BF16).astype(np.float32) * 0.5).astype(BF16).view(np.uint16))
    out4 = np.zeros(n, np.float32)
    samples.get_function("scale4_f32")(blocks(n // 4, 64), (64,), (out4, x, np.float32(3.0), np.int64(n)))
    np.testing.assert_array_equal(out4, 3 * x)


def test_arrays_keep_cuda_alignment(samples_module):
    probe = samples_module.get_function("address_mod_256")
    res = np.zeros(1, np.int64)
    x = np.zeros(1000, np.float32)
    probe((1,), (1,), (res, x))
    assert res[0] == 0  # a fresh allocation is 256-byte aligned
    probe((1,), (1,), (res, x[3:]))
    assert res[0] == 12  # a view keeps its offset, as a CuPy view does


def test_math_intrinsics(samples_module):
    import math

    n = 1000
    a = rng(16).uniform(-4, 4, n).astype(np.float32)
    b = rng(17).uniform(0.5, 4, n).astype(np.float32)
    out = np.zeros(n * 24, np.float32)
    samples_module.get_function("math_probe_f32")(blocks(n, 128), (128,), (out, a, b, np.int32(n)))
    A, B = a.astype(np.float64), b.astype(np.float64)
    erf = np.vectorize(math.erf)
    expect = np.stack([
        np.exp(A), np.exp(A), np.log(B), np.log(B), np.sqrt(B), 1 / np.sqrt(B), np.tanh(A), erf(A),
        np.maximum(A, B), np.minimum(A, B), np.abs(A), A / B, B ** A, np.maximum(A, B), np.minimum(np.arange(n), 5),
        np.clip(A, 0, 1), 0.5 * (1 + erf(A / np.sqrt(2))), np.exp2(A), np.log1p(B), np.rint(A), A * B + 1, A,
        np.copysign(B, A), np.ones(n),
    ], axis=1)
    # __expf, rsqrtf and __fdividef carry the GPU's documented error (below); the rest is exact
    np.testing.assert_allclose(out.reshape(n, 24), expect, rtol=2e-6, atol=1e-6)


def ulp_distance(a, b) -> np.ndarray:
    """|a - b| in float32 ulps (as ordered integers, across zero too)."""
    def ordered(x):
        i = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordered(a) - ordered(b))


def test_fast_intrinsics_carry_their_documented_error(samples_module):
    """__expf: 2 + floor(|1.16 x|) ulp; rsqrtf, __fdividef: 2 ulp (CUDA programming guide). The
    emulator moves the exact result by a deterministic draw within that bound, so a kernel that
    relies on them being exact fails its reference comparison here too."""
    n = 4000
    a = rng(19).uniform(-20, 20, n).astype(np.float32)
    b = rng(20).uniform(0.5, 4, n).astype(np.float32)
    out = np.zeros(n * 24, np.float32)
    fn = samples_module.get_function("math_probe_f32")
    fn(blocks(n, 128), (128,), (out, a, b, np.int32(n)))
    o = out.reshape(n, 24)
    A, B = a.astype(np.float64), b.astype(np.float64)
    for got, exact, bound in ((o[:, 1], np.exp(A), 2 + np.floor(np.abs(1.16 * A))), (o[:, 5], 1 / np.sqrt(B), 2),
                              (o[:, 11], A / B, 2)):
        d = ulp_distance(got, exact.astype(np.float32))
        assert (d <= bound + 1).all(), d.max()  # + 1: the exact value's own rounding (glibc's expf)
        assert (d >= 2).mean() > 0.3  # the model is on: most results are off by more than rounding
    again = np.zeros_like(out)
    fn(blocks(n, 128), (128,), (again, a, b, np.int32(n)))
    np.testing.assert_array_equal(again.view(np.uint32), out.view(np.uint32))  # deterministic
    x = np.array([1, -3, np.inf, 6], np.float32)
    y = np.array([2.0**127, 2.0**126 * 1.5, 2.0**127, 2.0**-100], np.float32)
    q = np.zeros(4, np.float32)
    samples_module.get_function("fdividef_probe")((1,), (32,), (q, x, y, np.int32(4)))
    assert q[0] == 0 and q[1] == 0 and np.isnan(q[2]) and ulp_distance(q[3], np.float32(6 * 2.0**100)) <= 2


def test_bit_intrinsics(samples_module):
    x = np.concatenate([[0, 1, 2, 3, 0x80000000, 0xFFFFFFFF, 1000, 999, 1001],
                        rng(18).integers(0, 2**32, 200, dtype=np.uint64)]).astype(np.uint32)
    out = np.zeros(x.size * 8, np.uint32)
    samples_module.get_function("bits_probe")(blocks(x.size, 64), (64,), (out, x, np.int32(x.size)))
    rows = []
    for v in map(int, x):
        rows.append([bin(v).count("1"), 32 - v.bit_length(), (v & -v).bit_length(), int(f"{v:032b}"[::-1], 2),
                     (v * 0x9E3779B9) >> 32, bin((0xF0F0 * v) % 2**64).count("1"), max(v, 1000), min(v, 1000)])
    np.testing.assert_array_equal(out.reshape(-1, 8), np.array(rows, dtype=np.uint64).astype(np.uint32))


def test_all_atomics(samples):
    i32 = np.array([0, 0, 0, 0, -1, 0, 0, 0, 0], np.int32)
    u32 = np.array([0, 500, 0], np.uint32)
    u64 = np.zeros(3, np.uint64)
    f32 = np.zeros(2, np.float32)
    samples.get_function("atomics_probe")((1,), (64,), (i32, u32, u64, f32))
    t = np.arange(64)
    assert list(i32[:8]) == [t.sum(), -t.sum(), -63, 63, -(2**31), 2**31 - 1, 0, 42]
    assert 1 <= i32[8] <= 64  # which thread's CAS wins depends on the schedule
    assert list(u32) == [64 % 10, 500 - 64, 128]
    assert list(u64) == [64 << 33, 63 << 40, 7]
    assert list(f32) == [32.0, -1.0]


def test_shuffles_of_every_type(samples_module):
    f = np.arange(32, dtype=np.float32) + 0.5
    d = np.arange(32, dtype=np.float64) * 1e100
    ll = np.arange(32, dtype=np.int64) - 2**40
    ull = np.arange(32, dtype=np.uint64) + 2**63
    h = (np.arange(32, dtype=np.float32) - 7).astype(BF16)
    h2 = (np.arange(64, dtype=np.float32) * 3).astype(BF16)
    before = [a.copy() for a in (f, d, ll, ull, h, h2)]
    samples_module.get_function("shuffle_types_probe")((1,), (32,), (f, d, ll, ull, h, h2))
    swap = np.arange(32) ^ 1
    for got, orig in zip((f, d, ll, ull, h), before):
        np.testing.assert_array_equal(got.view(np.uint8).reshape(32, -1), orig.view(np.uint8).reshape(32, -1)[swap])
    np.testing.assert_array_equal(h2.reshape(32, 2).view(np.uint16), before[5].reshape(32, 2)[swap].view(np.uint16))


# ================================================================================================
# The schedules
# ================================================================================================
def test_schedules_order_threads_and_blocks(samples_module):
    def order(schedule, seed=0):
        out, counter = np.full(192, -1, np.int32), np.zeros(1, np.int32)
        samples_module.with_schedule(schedule, seed).get_function("arrival_order")((3,), (64,), (out, counter))
        return out

    np.testing.assert_array_equal(order("forward"), np.arange(192))
    np.testing.assert_array_equal(order("reverse"), np.arange(192)[::-1])
    r1, r2 = order("random", 1), order("random", 2)
    assert sorted(r1) == list(range(192)) and sorted(r2) == list(range(192))
    assert not np.array_equal(r1, np.arange(192)) and not np.array_equal(r1, r2)
    np.testing.assert_array_equal(order("random", 1), r1)  # a seed reproduces its order


def test_orders_cover_every_schedule():
    assert {schedule for schedule, _ in ORDERS} == set(SCHEDULES)


def test_unknown_schedule_rejected():
    with pytest.raises(ValueError, match="schedule"):
        EmulatedModule(path=SAMPLES, schedule="backwards")


# ================================================================================================
# bfloat16
# ================================================================================================
def _bf16_test_values() -> np.ndarray:
    r = rng(11)
    bits = [r.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)]
    upper = r.integers(0, 2**16, 4000, dtype=np.uint32) << 16
    for low in (0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF, 0x0001):  # ties (even and odd upper halves) and neighbours
        bits.append(upper | low)
    sub = np.arange(0, 2**16, 7, dtype=np.uint32)  # subnormals with many low halves, both signs
    bits += [sub, sub | 0x80000000, (sub << 7) | 0x8000, 0x80000000 | (sub << 7) | 0x8000]
    bits.append(np.array([
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # zeros, infinities
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7EFFFF, 0x7F7E8000,  # near overflow
        0x00000001, 0x807FFFFF, 0x00800000, 0x00008000, 0x00018000, 0x80008000,  # subnormal/normal edges
        0x3F808000, 0x3F818000, 0x3F800000, 0xBF808000,  # ties around 1
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000,  # NaNs
    ], dtype=np.uint32))
    return np.concatenate(bits).view(np.float32)


def test_bf16_conversion_matches_ml_dtypes_bit_exactly(samples_module):
    x = _bf16_test_values()
    n = x.size
    outs = [np.zeros(n, BF16) for _ in range(4)]
    samples_module.get_function("f32_to_bf16")(blocks(n, 512), (512,), (*outs, x, np.int64(n)))
    got = [o.view(np.uint16) for o in outs]
    for g in got[1:]:  # __float2bfloat16, _rn, from_float<bf16>, the constructor agree
        np.testing.assert_array_equal(g, got[0])
    nan = np.isnan(x)
    with np.errstate(invalid="ignore"):  # NumPy warns when casting NaN
        expect = x.astype(BF16).view(np.uint16)
    mismatch = np.flatnonzero((got[0] != expect) & ~nan)
    assert mismatch.size == 0, f"{mismatch.size} mismatches, e.g. f32 {x[mismatch[:5]].view(np.uint32)}"
    # CUDA maps every NaN to the canonical 0x7fff; ml_dtypes keeps the sign and quiets (0x7fc0/0xffc0).
    assert nan.sum() > 5 and np.all(got[0][nan] == 0x7FFF)
    assert np.all(np.isnan(outs[0][nan].astype(np.float32)))


def test_bf16_to_float_is_exact_for_all_bit_patterns(samples_module):
    x = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(BF16)
    a, b = np.zeros(x.size, np.float32), np.zeros(x.size, np.float32)
    samples_module.get_function("bf16_to_f32")(blocks(x.size, 1024), (1024,), (a, b, x, np.int64(x.size)))
    expect = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(a.view(np.uint32), expect.view(np.uint32))
    np.testing.assert_array_equal(b.view(np.uint32), expect.view(np.uint32))


def test_bf16_multiply_rounds_once(samples_module):
    a = rng(12).standard_normal(4096, dtype=np.float32).astype(BF16)
    b = (rng(13).standard_normal(4096, dtype=np.float32) * 1e3).astype(BF16)
    out = np.zeros(4096, BF16)
    samples_module.get_function("bf16_mul")(blocks(4096, 256), (256,), (out, a, b, np.int32(4096)))
    # a bf16 product is exact in float32, so rounding it once to bf16 is the correct result
    expect = (a.astype(np.float32) * b.astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(out.view(np.uint16), expect.view(np.uint16))


# ================================================================================================
# Broken kernels are caught
# ================================================================================================
def test_wrong_tail_bound_is_caught(broken_module):
    n = 1000
    x, out = np.ones(n, np.float32), np.zeros(n, np.float32)
    with pytest.raises(OutOfBoundsError, match=r"tail_off_by_one_f32.*argument 0 \(float\*\).*0 byte\(s\) after the end \(element index 1000 "):
        broken_module.get_function("tail_off_by_one_f32")(blocks(n, 256), (256,), (out, x, np.int32(n)))
    assert not out.any()  # a failed launch leaves the arrays untouched


def test_write_before_start_is_caught(broken_module):
    out = np.zeros(100, np.float32)
    with pytest.raises(OutOfBoundsError, match="argument 0 .* before the start"):
        broken_module.get_function("write_before_start_f32")((1,), (128,), (out, np.int32(100)))


def test_missing_syncthreads_gives_wrong_result_under_some_schedule(samples_module, broken_unchecked):
    n = 2048
    x = rng(14).standard_normal(n, dtype=np.float32)
    expect = x.reshape(-1, 256).sum(1)
    wrong = []
    for schedule, seed in ORDERS:
        partial = np.zeros(n // 256, np.float32)
        broken_unchecked.with_schedule(schedule, seed).get_function("tree_sum_missing_sync_f32")(
            (n // 256,), (256,), (partial, x, np.int32(n)))
        if not np.allclose(partial, expect, rtol=1e-4, atol=1e-4):
            wrong.append(schedule)
        good = np.zeros(n // 256, np.float32)  # the correct kernel is right under the same order
        samples_module.with_schedule(schedule, seed).get_function("tree_sum_f32")(
            (n // 256,), (256,), (good, x, np.int32(n)))
        np.testing.assert_allclose(good, expect, rtol=1e-4, atol=1e-4)
    assert "forward" in wrong, wrong


def test_missing_barrier_reads_poisoned_shared_memory(broken_unchecked):
    x = np.arange(256, dtype=np.float32)
    out = np.zeros(256, np.float32)
    broken_unchecked.with_schedule("forward").get_function("neighbour_missing_sync_f32")((1,), (256,), (out, x))
    assert np.isnan(out[:-1]).all()  # under forward order, thread t reads slot t+1 before thread t+1 wrote it


def test_uninitialized_shared_memory_is_nan(broken_module):
    x = np.arange(64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    broken_module.get_function("uninitialized_shared_f32")((1,), (64,), (out, x))
    np.testing.assert_array_equal(out[:-1], x[1:])
    assert np.isnan(out[-1])


def test_warp_synchronous_code_without_syncwarp_is_wrong(broken_unchecked):
    x = np.arange(32, dtype=np.float32)
    results = []
    for schedule, seed in ORDERS:
        out = np.zeros(1, np.float32)
        broken_unchecked.with_schedule(schedule, seed).get_function("warp_lockstep_sum_f32")((1,), (32,), (out, x))
        results.append(out[0])
    assert any(r != x.sum() for r in results), results


def test_divergent_syncthreads_is_reported(broken_module):
    out = np.zeros(64, np.float32)
    with pytest.raises(BarrierError, match=r"(?s)threads 0-31: wait at __syncthreads\(\) at .*broken.cu.*threads 32-63: exited"):
        broken_module.get_function("divergent_syncthreads_f32")((1,), (64,), (out,))


def test_early_exit_before_barrier_is_reported(broken_module):
    n = 300
    x, out = np.ones(n, np.float32), np.zeros(n, np.float32)
    with pytest.raises(BarrierError, match=r"(?s)block \(1,0,0\).*threads 0-43: wait.*threads 44-255: exited"):
        broken_module.get_function("early_exit_before_barrier_f32")(blocks(n, 256), (256,), (out, x, np.int32(n)))
    # with n a multiple of the block size no thread exits early, and the kernel is fine
    x, out = np.ones(512, np.float32), np.zeros(512, np.float32)
    broken_module.get_function("early_exit_before_barrier_f32")((2,), (256,), (out, x, np.int32(512)))
    assert (out == 1).all()


def test_different_barrier_sites_are_reported(broken_module):
    with pytest.raises(BarrierError, match="divergent barrier"):
        broken_module.get_function("different_barriers_f32")((1,), (64,), (np.zeros(64, np.float32),))


def test_divergent_shuffle_is_reported(broken_module):
    x = np.ones(32, np.float32)
    with pytest.raises(BarrierError, match="divergent warp operation"):
        broken_module.get_function("divergent_shuffle_f32")((1,), (32,), (np.zeros(32, np.float32), x))


def test_shuffle_in_incomplete_warp_is_reported(broken_module):
    fn = broken_module.get_function("warp_sum_any_block_f32")
    x = np.ones(64, np.float32)
    out = np.zeros(64, np.float32)
    fn((1,), (64,), (out, x))
    assert (out == 32).all()
    with pytest.raises(BarrierError, match=r"incomplete warp.*warp 1 .*lanes 0x0000ffff"):
        fn((1,), (48,), (out, x))


def test_dynamic_shared_memory_overflow_is_reported(broken_module):
    out = np.zeros(64, np.float32)
    fn = broken_module.get_function("dynamic_smem_overflow_f32")
    fn((1,), (64,), (out,), shared_mem=65 * 4)
    with pytest.raises(OutOfBoundsError, match=r"shared_mem=256 bytes .* byte 256"):
        fn((1,), (64,), (out,), shared_mem=64 * 4)


def test_crash_becomes_an_exception(broken_module):
    x, out = np.ones(32, np.float32), np.zeros(32, np.float32)
    with pytest.raises(KernelFault, match=r"SIGSEGV.*block \(0,0,0\), thread \(\d+,0,0\)"):
        broken_module.get_function("wild_read_f32")((1,), (32,), (out, x))
    with pytest.raises(KernelFault, match="integer division by zero"):
        broken_module.get_function("divide_by_zero")((1,), (1,), (np.zeros(1, np.int32), np.int32(0)))
    with pytest.raises(KernelFault, match="stack overflow"):
        broken_module.get_function("huge_local_array")((1,), (2,), (out, np.int32(1 << 16)))
    # an index past a local array (the checked build's -fsanitize=bounds traps); in bounds it runs
    overrun = broken_module.get_function("local_array_overrun_f32")
    overrun((1,), (32,), (out, x, np.int32(3)))
    assert (out == 4).all()
    with pytest.raises(KernelFault, match=r"SIGILL \(illegal instruction at broken\.cu:\d+: .*out of the bounds of an "
                       r"array of known size, a thread's local array"):
        overrun((1,), (32,), (out, x, np.int32(4)))
    # the module, and the process, are fine afterwards
    broken_module.get_function("divide_by_zero")((1,), (4,), (out.view(np.int32)[:4], np.int32(7)))
    assert (out.view(np.int32)[:4] == 14).all()


def test_hang_becomes_a_timeout(broken_module):
    m = broken_module.with_schedule("forward")
    m.timeout = 0.3
    with pytest.raises(EmulationTimeout, match="spin-wait"):
        m.get_function("spin_wait")((1,), (2,), (np.zeros(1, np.int32),))


def test_device_assert_and_trap(broken_module):
    ok, bad = np.arange(10, dtype=np.int32), np.array([1, 2, -3], np.int32)
    for name in ("device_assert", "device_trap"):
        fn = broken_module.get_function(name)
        fn((1,), (32,), (ok, np.int32(ok.size)))
        with pytest.raises(DeviceAssertError, match=r"broken.cu.*thread \(2,0,0\)"):
            fn((1,), (32,), (bad, np.int32(bad.size)))


def test_libc_assert_in_kernel_is_a_device_assert():
    code = '#include "common.cuh"\n#include <assert.h>\nextern "C" __global__ void k(int n) { assert(n > 0); }\n'
    k = EmulatedModule(code=code).get_function("k")
    k((1,), (1,), (np.int32(1),))
    with pytest.raises(DeviceAssertError, match="n > 0"):
        k((1,), (1,), (np.int32(0),))


def test_write_through_const_pointer_is_reported(broken_module):
    with pytest.raises(EmulationError, match="const pointers"):
        broken_module.get_function("writes_const_input")((1,), (4,), (np.ones(4, np.float32),))


# ================================================================================================
# Races and out-of-bounds accesses (checked builds, the default)
# ================================================================================================
RACE_SAMPLES = [  # kernel, kind under the forward schedule
    ("race_raw_f32", "read after write"),
    ("race_war_f32", "write after read"),
    ("race_waw_f32", "write after write"),
    ("sum_and_sumsq_missing_sync_f32", "write after read"),
    ("tree_sum_missing_sync_f32", "write after read"),
    ("warp_lockstep_sum_f32", "write after read"),
]


def _race_args(name: str):
    x = np.linspace(-1, 1, 256, dtype=np.float32)
    if name == "warp_lockstep_sum_f32":
        return (1,), (32,), (np.zeros(1, np.float32), x[:32])
    if name == "tree_sum_missing_sync_f32":
        return (1,), (256,), (np.zeros(1, np.float32), x, np.int32(256))
    return (1,), (256,), (np.zeros(256, np.float32), x)


@pytest.mark.parametrize("name,kind", RACE_SAMPLES, ids=[n for n, _ in RACE_SAMPLES])
def test_planted_races_are_reported_under_every_schedule(broken_module, name, kind):
    for schedule, seed in ORDERS:
        grid, block, args = _race_args(name)
        with pytest.raises(SharedMemoryRaceError) as e:
            broken_module.with_schedule(schedule, seed).get_function(name)(grid, block, args)
        msg = str(e.value)
        # the kernel, the kind, the shared variable and address, two distinct threads with their source lines
        assert re.search(rf"kernel {name} .*shared-memory race \((read|write) after (read|write)\) in block \(0,0,0\) "
                         r"on byte \d+ of __shared__ \S+ \(\d+ bytes\), address 0x[0-9a-f]+: ", msg), msg
        threads = re.findall(r"thread \((\d+),0,0\) \(warp \d+ lane \d+\) (?:reads|writes|read|wrote) it at "
                             r"broken\.cu:(\d+)", msg)
        assert len(threads) == 2 and threads[0][0] != threads[1][0], msg
        if schedule == "forward":
            assert f"race ({kind})" in msg, msg


def test_race_report_names_lines_and_threads(broken_module):
    src = BROKEN.read_text().splitlines()
    with pytest.raises(SharedMemoryRaceError) as e:
        broken_module.with_schedule("forward").get_function("race_war_f32")(*_race_args("race_war_f32"))
    m = re.search(r"thread \(1,0,0\) \(warp 0 lane 1\) writes it at broken\.cu:(\d+); thread \(0,0,0\) \(warp 0 "
                  r"lane 0\) read it at broken\.cu:(\d+), with no __syncthreads\(\) or __syncwarp\(\) between them",
                  str(e.value))
    assert m, str(e.value)
    assert src[int(m.group(1)) - 1].strip() == "buf[t] = right;"
    assert src[int(m.group(2)) - 1].strip() == "const float right = buf[(t + 1) % blockDim.x];"
    assert "byte 4 of __shared__ race_war_f32::buf (1024 bytes)" in str(e.value)


def test_missing_trailing_barrier_is_wrong_only_when_a_warp_runs_ahead(broken_unchecked):
    """The issue's survivor: without the checks, only the warp-* schedules expose it."""
    x = rng(21).standard_normal(256, dtype=np.float32)
    expect = np.array([x.sum(), (x * x).sum()], np.float32)
    wrong = []
    for schedule, seed in ORDERS:
        out = np.zeros(2, np.float32)
        broken_unchecked.with_schedule(schedule, seed).get_function("sum_and_sumsq_missing_sync_f32")(
            (1,), (256,), (out, x))
        if not np.allclose(out, expect, rtol=1e-4):
            wrong.append(schedule)
    assert wrong and all(s.startswith("warp-") for s in wrong) and "warp-forward" in wrong, wrong


def test_race_free_warp_synchronous_code_passes(samples):
    x = rng(22).standard_normal(128, dtype=np.float32)
    out = np.zeros(128, np.float32)
    samples.get_function("warp_exchange_syncwarp_f32")((1,), (128,), (out, x))
    np.testing.assert_allclose(out, np.repeat(x.reshape(4, 32).sum(1), 32), rtol=1e-5, atol=1e-5)
    samples.get_function("half_warp_exchange_f32")((1,), (64,), (out[:64], x[:64]))
    lanes = np.arange(64)
    np.testing.assert_array_equal(out[:64], x[:64][lanes - lanes % 16 + (lanes + 1) % 16])
    keys = rng(23).integers(0, 1000, 3000).astype(np.int32)
    hist = np.zeros(16, np.int32)
    samples.get_function("shared_atomic_histogram")((3,), (128,), (hist, keys, np.int32(keys.size)))
    np.testing.assert_array_equal(hist, 3 * np.bincount(keys & 15, minlength=16))


def test_warp_schedules_let_a_warp_run_ahead(samples_module):
    def tickets(schedule):
        order, counter = np.full(128, -1, np.int32), np.zeros(1, np.int32)
        samples_module.with_schedule(schedule).get_function("phase_order")((1,), (64,), (order, counter))
        return order.reshape(64, 2)

    t = np.arange(64)
    np.testing.assert_array_equal(tickets("forward"), np.stack([t, 64 + t], 1))  # rounds: nobody runs ahead
    warp, lane = t // 32, t % 32
    np.testing.assert_array_equal(tickets("warp-forward"), np.stack([64 * warp + lane, 64 * warp + 32 + lane], 1))
    np.testing.assert_array_equal(tickets("warp-reverse"),
                                  np.stack([64 * (1 - warp) + 31 - lane, 64 * (1 - warp) + 63 - lane], 1))


def test_default_schedule_and_checks_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUTP_EMU_SCHEDULE", "warp-reverse")
    assert EmulatedModule(path=SAMPLES).schedule == "warp-reverse"
    monkeypatch.setenv("CUTP_EMU_SCHEDULE", "sideways")
    with pytest.raises(ValueError, match="schedule"):
        EmulatedModule(path=SAMPLES)
    monkeypatch.delenv("CUTP_EMU_SCHEDULE")
    monkeypatch.setenv("CUTP_EMU_CHECKS", "0")
    assert not EmulatedModule(path=BROKEN).checks


def test_out_of_bounds_reads_are_reported(broken_module, broken_unchecked):
    n = 1000
    x, out = np.ones(n, np.float32), np.zeros(n, np.float32)
    args = (blocks(n, 256), (256,), (out, x, np.int32(n)))
    broken_unchecked.get_function("tail_read_off_by_one_f32")(*args)  # unseen without the checks: NaN from the guard
    assert np.isnan(out[-1]) and (out[:-1] == 2).all()
    with pytest.raises(OutOfBoundsError, match=r"kernel tail_read_off_by_one_f32 .*out-of-bounds read of 4 bytes from "
                       r"argument 1 \(const float\*\) \[float32, 1000 elements\]: 0 byte\(s\) after the end \(element "
                       r"index 1000 of a 1000-element array\), at broken\.cu:\d+ by thread \(231,0,0\), block \(3,0,0\)"):
        broken_module.get_function("tail_read_off_by_one_f32")(*args)
    for schedule, seed in ORDERS:
        with pytest.raises(OutOfBoundsError, match=r"read of 4 bytes from argument 1 .* 4 byte\(s\) before the start "
                           r"\(element index -1\), at broken\.cu:\d+ by thread \(0,0,0\), block \(0,0,0\)"):
            broken_module.with_schedule(schedule, seed).get_function("read_before_start_f32")(*args)


def test_shared_memory_out_of_bounds_is_reported(broken_module):
    x, out = np.ones(32, np.float32), np.zeros(32, np.float32)
    # an index past a static __shared__ array (of known size): the bounds sanitizer's trap, at the line
    with pytest.raises(KernelFault, match=r"kernel static_smem_overrun_f32 .*SIGILL \(illegal instruction at "
                       r"broken\.cu:\d+: .*static __shared__.*block \(0,0,0\), thread \(31,0,0\)"):
        broken_module.get_function("static_smem_overrun_f32")((1,), (32,), (out, x))
    fn = broken_module.get_function("dynamic_smem_read_overrun_f32")
    fn((1,), (32,), (out,), shared_mem=33 * 4)
    with pytest.raises(OutOfBoundsError, match=r"shared-memory read of 4 bytes .*thread \(31,0,0\).*: the dynamic "
                       r"shared memory \(extern __shared__; shared_mem=128 bytes were given at launch\), byte 128"):
        fn((1,), (32,), (out,), shared_mem=32 * 4)
    with pytest.raises(OutOfBoundsError, match=r"atomic_smem_overrun .*shared-memory write of 4 bytes .*thread "
                       r"\(4,0,0\).*byte 0 past the end of __shared__ atomic_smem_overrun::counts \(16 bytes\)"):
        broken_module.get_function("atomic_smem_overrun")((1,), (32,), (np.zeros(4, np.int32),))


def test_unchecked_build_still_catches_writes_into_the_guards(broken_unchecked):
    out = np.zeros(100, np.float32)
    with pytest.raises(OutOfBoundsError, match="argument 0 .* before the start"):
        broken_unchecked.get_function("write_before_start_f32")((1,), (128,), (out, np.int32(100)))
    with pytest.raises(OutOfBoundsError, match=r"shared_mem=256 bytes .* byte 256"):
        broken_unchecked.get_function("dynamic_smem_overflow_f32")((1,), (64,), (np.zeros(64, np.float32),),
                                                                   shared_mem=64 * 4)


# ================================================================================================
# The CuPy-compatible launch interface
# ================================================================================================
def test_argument_checks(samples_module):
    fn = samples_module.get_function("scale_add_f32")
    assert fn.signature == "scale_add_f32(float*, const float*, const float*, float, long long int)"
    x = np.ones(8, np.float32)
    ok = (x.copy(), x, x, np.float32(2), np.int64(8))
    fn((1,), (32,), ok)
    cases = [
        ((x.copy(), x.astype(np.float64), x, np.float32(2), np.int64(8)), r"argument 1 \(const float\*\) expects an array of float32"),
        ((x.copy(), x, x, 2.0, np.int64(8)), r"argument 3 \(float\) expects a 4-byte float.*Python int as int64 and a float as float64"),
        ((x.copy(), x, x, np.float64(2), np.int64(8)), "expects a 4-byte float"),
        ((x.copy(), x, x, np.float32(2), np.int32(8)), r"argument 4 \(long long int\) expects a 8-byte integer"),
        ((x.copy(), x, x, np.float32(2)), "takes 5 arguments"),
        ((x.copy(), np.float32(1), x, np.float32(2), np.int64(8)), "is a pointer: pass a NumPy array"),
        ((x.copy(), x, x, x[:1], np.int64(8)), "is passed by value but got ndarray"),
        ((x.copy(), np.ones((4, 4), np.float32).T, x, np.float32(2), np.int64(8)), "not C-contiguous"),
        ((x.copy(), x.tolist(), x, np.float32(2), np.int64(8)), "pass a NumPy array"),
    ]
    for args, message in cases:
        with pytest.raises(KernelArgumentError, match=message):
            fn((1,), (32,), args)
    # a Python int is fine for a 64-bit parameter, as in CuPy; the value must fit the type
    fn((1,), (32,), (x.copy(), x, x, np.float32(2), 8))
    fn_u = samples_module.get_function("scale_inplace_f32")
    with pytest.raises(KernelArgumentError, match="expects a 4-byte float"):
        fn_u((1,), (32,), (x.copy(), np.int32(1), np.int64(8)))


def test_launch_configuration_checks(samples_module):
    fn = samples_module.get_function("scale_inplace_f32")
    x = np.ones(8, np.float32)
    args = (x, np.float32(1), np.int64(8))
    with pytest.raises(TypeError, match="tuple"):
        fn(1, (32,), args)  # cupy.RawKernel requires tuples
    with pytest.raises(TypeError, match="tuple"):
        fn((1,), [32], args)
    with pytest.raises(LaunchConfigError, match="block dimension x = 1025"):
        fn((1,), (1025,), args)
    with pytest.raises(LaunchConfigError, match=r"1056 threads, more than CUDA's limit \(1024\)"):
        fn((1,), (32, 33), args)
    with pytest.raises(LaunchConfigError, match="block dimension z = 65"):
        fn((1,), (1, 1, 65), args)
    with pytest.raises(LaunchConfigError, match="grid dimension y = 65536"):
        fn((1, 65536), (32,), args)
    with pytest.raises(LaunchConfigError, match="1 to 3 dimensions"):
        fn((1, 1, 1, 1), (32,), args)
    with pytest.raises(LaunchConfigError, match="1 to 3 dimensions"):
        fn((), (32,), args)
    with pytest.raises(LaunchConfigError, match="shared_mem"):
        fn((1,), (32,), args, shared_mem=-1)
    fn((0,), (0, 0), args)  # zeros mean 1, as in CuPy (which clamps with max(1, n))
    assert (x == 1).all()


def test_launch_bounds_are_enforced():
    code = '#include "common.cuh"\nextern "C" __global__ void __launch_bounds__(2 * 64) k(float* x) { x[threadIdx.x] = 1.0f; }\n'
    k = EmulatedModule(code=code).get_function("k")
    assert k.max_threads_per_block == 128
    k((1,), (128,), (np.zeros(128, np.float32),))
    with pytest.raises(LaunchConfigError, match="__launch_bounds__"):
        k((1,), (256,), (np.zeros(256, np.float32),))


def test_aliased_arguments_share_memory(samples_module):
    x = np.arange(100, dtype=np.float32)
    y = np.ones(100, np.float32)
    samples_module.get_function("scale_add_f32")((1,), (128,), (x, x, y, np.float32(2), np.int64(100)))  # out is x
    np.testing.assert_array_equal(x, 2 * np.arange(100, dtype=np.float32) + 1)
    z = np.zeros(300, np.float32)
    samples_module.get_function("scale_inplace_f32")((1,), (64,), (z[100:200], np.float32(2), np.int64(100)))
    assert not z.any()
    z[:] = 1
    samples_module.get_function("scale_add_f32")((1,), (128,), (z[100:200], z[:100], z[200:], np.float32(3), np.int64(100)))
    np.testing.assert_array_equal(z, np.r_[np.ones(100), 4 * np.ones(100), np.ones(100)])


def test_traffic_counts_the_bytes_each_array_argument_moves(samples_module):
    """record_traffic(): per launch and array, the bytes the kernel read and wrote (checked
    builds count every instrumented access at its size; shared memory and the stack are not
    global traffic)."""
    n = 1000
    x, y = rng(11).standard_normal((2, n), dtype=np.float32)
    out = np.zeros(n, np.float32)
    with cuda_emu.record_traffic() as log:
        samples_module.get_function("scale_add_f32")(blocks(n, 256), (256,), (out, x, y, np.float32(2), np.int64(n)))
        # in place: out and x are one piece of memory, read and written once each
        samples_module.get_function("scale_add_f32")(blocks(n, 256), (256,), (x, x, y, np.float32(2), np.int64(n)))
        # 128-bit loads and stores of bf16: 16 bytes per access, the same bytes in all
        xb = x.astype(BF16)
        ob = np.zeros(n, BF16)
        samples_module.get_function("scale128_bf16")(blocks(n // 8, 32), (32,), (ob, xb, np.float32(0.5), np.int64(n)))
        # a shared-memory tree reduction: x read once; the shared traffic is not counted
        part = np.zeros(blocks(n, 256)[0], np.float32)
        samples_module.get_function("tree_sum_f32")(blocks(n, 256), (256,), (part, x, np.int32(n)))
    assert [t.kernel for t in log] == ["scale_add_f32", "scale_add_f32", "scale128_bf16", "tree_sum_f32"]
    a, b, c, d = log
    assert a.grid == (4, 1, 1) and a.block == (256, 1, 1)
    assert (a.param(0).read, a.param(0).written) == (0, 4 * n)
    assert (a.param(1).read, a.param(1).written) == (4 * n, 0)
    assert a.of(y) == (4 * n, 0) and a.of(out) == (0, 4 * n)
    assert b.param(0) is b.param(1) and b.param(0).params == (0, 1)
    assert b.of(x) == (4 * n, 4 * n) and b.of(y) == (4 * n, 0)
    assert c.of(xb) == (2 * n, 0) and c.of(ob) == (0, 2 * n)
    assert d.of(x) == (4 * n, 0) and d.of(part) == (0, 4 * part.size)
    assert d.of(np.zeros(3)) == (0, 0)  # not an argument of the launch
    kern = samples_module.get_function("tree_sum_f32")
    assert kern.last_traffic is d
    with pytest.raises(KeyError, match="parameter 2"):
        d.param(2)  # a scalar
    # no recorder: nothing is logged, the kernel still keeps its last launch
    samples_module.get_function("scale_add_f32")(blocks(10, 256), (256,), (out[:10], x[:10], y[:10], np.float32(2),
                                                                         np.int64(10)))
    assert len(log) == 4
    assert samples_module.get_function("scale_add_f32").last_traffic.of(y) == (40, 0)
    # an unchecked build counts nothing: recording its launches is an error, not zeros
    unchecked = EmulatedModule(path=SAMPLES, checks=False).get_function("scale_add_f32")
    with cuda_emu.record_traffic(), pytest.raises(EmulationError, match="checked builds only"):
        unchecked((1,), (256,), (out[:10], x[:10], y[:10], np.float32(2), np.int64(10)))
    assert unchecked.last_traffic is None


def test_read_only_output_is_reported(samples_module):
    x = np.ones(16, np.float32)
    x.flags.writeable = False
    with pytest.raises(EmulationError, match="read-only"):
        samples_module.get_function("scale_inplace_f32")((1,), (16,), (x, np.float32(2), np.int64(16)))


def test_module_api(samples_module):
    assert {"scale_add_f32", "tree_sum_f32", "softmax_smem_f32"} <= set(samples_module.kernel_names)
    with pytest.raises(EmulationError, match="no kernel named 'nope'.*scale_add_f32"):
        samples_module.get_function("nope")
    again = EmulatedModule(path=str(SAMPLES.relative_to(ROOT)))  # cached build, relative path
    assert again.library_path == samples_module.library_path
    fn = samples_module.get_function("softmax_smem_f32")
    assert fn.max_threads_per_block == 1024 and fn.shared_size_bytes == 256
    with pytest.raises(EmulationError, match="name_expressions"):
        EmulatedModule(path=SAMPLES, name_expressions=["k<float>"])


def test_options_and_compile_errors():
    code = '#include "common.cuh"\nextern "C" __global__ void k(float* x) { x[0] = SCALE; }\n'
    m = EmulatedModule(code=code, options=("-DSCALE=3.0f", "--use_fast_math", "-arch=sm_90", "--std=c++17"))
    x = np.zeros(1, np.float32)
    m.get_function("k")((1,), (1,), (x,))
    assert x[0] == 3
    y = np.zeros(1, np.float32)
    m.k((1,), (1,), 0, y)  # a kernel as an attribute: (grid, block, shared_mem, *args)
    assert y[0] == 3
    with pytest.raises(AttributeError, match="no attribute or kernel 'nope'"):
        m.nope
    with pytest.raises(CompileError, match="not understood"):
        EmulatedModule(code=code, options=("--frobnicate",))
    with pytest.raises(CompileError, match="SCALE"):
        EmulatedModule(code=code)  # SCALE undefined: g++'s diagnostic is in the message


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    """A build cache of this test alone ($CUTP_CACHE_DIR is read at every build). The emulator
    runtime's object is copied over from the session's cache, so only the test's modules compile."""
    cuda_emu._runtime_object(os.environ.get("CUTP_EMU_CXX", "g++"), ())  # built once per session anyway
    session_cache = cuda_emu._cache_dir()
    monkeypatch.setenv("CUTP_CACHE_DIR", str(tmp_path / "cache"))
    cache = cuda_emu._cache_dir()
    for obj in session_cache.glob("runtime-*.o"):
        shutil.copy2(obj, cache / obj.name)
    return cache


def count_kernel_compiles(monkeypatch) -> list[list[str]]:
    """The g++ command lines that compile kernel sources from now on (appended as they run)."""
    compiles, run = [], cuda_emu._run

    def counting_run(cmd, what, cwd=None):
        if what == "compiling the kernels with g++":
            compiles.append(cmd)
        return run(cmd, what, cwd)

    monkeypatch.setattr(cuda_emu, "_run", counting_run)
    return compiles


def test_warnings_are_compile_errors(private_cache, tmp_path, monkeypatch):
    """-Werror: a kernel that only warns (an unused variable) does not build, and leaves no build."""
    compiles = count_kernel_compiles(monkeypatch)
    src = tmp_path / "warns.cu"
    src.write_text('#include "common.cuh"\n'
                   'extern "C" __global__ void k(float* x) {\n    int unused = 3;\n    x[0] = 1.0f;\n}\n')
    with pytest.raises(CompileError, match=r"(?s)compiling the kernels with g\+\+ failed.*warns\.cu:3.*"
                                           r"unused variable .unused..*-Werror=unused-variable"):
        EmulatedModule(path=src)
    assert len(compiles) == 1 and "-Werror" in compiles[0]
    assert not list(private_cache.glob("module-*")), "a failed build must not be cached"


def _gone(pid: int) -> bool:
    """Whether process pid has ended (a zombie its parent has not reaped yet counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("ending", ["exit", "SIGTERM"])
def test_a_session_that_ends_stops_its_compiles_and_their_children(tmp_path, ending):
    """A process that ends with a compile in progress on a daemon thread (a session stopped by
    -x, or by `timeout`'s SIGTERM, with its warm-up's g++ running) kills that compile with its
    whole process group on the way out: before, the g++ ran on, orphaned. A shell that starts a
    child stands in for g++ and its cc1plus; SIGTERM still ends the process (its default)."""
    child = tmp_path / "child.pid"
    code = ("import os, signal, sys, threading, time; import tests.cuda_emu as e\n"
            "e.stop_compiles_on_signals()\n"
            f"cmd = ['sh', '-c', 'sleep 60 & echo $! > {child}; wait']\n"
            "threading.Thread(target=e._run, args=(cmd, 'a compile'), daemon=True).start()\n"
            f"while not os.path.exists('{child}') or not open('{child}').read().strip(): time.sleep(0.01)\n"
            "print(next(iter(e._compiling)).pid, flush=True)\n"
            + ("os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\n" if ending == "SIGTERM" else "sys.exit(0)\n"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    shell, sleeper = int(out.stdout), int(child.read_text())
    assert out.returncode == (-signal.SIGTERM if ending == "SIGTERM" else 0), out.stderr
    try:
        for _ in range(200):  # (the kernel may take a moment)
            if _gone(shell) and _gone(sleeper):
                return
            threading.Event().wait(0.05)
        raise AssertionError(f"the compile ({shell}) or its child ({sleeper}) outlived its session")
    finally:  # (a failure leaves nothing running either)
        if not (_gone(shell) and _gone(sleeper)):
            with contextlib.suppress(OSError):
                os.killpg(shell, signal.SIGKILL)


def test_a_signal_the_process_ignores_stays_ignored():
    """Under nohup (SIGHUP ignored) a hang-up must neither end the session nor stop its compiles:
    only the signals that would end the process get the compiles stopped first."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        cuda_emu.stop_compiles_on_signals()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not saved[signal.SIGTERM]  # (wrapped)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_builds_are_cached_by_the_contents_of_sources_and_headers(private_cache, tmp_path, monkeypatch):
    """The cache key hashes the source and the headers it includes (next to it, or in an -I
    directory): a changed source or header builds anew; the same contents (even rewritten, or restored after
    a change) reuse the cached build without running the compiler."""
    compiles = count_kernel_compiles(monkeypatch)
    inc = tmp_path / "include"
    inc.mkdir()
    src, local_h, include_h = tmp_path / "k.cu", tmp_path / "local.cuh", inc / "scale.cuh"
    kernel = ('#include "common.cuh"\n#include "local.cuh"\n#include "scale.cuh"\n'
              'extern "C" __global__ void k(float* x) {{ x[0] = {value} * LOCAL * SCALE; }}\n')

    def write(value="1.0f", local="1.0f", scale="1.0f"):
        src.write_text(kernel.format(value=value))
        local_h.write_text(f"#define LOCAL {local}\n")
        include_h.write_text(f"#define SCALE {scale}\n")

    def build() -> tuple[Path, float]:
        m = EmulatedModule(path=src, options=("-I", str(inc)))
        x = np.zeros(1, np.float32)
        m.get_function("k")((1,), (1,), (x,))
        return m.library_path, float(x[0])

    write()
    first = build()
    assert first[1] == 1 and first[0].parent == private_cache and len(compiles) == 1
    write()  # the same bytes, written again
    assert build() == first and len(compiles) == 1
    write(value="2.0f")
    changed = build()
    assert changed[1] == 2 and changed[0] != first[0] and len(compiles) == 2
    write(value="2.0f", local="3.0f")  # a header next to the source
    local = build()
    assert local[1] == 6 and local[0] not in (first[0], changed[0]) and len(compiles) == 3
    write(value="2.0f", local="3.0f", scale="5.0f")  # a header of an -I directory
    scaled = build()
    assert scaled[1] == 30 and scaled[0] not in (first[0], changed[0], local[0]) and len(compiles) == 4
    write()  # back to the first contents: the first build, no compiler run
    assert build() == first and len(compiles) == 4
    assert len(list(private_cache.glob("module-*.so"))) == 4


def test_cache_key_follows_nested_includes_and_ignores_unrelated_files(private_cache, tmp_path, monkeypatch):
    """A header reached through another header, in a subdirectory or via `..`, is part of the
    key; a file no source includes (another snippet in the same directory) is not."""
    compiles = count_kernel_compiles(monkeypatch)
    (tmp_path / "src" / "sub").mkdir(parents=True)
    src = tmp_path / "src" / "k.cu"
    outer, inner, up = tmp_path / "src" / "sub" / "outer.cuh", tmp_path / "src" / "sub" / "inner.cuh", tmp_path / "up.cuh"
    src.write_text('#include "common.cuh"\n#include "sub/outer.cuh"\nextern "C" __global__ void k(float* x) { x[0] = INNER * UP; }\n')
    outer.write_text('#include "inner.cuh"\n#include "../../up.cuh"\n')

    def build(inner_value, up_value):
        inner.write_text(f"#define INNER {inner_value}\n")
        up.write_text(f"#define UP {up_value}\n")
        x = np.zeros(1, np.float32)
        m = EmulatedModule(path=src)
        m.get_function("k")((1,), (1,), (x,))
        return m.library_path, float(x[0])

    first = build("1.0f", "1.0f")
    assert first[1] == 1 and len(compiles) == 1
    assert build("5.0f", "1.0f")[1] == 5 and len(compiles) == 2  # included from a subdirectory's header
    assert build("5.0f", "3.0f")[1] == 15 and len(compiles) == 3  # included via ..
    (tmp_path / "src" / "unrelated.cu").write_text("// another snippet\n")
    (tmp_path / "src" / "unrelated.cuh").write_text("#define NOTHING 1\n")
    assert build("1.0f", "1.0f") == first and len(compiles) == 3  # unrelated files: the first build


def test_ucontext_fallback_runs_kernels():
    """The portable fiber switch (used off x86-64), forced on x86-64."""
    code = """#include "common.cuh"
extern "C" __global__ void row_sum(float* out, const float* x, int width) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) s += x[(long long)blockIdx.x * width + i];
    s = block_reduce_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}
extern "C" __global__ void wild(float* x) { x[threadIdx.x + (1ll << 42)] = 1.0f; }
"""
    m = EmulatedModule(code=code, cxx_flags=("-DCUDA_EMU_USE_UCONTEXT",), schedule="reverse")
    rows, width = 3, 500
    x = rng(15).standard_normal((rows, width), dtype=np.float32)
    out = np.zeros(rows, np.float32)
    m.get_function("row_sum")((rows,), (256,), (out, x, np.int32(width)))
    np.testing.assert_allclose(out, x.sum(1), rtol=1e-5, atol=1e-4)
    with pytest.raises(KernelFault, match="SIGSEGV"):
        m.get_function("wild")((1,), (32,), (np.zeros(32, np.float32),))


# ================================================================================================
# Kernel sources: compile with the real CUDA compilers (that every kernel ran in an emulated test:
# tests/kernels/test_launchers.py's test_every_kernel_ran_in_a_test_on_the_emulator)
# ================================================================================================
_KERNEL_DEF = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\("
)


def _strip_comments(src: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", " ", src, flags=re.S)


def kernel_entry_points(path: Path) -> list[str]:
    return _KERNEL_DEF.findall(_strip_comments(path.read_text()))


def test_kernel_scanner_finds_sample_entry_points(samples_module):
    assert set(kernel_entry_points(SAMPLES)) == set(samples_module.kernel_names)


def _cuda_sources() -> list[Path]:
    return [SAMPLES, BROKEN, *sorted((ROOT / "kernels").glob("*.cu"))]


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))), None)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_sources_compile_with_nvcc(tmp_path):
    """Device-only compiles (as NVRTC does, but with ptxas), warnings as errors: the emulator's
    samples here (sm_80); kernels/ (sm_80 and sm_90) through kernel_resources.compile_all, the compile the
    resource tests read (with common.cuh inlined, as cutp hands NVRTC the source; cached per
    source text, so this session compiles each kernel once)."""
    for warm_up in [t for t in threading.enumerate() if t.name == "nvcc-warm-up"]:
        warm_up.join()  # (tests/conftest.py: the same compiles, started at collection)
    kernel_resources.compile_all(_nvcc())  # raises with nvcc's log on an error or a warning
    # (the emulator's samples only need to be valid CUDA: one architecture; kernels/ gets both)
    jobs = [(src, "sm_80") for src in (SAMPLES, BROKEN)]

    def compile_one(job):
        src, arch = job
        cmd = [_nvcc(), f"-arch={arch}", "--cubin", "-I", str(ROOT / "kernels"), "-Werror", "all-warnings",
               "-o", str(tmp_path / f"{src.stem}-{arch}.cubin"), str(src)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        return job, p.returncode, p.stderr + p.stdout

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [f"{src.name} ({arch}):\n{log}" for (src, arch), rc, log in pool.map(compile_one, jobs) if rc != 0]
    assert not failures, "\n\n".join(failures)


def _find_nvrtc() -> tuple[str, str] | None:
    """(libnvrtc path, include dir with cuda_bf16.h), from the nvidia-cuda-nvrtc/-runtime wheels or a toolkit."""
    libs, incs = [], []
    try:
        import nvidia  # namespace package of NVIDIA's wheels

        for base in nvidia.__path__:
            libs += sorted(glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*")))
            incs += [os.path.dirname(p) for p in glob.glob(os.path.join(base, "*", "include", "cuda_bf16.h"))]
    except ImportError:
        pass
    libs += sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*"))
    incs += [os.path.dirname(p) for p in sorted(glob.glob("/usr/local/cuda*/include/cuda_bf16.h"))]
    libs = [p for p in libs if "builtins" not in p and ".alt." not in p]
    return (libs[0], incs[0]) if libs and incs else None


def load_nvrtc(lib_path: str):
    """libnvrtc via ctypes. It dlopens its builtins library by name: load that first, so the
    wheel works without LD_LIBRARY_PATH."""
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(lib_path), "libnvrtc-builtins.so*"))):
        if ".alt." not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(lib_path)


def nvrtc_compile(lib, source: bytes, name: str, options: list[str]) -> str | None:
    """Compiles one program with NVRTC; None on success, else the compiler's log."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(), 0, None, None) == 0
    rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*(o.encode() for o in options)))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return None if rc == 0 else log.value.decode(errors="replace")


@pytest.mark.skipif(_find_nvrtc() is None, reason="NVRTC (nvidia-cuda-nvrtc) not installed")
def test_sources_compile_with_nvrtc():
    """The production path: NVRTC, no standard library headers, common.cuh's __CUDACC_RTC__ branch."""
    lib_path, _ = _find_nvrtc()
    lib = load_nvrtc(lib_path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    # the headers as the runtime finds them (kernels.runtime): a wheel's include directory may lack
    # crt/mma.h (torch's CUDA 13 wheels: no nvidia-cuda-crt), found then in a toolkit
    include = kernel_runtime.find_cuda_include(major.value)
    failures = []
    for src in _cuda_sources():
        for arch in ("sm_80", "sm_90"):
            opts = [f"-arch={arch}", f"-I{ROOT / 'kernels'}", *kernel_runtime.source_options(src.stem, include)]
            log = nvrtc_compile(lib, src.read_bytes(), src.name, opts)
            if log is not None:
                failures.append(f"{src.name} ({arch}):\n{log}")
    assert not failures, "\n\n".join(failures)
