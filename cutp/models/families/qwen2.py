"""Qwen2 (`Qwen2ForCausalLM`, Qwen2 and Qwen2.5): Llama's block with biases on the q, k and v
projections only (none on o_proj or the MLP), tied or untied embeddings, head_dim n_embd / n_head
(Qwen2's config has no head_dim). Tensors: Llama's names (cutp.models.families.llama).
Windows as transformers' Qwen2Config has them: with use_sliding_window, sliding_window on the
layers `layer_types` names "sliding_attention" (without layer_types: the layers from
max_window_layers on); written back with layer_types and the max_window_layers that gives them.
"""
from __future__ import annotations

from .llama import LLAMA_SPEC, LlamaLike


class Qwen2(LlamaLike):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    presets = {
        "qwen2-0.5b": dict(n_layer=24, n_head=14, n_kv_head=2, n_embd=896, mlp_hidden=4864, vocab_size=151936,
                           block_size=32768, rope_theta=1000000.0, **{**LLAMA_SPEC, "tie_embeddings": True,
                                                                       "norm_eps": 1e-6},
                           qkv_bias=True, bos_token_id=151643, eos_token_id=151643),
    }

    def implies(self, cfg) -> bool:
        return super().implies(cfg) and not cfg.n_experts and self.biases(cfg) == (True, False, False)

    def config_from_hf(self, hf: dict, where: str) -> dict:
        # q/k/v biases, no o_proj or MLP bias (Qwen2's modelling code)
        return dict(self.common_from_hf(hf, where), qkv_bias=True, attn_out_bias=False, mlp_bias=False,
                    **self.layer_windows_from_hf(hf, where))

    windows = "layers"

    def bias_refusal(self, qkv, out, mlp, cfg) -> str | None:
        if (qkv, out, mlp) != (True, False, False):
            return (f"Qwen2 has biases on q, k and v only; this model has qkv_bias={qkv}, attn_out_bias={out}, "
                    f"mlp_bias={mlp}")
        return None

    def config_to_hf(self, cfg) -> dict:
        d = dict(self.common_to_hf(cfg), **self.layer_windows_to_hf(cfg))
        if cfg.head_size * cfg.n_head != cfg.n_embd:  # (transformers' Qwen2Attention reads config.head_dim)
            d["head_dim"] = cfg.head_size
        return d
