"""Counts every collective: calls, elements and bytes per group and per operation.

Tests assert exact communication volumes from it (e.g. two all-reduces of b*s*h elements per
transformer block forward); benchmarks and the training log report MB per step from it.

Bytes are those of the array a rank hands to the collective: the input of all_reduce,
reduce_scatter, broadcast, all_to_all (every row it sends, its own included) and send, this
rank's contribution to all_gather, and the receive buffer of recv.

Wire bytes are what one rank sends with the bandwidth-optimal (ring) algorithm, NCCL's "bus
bytes": all_reduce 2 (n-1)/n of its input, reduce_scatter (n-1)/n of its input, all_gather
(n-1) times its contribution, broadcast (n-1)/n of its array, send its array, all_to_all
(n-1)/n of its input (rows spread evenly; its own rows stay). So a
reduce-scatter plus an all-gather of the same tensor cost exactly one all-reduce's wire bytes
(sequence parallelism's claim, asserted from these numbers).

Time per group (`times[group]`: [comm_s, blocked_s]): `comm_s`, how long its collectives were
in flight (a blocking one: its call; a non-blocking one: from its start until it was seen
finished, by a test() or its wait()), and `blocked_s`, how long this rank waited for them (a
blocking call, a wait()): the exposed communication. What overlaps computation is the difference.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from .base import Communicator, Request, WrappedCommunicator


@dataclass(frozen=True)
class CommEvent:
    group: str
    op: str  # collective name: all_reduce, all_gather, ...
    shape: tuple
    dtype: str
    nbytes: int
    wire_bytes: float = 0.0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class CommCounter:
    """Totals per (group, collective), plus a full event list while `recording()` is active."""

    def __init__(self):
        self.totals: dict[tuple[str, str], list] = {}  # -> [calls, elements, bytes, wire bytes]
        self.times: dict[str, list] = {}  # group -> [comm_s, blocked_s] (module docstring)
        self._events: list[CommEvent] | None = None

    def record(self, group, op, x, size: int | None = None):
        """`size`: the group's size, for the wire bytes (None: not counted)."""
        n = int(x.size)
        nbytes = int(x.nbytes)
        wire = 0.0 if size is None else wire_bytes(op, nbytes, size)
        t = self.totals.setdefault((group, op), [0, 0, 0, 0.0])
        t[0] += 1
        t[1] += n
        t[2] += nbytes
        t[3] += wire
        if self._events is not None:
            self._events.append(CommEvent(group, op, tuple(x.shape), str(x.dtype), nbytes, wire))

    @contextlib.contextmanager
    def recording(self):
        """Yields the list that collects every event inside the block."""
        outer = self._events
        self._events = []
        events = self._events
        try:
            yield events
        finally:
            self._events = outer if outer is None else outer + events

    def add_time(self, group: str, comm_s: float, blocked_s: float) -> None:
        t = self.times.setdefault(group, [0.0, 0.0])
        t[0] += comm_s
        t[1] += blocked_s

    def calls(self, group=None, op=None) -> int:
        return sum(v[0] for (g, o), v in self.totals.items() if group in (None, g) and op in (None, o))

    def elements(self, group=None, op=None) -> int:
        return sum(v[1] for (g, o), v in self.totals.items() if group in (None, g) and op in (None, o))

    def bytes(self, group=None, op=None) -> int:
        return sum(v[2] for (g, o), v in self.totals.items() if group in (None, g) and op in (None, o))

    def reset(self):
        self.totals.clear()
        self.times.clear()

    def summary(self) -> dict:
        return {f"{g}.{o}": {"calls": v[0], "elements": v[1], "bytes": v[2]} for (g, o), v in sorted(self.totals.items())}


class CountingCommunicator(WrappedCommunicator):
    """Wraps a communicator; every collective is recorded in `counter` under this group's name."""

    def __init__(self, inner: Communicator, counter: CommCounter):
        super().__init__(inner)
        self.counter = counter

    def _call(self, op, x, fn, *args):
        if op != "barrier":
            self.counter.record(self.name, op, x, self.size)
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            took = time.perf_counter() - t0
            self.counter.add_time(self.name, took, took)

    def _start(self, op, x, fn, *args):
        self.counter.record(self.name, op, x, self.size)
        return TimedRequest(fn(*args), self.counter, self.name)

    def start_exchange(self, sends, recvs):
        for x, _, _ in sends:
            self.counter.record(self.name, "send", x, self.size)
        for x, _, _ in recvs:
            self.counter.record(self.name, "recv", x, self.size)
        return TimedRequest(self.inner.start_exchange(sends, recvs), self.counter, self.name)

    def exchange(self, sends, recvs):
        """Counted as a send of each sent array and a recv of each received one."""
        for x, _, _ in sends:
            self.counter.record(self.name, "send", x, self.size)
        for x, _, _ in recvs:
            self.counter.record(self.name, "recv", x, self.size)
        t0 = time.perf_counter()
        try:
            return self.inner.exchange(sends, recvs)
        finally:
            took = time.perf_counter() - t0
            self.counter.add_time(self.name, took, took)


class TimedRequest(Request):
    """A request whose time in flight and time waited for are added to a counter once it is done."""

    def __init__(self, inner: Request, counter: CommCounter, group: str):
        self.inner, self.counter, self.group = inner, counter, group
        self.op = inner.op
        self.started = time.perf_counter()
        self._blocked = 0.0
        self._done = False

    def _finish(self):
        if not self._done:
            self._done = True
            self.counter.add_time(self.group, time.perf_counter() - self.started, self._blocked)

    def test(self) -> bool:
        done = self.inner.test()
        if done:
            self._finish()
        return done

    def wait(self):
        if self._done:
            return self.inner.wait()
        t0 = time.perf_counter()
        result = self.inner.wait()
        self._blocked += time.perf_counter() - t0
        self._finish()
        return result


def wire_bytes(op: str, nbytes: int, size: int) -> float:
    """Bytes one rank sends for a collective over `size` ranks (ring algorithms; module docstring)."""
    if size <= 1 and op != "send":
        return 0.0
    factor = {"all_reduce": 2 * (size - 1) / size, "reduce_scatter": (size - 1) / size,
              "all_gather": size - 1, "broadcast": (size - 1) / size, "send": 1.0,
              "all_to_all": (size - 1) / size}
    return nbytes * factor.get(op, 0.0)
