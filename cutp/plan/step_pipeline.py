"""The activation memory of one pipeline stage's training step, simulated (`bench plan --pp`).

`stage_peak(shape, chunks, kind, m, p, stage)` walks the step of one pipeline rank the way
cutp/train/pipeline.py runs it: its schedule's plan (`cutp.train.pipeline.plan`: the forwards,
backwards and exchanges of its micro-batches and model chunks, in order), each forward and
backward the model's own walk (`cutp.plan.step_memory`) over the chunk's layers (the embedding
before the first virtual stage, ln_f, the LM head and the loss after the last). Between a
micro-batch's forward and its backward everything its forward cached is held aside (what
`GPT.take_activations` does), so a stage holds as many stashes as its schedule keeps in flight.

The point-to-point buffers are booked as `Schedule` holds them: an exchange allocates its
receive buffers before it drops the outputs it sends; a received input is the chunk's first
layer's input (its LayerNorm keeps it); a received output gradient lives through the chunk's
backward; an output or an input gradient lives until the exchange that sends it. Messages are
[b, T, h] (or the [b, T/tp, h] shard under sequence parallelism) in the activation dtype; MPI's
send and receive work on them in place.
"""
from __future__ import annotations

from ..train.pipeline import plan as schedule_plan
from .step_memory import _Walk
from .step_shape import Heap, StepShape


class RefHeap(Heap):
    """A Heap whose arrays may have several holders: `hold` adds one, `free` drops one, and the
    array goes when its last holder does (the pipeline's locals next to the layers' caches)."""

    def __init__(self, round_to: int = 1):
        super().__init__(round_to)
        self.refs: dict[str, int] = {}

    def hold(self, key: str) -> None:
        self.refs[key] = self.refs.get(key, 1) + 1

    def free(self, *keys: str) -> None:
        for k in keys:
            n = self.refs.pop(k, 1) - 1
            if n > 0:
                self.refs[k] = n
            else:
                super().free(k)

    def set_aside(self, keys) -> dict:
        """Takes `keys` out of the live set (they stay counted): one micro-batch's stash."""
        return {k: (self.live.pop(k), self.refs.pop(k, 1)) for k in keys}

    def put_back(self, kept: dict) -> None:
        for k, (n, r) in kept.items():
            if k in self.live:
                raise KeyError(f"simulated array {k!r} restored over a live one")
            self.live[k] = n
            if r != 1:
                self.refs[k] = r


class Chunk:
    """One model chunk of a rank: its layers' global indices, whether it holds the embedding
    (the first virtual stage) and the head (the last)."""

    def __init__(self, layers, first: bool, last: bool):
        self.layers, self.first, self.last = tuple(layers), first, last


