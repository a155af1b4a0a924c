"""Counts every collective: calls, elements and bytes per group and per operation.

Tests assert exact communication volumes from it (e.g. two all-reduces of b*s*h elements per
transformer block forward); benchmarks and the training log report MB per step from it.

Bytes are those of the array a rank hands to the collective: the input of all_reduce,
reduce_scatter, broadcast and send, this rank's contribution to all_gather, and the receive
buffer of recv.
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

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class CommCounter:
    """Totals per (group, collective), plus a full event list while `recording()` is active."""

    def __init__(self):
        self.totals: dict[tuple[str, str], list[int]] = {}  # -> [calls, elements, bytes]
        self._events: list[CommEvent] | None = None

    def record(self, group, op, x):
        n = int(x.size)
        nbytes = int(x.nbytes)
        t = self.totals.setdefault((group, op), [0, 0, 0])
        t[0] += 1
        t[1] += n
        t[2] += nbytes
        if self._events is not None:
            self._events.append(CommEvent(group, op, tuple(x.shape), str(x.dtype), nbytes))

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
            self.counter.record(self.name, op, x)
        return fn(*args)
