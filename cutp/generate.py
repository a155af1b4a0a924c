"""Autoregressive sampling from a (tensor-parallel) GPT, with a KV cache sharded by heads.

    from cutp.generate import generate, generate_text
    new_ids = generate(model, [15496, 995], max_new_tokens=20, temperature=0.8, top_k=40, seed=0)
    text = generate_text(model, load_tokenizer("path/to/model"), "Hello", 20)  # cutp.data.tokenizer

Collective over the model's TP group: every TP rank calls it with the same arguments. Each step
runs `model.forward_cached` (the prompt in one call, then one token at a time; each rank keeps
the K/V of its own heads), all-gathers only the last position's logits over TP ([B, vocab]:
`GPT.gather_logits`, which drops the vocabulary padding), and samples on the host with a NumPy
generator seeded by `seed`.
Every rank holds the same gathered logits and advances the same generator in the same way, so
every rank draws the same tokens without any further communication; and since TP=N computes
the same function as TP=1, the same seed gives the same tokens at any TP size (up to
floating-point ties: exactly so in float64).

Context length: the prompt plus the generated tokens must fit in the model's block_size
(learned positions end there); a longer request is refused up front with a ValueError naming
the numbers, rather than cropping the context (which would invalidate the cache).
"""
from __future__ import annotations

import numpy as np

from .runtime.backend import to_numpy
from .runtime.errors import ConfigError


def _as_batch(prompt_ids):
    a = to_numpy(prompt_ids)  # a list, a NumPy array, or a CuPy array (np.asarray refuses those)
    single = a.ndim == 1
    if single:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"prompt_ids must be a list of ids or a [batch, seq] array, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"prompt_ids must be integers, got dtype {a.dtype}")
    return a.astype(np.int64), single


def check_request(config, prompt_len: int, max_new_tokens: int) -> None:
    """Raises ValueError if a prompt of prompt_len tokens plus max_new_tokens does not fit in block_size."""
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if prompt_len < 1:
        raise ValueError("the prompt must hold at least one token")
    if prompt_len + max_new_tokens > config.block_size:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{prompt_len + max_new_tokens} exceeds the model's block_size ({config.block_size}); "
                         f"use at most {max(config.block_size - prompt_len, 0)} new tokens or a shorter prompt")


def next_token_logits(model, last_logits_shard):
    """Sharded logits [B, padded_vocab/tp] of the last position -> host float64 [B, vocab_size], on every TP rank."""
    return model.ctx.to_numpy(model.gather_logits(last_logits_shard)).astype(np.float64)


def sample_next(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0,
                top_k: int | None = None) -> np.ndarray:
    """Next token per row of host logits [B, V]. temperature 0: argmax (no draw from rng).

    Otherwise logits / temperature, all but the top_k largest (ties at the k-th value kept) set
    to -inf, softmax in float64, and one uniform draw per row from `rng` mapped through the
    cumulative distribution: a pure function of (logits, rng state), so identical on every rank.
    """
    if temperature == 0:
        return np.argmax(logits, axis=-1).astype(np.int64)
    z = logits / float(temperature)
    V = z.shape[-1]
    if top_k is not None and top_k < V:
        kth = np.partition(z, V - top_k, axis=-1)[:, V - top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(z.shape[0]) * cdf[:, -1]
    out = np.empty(z.shape[0], np.int64)
    for b in range(z.shape[0]):
        i = int(np.searchsorted(cdf[b], u[b], side="right"))
        i = min(i, V - 1)
        while p[b, i] == 0.0 and i > 0:  # never land on a masked token through rounding
            i -= 1
        out[b] = i
    return out


def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             seed: int = 0, use_cache: bool = True, stop_token: int | None = None):
    """Generates up to max_new_tokens after prompt_ids; returns the new tokens only.

    prompt_ids: a list of ids (returns a list of ints) or a [B, T] array / list of equal-length
    lists (returns a list of B lists). temperature 0 is greedy (argmax); top_k keeps the k most
    likely tokens. `seed` seeds the sampler (same tokens on every rank and at any TP size).
    use_cache=False recomputes the whole sequence every step (a reference for the cached path).
    stop_token: stop a row after it emits this id (kept in the output); stops when every row has.
    Runs in eval mode (no dropout; the model's mode is restored afterwards). Collective over
    the model's TP group.
    """
    if model.moe_layers and model.ctx.ep_size > 1:  # each token's experts would be on other ranks
        raise ConfigError("generation with expert parallelism (ep > 1) is not supported: load the model at ep 1 "
                          "(cutp.checkpoint.load_model with a context of ep=1) to generate")
    idx, single = _as_batch(prompt_ids)
    cfg = model.config
    check_request(cfg, idx.shape[1], max_new_tokens)
    if temperature is None or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    model.check_inputs(idx)
    was_training = model.training
    model.eval()
    try:
        with model.without_sequence_parallel():  # whatever the model trains with
            out = _decode_loop(model, idx, max_new_tokens, temperature, top_k, seed, use_cache, stop_token)
    finally:
        model.free_cache()
        if was_training:
            model.train()
    rows = [list(map(int, r)) for r in out]
    if stop_token is not None:
        rows = [r[: r.index(stop_token) + 1] if stop_token in r else r for r in rows]
    return rows[0] if single else rows


def _decode_loop(model, idx, max_new_tokens, temperature, top_k, seed, use_cache, stop_token):
    """The new tokens [B, n] (n <= max_new_tokens: fewer when every row hit stop_token)."""
    rng = np.random.default_rng(seed)
    B = idx.shape[0]
    out = np.empty((B, 0), np.int64)
    done = np.zeros(B, bool)
    xp = model.ctx.xp
    if use_cache:
        caches = model.new_kv_cache(B, idx.shape[1] + max_new_tokens)
    feed = seq = idx
    for _ in range(max_new_tokens):
        if use_cache:  # the prompt in one call, then one token at a time
            shard = model.forward_cached(xp.asarray(feed), caches)
        else:  # the reference: the whole sequence every step
            shard = model.forward(xp.asarray(seq), check=False)
        nxt = sample_next(next_token_logits(model, shard[:, -1, :]), rng, temperature, top_k)
        out = np.concatenate([out, nxt[:, None]], axis=1)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
        feed = nxt[:, None]
        if stop_token is not None:
            done |= nxt == stop_token
            if done.all():
                break
    return out


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, **kw) -> str:
    """The continuation of `prompt` as text, with a tokenizer of cutp.data.tokenizer (the one
    prepare-data used): the prompt encoded as it encodes text (BOS first where its template adds
    one), generation stopped at its EOS (unless `stop_token` is given; kept, and decoded), the new
    ids decoded. Other keywords as `generate`; collective over the model's TP group."""
    kw.setdefault("stop_token", tokenizer.eos_id)
    return tokenizer.decode(generate(model, tokenizer.encode(prompt), max_new_tokens, **kw))
