"""The pre-norm transformer block, built from a `BlockSpec` of submodule specs.

ParallelTransformerBlock: x + dropout(attn(norm_1(x))), then x + dropout(mlp(norm_2(x))). Which
norm, attention and MLP is the spec's choice (cutp.tensor_parallel.specs: `NormSpec`,
`AttentionSpec` or `MLASpec`, `MLPSpec` or `MoESpec`), each built by its own `build`; the block
has no branch on a kind. With a `post_norm` (Gemma 2 and 3) each branch's output is normalised
too before the residual add: x + dropout(post_attn_norm(attn(attn_norm(x)))), then
x + dropout(post_mlp_norm(mlp(mlp_norm(x)))). Learned positions are the model's, added before
the first block. Communication per block: 2 all-reduces of B*T*h forward (the two row
projections) and 2 backward (dx of the two column projections).

Activation recomputation (`ParallelTransformerBlock.recompute`, set by `GPT.set_recompute`):
"full" keeps only the block's input; its first forward stashes nothing (`not_stashed`), and
backward reruns the forward from the input, with the dropout streams put back where they were,
so the masks, the activations and the gradients are those of the first pass bit for bit.
"selective" is the attention's (`ParallelAttention.recompute_core`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layers import Dropout
from .mlp import ParallelMLP  # (re-exported: its home before the specs)
from .parameter import Module, not_stashed
from .random import REPLICATED, RNGTracker
from .specs import AttentionSpec, MLASpec, MLPSpec, MoESpec, NormSpec, prefixed


@dataclass(frozen=True)
class BlockSpec:
    """What a transformer block is built from (`ModelConfig.block_spec(layer)` makes it): the
    submodules' specs, chosen by the family, and the residual dropout."""

    n_embd: int
    norm: NormSpec  # before each branch (attn_norm, mlp_norm)
    attention: AttentionSpec | MLASpec
    mlp: MLPSpec | MoESpec
    post_norm: NormSpec | None = None  # after each branch too (Gemma 2 and 3)
    dropout: float = 0.0

    def parameters(self) -> list:
        """The block's parameters (`ParamDecl`s, names under the block), in the block's order."""
        norm = self.norm.parameters(self.n_embd)
        post = [] if self.post_norm is None else self.post_norm.parameters(self.n_embd)
        return (prefixed("attn_norm", norm) + prefixed("attn", self.attention.parameters())
                + prefixed("post_attn_norm", post) + prefixed("mlp_norm", norm)
                + prefixed("mlp", self.mlp.parameters()) + prefixed("post_mlp_norm", post))


class ParallelTransformerBlock(Module):
    """Pre-norm block. Input and output: replicated [B, T, n_embd]."""

    def __init__(self, ctx, spec: BlockSpec, *, layer: int = 0, name=None, rng: RNGTracker, seed=0, dtype=np.float32,
                 rotary=None):
        """spec: a BlockSpec; name: the parameters' prefix (default layers.{layer}); rotary: the
        model's (cos, sin) tables (a rotary attention needs them)."""
        s = spec
        name = f"layers.{layer}" if name is None else name
        self.spec = s
        kw = dict(seed=seed, dtype=dtype)

        def post(what):  # (Gemma's post-norms; None without)
            return None if s.post_norm is None else s.post_norm.build(ctx, s.n_embd, name=f"{name}.{what}", **kw)

        self.attn_norm = s.norm.build(ctx, s.n_embd, name=f"{name}.attn_norm", **kw)
        self.attn = s.attention.build(ctx, name=f"{name}.attn", rng=rng, rotary=rotary, **kw)
        self.post_attn_norm = post("post_attn_norm")
        self.attn_dropout = Dropout(s.dropout, rng, REPLICATED, site=f"{name}.attn_resid_dropout")
        self.mlp_norm = s.norm.build(ctx, s.n_embd, name=f"{name}.mlp_norm", **kw)
        self.mlp = s.mlp.build(ctx, name=f"{name}.mlp", **kw)
        self.post_mlp_norm = post("post_mlp_norm")
        self.mlp_dropout = Dropout(s.dropout, rng, REPLICATED, site=f"{name}.mlp_dropout")
        self.rng = rng
        self.recompute = False  # full recomputation: keep only the input (module docstring)

    @staticmethod
    def _post(norm, y, backward=False):
        """A branch's post-norm (Gemma's post_norms) forward or backward; y itself without one."""
        if norm is None:
            return y
        return norm.backward(y) if backward else norm.forward(y)

    def _forward(self, x, positions=None, documents=None):
        attn = self.attn.forward(self.attn_norm.forward(x), positions, documents)
        branch = self.attn_dropout.forward(self._post(self.post_attn_norm, attn))
        x, h = self.mlp_norm.forward_residual(x, branch)  # (RMSNorm: the add and the norm, one kernel)
        return x + self.mlp_dropout.forward(self._post(self.post_mlp_norm, self.mlp.forward(h)))

    def forward(self, x, positions=None, documents=None):
        """positions: the tokens' global position ids for rotary attention (None: arange(T));
        documents: the whole sequences' document ids [B, T] (None: one a row; packed sequences)."""
        if not (self.recompute and self.training):
            return self._forward(x, positions, documents)
        # the input, its positions and documents, and where the dropout draws stood
        self._save("input", (x, positions, documents, dict(self.rng.offsets), self.rng.position))
        with not_stashed(self):
            return self._forward(x, positions, documents)

    def backward(self, dy):
        if self.recompute:
            x, positions, documents, offsets, position = self._load("input")
            after = self.rng.offsets, self.rng.position
            self.rng.offsets, self.rng.position = dict(offsets), position
            try:
                self._forward(x, positions, documents)  # the first pass again, this time stashed
            finally:
                self.rng.offsets, self.rng.position = after
        # dy flows into both the residual and the MLP branch
        dm = self._post(self.post_mlp_norm, self.mlp_dropout.backward(dy), backward=True)
        dx = dy + self.mlp_norm.backward(self.mlp.backward(dm))
        da = self._post(self.post_attn_norm, self.attn_dropout.backward(dx), backward=True)
        return dx + self.attn_norm.backward(self.attn.backward(da))

    def forward_cached(self, x, cache):
        """Eval-mode incremental forward for generation (see ParallelAttention.forward_cached)."""
        x = x + self._post(self.post_attn_norm, self.attn.forward_cached(self.attn_norm.forward(x), cache))
        return x + self._post(self.post_mlp_norm, self.mlp.forward(self.mlp_norm.forward(x)))
