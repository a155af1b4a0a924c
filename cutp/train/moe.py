"""One optimizer step's mixture-of-experts figures: the auxiliary losses and the routing.

Each MoEMLP sums, over the step's training forwards (a recomputed forward is not counted again),
its load-balancing and z-losses and, per expert, the assignments the router made and those the
capacity dropped; all of them over the DP group's micro-batches already. `moe_step_stats` adds the
layers of every pipeline stage and resets the sums. The losses are per micro-batch means, as the
language-model loss is; the token counts are the step's.

`check_expert_parallel` checks a run's ep against the model and the rest of the layout.
"""
from __future__ import annotations

import numpy as np

from ..runtime.errors import ConfigError


def check_expert_parallel(cfg) -> None:
    """RunConfig's ep: an MoE model, ep dividing dp and n_experts (ConfigError naming the fix)."""
    ep, E = cfg.ep, cfg.model.n_experts
    if ep == 1:
        return
    if not E:
        raise ConfigError(f"`ep` {ep} splits the experts of an MoE model over ranks, but the model is dense "
                          "(n_experts=0); drop `ep` or give the model n_experts (`set` n_experts=N)")
    if cfg.dp % ep or E % ep:
        raise ConfigError(f"`ep` {ep} must divide dp={cfg.dp} and n_experts={E} (each EP group is ep consecutive DP "
                          f"ranks holding n_experts / ep experts each)")


def moe_step_stats(ctx, model, micro_batches: int) -> dict | None:
    """{"aux_loss", "z_loss", "dropped" (fraction of the assignments), "tokens_per_expert" [min,
    mean, max] (assignments per expert and layer)} of the step, or None for a dense model.
    Collective over the pipeline when pp > 1."""
    if not model.config.n_experts:
        return None
    mine = [(m.step_stats["aux_loss"], m.step_stats["z_loss"], m.step_stats["assigned"], m.step_stats["dropped"])
            for m in model.moe_layers]
    for m in model.moe_layers:
        m.reset_step_stats()
    if ctx.pp_size > 1:  # (host objects: a stage may hold no MoE layer)
        with ctx.watchdog.guard("the MoE statistics of the pipeline stages (host all-gather on pp)"):
            mine = [layer for stage in ctx.pp.mpi_comm.allgather(mine) for layer in stage]
    counts = np.concatenate([a for _, _, a, _ in mine])
    return {"aux_loss": sum(a for a, _, _, _ in mine) / micro_batches,
            "z_loss": sum(z for _, z, _, _ in mine) / micro_batches,
            "dropped": float(sum(d for _, _, _, d in mine) / max(counts.sum(), 1.0)),
            "tokens_per_expert": [float(counts.min()), float(counts.mean()), float(counts.max())]}
