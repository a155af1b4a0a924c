"""The device-path tests (marker ``device_path``): cutp's GPU code path run on the CPU through the
CuPy stand-in (tests/device_path/standin).

``make test`` runs the two representative ones (marked ``device_path_default`` too); the rest
run with ``pytest -m device_path`` (``make test-device``) and are reported skipped otherwise,
with that reason. The emulated kernels are built once per session, in this process, before any
MPI job (so that ranks load the build instead of compiling it side by side): the same build as
the kernel tests' (tests/kernels/conftest.py), shared through the session's cache directory.
"""
from __future__ import annotations

import os
import shutil

import pytest

FULL_REASON = "a device-path configuration run by `make test-device` (pytest -m device_path)"


def pytest_configure(config):
    config.addinivalue_line("markers", "device_path_default: a device-path test that `make test` runs too")


def pytest_collection_modifyitems(config, items):
    if "device_path" in (config.getoption("markexpr", "") or ""):
        return
    for item in items:
        if item.get_closest_marker("device_path") and not item.get_closest_marker("device_path_default"):
            item.add_marker(pytest.mark.skip(reason=FULL_REASON))


@pytest.fixture(scope="session")
def emulated_kernels():
    """The emulator's build of every kernel source (what the stand-in's RawModule runs); on a
    real GPU (CUTP_DEVICE_PATH=gpu) NVRTC builds them instead."""
    from tests.device_path.harness import ON_GPU

    if ON_GPU:
        return None
    cxx = os.environ.get("CUTP_EMU_CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"the device path runs its kernels in the CUDA emulator, which needs a C++ compiler (g++ >= 12, or "
                    f"$CUTP_EMU_CXX): {cxx!r} is not on PATH")
    from tests.device_path.standin.cuda import _kernels_module

    return _kernels_module()
