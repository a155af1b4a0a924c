"""The MLP and the pre-norm transformer block, built from a `BlockSpec`.

ParallelMLP: replicated [B, T, h] -> column (h -> 4h, sharded) -> bias + GeLU (fused) -> row
(4h -> h, all-reduce) -> replicated [B, T, h]. With mlp="swiglu" (Llama): one column projection
h -> 2F whose shard is this rank's [gate_r ; up_r] (`sharding.gate_up_sharding`), silu(gate) *
up on the local tensor (`ops.swiglu_forward`), then the row projection F -> h ("down").
mlp="geglu" (Gemma): the same layout with gelu(gate) * up (`ops.geglu_forward`, tanh GeLU).

ParallelTransformerBlock: x + dropout(attn(norm_1(x))), then x + dropout(mlp(norm_2(x))), the
norms LayerNorm (GPT-2) or RMSNorm (Llama), the attention with rotary positions or without
(learned positions are the model's, added before the first block), by the spec. With
`post_norms` (Gemma 2 and 3) each branch's output is normalised too before the residual add:
x + dropout(post_attn_norm(attn(attn_norm(x)))), then x + dropout(post_mlp_norm(mlp(mlp_norm(x)))).
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
    mlp: str = "gelu"  # gelu | swiglu | geglu
    gelu: str = "tanh"
    dropout: float = 0.0
    moe: dict | None = None  # MoEMLP's settings (n_experts, top_k, ffn, ...): a mixture-of-experts MLP
    window: int | None = None  # local attention: keys within `window` positions of the query (None: global)
    attn_softcap: float | None = None  # the attention scores soft-capped, cap * tanh(s / cap)
    norm_offset: bool = False  # RMSNorms scale by (1 + weight), weights zeros-initialised (Gemma)
    post_norms: bool = False  # a norm after the attention and after the MLP too (Gemma 2 and 3)
    attn_scale: float | None = None  # the attention scores' scale (None: 1 / sqrt(head_dim))
    mla: dict | None = None  # MultiLatentAttention's settings: multi-head latent attention (DeepSeek)


class ParallelMLP(Module):
    def __init__(self, ctx, n_embd, hidden, *, name, n_layer=1, bias=True, gelu="tanh", seed=0, dtype=np.float32,
                 kind="gelu"):
        """kind: "gelu" (GPT-2), "swiglu" (Llama: hidden is the gate's and the up's width) or "geglu"
        (Gemma: swiglu's layout, gelu(gate) * up with `gelu`'s approximation)."""
        check_mlp(n_embd, hidden, ctx.tp_size)
        self.ctx = ctx
        self.gelu = gelu
        self.kind = kind
        self.has_bias = bias
        if kind in ("swiglu", "geglu"):
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
        if self.kind == "geglu":
            a, gctx = ops.geglu_forward(self.fc1.forward(x), self.gelu)  # gelu(gate_r) * up_r
            self._save("geglu", gctx)
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
        if self.kind == "geglu":
            return self.fc1.backward(ops.geglu_backward(da, self._load("geglu")))
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
        def norm(what):
            return make_norm(ctx, s.norm, s.n_embd, name=f"{name}.{what}", eps=s.norm_eps, bias=s.norm_bias, seed=seed,
                             dtype=dtype, offset=s.norm_offset)

        self.attn_norm = norm("attn_norm")
        if s.mla:  # DeepSeek's multi-head latent attention
            self.attn = MultiLatentAttention(ctx, s.n_embd, s.n_head, name=f"{name}.attn", rotary=rotary, **s.mla,
                                             norm_eps=s.norm_eps, n_layer=s.n_layer, seed=seed, dtype=dtype, rng=rng,
                                             attn_dropout=s.dropout)
        else:
            self.attn = ParallelAttention(ctx, s.n_embd, s.n_head, s.n_kv_head, name=f"{name}.attn", rng=rng,
                                          n_layer=s.n_layer, attn_dropout=s.dropout, seed=seed, dtype=dtype,
                                          head_dim=s.head_dim, qkv_bias=s.qkv_bias, out_bias=s.attn_out_bias,
                                          rotary=rotary if s.rope else None, qk_norm=s.qk_norm, norm_eps=s.norm_eps,
                                          window=s.window, softcap=s.attn_softcap, scale=s.attn_scale,
                                          norm_offset=s.norm_offset)
        self.post_attn_norm = norm("post_attn_norm") if s.post_norms else None
        self.attn_dropout = Dropout(s.dropout, rng, REPLICATED, site=f"{name}.attn_resid_dropout")
        self.mlp_norm = norm("mlp_norm")
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
        self.post_mlp_norm = norm("post_mlp_norm") if s.post_norms else None
        self.mlp_dropout = Dropout(s.dropout, rng, REPLICATED, site=f"{name}.mlp_dropout")
        self.rng = rng
        self.recompute = False  # full recomputation: keep only the input (module docstring)

    @staticmethod
    def _post(norm, y, backward=False):
        """A branch's post-norm (Gemma's post_norms) forward or backward; y itself without one."""
        if norm is None:
            return y
        return norm.backward(y) if backward else norm.forward(y)

    def _forward(self, x, positions=None, documents=None):
        attn = self.attn.forward(self.attn_norm.forward(x), positions, documents)
        branch = self.attn_dropout.forward(self._post(self.post_attn_norm, attn))
        x, h = self.mlp_norm.forward_residual(x, branch)  # (RMSNorm: the add and the norm, one kernel)
        return x + self.mlp_dropout.forward(self._post(self.post_mlp_norm, self.mlp.forward(h)))

    def forward(self, x, positions=None, documents=None):
        """positions: the tokens' global position ids for rotary attention (None: arange(T));
        documents: the whole sequences' document ids [B, T] (None: one a row; packed sequences)."""
        if not (self.recompute and self.training):
            return self._forward(x, positions, documents)
        # the input, its positions and documents, and where the dropout draws stood
        self._save("input", (x, positions, documents, dict(self.rng.offsets), self.rng.position))
        with not_stashed(self):
            return self._forward(x, positions, documents)

    def backward(self, dy):
        if self.recompute:
            x, positions, documents, offsets, position = self._load("input")
            after = self.rng.offsets, self.rng.position
            self.rng.offsets, self.rng.position = dict(offsets), position
            try:
                self._forward(x, positions, documents)  # the first pass again, this time stashed
            finally:
                self.rng.offsets, self.rng.position = after
        # dy flows into both the residual and the MLP branch
        dm = self._post(self.post_mlp_norm, self.mlp_dropout.backward(dy), backward=True)
        dx = dy + self.mlp_norm.backward(self.mlp.backward(dm))
        da = self._post(self.post_attn_norm, self.attn_dropout.backward(dx), backward=True)
        return dx + self.attn_norm.backward(self.attn.backward(da))

    def forward_cached(self, x, cache):
        """Eval-mode incremental forward for generation (see ParallelAttention.forward_cached)."""
        x = x + self._post(self.post_attn_norm, self.attn.forward_cached(self.attn_norm.forward(x), cache))
        return x + self._post(self.post_mlp_norm, self.mlp.forward(self.mlp_norm.forward(x)))
