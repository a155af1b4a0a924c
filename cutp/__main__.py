"""`python -m cutp COMMAND ...`: the command-line entry points, one line each in `COMMANDS`.

Each command's module is loaded only when that command runs: `info` must work where MPI or CUDA
is broken (it reports why), and the benchmark suites need both.
"""
import importlib
import sys

# name: (the module whose main(argv) runs it, what it does): `python -m cutp` lists them
COMMANDS = {
    "info": ("cutp.info", "the machine, the backends and what cutp can use on it"),
    "plan": ("cutp.plan.cli", "memory and time of a model and layout before running it"),
    "bench": ("cutp.bench.__main__", "benchmark suites: kernels, comm, model, plan, compare-torch"),
    "prepare-data": ("cutp.data.prepare", "text and JSONL files to token shards for --data DIR"),
    "verify-data": ("cutp.data.verify", "check a prepared directory's shards against their digests"),
    "export-hf": ("cutp.checkpoint.export_hf", "a run or checkpoint as a Hugging Face model directory, with its "
                  "tokenizer"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m cutp COMMAND [ARGS...]   (python -m cutp COMMAND --help: its arguments)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "training: mpiexec -n N python examples/train_gpt.py --help"]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    print(usage(), file=sys.stderr)
    print(f"\npython -m cutp: error: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
