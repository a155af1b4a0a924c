"""`python -m cutp plan [options]` (also `python -m cutp bench plan`): memory and communication per
GPU for a model and a layout, from the model's shape, no hardware needed.

    python -m cutp plan --params 70B --tp 8                    # memory and communication per GPU
    python -m cutp plan --params 70B --tp 8 --pp 4 --accum 8   # memory per pipeline stage, p2p, bubble
    python -m cutp plan --params 70B --search --gpu-memory 80  # the TP x PP x DP layouts that fit
    python -m cutp plan --params 8B --seq-len 131072 --tp 8 --cp 8 --recompute full  # long context
    python -m cutp plan --preset gpt2 --tp 2 --micro-batch 8 --seq-len 1024 --device cpu
"""
from __future__ import annotations

import argparse
import sys

from ..runtime.errors import ConfigError, settings_named
from . import layout, overlap, pipeline, search


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", help="model size, e.g. 7B, 13B, 70B, 175B (a standard architecture of that size)")
    p.add_argument("--preset", help="a cutp preset instead (gpt2, gpt2-xl, ...), planned exactly as cutp trains it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override an architecture field")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallelism: the experts split over ep of the DP ranks")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallelism: each sequence split over cp ranks (seq-len / cp tokens per rank)")
    p.add_argument("--cp-comm", default="ring", choices=["ring", "a2a"],
                   help="context parallelism's attention: ring (K,V round the CP ranks) or a2a (Ulysses)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--accum", type=int, default=None,
                   help="micro-batches per optimizer step (and DP rank; default 1, with --pp: pp)")
    p.add_argument("--dtype", default=None, choices=list(layout.DTYPES),
                   help="parameter dtype (default bfloat16: fp32 gradients, master weights and Adam moments)")
    p.add_argument("--precision", default=None, choices=sorted(layout.PRECISION_DTYPE),
                   help="older name: mixed = --dtype bfloat16, fp32 = --dtype float32")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="optimizer state (and fp32 master weights) sharded over the DP ranks (ZeRO-1)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="whose activations a cutp preset plans (default cuda: the GPU code path)")
    p.add_argument("--threads", type=int, default=1, help="--device cpu: the ops' threads per rank")
    p.add_argument("--recompute", default="none", choices=list(layout.RECOMPUTE),
                   help="activation recomputation (selective: the core attention; full: whole layers)")
    p.add_argument("--recompute-layers", type=int, default=None, help="with --recompute full: the first N layers")
    p.add_argument("--sequence-parallel", action="store_true", help="activations split along the sequence over TP")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages: memory per stage, p2p bytes, bubble")
    p.add_argument("--pp-layers", default=None, help="layers of each stage, e.g. 5,6,6,5 (default: even)")
    p.add_argument("--pp-schedule", default=None, choices=list(pipeline.SCHEDULES),
                   help="default 1f1b (interleaved with --pp-virtual)")
    p.add_argument("--pp-virtual", type=int, default=1, help="model chunks per rank (the interleaved schedule)")
    p.add_argument("--search", action="store_true",
                   help="list the TP x PP x DP layouts of up to --gpus GPUs that fit (--params models; with "
                        "--cp N: x CP, the powers of two up to N that training takes, --cp-comm's attention)")
    p.add_argument("--gpus", type=int, default=64, help="--search: at most this many GPUs (default 64)")
    p.add_argument("--gpu-memory", type=float, action="append", default=None, metavar="GB",
                   help="--search: GB per GPU (repeatable; default 80 and 141)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="--search: sequences per step (default: 4M tokens, Llama-2's)")
    p.add_argument("--markdown", action="store_true", help="--search: print the layouts as a Markdown table")
    p.add_argument("--link-bandwidth", type=float, default=None, metavar="GB/s",
                   help="the DP link: expected exposed gradient reduction (cutp.plan.overlap)")
    p.add_argument("--link-latency", type=float, default=5.0, metavar="us", help="the DP link's latency")
    p.add_argument("--device-tflops", type=float, default=None, metavar="T",
                   help="with --link-bandwidth: the throughput a layer's FLOPs run at")
    p.add_argument("--bucket-size", type=int, default=None, help="elements per DP gradient bucket "
                   "(default max(40M, 1M x dp))")


# the planner's flags for the run settings a plan's errors name (the rest: --the-field-name)
FLAGS = {"micro_batch_size": "--micro-batch", "batch_size": "--micro-batch x --accum x --dp"}


def flag_of(field: str) -> str:
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def run(args):
    """Plans what args describe; returns its Report (its errors name this command's flags)."""
    with settings_named(flag_of):
        return _run(args)


def _run(args):
    overlap.check_args(args)
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
