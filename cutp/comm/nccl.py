"""Collectives on CuPy arrays through `cupy.cuda.nccl`.

One NCCL communicator per group (TP group, DP group). Bootstrapping follows ChainerMN and llm.c:
the group's first rank makes the unique id, MPI broadcasts it as a fixed-size byte buffer, a
barrier follows (some MPI stacks deadlock if ncclCommInitRank follows the broadcast directly),
and every rank constructs its communicator on the *current* CUDA device. If making the id fails
on the first rank, the buffer carries the error text instead, so every rank raises instead of
waiting in a broadcast that never comes.

All blocking calls run on the caller's current CuPy stream, so a host code's stream ordering
holds. The non-blocking ones (`start_*`, cutp.comm.base; `start_exchange` too, for context
parallelism's ring and the pipeline) run on a communication stream of the
group's own: the current (compute) stream records an event, the communication stream waits for
it and runs the NCCL call, and records a done event; `wait()` makes the compute stream wait for
that (the host does not block), `test()` asks the event. The request holds the input and output
arrays until its wait: CuPy's pool keeps one arena per stream, and an array freed on the compute
stream while NCCL still reads it on the other could be handed out again at once; after the wait
the compute stream's own order protects it. Every rank issues a group's NCCL calls in the same
order, both streams together (NCCL gives no concurrency guarantee between two communicators'
kernels; the buckets' order is fixed: cutp.optim.buckets).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..runtime.backend import is_device_array
from .base import CommError, Communicator, Request, check_op, dtype_name
from .base import check_array as _check_array

# NCCL's enum values by dtype name (CuPy has no dtype-to-NCCL helper).
_NCCL_DTYPES = {"int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_OPS = {"sum": 0, "max": 2, "avg": 4}

_UID_BYTES = 128
_MSG_BYTES = 1024  # room for an error message in the bootstrap buffer


def check_array(x, what):
    if not is_device_array(x):
        raise CommError(f"{what}: the NCCL communicator takes CuPy arrays, got {type(x).__module__}.{type(x).__name__}")
    _check_array(x, what)


def _load_nccl():
    from cupy.cuda import nccl  # optional dependency

    if not getattr(nccl, "available", False):
        raise CommError("NCCL is not available (libnccl.so.2 not found); install nvidia-nccl-cu12 or -cu13")
    return nccl


def broadcast_unique_id(mpi_comm, make_id):
    """Returns the id made by `make_id()` on rank 0 of mpi_comm, on every rank.

    Raises CommError on every rank if `make_id` raised on rank 0.
    """
    buf = np.zeros(1 + _MSG_BYTES, np.uint8)
    if mpi_comm.Get_rank() == 0:
        try:
            uid = bytes(bytearray(v & 0xFF for v in make_id()))
            if len(uid) != _UID_BYTES:
                raise CommError(f"NCCL unique id has {len(uid)} bytes, expected {_UID_BYTES}")
            buf[0] = 1
            buf[1 : 1 + _UID_BYTES] = np.frombuffer(uid, np.uint8)
        except Exception as e:  # any failure must reach the other ranks
            msg = f"{type(e).__name__}: {e}".encode()[:_MSG_BYTES]
            buf[0] = 2
            buf[1 : 1 + len(msg)] = np.frombuffer(msg, np.uint8)
    mpi_comm.Bcast([buf, MPI.UINT8_T], root=0)
    if buf[0] != 1:
        text = bytes(buf[1:]).rstrip(b"\0").decode(errors="replace")
        raise CommError(f"making the NCCL unique id failed on the group's first rank: {text}")
    return bytes(buf[1 : 1 + _UID_BYTES])


def all_to_all_plan(send, recv, rank):
    """[(kind, peer, first, rows)]: "send" of x's rows [first, first + rows) to peer, "recv" of
    rows from peer into out's [first, first + rows) (every peer with rows, in rank order, each
    send before its receive), and "copy" of this rank's own rows, first = (row in x, row in out)."""
    so, ro = np.cumsum([0] + list(send)).tolist(), np.cumsum([0] + list(recv)).tolist()
    plan = []
    for peer in range(len(send)):
        if peer == rank:
            if send[peer]:
                plan.append(("copy", peer, (so[peer], ro[peer]), send[peer]))
            continue
        if send[peer]:
            plan.append(("send", peer, so[peer], send[peer]))
        if recv[peer]:
            plan.append(("recv", peer, ro[peer], recv[peer]))
    return plan


