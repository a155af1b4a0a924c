"""Which assignments an expert with a capacity accepts: the most probable ones, ties to the
earlier token and then the lower slot, decided identically at every layout.

Two probabilities that are mathematically equal need not be equal in floating point: tokens
whose hidden states are equal (a run of one token at a sequence's start under RoPE, where no
position is added to the residual) get router probabilities that differ only by the rounding of
whatever reduction order the layout used (TP's all-reduce, SP's shards, CP's ring, EP's expert
split). Ranked on the raw values, the last bit would decide which of them an expert drops, and
so the layout would. `rank_key` ranks them in a narrower float (about half the mantissa), so
that such values tie and the stable sort falls back on token order (Megatron's alternative is
to drop by position, `moe_token_drop_policy=position`).
"""
from __future__ import annotations

import numpy as np


def rank_key(xp, p):
    """p in the next narrower float (float64 -> float32: 24 bits of mantissa; float32 -> float16:
    11), a monotone (non-decreasing) function of p: values a few roundings apart (relative 1e-16
    in float64, 1e-7 in float32) become equal, probabilities further apart than the narrower
    float's precision keep their order (in float16 down to 6e-5, below which they tie more
    coarsely: probabilities and sigmoid scores are within [0, 1], so nothing overflows). What
    remains possible: two equal-but-for-rounding values on either side of a rounding boundary of
    the narrower float, about (rounding noise) / (its spacing) ~ 1e-9 per tie in float64 (1e-4
    in float32); and within one token, a tie between two experts' scores in the top-k choice
    itself (it needs two router columns giving equal logits; not handled)."""
    return p.astype(np.float32 if p.dtype == np.float64 else np.float16)


def accepted(xp, e, p, n_experts, capacity):
    """[n * k] bool of the flattened assignments (expert e, probability p) in token-then-slot
    order: those within their expert's first `capacity` by (rank_key(p) down, then position)."""
    # by expert, then probability down, then token and slot: two stable sorts (CuPy's lexsort
    # takes one stacked array of a single dtype)
    by_p = xp.argsort(-rank_key(xp, p), kind="stable")
    order = by_p[xp.argsort(e[by_p], kind="stable")]
    sorted_e = e[order]
    first = xp.searchsorted(sorted_e, xp.arange(n_experts))
    out = xp.empty(e.shape[0], bool)
    out[order] = (xp.arange(e.shape[0]) - first[sorted_e]) < capacity
    return out
