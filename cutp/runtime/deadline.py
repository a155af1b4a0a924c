"""A deadline on a job's setup: MPI initialisation, NCCL's bootstrap, building and loading.

The collective watchdog (`watchdog`) covers collectives once a Context exists; before that a
rank that never arrives (stopped, or dead before MPI_Init on an MPI that does not notice) leaves
every other rank blocked inside MPI_Init or a bootstrap, in C, forever. A Python thread cannot
help there (the blocked call may hold the GIL), so the deadline is faulthandler's watchdog, a C
thread: when a setup phase takes longer than the timeout it prints "Timeout (h:mm:ss)!" and
where each thread of this rank was, then ends the process with status 1, and mpiexec ends the
job. `arm_setup_deadline` starts it (examples/train_gpt.py, before MPI is imported),
`setup_progress` restarts the clock at each phase of setup, `disarm_setup_deadline` ends it
once training starts. The timeout is --collective-timeout's: the flag, else
$CUTP_COLLECTIVE_TIMEOUT, else 600 s; 0 turns it off. No MPI here: this module must work
before MPI is initialised.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading

from .errors import ConfigError

DEFAULT_TIMEOUT_S = 600.0

_armed_timeout: float | None = None
_explainer: threading.Timer | None = None


def default_timeout() -> float:
    """$CUTP_COLLECTIVE_TIMEOUT (seconds, 0 = no watchdog), else DEFAULT_TIMEOUT_S."""
    v = os.environ.get("CUTP_COLLECTIVE_TIMEOUT")
    if v in (None, ""):
        return DEFAULT_TIMEOUT_S
    return check_timeout(v, "CUTP_COLLECTIVE_TIMEOUT")


def check_timeout(value, what: str = "collective_timeout") -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds >= 0 or seconds == float("inf"):
        raise ConfigError(f"{what}={value!r} is not a number of seconds >= 0; use e.g. 600, or 0 to turn "
                          "the collective watchdog off")
    return seconds


def timeout_from_argv(argv) -> float:
    """--collective-timeout S (or =S) from a command line not parsed yet, else default_timeout().
    A malformed value falls back to the default here (argparse and RunConfig report it)."""
    argv = list(argv)
    for i, a in enumerate(argv):
        value = None
        if a == "--collective-timeout" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--collective-timeout="):
            value = a.split("=", 1)[1]
        if value is not None:
            try:
                return check_timeout(value)
            except ConfigError:
                break
    try:
        return default_timeout()
    except ConfigError:
        return DEFAULT_TIMEOUT_S


def arm_setup_deadline(timeout_s: float) -> None:
    """Ends this process (status 1, with its threads' tracebacks) if the current setup phase
    takes longer than timeout_s seconds (0: never)."""
    global _armed_timeout, _explainer
    disarm_setup_deadline()
    if timeout_s and timeout_s > 0:
        _armed_timeout = float(timeout_s)
        faulthandler.dump_traceback_later(_armed_timeout, exit=True, file=sys.__stderr__)
        # says why just before, when the interpreter can still run (the C thread fires regardless)
        _explainer = threading.Timer(_armed_timeout * 0.98, _explain, args=(_armed_timeout,))
        _explainer.daemon = True
        _explainer.start()


def _explain(timeout_s: float) -> None:
    sys.__stderr__.write(f"[pid {os.getpid()}] cutp: a setup phase (MPI initialisation, NCCL's bootstrap, building "
                         f"or loading the model) has not finished within {timeout_s:g} s (--collective-timeout): "
                         "a rank that never arrived, or a slow file system; ending this rank\n")
    sys.__stderr__.flush()


def setup_progress(timeout_s: float | None = None) -> None:
    """A setup phase completed: the next one gets the whole timeout again (a new timeout_s, e.g.
    the run's --collective-timeout once parsed, replaces the armed one). A no-op when unarmed."""
    if _armed_timeout is not None:
        arm_setup_deadline(_armed_timeout if timeout_s is None else timeout_s)


def disarm_setup_deadline() -> None:
    global _armed_timeout, _explainer
    if _armed_timeout is not None:
        faulthandler.cancel_dump_traceback_later()
        _explainer.cancel()
        _armed_timeout = _explainer = None
