"""`mpiexec -n N python -m cutp bench comm`: every collective the runtime uses, over message sizes.

Reports time, algorithm bandwidth and bus bandwidth exactly as nccl-tests defines them
(doc/PERFORMANCE.md of nccl-tests):

    size    all_reduce, broadcast: the buffer; all_gather: the gathered output (n x each rank's
            part); reduce_scatter: the input (n x each rank's result)
    time    average over `iters` back-to-back calls, the maximum over the ranks
    algbw   size / time
    busbw   algbw * factor, factor = 2(n-1)/n for all_reduce, (n-1)/n for all_gather and
            reduce_scatter, 1 for broadcast: the per-link traffic of the optimal (ring)
            algorithm, comparable with the hardware's link bandwidth whatever n is.

CPU ranks use cutp's MpiCommunicator (NumPy buffers), GPU ranks its NcclCommunicator (CuPy
buffers; the stream is synchronised after the timed calls). all_reduce runs in place (as the
runtime calls it), the others into preallocated outputs. Each size is also checked once with
known data (column "check").
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import cutp

from ..runtime.threads import set_blas_threads, threads_per_rank
from ..train.reporting import Report, human_bytes, parse_size
from .common import device_of, machine_info, reduce_scalar

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for `op` over `n` ranks."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def bandwidths(op: str, size_bytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) for a collective moving `size_bytes` in `seconds`."""
    alg = size_bytes / seconds / 1e9
    return alg, alg * busbw_factor(op, n)


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    if factor < 2:
        raise ValueError("the size factor must be >= 2")
    out, s = [], max(1, min_bytes)
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def element_count(op: str, size_bytes: int, itemsize: int, n: int) -> int:
    """Elements of the size-defining buffer, rounded down so it splits evenly over n ranks."""
    count = size_bytes // itemsize
    if op in ("all_gather", "reduce_scatter"):
        count -= count % n
    return max(count, n if op in ("all_gather", "reduce_scatter") else 1)


def iterations(size_bytes: int, budget_bytes: int = 256 << 20, lo: int = 5, hi: int = 200) -> int:
    """More repeats for small messages (latency-bound), fewer for large ones."""
    return int(max(lo, min(hi, budget_bytes // max(size_bytes, 1))))


def _buffers(xp, op, count, dtype, n):
    if op == "all_reduce" or op == "broadcast":
        return xp.zeros(count, dtype), None
    if op == "all_gather":
        return xp.zeros(count // n, dtype), xp.empty(count, dtype)
    return xp.zeros(count, dtype), xp.empty(count // n, dtype)  # reduce_scatter


def _call(comm, op, x, out):
    if op == "all_reduce":
        comm.all_reduce(x, "sum", out=x)
    elif op == "all_gather":
        comm.all_gather(x, out=out)
    elif op == "reduce_scatter":
        comm.reduce_scatter(x, "sum", out=out)
    else:
        comm.broadcast(x, root=0)


def _check(xp, comm, op, count, dtype):
    """One call with known data; True if the result is right on this rank."""
    n, r = comm.size, comm.rank
    x, out = _buffers(xp, op, count, dtype, n)
    x[...] = r + 1
    _call(comm, op, x, out)
    if op == "all_reduce":
        return bool(xp.all(x == n * (n + 1) / 2))
    if op == "broadcast":
        return bool(xp.all(x == 1))
    if op == "reduce_scatter":
        return bool(xp.all(out == n * (n + 1) / 2))
    expect = xp.repeat(xp.arange(1, n + 1, dtype=dtype), count // n)
    return bool(xp.all(out == expect))


def run(args) -> Report:
    device, xp = device_of(args.device)
    world = MPI.COMM_WORLD
    n = world.Get_size()
    ctx = cutp.init(tp=n, dp=1, device=device)
    comm = ctx.world
    while hasattr(comm, "inner"):  # the raw MPI/NCCL communicator: no counting or watchdog in the loop
        comm = comm.inner
    report = Report("comm", machine_info(xp) if ctx.rank == 0 else {})
    report.meta.update(device=device, ranks=n, communicator=type(comm).__name__, dtype=args.dtype)
    dtype = np.dtype(args.dtype)
    if device == "cpu":
        set_blas_threads(threads_per_rank(ctx.local_size))
    top = parse_size(args.max_size) if args.max_size else (256 << 20 if device == "cuda" else 16 << 20)
    sizes = message_sizes(parse_size(args.min_size), top, args.factor or (2 if device == "cuda" else 4))
    ops = args.ops or list(OPS)
    t = report.table("comm", [("op", "collective", "", "<"), ("size_h", "size", "", ">"), ("count", "count", ",d"),
                              ("iters", "iters", "d"), ("us", "time us", ",.1f"), ("algbw", "algbw GB/s", ".2f"),
                              ("busbw", "busbw GB/s", ".2f"), ("check", "check", "", "<")],
                     title=f"{type(comm).__name__} over {n} ranks ({device}), {dtype.name}, nccl-tests definitions")
    stream_sync = (lambda: xp.cuda.get_current_stream().synchronize()) if xp is not np else (lambda: None)
    if n == 1:
        report.notes.append("one rank: collectives are copies or no-ops (busbw factor 0 for all_reduce); "
                            "run under mpiexec -n 2 or more")
    for op in ops:
        for size in sizes:
            count = element_count(op, size, dtype.itemsize, n)
            nbytes = count * dtype.itemsize
            iters = args.iters or iterations(nbytes)
            x, out = _buffers(xp, op, count, dtype, n)
            for _ in range(args.warmup):
                _call(comm, op, x, out)
            stream_sync()
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                _call(comm, op, x, out)
            stream_sync()
            dt = (time.perf_counter() - t0) / iters
            dt = reduce_scalar(world, dt)
            ok = _check(xp, comm, op, count, dtype)
            ok = reduce_scalar(world, 1 if ok else 0, 'min') == 1
            alg, bus = bandwidths(op, nbytes, dt, n)
            t.add(op=op, size=nbytes, size_h=human_bytes(nbytes), count=count, iters=iters, us=dt * 1e6, algbw=alg,
                  busbw=bus, check="ok" if ok else "WRONG")
            del x, out
    t.notes.append("busbw factor: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1")
    if device == "cpu" and not args.max_size:
        t.notes.append("CPU run capped at 16 MiB; --max-size 256M extends it")
    report.extra["rank"] = ctx.rank
    ctx.close()
    return report
