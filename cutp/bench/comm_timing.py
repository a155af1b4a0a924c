"""`bench model`'s communication timing: each of the context's communicators (inside its
CountingCommunicator) wrapped in a TimedCommunicator that times every collective into a CommClock,
per phase of the step and per group.collective, without changing what it does (cutp.bench.model's
docstring: what is measured on the CPU and on a GPU)."""
from __future__ import annotations

import time

import numpy as np

from ..comm.base import Request


class CommClock:
    """Accumulates collective time per phase; on the GPU from event pairs read at `collect`."""

    def __init__(self, xp):
        self.xp = xp
        self.phase = "other"
        self.seconds: dict[str, float] = {}
        self.by_op: dict[str, float] = {}
        self._events = []

    def reset(self):
        self.seconds, self.by_op, self._events = {}, {}, []

    def add(self, key, seconds):
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + seconds
        self.by_op[key] = self.by_op.get(key, 0.0) + seconds

    def collect(self):
        """Reads the GPU events (call after synchronising)."""
        if self._events:
            import cupy  # optional dependency

            for phase, key, a, b in self._events:
                s = cupy.cuda.get_elapsed_time(a, b) / 1e3
                self.seconds[phase] = self.seconds.get(phase, 0.0) + s
                self.by_op[key] = self.by_op.get(key, 0.0) + s
            self._events = []


def _timed(name):
    def method(self, *args, **kwargs):
        return _timed_call(self.clock, f"{self.name}.{name}", getattr(self.inner, name), *args, **kwargs)

    method.__name__ = name
    return method


class _TimedRequest(Request):
    """A non-blocking collective's request (`start_*`) whose calls are timed into `clock` under
    `key`, in the phase current at each call (where the step waits, not where it started).
    CPU: host time in its test() and wait() calls (MPI advances the collective and adds the
    ranks' pieces inside them; cutp.comm.mpi), as the blocking calls' whole time is taken. GPU:
    the wait only, as CUDA events recorded on the current stream just before and after it:
    wait() makes that stream wait for the collective's event (cutp.comm.nccl), so their
    interval is the time the computation stalled on it, zero when it was hidden; the collective's
    own time on the communication stream is not counted (the overlap table has its time in flight)."""

    def __init__(self, inner, clock: CommClock, key: str):
        self.inner, self.clock, self.key = inner, clock, key
        self.op = inner.op

    def test(self) -> bool:
        if self.clock.xp is not np:
            return self.inner.test()
        t0 = time.perf_counter()
        try:
            return self.inner.test()
        finally:
            self.clock.add(self.key, time.perf_counter() - t0)

    def wait(self):
        return _timed_call(self.clock, self.key, self.inner.wait)

    def __getattr__(self, item):  # (the request's other attributes: result, ...)
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)


def _timed_call(clock: CommClock, key: str, call, *args, **kwargs):
    """call(*args, **kwargs), its time added to clock under key: host perf_counter on the CPU,
    CUDA events around it on the current stream on the GPU (read at `collect`)."""
    if clock.xp is np:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            clock.add(key, time.perf_counter() - t0)
    import cupy  # optional dependency

    stream = cupy.cuda.get_current_stream()
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    a.record(stream)
    r = call(*args, **kwargs)
    b.record(stream)
    clock._events.append((clock.phase, key, a, b))
    return r


def _timed_start(name):
    """`start_<name>`: on the CPU the start's own host time (posting MPI's requests), then its
    request's calls (_TimedRequest), under the key of the blocking `name`."""
    def method(self, *args, **kwargs):
        key = f"{self.name}.{name}"
        start = getattr(self.inner, f"start_{name}")
        if self.clock.xp is np:
            request = _timed_call(self.clock, key, start, *args, **kwargs)
        else:  # (a GPU's start only queues the collective on the communication stream)
            request = start(*args, **kwargs)
        return _TimedRequest(request, self.clock, key)

    method.__name__ = f"start_{name}"
    return method


class TimedCommunicator:
    """Forwards everything to `inner`; times the collectives into `clock`, the blocking ones and
    the non-blocking ones (ZeRO-3's gathers, ZeRO-2/3's reduce-scatters, HSDP's and the gradient
    buckets' all-reduces; `_timed_start`)."""

    def __init__(self, inner, clock: CommClock):
        self.inner = inner
        self.clock = clock
        self.name, self.rank, self.size, self.kind = inner.name, inner.rank, inner.size, inner.kind

    all_reduce = _timed("all_reduce")
    all_gather = _timed("all_gather")
    reduce_scatter = _timed("reduce_scatter")
    broadcast = _timed("broadcast")
    send = _timed("send")
    recv = _timed("recv")
    barrier = _timed("barrier")
    start_all_reduce = _timed_start("all_reduce")
    start_all_gather = _timed_start("all_gather")
    start_reduce_scatter = _timed_start("reduce_scatter")
    start_reduce = _timed_start("reduce")
    start_broadcast = _timed_start("broadcast")

    def __getattr__(self, item):
        return getattr(self.inner, item)


def install_comm_timing(ctx, clock: CommClock) -> None:
    """Wraps the raw communicator inside each of ctx's counted groups (idempotent)."""
    groups = [ctx.world, ctx.tp, ctx.dp, *getattr(ctx, "_extra_groups", {}).values()]
    for g in groups:
        if not isinstance(g.inner, TimedCommunicator):
            g.inner = TimedCommunicator(g.inner, clock)
