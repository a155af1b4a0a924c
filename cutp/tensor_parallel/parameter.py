"""Parameters (a shard plus its gradient buffer) and the Module base class.

A layer is a Module with a hand-written `forward` (which caches what `backward` needs, unless
the module is in eval mode) and `backward` (which accumulates into each Parameter's `grad`, so
several micro-batches can run before an optimizer step, and returns the input gradient).
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Callable, Iterator

import numpy as np

from ..ops.adamw import sum_of_squares
from ..runtime.backend import get_array_module, on_host
from ..runtime.threads import parallel_map
from .sharding import Sharding, take_shard


class Parameter:
    """One rank's shard of a model parameter.

    name         full parameter name (neutral, e.g. "layers.0.attn.qkv.weight")
    data, grad   this rank's shard and its gradient accumulator (same shape and dtype)
    sharding     how the full tensor is split over TP (None: replicated on every TP rank)
    weight_decay whether AdamW decays it: matrices (linear layers and embeddings), not biases or
                 LayerNorm parameters (nanoGPT's, Megatron-LM's and Hugging Face Trainer's rule)
    norm_mask    for the global gradient norm, which entries this rank counts, so that each
                 full entry counts exactly once: all of a partitioned shard, the lowest rank's
                 copy of a replicated parameter, the first holder of a GQA-replicated KV column.
                 None = all; False = none; otherwise a bool vector along the shard axis.
    grad_sync    optional hook run once per optimizer step, before the DP reduction (GQA: sum
                 the gradient of KV heads replicated over several TP ranks)
    real_rows    for vocabulary tables: the full tensor's rows [real_rows:] are padding (zero,
                 never trained, left out of full state dicts); None otherwise
    sp           declared so (`cutp.tensor_parallel.declare`): replicated and used on sequence
                 shards, so the model marks it `sequence_parallel` when sequence parallelism is on
    sequence_parallel  replicated, but used on sequence shards (sequence parallelism): each TP
                 rank's gradient covers its tokens only, so `tp_grad_sync` sums it over TP
    tp_partial   replicated, and each TP rank runs its own tokens through it whatever the layout
                 (an MoE expert): summed over TP like a sequence-parallel parameter
    expert_parallel  an MoE expert held by one rank of the EP group (ep > 1): its gradient is
                 reduced over the expert-DP group (sum / dp), and the EP group's ranks each count
                 their own experts in the gradient norm
    trainable    False: frozen (`--freeze`, LoRA's base weights): no gradient buffer (`grad` None:
                 the layers skip its gradient), no fp32 master, no optimizer state, no gradient
                 reduction, not in the gradient norm, not saved in run checkpoints
    buffer       state its module changes itself, outside the optimizer (DeepSeek's correction
                 bias, `make_buffer`): frozen as above (no gradient, master or optimizer state;
                 in no ZeRO unit), but saved and loaded with the model's weights, and exported
    """

    real_rows: int | None = None
    draw: Callable | None = None  # made inside `deferred_parameters`: returns its values (data a stand-in till then)
    buffer: bool = False
    sp: bool = False
    sequence_parallel: bool = False
    tp_partial: bool = False
    expert_parallel: bool = False

    def __init__(self, name: str, data, sharding: Sharding | None, tp_rank: int, weight_decay: bool):
        self.name = name
        self.data = data
        self.grad = None
        self.sharding = sharding
        self.weight_decay = weight_decay
        self.tp_rank = tp_rank
        if sharding is None:
            self.norm_mask = None if tp_rank == 0 else False
        else:
            owned = sharding.owned_mask(tp_rank)
            # kept beside the data (on the GPU there), so the per-step norm copies nothing
            self.norm_mask = None if owned.all() else get_array_module(data).asarray(owned)
        self.grad_sync: Callable | None = None
        self._trainable = True
        self.zero_grad()

    @property
    def trainable(self) -> bool:
        return self._trainable

    @trainable.setter
    def trainable(self, on: bool) -> None:
        """Freezing drops the gradient buffer; unfreezing allocates a zero one."""
        self._trainable = bool(on)
        self.grad = None
        if self._trainable:
            self.zero_grad()

    @property
    def shape(self):
        return self.data.shape

    @property
    def full_shape(self):
        return self.data.shape if self.sharding is None else self.sharding.full_shape

    def zero_grad(self):
        if not self._trainable:
            return
        if self.grad is None:
            self.grad = self.data * 0  # same module, dtype and shape as data
        else:
            self.grad[...] = 0

    def grad_sq_sum(self):
        """Sum of squared gradient entries this rank counts toward the global norm (float64 scalar array)."""
        if self.norm_mask is False or not self._trainable:
            return None
        g = self.grad
        xp = get_array_module(g)
        if self.norm_mask is not None:
            g = xp.compress(self.norm_mask, g, axis=self.sharding.axis)
        if on_host(xp):
            return _sq_sum_host(g)
        return (g.astype(np.float64) ** 2).sum() if g.dtype != np.float64 else (g * g).sum()

    def __repr__(self):
        split = "replicated" if self.sharding is None else f"split axis {self.sharding.axis} of {self.sharding.full_shape}"
        return f"Parameter({self.name}, shard {tuple(self.data.shape)}, {split})"


_SQ_BLOCK = 1 << 16


def _sq_sum_host(g):
    """sum(g**2) accumulated in float64, in cache-sized blocks (float64 copies of 2**16 elements and
    a BLAS dot each, on the ops' threads) rather than through a full float64 copy of g and its
    square: measured 125-730 ms -> ~30 ms for GPT-2's 124M gradients. Blocks are summed in order.
    float32 / float64 arrays: one pass of the compiled kernel (cutp.ops.sum_of_squares) instead."""
    total = sum_of_squares(g)
    if total is not None:
        return total
    flat = g.reshape(-1)
    n = flat.shape[0]

    def part(s):
        b = flat[s:s + _SQ_BLOCK].astype(np.float64)
        return float(b @ b)

    total = np.float64(0.0)
    for p in parallel_map(get_array_module(g), part, range(0, n, _SQ_BLOCK)):
        total += p
    return total


def trainable_parameters(params) -> list:
    """The parameters that train (what the optimizer, its flat buffers and the gradient
    reduction take): frozen ones have no gradient to reduce, no master and no state."""
    return [p for p in params if p.trainable]


# ---- initialisation independent of TP size ------------------------------------------------
def param_rng(seed: int, name: str) -> np.random.Generator:
    """One generator per (seed, parameter name): the full tensor is the same at any TP size."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())])


def normal_init(std: float):
    def init(rng, shape, dtype):
        gen_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        a = rng.standard_normal(shape, dtype=gen_dtype)
        a *= std
        return a

    init.describe = f"normal(0, {std})"
    return init


def zeros_init(rng, shape, dtype):
    return np.zeros(shape, np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def ones_init(rng, shape, dtype):
    return np.ones(shape, np.float64 if np.dtype(dtype) == np.float64 else np.float32)


_deferring = []  # non-empty inside `deferred_parameters`


@contextlib.contextmanager
def deferred_parameters():
    """Inside, `make_parameter` keeps no values: a parameter's data and gradient are stand-ins of
    its shard's shape (no memory, NaN if read, read-only on the CPU) and `p.draw()` returns the
    shard it would have kept, bit for bit (drawn then, from the same generator). ZeRO-3 builds
    its model so and draws one unit at a time, keeping each rank's piece (cutp.optim.sharded):
    no rank holds the whole model. Buffers (`make_buffer`) are made at once."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()


def _stand_in(xp, shape, dtype):
    return xp.broadcast_to(xp.full((), np.nan, dtype), shape)


def make_parameter(ctx, name, full_shape, init, sharding=None, *, seed=0, dtype=np.float32,
                   weight_decay=False, real_rows=None, defer: bool = True) -> Parameter:
    """Builds the full tensor on the host from its own seeded generator, keeps this rank's shard.

    Only one full tensor exists at a time (it is dropped before the next parameter is made).
    real_rows: rows [real_rows:] are vocabulary padding: zero, and left out of full state dicts.
    seed=None skips initialisation: the shard is allocated as zeros (for weights about to be
    loaded from a checkpoint or a Hugging Face file). Inside `deferred_parameters` (and `defer`),
    nothing is drawn nor allocated until `p.draw()`.
    """
    shape = tuple(full_shape) if sharding is None else sharding.shard_shape(ctx.tp_rank)

    def draw():
        if seed is None:
            return ctx.xp.zeros(shape, dtype)
        full = init(param_rng(seed, name), tuple(full_shape), dtype)
        if real_rows is not None:
            full[real_rows:] = 0
        return ctx.asarray(np.ascontiguousarray(take_shard(full, sharding, ctx.tp_rank), dtype=dtype))

    if _deferring and defer:
        p = Parameter(name, _stand_in(ctx.xp, shape, dtype), sharding, ctx.tp_rank, weight_decay)
        p.grad = _stand_in(ctx.xp, shape, dtype)
        p.draw = draw
    else:
        p = Parameter(name, draw(), sharding, ctx.tp_rank, weight_decay)
    p.real_rows = real_rows
    return p


def make_buffer(ctx, name, full_shape, init, *, seed=0, dtype=np.float32) -> Parameter:
    """A replicated `Parameter.buffer`: what its module changes in place (never the optimizer),
    kept in float32 (float64 in a float64 model) whatever the model's dtype, so that a 16-bit
    model neither rounds the module's small moves away nor has float32 masters undo them."""
    kept = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    p = make_parameter(ctx, name, full_shape, init, seed=seed, dtype=kept, defer=False)
    p.trainable = False
    p.buffer = True
    return p


# ---- modules ---------------------------------------------------------------------------------
class Module:
    """Base class: finds child modules and parameters among attributes (and lists of them)."""

    training = True
    stash = True  # False (inside `not_stashed`): a training-mode forward keeps nothing for backward

    def children(self) -> Iterator["Module"]:
        for v in self.__dict__.values():
            if isinstance(v, Module):
                yield v
            elif isinstance(v, (list, tuple)):
                for item in v:
                    if isinstance(item, Module):
                        yield item

    def own_parameters(self) -> Iterator[Parameter]:
        for k, v in self.__dict__.items():
            if isinstance(v, Parameter) and not k.startswith("_shared"):
                yield v

    def parameters(self) -> list[Parameter]:
        """Every parameter once, in construction order (tied parameters appear once)."""
        seen, out = set(), []

        def walk(m):
            for p in m.own_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
            for c in m.children():
                walk(c)

        walk(self)
        return out

    def modules(self) -> Iterator["Module"]:
        yield self
        for c in self.children():
            yield from c.modules()

    def zero_grad(self):
        for p in self.parameters():
            p.zero_grad()

    # ---- layouts: each module lays itself out (the model calls these on every module; the
    # default is a module the layout does not change) ------------------------------------------
    def lay_out_sequence(self, on: bool, shard: tuple[int, int] | None) -> None:
        """Sequence parallelism on or off: `shard` (tp_rank, tp) when on. A layer that reads or
        writes the residual stream takes this rank's tokens; the replicated parameters used on
        them are declared `sp`, and the model marks those `sequence_parallel` (their gradients
        cover these tokens only)."""

    def lay_out_context(self, shard: tuple[int, int] | None) -> None:
        """Context parallelism on (`shard` = (cp_rank, cp)) or off (None): a layer whose work
        depends on the tokens' global positions (positions, dropout masks, the attention, MoE
        statistics) follows this rank's zigzag chunks."""

    def train(self, mode: bool = True):
        """Training mode: dropout on, forward caches what backward needs. Eval: neither."""
        for m in self.modules():
            m.training = mode
        if not mode:
            self.free_cache()
        return self

    def eval(self):
        return self.train(False)

    def free_cache(self):
        """Drops every cached activation (e.g. after an evaluation forward)."""
        for m in self.modules():
            for k in list(m.__dict__):
                if k.startswith("_cache"):
                    m.__dict__[k] = None

    def _save(self, name: str, value):
        """Caches `value` for backward only in training mode (and not inside `not_stashed`)."""
        setattr(self, "_cache_" + name, (value,) if self.training and self.stash else None)

    def _load(self, name: str):
        """Hands the cached value to backward and drops the module's reference to it, so each
        activation is freed as soon as backward has used it (none outlives the step: the next
        step's forward starts from parameters and optimizer state alone)."""
        v = getattr(self, "_cache_" + name, None)
        if v is None:
            raise RuntimeError(f"{type(self).__name__}.backward called without a training-mode forward "
                               "(its cache is empty: call model.train() and run forward first)")
        setattr(self, "_cache_" + name, None)
        return v[0]


@contextlib.contextmanager
def not_stashed(module: Module):
    """A training-mode forward inside this block keeps nothing for backward (dropout still draws
    its masks): full activation recomputation runs a layer's first forward so, and reruns it for
    real in backward."""
    mods = list(module.modules())
    before = [m.__dict__.get("stash") for m in mods]  # (nested in another, e.g. the MoE counting pass:
    for m in mods:  # a recomputed block's own not_stashed must leave the outer one's False in place)
        m.stash = False
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            if b is None:
                m.__dict__.pop("stash", None)
            else:
                m.stash = b
