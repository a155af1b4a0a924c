"""Once per optimizer step: finish the gradient reduction, then measure the global norm.

finish_grad_sync: run each parameter's grad_sync hook (GQA-replicated KV columns summed over
the ranks that hold them), sum the sequence-parallel parameters' gradients over TP, then
average every gradient over the ranks that hold the same weights (DP x CP: `replica_group`) in
a few flat buckets.

global_grad_norm: each full parameter entry counts exactly once (Megatron's rule): shards of
TP-split parameters are summed over the TP ranks, replicated parameters (LayerNorm, biases of
row layers, position embeddings) are counted on TP rank 0 only, not tp times, and tied weights
once; with expert parallelism each rank's experts are summed over the EP group (Megatron PR
#5916 left them out). One all-reduce of two float64 over the TP group (and the EP group).
"""
from __future__ import annotations

import math

import numpy as np

from ..runtime.backend import get_array_module, host_values
from ..runtime.errors import ConfigError

BUCKET_ELEMENTS = 1 << 24  # 16M elements (64 MB of float32) per DP all-reduce


def tp_grad_sync(params, tp=None) -> None:
    """Once per step before the DP reduction: each parameter's grad_sync hook (GQA: KV columns
    replicated over TP ranks summed), then the gradients of the parameters marked
    `sequence_parallel` (LayerNorms, row biases, positions used on sequence shards; the final
    LayerNorm too, Megatron's bug #1446) and those marked `tp_partial` (MoE experts, whose
    tokens are split over TP) summed over the TP group `tp`, in one all-reduce per dtype, so
    that every TP rank holds the same full gradient."""
    params = [p for p in params if p.trainable]  # (frozen: no gradient)
    for p in params:
        if p.grad_sync is not None:
            p.grad_sync(p)
    partial = [p for p in params if p.sequence_parallel or p.tp_partial]
    if not partial:
        return
    if tp is None:
        raise ValueError("tp_grad_sync: parameters are marked sequence_parallel or tp_partial; pass the TP group "
                         "(ctx.tp)")
    if tp.size == 1:
        return
    by_dtype = {}
    for p in partial:
        by_dtype.setdefault(np.dtype(p.grad.dtype).name, []).append(p)
    for group in by_dtype.values():
        xp = get_array_module(group[0].grad)
        flat = xp.concatenate([p.grad.reshape(-1) for p in group])
        tp.start_all_reduce(flat, "sum", out=flat).wait()  # rank-ordered: the same sums however cut
        off = 0
        for p in group:
            p.grad[...] = flat[off:off + p.grad.size].reshape(p.grad.shape)
            off += p.grad.size


def sum_grad_over(group):
    """A grad_sync hook: the parameter's gradient summed over `group` (in place), for a parameter
    held whole by each of the group's ranks that each see part of its use (a tied embedding on
    the first and last pipeline stages)."""

    def sync(param):
        if group is None or group.size == 1 or not param.trainable:
            return
        g = param.grad
        if g.flags.c_contiguous:
            group.all_reduce(g, "sum", out=g)
        else:
            part = get_array_module(g).ascontiguousarray(g)
            group.all_reduce(part, "sum", out=part)
            g[...] = part

    return sync


def replica_group(ctx):
    """The ranks that hold the same weights and average their gradients: DP x CP (`ctx.dp_cp`:
    with context parallelism each CP rank's gradient is its chunks' part; a context of cutp
    before context parallelism, or a stand-in of one: its DP group)."""
    return getattr(ctx, "dp_cp", None) or ctx.dp


def replica_size(ctx) -> int:
    return getattr(ctx, "dp_cp_size", ctx.dp_size)


def expert_replica_group(ctx):
    """The ranks that hold the same experts of an expert-parallel model (ep > 1) and sum their
    gradients: expert-DP x CP (`ctx.expert_dp_cp`; the expert-DP group at cp 1 or in a context
    of cutp before context parallelism)."""
    return getattr(ctx, "expert_dp_cp", None) or ctx.expert_dp


def finish_grad_sync(params, ctx, flat=None) -> None:
    """`flat`: a FlatParameters holding every gradient; then one in-place all-reduce suffices.
    (Training reduces over DP x CP through its optimizer: cutp.optim's reduce_gradients.)"""
    params = [p for p in params if p.trainable]
    if any(p.expert_parallel for p in params):
        raise ConfigError("finish_grad_sync averages every gradient over DP x CP; expert-parallel experts (ep > 1) are "
                          "reduced over the expert-DP x CP group: use cutp.optim's AdamW.reduce_gradients")
    tp_grad_sync(params, ctx.tp)
    if replica_size(ctx) == 1:
        return
    group = replica_group(ctx)
    if flat is not None:
        group.all_reduce(flat.grad, "avg", out=flat.grad)
        return
    for bucket in _buckets(params):
        xp = get_array_module(bucket[0].grad)
        flat = xp.concatenate([p.grad.reshape(-1) for p in bucket])
        group.all_reduce(flat, "avg", out=flat)
        off = 0
        for p in bucket:
            n = p.grad.size
            p.grad[...] = flat[off:off + n].reshape(p.grad.shape)
            off += n


def _buckets(params):
    by_dtype = {}
    for p in params:
        by_dtype.setdefault(np.dtype(p.grad.dtype).name, []).append(p)
    for group in by_dtype.values():
        bucket, n = [], 0
        for p in group:
            if bucket and n + p.grad.size > BUCKET_ELEMENTS:
                yield bucket
                bucket, n = [], 0
            bucket.append(p)
            n += p.grad.size
        if bucket:
            yield bucket


def global_grad_norm(params, ctx) -> float:
    """The global L2 norm of all gradients, each full entry counted once; NaN if any rank holds a
    non-finite gradient entry, including entries it does not count (a replicated LayerNorm's
    copy on TP rank 1 still has to stop the step, or the replicas would diverge)."""
    xp = ctx.xp
    acc = xp.zeros(2, np.float64)  # [sum of squares, non-finite entries not already counted]
    experts = xp.zeros(2, np.float64)  # the same for this rank's expert-parallel experts
    for p in params:
        if not p.trainable:
            continue
        a = experts if p.expert_parallel else acc
        s = p.grad_sq_sum()
        if s is not None:
            a[0] += s
        if p.norm_mask is not None:  # some or all entries are counted on another rank
            a[1] += int((~xp.isfinite(p.grad)).sum()) if xp is np else (~xp.isfinite(p.grad)).sum()
    if getattr(ctx, "ep_size", 1) > 1:  # the EP group's ranks hold different experts: each counted once
        ctx.ep.all_reduce(experts, "sum", out=experts)
        acc += experts
    if ctx.tp_size > 1:
        ctx.tp.all_reduce(acc, "sum", out=acc)
    if getattr(ctx, "pp_size", 1) > 1:  # every pipeline stage's parameters (a tied copy counted once)
        ctx.pp.all_reduce(acc, "sum", out=acc)
    total, bad = host_values(acc)  # one read of the pair
    if bad or not math.isfinite(total):
        return float("nan")
    return math.sqrt(total)
