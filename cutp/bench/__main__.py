"""`python -m cutp bench <suite> [options]`: cutp's benchmark suites.

    python -m cutp bench kernels                     # memory-bound ops: time, GB/s, % of copy bandwidth;
                                                     # attention: TFLOP/s, speed-up over the unfused path
    mpiexec -n 2 python -m cutp bench comm           # collectives: time, algbw, busbw (nccl-tests' definitions)
    python -m cutp bench model --preset tiny         # a training step: tokens/s, phases, FLOP/s or MFU, memory
    python -m cutp bench compare-torch               # cutp vs PyTorch eager on the CPU (needs torch)
    python -m cutp bench plan --params 70B --tp 8    # memory and communication per GPU, no hardware needed
    python -m cutp bench plan --params 70B --tp 8 --pp 4 --accum 8   # memory per pipeline stage, p2p, bubble
    python -m cutp bench plan --params 70B --search --gpu-memory 80  # the TP x PP x DP layouts that fit
    python -m cutp bench moe                         # grouped experts vs the dense SwiGLU MLP, one rank

Every suite prints tables; --json PATH writes them (and the raw measurements) for machines,
--plot PATH.png draws them for people. Under mpiexec only rank 0 prints and writes.
"""
from __future__ import annotations

import argparse
import sys

from mpi4py import MPI

from ..runtime import backend
from ..runtime.errors import ConfigError
from ..runtime.threads import available_cores
from ..train.config import add_setting_flags
from ..train.finetune import FINETUNE_DEFAULTS
from ..train.reporting import parse_size
from ..plan import cli as plan_cli
from . import comm, compare_torch, kernels, model
from . import moe as moe_bench
from .output import check_writable
from .plot import plot_report

SUITES = ("kernels", "comm", "model", "compare-torch", "plan", "moe")


