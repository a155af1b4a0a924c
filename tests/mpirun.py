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

Several passing workers on the same number of ranks share one launch (one start-up of the ranks,
~1-2 s, instead of one each) through SharedLaunch: each test checks its own case, and a case that
fails names itself (the cases after it report that they did not run).

    LAUNCH = SharedLaunch(4, {"layers": ("tests.x:_worker_layers", [2, 4]), "dropout": ("tests.x:_worker_dropout", [])})

    def test_layers():
        LAUNCH.check("layers")
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
    return _launch(nprocs, target, args, timeout, env, expect_failure)[0]


def _launch(nprocs, target, args, timeout, env, expect_failure, done_names=None):
    """run_mpi; with done_names, also the names of the markers the ranks wrote (`<case>.rank<r>`)
    and a failure is returned, not raised: (process or None on a timeout, output, names)."""
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
        if done_names is not None:
            done_names.update(os.listdir(done_dir))
            shutil.rmtree(done_dir, ignore_errors=True)
            return None, f"timed out after {timeout:.0f} s\n--- output ---\n{out[-20000:]}", done_names
        shutil.rmtree(done_dir, ignore_errors=True)
        raise MpiRunError(
            f"{target} on {nprocs} ranks timed out after {timeout:.0f} s; ranks that did not finish: {missing}\n"
            f"--- output ---\n{out[-20000:]}"
        )
    if done_names is not None:
        done_names.update(os.listdir(done_dir))
    shutil.rmtree(done_dir, ignore_errors=True)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if done_names is not None:
        return result, out, done_names
    if expect_failure:
        if proc.returncode == 0:
            raise MpiRunError(f"{target} on {nprocs} ranks was expected to fail but exited 0\n{out[-20000:]}")
        return result, out, None
    if proc.returncode != 0:
        raise MpiRunError(f"{target} on {nprocs} ranks failed (exit {proc.returncode})\n--- output ---\n{out[-20000:]}")
    return result, out, None


class SharedLaunch:
    """Passing workers on the same number of ranks run in one launch, in order, each on every rank
    (tests/_mpi_entry.py's run_cases): cases is {name: (target "module:function", [args])}. The
    launch starts at the first check() (so a session running one of the tests runs every case);
    timeout is the whole launch's. The workers must leave nothing behind that the next case sees
    (contexts closed, module state restored), as a worker of its own launch need not."""

    def __init__(self, nprocs: int, cases: dict, timeout: float = 300, env: dict | None = None):
        self.nprocs, self.cases, self.timeout, self.env = nprocs, dict(cases), timeout, env
        self._results = None

    def check(self, name: str) -> None:
        """Passes if case `name` finished on every rank; else raises with the launch's output."""
        if name not in self.cases:
            raise KeyError(f"no case {name!r} in this launch: {list(self.cases)}")
        if self._results is None:
            self._results = self._run()
        error = self._results[name]
        if error:
            raise MpiRunError(error)

    def _run(self) -> dict:
        names = list(self.cases)
        cases = [[name, target, list(args)] for name, (target, args) in self.cases.items()]
        proc, out, done = _launch(self.nprocs, "tests._mpi_entry:run_cases", [cases], self.timeout, self.env,
                                  False, set())
        results, failed = {}, None
        for name in names:
            finished = all(f"{name}.rank{r}" in done for r in range(self.nprocs))
            if finished and failed is None:
                results[name] = None
            elif failed is None:
                failed = name
                status = "timed out" if proc is None else f"exit {proc.returncode}"
                ranks = [r for r in range(self.nprocs) if f"{name}.failed.rank{r}" in done]
                results[name] = (f"case {name!r} of a shared launch on {self.nprocs} ranks failed ({status}; raised "
                                 f"on ranks {ranks}; the cases {names} run in this order)\n--- output ---\n"
                                 f"{out[-20000:]}")
            else:
                results[name] = f"case {name!r} of a shared launch did not run: case {failed!r} before it failed"
        if failed is None and proc is not None and proc.returncode != 0:  # every case ran, the exit failed
            for name in names:
                results[name] = f"the shared launch of {names} exited {proc.returncode}\n--- output ---\n{out[-20000:]}"
        return results


def _finished_ranks(done_dir):
    ranks = set()
    for name in os.listdir(done_dir):
        if name.startswith("rank") and name.endswith(".done"):
            ranks.add(int(name[4:-5]))
    return ranks
