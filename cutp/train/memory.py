"""Memory per rank, measured: the training state held between steps, and the peak of a step.

    state = state_bytes(run)                     # {"params", "grads", "optimizer"} from the live arrays
    with ActivationPeak(run.ctx) as peak:        # one step, measured (only while inside the block)
        stats = train_step(run)
    mem = memory_record(run, peak.bytes)         # + activations_peak, total, bytes_per_param
    mem = max_over_ranks(run.ctx, mem)           # collective: the largest rank's figures
    stats, mem = measured_step(run)              # the three lines above (examples/train_gpt.py's first step),
                                                 # + stash_per_layer: what each layer keeps for backward

State: the bytes of the arrays the run holds, not a formula: the flat parameter buffer, the flat
gradient buffer, the optimizer's moments and fp32 master weights (`optimizer.memory_bytes()`).

Activations peak: the most memory a step allocates on top of what was live when it began
(activations cached for backward, the gradients flowing back, each op's temporaries, the
optimizer update's blocks). Backward frees each cached activation once it has used it, so
nothing of a step outlives it and every step has the same peak.

* CPU: `tracemalloc` runs during the measured step only, and it sees what NumPy allocates (its
  data buffers are traced in domain ``np.lib.tracemalloc_domain``) and the Python objects the
  step creates around them (array headers, op contexts; under 1% of the figure in tiny
  models). tracemalloc knows only blocks allocated after it started, so its peak *is* the
  step's increase over the memory live at its start. The step computes exactly what it would
  untraced; it only runs slower (the first step's ms in the log includes that).
* GPU: CuPy's memory pool keeps no high-water mark, so during the step every allocation goes
  through a wrapper of the pool's malloc which reads `used_bytes()` right after it: the most
  used bytes are always reached right after an allocation, so the largest value read is the
  exact peak of the pool's used bytes (sizes rounded as the pool rounds them, 512 bytes). What
  does not go through the pool (cuBLAS workspaces, NCCL buffers, the CUDA context) is not in it.

Stash per layer: the bytes each transformer layer keeps for backward, measured once, right after
the first micro-batch's forward, by walking its modules' ``_cache_*`` attributes and summing each
distinct buffer once (views count once, parameters not at all): `stash_per_layer`. What
`--recompute` and `--sequence-parallel` change; `cutp bench plan` predicts it per layer.

Cheap when off: nothing is installed outside an `ActivationPeak` block.
"""
from __future__ import annotations

import gc
import tracemalloc

import numpy as np
from mpi4py import MPI

from ..runtime.shape_only import ShapeOnly
from ..tensor_parallel import Module
from .step import StepHooks, StepStats, TrainingRun, train_step

STATE_KEYS = ("params", "grads", "optimizer")


