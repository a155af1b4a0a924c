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


def test_a_broken_mpi_is_reported_not_raised(monkeypatch, capsys):
    """(in this process: mpi4py unimportable, as where its MPI library fails to load)"""
    from cutp import info

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    facts = info.collect()
    assert facts["mpi4py"].startswith("not importable (ModuleNotFoundError: ")
    assert facts["MPI library"].startswith("unusable (ModuleNotFoundError: ") and "MPI standard" not in facts
    assert facts["backend cpu"] == "usable (NumPy + MPI)" and "backend cuda" in facts  # (the rest still reported)
    assert info.main([]) == 0 and "MPI library: unusable (ModuleNotFoundError: " in capsys.readouterr().out


def test_the_package_lists_its_lazy_names():
    import cutp

    names = dir(cutp)
    assert {"init", "Context", "Mesh", "ConfigError", "__version__"} <= set(names) and names == sorted(names)
    assert all(name in names for name in cutp.__all__)


def test_info_says_what_the_cpu_ops_run_on_and_whether_compare_torch_can_run(monkeypatch):
    """(review F11) The compiled CPU kernels (a large part of the CPU's speed), the BLAS and its
    threads, and torch and transformers for compare-torch, each with why not."""
    from cutp import info
    from cutp.ops import compiled
    from cutp.runtime.threads import blas_library

    facts = info.collect()
    assert facts["cpu kernels"] == compiled.describe() or facts["cpu kernels"].startswith("off: the build by ")
    lib = blas_library()
    assert facts["BLAS"].startswith("not found" if lib is None else f"{lib.path.rsplit('/', 1)[-1]}, {lib.get()} thread(s)")
    assert "torch" in facts and "transformers" in facts and facts["CUTP_KERNELS"]
    monkeypatch.setenv("CUTP_CPU_KERNELS", "0")
    facts = info.collect()
    assert facts["cpu kernels"] == "off (CUTP_CPU_KERNELS=0): the CPU ops run their NumPy code"
    assert facts["CUTP_CPU_KERNELS"] == "0"
    monkeypatch.delenv("CUTP_CPU_KERNELS")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert info.collect()["cpu kernels"].startswith("off: no C compiler (no-such-compiler-here) found")
    monkeypatch.setitem(sys.modules, "torch", None)
    assert info.collect()["torch"].startswith("not importable (ModuleNotFoundError")
