"""Collectives registered with the collective watchdog (`cutp.runtime.watchdog`) while in flight.

MPI calls block, so they are registered for the duration of the call; NCCL calls return at
once, so a CUDA event recorded after the call tells the watchdog's thread when the GPU finished.
A non-blocking collective is registered while its wait() blocks (from the start it would be
"in flight" for a whole backward: long computations are not stalls): a peer that died with a
bucket's reduction pending leaves the wait stuck, and the watchdog aborts naming it.
"""
from __future__ import annotations

import functools

from ..runtime.watchdog import Watchdog
from .base import Communicator, Request, WrappedCommunicator


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

    def _start(self, op, x, fn, *args):
        desc = (f"waiting for the non-blocking {op} on group '{self.name}' (rank {self.rank} of {self.size}, shape "
                f"{tuple(x.shape)}, {x.dtype})")
        return WatchedRequest(fn(*args), self.watchdog, desc, nccl=self.kind == "nccl")


class WatchedRequest(Request):
    """A request whose wait() is registered with the watchdog while it blocks."""

    def __init__(self, inner: Request, watchdog: Watchdog, description: str, nccl: bool = False):
        self.inner, self.watchdog, self.description, self.nccl = inner, watchdog, description, nccl
        self.op = inner.op

    def test(self) -> bool:
        return self.inner.test()

    def wait(self):
        if self.nccl:  # the host does not block: the done event tells the watchdog's thread (as _call)
            result = self.inner.wait()
            import cupy  # optional dependency: NCCL groups exist only with CuPy

            self.watchdog.begin(self.description, done=functools.partial(_event_done, self.inner.done,
                                                                          cupy.cuda.runtime.getDevice()))
            return result
        token = self.watchdog.begin(self.description)
        try:
            return self.inner.wait()
        finally:
            self.watchdog.end(token)
