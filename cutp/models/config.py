"""The GPT model's configuration: its fields, presets, validation and parameter count.

`GPTConfig` is the one config object every layer of the model is built from (cutp.models.gpt);
`PRESETS` are the named shapes of `--preset`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..runtime.errors import ConfigError
from ..tensor_parallel import check_moe, pad_vocab
from ..tensor_parallel.validation import check_attention, check_mlp, check_vocab

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
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}


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
            elif isinstance(current, bool):
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
        check_attention(self.n_embd, self.n_head, self.kv_heads, tp)
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

    def num_parameters(self) -> int:
        """Parameters of the full model (unpadded vocabulary, tied head counted once)."""
        h, L, V = self.n_embd, self.n_layer, self.vocab_size
        hd = h // self.n_head
        qkv = (self.n_head + 2 * self.kv_heads) * hd
        b = 1 if self.bias else 0
        per_layer = (2 * h * (1 + b)  # two LayerNorms
                     + h * qkv + b * qkv + h * h + b * h)  # attention
        mlp = 2 * h * self.hidden + b * (self.hidden + h)
        ffn = self.moe_ffn or self.hidden
        moe = h * self.n_experts + self.n_experts * (2 * h * ffn + b * (ffn + h))  # router + experts
        n_moe = sum(self.is_moe_layer(i) for i in range(L))
        head = 0 if self.tie_embeddings else V * h
        return V * h + self.block_size * h + L * per_layer + (L - n_moe) * mlp + n_moe * moe + h * (1 + b) + head

    def num_active_parameters(self) -> int:
        """Parameters a token runs through: top_k of each MoE layer's experts (all of a dense model)."""
        h, b, ffn = self.n_embd, 1 if self.bias else 0, self.moe_ffn or self.hidden
        idle = (self.n_experts - self.moe_top_k) * (2 * h * ffn + b * (ffn + h))
        return self.num_parameters() - sum(self.is_moe_layer(i) for i in range(self.n_layer)) * idle

    def __str__(self):
        return json.dumps(self.to_dict())
