"""Train a GPT with tensor and data parallelism.

    mpirun -np 8 python examples/train_gpt.py                       # picks tp and a preset for the machine
    mpirun -np 2 python examples/train_gpt.py --preset tiny --steps 200 --out out/tiny
    mpirun -np 2 python examples/train_gpt.py --resume out/tiny --steps 400        # goes on in out/tiny, as it ran
    mpirun -np 2 python examples/train_gpt.py --init-from path/to/gpt2 --data train.bin --lr 3e-5  # fine-tune

One optimizer step (cutp.train.train_step): `accum` micro-batches of forward + backward per DP
rank (gradients accumulate), then the GQA/DP gradient reduction, global-norm clipping, AdamW.
--batch-size is the global number of sequences per step over all DP ranks, so changing tp or dp
never changes the math; --micro-batch-size only trades memory for speed. (Mixture-of-experts
models too: their auxiliary losses are the global batch's. Only an expert capacity,
moe_capacity_factor, applies to each DP rank's micro-batch: with one, dp and the micro-batch
size change which tokens are dropped.)

This file is meant to be read and edited: the loop is all here; the step, the defaults and the
checks live in cutp.train.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

try:
    import cutp
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cutp
from cutp.runtime.deadline import arm_setup_deadline, disarm_setup_deadline, setup_progress, timeout_from_argv

if __name__ == "__main__":  # the script: setup has a deadline, MPI's initialisation (the next import) included
    arm_setup_deadline(timeout_from_argv(sys.argv[1:]))

from cutp import train  # noqa: E402
from cutp.models.flops import training_flops_per_token  # noqa: E402
from cutp.train.config_file import (add_config_flags, check_saved_config, command_line_choices,  # noqa: E402
                                    config_text, save_config)
from mpi4py import MPI  # noqa: E402
from cutp.runtime.errors import settings_named  # noqa: E402
from cutp.runtime.failure import config_errors_exit, errors_raised_on_every_rank, install_abort_on_error  # noqa: E402


def parse_command_line(argv=None) -> tuple[dict, bool]:
    """(the settings of the command line: its --config file's, the flags given over them;
    --print-config). Every flag is a run setting declared once in cutp.train.config (RunConfig's
    fields): its type, allowed values, default and help. Collective (a file's error: every rank)."""
    p = train.command_line_parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p)
    args = p.parse_args(argv)
    with errors_raised_on_every_rank(MPI.COMM_WORLD):
        return command_line_choices(args)


def parse_args(argv=None) -> argparse.Namespace:
    """The settings of the command line as a Namespace: vars() of it go to resolve_run_config."""
    return argparse.Namespace(**parse_command_line(argv)[0])


