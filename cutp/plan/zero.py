"""ZeRO-2, ZeRO-3 and HSDP planned by formula from the model's units (cutp.optim.units).

    got = zero_plan(config, dp=4, zero=3, accum=2)
    got["state"]           {"params", "grads", "optimizer"}: bytes per rank
    got["gathered_peak"]   zero 3: the most bytes of whole units held at once
    got["init_above_state"]  zero 3: the most bytes its setup holds above the state (one unit whole)
    got["load_above_state"]  zero 3 with --init-from: the same, each parameter read from its file
    got["comm"]            {"GROUP.OP": {"calls", "elements", "bytes"}} as cutp.comm.counting counts them
    got["shard_elements"], got["whole_elements"]  the rank's shard (S), its segments whole (d C each)

The layout is the one cutp.optim.sharded allocates: each unit a segment (a parameter two units
use, or the tied embedding across pipeline stages, one of its own), padded to d x C elements,
C a multiple of 64; d the ranks a segment is sharded over (DP x CP, or one of R HSDP replicas;
at ep > 1 an MoE layer's experts are a segment of their own over the expert-DP x CP ranks,
d / ep, whose reductions and gathers run over that group).
Per rank: S = sum of C, T = that of the trainable segments (`finetune`: --freeze, LoRA; frozen
parameters are segments of their own). zero 2 holds the parameters whole (d S elements), zero 3
its S; both hold T float32 gradients (float64 for float64 models) and T x (m, v, fp32 master of
16-bit models) of optimizer state.

Communication per step, the counters' way (an all-gather's bytes: this rank's contribution, C;
on the wire x (d - 1)); m micro-batches:
    zero 3 all-gathers   in the model's dtype, replayed over the stage's forwards and backwards
                         in its schedule's order (`_simulate`): a unit's segments are gathered
                         before its forward and its backward unless held (without resharding
                         from the forward to the backward; the LM head always; the embeddings
                         from their backward to the next forward): at pp 1 about 2 m x every
                         unit, less m x the head and (m - 1) x the embeddings
    reduce-scatters      m x each trainable segment, d C elements, in the reduction dtype (float32 unless
                         --grad-reduce-dtype bfloat16)
    zero 2 all-gathers   1 x each trainable segment after the update
    HSDP                 1 all-reduce of the T gradient shard over the replicas (at ep > 1 the
                         experts' pieces in one of their own, over the expert replicas)
    the norm             1 all-reduce of 2 float64 over the shard group
Gathered peak (zero 3): the most bytes whole at once in that replay, the next unit's prefetch
(--overlap-param-gather) included.
"""
from __future__ import annotations

import numpy as np

from ..comm.shape_only import ShapeOnlyContext
from ..models import DTYPES, GPT, GPTConfig
from ..optim.flat import grad_dtype_for, is_low_precision, state_dtype_for
from ..optim.units import unit_key, unit_layout
from ..tensor_parallel.lora import set_up_trainable
from ..train.pipeline import plan as pipeline_plan


