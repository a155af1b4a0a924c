"""The communicator interface: exactly the collectives the runtime needs.

Semantics shared by every implementation (MPI on NumPy arrays, NCCL on CuPy arrays):

- Arrays must be C-contiguous and of a supported dtype (float32, float64, bfloat16, float16, int32,
  int64); anything else raises `CommError` before any communication starts.
- `out=None` allocates the result; `out=x` is in place where the shapes allow it. all_gather
  with x being this rank's slot of out, and reduce_scatter with out being this rank's slot of x,
  are in place too (NCCL's in-place layouts); any other overlap of x and out is also correct
  (x is copied first).
- all_gather concatenates the ranks' arrays along axis 0 (rank order); reduce_scatter splits
  axis 0 of the input into `size` equal chunks and returns this rank's reduced chunk.
  Layers that gather along another axis move it to the front themselves (see
  `cutp.tensor_parallel.mappings`).
- Reductions: "sum", "max", "avg" (avg = sum / size, in the array's dtype).
- all_to_all(x, send_counts, recv_counts): rows [sum(send_counts), ...] -> [sum(recv_counts), ...];
  rows [sum(send_counts[:r]), sum(send_counts[:r+1])) go to rank r, and the rows from rank r
  land in rank order (MPI Alltoallv; NCCL send/recv pairs in one group).

Non-blocking collectives (`start_all_reduce`, `start_reduce_scatter`, `start_reduce`,
`start_all_gather`, `start_broadcast`, and the point-to-point `start_exchange`) return a `Request`: `test()` makes progress and says
whether it has finished, `wait()` finishes it and returns the result (what the blocking call
returns). Its buffers must not be touched between the start and the wait. Every rank of a group
starts a group's non-blocking collectives in the same order. The default implementation runs the
blocking collective at once and returns a finished request (a group without peers, the planner's
shape-only groups); MPI and NCCL override them (cutp.comm.mpi, cutp.comm.nccl).
"""
from __future__ import annotations

import numpy as np

REDUCE_OPS = ("sum", "max", "avg")
SUPPORTED_DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")


