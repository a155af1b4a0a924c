"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (QK-norm, head_dim apart from
n_embd / n_head) and, in the sparse layers, a mixture of many narrow SwiGLU experts: softmax over
the router's logits, the top-k experts (ties to the lower index), their probabilities
renormalised when norm_topk_prob; no shared experts. The other layers (mlp_only_layers, and
those decoder_sparse_step skips: HF's layer i is sparse iff (i + 1) % step == 0) keep a dense
SwiGLU MLP of intermediate_size (cutp's moe_dense_layers). Tensors: Qwen3's names plus

    mlp.gate.weight [E, h]                         layers.i.mlp.router.weight [h, E]
    mlp.experts.e.{gate,up}_proj [F, h]            layers.i.mlp.experts.e.fc1 [h, 2F] ([gate | up])
    mlp.experts.e.down_proj [h, F]                 layers.i.mlp.experts.e.fc2 [F, h]

Configuration: Qwen3's, and num_experts (transformers 5 writes num_local_experts) -> n_experts,
num_experts_per_tok -> moe_top_k, moe_intermediate_size -> moe_ffn, norm_topk_prob ->
moe_renormalize, router_aux_loss_coef -> moe_aux_loss_coeff. Refused by name: a sliding window
in use.
"""
from __future__ import annotations

import dataclasses

from ..hf_files import HFFormatError
from .base import CONCAT_WEIGHTS, TRANSPOSED, Recipe
from .qwen3 import QWEN3_SPEC, Qwen3

_MOE = dict(moe_renormalize=True, moe_aux_loss_coeff=0.001, family="qwen3_moe")


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    spec_fields = Qwen3.spec_fields + ("moe_ffn", "moe_dense_layers", "moe_renormalize")
    presets = {
        # Qwen/Qwen3-30B-A3B's config.json: 48 layers, 128 experts of 768, 8 per token
        "qwen3-30b-a3b": dict(n_layer=48, n_head=32, n_kv_head=4, head_dim=128, n_embd=2048, mlp_hidden=6144,
                              vocab_size=151936, block_size=40960, n_experts=128, moe_top_k=8, moe_ffn=768,
                              **QWEN3_SPEC, **_MOE),
        # byte vocabulary, trains on the embedded corpus: qwen3-tiny's attention, 16 experts of 64, 4 per
        # token, the first layer dense (mlp_only_layers [0])
        "qwen3-moe-tiny": dict(n_layer=4, n_head=8, n_kv_head=2, head_dim=32, n_embd=128, mlp_hidden=320,
                               vocab_size=256, block_size=128, vocab_multiple=1, n_experts=16, moe_top_k=4, moe_ffn=64,
                               moe_dense_layers=(0,), **{**QWEN3_SPEC, "rope_theta": 10000.0, "bos_token_id": None,
                                                          "eos_token_id": None}, **_MOE),
    }

    def implies(self, cfg) -> bool:
        return Qwen3.implies(self, dataclasses.replace(cfg, n_experts=0)) and bool(cfg.n_experts)

    def config_from_hf(self, hf: dict, where: str) -> dict:
        E = hf.get("num_experts", hf.get("num_local_experts", 0))
        if not E:
            raise HFFormatError(f"{where}: num_experts={E!r}: a Qwen3-MoE model without experts is written as Qwen3")
        L, step = hf["num_hidden_layers"], int(hf.get("decoder_sparse_step", 1) or 1)
        dense = sorted({*hf.get("mlp_only_layers", ()), *(i for i in range(L) if (i + 1) % step)})
        return dict(super().config_from_hf(hf, where), n_experts=E, moe_top_k=hf.get("num_experts_per_tok", 8),
                    moe_ffn=hf.get("moe_intermediate_size", hf["intermediate_size"]),
                    moe_renormalize=bool(hf.get("norm_topk_prob", False)),
                    moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
                    moe_dense_layers=tuple(dense) or None)

    def refusal(self, cfg) -> str | None:
        if not cfg.n_experts:
            return "Qwen3-MoE's sparse layers are mixtures of experts; a dense model is written as Qwen3"
        why = Qwen3.refusal(self, dataclasses.replace(cfg, n_experts=0))
        if why:
            return why
        if cfg.moe_capacity_factor is not None:
            return "Qwen3-MoE is dropless: set moe_capacity_factor to None"
        return None

    def config_to_hf(self, cfg) -> dict:
        d = Qwen3.config_to_hf(self, cfg)
        del d["max_window_layers"]
        return dict(d, num_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                    moe_intermediate_size=cfg.moe_ffn or cfg.hidden, norm_topk_prob=bool(cfg.moe_renormalize),
                    router_aux_loss_coef=cfg.moe_aux_loss_coeff, output_router_logits=False, decoder_sparse_step=1,
                    mlp_only_layers=[i for i in range(cfg.n_layer) if not cfg.is_moe_layer(i)])

    def mlp_recipes(self, cfg, i: int, p: str, c: str) -> list:
        if not cfg.is_moe_layer(i):
            return super().mlp_recipes(cfg, i, p, c)
        h, F, E = cfg.n_embd, cfg.moe_ffn or cfg.hidden, cfg.n_experts
        m = p + "mlp."
        out = [Recipe(c + "mlp.router.weight", (m + "gate.weight",), TRANSPOSED, ((E, h),))]
        for e in range(E):
            x, y = f"{m}experts.{e}.", f"{c}mlp.experts.{e}."
            out += [Recipe(y + "fc1.weight", (x + "gate_proj.weight", x + "up_proj.weight"), CONCAT_WEIGHTS,
                           ((F, h), (F, h))),
                    Recipe(y + "fc2.weight", (x + "down_proj.weight",), TRANSPOSED, ((h, F),))]
        return out
