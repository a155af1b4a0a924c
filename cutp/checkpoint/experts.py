"""Checkpoints of expert-parallel models: every expert in the files an EP=1 run writes.

At ep > 1 each rank of an EP group holds only its own experts, and DP rank 0 (EP rank 0 of the
first EP group) writes the model and optimizer files. Before it does, the first EP group's
ranks hand it their experts' weights and optimizer state (`gather_experts`, a host gather over
ctx.ep), so the files hold every expert under its global name, in the order an EP=1 model lists
them: a checkpoint is the same at any EP size, and loading (by name) takes each rank's own
experts, so a run resumes at any EP size. The cost: DP rank 0 briefly holds every expert on the
host while it writes, as an EP=1 rank would (a file per EP rank is a later optimisation).
"""
from __future__ import annotations


def _layer(name: str) -> str | None:
    """The MoE layer prefix of an expert parameter's name ("layers.0.mlp"), else None."""
    return name.split(".experts.")[0] if ".experts." in name else None


def gather_experts(ctx, params, optimizer, param_info):
    """Collective over the first EP group (DP ranks [0, ep) of CP rank 0); a no-op elsewhere and
    at ep 1. Returns (model tensors, optimizer tensors, parameter infos) of the other EP ranks'
    experts, on DP rank 0 (empty dicts on the others)."""
    if ctx.ep_size == 1 or ctx.dp_rank >= ctx.ep_size or ctx.cp_rank:  # (CP ranks are replicas: CP rank 0 writes)
        return {}, {}, {}
    experts = [p for p in params if p.expert_parallel]
    names = {p.name for p in experts}
    # (the distributed optimizer's state: every DP rank writes its own pieces, nothing gathered)
    state = optimizer.state_dict() if optimizer is not None and not optimizer.distributed else {}
    mine = ({p.name: ctx.to_numpy(p.data) for p in experts},
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
