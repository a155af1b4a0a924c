"""One training step for every caller: the script, the benchmark, a host code embedding cutp.

    run = build_run(cfg, comm)              # context, model, optimizer, data (resumed if cfg.resume)
    while run.step < run.end_step:
        stats = train_step(run)             # StepStats: loss, grad norm, lr, skipped, timings, bytes
        if run.step % 100 == 0:
            val = evaluate(run)       # (cutp.train.evaluation)
    save(run)                               # a checkpoint of run.step into cfg.out
    run.close()

A step: `accum` micro-batches of forward + backward on each DP rank (gradients accumulate into
the flat buffer, float32 for 16-bit models, each scaled by loss_scale times its share of the
step's non-ignored targets: 1/accum without ignored ones; an MoE model with accum > 1 first runs
a counting forward of every micro-batch, so that its auxiliary losses are the global batch's:
cutp.train.moe.moe_step), the gradient reduction (GQA replicas,
sequence-parallel replicas, then DP: all-reduce, or reduce-scatter with the distributed
optimizer), the global gradient norm, the loss (the mean over the global batch's targets), then AdamW with the learning rate of the
schedule and global-norm clipping (on float32 master weights for 16-bit models; the distributed
optimizer then all-gathers the updated parameters). A step whose loss or norm is not finite is
skipped on every rank (the decision is made from all-reduced values) without touching weights or
moments; the float16 loss scaler then shrinks its scale (those overflow skips do not count while
the scale can still shrink), and `max_skips` other skips in a row stop the run. The collective
watchdog watches the step once, as a whole: it aborts the job when the step makes no progress
(no collective, no forward or backward of a micro-batch completes) for the collective timeout.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..checkpoint import load_checkpoint, load_weights, read_meta, resolve_checkpoint, save_checkpoint
from ..comm.context import Context, init
from ..data import BatchSampler, Dataset, load_dataset, model_kwargs
from ..models import GPT
from ..ops.gemm import allow_tf32
from ..optim import (AdamW, DistributedAdamW, DynamicLossScaler, ExpertParallelAdamW, FlatParameters, FlatParts,
                     GradBuckets, LossScaler, ParamGather, ShardedAdamW, clip_scale, describe_scaler, lr_schedule)

from ..tensor_parallel.grads import replica_group
from ..checkpoint.run_dir import RunDirLock, prepare_run_dir, prune_checkpoints
from ..runtime.consistency import check_same_on_all_ranks
from ..runtime.deadline import setup_progress
from ..runtime.errors import ConfigError
from ..runtime.failure import errors_raised_on_every_rank, mark_raised_on_every_rank
from ..runtime.threads import keep_freed_host_memory, set_blas_threads, threads_per_rank
from ..runtime.mesh import Mesh
from ..tensor_parallel import deferred_parameters, tp_grad_sync
from ..tensor_parallel.parameter import trainable_parameters
from .reductions import dp_mean, from_last_stage, losses_on_device, loss_weights
from .config import RunConfig, checkpoint_conflicts
from .data_check import check_data_fits_model
from .finetune import frozen_base_record, resumed_base, set_up_trainable
from .reporting import stderr_line
from .moe import apply_moe_bias_updates, moe_step, moe_step_stats
from .zero import sharded_optimizer
from .overlap import (comm_snapshot, comm_times, finish_param_gather, overlap_for_step, overlap_record,
                      set_up_overlap)
from .pipeline import Schedule


@dataclass
class TrainingRun:
    """What a run holds between steps. `step` counts the optimizer steps done; `start_step` is
    where this invocation began (0, or the resumed checkpoint's step)."""

    config: RunConfig
    ctx: Context
    model: GPT
    flat: FlatParameters  # FlatParts with ExpertParallelAdamW
    optimizer: AdamW  # or DistributedAdamW, ExpertParallelAdamW (the distributed optimizer at ep > 1)
    dataset: Dataset
    sampler: BatchSampler
    loss_scaler: LossScaler = field(default_factory=LossScaler)  # scale 1.0 unless float16 / --loss-scale
    blas: str = ""  # what set_blas_threads reported (the banner shows it)
    step: int = 0
    start_step: int = 0
    consecutive_skips: int = 0
    last_saved: int | None = None  # the step of the newest checkpoint this run wrote or resumed from
    pipeline_in_flight: int = 0  # the most micro-batches this stage held at once in the last step
    run_dir_lock: RunDirLock | None = None  # rank 0's lock on config.out
    replaced: list = field(default_factory=list)  # another run's checkpoints in out, removed after our first (--overwrite)
    frozen_base: dict = field(default_factory=dict)  # where a run with frozen parameters read them, and their
    # fingerprint: its checkpoints' train_args record it (cutp.train.finetune.frozen_base_record)
    grad_buckets: GradBuckets | None = None  # --overlap-grad-reduce (cutp.optim.buckets; ep > 1: GradBucketGroups)
    param_gather: ParamGather | None = None  # --overlap-param-gather (ParamGathers at ep > 1 with experts)

    def gather_params(self) -> None:
        """Waits for the parameter gathers in flight (--overlap-param-gather): before anything
        but the next training forward reads the parameters (evaluation, a checkpoint); zero 3:
        every parameter made whole until the next step."""
        finish_param_gather(self)
        if isinstance(self.optimizer, ShardedAdamW):
            self.optimizer.gather_all()

    def settle_params(self) -> None:
        """Waits for the parameter gathers in flight (--overlap-param-gather), zero 3's parameters
        left sharded: evaluation's forward gathers each unit as training's does."""
        finish_param_gather(self)

    @property
    def end_step(self) -> int:
        """The step this invocation stops after: `steps`, or sooner with `run_steps`."""
        cfg = self.config
        return cfg.steps if cfg.run_steps is None else min(cfg.steps, self.start_step + cfg.run_steps)

    def close(self) -> None:
        finish_param_gather(self)  # (no request left in flight on a communicator being freed)
        if isinstance(self.optimizer, ShardedAdamW):
            self.optimizer.drain()
        self.ctx.close()
        if self.run_dir_lock is not None:
            self.run_dir_lock.release()


@dataclass
class StepStats:
    """What one optimizer step did. Times in milliseconds; `forward_ms`, `backward_ms` and
    `optimizer_ms` split `ms` (exact on the CPU; on a GPU only with train_step(profile=True),
    which synchronises the device between the phases, else None)."""

    step: int  # the step just done, counting from 1
    loss: float  # mean over the step's tokens (all DP ranks)
    grad_norm: float  # global L2 norm before clipping
    lr: float
    skipped: bool
    ms: float
    tokens_per_s: float
    comm_bytes: int  # this rank's bytes through the context's collectives during the step
    forward_ms: float | None = None
    backward_ms: float | None = None
    optimizer_ms: float | None = None
    consecutive_skips: int = 0
    loss_scale: float | None = None  # the scale this step's backward used (float16 / --loss-scale)
    overflow: bool = False  # skipped because the scaled gradients overflowed (float16)
    pipeline_wait_ms: float | None = None  # pp > 1: this stage's time in pipeline sends/receives (host)
    moe: dict | None = None  # MoE models: auxiliary losses and routing (cutp.train.moe; not in `loss`)
    # the step's collectives' time in flight and blocked on (exposed), also by group (cutp.train.overlap)
    comm_ms: float = 0.0
    exposed_comm_ms: float = 0.0
    comm_ms_by_group: dict = field(default_factory=dict)
    link_ms_by_group: dict | None = None  # --link-bandwidth: the simulated link's (link_ms, exposed_ms)

    def record(self) -> dict:
        """The JSONL metrics row (examples/train_gpt.py --metrics)."""
        rec = {"step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm, "ms": self.ms,
               "tokens_per_s": self.tokens_per_s, "comm_mb": self.comm_bytes / 1e6}
        if self.loss_scale is not None:
            rec["loss_scale"] = self.loss_scale
        if self.skipped:
            rec["skipped"] = True
        if self.overflow:
            rec["overflow"] = True
        if self.pipeline_wait_ms is not None:
            rec["pipeline_wait_ms"] = self.pipeline_wait_ms
        if self.moe is not None:
            rec.update({f"moe_{k}": v for k, v in self.moe.items()})
        rec.update(overlap_record(self))
        return rec


class StepHooks:
    """Callbacks inside `train_step`, for measurements and tests; each does nothing by default.

    phase(name)                 a phase begins: "forward", "backward" or "optimizer" (zeroing the
                                gradients first; at the end the gradient reduction, the norm, the
                                loss average and the update)
    after_forward(run, micro)   after the forward of micro-batch `micro` (its activations cached)
    before_grad_sync(run)       every micro-batch's gradient is in, nothing reduced yet (with
                                --overlap-grad-reduce: the buckets started in the backward are)
    """

    def phase(self, name: str) -> None:
        pass

    def after_forward(self, run: TrainingRun, micro: int) -> None:
        pass

    def before_grad_sync(self, run: TrainingRun) -> None:
        pass


_NO_HOOKS = StepHooks()


@dataclass
class _PhaseClock:
    """Host time per phase, the device synchronised at each boundary when `sync` is set."""

    ctx: Context
    sync: bool
    hooks: StepHooks
    ms: dict = field(default_factory=dict)
    _phase: str | None = None
    _t: float = 0.0

    def enter(self, phase: str | None) -> None:
        if phase is not None and phase == self._phase:
            return
        if self.sync:
            self.ctx.synchronize()
        now = time.perf_counter()
        if self._phase is not None:
            self.ms[self._phase] = self.ms.get(self._phase, 0.0) + (now - self._t) * 1000
        self._phase, self._t = phase, now
        if phase is not None:
            self.hooks.phase(phase)


def build_run(config: RunConfig, comm=None, *, dataset: Dataset | None = None) -> TrainingRun:
    """The context, model, optimizer and data of `config` on the ranks of `comm` (default
    MPI.COMM_WORLD; any sub-communicator of a host code's), resumed from `config.resume` when
    set, or with the weights of `config.init_from` (step 0, a fresh optimizer). Collective over
    comm. `dataset` replaces `config.data` (tokens a host code holds). First, rank 0 checks
    `config.out` and locks it for the run's lifetime (cutp.checkpoint.run_dir)."""
    world = MPI.COMM_WORLD if comm is None else comm
    lock, replaced = None, []
    with errors_raised_on_every_rank(world):  # before any training: a writable --out no other job holds
        if config.out and world.Get_rank() == 0:
            lock, replaced = prepare_run_dir(config.out, resume=config.resume, overwrite=config.overwrite)
    try:
        run = _build_run(config, world, dataset)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    run.run_dir_lock, run.replaced = lock, replaced
    return run


def _build_run(cfg: RunConfig, world, dataset: Dataset | None) -> TrainingRun:
    # the data and this rank's batches, checked on every rank before any allocation
    with errors_raised_on_every_rank(world):
        if dataset is not None and cfg.data is not None:
            raise ConfigError("give the data as config.data (a path) or as dataset=, not both")
        dataset = dataset if dataset is not None else load_dataset(cfg.data)
        check_data_fits_model(dataset, cfg.model, cfg.init_from, cfg.data)  # the tokenizer and the vocabulary
        dp_rank = Mesh(cfg.tp, cfg.dp, cfg.pp, cp=cfg.cp).dp_rank(world.Get_rank())  # the Context's, before it exists
        sampler = BatchSampler(dataset, cfg.seq_len, cfg.batch_size, cfg.dp, dp_rank, cfg.micro_batch_size,
                               seed=cfg.seed, every_rank=lambda e: mark_raised_on_every_rank(e, world, reporter=0),
                               pack=cfg.pack, evaluate=cfg.eval_every > 0)  # (no validation: none needed)
    check_same_on_all_ranks(world, {"data": dataset.description, "data_blake2b": dataset.fingerprint()},
                            "training data")  # the same path may hold other bytes on another node
    setup_progress()  # each phase of setup gets the whole deadline (cutp.runtime.deadline)
    ctx = init(comm=world, tp=cfg.tp, dp=cfg.dp, pp=cfg.pp, ep=cfg.ep, cp=cfg.cp, device=cfg.device,
               collective_timeout=cfg.collective_timeout)
    if cfg.link_bandwidth is not None:
        ctx.simulate_link(cfg.link_bandwidth, cfg.link_latency)
    blas = set_blas_threads(threads_per_rank(ctx.local_size)) if cfg.device == "cpu" else "GPU"
    allow_tf32(cfg.allow_tf32)  # (float32 GEMMs on cuBLAS; nothing changes on the CPU)
    if cfg.device == "cpu":
        keep_freed_host_memory()  # backward frees activations early: keep them for the next step
    setup_progress()
    with errors_raised_on_every_rank(world):  # (a base that moved, or holds other weights: refused alike)
        draw, base = resumed_base(cfg)  # (a checkpoint without its frozen base: that from its init_from or seed)
        frozen_base = frozen_base_record(cfg, cfg.init_from if base is None else base)  # (read before it is loaded)
    run = assemble_run(cfg, ctx, dataset, sampler, init=draw, blas=blas, base=base)
    run.frozen_base = frozen_base
    if cfg.resume is not None:
        resume(run, cfg.resume)
        setup_progress()
    return run


def assemble_run(cfg: RunConfig, ctx, dataset: Dataset, sampler: BatchSampler, *, init: bool = True,
                 blas: str = "", base: str | None = None) -> TrainingRun:
    """The model (its weights drawn, or with init=False zeros to be loaded; `cfg.init_from`'s
    loaded), its layout (recomputation, sequence parallelism), the flat buffers and the optimizer
    of `cfg` on context `ctx`: the run `build_run` makes, and the one the planner (cutp.plan)
    makes on a shape-only context. Collective over ctx."""
    base = cfg.init_from if base is None else base  # (`base`: a resumed run's frozen weights' source)
    # zero 3: nothing drawn (nor read from `base`) until the optimizer draws each unit, keeping this
    # rank's piece (no rank holds the whole model)
    with deferred_parameters() if cfg.zero == 3 else contextlib.nullcontext():
        model = GPT(ctx, cfg.model, seed=cfg.seed, init=init, pp_layers=cfg.pp_layers,
                    pp_virtual=cfg.pp_virtual)  # resumed or initial weights are loaded next
    if base is not None:  # before the optimizer copies any weight (fp32 master weights)
        load_weights(model, base)
    set_up_trainable(model, cfg)  # --freeze, LoRA (refusals alike on every rank): before any layout and optimizer
    setup_progress()
    model.set_recompute(cfg.recompute, cfg.recompute_layers)
    model.set_sequence_parallel(cfg.sequence_parallel)
    if cfg.cp > 1:
        model.set_context_parallel_comm(cfg.cp_comm)
    kw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, grad_reduce_dtype=cfg.grad_reduce_dtype)
    params = trainable_parameters(model.parameters())  # frozen ones: no gradient, master or state
    if cfg.zero >= 2:  # gradients (and parameters) sharded unit by unit; the model calls its hooks
        optimizer = flat = sharded_optimizer(cfg, ctx, model, reads=base is not None, **kw)
    elif cfg.distributed_optimizer and cfg.ep > 1:  # the experts' state sharded over another group
        optimizer = ExpertParallelAdamW(params, ctx, **kw)
        flat = optimizer.flat
    elif cfg.distributed_optimizer:
        flat = FlatParameters(params, pad_to=DistributedAdamW.pad_multiple(cfg.dp * cfg.cp))
        optimizer = DistributedAdamW(flat, ctx, **kw)
    else:
        flat = FlatParameters(params)
        optimizer = AdamW(flat, **kw)
    run = TrainingRun(cfg, ctx, model, flat, optimizer, dataset, sampler, blas=blas, loss_scaler=make_loss_scaler(cfg))
    if (cfg.overlap_grad_reduce or cfg.overlap_param_gather) and cfg.zero < 2:
        set_up_overlap(run, replica_group(ctx))  # DP x CP: the ranks that average the gradients
    elif cfg.tp_comm_overlap:
        model.set_tp_comm_overlap(True)  # (zero 2 and 3 overlap their own reductions and gathers)
    return run


