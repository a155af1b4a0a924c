"""Tensor-parallel linear, embedding, LM-head, LayerNorm, RMSNorm and dropout layers.

Each layer names its input and output layout: "replicated" (identical on every TP rank),
"sharded" (split along the last dimension, this rank's part) or, with `sequence_parallel` set
(`GPT.set_sequence_parallel`), "sequence-sharded" (split along the sequence, axis 1 of
[B, T, h]: this rank's T/tp tokens). Weights use GPT-2's Conv1D layout [in, out]; the LM head
shares the token embedding's [vocab, hidden] table.

Under sequence parallelism the parameters used on sequence shards (LayerNorms, the row layers'
biases, the position embedding) get only this rank's tokens' part of their gradient; they are
marked `Parameter.sequence_parallel` and summed over TP once per step (`tp_grad_sync`).
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..ops.common import as_dtype, compute_dtype
from ..runtime.backend import get_array_module
from .context_parallel import local_segments
from .mappings import (
    copy_to_tp_backward,
    start_input_grad_sum,
    gather_from_sp_backward,
    gather_from_sp_forward,
    gather_from_tp_backward,
    gather_from_tp_forward,
    reduce_from_tp_forward,
    reduce_scatter_to_sp_backward,
    reduce_scatter_to_sp_forward,
    scatter_to_tp_backward,
    scatter_to_tp_forward,
)
from .declare import build_parameters, linear_parameters, norm_parameters, vocab_parameters
from .parameter import Module
from .random import REPLICATED, RNGTracker


def without_weight(op_ctx):
    """A linear or norm op's forward context, to keep for the backward, without the weight it
    refers to: ZeRO-3 frees each unit's gathered parameters after its forward, and a view of them
    kept here would hold the whole unit until its backward (every unit whole by the end of the
    forward). The backward hands the weight back (`with_weight`), gathered again by then."""
    return with_weight(op_ctx, None)


def with_weight(op_ctx, weight):
    """`without_weight`'s context with its weight back, as the parameter now holds it."""
    setattr(op_ctx, "w" if hasattr(op_ctx, "w") else "weight", weight)  # (LinearCtx's w; the norms' weight)
    return op_ctx