class NcclRequest(Request):
    """A collective queued on a group's communication stream (module docstring)."""

    def __init__(self, op, done, compute, keep, result):
        self.op, self.done, self.compute, self._keep, self.result = op, done, compute, keep, result

    def test(self) -> bool:
        return bool(self.done.done)

    def wait(self):
        if self._keep is not None:
            self.compute.wait_event(self.done)  # the compute stream's later work comes after it
            self._keep = None
        return self.result


class NcclCommunicator(Communicator):
    kind = "nccl"

    def __init__(self, mpi_comm, name: str = "group", nccl_module=None):
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size(), name)
        self.mpi_comm = mpi_comm
        self._nccl = nccl_module if nccl_module is not None else _load_nccl()
        uid = broadcast_unique_id(mpi_comm, self._nccl.get_unique_id)
        mpi_comm.Barrier()
        self.nccl_comm = self._nccl.NcclCommunicator(self.size, uid, self.rank)

    # ---- helpers -------------------------------------------------------------------------
    def _stream(self):
        import cupy  # optional dependency

        return cupy.cuda.get_current_stream().ptr

    def _streams(self):
        """(the current stream, this group's communication stream), CuPy Stream objects."""
        import cupy  # optional dependency

        if getattr(self, "_comm_stream", None) is None:
            self._comm_stream = cupy.cuda.Stream(non_blocking=True)
        return cupy.cuda.get_current_stream(), self._comm_stream

    def _on_comm_stream(self, op, issue, keep, result) -> NcclRequest:
        """`issue(stream_ptr)` queued on the communication stream after the compute stream's work."""
        compute, side = self._streams()
        side.wait_event(compute.record())
        issue(side.ptr)
        return NcclRequest(op, side.record(), compute, keep, result)

    def _dt(self, x):
        return _NCCL_DTYPES[dtype_name(x)]

    def _empty(self, shape, dtype):
        import cupy  # optional dependency

        return cupy.empty(shape, dtype)

    # ---- collectives: each prepared once (checks, output, the NCCL call), then issued on the
    # caller's stream (blocking) or on the communication stream (start_*, module docstring) ----
    def _all_reduce(self, x, op, out):
        check_array(x, f"all_reduce on {self.name}")
        check_op(op)
        self._check_out(out, x.shape, x.dtype, f"all_reduce on {self.name}")
        if out is None:
            out = self._empty(x.shape, x.dtype)
        x, _ = self._unalias(x, out, x_at=0)
        return (lambda stream: self.nccl_comm.allReduce(x.data.ptr, out.data.ptr, x.size, self._dt(x),
                                                        _NCCL_OPS[op], stream)), (x, out), out

    def _reduce_scatter(self, x, op, out):
        check_array(x, f"reduce_scatter on {self.name}")
        check_op(op)
        shape = self._scatter_shape(x)
        self._check_out(out, shape, x.dtype, f"reduce_scatter on {self.name}")
        if out is None:
            out = self._empty(shape, x.dtype)
        x, _ = self._unalias(x, out, out_at=self.rank * out.nbytes)  # NCCL takes out == x's slot as in place
        return (lambda stream: self.nccl_comm.reduceScatter(x.data.ptr, out.data.ptr, out.size, self._dt(x),
                                                            _NCCL_OPS[op], stream)), (x, out), out

    def _all_gather(self, x, out):
        check_array(x, f"all_gather on {self.name}")
        shape = self._gather_shape(x)
        self._check_out(out, shape, x.dtype, f"all_gather on {self.name}")
        if out is None:
            out = self._empty(shape, x.dtype)
        x, _ = self._unalias(x, out, x_at=self.rank * x.nbytes)  # NCCL takes x == out's slot as in place
        return (lambda stream: self.nccl_comm.allGather(x.data.ptr, out.data.ptr, x.size, self._dt(x),
                                                        stream)), (x, out), out

    def _broadcast(self, x, root):
        check_array(x, f"broadcast on {self.name}")
        return (lambda stream: self.nccl_comm.broadcast(x.data.ptr, x.data.ptr, x.size, self._dt(x), root,
                                                        stream)), (x,), x

    def all_reduce(self, x, op="sum", out=None):
        issue, _, out = self._all_reduce(x, op, out)
        issue(self._stream())
        return out

    def reduce_scatter(self, x, op="sum", out=None):
        issue, _, out = self._reduce_scatter(x, op, out)
        issue(self._stream())
        return out

    def all_gather(self, x, out=None):
        issue, _, out = self._all_gather(x, out)
        issue(self._stream())
        return out

    def broadcast(self, x, root=0):
        issue, _, x = self._broadcast(x, root)
        issue(self._stream())
        return x

    def start_all_reduce(self, x, op="sum", out=None):
        return self._on_comm_stream("all_reduce", *self._all_reduce(x, op, out))

    def start_reduce_scatter(self, x, op="sum", out=None):
        return self._on_comm_stream("reduce_scatter", *self._reduce_scatter(x, op, out))

    def start_reduce(self, x, root, op="sum"):
        check_array(x, f"reduce on {self.name}")
        check_op(op)
        return self._on_comm_stream("reduce", lambda stream: self.nccl_comm.reduce(
            x.data.ptr, x.data.ptr, x.size, self._dt(x), _NCCL_OPS[op], root, stream), (x,),
            x if self.rank == root else None)

    def start_all_gather(self, x, out=None):
        return self._on_comm_stream("all_gather", *self._all_gather(x, out))

    def start_broadcast(self, x, root=0):
        return self._on_comm_stream("broadcast", *self._broadcast(x, root))

    def start_exchange(self, sends, recvs):
        """The exchange's group on the communication stream, after what the compute stream has
        queued (its buffers are written there); wait() makes the compute stream wait for it.
        The arrays are kept referenced until then (CuPy's pool must not reuse them)."""
        for x, _, _ in list(sends) + list(recvs):
            check_array(x, f"exchange on {self.name}")
        compute, side = self._streams()
        side.wait_event(compute.record())
        with side:  # (self._stream(), the current stream, is the communication stream inside)
            self.exchange(sends, recvs)
        keep = tuple(x for x, _, _ in list(sends) + list(recvs))
        return NcclRequest("exchange", side.record(), compute, keep, [x for x, _, _ in recvs])

    def send(self, x, dest, tag=0):
        check_array(x, f"send on {self.name}")
        self.nccl_comm.send(x.data.ptr, x.size, self._dt(x), dest, self._stream())

    def recv(self, x, source, tag=0):
        check_array(x, f"recv on {self.name}")
        self.nccl_comm.recv(x.data.ptr, x.size, self._dt(x), source, self._stream())
        return x

    def _group(self):
        """NCCL's group calls (groupStart/groupEnd), a module with both."""
        from cupy.cuda import nccl  # optional dependency

        return nccl

    def exchange(self, sends, recvs):
        for x, _, _ in list(sends) + list(recvs):
            check_array(x, f"exchange on {self.name}")
        nccl = self._group()
        nccl.groupStart()  # one group: no send waits for a receive posted later
        try:
            for x, dest, _ in sends:
                self.nccl_comm.send(x.data.ptr, x.size, self._dt(x), dest, self._stream())
            for x, source, _ in recvs:
                self.nccl_comm.recv(x.data.ptr, x.size, self._dt(x), source, self._stream())
        finally:
            nccl.groupEnd()
        return [x for x, _, _ in recvs]

    def all_to_all(self, x, send_counts, recv_counts):
        """NCCL has no all-to-all: a send and a receive per peer with rows to move, in one group
        (`all_to_all_plan`); this rank's own rows are copied on the device."""
        check_array(x, f"all_to_all on {self.name}")
        nccl = self._group()
        send, recv = self._a2a_counts(x, send_counts, recv_counts)
        out = self._empty((sum(recv),) + tuple(x.shape[1:]), x.dtype)
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        plan = all_to_all_plan(send, recv, self.rank)
        nccl.groupStart()
        try:
            for kind, peer, first, rows in plan:
                if kind == "send":
                    self.nccl_comm.send(x.data.ptr + first * row * x.itemsize, rows * row, self._dt(x), peer,
                                        self._stream())
                elif kind == "recv":
                    self.nccl_comm.recv(out.data.ptr + first * row * x.itemsize, rows * row, self._dt(x), peer,
                                        self._stream())
        finally:
            nccl.groupEnd()
        for kind, _, first, rows in plan:
            if kind == "copy":
                out[first[1]:first[1] + rows] = x[first[0]:first[0] + rows]
        return out

    def barrier(self):
        # NCCL has no barrier: finish this rank's queued work, then meet on the host.
        import cupy  # optional dependency

        cupy.cuda.get_current_stream().synchronize()
        self.mpi_comm.Barrier()

    def abort(self):
        """Tears the communicator down without waiting for peers (used by the failure path)."""
        try:
            self.nccl_comm.abort()
        except Exception:
            pass

    def close(self):
        import cupy  # optional dependency

        if self.nccl_comm is None:
            return
        cupy.cuda.get_current_stream().synchronize()
        self.mpi_comm.Barrier()
        self.nccl_comm.destroy()
        self.nccl_comm = None