def zero_plan(config: GPTConfig, *, tp: int = 1, dp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, rank: int = 0,
              zero: int = 3, accum: int = 1, reshard_after_forward: bool = True, prefetch: bool = False,
              dp_replicate: int = 1, grad_reduce_dtype: str = "float32", pp_layers=None, pp_virtual: int = 1,
              schedule: str | None = None, finetune: dict | None = None) -> dict:
    """The state, gathered peak and communication of world rank `rank` (module docstring);
    `finetune`: RunConfig's freeze / lora_* settings (cutp.train.finetune.settings_of)."""
    ctx = ShapeOnlyContext(tp=tp, dp=dp, pp=pp, ep=ep, cp=cp, rank=rank, device="cpu")
    model = GPT(ctx, config, init=False, pp_layers=pp_layers, pp_virtual=pp_virtual)
    if finetune:
        set_up_trainable(model, finetune)
    whole = dp * cp
    d = whole // dp_replicate
    deferred = {id(model.tok_embed.weight)} if pp > 1 and config.tie_embeddings and model.tok_embed is not None \
        else set()
    # at ep > 1 the experts are segments of their own over the expert-DP x CP ranks of a replica
    # (cutp.train.zero.sharded_optimizer: the replicas hold whole EP groups)
    de = whole // ep // dp_replicate if ep > 1 else None
    segments, unit_segments, _, _ = unit_layout(model, d, deferred, de)
    ranks = {id(s): de if s.expert else d for s in segments}
    dtype = np.dtype(DTYPES[config.dtype])
    pb, gb = dtype.itemsize, grad_dtype_for(dtype).itemsize
    rb = 2 if grad_reduce_dtype == "bfloat16" else gb
    sb = state_dtype_for(dtype).itemsize
    trained = [s for s in segments if not s.frozen]
    S, T = sum(s.chunk for s in segments), sum(s.chunk for s in trained)
    state = {"params": (S if zero == 3 else sum(ranks[id(s)] * s.chunk for s in segments)) * pb, "grads": T * gb,
             "optimizer": T * (2 * sb + (4 if is_low_precision(dtype) else 0))}
    # the counters' group names (cutp.comm.context; HSDP's: cutp.train.zero)
    group = "hsdp_shard" if dp_replicate > 1 else ("dp_cp" if cp > 1 else "dp")
    experts = "hsdp_expert_shard" if dp_replicate > 1 else ("expert_dp_cp" if cp > 1 else "expert_dp")
    comm = {}

    def add(op, calls, elements, itemsize, name=group):
        if calls:
            c = comm.setdefault(f"{name}.{op}", {"calls": 0, "elements": 0, "bytes": 0})
            c["calls"] += calls
            c["elements"] += elements
            c["bytes"] += elements * itemsize

    def per_group(segs):
        """[(group name, its ranks, segments)] of the sharding groups over more than one rank."""
        return [(name, n, part) for name, n, part in
                ((group, d, [s for s in segs if not s.expert]), (experts, de, [s for s in segs if s.expert]))
                if part and n is not None and n > 1]

    peak = 0
    if zero == 3:  # the stage's forwards and backwards in the order its schedule runs them
        kind = schedule or ("interleaved" if pp_virtual > 1 else "1f1b")
        ops = ([op for i in range(accum) for op in (("F", i, 0), ("B", i, 0))] if pp == 1 else
               [op for op in pipeline_plan(kind, pp, ctx.pp_rank, accum, pp_virtual) if op[0] in "FB"])
        if config.n_experts and accum > 1 and config.moe_aux_loss_coeff > 0:
            # the MoE counting pass first (cutp.train.moe): every micro-batch's forward without the
            # LM head (at pp > 1 through the stage's chunks in order)
            ops = [("C", i, c) for i in range(accum) for c in range(pp_virtual)] + ops
        gathers, peak = _simulate(model, unit_segments, ops, reshard_after_forward, prefetch,
                                  {i: n * pb for i, n in ranks.items()})
        for name, _, part in [(group, d, [s for s in segments if not s.expert]),
                              (experts, de, [s for s in segments if s.expert])]:
            add("all_gather", sum(gathers.get(id(s), 0) for s in part),
                sum(gathers.get(id(s), 0) * s.chunk for s in part), pb, name)
    for name, n, part in per_group(trained):
        C = sum(s.chunk for s in part)
        add("reduce_scatter", accum * len(part), accum * n * C, rb, name)
        if zero == 2:
            add("all_gather", len(part), C, pb, name)
    if dp_replicate > 1:  # the gradient shards across the replicas: the experts' pieces apart
        dense, moe = (sum(s.chunk for s in trained if s.expert == e) for e in (False, True))
        if moe:
            add("all_reduce", int(dense > 0), dense, rb, "hsdp_replicas")
            add("all_reduce", 1, moe, rb, "hsdp_expert_replicas")
        else:
            add("all_reduce", 1, T, rb, "hsdp_replicas")
    add("all_reduce", 1, 2, 8)  # the norm's [sum of squares, non-finite entries]
    return {"state": state, "gathered_peak": peak, "comm": comm, "segments": len(segments), "shard_elements": S,
            "whole_elements": sum(ranks[id(s)] * s.chunk for s in segments),
            "init_above_state": _init_above_state(segments, d, dtype) if zero == 3 else None,
            "load_above_state": _load_above_state(segments, d, dtype) if zero == 3 else None}