class ColumnParallelLinear(Module):
    """y = x @ W + b with W [in, out] split by output columns.

    Input: replicated [..., in]. Output: sharded [..., out/tp], or replicated [..., out] with
    gather_output. Forward needs no communication; backward all-reduces dx over TP (`f`).
    With sequence_parallel: input sequence-sharded [B, T/tp, in], all-gathered along the
    sequence before the matmul (the gathered input is what backward keeps); backward
    reduce-scatters dx along the sequence instead of all-reducing it.
    With skip_bias_add, forward returns (x @ W_shard, b_shard) so the caller can fuse the bias
    into the next op (bias + GeLU) and hands the bias gradient back via `accumulate_bias_grad`.
    """

    def __init__(self, ctx, in_features, out_features, *, name, bias=True, gather_output=False,
                 skip_bias_add=False, init=None, seed=0, dtype=np.float32, params=None):
        """init: the weight's std (None: 0.02). params: {"weight", "bias"} its owner built from its
        declarations (a fused qkv or gate_up projection's); None: its own, column-split."""
        self.ctx = ctx
        self.name = name
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = False
        self.comm_overlap = False  # --tp-comm-overlap: dX's collective under the weight-gradient GEMM
        self.lora = None  # LoRA pairs on its output columns (cutp.tensor_parallel.lora)
        if params is None:
            params = build_parameters(ctx, linear_parameters(in_features, out_features, bias=bias, init=init), name,
                                      seed=seed, dtype=dtype)
        self.weight, self.bias = params["weight"], params.get("bias")

    def lay_out_sequence(self, on, shard):
        self.sequence_parallel = on

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sp_forward(self.ctx.tp, x)
        add_bias = self.bias is not None and not self.skip_bias_add
        y, lctx = ops.linear_forward(x, self.weight.data, self.bias.data if add_bias else None)
        self._save("linear", without_weight(lctx))
        if self.lora is not None:  # its columns of the low-rank products, before any gather
            self._save("lora", self.lora.forward(x, y))
        if self.gather_output:
            y = gather_from_tp_forward(self.ctx.tp, y)
        if self.skip_bias_add:
            return y, (self.bias.data if self.bias is not None else None)
        return y

    def accumulate_bias_grad(self, db):
        if self.bias.trainable:
            self.bias.grad += db

    def backward(self, dy, need_dx=True):
        if self.gather_output:
            dy = gather_from_tp_backward(self.ctx.tp, dy)
        if self.comm_overlap and need_dx and self.ctx.tp_size > 1:
            return self._backward_overlapped(dy)
        lctx = with_weight(self._load("linear"), self.weight.data)
        dx, _, db = ops.linear_backward(dy, lctx, need_dx=need_dx, wgrad_out=self.weight.grad,
                                        need_dw=self.weight.trainable)
        if db is not None and self.bias.trainable:
            self.bias.grad += db
        if self.lora is not None:  # its part of dx joins the base's before their one TP sum
            dx_lora = self.lora.backward(dy, self._load("lora"), need_dx)
            dx = dx + dx_lora if need_dx else dx
        if need_dx:
            sum_over_tp = gather_from_sp_backward if self.sequence_parallel else copy_to_tp_backward
            dx = sum_over_tp(self.ctx.tp, dx)
        return dx

    def _backward_overlapped(self, dy):
        """--tp-comm-overlap (Megatron's async dgrad all-reduce): the dX GEMM, then dX's
        collective started, the weight-gradient GEMM while it runs, then the wait. dX = dy @ W^T
        is linear_forward(dy, W^T), the product linear_backward computes (the same matmul of
        the same operands: the same bits, tests/train/test_overlap.py)."""
        lctx = with_weight(self._load("linear"), self.weight.data)
        dx, _ = ops.linear_forward(dy, lctx.w.T)
        if self.lora is not None:
            dx = dx + self.lora.backward(dy, self._load("lora"))
        finish = start_input_grad_sum(self.ctx.tp, dx, self.sequence_parallel)
        _, _, db = ops.linear_backward(dy, lctx, need_dx=False, wgrad_out=self.weight.grad,
                                       need_dw=self.weight.trainable)
        if db is not None and self.bias.trainable:
            self.bias.grad += db
        return finish()


class RowParallelLinear(Module):
    """y = x @ W + b with W [in, out] split by input rows.

    Input: sharded [..., in/tp] (input_is_parallel, the usual case after a column layer) or
    replicated [..., in] (sliced here). Output: replicated [..., out]. Forward all-reduces the
    partial products (`g`); the bias is replicated and added once after the reduction.
    Backward needs no communication (unless the input was replicated: then dx is gathered).
    With sequence_parallel: forward reduce-scatters the partial products along the sequence
    instead (output sequence-sharded [B, T/tp, out], the bias added to this rank's tokens);
    backward all-gathers dy along the sequence first.
    """

    def __init__(self, ctx, in_features, out_features, *, name, bias=True, input_is_parallel=True,
                 init=None, seed=0, dtype=np.float32, params=None):
        """init: the weight's std (None: 0.02); params: {"weight", "bias"} from its owner's
        declarations (None: its own)."""
        self.ctx = ctx
        self.name = name
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = False
        self.lora = None  # LoRA pairs: their partial products reduced with the base's (cutp.tensor_parallel.lora)
        if params is None:
            params = build_parameters(ctx, linear_parameters(in_features, out_features, bias=bias, split="row",
                                                             init=init), name, seed=seed, dtype=dtype)
        self.weight, self.bias = params["weight"], params.get("bias")  # (the bias: added to this rank's tokens)

    def lay_out_sequence(self, on, shard):
        self.sequence_parallel = on

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp_forward(self.ctx.tp, x)
        y, lctx = ops.linear_forward(x, self.weight.data)
        self._save("linear", without_weight(lctx))
        if self.lora is not None:  # this rank's x_r A_r B, summed over TP with the base's x_r W_r
            self._save("lora", self.lora.forward(x, y))
        if self.sequence_parallel:
            y = reduce_scatter_to_sp_forward(self.ctx.tp, y)
        else:
            y = reduce_from_tp_forward(self.ctx.tp, y)
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, dy, need_dx=True):
        if self.bias is not None and self.bias.trainable:  # 16-bit dy: summed in float32, not row by row in 16 bits
            dy2 = dy.reshape(-1, dy.shape[-1])
            if ops.on_cublas(dy2):  # a GEMM ones @ dy2 adding into the float32 main_grad
                ops.column_sums(dy2, out=self.bias.grad)
            else:
                self.bias.grad += as_dtype(dy2, compute_dtype(dy.dtype)).sum(axis=0)
        if self.sequence_parallel:
            dy = reduce_scatter_to_sp_backward(self.ctx.tp, dy)
        lctx = with_weight(self._load("linear"), self.weight.data)
        dx, _, _ = ops.linear_backward(dy, lctx, need_dx=need_dx, wgrad_out=self.weight.grad,
                                       need_dw=self.weight.trainable)
        if self.lora is not None:
            dx_lora = self.lora.backward(dy, self._load("lora"), need_dx)
            dx = dx + dx_lora if need_dx else dx
        if need_dx and not self.input_is_parallel:
            dx = scatter_to_tp_backward(self.ctx.tp, dx)
        return dx


