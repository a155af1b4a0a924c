"""Issue 30: overlapping communication with computation changes no bit, starts early, and
cannot hang.

- At tp2 x dp2, dp4 with the distributed optimizer, tp2 + sequence parallelism (x dp2, ZeRO)
  and pp2 x dp2, in float32 and bfloat16, two steps with --overlap-grad-reduce (small buckets:
  several per rank), --tp-comm-overlap and, with ZeRO, --overlap-param-gather give the losses
  and the weights of the same run without them, tolerance 0; the buckets did start during the
  backward.
- MoE at dp4 x ep2 (plain and ZeRO, float64 and float32) and tp2 + SP x dp2 x ep2 + ZeRO
  (bfloat16): the experts' own buckets over expert-DP change no bit and start during the
  backward; an instrumented expert-DP group shows the first expert bucket's reduction before
  block 0's backward ends, and the experts' parameter broadcasts.
- An instrumented DP communicator: the first bucket's reduction starts before the backward of
  the first layers has run; bucket k + 1's parameter broadcast starts before the forward of
  bucket k's layers ends.
- A rank stuck with a bucket pending: the peer's watchdog ends the job naming the wait.
"""
import numpy as np

from cutp.bench.model import random_tokens
from cutp.models import GPTConfig
from cutp.train import RunConfig, build_run, train_step
from cutp.comm.base import WrappedCommunicator
from tests.mpirun import run_mpi

LAYOUTS = {  # name: RunConfig settings (4 ranks)
    "tp2 x dp2": dict(tp=2, dp=2),
    "dp4 + ZeRO": dict(dp=4, distributed_optimizer=True),
    "tp2 + SP x dp2": dict(tp=2, dp=2, sequence_parallel=True, distributed_optimizer=True),
    "pp2 x dp2": dict(pp=2, dp=2),
}
N_LAYER = {"pp2 x dp2": 4}  # (two blocks per stage: a stage's buckets can start before its last unit)
OVERLAP = dict(overlap_grad_reduce=True, bucket_size=600, tp_comm_overlap=True)


def _config(dtype, layout, n_layer=2, moe=None, **overlap):
    model = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=61, block_size=8, dtype=dtype, vocab_multiple=1,
                      **(moe or {}))
    return RunConfig(model=model, batch_size=8, micro_batch_size=2, seq_len=8, steps=3, warmup=1, seed=3,
                     eval_every=0, quiet=True, save_on_signal=False, **layout, **overlap)


def _train(cfg, comm, data, expert_events=None):
    """Two steps: losses, weights, the last step's bucket starts ((member, bucket, units seen):
    member 1 the experts' buckets at ep > 1). `expert_events`: a list to log the expert-DP
    group's starts and the blocks' backwards into."""
    run = build_run(cfg, comm, dataset=data)
    buckets = run.grad_buckets
    members = [] if buckets is None else getattr(buckets, "members", [buckets])
    if expert_events is not None:
        experts = members[1]
        experts.group = _Recording(experts.group, expert_events, experts.flat)
        if run.param_gather is not None:  # (the experts' parameter broadcasts, on the same group)
            run.param_gather.members[1].group = experts.group
        for block in run.model.layers:
            block.layer = run.model.layers.index(block)
            _logging(expert_events, block, "backward")
    losses = [train_step(run).loss for _ in range(2)]
    starts = [(k, b, units) for k, m in enumerate(members) for b, units in m.started_log]
    run.gather_params()
    weights = [run.ctx.to_numpy(p.data).copy() for p in run.model.parameters()]
    run.close()
    return losses, weights, starts


def _worker():
    from mpi4py import MPI

    data = random_tokens(61, 4096, 0)
    for dtype in ("float32", "bfloat16"):
        for name, layout in LAYOUTS.items():
            extra = dict(OVERLAP, overlap_param_gather=bool(layout.get("distributed_optimizer")))
            n = N_LAYER.get(name, 2)
            off_losses, off_weights, _ = _train(_config(dtype, layout, n), MPI.COMM_WORLD, data)
            on_losses, on_weights, starts = _train(_config(dtype, layout, n, **extra), MPI.COMM_WORLD, data)
            assert on_losses == off_losses, (name, dtype, on_losses, off_losses)
            for a, b in zip(on_weights, off_weights):
                assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), (name, dtype)
            assert len(starts) > 2, (name, starts)
            # some bucket started before the backward's last unit (the embeddings) had run
            assert min(units for _, _, units in starts) < max(units for _, _, units in starts), (name, starts)


