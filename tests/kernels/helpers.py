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


def gpu_sized(*values):
    """A parameter set run on the cuda backend only: the emulated backend reports it skipped."""
    return pytest.param(*values, marks=pytest.mark.cuda_only(GPU_SIZED_REASON))


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