def make_loss_scaler(cfg: RunConfig) -> LossScaler:
    """A static scaler with --loss-scale; a dynamic one for float16 models; else scale 1.0."""
    if cfg.loss_scale is not None:
        return LossScaler(cfg.loss_scale)
    if cfg.model.dtype == "float16":
        return DynamicLossScaler(cfg.initial_loss_scale, growth_interval=cfg.loss_scale_window,
                                 hysteresis=cfg.hysteresis, min_scale=cfg.min_loss_scale)
    return LossScaler()


def resume(run: TrainingRun, checkpoint: str) -> dict:
    """Loads a checkpoint's weights, optimizer moments, step and RNG offsets into `run` (any TP
    and PP size: resharded on load), after checking that the run's settings continue the checkpoint's
    training (`checkpoint_conflicts`; raised on every rank). Collective. Returns the metadata."""
    world = run.ctx.world.mpi_comm
    with errors_raised_on_every_rank(world):
        path = resolve_checkpoint(checkpoint)
        conflicts = checkpoint_conflicts(run.config, read_meta(path))
        if conflicts:
            raise ConfigError(f"the run's settings differ from those of the checkpoint {path}: "
                              + "; ".join(conflicts) + ". A resumed run continues the same training: "
                              "resolve_run_config(resume=...) takes them from the checkpoint")
    if getattr(run.optimizer, "params_sharded", False):
        run.settle_params()  # (zero 3: each rank loads its pieces, one parameter whole at a time)
    else:
        run.gather_params()
    meta = load_checkpoint(path, run.model, run.optimizer)
    run.step = run.start_step = run.last_saved = int(meta["step"])
    rng = meta.get("rng")
    if rng:  # a pipeline checkpoint holds each stage's streams: this stage's at the same pp
        stages = rng.get("stages")
        same = stages and len(stages) == run.ctx.pp_size
        run.model.rng.load_state_dict(dict(rng, offsets=stages[run.ctx.pp_rank]) if same else rng)
    saved_scaler = meta.get("loss_scaler")
    if saved_scaler and saved_scaler.get("kind") == ("dynamic" if run.loss_scaler.dynamic else "static"):
        if run.loss_scaler.dynamic or run.config.loss_scale is None:
            run.loss_scaler.load_state_dict(saved_scaler)  # a new --loss-scale S overrides a saved static one
    elif saved_scaler and run.ctx.rank == 0:  # (the settings resolved keep the kind unless told otherwise)
        stderr_line(f"loss scale: the checkpoint's {describe_scaler(saved_scaler)} is not continued; this run uses "
                    f"{describe_scaler(run.loss_scaler.state_dict())}, as its settings say")
    return meta


