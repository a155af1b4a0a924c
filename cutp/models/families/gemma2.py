"""Gemma 2 (`Gemma2ForCausalLM`): a block of four (1 + w) RMSNorms (before and after the attention,
before and after the MLP), a GeGLU MLP with tanh GeLU (gelu_pytorch_tanh), grouped-query attention
with head_dim apart from n_embd / n_head and the scores scaled by query_pre_attn_scalar ** -0.5,
local (sliding-window) layers alternating with global ones, the attention scores and the final
logits soft-capped, the token embedding multiplied by sqrt(hidden_size) in the model's dtype, tied
embeddings. `GemmaLike` holds what Gemma 3 shares (families/gemma3.py).

Tensors: Llama's names (cutp.models.families.llama: q/k/v/o, gate/up/down, input_layernorm,
model.norm), except the norms around the MLP, and the norm weights are stored as transformers
stores them (w, the scale being 1 + w):

    post_attention_layernorm.weight      layers.i.post_attn_norm.weight
    pre_feedforward_layernorm.weight     layers.i.mlp_norm.weight
    post_feedforward_layernorm.weight    layers.i.post_mlp_norm.weight

Configuration: Llama's fields plus hidden_activation (gelu_pytorch_tanh, or gelu: exact erf),
query_pre_attn_scalar, sliding_window, layer_types (or Gemma's default pattern), attn_logit_softcapping,
final_logit_softcapping, attention_bias. Refused by name: another hidden_activation,
use_bidirectional_attention, rope types other than default and linear.
"""
from __future__ import annotations

from ..hf_files import HFFormatError
from .base import SAME, Recipe, require, rope_from_hf, rope_to_hf
from .llama import LlamaLike

# the Gemma block's spec, every Gemma (2, 3)
GEMMA_SPEC = dict(norm="rmsnorm", positions="rope", mlp="geglu", gelu="tanh", bias=False, tie_embeddings=True,
                  norm_eps=1e-6, norm_offset=True, embed_scale=True, post_norms=True, qkv_bias=False,
                  attn_out_bias=False, mlp_bias=False)
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def _number(v):
    """An integral float as the int transformers' config declares (query_pre_attn_scalar: int)."""
    return int(v) if float(v).is_integer() else v


def alternating(n_layer: int, every: int) -> tuple:
    """Gemma's default layer_types: every `every`-th layer global, the others local (sliding)."""
    return tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layer))


