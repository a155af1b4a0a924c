"""Mistral (`MistralForCausalLM`): Llama's block without biases, its own config class (head_dim,
sliding_window). Tensors: Llama's names (cutp.models.families.llama). A Mistral model keeps its
family through training and export (ModelConfig.family): exported, it loads as
MistralForCausalLM. Refused by name: a sliding_window in use (v0.1's 4096; v0.2 and later set
none).
"""
from __future__ import annotations

from .llama import LLAMA_SPEC, LlamaLike


class Mistral(LlamaLike):
    name = "mistral"
    architecture = "MistralForCausalLM"
    presets = {
        # Mistral 7B v0.3 (no sliding window, vocabulary 32768, rope_theta 1e6)
        "mistral-7b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=32768,
                           block_size=32768, rope_theta=1000000.0, **LLAMA_SPEC, family="mistral", bos_token_id=1,
                           eos_token_id=2),
    }

    def config_from_hf(self, hf: dict, where: str) -> dict:
        self.refuse_window(hf, hf.get("sliding_window") is not None, where)
        return dict(self.common_from_hf(hf, where), qkv_bias=False, attn_out_bias=False, mlp_bias=False)

    def config_to_hf(self, cfg) -> dict:
        return dict(self.common_to_hf(cfg), head_dim=cfg.head_size, sliding_window=None)

    def implies(self, cfg) -> bool:
        return False  # Llama computes the same function: a config is Mistral's only by its `family`
