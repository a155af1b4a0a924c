"""The submodules a transformer block is built from, each declared as data: which kind, its
settings, its parameters. A family picks one of each (`ModelConfig.block_spec` from the family's
fields) and `BlockSpec` (cutp.tensor_parallel.transformer) holds them; the block builds each
with its `build` and never branches on a kind.

    NormSpec       LayerNorm (with or without a bias) or RMSNorm (scale w, or 1 + w: Gemma)
    AttentionSpec  multi-head / grouped-query attention: biases, rotary or not, QK-norm, window,
                   soft-cap, scale (cutp.tensor_parallel.attention)
    MLASpec        DeepSeek's multi-head latent attention (cutp.tensor_parallel.mla)
    MLPSpec        GeLU, SwiGLU or GeGLU MLP (cutp.tensor_parallel.mlp)
    MoESpec        a router and routed experts (each an MLPSpec), DeepSeekMoE's shared experts and
                   routing settings (cutp.tensor_parallel.moe)

`parameters()` declares each submodule's parameters (`ParamDecl`): the name under the module,
the full shape, how TP splits it ("replicated", "column", "row", "qkv", "gate_up", "vocab";
"expert": a routed expert's, replicated over TP and divided over EP), whether it is summed over
TP under sequence parallelism (`sp`) or always (`tp_partial`), how many copies (`count`: the
experts), and whether it trains (`grad`: DeepSeek's correction bias does not). The model's
parameter count (`ModelConfig.num_parameters`), the planner's per-rank count and its TP gradient
all-reduce sum these declarations without building an array; tests/models/test_declarations.py
keeps them equal to what the built modules allocate, at every TP and EP size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .attention import ParallelAttention
from .layers import make_norm, pad_vocab
from .mla import MultiLatentAttention
from .mlp import ParallelMLP
from .moe import MoEMLP
from .sharding import kv_heads_of_rank

SPLITS = ("replicated", "column", "row", "qkv", "gate_up", "vocab", "expert")


@dataclass(frozen=True)
class ParamDecl:
    """One parameter as its module declares it (module docstring)."""

    name: str
    shape: tuple  # the full tensor's (vocabulary: unpadded)
    split: str = "replicated"  # one of SPLITS
    sp: bool = False  # replicated and used on sequence shards: summed over TP with sequence parallelism
    tp_partial: bool = False  # replicated, each TP rank's own tokens through it: always summed over TP
    count: int = 1  # copies of it (a layer's experts: one per expert)
    grad: bool = True  # trained (False: a buffer-like value no gradient reaches, not counted as a parameter)
    layout: tuple | None = None  # how to split it: "qkv" (n_head, n_kv_head, head_dim), "vocab" (vocab_multiple,)

    def prefixed(self, prefix: str) -> "ParamDecl":
        # (the constructor, not dataclasses.replace: a large model's declarations are made in milliseconds)
        return ParamDecl(f"{prefix}.{self.name}", self.shape, self.split, self.sp, self.tp_partial, self.count,
                         self.grad, self.layout)

    @property
    def numel(self) -> int:
        """Elements of the full tensors (all copies)."""
        return math.prod(self.shape) * self.count

    def local_numel(self, tp: int = 1, ep: int = 1) -> int:
        """Elements one TP (and EP) rank holds: its shard, or (vocab) its rows of the padded table."""
        n = math.prod(self.shape)
        if self.split in ("column", "row", "gate_up"):
            return n // tp * self.count
        if self.split == "qkv":
            n_head, n_kv_head, hd = self.layout
            cols = (n_head // tp + 2 * len(kv_heads_of_rank(n_head, n_kv_head, tp, 0))) * hd
            return n // self.shape[-1] * cols * self.count
        if self.split == "vocab":
            rows = pad_vocab(self.shape[0], tp, self.layout[0]) // tp
            return rows * (n // self.shape[0]) * self.count
        if self.split == "expert":
            return n * (self.count // ep)
        return n * self.count


def prefixed(prefix: str, decls) -> list:
    return [d.prefixed(prefix) for d in decls]


@dataclass(frozen=True)
class NormSpec:
    """LayerNorm (weight, and a bias when `bias`) or RMSNorm (weight; the scale 1 + weight with
    `offset`, Gemma's). Replicated; summed over TP under sequence parallelism."""

    kind: str = "layernorm"  # layernorm | rmsnorm
    eps: float = 1e-5
    bias: bool = True  # LayerNorm's
    offset: bool = False  # RMSNorm's (1 + weight)

    def parameters(self, dim: int) -> list:
        out = [ParamDecl("weight", (dim,), sp=True)]
        if self.kind == "layernorm" and self.bias:
            out.append(ParamDecl("bias", (dim,), sp=True))
        return out

    def build(self, ctx, dim: int, *, name, seed, dtype):
        return make_norm(ctx, self.kind, dim, name=name, eps=self.eps, bias=self.bias, seed=seed, dtype=dtype,
                         offset=self.offset)


@dataclass(frozen=True)
class AttentionSpec:
    """Multi-head or grouped-query attention (cutp.tensor_parallel.attention): a fused [q | k | v]
    column projection split by heads, a row projection; QK-norm's per-head RMSNorms (eps and
    offset of `qk_norm`, a NormSpec) replicated and summed over TP."""

    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_layer: int = 1
    qkv_bias: bool = True
    out_bias: bool = True
    rope: bool = False
    qk_norm: NormSpec | None = None
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    dropout: float = 0.0

    def parameters(self) -> list:
        h, hd = self.n_embd, self.head_dim
        width = (self.n_head + 2 * self.n_kv_head) * hd
        heads = (self.n_head, self.n_kv_head, hd)
        out = [ParamDecl("qkv.weight", (h, width), "qkv", layout=heads)]
        if self.qkv_bias:
            out.append(ParamDecl("qkv.bias", (width,), "qkv", layout=heads))
        out.append(ParamDecl("proj.weight", (self.n_head * hd, h), "row"))
        if self.out_bias:
            out.append(ParamDecl("proj.bias", (h,), sp=True))
        if self.qk_norm is not None:
            out += [ParamDecl(f"{which}.weight", (hd,), tp_partial=True) for which in ("q_norm", "k_norm")]
        return out

    def scores_per_key(self) -> int:
        """Multiply-adds per query token and key: the scores q.k and the weighted sum of v."""
        return 2 * self.n_head * self.head_dim

    def build(self, ctx, *, name, rng, seed, dtype, rotary):
        if self.rope and rotary is None:
            raise ValueError("a rotary block needs the model's rotary tables (rotary=(cos, sin))")
        qk = self.qk_norm or NormSpec("rmsnorm")
        return ParallelAttention(ctx, self.n_embd, self.n_head, self.n_kv_head, name=name, rng=rng,
                                 n_layer=self.n_layer, attn_dropout=self.dropout, seed=seed, dtype=dtype,
                                 head_dim=self.head_dim, qkv_bias=self.qkv_bias, out_bias=self.out_bias,
                                 rotary=rotary if self.rope else None, qk_norm=self.qk_norm is not None,
                                 norm_eps=qk.eps, window=self.window, softcap=self.softcap, scale=self.scale,
                                 norm_offset=qk.offset)


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek's multi-head latent attention (cutp.tensor_parallel.mla): the down-projections
    and their RMSNorms replicated, the up-projections split by heads, the output row-parallel."""

    n_embd: int
    n_head: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    softmax_scale: float | None = None
    norm_eps: float = 1e-6
    n_layer: int = 1
    dropout: float = 0.0  # attention dropout on the probabilities (as AttentionSpec's)

    def parameters(self) -> list:
        h, H, r, rq = self.n_embd, self.n_head, self.kv_lora_rank, self.q_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if rq:
            # (the down-projections and their norms run on each rank's tokens under SP: `sp`)
            q = [ParamDecl("q_a.weight", (h, rq), sp=True), ParamDecl("q_a_norm.weight", (rq,), sp=True),
                 ParamDecl("q_b.weight", (rq, H * qk), "column")]
        else:
            q = [ParamDecl("q_proj.weight", (h, H * qk), "column")]
        return q + [ParamDecl("kv_a.weight", (h, r + self.qk_rope_head_dim), sp=True),
                    ParamDecl("kv_a_norm.weight", (r,), sp=True),
                    ParamDecl("kv_b.weight", (r, H * (self.qk_nope_head_dim + self.v_head_dim)), "column"),
                    ParamDecl("proj.weight", (H * self.v_head_dim, h), "row")]

    def scores_per_key(self) -> int:
        """Multiply-adds per query token and key: the scores (query-key heads of nope + rope) and
        the weighted sum of v (heads of v_head_dim)."""
        return self.n_head * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)

    def build(self, ctx, *, name, rng, seed, dtype, rotary):
        return MultiLatentAttention(ctx, self.n_embd, self.n_head, name=name, rotary=rotary,
                                    q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                                    qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                                    v_head_dim=self.v_head_dim, softmax_scale=self.softmax_scale,
                                    norm_eps=self.norm_eps, n_layer=self.n_layer, seed=seed, dtype=dtype, rng=rng,
                                    attn_dropout=self.dropout)


@dataclass(frozen=True)
class MLPSpec:
    """A dense MLP (cutp.tensor_parallel.mlp): kind "gelu" (fc1 h -> hidden, column-split), "swiglu"
    or "geglu" (fc1 h -> 2 hidden, [gate | up] split gate_r ; up_r), then fc2 hidden -> h
    (row-split, its bias replicated)."""

    n_embd: int
    hidden: int
    kind: str = "gelu"  # gelu | swiglu | geglu
    bias: bool = True
    gelu: str = "tanh"
    n_layer: int = 1

    @property
    def gated(self) -> bool:
        return self.kind in ("swiglu", "geglu")

    def parameters(self) -> list:
        h, f = self.n_embd, self.hidden
        width, split = (2 * f, "gate_up") if self.gated else (f, "column")
        out = [ParamDecl("fc1.weight", (h, width), split)]
        if self.bias:
            out.append(ParamDecl("fc1.bias", (width,), split))
        out.append(ParamDecl("fc2.weight", (f, h), "row"))
        if self.bias:
            out.append(ParamDecl("fc2.bias", (h,), sp=True))
        return out

    def expert_parameters(self, n_experts: int) -> list:
        """The same tensors as one routed expert's (`experts.*.`): whole on every TP rank, each
        rank's tokens through them, n_experts of them divided over EP."""
        return [replace(d, name=f"experts.*.{d.name}", split="expert", sp=False, tp_partial=True, count=n_experts)
                for d in self.parameters()]

    def build(self, ctx, *, name, seed, dtype):
        return ParallelMLP(ctx, self.n_embd, self.hidden, name=name, n_layer=self.n_layer, bias=self.bias,
                           gelu=self.gelu, seed=seed, dtype=dtype, kind=self.kind)


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP (cutp.tensor_parallel.moe): a router [h, E] (replicated, summed
    over TP under sequence parallelism), E routed experts of `expert`'s kind and width,
    DeepSeekMoE's shared experts (`shared`: one dense MLP of their total width, split over TP)
    and the routing settings (MoEMLP's keywords: top_k, scoring, capacity, losses, ...)."""

    n_embd: int
    n_experts: int
    expert: MLPSpec
    shared: MLPSpec | None = None
    routing: dict = field(default_factory=dict)

    @property
    def top_k(self) -> int:
        return self.routing.get("top_k", 2)

    def parameters(self) -> list:
        out = [ParamDecl("router.weight", (self.n_embd, self.n_experts), sp=True)]
        if self.routing.get("score_bias"):
            out.append(ParamDecl("router.score_bias", (self.n_experts,), grad=False))
        if self.shared is not None:
            out += prefixed("shared_experts", self.shared.parameters())
        return out + self.expert.expert_parameters(self.n_experts)

    def build(self, ctx, *, name, seed, dtype):
        e = self.expert
        shared = None if self.shared is None else self.shared.build(ctx, name=f"{name}.shared_experts", seed=seed,
                                                                     dtype=dtype)
        return MoEMLP(ctx, self.n_embd, n_experts=self.n_experts, ffn=e.hidden, **self.routing,
                      shared_experts=shared, name=name, n_layer=e.n_layer, bias=e.bias, gelu=e.gelu, seed=seed,
                      dtype=dtype, kind=e.kind)


def count(decls, *, tp: int | None = None, ep: int = 1, where=None) -> int:
    """Elements of the declared parameters that train (`grad`): of the full tensors (tp None) or
    of one TP (and EP) rank; `where(decl)` picks some."""
    return sum(d.numel if tp is None else d.local_numel(tp, ep) for d in decls
               if d.grad and (where is None or where(d)))


def tp_summed(decl, sequence_parallel: bool) -> bool:
    """Whether `tp_grad_sync` sums this parameter's gradient over TP (cutp.tensor_parallel.grads)."""
    return decl.tp_partial or (sequence_parallel and decl.sp)


__all__ = ["ParamDecl", "NormSpec", "AttentionSpec", "MLASpec", "MLPSpec", "MoESpec", "count", "prefixed",
           "tp_summed"]
