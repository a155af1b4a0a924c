"""Qwen3 (`Qwen3ForCausalLM`): Llama's block with QK-norm (an RMSNorm over each query and each key
head, after the projections, before RoPE), head_dim apart from n_embd / n_head (128 in every
Qwen3), no biases (attention_bias adds them to q, k, v and o, as Llama's), tied embeddings in
the small models. Tensors: Llama's names (cutp.models.families.llama) plus

    self_attn.q_norm.weight [head_dim]     layers.i.attn.q_norm.weight
    self_attn.k_norm.weight [head_dim]     layers.i.attn.k_norm.weight

Window layers (use_sliding_window, max_window_layers, layer_types) as Qwen2's.
"""
from __future__ import annotations

from .llama import LLAMA_SPEC, Llama

QWEN3_SPEC = dict(**{**LLAMA_SPEC, "norm_eps": 1e-6}, qk_norm=True, rope_theta=1000000.0, bos_token_id=151643,
              eos_token_id=151645)


class Qwen3(Llama):
    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    qk_norm = True
    windows = "layers"  # (use_sliding_window, max_window_layers, layer_types: as Qwen2's)
    presets = {
        "qwen3-0.6b": dict(n_layer=28, n_head=16, n_kv_head=8, head_dim=128, n_embd=1024, mlp_hidden=3072,
                           vocab_size=151936, block_size=40960, **{**QWEN3_SPEC, "tie_embeddings": True}),
        "qwen3-8b": dict(n_layer=36, n_head=32, n_kv_head=8, head_dim=128, n_embd=4096, mlp_hidden=12288,
                         vocab_size=151936, block_size=40960, **QWEN3_SPEC),
        # byte vocabulary, trains on the embedded corpus: 8 query heads of 32 over n_embd 128 (head_dim
        # apart from n_embd / n_head, as in every Qwen3), 2 KV heads
        "qwen3-tiny": dict(n_layer=4, n_head=8, n_kv_head=2, head_dim=32, n_embd=128, mlp_hidden=320, vocab_size=256,
                           block_size=128, vocab_multiple=1, **{**QWEN3_SPEC, "rope_theta": 10000.0,
                                                                 "bos_token_id": None, "eos_token_id": None}),
    }

    def config_from_hf(self, hf: dict, where: str) -> dict:
        return dict(super().config_from_hf(hf, where), qk_norm=True, **self.layer_windows_from_hf(hf, where))

    def config_to_hf(self, cfg) -> dict:
        d = super().config_to_hf(cfg)
        del d["mlp_bias"], d["pretraining_tp"]
        return dict(d, **self.layer_windows_to_hf(cfg))

    def bias_refusal(self, qkv, out, mlp, cfg) -> str | None:
        if mlp:
            return "Qwen3's MLP has no biases; this model has mlp_bias=True"
        return super().bias_refusal(qkv, out, mlp, cfg)
