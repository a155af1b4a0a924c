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
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .base import Communicator, WrappedCommunicator


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

    def calls(self, group=None, op=None) -> int:
        return sum(v[0] for (g, o), v in self.totals.items() if group in (None, g) and op in (None, o))

    def elements(self, group=None, op=None) -> int:
        return sum(v[1] for (g, o), v in self.totals.items() if group in (None, g) and op in (None, o))

    def bytes(self, group=None, op=None) -> int:
        return sum(v[2] for (g, o), v in self.totals.items() if group in (None, g) and op in (None, o))

    def wire_bytes(self, group=None, op=None) -> float:
        return sum(v[3] for (g, o), v in self.totals.items() if group in (None, g) and op in (None, o))

    def reset(self):
        self.totals.clear()

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
        return fn(*args)

    def exchange(self, sends, recvs):
        """Counted as a send of each sent array and a recv of each received one."""
        for x, _, _ in sends:
            self.counter.record(self.name, "send", x, self.size)
        for x, _, _ in recvs:
            self.counter.record(self.name, "recv", x, self.size)
        return self.inner.exchange(sends, recvs)

    def start_exchange(self, sends, recvs):
        """Counted as `exchange` is, when posted."""
        for x, _, _ in sends:
            self.counter.record(self.name, "send", x, self.size)
        for x, _, _ in recvs:
            self.counter.record(self.name, "recv", x, self.size)
        return self.inner.start_exchange(sends, recvs)


def wire_bytes(op: str, nbytes: int, size: int) -> float:
    """Bytes one rank sends for a collective over `size` ranks (ring algorithms; module docstring)."""
    if size <= 1 and op != "send":
        return 0.0
    factor = {"all_reduce": 2 * (size - 1) / size, "reduce_scatter": (size - 1) / size,
              "all_gather": size - 1, "broadcast": (size - 1) / size, "send": 1.0,
              "all_to_all": (size - 1) / size}
    return nbytes * factor.get(op, 0.0)
