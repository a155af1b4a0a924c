"""The MLP and the pre-norm transformer block, built from a `BlockSpec`.

ParallelMLP: replicated [B, T, h] -> column (h -> 4h, sharded) -> bias + GeLU (fused) -> row
(4h -> h, all-reduce) -> replicated [B, T, h]. With mlp="swiglu" (Llama): one column projection
h -> 2F whose shard is this rank's [gate_r ; up_r] (`sharding.gate_up_sharding`), silu(gate) *
up on the local tensor (`ops.swiglu_forward`), then the row projection F -> h ("down").

ParallelTransformerBlock: x + dropout(attn(norm_1(x))), then x + dropout(mlp(norm_2(x))), the
norms LayerNorm (GPT-2) or RMSNorm (Llama), the attention with rotary positions or without
(learned positions are the model's, added before the first block), by the spec.
Communication per block: 2 all-reduces of B*T*h forward (the two row projections) and 2
backward (dx of the two column projections).

Activation recomputation (`ParallelTransformerBlock.recompute`, set by `GPT.set_recompute`):
"full" keeps only the block's input; its first forward stashes nothing (`not_stashed`), and
backward reruns the forward from the input, with the dropout streams put back where they were,
so the masks, the activations and the gradients are those of the first pass bit for bit.
"selective" is the attention's (`ParallelAttention.recompute_core`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import ops
from .attention import ParallelAttention
from .layers import ColumnParallelLinear, Dropout, RowParallelLinear, make_norm
from .mla import MultiLatentAttention
from .moe import MoEMLP
from .parameter import Module, normal_init, not_stashed
from .random import REPLICATED, RNGTracker
from .sharding import gate_up_sharding
from .validation import check_mlp


@dataclass(frozen=True)
class BlockSpec:
    """Everything a transformer block is built from (`GPTConfig.block_spec(layer)` makes it).
    Defaults: a GPT-2 block."""

    n_embd: int
    n_head: int
    n_kv_head: int | None = None  # None: n_head
    head_dim: int | None = None  # None: n_embd // n_head
    mlp_hidden: int | None = None  # None: 4 * n_embd
    n_layer: int = 1  # the model's depth (the residual projections' initial scale)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm's bias
    rope: bool = False  # rotary positions inside the attention
    qk_norm: bool = False  # an RMSNorm over each query and key head (Qwen3, Gemma 3)
    qkv_bias: bool = True
    attn_out_bias: bool = True
    mlp_bias: bool = True
    mlp: str = "gelu"  # gelu | swiglu
    gelu: str = "tanh"
    dropout: float = 0.0
    moe: dict | None = None  # MoEMLP's settings (n_experts, top_k, ffn, ...): a mixture-of-experts MLP
    window: int | None = None  # local attention: keys within `window` positions of the query (None: global)
    attn_softcap: float | None = None  # the attention scores soft-capped, cap * tanh(s / cap)
    mla: dict | None = None  # MultiLatentAttention's settings: multi-head latent attention (DeepSeek)


class ParallelMLP(Module):
    def __init__(self, ctx, n_embd, hidden, *, name, n_layer=1, bias=True, gelu="tanh", seed=0, dtype=np.float32,
                 kind="gelu"):
        """kind: "gelu" (GPT-2) or "swiglu" (Llama: hidden is the gate's and the up's width)."""
        check_mlp(n_embd, hidden, ctx.tp_size)
        self.ctx = ctx
        self.gelu = gelu
        self.kind = kind
        self.has_bias = bias
        if kind == "swiglu":
            self.fc1 = ColumnParallelLinear(ctx, n_embd, 2 * hidden, name=f"{name}.fc1", bias=bias, seed=seed,
                                             dtype=dtype,
                                             sharding=gate_up_sharding((n_embd, 2 * hidden), 1, ctx.tp_size))
        else:
            self.fc1 = ColumnParallelLinear(ctx, n_embd, hidden, name=f"{name}.fc1", bias=bias, skip_bias_add=True,
                                             seed=seed, dtype=dtype)
        self.fc2 = RowParallelLinear(ctx, hidden, n_embd, name=f"{name}.fc2", bias=bias, seed=seed, dtype=dtype,
                                        init=normal_init(0.02 / math.sqrt(2 * n_layer)))

    def forward(self, x):
        if self.kind == "swiglu":
            a, sctx = ops.swiglu_forward(self.fc1.forward(x))  # [gate_r ; up_r] -> silu(gate_r) * up_r
            self._save("swiglu", sctx)
            return self.fc2.forward(a)
        h, b = self.fc1.forward(x)
        if b is not None:
            a, gctx = ops.bias_gelu_forward(h, b, approximate=self.gelu)
        else:
            a, gctx = ops.gelu_forward(h, approximate=self.gelu)
        self._save("gelu", gctx)
        return self.fc2.forward(a)

    def backward(self, dy):
        da = self.fc2.backward(dy)
        if self.kind == "swiglu":
            return self.fc1.backward(ops.swiglu_backward(da, self._load("swiglu")))
        if self.has_bias:
            dh, db = ops.bias_gelu_backward(da, self._load("gelu"))
            self.fc1.accumulate_bias_grad(db)
        else:
            dh = ops.gelu_backward(da, self._load("gelu"))
        return self.fc1.backward(dh)


class ParallelTransformerBlock(Module):
    """Pre-norm block. Input and output: replicated [B, T, n_embd]."""

    def __init__(self, ctx, spec: BlockSpec, *, layer: int = 0, name=None, rng: RNGTracker, seed=0, dtype=np.float32,
                 rotary=None):
        """spec: a BlockSpec; name: the parameters' prefix (default layers.{layer}); rotary: the
        model's (cos, sin) tables when spec.rope."""
        s = spec
        name = f"layers.{layer}" if name is None else name
        self.spec = s
        hidden = s.mlp_hidden or 4 * s.n_embd
        if s.rope and rotary is None:
            raise ValueError("a rotary block needs the model's rotary tables (rotary=(cos, sin))")
        self.attn_norm = make_norm(ctx, s.norm, s.n_embd, name=f"{name}.attn_norm", eps=s.norm_eps, bias=s.norm_bias, seed=seed,
                              dtype=dtype)
        if s.mla:  # DeepSeek's multi-head latent attention
            self.attn = MultiLatentAttention(ctx, s.n_embd, s.n_head, name=f"{name}.attn", rotary=rotary, **s.mla,
                                             norm_eps=s.norm_eps, n_layer=s.n_layer, seed=seed, dtype=dtype)
        else:
            self.attn = ParallelAttention(ctx, s.n_embd, s.n_head, s.n_kv_head, name=f"{name}.attn", rng=rng,
                                          n_layer=s.n_layer, attn_dropout=s.dropout, seed=seed, dtype=dtype,
                                          head_dim=s.head_dim, qkv_bias=s.qkv_bias, out_bias=s.attn_out_bias,
                                          rotary=rotary if s.rope else None, qk_norm=s.qk_norm, norm_eps=s.norm_eps)
        self.attn_dropout = Dropout(s.dropout, rng, REPLICATED, site=f"{name}.attn_resid_dropout")
        self.mlp_norm = make_norm(ctx, s.norm, s.n_embd, name=f"{name}.mlp_norm", eps=s.norm_eps, bias=s.norm_bias, seed=seed,
                              dtype=dtype)
        if s.moe:
            shared = s.moe.get("shared_experts", 0)  # DeepSeekMoE: a dense MLP of their total width
            shared = ParallelMLP(ctx, s.n_embd, shared * s.moe["ffn"], name=f"{name}.mlp.shared_experts",
                                 n_layer=s.n_layer, bias=s.mlp_bias, gelu=s.gelu, seed=seed, dtype=dtype,
                                 kind=s.mlp) if shared else None
            self.mlp = MoEMLP(ctx, s.n_embd, **{**s.moe, "shared_experts": shared}, name=f"{name}.mlp",
                              n_layer=s.n_layer, bias=s.mlp_bias, gelu=s.gelu, seed=seed, dtype=dtype, kind=s.mlp)
        else:
            self.mlp = ParallelMLP(ctx, s.n_embd, hidden, name=f"{name}.mlp", n_layer=s.n_layer, bias=s.mlp_bias,
                                   gelu=s.gelu, seed=seed, dtype=dtype, kind=s.mlp)
        self.mlp_dropout = Dropout(s.dropout, rng, REPLICATED, site=f"{name}.mlp_dropout")
        self.rng = rng
        self.recompute = False  # full recomputation: keep only the input (module docstring)

    def _forward(self, x, positions=None):
        branch = self.attn_dropout.forward(self.attn.forward(self.attn_norm.forward(x), positions))
        x, h = self.mlp_norm.forward_residual(x, branch)  # (RMSNorm: the add and the norm, one kernel)
        return x + self.mlp_dropout.forward(self.mlp.forward(h))

    def forward(self, x, positions=None):
        """positions: the tokens' global position ids for rotary attention (None: arange(T))."""
        if not (self.recompute and self.training):
            return self._forward(x, positions)
        # the input, its positions, and where the dropout draws stood
        self._save("input", (x, positions, dict(self.rng.offsets), self.rng.position))
        with not_stashed(self):
            return self._forward(x, positions)

    def backward(self, dy):
        if self.recompute:
            x, positions, offsets, position = self._load("input")
            after = self.rng.offsets, self.rng.position
            self.rng.offsets, self.rng.position = dict(offsets), position
            try:
                self._forward(x, positions)  # the first pass again, this time stashed
            finally:
                self.rng.offsets, self.rng.position = after
        # dy flows into both the residual and the MLP branch
        dx = dy + self.mlp_norm.backward(self.mlp.backward(self.mlp_dropout.backward(dy)))
        return dx + self.attn_norm.backward(self.attn.backward(self.attn_dropout.backward(dx)))

    def forward_cached(self, x, cache):
        """Eval-mode incremental forward for generation (see ParallelAttention.forward_cached)."""
        x = x + self.attn.forward_cached(self.attn_norm.forward(x), cache)
        return x + self.mlp.forward(self.mlp_norm.forward(x))
