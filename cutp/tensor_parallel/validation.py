"""Shape rules of tensor parallelism, checked before anything is allocated or communicated.

Pure functions of the configuration: every rank reaches the same verdict without talking to
the others. Messages name the numbers and a valid alternative.
"""
from __future__ import annotations

from ..runtime.errors import ConfigError


def _valid_tps(n, limit=64):
    return [t for t in range(1, min(n, limit) + 1) if n % t == 0]


def check_attention(n_embd: int, n_head: int, n_kv_head: int, tp: int, head_dim: int | None = None) -> None:
    """head_dim None: each head n_embd // n_head wide (which must divide); else any width."""
    if n_head < 1 or n_kv_head < 1:
        raise ConfigError(f"n_head={n_head} and n_kv_head={n_kv_head} must be >= 1")
    if head_dim is None and n_embd % n_head:
        raise ConfigError(f"n_embd={n_embd} is not divisible by n_head={n_head}; choose n_head from {_valid_tps(n_embd)}")
    if n_head % n_kv_head:
        raise ConfigError(f"n_kv_head={n_kv_head} must divide n_head={n_head}; choose n_kv_head from {_valid_tps(n_head)}")
    if n_head % tp:
        raise ConfigError(f"tp={tp} does not divide n_head={n_head}: attention is split by whole heads; "
                          f"use tp in {_valid_tps(n_head)}")
    if n_kv_head % tp and tp % n_kv_head:
        raise ConfigError(
            f"tp={tp} and n_kv_head={n_kv_head}: KV heads are either split over TP (tp divides n_kv_head) or "
            f"replicated (tp a multiple of n_kv_head); use tp in "
            f"{sorted(set(t for t in _valid_tps(n_head) if n_kv_head % t == 0 or t % n_kv_head == 0))}"
        )


def check_mlp(n_embd: int, mlp_hidden: int, tp: int) -> None:
    if mlp_hidden % tp:
        raise ConfigError(f"tp={tp} does not divide the MLP width {mlp_hidden}; use tp in {_valid_tps(mlp_hidden)} "
                          f"or an MLP width that is a multiple of {tp}")


def check_vocab(vocab_size: int, padded_vocab: int, tp: int) -> None:
    if vocab_size < 1:
        raise ConfigError(f"vocab_size={vocab_size} must be >= 1")
    if padded_vocab < vocab_size or padded_vocab % tp:
        raise ConfigError(f"padded vocabulary {padded_vocab} must be >= vocab_size={vocab_size} and divisible by "
                          f"tp={tp}; use cutp.tensor_parallel.pad_vocab({vocab_size}, {tp})")


def check_routing(E, k, aux_coeff, z_coeff, scoring, n_group, topk_group, score_bias, rate, shared) -> None:
    """DeepSeekMoE's routing fields (ConfigError naming the fix)."""
    if scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"moe_scoring must be softmax or sigmoid, got {scoring!r}")
    if scoring == "sigmoid" and (aux_coeff or z_coeff):
        raise ConfigError("sigmoid scores (moe_scoring=sigmoid) have no load-balancing or z-loss here: set "
                          "moe_aux_loss_coeff=0 and moe_z_loss_coeff=0 (balance with moe_bias_update_rate)")
    if not (isinstance(n_group, int) and n_group >= 1 and E % n_group == 0 and (n_group == 1 or E // n_group >= 2)):
        raise ConfigError(f"moe_n_group={n_group!r} must divide n_experts={E} into groups of at least 2 experts")
    if not (isinstance(topk_group, int) and 1 <= topk_group <= n_group and k <= topk_group * E // n_group):
        raise ConfigError(f"moe_topk_group={topk_group!r} must be in [1, moe_n_group={n_group}] and its groups must "
                          f"hold moe_top_k={k} experts")
    if n_group > 1 and scoring != "sigmoid":
        raise ConfigError("group-limited routing (moe_n_group > 1) is DeepSeek's, with moe_scoring=sigmoid")
    if score_bias and scoring != "sigmoid":
        raise ConfigError("the correction bias (moe_score_bias) chooses among sigmoid scores: set moe_scoring=sigmoid")
    if not rate >= 0:
        raise ConfigError(f"moe_bias_update_rate must be >= 0 (0: the bias stays), got {rate!r}")
    if rate and not score_bias:
        raise ConfigError(f"moe_bias_update_rate={rate!r} needs moe_score_bias=true, and this model has no correction "
                          "bias; use a model with one (moe_score_bias=true with moe_scoring=sigmoid, e.g. the preset "
                          "deepseek-tiny), or omit moe_bias_update_rate")
    if not (isinstance(shared, int) and shared >= 0):
        raise ConfigError(f"moe_shared_experts must be an integer >= 0, got {shared!r}")
