"""The planner's fine-tuning arithmetic (`cutp plan --lora-rank R ...`, `--freeze GROUPS`): what
trains on a rank, so that gradients, fp32 masters and Adam's moments are planned for the
trainable elements only and the frozen base counts as parameters alone (cutp.train.finetune).

LoRA of rank r, per layer and TP rank t (PEFT's LoraParallelLinear, cutp.tensor_parallel.lora):

    column base [in, out] (q, k, v, gate, up; MLA's q_b, q_proj, kv_b)   A [in, r] whole, B [r, out / t]
    row base [in, out] (o, down)                                           A [in / t, r], B [r, out] whole
    replicated base (MLA's q_a, kv_a)                                      A [in, r], B [r, out], both whole
    MoE experts (E / ep on the rank, replicated over TP)                   A [in, r], B [r, out] each

GQA's KV heads replicated when tp > n_kv_head: one head's B columns per rank. The whole factor of
a column (A) or row (B) pair sees part of the use on each TP rank: its gradient is summed over TP
every step (`tp_partial`), as are the experts' adapters; the replicated MLA pairs' gradients are
the same on every rank.

--freeze's groups: a cutp model's parameters as it declares them (`planned_parameters` with the
groups applied); an MoE model's routed experts and routers (which the planner counts by formula)
are frozen with the group "mlp".
"""
from __future__ import annotations

import dataclasses

from ..runtime.errors import ConfigError
from ..tensor_parallel.lora import LoraSpec, freeze_groups, spec_of
from ..train.finetune import FINETUNE_DEFAULTS, FINETUNE_SETTINGS
from .moe import expert_params, expert_width, moe_layers
from .run import planned_parameters

DEFAULTS = FINETUNE_DEFAULTS


def settings_of(args) -> dict | None:
    """The fine-tuning settings of a command line (`cutp plan`'s flags), None when none is given."""
    got = {k: getattr(args, k, DEFAULTS[k]) for k in FINETUNE_SETTINGS}
    return None if got == DEFAULTS else got


