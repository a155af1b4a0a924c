"""The MLP and the pre-LN GPT-2 transformer block.

ParallelMLP: replicated [B, T, h] -> column (h -> 4h, sharded) -> bias + GeLU (fused) -> row
(4h -> h, all-reduce) -> replicated [B, T, h].

ParallelTransformerBlock: x + dropout(attn(ln_1(x))), then x + dropout(mlp(ln_2(x))).
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

import numpy as np

from .. import ops
from .attention import ParallelAttention
from .layers import ColumnParallelLinear, Dropout, LayerNorm, RowParallelLinear
from .moe import MoEMLP
from .parameter import Module, normal_init, not_stashed
from .random import REPLICATED, RNGTracker
from .validation import check_mlp


class ParallelMLP(Module):
    def __init__(self, ctx, n_embd, hidden, *, name, n_layer=1, bias=True, gelu="tanh", seed=0, dtype=np.float32):
        check_mlp(n_embd, hidden, ctx.tp_size)
        self.ctx = ctx
        self.gelu = gelu
        self.has_bias = bias
        self.c_fc = ColumnParallelLinear(ctx, n_embd, hidden, name=f"{name}.c_fc", bias=bias, skip_bias_add=True,
                                         seed=seed, dtype=dtype)
        self.c_proj = RowParallelLinear(ctx, hidden, n_embd, name=f"{name}.c_proj", bias=bias, seed=seed, dtype=dtype,
                                        init=normal_init(0.02 / math.sqrt(2 * n_layer)))

    def forward(self, x):
        h, b = self.c_fc.forward(x)
        if b is not None:
            a, gctx = ops.bias_gelu_forward(h, b, approximate=self.gelu)
        else:
            a, gctx = ops.gelu_forward(h, approximate=self.gelu)
        self._save("gelu", gctx)
        return self.c_proj.forward(a)

    def backward(self, dy):
        da = self.c_proj.backward(dy)
        if self.has_bias:
            dh, db = ops.bias_gelu_backward(da, self._load("gelu"))
            self.c_fc.accumulate_bias_grad(db)
        else:
            dh = ops.gelu_backward(da, self._load("gelu"))
        return self.c_fc.backward(dh)


class ParallelTransformerBlock(Module):
    """Pre-LN GPT-2 block. Input and output: replicated [B, T, n_embd]."""

    def __init__(self, ctx, n_embd, n_head, n_kv_head=None, mlp_hidden=None, *, name, rng: RNGTracker, n_layer=1,
                 bias=True, dropout=0.0, gelu="tanh", ln_eps=1e-5, seed=0, dtype=np.float32, moe: dict | None = None):
        """moe: MoEMLP's settings (n_experts, top_k, ffn, ...) for a mixture-of-experts MLP."""
        mlp_hidden = mlp_hidden or 4 * n_embd
        self.ln_1 = LayerNorm(ctx, n_embd, name=f"{name}.ln_1", eps=ln_eps, bias=bias, seed=seed, dtype=dtype)
        self.attn = ParallelAttention(ctx, n_embd, n_head, n_kv_head, name=f"{name}.attn", rng=rng, n_layer=n_layer,
                                      bias=bias, attn_dropout=dropout, seed=seed, dtype=dtype)
        self.attn_dropout = Dropout(dropout, rng, REPLICATED, site=f"{name}.attn_resid_dropout")
        self.ln_2 = LayerNorm(ctx, n_embd, name=f"{name}.ln_2", eps=ln_eps, bias=bias, seed=seed, dtype=dtype)
        if moe:
            self.mlp = MoEMLP(ctx, n_embd, **moe, name=f"{name}.mlp", n_layer=n_layer, bias=bias, gelu=gelu, seed=seed,
                              dtype=dtype)
        else:
            self.mlp = ParallelMLP(ctx, n_embd, mlp_hidden, name=f"{name}.mlp", n_layer=n_layer, bias=bias, gelu=gelu,
                                   seed=seed, dtype=dtype)
        self.mlp_dropout = Dropout(dropout, rng, REPLICATED, site=f"{name}.mlp_dropout")
        self.rng = rng
        self.recompute = False  # full recomputation: keep only the input (module docstring)

    def _forward(self, x):
        x = x + self.attn_dropout.forward(self.attn.forward(self.ln_1.forward(x)))
        return x + self.mlp_dropout.forward(self.mlp.forward(self.ln_2.forward(x)))

    def forward(self, x):
        if not (self.recompute and self.training):
            return self._forward(x)
        self._save("input", (x, dict(self.rng.offsets), self.rng.position))  # and where the dropout draws stood
        with not_stashed(self):
            return self._forward(x)

    def backward(self, dy):
        if self.recompute:
            x, offsets, position = self._load("input")
            after = self.rng.offsets, self.rng.position
            self.rng.offsets, self.rng.position = dict(offsets), position
            try:
                self._forward(x)  # the first pass again, this time stashed
            finally:
                self.rng.offsets, self.rng.position = after
        # dy flows into both the residual and the MLP branch
        dx = dy + self.ln_2.backward(self.mlp.backward(self.mlp_dropout.backward(dy)))
        return dx + self.ln_1.backward(self.attn.backward(self.attn_dropout.backward(dx)))

    def forward_cached(self, x, cache):
        """Eval-mode incremental forward for generation (see ParallelAttention.forward_cached)."""
        x = x + self.attn.forward_cached(self.ln_1.forward(x), cache)
        return x + self.mlp.forward(self.ln_2.forward(x))
