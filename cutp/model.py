"""GPT (GPT-2 architecture) built from cutp's tensor-parallel layers; the whole model in one file.

    ctx = cutp.init(tp=2)
    model = GPT(ctx, GPTConfig.preset("tiny"), seed=0)
    loss = model.forward(idx, targets)     # idx, targets: [B, T] int, identical on TP ranks
    model.backward()                       # accumulates into every Parameter.grad

Layouts: token ids and targets are replicated over the TP group; activations between blocks
are replicated [B, T, n_embd] (with `set_sequence_parallel()`: this rank's tokens [B, T/tp,
n_embd], so LayerNorm, dropout and the residual adds run on T/tp tokens); the logits stay
sharded over the vocabulary (`gather_logits` gathers them for a caller; the loss never does).
Parameters use GPT-2's names; `gather_state_dict` returns full, unpadded tensors under them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .ops._common import as_dtype, compute_dtype
from .runtime.backend import to_numpy
from .runtime.consistency import check_same_on_all_ranks
from .runtime.errors import ConfigError
from .runtime.failure import errors_raised_on_every_rank
from .tensor_parallel import (
    REPLICATED,
    ColumnParallelLinear,
    Dropout,
    LayerNorm,
    Module,
    ParallelLMHead,
    ParallelTransformerBlock,
    RNGTracker,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    gather_full,
    make_parameter,
    normal_init,
    pad_rows,
    pad_vocab,
    take_shard,
)
from .tensor_parallel.mappings import gather_from_tp_forward
from .tensor_parallel.validation import check_attention, check_mlp, check_vocab

# Parameters and activations are stored in the model's dtype. bfloat16/float16 models compute
# matmuls, LayerNorm statistics, softmax and the loss in float32 (cutp.ops' dtype policy) and are
# trained through fp32 master weights and fp32 gradient buffers (cutp.optim).
DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

PRESETS = {
    # trains on a 2-core CPU in minutes (byte-level vocabulary)
    "tiny": dict(n_layer=4, n_head=8, n_embd=128, vocab_size=256, block_size=128, vocab_multiple=1),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None: n_head (multi-head attention, as GPT-2)
    n_embd: int = 768
    mlp_hidden: int | None = None  # None: 4 * n_embd
    vocab_size: int = 50257
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    dtype: str = "float32"
    ln_eps: float = 1e-5
    gelu: str = "tanh"
    vocab_multiple: int = 128  # vocabulary padded to a multiple of this times tp
    label_smoothing: float = 0.0

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def with_overrides(self, items) -> "GPTConfig":
        """A copy with `KEY=VALUE` strings applied (the `--set` flag of the scripts), each value
        parsed as the field's type ('none' for None)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes = {}
        for item in items or ():
            key, sep, value = item.partition("=")
            if not sep or key not in fields:
                raise ConfigError(f"--set {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
            current = getattr(self, key)
            optional = "None" in str(fields[key].type)  # (gelu=none is the string "none", exact erf)
            if value.lower() in ("none", "null") and optional:
                changes[key] = None
            elif isinstance(current, bool):
                changes[key] = value.lower() in ("1", "true", "yes")
            elif isinstance(current, float):
                changes[key] = float(value)
            elif isinstance(current, int) or current is None:
                changes[key] = int(value)
            else:
                changes[key] = value
        return dataclasses.replace(self, **changes)

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def hidden(self) -> int:
        return 4 * self.n_embd if self.mlp_hidden is None else self.mlp_hidden

    def padded_vocab(self, tp: int) -> int:
        return pad_vocab(self.vocab_size, tp, self.vocab_multiple)

    def validate(self, tp: int = 1) -> None:
        """Every shape rule, before any allocation; raises ConfigError naming the fix."""
        for f in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{f} must be a positive integer, got {v!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported for training; use one of {sorted(DTYPES)}")
        for f in ("n_kv_head", "mlp_hidden"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{f} must be a positive integer or None (the default), got {v!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not (isinstance(self.vocab_multiple, int) and self.vocab_multiple >= 1):
            raise ConfigError(f"vocab_multiple must be an integer >= 1, got {self.vocab_multiple!r}")
        if not self.ln_eps > 0:
            raise ConfigError(f"ln_eps must be > 0, got {self.ln_eps}")
        if self.gelu not in ("tanh", "none"):
            raise ConfigError(f"gelu must be 'tanh' (GPT-2) or 'none' (exact erf), got {self.gelu!r}")
        check_attention(self.n_embd, self.n_head, self.kv_heads, tp)
        check_mlp(self.n_embd, self.hidden, tp)
        check_vocab(self.vocab_size, self.padded_vocab(tp), tp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown GPTConfig fields {sorted(unknown)}; the fields are {sorted(known)} "
                              "(a checkpoint or config written by another cutp version?)")
        return cls(**d)

    def num_parameters(self) -> int:
        """Parameters of the full model (unpadded vocabulary, tied head counted once)."""
        h, L, V = self.n_embd, self.n_layer, self.vocab_size
        hd = h // self.n_head
        qkv = (self.n_head + 2 * self.kv_heads) * hd
        b = 1 if self.bias else 0
        per_layer = (2 * h * (1 + b)  # two LayerNorms
                     + h * qkv + b * qkv + h * h + b * h  # attention
                     + 2 * h * self.hidden + b * (self.hidden + h))  # MLP
        head = 0 if self.tie_embeddings else V * h
        return V * h + self.block_size * h + L * per_layer + h * (1 + b) + head

    def __str__(self):
        return json.dumps(self.to_dict())


class PositionEmbedding(Module):
    """Learned positions, replicated on every TP rank. Input: T. Output: [T, n_embd], or with
    `sequence_shard = (rank, size)` this rank's positions [T/size, n_embd] of the T."""

    def __init__(self, ctx, block_size, dim, *, name, seed, dtype):
        self.weight = make_parameter(ctx, f"{name}.weight", (block_size, dim), normal_init(0.02), None, seed=seed,
                                     dtype=dtype)
        self.sequence_shard: tuple[int, int] | None = None

    def forward(self, T):
        start, stop = 0, T
        if self.sequence_shard is not None:
            rank, size = self.sequence_shard
            start, stop = rank * T // size, (rank + 1) * T // size
        self._save("rows", (start, stop))
        return self.weight.data[start:stop]

    def backward(self, dy):
        start, stop = self._load("rows")  # 16-bit dy: summed over the batch in float32
        self.weight.grad[start:stop] += as_dtype(dy, compute_dtype(dy.dtype)).reshape(
            -1, stop - start, dy.shape[-1]).sum(axis=0)


class GPT(Module):
    def __init__(self, ctx, config: GPTConfig, seed: int = 0, init: bool = True):
        """seed: initialisation and dropout streams. init=False allocates zeros instead of drawing
        the initial weights (for models whose weights are loaded right after).

        Collective over ctx's communicator: every rank must build the same model (a config or seed
        that differs on one rank would otherwise give silently wrong gradients or a hang)."""
        world = ctx.world.mpi_comm  # cutp talks only over the communicators it split off
        check_same_on_all_ranks(world, {"config": config.to_dict(), "seed": seed, "init": init},
                                "GPT model configuration")
        with errors_raised_on_every_rank(world):
            config.validate(ctx.tp_size)
        self.ctx = ctx
        self.config = config
        self.seed = seed
        c, dt = config, DTYPES[config.dtype]
        self.padded_vocab = c.padded_vocab(ctx.tp_size)
        self.rng = RNGTracker(seed, ctx.tp_rank, ctx.dp_rank)
        seed = seed if init else None
        self.wte = VocabParallelEmbedding(ctx, c.vocab_size, self.padded_vocab, c.n_embd, name="wte", seed=seed,
                                          dtype=dt)
        self.wpe = PositionEmbedding(ctx, c.block_size, c.n_embd, name="wpe", seed=seed, dtype=dt)
        self.drop = Dropout(c.dropout, self.rng, REPLICATED, site="drop")
        self.h = [ParallelTransformerBlock(ctx, c.n_embd, c.n_head, c.kv_heads, c.hidden, name=f"h.{i}",
                                           rng=self.rng, n_layer=c.n_layer, bias=c.bias, dropout=c.dropout,
                                           gelu=c.gelu, ln_eps=c.ln_eps, seed=seed, dtype=dt)
                  for i in range(c.n_layer)]
        self.ln_f = LayerNorm(ctx, c.n_embd, name="ln_f", eps=c.ln_eps, bias=c.bias, seed=seed, dtype=dt)
        if c.tie_embeddings:
            self.lm_head = ParallelLMHead(ctx, self.wte)
        else:
            self.lm_head = ParallelLMHead(ctx, vocab_size=c.vocab_size, padded_vocab=self.padded_vocab, dim=c.n_embd,
                                          name="lm_head", seed=seed, dtype=dt)
        self.loss_fn = VocabParallelCrossEntropy(ctx, c.vocab_size, self.padded_vocab,
                                                 label_smoothing=c.label_smoothing)
        self.sequence_parallel = False

    # ---- sequence parallelism ------------------------------------------------------------------
    def set_sequence_parallel(self, on: bool = True) -> None:
        """Between the tensor-parallel regions, keep each sequence split over the TP ranks
        (Korthikanti et al. 2022): the embedding reduce-scatters along the sequence, each column
        projection all-gathers before its matmul, each row projection reduce-scatters after it,
        the LM head gathers; LayerNorm, dropout and residual adds run on T/tp tokens. The same
        bytes as the all-reduces it replaces; the replicated parameters (LayerNorms, row biases,
        positions) are summed over TP by `tp_grad_sync`. Training sequences must split over tp;
        other forwards whose length does not (evaluation, logits), and generation, run without it. A no-op at
        tp 1. Changes memory, never the math."""
        self.sequence_parallel = bool(on)
        self._lay_out_sequence(self.sequence_parallel)

    def _lay_out_sequence(self, on: bool) -> None:
        on = on and self.ctx.tp_size > 1
        for m in self.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead)):
                m.sequence_parallel = on
        shard = (self.ctx.tp_rank, self.ctx.tp_size) if on else None
        for m in [self.drop, self.wpe] + [d for b in self.h for d in (b.attn_dropout, b.mlp_dropout)]:
            m.sequence_shard = shard
        for p in self.parameters():  # the replicated ones are exactly those used on sequence shards
            p.sequence_parallel = on and p.sharding is None

    @contextlib.contextmanager
    def without_sequence_parallel(self):
        """Runs the block's forwards with whole sequences on every TP rank (generation)."""
        was = self.sequence_parallel
        self.set_sequence_parallel(False)
        try:
            yield
        finally:
            self.set_sequence_parallel(was)

    def _splits_sequence(self, T: int) -> bool:
        return self.sequence_parallel and self.ctx.tp_size > 1 and T % self.ctx.tp_size == 0

    # ---- activation recomputation --------------------------------------------------------------
    RECOMPUTE = ("none", "selective", "full")

    def set_recompute(self, mode: str = "none", layers: int | None = None) -> None:
        """What backward recomputes instead of keeping: "selective" the core attention of every
        layer (its T x T probabilities), "full" whole layers (each keeps only its input), the
        first `layers` of them (default all). Changes memory and time, never the gradients."""
        n = self.config.n_layer
        if mode not in self.RECOMPUTE:
            raise ConfigError(f"--recompute {mode!r}: use one of {', '.join(self.RECOMPUTE)}")
        if layers is not None and (mode != "full" or not (isinstance(layers, int) and 1 <= layers <= n)):
            raise ConfigError(f"--recompute-layers {layers!r} needs --recompute full and 1 <= N <= n_layer ({n})")
        for i, block in enumerate(self.h):
            block.attn.recompute_core = mode == "selective"
            block.recompute = mode == "full" and i < (n if layers is None else layers)

    # ---- inputs --------------------------------------------------------------------------------
    def check_inputs(self, idx, targets=None):
        """Raises ValueError naming the offending value and the limit (before any collective)."""
        c = self.config
        for what, a in (("token ids", idx), ("targets", targets)):
            if a is not None and not isinstance(getattr(a, "dtype", None), np.dtype):
                raise TypeError(f"{what} must be a NumPy (or CuPy) integer array, got {type(a).__module__}."
                                f"{type(a).__name__}; convert it first (e.g. np.asarray(t.cpu()) for a torch tensor)")
        if idx.ndim != 2:
            raise ValueError(f"token ids must be [batch, seq], got shape {tuple(idx.shape)}")
        if idx.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {idx.dtype}")
        if idx.shape[1] > c.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size {c.block_size}; "
                             f"use --seq-len <= {c.block_size} or a model with a larger block_size")
        tp = self.ctx.tp_size
        if self.sequence_parallel and self.training and targets is not None and tp > 1 and idx.shape[1] % tp:
            raise ValueError(f"sequence length {idx.shape[1]} is not divisible by tp={tp}: sequence parallelism "
                             f"splits each sequence over the TP ranks; use a multiple of {tp}")
        if idx.size:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= c.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {c.vocab_size})")
        if targets is not None:
            if tuple(targets.shape) != tuple(idx.shape):
                raise ValueError(f"targets shape {tuple(targets.shape)} differs from ids shape {tuple(idx.shape)}")
            ok = (targets >= 0) & (targets < c.vocab_size) | (targets == self.loss_fn.ignore_index)
            if not bool(ok.all()):
                bad = int(targets[~ok].reshape(-1)[0])
                raise ValueError(f"target id {bad} is outside the vocabulary [0, {c.vocab_size}) "
                                 f"and is not ignore_index ({self.loss_fn.ignore_index})")

    # ---- forward / backward ------------------------------------------------------------------
    def hidden_states(self, idx):
        """Final-LayerNorm output [B, T, n_embd], replicated ([B, T/tp, n_embd], this rank's
        tokens, under sequence parallelism)."""
        T = idx.shape[1]
        if self.sequence_parallel and not self._splits_sequence(T) and not self.training:
            with self.without_sequence_parallel():  # an evaluation forward whose T does not split
                return self.hidden_states(idx)
        x = self.wte.forward(idx)
        x += self.wpe.forward(T)
        x = self.drop.forward(x)
        for block in self.h:
            x = block.forward(x)
        return self.ln_f.forward(x)

    def forward(self, idx, targets=None, check=True):
        """Sharded logits [B, T, padded_vocab/tp] when targets is None (this rank's columns of
        the padded vocabulary, the padding columns -inf; `gather_logits` gives [B, T, vocab_size]),
        else the mean loss (float) over the targets that are not ignore_index (-100).

        `targets` are already shifted: targets[:, t] is the token that follows idx[:, t] (nanoGPT's
        convention). Hugging Face's `labels=input_ids` are not: pass
        `targets=model.targets_from_labels(labels)`."""
        if check:
            self.check_inputs(idx, targets)
        idx = self.ctx.asarray(idx)  # host ids on a GPU model: moved once here (a no-op on the CPU)
        if self.sequence_parallel and not self._splits_sequence(idx.shape[1]) and not (self.training and targets
                                                                                        is not None):
            with self.without_sequence_parallel():  # the LM head's input is whole then too
                return self.forward(idx, targets, check=False)
        logits = self.lm_head.forward(self.hidden_states(idx))
        if targets is None:
            return self._mask_padding(logits)
        return self.loss_fn.forward(logits, self.ctx.asarray(targets), inplace_backward=True)

    def _mask_padding(self, logits):
        """Sets this rank's vocabulary-padding columns to -inf (in place; the loss masks its own)."""
        per = self.padded_vocab // self.ctx.tp_size
        real = min(max(self.config.vocab_size - self.ctx.tp_rank * per, 0), per)
        if real < per:
            logits[..., real:] = -np.inf
        return logits

    def gather_logits(self, logits_shard, rank: int | None = None):
        """This rank's logits [..., padded_vocab/tp] (from `forward` or `forward_cached`) -> the
        full logits [..., vocab_size] of the real vocabulary (padding dropped), an array of the
        model's device (`ctx.to_numpy` for the host). Collective over the TP group: returns them on
        TP rank `rank` (None: on every TP rank) and None elsewhere.

            logits = model.gather_logits(model.forward(idx))       # [B, T, vocab_size]
        """
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < self.ctx.tp_size):
            raise ValueError(f"rank must be None or a TP rank in [0, {self.ctx.tp_size}), got {rank!r}")
        per = self.padded_vocab // self.ctx.tp_size
        if logits_shard.shape[-1] != per:
            raise ValueError(f"logits_shard has {logits_shard.shape[-1]} columns; this rank's shard of the padded "
                             f"vocabulary has {per} (pass what forward(idx) returned, unsliced)")
        full = gather_from_tp_forward(self.ctx.tp, self.ctx.xp.ascontiguousarray(logits_shard))
        if rank is not None and self.ctx.tp_rank != rank:
            return None
        return full[..., : self.config.vocab_size]

    def backward(self, dloss: float = 1.0):
        dx = self.lm_head.backward(self.loss_fn.backward(dloss))
        dx = self.ln_f.backward(dx)
        for block in reversed(self.h):
            dx = block.backward(dx)
        dx = self.drop.backward(dx)
        self.wpe.backward(dx)
        self.wte.backward(dx)

    def targets_from_labels(self, labels):
        """Hugging Face-style labels (the input ids themselves, -100 where ignored) -> `forward`'s
        targets: shifted left by one, the last position ignored. forward(ids, targets_from_labels(
        ids)) is the loss GPT2LMHeadModel(input_ids=ids, labels=ids) computes."""
        xp = self.ctx.xp if not isinstance(labels, np.ndarray) else np
        targets = xp.full(labels.shape, self.loss_fn.ignore_index, dtype=np.int64)
        targets[:, :-1] = labels[:, 1:]
        return targets

    # ---- generation ---------------------------------------------------------------------------
    def new_kv_cache(self, batch: int, max_len: int):
        dt = DTYPES[self.config.dtype]
        return [b.attn.new_kv_cache(batch, max_len, dt) for b in self.h]

    def forward_cached(self, idx, caches):
        """Eval-mode logits (sharded, padding -inf, as `forward`'s) for new tokens idx [B, Tn] after
        caches' positions; never sequence-parallel (one new token does not split over the TP ranks)."""
        with self.without_sequence_parallel():
            return self._forward_cached(idx, caches)

    def _forward_cached(self, idx, caches):
        n0 = caches[0]["len"]
        idx = self.ctx.asarray(idx)
        T = idx.shape[1]
        if n0 + T > self.config.block_size:
            raise ValueError(f"generation reached {n0 + T} positions; block_size is {self.config.block_size}")
        x = self.wte.forward(idx)
        x += self.wpe.weight.data[n0:n0 + T]
        for block, cache in zip(self.h, caches):
            x = block.forward_cached(x, cache)
        return self._mask_padding(self.lm_head.forward(self.ln_f.forward(x)))

    # ---- state -------------------------------------------------------------------------------
    def named_parameters(self) -> dict:
        return {p.name: p for p in self.parameters()}

    def state_dict(self) -> dict:
        """This rank's shards, by parameter name (arrays of the backend: NumPy or CuPy)."""
        return {p.name: p.data for p in self.parameters()}

    def gather_state_dict(self, rank: int | None = 0) -> dict | None:
        """Full, unsharded tensors under GPT-2's names, vocabulary padding removed.

        Collective over the TP group. Returns host NumPy arrays on TP rank `rank` (None: on every
        TP rank) and None elsewhere.
        """
        out = {}
        for p in self.parameters():
            full = gather_full(self.ctx.tp, p.data, p.sharding)
            if rank is None or self.ctx.tp_rank == rank:
                full = self.ctx.to_numpy(full)
                if p.real_rows is not None:
                    full = full[: p.real_rows]
                if isinstance(full, np.ndarray) and np.may_share_memory(full, p.data):
                    full = full.copy()  # a replicated parameter's own array: a copy, never a live view
                out[p.name] = np.ascontiguousarray(full)
        return out if (rank is None or self.ctx.tp_rank == rank) else None

    def load_full_state_dict(self, full: dict, strict: bool = True) -> None:
        """Loads full (unsharded, unpadded) tensors, keeping this rank's shard of each. No communication."""
        params = self.named_parameters()
        missing = sorted(set(params) - set(full))
        unexpected = sorted(set(full) - set(params))
        if strict and (missing or unexpected):
            raise ValueError(f"state dict mismatch: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                             f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
        for name, p in params.items():
            if name not in full:
                continue
            a = to_numpy(full[name])  # host arrays, or a device state dict (np.asarray refuses CuPy arrays)
            if p.real_rows is not None and a.shape[0] == p.real_rows:
                a = pad_rows(a, p.full_shape[0])
            if tuple(a.shape) != tuple(p.full_shape):
                raise ValueError(f"{name}: expected full shape {tuple(p.full_shape)}, got {tuple(a.shape)}")
            shard = np.ascontiguousarray(take_shard(a, p.sharding, self.ctx.tp_rank), dtype=p.data.dtype)
            p.data[...] = self.ctx.asarray(shard)

    def num_parameters_local(self) -> int:
        return int(sum(p.data.size for p in self.parameters()))
