"""DP gradient buckets reduced during the backward, and parameter gathers during the forward.

`GradBuckets` cuts the optimizer's flat gradient buffer into buckets of about `bucket_size`
elements (default: Megatron's max(40M, 1M x dp), at most an eighth of the buffer; a bucket ends at the first parameter boundary
at or past that size, and with the distributed optimizer also at each DP rank's shard boundary,
so that each bucket belongs to one rank's shard). The model calls `grads_final(unit)` after the
backward of each unit of the last micro-batch (`GPT.units`: the head, each block, the
embeddings); when every parameter touching a bucket has had all its units' backwards, the
bucket is ready, and the buckets start in one fixed order on every rank (the order in which
they become ready in a backward, computed once from the units: a mismatch would pair
different buckets' collectives, wrong sums or a hang on NCCL): a bucket starts once it is
ready and all buckets before it have started. Starting a bucket first sums its sequence-
parallel (and other TP-partial) gradients over TP, then starts its DP reduction: an all-reduce
(averaged), or with the distributed optimizer a reduce to the rank whose shard holds it (the
other ranks' copies are not needed: their optimizers read their own shards only). `finish()`
(before the gradient norm) starts whatever has not started and waits for every bucket.
Between units `grads_final` also polls the buckets in flight (MPI progresses only inside its
calls: cutp.comm.mpi).

Parameters with a grad_sync hook (the tied embedding summed over the pipeline's ends, GQA's
replicated KV columns) run it at `finish()`: those collectives are over other groups whose
ranks are elsewhere in their backward, so their buckets start last.

Bit-identical with and without overlap: MPI's non-blocking reductions add the ranks' values in
rank order whatever the cut (cutp.comm.mpi), and the blocking path of the optimizers uses the
same requests, so a bucket's sum is the whole buffer's. (NCCL's order depends on its message
sizes: on GPUs a bucket's sum is the same value up to rounding.)

`ParamGather` is the distributed optimizer's other half (`--overlap-param-gather`): after the
update, each bucket's owner broadcasts its updated parameters (the same bytes per rank as the
all-gather, one bucket at a time); before a unit's forward, the buckets of its parameters are
waited for and the next bucket's broadcast started (one ahead, Megatron's prefetch).

Expert parallelism (ep > 1; Megatron's expert-parallel buffers and bucket groups): the experts
reduce over another group (expert-DP x CP), so they get buckets of their own, a `GradBuckets`
over their range of the plain optimizer's buffer (`region`) or over the ExpertParallelAdamW's
expert part, summed over that group and divided by dp x cp (`divide_by`: what the optimizers'
own reductions do, so the bits are theirs); `GradBucketGroups` and `ParamGathers` run the dense
and the expert sets as one, each starting its buckets in its own fixed order on its own group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..runtime.backend import get_array_module
from ..tensor_parallel import tp_grad_sync


MIN_BUCKETS = 8  # the default size cuts at least this many buckets of a buffer (parameters allowing)


def default_bucket_size(dp: int, elements: int | None = None) -> int:
    """Megatron's max(40M, 1M x dp) ("larger DP sizes need larger buckets to ensure collectives
    do not become latency-bound"), but at most 1/MIN_BUCKETS of `elements` (the gradient buffer
    to cut): a model smaller than Megatron's bucket would be one bucket, reduced only after the
    whole backward, nothing hidden (measured: 0% hidden in one bucket, 99% in 2M-element ones)."""
    size = max(40_000_000, 1_000_000 * dp)
    return size if not elements else min(size, max(1, -(-int(elements) // MIN_BUCKETS)))


@dataclass
class Bucket:
    start: int  # [start, stop) of the flat buffer
    stop: int
    owner: int | None  # the DP rank whose shard holds it (distributed optimizer), else None
    params: list = field(default_factory=list)  # the parameters with elements in it
    ready_at: int = -1  # the unit (counted over one backward) after which it is ready
    pending: int = 0  # its parameters not final yet, this step
    request: object = None
    low: object = None  # its gradients in the reduction dtype, while in flight (16-bit reductions)

    @property
    def size(self) -> int:
        return self.stop - self.start


def cut_buckets(flat, bucket_size: int, shards: int | None = None, region: tuple | None = None) -> list[Bucket]:
    """Buckets of flat's padded buffer in buffer order (module docstring); `shards`: the
    distributed optimizer's DP size (each bucket inside one shard), None for the plain one;
    `region`: [lo, hi) of the buffer to cut (the plain one's; default all of it)."""
    n = flat.padded_size
    if region is not None and shards is not None and tuple(region) != (0, n):
        raise ValueError("a distributed optimizer's buckets cover its whole buffer (its shards)")
    regions = [(0, n, None) if region is None else (region[0], region[1], None)] if shards is None else \
        [(r * n // shards, (r + 1) * n // shards, r) for r in range(shards)]
    bounds = sorted({s.start for s in flat.slices.values()} | {s.stop for s in flat.slices.values()})
    buckets = []
    for lo, hi, owner in regions:
        a = lo
        for b in bounds:
            if lo < b < hi and b - a >= bucket_size:
                buckets.append(Bucket(a, b, owner))
                a = b
        if hi > a:
            buckets.append(Bucket(a, hi, owner))
    for bucket in buckets:
        bucket.params = [p for p in flat.params if flat.slices[p.name].start < bucket.stop
                         and flat.slices[p.name].stop > bucket.start]
    return buckets


def _unit_params(unit) -> list:
    seen, out = set(), []
    for m in unit:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class GradBuckets:
    """The DP gradient reduction of `optimizer` (AdamW or DistributedAdamW) over `group` (the
    gradient reduction group: the DP group, or whichever group the optimizer averages over),
    in buckets (module docstring). `units`: every unit of the model stage in the order their
    backwards run in one micro-batch (chunks last to first); `tp`: the TP group. `region`
    ([lo, hi) of the plain optimizer's buffer) and `divide_by` (None: averaged over `group`;
    n: summed over it, then divided by n) for the experts at ep > 1 (module docstring)."""

    def __init__(self, optimizer, group, units, bucket_size: int, tp=None, *, region: tuple | None = None,
                 divide_by: int | None = None):
        self.optimizer, self.group, self.tp = optimizer, group, tp
        self.flat = optimizer.flat
        self.distributed = bool(optimizer.distributed)
        self.divide_by = divide_by
        self.buckets = cut_buckets(self.flat, bucket_size, group.size if self.distributed else None, region)
        mine = {id(p) for bucket in self.buckets for p in bucket.params}
        self.params = [p for p in self.flat.params if id(p) in mine]  # (the region's only)
        self._units = [[p for p in _unit_params(u) if id(p) in mine] for u in units]
        self._uses = {}  # id(param) -> how many units hold it (+1 for a grad_sync hook: run at finish)
        for params in self._units:
            for p in params:
                self._uses[id(p)] = self._uses.get(id(p), 0) + 1
        for p in self.params:  # (a parameter no unit holds is final from the start: 0 uses)
            self._uses[id(p)] = self._uses.get(id(p), 0) + (1 if p.grad_sync is not None else 0)
        self._buckets_of = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._buckets_of.setdefault(id(p), []).append(bucket)
        self._order_by_readiness()
        self.reset()

    def _order_by_readiness(self) -> None:
        """The start order: when each bucket becomes ready in a backward (then buffer order)."""
        left = dict(self._uses)
        final_at = {}
        for k, params in enumerate(self._units):
            for p in params:
                left[id(p)] -= 1
                if left[id(p)] == 0:
                    final_at[id(p)] = k
        never = len(self._units)  # grad_sync hooks: at finish
        for bucket in self.buckets:
            bucket.ready_at = max([final_at.get(id(p), -1 if self._uses[id(p)] == 0 else never)
                                   for p in bucket.params], default=-1)
        self.order = sorted(self.buckets, key=lambda b: (b.ready_at, b.start))

    def reset(self) -> None:
        """Before a step's last backward: nothing final, nothing started."""
        self._left = dict(self._uses)
        for bucket in self.buckets:
            bucket.pending = sum(1 for p in bucket.params if self._left[id(p)] > 0)
            bucket.request = bucket.low = None
        self._next = 0  # self.order[_next] is the next bucket to start
        self._synced = set()  # parameters whose TP sums are done
        self._units_seen = 0
        self.started_log = []  # (bucket index in buffer order, units seen before it started): tests

    # ---- during the backward ---------------------------------------------------------------------
    def grads_final(self, unit) -> None:
        """The model's after_unit_backward hook (the last micro-batch only)."""
        self._units_seen += 1
        for p in _unit_params(unit):
            self._release(p)
        self._start_ready()
        self.poll()

    def _release(self, p) -> None:
        left = self._left.get(id(p), 0)
        if left <= 0:
            return
        self._left[id(p)] = left - 1
        if left == 1:
            for bucket in self._buckets_of.get(id(p), ()):
                bucket.pending -= 1

    def _start_ready(self) -> None:
        while self._next < len(self.order) and self.order[self._next].pending == 0:
            self._start(self.order[self._next])
            self._next += 1

    def _start(self, bucket: Bucket) -> None:
        todo = [p for p in bucket.params if id(p) not in self._synced]
        self._synced.update(id(p) for p in todo)
        tp_grad_sync(todo, self.tp)  # grad_sync hooks, then the sequence-parallel sums over TP
        self.started_log.append((self.buckets.index(bucket), self._units_seen))
        g = self.flat.grad[bucket.start:bucket.stop]
        if self.group.size == 1:  # nothing to reduce (nor to round: the optimizers skip it too)
            self._divide(bucket, g)
            return
        low = g if self.optimizer.reduce_dtype == g.dtype else g.astype(self.optimizer.reduce_dtype)
        bucket.low = low
        op = "avg" if self.divide_by is None else "sum"
        if self.distributed:
            bucket.request = self.group.start_reduce(low, bucket.owner, op)
        else:
            bucket.request = self.group.start_all_reduce(low, op, out=low)

    def _divide(self, bucket: Bucket, g) -> None:
        """The experts' sum / (dp x cp), on the ranks that keep the bucket (as the optimizers do)."""
        if self.divide_by is not None and (not self.distributed or bucket.owner == self.group.rank):
            g /= self.divide_by

    def poll(self) -> None:
        for bucket in self.order[:self._next]:
            if bucket.request is not None and bucket.request.test():
                self._land(bucket)

    def _land(self, bucket: Bucket) -> None:
        bucket.request.wait()
        g = self.flat.grad[bucket.start:bucket.stop]
        if bucket.low is not g and (not self.distributed or bucket.owner == self.group.rank):
            g[...] = bucket.low
        self._divide(bucket, g)
        bucket.request = bucket.low = None

    # ---- after it ---------------------------------------------------------------------------
    def finish(self) -> None:
        """Every bucket started (the grad_sync hooks run now), then waited for, in start order."""
        self.start_rest()
        self.wait()

    def start_rest(self) -> None:
        """The buckets not started yet started (the grad_sync hooks run now)."""
        for p in self.params:
            if p.grad_sync is not None:
                self._release(p)
        for p in self.params:  # a step without the hook (overlap off): everything is final
            while self._left.get(id(p), 0) > 0:
                self._release(p)
        self._start_ready()
        assert self._next == len(self.order), "a bucket did not start"

    def wait(self) -> None:
        """Every bucket waited for, in start order (all started: `start_rest`)."""
        for bucket in self.order:
            if bucket.request is not None:
                self._land(bucket)


class GradBucketGroups:
    """Several GradBuckets driven as one (ep > 1: the dense parameters' over DP x CP, then the
    experts' over expert-DP x CP; module docstring). Each starts its own buckets in its own
    order on its own group; every rank calls them in the same order."""

    def __init__(self, members):
        self.members = list(members)
        self.buckets = [b for m in self.members for b in m.buckets]

    def reset(self) -> None:
        for m in self.members:
            m.reset()

    def grads_final(self, unit) -> None:
        for m in self.members:
            m.grads_final(unit)

    def finish(self) -> None:
        """Every member's buckets started, then every one waited for."""
        for m in self.members:
            m.start_rest()
        for m in self.members:
            m.wait()

    @property
    def started_log(self) -> list:
        """The members' logs, bucket indices into `buckets` (tests)."""
        out, offset = [], 0
        for m in self.members:
            out += [(k + offset, units) for k, units in m.started_log]
            offset += len(m.buckets)
        return out


class ParamGather:
    """The distributed optimizer's updated parameters broadcast per bucket from their owners
    (module docstring). `units`: the model stage's units in forward order (chunk 0 first)."""

    def __init__(self, buckets: GradBuckets, units):
        self.group, self.flat = buckets.group, buckets.flat
        by_param = {}
        for bucket in buckets.buckets:
            for p in bucket.params:
                by_param.setdefault(id(p), []).append(bucket)
        # the buckets in the order the forward first needs them (then those no unit uses)
        self.order, seen = [], set()
        self._needs = []  # per unit: the buckets to wait for before it
        for unit in units:
            need = []
            for p in _unit_params(unit):
                for bucket in by_param.get(id(p), ()):
                    if id(bucket) not in seen:
                        seen.add(id(bucket))
                        self.order.append(bucket)
                    need.append(bucket)
            self._needs.append((frozenset(id(p) for p in _unit_params(unit)), need))
        self.order += [b for b in buckets.buckets if id(b) not in seen]
        self._requests = {}
        self._next = 0
        self.started_log = []  # (bucket index in buffer order, units entered before it started): tests
        self._entered = 0
        self._all = buckets.buckets

    @property
    def in_flight(self) -> bool:
        return self._next > 0 or bool(self._requests)

    def start(self) -> None:
        """After the update: the first bucket's broadcast (the next ones start as the forward goes)."""
        self._entered = 0
        self.started_log = []
        self._start_next()

    def _start_next(self) -> None:
        if self._next < len(self.order):
            bucket = self.order[self._next]
            self._next += 1
            self.started_log.append((self._all.index(bucket), self._entered))
            self._requests[id(bucket)] = self.group.start_broadcast(self.flat.data[bucket.start:bucket.stop],
                                                                     bucket.owner)

    def _wait(self, bucket) -> None:
        while self.order.index(bucket) >= self._next:
            self._start_next()  # (needed before its turn: start everything up to it)
        request = self._requests.pop(id(bucket), None)
        if request is not None:
            request.wait()

    def before_forward(self, unit) -> None:
        """The model's before_unit_forward hook: this unit's buckets waited for, the next started."""
        ids = {id(p) for p in _unit_params(unit)}
        need = next((n for key, n in self._needs if key == ids), [])
        for bucket in need:
            self._wait(bucket)
        self._entered += 1
        self._start_next()
        for request in self._requests.values():
            request.test()
        if self._entered == len(self._needs):  # the last unit: nothing may be in flight at the update
            self.finish()

    def finish(self) -> None:
        """Every bucket's parameters in place (before anything else reads the parameters)."""
        while self._next < len(self.order):
            self._start_next()
        for bucket in self.order:
            self._wait(bucket)
        self._next = 0
        self._entered = 0


class ParamGathers:
    """Several ParamGathers driven as one (ep > 1: the dense part's and the experts' of an
    ExpertParallelAdamW; each part's update starts its own)."""

    def __init__(self, members):
        self.members = list(members)

    @property
    def in_flight(self) -> bool:
        return any(m.in_flight for m in self.members)

    def before_forward(self, unit) -> None:
        for m in self.members:
            m.before_forward(unit)  # (both parts' updates started theirs)

    def finish(self) -> None:
        for m in self.members:
            if m.in_flight:  # (a ParamGather's finish starts what has not started)
                m.finish()
