"""Llama (`LlamaForCausalLM`: Llama 2, 3, 3.1, 3.2, TinyLlama, SmolLM): RMSNorm, rotary positions
(with llama3 or linear scaling), a SwiGLU MLP, grouped-query attention, no biases (Llama's
attention_bias / mlp_bias may add them), untied or tied embeddings. `LlamaLike` holds what the
families built on Llama's block share (Qwen2, Mistral, Mixtral: their modules subclass it).

Names and layouts (HF's Linear weights are [out, in], cutp's [in, out]):

    model.embed_tokens.weight                  tok_embed.weight
    model.layers.i.input_layernorm.weight      layers.i.attn_norm.weight
    self_attn.{q,k,v}_proj.{weight,bias}       layers.i.attn.qkv.{weight,bias}: columns [q | k | v]
    self_attn.o_proj.{weight,bias}             layers.i.attn.proj
    post_attention_layernorm.weight            layers.i.mlp_norm.weight
    mlp.{gate,up}_proj                         layers.i.mlp.fc1: columns [gate | up] (each TP rank
                                               then holds [gate_r ; up_r], by the gate_up sharding)
    mlp.down_proj                              layers.i.mlp.fc2
    model.norm.weight, lm_head.weight          final_norm.weight, lm_head.weight (absent when tied)

Q and K load unpermuted: cutp's rotary op is HF's rotate_half layout. An old converter's
`rotary_emb.inv_freq` buffers are skipped.

Configuration: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, max_position_embeddings -> block_size, rms_norm_eps -> norm_eps,
rope_theta and rope_scaling (none/default, linear, llama3; top-level as Llama 3.x on the Hub ships
them, or transformers 5's rope_parameters), tie_word_embeddings, attention_bias / mlp_bias,
bos/eos/pad ids. Refused, naming the field: other rope types, partial rotary, another hidden_act.
"""
from __future__ import annotations

import re

from ..hf_files import HFFormatError
from .base import (CONCAT_BIASES, CONCAT_WEIGHTS, SAME, TRANSPOSED, Family, Recipe, require, rope_from_hf,
                   rope_to_hf)

_INV_FREQ = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

# the Llama family's spec (Llama 2/3, TinyLlama, Mistral, Qwen2): RMSNorm, RoPE, SwiGLU, no biases, untied
LLAMA_SPEC = dict(norm="rmsnorm", positions="rope", mlp="swiglu", bias=False, tie_embeddings=False, norm_eps=1e-5)
LLAMA3_SCALING = dict(rope_scaling="llama3", rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                      rope_original_max_positions=8192)


