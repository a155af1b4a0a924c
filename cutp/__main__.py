"""`python -m cutp info | bench ... | plan ... | prepare-data ... | export-hf ...`: the command-line entry points.

Each command's module is loaded only when that command runs: `info` must work where MPI or CUDA
is broken (it reports why), and the benchmark suites need both.
"""
import importlib
import sys

COMMANDS = {"info": "cutp.info", "bench": "cutp.bench.__main__", "plan": "cutp.plan.cli",
            "prepare-data": "cutp.data.prepare", "export-hf": "cutp.checkpoint.export_hf"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    print("usage: python -m cutp info | bench ... | plan ... | prepare-data ... | export-hf ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
