"""Pipeline-parallel schedules: one optimizer step's micro-batches through the stages.

Megatron-LM's schedules (core/pipeline_parallel/schedules.py) on cutp's communicators, for a
model that is this rank's stage (`GPT` with ctx.pp_size > 1):

- "gpipe": every micro-batch forward, then every one backward; a stage keeps the activations of
  all m micro-batches.
- "1f1b" (PipeDream-Flush, the default): stage s runs min(p - s - 1, m) warm-up forwards, then
  one forward and one backward in turn, then the warm-up's backwards; at most p - s
  micro-batches are in flight on stage s (`Schedule.max_in_flight` records it).

Activations go to the next stage, their gradients back to the previous one, over ctx.pp
(replicated [b, T, h] tensors, or the [b, T/tp, h] sequence shards under sequence parallelism:
1/tp of the bytes). In the 1F1B steady state a send and the receive from the same neighbour go
as one `sendrecv` (MPI_Sendrecv; one NCCL group), so two neighbours sending to each other never
wait on each other's send. Every schedule runs the backwards in micro-batch order 0..m-1, so the
gradients are summed in the same order, bit for bit, whichever schedule and whatever p.

Each stage holds the activations of its micro-batches in flight outside its modules
(`GPT.take_activations` after a forward, `restore_activations` before its backward). Dropout
draws by global position (`RNGTracker.set_position` per micro-batch), so the masks, too, are
those of one rank.
"""
from __future__ import annotations

import time

from ..model import DTYPES
from ..runtime.backend import get_array_module

SCHEDULES = ("1f1b", "gpipe")
# One tag for every message: a stage sends activations only to the next stage and gradients only
# to the previous one, so the direction tells them apart, and messages between two ranks arrive in
# the order they were sent.
_TAG = 0


