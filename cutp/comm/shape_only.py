"""A context for one rank of a mesh that does not exist: the planner's (cutp.plan).

`ShapeOnlyContext(tp=8, dp=4, rank=5, device="cuda")` has every attribute of a `Context` (the
mesh coordinates, the groups, the counter, the watchdog, `xp`), but its arrays are shape-only
(cutp.runtime.shape_only: their buffers booked on `ctx.xp.heap`) and its groups talk to nobody:
each group is the real communicator class of the device (MpiCommunicator on the CPU, NCCL's on
a GPU) over a transport with no peers, so a collective allocates what it allocates in a run
(its outputs, the float32 copies MPI reduces 16-bit data in) and moves nothing. Host-side
agreements (the checks that every rank has the same configuration, the errors raised on every
rank) see every rank answer as this one does.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..runtime import backend
from ..runtime.mesh import Mesh
from ..runtime.shape_only import ShapeArray, ShapeOnly
from ..runtime.watchdog import Watchdog
from .base import Communicator
from .context import Context, set_rank_attributes, stand_in
from .counting import CommCounter, CountingCommunicator
from .mpi import MpiCommunicator
from .nccl import NcclCommunicator


def _host_buffer(spec):
    """The NumPy array of an mpi4py buffer spec ([array, datatype] or the array), or None for a
    shape-only array (nothing to move)."""
    a = spec[0] if isinstance(spec, (list, tuple)) else spec
    if isinstance(a, ShapeArray) or a is MPI.IN_PLACE:
        return None
    return np.asarray(a)


class NoPeersComm:
    """The subset of an mpi4py communicator cutp calls, for a group of `size` ranks of which only
    this one exists: every other rank is taken to send what this one sends (so an all-gather of
    host data repeats it, a sum multiplies it by the size), and shape-only buffers are left as
    they are."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    # ---- buffers -------------------------------------------------------------------------------
    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        out = _host_buffer(recvbuf)
        if out is None:
            return
        src = out if sendbuf is MPI.IN_PLACE else _host_buffer(sendbuf)
        out[...] = src * self.size if op == MPI.SUM else src

    def Allgather(self, sendbuf, recvbuf):
        out = _host_buffer(recvbuf)
        if out is None:
            return
        src = _host_buffer(sendbuf)
        if src is not None:
            out.reshape(self.size, -1)[...] = src.reshape(1, -1)

    def Bcast(self, buf, root=0):
        return None

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        return None

    def Alltoallv(self, sendbuf, recvbuf):
        return None

    def Send(self, buf, dest, tag=0):
        return None

    def Recv(self, buf, source, tag=0):
        return None

    def Isend(self, buf, dest, tag=0):
        return MPI.REQUEST_NULL

    def Irecv(self, buf, source, tag=0):
        return MPI.REQUEST_NULL

    def Barrier(self):
        return None

    # non-blocking: nothing to wait for (the contents of a shape-only group do not matter)
    def Ialltoallv(self, sendbuf, recvbuf):
        return MPI.REQUEST_NULL

    def Iallgatherv(self, sendbuf, recvbuf):
        return MPI.REQUEST_NULL

    def Iallgather(self, sendbuf, recvbuf):
        self.Allgather(sendbuf, recvbuf)
        return MPI.REQUEST_NULL

    def Igather(self, sendbuf, recvbuf, root=0):
        return MPI.REQUEST_NULL

    def Ibcast(self, buf, root=0):
        return MPI.REQUEST_NULL

    # ---- Python objects ------------------------------------------------------------------------
    def allgather(self, obj):
        return [obj] * self.size

    def bcast(self, obj, root=0):
        return obj

    def allreduce(self, obj, op=MPI.SUM):
        return obj * self.size if op == MPI.SUM else obj

    def barrier(self):
        return None

    def Split(self, color=0, key=0):
        return NoPeersComm(0, 1)

    def Dup(self):
        return NoPeersComm(self.rank, self.size)

    def Free(self):
        return None