def _init_above_state(segments, d: int, dtype) -> int:
    """zero 3's setup (cutp.optim.sharded, the model built deferred): the most bytes it holds
    above the state, one segment whole (d C elements) while one of its parameters is drawn:
    the TP-whole tensor in the generator's dtype (float64 for float64 models, else float32), its
    TP shard taken from it (a copy when the parameter is TP-split) and cast to the model's
    dtype (a copy when that differs)."""
    gen = 8 if dtype == np.float64 else 4

    def drawn(p):
        full = int(np.prod(p.full_shape, dtype=np.int64))
        shard = p.data.size
        return full * gen + (shard * gen if p.sharding is not None else 0) + (shard * dtype.itemsize
                                                                             if dtype.itemsize != gen else 0)

    return max(d * s.chunk * dtype.itemsize + max(drawn(p) for p in s.params) for s in segments)


def _load_above_state(segments, d: int, dtype) -> int:
    """zero 3's setup loading `init_from` (cutp.checkpoint.load_weights: each deferred parameter
    read when its segment is made whole): one segment whole (d C elements) while one of its
    parameters is read: its file tensors whole, cutp's layout of them (a copy where the recipe
    joins, transposes or casts them), and this rank's TP shard of it (a copy when TP-split); the
    files in the model's dtype. (A cutp checkpoint at the same TP size reads the shard alone.)"""
    item = dtype.itemsize

    def read(p):
        return 2 * int(np.prod(p.full_shape, dtype=np.int64)) * item + (p.data.size * item if p.sharding is not None else 0)

    return max(d * s.chunk * item + max(read(p) for p in s.params) for s in segments)


def _simulate(model, unit_segments, ops, reshard: bool, prefetch: bool, bytes_per_chunk: dict):
    """cutp.optim.sharded's gathers replayed over a stage's forwards and backwards (`ops`:
    ("F"|"B"|"C", micro-batch, chunk); "C": the MoE counting pass's forward, cutp.train.moe, which
    stops before the LM head): each segment's all-gathers, and the most bytes held whole at
    once. A unit's segments are acquired before its forward and backward (gathered unless whole
    already), released after them; the forward's hold lasts to the backward without
    resharding and for the model's last unit; the first unit's backward hold lasts to the next
    forward (or the step's end); the prefetched next unit (the chunk's next, the LM head after a
    counting pass's last block too) is gathered then and stays whole until acquired.
    `bytes_per_chunk`: id(segment) -> the bytes of it whole per element of a piece (its group's
    ranks x itemsize)."""
    V = model.pp_virtual
    last = unit_key(model.units(V - 1)[-1]) if model.gives_loss(V - 1) else None
    first = unit_key(model.units(0)[0]) if model.takes_tokens(0) else None
    refs, count, lazy, peak, whole = {}, {}, [], 0, {}

    def gather(s):
        if id(s) not in whole:
            count[id(s)] = count.get(id(s), 0) + 1
            whole[id(s)] = s

    def release(s, n):
        refs[id(s)] -= n
        if refs[id(s)] <= 0:
            whole.pop(id(s), None)

    for kind, _, c in ops:
        keys = [unit_key(u) for u in model.units(c)]
        order = keys[:-1] if kind == "C" and model.gives_loss(c) else keys
        order = order[::-1] if kind == "B" else order
        for k, key in enumerate(order):
            for s in unit_segments[key]:
                gather(s)
                refs[id(s)] = refs.get(id(s), 0) + 1
            if kind != "B":
                for s in lazy:
                    release(s, 1)
                lazy = []
            at = keys.index(key) + (1 if kind != "B" else -1)  # (the chunk's next unit, in this direction)
            if prefetch and 0 <= at < len(keys):
                for s in unit_segments[keys[at]]:
                    gather(s)
            peak = max(peak, sum(s.chunk * bytes_per_chunk[i] for i, s in whole.items()))
            keep = not reshard or key == last
            for s in unit_segments[key]:
                if kind != "B":
                    release(s, 0 if keep else 1)
                else:
                    release(s, 1 + keep - (key == first))
                    if key == first:
                        lazy.append(s)
    return count, peak


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
