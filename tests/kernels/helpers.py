"""What the kernel tests share: the backends the kernels run on, random inputs, comparisons.

A :class:`KernelBackend` is where a test runs ``cutp.kernels.Launchers``:

* ``emulated``: ``tests.cuda_emu.EmulatedModule`` (the kernels compiled by g++, run on the CPU)
  standing in for ``cupy.RawModule``, NumPy arrays standing in for CuPy arrays. The same host
  code as on a GPU (argument checks, grid/block/shared-memory sizing, two-pass reductions) runs
  in every CI run, under several thread schedules.
* ``cuda``: ``cupy.RawModule`` compiled by NVRTC, CuPy arrays, on the GPU (``make gpu-check``).

References are ``cutp.ops`` on NumPy arrays (host copies of the inputs).

Every output a launcher allocates is poisoned before the launch (:class:`PoisonedAllocations`,
the array module of every Launchers a backend hands out): floats are NaN, integers a sentinel,
bools a byte that is neither 0 nor 1. A kernel that skips part of its writes leaves poison,
which fails the comparison with the reference (``KernelBackend.host`` refuses a bool array
holding poison bytes, since NumPy compares such bools as True).
"""
from __future__ import annotations

import functools
from typing import Callable

import ml_dtypes
import numpy as np
import pytest

from cutp.kernels import Launchers
from cutp.kernels.runtime import cupy_module_loader
from cutp.runtime.backend import to_numpy

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
DTYPES = [F32, BF16]
DT_IDS = ["f32", "bf16"]

# The emulator's thread orders between barriers (tests.cuda_emu.SCHEDULES), with their seeds: a
# missing barrier gives a wrong result under at least one of them (and the emulator's race
# detector reports it under any). "warp-reverse" runs one warp at a time, last warp first, each
# as far as it gets (into the next phase of a kernel, as a warp may run ahead on a GPU); lanes
# in reverse. A GPU has its own order.
EMULATED_SCHEDULES = (("forward", 0), ("warp-reverse", 0), ("random", 7))
DEVICE_SCHEDULE = ("device", 0)

# The AdamW hyper-parameters of the kernel tests.
ADAMW_KW = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7, grad_scale=0.5)

GPU_SIZED_REASON = ("GPU-sized case: seconds of CPU time under the emulator; the emulated backend runs the same "
                    "code paths at the smaller sizes of this test")


# kernel name -> node ids of the tests that launched it on the emulator in this session (filled by
# tests/kernels/conftest.py; read by test_launchers.py's test_every_kernel_ran_in_a_test_on_the_emulator).
LAUNCHED_BY: dict[str, set[str]] = {}


def gpu_sized(*values, id=None):  # noqa: A002 (pytest.param's name)
    """A parameter set run on the cuda backend only: the emulated backend reports it skipped."""
    return pytest.param(*values, marks=pytest.mark.cuda_only(GPU_SIZED_REASON), id=id)


# The poison of unwritten outputs, the emulator's shared-memory pattern (tests/cuda_emu): 0xffa5 in
# every 16 bits (NaN as float32 and bfloat16, -5898331 as int32, negative as int64), 0xa5 in a byte.
POISON16 = 0xFFA5
POISON8 = 0xA5


def poison(a):
    """Fills array `a` (NumPy or CuPy, contiguous) with the poison pattern in place; returns it."""
    if a.size:
        if a.itemsize == 1:
            a.view(np.uint8).fill(POISON8)
        else:
            a.view(np.uint16).fill(POISON16)
    return a


