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

The launches run in a pool of ranks started once per rank count (RankPool: the ranks run one
launch after another; CUTP_TEST_POOL=0 gives each its own mpiexec), except those given an env or
expect_failure, which start their own mpiexec.

Several passing workers on the same number of ranks share one launch (one start-up of the ranks,
~1-2 s, instead of one each) through SharedLaunch: each test checks its own case, and a case that
fails names itself (the cases after it report that they did not run).

    LAUNCH = SharedLaunch(4, {"layers": ("tests.x:_worker_layers", [2, 4]), "dropout": ("tests.x:_worker_dropout", [])})

    def test_layers():
        LAUNCH.check("layers")
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

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


def _environment(env, done_dir):
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
    return full_env


def _launch(nprocs, target, args, timeout, env, expect_failure, done_names=None):
    """run_mpi; with done_names, also the names of the markers the ranks wrote (`<case>.rank<r>`)
    and a failure is returned, not raised: (process or None on a timeout, output, names)."""
    if not env and not expect_failure and POOLED:
        return _pooled(nprocs, target, args, timeout, done_names)
    done_dir = tempfile.mkdtemp(prefix="cutp-mpi-")
    full_env = _environment(env, done_dir)
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


# Launches without an env of their own or an expected failure run in a pool of ranks started
# once per rank count (RankPool): a launch's start-up (mpiexec, then per rank the interpreter,
# NumPy, MPI and cutp: ~0.5 CPU-s) is paid once instead of at every launch. CUTP_TEST_POOL=0
# starts an mpiexec for every launch instead (to rule the pool out when a test fails).
POOLED = os.environ.get("CUTP_TEST_POOL", "1") != "0"


class RankPool:
    """`nprocs` ranks (tests/_mpi_entry.py's serve) that run the launches given to them one after
    another, each on every rank, as one mpiexec would: a passing launch is done when every rank
    finished it; a raising one ends the pool (the excepthook's traceback and abort, as in a launch
    of its own) and the next launch starts a fresh pool; a launch past its timeout is killed with
    the pool. A launch that leaves module state changed (tests._mpi_entry.module_state: a function,
    class or UPPER_CASE setting of cutp, tests or examples replaced) retires the pool after it, so
    no later launch sees it; so does the MAX_CASES-th launch (communicators a worker leaves open
    add up: MPICH has 2048 a process)."""

    MAX_CASES = 40

    def __init__(self, nprocs: int, env: dict):
        self.nprocs, self.env, self.cases = nprocs, env, 0
        self.dir = tempfile.mkdtemp(prefix=f"cutp-pool{nprocs}-")
        self.log = os.path.join(self.dir, "launcher.out")
        cmd = [find_mpiexec(), "-n", str(nprocs), sys.executable, "-m", "tests._mpi_entry", "--serve", self.dir,
               str(os.getpid())]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(env, CUTP_TEST_DONE_DIR=self.dir),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and self.cases < self.MAX_CASES

    def run(self, target: str, args, timeout: float):
        """(0 when it passed on every rank, else the pool's exit status, None on a timeout; the
        launch's output; the markers its ranks wrote)."""
        case = os.path.join(self.dir, f"case{self.cases}")
        os.mkdir(case)
        with open(os.path.join(self.dir, "next.json"), "w") as f:
            json.dump(dict(target=target, args=list(args), dir=case), f)
        os.replace(os.path.join(self.dir, "next.json"), os.path.join(self.dir, f"{self.cases}.json"))
        earlier, self.cases = self.cases, self.cases + 1
        done = {f"rank{r}.done" for r in range(self.nprocs)}
        deadline, wait = time.monotonic() + timeout, 0.001
        while True:
            names = set(os.listdir(case))
            if done <= names:
                status = 0
                break
            if self.proc.poll() is not None:
                names = set(os.listdir(case))
                status = self.proc.returncode or 1
                break
            if time.monotonic() > deadline:
                status = None
                break
            time.sleep(wait)
            wait = min(0.02, wait * 1.5)
        out = ""
        if "output" in names:
            with open(os.path.join(case, "output"), errors="replace") as f:
                out = f.read()
        if status != 0:
            if status is None:
                self.kill()  # (the launcher's output is complete once it ended)
            with open(self.log, errors="replace") as f:
                out += f.read()
            out += (f"\n(this launch ran in a pool of {self.nprocs} ranks after {earlier} other launches; "
                    "CUTP_TEST_POOL=0 runs each launch in an mpiexec of its own)")
        if status != 0 or any(n.endswith(".retire") for n in names):
            self.stop()
        return status, out, names

    def kill(self):
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.cases = self.MAX_CASES

    def stop(self):
        """Ends the ranks (they exit at the stop request; killed if they do not within 10 s)."""
        if self.proc.poll() is None:
            with open(os.path.join(self.dir, "next.json"), "w") as f:
                json.dump(dict(stop=True), f)
            os.replace(os.path.join(self.dir, "next.json"), os.path.join(self.dir, f"{self.cases}.json"))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict = {}  # nprocs -> RankPool, most recently used last
MAX_POOLS = 3  # pools kept at once (idle ranks sleep, but hold their memory)


def _pool(nprocs: int) -> RankPool:
    """The pool of nprocs ranks, started afresh when the environment a launch would get changed
    since it started (a test's monkeypatch.setenv, say: some settings are read at start-up)."""
    env = _environment(None, "")
    env.pop("PYTEST_CURRENT_TEST", None)  # (pytest sets it to each test's name)
    pool = _POOLS.pop(nprocs, None)
    if pool is None or not pool.alive or pool.env != env:
        if pool is not None:
            pool.stop()
        pool = RankPool(nprocs, env)
    _POOLS[nprocs] = pool
    while len(_POOLS) > MAX_POOLS:
        _POOLS.pop(next(iter(_POOLS))).stop()
    return pool


@atexit.register
def _stop_pools():
    while _POOLS:
        _POOLS.popitem()[1].stop()


def _pooled(nprocs, target, args, timeout, done_names):
    """_launch in this session's pool of nprocs ranks."""
    status, out, names = _pool(nprocs).run(target, args, timeout)
    missing = [r for r in range(nprocs) if f"rank{r}.finished" not in names]
    result = None if status is None else subprocess.CompletedProcess([target], status, out, "")
    if done_names is not None:
        done_names.update(names)
        return (result, f"timed out after {timeout:.0f} s\n--- output ---\n{out[-20000:]}" if status is None else out,
                done_names)
    if status is None:
        raise MpiRunError(f"{target} on {nprocs} ranks timed out after {timeout:.0f} s; ranks that did not finish: "
                          f"{missing}\n--- output ---\n{out[-20000:]}")
    if status != 0:
        raise MpiRunError(f"{target} on {nprocs} ranks failed (exit {status})\n--- output ---\n{out[-20000:]}")
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
