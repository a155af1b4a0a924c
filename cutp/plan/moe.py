"""The planner's mixture-of-experts arithmetic (`cutp bench plan` with n_experts > 0).

Parameters. An MoE layer (every `moe_every`-th, from layer 0, but moe_dense_layers) replaces the
MLP by a router (h x E, replicated) and E experts, each an MLP of width f = moe_ffn (default: the
MLP's): 2 h f weights (3 h f gated) + biases f + h; DeepSeekMoE's shared experts add one MLP of
moe_shared_experts x f, split over TP. Experts are replicated over TP (cutp splits the tokens, not
the experts, over the TP ranks) and divided over the EP group: a rank holds E / ep of them. A
token runs through top_k experts: the active parameters count top_k of them. The counts are
sums of the layers' declarations (`MoESpec.parameters`), not formulas of their own.

Activations an MoE layer keeps for backward (cutp.tensor_parallel.moe; act: the activation
item size, routing assumed balanced, so every expert sees n k / E of the n tokens' assignments,
nothing dropped), in place of the dense MLP's 2 s b h act (input) + 2 s b f act / t x 2 (the
GeLU input and the output projection's input) + s b (dropout mask):

    input          s b h act            (/t with sequence parallelism)
    router         3 s b E x 4 bytes    logits, probabilities, their top-k and gates (fp32; /t with SP)
    experts        k s b (2 h + 2 f) act / t   each assignment's input rows, GeLU input, the output projection's
                                         input and output (the tokens split over TP)
    dropout mask   s b                  (/t with SP)

All-to-all per MoE layer, micro-batch and direction (ep > 1): the assignments' rows go to their
experts' ranks and back: 2 x k s b h / t elements per rank (the communicators count a rank's own
rows too; (ep - 1) / ep of them leave it), forward and backward (tests/tensor_parallel/test_expert_parallel.py compares
it with the counted bytes).
"""
from __future__ import annotations

import dataclasses

from ..runtime.errors import ConfigError
from ..tensor_parallel.specs import count


def moe_layers(a) -> int:
    """How many of a's layers are MoE layers (moe_dense_layers excepted)."""
    return sum(1 for i in range(a.n_layer) if a.is_moe_layer(i))


def expert_width(a) -> int:
    return a.moe_ffn or a.hidden


def _dense_mlp(a):
    """The MLP spec of a's dense layers (cutp.tensor_parallel.specs.MLPSpec)."""
    return dataclasses.replace(a, n_experts=0).block_spec(0).mlp


def _moe_mlp(a):
    """The MLP spec of a's MoE layers (all alike), or None without any."""
    return next((a.block_spec(i).mlp for i in range(a.n_layer) if a.is_moe_layer(i)), None)


def expert_params(a) -> int:
    """One routed expert's parameters: its declarations' sum."""
    spec = _moe_mlp(a)
    expert = spec.expert if spec is not None else dataclasses.replace(_dense_mlp(a), hidden=expert_width(a))
    return count(expert.parameters())


def check_moe_layout(a, ep: int, dp: int) -> None:
    if not (isinstance(ep, int) and ep >= 1):
        raise ConfigError(f"--ep must be an integer >= 1, got {ep!r}")
    if ep > 1 and not a.n_experts:
        raise ConfigError(f"--ep {ep}: the model has no experts (n_experts=0); drop --ep or --set n_experts=N")
    if a.n_experts and a.n_experts % ep:
        raise ConfigError(f"--ep {ep} does not divide n_experts={a.n_experts}: each EP rank holds n_experts / ep")
    if dp % ep:
        raise ConfigError(f"--ep {ep} does not divide --dp {dp}: the EP group is carved from the DP group")


def moe_counts(a, tp: int = 1, ep: int = 1) -> dict:
    """Parameters of a's MoE layers in place of their dense MLPs: {"total", "per_rank", "active"}
    to add to a dense count, and the MoE layers' own {"router", "expert"}: sums of the layers'
    declarations (`MoESpec.parameters`, cutp.tensor_parallel.specs)."""
    n, spec, expert = moe_layers(a), _moe_mlp(a), expert_params(a)
    if spec is None:
        return {"total": 0, "per_rank": 0, "active": 0, "router": 0, "expert": expert, "layers": 0}
    moe, dense = spec.parameters(), _dense_mlp(a).parameters()
    routed = count(moe, where=lambda d: d.split == "expert")
    return {"total": n * (count(moe) - count(dense)),
            "per_rank": n * (count(moe, tp=tp, ep=ep) - count(dense, tp=tp)),
            "active": n * (count(moe) - routed + spec.top_k * expert - count(dense)),
            "router": count(moe, where=lambda d: d.name.startswith("router.")), "expert": expert, "layers": n}


def moe_layer_activation_bytes(a, s: int, b: int, t: int, act: int, sequence_parallel: bool) -> float:
    """What one MoE layer's MLP keeps for backward (module docstring)."""
    sp = t if sequence_parallel else 1
    k, f, h, E = a.moe_top_k, expert_width(a), a.n_embd, a.n_experts
    return (s * b * h * act / sp + 3 * s * b * E * 4 / sp + k * s * b * (2 * h + 2 * f) * act / t + s * b / sp)


def dense_mlp_activation_bytes(a, s: int, b: int, t: int, act: int, sequence_parallel: bool) -> float:
    """The dense MLP's part of Korthikanti et al.'s per-layer figure (ffn = 4h there: 19 s b h)."""
    sp = t if sequence_parallel else 1
    return 2 * s * b * a.n_embd * act / sp + 2 * s * b * a.hidden * act * 2 / t + s * b / sp


def all_to_all_elements(a, s: int, b: int, t: int, ep: int) -> int:
    """Elements one rank passes to an all-to-all (its own rows included, as the communicators
    count them) per MoE layer, micro-batch and direction: its k s b / t assignments' rows of h,
    dispatched, and as many combined back (balanced routing); (ep - 1) / ep of them go on the wire."""
    if ep == 1 or not a.n_experts:
        return 0
    return 2 * a.moe_top_k * s * b * a.n_embd // t
