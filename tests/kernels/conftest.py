"""The kernel tests' backends: each test that takes ``backend`` (or ``k``, ``ks``) runs once per backend.

* ``emulated``: the kernels under tests/cuda_emu on the CPU, with NumPy arrays (every CI run);
  skipped, with the reason, only when the C++ compiler the emulator needs is missing.
* ``cuda``: the kernels on the GPU through CuPy; skipped, with the reason, without CuPy or a GPU.

``$CUTP_KERNEL_BACKENDS`` (comma-separated, default ``emulated,cuda``) selects the backends;
``make gpu-check`` runs ``CUTP_KERNEL_BACKENDS=cuda pytest tests/kernels``.

Fixtures: ``backend`` (a ``helpers.KernelBackend``); ``k``, new Launchers on it; ``ks``, new
Launchers under each of the emulator's thread schedules (once on a GPU, whose thread order is
its own), for the kernels with barriers or shared memory; ``emulated_module``, the emulated
program of every kernel source, for tests of the emulated launches themselves.

A parameter set marked ``cuda_only`` (``helpers.gpu_sized``) is skipped on the emulated backend
with the marker's reason; a test function marked ``cuda_only`` runs on the cuda backend only. A
bfloat16 case is skipped, with the reason, on a GPU whose CuPy has no bfloat16 arrays.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from cutp.kernels import SOURCES
from cutp.ops import compiled
from cutp.runtime.backend import cupy_status
from tests.cuda_emu import KERNELS_DIR, LAUNCH_COUNTS, EmulatedModule

from .helpers import BF16, DEVICE_SCHEDULE, EMULATED_SCHEDULES, LAUNCHED_BY, cuda_backend, emulated_backend

BACKENDS = ("emulated", "cuda")
SELECTED = tuple(b.strip() for b in os.environ.get("CUTP_KERNEL_BACKENDS", ",".join(BACKENDS)).split(",")
                 if b.strip())
if not SELECTED or not set(SELECTED) <= set(BACKENDS):
    raise pytest.UsageError(f"CUTP_KERNEL_BACKENDS={os.environ.get('CUTP_KERNEL_BACKENDS')!r}: a comma-separated "
                            f"choice of {BACKENDS}")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_only(reason): runs on the cuda kernel backend only (tests/kernels)")


LAST = "test_every_kernel_ran_in_a_test_on_the_emulator"  # test_launchers.py: reads what every other test launched


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: getattr(item, "originalname", item.name) == LAST)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _note_emulated_launches(request):
    """Which emulated kernels each test launched (helpers.LAUNCHED_BY)."""
    before = dict(LAUNCH_COUNTS)
    yield
    for name, n in LAUNCH_COUNTS.items():
        if n != before.get(name, 0):
            LAUNCHED_BY.setdefault(name, set()).add(request.node.nodeid)


def pytest_generate_tests(metafunc):
    if "backend" not in metafunc.fixturenames:
        return
    names = SELECTED
    if metafunc.definition.get_closest_marker("cuda_only") is not None:
        names = tuple(n for n in names if n == "cuda")
    if "schedule" in metafunc.fixturenames:
        cases = [pytest.param(name, schedule, id=f"emulated-{schedule[0]}")
                 for name in names if name == "emulated" for schedule in EMULATED_SCHEDULES]
        cases += [pytest.param(name, DEVICE_SCHEDULE, id=name) for name in names if name != "emulated"]
        metafunc.parametrize(("backend", "schedule"), cases, indirect=True)
    else:
        metafunc.parametrize("backend", names, indirect=True)


@pytest.fixture(scope="session")
def emulated_module() -> EmulatedModule:
    """Every kernel source as one emulated program (one g++ run, ~2 s); on a GPU each source is
    its own RawModule."""
    cxx = os.environ.get("CUTP_EMU_CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"the CUDA emulator needs a C++ compiler (g++ >= 12, or $CUTP_EMU_CXX): {cxx!r} is not on PATH")
    # $CUTP_EMU_KERNEL_SOURCES (comma-separated names of SOURCES) builds only those, for runs of one
    # op's tests (tools/mutate_kernels.py builds one mutant per run: a quarter of the g++ time)
    only = [s.strip() for s in os.environ.get("CUTP_EMU_KERNEL_SOURCES", "").split(",") if s.strip()]
    if not set(only) <= set(SOURCES):
        raise pytest.UsageError(f"CUTP_EMU_KERNEL_SOURCES={only}: names of {SOURCES}")
    return EmulatedModule(path=[KERNELS_DIR / f"{s}.cu" for s in (only or SOURCES)])


@pytest.fixture(scope="session")
def emulated_kernel_backend(emulated_module):
    return emulated_backend(emulated_module)


@pytest.fixture(scope="session")
def cuda_kernel_backend():
    usable, why = cupy_status()
    if not usable:
        pytest.skip(f"the cuda backend needs an NVIDIA GPU and CuPy: {why}. The same kernels and launchers run on "
                    "the emulated backend")
    return cuda_backend()


@pytest.fixture
def backend(request):
    # Looked up by name so that a run of one backend never builds the other.
    return request.getfixturevalue(f"{request.param}_kernel_backend")


@pytest.fixture
def schedule(request) -> tuple[str, int]:
    return request.param


@pytest.fixture
def k(backend):
    return backend.launchers()


@pytest.fixture
def ks(backend, schedule):
    return backend.launchers(*schedule)


@pytest.fixture(autouse=True)
def _skip_what_the_backend_cannot_run(request):
    if "backend" not in request.fixturenames:
        return
    backend = request.getfixturevalue("backend")
    marker = request.node.get_closest_marker("cuda_only")
    if marker is not None and backend.emulated:
        pytest.skip(marker.args[0] if marker.args else "runs on the cuda backend only")
    callspec = getattr(request.node, "callspec", None)
    dtype = callspec.params.get("dtype") if callspec is not None else None
    if dtype is not None and np.dtype(dtype) == BF16:
        backend.require_bf16()


@pytest.fixture(autouse=True)
def _references_run_the_plain_numpy_code(monkeypatch):
    """The CUDA kernels are checked against the plain NumPy references of cutp.ops (llm.c's habit),
    not against the compiled CPU kernels, which sum in orders of their own (tests/ops/test_cpu_kernels
    checks those against the same references)."""
    monkeypatch.setattr(compiled, "library", lambda *_, **__: None)
