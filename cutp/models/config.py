"""The model's configuration: its fields, validation and parameter count.

`ModelConfig` (alias `GPTConfig`, its first name) is the one config object the model is built
from (cutp.models.gpt): a small spec of the transformer, whose defaults are GPT-2's (LayerNorm,
learned positions, GeLU MLP, biases everywhere, tied embeddings) and whose other values give
the Llama family (RMSNorm, rotary positions, SwiGLU, no biases, untied), Qwen2 (the same with
q/k/v biases), Mistral, Mixtral (SwiGLU experts, softmax top-2 renormalised), and Gemma 2 / 3
((1 + w) RMSNorms before and after each branch, GeGLU, scaled embeddings, soft-capping); `family`
names the Hugging Face family it is exported as. `block_spec()` is what each transformer block
is built from (cutp.tensor_parallel's `BlockSpec`: the norm, attention and MLP specs its family
chooses from these fields, cutp.models.blocks); `declarations()` lists every parameter as those
specs declare it, and the parameter
counts here and in the planner are its sums. `PRESETS` are the named shapes of
`--preset`, declared by the family modules (cutp.models.families).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..runtime.errors import ConfigError
from ..ops.rotary import RopeScaling, yarn_mscale
from ..tensor_parallel import BlockSpec, check_moe, pad_vocab
from ..tensor_parallel.specs import ParamDecl, count, prefixed
from .blocks import Blocks, blocks_of
from ..tensor_parallel.validation import check_attention, check_mlp, check_vocab

# Parameters and activations are stored in the model's dtype. bfloat16/float16 models compute
# matmuls, LayerNorm statistics, softmax and the loss in float32 (cutp.ops' dtype policy) and are
# trained through fp32 master weights and fp32 gradient buffers (cutp.optim).
DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# --preset name -> ModelConfig fields: each family module declares its own
# (cutp.models.families registers them when cutp.models is imported)
PRESETS: dict = {}
FAMILY_NAMES: set = set()  # the registered families' names (ModelConfig.family)

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu", "geglu")


@dataclass
class ModelConfig:
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None: n_head (multi-head attention, as GPT-2)
    n_embd: int = 768
    mlp_hidden: int | None = None  # None: 4 * n_embd
    vocab_size: int = 50257
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    dtype: str = "float32"
    norm_eps: float = 1e-5
    gelu: str = "tanh"
    vocab_multiple: int = 128  # vocabulary padded to a multiple of this times tp
    label_smoothing: float = 0.0
    # mixture of experts (cutp.tensor_parallel.moe): 0 experts = dense MLPs
    n_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1  # an MoE MLP in layers 0, k, 2k, ...
    # layers whose MLP stays dense though moe_every picks them (Qwen3-MoE's mlp_only_layers and
    # decoder_sparse_step, DeepSeek's first_k_dense_replace); their width is mlp_hidden
    moe_dense_layers: tuple | None = None
    moe_ffn: int | None = None  # each expert's width (None: the MLP's, mlp_hidden)
    moe_capacity_factor: float | None = None  # None: dropless
    moe_aux_loss_coeff: float = 1e-2  # load balancing (Switch/GShard)
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE uses 1e-3)
    moe_renormalize: bool = False  # the k gates renormalised to sum to 1
    # DeepSeekMoE (cutp.tensor_parallel.moe): sigmoid scores, group-limited choice (the topk_group of
    # n_group groups by their two best scores), the gates scaled; a correction bias that only chooses,
    # moved by bias_update_rate * sign(mean load - load) after each step; shared experts (a dense
    # SwiGLU of moe_shared_experts * moe_ffn) beside the routed ones
    moe_scoring: str = "softmax"  # softmax | sigmoid
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scaling: float = 1.0
    moe_score_bias: bool = False
    moe_bias_update_rate: float = 0.0
    moe_shared_experts: int = 0
    moe_seq_aux_loss: float = 0.0  # DeepSeek-V3's sequence-wise balance loss's alpha (cutp.tensor_parallel.moe_seq_aux)
    # the family's spec (defaults: GPT-2's)
    norm: str = "layernorm"  # layernorm | rmsnorm (eps: norm_eps, every norm's)
    positions: str = "learned"  # learned (a [block_size, n_embd] table) | rope
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | linear | llama3 | yarn (cutp.ops.RopeScaling, as transformers computes it)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    rope_beta_fast: float = 32.0  # yarn's (cutp.ops.RopeScaling)
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    mlp: str = "gelu"  # gelu (h -> hidden -> h) | swiglu (silu(gate) * up, then down) | geglu (gelu(gate) * up)
    head_dim: int | None = None  # None: n_embd // n_head
    qk_norm: bool = False  # an RMSNorm (eps norm_eps) over each query and key head before RoPE (Qwen3)
    # multi-head latent attention (DeepSeek-V2/V3, cutp.tensor_parallel.mla) when kv_lora_rank is set:
    # queries through q_lora_rank (None: a plain projection), keys and values through the latent,
    # heads of qk_nope_head_dim + qk_rope_head_dim (rotary on the last qk_rope_head_dim) and values of
    # v_head_dim; the softmax scale times `mla_softmax_factor()` (YaRN's mscale^2)
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # the checkpoint's layout of MLA's rope columns (q_b's and kv_a's): interleaved pairs (every
    # DeepSeek-V3 checkpoint, HF's rope_interleave) or already rotate-half; cutp computes rotate-half
    rope_interleave: bool = True
    # local attention (Mistral v0.1, Gemma): a query at p sees keys s with p - window < s <= p, as
    # transformers' `kv_idx > q_idx - sliding_window`; layer_types says which layers are local
    # ("sliding_attention") and which global ("full_attention"), as HF's; None: every layer local
    # when sliding_window is set
    sliding_window: int | None = None
    layer_types: tuple | None = None
    # soft-capping, cap * tanh(x / cap): of the attention scores (after the scale) and of the logits
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Gemma 2 and 3: RMSNorms scaling by (1 + weight) (weights stored as transformers stores them,
    # zeros-initialised), the token embedding multiplied by sqrt(n_embd) in the model's dtype, a norm
    # after the attention and after the MLP too (post_norms), the scores scaled by
    # query_pre_attn_scalar ** -0.5 (None: head_size's), and (Gemma 3) the local layers' own rope
    # theta, unscaled (rope_local_theta; None: rope_theta and rope_scaling for every layer)
    norm_offset: bool = False
    embed_scale: bool = False
    post_norms: bool = False
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    # biases per projection (None: `bias`, which also gives the LayerNorms theirs): Qwen2 has
    # qkv_bias only, Llama none, GPT-2 all
    qkv_bias: bool | None = None
    attn_out_bias: bool | None = None
    mlp_bias: bool | None = None
    # the Hugging Face family whose class computes this model (cutp.models.families: gpt2, llama,
    # qwen2, mistral, mixtral); None: the one the spec implies. Export writes its config.json.
    family: str | None = None
    # special token ids, written to config.json and generation_config.json on export (not the math)
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def with_overrides(self, items) -> "ModelConfig":
        """A copy with `KEY=VALUE` strings applied (the `--set` flag of the scripts), each value
        parsed as the field's type ('none' for None)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes = {}
        for item in items or ():
            key, sep, value = item.partition("=")
            key = _RENAMED.get(key, key)
            if not sep or key not in fields:
                raise ConfigError(f"`set` {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
            try:
                changes[key] = self._parse_override(key, value, fields)
            except ValueError:
                kind = fields[key].type
                kind = f"{kind}: true or false" if kind == "bool" else kind  # the spellings a bool takes
                raise ConfigError(f"`set` {item!r}: {value!r} is not a value of {key} ({kind})") from None
        return dataclasses.replace(self, **changes)

    def _parse_override(self, key, value, fields):
        current = getattr(self, key)
        optional = "None" in str(fields[key].type)  # (gelu=none is the string "none", exact erf)
        if value.lower() in ("none", "null") and optional:
            return None
        elif key == "moe_dense_layers":  # a comma-separated list of layers
            return tuple(int(v) for v in value.split(",") if v.strip())
        elif "tuple" in str(fields[key].type):  # comma-separated: layer_types=sliding_attention,full_attention
            return tuple(v.strip() for v in value.split(","))
        elif isinstance(current, bool) or (current is None and "bool" in str(fields[key].type)):
            if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise ValueError(value)  # a typo (bias=ture) must not read as False
            return value.lower() in ("1", "true", "yes")
        elif isinstance(current, str) or (current is None and "str" in str(fields[key].type)):
            return value  # (family=mistral: a field whose default is None takes its declared type)
        elif isinstance(current, float) or (current is None and "float" in str(fields[key].type)):
            return float(value)
        return int(value)

    @property
    def ln_eps(self) -> float:
        """norm_eps's name before every norm shared it (configs and checkpoints written with it
        are read: `from_dict`, `--set ln_eps=...`)."""
        return self.norm_eps

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def hidden(self) -> int:
        return 4 * self.n_embd if self.mlp_hidden is None else self.mlp_hidden

    @property
    def head_size(self) -> int:
        """Each attention head's width: head_dim, or n_embd // n_head."""
        return self.n_embd // self.n_head if self.head_dim is None else self.head_dim

    def has_bias(self, field: str) -> bool:
        """Whether a projection has biases: field qkv_bias, attn_out_bias or mlp_bias (unset: `bias`)."""
        v = getattr(self, field)
        return self.bias if v is None else bool(v)

    _bias = has_bias

    @property
    def rope(self) -> RopeScaling:
        return RopeScaling(self.rope_scaling, self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                           self.rope_original_max_positions, self.rope_beta_fast, self.rope_beta_slow,
                           self.rope_mscale, self.rope_mscale_all_dim)

    def blocks(self) -> Blocks:
        """Its family's choice of the blocks' submodules (cutp.models.blocks: cfg.family's, else the
        family its fields imply)."""
        return blocks_of(self)

    def block_spec(self, layer: int) -> BlockSpec:
        """What layer `layer`'s transformer block is built from: its submodules' specs
        (cutp.tensor_parallel.specs), as the family chooses them (`blocks`)."""
        return blocks_of(self).block_spec(self, layer)

    def declarations(self) -> list[ParamDecl]:
        """Every parameter of the model as its modules declare it (cutp.tensor_parallel.specs),
        named as the model names them: the counts below, and the planner's, sum these. (Kept by
        the config's fields, which alone decide them: the counts are asked for often.)"""
        key = repr(self)
        if key not in _DECLARED:
            if len(_DECLARED) >= 64:
                _DECLARED.clear()
            _DECLARED[key] = tuple(self._declare())
        return list(_DECLARED[key])

    def outer_declarations(self) -> list[ParamDecl]:
        """The parameters outside the blocks: the token (and learned position) embeddings, the final
        norm and the untied LM head."""
        h = self.n_embd
        vocab = [ParamDecl("weight", (self.vocab_size, h), "vocab", layout=(self.vocab_multiple,))]
        out = prefixed("tok_embed", vocab)
        if self.positions == "learned":
            out.append(ParamDecl("pos_embed.weight", (self.block_size, h), sp=True))
        out += prefixed("final_norm", self.blocks().norm_spec(self).parameters(h))
        return out + ([] if self.tie_embeddings else prefixed("lm_head", vocab))

    def _declare(self) -> list[ParamDecl]:
        outer = self.outer_declarations()
        out = [d for d in outer if d.name.startswith(("tok_embed.", "pos_embed."))]
        chooser = self.blocks()
        blocks = []  # [(spec, its declarations)]: layers alike declare alike (a window changes none)
        for i in range(self.n_layer):
            spec = dataclasses.replace(chooser.block_spec(self, i), attention=chooser.attention_spec(self, 0))
            same = next((decls for s, decls in blocks if s == spec), None)
            if same is None:
                same = spec.parameters()
                blocks.append((spec, same))
            out += prefixed(f"layers.{i}", same)
        return out + [d for d in outer if d.name.startswith(("final_norm.", "lm_head."))]

    def is_local_layer(self, layer: int) -> bool:
        """Whether layer `layer` is a local ("sliding_attention") one: by layer_types, else every
        layer when sliding_window is set (its rope is rope_local_theta's when that is set)."""
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        return self.sliding_window is not None

    def mla_settings(self) -> dict | None:
        """MultiLatentAttention's settings, or None for the multi-head attention."""
        if self.kv_lora_rank is None:
            return None
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return dict(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                    qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                    v_head_dim=self.v_head_dim, softmax_scale=self.mla_softmax_factor() / qk ** 0.5)

    def mla_softmax_factor(self) -> float:
        """MLA's softmax scale factor: YaRN's mscale(factor, mscale_all_dim)^2 whenever the rope is
        scaled and mscale_all_dim is set, as transformers' yarn_apply_mscale (1 otherwise)."""
        if self.rope_scaling == "none" or not self.rope_mscale_all_dim:
            return 1.0
        return yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2

    @property
    def rope_dim(self) -> int:
        """The rotary tables' width: each head's (MLA: its rope part's)."""
        return self.head_size if self.kv_lora_rank is None else self.qk_rope_head_dim

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (None: global attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def padded_vocab(self, tp: int) -> int:
        return pad_vocab(self.vocab_size, tp, self.vocab_multiple)

    def validate(self, tp: int = 1) -> None:
        """Every shape rule, before any allocation; raises ConfigError naming the fix."""
        for f in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{f} must be a positive integer, got {v!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported for training; use one of {sorted(DTYPES)}")
        for f in ("n_kv_head", "mlp_hidden"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{f} must be a positive integer or None (the default), got {v!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not (isinstance(self.vocab_multiple, int) and self.vocab_multiple >= 1):
            raise ConfigError(f"vocab_multiple must be an integer >= 1, got {self.vocab_multiple!r}")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.gelu not in ("tanh", "none"):
            raise ConfigError(f"gelu must be 'tanh' (GPT-2) or 'none' (exact erf), got {self.gelu!r}")
        for f, kinds in (("norm", NORMS), ("positions", POSITIONS), ("mlp", MLPS)):
            if getattr(self, f) not in kinds:
                raise ConfigError(f"{f} must be one of {', '.join(kinds)}, got {getattr(self, f)!r}")
        for f in ("qk_norm", "norm_offset", "embed_scale", "post_norms"):
            if getattr(self, f) not in (True, False):
                raise ConfigError(f"{f} must be true or false, got {getattr(self, f)!r}")
        if self.norm_offset and self.norm != "rmsnorm":
            raise ConfigError(f"norm_offset=True scales an RMSNorm by (1 + weight); norm is {self.norm!r}: "
                              "set norm=rmsnorm or norm_offset=False")
        if self.mlp == "geglu" and self.n_experts:
            raise ConfigError("mlp=geglu with experts: cutp's experts are GeLU or SwiGLU MLPs; set mlp=swiglu "
                              "or n_experts=0")
        for f in ("query_pre_attn_scalar", "rope_local_theta"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0):
                raise ConfigError(f"{f} must be a positive number or None, got {v!r}")
        if self.rope_local_theta is not None and self.positions != "rope":
            raise ConfigError("rope_local_theta is the local layers' rotary theta; positions is "
                              f"{self.positions!r}: set positions=rope or rope_local_theta=None")
        for f in ("qkv_bias", "attn_out_bias", "mlp_bias"):
            if getattr(self, f) not in (None, True, False):
                raise ConfigError(f"{f} must be true, false or None (follow `bias`), got {getattr(self, f)!r}")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool)
                                          or self.head_dim < 1):
            raise ConfigError(f"head_dim must be a positive integer or None (n_embd // n_head), got {self.head_dim!r}")
        if self.kv_lora_rank is not None:  # (before the rope checks: MLA's rope_dim is qk_rope_head_dim)
            self._validate_mla(tp)
        elif self.rope_interleave is not True:
            raise ConfigError(f"rope_interleave={self.rope_interleave!r} is the layout of multi-head latent "
                              "attention's rope columns in a checkpoint, and this model has none (kv_lora_rank "
                              "unset); omit rope_interleave")
        if self.positions == "rope":
            if self.rope_dim % 2:
                raise ConfigError(f"head_dim={self.rope_dim} is odd: rotary positions turn pairs of each head's "
                                  "elements; use an even head_dim (or positions=learned)")
            if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
                raise ConfigError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
            self.rope  # RopeScaling checks its own fields (ConfigError naming the field)
        self._validate_local_attention()
        if self.family is not None and self.family not in FAMILY_NAMES:
            raise ConfigError(f"family {self.family!r} is not one of cutp's families {sorted(FAMILY_NAMES)} "
                              "(or None: the one norm, positions and mlp imply)")
        for f in ("bos_token_id", "pad_token_id"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < self.vocab_size):
                raise ConfigError(f"{f} must be a token id in [0, {self.vocab_size}) or None, got {v!r}")
        if self.kv_lora_rank is None:
            check_attention(self.n_embd, self.n_head, self.kv_heads, tp, head_dim=self.head_dim)
        check_mlp(self.n_embd, self.hidden, tp)
        check_vocab(self.vocab_size, self.padded_vocab(tp), tp)
        check_moe(self.n_experts, self.moe_top_k, self.moe_every, self.moe_ffn, self.moe_capacity_factor,
                  self.moe_aux_loss_coeff, self.moe_z_loss_coeff, scoring=self.moe_scoring,
                  n_group=self.moe_n_group, topk_group=self.moe_topk_group, score_bias=self.moe_score_bias,
                  bias_update_rate=self.moe_bias_update_rate, shared=self.moe_shared_experts,
                  seq_aux=self.moe_seq_aux_loss)
        dense = self.moe_dense_layers
        if dense is not None and (not isinstance(dense, tuple)
                                  or any(not isinstance(i, int) or not 0 <= i < self.n_layer for i in dense)):
            raise ConfigError(f"moe_dense_layers must be a tuple of layer indices in [0, n_layer={self.n_layer}) "
                              f"(the layers whose MLP stays dense), or None; got {dense!r}")

    def _validate_mla(self, tp: int) -> None:
        if not isinstance(self.rope_interleave, bool):
            raise ConfigError(f"rope_interleave must be true or false, got {self.rope_interleave!r}")
        dims = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for f in dims + ("q_lora_rank",):
            v = getattr(self, f)
            if (v is not None or f != "q_lora_rank") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{f} must be a positive integer with kv_lora_rank set (multi-head latent "
                                  f"attention){' or None' if f == 'q_lora_rank' else ''}, got {v!r}")
        if self.positions != "rope":
            raise ConfigError("multi-head latent attention rotates its rope part: set positions=rope")
        if self.n_head % tp:
            raise ConfigError(f"tp={tp} must divide n_head={self.n_head} (MLA splits its heads over TP)")

    def _validate_local_attention(self) -> None:
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ConfigError(f"sliding_window must be a positive integer or None (global attention), got {w!r}")
        if self.layer_types is not None:
            kinds = ("full_attention", "sliding_attention")
            if len(self.layer_types) != self.n_layer or any(t not in kinds for t in self.layer_types):
                raise ConfigError(f"layer_types must list n_layer={self.n_layer} entries, each one of {kinds}, "
                                  f"got {self.layer_types!r}")
        for f in ("attn_softcap", "final_softcap"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0):
                raise ConfigError(f"{f} must be a positive number or None (no soft-capping), got {v!r}")

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i % self.moe_every == 0 and i not in (self.moe_dense_layers or ())

    def moe_settings(self, i: int) -> dict | None:
        """Layer i's MoEMLP settings, or None for a dense MLP."""
        if not self.is_moe_layer(i):
            return None
        return dict(n_experts=self.n_experts, top_k=self.moe_top_k, ffn=self.moe_ffn or self.hidden,
                    capacity_factor=self.moe_capacity_factor, aux_loss_coeff=self.moe_aux_loss_coeff,
                    z_loss_coeff=self.moe_z_loss_coeff, renormalize=self.moe_renormalize, scoring=self.moe_scoring,
                    n_group=self.moe_n_group, topk_group=self.moe_topk_group, routed_scaling=self.moe_routed_scaling,
                    score_bias=self.moe_score_bias, bias_update_rate=self.moe_bias_update_rate,
                    shared_experts=self.moe_shared_experts, seq_aux_coeff=self.moe_seq_aux_loss)


    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = {_RENAMED.get(k, k): v for k, v in d.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields {sorted(unknown)}; the fields are {sorted(known)} "
                              "(a checkpoint or config written by another cutp version?)")
        for f in ("layer_types", "moe_dense_layers"):
            if d.get(f) is not None:  # (JSON gives a list)
                d[f] = tuple(d[f])
        return cls(**d)

    def num_parameters(self) -> int:
        """Parameters of the full model (unpadded vocabulary, tied head counted once): the sum of
        its declarations (DeepSeek's correction bias is not counted: no gradient trains it, a
        buffer in transformers)."""
        return count(self.declarations())

    def num_stored_values(self) -> int:
        """Every value the model holds (a checkpoint's tensors): its parameters and DeepSeek's
        correction biases, which `num_parameters` leaves out as transformers does (buffers there)."""
        return sum(d.numel for d in self.declarations())

    def kv_cache_values_per_token(self) -> int:
        """Values generation's KV cache holds per token, all layers: K and V of every KV head, or
        (MLA) the compressed latent and the shared rope key."""
        per_layer = (2 * self.kv_heads * self.head_size if self.kv_lora_rank is None
                     else self.kv_lora_rank + self.qk_rope_head_dim)
        return self.n_layer * per_layer

    def num_active_parameters(self) -> int:
        """Parameters a token runs through: top_k of each MoE layer's experts (all of a dense model)."""
        decls = self.declarations()
        idle = sum(d.numel // d.count * (d.count - self.moe_top_k) for d in decls if d.split == "expert")
        return count(decls) - idle

    def __str__(self):
        return json.dumps(self.to_dict())


_RENAMED = {"ln_eps": "norm_eps"}  # fields' earlier names, read as today's
_DECLARED: dict = {}  # repr(config) -> its declarations (`ModelConfig.declarations`)

GPTConfig = ModelConfig  # its first name, from when GPT-2 was the only family