class VocabParallelEmbedding(Module):
    """Token embedding with the vocabulary split into contiguous ranges over TP.

    Input: replicated token ids [...]. Output: replicated [..., dim]. Ids outside this rank's
    range produce zeros locally; one all-reduce (b*s*dim elements) sums the ranks' parts (with
    sequence_parallel a reduce-scatter along the sequence: output [B, T/tp, dim]). The
    table has `padded_vocab` rows; rows >= vocab_size are zero and, since no id reaches them and
    the cross-entropy masks their logits, they never receive gradient.
    """

    def __init__(self, ctx, vocab_size, padded_vocab, dim, *, name, seed=0, dtype=np.float32, scale=None,
                 params=None):
        """scale: the rows multiplied by this number (Gemma's sqrt(dim)) rounded to the table's dtype,
        as transformers' scaled embedding does; None: no scaling. params: {"weight"} from the
        model's declarations (None: its own, `vocab_parameters`)."""
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab
        params = params or build_parameters(ctx, vocab_parameters(vocab_size, padded_vocab, dim, ctx.tp_size), name,
                                            seed=seed, dtype=dtype)
        self.weight = params["weight"]
        self.scale = None if scale is None else np.asarray(scale, dtype=self.weight.data.dtype)  # (the table's)
        per = padded_vocab // ctx.tp_size
        self.start, self.end = ctx.tp_rank * per, (ctx.tp_rank + 1) * per
        self.sequence_parallel = False

    def lay_out_sequence(self, on, shard):
        self.sequence_parallel = on

    def forward(self, ids):
        xp = self.ctx.xp
        if self.ctx.tp_size == 1:
            y, ectx = ops.embedding_forward(ids, self.weight.data)
        else:
            mask = (ids >= self.start) & (ids < self.end)
            local = xp.where(mask, ids - self.start, 0)
            y, ectx = ops.embedding_forward(local, self.weight.data, mask)
        self._save("emb", ectx)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp_forward(self.ctx.tp, y)
        else:
            y = reduce_from_tp_forward(self.ctx.tp, y)
        return y if self.scale is None else self._scaled(y)

    def _scaled(self, a):
        """a * scale, in a's dtype (16-bit: the product rounded once, as a 16-bit multiply)."""
        cdt = compute_dtype(a.dtype)
        return as_dtype(as_dtype(a, cdt) * cdt.type(self.scale), a.dtype)

    def backward(self, dy):
        if self.scale is not None:
            dy = self._scaled(dy)
        if self.sequence_parallel:
            dy = reduce_scatter_to_sp_backward(self.ctx.tp, dy)
        ectx = self._load("emb")
        if self.weight.trainable:
            ops.embedding_backward(dy, ectx, self.weight.grad)
        return None


