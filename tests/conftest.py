"""Test-session set-up shared by every test module.

Caches (CuPy's kernel cache, our emulated-kernel builds) go to a temporary directory of
this session, so tests never write into the user's home.
"""
import contextlib
import os
import shutil
import sys
import tempfile
import threading

import pytest

_SESSION_TMP = tempfile.mkdtemp(prefix="cutp-tests-")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)

os.environ.setdefault("CUPY_CACHE_DIR", os.path.join(_SESSION_TMP, "cupy-cache"))
os.environ.setdefault("CUTP_CACHE_DIR", os.path.join(_SESSION_TMP, "cutp-cache"))
os.environ.setdefault("MPLCONFIGDIR", os.path.join(_SESSION_TMP, "mpl"))
# Where the environment says PYTHONDONTWRITEBYTECODE, every process the tests start (each MPI
# rank, each CLI run) would compile cutp's ~150 modules from source again (~0.3 CPU-s a process,
# some thousand processes a session): they keep their bytecode in this session's directory
# instead, so still nothing is written into the checkout.
if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(_SESSION_TMP, "pycache")
# Ranks share the machine's cores; one BLAS thread per process keeps multi-rank tests fast.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.transformers_compat import hide_cutp_kernels_from_transformers  # noqa: E402

hide_cutp_kernels_from_transformers()


def _every_kernel():
    from cutp.kernels import SOURCES
    from tests.cuda_emu import KERNELS_DIR

    # what tests/kernels/conftest.py's emulated_module loads: $CUTP_EMU_KERNEL_SOURCES where set
    only = [s.strip() for s in os.environ.get("CUTP_EMU_KERNEL_SOURCES", "").split(",") if s.strip()]
    return dict(path=[KERNELS_DIR / f"{s}.cu" for s in (only or SOURCES)])


def _attention(**kwargs):
    from tests.cuda_emu import KERNELS_DIR

    return dict(path=[KERNELS_DIR / "attention.cu"], **kwargs)


# {test file (or directory/): the emulated builds its tests load, as keyword arguments of
# tests.cuda_emu.prebuild, from the file's module}: what the warm-up below builds.
_EMULATOR_BUILDS = {
    "bench/test_suites.py": lambda m: [_attention(checks=False, cxx_flags=("-O1",))],
    "cuda_emu/test_alignment.py": lambda m: [dict(code=m.CODE)],
    "cuda_emu/test_back_to_back_reductions.py": lambda m: [dict(code=m.CODE), dict(code=m.CODE, checks=False)],
    "cuda_emu/test_emulator.py": lambda m: [dict(path=m.SAMPLES), dict(path=m.BROKEN),
                                            dict(path=m.BROKEN, checks=False), dict(path=m.SAMPLES, checks=False)],
    "cuda_emu/test_wmma.py": lambda m: [dict(code=m.WMMA_KERNEL)],
    "device_path/test_training.py": lambda m: [_every_kernel()],
    "kernel_build/test_resources.py": lambda m: [_every_kernel()],
    "kernels/": lambda m: [_every_kernel()],
    "kernels/test_attention.py": lambda m: [_attention(checks=False)],
}


@pytest.hookimpl(trylast=True)  # after the directories' conftests have marked what they skip
def pytest_collection_modifyitems(session, config, items):
    """The CUDA emulator's g++ builds that the session's tests load (tests/cuda_emu: ~2-8 s each)
    start in a background thread now, in the order the tests first need them, at low priority:
    they use the core a single-process test leaves idle, and are in the build cache
    (tests/cuda_emu, this session's CUTP_CACHE_DIR) when their tests come. A test that comes
    first builds its own; a build in progress is waited for, not repeated; a failed build is not
    cached, so the test builds again and reports g++'s message. Set CUTP_TEST_WARM_UP=0 to skip.
    SIGTERM / SIGHUP (`timeout`, a cancelled job) stop the session's compiles before it ends."""
    from tests.cuda_emu import stop_compiles_on_signals

    stop_compiles_on_signals()
    _warm_up_emulator_builds(items)
    _warm_up_nvcc(items)


def _warm_up_emulator_builds(items):
    if os.environ.get("CUTP_TEST_WARM_UP", "1") == "0" or shutil.which(os.environ.get("CUTP_EMU_CXX", "g++")) is None:
        return
    table = _EMULATOR_BUILDS
    first = {}  # test file -> (index of its first test to run, its module)
    for i, item in enumerate(items):
        if item.get_closest_marker("skip") or item.get_closest_marker("skipif"):
            continue
        rel = os.path.relpath(str(item.path), os.path.join(_ROOT, "tests")).replace(os.sep, "/")
        for key in (rel, rel.split("/")[0] + "/"):
            if key in table and key not in first:
                first[key] = (i, getattr(item, "module", None))
    if not first:
        return
    builds = []
    for key, (_, module) in sorted(first.items(), key=lambda kv: kv[1][0]):
        try:
            builds += table[key](module)
        except Exception:  # a test file renamed its sources, say: its tests build them
            continue

    def warm():
        from tests.cuda_emu import prebuild

        with contextlib.suppress(OSError):  # low priority for this thread and the g++ runs it starts
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        for kwargs in builds:
            try:
                prebuild(**kwargs)
            except Exception:  # (the test that loads it reports it)
                pass

    threading.Thread(target=warm, name="emulator-warm-up", daemon=True).start()


def _warm_up_nvcc(items):
    """When the session runs the nvcc compile test, its compiles start in the background now:
    pytest runs on one core, and the other compiles while the early tests run. The compiles fill
    the resource cache (cutp.kernels.resources, this session's CUTP_CACHE_DIR), which the test
    then reads; a source that fails is not cached, so the test compiles it again and raises with
    nvcc's log."""
    if not any(item.name == "test_sources_compile_with_nvcc" for item in items):
        return
    from cutp.kernels import resources

    nvcc = resources.find_nvcc()
    if nvcc is None:
        return

    def warm():
        try:
            version = resources._nvcc_version(nvcc)
            for source in resources.SOURCES:
                resources.compile_source(source, nvcc, resources.ARCHS, version)
        except Exception:  # (the test reports it)
            pass

    threading.Thread(target=warm, name="nvcc-warm-up", daemon=True).start()
