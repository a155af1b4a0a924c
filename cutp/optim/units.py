"""The unit layout of ZeRO-2 and ZeRO-3 (cutp.optim.sharded): which segment each parameter is in.

Each unit of the model (`GPT.units`, every chunk's, in forward order) becomes a segment of its
parameters, weight-decayed ones first; a parameter two units use (the tied token embedding at
pp 1), or a deferred one, gets a segment of its own. A unit's frozen parameters (--freeze,
LoRA's base: `Parameter.trainable` False) are a segment apart from its trainable ones. A segment
of n elements is padded to d x C elements, C a multiple of ALIGN: rank r owns [r C, (r + 1) C) of
it, at `shard_at` of its shard buffers (zero 2 holds it whole at `full_at` of its parameter
buffer). The trainable segments come first in both: the gradient and optimizer-state shards
are the parameter shard's first `sum(C of the trainable segments)` elements, frozen ones having none.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ALIGN = 64  # each rank's piece of a segment: a multiple of 64 elements (128-bit aligned for every dtype)


@dataclass(eq=False)
class Segment:
    index: int
    params: list  # decayed first, each group in the model's order
    where: dict  # id(param) -> [start, stop) in the segment
    size: int  # real elements
    chunk: int  # C: this rank's piece (and every rank's)
    shard_at: int  # where that piece starts in the shard buffers
    full_at: int  # zero 2: where the segment starts in the whole parameter buffer
    n_decay: int
    uses: int = 0  # units holding it (its backwards per micro-batch)
    deferred: bool = False
    expert: bool = False  # an expert-parallel MoE layer's experts (ep > 1: sharded over expert-DP x CP)
    frozen: bool = False  # frozen parameters: gathered like the rest, never reduced nor updated, no state
    group: object = None  # the communicator it is sharded over (cutp.optim.sharded sets it)
    # during a step
    refs: int = 0
    full: object = None  # zero 3: the gathered segment
    gather: object = None  # its all-gather in flight
    grad: object = None  # the micro-batch's gradient of the whole segment, during the backward
    left: int = 0  # backwards still to run in this micro-batch
    pending: list = field(default_factory=list)  # [request] reduce-scatters in flight


def unit_key(unit) -> frozenset:
    return frozenset(id(m) for m in unit)


def unit_params(unit) -> list:
    """The parameters a unit's forward and backward use: its modules', and a tied LM head's table."""
    seen, out = set(), []
    for m in unit:
        shared = getattr(m, "_shared_weight", None)
        for p in m.parameters() + ([shared] if shared is not None else []):
            if id(p) not in seen and not p.buffer:  # (a buffer stays whole, outside the optimizer)
                seen.add(id(p))
                out.append(p)
    return out


def unit_layout(model, d: int, deferred: set, d_experts: int | None = None):
    """(segments, {unit key: its segments}, {unit key: the next unit of its chunk's forward},
    {unit key: the previous one}) of `model`'s units over `d` ranks; `deferred`: ids of the
    parameters that get a segment of their own. `d_experts` (ep > 1): a unit's expert-parallel
    parameters are a segment of their own, over that many ranks."""
    chunks = [model.units(c) for c in range(model.pp_virtual)]
    units = [u for c in chunks for u in c]
    held, order = {}, []  # id(param) -> how many units hold it; the parameters in forward order
    for u in units:
        for p in unit_params(u):
            if id(p) not in held:
                order.append(p)
            held[id(p)] = held.get(id(p), 0) + 1
    for p in model.parameters():  # (none today: every parameter but the buffers is in a unit)
        if id(p) not in held and not p.buffer:
            order.append(p)
            held[id(p)] = 0
    alone = {id(p) for p in order if held[id(p)] != 1 or id(p) in deferred}
    groups, home = [], set()
    for u in units:
        mine = [p for p in unit_params(u) if id(p) not in alone and id(p) not in home]
        home.update(id(p) for p in mine)
        split = d_experts is not None
        for trains in (True, False):
            for part in ([p for p in mine if not (split and p.expert_parallel) and p.trainable == trains],
                         [p for p in mine if split and p.expert_parallel and p.trainable == trains]):
                if part:
                    groups.append(part)
    groups += [[p] for p in order if id(p) in alone]
    segments = []
    for k, group in enumerate(groups):
        ps = [p for p in group if p.weight_decay] + [p for p in group if not p.weight_decay]
        where, off = {}, 0
        for p in ps:
            where[id(p)] = (off, off + p.data.size)
            off += p.data.size
        expert = d_experts is not None and ps[0].expert_parallel
        ranks = d_experts if expert else d
        chunk = -(-off // (ranks * ALIGN)) * ALIGN
        n_decay = sum(p.data.size for p in ps if p.weight_decay)
        frozen = not ps[0].trainable
        segments.append(Segment(k, ps, where, off, chunk, 0, 0, n_decay, expert=expert, frozen=frozen,
                                deferred=not frozen and any(id(p) in deferred for p in ps)))
    shard_at = full_at = 0
    for s in sorted(segments, key=lambda s: s.frozen):  # (the trainable first: module docstring)
        s.shard_at, s.full_at = shard_at, full_at
        shard_at += s.chunk
        full_at += s.chunk * (d_experts if s.expert else d)
    by_param = {id(p): s for s in segments for p in s.params}
    unit_segments, after, before = {}, {}, {}
    for c in chunks:
        keys = [unit_key(u) for u in c]
        for i, (key, u) in enumerate(zip(keys, c)):
            segs = []
            for p in unit_params(u):
                if by_param[id(p)] not in segs:
                    segs.append(by_param[id(p)])
            unit_segments[key] = segs
            if i + 1 < len(keys):
                after[key] = keys[i + 1]
            if i:
                before[key] = keys[i - 1]
    for segs in unit_segments.values():
        for s in segs:
            s.uses += 1
    for s in segments:
        s.left = s.uses
    return segments, unit_segments, after, before
