"""ZeRO-2, ZeRO-3 and HSDP planned by formula from the model's units (cutp.optim.units).

    got = zero_plan(config, dp=4, zero=3, accum=2)
    got["state"]           {"params", "grads", "optimizer"}: bytes per rank
    got["gathered_peak"]   zero 3: the most bytes of whole units held at once
    got["comm"]            {"GROUP.OP": {"calls", "elements", "bytes"}} as cutp.comm.counting counts them

The layout is the one cutp.optim.sharded allocates: each unit a segment (a parameter two units
use, or the tied embedding across pipeline stages, one of its own), padded to d x C elements,
C a multiple of 64; d the ranks a segment is sharded over (DP x CP, or one of R HSDP replicas).
Per rank: S = sum of C. zero 2 holds the parameters whole (d S elements), zero 3 its S; both
hold S float32 gradients (float64 for float64 models) and S x (m, v, fp32 master of 16-bit
models) of optimizer state.

Communication per step, the counters' way (an all-gather's bytes: this rank's contribution, C;
on the wire x (d - 1)); m micro-batches:
    zero 3 all-gathers   m x 2 x the segments of every unit, each unit's gathered for its
                         forward and again for its backward (but the model's last unit, the
                         LM head, kept from its forward to its backward), in the model's dtype; without
                         resharding 1 x each segment whenever a forward finds none of its
                         chunk's micro-batches in flight (m times at pp 1, once per step on
                         the first stages of 1F1B)
    reduce-scatters      m x each segment, d C elements, in the reduction dtype (float32 unless
                         --grad-reduce-dtype bfloat16)
    zero 2 all-gathers   1 x each segment after the update
    HSDP                 1 all-reduce of the S gradient shard over the replicas
    the norm             1 all-reduce of 2 float64 over the shard group
Gathered peak (zero 3): with resharding, the largest unit (with --overlap-param-gather two
consecutive units of a chunk, their shared segments once); without, every segment.
"""
from __future__ import annotations

import numpy as np

from ..comm.shape_only import ShapeOnlyContext
from ..models import DTYPES, GPT, GPTConfig
from ..optim.flat import grad_dtype_for, is_low_precision, state_dtype_for
from ..optim.units import unit_key, unit_layout
from ..train.pipeline import plan as pipeline_plan


def zero_plan(config: GPTConfig, *, tp: int = 1, dp: int = 1, pp: int = 1, cp: int = 1, rank: int = 0,
              zero: int = 3, accum: int = 1, reshard_after_forward: bool = True, prefetch: bool = False,
              dp_replicate: int = 1, grad_reduce_dtype: str = "float32", pp_layers=None, pp_virtual: int = 1,
              schedule: str | None = None) -> dict:
    """The state, gathered peak and communication of world rank `rank` (module docstring)."""
    ctx = ShapeOnlyContext(tp=tp, dp=dp, pp=pp, cp=cp, rank=rank, device="cpu")
    model = GPT(ctx, config, init=False, pp_layers=pp_layers, pp_virtual=pp_virtual)
    whole = dp * cp
    d = whole // dp_replicate
    deferred = {id(model.tok_embed.weight)} if pp > 1 and config.tie_embeddings and model.tok_embed is not None \
        else set()
    segments, unit_segments, after, _ = unit_layout(model, d, deferred)
    dtype = np.dtype(DTYPES[config.dtype])
    pb, gb = dtype.itemsize, grad_dtype_for(dtype).itemsize
    rb = 2 if grad_reduce_dtype == "bfloat16" else gb
    sb = state_dtype_for(dtype).itemsize
    S = sum(s.chunk for s in segments)
    state = {"params": (S if zero == 3 else d * S) * pb, "grads": S * gb,
             "optimizer": S * (2 * sb + (4 if is_low_precision(dtype) else 0))}
    group = "hsdp_shard" if dp_replicate > 1 else ("dp_cp" if cp > 1 else "dp")
    comm = {}

    def add(op, calls, elements, itemsize, name=group):
        if calls:
            c = comm.setdefault(f"{name}.{op}", {"calls": 0, "elements": 0, "bytes": 0})
            c["calls"] += calls
            c["elements"] += elements
            c["bytes"] += elements * itemsize

    used = [s for segs in unit_segments.values() for s in segs]
    if zero == 3 and reshard_after_forward:  # (the model's last unit once: kept from its forward to its backward)
        last = model.units(pp_virtual - 1)[-1] if model.gives_loss(pp_virtual - 1) else None
        kept = unit_segments[unit_key(last)] if last is not None else []
        add("all_gather", accum * (2 * len(used) - len(kept)),
            accum * (2 * sum(s.chunk for s in used) - sum(s.chunk for s in kept)), pb)
    elif zero == 3:  # each chunk's segments gathered when its first micro-batch in flight starts
        for c, gathers in enumerate(_first_in_flight(pp, ctx.pp_rank, accum, pp_virtual, schedule)):
            segs = list({id(s): s for u in model.units(c) for s in unit_segments[unit_key(u)]}.values())
            add("all_gather", gathers * len(segs), gathers * sum(s.chunk for s in segs), pb)
    if d > 1:
        add("reduce_scatter", accum * len(segments), accum * d * S, rb)
        if zero == 2:
            add("all_gather", len(segments), S, pb)
    if dp_replicate > 1:
        add("all_reduce", 1, S, rb, "hsdp_replicas")
    add("all_reduce", 1, 2, 8)  # the norm's [sum of squares, non-finite entries]

    def held(segs):
        return sum(d * s.chunk * pb for s in {id(s): s for s in segs}.values())

    peak = 0
    if zero == 3:
        if not reshard_after_forward:
            peak = held(used)
        else:
            for key, segs in unit_segments.items():
                nxt = after.get(key)
                peak = max(peak, held(segs + (unit_segments[nxt] if prefetch and nxt is not None else [])))
    return {"state": state, "gathered_peak": peak, "comm": comm, "segments": len(segments), "shard_elements": S}


