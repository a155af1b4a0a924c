"""Parameters as data: a `ParamDecl` says what one parameter is, `build_parameters` makes a
module's parameters from its declarations, one loop for every layer.

A declaration names the parameter under its module, gives the full tensor's shape, how TP splits
it ("replicated", "column", "row", "qkv", "gate_up", "vocab"; "expert": a routed expert's,
replicated over TP and divided over EP), whether it is summed over TP under sequence parallelism
(`sp`) or always (`tp_partial`), how many copies (`count`: the experts), whether it trains
(`grad`: DeepSeek's correction bias does not: a buffer) and how it is initialised (`init`).
The layers take what `build_parameters` made; the parameter counts (`ModelConfig.num_parameters`,
the planner's per-rank count and TP gradient sum) add the same declarations up without arrays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


from .parameter import make_buffer, make_parameter, normal_init, ones_init, zeros_init
from .sharding import Sharding, contiguous, gate_up_sharding, kv_heads_of_rank, pad_vocab, qkv_sharding

SPLITS = ("replicated", "column", "row", "qkv", "gate_up", "vocab", "expert")
STD = 0.02  # the normal initialisation's standard deviation (GPT-2's), unless `init` says another


@dataclass(frozen=True)
class ParamDecl:
    """One parameter as its module declares it (module docstring)."""

    name: str
    shape: tuple  # the full tensor's (vocabulary: unpadded)
    split: str = "replicated"  # one of SPLITS
    sp: bool = False  # replicated and used on sequence shards: summed over TP with sequence parallelism
    tp_partial: bool = False  # replicated, each TP rank's own tokens through it: always summed over TP
    count: int = 1  # copies of it (a layer's experts: one per expert)
    grad: bool = True  # trained (False: a buffer-like value no gradient reaches, not counted as a parameter)
    layout: tuple | None = None  # how to split it: "qkv" (n_head, n_kv_head, head_dim), "vocab" (vocab_multiple,)
    # "ones", "zeros" or a float (normal with that std); None: normal(0, STD) for a matrix, zeros for a vector
    init: str | float | None = None

    def prefixed(self, prefix: str) -> "ParamDecl":
        # (the constructor, not dataclasses.replace: a large model's declarations are made in milliseconds)
        return ParamDecl(f"{prefix}.{self.name}", self.shape, self.split, self.sp, self.tp_partial, self.count,
                         self.grad, self.layout, self.init)

    @property
    def numel(self) -> int:
        """Elements of the full tensors (all copies)."""
        return math.prod(self.shape) * self.count

    def local_numel(self, tp: int = 1, ep: int = 1) -> int:
        """Elements one TP (and EP) rank holds: its shard, or (vocab) its rows of the padded table."""
        n = math.prod(self.shape)
        if self.split in ("column", "row", "gate_up"):
            return n // tp * self.count
        if self.split == "qkv":
            n_head, n_kv_head, hd = self.layout
            cols = (n_head // tp + 2 * len(kv_heads_of_rank(n_head, n_kv_head, tp, 0))) * hd
            return n // self.shape[-1] * cols * self.count
        if self.split == "vocab":
            rows = pad_vocab(self.shape[0], tp, self.layout[0]) // tp
            return rows * (n // self.shape[0]) * self.count
        if self.split == "expert":
            return n * (self.count // ep)
        return n * self.count

    def full_shape(self, tp: int) -> tuple:
        """The allocated full tensor's shape at TP size tp (a vocabulary table's rows padded)."""
        if self.split == "vocab":
            return (pad_vocab(self.shape[0], tp, self.layout[0]),) + tuple(self.shape[1:])
        return tuple(self.shape)

    def sharding(self, tp: int) -> Sharding | None:
        """How TP splits the full tensor (None: replicated); a vector follows its matrix's columns."""
        shape, last = self.full_shape(tp), len(self.shape) - 1
        if self.split in ("column", "gate_up", "qkv"):
            if self.split == "qkv":
                return qkv_sharding(shape, last, *self.layout, tp)
            return (contiguous if self.split == "column" else gate_up_sharding)(shape, last, tp)
        if self.split in ("row", "vocab"):
            return contiguous(shape, 0, tp)
        return None

    def initializer(self):
        if self.init == "ones":
            return ones_init
        if self.init == "zeros" or (self.init is None and len(self.shape) < 2):
            return zeros_init
        return normal_init(STD if self.init is None else self.init)


