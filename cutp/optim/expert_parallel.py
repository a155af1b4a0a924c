"""The distributed optimizer of an expert-parallel model: dense and expert state sharded apart.

At ep > 1 the ranks of a DP group hold different experts at the same places, so the experts
cannot share the dense parameters' ZeRO shards (which a reduce-scatter over DP fills).
`ExpertParallelAdamW` keeps two flat buffers, each with a DistributedAdamW: the dense
parameters sharded over DP (averaged there), this rank's experts sharded over the expert-DP
group (the DP ranks holding the same experts; summed there and divided by dp). With context
parallelism both groups take in the CP ranks: DP x CP and expert-DP x CP (divided by dp x cp).
The gradient norm adds both parts' squares before one all-reduce over TP, DP (x CP) and PP:
every expert entry is on exactly one rank's expert shard in the DP (x CP) group. Checkpoints
see one optimizer: per-parameter state and pieces (`state_pieces`, `owned_part`, `load_state`)
from whichever part holds the name.

(The plain AdamW needs none of this: one buffer, the experts a range of their own,
`AdamW.reduce_gradients`.)
"""
from __future__ import annotations

from ..tensor_parallel.grads import expert_replica_group, replica_size
from .adamw import DistributedAdamW, finish_norm
from .flat import FlatParameters


class FlatParts:
    """The flat buffers of a run whose optimizer has several parts (what train_step uses)."""

    def __init__(self, *parts: FlatParameters):
        self.parts = parts
        self.slices = {name: s for part in parts for name, s in part.slices.items()}

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    @property
    def size(self) -> int:
        return sum(part.size for part in self.parts)


class ExpertParallelAdamW:
    """DistributedAdamW over the dense parameters (DP x CP) and over the experts (expert-DP x CP)."""

    distributed = True

    def __init__(self, params, ctx, **kw):
        params = list(params)
        dense = [p for p in params if not p.expert_parallel]
        experts = [p for p in params if p.expert_parallel]
        self.dense = DistributedAdamW(FlatParameters(dense, pad_to=DistributedAdamW.pad_multiple(replica_size(ctx))),
                                      ctx, **kw)
        self.experts = None  # (a pipeline stage without MoE layers has no experts: the dense part only)
        if experts:
            group = expert_replica_group(ctx)
            self.experts = DistributedAdamW(FlatParameters(experts, pad_to=DistributedAdamW.pad_multiple(group.size)),
                                            ctx, group=group, **kw)
        self.parts = (self.dense,) + ((self.experts,) if self.experts is not None else ())
        self.flat = FlatParts(*(part.flat for part in self.parts))
        self.master = self.dense.master  # (both parts keep master weights, or neither)
        self.ctx = ctx

    def _of(self, name: str) -> DistributedAdamW:
        return next(part for part in self.parts if name in part.flat.slices)

    @property
    def step_count(self) -> int:
        return self.dense.step_count

    def reduce_gradients(self, ctx) -> None:
        for part in self.parts:
            part.reduce_gradients(ctx)

    def grad_norm(self, ctx) -> float:
        return finish_norm(ctx, sum(part.norm_terms(ctx) for part in self.parts))

    def step(self, lr=None, grad_scale=1.0) -> None:
        for part in self.parts:
            part.step(lr, grad_scale)

    def memory_bytes(self) -> dict:
        each = [part.memory_bytes() for part in self.parts]
        return {k: sum(m[k] for m in each) for k in each[0]}

    def state_pieces(self) -> tuple[dict, dict]:
        pieces, offsets = {}, {}
        for part in self.parts:
            p, o = part.state_pieces()
            pieces.update(p)
            offsets.update(o)
        return pieces, offsets

    def owned_part(self, name: str) -> tuple[int, int]:
        return self._of(name).owned_part(name)

    def load_state(self, tensors: dict, step: int) -> None:
        for part in self.parts:
            part.load_state({k: v for k, v in tensors.items() if k.split(".", 1)[1] in part.flat.slices}, step)

    def resync_masters(self) -> None:
        for part in self.parts:
            part.resync_masters()

    def hyperparameters(self) -> dict:
        return self.dense.hyperparameters()