class Schedule:
    """One step's micro-batches on this rank's stage. `batches`: [(x, y)] host arrays of this DP
    rank; `weights`: each micro-batch's weight in the step's loss (train_step's _loss_weights);
    `first_row(i)`: the micro-batch's first row in the step's global batch (dropout positions)."""

    def __init__(self, run, batches, weights, step: int, first_row, loss_scale: float, hooks):
        self.run, self.model, self.ctx = run, run.model, run.ctx
        self.batches, self.weights, self.step = batches, weights, step
        self.first_row, self.loss_scale, self.hooks = first_row, loss_scale, hooks
        self.loss_sum = 0.0  # the weighted losses (last stage)
        self.kept: dict[int, list] = {}
        self.max_in_flight = 0
        self.wait_s = 0.0  # host time inside this stage's sends and receives (the bubble, on the CPU)
        pp = self.ctx.pp
        self.prev = pp.rank - 1 if pp.rank > 0 else None
        self.next = pp.rank + 1 if pp.rank < pp.size - 1 else None

    # ---- point to point ----------------------------------------------------------------------
    def _buffer(self, i):
        """Receive buffer of micro-batch i's activation (or its gradient) at this stage's input."""
        x = self.batches[i][0]
        T = x.shape[1]
        if self.model.sequence_parallel and self.ctx.tp_size > 1:
            T //= self.ctx.tp_size
        return self.ctx.xp.empty((x.shape[0], T, self.model.config.n_embd), DTYPES[self.model.config.dtype])

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.wait_s += time.perf_counter() - t0

    def recv_forward(self, i):
        if self.prev is None:
            return None
        return self._timed(self.ctx.pp.recv, self._buffer(i), self.prev, _TAG)

    def send_forward(self, out):
        if self.next is not None:
            self._timed(self.ctx.pp.send, _contiguous(out), self.next, _TAG)

    def recv_backward(self, i):
        if self.next is None:
            return None
        return self._timed(self.ctx.pp.recv, self._buffer(i), self.next, _TAG)

    def send_backward(self, dx):
        if self.prev is not None:
            self._timed(self.ctx.pp.send, _contiguous(dx), self.prev, _TAG)

    def send_forward_recv_backward(self, out, i):
        """Sends this micro-batch's output and receives micro-batch i's output gradient, both
        with the next stage, as one exchange."""
        if self.next is None:
            return None
        return self._timed(self.ctx.pp.sendrecv, _contiguous(out), self.next, self._buffer(i), self.next, _TAG)

    def send_backward_recv_forward(self, dx, i):
        """Sends an input gradient and receives micro-batch i's input, both with the previous stage."""
        if self.prev is None:
            return None
        return self._timed(self.ctx.pp.sendrecv, _contiguous(dx), self.prev, self._buffer(i), self.prev, _TAG)

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, i, inp):
        model, ctx = self.model, self.ctx
        x, y = self.batches[i]
        model.check_inputs(x, y)  # on the host arrays
        model.rng.set_position(self.step, self.first_row(i), self.run.config.batch_size)
        if model.first_stage:
            inp = ctx.asarray(x)
        out = model.stage_forward(inp, ctx.asarray(y) if model.last_stage else None)
        if model.last_stage:
            self.loss_sum += self.weights[i] * out
            out = None
        self.hooks.after_forward(self.run, i)  # (before the caches are taken: the hooks measure them)
        self.kept[i] = model.take_activations()
        self.max_in_flight = max(self.max_in_flight, len(self.kept))
        ctx.watchdog.progress()
        return out

    def backward(self, i, grad):
        model = self.model
        model.restore_activations(self.kept.pop(i))
        if model.last_stage:
            grad = self.loss_scale * self.weights[i]
        dx = model.stage_backward(grad)
        self.ctx.watchdog.progress()
        return dx

    # ---- schedules ---------------------------------------------------------------------------
    def gpipe(self):
        m = len(self.batches)
        for i in range(m):
            self.send_forward(self.forward(i, self.recv_forward(i)))
        for i in range(m):
            self.send_backward(self.backward(i, self.recv_backward(i)))

    def one_f_one_b(self):
        m, p, s = len(self.batches), self.ctx.pp_size, self.ctx.pp_rank
        warmup = min(p - s - 1, m)
        steady = m - warmup
        for i in range(warmup):
            self.send_forward(self.forward(i, self.recv_forward(i)))
        inp = self.recv_forward(warmup) if steady else None
        for k in range(steady):
            out = self.forward(warmup + k, inp)
            dx = self.backward(k, self.send_forward_recv_backward(out, k))
            if k == steady - 1:
                self.send_backward(dx)
            else:
                inp = self.send_backward_recv_forward(dx, warmup + k + 1)
        for i in range(steady, m):
            self.send_backward(self.backward(i, self.recv_backward(i)))

    def run_step(self, kind: str) -> float:
        """Runs the step's micro-batches; returns the weighted loss sum (0.0 off the last stage)."""
        {"gpipe": self.gpipe, "1f1b": self.one_f_one_b}[kind]()
        assert not self.kept, f"micro-batches {sorted(self.kept)} were never run backward"
        return self.loss_sum


def eval_losses(run, batches) -> list[float]:
    """Eval-mode forwards of `batches` through the pipeline (no backward); the losses on the last
    stage, [] elsewhere."""
    sched = Schedule(run, batches, [1.0] * len(batches), 0, lambda i: 0, 1.0, None)
    model, ctx = run.model, run.ctx
    losses = []
    for i, (x, y) in enumerate(batches):
        inp = ctx.asarray(x) if model.first_stage else sched.recv_forward(i)
        out = model.stage_forward(inp, ctx.asarray(y) if model.last_stage else None)
        if model.last_stage:
            losses.append(out)
        else:
            sched.send_forward(out)
        ctx.watchdog.progress()
    return losses


def _contiguous(a):
    return get_array_module(a).ascontiguousarray(a)  # (the array itself when it is contiguous)
