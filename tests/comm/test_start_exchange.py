"""`Communicator.start_exchange` (context parallelism's ring): posted now, finished by wait().

MPI: Isend/Irecv posted at once (a neighbour's data can arrive while this rank computes), the
receive buffers filled after wait(). NCCL, with a stand-in CuPy and NCCL that record the calls:
the group is queued on the communicator's side stream after an event of the caller's stream
(the buffers were written there), and wait() makes the caller's stream wait for the group's end.
The counters count it as exchange does.
"""
import sys
import types

import numpy as np

from cutp.comm import nccl as nccl_module
from cutp.comm.counting import CommCounter, CountingCommunicator
from tests.mpirun import run_mpi


def _worker_ring():
    from mpi4py import MPI
    from cutp.comm.mpi import MpiCommunicator

    comm = MpiCommunicator(MPI.COMM_WORLD.Dup(), "cp", owned=True)
    counter = CommCounter()
    group = CountingCommunicator(comm, counter)
    r, n = group.rank, group.size
    mine = np.full(3, float(r))
    got = np.zeros(3)
    pending = group.start_exchange([(mine, (r + 1) % n, 7)], [(got, (r - 1) % n, 7)])
    busy = float(np.arange(1000.0).sum())  # the compute the transfer overlaps
    assert pending.wait() == [got] and pending.wait() == [got] and busy > 0  # (a second wait returns at once)
    assert np.array_equal(got, np.full(3, float((r - 1) % n)))
    assert counter.calls("cp", "send") == counter.calls("cp", "recv") == 1 and counter.bytes("cp", "send") == 24
    comm.close()


def test_mpi_start_exchange_passes_a_ring():
    run_mpi(3, "tests.comm.test_start_exchange:_worker_ring", timeout=60)


class _Stream:
    def __init__(self, name, log):
        self.name, self.log, self.ptr = name, log, id(self)

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.on))

    def record(self, event=None):  # (CuPy's Stream.record: a new event recorded on this stream)
        event = event or _Event(self.log)
        event.record(self)
        return event

    def __enter__(self):
        self.log.append(("enter", self.name))
        _FakeCupy.current.append(self)

    def __exit__(self, *exc):
        _FakeCupy.current.pop()


class _Event:
    def __init__(self, log, disable_timing=True):
        self.log, self.on = log, None

    def record(self, stream):
        self.on = stream.name
        self.log.append(("record", stream.name))


class _FakeCupy:
    current: list = []


def test_nccl_start_exchange_queues_on_a_side_stream_and_wait_joins_it(monkeypatch):
    log = []
    main = _Stream("main", log)
    _FakeCupy.current = [main]
    cuda = types.SimpleNamespace(get_current_stream=lambda: _FakeCupy.current[-1],
                                 Stream=lambda non_blocking=True: _Stream("side", log),
                                 Event=lambda disable_timing=True: _Event(log))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(nccl_module, "check_array", lambda x, what: None)

    class Nccl:  # the communicator's calls, with the stream each is queued on
        def send(self, ptr, count, dtype, peer, stream):
            log.append(("send", peer, "main" if stream == main.ptr else "side"))

        def recv(self, ptr, count, dtype, peer, stream):
            log.append(("recv", peer, "main" if stream == main.ptr else "side"))

    group_calls = types.SimpleNamespace(groupStart=lambda: log.append(("groupStart",)),
                                        groupEnd=lambda: log.append(("groupEnd",)))
    comm = object.__new__(nccl_module.NcclCommunicator)
    comm.rank, comm.size, comm.name, comm.nccl_comm = 0, 2, "cp", Nccl()
    comm._group = lambda: group_calls
    buf = types.SimpleNamespace(data=types.SimpleNamespace(ptr=1), size=4, dtype=np.float32)
    pending = comm.start_exchange([(buf, 1, 0)], [(buf, 1, 0)])
    assert log == [("record", "main"), ("wait", "side", "main"), ("enter", "side"), ("groupStart",),
                   ("send", 1, "side"), ("recv", 1, "side"), ("groupEnd",), ("record", "side")]
    log.clear()
    assert pending.wait() == [buf]
    assert log == [("wait", "main", "side")]  # the caller's stream waits for the group's end
