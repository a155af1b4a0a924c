"""The coverage shim (tests/device_path/shim/sitecustomize.py) of `make coverage`: in a process
that measures, cutp's abort paths save the data before MPI_Abort, also where coverage itself
started the measurement before any sitecustomize (coverage 7.10+ installs a .pth that does: the
shim's process_startup() then returned None and nothing was wrapped, so every multi-rank failure
path counted as never executed)."""
import os
import subprocess
import sys

import pytest

from tests.mpirun import ROOT

SHIM = os.path.join(ROOT, "tests", "device_path", "shim")


def test_a_measured_process_saves_before_cutp_aborts_the_job(tmp_path):
    pytest.importorskip("coverage", reason="make coverage's measurement needs the coverage package")
    ini = tmp_path / "coverage.ini"
    ini.write_text(f"[run]\nparallel = true\ndata_file = {tmp_path}/.coverage\n")
    env = dict(os.environ, COVERAGE_PROCESS_START=str(ini), PYTHONPATH=os.pathsep.join((SHIM, ROOT)))
    code = ("import coverage, cutp.runtime.abort as a, cutp.runtime.failure as f\n"
            "print(coverage.Coverage.current() is not None, hasattr(a.abort_job, '__wrapped__'),\n"
            "      hasattr(a.wait_for_output_to_drain, '__wrapped__'), hasattr(f.end_job_together, '__wrapped__'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] * 4, out.stdout + out.stderr
