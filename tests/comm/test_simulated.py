"""Issue 30: the simulated link (cutp.comm.simulated) on a fake clock: transfers take latency +
wire bytes / bandwidth, one at a time, on the compute clock (time in the real collectives does
not hide them), and its account says how much of that this rank waited for."""
import types

import numpy as np
import pytest

from cutp.comm import simulated
from cutp.comm.base import Communicator, DoneRequest


class _Clock:
    def __init__(self):
        self.t = 100.0

    def perf_counter(self):
        return self.t

    def sleep(self, s):
        self.t += s


class _Instant(Communicator):
    """Two ranks whose collectives take `real` seconds of the fake clock."""

    kind = "mpi"

    def __init__(self, clock):
        super().__init__(0, 2, "dp")
        self.clock, self.real = clock, 0.0

    def all_reduce(self, x, op="sum", out=None):
        self.clock.t += self.real
        return x

    def start_all_reduce(self, x, op="sum", out=None):
        clock, real = self.clock, self.real

        class _Slow(DoneRequest):
            def wait(self):
                clock.t += real
                return x

        return _Slow("all_reduce", x)


@pytest.fixture
def link(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(simulated, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, sleep=clock.sleep))
    inner = _Instant(clock)
    return clock, inner, simulated.SimulatedLinkCommunicator(inner, simulated.Link(1.0, 0.0))


MB = np.zeros(250_000, np.float32)  # 1 MB: an all-reduce over 2 ranks sends 1 MB, 1 ms at 1 GB/s


def test_a_blocking_collective_waits_for_its_transfer(link):
    clock, _, comm = link
    t0 = clock.t
    comm.all_reduce(MB)
    assert clock.t - t0 == pytest.approx(1e-3)
    assert comm.link.times["dp"] == pytest.approx([1e-3, 1e-3])


def test_computation_after_the_start_hides_the_transfer_and_real_waits_do_not(link):
    clock, inner, comm = link
    req = comm.start_all_reduce(MB)
    clock.t += 5e-3  # computing for 5 ms
    assert req.test()
    req.wait()
    assert comm.link.times["dp"] == pytest.approx([1e-3, 0.0])
    inner.real = 10e-3  # the real transfer takes 10 ms of this rank's time, inside the wait
    req = comm.start_all_reduce(MB)
    clock.t += 0.3e-3  # computing for 0.3 ms only
    assert not req.test()
    req.wait()
    assert comm.link.times["dp"] == pytest.approx([2e-3, 0.7e-3])  # not hidden by the real 10 ms


def test_the_link_carries_one_transfer_at_a_time(link):
    clock, _, comm = link
    first, second = comm.start_all_reduce(MB), comm.start_all_reduce(MB)  # the second starts at 1 ms
    clock.t += 1.5e-3
    assert first.test() and not second.test()
    first.wait()
    second.wait()
    assert comm.link.times["dp"] == pytest.approx([2e-3, 0.5e-3])
