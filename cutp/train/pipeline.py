"""Pipeline-parallel schedules: one optimizer step's micro-batches through the stages.

Megatron-LM's schedules (core/pipeline_parallel/schedules.py) on cutp's communicators, for a
model that is this rank's stage (`GPT` with ctx.pp_size > 1):

- "gpipe": every micro-batch forward, then every one backward; a stage keeps the activations of
  all m micro-batches.
- "1f1b" (PipeDream-Flush, the default): stage s runs min(p - s - 1, m) warm-up forwards, then
  one forward and one backward in turn, then the warm-up's backwards; at most p - s
  micro-batches are in flight on stage s (`Schedule.max_in_flight` records it).
- "interleaved" (Megatron's interleaved 1F1B, Narayanan et al. 2021): each stage holds V model
  chunks (`GPT(pp_virtual=V)`; stage s's chunk c is virtual stage c * p + s), and the 1F1B
  pattern runs over the m * V chunk-forwards in groups of p micro-batches per chunk; the
  bubble shrinks by V, at V times the point-to-point messages. Stage s keeps at most
  min(m * V, 2 (p - s - 1) + (V - 1) p + 1) chunk-forwards in flight (all m * V at m = p, where
  every forward runs first). Needs m % p == 0.

A schedule is a plan (`plan(kind, p, s, m, V)`): a list of computations ("F"/"B", micro-batch,
chunk) and exchanges ("X", sends, receives) that `Schedule` runs. Each exchange posts its sends
and receives together (`Communicator.exchange`: MPI Isend/Irecv + Waitall, one NCCL group), and
lists activations before gradients on both sides, so that two neighbours never wait on each
other's send and NCCL, which has no tags, matches every message with its receive (tests check
both over many (kind, p, m, V) by simulating the plans of all stages). Every schedule runs each
chunk's backwards in micro-batch order 0..m-1, so the gradients are summed in the same order,
bit for bit, whichever schedule and whatever p and V.

Activations go to the next stage, their gradients back to the previous one, over ctx.pp
(replicated [b, T, h] tensors, or the [b, T/tp, h] sequence shards under sequence parallelism:
1/tp of the bytes); with chunks, the last stage's output of chunk c goes to the first stage's
chunk c + 1. Each stage holds the activations of its micro-batches in flight outside its
modules (`GPT.take_activations` after a forward, `restore_activations` before its backward).
Dropout draws by global position (`RNGTracker.set_position` per micro-batch), so the masks, too,
are those of one rank. An MoE model's step of several micro-batches first runs them all forward
through the stages, keeping nothing (`forwards_only`: cutp.train.moe's counting pass).
"""
from __future__ import annotations

import time

from ..data import model_kwargs
from ..models import DTYPES
from ..runtime.backend import get_array_module

SCHEDULES = ("1f1b", "gpipe", "interleaved")
# MPI tags (NCCL has none: there, the order of posting matches messages): activations go to the
# next stage and gradients to the previous one, which are the same rank at p = 2 with chunks.
ACTIVATION, GRADIENT = 0, 1


def pipeline_bubble(p: int, m: int, virtual: int = 1) -> float:
    """The ideal schedule's idle fraction of a step with equal stages: (p - 1) / (m + p - 1), the
    bubble of (p - 1) micro-batch times divided by V with V model chunks per stage (Narayanan et
    al. 2021, sec. 2.2), as a fraction of the step: (p - 1) / (V m + p - 1)."""
    return (p - 1) / (virtual * m + p - 1)


def plan(kind: str, p: int, s: int, m: int, virtual: int = 1) -> list[tuple]:
    """Stage s's part of one step: ("F", i, c) and ("B", i, c) run micro-batch i's forward or
    backward through model chunk c; ("X", sends, recvs) exchanges with the neighbours, each a list
    of (what, i, c), what being "act" (chunk c's output of micro-batch i, to the next stage; its
    input, from the previous) or "grad" (the gradient of that input, to the previous stage; of
    that output, from the next). Messages that have no peer (the model's input, its loss) are
    listed anyway; `Schedule` drops them."""
    if kind == "gpipe":
        return ([op for i in range(m) for op in (_x([], [("act", i, 0)]), ("F", i, 0), _x([("act", i, 0)], []))]
                + [op for i in range(m) for op in (_x([], [("grad", i, 0)]), ("B", i, 0), _x([("grad", i, 0)], []))])
    if kind == "1f1b":
        return _one_f_one_b(p, s, m)
    if kind == "interleaved":
        return _interleaved(p, s, m, virtual)
    raise ValueError(f"unknown pipeline schedule {kind!r}")


