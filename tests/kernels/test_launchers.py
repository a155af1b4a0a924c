"""What the launchers of every kernel family share, on each backend (the ops themselves: test_<op>.py).

Argument checks (a clear KernelArgumentError, never a silent wrong answer), every entry point of
kernels/*.cu launched by its launcher, launch shapes within each kernel's __launch_bounds__, the
emulator's refusals below the launchers, and the benchmark's "cuda_kernels" variants
(cutp/bench/kernel_variants.py) against the benchmark's references.

kernels/README.md says what a passing emulated test does and does not establish.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cutp.bench import kernel_variants
from cutp.bench import kernels as bench
from cutp.kernels import SOURCES, KernelArgumentError, Launchers, use_kernels
from tests.cuda_emu import KERNELS_DIR
from tests.cuda_emu import KernelArgumentError as EmulatorArgumentError
from tests.cuda_emu import LaunchConfigError as EmulatorLaunchConfigError
from tests.cuda_emu.test_emulator import kernel_entry_points

from .helpers import ADAMW_KW, BF16, DTYPES, F32, LAUNCHED_BY, randn

# ================================================================================================
# Argument checks: a clear error, never a silent wrong answer
# ================================================================================================
def test_non_contiguous_arrays_are_refused(backend, k):
    xp = backend.xp
    x = backend.to_device(randn((6, 16), F32, seed=30))
    strided = x[:, ::2]
    f32 = np.float32
    cases = [
        lambda: k.gelu_forward(strided),
        lambda: k.gelu_backward(strided, xp.ascontiguousarray(strided)),
        lambda: k.bias_gelu_forward(strided, xp.zeros(8, f32)),
        lambda: k.bias_gelu_backward(strided, xp.ascontiguousarray(strided)),
        lambda: k.softmax_forward(strided),
        lambda: k.softmax_backward(xp.ascontiguousarray(strided), strided),
        lambda: k.layernorm_forward(strided),
        lambda: k.ce_shard_forward(strided, xp.zeros(6, np.int64), 8),
        lambda: k.ce_shard_backward(x, xp.zeros(6, f32), xp.ones(6, f32), xp.zeros(6, np.int64), 16,
                                    xp.ones(6, f32), out=xp.empty((16, 6), f32).T),
        lambda: k.dropout_forward(strided, 0.5, 1, 2),
        lambda: k.adamw_update(strided[0], strided[0].copy(), xp.zeros(8, f32), xp.zeros(8, f32), xp.ones(8, f32),
                               **ADAMW_KW),
    ]
    for case in cases:
        with pytest.raises(KernelArgumentError, match="not C-contiguous"):
            case()


def test_wrong_dtypes_are_refused(backend, k):
    backend.require_bf16()
    xp = backend.xp
    x64 = xp.zeros((4, 8))
    with pytest.raises(KernelArgumentError, match="float64 through their reference composition"):
        k.gelu_forward(x64)
    with pytest.raises(KernelArgumentError, match="dtype int32"):
        k.softmax_forward(xp.zeros((2, 3), np.int32))
    x = xp.zeros((4, 8), np.float32)
    with pytest.raises(KernelArgumentError, match="dy has dtype bfloat16, expected float32"):
        k.gelu_backward(x.astype(BF16), x)
    with pytest.raises(KernelArgumentError, match="b has dtype bfloat16"):
        k.bias_gelu_forward(x, xp.zeros(8, BF16))
    with pytest.raises(KernelArgumentError, match="weight has dtype float64"):
        k.layernorm_forward(x, xp.ones(8))
    with pytest.raises(KernelArgumentError, match="mean has dtype float64"):
        k.layernorm_backward(x, x, None, xp.zeros(4), xp.ones(4, np.float32))
    with pytest.raises(KernelArgumentError, match="m has dtype float64"):
        k.adamw_update(x[0], x[0], xp.zeros(8), xp.zeros(8, np.float32), x[0], **ADAMW_KW)
    with pytest.raises(KernelArgumentError, match="mask has dtype float32, expected bool"):
        k.dropout_apply(x, x, 2.0)
    with pytest.raises(KernelArgumentError, match="out has dtype bfloat16"):
        k.ce_shard_backward(x, xp.zeros(4, np.float32), xp.ones(4, np.float32), xp.zeros(4, np.int64), 8,
                            xp.ones(4, np.float32), out=x.astype(BF16))


def test_wrong_shapes_and_array_types_are_refused(backend, k):
    xp = backend.xp
    f32 = np.float32
    x = xp.zeros((4, 8), f32)
    with pytest.raises(KernelArgumentError, match=r"dy has shape \(4, 7\), expected \(4, 8\)"):
        k.gelu_backward(xp.zeros((4, 7), f32), x)
    with pytest.raises(KernelArgumentError, match=r"b has shape \(9,\), expected \(8,\)"):
        k.bias_gelu_forward(x, xp.zeros(9, f32))
    with pytest.raises(KernelArgumentError, match=r"dy has shape"):
        k.softmax_backward(xp.zeros((8, 4), f32), x)
    with pytest.raises(KernelArgumentError, match=r"bias has shape \(7,\)"):
        k.layernorm_forward(x, None, xp.zeros(7, f32))
    with pytest.raises(KernelArgumentError, match="rstd has 3 elements, expected one per row: 4"):
        k.layernorm_backward(x, x, None, xp.zeros(4, f32), xp.ones(3, f32))
    with pytest.raises(KernelArgumentError, match="row_scale has 3 elements"):
        k.ce_shard_backward(x, xp.zeros(4, f32), xp.ones(4, f32), xp.zeros(4, np.int64), 8, xp.ones(3, f32))
    with pytest.raises(KernelArgumentError, match=r"g has shape \(7,\)"):
        k.adamw_update(x[0], x[0, :7], xp.zeros(8, f32), xp.zeros(8, f32), x[0], **ADAMW_KW)
    with pytest.raises(KernelArgumentError, match="takes flat arrays"):
        k.adamw_update(x, x, x, x, x, **ADAMW_KW)
    with pytest.raises(KernelArgumentError, match=f"must be a {xp.__name__} array"):
        k.gelu_forward([1.0, 2.0])
    if xp is not np:  # host arrays handed to the GPU's launchers
        with pytest.raises(KernelArgumentError, match="must be a cupy array"):
            k.gelu_forward(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="causal softmax needs Tq <= Tk"):
        k.softmax_forward(xp.zeros((5, 3), f32), causal=True)
    with pytest.raises(ValueError, match="n_valid=9 outside"):
        k.ce_shard_forward(x, xp.zeros(4, np.int64), 9)


def test_kernels_reject_bad_launches_too(emulated_module):
    """Below the launchers, the kernels themselves: an empty launch (CuPy runs grid (0,) as one
    block) is harmless, and the emulator rejects Python scalars as CuPy would mis-pass them."""
    gelu = emulated_module.get_function("gelu_forward_f32")
    empty = np.zeros(0, np.float32)
    gelu((0,), (256,), (empty, empty, np.int64(0), np.int32(0)))
    softmax = emulated_module.get_function("softmax_forward_bf16")
    e16 = np.zeros((0, 4), BF16)
    softmax((0,), (128,), (e16, e16, np.int64(0), np.int32(0), np.int32(4), np.float32(1), np.int32(1), np.int32(1)))
    with pytest.raises(EmulatorArgumentError, match="8-byte integer"):
        gelu((1,), (256,), (empty, empty, np.int32(0), np.int32(0)))  # an int32 for `long long n`
    with pytest.raises(EmulatorArgumentError, match="4-byte float"):
        softmax((1,), (128,), (e16, e16, np.int64(0), np.int32(0), np.int32(4), 1.0, np.int32(1), np.int32(1)))


def test_layernorm_backward_at_6144_columns_needs_the_opt_in(emulated_module):
    """2 * 6144 floats of dynamic shared memory are exactly 48 KiB, and the kernel's block
    reduction adds 256 bytes of static shared memory: over a device's default limit, so the
    emulator refuses the launch, as a GPU would, until the kernel opts in."""
    C, rows = 6144, 2
    fn = emulated_module.with_schedule("forward").get_function("layernorm_backward_f32")  # a fresh kernel object
    assert fn.shared_size_bytes == 256
    x, dy = randn((rows, C), F32, seed=1), randn((rows, C), F32, seed=2)
    mean, rstd = x.mean(1).astype(np.float32), (1 / x.std(1)).astype(np.float32)
    dx, partial = np.full_like(x, np.nan), np.full((2, 1, C), np.nan, np.float32)
    args = (dx, partial, dy, x, None, mean, rstd, np.int64(rows), np.int32(C))
    with pytest.raises(EmulatorLaunchConfigError, match="256 bytes of static __shared__"):
        fn((1,), (512,), args, shared_mem=2 * C * 4)
    fn.max_dynamic_shared_size_bytes = 2 * C * 4
    fn((1,), (512,), args, shared_mem=2 * C * 4)
    np.testing.assert_allclose(partial[1, 0], dy.sum(0), rtol=1e-5, atol=1e-5)
    assert not np.isnan(dx).any()


# ================================================================================================
# Every kernel, launched; launch shapes within bounds
# ================================================================================================
def test_every_kernel_is_launched_by_its_launcher(backend, k):
    backend.require_bf16()
    xp = backend.xp
    defined = set(entry_points())
    for dtype in DTYPES:
        x = backend.to_device(randn((3, 40), dtype, seed=40))
        targets = xp.asarray(np.array([1, -1, 38]))
        k.gelu_backward(x, k.gelu_forward(x))
        k.bias_gelu_backward(x, k.bias_gelu_forward(x, x[0])[1])
        k.softmax_backward(x, k.softmax_forward(x, 0.5, True), 0.5)
        _, mean, rstd = k.layernorm_forward(x, x[0], x[1])
        k.layernorm_backward(x, x, x[0], mean, rstd, dtype)
        m, se, _, _ = k.ce_shard_forward(x, targets, 39)
        k.ce_shard_backward(x, m, se, targets, 39, 1.0, out=x)
        p = x.reshape(-1).copy()
        k.adamw_update(p, p.copy(), xp.zeros(p.size, np.float32), xp.zeros(p.size, np.float32), p.copy(),
                       **ADAMW_KW)
        y, mask = k.dropout_forward(x, 0.5, 1, 2)
        k.dropout_apply(y, mask, 2.0)
        _, rstd = k.rmsnorm_forward(x, x[0])
        k.residual_rmsnorm_forward(x, x, x[0])
        k.rmsnorm_backward(x, x, x[0], rstd)
        k.swiglu_backward(k.swiglu_forward(x), x)
        cs = backend.to_device(np.ones((3, 8), np.float32))
        k.rotary(x.reshape(1, 3, 5, 8), cs, cs)
        for d, dv in ((64, 64), (128, 128), (192, 128)):
            q = backend.to_device(randn((1, 1, 2, 5, d), dtype, seed=41))
            kk = backend.to_device(randn((1, 1, 5, d), dtype, seed=42))
            v = backend.to_device(randn((1, 1, 5, dv), dtype, seed=43))
            o, lse = k.attention_forward(q, kk, v, 0.1)
            k.attention_backward(o, q, kk, v, o, lse, 0.1)
    k.dropout_mask((5,), 0.5, 1, 2)
    assert set(k.launches) == defined, sorted(defined - set(k.launches))


def entry_points() -> dict[str, str]:
    """Every extern "C" __global__ entry point of kernels/*.cu: {name: 'file.cu'}."""
    return {name: f"{s}.cu" for s in SOURCES for name in kernel_entry_points(KERNELS_DIR / f"{s}.cu")}


def kernels_without_an_emulated_test(defined: dict[str, str], launched_by: dict[str, set[str]]) -> list[str]:
    """'name (file.cu)' for each of `defined` that no test in `launched_by` (kernel name -> node ids
    of the tests that launched it on the emulator) launched, the launch test above not counted (it
    launches every kernel by design, checking no value)."""
    return sorted(f"{name} ({src})" for name, src in defined.items()
                  if not {t for t in launched_by.get(name, ()) if "::test_every_kernel_is_launched_by" not in t})


def test_every_kernel_ran_in_a_test_on_the_emulator(request):
    """Every extern "C" __global__ entry point of kernels/*.cu was launched on the emulator by a test
    of this session (what ran, recorded by the emulator: helpers.LAUNCHED_BY), not only by the launch
    test. Runs last (tests/kernels/conftest.py), after a session that ran every test file here
    unfiltered; and the check names a planted kernel that nothing launched."""
    here = Path(__file__).parent
    items = [item for item in request.session.items if item.path.parent == here]
    if request.config.option.keyword or request.config.option.markexpr or not any(
            "[emulated" in item.nodeid for item in items) or {i.path.name for i in items} != {
            p.name for p in here.glob("test_*.py")}:
        pytest.skip("reads what the whole of tests/kernels launched on the emulator: runs in a session of all of it "
                    "(no -k, no -m, the emulated backend)")
    defined = entry_points()
    missing = kernels_without_an_emulated_test(defined, LAUNCHED_BY)
    assert not missing, "kernels no emulated test launched (test them in tests/kernels/test_<op>.py): " + \
        ", ".join(missing)
    planted = {**defined, "planted_unlaunched_f32": "planted.cu"}
    assert kernels_without_an_emulated_test(planted, LAUNCHED_BY) == ["planted_unlaunched_f32 (planted.cu)"]


def test_the_coverage_check_does_not_count_the_launch_test():
    launched = {"a_f32": {"tests/kernels/test_a.py::test_values[emulated]"},
                "b_f32": {"tests/kernels/test_launchers.py::test_every_kernel_is_launched_by_its_launcher[emulated]"}}
    assert kernels_without_an_emulated_test({"a_f32": "a.cu", "b_f32": "b.cu", "c_f32": "c.cu"}, launched) == [
        "b_f32 (b.cu)", "c_f32 (c.cu)"]


def test_launch_shapes_stay_within_the_kernels_launch_bounds(emulated_module, monkeypatch):
    """The block sizes the launchers pick for short and very long rows: whole warps, within each
    kernel's __launch_bounds__ (which also caps its registers so the launch fits on the GPU). The
    bounds are read from the sources by the emulator; the launches are recorded, not run."""
    seen = []
    monkeypatch.setattr(Launchers, "_launch", lambda self, src, name, grid, block, args, shared_mem=0:
                        seen.append((name, grid, block, shared_mem, args)))
    k = Launchers(lambda name: emulated_module, np)
    for width in (1, 31, 1024, 1025, 4096, 50_257, 300_000):
        for dtype in DTYPES:
            x = np.zeros((2, width), dtype)
            w = np.zeros(width, dtype)
            m = np.zeros(2, np.float32)
            k.softmax_forward(x)
            k.softmax_backward(x, x)
            k.layernorm_forward(x, w, w)
            k.layernorm_backward(x, x, w, m, m, dtype)
            k.rmsnorm_forward(x, w)
            k.rmsnorm_backward(x, x, w, m)
            k.ce_shard_forward(x, np.zeros(2, np.int64), width)
            k.ce_shard_backward(x, m, m, np.zeros(2, np.int64), width, 1.0)
            k.bias_gelu_backward(x, x)
    assert len(seen) > 100
    for name, grid, block, smem, args in seen:
        threads = int(np.prod(block))
        bound = emulated_module.get_function(name).launch_bounds
        assert threads % 32 == 0 and threads <= (bound or 1024), (name, block, bound)
        assert all(1 <= g < 2**31 for g in grid), (name, grid)
        if name.startswith("layernorm_backward"):
            assert smem == block[1] * 2 * 4 * int(args[8]), (name, smem)  # R * 2 * C floats
        if name.startswith("rmsnorm_backward"):
            assert smem == block[1] * 4 * int(args[7]), (name, smem)  # R * C floats


# ================================================================================================
# The benchmark's variants
# ================================================================================================
def test_benchmark_variants_match_the_benchmark_references(backend, k, monkeypatch):
    """The "cuda_kernels" variants cutp/bench/kernel_variants.py registers with `python -m cutp
    bench kernels`, run with the benchmark's own (tiny) inputs and output checks: on the GPU
    through the device's launchers, under the emulator through these."""
    backend.require_bf16()
    xp = backend.xp
    if backend.emulated:
        monkeypatch.setattr(kernel_variants, "_bench_launchers", lambda xp: k)
    variants = {}
    kernel_variants.register_bench_variants(lambda op, name, make: variants.setdefault(op, make))
    assert set(variants) <= set(bench.OPS), sorted(set(variants) - set(bench.OPS))
    for op, make in variants.items():
        spec = bench.OPS[op]
        shape = spec.cases(bench.SIZES["tiny"])[0]
        for dt in (F32, BF16):
            with use_kernels(False):  # the baseline: cutp.ops without the kernels (on NumPy it runs none anyway)
                ref_in = spec.setup(xp, shape, dt, np.random.default_rng(0))
                want = bench._outputs(spec, ref_in, spec.reference(ref_in)())
            got_in = spec.setup(xp, shape, dt, np.random.default_rng(0))
            got = bench._outputs(spec, got_in, make(got_in, xp)())
            err = bench.max_rel_error(want, got)
            assert err <= (1e-4 if dt == F32 else 2e-2), (op, dt, err)
