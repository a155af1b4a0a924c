"""Checkpoints of expert-parallel models: every expert in the files an EP=1 run writes.

At ep > 1 each rank of an EP group holds only its own experts, and DP rank 0 (EP rank 0 of the
first EP group) writes the model and optimizer files. Before it does, the first EP group's
ranks hand it their experts' weights and optimizer state (`gather_experts`, a host gather over
ctx.ep), so the files hold every expert under its global name, in the order an EP=1 model lists
them: a checkpoint is the same at any EP size, and loading (by name) takes each rank's own
experts, so a run resumes at any EP size. The cost: DP rank 0 briefly holds every expert on the
host while it writes, as an EP=1 rank would (a file per EP rank is a later optimisation); at
zero 3 the save goes unit by unit (`with_experts`): one expert parameter per EP rank at a time.
"""
from __future__ import annotations


def _layer(name: str) -> str | None:
    """The MoE layer prefix of an expert parameter's name ("layers.0.mlp"), else None."""
    return name.split(".experts.")[0] if ".experts." in name else None


def _in_first_group(ctx) -> bool:
    """Whether this rank is in the first EP group (DP ranks [0, ep) of CP rank 0: CP ranks are
    replicas, CP rank 0 writes), at ep > 1."""
    return ctx.ep_size > 1 and ctx.dp_rank < ctx.ep_size and not ctx.cp_rank


def gather_experts(ctx, params, optimizer, param_info, *, streamed: bool = False):
    """Collective over the first EP group (DP ranks [0, ep) of CP rank 0); a no-op elsewhere and
    at ep 1. Returns (model tensors, optimizer tensors, parameter infos) of the other EP ranks'
    experts, on DP rank 0 (empty dicts on the others). `streamed` (a zero 3 save by unit): the
    model tensors' (shape, dtype) only, their values coming later through `with_experts`."""
    if not _in_first_group(ctx):
        return {}, {}, {}
    experts = [p for p in params if p.expert_parallel]
    names = {p.name for p in experts}
    # (the distributed optimizer's state: every DP rank writes its own pieces, nothing gathered)
    state = optimizer.state_dict() if optimizer is not None and not optimizer.distributed else {}
    mine = ({p.name: (tuple(p.data.shape), str(p.data.dtype)) if streamed else ctx.to_numpy(p.data)
             for p in experts},
            {k: ctx.to_numpy(v) for k, v in state.items() if k.split(".", 1)[1] in names},
            {n: param_info[n] for n in param_info if n in names})
    with ctx.watchdog.guard("gathering the experts for the checkpoint (host gather on ep)"):
        every = ctx.ep.mpi_comm.gather(mine if ctx.ep_rank else None, root=0)
    if ctx.ep_rank != 0:
        return {}, {}, {}
    model, optim, info = {}, {}, {}
    for part in every[1:]:
        model.update(part[0])
        optim.update(part[1])
        info.update(part[2])
    return model, optim, info


def with_experts(ctx, pairs, names):
    """The (name, whole values) pairs of a zero 3 save by unit (`ShardedAdamW.whole_parameters`),
    with the first EP group's other ranks' experts added on its EP rank 0 (DP rank 0, the
    writer): each expert parameter of `names` handed over as it comes (a host gather over ctx.ep:
    each EP rank holds as many, in the same order), so the writer holds one unit and one expert
    parameter per EP rank, never every expert. Collective over the first EP group; the pairs
    unchanged on the other ranks and at ep 1."""
    first = _in_first_group(ctx)
    for name, values in pairs:
        if not (first and name in names):
            yield name, values
            continue
        with ctx.watchdog.guard("handing an expert to the checkpoint's writer (host gather on ep)"):
            every = ctx.ep.mpi_comm.gather((name, ctx.to_numpy(values)) if ctx.ep_rank else None, root=0)
        if ctx.ep_rank == 0:
            yield name, values
            yield from every[1:]
        del values, every


def in_model_order(param_info: dict, gathered: dict, ranks_first: list) -> dict:
    """param_info (this rank's parameters, in model order) with the gathered experts' entries
    placed where an EP=1 model lists them: each MoE layer's experts in global order.
    `ranks_first`: this rank's expert names, which come first within each layer (EP rank 0)."""
    if not gathered:
        return param_info
    by_layer = {}
    for name in [*ranks_first, *gathered]:  # EP rank 0's experts, then the others' in rank order
        by_layer.setdefault(_layer(name), []).append(name)
    out = {}
    for name, info in param_info.items():
        layer = _layer(name)
        if layer is None:
            out[name] = info
        elif name not in out:
            for n in by_layer.pop(layer, []):
                out[n] = param_info[n] if n in param_info else gathered[n]
    return out
