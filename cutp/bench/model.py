"""`[mpiexec -n tp*cp*dp*pp] python -m cutp bench model`: one training step of a GPT preset.

The step measured is `cutp.train.train_step`, the one examples/train_gpt.py runs (on random
tokens, at a constant learning rate), with the device synchronised between phases.
Per step: tokens/s, ms split into forward, backward and optimizer (zero_grad, GQA/DP gradient
reduction, global gradient norm, loss average, AdamW), the communication inside each phase,
model FLOP/s, and the memory per rank.

Communication is timed by wrapping each of the context's communicators (inside its
CountingCommunicator) in a TimedCommunicator that measures every collective without changing
what it does: host perf_counter on the CPU (MPI calls are synchronous), CUDA events recorded on
the current stream around the NCCL call on the GPU (read after the step's final
synchronisation, so nothing is serialised that was not already). A non-blocking collective
(`start_*`: ZeRO-3's gathers, ZeRO-2/3's reduce-scatters, HSDP's and the gradient buckets'
all-reduces) counts under the blocking one's key, in the phase where its request is waited for:
on the CPU the host time of its start, test() and wait() calls; on the GPU the time the current
stream stalls at its wait() (`_TimedRequest`).

FLOPs per token: training's (`cutp.models.flops.training_flops_per_token`, the MFU
examples/train_gpt.py reports), so the two commands give one model the same figure: the matrix
products of the active parameters (an MoE layer's top_k experts, not all of them; the embedding
tables looked up, the LM head multiplied), attention's scores over min(T, window) keys, 3 x the
forward. Model FLOP/s = FLOPs per token * tokens/s; on a GPU MFU = model FLOP/s per GPU / the
GPU's dense peak for the model's dtype (common.GPU_PEAKS); on the CPU the achieved GFLOP/s is
reported instead.

Memory per rank: parameters, gradients and optimizer state are the live arrays' bytes
(`cutp.train.memory.state_bytes`); the peak a step allocates above them is measured over the
last warm-up step (`cutp.train.memory.ActivationPeak`: tracemalloc on the CPU, CuPy's pool on a
GPU), and what the modules cache for backward is measured after that step's forward by walking
every module's ``_cache_*`` attributes, however deeply nested, and summing each distinct
underlying buffer once (views of one buffer count once; parameter buffers are excluded), in all
and per transformer layer (`cutp.train.memory.stash_per_layer`: the largest layer's). On the
GPU the CuPy memory pool's reserved bytes after the steps (the pool emptied first) are reported
as well; on the CPU the process's peak resident set size.
"""
from __future__ import annotations

import contextlib
import resource

import numpy as np
from mpi4py import MPI

from ..data import Dataset
from ..runtime.errors import ConfigError
from ..models import GPTConfig
from ..models.flops import training_flops_per_token
from .. import ops
from ..ops import tf32_allowed
from ..ops.profile import OpTimer, breakdown
from ..runtime.threads import set_blas_threads
from ..optim import ShardedAdamW
from ..tensor_parallel.grads import replica_size
from ..train import StepHooks, build_run, resolve_run_config, train_step
from ..train.finetune import FINETUNE_DEFAULTS
from ..train.overlap import overlap_fraction
from ..train.memory import ActivationPeak, cached_activation_bytes, stash_per_layer, state_bytes
from ..train.pipeline import pipeline_bubble
from ..train.reporting import Report
from .comm_timing import CommClock, install_comm_timing
from .common import device_of, gpu_info, gpu_peak, machine_info, peak_tflops, reduce_scalar


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------
class _Measure(StepHooks):
    """Points the comm clock at the step's phases; measures the cached activations once."""

    def __init__(self, clock: CommClock, exclude):
        self.clock, self.exclude = clock, exclude
        self.measure_activations = False
        self.activation_bytes = 0
        self.per_layer: list[int] = []

    def phase(self, name):
        self.clock.phase = name

    def after_forward(self, run, micro):
        if self.measure_activations and micro == 0:
            self.activation_bytes = cached_activation_bytes(run.model, exclude=self.exclude)
            self.per_layer = stash_per_layer(run.model)


_NOTHING = contextlib.nullcontext()


