"""Helpers for TP=N versus TP=1 tests (used inside MPI workers)."""
from __future__ import annotations

import numpy as np

import cutp
from cutp.tensor_parallel import finish_grad_sync, gather_full


def group_ctx(n: int, device="cpu"):
    """Splits COMM_WORLD into groups of n contiguous ranks; returns (ctx, sub_mpi_comm). Collective."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    sub = world.Split(color=world.rank // n, key=world.rank)
    return cutp.init(comm=sub, tp=n, device=device), sub


def first_ranks(n: int):
    """The first n ranks of COMM_WORLD as a communicator, COMM_NULL on the others: one launch runs
    cases of several sizes one after the other. Collective."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)


def wait_for_all(comm) -> None:
    """A barrier whose waiting ranks sleep rather than spin (MPICH's Barrier polls): with fewer
    cores than ranks, the ranks still working keep the cores."""
    import time

    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def on_rank_0(compute):
    """compute() on rank 0 of COMM_WORLD alone, its result broadcast to every rank: the one-rank
    reference every rank compares against, computed once rather than by every rank (with fewer
    cores than ranks, n copies take n times as long); the other ranks sleep meanwhile. Collective."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    result = compute() if world.rank == 0 else None
    wait_for_all(world)
    return world.bcast(result, root=0)


def self_ctx(device="cpu"):
    """A TP=1 context on this rank alone: the reference every rank computes for itself."""
    from mpi4py import MPI

    return cutp.init(comm=MPI.COMM_SELF, tp=1, device=device)


def full_grads(module, ctx, sync=True) -> dict:
    if sync:
        finish_grad_sync(module.parameters(), ctx)
    return {p.name: np.asarray(ctx.to_numpy(gather_full(ctx.tp, p.grad, p.sharding))) for p in module.parameters()}


def full_params(module, ctx) -> dict:
    return {p.name: np.asarray(ctx.to_numpy(gather_full(ctx.tp, p.data, p.sharding))) for p in module.parameters()}


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise AssertionError(f"shape {got.shape} != reference {ref.shape}")
    scale = max(float(np.abs(ref).max()) if ref.size else 0.0, 1e-30)
    return float(np.abs(got - ref).max()) / scale if ref.size else 0.0


def assert_close(got, ref, rtol, what):
    if isinstance(ref, dict):
        assert set(got) == set(ref), f"{what}: names differ: {sorted(set(got) ^ set(ref))}"
        for k in ref:
            assert_close(got[k], ref[k], rtol, f"{what}[{k}]")
        return
    e = rel_err(got, ref)
    assert e <= rtol, f"{what}: relative error {e:.3e} > {rtol:.0e}"


def tol(dtype) -> float:
    return 1e-10 if np.dtype(dtype) == np.float64 else 1e-5
