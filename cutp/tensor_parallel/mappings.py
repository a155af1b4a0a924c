"""Communication operators of 1D tensor parallelism, kept apart from the layers that use them.

Each is a forward/backward pair over the TP group `comm` (Megatron-LM's mappings.py); an
identity half has no function (the layers skip it):

    copy_to_tp       forward identity        backward all-reduce      (Megatron's `f`)
    reduce_from_tp   forward all-reduce      backward identity        (Megatron's `g`)
    scatter_to_tp    forward keep my slice   backward all-gather      (last dimension)
    gather_from_tp   forward all-gather      backward keep my slice   (last dimension)

and, for sequence parallelism, along the sequence (axis 1 of [B, T, ...] activations; this
rank holds tokens [rank * T/tp, (rank + 1) * T/tp) of every sequence):

    gather_from_sp          forward all-gather       backward reduce-scatter  (before a column layer)
    reduce_scatter_to_sp    forward reduce-scatter   backward all-gather      (after a row layer)

An all-reduce is a reduce-scatter then an all-gather, so replacing each all-reduce by one of
them moves the same bytes (Korthikanti et al. 2022). The collectives concatenate along axis 0,
so the sequence axis is moved to the front and back (a copy each way unless B == 1).

The all-reduces run in place on buffers the caller owns, so they allocate nothing.
"""
from __future__ import annotations

from ..runtime.backend import get_array_module


def copy_to_tp_backward(comm, dy):
    """Sums the input gradient over the TP group (in place on dy, which the caller owns)."""
    if comm.size == 1:
        return dy
    dy = _contiguous(dy)
    return comm.all_reduce(dy, "sum", out=dy)


def reduce_from_tp_forward(comm, partial):
    """Sums partial results over the TP group (in place on `partial`, which the caller owns)."""
    if comm.size == 1:
        return partial
    partial = _contiguous(partial)
    return comm.all_reduce(partial, "sum", out=partial)


def _last_dim_slice(comm, x):
    n = x.shape[-1]
    if n % comm.size:
        raise ValueError(f"last dimension {n} does not split over {comm.size} TP ranks")
    k = n // comm.size
    return x[..., comm.rank * k:(comm.rank + 1) * k]


def scatter_to_tp_forward(comm, x):
    if comm.size == 1:
        return x
    return _contiguous(_last_dim_slice(comm, x))


def gather_from_tp_forward(comm, x):
    """All-gathers along the last dimension: [..., k] on each rank -> [..., k * tp]."""
    if comm.size == 1:
        return x
    xp = get_array_module(x)
    moved = xp.ascontiguousarray(xp.moveaxis(x, -1, 0))  # gather along axis 0
    g = comm.all_gather(moved)  # [tp*k, ...]
    return xp.ascontiguousarray(xp.moveaxis(g, 0, -1))


scatter_to_tp_backward = gather_from_tp_forward
gather_from_tp_backward = scatter_to_tp_forward


def sequence_shard(comm, T: int) -> tuple[int, int]:
    """(first token, tokens) of this rank's shard of a sequence of T tokens."""
    if T % comm.size:
        raise ValueError(f"sequence length {T} does not split over {comm.size} TP ranks "
                         f"(sequence parallelism needs a multiple of {comm.size})")
    k = T // comm.size
    return comm.rank * k, k


def gather_from_sp_forward(comm, x):
    """All-gathers along the sequence: [B, T/tp, ...] on each rank -> [B, T, ...]."""
    if comm.size == 1:
        return x
    xp = get_array_module(x)
    g = comm.all_gather(xp.ascontiguousarray(xp.moveaxis(x, 1, 0)))  # [T, B, ...]
    return xp.ascontiguousarray(xp.moveaxis(g, 0, 1))


def reduce_scatter_to_sp_forward(comm, partial):
    """Sums partial [B, T, ...] over the TP group and keeps this rank's tokens: [B, T/tp, ...]."""
    if comm.size == 1:
        return partial
    xp = get_array_module(partial)
    sequence_shard(comm, partial.shape[1])
    r = comm.reduce_scatter(xp.ascontiguousarray(xp.moveaxis(partial, 1, 0)), "sum")  # [T/tp, B, ...]
    return xp.ascontiguousarray(xp.moveaxis(r, 0, 1))


gather_from_sp_backward = reduce_scatter_to_sp_forward
reduce_scatter_to_sp_backward = gather_from_sp_forward


def start_input_grad_sum(comm, dx, sequence_parallel: bool):
    """The column layer's backward collective, non-blocking (--tp-comm-overlap): dx summed over
    the TP group (copy_to_tp_backward) or, under sequence parallelism, reduce-scattered along
    the sequence (gather_from_sp_backward). Returns a function that waits and returns what the
    blocking mapping returns. (Rank-ordered sums, cutp.comm.mpi: at tp 2 the same bits as the
    blocking all-reduce; at more ranks MPI's own order may differ in the last bits.)"""
    if comm.size == 1:
        return lambda: dx
    xp = get_array_module(dx)
    if not sequence_parallel:
        dx = _contiguous(dx)
        request = comm.start_all_reduce(dx, "sum", out=dx)
        return request.wait
    sequence_shard(comm, dx.shape[1])
    request = comm.start_reduce_scatter(xp.ascontiguousarray(xp.moveaxis(dx, 1, 0)), "sum")  # [T/tp, B, ...]
    return lambda: xp.ascontiguousarray(xp.moveaxis(request.wait(), 0, 1))


def _contiguous(x):
    if x.flags.c_contiguous:
        return x
    return get_array_module(x).ascontiguousarray(x)