def _pipeline_table(report, ctx, cfg, waits, step_s):
    """Each stage's median time in pipeline sends and receives, as a fraction of the step: the
    measured bubble, next to the ideal schedule's (p - 1) / (m + p - 1), / V interleaved."""
    p, m, V = ctx.pp_size, cfg.accum_steps, cfg.pp_virtual
    mine = float(np.median(waits)) if waits else 0.0
    per_stage = ctx.world.mpi_comm.allgather((ctx.pp_rank, mine))  # (stage, seconds) of every rank
    by_stage = {}
    for stage, s in per_stage:
        by_stage[stage] = max(by_stage.get(stage, 0.0), s)
    t = report.table("pipeline", [("stage", "stage", "d"), ("wait_ms", "waiting ms/step", ",.1f"),
                                  ("bubble", "bubble %", ".1f")],
                     title=f"pipeline ({cfg.pp_schedule}, p={p}" + (f", V={V}" if V > 1 else "")
                     + f", m={m} micro-batches of {cfg.micro_batch_size})")
    for stage in range(p):
        t.add(stage=stage, wait_ms=by_stage[stage] * 1e3, bubble=100 * by_stage[stage] / step_s)
    ideal = pipeline_bubble(p, m, V)
    mean = sum(by_stage.values()) / p / step_s
    formula = "(p-1)/(m+p-1)" if V == 1 else "(p-1)/(V*m+p-1)"
    t.notes.append(f"measured bubble (mean over stages) {100 * mean:.1f}% of the step; the schedule's ideal "
                   f"{formula} = {100 * ideal:.1f}% (time in sends/receives, host clock: exact on the CPU, "
                   "a lower bound on GPUs)")
    report.extra["pipeline"] = {"wait_ms": [by_stage[s] * 1e3 for s in range(p)], "bubble": mean,
                                "ideal_bubble": ideal}


def _op_table(report, world, op_steps, gpu):
    """Where a step's time goes per op kind (cutp.ops.profile): the median over the profiled
    steps of each kind's seconds, then the slowest rank."""
    t = report.table("ops", [("kind", "op kind", "", "<"), ("ms", "ms/step", ",.1f"), ("pct", "% of step", ".1f")],
                     title="where a step goes, per op kind (slowest rank)")
    step_s = reduce_scalar(world, float(np.median([s for s, _, _ in op_steps])))
    rows = [breakdown(s, ops_s, comm_s) for s, ops_s, comm_s in op_steps]
    out = {}
    for i, (kind, _) in enumerate(rows[0]):
        sec = reduce_scalar(world, float(np.median([r[i][1] for r in rows])))
        out[kind] = sec * 1e3
        t.add(kind=kind, ms=sec * 1e3, pct=100 * sec / step_s)
    t.add(kind="step", ms=step_s * 1e3, pct=100.0)
    t.notes.append("gemm: linear layers and other matrix products; attention: the core attention, rotary, softmax; "
                   "outside the ops: the step minus the ops and the communication (Python, residual adds, "
                   "gradient norm, zero_grad)" + ("; a GPU: one extra step, every op synchronised" if gpu else ""))
    report.extra["op_kinds_ms"] = out


def random_tokens(vocab_size: int, n: int, seed: int) -> Dataset:
    """Uniform random token ids below the model's vocabulary: any vocabulary fits, and the
    work of a step does not depend on the data."""
    rng = np.random.default_rng(seed)
    return Dataset(rng.integers(0, vocab_size, n), rng.integers(0, vocab_size, n), vocab_size,
                   f"random tokens (vocabulary {vocab_size})")


def _overlap_settings(args) -> dict:
    """The overlap and simulated-link settings of the command line (cutp.train.overlap)."""
    names = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "bucket_size", "link_bandwidth",
             "link_latency")
    return {k: getattr(args, k) for k in names if getattr(args, k, None) not in (None, False)}


def _overlap_table(report, world, times, name="overlap", title="communication hidden behind computation (wall "
                   "clock)", note="in flight: blocking collectives' calls and non-blocking ones from start to seen "
                   "finished; exposed: time blocked in them (cutp.comm.counting)"):
    """Per group: its collectives' time in flight, the time this rank blocked on them, and the
    share hidden (median over the measured steps, then the slowest rank)."""
    t = report.table(name, [("group", "group", "", "<"), ("comm_ms", "in flight ms/step", ",.2f"),
                            ("exposed_ms", "exposed ms/step", ",.2f"), ("overlap", "hidden %", ".1f")], title=title)
    groups = sorted(set().union(*world.allgather(sorted({g for step in times for g in step}))))
    out = {}
    for group in groups + ["all"]:
        def med(k):
            vals = [sum(v[k] for v in step.values()) if group == "all" else step.get(group, (0.0, 0.0))[k]
                    for step in times]
            return reduce_scalar(world, float(np.median(vals)) if vals else 0.0)

        comm, exposed = med(0), med(1)
        frac = overlap_fraction(comm, exposed)
        out[group] = {"comm_ms": comm, "exposed_comm_ms": exposed, "overlap_fraction": frac}
        if comm > 0:
            t.add(group=group, comm_ms=comm, exposed_ms=exposed, overlap=None if frac is None else 100 * frac)
    t.notes.append(note)
    report.extra[name] = out
    return out


