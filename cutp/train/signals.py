"""Stopping a run cleanly on SIGTERM/SIGINT (a job scheduler's time limit, Ctrl-C).

The signal only sets a flag; after the current step every rank asks whether any rank got one
(an all-reduce of the flag), so all ranks stop after the same step and can write one
consistent checkpoint. A signal that reaches some ranks only (a scheduler signalling one node)
stops the whole job all the same.
"""
from __future__ import annotations

import signal

import numpy as np
from mpi4py import MPI


class StopOnSignal:
    """Turns SIGTERM/SIGINT into a request to stop after the current step (agreed by all ranks).
    Disabled, the signals keep Python's default behaviour (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, enabled: bool = True):
        self.requested = False
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.requested = True

    def agreed(self, ctx) -> bool:
        """Whether any rank of ctx's world got a signal. Collective over ctx.world."""
        flag = np.array([1 if self.requested else 0], np.int32)
        with ctx.watchdog.guard("the end-of-step stop check (host all-reduce on world)"):
            ctx.world.mpi_comm.Allreduce(MPI.IN_PLACE, [flag, MPI.INT32_T], op=MPI.MAX)
        return bool(flag[0])
