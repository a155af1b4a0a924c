"""Embedding cutp in an existing MPI code.

    mpirun -np 4 python examples/embed.py

The host program owns MPI.COMM_WORLD. It splits the world into two halves and gives each half
its own cutp context (its own TP group, no shared state): one half runs a tensor-parallel
transformer block, the other a tensor-parallel MLP, on data the host code made itself. Arrays
cross the boundary through DLPack / __cuda_array_interface__ (`ctx.asarray`) and come back as
the host's own arrays; on a GPU, cutp works on the caller's current CuPy stream. Finally the
host code combines the two halves' results over its own communicator.
"""
from __future__ import annotations

import contextlib
import os
import sys

try:
    import cutp
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cutp

import numpy as np
from mpi4py import MPI

from cutp.tensor_parallel import BlockSpec, ParallelMLP, ParallelTransformerBlock, RNGTracker
from cutp.tensor_parallel.specs import AttentionSpec, MLPSpec, NormSpec


def host_data(seed, shape):
    """Stands for whatever the host code computes (a simulation field, features, ...)."""
    return np.random.default_rng(seed).standard_normal(shape)


def run_half(ctx, which, x_host):
    """Runs this half's model forward and backward; returns (y, dx) as host NumPy arrays."""
    h = x_host.shape[-1]
    if which == 0:
        spec = BlockSpec(h, NormSpec(), AttentionSpec(h, 4, 4, h // 4), MLPSpec(h, 4 * h))  # a GPT-2 block
        layer = ParallelTransformerBlock(ctx, spec, name="host.block",
                                         rng=RNGTracker(0, ctx.tp_rank), dtype=np.float64, seed=11)
    else:
        layer = ParallelMLP(ctx, h, 4 * h, name="host.mlp", dtype=np.float64, seed=12)
    stream = contextlib.nullcontext()
    if ctx.device == "cuda":
        import cupy  # optional dependency: only on GPUs

        stream = cupy.cuda.Stream(non_blocking=True)  # the host code's own stream: cutp follows it
        # The layer's weights were copied in (and its gradients zeroed) on the default stream, which
        # a non-blocking stream does not wait for: order that work before everything queued on it.
        stream.wait_event(cupy.cuda.get_current_stream().record())
    with stream:  # the copy in, the layer's kernels and collectives, the copy out: all on it
        x = ctx.asarray(x_host)  # zero-copy where possible (DLPack / CUDA array interface)
        y = layer.forward(x)
        dx = layer.backward(ctx.xp.ones_like(y))
        return ctx.to_numpy(y), ctx.to_numpy(dx)


def main():
    world = MPI.COMM_WORLD
    if world.size % 2:
        raise SystemExit("run with an even number of ranks (e.g. mpirun -np 4)")
    half = world.rank // (world.size // 2)
    sub = world.Split(color=half, key=world.rank)
    ctx = cutp.init(comm=sub, tp=sub.size, device=os.environ.get("CUTP_DEVICE", "cpu"))

    x = host_data(seed=100 + half, shape=(2, 6, 16))  # identical on the ranks of one half
    y, dx = run_half(ctx, half, x)

    # The host code checks cutp against a TP=1 run of the same layer on this rank alone...
    alone = cutp.init(comm=MPI.COMM_SELF, tp=1, device=ctx.device)
    y1, dx1 = run_half(alone, half, x)
    ok = np.allclose(y, y1, rtol=1e-10, atol=1e-12) and np.allclose(dx, dx1, rtol=1e-10, atol=1e-12)

    # ...and combines the halves' results over its own communicator.
    summary = np.array([float(np.abs(y).sum()), float(ok)])
    every = np.empty((world.size, 2))
    world.Allgather(summary, every)
    if world.rank == 0:
        halves = {0: "transformer block", 1: "MLP"}
        for r in range(world.size):
            print(f"rank {r} ({halves[r // (world.size // 2)]}, TP={sub.size}): |y|_1 = {every[r, 0]:.6f}, "
                  f"matches TP=1: {bool(every[r, 1])}")
    if not every[:, 1].all():
        raise SystemExit("a half disagreed with its TP=1 reference")
    for c in (alone, ctx):
        c.close()
    sub.Free()


if __name__ == "__main__":
    main()
