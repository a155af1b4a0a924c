"""`make coverage`'s runner: the test suite under coverage in parts, each resumable.

    python tools/coverage_run.py out/coverage [--fresh] [--parts device_path ops ...] [--list]

The suite is cut into parts (each directory of tests/, and the top-level test files together),
each run by its own pytest with the device-path tests included (``-m "device_path or not
device_path"``) and coverage started in every Python process, MPI ranks included
(``$COVERAGE_PROCESS_START``; tests/device_path/shim/sitecustomize.py starts it). A part's data go
to OUT/parts/NAME; a part that finished leaves OUT/parts/NAME/done (its exit status and time), and
a later run skips it: an interrupted `make coverage` resumes where it stopped (`--fresh` starts
over). tools/coverage_report.py combines every part's data.

Tests that start a process with ``PYTHONPATH`` set to the checkout alone (the CLI's and the
failure paths' tests) drop the shim's directory; for the run, a ``sitecustomize.py`` at the
checkout's root (`ROOT_HOOK`, git-ignored, removed at the end) loads the shim there too.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
SHIM = os.path.join(TESTS, "device_path", "shim")
TOP = "top"  # the test files directly in tests/
FINISHED = (0, 1, 5)  # pytest's exit statuses of a run that went through (5: nothing collected)
ROOT_HOOK = os.path.join(ROOT, "sitecustomize.py")
ROOT_HOOK_TEXT = '''# Written by tools/coverage_run.py for the run of `make coverage`, removed after it (git-ignored):
# a test process whose PYTHONPATH is the checkout alone loads the coverage shim all the same.
import importlib.util
import os
import sys

if not getattr(sys, "_cutp_device_shim", False) and os.environ.get("COVERAGE_PROCESS_START"):
    _spec = importlib.util.spec_from_file_location("_cutp_device_shim", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "tests", "device_path", "shim", "sitecustomize.py"))
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def parts() -> dict[str, list[str]]:
    """{name: pytest paths}: the device-path tests first (the subject of the report), then the
    directories of tests/ that hold test files, then the top-level test files."""
    out: dict[str, list[str]] = {}
    for name in sorted(os.listdir(TESTS)):
        path = os.path.join(TESTS, name)
        if os.path.isdir(path) and any(f.startswith("test_") and f.endswith(".py") for _, _, fs in os.walk(path)
                                       for f in fs):
            out[name] = [os.path.join("tests", name)]
    top = sorted(f for f in os.listdir(TESTS) if f.startswith("test_") and f.endswith(".py"))
    if top:
        out[TOP] = [os.path.join("tests", f) for f in top]
    if "device_path" in out:
        out = {"device_path": out.pop("device_path"), **out}
    return out


def run_part(name: str, paths: list[str], out: str, extra: list[str]) -> dict:
    data = os.path.join(out, "parts", name)
    shutil.rmtree(data, ignore_errors=True)  # an interrupted earlier try's data
    os.makedirs(data)
    # CUTP_TEST_POOL=0: a pooled rank ends with os._exit, so coverage would never save its data.
    env = dict(os.environ, CUTP_TEST_POOL="0", COVERAGE_PROCESS_START=os.path.join(ROOT, "tools", "coverage.ini"), COV_ROOT=ROOT,
               COV_OUT=data, PYTHONPATH=os.pathsep.join(p for p in (SHIM, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths,
           "-m", "device_path or not device_path", *extra]
    print(f"[coverage] {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    done = {"part": name, "rc": rc, "seconds": round(time.time() - start, 1)}
    print(f"[coverage] {name}: exit {rc} in {done['seconds']} s", flush=True)
    if rc not in FINISHED:
        return done  # interrupted or not run: tried again next time
    with open(os.path.join(data, "done"), "w") as f:
        json.dump(done, f)
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="out/coverage")
    ap.add_argument("--parts", nargs="*", help="only these parts, in this order (names as --list prints them)")
    ap.add_argument("--fresh", action="store_true", help="forget the parts already done")
    ap.add_argument("--list", action="store_true", help="print the parts and whether each is done")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]  # after --: passed to every pytest
    out = os.path.abspath(args.out)
    table = parts()
    unknown = sorted(set(args.parts or ()) - set(table))
    if unknown:
        print(f"coverage_run: no part named {', '.join(unknown)}; the parts are {', '.join(table)}")
        return 2
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    chosen = args.parts or list(table)  # (in the order given)
    if args.list:
        for n in table:
            marker = os.path.join(out, "parts", n, "done")
            print(f"{n:16s} {'done ' + open(marker).read() if os.path.exists(marker) else 'to run'}")
        return 0
    failed = []
    if os.path.exists(ROOT_HOOK) and open(ROOT_HOOK).read() != ROOT_HOOK_TEXT:
        print(f"coverage_run: {ROOT_HOOK} exists and is not this tool's; move it away first")
        return 2
    with open(ROOT_HOOK, "w") as f:
        f.write(ROOT_HOOK_TEXT)
    try:
        for n in chosen:
            marker = os.path.join(out, "parts", n, "done")
            if os.path.exists(marker):
                print(f"[coverage] {n}: done before, kept ({marker})", flush=True)
                continue
            if run_part(n, table[n], out, extra)["rc"] != 0:
                failed.append(n)
    finally:
        os.remove(ROOT_HOOK)
    if failed:
        print(f"[coverage] parts with failing tests (their lines are still counted; exit 2-4: not finished, run again): {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
