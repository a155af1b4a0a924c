"""Test-session set-up shared by every test module.

Caches (CuPy's kernel cache, our emulated-kernel builds) go to a temporary directory of
this session, so tests never write into the user's home.
"""
import os
import sys
import tempfile

_SESSION_TMP = tempfile.mkdtemp(prefix="cutp-tests-")


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(_SESSION_TMP, ignore_errors=True)

os.environ.setdefault("CUPY_CACHE_DIR", os.path.join(_SESSION_TMP, "cupy-cache"))
os.environ.setdefault("CUTP_CACHE_DIR", os.path.join(_SESSION_TMP, "cutp-cache"))
os.environ.setdefault("MPLCONFIGDIR", os.path.join(_SESSION_TMP, "mpl"))
# Ranks share the machine's cores; one BLAS thread per process keeps multi-rank tests fast.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.transformers_compat import hide_cutp_kernels_from_transformers  # noqa: E402

hide_cutp_kernels_from_transformers()


def pytest_collection_modifyitems(session, config, items):
    """When the session runs the nvcc compile test, its compiles start in the background now:
    pytest runs on one core, and the other compiles while the early tests run. The compiles fill
    the resource cache (cutp.kernels.resources, this session's CUTP_CACHE_DIR), which the test
    then reads; a source that fails is not cached, so the test compiles it again and raises with
    nvcc's log."""
    if not any(item.name == "test_sources_compile_with_nvcc" for item in items):
        return
    import threading

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
