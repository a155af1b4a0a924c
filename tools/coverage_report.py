"""The report of `make coverage`: the Python lines of cutp/ and kernels/*.py that no test ran.

    python tools/coverage_report.py out/coverage

Combines the data files every process of every part wrote (tools/coverage_run.py: OUT/parts/NAME,
MPI ranks included), says which parts ran (and which did not yet), prints per file the lines never
executed (as ranges, with the function holding them), set apart: those of GPU_ONLY, code that
only a real GPU can run, each with its reason. The goal is nothing outside that list.
"""
from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (file, function): why only a real GPU runs it. Empty since session 11: every function that was
# here (cupy_status's no-GPU answers, find_mma_include's error, gpu_info, cupy_module_loader) now
# runs in the suite or on the stand-in (tests/device_path/test_device_edges.py); what only a real
# GPU can settle is behaviour, not lines (docs/device-path.md, "Not done yet").
GPU_ONLY: dict[tuple[str, str], str] = {}

# (file, function): (the first line excused, by its text; None: the whole body), why. Lines that run
# after the coverage data's last save in a process that MPI_Abort ends: MPICH's launcher kills
# every rank with SIGKILL, so no exit handler saves them (the shim saves before each call of
# tests/device_path/shim/sitecustomize.py ABORT_PATHS); they ran, and no measurement can say so.
AFTER_LAST_SAVE: dict[tuple[str, str], tuple[str | None, str]] = {
    ("cutp/runtime/failure.py", "end_job_together"): (None, "ends the job through MPI_Abort (rank 0) or waits to be "
                                                     "killed by the launcher (the others): its data are saved on entry"),
    ("cutp/runtime/abort.py", "abort_job"): ("MPI.COMM_WORLD.Abort(code)", "MPI_Abort ends every rank: saved just "
                                             "before (wait_for_output_to_drain)"),
}

# Files whose lines run only where an optional package CI does not install is importable: a run of
# `make coverage` without it reports them never executed (a note says which of them applies).
OPTIONAL_ONLY = {"cutp/bench/compare_torch.py": "torch"}


def _functions(path: str) -> list[tuple[int, int, str]]:
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.lineno, node.end_lineno or node.lineno, node.name))
    return out


def _owner(funcs, line):
    best = None
    for lo, hi, name in funcs:
        if lo <= line <= hi and (best is None or lo > best[0]):
            best = (lo, name)
    return best[1] if best else "<module>"


def _ranges(lines):
    out, start, prev = [], None, None
    for n in sorted(lines):
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            out.append((start, prev))
            start = prev = n
    if start is not None:
        out.append((start, prev))
    return out


def _after_last_save(path, rel, func, funcs, missing) -> list[int]:
    """The lines of `missing` in `func` that AFTER_LAST_SAVE excuses."""
    if (rel, func) not in AFTER_LAST_SAVE:
        return []
    marker = AFTER_LAST_SAVE[(rel, func)][0]
    lo, hi = next((a, b) for a, b, name in funcs if name == func)
    if marker is not None:
        with open(path) as f:
            text = f.read().splitlines()
        lo = next((n for n in range(lo, hi + 1) if marker in text[n - 1]), hi + 1)
    return [n for n in missing if lo <= n <= hi]


def main(out_dir: str) -> int:
    import coverage

    os.environ.setdefault("COV_ROOT", ROOT)
    os.environ["COV_OUT"] = os.path.abspath(out_dir)
    cov = coverage.Coverage(config_file=os.path.join(ROOT, "tools", "coverage.ini"))
    cov.erase()  # the combination of an earlier report; the parts keep their own data
    parts = sorted(glob.glob(os.path.join(out_dir, "parts", "*")))
    cov.combine(data_paths=parts, keep=True)
    cov.save()
    cov.load()
    print("parts (tools/coverage_run.py):")
    for part in parts:
        marker = os.path.join(part, "done")
        state = json.load(open(marker)) if os.path.exists(marker) else None
        print(f"  {os.path.basename(part):16s} " + (f"exit {state['rc']}, {state['seconds']} s" if state else
                                                    "NOT finished: its lines so far only"))
    total = missed = gpu_only = after_save = 0
    lines_out, after_out = [], []
    for path in sorted(cov.get_data().measured_files()):
        rel = os.path.relpath(path, ROOT)
        _, statements, _, missing, _ = cov.analysis2(path)
        total += len(statements)
        if not missing:
            continue
        funcs = _functions(path)
        by_func: dict[str, list[int]] = {}
        for n in missing:
            by_func.setdefault(_owner(funcs, n), []).append(n)
        for func, ns in by_func.items():
            excused = _after_last_save(path, rel, func, funcs, ns)
            if excused:
                after_save += len(excused)
                after_out.append(f"{rel} {func}: {', '.join(f'{a}' if a == b else f'{a}-{b}' for a, b in _ranges(excused))}"
                                 f" ({AFTER_LAST_SAVE[(rel, func)][1]})")
                ns = [n for n in ns if n not in excused]
                if not ns:
                    continue
            reason = GPU_ONLY.get((rel, func))
            where = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _ranges(ns))
            if reason:
                gpu_only += len(ns)
            else:
                missed += len(ns)
                lines_out.append(f"{rel} {func}: {where}")
    print(f"coverage of cutp/ and kernels/*.py: {total} statements; never executed: {missed} "
          f"(+ {gpu_only} that only a GPU runs, + {after_save} run after a process's last save)")
    print("\nnever executed (file, function: lines):")
    for line in lines_out:
        print("  " + line)
    print("\nrun after the last save of a process MPI_Abort ends (file, function: lines, why):")
    for line in after_out:
        print("  " + line)
    for f, package in OPTIONAL_ONLY.items():
        here = importlib.util.find_spec(package) is not None
        print(f"\nnote: {f} runs only with {package} installed (CI has not); {package} is "
              + ("installed here: its lines count as in this run, not as in CI's" if here else
                 "not installed here: its never-executed lines above are CI's too"))
    print("\nonly a real GPU runs (file, function: why):")
    for (f, fn), why in GPU_ONLY.items():
        print(f"  {f} {fn}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out/coverage"))
