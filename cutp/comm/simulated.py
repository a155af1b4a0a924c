"""A simulated interconnect: collectives that take as long as they would on a slower link.

Shared-memory MPI on one machine moves a gradient bucket in microseconds, so overlapping it
with the backward shows nothing. `SimulatedLinkCommunicator` makes each collective of a group
finish no earlier than `latency + wire bytes / bandwidth` after it could start on this rank's
link (the wire bytes of cutp.comm.counting: what one rank sends with the ring algorithm), and
the link carries one collective at a time: a collective started while another is in flight
starts when that one ends (two buckets in flight do not each get the whole bandwidth).
A blocking collective sleeps until then; a non-blocking one reports itself unfinished
(`test()`) until then, and its `wait()` sleeps for the rest. The data really move, over the
inner communicator; only their timing is modelled. Used by `cutp bench model --link-bandwidth
GB/s --link-latency us` to show how much of an InfiniBand-class link each overlap hides.
"""
from __future__ import annotations

import time

from .base import Communicator, Request, WrappedCommunicator
from .counting import wire_bytes


class Link:
    """One rank's link: when it is free again (shared by the groups that use it)."""

    def __init__(self, bandwidth_gbs: float, latency_us: float):
        if not bandwidth_gbs > 0 or latency_us < 0:
            raise ValueError(f"a simulated link needs bandwidth > 0 GB/s and latency >= 0 us, got "
                             f"{bandwidth_gbs} GB/s and {latency_us} us")
        self.bytes_per_s = bandwidth_gbs * 1e9
        self.latency_s = latency_us * 1e-6
        self.free_at = 0.0

    def occupy(self, nbytes: float) -> float:
        """Schedules a transfer of `nbytes` from now (or when the link frees); returns its end."""
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + self.latency_s + nbytes / self.bytes_per_s
        return self.free_at


def _sleep_until(t: float) -> None:
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


class SimulatedRequest(Request):
    def __init__(self, inner: Request, finished_at: float):
        self.inner, self.finished_at = inner, finished_at
        self.op = inner.op

    def test(self) -> bool:
        done = self.inner.test()  # progress on the real transfer either way
        return done and time.perf_counter() >= self.finished_at

    def wait(self):
        result = self.inner.wait()
        _sleep_until(self.finished_at)
        return result


class SimulatedLinkCommunicator(WrappedCommunicator):
    """`inner`'s collectives, timed as if over `link` (module docstring). Groups of one rank
    send nothing and are not slowed."""

    def __init__(self, inner: Communicator, link: Link):
        super().__init__(inner)
        self.link = link

    def _end(self, op, x):
        nbytes = wire_bytes(op, int(x.nbytes), self.size)
        return self.link.occupy(nbytes) if self.size > 1 and nbytes else time.perf_counter()

    def _call(self, op, x, fn, *args):
        if op == "barrier":
            return fn(*args)
        end = self._end(op, x)
        result = fn(*args)
        _sleep_until(end)
        return result

    def exchange(self, sends, recvs):
        end = max([self._end("send", x) for x, _, _ in sends] or [time.perf_counter()])
        result = self.inner.exchange(sends, recvs)
        _sleep_until(end)
        return result

    def _start(self, op, x, fn, *args):
        end = self._end("reduce_scatter" if op == "reduce" else op, x)
        return SimulatedRequest(fn(*args), end)
