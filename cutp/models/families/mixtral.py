"""Mixtral (`MixtralForCausalLM`): Llama's attention without biases, and a mixture of SwiGLU
experts in every layer: softmax over the router's logits, top-k, the k gates renormalised;
router_aux_loss_coef the load-balancing loss's weight.

    block_sparse_moe.gate.weight [E, h]        layers.i.mlp.router.weight [h, E]
    block_sparse_moe.experts.e.w1 / w3 / w2    layers.i.mlp.experts.e.fc1 [gate | up] / fc2

sliding_window: every layer's window, as Mistral's. Refused by name: router jitter.
"""
from __future__ import annotations

import dataclasses

from ..hf_files import HFFormatError
from .base import CONCAT_WEIGHTS, TRANSPOSED, Recipe
from .llama import LLAMA_SPEC, LlamaLike


class Mixtral(LlamaLike):
    windows = "all"  # (sliding_window: every layer's, as Mistral's)
    name = "mixtral"
    architecture = "MixtralForCausalLM"
    presets = {
        "mixtral-8x7b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=32000,
                             block_size=32768, rope_theta=1000000.0, n_experts=8, moe_top_k=2, moe_renormalize=True,
                             moe_aux_loss_coeff=0.02, **LLAMA_SPEC, bos_token_id=1, eos_token_id=2),
    }

    def implies(self, cfg) -> bool:
        return LlamaLike.implies(self, cfg) and bool(cfg.n_experts)  # (Qwen3-MoE, with qk_norm, is not Mixtral)

    def config_from_hf(self, hf: dict, where: str) -> dict:
        if float(hf.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise HFFormatError(f"{where}: router_jitter_noise={hf['router_jitter_noise']!r} is not supported; "
                                "cutp's router is deterministic")
        return dict(self.common_from_hf(hf, where), qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                    n_experts=hf.get("num_local_experts", 8), moe_top_k=hf.get("num_experts_per_tok", 2),
                    moe_renormalize=True, moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.02)),
                    sliding_window=hf.get("sliding_window"))  # (every layer's, as Mistral's; MixtralConfig: None)

    def refusal(self, cfg) -> str | None:
        if self.attention_refusal(cfg):
            return self.attention_refusal(cfg)
        if not LlamaLike.implies(self, cfg):
            return LlamaLike.refusal(self, dataclasses.replace(cfg, n_experts=0))
        if not cfg.n_experts:
            return "Mixtral's MLPs are mixtures of experts; a dense model is written as Llama"
        if self.biases(cfg) != (False, False, False) or cfg.moe_every != 1 or not cfg.moe_renormalize \
                or cfg.moe_capacity_factor is not None or cfg.moe_ffn not in (None, cfg.hidden):
            return ("a mixture-of-experts model is written as Mixtral, which needs no biases, an MoE MLP in every "
                    "layer (moe_every=1), moe_renormalize=true, no moe_capacity_factor and moe_ffn equal to "
                    "mlp_hidden")
        return None

    def config_to_hf(self, cfg) -> dict:
        return dict(self.common_to_hf(cfg), head_dim=cfg.head_size, num_local_experts=cfg.n_experts,
                    num_experts_per_tok=cfg.moe_top_k, router_aux_loss_coef=cfg.moe_aux_loss_coeff,
                    output_router_logits=False, sliding_window=cfg.sliding_window, router_jitter_noise=0.0)

    def mlp_recipes(self, cfg, i: int, p: str, c: str) -> list:
        h, F, E = cfg.n_embd, cfg.hidden, cfg.n_experts
        m = p + "block_sparse_moe."
        out = [Recipe(c + "mlp.router.weight", (m + "gate.weight",), TRANSPOSED, ((E, h),))]
        for e in range(E):
            x, y = f"{m}experts.{e}.", f"{c}mlp.experts.{e}."
            out += [Recipe(y + "fc1.weight", (x + "w1.weight", x + "w3.weight"), CONCAT_WEIGHTS, ((F, h), (F, h))),
                    Recipe(y + "fc2.weight", (x + "w2.weight",), TRANSPOSED, ((h, F),))]
        return out