def prefixed(prefix: str, decls) -> list:
    return [d.prefixed(prefix) for d in decls]


def build_parameters(ctx, decls, prefix: str, *, seed, dtype) -> dict:
    """{declared name: Parameter} for a module named `prefix` (a routed expert's declaration
    "experts.*.x" gives "experts.{e}.x" for each expert e this EP rank holds). Each tensor is
    drawn from its own generator (`param_rng(seed, full name)`), so the values do not depend on
    the order or the layout; matrices are weight-decayed, vectors not."""
    out = {}
    for d in decls:
        names = [d.name]
        if d.split == "expert":
            local = d.count // ctx.ep_size
            names = [d.name.replace("*", str(e)) for e in range(ctx.ep_rank * local, (ctx.ep_rank + 1) * local)]
        for name in names:
            full = f"{prefix}.{name}" if prefix else name
            if not d.grad:
                p = make_buffer(ctx, full, d.shape, d.initializer(), seed=seed, dtype=dtype)
            else:
                p = make_parameter(ctx, full, d.full_shape(ctx.tp_size), d.initializer(), d.sharding(ctx.tp_size),
                                   seed=seed, dtype=dtype, weight_decay=len(d.shape) >= 2,
                                   real_rows=d.shape[0] if d.split == "vocab" else None)
            p.sp, p.tp_partial = d.sp, d.tp_partial
            p.expert_parallel = d.split == "expert" and ctx.ep_size > 1
            out[name] = p
    return out


def linear_parameters(in_features, out_features, *, bias=True, split="column", init=None, layout=None) -> list:
    """A linear layer's declarations (`cutp.tensor_parallel.declare`): weight [in, out] split by
    `split` ("column": by output columns, or "qkv" / "gate_up"; "row": by input rows), and a bias
    split with the columns (a row layer's: replicated, summed over TP under sequence parallelism).
    init: the weight's (None: normal(0, 0.02)); biases start at zero."""
    out = [ParamDecl("weight", (in_features, out_features), split, layout=layout, init=init)]
    if bias:
        out.append(ParamDecl("bias", (out_features,), split, layout=layout) if split != "row"
                   else ParamDecl("bias", (out_features,), sp=True))
    return out


def norm_parameters(kind: str, dim: int, *, bias=True, offset=False, per_head=False) -> list:
    """A norm's declarations: LayerNorm's weight (ones) and bias (zeros, when `bias`), or RMSNorm's
    weight (ones; zeros with `offset`, Gemma's 1 + w). Replicated, summed over TP under sequence
    parallelism; a QK-norm's (`per_head`: each TP rank normalises its own heads) always."""
    marks = dict(tp_partial=True) if per_head else dict(sp=True)
    out = [ParamDecl("weight", (dim,), init="zeros" if kind == "rmsnorm" and offset else "ones", **marks)]
    if kind == "layernorm" and bias:
        out.append(ParamDecl("bias", (dim,), init="zeros", **marks))
    return out


def vocab_parameters(vocab_size, padded_vocab, dim, tp) -> list:
    """A [vocab, dim] table split by rows over TP, padded to `padded_vocab` rows (a multiple of tp)."""
    return [ParamDecl("weight", (vocab_size, dim), "vocab", layout=(padded_vocab // tp,))]


def below(params: dict | None, prefix: str) -> dict | None:
    """The entries of `params` under `prefix.`, named without it (a submodule's; None stays None)."""
    if params is None:
        return None
    n = len(prefix) + 1
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix + ".")}


__all__ = ["ParamDecl", "SPLITS", "below", "build_parameters", "linear_parameters", "norm_parameters", "prefixed",
           "vocab_parameters"]
