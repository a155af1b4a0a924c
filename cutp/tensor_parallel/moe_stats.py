"""An MoE layer's routing statistics (its losses, assignments and drops), read on the host once
per training step for every layer together, not once per layer and forward.

Each training forward inside a step (`MoEMLP.begin_step` gave it the step's token count, so the
backward needs no host value) keeps its statistics vector on the device ([assigned per expert,
probability sums, tokens, sum of lse^2, dropped, sequences' sum f_i P_i], already summed over
the DP group) in the layer's `pending`; `read_pending` copies every pending vector of the given
layers to the host in ONE device-to-host copy and turns each into the forward's losses
(`MoEMLP.last`) and the step's sums (`step_stats`). The training step calls it once
(cutp.train.moe.moe_step_stats); `last` calls it for its own layer when read earlier. A forward
outside a step reads its statistics at once (its token count is one of them).

`finish_counting`: the counting pass's tallies of every layer, likewise in one copy.
"""
from __future__ import annotations

import numpy as np

from ..ops.common import compute_dtype
from ..runtime.backend import to_numpy


def losses(layer, host, n_all: float, f_host, seq_T) -> dict:
    """One forward's statistics on the host -> its part of the auxiliary losses and its counts."""
    E, k = layer.n_experts, layer.top_k
    z_sum, dropped, seq_sum = (float(v) for v in host[2 * E + 1:2 * E + 4])
    if f_host is None:
        f_host = host[:E] / (n_all * k)
    # the sequence-wise loss: alpha * sum_i f_i P_i averaged over the step's n_all / T sequences
    return {"aux_loss": layer.aux_loss_coeff * E * float((f_host * host[E:2 * E]).sum()) / n_all,
            "z_loss": layer.z_loss_coeff * z_sum / n_all,
            "seq_aux_loss": 0.0 if seq_T is None else layer.seq_aux_coeff * seq_sum * seq_T / n_all,
            "assigned": np.array(host[:E], np.float64), "dropped": dropped}


def settle(layer, host, n_all: float, f_host, seq_T, counted: bool) -> None:
    """The forward's figures as `layer.last`, and added to the step's sums when `counted` (a
    training forward that stashes: full recomputation's first pass is not counted twice)."""
    layer.last = last = losses(layer, host, n_all, f_host, seq_T)
    if counted:
        s = layer.step_stats
        for key in ("aux_loss", "z_loss", "seq_aux_loss", "dropped"):
            s[key] += last[key]
        s["assigned"] = s["assigned"] + last["assigned"]
        s["forwards"] += 1


def read_pending(layers) -> None:
    """Every pending forward's statistics of `layers` to the host in one copy, then settled in
    the order they ran."""
    pending = [(layer, p) for layer in layers for p in layer.pending]
    if not pending:
        return
    xp = pending[0][0].ctx.xp
    host = to_numpy(xp.concatenate([p[0].astype(np.float64) for _, p in pending]))
    at = 0
    for layer in layers:
        layer.pending = ()
    for layer, (stats, n_all, f_host, seq_T, counted) in pending:
        size = stats.shape[0]  # (its own dtype again: the figures a read of it alone gives)
        settle(layer, host[at:at + size].astype(stats.dtype), n_all, f_host, seq_T, counted)
        at += size


def finish_counting(layers) -> None:
    """The counting pass ends: each layer's tallies summed over its statistics groups, read in
    one copy for all layers, and the step's assignment fractions set (`MoEMLP.step_fractions`).
    Collective over those groups."""
    tallies = []
    for layer in layers:
        tally, layer._tally = layer._tally, None
        xp = layer.ctx.xp
        if isinstance(tally, float):  # (no forward ran: a stage of no micro-batch; not reached by train_step)
            tally = xp.zeros(layer.n_experts + 1, np.float64)
        for g in layer._stats_groups():
            g.all_reduce(tally, "sum", out=tally)
        tallies.append(tally)
    if not tallies:
        return
    host = to_numpy(layers[0].ctx.xp.concatenate(tallies))
    at = 0
    for layer, tally in zip(layers, tallies):
        E = layer.n_experts
        mine, at = host[at:at + E + 1], at + E + 1
        if layer.step_tokens is not None and mine[E] != layer.step_tokens:
            raise RuntimeError(f"the counting pass routed {mine[E]:g} tokens; the step has {layer.step_tokens:g}")
        cdt = compute_dtype(layer.router.data.dtype)
        f = mine[:E] / (mine[E] * layer.top_k)
        layer.step_fractions = (layer.ctx.asarray(f.astype(cdt)), f.astype(cdt))