class _StageWalk(_Walk):
    def __init__(self, s: StepShape, chunks: list[Chunk]):
        super().__init__(s)
        self.heap = RefHeap(self.heap.round_to)
        self.chunks = chunks
        self.kept: dict = {}  # (micro-batch, chunk) -> its stash, set aside
        self.inputs: dict = {}  # (micro-batch, chunk) -> the layers' inputs
        self.in_flight = 0
        self.layer_stash: dict = {}  # global layer index -> bytes it keeps after its first forward
        self.stash_bytes: dict = {}  # (micro-batch, chunk) -> bytes set aside after its forward
        self.message = self.Ns * self.h * self.a  # one activation (or its gradient) between stages

    def recv(self, key):
        self.heap.alloc(key, self.message)
        return key

    def forward(self, i, c, inp):
        """Chunk c's forward of micro-batch i; returns its output's key (None on the last stage)."""
        H, ch = self.heap, self.chunks[c]
        before = set(H.live)
        x = self.embedding() if ch.first else inp
        inputs = []
        for n in ch.layers:
            inputs.append(x)
            x = self.block_fwd(f"h{n}", x, keep=not self.s.recomputed(n))
        out = None
        if ch.last:
            self.head_fwd()
        else:
            out = f"out.{i}.{c}"
            H.live[out] = H.live.pop(x)  # the stage's output: the schedule's now, not the layers'
        new = [k for k in H.live if k not in before and k != out]
        held = sum(H.live[k] for k in new)
        if inp is not None:  # the received input (its own name: not set aside): the first LayerNorm keeps it
            H.hold(inp)
            held += H.live[inp]
        for j, n in enumerate(ch.layers):  # what each layer keeps for backward after its first forward
            self.layer_stash.setdefault(n, H.live[inputs[j]] + sum(v for k, v in H.live.items()
                                                                   if k.startswith(f"h{n}.") and k != f"h{n}.out"))
        self.stash_bytes[(i, c)] = held
        self.kept[(i, c)] = (H.set_aside(new), inputs, x if ch.last else None)
        self.in_flight = max(self.in_flight, len(self.kept))
        return out

    def backward(self, i, c, grad):
        """Chunk c's backward of micro-batch i; `grad`: the received output gradient's key (held
        by the caller too). Returns the input gradient's key (None on the first stage)."""
        H, ch = self.heap, self.chunks[c]
        kept, inputs, x_last = self.kept.pop((i, c))
        H.put_back(kept)
        if ch.last:
            d = self.head_bwd(x_last)
        else:
            H.hold(grad)  # the last layer's backward drops one holder; the frames keep the other
            d = grad
        for n, x in zip(reversed(ch.layers), reversed(inputs)):
            d = self.block_bwd(f"h{n}", d, x, recomputed=self.s.recomputed(n))
        if ch.first:
            self.embedding_bwd(d)
            return None
        dx = f"dx.{i}.{c}"
        H.live[dx] = H.live.pop(d)
        return dx

    def release(self, *keys):
        self.heap.free(*(k for k in keys if k is not None))

    # ---- the schedule (cutp/train/pipeline.py) ------------------------------------------------
    def walk_plan(self, ops):
        """`cutp.train.pipeline.plan`'s ops as `Schedule` runs them: an exchange allocates its
        receive buffers, then drops the outputs it sent; a received input lives until its forward
        (its first layer's stash keeps it), a received gradient through its backward; an output
        or an input gradient until the exchange that sends it."""
        held = {}
        for op in ops:
            if op[0] == "X":
                for what, i, c in op[2]:
                    ch = self.chunks[c]
                    if (what == "act" and not ch.first) or (what == "grad" and not ch.last):
                        held[("in" if what == "act" else "g", i, c)] = self.recv(
                            f"{'in' if what == 'act' else 'g'}.{i}.{c}")
                self.release(*(held.pop(key, None) for key in op[1]))
            elif op[0] == "F":
                _, i, c = op
                inp = held.pop(("in", i, c), None)
                out = self.forward(i, c, inp)
                self.release(inp)
                if out is not None:
                    held[("act", i, c)] = out
            else:
                _, i, c = op
                g = held.pop(("g", i, c), None)
                dx = self.backward(i, c, g)
                self.release(g)
                if dx is not None:
                    held[("grad", i, c)] = dx
        assert not held, sorted(held)

    def run(self, kind, m, p, stage):
        s, H = self.s, self.heap
        if self.cpu:  # the step's token windows, read up front (host memory: not in a GPU's pool)
            H.alloc("batches", m * s.micro_batch * (s.seq_len + 1) * 8)
            H.temp(s.micro_batch * (s.seq_len + 1) * 8 + 4 * self.N, what="batch")
        self.walk_plan(schedule_plan(kind, p, stage, m, len(self.chunks)))
        assert not self.kept, sorted(self.kept)
        self.optimizer_phase()
        return H


def stage_peak(shape: StepShape, chunks: list[Chunk], kind: str, m: int, p: int, stage: int) -> dict:
    """One pipeline rank's step (module docstring): {"activations_peak", "where", "left" (the
    simulated arrays still live at the end: the token windows only), "stash_per_layer" (the
    bytes each of the rank's layers keeps after the first forward), "in_flight" (the most
    micro-batches held at once), "stash_per_micro_batch" (bytes held aside per micro-batch and
    chunk after its forward)}."""
    walk = _StageWalk(shape, chunks)
    heap = walk.run(kind, m, p, stage)
    return {"activations_peak": heap.peak, "where": heap.where, "left": sorted(heap.live),
            "stash_per_layer": [walk.layer_stash[n] for n in shape.layers], "in_flight": walk.in_flight,
            "stash_per_micro_batch": max(walk.stash_bytes.values())}
