"""A watchdog for collectives that can block forever on a dead or stuck peer.

MPICH's mpiexec ends a job when a rank dies, but a rank that hangs (a deadlocked peer, a stuck
GPU, a cluster MPI that does not propagate failures) would leave the others waiting in a
collective forever. Every collective is registered with the watchdog while it is in flight
(`cutp.comm.watched.WatchdogCommunicator`; host-side MPI calls with `Watchdog.guard`). A daemon thread
aborts the whole job (MPI Abort, after printing which collective on which group of which rank
stalled) when one has been in flight longer than the timeout.

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
from .errors import ConfigError

DEFAULT_TIMEOUT_S = 600.0


def default_timeout() -> float:
    """$CUTP_COLLECTIVE_TIMEOUT (seconds, 0 = no watchdog), else DEFAULT_TIMEOUT_S."""
    v = os.environ.get("CUTP_COLLECTIVE_TIMEOUT")
    if v in (None, ""):
        return DEFAULT_TIMEOUT_S
    return check_timeout(v, "CUTP_COLLECTIVE_TIMEOUT")


def check_timeout(value, what: str = "collective_timeout") -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds >= 0 or seconds == float("inf"):
        raise ConfigError(f"{what}={value!r} is not a number of seconds >= 0; use e.g. 600, or 0 to turn "
                          "the collective watchdog off")
    return seconds


class Watchdog:
    def __init__(self, timeout_s: float, rank: int):
        self.timeout = float(timeout_s)
        self.rank = rank
        self._inflight = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    def begin(self, description: str, done=None) -> int:
        token = next(self._ids)
        with self._lock:
            self._inflight[token] = (description, time.monotonic(), done)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cutp-watchdog", daemon=True)
            self._thread.start()
        return token

    def end(self, token: int) -> None:
        with self._lock:
            self._inflight.pop(token, None)

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

    def _run(self):
        # the timeout may change while the thread runs (configure_host_watchdog): poll after it
        while not self._stop.wait(min(max(self.timeout / 8, 0.05), 5.0) if self.enabled else 5.0):
            if not self.enabled:
                continue
            now = time.monotonic()
            with self._lock:
                items = list(self._inflight.items())
            for token, (desc, t0, done) in items:
                if done is not None:
                    try:
                        finished = done()
                    except Exception:
                        finished = False
                    if finished:
                        self.end(token)
                        continue
                if now - t0 > self.timeout:
                    self._fire(desc, now - t0)

    def _fire(self, desc, waited):
        abort_job(f"[rank {self.rank}] cutp watchdog: {desc} has not completed after {waited:.1f} s "
                  f"(timeout {self.timeout:g} s). A peer rank is probably dead or stuck; aborting the job. "
                  "Set CUTP_COLLECTIVE_TIMEOUT (or cutp.init(collective_timeout=...)) to change the limit.\n")

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