class LlamaLike(Family):
    """What Llama, Qwen2, Mistral and Mixtral share: the block's tensors and most of config.json."""

    embedding_key = "model.embed_tokens.weight"
    spec_fields = Family.spec_fields + ("rope_theta", "rope_scaling", "rope_factor", "n_experts", "moe_top_k",
                                        "qk_norm")
    qk_norm = False  # whether the family's attention normalises each query and key head (Qwen3)
    # local attention the family's config expresses: None (none), "all" (one window for every layer:
    # Mistral) or "layers" (a window on the layers layer_types names: Qwen2)
    windows = None

    def implies(self, cfg) -> bool:
        return (cfg.norm, cfg.positions, cfg.mlp) == ("rmsnorm", "rope", "swiglu") and cfg.qk_norm == self.qk_norm

    # ---- configuration ---------------------------------------------------------------------------
    def common_from_hf(self, hf: dict, where: str) -> dict:
        """The fields every Llama-like config.json has; refusals shared by all of them."""
        require(hf, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
                hf.get("model_type"), where)
        if hf.get("hidden_act", "silu") != "silu":
            raise HFFormatError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported; cutp's SwiGLU is silu")
        if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
            raise HFFormatError(f"{where}: partial_rotary_factor={hf['partial_rotary_factor']!r} is not supported; "
                                "cutp rotates the whole head")
        h, n_head = hf["hidden_size"], hf["num_attention_heads"]
        return dict(n_layer=hf["num_hidden_layers"], n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head,
                    n_embd=h, mlp_hidden=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                    block_size=hf.get("max_position_embeddings", 2048), bias=False,
                    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                    norm_eps=float(hf.get("rms_norm_eps", 1e-6)), norm="rmsnorm", positions="rope", mlp="swiglu",
                    head_dim=hf.get("head_dim") or h // n_head, **rope_from_hf(hf, where))

    @staticmethod
    def layer_windows_from_hf(hf: dict, where: str) -> dict:
        """sliding_window and layer_types of a Qwen2 / Qwen3 config.json, as transformers reads it:
        with use_sliding_window, the window on the layers layer_types names "sliding_attention"
        (without layer_types: the layers from max_window_layers on)."""
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

    @staticmethod
    def layer_windows_to_hf(cfg) -> dict:
        """The inverse of `layer_windows_from_hf`: layer_types written out, and the
        max_window_layers that gives them where they are global layers, then local ones."""
        if cfg.sliding_window is None:
            return dict(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layer)
        types = ["full_attention" if cfg.layer_window(i) is None else "sliding_attention" for i in range(cfg.n_layer)]
        return dict(use_sliding_window=True, sliding_window=cfg.sliding_window,
                    max_window_layers=types.index("sliding_attention"), layer_types=types)

    def common_to_hf(self, cfg) -> dict:
        return {"architectures": [self.architecture], "model_type": self.name, "hidden_size": cfg.n_embd,
                "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layer,
                "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
                "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
                "rope_scaling": rope_to_hf(cfg), "vocab_size": cfg.vocab_size,
                "tie_word_embeddings": bool(cfg.tie_embeddings), "hidden_act": "silu", "attention_dropout": 0.0,
                "initializer_range": 0.02, "use_cache": True, "torch_dtype": cfg.dtype,
                "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}

    def attention_refusal(self, cfg) -> str | None:
        """Why the family's attention cannot express cfg's window or soft-capping (None: it can)."""
        if cfg.attn_softcap is not None:
            return f"attn_softcap={cfg.attn_softcap}: {self.architecture} has no attention soft-capping (Gemma 2 has)"
        if cfg.sliding_window is None or self.windows == "layers":
            return None
        if self.windows is None:
            return (f"sliding_window={cfg.sliding_window}: {self.architecture} attends globally (a Llama-shaped "
                    "model with a window is written as Mistral)")
        if cfg.layer_types is not None and "full_attention" in cfg.layer_types:
            return (f"layer_types {list(cfg.layer_types)}: {self.architecture} applies its window to every layer "
                    "(a model with global layers among local ones is written as Qwen2 or Gemma)")
        return None

    def refusal(self, cfg) -> str | None:
        why = self.attention_refusal(cfg)
        if why:
            return why
        if cfg.qk_norm != self.qk_norm:  # (first: `implies` below asks for the family's qk_norm too)
            written = "" if self.qk_norm else " (a QK-norm model is written as Qwen3, with experts Qwen3-MoE)"
            return (f"qk_norm={cfg.qk_norm}: {self.architecture} {'normalises' if self.qk_norm else 'has no'} "
                    f"query and key heads{written}")
        if not LlamaLike.implies(self, cfg):
            return (f"norm={cfg.norm}, positions={cfg.positions}, mlp={cfg.mlp} is not a Llama-family model "
                    "(rmsnorm, rope, swiglu); GPT-2's adapter writes layernorm/learned/gelu models")
        if cfg.n_experts:
            return f"a mixture-of-experts model (n_experts={cfg.n_experts}) is written as Mixtral, not {self.name}"
        return self.bias_refusal(*self.biases(cfg), cfg)

    @staticmethod
    def biases(cfg) -> tuple:
        return cfg._bias("qkv_bias"), cfg._bias("attn_out_bias"), cfg._bias("mlp_bias")

    def bias_refusal(self, qkv: bool, out: bool, mlp: bool, cfg) -> str | None:
        """Why this family's projections cannot have these biases (None: they can)."""
        if (qkv, out, mlp) != (False, False, False):
            return (f"{self.architecture} has no biases; this model has qkv_bias={qkv}, attn_out_bias={out}, "
                    f"mlp_bias={mlp}")
        return None

    # ---- tensors -----------------------------------------------------------------------------
    def recipes(self, cfg) -> list:
        h, V, F, hd = cfg.n_embd, cfg.vocab_size, cfg.hidden, cfg.head_size
        q, kv = cfg.n_head * hd, cfg.kv_heads * hd
        out = [Recipe("tok_embed.weight", ("model.embed_tokens.weight",), SAME, ((V, h),)),
               Recipe("final_norm.weight", ("model.norm.weight",), SAME, ((h,),))]
        if not cfg.tie_embeddings:
            out.append(Recipe("lm_head.weight", ("lm_head.weight",), SAME, ((V, h),)))
        qkv_bias, out_bias, _ = self.biases(cfg)
        for i in range(cfg.n_layer):
            p, c = f"model.layers.{i}.", f"layers.{i}."
            a = p + "self_attn."
            out += [Recipe(c + "attn_norm.weight", (p + "input_layernorm.weight",), SAME, ((h,),)),
                    Recipe(c + "mlp_norm.weight", (p + "post_attention_layernorm.weight",), SAME, ((h,),)),
                    Recipe(c + "attn.qkv.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                           CONCAT_WEIGHTS, ((q, h), (kv, h), (kv, h))),
                    Recipe(c + "attn.proj.weight", (a + "o_proj.weight",), TRANSPOSED, ((h, q),))]
            if cfg.qk_norm:
                out += [Recipe(c + "attn.q_norm.weight", (a + "q_norm.weight",), SAME, ((hd,),)),
                        Recipe(c + "attn.k_norm.weight", (a + "k_norm.weight",), SAME, ((hd,),))]
            if qkv_bias:
                out.append(Recipe(c + "attn.qkv.bias", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                                  CONCAT_BIASES, ((q,), (kv,), (kv,))))
            if out_bias:
                out.append(Recipe(c + "attn.proj.bias", (a + "o_proj.bias",), SAME, ((h,),)))
            out += self.mlp_recipes(cfg, i, p, c)
        return out

    def mlp_recipes(self, cfg, i: int, p: str, c: str) -> list:
        """Layer i's MLP tensors (HF prefix p, cutp prefix c): a dense SwiGLU MLP here."""
        h, F = cfg.n_embd, cfg.hidden
        m = p + "mlp."
        out = [Recipe(c + "mlp.fc1.weight", (m + "gate_proj.weight", m + "up_proj.weight"), CONCAT_WEIGHTS,
                      ((F, h), (F, h))),
               Recipe(c + "mlp.fc2.weight", (m + "down_proj.weight",), TRANSPOSED, ((h, F),))]
        if cfg._bias("mlp_bias"):
            out += [Recipe(c + "mlp.fc1.bias", (m + "gate_proj.bias", m + "up_proj.bias"), CONCAT_BIASES,
                           ((F,), (F,))),
                    Recipe(c + "mlp.fc2.bias", (m + "down_proj.bias",), SAME, ((h,),))]
        return out

    def key_of(self, file_key: str) -> str | None:
        return None if _INV_FREQ.match(file_key) else file_key


class Llama(LlamaLike):
    name = "llama"
    architecture = "LlamaForCausalLM"
    presets = {
        # the Llama family's tiny: GQA (8 query heads, 2 KV heads), untied, SwiGLU 392 wide: within
        # tiny's parameter budget (832,640 against tiny's 842,496, the untied head included)
        "llama-tiny": dict(n_layer=4, n_head=8, n_kv_head=2, n_embd=128, mlp_hidden=392, vocab_size=256,
                           block_size=128, vocab_multiple=1, **LLAMA_SPEC),
        # Hugging Face models' shapes (config.json of each; the planner and --init-from checks)
        "llama3.2-1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, mlp_hidden=8192, vocab_size=128256,
                            block_size=131072, rope_theta=500000.0, **{**LLAMA_SPEC, "tie_embeddings": True},
                            **LLAMA3_SCALING, bos_token_id=128000, eos_token_id=128001),
        "llama3-8b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=128256,
                          block_size=8192, rope_theta=500000.0, **LLAMA_SPEC, bos_token_id=128000,
                          eos_token_id=128001),
        "llama3-70b": dict(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, mlp_hidden=28672, vocab_size=128256,
                           block_size=8192, rope_theta=500000.0, **LLAMA_SPEC, bos_token_id=128000,
                           eos_token_id=128001),
        # GPT-2 small's size with Llama's spec (bench compare-torch: 12 query / 4 KV heads, SwiGLU 2,048,
        # untied, GPT-2's vocabulary): 152.7M parameters
        "llama-gpt2": dict(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, mlp_hidden=2048, vocab_size=50257,
                           block_size=1024, **LLAMA_SPEC),
        # Llama 2 (the planner's --params 7B, 13B, 70B)
        "llama2-7b": dict(n_layer=32, n_head=32, n_embd=4096, mlp_hidden=11008, vocab_size=32000, block_size=4096,
                          **LLAMA_SPEC, bos_token_id=1, eos_token_id=2),
        "llama2-13b": dict(n_layer=40, n_head=40, n_embd=5120, mlp_hidden=13824, vocab_size=32000, block_size=4096,
                           **LLAMA_SPEC, bos_token_id=1, eos_token_id=2),
        "llama2-70b": dict(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, mlp_hidden=28672, vocab_size=32000,
                           block_size=4096, **LLAMA_SPEC, bos_token_id=1, eos_token_id=2),
        "tinyllama-1.1b": dict(n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, mlp_hidden=5632, vocab_size=32000,
                               block_size=2048, **LLAMA_SPEC, bos_token_id=1, eos_token_id=2),
    }

    def implies(self, cfg) -> bool:
        qkv, out, mlp = self.biases(cfg)
        return super().implies(cfg) and not cfg.n_experts and not (qkv and not out and not mlp)

    def config_from_hf(self, hf: dict, where: str) -> dict:
        bias = bool(hf.get("attention_bias", False))
        return dict(self.common_from_hf(hf, where), qkv_bias=bias, attn_out_bias=bias,
                    mlp_bias=bool(hf.get("mlp_bias", False)))

    def bias_refusal(self, qkv, out, mlp, cfg) -> str | None:
        if qkv != out:
            return (f"qkv_bias={qkv} with attn_out_bias={out}: Llama's attention_bias sets all four projections' "
                    "biases, Qwen2 has q/k/v biases only (and no MLP bias)")
        return None

    def config_to_hf(self, cfg) -> dict:
        qkv, _, mlp = self.biases(cfg)
        return dict(self.common_to_hf(cfg), head_dim=cfg.head_size, attention_bias=qkv, mlp_bias=mlp,
                    pretraining_tp=1)
