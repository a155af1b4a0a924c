"""The planner's groups without peers (cutp.comm.shape_only): every collective cutp's
communicators call, on both devices (MPI's communicator over `NoPeersComm`, NCCL's shape-only
one): outputs of a run's shapes and dtypes booked on the context's heap, host data as if every
rank had sent this one's (a sum multiplied by the size, an all-gather repeating it), the
non-blocking forms finished at once, the Python-object forms likewise."""
import numpy as np
import pytest
from mpi4py import MPI

from cutp.comm.shape_only import NoPeersComm, ShapeOnlyContext
from cutp.runtime.shape_only import ShapeArray

F32 = np.float32


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_collective_of_a_group_without_peers(device):
    ctx = ShapeOnlyContext(tp=2, dp=2, rank=3, device=device)
    assert ctx.describe() == f"rank 3/4 mesh {ctx.mesh!r} (shape-only, {device})" and ctx.synchronize() is None
    g, xp = ctx.tp, ctx.xp
    x = xp.empty((4, 6), F32)
    shapes = {
        "all_reduce": (g.all_reduce(x), (4, 6)),
        "all_gather": (g.all_gather(x), (8, 6)),
        "reduce_scatter": (g.reduce_scatter(x), (2, 6)),
        "broadcast": (g.broadcast(x, root=1), (4, 6)),
        "recv": (g.recv(xp.empty((3,), F32), 0), (3,)),
        "all_to_all": (g.all_to_all(xp.empty((5, 6), F32), [2, 3], [2, 3]), (5, 6)),
        "start_all_reduce": (g.start_all_reduce(x).wait(), (4, 6)),
        "start_reduce_scatter": (g.start_reduce_scatter(x).wait(), (2, 6)),
        "start_all_gather": (g.start_all_gather(x).wait(), (8, 6)),
        "start_broadcast": (g.start_broadcast(x, root=0).wait(), (4, 6)),
    }
    for op, (out, shape) in shapes.items():
        assert isinstance(out, ShapeArray) and out.shape == shape and out.dtype == F32, op
    reduced = g.start_reduce(xp.empty((4,), F32), root=g.rank)
    assert reduced.test() and reduced.wait().shape == (4,)  # (the root's result; others get None)
    assert g.start_reduce(xp.empty((4,), F32), root=1 - g.rank).wait() is None
    assert g.send(x, 1 - g.rank) is None and g.barrier() is None
    other, buf = 1 - g.rank, xp.empty((2,), F32)
    assert g.exchange([(xp.empty((2,), F32), other, 0)], [(buf, other, 0)])[0] is buf
    g.start_exchange([(xp.empty((2,), F32), other, 1)], [(buf, other, 1)]).wait()
    assert ctx.counter.bytes() > 0  # (the counting wrapper saw what a run would move)
    ctx.close()
    assert ctx.closed


def test_host_data_as_if_every_rank_sent_this_ones():
    peers = NoPeersComm(1, 4)
    x, out = np.arange(3, dtype=F32), np.zeros(3, F32)
    peers.Allreduce(x, out)
    assert out.tolist() == [0, 4, 8]
    peers.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX)
    assert out.tolist() == [0, 4, 8]
    gathered = np.zeros(12, F32)
    assert peers.Iallgather(x, gathered) == MPI.REQUEST_NULL and gathered.tolist() == [0, 1, 2] * 4
    assert peers.allgather("a") == ["a"] * 4 and peers.bcast(7) == 7 and peers.allreduce(3) == 12
    assert peers.allreduce(3, op=MPI.MAX) == 3 and peers.barrier() is None and peers.Barrier() is None
    for call in (lambda: peers.Bcast(x), lambda: peers.Reduce_scatter_block(x, out), lambda: peers.Alltoallv(x, out),
                 lambda: peers.Send(x, 0), lambda: peers.Recv(out, 0)):
        assert call() is None
    for call in (lambda: peers.Ialltoallv(x, out), lambda: peers.Iallgatherv(x, out), lambda: peers.Igather(x, out),
                 lambda: peers.Ibcast(x), lambda: peers.Isend(x, 0), lambda: peers.Irecv(out, 0)):
        assert call() == MPI.REQUEST_NULL
    one, dup = peers.Split(0, 0), peers.Dup()
    assert (one.Get_rank(), one.Get_size()) == (0, 1) and (dup.Get_rank(), dup.Get_size()) == (1, 4)
    assert dup.Free() is None


def test_the_shape_only_context_closes_as_a_context():
    with ShapeOnlyContext(tp=2, device="cuda") as ctx:
        assert ctx.tp.close() is None  # (NCCL's shape-only group: nothing to tear down)
        host = np.arange(3.0)
        assert ctx.to_numpy(host) is host
    assert ctx.closed
