"""A failing rank ends the whole job; it never leaves the others waiting in a collective.

An uncaught exception on one MPI rank, while the others sit in a collective, hangs the job
forever (measured with MPICH: the job only ended at an external timeout). So cutp replaces
`sys.excepthook` (and `threading.excepthook`) with one that prints the traceback with every
line prefixed by the rank, flushes, and calls `MPI.COMM_WORLD.Abort` (`abort.abort_job`), which
makes mpiexec kill every rank. An error every rank raises at the same point (a configuration
check, `errors_raised_on_every_rank`, `agree_on_error`) ends the job with one traceback (one
line from a command line's `config_errors_exit`) and exit status 1 (2), deterministically,
without MPICH's banners (`end_together`, `end_job_together`).
"""
from __future__ import annotations

import builtins
import contextlib
import importlib
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from .abort import abort_job, format_rank_traceback, wait_for_output_to_drain
from .errors import UserError
from .watchdog import host_watchdog

_installed = False
# How long a rank that raised an error every rank raises waits for the others to reach the exit
# barrier before it falls back to MPI_Abort (a rank that caught the error must not hang the job).
EXIT_BARRIER_TIMEOUT = 30.0


class EveryRank:
    """Attached to an exception that every rank of a communicator raises at the same point (as
    `exc.cutp_every_rank`): what the excepthook needs to end the job with one traceback."""

    def __init__(self, mpi_comm, reporter: int):
        self.reporter = reporter  # rank in mpi_comm whose traceback is printed
        self.i_report = mpi_comm.Get_rank() == reporter
        self.spans_job = mpi_comm.Get_size() == MPI.COMM_WORLD.Get_size()
        # Where the ranks meet again at exit. mpi_comm itself may be freed while the exception
        # unwinds (a `with cutp.init(...)` block closes its communicators), so keep our own:
        # COMM_WORLD when every process raised, else a Dup made while every rank of mpi_comm is
        # here, one per set of processes (errors a program catches must not use up communicators).
        self.exit_comm = MPI.COMM_WORLD if self.spans_job else _exit_comm_for(mpi_comm)


_exit_comms: dict = {}


def _exit_comm_for(mpi_comm):
    """Collective over mpi_comm: the spare communicator its processes meet on at exit."""
    members = tuple(MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(mpi_comm.Get_size())),
                                              MPI.COMM_WORLD.Get_group()))
    if members not in _exit_comms:  # the same answer on every member: all Dup, or none
        _exit_comms[members] = mpi_comm.Dup()
    return _exit_comms[members]


def mark_raised_on_every_rank(exc: BaseException, mpi_comm, reporter: int) -> BaseException:
    """Collective over mpi_comm: records that every rank of it raises `exc` at this point and
    that rank `reporter` holds the informative traceback (see `end_together`)."""
    exc.cutp_every_rank = EveryRank(mpi_comm, reporter)
    return exc


def _exit_together(mpi_comm, timeout: float | None = None) -> bool:
    """True once every rank of mpi_comm has reached this point (non-blocking barrier polled up
    to `timeout`, default EXIT_BARRIER_TIMEOUT); False if some rank did not come (it caught the
    error and went on)."""
    timeout = EXIT_BARRIER_TIMEOUT if timeout is None else timeout
    try:
        request = mpi_comm.Ibarrier()
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True
    except Exception:
        return False


def end_together(every: EveryRank, rank: int, etype, value, tb) -> None:
    """Ends the job for an error every rank raised: the reporting rank prints its traceback and
    waits until mpiexec has read it (every rank drains its output: MPI_Abort's teardown once
    raced mpiexec's output forwarding and lost every message), the ranks meet, then the job
    ends with status 1 (`end_job_together`).
    Only part of the job runs cutp (cutp.init on a sub-communicator): those ranks abort the
    job after meeting, as any failure does. A rank that does not come within
    EXIT_BARRIER_TIMEOUT (it caught the error) gets the job aborted. Does not return."""
    if every.i_report:
        sys.stderr.write(format_rank_traceback(rank, etype, value, tb))
    sys.stderr.flush()
    sys.stdout.flush()
    wait_for_output_to_drain()
    if not _exit_together(every.exit_comm):
        abort_job(f"[rank {rank}] {etype.__name__}: {value}\n[rank {rank}] not every rank stopped on this error "
                  f"within {EXIT_BARRIER_TIMEOUT:g} s; aborting the job\n")
    if not every.spans_job:
        abort_job()
    end_job_together(1)


