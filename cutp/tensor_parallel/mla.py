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
all-reduced over TP before its backward. Generation's KV cache holds the compressed latent
(normalised) and the rotated shared key per token, kv_lora_rank + qk_rope_head_dim values per
layer, and expands the latents into heads at each step. Not yet (refused by name): sequence and
context parallelism, attention dropout.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..runtime.errors import ConfigError
from .layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from .parameter import Module, make_parameter, normal_init


class MultiLatentAttention(Module):
    def __init__(self, ctx, n_embd, n_head, *, name, rotary, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                 qk_rope_head_dim, v_head_dim, softmax_scale=None, norm_eps=1e-6, n_layer=1, seed=0,
                 dtype=np.float32):
        tp = ctx.tp_size
        if n_head % tp:
            raise ConfigError(f"tp={tp} must divide n_head={n_head}: MLA splits its heads over the TP ranks")
        self.ctx, self.rotary = ctx, rotary
        self.nh = n_head // tp
        self.nope, self.rope, self.vd, self.r = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.scale = 1.0 / math.sqrt(qk) if softmax_scale is None else softmax_scale
        kw = dict(seed=seed, dtype=dtype)
        self.q_a = self.q_a_norm = self.q_proj = None
        if q_lora_rank:
            self.q_a = make_parameter(ctx, f"{name}.q_a.weight", (n_embd, q_lora_rank), normal_init(0.02),
                                      weight_decay=True, **kw)
            self.q_a_norm = RMSNorm(ctx, q_lora_rank, name=f"{name}.q_a_norm", eps=norm_eps, **kw)
            self.q_b = ColumnParallelLinear(ctx, q_lora_rank, n_head * qk, name=f"{name}.q_b", bias=False, **kw)
        else:
            self.q_b = ColumnParallelLinear(ctx, n_embd, n_head * qk, name=f"{name}.q_proj", bias=False, **kw)
        self.kv_a = make_parameter(ctx, f"{name}.kv_a.weight", (n_embd, kv_lora_rank + qk_rope_head_dim),
                                   normal_init(0.02), weight_decay=True, **kw)
        self.kv_a_norm = RMSNorm(ctx, kv_lora_rank, name=f"{name}.kv_a_norm", eps=norm_eps, **kw)
        self.kv_b = ColumnParallelLinear(ctx, kv_lora_rank, n_head * (qk_nope_head_dim + v_head_dim),
                                         name=f"{name}.kv_b", bias=False, **kw)
        self.proj = RowParallelLinear(ctx, n_head * v_head_dim, n_embd, name=f"{name}.proj", bias=False,
                                      init=normal_init(0.02 / math.sqrt(2 * n_layer)), **kw)

    def lay_out_sequence(self, on, shard):
        if on:
            raise ConfigError("multi-head latent attention has no sequence parallelism yet; drop "
                              "--sequence-parallel")

    def lay_out_context(self, shard):
        if shard is not None:
            raise ConfigError("multi-head latent attention has no context parallelism yet; use cp=1")

    def _tables(self, T, positions):
        cos, sin = self.rotary
        n0 = int(positions or 0)
        if not 0 <= n0 <= cos.shape[0] - T:
            raise ValueError(f"rotary positions {n0}..{n0 + T - 1} lie past the tables' {cos.shape[0]} (block_size)")
        return cos[n0:n0 + T], sin[n0:n0 + T]

    def _queries(self, x):
        """[B, T, H, d_nope + d_rope] of this rank's heads, and the low-rank path's linear context."""
        B, T, _ = x.shape
        if self.q_a is None:
            return self.q_b.forward(x).reshape(B, T, self.nh, -1), None
        cq, qa_ctx = ops.linear_forward(x, self.q_a.data)
        return self.q_b.forward(self.q_a_norm.forward(cq)).reshape(B, T, self.nh, -1), qa_ctx

    def _attend(self, q_nope, q_pe, kv, k_pe):
        """The attention of queries [B, Tq, H, .] over keys and values from kv [B, Tk, H, d_nope +
        d_v] and the shared k_pe [B, Tk, 1, d_rope] (the op's layout: q [B, H, 1, Tq, d_qk],
        k [B, H, Tk, d_qk], v [B, H, Tk, d_v]): (o [B, H, 1, Tq, d_v], the op's context)."""
        xp = self.ctx.xp
        B, Tk, H, _ = kv.shape
        dn, dr = self.nope, self.rope
        qf = xp.concatenate([q_nope, q_pe], axis=-1)
        kf = xp.concatenate([kv[..., :dn], xp.broadcast_to(k_pe, (B, Tk, H, dr))], axis=-1)
        return ops.causal_attention_forward(qf.transpose(0, 2, 1, 3)[:, :, None], kf.transpose(0, 2, 1, 3),
                                            kv[..., dn:].transpose(0, 2, 1, 3), scale=self.scale)

    def _output(self, o):
        B, H, _, T, dv = o.shape
        return self.proj.forward(o[:, :, 0].transpose(0, 2, 1, 3).reshape(B, T, H * dv))

    def forward(self, x, positions=None, documents=None):
        """positions: None (arange(T)) or an offset n0 (arange(n0, n0 + T)); documents: packed rows,
        not taken by MLA yet (ValueError; `pack` is refused for such models before a run starts)."""
        if documents is not None:
            raise ValueError("multi-head latent attention does not take packed rows (documents) yet; "
                             "train this model without packing")
        xp = self.ctx.xp
        B, T, _ = x.shape
        H, dn, dv, r = self.nh, self.nope, self.vd, self.r
        q, qa_ctx = self._queries(x)
        ckv, kva_ctx = ops.linear_forward(x, self.kv_a.data)
        kv = self.kv_b.forward(self.kv_a_norm.forward(xp.ascontiguousarray(ckv[..., :r]))).reshape(B, T, H, dn + dv)
        cos, sin = self._tables(T, positions)
        q_pe, rq = ops.rotary_forward(xp.ascontiguousarray(q[..., dn:]), cos, sin)
        k_pe, rk = ops.rotary_forward(xp.ascontiguousarray(ckv[..., None, r:]), cos, sin)
        o, attn = self._attend(q[..., :dn], q_pe, kv, k_pe)
        self._save("mla", (qa_ctx, kva_ctx, rq, rk, attn, (B, T)))
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
        ckv, _ = ops.linear_forward(x, self.kv_a.data)
        cos, sin = self._tables(tn, n0)
        cache["latent"][:, n0:n0 + tn] = self.kv_a_norm.forward(xp.ascontiguousarray(ckv[..., :r]))
        k_pe, _ = ops.rotary_forward(xp.ascontiguousarray(ckv[..., None, r:]), cos, sin)
        cache["k_rope"][:, n0:n0 + tn] = k_pe[:, :, 0]
        n = cache["len"] = n0 + tn
        kv = self.kv_b.forward(cache["latent"][:, :n]).reshape(B, n, self.nh, dn + dv)
        q_pe, _ = ops.rotary_forward(xp.ascontiguousarray(q[..., dn:]), cos, sin)
        o, _ = self._attend(q[..., :dn], q_pe, kv, cache["k_rope"][:, :n, None])
        return self._output(o)

    def backward(self, dy):
        xp = self.ctx.xp
        qa_ctx, kva_ctx, rq, rk, attn, (B, T) = self._load("mla")
        H, dn, dv = self.nh, self.nope, self.vd
        do = self.proj.backward(dy).reshape(B, T, H, dv).transpose(0, 2, 1, 3)[:, :, None]
        dq, dk, dvv = ops.causal_attention_backward(do, attn)
        dq, dk, dvv = dq[:, :, 0].transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3), dvv.transpose(0, 2, 1, 3)
        dq_pe = ops.rotary_backward(xp.ascontiguousarray(dq[..., dn:]), rq)
        dk_pe = xp.ascontiguousarray(dk[..., dn:].sum(axis=2, keepdims=True))  # the shared key: every head's share
        if self.ctx.tp_size > 1:  # (and every TP rank's heads')
            self.ctx.tp.all_reduce(dk_pe, "sum", out=dk_pe)
        dk_pe = ops.rotary_backward(dk_pe, rk)
        dcq = self.q_b.backward(xp.concatenate([dq[..., :dn], dq_pe], axis=-1).reshape(B, T, -1))
        if self.q_a is not None:
            dx, _, _ = ops.linear_backward(self.q_a_norm.backward(dcq), qa_ctx, wgrad_out=self.q_a.grad)
        else:
            dx = dcq
        dkv_b = xp.concatenate([dk[..., :dn], dvv], axis=-1).reshape(B, T, -1)
        dlat = self.kv_a_norm.backward(self.kv_b.backward(dkv_b))
        dkv, _, _ = ops.linear_backward(xp.concatenate([dlat, dk_pe[:, :, 0]], axis=-1), kva_ctx,
                                        wgrad_out=self.kv_a.grad)
        return dx + dkv
