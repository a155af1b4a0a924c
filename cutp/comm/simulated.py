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

The link's own account (`Link.times`, per group): `link_s`, the modelled transfer times, and
`exposed_s`, the part of them this rank spent blocked (a blocking collective: all of it, from
the call to its modelled end; a wait: from the wait until the modelled end, if that is later).
On one machine the real transfers are memory copies on the same cores as the computation, and
MPI progresses them only inside its calls (cutp.comm.mpi): they, and the ranks' skew, are in
the counters' wall-clock times (cutp.comm.counting), not in the link's account, which says how
much of the link's time the schedule hides: a non-blocking transfer starts on the link when
its call returns, and what of it has not ended when its wait begins is exposed.
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
        self.times: dict[str, list] = {}  # group -> [link_s, exposed_s] (module docstring)

    def occupy(self, nbytes: float, group: str) -> float:
        """Schedules a transfer of `nbytes` from now (or when the link frees); returns its end."""
        start = max(time.perf_counter(), self.free_at)
        took = self.latency_s + nbytes / self.bytes_per_s
        self.free_at = start + took
        self._account(group).__setitem__(0, self._account(group)[0] + took)
        return self.free_at

    def _account(self, group: str) -> list:
        return self.times.setdefault(group, [0.0, 0.0])

    def exposed(self, group: str, since: float, end: float) -> None:
        """This rank blocked from `since` on a transfer that ends (modelled) at `end`."""
        if end > since:
            self._account(group)[1] += end - since


def _sleep_until(t: float) -> None:
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


class SimulatedRequest(Request):
    def __init__(self, inner: Request, finished_at: float, link: Link, group: str):
        self.inner, self.finished_at, self.link, self.group = inner, finished_at, link, group
        self.op = inner.op
        self._waited = False

    def test(self) -> bool:
        done = self.inner.test()  # progress on the real transfer either way
        return done and time.perf_counter() >= self.finished_at

    def wait(self):
        since = time.perf_counter()
        result = self.inner.wait()
        _sleep_until(self.finished_at)
        if not self._waited:
            self._waited = True
            self.link.exposed(self.group, since, self.finished_at)
        return result


class SimulatedLinkCommunicator(WrappedCommunicator):
    """`inner`'s collectives, timed as if over `link` (module docstring). Groups of one rank
    send nothing and are not slowed."""

    def __init__(self, inner: Communicator, link: Link):
        super().__init__(inner)
        self.link = link

    def _end(self, op, x):
        nbytes = wire_bytes(op, int(x.nbytes), self.size)
        return self.link.occupy(nbytes, self.name) if self.size > 1 and nbytes else time.perf_counter()

    def _call(self, op, x, fn, *args):
        if op == "barrier":
            return fn(*args)
        since = time.perf_counter()
        end = self._end(op, x)
        result = fn(*args)
        _sleep_until(end)
        self.link.exposed(self.name, since, end)
        return result

    def exchange(self, sends, recvs):
        since = time.perf_counter()
        end = max([self._end("send", x) for x, _, _ in sends] or [since])
        result = self.inner.exchange(sends, recvs)
        _sleep_until(end)
        self.link.exposed(self.name, since, end)
        return result

    def start_exchange(self, sends, recvs):
        request = self.inner.start_exchange(sends, recvs)
        end = max([self._end("send", x) for x, _, _ in sends] or [time.perf_counter()])
        return SimulatedRequest(request, end, self.link, self.name)

    def _start(self, op, x, fn, *args):
        # a reduce to one rank: modelled as the reduce-scatter its buckets add up to (over the
        # group's ranks, each owner's buckets reduced to it: (n-1)/n of the bytes per rank)
        request = fn(*args)  # the link's transfer starts once the call has posted it (its own time is real)
        end = self._end("reduce_scatter" if op == "reduce" else op, x)
        return SimulatedRequest(request, end, self.link, self.name)
