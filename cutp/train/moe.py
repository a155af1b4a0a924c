"""One optimizer step's mixture-of-experts losses and figures: the auxiliary losses over the
step's global batch, and the routing.

`moe_step` wraps a step's forwards and backwards: it gives every MoE layer the step's token count
T (all micro-batches, all DP ranks) and, when the step has several micro-batches and a non-zero
load-balancing coefficient, first runs the counting pass that gives each layer the step's
assignments per expert (cutp.tensor_parallel.moe, "The step's statistics", says why and what it
costs). The load-balancing and z-losses, and their gradients, are then those of one rank running
the global batch as one micro-batch: neither --micro-batch-size nor dp nor cp changes them (a capacity,
moe_capacity_factor, stays per micro-batch and DP rank: with one, the micro-batch size changes
what is dropped).

Each MoEMLP sums, over the step's training forwards (a recomputed forward is not counted again),
its parts of the load-balancing and z-losses and, per expert, the assignments the router made and
those the capacity dropped; all of them over the DP (x CP) group's micro-batches already.
`moe_step_stats` adds the layers of every pipeline stage and resets the sums: the step's losses
(summed over the layers) and token counts; before, each layer with a correction bias and a
moe_bias_update_rate plans its bias move from the step's assignments (DeepSeek-V3's
auxiliary-loss-free balancing), which `apply_moe_bias_updates` makes after the optimizer step
(a skipped step moves nothing; the bias has no gradient, so the optimizer leaves it as it is).

`check_expert_parallel` checks a run's ep against the model and the rest of the layout.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..runtime.errors import ConfigError
from ..tensor_parallel.moe_stats import finish_counting, read_pending
from ..tensor_parallel.parameter import not_stashed
from .pipeline import forwards_only


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


@contextlib.contextmanager
def moe_step(run, batches, step: int, first_row):
    """The step's forwards and backwards inside: the MoE layers' auxiliary losses over its global
    batch (module docstring). `batches`: this DP rank's [(x, y)] host arrays (every DP rank holds
    as many, of the same shape); `first_row(i)`: micro-batch i's first row in the global batch
    (dropout positions). Nothing for a dense model. Collective (the counting pass)."""
    model = run.model
    if not model.config.n_experts:
        yield
        return
    tokens = run.ctx.dp_size * sum(int(x.size) for x, _ in batches)
    for layer in model.moe_layers:
        layer.begin_step(tokens)
    try:
        if len(batches) > 1 and model.config.moe_aux_loss_coeff > 0:
            _count_assignments(run, batches, step, first_row)
        yield
    finally:
        for layer in model.moe_layers:
            layer.end_step()


def _count_assignments(run, batches, step: int, first_row) -> None:
    """The counting pass: a training-mode forward of every micro-batch, keeping nothing, through
    the pipeline at pp > 1 (with context parallelism on each CP rank's chunks, as the step's
    forwards); each MoE layer adds up its assignments per expert, then sums them over the DP
    (x CP) group."""
    model, ctx = run.model, run.ctx
    for layer in model.moe_layers:
        layer.start_counting()
    streams = dict(model.rng.offsets)  # (named sites draw by position and advance no stream; a checkpoint
    # saves the streams, so the pass leaves them as it found them whatever a site does)
    with not_stashed(model):
        if ctx.pp_size > 1:
            forwards_only(run, batches, step=step, first_row=first_row)
        else:
            for micro, (x, y) in enumerate(batches):
                model.rng.set_position(step, first_row(micro), run.config.batch_size)
                model.check_inputs(x, y)  # on the host arrays, before any collective
                model.stage_forward(ctx.asarray(x), head=False)
                ctx.watchdog.progress()
    model.rng.offsets = streams
    finish_counting(model.moe_layers)  # (every layer's tallies in one host read)


def moe_step_stats(ctx, model) -> dict | None:
    """{"aux_loss", "z_loss", "seq_aux_loss" (the step's, summed over the MoE layers), "dropped" (fraction of the
    assignments), "tokens_per_expert" [min, mean, max] (assignments per expert and layer)} of the
    step, or None for a dense model. Collective over the pipeline when pp > 1."""
    if not model.config.n_experts:
        return None
    read_pending(model.moe_layers)  # (the step's routing statistics, every layer's in one host read)
    mine = [(m.step_stats["aux_loss"], m.step_stats["z_loss"], m.step_stats["assigned"], m.step_stats["dropped"],
             m.step_stats["seq_aux_loss"]) for m in model.moe_layers]
    for m in model.moe_layers:  # (DeepSeek's correction bias: from the step's global counts, every layout alike)
        m.plan_score_bias(m.step_stats["assigned"])
        m.reset_step_stats()
    if ctx.pp_size > 1:  # (host objects: a stage may hold no MoE layer)
        with ctx.watchdog.guard("the MoE statistics of the pipeline stages (host all-gather on pp)"):
            mine = [layer for stage in ctx.pp.mpi_comm.allgather(mine) for layer in stage]
    counts = np.concatenate([layer[2] for layer in mine])
    return {"aux_loss": sum(layer[0] for layer in mine),
            "z_loss": sum(layer[1] for layer in mine),
            "seq_aux_loss": sum(layer[4] for layer in mine),
            "dropped": float(sum(layer[3] for layer in mine) / max(counts.sum(), 1.0)),
            "tokens_per_expert": [float(counts.min()), float(counts.mean()), float(counts.max())]}


def apply_moe_bias_updates(model) -> None:
    """After the optimizer step: every MoE layer's planned correction-bias move (`moe_step_stats`)."""
    for m in model.moe_layers:
        m.apply_score_bias()
