"""Causal self-attention split by whole heads (Megatron-style), with grouped-query attention.

Input: replicated [B, T, n_embd]. Output: replicated [B, T, n_embd]. Under sequence parallelism
(the projections' `sequence_parallel`): input and output [B, T/tp, n_embd], this rank's tokens;
qkv all-gathers them, proj reduce-scatters its output.

The QKV projection is one column-parallel linear whose shard holds this rank's query heads'
Q columns and the K and V columns of the KV heads they use (`sharding.qkv_columns`); the
output projection is row-parallel over the same heads. So a block's attention costs one
all-reduce forward (in proj) and one backward (dx of qkv).

GQA (n_kv_head < n_head): when tp <= n_kv_head the KV heads are split with their queries;
when tp > n_kv_head each KV head is replicated on the tp / n_kv_head ranks whose queries use
it. Each copy then gets only its own queries' share of the gradient, so those columns' weight
and bias gradients are summed over exactly those ranks once per optimizer step
(`Parameter.grad_sync`, run by `finish_grad_sync`), which keeps the copies identical.

The attention between the two projections is the op `cutp.ops.causal_attention_forward` /
`_backward` (its plain composition and its blocked NumPy path live there); this layer splits
the fused QKV output into the op's head layout (views), owns the attention dropout's RNG
stream, and keeps the KV cache of generation.

Rotary positions (`rotary`: the model's (cos, sin) tables, built once per model by
`cutp.ops.rope_tables`): after the QKV projection (and its bias: Qwen2's q/k biases are added
before the rotation, as HF does) this rank's Q and K columns of the fused buffer, viewed as
[B, T, nq + nkv, hd], are turned in place by their tokens' GLOBAL positions (`positions`:
arange(T) by default, the whole sequence, also under sequence parallelism, which gathers before
the projection; arange(n0, n0 + Tn) for the KV cache, which stores rotated K as HF does; a
caller such as context parallelism passes its chunks' ids). Backward turns the same view of
dqkv back (the transpose rotation) before the projection's backward. V is never rotated.

QK-norm (`qk_norm`, Qwen3 and Gemma 3): after the projection and its bias, before the rotation,
each query head and each key head is RMS-normalised over its head_dim with one weight for all
query heads (`q_norm`) and one for all key heads (`k_norm`), as transformers does. Both weights
are replicated over TP while each rank normalises its own heads, so their gradients are summed
over TP (`tp_partial`), replicated KV heads included (each copy adds its queries' share).

Context parallelism (`context_shard = (cp_rank, cp)`, set by the model): x holds this CP
rank's local sequence (`cutp.tensor_parallel.context_parallel`'s zigzag chunks; under sequence
parallelism its TP shard, gathered by qkv as always); RoPE turns Q and K by the chunks'
global positions, and the attention is the ring over `ctx.cp`, its dropout masks keyed by
global (head, query, key) as the one-rank attention's (`cp_comm` "a2a": the all-to-all
attention instead, on whole sequences of a cp-th of the heads). The ring's context is O(T) (q, k, v, o, the
log-sum-exp): selective recomputation has nothing to recompute there either.

Local attention and packing (issues 37, 38): `window` and `softcap` (the layer's BlockSpec's)
and the forward's `documents` ([B, T] ids of the whole sequences, None: one document a row) are
the op's mask rule (`cutp.ops.attention`), with global positions on every path: the whole
sequence after sequence parallelism's gather, the ring's tiles and the all-to-all's whole
sequences under context parallelism, the KV cache's absolute positions (a local layer's cache holds
only the window - 1 latest keys, all that later queries see). RoPE then takes the tokens' positions inside their
documents (`positions`, from the model).

Selective recomputation (`recompute_core`): forward keeps Q, K, V (views of the QKV projection's
output) and the dropout's (p, seed, offset), not the attention's probabilities (the T x T part);
backward recomputes them with the same op and the same mask, so the gradients are bit-identical.
With the fused kernels (a GPU, kernels on, head dim 64 or 128) the op's context is already
O(T), o and the rows' log-sum-exp (the dropout mask is recomputed from its counters), and is kept:
there is nothing to recompute.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..runtime.backend import get_array_module
from .context_parallel import (MaskRule, RingCtx, UlyssesCtx, ring_attention_backward, ring_attention_forward,
                               ulysses_attention_backward, ulysses_attention_forward, zigzag_chunks)
from .declare import below, build_parameters, linear_parameters, norm_parameters, prefixed
from .layers import ColumnParallelLinear, Dropout, RMSNorm, RowParallelLinear
from .parameter import Module
from .random import SHARDED, RNGTracker
from .sharding import kv_heads_of_rank
from .validation import check_attention


def attention_parameters(n_embd, n_head, n_kv_head, head_dim, *, n_layer=1, qkv_bias=True, out_bias=True,
                         qk_norm=False, norm_offset=False) -> list:
    """The attention's declarations (`cutp.tensor_parallel.declare`): the fused [q | k | v]
    projection split by heads, the row projection (GPT-2's 0.02 / sqrt(2 n_layer)), QK-norm's
    per-head RMSNorm weights (replicated, summed over TP)."""
    width = (n_head + 2 * n_kv_head) * head_dim
    out = prefixed("qkv", linear_parameters(n_embd, width, bias=qkv_bias, split="qkv",
                                            layout=(n_head, n_kv_head, head_dim)))
    out += prefixed("proj", linear_parameters(n_head * head_dim, n_embd, bias=out_bias, split="row",
                                              init=0.02 / math.sqrt(2 * n_layer)))
    if qk_norm:
        for which in ("q_norm", "k_norm"):
            out += prefixed(which, norm_parameters("rmsnorm", head_dim, offset=norm_offset, per_head=True))
    return out


class ParallelAttention(Module):
    def __init__(self, ctx, n_embd, n_head, n_kv_head=None, *, name, rng: RNGTracker, n_layer=1, bias=True,
                 attn_dropout=0.0, seed=0, dtype=np.float32, head_dim=None, qkv_bias=None, out_bias=None,
                 rotary=None, qk_norm=False, norm_eps=1e-6, window=None, softcap=None, scale=None,
                 norm_offset=False, params=None):
        """head_dim: each head's width (None: n_embd // n_head). qkv_bias / out_bias: the two
        projections' biases (None: `bias`). rotary: (cos, sin) tables [max_len, head_dim] for
        rotary positions (None: none; the model adds learned positions before the blocks).
        qk_norm: an RMSNorm over each query and each key head (Qwen3, Gemma 3; module docstring),
        its scale 1 + weight with `norm_offset` (Gemma 3). scale: the scores' scale (None:
        1/sqrt(head_dim); Gemma: query_pre_attn_scalar ** -0.5). window: local attention, keys
        within `window` positions (None: global); softcap: the scores soft-capped (None: not).
        params: its parameters, built from `attention_parameters` (None: built here)."""
        n_kv_head = n_kv_head or n_head
        tp = ctx.tp_size
        check_attention(n_embd, n_head, n_kv_head, tp, head_dim=head_dim)
        self.ctx = ctx
        self.hd = n_embd // n_head if head_dim is None else head_dim
        self.rotary = rotary
        self.nq = n_head // tp
        self.kv_heads = kv_heads_of_rank(n_head, n_kv_head, tp, ctx.tp_rank)
        self.nkv = len(self.kv_heads)
        self.group = self.nq // self.nkv  # local query heads per local KV head
        self.scale = 1.0 / math.sqrt(self.hd) if scale is None else float(scale)
        self.window, self.softcap = window, softcap
        qkv_bias, out_bias = bias if qkv_bias is None else qkv_bias, bias if out_bias is None else out_bias
        if params is None:
            params = build_parameters(ctx, attention_parameters(n_embd, n_head, n_kv_head, self.hd, n_layer=n_layer,
                                                                qkv_bias=qkv_bias, out_bias=out_bias, qk_norm=qk_norm,
                                                                norm_offset=norm_offset), name, seed=seed, dtype=dtype)
        qkv_out = (n_head + 2 * n_kv_head) * self.hd
        self.qkv = ColumnParallelLinear(ctx, n_embd, qkv_out, name=f"{name}.qkv", params=below(params, "qkv"))
        self.proj = RowParallelLinear(ctx, n_head * self.hd, n_embd, name=f"{name}.proj", params=below(params, "proj"))
        self.n_head = n_head
        # QK-norm: one weight [head_dim] for every query head, one for every key head; replicated,
        # and each TP rank normalises its own heads: their gradients summed over TP (declared tp_partial)
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(ctx, self.hd, name=f"{name}.q_norm", eps=norm_eps, offset=norm_offset,
                                  params=below(params, "q_norm"))
            self.k_norm = RMSNorm(ctx, self.hd, name=f"{name}.k_norm", eps=norm_eps, offset=norm_offset,
                                  params=below(params, "k_norm"))
        self.attn_dropout = Dropout(attn_dropout, rng, SHARDED, site=f"{name}.attn_dropout")
        self.recompute_core = False  # selective recomputation (module docstring)
        self.context_shard: tuple[int, int] | None = None  # (cp_rank, cp): context parallelism (module docstring)
        self.cp_comm = "ring"  # or "a2a" (Ulysses): how the CP ranks' attention meets the whole sequence
        if tp > n_kv_head:
            # one group per layout: which ranks share a KV head depends on n_kv_head
            replicas = ctx.subgroup(f"tp_kv{n_kv_head}", color=self.kv_heads[0], key=ctx.tp_rank)
            kv_from = self.nq * self.hd
            for p in (self.qkv.weight, self.qkv.bias):
                if p is not None:
                    p.grad_sync = _sum_columns_over(replicas, kv_from)

    def lay_out_context(self, shard):
        self.context_shard = shard  # the ring (or all-to-all) over the CP group

    # ---- forward / backward ------------------------------------------------------------------
    def _split_heads(self, qkv):
        """Views of a [B, T, (nq + 2 nkv) hd] QKV tensor (or its gradient buffer) in the op's
        layout: q [B, nkv, g, T, hd], k and v [B, nkv, T, hd]. Splitting the last axis never
        copies, so writing into the views writes the buffer."""
        B, T, _ = qkv.shape
        nq, nkv, hd, g = self.nq, self.nkv, self.hd, self.group
        q = qkv[..., : nq * hd].reshape(B, T, nkv, g, hd).transpose(0, 2, 3, 1, 4)  # [B, nkv, g, T, hd]
        k = qkv[..., nq * hd:(nq + nkv) * hd].reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)  # [B, nkv, T, hd]
        v = qkv[..., (nq + nkv) * hd:].reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
        return q, k, v

    def _merge_heads(self, o):
        """[B, nkv, g, T, hd] -> [B, T, nq*hd], proj's sharded input (free after the blocked op)."""
        B, _, _, T, _ = o.shape
        return o.transpose(0, 3, 1, 2, 4).reshape(B, T, self.nq * self.hd)

    def _qk_heads(self, qkv):
        """The Q and K columns of a QKV buffer (or its gradient) as [B, T, nq + nkv, hd]: a view."""
        B, T, _ = qkv.shape
        return qkv[..., : (self.nq + self.nkv) * self.hd].reshape(B, T, self.nq + self.nkv, self.hd)

    def _normalize_qk(self, qkv, backward: bool = False):
        """QK-norm in place on the Q and K heads of a QKV buffer (after the projection and its
        bias, before the rotation, as transformers' Qwen3 and Gemma 3 apply it); with
        `backward`, its backward in place on the Q and K columns of the QKV gradient."""
        B, T, _ = qkv.shape
        xp = get_array_module(qkv)
        for norm, cols in ((self.q_norm, slice(0, self.nq * self.hd)),
                           (self.k_norm, slice(self.nq * self.hd, (self.nq + self.nkv) * self.hd))):
            heads = xp.ascontiguousarray(qkv[..., cols]).reshape(B, T, -1, self.hd)
            qkv[..., cols] = (norm.backward(heads) if backward else norm.forward(heads)).reshape(B, T, -1)

    def _rotate(self, qkv, positions):
        """Turns the Q and K heads of qkv in place by `positions`; returns the op's context.

        positions: None (arange(T)), an int n0 (arange(n0, n0 + T): a KV cache's next tokens), or
        global position ids [T] / [B, T]. A range takes the tables' rows as a slice (no gather,
        and no range check that would read device values)."""
        cos, sin = self.rotary
        heads = self._qk_heads(qkv)
        T = qkv.shape[1]
        if positions is None or isinstance(positions, (int, np.integer)):
            n0 = int(positions or 0)
            if not 0 <= n0 <= cos.shape[0] - T:
                raise ValueError(f"rotary positions {n0}..{n0 + T - 1} lie past the tables' {cos.shape[0]} "
                                 "(block_size)")
            _, rctx = ops.rotary_forward(heads, cos[n0:n0 + T], sin[n0:n0 + T], out=heads)
        else:
            _, rctx = ops.rotary_forward(heads, cos, sin, positions, out=heads)
        return rctx

    def _mask(self, documents) -> dict:
        """The op's mask keyword arguments for the whole sequences' documents [B, T] (or None)."""
        return dict(window=self.window, softcap=self.softcap,
                    documents=None if documents is None else (documents, documents))

    def forward(self, x, positions=None, documents=None):
        """positions: the tokens' global positions for rotary attention (`_rotate`: None for
        arange(T) of the whole sequence, an offset, or ids [T] / [B, T]); unused without rotary.
        documents: None or the whole sequences' document ids [B, T] (module docstring)."""
        if self.context_shard is not None:
            return self._forward_context_parallel(x, positions, documents)
        qkv = self.qkv.forward(x)
        if self.q_norm is not None:
            self._normalize_qk(qkv)
        if self.rotary is not None:
            self._save("rotary", self._rotate(qkv, positions))
        q, k, v = self._split_heads(qkv)
        B, T = qkv.shape[0], qkv.shape[1]  # the whole sequence (x is a shard of it under sequence parallelism)
        # the probabilities [B, nq, T, T] of this rank's heads, at their global heads' places in each
        # row's [n_head, T, T] (p 0: none, in eval or without dropout)
        p, seed, offset = self.attn_dropout.draw_rows(B, self.nq * T * T, first_elem=self.ctx.tp_rank * self.nq * T * T,
                                                      global_row_elems=self.n_head * T * T)
        mask = self._mask(documents)
        o, attn_ctx = ops.causal_attention_forward(q, k, v, scale=self.scale, dropout_p=p, seed=seed, offset=offset,
                                                   **mask)
        # the fused kernels' context holds O(T) (o and the log-sum-exp, no probabilities): kept
        recompute = self.recompute_core and not attn_ctx.fused
        self._save("attn", ((q, k, v), (p, seed, offset), mask) if recompute else attn_ctx)
        return self.proj.forward(self._merge_heads(o))

    def _forward_context_parallel(self, x, positions=None, documents=None):
        """The forward of a CP rank's local sequence: the ring attention (module docstring).
        positions: None (the zigzag chunks' global positions) or the local tokens' ids [B, T/cp];
        documents: the whole sequences' [B, T]."""
        cp_rank, cp = self.context_shard
        qkv = self.qkv.forward(x)
        if self.q_norm is not None:
            self._normalize_qk(qkv)
        B, T_local = qkv.shape[0], qkv.shape[1]
        T = T_local * cp  # the whole sequence
        if self.rotary is not None and positions is not None:
            self._save("rotary", self._rotate(qkv, positions))
        elif self.rotary is not None:  # the two chunks' rows of the tables (slices: no gather, no value read)
            c, (first, second) = T_local // 2, zigzag_chunks(cp, cp_rank)
            cos, sin = (self.ctx.xp.concatenate([t[first * c:(first + 1) * c], t[second * c:(second + 1) * c]])
                        for t in self.rotary)
            heads = self._qk_heads(qkv)
            self._save("rotary", ops.rotary_forward(heads, cos, sin, out=heads)[1])
        q, k, v = self._split_heads(qkv)
        p, seed, offsets = self.attn_dropout.draw_rows(B, self.nq * T * T,
                                                       first_elem=self.ctx.tp_rank * self.nq * T * T,
                                                       global_row_elems=self.n_head * T * T)
        attend = ulysses_attention_forward if self.cp_comm == "a2a" else ring_attention_forward
        o, cp_ctx = attend(self.ctx.cp, q, k, v, self.scale, (p, seed, offsets, T) if p else None,
                           MaskRule(self.window, self.softcap, documents))
        self._save("attn", cp_ctx)
        return self.proj.forward(self._merge_heads(o))

    def backward(self, dy):
        attn_ctx = self._load("attn")
        if isinstance(attn_ctx, (RingCtx, UlyssesCtx)):
            return self._backward_context_parallel(dy, attn_ctx)
        if isinstance(attn_ctx, tuple):  # recompute_core: the attention again, from Q, K, V and the same mask
            (q, k, v), (p, seed, offset), mask = attn_ctx
            _, attn_ctx = ops.causal_attention_forward(q, k, v, scale=self.scale, dropout_p=p, seed=seed,
                                                       offset=offset, **mask)
        B, nkv, g, T, hd = attn_ctx.q.shape
        do = self.proj.backward(dy)  # [B, T, nq*hd], sharded like the heads
        do = do.reshape(B, T, nkv, g, hd).transpose(0, 2, 3, 1, 4)  # [B, nkv, g, T, hd]
        dqkv = self.ctx.xp.empty((B, T, (self.nq + 2 * nkv) * hd), do.dtype)
        ops.causal_attention_backward(do, attn_ctx, out=self._split_heads(dqkv))
        if self.rotary is not None:
            dheads = self._qk_heads(dqkv)
            ops.rotary_backward(dheads, self._load("rotary"), out=dheads)
        if self.q_norm is not None:
            self._normalize_qk(dqkv, backward=True)
        return self.qkv.backward(dqkv)

    def _backward_context_parallel(self, dy, cp_ctx):
        nkv, g, hd = self.nkv, self.group, self.hd
        do = self.proj.backward(dy)
        B, T_local = do.shape[0], do.shape[1]
        do = do.reshape(B, T_local, nkv, g, hd).transpose(0, 2, 3, 1, 4)
        dqkv = self.ctx.xp.empty((B, T_local, (self.nq + 2 * nkv) * hd), do.dtype)
        backward = ring_attention_backward if isinstance(cp_ctx, RingCtx) else ulysses_attention_backward
        backward(self.ctx.cp, do, cp_ctx, out=self._split_heads(dqkv))
        if self.rotary is not None:
            dheads = self._qk_heads(dqkv)
            ops.rotary_backward(dheads, self._load("rotary"), out=dheads)
        if self.q_norm is not None:
            self._normalize_qk(dqkv, backward=True)
        return self.qkv.backward(dqkv)

    # ---- incremental decoding (generation) -----------------------------------------------------
    def new_kv_cache(self, batch, max_len, dtype):
        """This rank's heads' K/V for up to max_len positions; a local layer's holds only the
        window - 1 latest (all that later queries see)."""
        xp = self.ctx.xp
        keep = max_len if self.window is None else min(max_len, self.window - 1)
        return {"k": xp.zeros((batch, self.nkv, keep, self.hd), dtype),
                "v": xp.zeros((batch, self.nkv, keep, self.hd), dtype), "len": 0, "max": max_len}

    def forward_cached(self, x, cache):
        """Eval-mode forward of new positions x [B, Tn, n_embd], appending this rank's heads' K/V
        to `cache` (rotated K under rotary positions: positions n0..n0+Tn-1 after the cached n0)."""
        if self.training:
            raise RuntimeError("forward_cached is for generation: call model.eval() first")
        qkv = self.qkv.forward(x)
        if self.q_norm is not None:
            self._normalize_qk(qkv)
        n0, tn = cache["len"], x.shape[1]
        if n0 + tn > cache["max"]:
            raise ValueError(f"KV cache holds {cache['max']} positions; {n0 + tn} requested")
        if self.rotary is not None:
            self._rotate(qkv, n0)
        q, k, v = self._split_heads(qkv)
        if self.window is not None:
            return self._forward_cached_window(q, k, v, cache)
        cache["k"][:, :, n0:n0 + tn] = k
        cache["v"][:, :, n0:n0 + tn] = v
        cache["len"] = n0 + tn
        # the plain op: generation keeps the whole-matrix numbers it always had (the blocked
        # path agrees with them only to rounding)
        o, _ = ops.causal_attention_forward(q, cache["k"][:, :, : n0 + tn], cache["v"][:, :, : n0 + tn],
                                            scale=self.scale, blocked=False, softcap=self.softcap)
        return self.proj.forward(self._merge_heads(o))

    def _forward_cached_window(self, q, k, v, cache):
        """A local layer's cached forward: the held keys (the window - 1 before position n0) and
        the new ones, at their global indices; then the latest window - 1 held."""
        xp = self.ctx.xp
        n0, tn, keep = cache["len"], q.shape[3], cache["k"].shape[2]
        held = min(n0, keep)
        ks = xp.concatenate([cache["k"][:, :, :held], k], axis=2)  # positions n0 - held .. n0 + tn - 1
        vs = xp.concatenate([cache["v"][:, :, :held], v], axis=2)
        o, _ = ops.causal_attention_forward(q, ks, vs, scale=self.scale, blocked=False, window=self.window,
                                            softcap=self.softcap, q_first=n0, k_first=n0 - held)
        now = min(n0 + tn, keep)
        cache["k"][:, :, :now] = ks[:, :, ks.shape[2] - now:]
        cache["v"][:, :, :now] = vs[:, :, vs.shape[2] - now:]
        cache["len"] = n0 + tn
        return self.proj.forward(self._merge_heads(o))


def _sum_columns_over(group, first_col):
    """grad_sync hook: sum the gradient's columns [first_col:] (the replicated K and V) over `group`."""

    def sync(param):
        if group.size == 1:
            return
        g = param.grad
        part = get_array_module(g).ascontiguousarray(g[..., first_col:])
        group.all_reduce(part, "sum", out=part)
        g[..., first_col:] = part

    return sync
