"""The device-path tests on one backend, and what differs between two runs of them.

    python tools/device_path_check.py run standin|gpu OUT [pytest args]  # OUT/junit.xml, OUT/figures.jsonl
    python tools/device_path_check.py diff A B                          # the summary, B against A
    python tools/device_path_check.py gpu OUT [pytest args]             # make gpu-check's part: both, then diff

`make test-device` runs them on the stand-in and keeps the results in out/device-path/standin;
`make gpu-check`, on a lent GPU, runs the same tests on the real CuPy (CUTP_DEVICE_PATH=gpu) into
out/device-path/gpu (the stand-in's run first, on that machine, when none is kept) and prints the
summary: each test id's outcome on both (passed / failed / skipped, with the reason of a failure
or a skip that only one has), and per case the figures both recorded (the losses, the gradient
norm, the largest gradient difference to the NumPy path, host syncs) side by side, with those only
one records (the stand-in's kernel, GEMM and NCCL counts) named. Exit status 1 when a test that
passed on A does not pass on B.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = {"standin": "stand-in", "gpu": "GPU"}


def run(backend: str, out: str, pytest_args: list[str]) -> int:
    """pytest -m device_path tests/device_path on `backend`, its results in `out`."""
    os.makedirs(out, exist_ok=True)
    figures = os.path.join(out, "figures.jsonl")
    if os.path.exists(figures):
        os.remove(figures)
    with open(os.path.join(out, "backend"), "w") as f:
        f.write(backend + "\n")
    env = dict(os.environ, CUTP_DEVICE_PATH=backend, CUTP_DEVICE_PATH_FIGURES=figures)
    if backend == "gpu":  # the tests' 2 and 4 ranks share the lent machine's GPU (NCCL >= 2.30)
        env.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "device_path", "tests/device_path",
           f"--junitxml={os.path.join(out, 'junit.xml')}", *pytest_args]
    return subprocess.call(cmd, cwd=ROOT, env=env)


def outcomes(out: str) -> dict[str, tuple[str, str]]:
    """{test id: (passed | failed | skipped, the first line of the failure's or skip's message)}."""
    found = {}
    for case in ET.parse(os.path.join(out, "junit.xml")).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        test_id = f"{path}.py::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = (node.get("message") or node.text or "").strip()
                message = text.splitlines()[0][:160] if text else ""
                break
        found[test_id] = (outcome, message)
    return found


def figures(out: str) -> dict[str, dict]:
    path = os.path.join(out, "figures.jsonl")
    if not os.path.exists(path):
        return {}
    got = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                got[rec.pop("case")] = rec
    return got


def _rel(a, b) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _side_by_side(a, b) -> str:
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and a:
        worst = max(_rel(x, y) for x, y in zip(a, b))
        return f"{a} | {b} (largest relative difference {worst:.1e})"
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return f"{a:.6g} | {b:.6g}" + (f" (relative difference {_rel(a, b):.1e})" if a != b else " (equal)")
    return f"{a} | {b}"


def summary(a_dir: str, b_dir: str) -> tuple[list[str], bool]:
    """(the summary's lines, whether B passed every test A passed)."""
    def name(d):
        path = os.path.join(d, "backend")
        return NAMES.get(open(path).read().strip(), d) if os.path.exists(path) else d

    na, nb = name(a_dir), name(b_dir)
    ra, rb = outcomes(a_dir), outcomes(b_dir)
    lines = [f"device-path tests: {nb} ({b_dir}) against {na} ({a_dir})"]
    same = [t for t in ra if t in rb and ra[t][0] == rb[t][0]]
    differ = [t for t in ra if t in rb and ra[t][0] != rb[t][0]]
    lines.append(f"  {len(set(ra) | set(rb))} test ids; same outcome {len(same)}; different {len(differ)}; "
                 f"only on {na} {len(set(ra) - set(rb))}; only on {nb} {len(set(rb) - set(ra))}")
    for who, r in ((na, ra), (nb, rb)):
        lines.append(f"  {who}: " + ", ".join(f"{sum(1 for o, _ in r.values() if o == k)} {k}"
                                              for k in ("passed", "failed", "skipped")))
    if differ:
        lines.append(f"different outcomes (test: {na} -> {nb}):")
        for t in differ:
            why = rb[t][1] or ra[t][1]
            lines.append(f"  {t}: {ra[t][0]} -> {rb[t][0]}" + (f"  [{why}]" if why else ""))
    for who, only in ((na, sorted(set(ra) - set(rb))), (nb, sorted(set(rb) - set(ra)))):
        if only:
            lines.append(f"only on {who}: " + ", ".join(only))
    fa, fb = figures(a_dir), figures(b_dir)
    if fa or fb:
        lines.append(f"figures (case: {na} | {nb}):")
        for case in [c for c in fa if c in fb]:
            lines.append(f"  {case}:")
            for key in [k for k in fa[case] if k in fb[case]]:
                lines.append(f"    {key}: {_side_by_side(fa[case][key], fb[case][key])}")
            for who, keys in ((na, [k for k in fa[case] if k not in fb[case]]),
                              (nb, [k for k in fb[case] if k not in fa[case]])):
                if keys:
                    lines.append(f"    only {who} records: " + ", ".join(keys))
        for who, cases in ((na, [c for c in fa if c not in fb]), (nb, [c for c in fb if c not in fa])):
            if cases:
                lines.append(f"  cases only {who} ran: " + "; ".join(cases))
    regressed = [t for t in ra if ra[t][0] == "passed" and rb.get(t, ("absent",))[0] != "passed"]
    lines.append("no test that passed on {} fails on {}".format(na, nb) if not regressed else
                 f"{len(regressed)} test(s) that passed on {na} do not pass on {nb}: " + ", ".join(regressed))
    return lines, not regressed


def gpu_check(out: str, pytest_args: list[str]) -> int:
    """The stand-in's run (unless OUT/standin holds one: make test-device's), the GPU's, the
    summary printed and written to OUT/summary.txt."""
    standin, gpu = os.path.join(out, "standin"), os.path.join(out, "gpu")
    if not os.path.exists(os.path.join(standin, "junit.xml")):
        run("standin", standin, pytest_args)
    run("gpu", gpu, pytest_args)
    lines, ok = summary(standin, gpu)
    print("\n".join(lines))
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


def gpu_missing() -> str | None:
    """None when CuPy imports and sees a GPU; else why not (cutp.runtime.backend.cupy_status)."""
    if ROOT not in sys.path:  # (run as a script: cutp from this checkout)
        sys.path.insert(0, ROOT)
    from cutp.runtime import backend  # (after the path: this file runs as a script)

    ok, why = backend.cupy_status()
    return None if ok else why


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the GPU's run without a GPU: one line now, not 70 s of tests failing on `import cupy`
    wants_gpu = (len(argv) >= 3 and argv[:2] == ["run", "gpu"]) or (len(argv) >= 2 and argv[0] == "gpu")
    why = gpu_missing() if wants_gpu else None
    if why:
        print(f"device_path_check: no usable GPU here: {why}; the stand-in runs the same tests without one: "
              f"python tools/device_path_check.py run standin OUT", file=sys.stderr)
        return 2
    if len(argv) >= 3 and argv[0] == "run" and argv[1] in NAMES:
        return run(argv[1], argv[2], argv[3:])
    if len(argv) >= 2 and argv[0] == "gpu":
        return gpu_check(argv[1], argv[2:])
    if len(argv) == 3 and argv[0] == "diff":
        missing = [d for d in argv[1:] if not os.path.exists(os.path.join(d, "junit.xml"))]
        if missing:
            print(f"device_path_check: no results in {', '.join(missing)} (junit.xml): run "
                  f"`python tools/device_path_check.py run standin|gpu DIR` first")
            return 2
        lines, ok = summary(argv[1], argv[2])
        print("\n".join(lines))
        return 0 if ok else 1
    print(__doc__.split("\n\n")[1])
    return 2


if __name__ == "__main__":
    sys.exit(main())
