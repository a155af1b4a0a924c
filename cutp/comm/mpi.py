"""Collectives on NumPy arrays over mpi4py's buffer interface (upper-case methods, no pickling).

bfloat16 and float16 have no standard MPI datatype. Data movement (gather, broadcast, send/recv)
ships their raw 16-bit words; reductions convert to float32, reduce, and round back to the 16-bit
type once. That is at least as accurate as NCCL's native 16-bit reduction (which rounds after
every step of its ring), so a 16-bit sum can differ from NCCL's in the last bit, never by more.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..runtime.backend import get_array_module
from .base import Communicator, PendingExchange, check_array, check_op, dtype_name

_MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "avg": MPI.SUM}
_HALF = ("bfloat16", "float16")  # reduced in float32, moved as raw 16-bit words


def _buf(x):
    """An mpi4py buffer spec that never guesses the datatype."""
    name = dtype_name(x)
    if name in _HALF:
        return [x.view(np.uint16), MPI.UINT16_T]
    return [x, MPI._typedict[np.dtype(x.dtype).char]]


class MpiCommunicator(Communicator):
    kind = "mpi"

    def __init__(self, mpi_comm: MPI.Comm, name: str = "group", owned: bool = False):
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size(), name)
        self.mpi_comm = mpi_comm
        # Only communicators cutp split off itself are freed by close(); the caller's stay.
        self.owned = owned

    # ---- reductions ------------------------------------------------------------------------
    def all_reduce(self, x, op="sum", out=None):
        check_array(x, f"all_reduce on {self.name}")
        check_op(op)
        self._check_out(out, x.shape, x.dtype, f"all_reduce on {self.name}")
        if dtype_name(x) in _HALF:
            acc = x.astype(np.float32)
            self.mpi_comm.Allreduce(MPI.IN_PLACE, _buf(acc), op=_MPI_OPS[op])
            self._finish_avg(acc, op)
            if out is None:
                return acc.astype(x.dtype)
            out[...] = acc
            return out
        if out is None:
            out = get_array_module(x).empty_like(x)
        x, in_place = self._unalias(x, out, x_at=0)
        if in_place:
            self.mpi_comm.Allreduce(MPI.IN_PLACE, _buf(out), op=_MPI_OPS[op])
        else:
            self.mpi_comm.Allreduce(_buf(x), _buf(out), op=_MPI_OPS[op])
        self._finish_avg(out, op)
        return out

    def reduce_scatter(self, x, op="sum", out=None):
        check_array(x, f"reduce_scatter on {self.name}")
        check_op(op)
        shape = self._scatter_shape(x)
        self._check_out(out, shape, x.dtype, f"reduce_scatter on {self.name}")
        if dtype_name(x) in _HALF:
            acc = get_array_module(x).empty(shape, np.float32)
            self.mpi_comm.Reduce_scatter_block(_buf(x.astype(np.float32)), _buf(acc), op=_MPI_OPS[op])
            self._finish_avg(acc, op)
            if out is None:
                return acc.astype(x.dtype)
            out[...] = acc
            return out
        if out is None:
            out = get_array_module(x).empty(shape, x.dtype)
        x, _ = self._unalias(x, out)  # MPI's IN_PLACE would put the result at x[0], not at our slot
        self.mpi_comm.Reduce_scatter_block(_buf(x), _buf(out), op=_MPI_OPS[op])
        self._finish_avg(out, op)
        return out

    def _finish_avg(self, a, op):
        if op != "avg" or self.size == 1:
            return
        if a.dtype.kind == "f":
            a /= self.size
        else:  # integers: C division (toward zero), as NCCL's ncclAvg computes sum / nranks
            neg = a < 0
            xp = get_array_module(a)
            xp.floor_divide(xp.abs(a), self.size, out=a)
            xp.negative(a, out=a, where=neg)

    # ---- data movement -------------------------------------------------------------------
    def all_gather(self, x, out=None):
        check_array(x, f"all_gather on {self.name}")
        shape = self._gather_shape(x)
        self._check_out(out, shape, x.dtype, f"all_gather on {self.name}")
        if out is None:
            out = get_array_module(x).empty(shape, x.dtype)
        x, in_place = self._unalias(x, out, x_at=self.rank * x.nbytes)
        if in_place:
            self.mpi_comm.Allgather(MPI.IN_PLACE, _buf(out))
        else:
            self.mpi_comm.Allgather(_buf(x), _buf(out))
        return out

    def broadcast(self, x, root=0):
        check_array(x, f"broadcast on {self.name}")
        self.mpi_comm.Bcast(_buf(x), root=root)
        return x

    def send(self, x, dest, tag=0):
        check_array(x, f"send on {self.name}")
        self.mpi_comm.Send(_buf(x), dest=dest, tag=tag)

    def recv(self, x, source, tag=0):
        check_array(x, f"recv on {self.name}")
        self.mpi_comm.Recv(_buf(x), source=source, tag=tag)
        return x

    def exchange(self, sends, recvs):
        for x, _, _ in list(sends) + list(recvs):
            check_array(x, f"exchange on {self.name}")
        requests = [self.mpi_comm.Irecv(_buf(x), source=src, tag=tag) for x, src, tag in recvs]
        requests += [self.mpi_comm.Isend(_buf(x), dest=dest, tag=tag) for x, dest, tag in sends]
        MPI.Request.Waitall(requests)
        return [x for x, _, _ in recvs]

    def start_exchange(self, sends, recvs):
        """Isend/Irecv posted now; wait() is their Waitall."""
        for x, _, _ in list(sends) + list(recvs):
            check_array(x, f"exchange on {self.name}")
        requests = [self.mpi_comm.Irecv(_buf(x), source=src, tag=tag) for x, src, tag in recvs]
        requests += [self.mpi_comm.Isend(_buf(x), dest=dest, tag=tag) for x, dest, tag in sends]
        received = [x for x, _, _ in recvs]

        def finish():
            MPI.Request.Waitall(requests)
            return received

        return PendingExchange(finish)

    def all_to_all(self, x, send_counts, recv_counts):
        check_array(x, f"all_to_all on {self.name}")
        send, recv = self._a2a_counts(x, send_counts, recv_counts)
        out = get_array_module(x).empty((sum(recv),) + tuple(x.shape[1:]), x.dtype)
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        (sbuf, stype), (rbuf, rtype) = _buf(x), _buf(out)
        sc, rc = [c * row for c in send], [c * row for c in recv]
        sd, rd = np.cumsum([0] + sc[:-1]).tolist(), np.cumsum([0] + rc[:-1]).tolist()
        self.mpi_comm.Alltoallv([sbuf, (sc, sd), stype], [rbuf, (rc, rd), rtype])
        return out

    def barrier(self):
        self.mpi_comm.Barrier()

    def close(self):
        if self.owned and self.mpi_comm != MPI.COMM_NULL:
            self.mpi_comm.Free()
            self.owned = False