def _first_in_flight(p: int, s: int, m: int, V: int, schedule: str | None) -> list[int]:
    """Per model chunk of stage s: how often a forward starts with none of the chunk's micro-
    batches in flight (what a zero 3 gather costs without resharding: a unit stays whole from
    a micro-batch's forward to its backward, so while any is in flight)."""
    if p == 1:
        return [m]
    kind = schedule or ("interleaved" if V > 1 else "1f1b")
    flying, starts = [0] * V, [0] * V
    for op in pipeline_plan(kind, p, s, m, V):
        if op[0] == "F":
            starts[op[2]] += flying[op[2]] == 0
            flying[op[2]] += 1
        elif op[0] == "B":
            flying[op[2]] -= 1
    return starts


def zero_state_bytes(n_local: int, *, dtype: str, d: int, zero: int) -> dict:
    """`cutp.plan.layout.state_bytes` at zero 2 or 3 by formula, for models the planner does not
    build (--params): the rank's n_local parameters padded as one segment to d x 64 elements
    (the run pads each unit's: at most (units - 1) x d x 64 elements more)."""
    item = np.dtype(DTYPES[dtype])
    pb, gb, sb = item.itemsize, grad_dtype_for(item).itemsize, state_dtype_for(item).itemsize
    shard = -(-int(n_local) // (64 * d)) * 64
    return {"params": (shard if zero == 3 else d * shard) * pb, "grads": shard * gb,
            "optimizer": shard * (2 * sb + (4 if is_low_precision(item) else 0)), "padded": d * shard,
            "shard": shard}


def zero_collectives(n_padded: int, *, d: int, replicas: int, zero: int, accum: int, dtype: str, units: int,
                     reshard_after_forward: bool = True, grad_reduce_dtype: str = "float32",
                     counted: dict | None = None, group: str = "dp") -> dict:
    """The plan's DP collectives at zero 2 or 3 (cutp.plan.layout's `coll` entries): dp_reduce_scatter
    (accum x the padded buffer, in the reduction dtype, one call per unit), dp_all_gather (zero 3:
    2 x accum x the rank's shard with resharding, accum x without; zero 2: once after the update),
    dp_allreduce (none), dp_replicas_allreduce (HSDP: the shard, once per step). `counted`: a
    `zero_plan`'s comm (exact, from the model's units; `group` its shard group's name) instead."""
    item = np.dtype(DTYPES[dtype])
    pb = item.itemsize
    rb = 2 if grad_reduce_dtype == "bfloat16" else grad_dtype_for(item).itemsize
    shard = n_padded // d
    times = (2 * accum if reshard_after_forward else accum) if zero == 3 else int(d > 1)
    formula = {"reduce_scatter": (accum * units * (d > 1), accum * n_padded * (d > 1), rb),
               "all_gather": (times * units, times * shard, pb),
               "all_reduce": (int(replicas > 1), shard * (replicas > 1), rb)}
    if counted is not None:
        formula = {op: (c["calls"], c["elements"], c["bytes"] // max(1, c["elements"]))
                   for op, c in ((op, counted.get(f"{g}.{op}", {"calls": 0, "elements": 0, "bytes": 0}))
                                 for op, g in (("reduce_scatter", group), ("all_gather", group),
                                               ("all_reduce", "hsdp_replicas")))}

    def coll(op, factor):
        calls, elements, itemsize = formula[op]
        return {"calls": calls, "elements": elements, "bytes": elements * itemsize,
                "wire_bytes": elements * itemsize * factor}

    return {"dp_allreduce": {"calls": 0, "elements": 0, "bytes": 0, "wire_bytes": 0.0},
            "dp_reduce_scatter": coll("reduce_scatter", (d - 1) / d),
            "dp_all_gather": coll("all_gather", d - 1),
            "dp_replicas_allreduce": coll("all_reduce", 2 * (replicas - 1) / replicas)}


def gathered_units_bytes(unit_params: int, n_local: int, *, dtype: str, reshard_after_forward: bool = True) -> int:
    """zero 3's whole units at once, by formula: two of the largest (`unit_params` elements: the
    one computing and the next in flight) with resharding, every parameter without."""
    pb = np.dtype(DTYPES[dtype]).itemsize
    return (2 * unit_params if reshard_after_forward else n_local) * pb
