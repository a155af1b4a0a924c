"""Host threads (cutp.runtime.threads) where the process's environment differs from this
machine's: no sched_getaffinity, no /proc, no loadable BLAS, a BLAS without OpenBLAS's entry
points, a user's OpenBLAS timeout; and the thread pool's serial sections and growth."""
import types

import numpy as np
import pytest

from cutp.runtime import threads


def test_keep_freed_host_memory_is_false_without_mallopt(monkeypatch):
    def no_libc(_):
        raise OSError("no libc")

    monkeypatch.setattr(threads, "ctypes", types.SimpleNamespace(CDLL=no_libc))
    assert threads.keep_freed_host_memory() is False
    monkeypatch.setattr(threads, "ctypes", types.SimpleNamespace(CDLL=lambda _: object()))  # no mallopt
    assert threads.keep_freed_host_memory() is False


def test_available_cores_falls_back_to_the_cpu_count(monkeypatch):
    monkeypatch.delattr(threads.os, "sched_getaffinity")
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 7)
    assert threads.available_cores() == 7
    monkeypatch.setattr(threads.os, "cpu_count", lambda: None)
    assert threads.available_cores() == 1
    assert threads.threads_per_rank(4) == 1


def test_no_blas_found_sets_the_environment_for_child_processes(monkeypatch):
    def no_proc(*_):
        raise OSError("no /proc")

    monkeypatch.setattr(threads, "open", no_proc, raising=False)  # (the module's global shadows the builtin)
    assert threads._loaded_blas_paths() == []
    monkeypatch.undo()
    monkeypatch.setattr(threads, "_blas", False)  # looked up again, restored afterwards
    monkeypatch.setattr(threads, "_loaded_blas_paths", lambda: ["/nonexistent/libopenblas.so"])
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "9")  # restored afterwards
    assert threads.blas_library() is None
    assert threads.get_blas_threads() is None
    assert threads.set_blas_threads(3) == \
        "BLAS library not found in the process; set OMP_NUM_THREADS=3 for child processes"
    assert [threads.os.environ[v] for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")] == ["3"] * 3
    monkeypatch.delenv("CUTP_OP_THREADS", raising=False)
    assert threads.op_threads() == 1


def test_find_returns_none_when_no_name_is_there():
    lib = types.SimpleNamespace(b=len)
    assert threads._find(lib, ("a", "b")) is len
    assert threads._find(lib, ("a", "c")) is None


class _FakeBlas:
    def __init__(self, n):
        self.n, self.calls = n, []

    def get(self):
        return self.n

    def set(self, n):
        self.calls.append(n)
        self.n = n


def test_parallel_map_runs_the_blas_serially_and_restores_it(monkeypatch):
    blas = _FakeBlas(3)
    monkeypatch.setattr(threads, "_find_blas_threads", lambda: (blas.get, blas.set))
    monkeypatch.delenv("CUTP_OP_THREADS", raising=False)
    seen = []

    def item(i):
        seen.append((threads.op_threads(), blas.n))  # inside: the caller's setting, the BLAS on one thread
        return i * i

    assert threads.parallel_map(np, item, range(5)) == [0, 1, 4, 9, 16]
    assert seen == [(3, 1)] * 5
    assert blas.calls == [1, 3] and threads._serial_depth == 0


def test_parallel_map_without_a_blas_leaves_it_alone(monkeypatch):
    monkeypatch.setattr(threads, "_find_blas_threads", lambda: (None, None))
    monkeypatch.setenv("CUTP_OP_THREADS", "2")
    assert threads.parallel_map(np, lambda i: -i, range(4)) == [0, -1, -2, -3]
    assert threads._serial_depth == 0


def test_parallel_map_runs_every_item_under_the_callers_numpy_error_state(monkeypatch):
    """(NumPy's error state is per thread: a float16 step's np.errstate(over="ignore") reached
    only the calling thread's items; the pool's warned of the overflow the step handles.)"""
    monkeypatch.setattr(threads, "_find_blas_threads", lambda: (None, None))
    monkeypatch.setenv("CUTP_OP_THREADS", "2")
    with np.errstate(over="ignore", invalid="raise"):
        states = threads.parallel_map(np, lambda i: (np.geterr()["over"], np.geterr()["invalid"]), range(4))
    assert states == [("ignore", "raise")] * 4
    assert threads.parallel_map(np, lambda i: np.geterr()["over"], range(4)) == [np.geterr()["over"]] * 4


def test_the_pool_grows_and_is_reused(monkeypatch):
    monkeypatch.setattr(threads, "_pool", None)
    monkeypatch.setattr(threads, "_pool_size", 0)
    monkeypatch.setattr(threads, "_blas_tuned", True)
    small = threads._pool_for(1)
    big = threads._pool_for(2)
    try:
        assert big is not small and small._shutdown and threads._pool_size == 2
        assert threads._pool_for(1) is big
    finally:
        big.shutdown()


@pytest.mark.parametrize("env", ["OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT"])
def test_a_users_openblas_timeout_is_left_as_it_is(monkeypatch, env):
    monkeypatch.setattr(threads, "_blas_tuned", False)
    monkeypatch.setenv(env, "4")
    monkeypatch.setattr(threads, "blas_library", lambda: pytest.fail("looked the BLAS up"))
    threads._quiet_blas_workers()
    assert threads._blas_tuned and threads.os.environ[env] == "4"


def test_a_blas_that_fails_to_quiet_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(threads, "_blas_tuned", False)
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    monkeypatch.delenv("GOTO_THREAD_TIMEOUT", raising=False)

    def broken():
        raise OSError("a BLAS that cannot be asked")

    monkeypatch.setattr(threads, "blas_library", broken)
    threads._quiet_blas_workers()  # no exception
    assert threads._blas_tuned and "OPENBLAS_THREAD_TIMEOUT" not in threads.os.environ
