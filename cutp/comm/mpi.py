"""Collectives on NumPy arrays over mpi4py's buffer interface (upper-case methods, no pickling).

bfloat16 and float16 have no standard MPI datatype. Data movement (gather, broadcast, send/recv)
ships their raw 16-bit words; reductions convert to float32, reduce, and round back to the 16-bit
type once. That is at least as accurate as NCCL's native 16-bit reduction (which rounds after
every step of its ring), so a 16-bit sum can differ from NCCL's in the last bit, never by more.

Non-blocking reductions sum in rank order. MPICH chooses its reduction algorithm (and so the
order in which the ranks' values are added) by message size and by blocking or not: at 4 ranks
Reduce_scatter_block and Ireduce_scatter_block of the same 256K floats differ in the last bits,
and so do one call and the same buffer cut in three. The gradient buckets
(cutp.optim.buckets) must give the same bits however the buffer is cut and whenever each piece
starts, so `start_all_reduce`, `start_reduce_scatter` and `start_reduce` let MPI only move data
(Ialltoallv, Igather, Iallgatherv: no arithmetic) and add the ranks' values here, rank 0's
first: (((x0 + x1) + x2) + x3) for every element, whatever the cut. The bytes on the wire are
the ring algorithms': (n-1)/n of the input for a reduce-scatter, twice that for an all-reduce.

Progress: MPI-3 does not promise that a non-blocking collective progresses outside MPI calls,
and MPICH does not without its progress thread (MPIR_CVAR_ASYNC_PROGRESS, which needs
MPI_THREAD_MULTIPLE and a spare core per rank; this machine has none to spare). So a
`Request.test()` (MPI_Test) is called from the training step between layers: each call advances
the collective, and a multi-phase one (all-reduce: exchange, add, gather) posts its next phase
there.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..runtime.backend import get_array_module
from .base import Communicator, Request, check_array, check_op, dtype_name

_MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "avg": MPI.SUM}
_HALF = ("bfloat16", "float16")  # reduced in float32, moved as raw 16-bit words


def _buf(x):
    """An mpi4py buffer spec that never guesses the datatype."""
    name = dtype_name(x)
    if name in _HALF:
        return [x.view(np.uint16), MPI.UINT16_T]
    return [x, MPI._typedict[np.dtype(x.dtype).char]]


def _words(x):
    """The raw buffer of x for data movement: 16-bit types as their words."""
    return x.view(np.uint16) if dtype_name(x) in _HALF else x


def _ordered_sum(rows, op: str, size: int, dtype):
    """rows [size, n] (rank r's contribution in row r) reduced in rank order: float32 for 16-bit
    types (rounded once, after avg's division, as the blocking reductions do), returned in dtype."""
    acc_dtype = np.float32 if np.dtype(dtype).name in _HALF else rows.dtype
    acc = rows[0].astype(acc_dtype)  # a copy
    combine = get_array_module(rows).maximum if op == "max" else None
    for r in range(1, size):
        if combine is None:
            acc += rows[r]
        else:
            combine(acc, rows[r], out=acc)
    MpiCommunicator._finish_avg_static(acc, op, size)
    return acc if acc.dtype == np.dtype(dtype) else acc.astype(dtype)


class AllReduceRequest(Request):
    """An all-reduce in two MPI phases: the exchange of pieces (then their rank-ordered sum),
    and the gather of the sums. MPI matches a communicator's collectives in the order the ranks
    post them, and the exchanges of several all-reduces may finish in a different order on
    different ranks: so the gathers go on a communicator of their own, posted in the order
    the all-reduces started (`queue`, shared by the group's all-reduces), whatever order their
    exchanges finish in."""

    op = "all_reduce"

    def __init__(self, queue: list, exchange, then, result):
        self.queue, self.exchange, self.then, self.result = queue, exchange, then, result
        self.gather = self._keep = None
        queue.append(self)

    def _post_gathers(self, block: bool) -> None:
        """Posts the queued gathers in order: those whose exchange has finished (block: waiting
        for each exchange up to this request's)."""
        while self.gather is None and self.queue:
            head = self.queue[0]
            if block:
                head.exchange.Wait()
            elif not head.exchange.Test():
                return
            head.gather, head._keep = head.then()
            self.queue.pop(0)

    def test(self) -> bool:
        self._post_gathers(block=False)
        return self.gather is not None and self.gather.Test()

    def wait(self):
        self._post_gathers(block=True)
        self.gather.Wait()
        self._keep = None
        return self.result


class MpiExchangeRequest(Request):
    """Point-to-point sends and receives posted together (Isend/Irecv), finished together."""

    op = "exchange"

    def __init__(self, requests, received, sent):
        self.requests, self.result, self._sent = requests, received, sent

    def test(self) -> bool:
        return bool(MPI.Request.Testall(self.requests))

    def wait(self):
        MPI.Request.Waitall(self.requests)
        self._sent = None
        return self.result


class MpiRequest(Request):
    """Phases of MPI requests: each phase is (mpi_request, then) where `then()` runs when the
    request has completed and returns the next phase or None; `result` is what wait() returns."""

    def __init__(self, op: str, mpi_request, then, result=None):
        self.op = op
        self._phase = (mpi_request, then)
        self.result = result

    def test(self) -> bool:
        while self._phase is not None:
            req, then = self._phase
            if not req.Test():
                return False
            self._phase = then() if then is not None else None
        return True

    def wait(self):
        while self._phase is not None:
            req, then = self._phase
            req.Wait()
            self._phase = then() if then is not None else None
        return self.result


def _split_counts(n: int, size: int) -> list[int]:
    """n elements cut into `size` near-equal consecutive pieces (the first ones one longer)."""
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


def _displacements(counts) -> list[int]:
    return np.cumsum([0] + list(counts[:-1])).tolist()


def _buf_raw(x):
    """A buffer spec for moving x's bytes (16-bit types as words)."""
    w = _words(x)
    return [w, MPI._typedict[np.dtype(w.dtype).char]]


class MpiCommunicator(Communicator):
    kind = "mpi"

    def __init__(self, mpi_comm: MPI.Comm, name: str = "group", owned: bool = False):
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size(), name)
        self.mpi_comm = mpi_comm
        # Only communicators cutp split off itself are freed by close(); the caller's stay.
        self.owned = owned
        self._gather_comm = None  # the all-reduces' second phase (AllReduceRequest)
        self._gathers_to_post = []

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
        self._finish_avg_static(a, op, self.size)

    @staticmethod
    def _finish_avg_static(a, op, size):
        if op != "avg" or size == 1:
            return
        if a.dtype.kind == "f":
            a /= size
        else:  # integers: C division (toward zero), as NCCL's ncclAvg computes sum / nranks
            neg = a < 0
            xp = get_array_module(a)
            xp.floor_divide(xp.abs(a), size, out=a)
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
        for x, _, _ in list(sends) + list(recvs):
            check_array(x, f"exchange on {self.name}")
        requests = [self.mpi_comm.Irecv(_buf(x), source=src, tag=tag) for x, src, tag in recvs]
        requests += [self.mpi_comm.Isend(_buf(x), dest=dest, tag=tag) for x, dest, tag in sends]
        return MpiExchangeRequest(requests, [x for x, _, _ in recvs], [x for x, _, _ in sends])

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

    # ---- non-blocking, summed in rank order (module docstring) ---------------------------------
    # The planner's shape-only arrays take these same paths over a group without peers (cutp.comm.
    # shape_only.NoPeersComm: nothing moves), so that it books the buffers a run allocates when and
    # for as long as the run holds them: the pieces received from the start to the wait, the sum
    # (in float32 for 16-bit data) from the wait; a blocking stand-in booked others (a copy of the
    # input, a second result) and held them to the request's end.
    def _exchange_pieces(self, flat, counts):
        """Ialltoallv: piece r of `flat` (counts[r] elements) to rank r; returns (request, rows
        [size, counts[rank]]: every rank's piece of this rank, in rank order)."""
        xp = get_array_module(flat)
        mine = counts[self.rank]
        rows = xp.empty((self.size, mine), flat.dtype)
        (sbuf, stype), (rbuf, rtype) = _buf_raw(flat), _buf_raw(rows)
        req = self.mpi_comm.Ialltoallv([sbuf, (counts, _displacements(counts)), stype],
                                       [rbuf, ([mine] * self.size, [mine * r for r in range(self.size)]), rtype])
        return req, rows

    def start_reduce_scatter(self, x, op="sum", out=None):
        check_array(x, f"reduce_scatter on {self.name}")
        check_op(op)
        shape = self._scatter_shape(x)
        self._check_out(out, shape, x.dtype, f"reduce_scatter on {self.name}")
        piece = int(np.prod(shape, dtype=np.int64))
        # out is written only after the exchange has read x: any overlap of the two is fine
        req, rows = self._exchange_pieces(x.reshape(-1), [piece] * self.size)
        request = MpiRequest("reduce_scatter", req, None)

        def add():
            total = _ordered_sum(rows, op, self.size, x.dtype).reshape(shape)
            if out is None:
                request.result = total
            else:
                out[...] = total
                request.result = out
            return None

        request._phase = (req, add)
        return request

    def start_all_reduce(self, x, op="sum", out=None):
        check_array(x, f"all_reduce on {self.name}")
        check_op(op)
        self._check_out(out, x.shape, x.dtype, f"all_reduce on {self.name}")
        xp = get_array_module(x)
        if out is None:
            out = xp.empty_like(x)
        src = x.reshape(-1)  # read by the exchange, which completes before the gather writes out
        if self._gather_comm is None:  # (collective over the group: the first all-reduce starts on every rank)
            self._gather_comm = self.mpi_comm.Dup()
        counts = _split_counts(src.size, self.size)
        req, rows = self._exchange_pieces(src, counts)

        def add_then_gather():
            mine = _ordered_sum(rows, op, self.size, x.dtype)
            (sbuf, stype), (rbuf, rtype) = _buf_raw(mine), _buf_raw(out.reshape(-1))
            gather = self._gather_comm.Iallgatherv([sbuf, stype], [rbuf, (counts, _displacements(counts)), rtype])
            return gather, mine  # (mine alive until the gather is done)

        return AllReduceRequest(self._gathers_to_post, req, add_then_gather, out)

    def start_reduce(self, x, root, op="sum"):
        check_array(x, f"reduce on {self.name}")
        check_op(op)
        xp = get_array_module(x)
        flat = x.reshape(-1)
        rows = xp.empty((self.size, flat.size), x.dtype) if self.rank == root else None
        if self.rank == root:
            req = self.mpi_comm.Igather(_buf_raw(flat), _buf_raw(rows), root=root)
        else:
            req = self.mpi_comm.Igather(_buf_raw(flat), None, root=root)
        request = MpiRequest("reduce", req, None)

        def add():
            if self.rank == root:
                flat[...] = _ordered_sum(rows, op, self.size, x.dtype)
                request.result = x
            return None

        request._phase = (req, add)
        return request

    def start_all_gather(self, x, out=None):
        if not isinstance(x, np.ndarray):  # the planner's shape-only arrays: nothing to move
            return super().start_all_gather(x, out)
        check_array(x, f"all_gather on {self.name}")
        shape = self._gather_shape(x)
        self._check_out(out, shape, x.dtype, f"all_gather on {self.name}")
        if out is None:
            out = get_array_module(x).empty(shape, x.dtype)
        x, in_place = self._unalias(x, out, x_at=self.rank * x.nbytes)
        if in_place:
            req = self.mpi_comm.Iallgather(MPI.IN_PLACE, _buf_raw(out))
        else:
            req = self.mpi_comm.Iallgather(_buf_raw(x), _buf_raw(out))
        request = MpiRequest("all_gather", req, None, result=out)
        request._keep = x
        return request

    def start_broadcast(self, x, root=0):
        if not isinstance(x, np.ndarray):  # the planner's shape-only arrays: nothing to move
            return super().start_broadcast(x, root)
        check_array(x, f"broadcast on {self.name}")
        return MpiRequest("broadcast", self.mpi_comm.Ibcast(_buf_raw(x), root=root), None, result=x)

    def close(self):
        if self._gather_comm is not None:
            self._gather_comm.Free()
            self._gather_comm = None
        if self.owned and self.mpi_comm != MPI.COMM_NULL:
            self.mpi_comm.Free()
            self.owned = False