def save(run: TrainingRun) -> str | None:
    """Writes a checkpoint of `run.step` into `config.out` (keeping `config.keep`); returns its
    directory, or None when there is no `out` or this step is saved already. Collective."""
    cfg = run.config
    if not cfg.out or run.last_saved == run.step:
        return None
    opt = run.optimizer  # zero 3: its units written one at a time, never the whole model
    by_unit = isinstance(opt, ShardedAdamW) and opt.zero == 3 and not opt.all_gathered
    if by_unit:
        run.settle_params()
    else:
        run.gather_params()
    path = save_checkpoint(cfg.out, run.step, run.model, run.optimizer, rng_state=run.model.rng.state_dict(),
                           data_state=run.sampler.state(run.step),
                           train_args={**cfg.checkpoint_settings(), **run.frozen_base},
                           keep=0 if run.replaced else cfg.keep, loss_scaler=run.loss_scaler.state_dict(),
                           by_unit=by_unit)
    run.last_saved = run.step
    if run.replaced:  # rank 0, --overwrite: the other run's checkpoints go once one of ours is complete
        for old in run.replaced:
            if os.path.realpath(old) != os.path.realpath(path):
                shutil.rmtree(old, ignore_errors=True)
        print(f"--overwrite: removed the {len(run.replaced)} checkpoint(s) of the previous run in {cfg.out}",
              file=sys.stderr, flush=True)
        run.replaced = []
        prune_checkpoints(cfg.out, cfg.keep, newest_step=run.step)
    return path


