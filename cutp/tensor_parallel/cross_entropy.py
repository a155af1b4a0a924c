"""Vocab-parallel softmax cross-entropy: the full logits are never gathered.

Input: sharded logits [..., V_pad/tp] (this rank's contiguous vocabulary range, from
ParallelLMHead) and replicated targets [...]. Output: the mean loss, identical on every TP rank.

Each rank reads its logits shard once in the forward (ops.ce_shard_forward: an online softmax
giving the shard's own row max and sum of exps, the target logit and the sum of logits in one
pass) and once in the backward: two passes over the logits per step.

Communication, O(rows) elements: one all-reduce (max) of the shards' row maxima; each rank then
rescales its sum of exps to the global max (ops.ce_rescale_sum, on [rows] vectors), and ONE
all-reduce (sum) of stacked per-row vectors: the sum of exps, the target logit (non-zero only on
the rank owning the target) and, with label smoothing only, the sum of logits. Label smoothing is
computed over the full real vocabulary, so every TP rank gets the same loss (Megatron's
implementation uses the local shard's mean instead: its issue 737). Columns of padded vocabulary
are masked: they never win the softmax and get zero gradient.

Backward needs no communication: each rank writes (softmax - one-hot) * scale over its shard.

Host synchronizations: the target count stays on the device (the backward's scale is computed
there); the loss is read once per forward, or not at all with `defer_loss` (the training step
sums the micro-batches' device losses and reads the sum once per step).
"""
from __future__ import annotations

import numpy as np

from .. import ops
from .parameter import Module


class VocabParallelCrossEntropy(Module):
    def __init__(self, ctx, vocab_size: int, padded_vocab: int, *, ignore_index: int = -100,
                 label_smoothing: float = 0.0):
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index
        self.label_smoothing = float(label_smoothing)
        per = padded_vocab // ctx.tp_size
        self.start = ctx.tp_rank * per
        self.width = per
        self.n_valid = max(0, min(vocab_size - self.start, per))
        # True: forward returns the loss as a float64 0-d array on the logits' device, unread
        # (cutp.train.step sets it for its micro-batches: one read of their sum per step)
        self.defer_loss = False

    def forward(self, logits, targets, inplace_backward: bool = False):
        """Mean loss over non-ignored targets (0.0 if there are none), as a float (`defer_loss`: a
        float64 0-d device array, the same value).

        With inplace_backward the logits buffer is overwritten by its gradient in backward
        (llm.c's fused classifier): the caller must not use the logits afterwards.
        """
        xp = self.ctx.xp
        tp = self.ctx.tp
        z = logits.reshape(-1, self.width)
        t = targets.reshape(-1)
        valid = t != self.ignore_index
        local_t = t - self.start
        mine = valid & (local_t >= 0) & (local_t < self.n_valid)
        local_t = xp.where(mine, local_t, -1).astype(xp.int64)

        eps = self.label_smoothing
        local_max, *parts = ops.ce_shard_forward(z, local_t, self.n_valid, need_sum_logits=eps > 0)
        row_max = local_max
        if tp.size > 1:
            row_max = tp.all_reduce(xp.ascontiguousarray(local_max), "max")
            parts[0] = ops.ce_rescale_sum(local_max, parts[0], row_max)
        stats = xp.stack([p for p in parts if p is not None])  # the sum of logits only for smoothing
        if tp.size > 1:
            tp.all_reduce(stats, "sum", out=stats)
        sum_exp, target_logit = stats[0], stats[1]

        logz = xp.log(sum_exp) + row_max  # log of the partition function per row
        nll = logz - target_logit
        if eps > 0:
            smooth = logz - stats[2] / self.vocab_size  # mean over classes of -log p_c
            per_row = (1.0 - eps) * nll + eps * smooth
        else:
            per_row = nll
        count = xp.maximum(valid.sum(), 1)  # on the device (no target counted: the sum below is 0)
        per_row = xp.where(valid, per_row, 0.0)
        loss = per_row.sum().astype(np.float64) / count  # (the float of the sum, divided in float64)
        self._save("ce", (z, row_max, sum_exp, local_t, valid, count, logits.shape, inplace_backward))
        return loss if self.defer_loss else float(loss)

    def backward(self, dloss: float = 1.0):
        """Gradient of the mean loss w.r.t. this rank's logits shard, shaped like the logits."""
        z, row_max, sum_exp, local_t, valid, count, shape, inplace = self._load("ce")
        xp = self.ctx.xp
        dtype = z.dtype if z.dtype.kind == "f" and z.dtype.itemsize >= 4 else xp.float32
        scale = (float(dloss) / count).astype(dtype)  # divided in float64, then rounded (no host read)
        row_scale = valid.astype(dtype) * scale
        d = ops.ce_shard_backward(z, row_max, sum_exp, local_t, self.n_valid, row_scale, self.label_smoothing,
                                  self.vocab_size, out=z if inplace else None)
        return d.reshape(shape)