class ParallelLMHead(Module):
    """logits = x @ E^T with E the [vocab, dim] table split by vocabulary rows.

    Input: replicated [..., dim]. Output: sharded logits [..., padded_vocab/tp] for this rank's
    vocabulary range; feed them to VocabParallelCrossEntropy, never gather them. Backward
    all-reduces dx over TP. With a tied embedding (GPT-2) the table is the embedding's Parameter,
    so both gradient contributions land in the same buffer. With sequence_parallel the input is
    sequence-sharded [B, T/tp, dim], all-gathered before the matmul; backward reduce-scatters dx.
    """

    def __init__(self, ctx, embedding: VocabParallelEmbedding | None = None, *, vocab_size=None, padded_vocab=None,
                 dim=None, name="lm_head", seed=0, dtype=np.float32, params=None):
        self.ctx = ctx
        self.sequence_parallel = False
        if embedding is not None:
            self._shared_weight = embedding.weight  # tied: counted once, as the embedding's
            self.vocab_size, self.padded_vocab = embedding.vocab_size, embedding.padded_vocab
        else:
            params = params or build_parameters(ctx, vocab_parameters(vocab_size, padded_vocab, dim, ctx.tp_size),
                                                name, seed=seed, dtype=dtype)
            self.weight = params["weight"]
            self.vocab_size, self.padded_vocab = vocab_size, padded_vocab

    @property
    def table(self):
        return self._shared_weight if hasattr(self, "_shared_weight") else self.weight

    def lay_out_sequence(self, on, shard):
        self.sequence_parallel = on

    def forward(self, x):
        # cutp.ops.gemm: 16-bit inputs on cuBLAS with float32 accumulation on a GPU; on the CPU
        # multiplied in float32 (cutp.ops' dtype policy), never in NumPy's slow 16-bit loops
        if self.sequence_parallel:
            x = gather_from_sp_forward(self.ctx.tp, x)
        w = self.table.data
        x2 = x.reshape(-1, x.shape[-1])
        logits = ops.gemm(ops.gemm_operand(x2), ops.gemm_operand(w), trans_b=True, out_dtype=x.dtype)
        self._save("x2", x2)
        return logits.reshape(x.shape[:-1] + (w.shape[0],))

    def backward(self, dlogits):
        x2 = self._load("x2")
        w = self.table
        d2 = ops.gemm_operand(dlogits.reshape(-1, dlogits.shape[-1]))
        # float32 main_grad: the product added unrounded (on a GPU inside the GEMM, beta = 1)
        if w.trainable:
            ops.gemm(d2, ops.gemm_operand(x2), trans_a=True, out=w.grad, accumulate=True)
        dx = ops.gemm(d2, ops.gemm_operand(w.data), out_dtype=x2.dtype).reshape(dlogits.shape[:-1] + (x2.shape[1],))
        if self.sequence_parallel:
            return gather_from_sp_backward(self.ctx.tp, dx)
        return copy_to_tp_backward(self.ctx.tp, dx)


class LogitSoftcap(Module):
    """Soft-capped logits, cap * tanh(x / cap) (Gemma 2's final_logit_softcapping): elementwise on
    this rank's vocabulary-parallel shard, so no communication; its own tanh kept for backward."""

    def __init__(self, cap: float):
        self.cap = float(cap)

    def forward(self, logits):
        y, sctx = ops.softcap_forward(logits, self.cap)
        self._save("softcap", sctx)
        return y

    def backward(self, dy):
        return ops.softcap_backward(dy, self._load("softcap"))


