"""``cupy.cuda.nccl`` of the stand-in: NCCL communicators carried over MPI.

A communicator's ranks find each other through COMM_WORLD: the unique id names the world rank
that made it; members send it their world rank, it answers with the member list, and all create
an MPI communicator of those ranks (MPI_Comm_create_group: collective over the members only, as
ncclCommInitRank). Collectives gather every rank's bytes and reduce in rank order, in the dtype
(bfloat16 sums in float32, rounded after each addition), so every rank gets the same bits.
Group semantics: between groupStart and groupEnd the calls are only queued; groupEnd issues
them (sends and receives together, so no send waits for a receive posted later). A stream
synchronize or host read while a group is open is reported (the calls never launch: a GPU
would wait forever). Each call records its reads and writes on its stream (tracking.access).
"""
from __future__ import annotations

import itertools
import os

import ml_dtypes
import numpy as np

from . import tracking

available = True
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
(NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_FLOAT32,
 NCCL_FLOAT64, NCCL_BFLOAT16) = range(10)
NCCL_CHAR, NCCL_INT, NCCL_HALF, NCCL_FLOAT, NCCL_DOUBLE = NCCL_INT8, NCCL_INT32, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64
_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
           7: np.float32, 8: np.float64, 9: ml_dtypes.bfloat16}
_uid_counter = itertools.count(1)
_TAG = 31000
_group: list = []  # the queued calls of the open group (nesting depth in _depth)
_depth = [0]


class NcclError(RuntimeError):
    pass


def get_version() -> int:
    return 22703


def get_build_version() -> int:
    return 22703


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def get_unique_id():
    w = _world()
    uid = np.zeros(128, np.uint8)
    uid[:8] = np.frombuffer(np.int64(w.Get_rank()).tobytes(), np.uint8)
    uid[8:16] = np.frombuffer(np.int64(next(_uid_counter)).tobytes(), np.uint8)
    uid[16:24] = np.frombuffer(np.int64(os.getpid()).tobytes(), np.uint8)
    return bytes(uid)


def groupStart():
    if _depth[0] == 0:
        tracking._open_groups.append(tracking.place())
    _depth[0] += 1


def groupEnd():
    if _depth[0] == 0:
        raise NcclError("ncclGroupEnd without ncclGroupStart (ncclInvalidUsage)")
    _depth[0] -= 1
    if _depth[0] == 0:
        tracking._open_groups.pop()
        calls, _group[:] = list(_group), []
        _issue(calls)


def _issue(calls):
    """Runs queued calls: collectives in order; point-to-point ones posted together, then waited."""
    reqs, finish = [], []
    for call in calls:
        if call[0] in ("send", "recv"):
            r, f = call[1]()
            reqs.append(r)
            if f is not None:
                finish.append(f)
        else:
            call[1]()
    if reqs:
        from mpi4py import MPI

        MPI.Request.Waitall(reqs)
    for f in finish:
        f()


def _view(ptr, count, dtype_code, what, where):
    if dtype_code not in _DTYPES:
        raise NcclError(f"{what} at {where}: datatype {dtype_code} is not an NCCL datatype (ncclInvalidArgument)")
    dt = np.dtype(_DTYPES[dtype_code])
    alloc = tracking.find(ptr)
    if alloc is None:
        raise NcclError(f"{what} at {where}: buffer {ptr:#x} is not device memory (ncclInvalidArgument)")
    if ptr + count * dt.itemsize > alloc.ptr + alloc.requested:
        raise NcclError(f"{what} at {where}: {count} x {dt} from {ptr:#x} pass the end of its allocation")
    return np.ndarray((count,), dt, buffer=alloc.buf, offset=ptr - alloc.ptr)


def _stream(ptr):
    for s in list(tracking._streams.values()):
        if s.ptr == ptr:
            return s
    raise NcclError(f"no stream with ptr {ptr:#x}")


def _reduce(parts, op, dt):
    acc = parts[0].astype(np.float64 if dt == np.float64 else np.float32) if dt.kind in "fV" else parts[0].copy()
    for p in parts[1:]:
        q = p.astype(acc.dtype)
        if op in (NCCL_SUM, NCCL_AVG):
            acc = acc + q
        elif op == NCCL_PROD:
            acc = acc * q
        elif op == NCCL_MAX:
            acc = np.maximum(acc, q)
        elif op == NCCL_MIN:
            acc = np.minimum(acc, q)
        else:
            raise NcclError(f"reduction op {op} is not an NCCL op")
        if dt.kind in "fV":
            acc = acc.astype(dt).astype(acc.dtype)  # rounded to the wire type after each step
    if op == NCCL_AVG:
        acc = acc / len(parts)
    return acc.astype(dt)