def main(argv=None, hooks: train.StepHooks | None = None, keep_history: bool = True):
    """Runs the training the command line describes; returns the metrics rows of this invocation
    (none kept with keep_history=False, as the script runs: a long run's memory must not grow with
    its steps; the rows are in the --metrics file). `hooks` reach inside each step (tests inject
    faults through them)."""
    install_abort_on_error()  # an error on any rank ends the whole job, with that rank's traceback

    # ---- configuration: every default derived, checked on every rank, before any allocation -----
    with settings_named(train.flag_name):  # their errors name the flags (the library's name the fields)
        choices, print_config = parse_command_line(argv)  # --config FILE's settings, the flags over them
        with errors_raised_on_every_rank(MPI.COMM_WORLD):  # --resume DIR: its checkpoints go on into DIR
            choices = train.resume_out(choices)
        cfg = train.resolve_run_config(source="command line", **choices)
        if print_config:
            if MPI.COMM_WORLD.Get_rank() == 0:
                print(config_text(cfg, f"examples/train_gpt.py --config FILE (on {MPI.COMM_WORLD.Get_size()} "
                                       "ranks) reproduces this run"), end="", flush=True)
            return []
        with errors_raised_on_every_rank(MPI.COMM_WORLD):  # a config.toml of the user's in --out is never replaced
            if cfg.out and MPI.COMM_WORLD.Get_rank() == 0:
                check_saved_config(cfg.out)
        setup_progress(cfg.collective_timeout)  # the run's timeout from here on (None: the one armed)
        run = train.build_run(cfg)  # context, model, optimizer, data; the checkpoint's state on resume
        with errors_raised_on_every_rank(MPI.COMM_WORLD):  # --sample-every: the prompt encoded (chat: templated)
            sampler = train.PromptSampler.for_run(run)
    disarm_setup_deadline()  # from here the collective watchdog watches every step
    ctx = run.ctx
    if cfg.out and ctx.rank == 0:
        save_config(cfg, cfg.out)  # the resolved settings beside the checkpoints
    log = print if (ctx.rank == 0 and not cfg.quiet) else (lambda *a, **k: None)
    log(f"cutp {cutp.__version__} | {ctx.describe()} | {run.blas}")
    origin = (f"resumed from {cfg.resume}" if cfg.resume else f"initialised from {cfg.init_from}" if cfg.init_from
              else f"preset {cfg.preset}") + (f" with {list(cfg.overrides)}" if cfg.overrides and not cfg.resume else "")
    note = train.resume_note(cfg)
    if note:
        log(note)
    log(f"model: {origin}: {train.model_summary(cfg.model)}")
    log(f"parameters: {train.parameter_counts(cfg.model, run.model)} | data: {run.dataset.description}")
    trains = train.finetune.trainable_line(cfg, run.model)
    if trains:
        log(trains)
    oversized = train.finetune.oversized_rank_line(cfg, run.model)  # (collective over PP: every rank asks)
    if oversized and ctx.rank == 0:  # (a warning: printed under --quiet too)
        print(oversized, file=sys.stderr, flush=True)
    state = train.max_over_ranks(ctx, train.memory_record(run))  # measured from the live arrays (collective)
    log(f"memory per rank (largest of {ctx.world_size}): {train.memory.state_line(state)}")
    log(f"batch {cfg.batch_size} x {cfg.seq_len} tokens = {cfg.tokens_per_step:,} tokens/step | micro-batch "
        f"{cfg.micro_batch_size}, accumulation {cfg.accum_steps} | lr {cfg.lr:g} warmup {cfg.warmup} | "
        f"steps {run.step}..{cfg.steps}")
    opt = run.optimizer
    log(f"precision: {cfg.model.dtype} parameters and activations"
        + (f", fp32 master weights and gradients (DP reduction in {cfg.grad_reduce_dtype})" if opt.master is not None
           else "") + (f", loss scale {run.loss_scaler.scale:g}" + (" (dynamic)" if run.loss_scaler.dynamic else "")
                       if run.loss_scaler.dynamic or run.loss_scaler.scale != 1.0 else "")
        + (f" | optimizer: AdamW, state sharded over {ctx.dp_cp.name}={ctx.dp_cp_size}"
           + (f", the experts' over {ctx.expert_dp_cp.name}={ctx.expert_dp_cp.size}" if ctx.ep_size > 1 else "")
           + (f" (ZeRO-{cfg.zero}" + (", gradients" if cfg.zero == 2 else ", gradients and parameters by unit"
                                        if cfg.zero == 3 else "")
              + (f", {cfg.dp_replicate} HSDP replicas" if cfg.dp_replicate > 1 else "") + ")")
           if opt.distributed else " | optimizer: AdamW")
        + (f" | recompute: {cfg.recompute}" + (f" (first {cfg.recompute_layers} layers)" if cfg.recompute_layers else "")
           if cfg.recompute != "none" else "")
        + (f" | sequence parallel over tp={cfg.tp}" if cfg.sequence_parallel and cfg.tp > 1 else "")
        + (f" | context parallel over cp={cfg.cp} ({cfg.cp_comm}): {cfg.seq_len // cfg.cp} tokens per rank"
           if cfg.cp > 1 else ""))

    buckets = train.bucket_line(run)
    if buckets:
        log(buckets)

    stop = train.StopOnSignal(cfg.save_on_signal)
    if cfg.save_on_signal and not cfg.out:
        log("note: no --out: a SIGTERM/SIGINT stops the run after the current step without a checkpoint")
    metrics = train.MetricsLog(cfg.metrics, ctx.rank, resumed_step=run.start_step if cfg.resume else None)
    board = train.TensorBoardLog(cfg.tensorboard, ctx.rank, resumed_step=run.start_step if cfg.resume else None)
    history, first = [], True
    peak = cfg.peak_tflops or train.known_peak_tflops(train.gpu_name(cfg.device), cfg.model.dtype, cfg.allow_tf32)
    progress = train.Progress(training_flops_per_token(cfg.model, cfg.seq_len), peak, ctx.world_size, run.step,
                              run.end_step)
    log(f"MFU: {training_flops_per_token(cfg.model, cfg.seq_len) / 1e6:,.1f} MFLOP per token trained over "
        + (f"{peak:g} TFLOP/s per rank" if peak else "an unknown peak (n/a; --peak-tflops gives it)"))
    progress.start(time.perf_counter())

    def save():
        path = train.save(run)
        if path:
            log(f"saved {path}")

    # ---- the loop ------------------------------------------------------------------------------
    while run.step < run.end_step:
        memory = None
        if not first:
            stats = train.train_step(run, hooks)
        else:  # the first step also measures the memory per rank (its results are the same)
            stats, memory = train.measured_step(run, hooks)
            first = False
        step, rec = stats.step, progress.add(stats.record(), time.perf_counter())
        if memory:
            rec["memory"] = memory
            log(f"memory per rank (largest of {ctx.world_size}): {train.memory.peak_line(memory, step)}")
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            rec["val_loss"] = train.evaluate(run)
        if sampler is not None and (step % cfg.sample_every == 0 or step == cfg.steps):
            rec["sample"] = sampler.sample(run)
            log(f"sample after step {step}: {rec['sample']!r}")
        if keep_history:
            history.append(rec)
        metrics.write(rec)
        board.write(rec)
        if step % cfg.log_every == 0 or "val_loss" in rec:
            log(train.progress_line(rec, cfg.steps))
        if cfg.save_every and step % cfg.save_every == 0:
            save()
        if stop.agreed(ctx):
            if ctx.rank == 0:  # said even with --quiet: the run ends early on purpose
                print(f"signal received: stopping after step {step}"
                      + (", writing a checkpoint" if cfg.out else " (no --out: no checkpoint)"), flush=True)
            break
    save()
    metrics.close()
    board.close()
    run.close()
    return history


if __name__ == "__main__":
    # a setting that cannot run: one line naming its flags, exit status 2
    with config_errors_exit("train_gpt.py", name_of=train.flag_name):
        main(keep_history=False)
