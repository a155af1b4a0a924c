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
from .declare import below, build_parameters, linear_parameters, prefixed
from .layers import ColumnParallelLinear, RowParallelLinear
from .parameter import Module
from .validation import check_mlp

GATED = ("swiglu", "geglu")


def mlp_parameters(n_embd, hidden, *, kind="gelu", bias=True, n_layer=1) -> list:
    """The MLP's declarations (`cutp.tensor_parallel.declare`): fc1 h -> hidden column-split (gated
    kinds: h -> 2 hidden, [gate | up] split gate_r ; up_r), fc2 hidden -> h row-split (GPT-2's
    0.02 / sqrt(2 n_layer))."""
    gated = kind in GATED
    return (prefixed("fc1", linear_parameters(n_embd, 2 * hidden if gated else hidden, bias=bias,
                                              split="gate_up" if gated else "column"))
            + prefixed("fc2", linear_parameters(hidden, n_embd, bias=bias, split="row",
                                                init=0.02 / math.sqrt(2 * n_layer))))


class ParallelMLP(Module):
    def __init__(self, ctx, n_embd, hidden, *, name, n_layer=1, bias=True, gelu="tanh", seed=0, dtype=np.float32,
                 kind="gelu", params=None):
        """kind: "gelu" (GPT-2), "swiglu" (Llama: hidden is the gate's and the up's width) or "geglu"
        (Gemma: swiglu's layout, gelu(gate) * up with `gelu`'s approximation). params: its
        parameters, built from `mlp_parameters` (None: built here)."""
        check_mlp(n_embd, hidden, ctx.tp_size)
        self.ctx = ctx
        self.gelu = gelu
        self.kind = kind
        self.has_bias = bias
        if params is None:
            params = build_parameters(ctx, mlp_parameters(n_embd, hidden, kind=kind, bias=bias, n_layer=n_layer), name,
                                      seed=seed, dtype=dtype)
        width = 2 * hidden if kind in GATED else hidden
        self.fc1 = ColumnParallelLinear(ctx, n_embd, width, name=f"{name}.fc1", skip_bias_add=kind not in GATED,
                                        params=below(params, "fc1"))
        self.fc2 = RowParallelLinear(ctx, hidden, n_embd, name=f"{name}.fc2", params=below(params, "fc2"))

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
