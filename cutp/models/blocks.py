"""Which submodules a family's transformer block is built from: `Blocks` turns a ModelConfig's
fields into the specs of cutp.tensor_parallel.specs (the norm, the attention, the MLP or MoE, the
post-norms). Every family (cutp.models.families.base.Family) is a `Blocks`; this default choice,
from the fields alone, is the one GPT-2, Llama, Qwen, Mistral, Mixtral, Gemma and DeepSeek-V3 use, and
a family whose block has a new piece overrides the method for it in its own module.

`ModelConfig.block_spec(layer)` asks its family's (`blocks_of`: cfg.family's, else the family its
fields imply, else this default) and the model, the planner and the parameter counts read that.
"""
from __future__ import annotations

import dataclasses

from ..tensor_parallel import BlockSpec
from ..tensor_parallel.specs import AttentionSpec, MLASpec, MLPSpec, MoESpec, NormSpec

CHOOSERS: dict = {}  # family name -> its Blocks (cutp.models.families registers each family)


class Blocks:
    """The specs of a block, chosen from a config's fields (module docstring)."""

    def implies(self, cfg) -> bool:
        """Whether a config with no `family` set is this family's."""
        return False

    def block_spec(self, cfg, layer: int) -> BlockSpec:
        """What layer `layer`'s transformer block is built from."""
        return BlockSpec(n_embd=cfg.n_embd, norm=self.norm_spec(cfg), attention=self.attention_spec(cfg, layer),
                         mlp=self.mlp_spec(cfg, layer), post_norm=self.norm_spec(cfg) if cfg.post_norms else None,
                         dropout=cfg.dropout)

    def norm_spec(self, cfg) -> NormSpec:
        """Every norm's (the blocks', Gemma's post-norms, the final one): `norm`, norm_eps, a
        LayerNorm's bias with `bias`, Gemma's (1 + w) with norm_offset."""
        return NormSpec(cfg.norm, cfg.norm_eps, bias=cfg.bias, offset=bool(cfg.norm_offset))

    def attention_spec(self, cfg, layer: int) -> AttentionSpec | MLASpec:
        """Layer `layer`'s attention: multi-head latent (kv_lora_rank set), else multi-head or
        grouped-query with the config's biases, rope, QK-norm, window, soft-cap and scale."""
        if cfg.kv_lora_rank is not None:
            return MLASpec(cfg.n_embd, cfg.n_head, **cfg.mla_settings(), norm_eps=cfg.norm_eps, n_layer=cfg.n_layer,
                           dropout=cfg.dropout)
        scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
        return AttentionSpec(cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size, n_layer=cfg.n_layer,
                             qkv_bias=cfg.has_bias("qkv_bias"), out_bias=cfg.has_bias("attn_out_bias"),
                             rope=cfg.positions == "rope",
                             qk_norm=NormSpec("rmsnorm", cfg.norm_eps, offset=bool(cfg.norm_offset))
                             if cfg.qk_norm else None,
                             window=cfg.layer_window(layer), softcap=cfg.attn_softcap, scale=scale,
                             dropout=cfg.dropout)

    def mlp_spec(self, cfg, layer: int) -> MLPSpec | MoESpec:
        """Layer `layer`'s MLP: dense (`mlp`, `hidden`), or with moe_settings(layer) a router and
        experts of that kind (DeepSeekMoE: and the shared experts, one MLP of their total width)."""
        dense = MLPSpec(cfg.n_embd, cfg.hidden, cfg.mlp, bias=cfg.has_bias("mlp_bias"), gelu=cfg.gelu,
                        n_layer=cfg.n_layer)
        moe = cfg.moe_settings(layer)
        if moe is None:
            return dense
        ffn, n_experts, shared = moe.pop("ffn"), moe.pop("n_experts"), moe.pop("shared_experts")
        return MoESpec(cfg.n_embd, n_experts, dataclasses.replace(dense, hidden=ffn),
                       shared=dataclasses.replace(dense, hidden=shared * ffn) if shared else None, routing=moe)


DEFAULT = Blocks()


def blocks_of(cfg) -> Blocks:
    """The Blocks that builds cfg: its family's, else the first registered family its fields imply,
    else the default (a hand-built config no family computes)."""
    if cfg.family in CHOOSERS:
        return CHOOSERS[cfg.family]
    return next((f for f in CHOOSERS.values() if f.implies(cfg)), DEFAULT)


__all__ = ["Blocks", "CHOOSERS", "DEFAULT", "blocks_of"]
