"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention (cutp.tensor_parallel.mla)
and DeepSeekMoE (cutp.tensor_parallel.moe): the first `first_k_dense_replace` layers with a
dense SwiGLU MLP of intermediate_size, the others with n_routed_experts experts of
moe_intermediate_size chosen by sigmoid scores plus the correction bias, group-limited (n_group,
topk_group), renormalised (norm_topk_prob) and scaled (routed_scaling_factor), beside
n_shared_experts always-on experts (one SwiGLU of their total width). Tensors:

    self_attn.q_a_proj / q_a_layernorm / q_b_proj   layers.i.attn.q_a / q_a_norm / q_b (or q_proj)
    self_attn.kv_a_proj_with_mqa / kv_a_layernorm   layers.i.attn.kv_a / kv_a_norm
    self_attn.kv_b_proj / o_proj                    layers.i.attn.kv_b / proj
    mlp.gate.weight, mlp.gate.e_score_correction_bias   layers.i.mlp.router.weight, .router.score_bias
    mlp.experts.e.{gate,up,down}_proj               layers.i.mlp.experts.e.fc1 ([gate | up]) / fc2
    mlp.shared_experts.{gate,up,down}_proj          layers.i.mlp.shared_experts.fc1 / fc2

With rope_interleave (every DeepSeek-V3 checkpoint) the rope columns of q_b (q_proj) and kv_a are
interleaved pairs: read, they are permuted to the rotate-half layout cutp computes (evens, then
odds: what transformers does before rotating), and written back interleaved; with
rope_interleave false (transformers' plain rotate-half) they are read and written as they are.
The multi-token prediction layers (keys of layers past num_hidden_layers) are skipped on load, as transformers
skips them (one line says so). YaRN rope scaling as transformers computes it: its frequencies,
cos and sin times its attention factor, and MLA's softmax scale times mscale(factor,
mscale_all_dim)^2 (ModelConfig.mla_softmax_factor). Refused by name: scoring other than
sigmoid, topk_method other than noaux_tc, attention_bias.
"""
from __future__ import annotations

import re
import sys

import numpy as np

from ..hf_files import HFFormatError
from .base import CONCAT_WEIGHTS, SAME, TRANSPOSED, Recipe, refuse_unless
from .llama import LLAMA_SPEC, LlamaLike

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_V3 = dict(**{**LLAMA_SPEC, "norm_eps": 1e-6}, moe_renormalize=True, moe_scoring="sigmoid", moe_score_bias=True,
           moe_aux_loss_coeff=0.0, moe_routed_scaling=2.5, moe_shared_experts=1, family="deepseek_v3")


def interleaved_rope_columns(d_rope: int) -> np.ndarray:
    """cutp's rope column j is the interleaved checkpoint's column [evens, odds][j]."""
    return np.concatenate([np.arange(0, d_rope, 2), np.arange(1, d_rope, 2)])


class DeepseekV3(LlamaLike):
    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    spec_fields = LlamaLike.spec_fields + ("moe_ffn", "moe_dense_layers", "kv_lora_rank", "q_lora_rank",
                                           "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_n_group",
                                           "moe_topk_group", "moe_shared_experts")
    presets = {
        # deepseek-ai/DeepSeek-V3's config.json (YaRN factor 40 over 4096 positions), without its
        # multi-token prediction layer
        "deepseek-v3": dict(n_layer=61, n_head=128, n_embd=7168, mlp_hidden=18432, vocab_size=129280,
                            block_size=163840, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, n_experts=256, moe_top_k=8, moe_ffn=2048,
                            moe_n_group=8, moe_topk_group=4, moe_dense_layers=(0, 1, 2), rope_scaling="yarn",
                            rope_factor=40.0, rope_original_max_positions=4096, rope_mscale=1.0,
                            rope_mscale_all_dim=1.0,
                            bos_token_id=0, eos_token_id=1, **_V3),
        # byte vocabulary, trains on the embedded corpus: MLA, one shared + 16 routed experts of 32 in
        # 4 groups (2 kept), 4 per token, layer 0 dense
        "deepseek-tiny": dict(n_layer=4, n_head=8, n_embd=128, mlp_hidden=320, vocab_size=256, block_size=128,
                              vocab_multiple=1, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=16, n_experts=16, moe_top_k=4, moe_ffn=32, moe_n_group=4,
                              moe_topk_group=2, moe_dense_layers=(0,), moe_bias_update_rate=1e-3, **_V3),
    }

    # the router's weight and correction bias, as transformers' DeepseekV3 keeps them (its scores
    # are float32; a bias rounded to 8 bits can change which experts a token gets)
    keep_in_float32 = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

    def implies(self, cfg) -> bool:
        return cfg.kv_lora_rank is not None and cfg.moe_scoring == "sigmoid"

    def config_from_hf(self, hf: dict, where: str) -> dict:
        refuse_unless(hf, "scoring_func", ("sigmoid",), "DeepSeek-V3's router scores are sigmoids", where, "sigmoid")
        refuse_unless(hf, "topk_method", ("noaux_tc",), "cutp routes as DeepSeek-V3 (noaux_tc)", where, "noaux_tc")
        refuse_unless(hf, "attention_bias", (False,), "MLA without biases", where, False)
        refuse_unless(hf, "moe_layer_freq", (1,), "every layer past first_k_dense_replace is MoE", where, 1)
        base = self.common_from_hf(dict(hf, head_dim=None), where)
        L, k = hf["num_hidden_layers"], int(hf.get("first_k_dense_replace", 0))
        return dict(base, head_dim=None, n_kv_head=None, qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                    q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                    v_head_dim=hf["v_head_dim"], n_experts=hf["n_routed_experts"],
                    moe_top_k=hf["num_experts_per_tok"], moe_ffn=hf["moe_intermediate_size"],
                    moe_dense_layers=tuple(range(min(k, L))) or None, moe_renormalize=bool(hf.get("norm_topk_prob")),
                    moe_scoring="sigmoid", moe_n_group=hf.get("n_group", 1), moe_topk_group=hf.get("topk_group", 1),
                    moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.0)), moe_score_bias=True,
                    moe_shared_experts=hf.get("n_shared_experts") or 0, moe_aux_loss_coeff=0.0,
                    rope_interleave=bool(hf.get("rope_interleave", True)))  # (transformers' default: True)

    def refusal(self, cfg) -> str | None:
        if cfg.kv_lora_rank is None or not cfg.n_experts or cfg.moe_scoring != "sigmoid" or not cfg.moe_score_bias:
            return ("DeepSeek-V3 has multi-head latent attention (kv_lora_rank) and sigmoid-scored experts with a "
                    "correction bias (n_experts, moe_scoring=sigmoid, moe_score_bias=true)")
        dense = tuple(i for i in range(cfg.n_layer) if not cfg.is_moe_layer(i))
        if dense != tuple(range(len(dense))) or cfg.moe_capacity_factor is not None:
            return "DeepSeek-V3's dense layers are the first ones (first_k_dense_replace) and it is dropless"
        if LlamaLike.biases(cfg) != (False, False, False) or cfg.rope_scaling not in ("none", "linear", "yarn"):
            return "DeepSeek-V3 has no biases and default, linear or yarn rope scaling"
        return None

    def config_to_hf(self, cfg) -> dict:
        d = self.common_to_hf(cfg)
        dense = sum(not cfg.is_moe_layer(i) for i in range(cfg.n_layer))
        return dict(d, num_key_value_heads=cfg.n_head, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                    qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                    v_head_dim=cfg.v_head_dim, n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                    moe_intermediate_size=cfg.moe_ffn or cfg.hidden, first_k_dense_replace=dense,
                    norm_topk_prob=bool(cfg.moe_renormalize), n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
                    routed_scaling_factor=cfg.moe_routed_scaling, n_shared_experts=cfg.moe_shared_experts,
                    rope_interleave=cfg.rope_interleave, attention_bias=False, num_nextn_predict_layers=0)

    # ---- tensors -----------------------------------------------------------------------------
    def recipes(self, cfg) -> list:
        h, V = cfg.n_embd, cfg.vocab_size
        out = [Recipe("tok_embed.weight", ("model.embed_tokens.weight",), SAME, ((V, h),)),
               Recipe("final_norm.weight", ("model.norm.weight",), SAME, ((h,),))]
        if not cfg.tie_embeddings:
            out.append(Recipe("lm_head.weight", ("lm_head.weight",), SAME, ((V, h),)))
        for i in range(cfg.n_layer):
            p, c = f"model.layers.{i}.", f"layers.{i}."
            out += [Recipe(c + "attn_norm.weight", (p + "input_layernorm.weight",), SAME, ((h,),)),
                    Recipe(c + "mlp_norm.weight", (p + "post_attention_layernorm.weight",), SAME, ((h,),))]
            out += self.attention_recipes(cfg, p + "self_attn.", c + "attn.")
            out += self.mlp_recipes(cfg, i, p, c)
        return out

    @staticmethod
    def attention_recipes(cfg, a: str, c: str) -> list:
        h, H, r, rq = cfg.n_embd, cfg.n_head, cfg.kv_lora_rank, cfg.q_lora_rank
        dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        rope = interleaved_rope_columns(dr) if cfg.rope_interleave else np.arange(dr)
        q_cols = tuple(np.concatenate([np.r_[j * (dn + dr):j * (dn + dr) + dn, j * (dn + dr) + dn + rope]
                                       for j in range(H)]).tolist())
        out = []
        if rq:
            out += [Recipe(c + "q_a.weight", (a + "q_a_proj.weight",), TRANSPOSED, ((rq, h),)),
                    Recipe(c + "q_a_norm.weight", (a + "q_a_layernorm.weight",), SAME, ((rq,),)),
                    Recipe(c + "q_b.weight", (a + "q_b_proj.weight",), TRANSPOSED, ((H * (dn + dr), rq),),
                           columns=q_cols)]
        else:
            out.append(Recipe(c + "q_proj.weight", (a + "q_proj.weight",), TRANSPOSED, ((H * (dn + dr), h),),
                              columns=q_cols))
        return out + [
            Recipe(c + "kv_a.weight", (a + "kv_a_proj_with_mqa.weight",), TRANSPOSED, ((r + dr, h),),
                   columns=tuple(np.r_[np.arange(r), r + rope].tolist())),
            Recipe(c + "kv_a_norm.weight", (a + "kv_a_layernorm.weight",), SAME, ((r,),)),
            Recipe(c + "kv_b.weight", (a + "kv_b_proj.weight",), TRANSPOSED, ((H * (dn + dv), r),)),
            Recipe(c + "proj.weight", (a + "o_proj.weight",), TRANSPOSED, ((h, H * dv),))]

    def mlp_recipes(self, cfg, i: int, p: str, c: str) -> list:
        if not cfg.is_moe_layer(i):
            return super().mlp_recipes(cfg, i, p, c)
        h, F, E = cfg.n_embd, cfg.moe_ffn or cfg.hidden, cfg.n_experts
        m = p + "mlp."
        out = [Recipe(c + "mlp.router.weight", (m + "gate.weight",), TRANSPOSED, ((E, h),)),
               Recipe(c + "mlp.router.score_bias", (m + "gate.e_score_correction_bias",), SAME, ((E,),))]
        experts = [(f"{m}experts.{e}.", f"{c}mlp.experts.{e}.", F) for e in range(E)]
        if cfg.moe_shared_experts:
            experts.append((m + "shared_experts.", c + "mlp.shared_experts.", cfg.moe_shared_experts * F))
        for x, y, width in experts:
            out += [Recipe(y + "fc1.weight", (x + "gate_proj.weight", x + "up_proj.weight"), CONCAT_WEIGHTS,
                           ((width, h), (width, h))),
                    Recipe(y + "fc2.weight", (x + "down_proj.weight",), TRANSPOSED, ((h, width),))]
        return out

    def key_of(self, file_key: str) -> str | None:
        m = _LAYER.match(file_key)
        if m and int(m.group(1)) >= self._layers:
            if not self._said:
                print(f"cutp: skipping the multi-token prediction layers (model.layers.{self._layers} and past), "
                      "as transformers does", file=sys.stderr)
                self._said = True
            return None
        return super().key_of(file_key)

    _layers = 1 << 30  # the layers of the directory being read (`reading`)
    _said = False

    def reading(self, cfg) -> None:
        self._layers, self._said = cfg.n_layer, False
