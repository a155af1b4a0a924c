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
from ..train.config import add_setting_flags
from ..train.overlap import check_overlap
from ..train.zero import check_one_stage, check_zero
from . import finetune, layout, overlap, pipeline, search


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", help="model size, e.g. 7B, 13B, 70B, 175B (a standard architecture of that size)")
    # the training settings a plan takes: declared once in cutp.train.config (train_gpt.py's flags, same names
    # and meanings: --batch-size the global sequences per step, --dtype the parameters', --device where the
    # planned run computes), with the planner's defaults (bfloat16, cuda, --search: 4M tokens a step)
    add_setting_flags(p, {"preset": None, "set": [], "tp": 8, "dp": 1, "ep": 1, "cp": 1, "cp_comm": "ring",
                          "micro_batch_size": 1, "seq_len": None, "distributed_optimizer": False, "zero": 0,
                          "reshard_after_forward": True, "dp_replicate": 1, "recompute": "none",
                          "recompute_layers": None, "sequence_parallel": False, "pp": 1, "pp_layers": None,
                          "pp_schedule": None, "pp_virtual": 1, "link_bandwidth": None, "link_latency": 5.0,
                          "bucket_size": None, "overlap_param_gather": False, "dtype": None, "device": "cuda", "batch_size": None,
                          **finetune.DEFAULTS},  # (what trains: --freeze, --lora-*)
                      aliases={"micro_batch_size": ("--micro-batch",)})  # (the planner's older spelling)
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


# the planner's flags for the run settings a plan's errors name (the rest: --the-field-name)
FLAGS = {"batch_size": "--micro-batch-size x --accum x --dp"}


def flag_of(field: str) -> str:
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def run(args):
    """Plans what args describe; returns its Report (its errors name this command's flags)."""
    args.micro_batch = args.micro_batch_size  # (the planner's modules' name for it)
    # the planner's own defaults of the shared settings: a GPU run (auto plans the GPU path), bfloat16
    # (layout.resolve_dtype), the search's global batch 4M tokens (Llama 2's) when not given
    if args.device == "auto":
        args.device = "cuda"
    with settings_named(flag_of):
        return _run(args)


def _run(args):
    overlap.check_args(args)
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
        report = run(args)
    except ConfigError as e:  # a setting that cannot run: one line naming it and the fix
        print(f"python -m cutp plan: error: {e}", file=sys.stderr)
        return 2
    report.publish(args.json, args.quiet)
    return 0
