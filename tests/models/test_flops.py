"""A model's training FLOPs per token (cutp.models.flops), from its config's declarations: PaLM's
6N + 12 L H Q T for a GPT-2, SwiGLU's third matrix, an MoE layer's top-k experts and router."""
import dataclasses

from cutp.models import GPTConfig
from cutp.models.flops import forward_flops_per_token, training_flops_per_token


def test_gpt2_matches_palms_count():
    c = GPTConfig.preset("gpt2")
    matmul_params = c.num_parameters() - c.block_size * c.n_embd - (2 * c.n_layer + 1) * 2 * c.n_embd \
        - c.n_layer * (4 * c.n_embd + c.hidden + c.n_embd + 3 * c.n_embd)  # no positions, norms, biases
    palm = 6 * matmul_params + 12 * c.n_layer * c.n_embd * 1024
    assert abs(training_flops_per_token(c, 1024) - palm) / palm < 1e-3
    assert training_flops_per_token(c, 1024) == 3 * forward_flops_per_token(c, 1024)


def test_swiglu_counts_three_matrices_and_moe_its_active_experts():
    gelu = GPTConfig(n_layer=2, n_head=4, n_embd=64, mlp_hidden=128, vocab_size=100)
    swiglu = dataclasses.replace(gelu, mlp="swiglu")
    assert forward_flops_per_token(swiglu, 8) - forward_flops_per_token(gelu, 8) == 2 * 2 * 64 * 128
    moe = dataclasses.replace(gelu, n_experts=8, moe_top_k=2, moe_ffn=32)
    per_layer_moe = 64 * 8 + 2 * 2 * 64 * 32  # router, two experts of width 32
    assert forward_flops_per_token(gelu, 8) - forward_flops_per_token(moe, 8) == 2 * 2 * (2 * 64 * 128 - per_layer_moe)
    gqa = dataclasses.replace(gelu, n_kv_head=1)  # K and V: one head of 16 instead of four
    assert forward_flops_per_token(gelu, 8) - forward_flops_per_token(gqa, 8) == 2 * 2 * 2 * 64 * 48


def test_latent_attention_and_shared_experts_count_as_declared():
    """DeepSeek: every matrix a token runs through (MLA's down- and up-projections, the shared and
    top-k routed experts, the routers, the untied head) is its active parameters less the
    vectors and the looked-up embedding; the scores use MLA's query-key and value widths."""
    c = GPTConfig.preset("deepseek-tiny")
    assert c.moe_shared_experts and c.q_lora_rank and not c.tie_embeddings
    vectors = sum(d.numel for d in c.declarations() if len(d.shape) == 1 and d.grad)  # norms (no biases)
    matmul = c.num_active_parameters() - vectors - c.vocab_size * c.n_embd
    per_key = c.n_head * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    assert forward_flops_per_token(c, 8) == 2 * (matmul + c.n_layer * per_key * 8)