class GemmaLike(LlamaLike):
    """What Gemma 2 and Gemma 3 share: the block's tensors and most of config.json."""

    embedding_key = "model.embed_tokens.weight"
    pieces = ("norm_offset", "embed_scale", "post_norms", "query_pre_attn_scalar", "final_softcap")
    spec_fields = LlamaLike.spec_fields + ("norm_offset", "embed_scale", "post_norms", "query_pre_attn_scalar",
                                           "rope_local_theta", "sliding_window", "layer_types", "attn_softcap",
                                           "final_softcap", "gelu")
    pattern = 2  # layer_types' default: every pattern-th layer global
    defaults: dict = {}  # config.json's defaults of the fields an older file may leave out

    def implies(self, cfg) -> bool:
        return (cfg.norm, cfg.positions, cfg.mlp, cfg.norm_offset) == ("rmsnorm", "rope", "geglu", True) and \
            cfg.qk_norm == self.qk_norm

    # ---- configuration ---------------------------------------------------------------------------
    def _get(self, hf: dict, field: str):
        return hf[field] if field in hf else self.defaults.get(field)

    def common_from_hf(self, hf: dict, where: str) -> dict:
        require(hf, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
                hf.get("model_type"), where)
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise HFFormatError(f"{where}: hidden_activation={act!r} is not supported; cutp's GeGLU computes "
                                f"{sorted(_ACTIVATIONS)}")
        if hf.get("use_bidirectional_attention"):
            raise HFFormatError(f"{where}: use_bidirectional_attention={hf['use_bidirectional_attention']!r} is not "
                                "supported; cutp's attention is causal")
        h, n_head, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
        bias = bool(hf.get("attention_bias", False))
        window = self._get(hf, "sliding_window")
        types = hf.get("layer_types")
        types = tuple(types) if types is not None else alternating(L, hf.get("sliding_window_pattern", self.pattern))
        scalar = self._get(hf, "query_pre_attn_scalar")
        return dict(GEMMA_SPEC, n_layer=L, n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head,
                    n_embd=h, mlp_hidden=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                    block_size=hf.get("max_position_embeddings", 8192), gelu=_ACTIVATIONS[act],
                    tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                    norm_eps=float(hf.get("rms_norm_eps", 1e-6)), head_dim=hf.get("head_dim") or h // n_head,
                    qkv_bias=bias, attn_out_bias=bias, mlp_bias=False,
                    query_pre_attn_scalar=None if scalar is None else float(scalar),
                    sliding_window=window, layer_types=types,
                    attn_softcap=self._get(hf, "attn_logit_softcapping"),
                    final_softcap=self._get(hf, "final_logit_softcapping"))

    def common_to_hf(self, cfg) -> dict:
        qkv, _, _ = self.biases(cfg)
        types = list(cfg.layer_types or [("full_attention" if cfg.sliding_window is None else "sliding_attention")]
                     * cfg.n_layer)
        # (transformers' local layers need a window: without one, block_size's, which leaves no key out)
        window = cfg.sliding_window if cfg.sliding_window is not None or "sliding_attention" not in types \
            else cfg.block_size
        return {"architectures": [self.architecture], "model_type": self.name, "hidden_size": cfg.n_embd,
                "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layer,
                "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
                "hidden_activation": {"tanh": "gelu_pytorch_tanh", "none": "gelu"}[cfg.gelu],
                "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "vocab_size": cfg.vocab_size,
                "tie_word_embeddings": bool(cfg.tie_embeddings), "attention_bias": qkv, "attention_dropout": 0.0,
                "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar or cfg.head_size),
                "sliding_window": window, "layer_types": types,
                "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.final_softcap,
                "initializer_range": 0.02, "use_cache": True, "torch_dtype": cfg.dtype,
                "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}

    def refusal(self, cfg) -> str | None:
        if cfg.qk_norm != self.qk_norm:  # (first: `implies` below asks for the family's qk_norm too)
            return (f"qk_norm={cfg.qk_norm}: {self.architecture} {'normalises' if self.qk_norm else 'has no'} "
                    f"query and key heads{'' if self.qk_norm else ' (a QK-norm Gemma is written as Gemma 3)'}")
        if not GemmaLike.implies(self, cfg) or not (cfg.embed_scale and cfg.post_norms):
            return (f"norm={cfg.norm}, positions={cfg.positions}, mlp={cfg.mlp}, norm_offset={cfg.norm_offset}, "
                    f"embed_scale={cfg.embed_scale}, post_norms={cfg.post_norms} is not a Gemma model (rmsnorm, "
                    "rope, geglu, and each of the three true)")
        if cfg.n_experts:
            return f"a mixture-of-experts model (n_experts={cfg.n_experts}) cannot be written as {self.architecture}"
        qkv, out, mlp = self.biases(cfg)
        if qkv != out or mlp:
            return (f"qkv_bias={qkv}, attn_out_bias={out}, mlp_bias={mlp}: Gemma's attention_bias sets the four "
                    "attention projections' biases, and its MLP has none")
        return None

    # ---- tensors -----------------------------------------------------------------------------
    def recipes(self, cfg) -> list:
        h = cfg.n_embd
        out = []
        for r in super().recipes(cfg):  # Llama's, with the norms around the MLP renamed
            if r.name.endswith(".mlp_norm.weight"):
                p, c = r.keys[0].rsplit("post_attention_layernorm", 1)[0], r.name.rsplit("mlp_norm", 1)[0]
                r = Recipe(r.name, (p + "pre_feedforward_layernorm.weight",), SAME, ((h,),))
                out += [Recipe(c + "post_attn_norm.weight", (p + "post_attention_layernorm.weight",), SAME, ((h,),)),
                        Recipe(c + "post_mlp_norm.weight", (p + "post_feedforward_layernorm.weight",), SAME, ((h,),))]
            out.append(r)
        return out


class Gemma2(GemmaLike):
    name = "gemma2"
    architecture = "Gemma2ForCausalLM"
    defaults = dict(sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0)
    presets = {
        # google/gemma-2-2b
        "gemma2-2b": dict(GEMMA_SPEC, family="gemma2", n_layer=26, n_head=8, n_kv_head=4, head_dim=256, n_embd=2304,
                          mlp_hidden=9216, vocab_size=256000, block_size=8192, rope_theta=10000.0,
                          query_pre_attn_scalar=256.0, sliding_window=4096, layer_types=alternating(26, 2),
                          attn_softcap=50.0, final_softcap=30.0, bos_token_id=2, eos_token_id=1, pad_token_id=0),
    }

    def config_from_hf(self, hf: dict, where: str) -> dict:
        return dict(self.common_from_hf(hf, where), **rope_from_hf(hf, where))

    def config_to_hf(self, cfg) -> dict:
        rope = dict(rope_to_hf(cfg) or {"rope_type": "default"}, rope_theta=cfg.rope_theta)
        # (transformers 5's rope_parameters, and 4.x's top-level fields, which 5 reads as the same)
        return dict(self.common_to_hf(cfg), rope_parameters=rope, rope_theta=cfg.rope_theta,
                    rope_scaling=rope_to_hf(cfg))

    def refusal(self, cfg) -> str | None:
        why = super().refusal(cfg)
        if why is None and cfg.rope_local_theta is not None:
            return (f"rope_local_theta={cfg.rope_local_theta}: Gemma 2 has one rope for every layer (Gemma 3's "
                    "local layers have their own)")
        return why
