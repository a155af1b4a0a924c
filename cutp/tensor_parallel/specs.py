"""The submodules a transformer block is built from, each declared as data: which kind, its
settings, its parameters. A family picks one of each from its config's fields (its `Blocks`,
cutp.models.blocks; `ModelConfig.block_spec` asks it) and `BlockSpec` (cutp.tensor_parallel.transformer) holds them; the block builds each
with its `build` and never branches on a kind.

    NormSpec       LayerNorm (with or without a bias) or RMSNorm (scale w, or 1 + w: Gemma)
    AttentionSpec  multi-head / grouped-query attention: biases, rotary or not, QK-norm, window,
                   soft-cap, scale (cutp.tensor_parallel.attention)
    MLASpec        DeepSeek's multi-head latent attention (cutp.tensor_parallel.mla)
    MLPSpec        GeLU, SwiGLU or GeGLU MLP (cutp.tensor_parallel.mlp)
    MoESpec        a router and routed experts (each an MLPSpec), DeepSeekMoE's shared experts and
                   routing settings (cutp.tensor_parallel.moe)

`parameters()` declares each submodule's parameters (`ParamDecl`, cutp.tensor_parallel.declare:
the name under the module, the full shape, how TP splits it, the sequence-parallel and tp_partial
marks, the copies, whether it trains, its initialisation), as its layer's declaring function
(`attention_parameters`, `mlp_parameters`, ...) gives them; `build` makes the parameters from
them (`build_parameters`, one loop) and hands them to the module, which allocates none itself.
The model's parameter count (`ModelConfig.num_parameters`), the planner's per-rank count and its
TP gradient all-reduce sum the same declarations without building an array;
tests/models/test_declarations.py checks the built model against them at every TP and EP size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .attention import ParallelAttention, attention_parameters
from .declare import ParamDecl, below, build_parameters, norm_parameters, prefixed
from .layers import make_norm
from .mla import MultiLatentAttention, mla_parameters
from .mlp import ParallelMLP, mlp_parameters
from .moe import MoEMLP, moe_parameters
from .moe_experts import expert_parameters


@dataclass(frozen=True)
class NormSpec:
    """LayerNorm (weight, and a bias when `bias`) or RMSNorm (weight; the scale 1 + weight with
    `offset`, Gemma's). Replicated; summed over TP under sequence parallelism."""

    kind: str = "layernorm"  # layernorm | rmsnorm
    eps: float = 1e-5
    bias: bool = True  # LayerNorm's
    offset: bool = False  # RMSNorm's (1 + weight)

    def parameters(self, dim: int) -> list:
        return norm_parameters(self.kind, dim, bias=self.bias, offset=self.offset)

    def build(self, ctx, dim: int, *, name, seed, dtype):
        return make_norm(ctx, self.kind, dim, name=name, eps=self.eps, bias=self.bias, offset=self.offset,
                         params=build_parameters(ctx, self.parameters(dim), name, seed=seed, dtype=dtype))


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
        return attention_parameters(self.n_embd, self.n_head, self.n_kv_head, self.head_dim, n_layer=self.n_layer,
                                    qkv_bias=self.qkv_bias, out_bias=self.out_bias, qk_norm=self.qk_norm is not None,
                                    norm_offset=self.qk_norm is not None and self.qk_norm.offset)

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
                                 norm_offset=qk.offset,
                                 params=build_parameters(ctx, self.parameters(), name, seed=seed, dtype=dtype))


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
        return mla_parameters(self.n_embd, self.n_head, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                              qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                              v_head_dim=self.v_head_dim, n_layer=self.n_layer)

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
                                    attn_dropout=self.dropout,
                                    params=build_parameters(ctx, self.parameters(), name, seed=seed, dtype=dtype))


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
        return mlp_parameters(self.n_embd, self.hidden, kind=self.kind, bias=self.bias, n_layer=self.n_layer)

    def expert_parameters(self, n_experts: int) -> list:
        """The same tensors as one routed expert's (`experts.*.`): whole on every TP rank, each
        rank's tokens through them, n_experts of them divided over EP."""
        return expert_parameters(self.n_embd, self.hidden, kind=self.kind, bias=self.bias, n_layer=self.n_layer,
                                 n_experts=n_experts)

    def build(self, ctx, *, name, seed, dtype):
        return ParallelMLP(ctx, self.n_embd, self.hidden, name=name, n_layer=self.n_layer, bias=self.bias,
                           gelu=self.gelu, kind=self.kind,
                           params=build_parameters(ctx, self.parameters(), name, seed=seed, dtype=dtype))


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
        e = self.expert
        return moe_parameters(self.n_embd, n_experts=self.n_experts, ffn=e.hidden, kind=e.kind, bias=e.bias,
                              n_layer=e.n_layer, score_bias=bool(self.routing.get("score_bias")),
                              shared=None if self.shared is None else self.shared.parameters())

    def build(self, ctx, *, name, seed, dtype):
        e, params = self.expert, build_parameters(ctx, self.parameters(), name, seed=seed, dtype=dtype)
        shared = None if self.shared is None else ParallelMLP(
            ctx, self.n_embd, self.shared.hidden, name=f"{name}.shared_experts", n_layer=self.shared.n_layer,
            bias=self.shared.bias, gelu=self.shared.gelu, kind=self.shared.kind,
            params=below(params, "shared_experts"))
        return MoEMLP(ctx, self.n_embd, n_experts=self.n_experts, ffn=e.hidden, **self.routing,
                      shared_experts=shared, name=name, n_layer=e.n_layer, bias=e.bias, gelu=e.gelu, dtype=dtype,
                      kind=e.kind, params=params)


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