def address(a) -> int:
    """The first byte of a NumPy or CuPy array."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return a.data.ptr  # CuPy


def overlaps(a, b) -> bool:
    """Whether two contiguous arrays share any byte."""
    a0, b0 = address(a), address(b)
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


class CommError(RuntimeError):
    """A collective was called with arguments it cannot take."""


def dtype_name(x) -> str:
    return np.dtype(x.dtype).name


def check_array(x, what: str = "array") -> None:
    name = dtype_name(x)
    if name not in SUPPORTED_DTYPES:
        raise CommError(f"{what} has dtype {name}; collectives take {', '.join(SUPPORTED_DTYPES)}")
    if not x.flags.c_contiguous:
        raise CommError(f"{what} is not C-contiguous; pass xp.ascontiguousarray(x)")


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise CommError(f"reduce op {op!r} is not one of {REDUCE_OPS}")


class Request:
    """A non-blocking collective in flight (module docstring)."""

    #: the collective's name, as the counters record it
    op: str = "request"

    def test(self) -> bool:
        """Makes progress (MPI advances a non-blocking collective only inside its calls) and
        says whether the collective has finished; it never blocks."""
        raise NotImplementedError

    def wait(self):
        """Blocks until the collective has finished; returns its result. Idempotent."""
        raise NotImplementedError


class DoneRequest(Request):
    """A collective that already ran (the blocking fallback)."""

    def __init__(self, op: str, result):
        self.op, self.result = op, result

    def test(self) -> bool:
        return True

    def wait(self):
        return self.result


class Communicator:
    """A group of ranks. Subclasses implement the collectives on one array type."""

    #: "mpi" or "nccl"
    kind: str = "abstract"

    def __init__(self, rank: int, size: int, name: str = "group"):
        self.rank = rank
        self.size = size
        self.name = name

    # ---- collectives -------------------------------------------------------------------
    def all_reduce(self, x, op: str = "sum", out=None):
        raise NotImplementedError

    def all_gather(self, x, out=None):
        raise NotImplementedError

    def reduce_scatter(self, x, op: str = "sum", out=None):
        raise NotImplementedError

    def broadcast(self, x, root: int = 0):
        """In place: every rank's x becomes root's x. Returns x."""
        raise NotImplementedError

    def send(self, x, dest: int, tag: int = 0) -> None:
        raise NotImplementedError

    def recv(self, x, source: int, tag: int = 0):
        """Receives into x (which gives the shape and dtype). Returns x."""
        raise NotImplementedError

    def exchange(self, sends, recvs):
        """Point-to-point sends [(x, dest, tag)] and receives [(x, source, tag)] posted together
        and finished together (MPI Isend/Irecv + Waitall; one NCCL group), so that no order in
        which neighbours post them can deadlock. NCCL has no tags: messages between two ranks
        match in the order they were posted, so both sides must list them in the same order
        (pipeline schedules list activations before gradients). Returns the receive buffers."""
        raise NotImplementedError

    def all_to_all(self, x, send_counts, recv_counts):
        """Rows of x (axis 0) to every rank: send_counts[r] consecutive rows to rank r, in rank
        order; returns the rows received, recv_counts[r] from rank r, in rank order (a new array
        [sum(recv_counts), *x.shape[1:]]). Both count lists have `size` entries, and rank r's
        send_counts[s] must equal rank s's recv_counts[r]."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    # ---- non-blocking collectives (module docstring) -------------------------------------
    def start_all_reduce(self, x, op: str = "sum", out=None) -> Request:
        return DoneRequest("all_reduce", self.all_reduce(x, op, out))

    def start_reduce_scatter(self, x, op: str = "sum", out=None) -> Request:
        return DoneRequest("reduce_scatter", self.reduce_scatter(x, op, out))

    def start_reduce(self, x, root: int, op: str = "sum") -> Request:
        """x reduced over the group into x itself on rank `root` (in place; the other ranks' x
        is left as it was). wait() returns x on root, None elsewhere."""
        out = self.all_reduce(x, op, out=x) if self.rank == root else None
        if self.rank != root:
            self.all_reduce(x.copy(), op)
        return DoneRequest("reduce", out)

    def start_all_gather(self, x, out=None) -> Request:
        return DoneRequest("all_gather", self.all_gather(x, out))

    def start_broadcast(self, x, root: int = 0) -> Request:
        return DoneRequest("broadcast", self.broadcast(x, root))

    def start_exchange(self, sends, recvs) -> Request:
        """`exchange`, non-blocking: wait() returns the receive buffers (MPI Isend/Irecv posted
        now; NCCL's group on the communication stream). The work between the start and the wait
        (context parallelism's attention on the block already here) overlaps the transfer."""
        return DoneRequest("exchange", self.exchange(sends, recvs))

    # ---- shape helpers shared by the implementations ------------------------------------
    def _gather_shape(self, x):
        return (x.shape[0] * self.size,) + tuple(x.shape[1:]) if x.ndim else (self.size,)

    def _scatter_shape(self, x):
        if x.ndim == 0 or x.shape[0] % self.size:
            raise CommError(
                f"reduce_scatter over {self.size} ranks needs axis 0 divisible by {self.size}; got shape {tuple(x.shape)}"
            )
        return (x.shape[0] // self.size,) + tuple(x.shape[1:])

    def _a2a_counts(self, x, send_counts, recv_counts):
        """The counts as lists of ints, checked against x and the group size."""
        send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(send) != self.size or len(recv) != self.size or min(send + recv) < 0:
            raise CommError(f"all_to_all on {self.name}: send_counts {send} and recv_counts {recv} must be "
                            f"{self.size} counts >= 0 each")
        if x.ndim == 0 or sum(send) != x.shape[0]:
            raise CommError(f"all_to_all on {self.name}: send_counts sum to {sum(send)} rows but x has shape "
                            f"{tuple(x.shape)}")
        return send, recv

    def _check_out(self, out, shape, dtype, what):
        if out is None:
            return
        check_array(out, f"{what} out")
        if tuple(out.shape) != tuple(shape) or np.dtype(out.dtype) != np.dtype(dtype):
            raise CommError(
                f"{what}: out has shape {tuple(out.shape)} and dtype {np.dtype(out.dtype).name}; "
                f"expected {tuple(shape)} and {np.dtype(dtype).name}"
            )

    def _unalias(self, x, out, x_at: int | None = None, out_at: int | None = None):
        """(x, in_place): in place when x starts at byte `x_at` of out (all_gather's in-place
        layout) or out at byte `out_at` of x (reduce_scatter's); x is copied when it overlaps
        out in any other way (MPI forbids aliased buffers, NCCL leaves the result undefined)."""
        if out is None or not overlaps(x, out):
            return x, False
        if (x_at is not None and address(x) - address(out) == x_at) or \
                (out_at is not None and address(out) - address(x) == out_at):
            return x, True
        return x.copy(), False

    def close(self) -> None:
        pass

    def __repr__(self):
        return f"<{type(self).__name__} {self.name} rank {self.rank}/{self.size}>"


class WrappedCommunicator(Communicator):
    """A communicator that adds behaviour around another one (counting, the watchdog).

    Every collective goes through `_call(op, x, fn, *args)`, which by default just calls `fn`;
    a subclass overrides that one method. Anything else (mpi_comm, nccl_comm, abort, ...) is the
    inner communicator's.
    """

    def __init__(self, inner: Communicator):
        super().__init__(inner.rank, inner.size, inner.name)
        self.inner = inner
        self.kind = inner.kind

    def _call(self, op, x, fn, *args):
        return fn(*args)

    def all_reduce(self, x, op="sum", out=None):
        return self._call("all_reduce", x, self.inner.all_reduce, x, op, out)

    def all_gather(self, x, out=None):
        return self._call("all_gather", x, self.inner.all_gather, x, out)

    def reduce_scatter(self, x, op="sum", out=None):
        return self._call("reduce_scatter", x, self.inner.reduce_scatter, x, op, out)

    def broadcast(self, x, root=0):
        return self._call("broadcast", x, self.inner.broadcast, x, root)

    def send(self, x, dest, tag=0):
        return self._call("send", x, self.inner.send, x, dest, tag)

    def recv(self, x, source, tag=0):
        return self._call("recv", x, self.inner.recv, x, source, tag)

    def exchange(self, sends, recvs):
        first = (list(sends) + list(recvs))[0][0]  # (the watchdog names the first buffer)
        return self._call("exchange", first, self.inner.exchange, sends, recvs)

    def all_to_all(self, x, send_counts, recv_counts):
        return self._call("all_to_all", x, self.inner.all_to_all, x, send_counts, recv_counts)

    def barrier(self):
        return self._call("barrier", np.empty(0), self.inner.barrier)

    # non-blocking: `_start(op, x, fn, *args)` wraps the start and returns the request
    def _start(self, op, x, fn, *args):
        return fn(*args)

    def start_all_reduce(self, x, op="sum", out=None):
        return self._start("all_reduce", x, self.inner.start_all_reduce, x, op, out)

    def start_reduce_scatter(self, x, op="sum", out=None):
        return self._start("reduce_scatter", x, self.inner.start_reduce_scatter, x, op, out)

    def start_reduce(self, x, root, op="sum"):
        return self._start("reduce", x, self.inner.start_reduce, x, root, op)

    def start_all_gather(self, x, out=None):
        return self._start("all_gather", x, self.inner.start_all_gather, x, out)

    def start_broadcast(self, x, root=0):
        return self._start("broadcast", x, self.inner.start_broadcast, x, root)

    def start_exchange(self, sends, recvs):
        first = (list(sends) + list(recvs))[0][0]
        return self._start("exchange", first, self.inner.start_exchange, sends, recvs)

    def close(self):
        return self.inner.close()

    def __getattr__(self, item):  # only reached for attributes this wrapper does not have
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)