class LayerNorm(Module):
    """LayerNorm over the last dimension, replicated: identical inputs, parameters and gradients
    on every TP rank (no communication; each rank computes the same gradient). On sequence
    shards (sequence parallelism) each rank's gradient covers its tokens only: the parameters
    are then marked `sequence_parallel` and summed over TP by `tp_grad_sync`."""

    def __init__(self, ctx, dim, *, name, eps=1e-5, bias=True, seed=0, dtype=np.float32, params=None):
        """params: {"weight", "bias"} from its owner's declarations (None: its own, `norm_parameters`)."""
        self.ctx = ctx
        self.eps = eps
        params = params or build_parameters(ctx, norm_parameters("layernorm", dim, bias=bias), name, seed=seed,
                                            dtype=dtype)
        self.weight, self.bias = params["weight"], params.get("bias")

    def forward(self, x):
        y, lctx = ops.layernorm_forward(x, self.weight.data, self.bias.data if self.bias is not None else None, self.eps)
        self._save("ln", without_weight(lctx))
        return y

    def forward_residual(self, x, branch):
        """(s, y): the residual add s = x + branch, then this norm of s (RMSNorm fuses the two)."""
        s = x + branch
        return s, self.forward(s)

    def backward(self, dy):
        dx, dw, db = ops.layernorm_backward(dy, with_weight(self._load("ln"), self.weight.data))
        if self.weight.trainable:
            self.weight.grad += dw
        if self.bias is not None and self.bias.trainable:
            self.bias.grad += db
        return dx


class RMSNorm(Module):
    """RMSNorm over the last dimension (Llama, Qwen2, Mistral: `cutp.ops.rmsnorm_forward`, HF's
    rounding order), replicated like LayerNorm (its weight summed over TP under sequence
    parallelism, as LayerNorm's).

    offset (Gemma): the scale is (1 + weight), the weight stored as transformers stores it and
    initialised to zeros; 1 + weight is formed in the compute dtype (float32 for 16-bit models, as
    Gemma's `1.0 + weight.float()`), 16-bit outputs rounded once after it (Gemma's order, not
    Llama's), and its gradient is the weight's."""

    def __init__(self, ctx, dim, *, name, eps=1e-6, seed=0, dtype=np.float32, offset=False, params=None):
        """params: {"weight"} from its owner's declarations (None: its own, `norm_parameters`)."""
        self.ctx = ctx
        self.eps = eps
        self.offset = bool(offset)
        params = params or build_parameters(ctx, norm_parameters("rmsnorm", dim, offset=offset), name, seed=seed,
                                            dtype=dtype)
        self.weight = params["weight"]
        self.bias = None  # (no bias: the attribute LayerNorm's callers read)

    def _scale(self):
        w = self.weight.data
        return as_dtype(w, compute_dtype(w.dtype)) + 1.0 if self.offset else w

    def forward(self, x):
        y, rctx = ops.rmsnorm_forward(x, self._scale(), self.eps, round_first=not self.offset)
        self._save("rms", without_weight(rctx))
        return y

    def forward_residual(self, x, branch):
        """(s, y): the residual add s = x + branch and this norm of s in one pass (on a GPU one
        kernel reading x and branch once: llm.c's fused_residual_forward); `backward` is the
        norm's (the add's is the identity)."""
        s, y, rctx = ops.residual_rmsnorm_forward(x, branch, self._scale(), self.eps, round_first=not self.offset)
        self._save("rms", without_weight(rctx))
        return s, y

    def backward(self, dy):
        dx, dw = ops.rmsnorm_backward(dy, with_weight(self._load("rms"), self._scale()))
        if self.weight.trainable:
            self.weight.grad += dw
        return dx


def make_norm(ctx, kind: str, dim, *, name, eps, bias, seed=0, dtype=np.float32, offset=False, params=None):
    """A LayerNorm (with a bias when `bias`) or an RMSNorm (its scale 1 + weight when `offset`:
    Gemma's), by the spec's `norm`."""
    if kind == "rmsnorm":
        return RMSNorm(ctx, dim, name=name, eps=eps, seed=seed, dtype=dtype, offset=offset, params=params)
    return LayerNorm(ctx, dim, name=name, eps=eps, bias=bias, seed=seed, dtype=dtype, params=params)


