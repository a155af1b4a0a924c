"""Train a GPT with tensor and data parallelism.

    mpirun -np 8 python examples/train_gpt.py                       # picks tp and a preset for the machine
    mpirun -np 2 python examples/train_gpt.py --preset tiny --steps 200 --out out/tiny
    mpirun -np 4 python examples/train_gpt.py --tp 2 --dp 2 --resume out/tiny

One optimizer step: `accum` micro-batches of forward + backward per DP rank (gradients
accumulate), then the GQA/DP gradient reduction, global-norm clipping, AdamW. --batch-size is
the global number of sequences per step over all DP ranks, so changing tp or dp never changes
the math; --micro-batch-size only trades memory for speed.

This file is meant to be read and edited: the loop is all here, the parts live in cutp.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

try:
    import cutp
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cutp

import numpy as np

from cutp import checkpoint
from cutp.runtime.consistency import check_same_on_all_ranks
from cutp.data import BatchSampler, load_dataset
from cutp.model import GPT, PRESETS, GPTConfig
from cutp.optim import AdamW, FlatParameters, clip_scale, lr_schedule
from cutp.tensor_parallel import finish_grad_sync, global_grad_norm
from cutp.runtime.threads import set_blas_threads, threads_per_rank


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: gpt2 on GPUs, tiny on the CPU)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: chosen for the machine)")
    p.add_argument("--dp", type=int, help="data-parallel size (default: world size / tp)")
    p.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    p.add_argument("--dtype", default=None, choices=["float32", "float64"], help="default float32")
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
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept in --out")
    p.add_argument("--metrics", default=None, help="JSONL file, one object per step (rank 0 writes)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--max-skips", type=int, default=5, help="stop after this many consecutive non-finite steps")
    p.add_argument("--save-on-signal", action=argparse.BooleanOptionalAction, default=True,
                   help="on SIGTERM/SIGINT finish the step, checkpoint, exit (default on)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model field of the preset, e.g. --set n_layer=2 --set n_kv_head=2")
    p.add_argument("--collective-timeout", type=float, default=None,
                   help="seconds a collective may wait for a peer before the job is aborted "
                        "(default: $CUTP_COLLECTIVE_TIMEOUT or 600; 0 turns the watchdog off)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (warnings are still printed)")
    return p.parse_args(argv)


# Settings that define the training itself. A resumed run takes them from the checkpoint; a flag
# that contradicts the checkpoint is refused (the run would silently change its math), except
# --steps, which may extend or shorten the run (the LR schedule's length changes with it).
RUN_DEFAULTS = {"steps": 200, "batch_size": None, "seq_len": None, "lr": None, "min_lr": None, "warmup": None,
                "weight_decay": 0.1, "grad_clip": 1.0, "dropout": 0.0, "seed": 1337, "data": None}


def resolve_run_settings(args, resume_meta):
    """Fills the run settings of `args` from the checkpoint (on resume) or the defaults."""
    saved = (resume_meta or {}).get("train_args") or {}
    for key, default in RUN_DEFAULTS.items():
        value, before = getattr(args, key), saved.get(key)
        if value is None:
            setattr(args, key, before if resume_meta is not None and key in saved else default)
        elif resume_meta is not None and key in saved and before is not None and value != before and key != "steps":
            flag = "--" + key.replace("_", "-")
            raise cutp.ConfigError(f"{flag} {value} differs from the resumed run's {before}; a resumed run continues "
                                   f"the same training: omit {flag}")


def saved_preset(meta, device):
    return ((meta.get("train_args") or {}).get("preset")) or ("gpt2" if device == "cuda" else "tiny")


def choose_tp(world: int, local: int, config: GPTConfig, device: str) -> int:
    """Largest tp that fits in a node (at most 8 GPUs, 4 CPU ranks so the CPU keeps some DP),
    divides the world and satisfies the model's shape rules."""
    for tp in range(min(world, local, 8 if device == "cuda" else 4), 0, -1):
        if world % tp:
            continue
        try:
            config.validate(tp)
            return tp
        except cutp.ConfigError:
            continue
    return 1


