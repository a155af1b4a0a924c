"""Ending every rank of an MPI job from one of them, without losing what it printed.

`abort_job` is the last resort of the failure handling (`failure`) and of the collective
watchdog (`watchdog`): it prints, waits until the launcher has read this rank's output, and
calls MPI_Abort, which makes mpiexec end every rank.
"""
from __future__ import annotations

import fcntl
import os
import stat
import struct
import sys
import termios
import time
import traceback

from mpi4py import MPI

# How long abort_job waits for the launcher to take this rank's last output off the pipe.
OUTPUT_DRAIN_TIMEOUT = 2.0


def format_rank_traceback(rank: int, etype, value, tb) -> str:
    text = "".join(traceback.format_exception(etype, value, tb)).rstrip("\n")
    return "".join(f"[rank {rank}] {line}\n" for line in text.splitlines())


def abort_job(message: str = "", code: int = 1) -> None:
    """Print `message` (already prefixed) and end every rank of the job."""
    if message:
        sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    wait_for_output_to_drain()
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # Abort does not return; this is for MPI stacks where it does


def wait_for_output_to_drain(timeout: float = OUTPUT_DRAIN_TIMEOUT, fds=(1, 2)) -> None:
    """Waits until the launcher has read what this rank wrote to stdout/stderr, up to `timeout`.

    mpiexec forwards each rank's output asynchronously, and MPI_Abort tears the job down at once:
    bytes still sitting in the pipe are lost, and under load CI once lost a whole job's output,
    the error message included. On a pipe, FIONREAD counts the bytes its reader has not taken.
    """
    deadline = time.monotonic() + timeout
    for fd in fds:
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            while time.monotonic() < deadline:
                unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
                if unread == 0:
                    break
                time.sleep(0.005)
        except OSError:
            continue