class Dropout(Module):
    """Dropout whose mask comes from one stream of an RNGTracker ("replicated" or "sharded"), or,
    for a named `site` once the tracker has a position (training), from the element's global
    position (cutp.tensor_parallel.random), so that no layout changes the masks. Input and output:
    whatever layout: a replicated activation [B, T, h], or with `sequence_shard = (rank, size)`
    this rank's part [B, T/size, h] of every sequence, masked as that part of the whole."""

    def __init__(self, p: float, rng: RNGTracker, stream: str, site: str | None = None):
        self.p = float(p)
        self.rng = rng
        self.stream = stream
        self.site = site
        self.sequence_shard: tuple[int, int] | None = None
        # (cp_rank, cp): context parallelism, the tokens are this CP rank's zigzag chunks
        # (cutp.tensor_parallel.context_parallel), masked at their global positions
        self.context_shard: tuple[int, int] | None = None

    def draw_rows(self, rows: int, row_elems: int, first_elem: int = 0, global_row_elems: int | None = None):
        """``(p, seed, offsets)``: the first counter of each of `rows` local batch rows, whose
        `row_elems` elements sit at [first_elem, first_elem + row_elems) of a global row of
        `global_row_elems` (default row_elems): by position when the tracker has one and the site
        a name, else from the stream. ``p`` 0.0 (offsets all 0) in eval mode or without dropout."""
        if not self.training or self.p == 0.0:
            return 0.0, 0, [0] * rows
        per_row = global_row_elems or row_elems
        if self.rng.position is None or self.site is None:  # the whole rows from the stream
            seed, offset = self.rng.draw(self.stream, rows * per_row)
            return self.p, seed, [offset + r * per_row + first_elem for r in range(rows)]
        step, row0, batch = self.rng.position
        return self.p, self.rng.site_seed(self.site), [(step * batch + row0 + r) * per_row + first_elem
                                                       for r in range(rows)]

    def lay_out_sequence(self, on, shard):
        if self.stream == REPLICATED:  # the residual stream's (the attention's probabilities stay whole)
            self.sequence_shard = shard

    def lay_out_context(self, shard):
        if self.stream == REPLICATED:
            self.context_shard = shard

    def forward(self, x):
        if self.context_shard is not None:
            return self._forward_context_parallel(x)
        rows = x.shape[0] if x.ndim else 1
        row_elems = x.size // max(rows, 1)
        if self.sequence_shard is None:
            p, seed, offsets = self.draw_rows(rows, row_elems)
        else:  # a sequence shard's elements are contiguous within the row of the whole sequence
            rank, size = self.sequence_shard
            p, seed, offsets = self.draw_rows(rows, row_elems, rank * row_elems, size * row_elems)
        if p == 0.0:
            self._save("ctx", None)
            return x
        y, dctx = ops.dropout_forward_rows(x, p, seed, offsets)  # one piece when the rows follow each other
        self._save("ctx", dctx)
        return y

    def _forward_context_parallel(self, x):
        """x [B, T_here, ...]: tokens of this CP rank's local sequence (its TP shard of them under
        sequence parallelism), each masked as the same token of the whole sequence."""
        cp_rank, cp = self.context_shard
        sp_rank, sp = self.sequence_shard or (0, 1)
        B, here = x.shape[0], x.shape[1]
        token = x[0, 0].size  # elements per token
        local_len = here * sp
        p, seed, offsets = self.draw_rows(B, here * token, 0, local_len * cp * token)
        if p == 0.0:
            self._save("ctx", None)
            return x
        xp = get_array_module(x)
        runs = local_segments(local_len, cp, cp_rank, sp_rank * here, (sp_rank + 1) * here)
        mask = xp.concatenate([xp.stack([ops.dropout_mask(xp, (n,) + x.shape[2:], p, seed, o + first * token)
                                         for o in offsets]) for _, first, n in runs], axis=1)
        y, dctx = ops.dropout_forward_mask(x, p, mask)
        self._save("ctx", dctx)
        return y

    def backward(self, dy):
        dctx = self._load("ctx")
        if dctx is None:
            return dy
        return ops.dropout_backward(dy, dctx)
