"""The failure handling's branches that only a multi-rank job's rare events reach, run in this
process with the job's shape faked (a world of 2 ranks, a job ender that records instead of
aborting): a thread's exception, a one-line error one rank alone raised, ranks that never meet at
exit, an exception class another rank cannot rebuild; the setup deadline's message, a malformed
$CUTP_COLLECTIVE_TIMEOUT, and the watchdog when a collective's completion test itself fails."""
import io
import sys
import threading
import types

import pytest

from cutp.runtime import deadline, failure, watchdog
from cutp.runtime.errors import ConfigError


class _Ended(Exception):
    """What the faked job ender raises: abort_job never returns."""


@pytest.fixture
def two_ranks(monkeypatch):
    """COMM_WORLD of 2 ranks (this one rank 0) as failure.py sees it; abort_job recorded."""
    world = types.SimpleNamespace(Get_size=lambda: 2, Get_rank=lambda: 0)
    monkeypatch.setattr(failure, "MPI", types.SimpleNamespace(COMM_WORLD=world))
    ended = []

    def abort_job(message="", code=1):
        ended.append((message, code))
        raise _Ended

    monkeypatch.setattr(failure, "abort_job", abort_job)
    monkeypatch.setattr(failure, "wait_for_output_to_drain", lambda *a, **k: None)
    return ended


