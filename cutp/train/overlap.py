"""The training step's overlap of communication with computation, and how much of it was hidden.

    --overlap-grad-reduce   the DP gradient reduction in buckets started during the last
                            micro-batch's backward (cutp.optim.buckets.GradBuckets)
    --bucket-size N         elements per bucket (default max(40M, 1M x dp), Megatron's)
    --overlap-param-gather  the distributed optimizer's updated parameters broadcast per bucket,
                            each waited for before the first layer using it in the next forward
                            (cutp.optim.buckets.ParamGather)
    --tp-comm-overlap       a column-parallel layer's backward starts the dX all-reduce (under
                            sequence parallelism the reduce-scatter) before its weight-gradient
                            GEMM and waits after it (cutp.tensor_parallel.layers); the pipeline
                            posts its receives early (cutp.train.pipeline)
    --link-bandwidth GB/s   every group's collectives timed as over a slower link
    --link-latency us       (cutp.comm.simulated: shared-memory MPI hides nothing worth seeing)

At ep > 1 the experts' gradients and parameters have buckets of their own over expert-DP
(x CP) (`expert_buckets`). None changes a bit of the losses or the weights
(tests/train/test_overlap.py). Each step
reports `comm_ms` (its collectives' time in flight), `exposed_comm_ms` (the time this rank
blocked on them) and `overlap_fraction` = 1 - exposed / comm (cutp.comm.counting).
"""
from __future__ import annotations

from ..optim import (ExpertParallelAdamW, GradBucketGroups, GradBuckets, ParamGather, ParamGathers,
                     default_bucket_size)
from ..tensor_parallel.grads import expert_replica_group, replica_size
from ..runtime.errors import ConfigError


# RunConfig's fields for all this (cutp.train.config)
OVERLAP_SETTINGS = ("overlap_grad_reduce", "bucket_size", "overlap_param_gather", "tp_comm_overlap",
                    "link_bandwidth", "link_latency")


def check_overlap(cfg) -> None:
    """ConfigError for overlap settings a RunConfig cannot take."""
    if cfg.overlap_param_gather and not cfg.distributed_optimizer:
        raise ConfigError("`overlap_param_gather` overlaps the gathers of ZeRO's parameters, and `zero` is 0; use "
                          "`zero` 1, or omit `overlap_param_gather`")


def set_up_overlap(run, group) -> None:
    """The gradient buckets of --overlap-grad-reduce (and the parameter gathers of
    --overlap-param-gather) of `run` over `group`, the gradient reduction group (the DP group;
    whatever group the gradients are averaged over). At ep > 1 the experts get buckets of their
    own over the expert-DP (x CP) group (`expert_buckets`)."""
    cfg, model = run.config, run.model
    size = cfg.bucket_size if cfg.bucket_size is not None else \
        default_bucket_size(group.size, sum(p.data.size for p in model.parameters()))
    backward = [u for c in reversed(range(model.pp_virtual)) for u in reversed(model.units(c))]
    forward = [u for c in range(model.pp_virtual) for u in model.units(c)]
    members = expert_buckets(run, group, backward, size) if cfg.ep > 1 else \
        [GradBuckets(run.optimizer, group, backward, size, tp=run.ctx.tp)]
    run.grad_buckets = members[0] if len(members) == 1 else GradBucketGroups(members)
    if cfg.overlap_param_gather:
        gathers = []
        for buckets in members:  # (each optimizer part's update starts its own)
            buckets.optimizer.param_gather = ParamGather(buckets, forward)
            gathers.append(buckets.optimizer.param_gather)
        run.param_gather = gathers[0] if len(gathers) == 1 else ParamGathers(gathers)
    model.set_tp_comm_overlap(cfg.tp_comm_overlap)


