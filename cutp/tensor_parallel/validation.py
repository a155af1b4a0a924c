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
