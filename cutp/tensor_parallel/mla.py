"""Multi-head latent attention (MLA, DeepSeek-V2/V3), split over TP by heads as Megatron's.

Input and output: replicated [B, T, n_embd]. As transformers' DeepseekV3Attention computes it:

    queries   q_lora_rank set: x @ q_a (replicated [h, r_q]) -> RMSNorm -> q_b (column-parallel,
              [r_q, H * (d_nope + d_rope)], this rank's heads); unset: q_proj (column-parallel)
    keys, values  x @ kv_a (replicated [h, r_kv + d_rope]) = [latent | k_rope]; the latent ->
              RMSNorm -> kv_b (column-parallel, [r_kv, H * (d_nope + d_v)]) = per head [k_nope | v];
              k_rope is one key part shared by every head
    positions RoPE (rotate-half layout, the model's tables of width d_rope) on each query head's
              rope part and on the shared k_rope; q = [q_nope | q_rope], k = [k_nope | k_rope]
    attention causal, scale `softmax_scale` (default (d_nope + d_rope)^-1/2; the family passes
              YaRN's mscale^2 times it), v of width d_v (the op's plain path: d_v != d_qk)
    output    o_proj (row-parallel, [H * d_v, h])

DeepSeek's checkpoints lay the rope dimensions out in interleaved pairs (`rope_interleave`):
transformers de-interleaves them before a rotate-half rotation, which equals permuting the rope
columns of q_b (or q_proj) and kv_a once when the weights are read; this module computes the
rotate-half layout only.

TP: the down-projections and their norms are replicated; the column-parallel up-projections'
backward all-reduces the latent's gradient, so their gradients are the same on every rank
(replicated, nothing to sum), and the shared k_rope's gradient, each rank's heads' share, is
all-reduced over TP after its backward rotation. Generation's KV cache holds the compressed latent
(normalised) and the rotated shared key per token, kv_lora_rank + qk_rope_head_dim values per
layer, and expands the latents into heads at each step.

Sequence parallelism (`lay_out_sequence`): x is this rank's T/tp tokens. The down-projections and
their norms run on them, and what the up-projections need is gathered after: the normalised q
latent (by q_b, column-parallel under SP), the normalised kv latent (by kv_b) and the raw rope key
(here), r_q + r_kv + d_rope values per token (2,112 in V3) instead of the hidden state (7,168),
and no rank repeats another's down-projection. (Without q_lora_rank, q_proj gathers x itself.)
Backward reduce-scatters the three gradients back to this rank's tokens, so the down-projections'
and norms' weight gradients cover these tokens only: they are marked `sequence_parallel` and
summed over TP as SP's norms are (`tp_grad_sync`). o_proj reduce-scatters its output.

Context parallelism (`lay_out_context`, `cp_comm`): everything but the attention works on this
CP rank's zigzag chunks; RoPE takes their global positions; the expanded heads meet the whole
sequence by the ring (K,V travel: k of width d_nope + d_rope with the shared rope key broadcast
into each head, v of width d_v) or the all-to-all (`cutp.tensor_parallel.context_parallel`, which
takes v's head dim apart from k's). The shared key's gradient stays on its CP rank (the ring
brings each dK home).

Selective recomputation (`recompute_core`): as ParallelAttention's, forward keeps q, k, v and the
dropout's (p, seed, offsets), not the probabilities, and backward recomputes them (the fused
kernels' and the ring's contexts are O(T) already: kept).

Attention dropout (`attn_dropout`): ParallelAttention's rule, probability (head, query, key) of
a batch row keyed by its global head, query and key (this rank's heads at their global places),
so that no TP, SP or CP layout changes the masks. Packed rows (`documents`): the op's mask rule,
RoPE by the positions inside the documents (the model's `positions` ids).
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..runtime.errors import ConfigError
from .context_parallel import (MaskRule, RingCtx, UlyssesCtx, ring_attention_backward,
                               ring_attention_forward, ulysses_attention_backward, ulysses_attention_forward,
                               zigzag_chunks)
from .declare import ParamDecl, below, build_parameters, linear_parameters, norm_parameters, prefixed
from .layers import ColumnParallelLinear, Dropout, RMSNorm, RowParallelLinear, with_weight, without_weight
from .mappings import gather_from_sp_backward, gather_from_sp_forward
from .parameter import Module
from .random import SHARDED


def mla_parameters(n_embd, n_head, *, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                   n_layer=1) -> list:
    """MLA's declarations (`cutp.tensor_parallel.declare`): the down-projections and their norms
    replicated (run on each rank's tokens under sequence parallelism: `sp`), the up-projections
    split by heads, the output row-parallel."""
    h, H, r = n_embd, n_head, kv_lora_rank
    qk = qk_nope_head_dim + qk_rope_head_dim
    if q_lora_rank:
        q = ([ParamDecl("q_a.weight", (h, q_lora_rank), sp=True)]
             + prefixed("q_a_norm", norm_parameters("rmsnorm", q_lora_rank))
             + prefixed("q_b", linear_parameters(q_lora_rank, H * qk, bias=False)))
    else:
        q = prefixed("q_proj", linear_parameters(h, H * qk, bias=False))
    return q + ([ParamDecl("kv_a.weight", (h, r + qk_rope_head_dim), sp=True)]
                + prefixed("kv_a_norm", norm_parameters("rmsnorm", r))
                + prefixed("kv_b", linear_parameters(r, H * (qk_nope_head_dim + v_head_dim), bias=False))
                + prefixed("proj", linear_parameters(H * v_head_dim, h, bias=False, split="row",
                                                     init=0.02 / math.sqrt(2 * n_layer))))


class MultiLatentAttention(Module):
    def __init__(self, ctx, n_embd, n_head, *, name, rotary, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                 qk_rope_head_dim, v_head_dim, softmax_scale=None, norm_eps=1e-6, n_layer=1, seed=0,
                 dtype=np.float32, rng=None, attn_dropout=0.0, params=None):
        """rng: the model's RNGTracker (its SHARDED stream for the attention dropout; None only
        with attn_dropout 0). params: its parameters, built from `mla_parameters` (None: built here)."""
        tp = ctx.tp_size
        if n_head % tp:
            raise ConfigError(f"tp={tp} must divide n_head={n_head}: MLA splits its heads over the TP ranks")
        self.ctx, self.rotary = ctx, rotary
        self.n_head, self.nh = n_head, n_head // tp
        self.nope, self.rope, self.vd, self.r = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.scale = 1.0 / math.sqrt(qk) if softmax_scale is None else softmax_scale
        if params is None:
            params = build_parameters(ctx, mla_parameters(n_embd, n_head, q_lora_rank=q_lora_rank,
                                                          kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                                                          qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                                                          n_layer=n_layer), name, seed=seed, dtype=dtype)
        self.q_a = self.q_a_norm = self.q_proj = None
        if q_lora_rank:
            self.q_a = params["q_a.weight"]
            self.q_a_norm = RMSNorm(ctx, q_lora_rank, name=f"{name}.q_a_norm", eps=norm_eps,
                                    params=below(params, "q_a_norm"))
            self.q_b = ColumnParallelLinear(ctx, q_lora_rank, n_head * qk, name=f"{name}.q_b", params=below(params, "q_b"))
        else:
            self.q_b = ColumnParallelLinear(ctx, n_embd, n_head * qk, name=f"{name}.q_proj",
                                            params=below(params, "q_proj"))
        self.kv_a = params["kv_a.weight"]
        self.kv_a_norm = RMSNorm(ctx, kv_lora_rank, name=f"{name}.kv_a_norm", eps=norm_eps,
                                 params=below(params, "kv_a_norm"))
        self.kv_b = ColumnParallelLinear(ctx, kv_lora_rank, n_head * (qk_nope_head_dim + v_head_dim),
                                         name=f"{name}.kv_b", params=below(params, "kv_b"))
        self.proj = RowParallelLinear(ctx, n_head * v_head_dim, n_embd, name=f"{name}.proj", params=below(params, "proj"))
        self.attn_dropout = Dropout(attn_dropout, rng, SHARDED, site=f"{name}.attn_dropout")
        self.sequence_parallel = False  # x is this rank's T/tp tokens (module docstring)
        self.context_shard: tuple[int, int] | None = None  # (cp_rank, cp): context parallelism
        self.cp_comm = "ring"  # or "a2a"
        self.recompute_core = False  # selective recomputation (module docstring)
        self.q_a_lora = self.kv_a_lora = None  # LoRA on the down-projections (cutp.tensor_parallel.lora)

    def lay_out_sequence(self, on, shard):
        """The down-projections run on this rank's tokens: their weights' gradients cover those
        only (declared `sp`: the model marks them, and the norms', summed over TP by
        `tp_grad_sync`); so do their LoRA pairs' (marked here)."""
        self.sequence_parallel = on
        for adapter in (self.q_a_lora, self.kv_a_lora):  # (their LoRA pairs run on the same tokens)
            for pair in [] if adapter is None else adapter.pairs:
                if on and pair.dropout.p > 0:  # (its masks are drawn at whole-sequence token places)
                    raise ConfigError("`lora_dropout` on q_a / kv_a of multi-head latent attention runs on each "
                                      "rank's tokens under sequence parallelism; set lora_dropout=0, or drop "
                                      "q_a,kv_a from lora_targets, or omit sequence_parallel")
                pair.A.sequence_parallel = pair.B.sequence_parallel = on

    def lay_out_context(self, shard):
        self.context_shard = shard

    def _sp(self) -> bool:
        return self.sequence_parallel and self.ctx.tp_size > 1

    def _rotate(self, a, positions):
        """(a [B, T, heads, d_rope] rotated, the op's context) by `positions`: None (arange(T), or
        under context parallelism this rank's zigzag chunks' positions), an offset n0, or ids
        [T] / [B, T] (packed rows' positions inside their documents, this rank's under CP)."""
        cos, sin = self.rotary
        T = a.shape[1]
        if positions is not None and not isinstance(positions, (int, np.integer)):
            return ops.rotary_forward(a, cos, sin, positions)
        if self.context_shard is not None and positions is None:  # the two chunks' rows (slices: no gather)
            cp_rank, cp = self.context_shard
            c, (first, second) = T // 2, zigzag_chunks(cp, cp_rank)
            cos, sin = (self.ctx.xp.concatenate([t[first * c:(first + 1) * c], t[second * c:(second + 1) * c]])
                        for t in self.rotary)
            return ops.rotary_forward(a, cos, sin)
        n0 = int(positions or 0)
        if not 0 <= n0 <= cos.shape[0] - T:
            raise ValueError(f"rotary positions {n0}..{n0 + T - 1} lie past the tables' {cos.shape[0]} (block_size)")
        return ops.rotary_forward(a, cos[n0:n0 + T], sin[n0:n0 + T])

    def _queries(self, x):
        """[B, T, H, d_nope + d_rope] of this rank's heads (T: the whole sequence, q_b gathering
        under sequence parallelism), and the low-rank path's linear context."""
        B = x.shape[0]
        if self.q_a is None:
            return self.q_b.forward(x).reshape(B, -1, self.nh, self.nope + self.rope), None
        cq, qa_ctx = self._down(x, self.q_a, self.q_a_lora)
        return self.q_b.forward(self.q_a_norm.forward(cq)).reshape(B, -1, self.nh, self.nope + self.rope), qa_ctx


    def _down(self, x, weight, lora):
        """A replicated down-projection x @ W (+ its LoRA pairs): (y, what `_down_backward` needs)."""
        y, ctx = ops.linear_forward(x, weight.data)
        return y, (without_weight(ctx), None if lora is None else lora.forward(x, y))

    def _down_backward(self, dy, saved, weight, lora):
        ctx, lora_saved = saved
        dx, _, _ = ops.linear_backward(dy, with_weight(ctx, weight.data), wgrad_out=weight.grad,
                                       need_dw=weight.trainable)
        return dx if lora is None else dx + lora.backward(dy, lora_saved)

    def _heads(self, q_nope, q_pe, kv, k_pe):
        """The op's layout of queries [B, Tq, H, .], keys and values from kv [B, Tk, H, d_nope +
        d_v] and the shared k_pe [B, Tk, 1, d_rope]: q [B, H, 1, Tq, d_qk], k [B, H, Tk, d_qk],
        v [B, H, Tk, d_v]."""
        xp = self.ctx.xp
        B, Tk, H, _ = kv.shape
        dn, dr = self.nope, self.rope
        qf = xp.concatenate([q_nope, q_pe], axis=-1)
        kf = xp.concatenate([kv[..., :dn], xp.broadcast_to(k_pe, (B, Tk, H, dr))], axis=-1)
        return qf.transpose(0, 2, 1, 3)[:, :, None], kf.transpose(0, 2, 1, 3), kv[..., dn:].transpose(0, 2, 1, 3)

    def _attend(self, q, k, v, documents=None, dropout=None):
        """(o [B, H, 1, Tq, d_v], the attention's context): the op's, or under context
        parallelism the ring's or the all-to-all's; the dropout's masks at the heads' global
        places of the whole sequence (ParallelAttention's rule). Selective recomputation: the
        context is (q, k, v, the dropout's (p, seed, offsets), documents), and `dropout` those
        again in backward."""
        B, H, _, Tq, _ = q.shape
        cp = 1 if self.context_shard is None else self.context_shard[1]
        T = Tq * cp
        p, seed, offsets = dropout or self.attn_dropout.draw_rows(
            B, H * T * T, first_elem=self.ctx.tp_rank * H * T * T, global_row_elems=self.n_head * T * T)
        if self.context_shard is not None:  # (the ring's context is O(T): nothing to recompute)
            attend = ulysses_attention_forward if self.cp_comm == "a2a" else ring_attention_forward
            return attend(self.ctx.cp, q, k, v, self.scale, (p, seed, offsets, T) if p else None,
                          MaskRule(documents=documents))
        o, attn = ops.causal_attention_forward(q, k, v, scale=self.scale, dropout_p=p, seed=seed, offset=offsets,
                                               documents=None if documents is None else (documents, documents))
        if self.recompute_core and dropout is None and not attn.fused:  # (the fused kernels' context is O(T))
            attn = (q, k, v, (p, seed, offsets), documents)
        return o, attn

    def _output(self, o):
        B, H, _, T, dv = o.shape
        return self.proj.forward(o[:, :, 0].transpose(0, 2, 1, 3).reshape(B, T, H * dv))

    def forward(self, x, positions=None, documents=None):
        """x: [B, T, n_embd] (this rank's tokens: T/tp under sequence parallelism, its CP chunks
        under context parallelism); positions: None, an offset n0, or the tokens' position ids
        (`_rotate`); documents: None or the whole sequences' document ids [B, T] (packed rows)."""
        xp = self.ctx.xp
        B = x.shape[0]
        dn, dv, r = self.nope, self.vd, self.r
        q, qa_ctx = self._queries(x)
        ckv, kva_ctx = self._down(x, self.kv_a, self.kv_a_lora)
        kv = self.kv_b.forward(self.kv_a_norm.forward(xp.ascontiguousarray(ckv[..., :r]))).reshape(B, -1, self.nh,
                                                                                                     dn + dv)
        k_pe = xp.ascontiguousarray(ckv[..., None, r:])  # [B, T, 1, d_rope]: this rank's tokens
        if self._sp():  # (the small rope key gathered, as q_b and kv_b gather their latents)
            k_pe = gather_from_sp_forward(self.ctx.tp, k_pe)
        q_pe, rq = self._rotate(xp.ascontiguousarray(q[..., dn:]), positions)
        k_pe, rk = self._rotate(k_pe, positions)
        o, attn = self._attend(*self._heads(q[..., :dn], q_pe, kv, k_pe), documents)
        self._save("mla", (qa_ctx, kva_ctx, rq, rk, attn))
        return self._output(o)

    # ---- generation: the compressed KV cache -----------------------------------------------------
    def new_kv_cache(self, batch, max_len, dtype):
        """Per token the normalised latent and the rotated shared key: kv_lora_rank +
        qk_rope_head_dim values per layer (not the expanded heads), the same on every TP rank."""
        xp = self.ctx.xp
        return {"latent": xp.zeros((batch, max_len, self.r), dtype),
                "k_rope": xp.zeros((batch, max_len, self.rope), dtype), "len": 0}

    def forward_cached(self, x, cache):
        """Eval-mode forward of new positions x [B, Tn, n_embd] after the cached n0: their latents
        and rope keys appended, every cached latent expanded into this rank's heads' keys and values."""
        if self.training:
            raise RuntimeError("forward_cached is for generation: call model.eval() first")
        xp = self.ctx.xp
        B, tn, _ = x.shape
        n0, r, dn, dv = cache["len"], self.r, self.nope, self.vd
        if n0 + tn > cache["latent"].shape[1]:
            raise ValueError(f"KV cache holds {cache['latent'].shape[1]} positions; {n0 + tn} requested")
        q, _ = self._queries(x)
        ckv, _ = self._down(x, self.kv_a, self.kv_a_lora)
        cache["latent"][:, n0:n0 + tn] = self.kv_a_norm.forward(xp.ascontiguousarray(ckv[..., :r]))
        k_pe, _ = self._rotate(xp.ascontiguousarray(ckv[..., None, r:]), n0)
        cache["k_rope"][:, n0:n0 + tn] = k_pe[:, :, 0]
        n = cache["len"] = n0 + tn
        kv = self.kv_b.forward(cache["latent"][:, :n]).reshape(B, n, self.nh, dn + dv)
        q_pe, _ = self._rotate(xp.ascontiguousarray(q[..., dn:]), n0)
        o, _ = ops.causal_attention_forward(*self._heads(q[..., :dn], q_pe, kv, cache["k_rope"][:, :n, None]),
                                            scale=self.scale, blocked=False)
        return self._output(o)

    def backward(self, dy):
        xp = self.ctx.xp
        qa_ctx, kva_ctx, rq, rk, attn = self._load("mla")
        H, dn, dv = self.nh, self.nope, self.vd
        do = self.proj.backward(dy)  # [B, T, H * d_v] (the whole sequence under SP: proj gathers dy)
        B, T = do.shape[:2]
        do = do.reshape(B, T, H, dv).transpose(0, 2, 1, 3)[:, :, None]
        if isinstance(attn, tuple):  # selective recomputation: the attention again, with the same masks
            q, k, v, dropout, documents = attn
            _, attn = self._attend(q, k, v, documents, dropout)
        if isinstance(attn, RingCtx):
            dq, dk, dvv = ring_attention_backward(self.ctx.cp, do, attn)
        elif isinstance(attn, UlyssesCtx):
            dq, dk, dvv = ulysses_attention_backward(self.ctx.cp, do, attn)
        else:
            dq, dk, dvv = ops.causal_attention_backward(do, attn)
        dq, dk, dvv = dq[:, :, 0].transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3), dvv.transpose(0, 2, 1, 3)
        dq_pe = ops.rotary_backward(xp.ascontiguousarray(dq[..., dn:]), rq)
        # the shared key: every head's share, then every TP rank's heads' (SP: and back to this rank's tokens)
        dk_pe = ops.rotary_backward(xp.ascontiguousarray(dk[..., dn:].sum(axis=2, keepdims=True)), rk)
        if self._sp():
            dk_pe = gather_from_sp_backward(self.ctx.tp, dk_pe)
        elif self.ctx.tp_size > 1:
            self.ctx.tp.all_reduce(dk_pe, "sum", out=dk_pe)
        dcq = self.q_b.backward(xp.concatenate([dq[..., :dn], dq_pe], axis=-1).reshape(B, T, -1))
        if self.q_a is not None:
            dx = self._down_backward(self.q_a_norm.backward(dcq), qa_ctx, self.q_a, self.q_a_lora)
        else:
            dx = dcq
        dkv_b = xp.concatenate([dk[..., :dn], dvv], axis=-1).reshape(B, T, -1)
        dlat = self.kv_a_norm.backward(self.kv_b.backward(dkv_b))
        dkv = self._down_backward(xp.concatenate([dlat, dk_pe[:, :, 0]], axis=-1), kva_ctx, self.kv_a, self.kv_a_lora)
        return dx + dkv