def is_poison(a) -> np.ndarray:
    """Per element of host array `a`: whether it still holds the poison pattern."""
    a = np.ascontiguousarray(to_numpy(a))
    if a.itemsize == 1:
        return a.view(np.uint8) == POISON8
    return (a.view(np.uint16).reshape(a.shape + (a.itemsize // 2,)) == POISON16).all(axis=-1)


class PoisonedAllocations:
    """An array module (numpy or cupy) whose ``empty`` and ``empty_like`` return poisoned arrays,
    everything else passing through: the ``xp`` of every Launchers the tests use, so that every
    output and scratch buffer a launcher allocates (``xp.empty``) starts as poison and no test
    can forget to poison one."""

    def __init__(self, xp):
        self._xp = xp
        self.__name__ = xp.__name__
        self.allocated = 0  # arrays poisoned so far (tests of the mechanism check it)

    def __getattr__(self, name):
        return getattr(self._xp, name)

    def __repr__(self):
        return f"<poisoned allocations of {self._xp.__name__}>"

    def empty(self, *args, **kwargs):
        self.allocated += 1
        return poison(self._xp.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        self.allocated += 1
        return poison(self._xp.empty_like(*args, **kwargs))


class KernelBackend:
    """The kernels on one backend: its array module, fresh Launchers, device <-> host copies.

    name: "emulated" or "cuda". xp: numpy or cupy. device: the cutp device whose arrays are
    xp's ("cpu" for the emulated kernels on NumPy arrays). load(schedule, seed): the module
    loader of a Launchers (the schedule means nothing on a GPU). bf16_reason: why this backend
    has no bfloat16 arrays, or "" when it has them.
    """

    def __init__(self, name: str, xp, device: str, load: Callable[[str, int], Callable], bf16_reason: str = ""):
        self.name = name
        self.xp = xp
        self.device = device
        self._load = load
        self.bf16_reason = bf16_reason

    def __repr__(self):
        return f"<KernelBackend {self.name}>"

    @property
    def emulated(self) -> bool:
        return self.name == "emulated"

    def launchers(self, schedule: str = "forward", seed: int = 0) -> Launchers:
        """New Launchers (launch counters at zero) over this backend's compiled modules."""
        what = f"emulated ({schedule})" if self.emulated else "cupy (tests)"
        return Launchers(self._load(schedule, seed), PoisonedAllocations(self.xp), description=what)

    def launchers_for_determinism(self) -> list[Launchers]:
        """Launchers whose results must agree bit for bit: one per thread schedule under the
        emulator; on a GPU the same device twice (two runs)."""
        if self.emulated:
            return [self.launchers(s, seed) for s, seed in EMULATED_SCHEDULES]
        return [self.launchers(), self.launchers()]

    def to_device(self, a):
        """A copy of host array `a` in this backend's array module (always a copy, so in-place
        kernels never write into the host reference's inputs)."""
        return self.xp.array(np.asarray(a), copy=True)

    @staticmethod
    def host(a):
        """Host copy of a device array. A bool array holding a poison byte (an element no kernel
        wrote) raises: NumPy would compare it as True."""
        if a is None:
            return None
        a = to_numpy(a)
        if a.dtype == np.bool_ and a.size and bool(is_poison(a).any()):
            raise AssertionError(f"bool array of shape {a.shape}: {int(is_poison(a).sum())} elements never written "
                                 "(poison bytes)")
        return a

    def address(self, a) -> int:
        return a.ctypes.data if self.emulated else a.data.ptr

    def tolerance(self, *, emulated, cuda):
        """The bound of a comparison with the NumPy reference. The GPU's may be wider: its expf,
        tanhf, ... are not glibc's, and NVRTC need not contract the same multiply-adds into FMAs
        as g++ does for the emulator (kernels/README.md, "What the emulation does NOT model")."""
        return emulated if self.emulated else cuda

    def require_bf16(self) -> None:
        if self.bf16_reason:
            pytest.skip(self.bf16_reason)


def emulated_backend(module) -> KernelBackend:
    """The emulated backend over `module`, an EmulatedModule of every kernel source."""
    def load(schedule, seed):
        mod = module.with_schedule(schedule, seed)
        return lambda name: mod

    return KernelBackend("emulated", np, "cpu", load)


def cuda_backend() -> KernelBackend:
    """The cuda backend of the current device: its RawModules built once for all tests."""
    import cupy  # optional dependency: only a GPU machine has it

    load_module = functools.lru_cache(maxsize=None)(cupy_module_loader())
    try:
        ok = bool((cupy.asarray(np.ones(3, BF16)) * 2).get().astype(np.float32).sum() == 6)
    except Exception:
        ok = False
    reason = "" if ok else ("this CuPy has no bfloat16 arrays (CuPy >= 14 with ml_dtypes has); the bf16 kernels are "
                            "covered by the emulated backend")
    return KernelBackend("cuda", cupy, "cuda", lambda schedule, seed: load_module, reason)


def rng(seed=0):
    return np.random.default_rng(seed)


def randn(shape, dtype, seed=0, scale=1.0):
    """Host array of normal values, drawn in float32 and rounded to `dtype`."""
    return (rng(seed).standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def close(got, want, dtype, rtol=None, atol=None):
    """Same shape and dtype, and within tolerance: float32 ~1e-5 relative by default; bf16
    within ~2 bf16 ulps (the reference ran on the same bf16 inputs). Device arrays are copied
    to the host first. An element of `got` holding the poison pattern (never written) fails,
    even where the reference is NaN."""
    if dtype == BF16:
        rtol = 2e-2 if rtol is None else rtol
        atol = 1e-3 if atol is None else atol
    else:
        rtol = 1e-5 if rtol is None else rtol
        atol = 1e-6 if atol is None else atol
    got = to_numpy(got)
    want = to_numpy(want)
    unwritten = is_poison(got)
    assert not unwritten.any(), (f"{int(unwritten.sum())} of {got.size} elements still hold the poison of an "
                                 f"unwritten output, first at {np.argwhere(unwritten)[0].tolist()}")
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)


def bits(a):
    """The bit patterns of a float32 / bf16 / bool array, for bit-for-bit comparisons."""
    a = to_numpy(a)
    return a.view(np.uint16 if a.dtype == BF16 else np.uint32 if a.itemsize == 4 else np.uint8)


class RecordingAllocations:
    """NumPy standing in for CuPy, recording the bytes of every array a launcher allocates."""

    def __init__(self):
        self.nbytes: list[int] = []

    def __getattr__(self, name):
        return getattr(np, name)

    def empty(self, *args, **kwargs):
        a = np.empty(*args, **kwargs)
        self.nbytes.append(a.nbytes)
        return a

    def asarray(self, a, *args, **kwargs):  # a host-to-device copy on a GPU: a new allocation
        a = np.array(a, *args, **kwargs)
        self.nbytes.append(a.nbytes)
        return a

    ascontiguousarray = asarray  # (of host position ids: a copy to the device as well)


# ------------------------------------------------------------------------------------------------
# Element-wise bounds (issue 42): column sums against the correctly rounded sum, float32 formulas
# in ulps of their operations, and the widths that take each vector path.
# ------------------------------------------------------------------------------------------------
# Row widths that take each path of a bf16 kernel (8 bf16 to a 128-bit pack, 4 floats): 12 and 20
# are 4 mod 8 (whole float32 packs, a half pack at each bf16 row's end: a kernel that sizes its
# bf16 chunks as float32's passes every float32 test and fails these), 13 is odd (the element path).
BF16_PATH_WIDTHS = (12, 20, 13)


def ulp(a, dtype) -> np.ndarray:
    """The spacing of `dtype` (float32 or bfloat16) at each |a| (float64; normal numbers' spacing
    below the smallest normal)."""
    bits_ = 8 if np.dtype(dtype) == BF16 else 24
    _, e = np.frexp(np.maximum(np.abs(np.asarray(a, np.float64)), np.finfo(np.float32).tiny))
    return np.ldexp(1.0, e - bits_)


def assert_correctly_rounded_column_sums(got, terms, dtype, term_error: float = 0.0):
    """Each column sum `got` [C] (in `dtype`, added in float32 and rounded once) of `terms`
    [rows, C] (float64, what the kernel adds) is the correctly rounded exact sum, element by
    element: within half an ulp of `dtype` of it, plus the float32 additions' own error bound
    (rows * 2^-24 * sum |terms|) and `term_error` * sum |terms| (terms the kernel computes in
    float32 with an error the test cannot reproduce). A sum kept in 16 bits, or rounded twice,
    is off by more than half an ulp."""
    got = to_numpy(got)
    assert got.dtype == dtype, (got.dtype, dtype)
    exact = terms.sum(axis=0)
    mag = np.abs(terms).sum(axis=0)
    allowed = 0.5 * ulp(exact, dtype) + (terms.shape[0] * 2.0 ** -24 + term_error) * mag + 2.0 ** -149
    err = np.abs(got.astype(np.float64) - exact)
    bad = np.flatnonzero(err > allowed)
    assert not bad.size, (f"{bad.size} of {got.size} column sums are not the correctly rounded sum; column "
                          f"{bad[0]}: got {float(got[bad[0]])!r}, exact {exact[bad[0]]!r}, off by "
                          f"{err[bad[0]] / ulp(exact[bad[0]], dtype):.2f} ulp (allowed "
                          f"{allowed[bad[0]] / ulp(exact[bad[0]], dtype):.2f})")


# A CUDA function's maximum error in ulps (CUDA C++ Programming Guide, "Single-precision
# mathematical functions"; glibc's, under the emulator, are within these).
CUDA_ULPS = {"expf": 2, "tanhf": 2, "erfcf": 4}


class _Sites:
    """The rounding sites of a float32 formula evaluated in float64: `r(v, ulps)` marks an
    operation's result; the one numbered `moved` is moved by `ulps` ulps (relative 2^-23 each)."""

    def __init__(self, moved=-1):
        self.moved = moved
        self.n = 0

    def __call__(self, v, ulps=0.5):
        i = self.n
        self.n += 1
        return v * (1.0 + ulps * 2.0 ** -23) if i == self.moved else v


def float32_formula_bound(formula, *inputs):
    """(exact, bound): a float32 kernel formula `formula(r, *inputs)` (float64 arrays, every
    operation's result wrapped in r(value, ulps): 0.5 for a correctly rounded one, CUDA_ULPS for a
    function) evaluated exactly, and element by element the first-order bound of the float32
    evaluation's error: the sum over operations of the change in the result when that operation
    alone is off by its bound (cancellations included, so the bound holds where a relative one
    cannot). `formula` may return a tuple of outputs: then tuples of exacts and bounds."""
    r = _Sites()
    exact = formula(r, *inputs)
    single = not isinstance(exact, tuple)
    exact = (exact,) if single else exact
    bound = [np.zeros_like(e) for e in exact]
    for i in range(r.n):
        moved = formula(_Sites(i), *inputs)
        for b, e, m in zip(bound, exact, (moved,) if single else moved):
            b += np.abs(m - e)
    return (exact[0], bound[0]) if single else (exact, tuple(bound))


def assert_within_float32_bound(got, exact, bound, what: str):
    """float32 `got` within 1.25 x the first-order `bound` (second-order terms) plus half an ulp of
    the exact result (the final rounding), element by element, and never closer than 2^-120 in
    absolute (intermediates in float32's subnormal range lose relative precision the first-order
    bound does not model); the message gives the worst element's error and allowance in ulps."""
    got = to_numpy(got)
    assert got.dtype == np.float32, got.dtype
    unwritten = is_poison(got)
    assert not unwritten.any(), f"{what}: {int(unwritten.sum())} elements never written"
    got, exact, bound = (np.ravel(a).astype(np.float64) for a in (got, exact, bound))
    u = ulp(exact, np.float32)
    err = np.abs(got - exact)
    allowed = 1.25 * bound + 0.5 * u + 2.0 ** -120
    worst = int(np.argmax(err / allowed))
    assert err[worst] <= allowed[worst], (
        f"{what}: {int((err > allowed).sum())} of {got.size} elements out of bound; worst: got {got[worst]!r}, "
        f"exact {exact[worst]!r}, off by {err[worst] / u[worst]:.1f} ulp, allowed {allowed[worst] / u[worst]:.1f}")


def assert_within_ulps(got, exact, ulps: float, what: str, floor: float = 0.0):
    """float32 `got` within `ulps` float32 ulps of the float64 `exact` (plus `floor` in absolute),
    element by element: the bound of a formula whose every rounding the test reproduces but a
    function's (expf: 2 ulps), which a fast-math intrinsic (__expf: 2 + 1.16 |x| ulps) exceeds."""
    got = np.ravel(to_numpy(got)).astype(np.float64)
    exact = np.ravel(np.asarray(exact, np.float64))
    err = np.abs(got - exact)
    bad = err > ulps * ulp(exact, np.float32) + floor
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {got.size} elements off by more than {ulps} ulps, e.g. "
                           f"{got[bad][:3]} vs {exact[bad][:3]}")


def wide_range(n_linear: int = 800, lo: float = -40.0, hi: float = 40.0) -> np.ndarray:
    """float32 inputs over a wide range: a linear sweep of [lo, hi] and +-logspace(1e-5 .. 30)."""
    logs = np.logspace(-5, np.log10(30.0), 200)
    return np.concatenate([np.linspace(lo, hi, n_linear), logs, -logs]).astype(np.float32)


# The online softmax's rescale (softmax.cu and cross_entropy.cu's forward): a thread multiplies its
# running sum s by expf(m_old - m_new) when a chunk raises its max. A fast exp there (__expf: 2 +
# floor(1.16 |x|) ulps) errs by more than expf's 2 ulps only for a large rise a, and weighs on the
# row's sum by the rescaled part's share, s e^-a / S: separable only on rows where each thread
# holds many more than e^a terms below its later max. RESCALE_RISE = 5.5452 (just under 8 ln 2):
# e^-a lies just above 2^-8, where one ulp is 2^-23 of the value (the most), and the emulator's
# __expf model draws +8 ulps, its documented maximum, at -a (tests/cuda_emu/cuda_emu.h): a kernel
# with __expf there is off by ~0.8 x 8 x 2^-23 of the sum on late_max_row(T, 1024), which the bound
# of the real kernel (expf's 2 ulps on the same share: ~7 x 2^-24 in all) does not allow.
RESCALE_RISE = np.float32(5.545175552368164)


def late_max_row(threads: int, zeros_per_thread: int, out=lambda r, s: s):
    """(row, exact, bound): a float32 row over which each of `threads` threads (chunks of 4 floats
    dealt round-robin, as the block-per-row kernels read them) reads `zeros_per_thread` zeros, then
    a last chunk [a, -inf, -inf, -inf] (a = RESCALE_RISE), so that every thread's running max rises
    from 0 to a once, rescaling its sum n = zeros_per_thread by expf(-a); and `out(r, S)` (a float32
    formula of the row's sum S = sum exp(x - a), rounding sites r as float32_formula_bound's) exact
    with the first-order bound of its float32 evaluation. The kernel's S: per thread
    s = (n * expf(-a)) + 1 (n ones summed exactly, expf(0) = 1 and expf(-inf) = 0 exactly by CUDA's
    math API), then the threads' equal sums added pairwise (exact)."""
    p = 4
    row = np.zeros(threads * p * (zeros_per_thread // p + 1), np.float32)
    tail = row[-threads * p:]
    tail[:] = -np.inf
    tail[::p] = RESCALE_RISE

    def formula(r, e):
        return out(r, threads * r(r(zeros_per_thread * r(e, CUDA_ULPS["expf"])) + 1.0))

    exact, bound = float32_formula_bound(formula, np.exp(-np.array([RESCALE_RISE], np.float64)))
    return row, exact, bound
