"""Entry point of every rank started by tests.mpirun: `python -m tests._mpi_entry mod:fn '[args]'` runs one
worker; `python -m tests._mpi_entry --serve DIR PID` is a rank of a RankPool (tests/mpirun.py) and runs
the cases written to DIR one after another until the pool is stopped or the test session (PID) ends."""
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import types
import warnings

import numpy as np
from mpi4py import MPI

from cutp.runtime.failure import install_abort_on_error
from cutp.runtime.threads import get_blas_threads, set_blas_threads
from tests.transformers_compat import hide_cutp_kernels_from_transformers

POLL_S = (0.001, 0.05)  # an idle rank of a pool looks for the next case after 1 ms, then less and less often
RESTORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)  # a launch's handlers are put back after it
PACKAGES = ("cutp", "tests", "examples")  # whose module state a pooled case must leave as it found it


def run_cases(cases):
    """SharedLaunch's worker: each [name, "module:function", args] in turn, every rank finishing a
    case before any starts the next (a barrier); this rank marks each case done, or failed, in the
    launch's marker directory (`<name>.rank<r>`, `<name>.failed.rank<r>`)."""
    done = os.environ.get("CUTP_TEST_DONE_DIR") or tempfile.mkdtemp()
    rank = MPI.COMM_WORLD.Get_rank()
    for name, target, args in cases:
        if rank == 0:
            print(f"--- shared launch: case {name!r} ({target}) ---", flush=True)
        module, _, func = target.partition(":")
        try:
            getattr(importlib.import_module(module), func)(*args)
        except BaseException:
            open(os.path.join(done, f"{name}.failed.rank{rank}"), "w").close()
            raise
        MPI.COMM_WORLD.Barrier()
        open(os.path.join(done, f"{name}.rank{rank}"), "w").close()


def _call(target, args):
    module, _, func = target.partition(":")
    getattr(importlib.import_module(module), func)(*args)


def module_state():
    """{(module, name): id} of what a test could patch and not put back: the functions, classes and
    UPPER_CASE settings of every loaded module of PACKAGES, and the functions of their classes
    (lazily filled caches, lower-case module globals, are left out: filling one changes nothing)."""
    state = {}
    for mname, mod in list(sys.modules.items()):
        if mod is None or mname.partition(".")[0] not in PACKAGES:
            continue
        for name, value in list(vars(mod).items()):
            if isinstance(value, type) and value.__module__ == mname:
                for attr, member in list(vars(value).items()):
                    if callable(member) or isinstance(member, (staticmethod, classmethod, property)):
                        state[(mname, f"{name}.{attr}")] = id(member)
            if name.isupper() or isinstance(value, (types.FunctionType, type, types.ModuleType)):
                state[(mname, name)] = id(value)
    return state


def _quiet_barrier(comm):
    """A barrier that sleeps while it waits (MPI's blocking one spins a core)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


def serve(control, session_pid):
    """A rank of a RankPool: case k is the file DIR/k.json ({"target", "args", "dir"}, written
    whole by the test); its output (every rank's stdout and stderr) goes to <dir>/output, its
    markers to <dir> (CUTP_TEST_DONE_DIR, as for one launch; <dir>/rank<r>.finished when this
    rank returned from it). A raising case ends the pool as it
    ends a launch (the excepthook's traceback and abort); a passing one is marked
    <dir>/rank<r>.done once every rank finished it, and <dir>/rank<r>.retire when it left module
    state changed (module_state) or the pool ran out of communicators' headroom: the test then
    stops this pool and starts a fresh one for the next case. The process environment, working
    directory, BLAS threads, NumPy error settings and warning filters are put back after each case."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    env, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    blas, errors, filters = get_blas_threads(), np.geterr(), list(warnings.filters)
    handlers = {sig: signal.getsignal(sig) for sig in RESTORED_SIGNALS}  # (StopOnSignal installs its own)
    k = 0
    while True:
        request = os.path.join(control, f"{k}.json")
        wait, checked = POLL_S[0], time.monotonic()
        while not os.path.exists(request):
            time.sleep(wait)
            wait = min(POLL_S[1], wait * 1.5)
            if time.monotonic() - checked > 1.0:  # the session ended without stopping the pool (killed, say)
                checked = time.monotonic()
                try:
                    os.kill(session_pid, 0)
                except OSError:
                    os._exit(0)
        with open(request) as f:
            case = json.load(f)
        if case.get("stop"):
            os._exit(0)
        before = module_state()
        out = os.open(os.path.join(case["dir"], "output"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.environ["CUTP_TEST_DONE_DIR"] = case["dir"]
        try:
            _call(case["target"], case["args"])
        except SystemExit as e:
            if e.code not in (None, 0):
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(e.code if isinstance(e.code, int) else 1)
        except BaseException:
            sys.excepthook(*sys.exc_info())  # ends the job (install_abort_on_error) on 2+ ranks
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        open(os.path.join(case["dir"], f"rank{rank}.finished"), "w").close()
        _quiet_barrier(comm)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, out):
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
        if blas is not None and get_blas_threads() != blas:
            set_blas_threads(blas)
        np.seterr(**errors)
        warnings.filters[:] = filters
        for sig, handler in handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:  # (None: set outside Python)
                signal.signal(sig, handler)
        changed = sorted(f"{m}.{n}" for (m, n), i in module_state().items() if (m, n) in before and before[(m, n)] != i)
        if changed:
            with open(os.path.join(case["dir"], f"rank{rank}.retire"), "w") as f:
                f.write(" ".join(changed[:20]))
        open(os.path.join(case["dir"], f"rank{rank}.done"), "w").close()
        k += 1


def main():
    install_abort_on_error()
    hide_cutp_kernels_from_transformers()
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
    target, args = sys.argv[1], json.loads(sys.argv[2])
    _call(target, args)
    done = os.environ.get("CUTP_TEST_DONE_DIR")
    if done:
        open(os.path.join(done, f"rank{MPI.COMM_WORLD.Get_rank()}.done"), "w").close()


if __name__ == "__main__":
    main()