MOE = dict(n_experts=4, moe_top_k=2, moe_ffn=32)
MOE_LAYOUTS = {  # ep 2 carved from dp 4 (expert-DP 2); tp2 x dp2 at ep 2 (expert-DP 1, TP-partial experts)
    "dp4 ep2": dict(dp=4, ep=2),
    "dp4 ep2 + ZeRO": dict(dp=4, ep=2, distributed_optimizer=True),
    "tp2 + SP x dp2 ep2 + ZeRO": dict(tp=2, dp=2, ep=2, sequence_parallel=True, distributed_optimizer=True),
}
MOE_DTYPES = {"tp2 + SP x dp2 ep2 + ZeRO": ("bfloat16",)}


def _moe_worker():
    """MoE at ep 2: the experts' own buckets over expert-DP (and, with ZeRO, their own parameter
    broadcasts) change no bit; at dp4 ep2 + ZeRO (float32) an instrumented expert-DP group shows
    the first expert bucket's reduction starting before block 0's backward has ended."""
    from mpi4py import MPI

    data = random_tokens(61, 4096, 0)
    for name, layout in MOE_LAYOUTS.items():
        for dtype in MOE_DTYPES.get(name, ("float64", "float32")):
            extra = dict(OVERLAP, overlap_param_gather=bool(layout.get("distributed_optimizer")))
            off_losses, off_weights, _ = _train(_config(dtype, layout, moe=MOE), MPI.COMM_WORLD, data)
            events = [] if (name, dtype) == ("dp4 ep2 + ZeRO", "float32") else None
            on_losses, on_weights, starts = _train(_config(dtype, layout, moe=MOE, **extra), MPI.COMM_WORLD, data,
                                                   expert_events=events)
            assert on_losses == off_losses, (name, dtype, on_losses, off_losses)
            for a, b in zip(on_weights, off_weights):
                assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), (name, dtype)
            experts = [units for member, _, units in starts if member == 1]
            assert len(experts) >= 2, (name, starts)
            # an expert bucket started after the head's backward, before the last unit's (the embeddings)
            assert any(0 < units < 4 for units in experts), (name, starts)
            if events is not None:
                last_backward = max(i for i, e in enumerate(events) if e == ("backward", "begin", 1))
                first = next(i for i, e in enumerate(events) if i > last_backward and e[:2] == ("start", "reduce"))
                block0_done = next(i for i, e in enumerate(events) if i > last_backward and e == ("backward", "end", 0))
                assert first < block0_done, events[last_backward:block0_done + 1]
                # the experts' updated parameters went out in broadcasts per bucket (the first step's update)
                assert sum(e[:2] == ("start", "broadcast") for e in events) >= 2, events


def _both_workers():
    _worker()
    _moe_worker()
    _order_worker()


def test_overlap_changes_no_bit_and_starts_each_collective_early():
    """(One launch for both claims: the bits, then the order of the instrumented collectives.)"""
    run_mpi(4, "tests.train.test_overlap:_both_workers", timeout=300)


class _Recording(WrappedCommunicator):
    """Logs each non-blocking collective's start (op, which bucket) into a shared event list."""

    def __init__(self, inner, events, flat):
        super().__init__(inner)
        self.events, self.flat = events, flat

    def _start(self, op, x, fn, *args):
        self.events.append(("start", op, _bucket_at(self.flat, x)))
        return fn(*args)


