"""A watchdog for collectives that can block forever on a dead or stuck peer.

MPICH's mpiexec ends a job when a rank dies, but a rank that hangs (a deadlocked peer, a stuck
GPU, a cluster MPI that does not propagate failures) would leave the others waiting in a
collective forever. Every collective is registered with the watchdog while it is in flight
(`cutp.comm.watched.WatchdogCommunicator`; host-side MPI calls with `Watchdog.guard`), and a
training step is watched as a whole (`Watchdog.watch_progress`). A daemon thread aborts the
whole job (MPI Abort, after printing which collective on which group of which rank stalled)
when a collective has been in flight longer than the timeout, or a step has gone that long
without progress (no collective, no micro-batch's forward or backward completing).

Timeout: `cutp.init(collective_timeout=...)`, else the environment variable
CUTP_COLLECTIVE_TIMEOUT (seconds), else 600 s. 0 disables the watchdog.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time

from mpi4py import MPI

from .abort import abort_job
from .deadline import DEFAULT_TIMEOUT_S, check_timeout, default_timeout  # noqa: F401 (re-exported)
from .errors import ConfigError

class Watchdog:
    """Aborts the job when something registered with it waits longer than `timeout_s`.

    Two kinds of registration: a blocking call (`begin`/`end`, `guard`: a collective, a host-side
    MPI reduction) must finish within the timeout; a scope (`watch_progress`: a training step)
    must make progress within it, where progress is any registered call beginning or ending, or
    `progress()`. A scope is how a whole step is watched once: its own host-side reductions are
    covered, and a step that computes for longer than the timeout between collectives is not
    mistaken for a stuck one."""

    def __init__(self, timeout_s: float, rank: int):
        self.timeout = float(timeout_s)
        self.rank = rank
        self._inflight = {}  # token -> (description, start, done() or None, is_scope)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._last_progress = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    def begin(self, description: str, done=None, *, scope: bool = False) -> int:
        token = next(self._ids)
        now = time.monotonic()
        with self._lock:
            self._inflight[token] = (description, now, done, scope)
            self._last_progress = now
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cutp-watchdog", daemon=True)
            self._thread.start()
        return token

    def end(self, token: int) -> None:
        with self._lock:
            self._inflight.pop(token, None)
            self._last_progress = time.monotonic()

    def progress(self) -> None:
        """Tells the watchdog that the current scope is moving (e.g. a micro-batch finished)."""
        self._last_progress = time.monotonic()

    @contextlib.contextmanager
    def guard(self, description: str):
        """Watches a blocking call made outside the communicators (a host-side MPI reduction)."""
        if not self.enabled:
            yield
            return
        token = self.begin(description)
        try:
            yield
        finally:
            self.end(token)

    @contextlib.contextmanager
    def watch_progress(self, description: str):
        """Watches a block (a training step) that must make progress within the timeout: the job
        is aborted when nothing inside it (no collective, no host reduction, no `progress()`) has
        begun or ended for that long."""
        if not self.enabled:
            yield
            return
        token = self.begin(description, scope=True)
        try:
            yield
        finally:
            self.end(token)

    def _poll_s(self, timeout: float) -> float:
        return min(max(timeout / 8, 0.05), 5.0) if timeout > 0 else 5.0

    def _run(self):
        # the timeout may change while the thread runs (configure_host_watchdog): read once a round,
        # so that a round never compares with a timeout it did not check was on
        poll = self._poll_s(self.timeout)
        while not self._stop.wait(poll):
            timeout = self.timeout
            poll = self._poll_s(timeout)
            if timeout <= 0:
                continue
            with self._lock:
                items = list(self._inflight.items())
            # blocking calls first: when a stuck collective stalls the step around it, the
            # collective is what the message names
            for token, (desc, t0, done, scope) in sorted(items, key=lambda item: item[1][3]):
                if done is not None:
                    try:
                        finished = done()
                    except Exception:
                        finished = False
                    if finished:
                        self.end(token)
                        continue
                now = time.monotonic()
                waited = now - (max(t0, self._last_progress) if scope else t0)
                if waited > timeout:
                    self._fire(desc, waited, timeout, scope, [d for t, (d, *_) in items if t != token])

    def _fire(self, desc, waited, timeout, scope=False, others=()):
        what = "has made no progress for" if scope else "has not completed after"
        inside = "".join(f"; also in flight: {d}" for d in others)
        cause = ("A peer rank is probably dead or stuck (or this rank computed that long between two "
                 "collectives)" if scope else "A peer rank is probably dead or stuck")
        abort_job(f"[rank {self.rank}] cutp watchdog: {desc} {what} {waited:.1f} s (timeout {timeout:g} s)"
                  f"{inside}. {cause}; aborting the job. Set "
                  "CUTP_COLLECTIVE_TIMEOUT (or cutp.init(collective_timeout=...), --collective-timeout) to "
                  "change the limit.\n")

    def close(self):
        self._stop.set()


_host_watchdog = None
_host_timeout = None


def configure_host_watchdog(timeout_s: float) -> None:
    """Sets the timeout of `host_watchdog` (cutp.init does, with its collective_timeout)."""
    global _host_timeout
    _host_timeout = float(timeout_s)
    if _host_watchdog is not None:
        _host_watchdog.timeout = _host_timeout


def host_watchdog() -> Watchdog:
    """The watchdog over the host-side MPI collectives cutp makes outside a Context's
    communicators (the cross-rank configuration checks, the agreement on an error): a peer stuck
    there ends the job like anywhere else. Its timeout is the newest Context's collective_timeout;
    before any, $CUTP_COLLECTIVE_TIMEOUT or the default (a malformed variable is reported by
    cutp.init, not here: this runs inside the error agreement itself)."""
    global _host_watchdog
    if _host_watchdog is None:
        timeout = _host_timeout
        if timeout is None:
            try:
                timeout = default_timeout()
            except ConfigError:
                timeout = DEFAULT_TIMEOUT_S
        _host_watchdog = Watchdog(timeout, MPI.COMM_WORLD.Get_rank())
    return _host_watchdog