class _NoNccl:
    """The NCCL communicator and group calls of a group without peers."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class ShapeOnlyNcclCommunicator(NcclCommunicator):
    """NCCL's collectives (what they allocate: their outputs; 16-bit data reduced natively) on
    shape-only GPU arrays, moving nothing."""

    def __init__(self, mpi_comm: NoPeersComm, name: str, xp: ShapeOnly):
        super(NcclCommunicator, self).__init__(mpi_comm.Get_rank(), mpi_comm.Get_size(), name)
        self.mpi_comm, self.xp = mpi_comm, xp
        self.nccl_comm = _NoNccl()

    def _stream(self):
        return 0

    def _empty(self, shape, dtype):
        return self.xp.empty(shape, dtype)

    def _group(self):
        return _NoNccl()

    # no streams, no NCCL: the blocking collectives, finished at once (Communicator's defaults)
    start_all_reduce = Communicator.start_all_reduce
    start_reduce_scatter = Communicator.start_reduce_scatter
    start_reduce = Communicator.start_reduce
    start_all_gather = Communicator.start_all_gather
    start_broadcast = Communicator.start_broadcast
    start_exchange = Communicator.start_exchange  # (no side stream: nothing moves)

    def barrier(self):
        return None

    def close(self):
        return None


class ShapeOnlyContext:
    """The planner's stand-in of `cutp.comm.context.Context` for world rank `rank` of a mesh
    (`Mesh(tp, dp, pp, ep)`, or `mesh=` any mesh of named dimensions), on device "cpu" (NumPy's
    allocations, MPI's collectives) or "cuda" (CuPy's pool, NCCL's); `threads`: the CPU ops'
    threads. Its groups are Context's own (`Context.GROUPS`, `Context.UNLESS_CARVED`), sized and
    ranked by the mesh, so a new mesh dimension reaches the planner with no change here."""

    def __init__(self, *, tp: int = 1, dp: int = 1, pp: int = 1, ep: int = 1, rank: int = 0, device: str = "cpu",
                 threads: int = 1, mesh: Mesh | None = None, cp: int = 1):
        self.mesh = Mesh(tp, dp, pp, ep, cp=cp) if mesh is None else mesh
        self.rank, self.world_size = rank, self.mesh.size
        set_rank_attributes(self, self.mesh, rank, Context.GROUPS)  # as Context sets them
        self.local_rank, self.local_size = 0, 1
        self.device, self.device_id = device, None
        self.xp = ShapeOnly(device, threads)
        self.counter = CommCounter()
        self.watchdog = Watchdog(0, rank)
        self.world = self._group("world", rank, self.world_size)
        for name, dims in Context.GROUPS:
            unsplit, instead = stand_in(self.mesh, name)
            if unsplit:
                setattr(self, name, None if instead is None else getattr(self, instead))
                continue
            members = self.mesh.group(rank, *dims)
            setattr(self, name, self._group(name, members.index(rank), len(members)))
        ends = self.pp_size > 1 and self.pp_rank in (0, self.pp_size - 1)
        self.embedding = self._group("embedding", 0 if self.pp_rank == 0 else 1, 2) if ends else None
        self._extra_groups = {}
        self.closed = False

    def _group(self, name, rank, size):
        peers = NoPeersComm(rank, size)
        comm = (ShapeOnlyNcclCommunicator(peers, name, self.xp) if self.device == "cuda"
                else MpiCommunicator(peers, name))
        return CountingCommunicator(comm, self.counter)

    def subgroup(self, name: str, color: int, key: int, of=None, expect: tuple | None = None):
        if name not in self._extra_groups:  # (sized by `expect`; else one rank)
            self._extra_groups[name] = self._group(name, *(expect or (0, 1)))
        return self._extra_groups[name]

    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype)

    def to_numpy(self, a):
        return backend.to_numpy(a)

    def synchronize(self) -> None:
        return None

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size} mesh {self.mesh!r} (shape-only, {self.device})"

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
