"""ZeRO-2 and ZeRO-3: gradients, and with ZeRO-3 parameters too, sharded over DP unit by unit.

The model's units (`GPT.units`: the embeddings, each block, the final norm with the LM head)
each become a segment of the flat layout (a parameter held by two units, the tied embedding,
or one with a deferred hook, gets a segment of its own). A segment of n elements is padded to
d x C (C a multiple of 64, d the DP x CP size) and DP rank r owns its elements [r C, (r + 1) C):
FSDP's layout, so gathering a unit is one all-gather of equal pieces and reducing its gradients
one reduce-scatter. Each rank's shard is the concatenation of its pieces of every segment
(`shard_at`): the optimizer state (AdamW's moments, float32 master weights of 16-bit models) and
the float32 gradient accumulator live there only.

    zero 2   parameters whole on every rank (one buffer, the segments in turn); during each
             micro-batch's backward, a unit's gradients go into a buffer of their own, which is
             reduce-scattered (averaged, in the reduction dtype) right after the last unit
             using them and added to the rank's shard; after the update each segment's
             updated piece is all-gathered in place.
    zero 3   parameters sharded too: a unit is all-gathered in the model's dtype just before
             its forward and freed after it (`reshard_after_forward`; off: kept to its
             backward), gathered again before its backward (a recomputed forward uses that
             gather), its gradients reduce-scattered right after. `prefetch`
             (--overlap-param-gather) starts the next unit's gather (the previous one's in the
             backward) before this one computes: at most two units whole at a time; and across
             steps, the next step's first unit's gather starts as soon as the update has written
             that unit's pieces (they are updated first), hidden behind the rest of the update
             (torchtitan's and Megatron-FSDP's prefetch of the next iteration's first gather).

`overlap` (--overlap-grad-reduce) leaves each reduce-scatter in flight until the segment's
next one, or the end of the step (the step's last ones land while the norm sums the
segments already landed: `norm_terms`); off, each is waited for at once. Each segment's pieces are
added in micro-batch order either way, and MPI's non-blocking reductions sum in rank order
(cutp.comm.mpi), so overlap changes no bit. A deferred parameter (the tied token embedding on
the first and last pipeline stages: a segment of its own, the same layout on both) has its
grad_sync hook run on its shard at the end of the step (a sum: it commutes with the average).

Frozen parameters (--freeze, LoRA's base weights; `Parameter.trainable` False) are segments of
their own (cutp.optim.units): sharded and gathered like the rest at zero 3 (whole at zero 2),
never reduced nor updated, with no gradient, master or optimizer state: those shards cover the
trainable segments only (the first `state_size` elements of the parameter shard).

HSDP (--dp-replicate R): the DP x CP group split into R replicas of consecutive ranks; every
shard, gather and reduce-scatter stays inside a replica, and at the end of the step each
rank's gradient shard is averaged with its replicas' (one all-reduce across the replicas). At
ep > 1 the experts' segments are sharded over the expert-DP (x CP) ranks inside the replica
(`expert_group`) and their pieces summed across the replicas (`expert_replicas`), apart.

The model calls the hooks (`GPT.unit_hooks`) around each unit's forward and backward, in
evaluation too (each unit gathered for its forward, freed after it); a checkpoint's save takes
the parameters unit by unit (`whole_parameters`). `gather_all()` makes every parameter whole
until the next `begin_step()`, which takes each rank's piece back from the whole parameters (a
checkpoint loaded into them, say; generation).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import ops
from ..runtime.backend import get_array_module
from ..tensor_parallel import tp_grad_sync
from ..tensor_parallel.grads import expert_replica_group, replica_group, replica_size
from .adamw import GRAD_REDUCE_DTYPES, finish_norm
from .flat import grad_dtype_for, is_low_precision, state_dtype_for
from .shard_state import ShardState
from .units import Segment, unit_key, unit_layout


def _absent(xp, shape, dtype):
    """A freed parameter's stand-in: its shape, no memory, NaN if read, read-only on the CPU."""
    return xp.broadcast_to(xp.full((), np.nan, dtype), shape)