def state_bytes(run) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer state, from the live arrays:
    `run.optimizer.memory_bytes()` (cutp.optim's optimizers: the flat buffers, Adam's moments and
    the fp32 master weights of 16-bit models; a shard of them with the distributed optimizer),
    else the flat buffers and whichever of `m`, `v`, `master` the optimizer holds; frozen
    parameters count in `params` only (no gradient, no state)."""
    opt, flat = run.optimizer, run.flat
    # frozen parameters (--freeze, LoRA's base) are outside the flat buffers: held, never trained
    # (zero 2 and 3 shard them with the rest: in the optimizer's params, `holds_frozen`)
    frozen = 0 if getattr(opt, "holds_frozen", False) else \
        sum(int(p.data.nbytes) for p in run.model.parameters() if not p.trainable)
    if hasattr(opt, "memory_bytes"):
        got = opt.memory_bytes()
        return {k: int(got[k]) + (frozen if k == "params" else 0) for k in STATE_KEYS}
    optim = sum(int(a.nbytes) for a in (getattr(opt, k, None) for k in ("m", "v", "master")) if a is not None)
    return {"params": int(flat.data.nbytes) + frozen, "grads": int(flat.grad.nbytes), "optimizer": optim}


def memory_record(run, activations_peak: int | None = None, stash: list[int] | None = None) -> dict:
    """This rank's figures for the log: state bytes, the step's activation peak, their total, the
    state's bytes per local parameter (`params_local` of them) and, when measured, the bytes
    each layer keeps for backward (`stash_per_layer`, one entry per layer, see `stash_per_layer`)."""
    rec = state_bytes(run)
    n = int(run.model.num_parameters_local())
    state = sum(rec[k] for k in STATE_KEYS)
    rec.update(params_local=n, bytes_per_param=state / n)
    if activations_peak is not None:
        rec["activations_peak"] = int(activations_peak)
    gathered = getattr(run.optimizer, "peak_gathered_bytes", None)
    if activations_peak is not None and gathered is not None and run.config.zero == 3:
        rec["gathered_units_peak"] = int(gathered)  # (part of activations_peak: whole units held at once)
    if stash is not None:
        rec["stash_per_layer"] = [int(b) for b in stash]
    ctx = run.ctx
    if activations_peak is not None and ctx.pp_size > 1:  # each stage's most (micro-batch, chunk)s in flight
        rec["pipeline_in_flight"] = [run.pipeline_in_flight if s == ctx.pp_rank else 0 for s in range(ctx.pp_size)]
    rec["total"] = state + rec.get("activations_peak", 0)
    return rec


def max_over_ranks(ctx, rec: dict) -> dict:
    """Each figure's largest value over the ranks of ctx's world (lists of numbers element by
    element; collective: every rank calls it with the same keys and list lengths); `ranks` says
    how many ranks it covers."""
    def numeric(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    keys = sorted(k for k, v in rec.items() if numeric(v) or (isinstance(v, list) and all(map(numeric, v))))
    flat = [float(x) for k in keys for x in (rec[k] if isinstance(rec[k], list) else [rec[k]])]
    buf = np.array(flat)
    ctx.world.mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    out, i = {}, 0
    for k in keys:
        v = rec[k]
        items = v if isinstance(v, list) else [v]
        vals = [float(m) if isinstance(x, float) else int(m) for x, m in zip(items, buf[i:i + len(items)])]
        out[k] = vals if isinstance(v, list) else vals[0]
        i += len(items)
    out["ranks"] = ctx.world_size
    return out


def measure_step(run: TrainingRun, hooks: StepHooks | None = None) -> tuple[StepStats, int, list[int]]:
    """`train_step(run, hooks)` with this rank's memory measured: (its StepStats, the step's
    activation peak, each layer's stash after the first micro-batch's forward, `stash_per_layer`,
    by global layer index). The planner runs it on a shape-only context."""
    probe = _StashProbe(hooks)
    with ActivationPeak(run.ctx) as peak:
        stats = train_step(run, probe)
    return stats, peak.bytes, probe.per_layer


def measured_step(run: TrainingRun, hooks: StepHooks | None = None) -> tuple[StepStats, dict]:
    """`train_step(run, hooks)` with its memory measured: (its StepStats, the memory record of
    every rank's largest figures, with each layer's stash measured after the first micro-batch's
    forward: one entry per layer of the model, each from the pipeline stage that holds it).
    Collective. The step computes exactly what it computes unmeasured (only slower on the CPU,
    where tracemalloc runs during it)."""
    stats, peak, stash = measure_step(run, hooks)
    return stats, max_over_ranks(run.ctx, memory_record(run, peak, stash))


# ---- what the layers keep for backward ----------------------------------------------------------
def _owner(a):
    base = a
    while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes") and hasattr(base.base, "shape"):
        base = base.base
    return base


def _arrays_in(obj, out, visited):
    """Appends every array reachable from obj (through containers and objects' attributes) to
    out, each object visited once, however deep it is nested. Modules are not entered: each one's
    own caches are walked by cached_activation_bytes, and their parameters are not activations."""
    if obj is None or id(obj) in visited or isinstance(obj, (int, float, str, bytes, bool, Module, type)):
        return
    visited.add(id(obj))
    if hasattr(obj, "nbytes") and hasattr(obj, "shape") and hasattr(obj, "dtype"):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _arrays_in(v, out, visited)
    elif isinstance(obj, dict):
        for v in obj.values():
            _arrays_in(v, out, visited)
    elif not callable(obj):
        for k in getattr(type(obj), "__slots__", ()):
            _arrays_in(getattr(obj, k, None), out, visited)
        for v in getattr(obj, "__dict__", {}).values():
            _arrays_in(v, out, visited)


def cached_activation_bytes(model, exclude=()) -> int:
    """Bytes of the distinct buffers held in the `_cache_*` attributes of `model`'s modules
    (views of one buffer count once; buffers of the arrays in `exclude`, e.g. the parameters
    the LayerNorm and linear contexts refer to, not at all)."""
    excluded = {id(_owner(a)) for a in exclude}
    seen, total = set(), 0
    for m in model.modules():
        for k, v in m.__dict__.items():
            if not k.startswith("_cache_"):
                continue
            found = []
            _arrays_in(v, found, set())
            for a in found:
                o = _owner(a)
                if id(o) in seen or id(o) in excluded:
                    continue
                seen.add(id(o))
                total += int(o.nbytes)
    return total


def stash_per_layer(model) -> list[int]:
    """Bytes each transformer layer (`model.layers[i]`) keeps for backward, measured from its
    modules' caches right after a training forward (parameters excluded): its own
    `cached_activation_bytes`. A buffer two layers' caches share counts in both, except the
    model's rotary (cos, sin) tables: every layer refers to them, the model holds them once."""
    held = [p.data for p in model.parameters()]
    for tables in (getattr(model, "rotary", None), getattr(model, "rotary_local", None)):
        held += list(tables or ())
    return [cached_activation_bytes(block, exclude=held) for block in model.layers]


class _StashProbe(StepHooks):
    """Measures `stash_per_layer` after the first micro-batch's forward, then runs `inner`'s hooks."""

    def __init__(self, inner: StepHooks | None):
        self.inner = inner or StepHooks()
        self.per_layer: list[int] | None = None

    def phase(self, name):
        self.inner.phase(name)

    def after_forward(self, run, micro):
        if micro == 0 and self.per_layer is None:  # by global layer index: a pipeline stage's at theirs, 0 elsewhere
            self.per_layer = [0] * run.model.config.n_layer
            for i, b in zip(run.model.layer_ids, stash_per_layer(run.model)):
                self.per_layer[i] = b
        self.inner.after_forward(run, micro)

    def before_grad_sync(self, run):
        self.inner.before_grad_sync(run)


def format_bytes(n: float) -> str:
    """1.50 GB / 12.3 MB / 512 kB / 100 B (powers of 1000, as the planner prints)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if n < 10 * scale else 1}f} {unit}"
    return f"{int(n)} B"


def state_line(rec: dict) -> str:
    """`params 1.72 MB, grads 1.72 MB, optimizer 3.45 MB = 16.00 B/param (431,104 params)`."""
    return (f"params {format_bytes(rec['params'])}, grads {format_bytes(rec['grads'])}, optimizer "
            f"{format_bytes(rec['optimizer'])} = {rec['bytes_per_param']:.2f} B/param "
            f"({rec['params_local']:,} params)")


# ---- the peak of a step ------------------------------------------------------------------------
class ActivationPeak:
    """Context manager: `bytes` is the peak of memory allocated inside the block above what was
    live when it began (on the CPU through tracemalloc, on a GPU through CuPy's pool; see the
    module docstring). Installs nothing outside the block."""

    def __init__(self, ctx=None, *, xp=None):
        self.xp = xp if xp is not None else (ctx.xp if ctx is not None else np)
        self.bytes: int | None = None
        self._impl = None

    def __enter__(self):
        if isinstance(self.xp, ShapeOnly):
            self._impl = _HeapPeak(self.xp.heap)
        else:
            self._impl = _TracemallocPeak() if self.xp is np else _CupyPoolPeak(self.xp)
        self._impl.start()
        return self

    def __exit__(self, *exc):
        self.bytes = self._impl.stop()
        self._impl = None
        return False


class _HeapPeak:
    """Shape-only arrays (the planner): the peak of their heap over the block."""

    def __init__(self, heap):
        self.heap = heap

    def start(self):
        self.heap.reset_peak()
        self.base = self.heap.cur

    def stop(self) -> int:
        return max(0, self.heap.peak - self.base)


class _TracemallocPeak:
    """Peak of traced memory over the block. When tracemalloc was already tracing (a caller's
    own session) it is left running, and its peak is reset at the start (the only way to get
    the block's own): the block's peak is then measured above the traced memory at its start."""

    def start(self):
        self.was_tracing = tracemalloc.is_tracing()
        if self.was_tracing:
            tracemalloc.reset_peak()
            self.base = tracemalloc.get_traced_memory()[0]
        else:
            tracemalloc.start()
            self.base = 0

    def stop(self) -> int:
        peak = tracemalloc.get_traced_memory()[1]
        if not self.was_tracing:
            tracemalloc.stop()
        return max(0, int(peak) - self.base)


class PoolPeak:
    """The allocator hook of `_CupyPoolPeak`, apart from CuPy so that the CPU tests run it on a
    stand-in pool: `malloc(size)` allocates through `pool.malloc` and records the pool's used
    bytes right after; `peak` is the largest value seen (or the used bytes at the start)."""

    def __init__(self, pool):
        self.pool = pool
        self.base = int(pool.used_bytes())
        self.peak = self.base

    def malloc(self, size):
        mem = self.pool.malloc(size)
        used = self.pool.used_bytes()
        if used > self.peak:
            self.peak = used
        return mem

    def bytes_above_start(self) -> int:
        return max(int(self.peak), int(self.pool.used_bytes())) - self.base


class _CupyPoolPeak:
    """CuPy: the default memory pool's malloc, wrapped for the block (this thread only)."""

    def __init__(self, cupy):
        self.cupy = cupy

    def start(self):
        cuda = self.cupy.cuda
        # garbage holding device arrays (reference cycles of an earlier run) collected inside the
        # block would return its bytes to the pool there and hide as much of the block's peak
        gc.collect()
        self.hook = PoolPeak(self.cupy.get_default_memory_pool())
        self.scope = cuda.using_allocator(self.hook.malloc)  # thread-local, restored on exit
        self.scope.__enter__()

    def stop(self) -> int:
        self.scope.__exit__(None, None, None)
        return self.hook.bytes_above_start()


def peak_line(rec: dict, step: int) -> str:
    """`activations peak 6.20 MB in step 1 (each layer keeps 1.20 MB for backward), total 13.1 MB`
    (`layers keep 0.26-1.20 MB each` when they differ: --recompute-layers)."""
    stash = rec.get("stash_per_layer")
    kept = ""
    if stash:
        lo, hi = min(stash), max(stash)
        kept = (f" (each layer keeps {format_bytes(hi)} for backward)" if lo == hi else
                f" (layers keep {format_bytes(lo)}-{format_bytes(hi)} each for backward)")
    flight = rec.get("pipeline_in_flight")
    held = "" if not flight else f"; forwards in flight at most: {', '.join(map(str, flight))} (stages 0..{len(flight) - 1})"
    units = rec.get("gathered_units_peak")
    whole = "" if units is None else f" (of which zero 3's whole units at most {format_bytes(units)})"
    return (f"activations peak {format_bytes(rec['activations_peak'])} in step {step}{kept}{whole}, "
            f"total {format_bytes(rec['total'])}{held}")
