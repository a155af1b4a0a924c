import subprocess
import sys

from cutp.runtime import backend


def test_python_m_cutp_info_reports_versions_and_backends():
    out = subprocess.run([sys.executable, "-m", "cutp", "info"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for key in ("cutp:", "python:", "numpy:", "mpi4py:", "MPI library:", "cupy:", "NCCL:", "backend cpu:", "backend cuda:"):
        assert key in text, f"{key} missing from\n{text}"
    assert "MPICH" in text or "Open MPI" in text or "Intel" in text
    if backend.cuda_device_count() == 0:
        assert "backend cuda: not usable" in text
    else:
        assert "GPU 0:" in text


def test_unknown_subcommand_prints_usage():
    out = subprocess.run([sys.executable, "-m", "cutp", "nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr
