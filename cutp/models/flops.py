"""A model's training FLOPs per token, from its config's public declarations only (n_layer,
n_embd, n_head, kv_heads, head_size, hidden, vocab_size, mlp, n_experts, moe_top_k, moe_ffn,
is_moe_layer), for the MFU a run reports (cutp.train.reporting).

Counted as PaLM's appendix B and Megatron's MFU do: the matrix multiplications only (norms,
activations, softmax and the optimizer are a few percent), 2 FLOPs per multiply-add, a
training step 3 times the forward (the backward computes the gradients of the activations and
of the weights); attention's scores and weighted sum over the whole sequence (2 x 2 x heads x
head_size x seq_len per token and layer, min(seq_len, window) for a local layer; no causal
discount, as PaLM counts), an MoE layer's
router and its top_k experts (the active parameters), the LM head over the whole vocabulary.
Recomputation is not counted (MFU, not hardware FLOPs utilisation).
"""
from __future__ import annotations


def _mlp_matmul(config, width: int) -> int:
    """Multiply-adds per token of one MLP (or expert) of `width`: GeLU's two matrices, SwiGLU's three."""
    return (3 if config.mlp in ("swiglu", "geglu") else 2) * config.n_embd * width


def forward_flops_per_token(config, seq_len: int) -> float:
    """The forward's FLOPs per token of a sequence of `seq_len` tokens."""
    h, q = config.n_embd, config.n_head * config.head_size
    kv = config.kv_heads * config.head_size
    per_layer = h * (q + 2 * kv) + q * h  # Q, K, V and the output projection
    total = 0
    for i in range(config.n_layer):
        window = config.layer_window(i) if hasattr(config, "layer_window") else None
        keys = seq_len if window is None else min(seq_len, window)  # a local layer's queries see `window` keys
        total += per_layer + 2 * config.n_head * config.head_size * keys  # scores, weighted sum
        if config.is_moe_layer(i):
            total += h * config.n_experts + config.moe_top_k * _mlp_matmul(config, config.moe_ffn or config.hidden)
        else:
            total += _mlp_matmul(config, config.hidden)
    total += h * config.vocab_size  # the LM head
    return 2.0 * total


def training_flops_per_token(config, seq_len: int) -> float:
    """FLOPs per token of a training step (forward and backward: 3 x the forward)."""
    return 3.0 * forward_flops_per_token(config, seq_len)