def end_job_together(status: int) -> None:
    """Every rank of the job is here (they met in _exit_together) with its output drained: end
    the job with `status`, deterministically. Rank 0 calls MPI_Abort(status) with its stdout and
    stderr silenced (MPICH's "application called MPI_Abort" line is noise here; what the user
    must read was printed and drained before the meeting); the others wait to be ended by the
    launcher. Not MPI_Finalize and exit: MPICH's mpiexec kills every process still alive when
    one exits after finalising, so ranks exiting with a status as their MPI_Finalize returned
    (milliseconds apart) drew status 9 and its BAD TERMINATION banner in 8 of 20 runs of 4 ranks
    (and 2 of 20 when exiting at one agreed instant, on a loaded machine); MPI_Abort from one
    rank: 30 of 30 with the status and nothing else. No interpreter teardown either: destructors
    of live NCCL communicators (ncclCommDestroy, blocking) would run in garbage-collection order
    on every rank. Does not return."""
    try:
        if MPI.COMM_WORLD.Get_rank() == 0:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            MPI.COMM_WORLD.Abort(status)
        time.sleep(EXIT_BARRIER_TIMEOUT)  # the launcher ends this process long before
    finally:
        os._exit(status)


@contextlib.contextmanager
def config_errors_exit(prog: str, name_of=None):
    """For a command-line entry point: a `UserError` (a setting or input that cannot run:
    `ConfigError`, a damaged checkpoint) leaving the block ends the program with one line,
    ``<prog>: error: <message>``, and its exit status (2 for a ConfigError, argparse's
    convention for usage errors; 1 for run-time problems), no traceback. An error every rank raised
    (`errors_raised_on_every_rank`; cutp's configuration checks) is printed once, by the rank
    that found it, and the ranks exit together; one only this rank raised ends the job with its
    line (MPI_Abort). Other exceptions pass through (the excepthook's traceback and abort).
    `name_of` writes the settings a message names in the command line's terms (its flags:
    `UserError.render`)."""
    try:
        yield
    except UserError as e:
        every = getattr(e, "cutp_every_rank", None)
        rank = MPI.COMM_WORLD.Get_rank()
        line = f"{prog}: error: {e.render(name_of)}\n"
        status = e.exit_status
        if MPI.COMM_WORLD.Get_size() > 1 and not isinstance(every, EveryRank):
            abort_job(f"[rank {rank}] {line}", code=status)
        if every is None or every.i_report:
            sys.stderr.write(line)
        sys.stderr.flush()
        sys.stdout.flush()
        if every is None or MPI.COMM_WORLD.Get_size() == 1:
            sys.exit(status)
        wait_for_output_to_drain()
        if not _exit_together(every.exit_comm):
            abort_job(f"[rank {rank}] not every rank stopped on this error within {EXIT_BARRIER_TIMEOUT:g} s; "
                      "aborting the job\n", code=status)
        if not every.spans_job:
            abort_job(code=status)
        end_job_together(status)


def install_abort_on_error() -> bool:
    """Installs the hooks once per process. Returns True if they are installed.

    With a single rank the default hook is kept: there is no peer to release, and Python's own
    exit status and traceback are what a user expects.
    """
    global _installed
    if _installed:
        return True
    if MPI.COMM_WORLD.Get_size() == 1:
        return False
    rank = MPI.COMM_WORLD.Get_rank()

    def excepthook(etype, value, tb):
        every = getattr(value, "cutp_every_rank", None)
        if isinstance(every, EveryRank):
            end_together(every, rank, etype, value, tb)
        abort_job(format_rank_traceback(rank, etype, value, tb))

    def thread_excepthook(args):
        if args.exc_type is SystemExit:
            return
        header = f"[rank {rank}] exception in thread {args.thread.name if args.thread else '?'}:\n"
        abort_job(header + format_rank_traceback(rank, args.exc_type, args.exc_value, args.exc_traceback))

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    _installed = True
    return True