def _bucket_at(flat, x):
    """The flat-buffer offset where x starts (buckets are named by their start)."""
    base = flat.grad if np.shares_memory(x, flat.grad) else flat.data
    return (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // base.itemsize \
        if np.shares_memory(x, base) else None


def _logging(events, block, what):
    plain = getattr(block, what)

    def logged(*args, **kw):
        events.append((what, "begin", block.layer))
        out = plain(*args, **kw)
        events.append((what, "end", block.layer))
        return out

    setattr(block, what, logged)


def _order_worker():
    """An instrumented DP communicator and logged block forwards/backwards, dp4 + ZeRO: the first
    bucket's reduction starts before the backward of the first layers has run, and bucket k + 1's
    parameter broadcast starts before the forward of bucket k's layers ends."""
    from mpi4py import MPI

    cfg = _config("float32", dict(dp=4, distributed_optimizer=True), 3, overlap_grad_reduce=True, bucket_size=600,
                  overlap_param_gather=True)
    run = build_run(cfg, MPI.COMM_WORLD, dataset=random_tokens(61, 4096, 0))
    events = []
    run.grad_buckets.group = run.param_gather.group = _Recording(run.grad_buckets.group, events, run.flat)
    for block in run.model.layers:
        block.layer = run.model.layers.index(block)
        _logging(events, block, "forward")
        _logging(events, block, "backward")
    train_step(run)
    step_end = len(events)
    train_step(run)  # its forward waits for the gathers the first step's update started
    run.close()
    # the last micro-batch's backward: its first bucket reduction starts before block 0's backward has run
    last_backward = max(i for i, e in enumerate(events[:step_end]) if e == ("backward", "begin", 2))
    first_reduce = next(i for i, e in enumerate(events) if i > last_backward and e[:2] == ("start", "reduce"))
    block0_done = next(i for i, e in enumerate(events) if i > last_backward and e == ("backward", "end", 0))
    assert first_reduce < block0_done, events[last_backward:block0_done + 1]
    # the next step's forward: bucket k + 1's broadcast starts before the forward of bucket k's layers ends
    gather = run.param_gather
    second_forward = step_end
    starts = {}  # bucket -> where its broadcast first started in the second step
    for i, e in enumerate(events[second_forward:]):
        if e[:2] == ("start", "broadcast"):
            starts.setdefault(e[2], second_forward + i)
    order = [b.start for b in gather.order]
    checked = 0
    for k, bucket in enumerate(gather.order[:-1]):
        users = [j for j, (_, need) in enumerate(gather._needs) if any(b is bucket for b in need)]
        unit = users[0] - (1 if run.model.takes_tokens() else 0)  # block index of its first user
        if not 0 <= unit < len(run.model.layers):
            continue  # (the embeddings' or the head's bucket)
        ends = next(i for i, e in enumerate(events) if i > second_forward and e == ("forward", "end", unit))
        assert starts[order[k + 1]] < ends, (k, order, events[second_forward:ends + 1])
        checked += 1
    assert checked >= 2, checked


def _stuck_worker():
    """Rank 1 stops for good right after its first bucket's reduction has started."""
    import time

    from mpi4py import MPI

    cfg = _config("float32", dict(dp=2), overlap_grad_reduce=True, bucket_size=600, collective_timeout=2)
    run = build_run(cfg, MPI.COMM_WORLD, dataset=random_tokens(61, 4096, 0))
    if run.ctx.rank == 1:
        run.ctx.watchdog.timeout = 0  # (a rank stuck for good notices nothing: the peer's watchdog must)
        start = run.grad_buckets._start

        def start_then_hang(bucket):
            start(bucket)
            time.sleep(120)

        run.grad_buckets._start = start_then_hang
    train_step(run)


def test_a_rank_stuck_with_a_bucket_pending_ends_the_job_naming_the_wait():
    import time

    t0 = time.monotonic()
    res = run_mpi(2, "tests.train.test_overlap:_stuck_worker", timeout=60, expect_failure=True)
    assert time.monotonic() - t0 < 20
    assert "[rank 0] cutp watchdog: waiting for the non-blocking all_reduce on group 'dp' (rank 0 of 2" \
           in res.stdout, res.stdout[-3000:]


def test_param_gather_overlap_alone_reduces_every_bucket_at_the_end_and_changes_no_bit():
    """--overlap-param-gather without --overlap-grad-reduce: the buckets exist (for the gathers) but
    no backward hook releases their gradients; every bucket starts at the end of the step, after
    every unit (in process: one rank, ZeRO 1)."""
    from mpi4py import MPI

    data = random_tokens(61, 4096, 0)
    layout = dict(distributed_optimizer=True)
    off_losses, off_weights, _ = _train(_config("float32", layout, 1), MPI.COMM_SELF, data)
    on_losses, on_weights, starts = _train(_config("float32", layout, 1, overlap_param_gather=True), MPI.COMM_SELF,
                                           data)
    assert on_losses == off_losses
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(on_weights, off_weights))
    assert len(starts) > 2 and {units for _, _, units in starts} == {0}  # (no unit's hook ran: all at finish)
