"""The tensor-parallel MLP of a transformer block (and of DeepSeekMoE's shared experts).

ParallelMLP: replicated [B, T, h] -> column (h -> 4h, sharded) -> bias + GeLU (fused) -> row
(4h -> h, all-reduce) -> replicated [B, T, h]. With kind="swiglu" (Llama): one column projection
h -> 2F whose shard is this rank's [gate_r ; up_r] (`sharding.gate_up_sharding`), silu(gate) *
up on the local tensor (`ops.swiglu_forward`), then the row projection F -> h ("down").
kind="geglu" (Gemma): the same layout with gelu(gate) * up (`ops.geglu_forward`, tanh GeLU).
Which kind a block uses is its `MLPSpec`'s (cutp.tensor_parallel.specs).
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops
from .layers import ColumnParallelLinear, RowParallelLinear
from .parameter import Module, normal_init
from .sharding import gate_up_sharding
from .validation import check_mlp


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