class Stopper:
    """Turns SIGTERM/SIGINT into a request to stop after the current step (agreed by all ranks)."""

    def __init__(self, enabled: bool):
        self.requested = False
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.requested = True

    def agreed(self, ctx) -> bool:
        from mpi4py import MPI

        flag = np.array([1 if self.requested else 0], np.int32)
        with ctx.watchdog.guard("the end-of-step stop check (host all-reduce on world)"):
            ctx.world.mpi_comm.Allreduce(MPI.IN_PLACE, [flag, MPI.INT32_T], op=MPI.MAX)
        return bool(flag[0])


def main(argv=None):
    args = parse_args(argv)
    from mpi4py import MPI

    from cutp.runtime.failure import errors_raised_on_every_rank, install_abort_on_error
    from cutp.runtime.watchdog import check_timeout, configure_host_watchdog

    install_abort_on_error()  # an error on any rank ends the whole job, with that rank's traceback
    world = MPI.COMM_WORLD
    local_ranks = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank).Get_size()

    # ---- configuration (validated on every rank before any allocation) ------------------------
    # the same command line on every rank first: a flag given to some ranks only is named as such
    check_same_on_all_ranks(world, vars(args), "command line")
    # An error in these checks, on any rank, is raised on every rank (so the job ends at once,
    # with one traceback, whether every rank or only one node sees the problem).
    with errors_raised_on_every_rank(world):
        if args.collective_timeout is not None:
            check_timeout(args.collective_timeout, "--collective-timeout")
        device = cutp.runtime.backend.resolve_device(args.device)
        resume_meta = None
        if args.resume:
            resume_dir = checkpoint.resolve_checkpoint(args.resume)
            resume_meta = checkpoint.read_meta(resume_dir)
        resolve_run_settings(args, resume_meta)
        if resume_meta is not None:
            config = GPTConfig.from_dict({**resume_meta["config"], "dropout": args.dropout})
            if args.preset or args.dtype or args.set:  # the same command line again: it must describe this model
                asked = GPTConfig.preset(args.preset or saved_preset(resume_meta, device), dtype=args.dtype or config.dtype,
                                         dropout=args.dropout).with_overrides(args.set)
                diff = [f"{k}: checkpoint {getattr(config, k)!r}, flags {getattr(asked, k)!r}"
                        for k in checkpoint.ARCH_FIELDS + ("dtype",) if getattr(config, k) != getattr(asked, k)]
                if diff:
                    raise cutp.ConfigError("--preset/--set/--dtype describe another model than the checkpoint: "
                                           + "; ".join(diff) + ". Omit them when resuming.")
        else:
            preset = args.preset or ("gpt2" if device == "cuda" else "tiny")
            config = GPTConfig.preset(preset, dtype=args.dtype or "float32", dropout=args.dropout).with_overrides(args.set)
        dataset = load_dataset(args.data)
        if dataset.vocab_size > config.vocab_size:
            raise cutp.ConfigError(f"the data has token ids up to {dataset.vocab_size - 1} but the model's vocabulary is "
                                   f"{config.vocab_size}; use a model with vocab_size >= {dataset.vocab_size}")
        tp = args.tp or choose_tp(world.size, local_ranks, config, device)
        config.validate(tp)
        seq_len = args.seq_len or (min(config.block_size, 256) if device == "cpu" else config.block_size)
        if seq_len > config.block_size:
            raise cutp.ConfigError(f"--seq-len {seq_len} exceeds the model's block_size {config.block_size}")
    # every rank must run the same thing: compare before anything is allocated
    # and the same derived settings (a stale `latest` read on one node would load another step)
    check_same_on_all_ranks(world, {"model": config.to_dict(), "tp": tp, "device": device, "run": vars(args),
                                    "data": dataset.description,
                                    "resume": resume_meta and {"dir": resume_dir, "step": resume_meta.get("step")}},
                            "training configuration")
    if args.collective_timeout is not None:  # after setup: ranks may finish reading the data far apart
        configure_host_watchdog(args.collective_timeout)
    args.seq_len = seq_len  # resolved values go back into args: the checkpoint records them, a resume repeats them
    ctx = cutp.init(tp=tp, dp=args.dp, device=device, collective_timeout=args.collective_timeout)
    args.batch_size = batch = args.batch_size or -(-8 // ctx.dp_size) * ctx.dp_size
    micro = args.micro_batch_size or batch // ctx.dp_size
    sampler = BatchSampler(dataset, seq_len, batch, ctx.dp_size, ctx.dp_rank, micro, seed=args.seed)
    blas = set_blas_threads(threads_per_rank(local_ranks)) if device == "cpu" else "GPU"
    args.lr = lr = args.lr or (1e-3 if config.n_embd <= 256 else 6e-4)
    args.warmup = warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    log = print if (ctx.rank == 0 and not args.quiet) else (lambda *a, **k: None)
    warn = (lambda msg: print(f"warning: {msg}", file=sys.stderr, flush=True)) if ctx.rank == 0 else (lambda msg: None)

    # ---- model, optimizer, state -------------------------------------------------------------
    model = GPT(ctx, config, seed=args.seed, init=not args.resume)  # resumed weights are loaded next
    flat = FlatParameters(model.parameters())
    optimizer = AdamW(flat, lr=lr, weight_decay=args.weight_decay)
    start_step = 0
    if args.resume:
        meta = checkpoint.load_checkpoint(resume_dir, model, optimizer)
        start_step = int(meta["step"])
        if meta.get("rng"):
            model.rng.load_state_dict(meta["rng"])
    params = model.parameters()
    tokens_per_step = batch * seq_len
    log(f"cutp {cutp.__version__} | {ctx.describe()} | {blas}")
    model_name = (f"resumed from {resume_dir}" if args.resume else
                  f"preset {args.preset or ('gpt2' if device == 'cuda' else 'tiny')}" + (f" with {args.set}" if args.set else ""))
    log(f"model: {model_name}: {json.dumps(config.to_dict())}")
    log(f"parameters: {config.num_parameters():,} total, {model.num_parameters_local():,} on this rank "
        f"(vocab padded to {model.padded_vocab}) | data: {dataset.description}")
    log(f"batch {batch} x {seq_len} tokens = {tokens_per_step:,} tokens/step | micro-batch {micro}, "
        f"accumulation {sampler.accum_steps} | lr {lr:g} warmup {warmup} | steps {start_step}..{args.steps}")

    stopper = Stopper(args.save_on_signal)
    if args.save_on_signal and not args.out:
        log("note: no --out: a SIGTERM/SIGINT stops the run after the current step without a checkpoint")
    metrics_file = None
    if args.metrics and ctx.rank == 0:
        if args.resume:  # drop rows of steps after the checkpoint (a crashed run logged them): they re-run now
            keep_rows = []
            if os.path.exists(args.metrics):
                with open(args.metrics) as f:
                    keep_rows = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= start_step]
            with open(args.metrics + ".tmp", "w") as f:
                f.writelines(keep_rows)
            os.replace(args.metrics + ".tmp", args.metrics)
        metrics_file = open(args.metrics, "a" if args.resume else "w")
    history, skips, step = [], 0, start_step
    end_step = args.steps if args.run_steps is None else min(args.steps, start_step + args.run_steps)
    # fault injection for the reliability tests: a NaN in one gradient on one rank at one step
    nan_step = int(os.environ.get("CUTP_FAULT_NAN_STEP", "0"))
    nan_rank = int(os.environ.get("CUTP_FAULT_NAN_RANK", "0"))
    nan_param = model.named_parameters()[os.environ.get("CUTP_FAULT_NAN_PARAM", params[0].name)]
    last_saved = start_step if args.resume else None

    def save(step_done):
        nonlocal last_saved
        if args.out and last_saved != step_done:
            path = checkpoint.save_checkpoint(
                args.out, step_done, model, optimizer, rng_state=model.rng.state_dict(),
                data_state=sampler.state(step_done), train_args=vars(args), keep=args.keep)
            last_saved = step_done
            log(f"saved {path}")

    def evaluate():
        model.eval()
        losses = []
        for i in range(args.eval_batches):
            for x, y in sampler.micro_batches(i, "val"):
                model.check_inputs(x, y)
                losses.append(model.forward(ctx.asarray(x), ctx.asarray(y), check=False))
        model.train()
        v = np.array([sum(losses) / len(losses)])
        with ctx.watchdog.guard("the validation-loss average (host all-reduce on dp)"):
            ctx.dp.mpi_comm.Allreduce(MPI.IN_PLACE, v)
        return float(v[0]) / ctx.dp_size

    # ---- the loop ------------------------------------------------------------------------------
    while step < end_step:
        t0 = time.perf_counter()
        bytes0 = ctx.counter.bytes()
        flat.zero_grad()
        loss_sum = 0.0
        for x, y in sampler.micro_batches(step):
            model.check_inputs(x, y)  # on the host arrays: no device round trip
            loss_sum += model.forward(ctx.asarray(x), ctx.asarray(y), check=False)
            model.backward(1.0 / sampler.accum_steps)
        if step + 1 == nan_step and ctx.rank == nan_rank:
            nan_param.grad.reshape(-1)[0] = float("nan")
        finish_grad_sync(params, ctx, flat)
        norm = global_grad_norm(params, ctx)
        loss = np.array([loss_sum / sampler.accum_steps])
        with ctx.watchdog.guard("the loss average (host all-reduce on dp)"):
            ctx.dp.mpi_comm.Allreduce(MPI.IN_PLACE, loss)
        loss = float(loss[0]) / ctx.dp_size
        step_lr = lr_schedule(step, lr, warmup, args.steps, args.min_lr)
        skipped = not (math.isfinite(loss) and math.isfinite(norm))
        if not skipped:
            optimizer.step(step_lr, grad_scale=clip_scale(norm, args.grad_clip))
            skips = 0
        else:
            skips += 1
            warn(f"step {step + 1}: non-finite loss {loss} or grad norm {norm}: step skipped "
                 f"({skips} in a row; the run stops at {args.max_skips})")
            if skips >= args.max_skips:
                raise FloatingPointError(f"{skips} consecutive non-finite steps; stopping (lower --lr?)")
        if ctx.device == "cuda":
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        ms = (time.perf_counter() - t0) * 1000
        step += 1
        rec = {"step": step, "loss": loss, "lr": step_lr, "grad_norm": norm, "ms": ms,
               "tokens_per_s": tokens_per_step / (ms / 1000), "comm_mb": (ctx.counter.bytes() - bytes0) / 1e6}
        if skipped:
            rec["skipped"] = True
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            rec["val_loss"] = evaluate()
        history.append(rec)
        if metrics_file:
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
        if step % args.log_every == 0 or "val_loss" in rec:
            log(f"step {step:5d} | loss {loss:.4f} | lr {step_lr:.2e} | norm {norm:.3f} | {ms:7.1f} ms | "
                f"{rec['tokens_per_s']:9,.0f} tok/s | comm {rec['comm_mb']:.2f} MB"
                + (f" | val {rec['val_loss']:.4f}" if "val_loss" in rec else ""))
        if args.save_every and step % args.save_every == 0:
            save(step)
        if stopper.agreed(ctx):
            if ctx.rank == 0:  # said even with --quiet: the run ends early on purpose
                print(f"signal received: stopping after step {step}"
                      + (", writing a checkpoint" if args.out else " (no --out: no checkpoint)"), flush=True)
            break
    save(step)
    if metrics_file:
        metrics_file.close()
    ctx.close()
    return history


if __name__ == "__main__":
    main()
