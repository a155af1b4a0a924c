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
