"""One expert of an MoE layer (cutp.tensor_parallel.moe): its parameters, replicated, and its own
forward and backward, which LoRA adapters and frozen weights take (the layer otherwise runs its
local experts together in one grouped pass, `moe_grouped.GroupedExperts`)."""
from __future__ import annotations

import math

from .. import ops
from .parameter import Module, make_parameter, normal_init, zeros_init


class ExpertMLP(Module):
    """One expert's parameters: GPT-2's MLP (or with kind "swiglu" Llama's: fc1 the fused
    [gate | up]), replicated; the MoE layer's local experts are computed together
    (`moe_grouped.GroupedExperts`)."""

    def __init__(self, ctx, n_embd, ffn, *, name, n_layer, bias, gelu, seed, dtype, kind="gelu"):
        self.gelu = gelu
        self.kind = kind
        fc = 2 * ffn if kind == "swiglu" else ffn
        self.fc1 = make_parameter(ctx, f"{name}.fc1.weight", (n_embd, fc), normal_init(0.02), seed=seed, dtype=dtype,
                                   weight_decay=True)
        self.fc2 = make_parameter(ctx, f"{name}.fc2.weight", (ffn, n_embd),
                                     normal_init(0.02 / math.sqrt(2 * n_layer)), seed=seed, dtype=dtype,
                                     weight_decay=True)
        self.fc1_bias = self.fc2_bias = None
        if bias:
            self.fc1_bias = make_parameter(ctx, f"{name}.fc1.bias", (fc,), zeros_init, seed=seed, dtype=dtype)
            self.fc2_bias = make_parameter(ctx, f"{name}.fc2.bias", (n_embd,), zeros_init, seed=seed,
                                              dtype=dtype)
        for p in self.own_parameters():
            p.tp_partial = True  # each TP rank runs its own tokens through the expert
        self.fc1_lora = self.fc2_lora = None  # LoRA pairs (cutp.tensor_parallel.lora)

    def forward(self, x):
        lora = [None, None]  # the adapters' contexts (fc1's, fc2's)
        y, saved = self._forward(x, lora)
        if self.fc1_lora is None and self.fc2_lora is None:
            return y, saved
        return y, saved + (lora,)

    def _forward(self, x, lora):
        if self.kind == "swiglu":
            h, fc = ops.linear_forward(x, self.fc1.data, None if self.fc1_bias is None else self.fc1_bias.data)
            if self.fc1_lora is not None:
                lora[0] = self.fc1_lora.forward(x, h)
            a, g = ops.swiglu_forward(h)
            y, proj = ops.linear_forward(a, self.fc2.data,
                                         None if self.fc2_bias is None else self.fc2_bias.data)
            if self.fc2_lora is not None:
                lora[1] = self.fc2_lora.forward(a, y)
            return y, (fc, g, proj)
        h, fc = ops.linear_forward(x, self.fc1.data)
        if self.fc1_lora is not None:
            lora[0] = self.fc1_lora.forward(x, h)
        if self.fc1_bias is not None:
            a, g = ops.bias_gelu_forward(h, self.fc1_bias.data, approximate=self.gelu)
        else:
            a, g = ops.gelu_forward(h, approximate=self.gelu)
        y, proj = ops.linear_forward(a, self.fc2.data, None if self.fc2_bias is None else self.fc2_bias.data)
        if self.fc2_lora is not None:
            lora[1] = self.fc2_lora.forward(a, y)
        return y, (fc, g, proj)

    def backward(self, dy, saved):
        fc, g, proj = saved[:3]
        lora = saved[3] if len(saved) > 3 else (None, None)
        da, _, db = ops.linear_backward(dy, proj, wgrad_out=self.fc2.grad, need_dw=self.fc2.trainable)
        if db is not None and self.fc2_bias.trainable:
            self.fc2_bias.grad += db
        if lora[1] is not None:
            da = da + self.fc2_lora.backward(dy, lora[1])
        if self.kind == "swiglu":
            dh = ops.swiglu_backward(da, g)
        elif self.fc1_bias is not None:
            dh, db = ops.bias_gelu_backward(da, g)
            if self.fc1_bias.trainable:
                self.fc1_bias.grad += db
        else:
            dh = ops.gelu_backward(da, g)
        dx, _, db = ops.linear_backward(dh, fc, wgrad_out=self.fc1.grad, need_dw=self.fc1.trainable)
        if self.kind == "swiglu" and db is not None and self.fc1_bias.trainable:
            self.fc1_bias.grad += db
        if lora[0] is not None:
            dx = dx + self.fc1_lora.backward(dh, lora[0])
        return dx
