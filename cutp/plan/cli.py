"""`python -m cutp plan [options]` (also `python -m cutp bench plan`): memory and communication per
GPU for a model and a layout, from the model's shape, no hardware needed.

    python -m cutp plan --params 70B --tp 8                    # memory and communication per GPU
    python -m cutp plan --params 70B --tp 8 --pp 4 --accum 8   # memory per pipeline stage, p2p, bubble
    python -m cutp plan --params 70B --search --gpu-memory 80  # the TP x PP x DP layouts that fit
    python -m cutp plan --params 8B --seq-len 131072 --tp 8 --cp 8 --recompute full  # long context
    python -m cutp plan --preset gpt2 --tp 2 --micro-batch-size 8 --seq-len 1024 --device cpu
    python -m cutp plan --params 8B --tp 1 --dp 8 --zero 3 --seq-len 8192 --micro-batch-size 2  # FSDP
    python -m cutp plan --preset llama3-8b --tp 2 --lora-rank 16 --lora-alpha 32 --seq-len 4096  # LoRA
"""
from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from ..runtime.errors import ConfigError, settings_named
from ..bench.output import check_writable
from ..train.config import add_setting_flags
from ..train.defaults import default_micro_batch
from ..train.overlap import check_overlap
from ..train.zero import check_one_stage, check_zero
from . import finetune, layout, overlap, pipeline, search


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", help="model size: one of " + ", ".join(layout.ARCHITECTURES) + " (Llama 2 and 3's, "
                   "GPT-3's architecture of that size; any other model: --preset)")
    # the training settings a plan takes: declared once in cutp.train.config (train_gpt.py's flags, same names
    # and meanings: --batch-size the global sequences per step, --dtype the parameters', --device where the
    # planned run computes), with the planner's defaults (bfloat16, cuda, --search: 4M tokens a step)
    add_setting_flags(p, {"preset": None, "set": [], "tp": 8, "dp": 1, "ep": 1, "cp": 1, "cp_comm": "ring",
                          "micro_batch_size": None, "seq_len": None, "distributed_optimizer": False, "zero": 0,
                          "reshard_after_forward": True, "dp_replicate": 1, "recompute": "none",
                          "recompute_layers": None, "sequence_parallel": False, "pp": 1, "pp_layers": None,
                          "pp_schedule": None, "pp_virtual": 1, "link_bandwidth": None, "link_latency": 5.0,
                          "bucket_size": None, "overlap_param_gather": False, "dtype": None, "device": "cuda", "batch_size": None,
                          **finetune.DEFAULTS},  # (what trains: --freeze, --lora-*)
                      aliases={"micro_batch_size": ("--micro-batch",)})  # (the planner's older spelling)
    _state_defaults(p, PLANNER_DEFAULTS)
    p.add_argument("--accum", type=int, default=None,
                   help="micro-batches per optimizer step (and DP rank; default 1, with --pp: pp)")
    p.add_argument("--precision", default=None, choices=sorted(layout.PRECISION_DTYPE),
                   help="older name: mixed = --dtype bfloat16, fp32 = --dtype float32")
    p.add_argument("--threads", type=int, default=1, help="--device cpu: the ops' threads per rank")
    p.add_argument("--search", action="store_true",
                   help="list the TP x PP x DP layouts of up to --gpus GPUs that fit (--params models; with "
                        "--cp N: x CP, the powers of two up to N that training takes, --cp-comm's attention)")
    p.add_argument("--gpus", type=int, default=64, help="--search: at most this many GPUs (default 64)")
    p.add_argument("--gpu-memory", type=float, action="append", default=None, metavar="GB",
                   help="--search: GB per GPU (repeatable; default 80 and 141)")
    p.add_argument("--markdown", action="store_true", help="--search: print the layouts as a Markdown table")
    p.add_argument("--device-tflops", type=float, default=None, metavar="T",
                   help="with --link-bandwidth: the throughput a layer's FLOPs run at")


# the defaults the planner derives itself where training's --help text would say training's (a user
# who copied a float32 training command got a bfloat16 plan, with --help saying float32)
PLANNER_DEFAULTS = {
    "preset": "--params 70B's Llama-2-70B when neither is given",
    "dtype": "bfloat16, training's with fp32 master weights; training's own default is float32",
    "batch_size": "--micro-batch-size x --accum x --dp; --search: 4M tokens a step (Llama 2's)",
    "micro_batch_size": "with --batch-size, training's: the per-DP batch at once (with --pp, the largest that "
                        "gives the schedule its micro-batches; with --accum, batch / (dp x accum)); else, and "
                        "with --search, 1",
    "seq_len": "the model's block size",
}


