"""Qwen2 (`Qwen2ForCausalLM`, Qwen2 and Qwen2.5): Llama's block with biases on the q, k and v
projections only (none on o_proj or the MLP), tied or untied embeddings, head_dim n_embd / n_head
(Qwen2's config has no head_dim). Tensors: Llama's names (cutp.models.families.llama).
Windows as transformers' Qwen2Config has them: with use_sliding_window, sliding_window on the
layers `layer_types` names "sliding_attention" (without layer_types: the layers from
max_window_layers on); written back with layer_types and the max_window_layers that gives them.
"""
from __future__ import annotations

from ..hf_files import HFFormatError
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
                    **self._windows_from_hf(hf, where))

    windows = "layers"

    @staticmethod
    def _windows_from_hf(hf: dict, where: str) -> dict:
        if not hf.get("use_sliding_window", False) or hf.get("sliding_window", 4096) is None:
            return dict(sliding_window=None, layer_types=None)
        n, window = hf["num_hidden_layers"], hf.get("sliding_window", 4096)
        types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28) else
                                          "full_attention" for i in range(n)]
        if len(types) != n or any(t not in ("full_attention", "sliding_attention") for t in types):
            raise HFFormatError(f"{where}: layer_types {types!r} must list num_hidden_layers={n} entries of "
                                "full_attention / sliding_attention")
        if "sliding_attention" not in types:
            return dict(sliding_window=None, layer_types=None)
        return dict(sliding_window=window, layer_types=tuple(types))

    def bias_refusal(self, qkv, out, mlp, cfg) -> str | None:
        if (qkv, out, mlp) != (True, False, False):
            return (f"Qwen2 has biases on q, k and v only; this model has qkv_bias={qkv}, attn_out_bias={out}, "
                    f"mlp_bias={mlp}")
        if cfg.head_size * cfg.n_head != cfg.n_embd:
            return f"Qwen2's config has no head_dim: head_dim={cfg.head_size} must be n_embd / n_head"
        return None

    def config_to_hf(self, cfg) -> dict:
        if cfg.sliding_window is None:
            return dict(self.common_to_hf(cfg), use_sliding_window=False, sliding_window=None,
                        max_window_layers=cfg.n_layer)
        types = ["full_attention" if cfg.layer_window(i) is None else "sliding_attention" for i in range(cfg.n_layer)]
        first = types.index("sliding_attention")
        return dict(self.common_to_hf(cfg), use_sliding_window=True, sliding_window=cfg.sliding_window,
                    max_window_layers=first, layer_types=types)