def _x(sends, recvs):
    return ("X", sends, recvs)


def _one_f_one_b(p, s, m):
    """PipeDream-Flush: Megatron's forward_backward_pipelining_without_interleaving."""
    warmup = min(p - s - 1, m)
    steady = m - warmup
    ops = []
    for i in range(warmup):
        ops += [_x([], [("act", i, 0)]), ("F", i, 0), _x([("act", i, 0)], [])]
    if steady:
        ops.append(_x([], [("act", warmup, 0)]))
    for k in range(steady):
        ops += [("F", warmup + k, 0), _x([("act", warmup + k, 0)], [("grad", k, 0)]), ("B", k, 0)]
        ops.append(_x([("grad", k, 0)], [("act", warmup + k + 1, 0)] if k < steady - 1 else []))
    for i in range(steady, m):
        ops += [_x([], [("grad", i, 0)]), ("B", i, 0), _x([("grad", i, 0)], [])]
    return ops


def _interleaved(p, s, m, V):
    """Megatron's forward_backward_pipelining_with_interleaving (V model chunks per stage)."""
    total = m * V

    def forward(k):  # the k-th chunk-forward: micro-batches in groups of p, each group through every chunk
        return (k // (p * V)) * p + k % p, (k % (p * V)) // p

    def backward(k):
        i, c = forward(k)
        return i, V - 1 - c

    if m == p:  # every forward first: Megatron's all_warmup_microbatches (without it, at m = p, the
        warmup = total  # last stages' first backward would wait on a gradient sent after their own)
    else:
        warmup = min(2 * (p - s - 1) + (V - 1) * p, total)
    steady = total - warmup
    ops = [_x([], [("act", *forward(0))])]
    for k in range(warmup):
        ops.append(("F", *forward(k)))
        recvs = [("act", *forward(k + 1))] if k + 1 < total else []
        if k == warmup - 1 and steady:
            recvs.append(("grad", *backward(0)))
        ops.append(_x([("act", *forward(k))], recvs))
    for k in range(steady):
        f = warmup + k
        ops += [("F", *forward(f)), ("B", *backward(k))]
        recvs = ([("act", *forward(f + 1))] if f + 1 < total else []) + (
            [("grad", *backward(k + 1))] if k + 1 < total else [])
        ops.append(_x([("act", *forward(f)), ("grad", *backward(k))], recvs))
    if not steady:
        ops.append(_x([], [("grad", *backward(0))]))
    for k in range(steady, total):
        ops.append(("B", *backward(k)))
        ops.append(_x([("grad", *backward(k))], [("grad", *backward(k + 1))] if k + 1 < total else []))
    return ops


class Schedule:
    """One step's micro-batches on this rank's stage. `batches`: [(x, y)] host arrays of this DP
    rank; `weights`: each micro-batch's weight in the step's loss (cutp.train.reductions.loss_weights);
    `first_row(i)`: the micro-batch's first row in the step's global batch (dropout positions);
    `aux_weight`: the MoE auxiliary losses' weight in each micro-batch's backward (train_step's)."""

    def __init__(self, run, batches, weights, step: int, first_row, loss_scale: float, hooks, aux_weight=0.0):
        self.run, self.model, self.ctx = run, run.model, run.ctx
        self.batches, self.weights, self.step = batches, weights, step
        self.first_row, self.loss_scale, self.hooks = first_row, loss_scale, hooks
        self.aux_weight = aux_weight  # of the MoE auxiliary losses (train_step)
        self.loss_sum = 0.0  # the weighted losses (last stage)
        self.kept: dict[tuple, list] = {}  # (micro-batch, chunk) -> its activations, while in flight
        self.max_in_flight = 0
        self.wait_s = 0.0  # host time inside this stage's sends and receives (the bubble, on the CPU)
        # by (micro-batch, chunk): received inputs and output gradients, results not yet sent
        self.inputs, self.output_grads, self.outputs, self.input_grads = {}, {}, {}, {}
        pp = self.ctx.pp
        self.prev, self.next = (pp.rank - 1) % pp.size, (pp.rank + 1) % pp.size
        self.posted = []  # --tp-comm-overlap: exchanges in flight (_Pending)

    # ---- point to point ----------------------------------------------------------------------
    def _buffer(self, i):
        """Receive buffer of micro-batch i's activation (or its gradient) at a chunk's input."""
        x = self.batches[i][0]
        T = x.shape[1]
        if self.model.training:  # context parallelism: this CP rank's chunks (evaluation: whole sequences)
            T //= self.ctx.cp_size
        if self.model.sequence_parallel and self.ctx.tp_size > 1:
            T //= self.ctx.tp_size
        return self.ctx.xp.empty((x.shape[0], T, self.model.config.n_embd), DTYPES[self.model.config.dtype])

    def exchange(self, sends, recvs):
        """Runs one ("X", sends, recvs) of the plan: the messages that cross to another stage."""
        model = self.model
        ops = []  # (tag, is_send, buffer, peer, where a receive goes)
        for what, i, c in sends:
            if what == "act" and not model.gives_loss(c):
                ops.append((ACTIVATION, True, _contiguous(self.outputs.pop((i, c))), self.next, None))
            elif what == "grad" and not model.takes_tokens(c):
                ops.append((GRADIENT, True, _contiguous(self.input_grads.pop((i, c))), self.prev, None))
        for what, i, c in recvs:
            if what == "act" and not model.takes_tokens(c):
                ops.append((ACTIVATION, False, self._buffer(i), self.prev, (self.inputs, (i, c))))
            elif what == "grad" and not model.gives_loss(c):
                ops.append((GRADIENT, False, self._buffer(i), self.next, (self.output_grads, (i, c))))
        if not ops:
            return
        ops.sort(key=lambda op: op[0])  # activations before gradients on both sides (NCCL matches by order)
        sends = [(buf, peer, tag) for tag, send, buf, peer, _ in ops if send]
        recvs = [(buf, peer, tag) for tag, send, buf, peer, _ in ops if not send]
        t0 = time.perf_counter()
        try:
            if self.run.config.tp_comm_overlap:  # posted now, waited for by the first use of what it brings
                pending = _Pending(self.ctx.pp.start_exchange(sends, recvs))
                self.posted.append(pending)
            else:
                self.ctx.pp.exchange(sends, recvs)
        finally:
            self.wait_s += time.perf_counter() - t0
        for _, send, buf, _, where in ops:
            if not send:
                table, key = where
                table[key] = _Arrival(pending, buf) if self.run.config.tp_comm_overlap else buf

    def _take(self, table, key):
        """A received input or gradient, waited for here when its exchange is still in flight."""
        value = table.pop(key)
        if isinstance(value, _Arrival):
            t0 = time.perf_counter()
            value.pending.wait()
            self.wait_s += time.perf_counter() - t0
            value = value.buffer
        return value

    def finish_exchanges(self) -> None:
        """Every posted exchange waited for (its sends' buffers free again)."""
        t0 = time.perf_counter()
        for pending in self.posted:
            pending.wait()
        self.posted = []
        self.wait_s += time.perf_counter() - t0

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, i, c):
        model, ctx = self.model, self.ctx
        x, y = self.batches[i]
        if c == 0:
            model.check_inputs(x, y)  # on the host arrays
        model.rng.set_position(self.step, self.first_row(i), self.run.config.batch_size)
        inp = ctx.asarray(x) if model.takes_tokens(c) else self._take(self.inputs, (i, c))
        out = model.stage_forward(inp, ctx.asarray(y) if model.gives_loss(c) else None, chunk=c,
                                  **model_kwargs(self.batches[i], ctx.asarray))
        if model.gives_loss(c):
            self.loss_sum += self.weights[i] * out
        else:
            self.outputs[(i, c)] = out
        ctx.watchdog.progress()
        if c == model.pp_virtual - 1:  # the hooks see all the micro-batch's activations in the modules
            earlier = [self.kept[(i, e)] for e in range(c)]  # (its earlier chunks, not yet run backward)
            for kept in earlier:
                model.restore_activations(kept)
            self.hooks.after_forward(self.run, i)
            for kept in earlier:
                for m, k, _ in kept:
                    setattr(m, k, None)
        self.kept[(i, c)] = model.take_activations()
        self.max_in_flight = max(self.max_in_flight, len(self.kept))

    def backward(self, i, c):
        model = self.model
        model.restore_activations(self.kept.pop((i, c)))
        grad = self.loss_scale * self.weights[i] if model.gives_loss(c) else self._take(self.output_grads, (i, c))
        buckets = self.run.grad_buckets  # --overlap-grad-reduce: the last micro-batch's backward starts them
        last = buckets is not None and self.run.config.overlap_grad_reduce and i == len(self.batches) - 1
        model.after_unit_backward = buckets.grads_final if last else None
        try:
            dx = model.stage_backward(grad, chunk=c, aux_grad=self.loss_scale * self.aux_weight)
        finally:
            model.after_unit_backward = None
        if dx is not None:
            self.input_grads[(i, c)] = dx
        self.ctx.watchdog.progress()

    def run_step(self, kind: str) -> float:
        """Runs the step's micro-batches; returns the weighted loss sum (0.0 off the last stage)."""
        ctx = self.ctx
        for op in plan(kind, ctx.pp_size, ctx.pp_rank, len(self.batches), self.model.pp_virtual):
            if op[0] == "F":
                self.forward(op[1], op[2])
            elif op[0] == "B":
                self.backward(op[1], op[2])
            else:
                self.exchange(op[1], op[2])
        self.finish_exchanges()
        left = {k: sorted(t) for k, t in (("kept", self.kept), ("inputs", self.inputs), ("outputs", self.outputs),
                                          ("output_grads", self.output_grads), ("input_grads", self.input_grads)) if t}
        assert not left, f"the {kind} plan left (micro-batch, chunk) pairs behind: {left}"
        return self.loss_sum


