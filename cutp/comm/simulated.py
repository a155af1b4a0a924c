"""A simulated interconnect: collectives that take as long as they would on a slower link.

Shared-memory MPI on one machine moves a gradient bucket in microseconds of wire time, so
overlapping it with the backward would show nothing. `SimulatedLinkCommunicator` puts each
collective of a group on a modelled link of this rank: it takes `latency + wire bytes /
bandwidth` (the wire bytes of cutp.comm.counting: what one rank sends with the ring algorithm;
a reduce to one rank as the reduce-scatter its buckets add up to), from when its call returns
(blocking: when it is called), and the link carries one transfer at a time (a transfer started
while another is on the link starts when that one ends: two buckets in flight do not each get
the whole bandwidth). A blocking collective then sleeps until its transfer ends; a non-blocking
one reports itself unfinished (`test()`) until then, and its `wait()` sleeps for the rest. The
data really move, over the inner communicator; only their timing is modelled. Used by `cutp
bench model --link-bandwidth GB/s --link-latency us`, to show how much of an InfiniBand-class
link each overlap hides.

The model runs on the compute clock: wall time less the time this rank spent inside the real
collectives and waits (the model's own sleeps are modelled time, and count). On one machine the real transfers are
memory copies on the cores that compute, MPI progresses them only inside its calls
(cutp.comm.mpi), and a loaded machine adds the ranks' skew: all of that is blocked time in the
counters' wall clock (cutp.comm.counting), and none of it may hide the modelled link, as if the
real transfers took no time. The link's account (`Link.times`, per group): `link_s`, the
modelled transfer times, and `exposed_s`, the part of them this rank waited for: a blocking
transfer all of it (with the queue before it), a non-blocking one what of it has not ended on
the compute clock when its wait begins.
"""
from __future__ import annotations

import time

from .base import Communicator, Request, WrappedCommunicator
from .counting import wire_bytes


class Link:
    """One rank's link: its schedule on the compute clock (shared by the groups that use it)."""

    def __init__(self, bandwidth_gbs: float, latency_us: float):
        if not bandwidth_gbs > 0 or latency_us < 0:
            raise ValueError(f"a simulated link needs bandwidth > 0 GB/s and latency >= 0 us, got "
                             f"{bandwidth_gbs} GB/s and {latency_us} us")
        self.bytes_per_s = bandwidth_gbs * 1e9
        self.latency_s = latency_us * 1e-6
        self.free_at = 0.0  # on the compute clock
        self.away = 0.0  # seconds inside the real collectives
        self.times: dict[str, list] = {}  # group -> [link_s, exposed_s] (module docstring)

    def clock(self) -> float:
        """The compute clock: wall time less the time inside the real collectives."""
        return time.perf_counter() - self.away

    def occupy(self, nbytes: float, group: str) -> float:
        """Schedules a transfer of `nbytes` from now (or when the link frees); returns its end."""
        start = max(self.clock(), self.free_at)
        took = self.latency_s + nbytes / self.bytes_per_s
        self.free_at = start + took
        self._account(group)[0] += took
        return self.free_at

    def _account(self, group: str) -> list:
        return self.times.setdefault(group, [0.0, 0.0])

    def real(self, fn, *args):
        """fn(*args), its time counted away from computing."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.away += time.perf_counter() - t0

    def wait_until(self, end: float, group: str, since: float | None = None) -> None:
        """Sleeps until the transfer ending at `end` (compute clock) has ended; the wait, from
        `since` (default now; a blocking call: when it was called), is exposed link time."""
        now = self.clock()
        since = now if since is None else since
        if end > since:
            self._account(group)[1] += end - since
        if end > now:
            time.sleep(end - now)  # (modelled time: the compute clock runs on, to the transfer's end)


class SimulatedRequest(Request):
    def __init__(self, inner: Request, end: float, link: Link, group: str):
        self.inner, self.end, self.link, self.group = inner, end, link, group
        self.op = inner.op
        self._waited = False

    def test(self) -> bool:
        done = self.link.real(self.inner.test)  # progress on the real transfer either way
        return done and self.link.clock() >= self.end

    def wait(self):
        since = self.link.clock()
        result = self.link.real(self.inner.wait)
        if not self._waited:
            self._waited = True
            self.link.wait_until(self.end, self.group, since)
        return result


class SimulatedLinkCommunicator(WrappedCommunicator):
    """`inner`'s collectives, timed as if over `link` (module docstring). Groups of one rank
    send nothing and are not slowed."""

    def __init__(self, inner: Communicator, link: Link):
        super().__init__(inner)
        self.link = link

    def _end(self, op, x):
        nbytes = wire_bytes(op, int(x.nbytes), self.size)
        return self.link.occupy(nbytes, self.name) if self.size > 1 and nbytes else self.link.clock()

    def _call(self, op, x, fn, *args):
        if op == "barrier":
            return fn(*args)
        since = self.link.clock()
        end = self._end(op, x)
        result = self.link.real(fn, *args)
        self.link.wait_until(end, self.name, since)
        return result

    def exchange(self, sends, recvs):
        since = self.link.clock()
        end = max([self._end("send", x) for x, _, _ in sends] or [since])
        result = self.link.real(self.inner.exchange, sends, recvs)
        self.link.wait_until(end, self.name, since)
        return result

    def start_exchange(self, sends, recvs):
        request = self.link.real(self.inner.start_exchange, sends, recvs)
        end = max([self._end("send", x) for x, _, _ in sends] or [self.link.clock()])
        return SimulatedRequest(request, end, self.link, self.name)

    def _start(self, op, x, fn, *args):
        request = self.link.real(fn, *args)  # on the link once the call has returned
        end = self._end("reduce_scatter" if op == "reduce" else op, x)
        return SimulatedRequest(request, end, self.link, self.name)
