"""Collectives registered with the collective watchdog (`cutp.runtime.watchdog`) while in flight.

MPI calls block, so they are registered for the duration of the call; NCCL calls return at
once, so a CUDA event recorded after the call tells the watchdog's thread when the GPU finished.
"""
from __future__ import annotations

import functools

from ..runtime.watchdog import Watchdog
from .base import Communicator, PendingExchange, WrappedCommunicator


def _event_done(event, device: int) -> bool:
    """Whether a CUDA event has completed, asked from the watchdog's thread. A new thread's
    current device is 0: it is set to the event's device first (and left there), so that the
    runtime has no reason to create a CUDA context on GPU 0 in every rank of a multi-GPU node
    (memory taken there; on GPUs in exclusive-process mode an error, with which the event would
    never count as done and the watchdog would abort a healthy job)."""
    from cupy.cuda import runtime  # optional dependency: only NCCL groups get here

    if runtime.getDevice() != device:
        runtime.setDevice(device)
    return bool(event.done)


class WatchdogCommunicator(WrappedCommunicator):
    """Registers each collective of `inner` with the watchdog while it is in flight."""

    def __init__(self, inner: Communicator, watchdog: Watchdog):
        super().__init__(inner)
        self.watchdog = watchdog

    def start_exchange(self, sends, recvs):
        """MPI: watched from the posting to the end of wait() (where a missing peer shows);
        NCCL: as its other calls, by the completion event recorded after the posting."""
        if self.kind == "nccl":
            return super().start_exchange(sends, recvs)
        x = (list(sends) + list(recvs))[0][0]
        token = self.watchdog.begin(f"exchange on group '{self.name}' (rank {self.rank} of {self.size}, shape "
                                    f"{tuple(x.shape)}, {x.dtype})")
        try:
            pending = self.inner.start_exchange(sends, recvs)
        except BaseException:
            self.watchdog.end(token)
            raise

        def finish():
            try:
                return pending.wait()
            finally:
                self.watchdog.end(token)

        return PendingExchange(finish)

    def _call(self, op, x, fn, *args):
        desc = f"{op} on group '{self.name}' (rank {self.rank} of {self.size}, shape {tuple(x.shape)}, {x.dtype})"
        if self.kind == "nccl" and op != "barrier":  # NCCL returns at once: watch its completion event
            result = fn(*args)
            import cupy  # optional dependency: NCCL groups exist only with CuPy

            event = cupy.cuda.Event(disable_timing=True)
            event.record(cupy.cuda.get_current_stream())  # the stream the collective was queued on
            self.watchdog.begin(desc, done=functools.partial(_event_done, event, cupy.cuda.runtime.getDevice()))
            return result
        token = self.watchdog.begin(desc)
        try:
            return fn(*args)
        finally:
            self.watchdog.end(token)