def _shards(opt, ctx) -> int:
    """The ranks the optimizer state is sharded over: ZeRO 2/3's shard group (one HSDP replica's
    ranks), else DP x CP (ZeRO 1; at ep > 1 the experts' over DP x CP / ep)."""
    return opt.group.size if isinstance(opt, ShardedAdamW) else replica_size(ctx)


def run(args) -> Report:
    device, xp = device_of(args.device)
    world = MPI.COMM_WORLD
    cp = getattr(args, "cp", 1)
    dp = args.dp or max(1, world.Get_size() // (args.tp * cp * args.pp))
    if args.batch_size and args.batch_size % dp:  # (batch 1 over dp 2 was refused as micro_batch_size 0)
        raise ConfigError(f"--batch-size {args.batch_size} is the global batch, and dp {dp} does not divide it; give "
                          f"a multiple of {dp}, e.g. --batch-size {dp * max(1, args.batch_size // dp)}")
    B = args.batch_size // dp if args.batch_size else 8  # sequences per DP rank (--batch-size: the global batch)
    model = GPTConfig.preset(args.preset, dtype=args.dtype).with_overrides(args.set)
    if args.seq_len and args.seq_len > model.block_size:  # (it ran the block size instead)
        raise ConfigError(f"--seq-len {args.seq_len} is past {args.preset}'s block size {model.block_size} (the "
                          f"positions it has); give --seq-len {model.block_size} or less, or --set "
                          f"block_size={args.seq_len}")
    # a link that moves nothing: 0 GB/s was dropped as "not given" (no link simulated), -2 a traceback
    if args.link_bandwidth is not None and not args.link_bandwidth > 0:
        raise ConfigError(f"--link-bandwidth {args.link_bandwidth:g}: a link moves more than 0 GB/s; give e.g. "
                          "--link-bandwidth 50, or omit it")
    if args.link_latency < 0:
        raise ConfigError(f"--link-latency {args.link_latency:g}: a latency is >= 0 us; give e.g. --link-latency 5")
    T = min(args.seq_len or (min(model.block_size, 256) if device == "cpu" else model.block_size), model.block_size)
    # the training step of cutp.train, at a constant learning rate, on random tokens
    cfg = resolve_run_config(world, source="bench model settings", preset=args.preset, set=args.set,
                             dtype=args.dtype, device=device, tp=args.tp, dp=args.dp, ep=getattr(args, "ep", 1), batch_size=args.batch_size or B * dp,
                             pp=args.pp, pp_schedule=args.pp_schedule, pp_virtual=args.pp_virtual,
                             pp_layers=args.pp_layers, cp=cp, cp_comm=getattr(args, "cp_comm", "ring"),
                             micro_batch_size=args.micro_batch_size or B, seq_len=T, steps=args.warmup + args.steps + (device != "cpu"), lr=1e-4,
                             min_lr=1e-4, warmup=0, seed=args.seed, eval_every=0, quiet=True,
                             save_on_signal=False, distributed_optimizer=args.distributed_optimizer,
                             zero=getattr(args, "zero", 0), dp_replicate=getattr(args, "dp_replicate", 1),
                             reshard_after_forward=getattr(args, "reshard_after_forward", True),
                             recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                             allow_tf32=getattr(args, "allow_tf32", False), **_overlap_settings(args),
                             **{k: getattr(args, k, v) for k, v in FINETUNE_DEFAULTS.items()})  # (LoRA, --freeze)
    run = build_run(cfg, world, dataset=random_tokens(model.vocab_size, max(1 << 16, 4 * B * dp * (T + 1)),
                                                      args.seed))
    ctx, config, T = run.ctx, cfg.model, cfg.seq_len
    if device == "cpu" and args.threads:
        set_blas_threads(args.threads)
    report = Report("model", machine_info(xp) if ctx.rank == 0 else {})
    report.meta.update(device=device, preset=args.preset, overrides=list(args.set), tp=ctx.tp_size, dp=ctx.dp_size,
                       pp=ctx.pp_size, cp=ctx.cp_size, cp_comm=cfg.cp_comm, batch_per_dp_rank=B,
                       micro_batch=cfg.micro_batch_size, seq_len=T,
                       config=config.to_dict(), recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel,
                       distributed_optimizer=cfg.distributed_optimizer, pp_schedule=cfg.pp_schedule,
                       pp_virtual=cfg.pp_virtual)
    flat, opt = run.flat, run.optimizer
    clock = CommClock(xp)
    if not args.no_comm_timing:
        install_comm_timing(ctx, clock)
    hooks = _Measure(clock, exclude=(flat.data, flat.grad))

    pool = None
    if xp is not np:
        pool = xp.get_default_memory_pool()
        pool.free_all_blocks()

    phases = ("forward", "backward", "optimizer")
    rec = {p: [] for p in phases}
    comm = {p: [] for p in phases}
    comm_ops: dict[str, list] = {}
    losses = []
    waits = []  # this stage's time in pipeline sends/receives per measured step
    bytes_per_step = {}
    overlap_times, link_times = [], []  # per measured step: {group: (comm_ms, exposed_ms)}
    step_peak = 0
    # per op kind (cutp.ops.profile): on the CPU over the measured steps (the hook costs ~1 us a
    # call); on a GPU, whose ops must be synchronised one by one to be timed, over one more step
    # after them, kept out of the step's figures
    gpu = xp is not np
    op_timer = OpTimer(ops, sync=(lambda: xp.cuda.get_current_stream().synchronize()) if gpu else None)
    op_steps = []  # per profiled step: (step seconds, {kind: seconds}, comm seconds)
    by_op = []  # per profiled step: {op: seconds}
    for step in range(args.warmup + args.steps + (1 if gpu else 0)):
        measured = args.warmup <= step < args.warmup + args.steps
        profiled = step == args.warmup + args.steps if gpu else measured
        # the activations are walked in the last warm-up step: the walk's time is not measured
        hooks.measure_activations = step == max(args.warmup - 1, 0)
        clock.reset()
        b0 = {k: v[2] for k, v in ctx.counter.totals.items()}
        c0 = {k: v[0] for k, v in ctx.counter.totals.items()}
        op_timer.reset()
        with ActivationPeak(ctx) if hooks.measure_activations else _NOTHING as peak, \
                op_timer if profiled else _NOTHING:
            stats = train_step(run, hooks, profile=True)
        if hooks.measure_activations:
            step_peak = peak.bytes
        clock.collect()
        if profiled:
            op_steps.append(((stats.forward_ms + stats.backward_ms + stats.optimizer_ms) / 1e3,
                             dict(op_timer.seconds), sum(clock.seconds.values())))
            by_op.append(dict(op_timer.by_op))
        if step >= args.warmup + args.steps:  # the GPU's profiled step: in no other figure
            continue
        losses.append(stats.loss)
        if measured and stats.pipeline_wait_ms is not None:
            waits.append(stats.pipeline_wait_ms / 1e3)
        if measured:
            for p, ms in zip(phases, (stats.forward_ms, stats.backward_ms, stats.optimizer_ms)):
                rec[p].append(ms / 1e3)
                comm[p].append(clock.seconds.get(p, 0.0))
            for k, s in clock.by_op.items():
                comm_ops.setdefault(k, []).append(s)
            overlap_times.append(stats.comm_ms_by_group)
            if stats.link_ms_by_group is not None:
                link_times.append(stats.link_ms_by_group)
            bytes_per_step = {f"{g}.{o}": (v[0] - c0.get((g, o), 0), v[2] - b0.get((g, o), 0))
                              for (g, o), v in ctx.counter.totals.items()}
    act_bytes = hooks.activation_bytes
    # the slowest rank defines each phase (median over the measured steps first)
    med = {p: reduce_scalar(world, np.median(rec[p])) for p in phases}
    med_comm = {p: reduce_scalar(world, np.median(comm[p])) for p in phases}
    step_s = sum(med.values())
    tokens = B * T * ctx.dp_size
    tok_s = tokens / step_s
    fpt = training_flops_per_token(config, T)  # (training's MFU counts the same FLOPs)
    flops = fpt * tok_s
    n_dev = ctx.world_size

    t = report.table("step", [("preset", "preset", "", "<"), ("mesh", "tp x dp", "", "<"), ("shape", "B x T per DP rank", "", "<"),
                              ("tokens", "tokens/step", ",d"), ("ms", "ms/step", ",.1f"), ("tok_s", "tokens/s", ",.0f"),
                              ("gflops", "model GFLOP/s", ",.1f"), ("gflops_dev", "per rank", ",.1f"),
                              ("mfu", "MFU %", ".1f"), ("loss", "loss", ".4f")],
                     title=f"training step ({device}, {config.dtype}, median of {args.steps} steps after {args.warmup} warm-up)")
    mfu = None
    peak = None
    if device == "cuda":
        info = gpu_info(xp)
        peak = gpu_peak(info["gpu"])
        tf32 = tf32_allowed()  # --allow-tf32: float32 GEMMs on tensor cores (cutp.ops.gemm)
        pk = peak_tflops(peak, config.dtype, tf32=tf32)
        if pk:
            mfu = 100.0 * flops / n_dev / (pk * 1e12)
            report.notes.append(f"MFU against {peak['label']} dense {config.dtype}{' (TF32)' if tf32 else ''} peak "
                                f"{pk} TFLOP/s per GPU (bf16 peak {peak['bf16_tflops']} TFLOP/s)")
        else:
            report.notes.append(f"no peak known for {info['gpu']!r} in {config.dtype}: MFU not computed")
    t.add(preset=args.preset, mesh=f"{ctx.tp_size}" + (f" x cp {ctx.cp_size}" if ctx.cp_size > 1 else "")
          + f" x {ctx.dp_size}" + (f" x pp {ctx.pp_size}" if ctx.pp_size > 1 else ""), shape=f"{B} x {T}", tokens=tokens, ms=step_s * 1e3,
          tok_s=tok_s, gflops=flops / 1e9, gflops_dev=flops / n_dev / 1e9, mfu=mfu, loss=losses[-1])
    t.notes.append(f"FLOPs/token = {fpt:,.0f}: training's count (cutp.models.flops: the active parameters' matrix "
                   f"products and attention over {T} keys, forward and backward)")

    ph = report.table("phases", [("phase", "phase", "", "<"), ("ms", "ms", ",.1f"), ("comm_ms", "of which comm ms", ",.1f"),
                                 ("compute_ms", "compute ms", ",.1f"), ("pct", "% of step", ".1f")],
                      title="where a step goes (slowest rank)")
    for p in phases:
        ph.add(phase=p, ms=med[p] * 1e3, comm_ms=None if args.no_comm_timing else med_comm[p] * 1e3,
               compute_ms=(med[p] - (0 if args.no_comm_timing else med_comm[p])) * 1e3, pct=100 * med[p] / step_s)
    total_comm = sum(med_comm.values())
    ph.add(phase="step", ms=step_s * 1e3, comm_ms=None if args.no_comm_timing else total_comm * 1e3,
           compute_ms=(step_s - (0 if args.no_comm_timing else total_comm)) * 1e3, pct=100.0)
    if args.no_comm_timing:
        ph.notes.append("communication timing off (--no-comm-timing)")
    else:
        ph.notes.append("comm time is spent inside collectives, including waiting for the slowest rank")

    cm = report.table("comm", [("key", "group.collective", "", "<"), ("calls", "calls/step", "d"),
                               ("mb", "MB/step", ",.3f"), ("ms", "ms/step", ",.2f")],
                      title="communication per step (this rank's buffers; time: slowest rank)")
    # every rank's keys: the ranks of a pipeline run different collectives (the embedding group
    # exists on the first and last stages only), and each key is reduced over every rank
    keys = sorted(set().union(*world.allgather(sorted(bytes_per_step))))
    for key in keys:
        calls, nb = bytes_per_step.get(key, (0, 0))
        times = comm_ops.get(key)
        ms = reduce_scalar(world, float(np.median(times)) * 1e3 if times else 0.0)
        if calls == 0:
            continue
        cm.add(key=key, calls=calls, mb=nb / 1e6, ms=None if args.no_comm_timing else ms)
    if not cm.rows:
        cm.notes.append("no collectives (tp = dp = 1)")

    _op_table(report, world, op_steps, gpu)
    report.extra["ops_ms"] = {k: 1e3 * float(np.median([d.get(k, 0.0) for d in by_op]))
                              for k in sorted(set().union(*by_op), key=lambda k: -by_op[-1].get(k, 0.0))}
    if ctx.pp_size > 1:
        _pipeline_table(report, ctx, cfg, waits, step_s)
    over = _overlap_table(report, world, overlap_times)
    link = None
    if cfg.link_bandwidth is not None:
        link = _overlap_table(report, world, link_times, "link", f"the simulated link's time hidden "
                              f"({cfg.link_bandwidth:g} GB/s, {cfg.link_latency:g} us)",
                              "in flight: the modelled transfer times (latency + wire bytes / bandwidth); exposed: "
                              "blocked before their modelled end (cutp.comm.simulated)")
        report.notes.append(f"simulated link under every group: {cfg.link_bandwidth:g} GB/s, {cfg.link_latency:g} us "
                            "(cutp.comm.simulated)")
    report.meta.update(overlap_grad_reduce=cfg.overlap_grad_reduce, overlap_param_gather=cfg.overlap_param_gather,
                       tp_comm_overlap=cfg.tp_comm_overlap, bucket_size=cfg.bucket_size,
                       link_bandwidth=cfg.link_bandwidth, link_latency=cfg.link_latency)

    mem = report.table("memory", [("what", "per rank", "", "<"), ("mib", "MiB", ",.1f"), ("how", "how", "", "<")],
                       title="memory per rank")
    state = state_bytes(run)  # the optimizer's memory_bytes(): its live arrays
    p_b, g_b, o_b = (int(reduce_scalar(world, state[k])) for k in ("params", "grads", "optimizer"))
    act = int(reduce_scalar(world, act_bytes))
    peak_b = int(reduce_scalar(world, step_peak))
    mem.add(what="parameters", mib=p_b / 2**20, how=f"{flat.size:,} x {flat.dtype.itemsize} B")
    mem.add(what="gradients", mib=g_b / 2**20, how=f"{flat.padded_size:,} x {flat.grad.dtype.itemsize} B")
    mem.add(what="optimizer state", mib=o_b / 2**20,
            how="AdamW m, v" + (" + fp32 master weights" if opt.master is not None else "")
                + (f", 1/{_shards(opt, ctx)} of them (distributed)" if opt.distributed else ""))
    mem.add(what="cached activations", mib=act / 2**20, how="modules' _cache_* buffers after forward (max over ranks)")
    layer = int(reduce_scalar(world, max(hooks.per_layer, default=0)))
    mem.add(what="kept per layer", mib=layer / 2**20, how="the largest layer's cached buffers after forward (max over ranks)")
    mem.add(what="step peak", mib=peak_b / 2**20, how="allocated by a step above the state, measured (max over ranks)")
    mem.add(what="sum", mib=(p_b + g_b + o_b + peak_b) / 2**20, how="state + step peak")
    if pool is not None:
        hw = int(reduce_scalar(world, pool.total_bytes()))
        mem.add(what="CuPy pool high-water", mib=hw / 2**20, how="reserved bytes after the steps (max over ranks)")
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        rss = int(reduce_scalar(world, rss))
        mem.add(what="process peak RSS", mib=rss / 2**20, how="getrusage ru_maxrss (max over ranks; includes Python)")
    report.extra["result"] = {"step_ms": step_s * 1e3, "tokens_per_s": tok_s, "flops_per_token": fpt,
                              "model_flops": flops, "mfu_pct": mfu, "phases_ms": {p: med[p] * 1e3 for p in phases},
                              "comm_ms": {p: med_comm[p] * 1e3 for p in phases}, "activation_bytes": act,
                              "stash_per_layer_max": layer,
                              "step_peak_bytes": peak_b,
                              "losses": losses, "peak": peak,
                              "exposed_comm_ms": over["all"]["exposed_comm_ms"],
                              "overlap_fraction": over["all"]["overlap_fraction"],
                              "dp_overlap_fraction": over.get("dp", {}).get("overlap_fraction"),
                              "link_overlap_fraction": None if link is None else link["all"]["overlap_fraction"],
                              "dp_link_overlap_fraction": None if link is None else
                              link.get("dp", {}).get("overlap_fraction")}
    report.extra["rank"] = ctx.rank
    run.close()
    return report
