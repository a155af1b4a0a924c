"""Multi-rank tests from a plain `python -m pytest`: each launches `mpiexec -n N` itself.

    from tests.mpirun import run_mpi

    def _worker(a, b):           # runs on every rank, under MPI
        ...asserts...

    def test_something():
        run_mpi(4, "tests.comm.test_x:_worker", 1, "two", timeout=60)

The worker is named "module:function"; its arguments travel as JSON. Every rank runs it under
`tests/_mpi_entry.py`, which aborts the whole job (after printing the rank-prefixed traceback)
when any rank raises, and writes a marker when a rank finishes. A failing rank fails the test
with every rank's output; a timeout kills the job and names the ranks that did not finish.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class MpiRunError(AssertionError):
    pass


def find_mpiexec() -> str:
    """The mpiexec beside this Python (the venv's mpich), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    found = shutil.which("mpiexec")
    if found:
        return found
    raise MpiRunError(
        "no mpiexec found beside this Python or on PATH: multi-rank tests need one. "
        "`make test` installs it (pip install -e '.[mpich,test]')."
    )


def run_mpi(nprocs: int, target: str, *args, timeout: float = 120, env: dict | None = None,
            expect_failure: bool = False) -> subprocess.CompletedProcess:
    """Runs `target(*args)` on `nprocs` ranks. Returns the completed process.

    With expect_failure, a non-zero exit is the expected outcome (the caller inspects the
    output); a zero exit then fails the test.
    """
    done_dir = tempfile.mkdtemp(prefix="cutp-mpi-")
    full_env = dict(os.environ)
    full_env.update({
        "PYTHONPATH": ROOT + os.pathsep + full_env.get("PYTHONPATH", ""),
        "CUTP_TEST_DONE_DIR": done_dir,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
    })
    full_env.update(env or {})
    cmd = [find_mpiexec(), "-n", str(nprocs), sys.executable, "-m", "tests._mpi_entry", target, json.dumps(list(args))]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        finished = _finished_ranks(done_dir)
        missing = [r for r in range(nprocs) if r not in finished]
        shutil.rmtree(done_dir, ignore_errors=True)
        raise MpiRunError(
            f"{target} on {nprocs} ranks timed out after {timeout:.0f} s; ranks that did not finish: {missing}\n"
            f"--- output ---\n{out[-20000:]}"
        )
    shutil.rmtree(done_dir, ignore_errors=True)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if expect_failure:
        if proc.returncode == 0:
            raise MpiRunError(f"{target} on {nprocs} ranks was expected to fail but exited 0\n{out[-20000:]}")
        return result
    if proc.returncode != 0:
        raise MpiRunError(f"{target} on {nprocs} ranks failed (exit {proc.returncode})\n--- output ---\n{out[-20000:]}")
    return result


def _finished_ranks(done_dir):
    ranks = set()
    for name in os.listdir(done_dir):
        if name.startswith("rank") and name.endswith(".done"):
            ranks.add(int(name[4:-5]))
    return ranks
