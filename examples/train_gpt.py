"""Train a GPT with tensor and data parallelism.

    mpirun -np 8 python examples/train_gpt.py                       # picks tp and a preset for the machine
    mpirun -np 2 python examples/train_gpt.py --preset tiny --steps 200 --out out/tiny
    mpirun -np 4 python examples/train_gpt.py --tp 2 --dp 2 --resume out/tiny
    mpirun -np 2 python examples/train_gpt.py --init-from path/to/gpt2 --data train.bin --lr 3e-5  # fine-tune

One optimizer step (cutp.train.train_step): `accum` micro-batches of forward + backward per DP
rank (gradients accumulate), then the GQA/DP gradient reduction, global-norm clipping, AdamW.
--batch-size is the global number of sequences per step over all DP ranks, so changing tp or dp
never changes the math; --micro-batch-size only trades memory for speed.

This file is meant to be read and edited: the loop is all here; the step, the defaults and the
checks live in cutp.train.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

try:
    import cutp
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cutp
from cutp.runtime.deadline import arm_setup_deadline, disarm_setup_deadline, setup_progress, timeout_from_argv

if __name__ == "__main__":  # the script: setup has a deadline, MPI's initialisation (the next import) included
    arm_setup_deadline(timeout_from_argv(sys.argv[1:]))

from cutp import train  # noqa: E402
from cutp.models import PRESETS  # noqa: E402
from cutp.runtime.failure import config_errors_exit, install_abort_on_error  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: gpt2 on GPUs, tiny on the CPU)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: chosen for the machine)")
    p.add_argument("--dp", type=int, help="data-parallel size (default: world size / (tp * pp))")
    p.add_argument("--pp", type=int, help="pipeline stages (default 1): the layers split over pp ranks")
    p.add_argument("--ep", type=int, help="expert parallelism (default 1): an MoE model's experts split over ep "
                   "consecutive DP ranks (ep divides dp and n_experts), tokens sent to them by all-to-all")
    p.add_argument("--pp-layers", help="layers of each stage, e.g. 5,6,6,5 (default: n_layer / pp each); with "
                   "--pp-virtual V, of each of the pp * V model chunks in the model's order")
    p.add_argument("--pp-schedule", choices=["1f1b", "gpipe", "interleaved"],
                   help="pipeline schedule (default 1f1b: at most pp - stage micro-batches in flight; gpipe: all; "
                        "interleaved: Megatron's interleaved 1F1B over --pp-virtual chunks, bubble / V)")
    p.add_argument("--pp-virtual", type=int, help="model chunks per pipeline stage (the interleaved schedule; "
                   "default 1, or give 2 or more: implies --pp-schedule interleaved)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], help="default auto: cuda when a GPU is usable")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"],
                   help="parameters and activations (default float32); bfloat16/float16 train through fp32 "
                        "master weights and fp32 gradients, float16 with a dynamic loss scale")
    p.add_argument("--distributed-optimizer", action="store_true", default=None,
                   help="shard the optimizer state (fp32 master weights, Adam moments) over DP (ZeRO-1)")
    p.add_argument("--grad-reduce-dtype", choices=["float32", "bfloat16"],
                   help="dtype of the DP gradient reduction (default float32; bfloat16 halves the bytes, "
                        "with sums rounded to bf16)")
    p.add_argument("--recompute", choices=["none", "selective", "full"],
                   help="activation recomputation (default none): selective recomputes the core attention "
                        "in backward, full whole layers (each keeps only its input); the math is unchanged")
    p.add_argument("--recompute-layers", type=int, help="with --recompute full: the first N layers (default all)")
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="split activations between the TP regions along the sequence (LayerNorm, dropout and "
                        "residuals on seq-len/tp tokens per rank; the same bytes; --seq-len must divide by --tp)")
    p.add_argument("--loss-scale", type=float, help="a static loss scale (default: dynamic for float16, else none)")
    p.add_argument("--initial-loss-scale", type=float, help="the dynamic scale's start (default 65536)")
    p.add_argument("--loss-scale-window", type=int, help="clean steps before the dynamic scale doubles (default 1000)")
    p.add_argument("--hysteresis", type=int, help="overflows before the dynamic scale halves (default 2)")
    p.add_argument("--min-loss-scale", type=float, help="the dynamic scale's floor (default 1)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of the whole run (sets the LR schedule; "
                   "default 200)")
    p.add_argument("--run-steps", type=int, default=None,
                   help="stop (and checkpoint) after this many steps in this invocation, e.g. to fit a job time limit")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global sequences per optimizer step (default 8, rounded up to a multiple of dp)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per rank per forward (default: all)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: block size, at most 256 on CPU)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3 tiny, 6e-4 otherwise)")
    p.add_argument("--min-lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default steps/20)")
    p.add_argument("--weight-decay", type=float, default=None, help="default 0.1")
    p.add_argument("--grad-clip", type=float, default=None, help="default 1.0")
    p.add_argument("--dropout", type=float, default=None, help="default 0.0")
    p.add_argument("--seed", type=int, default=None, help="default 1337")
    p.add_argument("--data", default=None, help="text file or uint16 .bin (default: the Python stdlib sources)")
    p.add_argument("--out", default=None, help="run directory for checkpoints")
    p.add_argument("--resume", default=None, help="run or checkpoint directory to continue from")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="--out may hold another run's checkpoints: they are removed once this run's first one is saved")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="fine-tune: start a new run (step 0, fresh optimizer and schedule) from the weights of a "
                        "Hugging Face GPT-2 directory or a cutp checkpoint/run directory; the model is DIR's "
                        "(--dropout and --dtype may change; --preset/--set may not change its shapes)")
    p.add_argument("--eval-every", type=int, help="validation every N steps and at the last (default 50; 0: never)")
    p.add_argument("--eval-batches", type=int, help="validation batches (default 4)")
    p.add_argument("--save-every", type=int, help="checkpoint every N steps (default 0: only at the end)")
    p.add_argument("--keep", type=int, help="the newest healthy checkpoints kept in --out (default 3; 0: all)")
    p.add_argument("--metrics", default=None, help="JSONL file, one object per step (rank 0 writes)")
    p.add_argument("--log-every", type=int, help="a progress line every N steps (default 1)")
    p.add_argument("--max-skips", type=int, help="stop after this many consecutive non-finite steps (default 5)")
    p.add_argument("--save-on-signal", action=argparse.BooleanOptionalAction,
                   help="on SIGTERM/SIGINT finish the step, checkpoint, exit (default on)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model field of the preset, e.g. --set n_layer=2 --set n_kv_head=2")
    p.add_argument("--collective-timeout", type=float, default=None,
                   help="seconds a collective may wait for a peer, and a training step may go without "
                        "progress (no collective or micro-batch completing), before the job is aborted "
                        "(default: $CUTP_COLLECTIVE_TIMEOUT or 600; 0 turns the watchdog off)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (warnings are still printed)")
    return p.parse_args(argv)


def main(argv=None, hooks: train.StepHooks | None = None, keep_history: bool = True):
    """Runs the training the command line describes; returns the metrics rows of this invocation
    (none kept with keep_history=False, as the script runs: a long run's memory must not grow with
    its steps; the rows are in the --metrics file). `hooks` reach inside each step (tests inject
    faults through them)."""
    args = parse_args(argv)
    install_abort_on_error()  # an error on any rank ends the whole job, with that rank's traceback

    # ---- configuration: every default derived, checked on every rank, before any allocation -----
    cfg = train.resolve_run_config(source="command line", **vars(args))
    setup_progress(cfg.collective_timeout)  # the run's timeout from here on (None: the one armed)
    run = train.build_run(cfg)  # context, model, optimizer, data; the checkpoint's state on resume
    disarm_setup_deadline()  # from here the collective watchdog watches every step
    ctx = run.ctx
    log = print if (ctx.rank == 0 and not cfg.quiet) else (lambda *a, **k: None)
    log(f"cutp {cutp.__version__} | {ctx.describe()} | {run.blas}")
    origin = (f"resumed from {cfg.resume}" if cfg.resume else f"initialised from {cfg.init_from}" if cfg.init_from
              else f"preset {cfg.preset}") + (f" with {list(cfg.overrides)}" if cfg.overrides and not cfg.resume else "")
    log(f"model: {origin}: {json.dumps(cfg.model.to_dict())}")
    log(f"parameters: {cfg.model.num_parameters():,} total, {run.model.num_parameters_local():,} on this rank "
        f"(vocab padded to {run.model.padded_vocab}) | data: {run.dataset.description}")
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
        + f" | optimizer: AdamW{f', state sharded over dp={ctx.dp_size} (distributed)' if opt.distributed else ''}"
        + (f" | recompute: {cfg.recompute}" + (f" (first {cfg.recompute_layers} layers)" if cfg.recompute_layers else "")
           if cfg.recompute != "none" else "")
        + (f" | sequence parallel over tp={cfg.tp}" if cfg.sequence_parallel and cfg.tp > 1 else ""))

    stop = train.StopOnSignal(cfg.save_on_signal)
    if cfg.save_on_signal and not cfg.out:
        log("note: no --out: a SIGTERM/SIGINT stops the run after the current step without a checkpoint")
    metrics = train.MetricsLog(cfg.metrics, ctx.rank, resumed_step=run.start_step if cfg.resume else None)
    history, first = [], True

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
        step, rec = stats.step, stats.record()
        if memory:
            rec["memory"] = memory
            log(f"memory per rank (largest of {ctx.world_size}): {train.memory.peak_line(memory, step)}")
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            rec["val_loss"] = train.evaluate(run)
        if keep_history:
            history.append(rec)
        metrics.write(rec)
        if step % cfg.log_every == 0 or "val_loss" in rec:
            log(train.progress_line(rec))
        if cfg.save_every and step % cfg.save_every == 0:
            save()
        if stop.agreed(ctx):
            if ctx.rank == 0:  # said even with --quiet: the run ends early on purpose
                print(f"signal received: stopping after step {step}"
                      + (", writing a checkpoint" if cfg.out else " (no --out: no checkpoint)"), flush=True)
            break
    save()
    metrics.close()
    run.close()
    return history


if __name__ == "__main__":
    with config_errors_exit("train_gpt.py"):  # a setting that cannot run: one line, exit status 2
        main(keep_history=False)
