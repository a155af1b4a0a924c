"""The step's reductions of host numbers over groups: each micro-batch's weight in the loss (the
mean over the global count of non-ignored targets, over DP x CP), the DP mean of a loss, the
last pipeline stage's value on every stage. Each is one host collective named for the watchdog."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from ..comm.context import Context
from ..tensor_parallel.context_parallel import take_local


def loss_weights(ctx: Context, targets, ignore_index: int) -> list[float]:
    """The weight of each micro-batch's mean loss in the step's loss, the mean over every
    target of the global batch that is not ignore_index: dp * c_m / C for a micro-batch with c_m
    such targets out of C over all DP ranks (DP averages the gradients, hence dp). With context
    parallelism, over the DP x CP group: c_m counts this CP rank's chunks' targets, and dp is
    dp * cp (the gradients are averaged over DP x CP). Ranks and
    micro-batches holding different numbers of ignored targets then give one rank's loss and
    gradients (Hugging Face's num_items_in_batch fix); without ignored targets it is 1 / accum.
    One host all-reduce of an integer over DP."""
    if ctx.cp_size > 1:  # each CP rank's loss is the mean over its own chunks' targets
        targets = [take_local(np.asarray(y), ctx.cp_size, ctx.cp_rank) for y in targets]
    counts = [int((np.asarray(y) != ignore_index).sum()) for y in targets]
    total = np.array([sum(counts)], dtype=np.int64)
    if ctx.dp_cp_size > 1:
        with ctx.watchdog.guard(f"the target count (host all-reduce on {ctx.dp_cp.name})"):
            ctx.dp_cp.mpi_comm.Allreduce(MPI.IN_PLACE, total)
    if not total[0]:
        return [0.0] * len(counts)
    return [ctx.dp_cp_size * c / int(total[0]) for c in counts]


def from_last_stage(ctx: Context, value: float) -> float:
    """The last pipeline stage's value (the loss is computed there), on every stage."""
    with ctx.watchdog.guard("the loss from the last pipeline stage (host broadcast on pp)"):
        return float(ctx.pp.mpi_comm.bcast(value, root=ctx.pp_size - 1))


def dp_mean(ctx: Context, value: float, what: str, per_cp_rank: bool = False) -> float:
    """The mean of a host float over the DP group (sum, then divided by dp: the order the
    losses have always been averaged in); `per_cp_rank`: over DP x CP (a training loss, whose
    CP ranks each hold their chunks' part; evaluation runs whole sequences on every CP rank).
    Named for the watchdog: a peer that never comes shows as this reduction."""
    buf = np.array([value])
    group = ctx.dp_cp if per_cp_rank else ctx.dp
    with ctx.watchdog.guard(f"{what} (host all-reduce on {group.name})"):
        group.mpi_comm.Allreduce(MPI.IN_PLACE, buf)
    return float(buf[0]) / group.size


def dp_sums(ctx: Context, values: list, what: str) -> list[float]:
    """Host floats summed over the DP group (evaluation: each DP rank's loss sum and target count)."""
    buf = np.array(values, dtype=np.float64)
    with ctx.watchdog.guard(f"{what} (host all-reduce on {ctx.dp.name})"):
        ctx.dp.mpi_comm.Allreduce(MPI.IN_PLACE, buf)
    return [float(v) for v in buf]


@contextmanager
def losses_on_device(model):
    """The step's micro-batch losses kept on the device (`VocabParallelCrossEntropy.defer_loss`):
    the step sums them there and reads the sum once, after the gradient norm's read."""
    loss_fn = getattr(model, "loss_fn", None)  # (None on a pipeline stage without the LM head)
    if loss_fn is None:
        yield
        return
    loss_fn.defer_loss = True
    try:
        yield
    finally:
        loss_fn.defer_loss = False