def _pair(n_in: int, n_out: int, r: int, kind: str, tp: int) -> tuple[int, int]:
    """(elements on a rank, of them summed over TP) of one pair on a base of kind column, row,
    replicated or expert."""
    if kind == "column":
        return n_in * r + r * (n_out // tp), n_in * r
    if kind == "row":
        return (n_in // tp) * r + r * n_out, r * n_out
    return n_in * r + r * n_out, (n_in * r + r * n_out) * (kind == "expert")


def _mlp_pairs(width: int, h: int, gated: bool, kind: str) -> list:
    """(projection, n_in, n_out, kind) of an MLP's targets: gate and up ([gate | up] fused), down."""
    up = [("gate", h, width, kind), ("up", h, width, kind)] if gated else [("up", h, width, kind)]
    return up + [("down", width, h, "row" if kind == "column" else kind)]


def attention_pairs(a) -> list:
    """(projection, n_in, n_out, kind) of one layer's attention: q, k, v, o, or MLA's q_a, q_b (q
    without q_lora_rank), kv_a, kv_b, o."""
    h = a.n_embd
    if a.kv_lora_rank is None:
        hd = a.head_size
        return [("q", h, a.n_head * hd, "column"), ("k", h, a.kv_heads * hd, "column"),
                ("v", h, a.kv_heads * hd, "column"), ("o", a.n_head * hd, h, "row")]
    qk, rq, rkv = a.qk_nope_head_dim + a.qk_rope_head_dim, a.q_lora_rank, a.kv_lora_rank
    q = ([("q_a", h, rq, "replicated"), ("q_b", rq, a.n_head * qk, "column")] if rq
         else [("q", h, a.n_head * qk, "column")])
    return q + [("kv_a", h, rkv + a.qk_rope_head_dim, "replicated"),
                ("kv_b", rkv, a.n_head * (a.qk_nope_head_dim + a.v_head_dim), "column"),
                ("o", a.n_head * a.v_head_dim, h, "row")]


def lora_elements(a, spec: LoraSpec, tp: int = 1, ep: int = 1) -> dict:
    """LoRA's elements on one rank of a tp x ep mesh (module docstring): {"trainable", "experts"
    (of them on the routed experts, whose state ZeRO shards over expert-DP), "tp_partial" (summed
    over TP each step)}."""
    r, h, t = spec.rank, a.n_embd, set(spec.targets)
    gated = a.mlp in ("swiglu", "geglu")
    total = experts = partial = 0
    for i in range(a.n_layer):
        pairs = attention_pairs(a)
        if a.n_experts and a.is_moe_layer(i):
            if a.moe_shared_experts:
                pairs += _mlp_pairs(a.moe_shared_experts * expert_width(a), h, gated, "column")
            routed = [_pair(n_in, n_out, r, kind, tp) for proj, n_in, n_out, kind
                      in _mlp_pairs(expert_width(a), h, gated, "expert") if proj in t]
            experts += (a.n_experts // ep) * sum(n for n, _ in routed)
            partial += (a.n_experts // ep) * sum(p for _, p in routed)
        else:
            pairs += _mlp_pairs(a.hidden, h, gated, "column")
        for proj, n_in, n_out, kind in pairs:
            if proj not in t:
                continue
            if kind == "column" and proj in ("k", "v") and tp > a.kv_heads:  # one replicated KV head here
                n_out = tp * a.head_size
            n, p = _pair(n_in, n_out, r, kind, tp)
            total, partial = total + n, partial + p
    return {"trainable": total + experts, "experts": experts, "tp_partial": partial}


def moe_frozen(a, groups, tp: int, ep: int, moe_per_rank: int) -> int:
    """Of an MoE model's MoE-layer parameters the planner counts by formula (`moe_per_rank`: those
    in place of the dense MLPs), the frozen ones: all with "mlp", else none; a name glob cannot be
    matched against parameters the plan does not build (refused by name)."""
    globs = [g for g in groups if g not in ("embeddings", "norms", "head", "attention", "mlp")]
    if globs and moe_layers(a):
        raise ConfigError(f"`freeze` {globs[0]!r}: the plan of an MoE model counts its experts by formula and "
                          "matches groups only; give some of embeddings, norms, head, attention, mlp")
    return moe_per_rank if "mlp" in groups else 0


def spec_and_groups(settings: dict | None) -> tuple:
    """(the LoRA spec or None, --freeze's groups) of fine-tuning settings (None: none)."""
    if not settings:
        return None, ()
    return spec_of(settings), freeze_groups(settings)


def trainable_split(a, config, settings: dict, *, tp: int, ep: int, params: int, ranks, moe_per_rank: int = 0) -> dict:
    """What trains on the TP rank holding the most: {"params" (every parameter there, adapters
    included), "trainable", "experts" (of them on routed experts), "tp_partial" (None: as without
    fine-tuning)}. `params`: the rank's parameters without adapters (the plan's count); `config`:
    the cutp model when its dense parameters are the model's own declarations (exact, name globs
    too), None for a --params architecture; `moe_per_rank`: the MoE layers' formula share of
    `params`; `ranks`: the TP ranks whose declarations are read."""
    spec, groups = spec_and_groups(settings)
    if spec is not None:  # every base weight frozen
        lora = lora_elements(a, spec, tp, ep)
        return {"params": params + lora["trainable"], "trainable": lora["trainable"], "experts": lora["experts"],
                "tp_partial": lora["tp_partial"]}
    # (a --params architecture's count has its vocabulary unpadded: so are its frozen tables here)
    dense = dataclasses.replace(a, vocab_multiple=1) if config is None else config
    if a.n_experts:
        dense = dataclasses.replace(dense, n_experts=0)
    frozen = max(sum(p.numel for p in planned_parameters(dense, tp=tp, rank=r, finetune={"freeze": ",".join(groups)})
                     if not p.trainable) for r in ranks)
    frozen += moe_frozen(a, groups, tp, ep, moe_per_rank)
    experts = 0 if "mlp" in groups else moe_layers(a) * (a.n_experts // ep) * expert_params(a)
    return {"params": params, "trainable": params - frozen, "experts": experts, "tp_partial": None}
