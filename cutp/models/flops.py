"""A model's training FLOPs per token, from its parameter declarations (`ModelConfig.declarations`,
cutp.tensor_parallel.specs) and its layers' attention specs, for the MFU a run reports
(cutp.train.reporting).

Counted as PaLM's appendix B and Megatron's MFU do: the matrix multiplications only (norms,
activations, softmax and the optimizer are a few percent), 2 FLOPs per multiply-add, a
training step 3 times the forward (the backward computes the gradients of the activations and
of the weights). Every declared matrix multiplies each token once (MLA's down- and
up-projections, DeepSeekMoE's shared experts, an MoE layer's router), a routed expert's top_k
times of its count (the active parameters); the embedding tables are looked up, the LM head
multiplies over the whole vocabulary (tied or not). Attention's scores and weighted sum over the
whole sequence (`scores_per_key`: 2 x heads x head_size per token, key and layer, MLA's heads of
its query-key and value widths; min(seq_len, window) keys for a local layer; no causal discount,
as PaLM counts). Recomputation is not counted (MFU, not hardware FLOPs utilisation).
"""
from __future__ import annotations

_LOOKED_UP = ("tok_embed.", "pos_embed.", "lm_head.")


def forward_flops_per_token(config, seq_len: int) -> float:
    """The forward's FLOPs per token of a sequence of `seq_len` tokens."""
    total = config.n_embd * config.vocab_size  # the LM head
    for d in config.declarations():
        if len(d.shape) == 2 and not d.name.startswith(_LOOKED_UP):
            total += d.numel // d.count * (config.moe_top_k if d.split == "expert" else d.count)
    for i in range(config.n_layer):
        attention = config.block_spec(i).attention
        keys = seq_len if getattr(attention, "window", None) is None else min(seq_len, attention.window)
        total += attention.scores_per_key() * keys
    return 2.0 * total


def training_flops_per_token(config, seq_len: int) -> float:
    """FLOPs per token of a training step (forward and backward: 3 x the forward)."""
    return 3.0 * forward_flops_per_token(config, seq_len)
