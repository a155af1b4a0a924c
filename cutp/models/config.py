"""The model's configuration: its fields, presets, validation and parameter count.

`GPTConfig` (alias `ModelConfig`) is the one config object the model is built from
(cutp.models.gpt): a small spec of the transformer, whose defaults are GPT-2's (LayerNorm,
learned positions, GeLU MLP, biases everywhere, tied embeddings) and whose other values give
the Llama family (RMSNorm, rotary positions, SwiGLU, no biases, untied), Qwen2 (the same with
q/k/v biases), Mistral, and Mixtral (SwiGLU experts, softmax top-2 renormalised).
`block_spec()` is the part each transformer block is built from (cutp.tensor_parallel's
`BlockSpec`). `PRESETS` are the named shapes of `--preset`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..runtime.errors import ConfigError
from ..ops.rotary import RopeScaling
from ..tensor_parallel import BlockSpec, check_moe, pad_vocab
from ..tensor_parallel.validation import check_attention, check_mlp, check_vocab

# the Llama family's spec (Llama 2/3, TinyLlama, Mistral): RMSNorm, RoPE, SwiGLU, no biases, untied
_LLAMA = dict(norm="rmsnorm", positions="rope", mlp="swiglu", bias=False, tie_embeddings=False, ln_eps=1e-5)
_LLAMA3_SCALING = dict(rope_scaling="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
                       rope_high_freq_factor=4.0, rope_original_max_positions=8192)

# Parameters and activations are stored in the model's dtype. bfloat16/float16 models compute
# matmuls, LayerNorm statistics, softmax and the loss in float32 (cutp.ops' dtype policy) and are
# trained through fp32 master weights and fp32 gradient buffers (cutp.optim).
DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

PRESETS = {
    # trains on a 2-core CPU in minutes (byte-level vocabulary)
    "tiny": dict(n_layer=4, n_head=8, n_embd=128, vocab_size=256, block_size=128, vocab_multiple=1),
    # tiny with 8 experts of width 256 in every layer, 2 per token: tiny's active parameters
    "tiny-moe": dict(n_layer=4, n_head=8, n_embd=128, vocab_size=256, block_size=128, vocab_multiple=1,
                     n_experts=8, moe_top_k=2, moe_ffn=256),
    # the Llama family's tiny: GQA (8 query heads, 2 KV heads), untied, SwiGLU 392 wide: within
    # tiny's parameter budget (832,640 against tiny's 842,496, the untied head included)
    "llama-tiny": dict(n_layer=4, n_head=8, n_kv_head=2, n_embd=128, mlp_hidden=392, vocab_size=256, block_size=128,
                       vocab_multiple=1, **_LLAMA),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "llama-gpt2": dict(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, mlp_hidden=2048, **_LLAMA),  # gpt2's size, Llama's spec
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    # Hugging Face models' shapes (config.json of each; the planner and --init-from checks)
    "llama3.2-1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, mlp_hidden=8192, vocab_size=128256,
                        block_size=131072, rope_theta=500000.0, **{**_LLAMA, "tie_embeddings": True},
                        **_LLAMA3_SCALING),
    "llama3-8b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=128256,
                      block_size=8192, rope_theta=500000.0, **_LLAMA),
    "llama3-70b": dict(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, mlp_hidden=28672, vocab_size=128256,
                       block_size=8192, rope_theta=500000.0, **_LLAMA),
    "qwen2-0.5b": dict(n_layer=24, n_head=14, n_kv_head=2, n_embd=896, mlp_hidden=4864, vocab_size=151936,
                       block_size=32768, rope_theta=1000000.0, **{**_LLAMA, "tie_embeddings": True, "ln_eps": 1e-6},
                       qkv_bias=True),
    "tinyllama-1.1b": dict(n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, mlp_hidden=5632, vocab_size=32000,
                           block_size=2048, **_LLAMA),
    # Mistral 7B v0.3 (no sliding window, vocabulary 32768, rope_theta 1e6)
    "mistral-7b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=32768,
                       block_size=32768, rope_theta=1000000.0, **_LLAMA),
    "mixtral-8x7b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=32000,
                         block_size=32768, rope_theta=1000000.0, n_experts=8, moe_top_k=2, moe_renormalize=True,
                         moe_aux_loss_coeff=0.02, **_LLAMA),
}

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu")


@dataclass
class GPTConfig:
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
    ln_eps: float = 1e-5
    gelu: str = "tanh"
    vocab_multiple: int = 128  # vocabulary padded to a multiple of this times tp
    label_smoothing: float = 0.0
    # mixture of experts (cutp.tensor_parallel.moe): 0 experts = dense MLPs
    n_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1  # an MoE MLP in layers 0, k, 2k, ...
    moe_ffn: int | None = None  # each expert's width (None: the MLP's, mlp_hidden)
    moe_capacity_factor: float | None = None  # None: dropless
    moe_aux_loss_coeff: float = 1e-2  # load balancing (Switch/GShard)
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE uses 1e-3)
    moe_renormalize: bool = False  # the k gates renormalised to sum to 1
    # the family's spec (defaults: GPT-2's)
    norm: str = "layernorm"  # layernorm | rmsnorm (eps: ln_eps)
    positions: str = "learned"  # learned (a [block_size, n_embd] table) | rope
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | linear | llama3 (cutp.ops.RopeScaling, as transformers computes it)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    mlp: str = "gelu"  # gelu (h -> hidden -> h) | swiglu (silu(gate) * up, then down)
    head_dim: int | None = None  # None: n_embd // n_head
    # biases per projection (None: `bias`, which also gives the LayerNorms theirs): Qwen2 has
    # qkv_bias only, Llama none, GPT-2 all
    qkv_bias: bool | None = None
    attn_out_bias: bool | None = None
    mlp_bias: bool | None = None

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def with_overrides(self, items) -> "GPTConfig":
        """A copy with `KEY=VALUE` strings applied (the `--set` flag of the scripts), each value
        parsed as the field's type ('none' for None)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes = {}
        for item in items or ():
            key, sep, value = item.partition("=")
            if not sep or key not in fields:
                raise ConfigError(f"`set` {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
            current = getattr(self, key)
            optional = "None" in str(fields[key].type)  # (gelu=none is the string "none", exact erf)
            if value.lower() in ("none", "null") and optional:
                changes[key] = None
            elif isinstance(current, bool) or (current is None and "bool" in str(fields[key].type)):
                changes[key] = value.lower() in ("1", "true", "yes")
            elif isinstance(current, float) or (current is None and "float" in str(fields[key].type)):
                changes[key] = float(value)
            elif isinstance(current, int) or current is None:
                changes[key] = int(value)
            else:
                changes[key] = value
        return dataclasses.replace(self, **changes)

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

    def _bias(self, field: str) -> bool:
        v = getattr(self, field)
        return self.bias if v is None else bool(v)

    @property
    def rope(self) -> RopeScaling:
        return RopeScaling(self.rope_scaling, self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                           self.rope_original_max_positions)

    def block_spec(self, layer: int) -> BlockSpec:
        """What layer `layer`'s transformer block is built from."""
        return BlockSpec(n_embd=self.n_embd, n_head=self.n_head, n_kv_head=self.kv_heads, head_dim=self.head_size,
                         mlp_hidden=self.hidden, n_layer=self.n_layer, norm=self.norm, norm_eps=self.ln_eps,
                         norm_bias=self.bias, rope=self.positions == "rope", qkv_bias=self._bias("qkv_bias"),
                         attn_out_bias=self._bias("attn_out_bias"), mlp_bias=self._bias("mlp_bias"), mlp=self.mlp,
                         gelu=self.gelu, dropout=self.dropout, moe=self.moe_settings(layer))

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
        if not self.ln_eps > 0:
            raise ConfigError(f"ln_eps must be > 0, got {self.ln_eps}")
        if self.gelu not in ("tanh", "none"):
            raise ConfigError(f"gelu must be 'tanh' (GPT-2) or 'none' (exact erf), got {self.gelu!r}")
        for f, kinds in (("norm", NORMS), ("positions", POSITIONS), ("mlp", MLPS)):
            if getattr(self, f) not in kinds:
                raise ConfigError(f"{f} must be one of {', '.join(kinds)}, got {getattr(self, f)!r}")
        for f in ("qkv_bias", "attn_out_bias", "mlp_bias"):
            if getattr(self, f) not in (None, True, False):
                raise ConfigError(f"{f} must be true, false or None (follow `bias`), got {getattr(self, f)!r}")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool)
                                          or self.head_dim < 1):
            raise ConfigError(f"head_dim must be a positive integer or None (n_embd // n_head), got {self.head_dim!r}")
        if self.positions == "rope":
            if self.head_size % 2:
                raise ConfigError(f"head_dim={self.head_size} is odd: rotary positions turn pairs of each head's "
                                  "elements; use an even head_dim (or positions=learned)")
            if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
                raise ConfigError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
            self.rope  # RopeScaling checks its own fields (ConfigError naming the field)
        check_attention(self.n_embd, self.n_head, self.kv_heads, tp, head_dim=self.head_dim)
        check_mlp(self.n_embd, self.hidden, tp)
        check_vocab(self.vocab_size, self.padded_vocab(tp), tp)
        check_moe(self.n_experts, self.moe_top_k, self.moe_every, self.moe_ffn, self.moe_capacity_factor,
                  self.moe_aux_loss_coeff, self.moe_z_loss_coeff)

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i % self.moe_every == 0

    def moe_settings(self, i: int) -> dict | None:
        """Layer i's MoEMLP settings, or None for a dense MLP."""
        if not self.is_moe_layer(i):
            return None
        return dict(n_experts=self.n_experts, top_k=self.moe_top_k, ffn=self.moe_ffn or self.hidden,
                    capacity_factor=self.moe_capacity_factor, aux_loss_coeff=self.moe_aux_loss_coeff,
                    z_loss_coeff=self.moe_z_loss_coeff, renormalize=self.moe_renormalize)


    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown GPTConfig fields {sorted(unknown)}; the fields are {sorted(known)} "
                              "(a checkpoint or config written by another cutp version?)")
        return cls(**d)

    def _mlp_parameters(self, width: int) -> int:
        """One MLP (or expert) of `width`: GeLU's two matrices or SwiGLU's three, and their biases."""
        h, b = self.n_embd, 1 if self._bias("mlp_bias") else 0
        if self.mlp == "swiglu":
            return 3 * h * width + b * (2 * width + h)
        return 2 * h * width + b * (width + h)

    def num_parameters(self) -> int:
        """Parameters of the full model (unpadded vocabulary, tied head counted once)."""
        h, L, V = self.n_embd, self.n_layer, self.vocab_size
        q, kv = self.n_head * self.head_size, self.kv_heads * self.head_size
        norm = h * (2 if self.norm == "layernorm" and self.bias else 1)  # weight (+ LayerNorm's bias)
        attention = h * (q + 2 * kv) + q * h + self._bias("qkv_bias") * (q + 2 * kv) + self._bias("attn_out_bias") * h
        per_layer = 2 * norm + attention
        # an MoE layer's router and experts
        moe = h * self.n_experts + self.n_experts * self._mlp_parameters(self.moe_ffn or self.hidden)
        n_moe = sum(self.is_moe_layer(i) for i in range(L))
        head = 0 if self.tie_embeddings else V * h
        positions = self.block_size * h if self.positions == "learned" else 0
        return (V * h + positions + L * per_layer + (L - n_moe) * self._mlp_parameters(self.hidden) + n_moe * moe
                + norm + head)

    def num_active_parameters(self) -> int:
        """Parameters a token runs through: top_k of each MoE layer's experts (all of a dense model)."""
        idle = (self.n_experts - self.moe_top_k) * self._mlp_parameters(self.moe_ffn or self.hidden)
        return self.num_parameters() - sum(self.is_moe_layer(i) for i in range(self.n_layer)) * idle

    def __str__(self):
        return json.dumps(self.to_dict())


ModelConfig = GPTConfig  # the neutral name: the config of every family
