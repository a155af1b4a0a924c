"""AdamW over a FlatParameters: the plain optimizer and the distributed one (ZeRO-1).

Both hold AdamW's moments (and, for bfloat16/float16 models, float32 master weights) for a range
[lo, hi) of the flat buffer: `AdamW` the whole model on every DP rank, `DistributedAdamW` a
contiguous 1/dp of it on each DP rank. A step, as `cutp.train.train_step` drives it:

    optimizer.reduce_gradients(ctx)     DP: all-reduce (plain) or reduce-scatter (distributed) of
                                        the gradient buffer, averaged, in float32 by default
    norm = optimizer.grad_norm(ctx)     global L2 norm, every full entry counted once over TP and DP
    optimizer.step(lr, grad_scale)      AdamW on [lo, hi): of the master weights when there are
                                        some (then rounded into the 16-bit parameters), else of the
                                        parameters; distributed: the updated shards all-gathered

Bytes per parameter and rank (Megatron's table; d = DP size): float32 plain 4 + 4 + 8 = 16,
distributed 8 + 8/d; bfloat16/float16 plain 2 + 4 (float32 gradients) + 12 (master, m, v) = 18,
distributed 6 + 12/d. `memory_bytes()` measures them on the live arrays.

Reducing the gradients in bfloat16 (`grad_reduce_dtype="bfloat16"`) halves the bytes on the wire
but rounds the sum to 8 bits of mantissa (and NCCL's ring rounds at every hop, so the error
grows with the DP size: Megatron-LM #6199); the default is the gradient buffer's float32.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .. import ops
from ..runtime.backend import get_array_module, host_values
from ..runtime.errors import ConfigError
from ..tensor_parallel import global_grad_norm
from ..tensor_parallel.grads import expert_replica_group, replica_group, replica_size
from .flat import FlatParameters, is_low_precision, state_dtype_for

# A DP collective moves at most this many elements per call (the distributed optimizer's
# reduce-scatter and all-gather pack a bucket's columns of the [dp, shard] view).
BUCKET_ELEMENTS = 1 << 24

GRAD_REDUCE_DTYPES = ("float32", "bfloat16")


class AdamW:
    """AdamW with decoupled weight decay (PyTorch's formulation), decay only where
    Parameter.weight_decay: the matrices, token and position embeddings included, never biases
    or LayerNorm parameters (as nanoGPT, Megatron-LM and Hugging Face Trainer decay).
    Every DP rank holds the whole optimizer state."""

    distributed = False

    def __init__(self, flat: FlatParameters, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, *,
                 grad_reduce_dtype: str | None = None):
        self.flat = flat
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.step_count = 0
        if grad_reduce_dtype not in (None,) + GRAD_REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype must be one of {GRAD_REDUCE_DTYPES}, got {grad_reduce_dtype!r}")
        # "float32" (the default): the gradient buffer's own precision (float64 for float64 models)
        self.reduce_dtype = np.dtype(ml_dtypes.bfloat16 if grad_reduce_dtype == "bfloat16" else flat.grad_dtype)
        self.lo, self.hi = self._owned_range()
        xp = get_array_module(flat.data)
        n = self.hi - self.lo
        state = state_dtype_for(flat.dtype)
        self.m = xp.zeros(n, state)
        self.v = xp.zeros(n, state)
        # float32 master weights of 16-bit parameters: the update runs on them, the parameters are
        # their rounding (to nearest even)
        self.master = flat.data[self.lo:self.hi].astype(np.float32) if is_low_precision(flat.dtype) else None

    def _owned_range(self) -> tuple[int, int]:
        return 0, self.flat.padded_size

    # ---- the step -----------------------------------------------------------------------------
    def reduce_gradients(self, ctx) -> None:
        """Averages the gradient buffer over the DP group (with context parallelism DP x CP:
        the CP ranks' parts of the sequences) after the TP hooks have run. With expert
        parallelism the experts' range [expert_start, size) is summed over the expert-DP
        (x CP) group and divided by dp (x cp): its ranks' experts saw the tokens of every DP
        rank of their EP groups, so that is the DP (x CP) average; the rest averaged over DP (x CP)."""
        if replica_size(ctx) == 1:
            return
        g, e = self.flat.grad, self.flat.expert_start
        if e == self.flat.size:
            self._reduce(replica_group(ctx), g, "avg")
            return
        self._reduce(replica_group(ctx), g[:e], "avg")
        experts = expert_replica_group(ctx)
        if experts.size > 1:
            self._reduce(experts, g[e:], "sum")
        g[e:] /= replica_size(ctx)

    def _reduce(self, group, g, op) -> None:
        # the non-blocking request, waited at once: its sum is in rank order, as the gradient
        # buckets' (cutp.optim.buckets), so overlapping the reduction never changes a bit
        if self.reduce_dtype == g.dtype:
            group.start_all_reduce(g, op, out=g).wait()
        else:
            low = g.astype(self.reduce_dtype)
            group.start_all_reduce(low, op, out=low).wait()
            g[...] = low

    def grad_norm(self, ctx) -> float:
        """Global L2 norm of the (reduced) gradients; NaN when any rank holds a non-finite entry."""
        return global_grad_norm(self.flat.model_order, ctx)

    def step(self, lr=None, grad_scale=1.0) -> None:
        """One AdamW update of [lo, hi) with the gradient times `grad_scale` (clipping and the
        loss scale folded in). Weight decay applies to the decayed range only."""
        self.step_count += 1
        flat = self.flat
        p = self.master if self.master is not None else flat.data[self.lo:self.hi]
        g = flat.grad[self.lo:self.hi]
        for a, b, decays in flat.decay_ranges(self.lo, self.hi):
            a, b = a - self.lo, b - self.lo
            ops.adamw_update(p[a:b], g[a:b], self.m[a:b], self.v[a:b], None, lr=self.lr if lr is None else lr,
                             beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                             weight_decay=self.weight_decay if decays else 0.0, step=self.step_count,
                             grad_scale=grad_scale)
        if self.master is not None:
            flat.data[self.lo:self.hi] = self.master  # rounded to nearest even
        self._after_update()

    def _after_update(self) -> None:
        pass

    # ---- state: per parameter, so checkpoints can be resharded like the parameters -------------
    def memory_bytes(self) -> dict:
        """This rank's bytes of parameters, gradients and optimizer state, from the live arrays."""
        optim = self.m.nbytes + self.v.nbytes + (self.master.nbytes if self.master is not None else 0)
        return {"params": int(self.flat.data.nbytes), "grads": int(self.flat.grad.nbytes), "optimizer": int(optim)}

    def _state_buffers(self) -> dict:
        """prefix -> this rank's [lo, hi) buffer."""
        out = {"exp_avg.": self.m, "exp_avg_sq.": self.v}
        if self.master is not None:
            out["master."] = self.master
        return out

    def state_dict(self) -> dict:
        """Per parameter (this TP rank's shard): exp_avg.NAME, exp_avg_sq.NAME and, with master
        weights, master.NAME (float32). Plain: views, on every rank."""
        return self._per_parameter(self._state_buffers())

    def _per_parameter(self, buffers: dict) -> dict:
        out = {}
        for p in self.flat.params:
            s = self.flat.slices[p.name]
            for prefix, buf in buffers.items():
                out[prefix + p.name] = buf[s].reshape(p.data.shape)
        return out

    def hyperparameters(self) -> dict:
        return {"step": self.step_count, "lr": self.lr, "betas": [self.beta1, self.beta2], "eps": self.eps,
                "weight_decay": self.weight_decay, "distributed": self.distributed,
                "master_weights": self.master is not None}

    def owned_part(self, name: str) -> tuple[int, int]:
        """[a, b): the elements of parameter `name` (flat, in its own coordinates) whose state this
        rank holds (all of them for the plain optimizer; possibly none for the distributed one)."""
        s = self.flat.slices[name]
        a, b = max(s.start, self.lo), min(s.stop, self.hi)
        return (a - s.start, b - s.start) if b > a else (0, 0)

    def load_state(self, tensors: dict, step: int) -> None:
        """Loads per-parameter tensors (as `state_dict` names them) into [lo, hi): each either
        the parameter's whole TP shard or only its `owned_part` (what checkpoint loading reads).
        master.NAME is needed when this optimizer keeps master weights."""
        for name, s in self.flat.slices.items():
            a, b = self.owned_part(name)
            for prefix, buf in self._state_buffers().items():
                key = prefix + name
                if key not in tensors:
                    raise ValueError(f"optimizer state is missing {key}")
                t = tensors[key].reshape(-1)
                if t.size == s.stop - s.start:
                    t = t[a:b]
                elif t.size != b - a:
                    raise ValueError(f"optimizer state {key} has {t.size} elements, expected {s.stop - s.start} "
                                     f"(or this rank's {b - a})")
                if b > a:
                    buf[s.start + a - self.lo:s.start + b - self.lo] = t
        self.step_count = int(step)

    def resync_masters(self) -> None:
        """Master weights := the parameters (after weights were loaded or changed outside the
        optimizer, e.g. cutp.hf.load_hf_into(run.model, ...): the masters would otherwise
        overwrite them at the next step)."""
        if self.master is not None:
            self.master[...] = self.flat.data[self.lo:self.hi]


def finish_norm(ctx, acc, group=None) -> float:
    """The L2 norm from [sum of squares, non-finite entries] of each rank's shard, all-reduced
    over TP, `group` (default DP x CP, the group the optimizer shards over; HSDP: a replica's
    shard group) and PP; NaN when any entry anywhere is not finite."""
    if ctx.tp_size > 1:
        ctx.tp.all_reduce(acc, "sum", out=acc)
    (replica_group(ctx) if group is None else group).all_reduce(acc, "sum", out=acc)
    if ctx.pp_size > 1:  # every pipeline stage's parameters
        ctx.pp.all_reduce(acc, "sum", out=acc)
    total, bad = host_values(acc)  # one read of the pair
    if bad or not math.isfinite(total):
        return float("nan")
    return math.sqrt(total)


class DistributedAdamW(AdamW):
    """AdamW whose state is sharded over the DP group (ZeRO-1, Megatron's distributed optimizer):
    DP rank r owns [r * S, (r + 1) * S) of the flat buffer (S = padded size / dp; the buffer is
    padded with zeros to a multiple of 64 * dp). Gradients are reduce-scattered, each rank
    updates its shard, and the updated parameters are all-gathered. The same math as AdamW."""

    distributed = True

    def __init__(self, flat: FlatParameters, ctx, *, group=None, **kw):
        self.ctx = ctx
        # the group the state is sharded over: DP x CP, or (an expert-parallel model's experts,
        # cutp.optim.expert_parallel) the expert-DP x CP group, whose sums are divided by dp x cp all the same
        self.group = group  # None: ctx.dp_cp, DP x CP (asked for only when communicating)
        self.shards, self.shard_rank = ((replica_size(ctx), getattr(ctx, "dp_cp_rank", ctx.dp_rank)) if group is None
                                        else (group.size, group.rank))
        if group is None and flat.expert_start < flat.size:
            raise ConfigError("the distributed optimizer shards the experts of an expert-parallel model (ep > 1) "
                              "over the expert-DP group: use cutp.optim.ExpertParallelAdamW")
        self.param_gather = None  # --overlap-param-gather: a ParamGather (train.step sets it)
        if flat.padded_size % self.shards:
            raise ValueError(f"the flat buffer ({flat.padded_size} elements) must be padded to a multiple of the "
                             f"group size {self.shards}: FlatParameters(params, "
                             f"pad_to=DistributedAdamW.pad_multiple({self.shards}))")
        super().__init__(flat, **kw)

    def _comm(self):
        return replica_group(self.ctx) if self.group is None else self.group

    @staticmethod
    def pad_multiple(dp: int) -> int:
        return 64 * dp  # shards start on 64-element boundaries (128-bit aligned for every dtype)

    def _owned_range(self) -> tuple[int, int]:
        shard = self.flat.padded_size // self.shards
        return self.shard_rank * shard, (self.shard_rank + 1) * shard

    def _chunks(self):
        """Column ranges of the [d, shard] view, each moving at most BUCKET_ELEMENTS elements."""
        shard = self.hi - self.lo
        width = max(1, BUCKET_ELEMENTS // self.shards)
        return [(c, min(c + width, shard)) for c in range(0, shard, width)]

    def reduce_gradients(self, ctx) -> None:
        """Reduce-scatter over the group: averaged over DP x CP, or summed over the expert-DP x
        CP group and divided by dp x cp (the DP x CP average of an expert's gradient)."""
        g, group = self.flat.grad, self._comm()
        op = "avg" if self.group is None else "sum"
        d, shard = group.size, self.hi - self.lo
        chunks = self._chunks()
        if d == 1:
            pass
        elif len(chunks) == 1 and self.reduce_dtype == g.dtype:  # (summed in rank order: AdamW._reduce)
            group.start_reduce_scatter(g, op, out=g[self.lo:self.hi]).wait()
        else:
            view = g.reshape(d, shard)
            for c0, c1 in chunks:
                packed = view[:, c0:c1].astype(self.reduce_dtype)  # a contiguous copy: [d, c1 - c0]
                mine = group.start_reduce_scatter(packed.reshape(-1), op).wait()
                view[group.rank, c0:c1] = mine
        if op == "sum":
            g[self.lo:self.hi] /= replica_size(ctx)

    def norm_terms(self, ctx):
        """[sum of squares, non-finite entries] of this rank's shard, each full entry once (the
        TP norm masks of the parameters it intersects): summed over TP, DP and PP, every entry
        of the model counted once (an expert's expert-DP shards on the ranks of its EP rank)."""
        xp = get_array_module(self.flat.grad)
        acc = xp.zeros(2, np.float64)
        for p in self.flat.model_order:
            s = self.flat.slices[p.name]
            a, b = max(s.start, self.lo), min(s.stop, self.hi)
            if b <= a or p.norm_mask is False:
                continue
            g = self.flat.grad[a:b]
            if p.norm_mask is not None:  # entries counted on this TP rank, along the sharded axis
                shape, axis = p.data.shape, p.sharding.axis
                stride = int(np.prod(shape[axis + 1:], dtype=np.int64))
                index = (xp.arange(a - s.start, b - s.start) // stride) % shape[axis]
                g = g[p.norm_mask[index]]
            g64 = g.astype(np.float64)
            acc[0] += g64 @ g64
        shard = self.flat.grad[self.lo:self.hi]
        acc[1] = (~xp.isfinite(shard)).sum()
        return acc

    def grad_norm(self, ctx) -> float:
        """The norm of `norm_terms`, all-reduced over TP, DP and PP."""
        return finish_norm(ctx, self.norm_terms(ctx))

    def _after_update(self) -> None:
        """Every group rank's updated shard into every rank's parameter buffer (or, with
        `param_gather` set, cutp.optim.buckets.ParamGather, its first bucket's broadcast started:
        the forward waits for each bucket before using it)."""
        group, data = self._comm(), self.flat.data
        if group.size == 1:
            return
        if self.param_gather is not None:
            self.param_gather.start()
            return
        chunks = self._chunks()
        if len(chunks) == 1:
            group.all_gather(data[self.lo:self.hi], out=data)
            return
        d, shard = group.size, self.hi - self.lo
        view = data.reshape(d, shard)
        for c0, c1 in chunks:
            view[:, c0:c1] = group.all_gather(view[group.rank, c0:c1].copy()).reshape(d, c1 - c0)

    def state_dict(self) -> dict:
        """Collective over the group: every rank's shards gathered on its rank 0 (host arrays),
        per parameter as in AdamW.state_dict; an empty dict on the other ranks."""
        ctx, group = self.ctx, self._comm()
        full = {}
        for prefix, buf in self._state_buffers().items():
            host = np.ascontiguousarray(ctx.to_numpy(buf))
            whole = np.empty(self.flat.padded_size, host.dtype) if group.rank == 0 else None
            with ctx.watchdog.guard(f"gathering the optimizer's {prefix.rstrip('.')} shards (host gather on "
                                    f"{group.name})"):
                group.mpi_comm.Gather(host, whole, root=0)
            full[prefix] = whole
        return self._per_parameter(full) if group.rank == 0 else {}

    def state_pieces(self) -> tuple[dict, dict]:
        """This rank's part of the state, for a checkpoint shard of its own (nothing gathered):
        ({exp_avg.NAME, exp_avg_sq.NAME, master.NAME: the flat elements [a, b) of NAME this rank
        owns}, {NAME: [a, b]}), parameters it owns nothing of left out. Views, no copies."""
        pieces, offsets = {}, {}
        for name, s in self.flat.slices.items():
            a, b = self.owned_part(name)
            if b > a:
                offsets[name] = [a, b]
                for prefix, buf in self._state_buffers().items():
                    pieces[prefix + name] = buf[s.start + a - self.lo:s.start + b - self.lo]
        return pieces, offsets

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "dp": self.ctx.dp_size}