class ShardedAdamW(ShardState):
    """AdamW of ZeRO stage `zero` (2 or 3) over `model`'s units, sharded over `group` (default:
    the DP x CP group; HSDP: one replica's ranks, `replicas` the group across replicas, over
    which the gradient shards are averaged at the end of the step). `deferred`: parameters whose
    grad_sync hook runs at the end of the step, on the shard. (The module docstring.)"""

    distributed = True
    reduces_in_backward = True

    def __init__(self, model, ctx, *, zero: int, group=None, replicas=None, expert_group=None,
                 expert_replicas=None, deferred=(),
                 reshard_after_forward: bool = True,
                 overlap: bool = False, prefetch: bool = False, lr=6e-4, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.1, grad_reduce_dtype: str | None = None):
        if zero not in (2, 3):
            raise ValueError(f"ShardedAdamW is ZeRO 2 or 3, got {zero!r}")
        if grad_reduce_dtype not in (None,) + GRAD_REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype must be one of {GRAD_REDUCE_DTYPES}, got {grad_reduce_dtype!r}")
        self.model, self.ctx, self.zero = model, ctx, zero
        self.group = replica_group(ctx) if group is None else group
        self.replicas = replicas  # HSDP: the group of the replicas of this rank's shard (None: no replicas)
        self.reshard, self.overlap, self.prefetch = bool(reshard_after_forward), bool(overlap), bool(prefetch)
        self.lr, (self.beta1, self.beta2), self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        params = model.parameters()
        self.dtype = np.dtype(params[0].data.dtype)
        self.grad_dtype = grad_dtype_for(self.dtype)
        self.reduce_dtype = np.dtype(ml_dtypes.bfloat16 if grad_reduce_dtype == "bfloat16" else self.grad_dtype)
        self.xp = xp = get_array_module(params[0].data)
        # at ep > 1 the experts in segments of their own, over the expert-DP (x CP) group, whose sums
        # are divided by dp x cp (the optimizers' rule: cutp.optim.expert_parallel)
        experts = None if getattr(ctx, "ep_size", 1) == 1 else (
            expert_replica_group(ctx) if expert_group is None else expert_group)
        self.expert_replicas = expert_replicas  # HSDP at ep > 1: the experts' pieces summed over it
        self.divide_by = replica_size(ctx)
        self.segments, self.unit_segments, self._next, self._prev = unit_layout(
            model, self.group.size, {id(p) for p in deferred}, None if experts is None else experts.size)
        for s in self.segments:
            s.group = experts if s.expert else self.group
        # the model's last unit (the final norm and LM head) is not resharded after its forward: its
        # backward comes next (torchtitan's rule for the output layer)
        last = model.pp_virtual - 1
        self._kept = {unit_key(model.units(last)[-1])} if model.gives_loss(last) else set()
        # and the first (the embeddings) stays gathered from its backward to the next forward, which
        # starts with it (the step's next micro-batch), or the end of the step
        self._first = unit_key(model.units(0)[0]) if model.takes_tokens(0) else None
        self._opening = unit_key(model.units(0)[0])  # (this stage's first forward: prefetched across steps)
        self._ahead = set()  # ids of the segments gathered for the next step's first forward
        self._lazy = []
        self.trained = [s for s in self.segments if not s.frozen]
        self._by_name = {p.name: (s, p) for s in self.trained for p in s.params}  # (the state's: trainable only)
        self._segment_of = {id(p): s for s in self.segments for p in s.params}
        self.shard_size = sum(s.chunk for s in self.segments)
        self.state_size = sum(s.chunk for s in self.trained)  # (the trainable segments: first in the shard)
        self.full_size = sum(s.group.size * s.chunk for s in self.segments)
        state = state_dtype_for(self.dtype)
        self.m = xp.zeros(self.state_size, state)
        self.v = xp.zeros(self.state_size, state)
        self.grad = xp.zeros(self.state_size, self.grad_dtype)  # the float32 gradient shard
        # each segment's values (the model's, or drawn now: cutp.tensor_parallel.deferred_parameters),
        # one segment whole at a time
        self.data = xp.zeros(self.full_size if zero == 2 else self.shard_size, self.dtype)
        for s in self.segments:
            w = self._whole(s)
            if zero == 2:
                self.data[s.full_at:s.full_at + w.size] = w
                self._point_data(s, self.data[s.full_at:s.full_at + w.size])
            else:
                r = s.group.rank
                self.data[s.shard_at:s.shard_at + s.chunk] = w[r * s.chunk:(r + 1) * s.chunk]
                self._point_data(s, None)
            del w
        for s in self.trained:
            for p in s.params:
                p.grad = _absent(xp, p.data.shape, self.grad_dtype)
        self.all_gathered = False
        self.master = None
        if is_low_precision(self.dtype):
            self.master = xp.zeros(self.state_size, np.float32)
            self.resync_masters()
        self.gathered_bytes = self.peak_gathered_bytes = 0  # zero 3: the whole units held now, and at most
        self.flat = self  # (what TrainingRun.flat and the step's zero_grad use)
        self.size = self.padded_size = int(self.data.size)  # (FlatParameters' names: the elements this rank holds)

    def _whole(self, s: Segment):
        """Segment s whole: its parameters' values, a deferred one's drawn (and its `draw` dropped)."""
        w = self.xp.zeros(s.group.size * s.chunk, self.dtype)
        for p in s.params:
            a, b = s.where[id(p)]
            w[a:b] = (p.data if p.draw is None else p.draw()).reshape(-1)
            p.draw = None
        return w

    def _point_data(self, s: Segment, whole) -> None:
        for p in s.params:
            shape = p.data.shape
            a, b = s.where[id(p)]
            p.data = _absent(self.xp, shape, self.dtype) if whole is None else whole[a:b].reshape(shape)

    def _local(self, s: Segment):
        """This rank's piece of segment s's parameters (a view: of the whole buffer at zero 2)."""
        if self.zero == 3:
            return self.data[s.shard_at:s.shard_at + s.chunk]
        at = s.full_at + s.group.rank * s.chunk
        return self.data[at:at + s.chunk]

    def _mine(self, s: Segment, a: int, b: int) -> tuple[int, int]:
        """[a, b) of segment s (its coordinates) cut to this rank's piece, in shard coordinates."""
        lo = s.group.rank * s.chunk
        a, b = max(a, lo), min(b, lo + s.chunk)
        return (s.shard_at + a - lo, s.shard_at + b - lo) if b > a else (0, 0)

    # ---- zero 3: gathers ----------------------------------------------------------------------
    def _start_gather(self, s: Segment) -> None:
        if s.full is not None:
            return
        s.full = self.xp.empty(s.group.size * s.chunk, self.dtype)
        s.gather = s.group.start_all_gather(self.data[s.shard_at:s.shard_at + s.chunk], out=s.full)
        self._point_data(s, s.full)
        self.gathered_bytes += s.full.nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _acquire(self, s: Segment) -> None:
        self._start_gather(s)
        s.refs += 1
        if s.gather is not None:
            s.gather.wait()
            s.gather = None

    def _free(self, s: Segment) -> None:
        if s.gather is not None:
            s.gather.wait()
            s.gather = None
        if s.full is not None:
            self.gathered_bytes -= s.full.nbytes
        s.full, s.refs = None, 0
        self._point_data(s, None)

    def _release(self, s: Segment) -> None:
        s.refs -= 1
        if s.refs <= 0:
            self._free(s)

    def _prefetch(self, key) -> None:
        if key is not None:
            for s in self.unit_segments[key]:
                self._start_gather(s)

    def _gathering(self) -> bool:
        return self.zero == 3 and not self.all_gathered

    # ---- the model's hooks (GPT.unit_hooks) -------------------------------------------------------
    def before_forward(self, unit) -> None:
        if self._gathering():
            key = unit_key(unit)
            for s in self.unit_segments[key]:
                self._acquire(s)
            lazy, self._lazy = self._lazy, []
            for s in lazy:  # (the embeddings' hold from their last backward)
                self._release(s)
            if self.prefetch:
                self._prefetch(self._next.get(key))

    def _held_to_backward(self, key) -> bool:
        return not self.reshard or key in self._kept

    def after_forward(self, unit) -> None:
        key = unit_key(unit)
        if self._gathering() and (not self._held_to_backward(key) or not self.model.training):
            for s in self.unit_segments[key]:
                self._release(s)

    def before_backward(self, unit) -> None:
        key = unit_key(unit)
        if self._gathering():
            for s in self.unit_segments[key]:
                self._acquire(s)
            if self.prefetch:
                self._prefetch(self._prev.get(key))
        for s in self.unit_segments[key]:
            if s.grad is None and not s.frozen:
                s.grad = self.xp.zeros(s.group.size * s.chunk, self.grad_dtype)
                for p in s.params:
                    a, b = s.where[id(p)]
                    p.grad = s.grad[a:b].reshape(p.data.shape)

    def after_backward(self, unit) -> None:
        key = unit_key(unit)
        for s in self.unit_segments[key]:
            s.left -= 0 if s.frozen else 1
            if s.left == 0:
                self._reduce(s)
                s.left = s.uses
            if self._gathering():
                holds = 1 + self._held_to_backward(key)  # (this backward's, and the forward's)
                if key == self._first:
                    holds -= 1
                    self._lazy.append(s)
                for _ in range(holds):
                    self._release(s)
        if self.overlap:  # the reductions in flight progressed between layers (docs/parallelism.md, Backends)
            self.poll()

    # ---- gradients ------------------------------------------------------------------------------
    def _reduce(self, s: Segment) -> None:
        """Segment s's micro-batch gradients final: their TP sums, then the reduce-scatter."""
        hooks = [(p, p.grad_sync) for p in s.params] if s.deferred else []
        for p, _ in hooks:
            p.grad_sync = None  # (run on the shard at the end of the step)
        try:
            tp_grad_sync(s.params, self.ctx.tp)
        finally:
            for p, hook in hooks:
                p.grad_sync = hook
        g, s.grad = s.grad, None
        for p in s.params:
            p.grad = _absent(self.xp, p.data.shape, self.grad_dtype)
        self._land_all(s)  # (the previous micro-batch's first: its pieces are added in order)
        mine = self.grad[s.shard_at:s.shard_at + s.chunk]
        if s.group.size == 1:  # nothing to reduce (nor to round)
            mine += g / self.divide_by if s.expert else g
            return
        low = g if self.reduce_dtype == g.dtype else g.astype(self.reduce_dtype)
        s.pending.append(s.group.start_reduce_scatter(low, "sum" if s.expert else "avg"))
        if not self.overlap:
            self._land_all(s)

    def _land_all(self, s: Segment) -> None:
        for request in s.pending:
            got = request.wait().astype(self.grad_dtype, copy=False)
            if s.expert:  # (an expert's sum over expert-DP x CP / (dp x cp): its DP x CP average)
                got = got / self.divide_by
            self.grad[s.shard_at:s.shard_at + s.chunk] += got
        s.pending = []

    def poll(self) -> None:
        for s in self.segments:
            for request in s.pending:
                request.test()

    def zero_grad(self) -> None:
        self.grad[...] = 0

    def begin_step(self) -> None:
        """Before a step's first forward: the whole parameters of `gather_all` given back (each
        rank's piece taken from them), nothing gathered but the first unit's gather that the
        last update started (with --overlap-param-gather)."""
        self._adopt_gathered()
        keep = set() if self.all_gathered else self._ahead
        self.all_gathered = False
        self._free_gathered(keep)
        self._ahead = set()
        self.peak_gathered_bytes = self.gathered_bytes  # (this step's, from here)

    def _adopt_gathered(self) -> None:
        """zero 3 after `gather_all`: each rank's piece taken from the whole parameters (which a
        checkpoint, or a caller, may have written)."""
        if self.zero == 3 and self.all_gathered:
            for s in self.segments:
                if s.full is not None:
                    r = s.group.rank
                    self.data[s.shard_at:s.shard_at + s.chunk] = s.full[r * s.chunk:(r + 1) * s.chunk]

    def _free_gathered(self, keep=()) -> None:
        self._lazy = []
        for s in self.segments:
            if s.full is not None and id(s) not in keep:
                self._free(s)

    def reduce_gradients(self, ctx) -> None:
        """After the step's backwards: every reduce-scatter landed (with `overlap`, but for HSDP,
        those of segments without a deferred hook land in `norm_terms`), the deferred hooks run
        on their shards, nothing gathered any more."""
        hsdp = self.replicas is not None and self.replicas.size > 1
        for s in self.segments:
            if hsdp or s.deferred or not self.overlap:
                self._land_all(s)
            assert s.grad is None and s.left == s.uses, f"segment {s.index}: a backward did not complete"
        if hsdp:  # HSDP: the replicas' shards averaged (the experts' pieces, divided already, summed)
            experts = [s for s in self.trained if s.expert]
            if not experts:
                self._across(self.grad, self.replicas, "avg")
            else:
                for group, op, segs in ((self.replicas, "avg", [s for s in self.trained if not s.expert]),
                                        (self.expert_replicas, "sum", experts)):
                    if segs:
                        both = self.xp.concatenate([self.grad[s.shard_at:s.shard_at + s.chunk] for s in segs])
                        self._across(both, group, op)
                        at = 0
                        for s in segs:
                            self.grad[s.shard_at:s.shard_at + s.chunk] = both[at:at + s.chunk]
                            at += s.chunk
        for s in self.trained:
            if s.deferred:
                mine = self.grad[s.shard_at:s.shard_at + s.chunk]
                for p in s.params:
                    if p.grad_sync is not None:
                        p.grad_sync(_GradOf(mine))
        self._free_gathered()
        self.gathered_bytes = 0

    def _across(self, buf, group, op: str) -> None:
        """buf all-reduced in place over `group` (HSDP's replicas), in the reduction dtype."""
        low = buf if self.reduce_dtype == buf.dtype else buf.astype(self.reduce_dtype)
        group.start_all_reduce(low, op, out=low).wait()  # (rank-ordered sums, as the optimizers')
        if low is not buf:
            buf[...] = low

    def norm_terms(self, ctx):
        """[sum of squares, non-finite entries] of this rank's shard, each full entry once. The
        segments whose reduce-scatters are still in flight are landed and counted last (the
        others' terms hide them); the terms are added in segment order all the same."""
        xp = self.xp
        sq, acc = {}, xp.zeros(2, np.float64)
        for s in sorted(self.trained, key=lambda s: bool(s.pending)):
            self._land_all(s)
            acc[1] += (~xp.isfinite(self.grad[s.shard_at:s.shard_at + s.chunk])).sum()
            sq.update(self._square_sums(s))
        for s in self.trained:
            for p in s.params:
                if (s.index, id(p)) in sq:
                    acc[0] += sq[s.index, id(p)]
        return acc

    def _square_sums(self, s: Segment) -> dict:
        """{(segment index, id(param)): the sum of squares of its entries in this rank's piece}."""
        xp, out = self.xp, {}
        for p in s.params:
            if p.norm_mask is False:
                continue
            a0, b0 = s.where[id(p)]
            a, b = self._mine(s, a0, b0)
            if b <= a:
                continue
            g = self.grad[a:b]
            if p.norm_mask is not None:
                shape, axis = p.data.shape, p.sharding.axis
                stride = int(np.prod(shape[axis + 1:], dtype=np.int64))
                first = a - s.shard_at + s.group.rank * s.chunk - a0
                index = (xp.arange(first, first + (b - a)) // stride) % shape[axis]
                g = g[p.norm_mask[index]]
            g64 = g.astype(np.float64)
            out[s.index, id(p)] = g64 @ g64
        return out

    def grad_norm(self, ctx) -> float:
        return finish_norm(ctx, self.norm_terms(ctx), self.group)  # (HSDP: a replica's shards)

    # ---- the update -------------------------------------------------------------------------------
    def _pieces(self, s: Segment):
        """([a, b) in shard coordinates, decays) over this rank's real elements of segment s."""
        for lo, hi, decays in ((0, s.n_decay, True), (s.n_decay, s.size, False)):
            a, b = self._mine(s, lo, hi)
            if b > a:
                yield a, b, decays

    def step(self, lr=None, grad_scale=1.0) -> None:
        """The update, segment by segment; zero 3 with `prefetch`: this stage's first unit's
        segments first, then their gather for the next step started (module docstring)."""
        self.step_count += 1
        ahead = self.zero == 3 and self.prefetch and not self.all_gathered
        opening = [s for s in self.unit_segments[self._opening] if not s.frozen] if ahead else []
        order = opening + [s for s in self.trained if s not in opening]
        if ahead and not opening:  # (nothing of it trains: its gather at once)
            self._gather_ahead()
        for k, s in enumerate(order):
            self._land_all(s)
            for a, b, decays in self._pieces(s):
                p = self.master[a:b] if self.master is not None else self._local(s)[a - s.shard_at:b - s.shard_at]
                ops.adamw_update(p, self.grad[a:b], self.m[a:b], self.v[a:b], None, lr=self.lr if lr is None else lr,
                                 beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                                 weight_decay=self.weight_decay if decays else 0.0, step=self.step_count,
                                 grad_scale=grad_scale)
            local = self._local(s)
            if self.master is not None:
                local[...] = self.master[s.shard_at:s.shard_at + s.chunk]  # rounded to nearest even
            if self.zero == 2 and s.group.size > 1:  # every rank's updated piece, in place
                s.group.start_all_gather(local, out=self.data[s.full_at:s.full_at + s.group.size * s.chunk]).wait()
            if opening and k == len(opening) - 1:
                self._gather_ahead()

    def _gather_ahead(self) -> None:
        """The next step's first unit's gathers started (kept by `begin_step`)."""
        self._prefetch(self._opening)
        self._ahead = {id(s) for s in self.unit_segments[self._opening]}

    def resync_masters(self) -> None:
        """Master weights := the parameters (after they were written outside the optimizer; at
        zero 3 into the whole parameters of `gather_all`)."""
        self._adopt_gathered()
        if self.master is not None:
            for s in self.trained:
                self.master[s.shard_at:s.shard_at + s.chunk] = self._local(s)

    def gather_all(self) -> None:
        """Every parameter whole (zero 3) until the next `begin_step` (evaluation, checkpoints)."""
        for s in self.segments:
            self._land_all(s)
        if self.zero == 3 and not self.all_gathered:
            for s in self.segments:
                self._start_gather(s)
            for s in self.segments:
                if s.gather is not None:
                    s.gather.wait()
                    s.gather = None
            self.all_gathered = True

    def drain(self) -> None:
        """Nothing in flight (before the communicators close)."""
        for s in self.segments:
            self._land_all(s)
            if s.gather is not None:
                s.gather.wait()
                s.gather = None


class _GradOf:
    """A stand-in parameter whose grad is a shard (a deferred grad_sync hook runs on it)."""

    trainable = True  # (the hooks skip frozen parameters; a shard's stand-in always trains)

    def __init__(self, grad):
        self.grad = grad