class NcclCommunicator:
    def __init__(self, ndev: int, commId, rank: int):
        from mpi4py import MPI

        uid = np.frombuffer(bytes(commId), np.uint8)
        if uid.size != 128:
            raise NcclError(f"NcclCommunicator: the unique id has {uid.size} bytes, expected 128")
        w = _world()
        maker = int(np.frombuffer(uid[:8].tobytes(), np.int64)[0])
        serial = int(np.frombuffer(uid[8:16].tobytes(), np.int64)[0])
        tag = _TAG + serial % 1000
        me = np.array([w.Get_rank(), rank], np.int64)
        if w.Get_rank() == maker:
            members = np.zeros(ndev, np.int64)
            members[rank] = w.Get_rank()
            for _ in range(ndev - 1):
                got = np.zeros(2, np.int64)
                w.Recv(got, source=MPI.ANY_SOURCE, tag=tag)
                members[got[1]] = got[0]
            for r in members:
                if r != w.Get_rank():
                    w.Send(members, dest=int(r), tag=tag)
        else:
            w.Send(me, dest=maker, tag=tag)
            members = np.zeros(ndev, np.int64)
            w.Recv(members, source=maker, tag=tag)
        group = w.Get_group().Incl([int(r) for r in members])
        self.mpi = w.Create_group(group, tag)
        group.Free()
        self._rank, self._size = rank, ndev
        if self.mpi.Get_rank() != rank:
            raise NcclError(f"NcclCommunicator: rank {rank} came out as {self.mpi.Get_rank()}")
        self._alive = True

    def rank_id(self):
        return self._rank

    def size(self):
        return self._size

    def device_id(self):
        return 0

    def check_async_error(self):
        pass

    def abort(self):
        self._alive = False

    def destroy(self):
        if self._alive:
            self.mpi.Free()
        self._alive = False

    # ---- the calls --------------------------------------------------------------------------
    def _enqueue(self, kind, run):
        tracking.CALLS[f"nccl {kind}"] += 1
        if _depth[0] > 0:
            _group.append((kind, run))
        else:
            _issue([(kind, run)])

    def _gather(self, send):
        parts = np.empty((self._size,) + send.shape, send.dtype)
        self.mpi.Allgather(send.view(np.uint8), parts.view(np.uint8).reshape(self._size, -1))
        return parts

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        where, s = tracking.place(), _stream(stream)
        snd = _view(sendbuf, count, datatype, "allReduce", where)
        rcv = _view(recvbuf, count, datatype, "allReduce", where)

        def run():
            tracking.access([snd], "r", s, where)
            parts = self._gather(snd.copy())
            tracking.access([rcv], "w", s, where)
            rcv[...] = _reduce(list(parts), op, snd.dtype)

        self._enqueue("allReduce", run)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        where, s = tracking.place(), _stream(stream)
        snd = _view(sendbuf, count, datatype, "reduce", where)
        rcv = _view(recvbuf, count, datatype, "reduce", where)

        def run():
            tracking.access([snd], "r", s, where)
            parts = self._gather(snd.copy())
            if self._rank == root:
                tracking.access([rcv], "w", s, where)
                rcv[...] = _reduce(list(parts), op, snd.dtype)

        self._enqueue("reduce", run)

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        where, s = tracking.place(), _stream(stream)
        snd = _view(sendbuf, count, datatype, "broadcast", where) if self._rank == root else None
        rcv = _view(recvbuf, count, datatype, "broadcast", where)

        def run():
            buf = np.empty(count, rcv.dtype)
            if snd is not None:
                tracking.access([snd], "r", s, where)
                buf[...] = snd
            self.mpi.Bcast(buf.view(np.uint8), root=root)
            tracking.access([rcv], "w", s, where)
            rcv[...] = buf

        self._enqueue("broadcast", run)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        where, s = tracking.place(), _stream(stream)
        snd = _view(sendbuf, recvcount * self._size, datatype, "reduceScatter", where)
        rcv = _view(recvbuf, recvcount, datatype, "reduceScatter", where)

        def run():
            tracking.access([snd], "r", s, where)
            parts = self._gather(snd.copy())
            mine = [p[self._rank * recvcount:(self._rank + 1) * recvcount] for p in parts]
            tracking.access([rcv], "w", s, where)
            rcv[...] = _reduce(mine, op, snd.dtype)

        self._enqueue("reduceScatter", run)

    def allGather(self, sendbuf, recvbuf, sendcount, datatype, stream):
        where, s = tracking.place(), _stream(stream)
        snd = _view(sendbuf, sendcount, datatype, "allGather", where)
        rcv = _view(recvbuf, sendcount * self._size, datatype, "allGather", where)

        def run():
            tracking.access([snd], "r", s, where)
            parts = self._gather(snd.copy())
            tracking.access([rcv], "w", s, where)
            rcv[...] = parts.reshape(-1)

        self._enqueue("allGather", run)

    def send(self, sendbuf, count, datatype, peer, stream):
        where, s = tracking.place(), _stream(stream)
        snd = _view(sendbuf, count, datatype, "send", where)

        def run():
            tracking.access([snd], "r", s, where)
            return self.mpi.Isend(snd.copy().view(np.uint8), dest=peer, tag=7), None

        self._enqueue("send", run)

    def recv(self, recvbuf, count, datatype, peer, stream):
        where, s = tracking.place(), _stream(stream)
        rcv = _view(recvbuf, count, datatype, "recv", where)

        def run():
            tmp = np.empty(count, rcv.dtype)

            def finish():
                tracking.access([rcv], "w", s, where)
                rcv[...] = tmp

            return self.mpi.Irecv(tmp.view(np.uint8), source=peer, tag=7), finish

        self._enqueue("recv", run)