def _state_defaults(parser, defaults: dict) -> None:
    """Replaces the "(default: ...)" of each named setting's --help line (declared once, with
    training's) by this command's."""
    for action in parser._actions:
        if action.dest in defaults and action.help and " (default: " in action.help:
            action.help = action.help.rsplit(" (default: ", 1)[0] + f" (default: {defaults[action.dest]})"


# the planner's flags for the run settings a plan's errors name (the rest: --the-field-name)
FLAGS = {"batch_size": "--micro-batch-size x --accum x --dp"}


def flag_of(field: str) -> str:
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def micro_batch_size(args) -> int:
    """--micro-batch-size, or what training runs when it is not given: with --batch-size, the
    per-DP batch at once (with a pipeline, the largest micro-batch that gives the schedule its
    micro-batches: cutp.train.defaults.default_micro_batch), with --accum too, the batch /
    (dp x accum) that makes them agree; else (and for --search, which picks per layout) 1. A
    batch these do not divide keeps 1, so that micro_batches' refusal names the fix."""
    if args.micro_batch_size is not None:
        return args.micro_batch_size
    batch = args.batch_size
    if batch is None or args.search or not isinstance(batch, int) or batch < 1 or args.dp < 1 or batch % args.dp:
        return 1
    per_rank = batch // args.dp
    if args.accum is not None:
        return per_rank // args.accum if args.accum >= 1 and per_rank % args.accum == 0 else 1
    virtual = args.pp_virtual or 1
    schedule = args.pp_schedule or ("interleaved" if virtual > 1 else "1f1b")
    return default_micro_batch(per_rank, args.pp, schedule)


def run(args):
    """Plans what args describe; returns its Report (its errors name this command's flags)."""
    # training's micro-batch when none is given (a plan of micro-batch 1 for a run of the whole batch
    # at once under-predicted its activations by the batch's factor)
    args.micro_batch_size = args.micro_batch = micro_batch_size(args)  # (micro_batch: the planner modules' name)
    # the planner's own defaults of the shared settings: a GPU run (auto plans the GPU path), bfloat16
    # (layout.resolve_dtype), the search's global batch 4M tokens (Llama 2's) when not given
    if args.device == "auto":
        args.device = "cuda"
    with settings_named(flag_of):
        return _run(args)


def _run(args):
    overlap.check_args(args)
    # numbers no plan can take, refused by name (--seq-len 0 planned the block size)
    for name in ("seq_len", "batch_size", "accum"):
        if getattr(args, name, None) is not None:
            layout.check_positive(name, getattr(args, name))
    if args.markdown and not args.search:
        raise ConfigError("--markdown prints --search's table of layouts; add --search, or omit --markdown")
    # training's refusals of these ZeRO settings, in its words (cutp.train.zero, cutp.train.overlap);
    # HSDP's and resharding's have the planner's own checks (cutp.plan.layout.plan)
    check_one_stage(args.zero, args.distributed_optimizer)
    stage = max(args.zero, int(bool(args.distributed_optimizer)))
    settings = SimpleNamespace(zero=stage, distributed_optimizer=stage >= 1, reshard_after_forward=True,
                               dp_replicate=1, dp=args.dp, ep=1, overlap_param_gather=args.overlap_param_gather,
                               bucket_size=args.bucket_size)
    check_overlap(settings)
    check_zero(settings)
    if finetune.settings_of(args) and args.search:
        raise ConfigError("--search with --lora-rank or --freeze: the search plans full training only; plan the "
                          "fine-tuning layout it suggests without --search")
    if args.search:
        return search.run(args)
    if args.pp > 1 or args.pp_virtual > 1:
        return pipeline.run(args)
    args.accum = pipeline.micro_batches(args)
    return layout.run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutp plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no tables on stdout")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_writable(args.json, "--json", report=True)  # before the plan, not a traceback after it
        report = run(args)
    except ConfigError as e:  # a setting that cannot run: one line naming it and the fix
        print(f"python -m cutp plan: error: {e}", file=sys.stderr)
        return 2
    try:
        report.publish(args.json, args.quiet)
    except OSError as e:  # (checked above; the disk may still fill or the directory go)
        print(f"python -m cutp plan: error: cannot write the results: {e}", file=sys.stderr)
        return 2
    return 0
