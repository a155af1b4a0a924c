"""The ZeRO stage of a run (--zero 1|2|3, --reshard-after-forward): its checks and its optimizer.

    zero 1   the optimizer state sharded over DP x CP (--distributed-optimizer: DistributedAdamW,
             ExpertParallelAdamW at ep > 1)
    zero 2   the float32 gradients too, reduce-scattered unit by unit in every micro-batch
    zero 3   the parameters too, each unit gathered for its forward and its backward
             (cutp.optim.sharded.ShardedAdamW for both)
    --dp-replicate R   HSDP: zero 2/3 shard inside each of R replicas, gradients all-reduced across them
                       (at ep > 1 the experts over the expert-DP ranks inside a replica, summed across them)
"""
from __future__ import annotations

import contextlib

from ..optim import ShardedAdamW
from ..runtime.errors import ConfigError
from ..runtime.failure import errors_raised_on_every_rank
from ..tensor_parallel.grads import expert_replica_group, replica_group
from .defaults import layout_text

ZERO_STAGES = (0, 1, 2, 3)


def normalise_zero(cfg) -> None:
    """RunConfig's zero and distributed_optimizer made one: --distributed-optimizer is zero 1,
    and every stage from 1 shards the optimizer state (`distributed_optimizer` True)."""
    if cfg.distributed_optimizer and cfg.zero == 0:
        object.__setattr__(cfg, "zero", 1)
    if cfg.zero >= 1:
        object.__setattr__(cfg, "distributed_optimizer", True)


def check_one_stage(zero, distributed_optimizer) -> None:
    """`distributed_optimizer` is zero 1 (normalise_zero): given with `zero` 2 or 3, two stages are
    asked for, and neither can be chosen silently (ConfigError, one line)."""
    if distributed_optimizer and zero is not None and zero >= 2:
        raise ConfigError(f"`distributed_optimizer` is zero 1, and `zero` {zero} is given too: two ZeRO stages; omit "
                          f"`distributed_optimizer` (zero {zero} shards the optimizer state as well), or give `zero` 1")


def sharding_nothing(cfg) -> str | None:
    """The warning line of a ZeRO stage whose shard group is one rank (dp x cp / dp_replicate = 1):
    it runs, and shards nothing; None otherwise."""
    if cfg.zero < 1:
        return None
    ranks = cfg.dp * cfg.cp // (cfg.dp_replicate if cfg.zero >= 2 else 1)
    if ranks > 1:
        return None
    if cfg.dp_replicate > 1:
        return (f"warning: zero {cfg.zero} shards inside each of {cfg.dp_replicate} replicas of one rank (dp x cp = "
                f"{cfg.dp * cfg.cp}): nothing is sharded; fewer replicas would shard")
    return f"warning: zero {cfg.zero} shards over dp x cp, which is 1 here ({layout_text(cfg)}): nothing is sharded"


def check_zero(cfg) -> None:
    """ConfigError for a ZeRO stage the other settings cannot go with (one line, the fix)."""
    z = cfg.zero
    if not cfg.reshard_after_forward and z != 3:
        raise ConfigError(f"`reshard_after_forward` off keeps zero 3's gathered units to their backward, and `zero` "
                          f"is {z}; use `zero` 3, or omit `reshard_after_forward`")
    if cfg.dp_replicate > 1 and z < 2:
        raise ConfigError(f"`dp_replicate` {cfg.dp_replicate} shards zero 2 or 3 inside each of its replicas, and "
                          f"`zero` is {z}; use `zero` 3, or omit `dp_replicate`")
    if cfg.dp % cfg.dp_replicate:
        ok = [r for r in range(1, cfg.dp + 1) if cfg.dp % r == 0]
        raise ConfigError(f"`dp_replicate` {cfg.dp_replicate} must divide dp={cfg.dp} (R replicas of dp / R shards "
                          f"each); use a `dp_replicate` from [{', '.join(map(str, ok))}]")
    if z < 2:
        return
    if cfg.ep > 1 and (cfg.dp // cfg.dp_replicate) % cfg.ep:
        ok = [r for r in range(1, cfg.dp + 1) if cfg.dp % r == 0 and (cfg.dp // r) % cfg.ep == 0]
        raise ConfigError(f"`dp_replicate` {cfg.dp_replicate} leaves {cfg.dp // cfg.dp_replicate} DP rank(s) in each "
                          f"replica, and at `ep` {cfg.ep} a replica holds whole expert-parallel groups; use a "
                          f"`dp_replicate` from [{', '.join(map(str, ok))}]")
    if z == 2 and cfg.overlap_param_gather:
        raise ConfigError("`overlap_param_gather` prefetches the parameter gathers of zero 3 (and zero 1's), and "
                          "zero 2 gathers its updated parameters after the update; use `zero` 3, or omit "
                          "`overlap_param_gather`")
    if cfg.bucket_size is not None:
        raise ConfigError(f"`bucket_size` cuts the gradient buckets of zero 0 and 1, and zero {z} reduces unit by "
                          "unit; omit `bucket_size`, or use `zero` 1")


def sharded_optimizer(cfg, ctx, model, *, reads: bool = False, **kw) -> ShardedAdamW:
    """zero 2 or 3: the ShardedAdamW of `model`, whose hooks it becomes (GPT.unit_hooks). The tied
    token embedding on the first and last pipeline stages is deferred: its sum over the two
    stages runs on the shards at the end of the step. `reads`: the deferred parameters' draws read
    files (`init_from`: cutp.checkpoint.load_weights), so a failed read is raised on every rank
    (the optimizer's setup calls no collective)."""
    deferred = [model.tok_embed.weight] if (ctx.pp_size > 1 and cfg.model.tie_embeddings
                                            and model.tok_embed is not None) else []
    R, groups = cfg.dp_replicate, {}
    if R > 1:  # HSDP: R replicas of consecutive DP x CP ranks (at ep > 1, of expert-DP x CP ranks too:
        # the same replicas, as each holds whole EP groups)
        experts = expert_replica_group(ctx) if getattr(ctx, "ep_size", 1) > 1 else None
        for name, of in (("", replica_group(ctx)), ("expert_", experts)):
            if of is not None:
                n = of.size // R
                groups[f"{name}group"] = ctx.subgroup(f"hsdp_{name}shard", color=of.rank // n, key=of.rank, of=of,
                                                      expect=(of.rank % n, n))
                groups[f"{name}replicas"] = ctx.subgroup(f"hsdp_{name}replicas", color=of.rank % n, key=of.rank,
                                                         of=of, expect=(of.rank // n, R))
    with errors_raised_on_every_rank(ctx.world.mpi_comm) if reads else contextlib.nullcontext():
        optimizer = ShardedAdamW(model, ctx, zero=cfg.zero, **groups, deferred=deferred,
                                 reshard_after_forward=cfg.reshard_after_forward, overlap=cfg.overlap_grad_reduce,
                                 prefetch=cfg.overlap_param_gather, **kw)
    model.unit_hooks = optimizer
    return optimizer