class _Pending:
    """An exchange in flight, waited for once."""

    def __init__(self, request):
        self.request, self.done = request, False

    def wait(self):
        if not self.done:
            self.request.wait()
            self.done = True


class _Arrival:
    """A receive buffer whose exchange may still be in flight."""

    def __init__(self, pending: _Pending, buffer):
        self.pending, self.buffer = pending, buffer


def eval_losses(run, batches) -> list[float]:
    """Eval-mode forwards of `batches` through the pipeline (no backward), each micro-batch
    through every chunk in turn; the losses on the last stage, [] elsewhere."""
    return forwards_only(run, batches)


def forwards_only(run, batches, *, step: int | None = None, first_row=None) -> list[float]:
    """Forwards of `batches` through the pipeline (no backward), each micro-batch through every
    chunk in turn: the losses on the last stage, [] elsewhere. With `step` (training mode, the
    MoE counting pass of cutp.train.moe): dropout drawn by position as in the step's own
    forwards (`first_row(i)`: micro-batch i's first row), the blocks only (no LM head, no loss)."""
    sched = Schedule(run, batches, [1.0] * len(batches), 0, lambda i: 0, 1.0, None)
    model, ctx = run.model, run.ctx
    head = step is None
    losses = []
    for i, (x, y) in enumerate(batches):
        for c in range(model.pp_virtual):
            sched.exchange([], [("act", i, c)])
            if not head:
                if c == 0:
                    model.check_inputs(x, y)  # on the host arrays
                model.rng.set_position(step, first_row(i), run.config.batch_size)
            inp = ctx.asarray(x) if model.takes_tokens(c) else sched._take(sched.inputs, (i, c))
            out = model.stage_forward(inp, ctx.asarray(y) if model.gives_loss(c) and head else None, chunk=c,
                                      head=head, **model_kwargs(batches[i], ctx.asarray))
            if model.gives_loss(c):
                if head:
                    losses.append(out)
            else:
                sched.outputs[(i, c)] = out
                sched.exchange([("act", i, c)], [])
            ctx.watchdog.progress()
    sched.finish_exchanges()
    return losses


def _contiguous(a):
    return get_array_module(a).ascontiguousarray(a)  # (the array itself when it is contiguous)