def expert_buckets(run, group, backward, size) -> list:
    """ep > 1 (Megatron's expert-parallel buffers): [the dense parameters' GradBuckets over
    `group`, the experts' over expert-DP x CP], the experts' summed and divided by dp x cp, as
    the optimizers' own reductions do (AdamW.reduce_gradients, DistributedAdamW's); of the
    ExpertParallelAdamW's two parts, or two regions of the plain AdamW's buffer. The bucket
    size is the dense group's for both (Megatron's one bucket_size). A pipeline stage without
    MoE layers has the dense buckets only."""
    opt, ctx = run.optimizer, run.ctx
    experts, n = expert_replica_group(ctx), replica_size(ctx)
    if isinstance(opt, ExpertParallelAdamW):
        out = [GradBuckets(opt.dense, group, backward, size, tp=ctx.tp)]
        if opt.experts is not None:
            out.append(GradBuckets(opt.experts, experts, backward, size, tp=ctx.tp, divide_by=n))
        return out
    e, end = opt.flat.expert_start, opt.flat.padded_size
    out = [GradBuckets(opt, group, backward, size, tp=ctx.tp, region=(0, e))]
    if e < opt.flat.size:
        out.append(GradBuckets(opt, experts, backward, size, tp=ctx.tp, region=(e, end), divide_by=n))
    return out


def overlap_fraction(comm_ms: float, exposed_ms: float) -> float | None:
    """1 - exposed / comm (None without communication)."""
    return None if comm_ms <= 0 else max(0.0, 1.0 - exposed_ms / comm_ms)


def comm_snapshot(ctx) -> tuple:
    """The context's communication times so far (the counter's, the simulated link's)."""
    link = getattr(ctx, "link", None)
    return ({g: tuple(v) for g, v in ctx.counter.times.items()},
            None if link is None else {g: tuple(v) for g, v in link.times.items()})


def _deltas(now: dict, before: dict) -> dict:
    return {g: ((a - before.get(g, (0.0, 0.0))[0]) * 1000, (b - before.get(g, (0.0, 0.0))[1]) * 1000)
            for g, (a, b) in now.items()}


def comm_times(ctx, before: tuple) -> dict:
    """StepStats' communication fields since `before` (a comm_snapshot): comm_ms,
    exposed_comm_ms and comm_ms_by_group ({group: (comm_ms, exposed_ms)}) from the counters'
    wall clock; with a simulated link, link_ms_by_group likewise from the link's account."""
    now_counter, now_link = comm_snapshot(ctx)
    by_group = _deltas(now_counter, before[0])
    out = dict(comm_ms=sum(c for c, _ in by_group.values()), exposed_comm_ms=sum(b for _, b in by_group.values()),
               comm_ms_by_group=by_group)
    if now_link is not None:
        out["link_ms_by_group"] = _deltas(now_link, before[1] or {})
    return out


def overlap_record(stats) -> dict:
    """The JSONL metrics of a StepStats' communication times."""
    rec = dict(comm_ms=stats.comm_ms, exposed_comm_ms=stats.exposed_comm_ms,
               overlap_fraction=overlap_fraction(stats.comm_ms, stats.exposed_comm_ms))
    if "dp" in stats.comm_ms_by_group:
        rec["dp_overlap_fraction"] = overlap_fraction(*stats.comm_ms_by_group["dp"])
    if stats.link_ms_by_group is not None:
        link = stats.link_ms_by_group
        total, exposed = sum(a for a, _ in link.values()), sum(b for _, b in link.values())
        rec.update(link_ms=total, link_exposed_ms=exposed, link_overlap_fraction=overlap_fraction(total, exposed))
        if "dp" in link:
            rec["dp_link_overlap_fraction"] = overlap_fraction(*link["dp"])
    return rec


def overlap_for_step(run):
    """(the ParamGather the step's first forward waits on, or None; the GradBuckets, reset for
    the step, or None). The parameter prefetch follows pp 1's forward of a dense model: a
    pipeline or an MoE model's counting pass first waits for every bucket."""
    gather = run.param_gather if run.param_gather is not None and run.param_gather.in_flight else None
    if gather is not None and (run.ctx.pp_size > 1 or run.model.moe_layers):
        finish_param_gather(run)
        gather = None
    if run.grad_buckets is not None:
        run.grad_buckets.reset()
    return gather, run.grad_buckets


def finish_param_gather(run) -> None:
    if run.param_gather is not None and run.param_gather.in_flight:
        run.param_gather.finish()
