"""One expert of an MoE layer (cutp.tensor_parallel.moe): its parameters, replicated, and its own
forward and backward (and the MoE layer's declarations, `moe_parameters`), which LoRA adapters and frozen weights take (the layer otherwise runs its
local experts together in one grouped pass, `moe_grouped.GroupedExperts`)."""
from __future__ import annotations

from dataclasses import replace

from .. import ops
from .declare import ParamDecl, build_parameters, prefixed
from .layers import with_weight, without_weight
from .mlp import mlp_parameters
from .parameter import Module


def expert_parameters(n_embd, ffn, *, kind, bias, n_layer, n_experts=None) -> list:
    """One expert's declarations (`cutp.tensor_parallel.declare`): a dense MLP's tensors whole on
    every TP rank, each rank's tokens through them (`tp_partial`); with n_experts, a layer's
    routed experts' ("experts.*.", n_experts of each, divided over EP)."""
    decls = mlp_parameters(n_embd, ffn, kind=kind, bias=bias, n_layer=n_layer)
    if n_experts is None:
        return [replace(d, split="replicated", sp=False, tp_partial=True) for d in decls]
    return [replace(d, name=f"experts.*.{d.name}", split="expert", sp=False, tp_partial=True, count=n_experts)
            for d in decls]


def moe_parameters(n_embd, *, n_experts, ffn, kind="gelu", bias=True, n_layer=1, score_bias=False,
                   shared=None) -> list:
    """The MoE layer's declarations (`cutp.tensor_parallel.declare`): the router [h, E]
    (replicated, summed over TP under sequence parallelism), DeepSeek's correction bias (a buffer:
    no gradient), the shared experts' (`shared`: their MLP's declarations) and the routed experts'."""
    out = [ParamDecl("router.weight", (n_embd, n_experts), sp=True)]
    if score_bias:
        out.append(ParamDecl("router.score_bias", (n_experts,), grad=False, init="zeros"))
    return (out + prefixed("shared_experts", shared or [])
            + expert_parameters(n_embd, ffn, kind=kind, bias=bias, n_layer=n_layer, n_experts=n_experts))


class ExpertMLP(Module):
    """One expert's parameters: GPT-2's MLP (or with kind "swiglu" Llama's: fc1 the fused
    [gate | up]), replicated; the MoE layer's local experts are computed together
    (`moe_grouped.GroupedExperts`)."""

    def __init__(self, ctx, n_embd, ffn, *, name, n_layer, bias, gelu, seed, dtype, kind="gelu", params=None):
        """params: its parameters, the MoE layer's built from `expert_parameters` (None: built here)."""
        self.gelu = gelu
        self.kind = kind
        if params is None:
            params = build_parameters(ctx, expert_parameters(n_embd, ffn, kind=kind, bias=bias, n_layer=n_layer), name,
                                      seed=seed, dtype=dtype)
        self.fc1, self.fc2 = params["fc1.weight"], params["fc2.weight"]
        self.fc1_bias, self.fc2_bias = params.get("fc1.bias"), params.get("fc2.bias")
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
            return y, (without_weight(fc), g, without_weight(proj))
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
        return y, (without_weight(fc), g, without_weight(proj))

    def backward(self, dy, saved):
        fc, g, proj = saved[:3]
        lora = saved[3] if len(saved) > 3 else (None, None)
        da, _, db = ops.linear_backward(dy, with_weight(proj, self.fc2.data), wgrad_out=self.fc2.grad,
                                        need_dw=self.fc2.trainable)
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
        dx, _, db = ops.linear_backward(dh, with_weight(fc, self.fc1.data), wgrad_out=self.fc1.grad,
                                        need_dw=self.fc1.trainable)
        if self.kind == "swiglu" and db is not None and self.fc1_bias.trainable:
            self.fc1_bias.grad += db
        if lora[0] is not None:
            dx = dx + self.fc1_lora.backward(dh, lora[0])
        return dx