def agree_on_error(mpi_comm, error: str | None, exc_type=RuntimeError,
                   what: str = "the cross-rank agreement on errors") -> None:
    """Collective: if any rank has an error message, every rank raises `exc_type` with the
    message of the lowest failing rank (prefixed by that rank). So a problem one rank sees
    (a corrupt shard it reads, a config that differs) stops every rank at the same point,
    before any further collective, instead of leaving the others waiting. `what` names the
    agreement in the watchdog's message if a rank never comes to it.
    """
    install_abort_on_error()
    reported = _first_error(mpi_comm, error, what)
    if reported is None:
        return
    first, text = reported
    message = text if mpi_comm.Get_rank() == first else f"(reported by rank {first}) {text}"
    raise mark_raised_on_every_rank(exc_type(message), mpi_comm, first)


def _first_error(mpi_comm, error: str | None, what: str = "the cross-rank agreement on errors"):
    """Collective: None if no rank has an error, else (lowest failing rank, its message)."""
    me = mpi_comm.Get_rank()
    with host_watchdog().guard(f"{what} (host all-reduce)"):
        flag = np.array([me if error else mpi_comm.Get_size()], np.int64)
        mpi_comm.Allreduce(MPI.IN_PLACE, [flag, MPI.INT64_T], op=MPI.MIN)
        first = int(flag[0])
        if first == mpi_comm.Get_size():
            return None
        buf = np.zeros(4096, np.uint8)
        if me == first:
            msg = error.encode(errors="backslashreplace")[:4096]
            buf[: len(msg)] = np.frombuffer(msg, np.uint8)
        mpi_comm.Bcast([buf, MPI.UINT8_T], root=first)
    return first, bytes(buf).rstrip(b"\0").decode(errors="replace")


class JobError(RuntimeError):
    """Another rank of the job failed with an exception this rank cannot rebuild; it stops with it."""


@contextlib.contextmanager
def errors_raised_on_every_rank(mpi_comm):
    """Collective over mpi_comm at the end of the block: an exception on any rank is raised on
    every rank. The lowest failing rank re-raises its own exception (its traceback is the one
    printed); the other ranks raise the same exception class (cutp's errors and Python's
    built-in ones; `JobError` for others) with the message prefixed by the reporting rank, so
    `except cutp.ConfigError` works alike everywhere. For checks that can fail on some ranks
    only (a file one node cannot read, a device one node lacks) as much as for checks that fail
    everywhere. The block must not call collectives: a rank that failed before one would leave
    the others waiting in it.
    """
    install_abort_on_error()  # raised uncaught on a sub-communicator, it must still end the host's other ranks
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every exception must reach the other ranks
        error = e
    reported = _first_error(mpi_comm, None if error is None else _describe(error))
    if reported is None:
        return
    first, text = reported
    if mpi_comm.Get_rank() == first:
        raise mark_raised_on_every_rank(error, mpi_comm, first)
    classes, name, message = text.split("\x1f", 2)
    raise mark_raised_on_every_rank(_rebuild(classes.split("\x1e"), f"(reported by rank {first}) {name}: {message}"),
                                    mpi_comm, first)


def _describe(error: Exception) -> str:
    """The exception's classes (most derived first, as module:qualname), its name and message."""
    classes = "\x1e".join(f"{c.__module__}:{c.__qualname__}" for c in type(error).__mro__ if issubclass(c, Exception))
    return f"{classes}\x1f{type(error).__name__}\x1f{error}"  # the message last: it may be cut at 4 KiB


def _rebuild(classes: list, message: str) -> Exception:
    """The nearest class of the failing rank's exception that this rank can rebuild (cutp's and
    Python's built-in exceptions; e.g. json.JSONDecodeError becomes ValueError), so that an
    `except` clause catches it alike on every rank."""
    for entry in classes:
        module, _, name = entry.partition(":")
        if entry == "builtins:Exception":
            break  # nothing nearer: JobError says what happened
        cls = None
        if module == "builtins":
            cls = getattr(builtins, name, None)
        elif module == "cutp" or module.startswith("cutp."):
            try:
                cls = getattr(importlib.import_module(module), name, None)
            except ImportError:
                cls = None
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                return cls(message)
            except Exception:  # noqa: BLE001 - a constructor with other arguments: try the base
                continue
    return JobError(message)
