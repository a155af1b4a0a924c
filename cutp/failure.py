"""A failing rank ends the whole job; it never leaves the others waiting in a collective.

An uncaught exception on one MPI rank, while the others sit in a collective, hangs the job
forever (measured with MPICH: the job only ended at an external timeout). So cutp replaces
`sys.excepthook` (and `threading.excepthook`) with one that prints the traceback with every
line prefixed by the rank, flushes, and calls `MPI.COMM_WORLD.Abort`, which makes mpiexec kill
every rank.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback

_installed = False


def format_rank_traceback(rank: int, etype, value, tb) -> str:
    text = "".join(traceback.format_exception(etype, value, tb)).rstrip("\n")
    return "".join(f"[rank {rank}] {line}\n" for line in text.splitlines())


def abort_job(message: str = "", code: int = 1) -> None:
    """Print `message` (already prefixed) and end every rank of the job."""
    from mpi4py import MPI

    if message:
        sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # Abort does not return; this is for MPI stacks where it does


def install_abort_on_error() -> bool:
    """Installs the hooks once per process. Returns True if they are installed.

    With a single rank the default hook is kept: there is no peer to release, and Python's own
    exit status and traceback are what a user expects.
    """
    global _installed
    from mpi4py import MPI

    if _installed:
        return True
    if MPI.COMM_WORLD.Get_size() == 1:
        return False
    rank = MPI.COMM_WORLD.Get_rank()

    def excepthook(etype, value, tb):
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


def agree_on_error(mpi_comm, error: str | None, exc_type=RuntimeError) -> None:
    """Collective: if any rank has an error message, every rank raises `exc_type` with the
    message of the lowest failing rank (prefixed by that rank). So a problem one rank sees
    (a corrupt shard it reads, a config that differs) stops every rank at the same point,
    before any further collective, instead of leaving the others waiting.
    """
    import numpy as np
    from mpi4py import MPI

    me = mpi_comm.Get_rank()
    flag = np.array([me if error else mpi_comm.Get_size()], np.int64)
    mpi_comm.Allreduce(MPI.IN_PLACE, [flag, MPI.INT64_T], op=MPI.MIN)
    first = int(flag[0])
    if first == mpi_comm.Get_size():
        return
    buf = np.zeros(4096, np.uint8)
    if me == first:
        msg = error.encode()[:4096]
        buf[: len(msg)] = np.frombuffer(msg, np.uint8)
    mpi_comm.Bcast([buf, MPI.UINT8_T], root=first)
    text = bytes(buf).rstrip(b"\0").decode(errors="replace")
    raise exc_type(text if me == first else f"(reported by rank {first}) {text}")
