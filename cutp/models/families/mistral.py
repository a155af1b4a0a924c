"""Mistral (`MistralForCausalLM`): Llama's block without biases, its own config class (head_dim,
sliding_window). Tensors: Llama's names (cutp.models.families.llama). A Mistral model keeps its
family through training and export (ModelConfig.family): exported, it loads as
MistralForCausalLM. `sliding_window` (v0.1's 4096; v0.2 and later null; transformers' default 4096
where config.json has no such field) is every layer's window, as transformers applies it.
"""
from __future__ import annotations

from ..hf_files import HFFormatError
from .llama import LLAMA_SPEC, LlamaLike


class Mistral(LlamaLike):
    name = "mistral"
    architecture = "MistralForCausalLM"
    presets = {
        # Mistral 7B v0.3 (no sliding window, vocabulary 32768, rope_theta 1e6)
        "mistral-7b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=32768,
                           block_size=32768, rope_theta=1000000.0, **LLAMA_SPEC, family="mistral", bos_token_id=1,
                           eos_token_id=2),
        # Mistral 7B v0.1 (mistralai/Mistral-7B-v0.1's config.json: a 4096-token window on every layer)
        "mistral-7b-v0.1": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=32000,
                                block_size=32768, rope_theta=10000.0, sliding_window=4096, **LLAMA_SPEC,
                                family="mistral", bos_token_id=1, eos_token_id=2),
    }
    windows = "all"

    def config_from_hf(self, hf: dict, where: str) -> dict:
        window = hf.get("sliding_window", 4096)  # (MistralConfig's default; transformers ignores layer_types)
        if window is not None and not (isinstance(window, int) and window >= 1):
            raise HFFormatError(f"{where}: sliding_window={window!r} must be a positive integer or null")
        return dict(self.common_from_hf(hf, where), qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                    sliding_window=window)

    def config_to_hf(self, cfg) -> dict:
        return dict(self.common_to_hf(cfg), head_dim=cfg.head_size, sliding_window=cfg.sliding_window)

    def implies(self, cfg) -> bool:
        return False  # Llama computes the same function: a config is Mistral's only by its `family`