def train_step(run: TrainingRun, hooks: StepHooks | None = None, *, profile: bool = False) -> StepStats:
    """One optimizer step (the module docstring says what it does). Collective over the run's
    context. `profile` synchronises the device between phases so that the phase times are exact
    on a GPU too. Raises FloatingPointError after `max_skips` non-finite steps in a row."""
    hooks = hooks or _NO_HOOKS
    cfg, ctx, model, scaler = run.config, run.ctx, run.model, run.loss_scaler
    clock = _PhaseClock(ctx, sync=profile, hooks=hooks)
    n = run.step
    # (float16: an overflow of the scaled gradients is expected and handled, the step skipped and
    # said in one line; NumPy's RuntimeWarnings about it, every rank's, would only repeat that)
    quiet_overflow = np.errstate(over="ignore", invalid="ignore") if cfg.model.dtype == "float16" else \
        contextlib.nullcontext()
    with ctx.watchdog.watch_progress(f"training step {n + 1}"), quiet_overflow:
        t0 = time.perf_counter()
        bytes0 = ctx.counter.bytes()
        times0 = comm_snapshot(ctx)
        wait_ms = None
        clock.enter("optimizer")  # clearing the gradients counts with their use at the end
        if isinstance(run.optimizer, ShardedAdamW):
            run.optimizer.begin_step()
        run.flat.zero_grad()
        clock.enter("forward")  # reading the step's batch counts with the forward
        batches = list(run.sampler.micro_batches(n))
        weights = loss_weights(ctx, [y for _, y in batches], model.ignore_index)
        loss_sum = 0.0
        first_row = run.sampler.first_row  # dropout masks by global position: a micro-batch's first row

        # MoE load-balancing and z-losses over the step's global batch (cutp.train.moe): each
        # micro-batch's forward gives its part of them; its gradient on each rank is its tokens'
        # share, and DP x CP averages it: x dp x cp
        aux_weight = ctx.dp_cp_size
        gather, buckets = overlap_for_step(run)
        # (MoE: a counting pass first, with several micro-batches; the losses stay on the device)
        with moe_step(run, batches, n, first_row), losses_on_device(model):
            if ctx.pp_size > 1:  # the schedule interleaves the stages' forwards and backwards
                schedule = Schedule(run, batches, weights, n, first_row, scaler.scale, hooks, aux_weight)
                loss_sum = schedule.run_step(cfg.pp_schedule)
                run.pipeline_in_flight = schedule.max_in_flight
                wait_ms = schedule.wait_s * 1000
            else:
                for micro, batch in enumerate(batches):
                    x, y = batch
                    clock.enter("forward")
                    model.rng.set_position(n, first_row(micro), cfg.batch_size)
                    model.check_inputs(x, y)  # on the host arrays: no device round trip
                    model.before_unit_forward = gather.before_forward if gather is not None and micro == 0 else None
                    loss_sum += weights[micro] * model.forward(ctx.asarray(x), ctx.asarray(y), check=False,
                                                               **model_kwargs(batch, ctx.asarray))
                    model.before_unit_forward = None
                    ctx.watchdog.progress()
                    hooks.after_forward(run, micro)
                    clock.enter("backward")
                    last = buckets is not None and cfg.overlap_grad_reduce and micro == len(batches) - 1
                    model.after_unit_backward = buckets.grads_final if last else None  # grads final in it
                    model.backward(scaler.scale * weights[micro], aux_dloss=scaler.scale * aux_weight)
                    model.after_unit_backward = None
                    ctx.watchdog.progress()
        model.rng.position = None  # a forward outside train_step draws from its streams again
        clock.enter("optimizer")
        hooks.before_grad_sync(run)
        if buckets is not None:  # (the TP sums and grad_sync hooks per bucket, as each starts)
            buckets.finish()
        else:
            if not isinstance(run.optimizer, ShardedAdamW):  # (zero 2/3: unit by unit, in the backward)
                tp_grad_sync(model.parameters(), ctx.tp)
            run.optimizer.reduce_gradients(ctx)
        scale = scaler.scale
        norm = run.optimizer.grad_norm(ctx) / scale  # of the unscaled gradients
        loss = dp_mean(ctx, float(loss_sum), "the loss average", per_cp_rank=True)  # (the step's one read)
        if ctx.pp_size > 1:
            loss = from_last_stage(ctx, loss)
        moe = moe_step_stats(ctx, model)  # (its one read of the routing statistics: the device is idle by now)
        # the schedule moves with the updates made (Megatron steps its scheduler only on a successful
        # update): a skipped step leaves it where it was; the optimizer's count is in checkpoints
        lr = lr_schedule(run.optimizer.step_count, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
        skipped = not (math.isfinite(loss) and math.isfinite(norm))
        # the decision above comes from all-reduced values: every rank updates its scaler alike
        overflow = skipped and math.isfinite(loss) and scaler.dynamic
        absorbed = overflow and not scaler.at_floor  # the scaler's business, not the run's trouble
        scaler.update(not math.isfinite(norm))
        if not skipped:
            run.optimizer.step(lr, grad_scale=clip_scale(norm, cfg.grad_clip) / scale)
            apply_moe_bias_updates(model)  # (DeepSeek's correction bias, from the step's counts)
            run.consecutive_skips = 0
        elif absorbed:
            if ctx.rank == 0 and not cfg.quiet:  # (one write: a line of its own beside the progress lines)
                stderr_line(f"step {n + 1}: float16 gradients overflowed at loss scale {scale:g}: step skipped, "
                            f"scale now {scaler.scale:g}")
        else:
            run.consecutive_skips += 1
            if ctx.rank == 0:  # said even when progress lines are off: the run is in trouble
                stderr_line(f"warning: step {n + 1}: non-finite loss {loss} or grad norm {norm}: step skipped "
                            f"({run.consecutive_skips} in a row; the run stops at {cfg.max_skips})")
            if run.consecutive_skips >= cfg.max_skips:
                run.gather_params()  # (zero 3: the whole parameters, to name a non-finite one)
                bad = next((p.name for p in model.parameters() if not bool(ctx.xp.isfinite(p.data).all())), None)
                cause = (f"parameter {bad} holds NaN or Inf values on rank {ctx.rank}: the weights diverged"
                         if bad else "the weights are finite (perhaps too large): the loss or the gradients are not")
                raise FloatingPointError(f"{run.consecutive_skips} consecutive non-finite steps; stopping after step "
                                         f"{n + 1}: {cause} (lower --lr, or resume from the last checkpoint)")
        ctx.synchronize()
        clock.enter(None)
        ms = (time.perf_counter() - t0) * 1000
    run.step = n + 1
    exact = profile or ctx.device == "cpu"
    return StepStats(step=n + 1, loss=loss, grad_norm=norm, lr=lr, skipped=skipped, ms=ms,
                     tokens_per_s=cfg.tokens_per_step / (ms / 1000), comm_bytes=ctx.counter.bytes() - bytes0,
                     forward_ms=clock.ms.get("forward", 0.0) if exact else None,  # (pp > 1: the schedule, both ways)
                     backward_ms=clock.ms.get("backward", 0.0) if exact else None,
                     optimizer_ms=clock.ms.get("optimizer", 0.0) if exact else None,
                     consecutive_skips=run.consecutive_skips,
                     loss_scale=scale if (scaler.dynamic or scale != 1.0) else None, overflow=overflow,
                     pipeline_wait_ms=wait_ms, moe=moe, **comm_times(ctx, times0))

