"""Gemma 3, text (`Gemma3ForCausalLM`, model_type gemma3_text): Gemma 2's block
(cutp.models.families.gemma2) with QK-norm ((1 + w) RMSNorms over each query and key head, before
RoPE), no soft-capping by default, five local layers to a global one (layer_types, or
sliding_window_pattern), and a rope per layer type: the local layers' rope_local_base_freq
unscaled, the global layers' rope_theta with its scaling (linear in gemma-3-4b and larger).
Tensors: Gemma 2's names plus

    self_attn.q_norm.weight [head_dim]     layers.i.attn.q_norm.weight
    self_attn.k_norm.weight [head_dim]     layers.i.attn.k_norm.weight

config.json's rope: transformers 5's rope_parameters by layer type ({"full_attention": {...},
"sliding_attention": {...}}), or the Hub's top-level rope_theta, rope_scaling and
rope_local_base_freq. Refused by name: a scaled local rope, and Gemma 2's refusals.
"""
from __future__ import annotations

from ..hf_files import HFFormatError
from .base import rope_from_hf, rope_to_hf
from .gemma2 import GEMMA_SPEC, GemmaLike, alternating

_LOCAL_THETA, _GLOBAL_THETA = 10000.0, 1000000.0  # transformers' defaults


class Gemma3(GemmaLike):
    name = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    qk_norm = True
    pattern = 6
    pieces = GemmaLike.pieces + ("rope_local_theta",)
    defaults = dict(sliding_window=4096, query_pre_attn_scalar=256)
    presets = {
        # google/gemma-3-1b-pt
        "gemma3-1b": dict(GEMMA_SPEC, family="gemma3_text", qk_norm=True, n_layer=26, n_head=4, n_kv_head=1,
                          head_dim=256, n_embd=1152, mlp_hidden=6912, vocab_size=262144, block_size=32768,
                          rope_theta=_GLOBAL_THETA, rope_local_theta=_LOCAL_THETA, query_pre_attn_scalar=256.0,
                          sliding_window=512, layer_types=alternating(26, 6), bos_token_id=2, eos_token_id=1,
                          pad_token_id=0),
        # byte vocabulary, trains on the embedded corpus: local layers (a window of 64, shorter than
        # block_size) alternating with global ones, two rope tables, QK-norm, the logits soft-capped
        "gemma-tiny": dict(GEMMA_SPEC, family="gemma3_text", qk_norm=True, n_layer=4, n_head=4, n_kv_head=2,
                           head_dim=32, n_embd=128, mlp_hidden=256, vocab_size=256, block_size=128,
                           vocab_multiple=1, rope_theta=_GLOBAL_THETA, rope_local_theta=_LOCAL_THETA,
                           query_pre_attn_scalar=32.0, sliding_window=64, layer_types=alternating(4, 2),
                           final_softcap=30.0),
    }

    def config_from_hf(self, hf: dict, where: str) -> dict:
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
            full.setdefault("rope_theta", hf.get("rope_theta", _GLOBAL_THETA))
            local.setdefault("rope_theta", hf.get("rope_local_base_freq", _LOCAL_THETA))
            rope = rope_from_hf({"rope_parameters": full}, where)
        else:  # the Hub's config.json of transformers 4.x
            local = {"rope_theta": hf.get("rope_local_base_freq", _LOCAL_THETA)}
            rope = rope_from_hf(dict(hf, rope_theta=hf.get("rope_theta", _GLOBAL_THETA)), where)
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise HFFormatError(f"{where}: rope_parameters.sliding_attention={local!r} is not supported; cutp's "
                                "local layers turn by an unscaled rope (rope_type default)")
        # (Gemma3Attention keeps attn_logit_softcapping but never applies it: nor does cutp)
        return dict(self.common_from_hf(hf, where), **rope, rope_local_theta=float(local["rope_theta"]), qk_norm=True,
                    attn_softcap=None)

    def refusal(self, cfg) -> str | None:
        why = super().refusal(cfg)
        if why is None and cfg.attn_softcap is not None:
            return (f"attn_softcap={cfg.attn_softcap}: Gemma3ForCausalLM does not soft-cap the attention scores "
                    "(transformers ignores its attn_logit_softcapping), and Gemma2ForCausalLM, which does, has no "
                    "QK-norm; set attn_softcap=None")
        if why is None and cfg.rope_local_theta is None and cfg.rope_scaling != "none":
            return (f"rope_scaling={cfg.rope_scaling} on every layer: Gemma 3's local layers turn by an unscaled rope "
                    "of their own; set rope_local_theta (transformers' rope_local_base_freq)")
        return why

    def config_to_hf(self, cfg) -> dict:
        full = dict(rope_to_hf(cfg) or {"rope_type": "default"}, rope_theta=cfg.rope_theta)
        local = full if cfg.rope_local_theta is None else {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
        # (transformers 5's rope_parameters by layer type, and 4.x's top-level fields, which 5 reads as the same)
        return dict(self.common_to_hf(cfg), attn_logit_softcapping=None, rope_parameters={"full_attention": full, "sliding_attention": local},
                    rope_theta=cfg.rope_theta, rope_scaling=rope_to_hf(cfg), rope_local_base_freq=local["rope_theta"])
