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

    def exchange(self, sends, recvs):
        self.clock.t += self.real
        return [r for r, _, _ in recvs]

    def barrier(self):
        self.clock.t += self.real


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


def test_point_to_point_transfers_and_barriers_on_the_link(link):
    clock, inner, comm = link
    got = np.zeros_like(MB)
    t0 = clock.t
    assert comm.exchange([(MB, 1, 0)], [(got, 1, 0)])[0] is got  # 1 MB sent: 1 ms
    assert clock.t - t0 == pytest.approx(1e-3)
    req = comm.start_exchange([(MB, 1, 0)], [(got, 1, 0)])
    clock.t += 5e-3  # computing for 5 ms hides the second
    assert req.test() and req.wait()[0] is got
    assert comm.link.times["dp"] == pytest.approx([2e-3, 1e-3])
    t0, inner.real = clock.t, 0.5e-3
    comm.barrier()  # no data: the real barrier's time only, nothing on the link
    assert clock.t - t0 == pytest.approx(0.5e-3) and comm.link.times["dp"] == pytest.approx([2e-3, 1e-3])


@pytest.mark.parametrize("bandwidth,latency", [(0.0, 1.0), (10.0, -1.0)])
def test_a_link_needs_a_bandwidth_and_a_latency(bandwidth, latency):
    with pytest.raises(ValueError, match="a simulated link needs bandwidth > 0 GB/s and latency >= 0 us"):
        simulated.Link(bandwidth, latency)