def test_an_exception_in_a_thread_ends_the_job_naming_the_thread(two_ranks, monkeypatch):
    monkeypatch.setattr(failure, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # (restored after the test)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    assert failure.install_abort_on_error() is True
    hook = threading.excepthook
    hook(types.SimpleNamespace(exc_type=SystemExit, exc_value=SystemExit(0), exc_traceback=None, thread=None))
    assert two_ranks == []  # a thread's SystemExit ends nothing
    try:
        raise ValueError("the loader's file vanished")
    except ValueError as e:
        args = types.SimpleNamespace(exc_type=ValueError, exc_value=e, exc_traceback=e.__traceback__,
                                     thread=types.SimpleNamespace(name="cutp-loader"))
    with pytest.raises(_Ended):
        hook(args)
    message, code = two_ranks[0]
    assert message.startswith("[rank 0] exception in thread cutp-loader:\n") and code == 1
    assert "ValueError: the loader's file vanished" in message
    with pytest.raises(_Ended):  # the same error in the main thread, raised on this rank only
        sys.excepthook(ValueError, args.exc_value, args.exc_traceback)
    message, code = two_ranks[1]
    assert message.startswith("[rank 0] Traceback (most recent call last):\n") and code == 1
    assert message.endswith("[rank 0] ValueError: the loader's file vanished\n")


def test_a_one_line_error_only_this_rank_raised_ends_the_job_with_it(two_ranks):
    with pytest.raises(_Ended):
        with failure.config_errors_exit("cutp"):
            raise ConfigError("--lr -1 is not a number > 0")
    assert two_ranks == [("[rank 0] cutp: error: --lr -1 is not a number > 0\n", 2)]


class _Barrier:
    def __init__(self, comes):
        self.comes = comes

    def Ibarrier(self):
        if self.comes is None:
            raise RuntimeError("the communicator was freed")
        return types.SimpleNamespace(Test=lambda: self.comes)


def _every_rank(exit_comm, spans_job):
    every = object.__new__(failure.EveryRank)  # (its constructor makes MPI communicators)
    every.reporter, every.i_report, every.spans_job, every.exit_comm = 0, True, spans_job, exit_comm
    return every


@pytest.mark.parametrize("meet,spans_job,ended", [
    (False, True, "[rank 0] not every rank stopped on this error within 0.05 s; aborting the job\n"),
    (True, False, ""),  # part of the job: the ranks meet, then end the job
])
def test_an_agreed_error_ends_the_job_when_its_ranks_cannot_exit_alone(two_ranks, capsys, monkeypatch, meet,
                                                                       spans_job, ended):
    monkeypatch.setattr(failure, "EXIT_BARRIER_TIMEOUT", 0.05)
    error = ConfigError("--tp 3 does not divide 4 heads")
    error.cutp_every_rank = _every_rank(_Barrier(meet), spans_job=spans_job)
    with pytest.raises(_Ended):
        with failure.config_errors_exit("cutp"):
            raise error
    assert two_ranks == [(ended, 2)]
    assert capsys.readouterr().err == "cutp: error: --tp 3 does not divide 4 heads\n"  # printed once, first


def test_ranks_cannot_meet_on_a_communicator_that_fails():
    assert failure._exit_together(_Barrier(None), timeout=1.0) is False
    assert failure._exit_together(_Barrier(True), timeout=1.0) is True


def test_an_exception_is_rebuilt_as_its_nearest_class_this_rank_can_make():
    # UnicodeDecodeError's constructor takes five arguments: its base ValueError is made instead
    e = failure._rebuild(["builtins:UnicodeDecodeError", "builtins:ValueError", "builtins:Exception"], "bad bytes")
    assert type(e) is ValueError and str(e) == "bad bytes"
    e = failure._rebuild(["cutp.no_such_module:ShardError", "builtins:OSError", "builtins:Exception"], "gone")
    assert type(e) is OSError
    e = failure._rebuild(["cutp.no_such_module:ShardError", "builtins:Exception"], "gone")
    assert type(e) is failure.JobError and str(e) == "gone"


@pytest.mark.parametrize("argv", [[], ["--collective-timeout", "soon"]])
def test_a_malformed_timeout_variable_falls_back_to_the_default(monkeypatch, argv):
    monkeypatch.setenv("CUTP_COLLECTIVE_TIMEOUT", "ten minutes")
    assert deadline.timeout_from_argv(argv) == deadline.DEFAULT_TIMEOUT_S
    monkeypatch.setattr(watchdog, "_host_watchdog", None)
    monkeypatch.setattr(watchdog, "_host_timeout", None)
    wd = watchdog.host_watchdog()
    try:
        assert wd.timeout == deadline.DEFAULT_TIMEOUT_S and watchdog.host_watchdog() is wd
    finally:
        wd.close()


def test_the_setup_deadline_says_why_before_it_fires(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "__stderr__", err)
    deadline._explain(42.0)
    text = err.getvalue()
    assert "a setup phase (MPI initialisation, NCCL's bootstrap, building or loading the model) has not finished " \
           "within 42 s (--collective-timeout)" in text and text.endswith("ending this rank\n")


def test_a_collective_whose_completion_test_fails_counts_as_still_in_flight(monkeypatch):
    fired = threading.Event()
    messages = []

    def abort_job(message="", code=1):
        messages.append(message)
        fired.set()

    monkeypatch.setattr(watchdog, "abort_job", abort_job)
    wd = watchdog.Watchdog(0.3, rank=3)

    def done():
        raise RuntimeError("the request was freed")

    try:
        wd.begin("all_reduce on tp", done=done)
        assert fired.wait(20), "the watchdog never fired"
    finally:
        wd.close()
    assert messages[0].startswith("[rank 3] cutp watchdog: all_reduce on tp has not completed after")


def test_the_host_watchdog_turned_off_while_its_thread_runs_fires_no_more(monkeypatch):
    """A newer cutp.init(collective_timeout=0) turns the host watchdog off while its thread runs
    (configure_host_watchdog): what is in flight then never fires, however long it waits."""
    import time

    fired = threading.Event()
    monkeypatch.setattr(watchdog, "abort_job", lambda message: fired.set())
    monkeypatch.setattr(watchdog, "_host_timeout", watchdog._host_timeout)  # (restored after)
    monkeypatch.setattr(watchdog, "_host_watchdog", watchdog.Watchdog(0.3, rank=0))
    wd = watchdog.host_watchdog()
    try:
        wd.end(wd.begin("a first check"))  # (its thread started, polling every 0.05 s)
        watchdog.configure_host_watchdog(0)
        wd.begin("the configuration check (host all-gather)")  # (never ends)
        time.sleep(0.8)  # (past the 0.3 s it had)
        assert not fired.is_set() and wd.timeout == 0
    finally:
        wd.close()


def test_output_drain_skips_what_is_no_pipe_and_waits_for_a_pipes_reader(tmp_path):
    import os
    import time

    from cutp.runtime.abort import wait_for_output_to_drain

    with open(tmp_path / "log", "w") as f:
        t0 = time.monotonic()
        wait_for_output_to_drain(timeout=60.0, fds=(f.fileno(), 10 ** 6))  # a file, a closed descriptor
        assert time.monotonic() - t0 < 30.0  # (not the timeout: nothing to wait for)
    r, w = os.pipe()
    try:
        os.write(w, b"unread")
        t0 = time.monotonic()
        wait_for_output_to_drain(timeout=0.2, fds=(w,))  # nobody reads: up to the timeout
        assert time.monotonic() - t0 >= 0.2
    finally:
        os.close(r)
        os.close(w)