def _common(p):
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG figure (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no tables on stdout")


def _size(text: str) -> int:
    """A message size as argparse's type: 4K, 256M, 1G or bytes (a refusal names the flag, one line)."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes or a number with K, M or G") from None


def _factor(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: each message size is the previous one times an integer >= 2")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cutp bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="suite", required=True, metavar="{" + ",".join(SUITES) + "}")

    k = sub.add_parser("kernels", help="memory-bound ops and attention per shape and dtype")
    k.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    k.add_argument("--ops", nargs="+", metavar="OP", help=f"subset of {', '.join(kernels.OPS)}, or the groups "
                   f"{', '.join(kernels.OP_GROUPS)}")
    k.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float64"])
    k.add_argument("--size", choices=sorted(kernels.SIZES), help="shape preset (default: cpu on the CPU, gpu on a GPU)")
    k.add_argument("--repeat", type=int, default=None, help="timed repeats (default 10 CPU, 30 GPU)")
    k.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2 CPU, 3 GPU)")
    k.add_argument("--min-time", type=float, default=0.1, help="CPU: keep repeating until this many seconds per case")
    k.add_argument("--copy-mib", type=int, default=256, help="buffer of the copy-bandwidth measurement")
    k.add_argument("--budget", type=float, default=None,
                   help="stop starting new cases after this many seconds (default: 60 on a GPU, none on the CPU; 0: none)")
    _common(k)

    c = sub.add_parser("comm", help="collectives over message sizes (run under mpiexec)")
    c.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    c.add_argument("--ops", nargs="+", choices=["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
    c.add_argument("--min-size", default="4K", type=_size, help="smallest message (default 4K)")
    c.add_argument("--max-size", default=None, type=_size, help="largest message (default 256M on GPUs, 16M on the CPU)")
    c.add_argument("--factor", type=_factor, default=None, help="size step (default 2 on GPUs, 4 on the CPU)")
    c.add_argument("--iters", type=int, default=None, help="timed calls per size (default: by size, 5..200)")
    c.add_argument("--warmup", type=int, default=3)
    c.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    _common(c)

    m = sub.add_parser("model", help="a training step (run under mpiexec -n tp*cp*dp*pp)")
    # the training settings: declared once in cutp.train.config (train_gpt.py's flags, same names and meanings;
    # --batch-size is the global batch), with this command's defaults
    add_setting_flags(m, {"preset": "tiny", "set": [], "tp": 1, "ep": 1, "pp": 1, "pp_schedule": None, "pp_virtual": None,
                          "pp_layers": None, "cp": 1, "cp_comm": "ring", "dp": None, "device": "auto",
                          "dtype": "float32", "allow_tf32": False, "distributed_optimizer": False, "zero": 0,
                          "reshard_after_forward": True, "dp_replicate": 1, "recompute": "none",
                          "sequence_parallel": False, "batch_size": None, "micro_batch_size": None, "seq_len": None,
                          "overlap_grad_reduce": False, "overlap_param_gather": False, "tp_comm_overlap": False,
                          "bucket_size": None, "link_bandwidth": None, "link_latency": 5.0, **FINETUNE_DEFAULTS})
    # the benchmark's own
    # (timed and untimed steps have names of their own: --steps and --warmup are a training run's
    # length and its learning-rate warmup, and are refused here by name)
    m.add_argument("--timed-steps", dest="steps", type=int, default=5, help="training steps measured (default 5)")
    m.add_argument("--untimed-steps", dest="warmup", type=int, default=2,
                   help="training steps run before measuring (default 2)")
    for flag, instead in (("--steps", "--timed-steps"), ("--warmup", "--untimed-steps")):
        m.add_argument(flag, action=_RenamedFlag, instead=instead, help=argparse.SUPPRESS)
    m.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks per node)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--no-comm-timing", action="store_true", help="do not wrap the communicators")
    _common(m)

    t = sub.add_parser("compare-torch", help="cutp vs PyTorch eager, CPU float32 (needs torch)")
    t.add_argument("--presets", nargs="+", default=["tiny", "gpt2"])
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    t.add_argument("--batch-size", type=int, default=None, help="default: 16 (tiny), 4 (gpt2)")
    t.add_argument("--seq-len", type=int, default=None, help="default: 128 (tiny), 256 (gpt2)")
    t.add_argument("--threads", type=int, default=None, help="threads for both (default: the cores)")
    t.add_argument("--repeat", type=int, default=5)
    t.add_argument("--warmup", type=int, default=1)
    t.add_argument("--torch-attention", default="sdpa", choices=["sdpa", "manual"],
                   help="sdpa: F.scaled_dot_product_attention (nanoGPT's default); manual: masked softmax")
    t.add_argument("--check-only", action="store_true", help="only check that both compute the same loss and grads")
    t.add_argument("--gap", type=float, default=0.01, help="seconds of pause before each timed step")
    t.add_argument("--profile-repeats", type=int, default=1, metavar="N",
                   help="profiled steps of each after the timed ones, for the GEMM / rest split (medians; "
                        "0: none)")
    _common(t)

    pl = sub.add_parser("plan", help="memory and communication per GPU, from the model's shape")
    plan_cli.add_arguments(pl)
    _common(pl)

    mo = sub.add_parser("moe", help="the grouped expert path against the dense SwiGLU MLP, one rank")
    moe_bench.add_arguments(mo)
    _common(mo)
    return p


class _RenamedFlag(argparse.Action):
    """A training flag whose meaning this command does not have: refused, naming the one it has."""

    def __init__(self, option_strings, dest, instead, **kw):
        super().__init__(option_strings, dest, nargs=1, **kw)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is a training run's setting; bench model measures {self.instead} N steps")


# each suite's numbers and the least each may be (None: not given, the suite's default), refused
# before any work: --timed-steps 0 raised IndexError after the warm-up, --iters -3 printed negative
# bandwidths, --tokens 0 divided by zero, --repeat 0 had no median
AT_LEAST = {
    "kernels": (("repeat", "--repeat", 1), ("warmup", "--warmup", 0), ("min_time", "--min-time", 0),
                ("copy_mib", "--copy-mib", 1), ("budget", "--budget", 0)),
    "comm": (("min_size", "--min-size", 1), ("max_size", "--max-size", 1), ("iters", "--iters", 1),
             ("warmup", "--warmup", 0)),
    "model": (("steps", "--timed-steps", 1), ("warmup", "--untimed-steps", 0), ("batch_size", "--batch-size", 1),
              ("micro_batch_size", "--micro-batch-size", 1), ("seq_len", "--seq-len", 1), ("threads", "--threads", 1)),
    "compare-torch": (("repeat", "--repeat", 1), ("warmup", "--warmup", 0), ("batch_size", "--batch-size", 1),
                      ("seq_len", "--seq-len", 1), ("threads", "--threads", 1), ("gap", "--gap", 0),
                      ("profile_repeats", "--profile-repeats", 0)),
    "moe": (("tokens", "--tokens", 1), ("hidden", "--hidden", 1), ("experts", "--experts", 1),
            ("expert_width", "--expert-width", 1), ("top_k", "--top-k", 1), ("repeat", "--repeat", 1)),
}


def check_numbers(args) -> None:
    """ConfigError naming the first number of args.suite below what it can take, and the fix."""
    for dest, flag, low in AT_LEAST.get(args.suite, ()):
        value = getattr(args, dest, None)
        if value is not None and value < low:
            raise ConfigError(f"{flag} {value:g} is below {low}: give {flag} {low} or more, or omit it for the "
                              "default")
    if args.suite == "comm" and args.max_size is not None and args.max_size < args.min_size:
        raise ConfigError(f"--max-size {args.max_size:,} B is below --min-size {args.min_size:,} B: no message "
                          "size between them; give --max-size >= --min-size")
    if args.suite == "moe" and args.top_k > args.experts:
        raise ConfigError(f"--top-k {args.top_k} is more than --experts {args.experts}: each token picks top_k "
                          f"different experts; give --top-k <= {args.experts}")


def run(args):
    """Runs one suite; returns its Report (on every rank)."""
    check_numbers(args)
    if args.suite == "kernels":
        gpu = args.device == "cuda" or (args.device == "auto" and _gpu_default())
        args.repeat = args.repeat or (30 if gpu else 10)
        args.warmup = args.warmup if args.warmup is not None else (3 if gpu else 2)
        args.budget = args.budget if args.budget is not None else (60.0 if gpu else 0.0)
        args.keep_freed_memory = True  # glibc keeps freed memory: the ops are measured, not page faults
        return kernels.run(args)
    if args.suite == "comm":
        return comm.run(args)
    if args.suite == "model":
        return model.run(args)
    if args.suite == "moe":
        return moe_bench.run(args)
    if args.suite == "compare-torch":
        args.threads = args.threads or available_cores()
        return compare_torch.run(args)
    return plan_cli.run(args)


def _gpu_default() -> bool:
    return backend.resolve_device("auto") == "cuda"


def _is_rank0(report) -> bool:
    return int(report.extra.get("rank", 0)) == 0


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        # where the results go, before the work (every rank checks: each refuses alike, none waits alone)
        check_writable(args.json, "--json", report=True)
        check_writable(getattr(args, "plot", None), "--plot")
        report = run(args)
    except ConfigError as e:  # a setting that cannot run: one line naming it and the fix
        # every rank refuses alike (the checks above read only the command line; the suites raise on
        # every rank): rank 0 says it, once (two ranks' prints came out glued on one line)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"python -m cutp bench {args.suite}: error: {e}", file=sys.stderr, flush=True)
        return 2
    if not _is_rank0(report):
        return 0
    try:
        report.publish(args.json, args.quiet)
        if getattr(args, "plot", None):
            plot_report(report, args.plot)
            if not args.quiet:
                print(f"wrote {args.plot}")
    except OSError as e:  # (checked above; the disk may still fill or the directory go)
        print(f"python -m cutp bench {args.suite}: error: cannot write the results: {e}", file=sys.stderr)
        return 2
    if report.extra.get("disagree"):  # compare-torch: a failed check fails the command (make compare-torch)
        print(f"python -m cutp bench compare-torch: error: cutp and torch disagree on "
              f"{', '.join(report.extra['disagree'])} (see the notes)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
