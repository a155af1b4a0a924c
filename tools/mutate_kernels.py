"""Mutation testing of the CUDA kernels: plants bugs in kernels/*.cu one at a time and runs the
kernel tests against each; a mutant the tests fail is *killed*, one they pass *survives*.

    python tools/mutate_kernels.py --list                  # the mutants, nothing run
    python tools/mutate_kernels.py --max-time 3600         # the campaign (results/ is the default out)
    python tools/mutate_kernels.py --only softmax.cu --ops barrier,relop
    python tools/mutate_kernels.py --only attention.cu --quick --jobs 2   # a stage's fast selection
    python tools/mutate_kernels.py --ids attention-042 attention-049     # re-run chosen mutants
    python tools/mutate_kernels.py --only attention.cu --since main      # the lines changed since a revision
    python tools/mutate_kernels.py --only common.cuh --stages layernorm rmsnorm   # only these families' tests
    python tools/mutate_kernels.py --report out/mutants/results.jsonl

The mutants are generated from patterns over every code line of kernels/*.cu and
kernels/common.cuh (comments, preprocessor lines and kernel signatures left alone), one
occurrence at a time:

  accumulate  ``+=`` -> ``=``, ``-=`` -> ``+=``       (a sum that keeps only its last term)
  relop       ``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``  (bounds, tails, boundaries)
  bound       ``< n`` -> ``< n - 1`` for a bound name; ``+ 1`` / ``- 1`` dropped (off by one)
  barrier     ``__syncthreads();`` removed
  init        ``-INFINITY`` -> ``0.0f``; ``= 0.0f`` -> ``= 1.0f``  (identities of max and sum)
  index32     ``(long long)`` -> ``(int)``, a ``long long`` local -> ``int``, ``(unsigned long long)``
              -> ``(unsigned)``  (32-bit index arithmetic)
  shared      a ``__shared__`` array's extent ``[X]`` -> ``[X / 2]``
  skipwrite   a store (``store_chunk(``, ``a[i] = ...``) guarded by ``if (false)``
  stride      ``WARP_SIZE`` -> ``16``, ``blockDim.x`` -> ``WARP_SIZE`` (wrong lane counts, strides)
  math        ``fmaxf`` <-> ``fminf``
  round16     a float accumulation ``a += b;`` -> ``a = to_float(from_float<T>(a + b));``: in the
              bf16 instantiation a sum kept in 16 bits, in float32's the same code (the weight
              and bias gradients' sources only; outside a template on T, stillborn)
  halves      a rotary table's second half read as its first (``cr + hh + e0`` -> ``cr + e0``,
              ``c2[k]`` <-> ``c1[k]``, ``s2[k]`` <-> ``s1[k]``)
  fastmath    ``expf(`` -> ``__expf(``, ``tanhf(`` -> ``__tanhf(`` (fast-math intrinsics; the float32
              activations, softmax, cross-entropy, the attention's exp and soft cap)
  vecwidth    a bf16 kernel's 128-bit pack sized as float32's: ``% P == 0`` -> ``% 4 == 0``,
              ``(n + P - 1) / P`` -> ``(n + 3) / 4``, ``count >= N`` -> ``count >= 4``
  skiptile    a tile skip ``if (...) continue;`` made empty: the tile is visited and masked
              instead of skipped (the fused attention's window and documents)
  softcap     the soft cap's ``tanhf(`` -> ``(`` (no cap) and its derivative `` * dcap`` dropped

Each mutant is compiled and tested in a private copy of tests/ and kernels/ (the working tree is
never modified, so the campaign can run while you edit), with the emulated backend only, pytest
``-x``, and only the test files of the mutated source (``STAGES_OF``: the source's own test file, run
with only the sources it needs built; common.cuh's mutants go through every op's file in turn
until one fails) plus the kernels' 64-bit index audit (tests/kernels/test_index_width.py, first:
it kills an index mutant without a build). ``--jobs`` runs mutants in parallel sandboxes. A mutant g++ rejects is *stillborn* and not counted. A run past its time limit
counts as killed (a hang is what a GPU would show too). Results go, one JSON line per mutant, to
``<out>/results.jsonl`` as they finish (a capped run leaves a valid partial file; ``--resume``
continues it), and the summary (kill rate, every survivor with its line) to stdout and
``<out>/summary.md``. Not part of ``make test``: a full campaign takes an hour or more on 2 cores.

``--quick`` runs, for a stage that has one (``QUICK``: attention), a fast selection of its test
file instead of the whole file, as pytest node ids in a fixed order: attention.cu's whole file
takes ~35 s of tests plus two ~5 s builds of the source (checked and unchecked) per mutant, its
selection ~12 s, and a mutant the checked build's tests kill never builds the unchecked module
(its grid cases run last): 171 mutants in 30 minutes with 2 jobs on 2 shared cores. The baseline runs the same selection, and only the stages of the
mutated sources. A survivor of the selection is not yet a survivor: re-run it on the whole file
(``--ids ...`` without ``--quick``, into another ``--out``). Each result records ``quick``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cutp.kernels.family import families  # noqa: E402  (after the path set-up above)

KERNELS = ROOT / "kernels"
SOURCES_CU = sorted(p.stem for p in KERNELS.glob("*.cu"))
SOURCES = [f"{name}.cu" for name in SOURCES_CU] + ["common.cuh"]

# A stage: a kernel family's test files (tests/kernels/) and the kernel sources its emulated module
# builds ($CUTP_EMU_KERNEL_SOURCES: one op's sources build in a quarter of the time of all of them),
# as each family declares them (kernels/<op>.py FAMILY, cutp.kernels.family).
STAGES = {f.name: (list(f.tests), list(f.sources)) for f in families() if f.tests}
# The stages that test each source, run in order until one fails (AUDIT_TESTS first, in the first):
# the families that launch it; common.cuh's, every family's, those with a --quick selection (slow) last.
_BY_COST = sorted(STAGES, key=lambda name: (bool(next(f for f in families() if f.name == name).quick_tests), name))
STAGES_OF = {f"{source}.cu": [name for name in _BY_COST if source in STAGES[name][1]] for source in SOURCES_CU}
STAGES_OF["common.cuh"] = _BY_COST
AUDIT_TESTS = ["test_index_width.py"]  # source-level checks that apply to every kernel source

# --quick: a stage's fast selection, pytest node ids under tests/kernels/ run in this order (the
# family's quick_tests: kernels/attention.py QUICK_TESTS), for a stage whose full files are too
# slow per mutant; a mutant that survives its quick selection is re-run on the full files (--ids,
# without --quick) before it counts as a survivor.
QUICK = {f.name: list(f.quick_tests) for f in families() if f.quick_tests}

LAUNCH_TIMEOUT = 10

OPS = ("accumulate", "relop", "bound", "barrier", "init", "index32", "shared", "skipwrite", "stride", "math",
       "round16", "halves", "fastmath", "vecwidth", "skiptile", "softcap", "headdim")
# Operators that apply to some sources only (the bug classes of issue 42), as the families declare
# them (FAMILY.mutation_classes, of their own source), and those of the shared header; the others
# apply everywhere.
COMMON_CLASSES = ("vecwidth",)  # common.cuh: load_chunk / store_chunk (its sums are on no storage type T)
SOURCE_CLASSES = ("round16", "halves", "fastmath", "skiptile", "softcap", "headdim")
OP_SOURCES = {op: tuple(f"{f.sources[0]}.cu" for f in families() if op in f.mutation_classes)
              + (("common.cuh",) if op in COMMON_CLASSES else ()) for op in SOURCE_CLASSES}

BOUND_NAMES = r"(?:n|C|W|L|Tk|Tq|n_valid|n_rows|count|nwarps|r1|n_chunks|P|N|size)"


@dataclasses.dataclass
class Mutant:
    id: str
    source: str
    line: int  # 1-based
    op: str
    original: str
    mutated: str

    def describe(self) -> str:
        return f"{self.source}:{self.line} [{self.op}] {self.original.strip()}  ->  {self.mutated.strip()}"


# ------------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------------
def _code_part(line: str) -> str:
    """The line without its // comment (no string literals with // in kernel code)."""
    i = line.find("//")
    return line if i < 0 else line[:i]


def _mutable_lines(text: str):
    """(index, line) of the lines that hold device code: not comments, not preprocessor lines,
    not kernel signatures (extern "C" ... up to the opening brace), not static_asserts."""
    in_block_comment = False
    in_signature = False
    for i, line in enumerate(text.splitlines(keepends=True)):
        s = line.strip()
        if in_block_comment:
            if "*/" in s:
                in_block_comment = False
            continue
        if s.startswith("/*"):
            in_block_comment = "*/" not in s
            continue
        if not s or s.startswith("//") or s.startswith("#") or s.startswith("static_assert"):
            continue
        if s.startswith('extern "C"'):
            in_signature = not s.endswith("{")
            continue
        if in_signature:
            in_signature = not s.endswith("{")
            continue
        yield i, line


def _sub_each(pattern: str, repl, code: str):
    """Each single-occurrence substitution of `pattern` in `code`: [(start, end, replacement)]."""
    out = []
    for m in re.finditer(pattern, code):
        r = repl(m) if callable(repl) else m.expand(repl)
        if r is not None and r != m.group(0):
            out.append((m.start(), m.end(), r))
    return out


# (operator, pattern, replacement, only on lines containing): each occurrence of the pattern in a
# code line, replaced alone, is a mutant.
PATTERNS = [
    ("accumulate", r" \+= ", " = ", ""),
    ("accumulate", r" -= ", " += ", ""),
    ("relop", r"(?<=[\w\)\]]) < (?=[\w\(\-])", " <= ", ""),
    ("relop", r" <= ", " < ", ""),
    ("relop", r"(?<=[\w\)\]]) > (?=[\w\(\-])", " >= ", ""),
    ("relop", r" >= ", " > ", ""),
    ("relop", r" == ", " != ", ""),
    ("relop", r" != ", " == ", ""),
    ("bound", rf"(?<= < ){BOUND_NAMES}\b(?! [-+*/])", lambda m: f"{m.group(0)} - 1", ""),
    ("bound", r" [+-] 1(?![\w.])", "", ""),
    ("barrier", r"__syncthreads\(\);", "", "__syncthreads();"),
    ("init", r"-INFINITY", "0.0f", ""),
    ("init", r"(?<== )0\.0f(?=[;,])", "1.0f", ""),
    ("index32", r"\(long long\)", "(int)", ""),
    ("index32", r"\(unsigned long long\)", "(unsigned)", ""),
    ("index32", r"(?<![\w(])long long(?= \w+ =)", "int", ""),
    ("shared", r"\[([^\]\[]+)\]", lambda m: f"[({m.group(1)}) / 2]", "__shared__"),
    ("skipwrite", r"\bstore_chunk(?:<[^>]*>)?\(", lambda m: "if (false) " + m.group(0), ""),
    ("skipwrite", r"(?<![\w.\]])(\w+(?:\.\w+)?\[[^\]=]+\]) = (?!=)", lambda m: f"if (false) {m.group(0)}", ""),
    ("stride", r"(?<![\w(])WARP_SIZE\b", "16", ""),
    ("stride", r"\bblockDim\.x\b", "WARP_SIZE", ""),
    ("math", r"\bfmaxf\b", "fminf", ""),
    ("math", r"\bfminf\b", "fmaxf", ""),
    ("round16", r"(?<![\w.\]])(\w+(?:\[[^\];]*\])?) \+= ([^;=]+);",
     lambda m: f"{m.group(1)} = to_float(from_float<T>({m.group(1)} + ({m.group(2)})));", ""),
    ("halves", r"\b([cs])r \+ hh \+ e0", r"\1r + e0", "load_chunk"),
    ("halves", r"\b([cs])([12])\[k\]", lambda m: f"{m.group(1)}{3 - int(m.group(2))}[k]", ""),
    ("fastmath", r"(?<![\w])expf\(", "__expf(", ""),
    ("vecwidth", r"% P == 0", "% 4 == 0", ""),
    ("vecwidth", r"\+ P - 1\) / P", "+ 3) / 4", ""),
    ("vecwidth", r"\bcount >= N\b", "count >= 4", ""),
    ("skiptile", r"(?<=\)) continue;", " {}", ""),
    ("softcap", r"\btanhf\(", "(", ""),
    ("softcap", r" \* dcap\b", "", ""),
    # MLA's head dims: v's (DV, its tiles' VLD, accumulators' VOLD) taken for q/k's, and on the
    # lines that name both, q/k's for v's
    ("headdim", r"\bDV\b", "D", ""),
    ("headdim", r"\bVLD\b", "LD", ""),
    ("headdim", r"\bVOLD\b", "OLD", ""),
    ("headdim", r"\bD\b", "DV", "DV"),
    ("headdim", r"\bLD\b", "VLD", "VLD"),
    ("headdim", r"\bOLD\b", "VOLD", "VOLD"),
]
# Patterns added after a source's ids were recorded (kernels/README.md's campaigns): numbered after
# every mutant of PATTERNS in that source, so that the recorded ids keep naming the same mutants.
LATE_PATTERNS = [
    ("fastmath", r"(?<![\w])tanhf\(", "__tanhf(", ""),  # session 12: tanh.approx, ~2^-11 relative
]


def _line_mutations(line: str, source: str = "", patterns=PATTERNS):
    """[(op, mutated line)] for one code line of `source` by `patterns` (OP_SOURCES: some operators
    apply to some sources only)."""
    code = _code_part(line)
    rest = line[len(code):]
    # a skipped write is a statement: not a declaration, loop header or function header
    statement = not code.lstrip().startswith(("return", "const ", "float ", "int ", "long ", "for ", "T ")) and \
        "__device__" not in code
    found = []
    for op, pattern, repl, needs in patterns:
        if needs not in code or (op == "skipwrite" and not statement) or (op == "stride" and "constexpr" in code):
            continue
        if op in OP_SOURCES and source not in OP_SOURCES[op]:
            continue
        for a, b, r in _sub_each(pattern, repl, code):
            found.append((op, code[:a] + r + code[b:] + rest))
    return found


def generate(sources=SOURCES, ops=OPS) -> list[Mutant]:
    """The mutants of `sources` by the operators `ops`, numbered per source over every operator
    (an id names the same mutant whatever --ops selects, so --resume and --ids work across runs;
    LATE_PATTERNS' mutants after all the others)."""
    mutants: list[Mutant] = []
    for source in sources:
        text = (KERNELS / source).read_text()
        seen = set()
        n = 0
        for patterns in (PATTERNS, LATE_PATTERNS):
            for i, line in _mutable_lines(text):
                for op, new in _line_mutations(line, source, patterns):
                    if new == line or (i, new) in seen:
                        continue
                    seen.add((i, new))
                    if op in ops:
                        mutants.append(Mutant(f"{source.split('.')[0]}-{n:03d}", source, i + 1, op,
                                              line.rstrip("\n"), new.rstrip("\n")))
                    n += 1
    return mutants


def changed_lines(source: str, rev: str) -> set[int]:
    """The 1-based line numbers of kernels/<source> that differ from git revision `rev` (added
    or changed lines of `git diff -U0`): a campaign over a change's new code (--since)."""
    out = subprocess.run(["git", "diff", "-U0", rev, "--", f"kernels/{source}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    lines = set()
    for m in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", out, re.M):
        start, count = int(m.group(1)), int(m.group(2) or 1)
        lines.update(range(start, start + count))
    return lines


def apply(mutant: Mutant, text: str) -> str:
    lines = text.splitlines(keepends=True)
    assert lines[mutant.line - 1].rstrip("\n") == mutant.original, mutant
    lines[mutant.line - 1] = mutant.mutated + "\n"
    return "".join(lines)


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------
def make_sandbox() -> Path:
    """A private copy of tests/ and kernels/ (plus the pytest configuration): cutp itself is
    imported from the installed (editable) package, the kernel sources from the copy."""
    box = Path(tempfile.mkdtemp(prefix="cutp-mutants-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "tests", box / "tests", ignore=ignore)
    shutil.copytree(ROOT / "kernels", box / "kernels", ignore=ignore)
    for f in ("setup.cfg", "pyproject.toml"):
        shutil.copy2(ROOT / f, box / f)
    return box


def stage_tests(stage: str, quick: bool = False) -> list[str]:
    """The stage's test files, or with quick its QUICK node ids where it has them."""
    return QUICK[stage] if quick and stage in QUICK else STAGES[stage][0]


def run_tests(box: Path, tests: list[str], sources: list[str], timeout: float,
              launch_timeout: float = LAUNCH_TIMEOUT) -> tuple[str, float, str]:
    """('killed' | 'survived' | 'stillborn' | 'timeout', seconds, last lines of output); tests: files
    or node ids under tests/kernels/, run in this order."""
    tests = [t for t in tests if (box / "tests" / "kernels" / t.split("::")[0]).exists()]
    # One build cache for all mutants: the emulator's runtime object is compiled once; the
    # module of each mutant (keyed by its source text) is removed after its run.
    # A launch over LAUNCH_TIMEOUT s is a hang (an infinite loop): the tests' longest launch takes ~1 s
    # on an idle machine (on a loaded one, --launch-timeout: a baseline that times out says so).
    env = dict(os.environ, CUTP_KERNEL_BACKENDS="emulated", CUTP_EMU_TIMEOUT=str(launch_timeout),
               PYTHONDONTWRITEBYTECODE="1", CUTP_CACHE_DIR=str(box / "cache"),
               # no background warm-up builds: a mutant's pytest -x ends at its first failure, and the
               # warm-up's builds of what it never reaches were wasted (and, before the emulator
               # killed its compiles at exit, left running: 33 g++ after 18 mutants of common.cuh)
               CUTP_TEST_WARM_UP="0",
               CUTP_EMU_KERNEL_SOURCES=",".join(sources))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--no-header", "-rfE",
           *[f"tests/kernels/{t}" for t in tests]]
    try:
        return _run(cmd, box, env, timeout)
    finally:
        for f in (box / "cache" / "cuda_emu").glob("module-*"):
            f.unlink()


def _run(cmd, box, env, timeout):
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=box, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "timeout", time.monotonic() - t0, out[-2000:]
    dt = time.monotonic() - t0
    out = p.stdout + p.stderr
    if p.returncode == 0:
        return "survived", dt, out[-600:]
    if "CompileError" in out and "error:" in out:
        return "stillborn", dt, out[-2000:]
    return "killed", dt, out[-2000:]


def _killing_test(out: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return m.group(1) if m else ""


def prioritised(mutants):
    """The categories the issues name first (issue 42's, then the first review's: a capped run
    still covers them), then relop and bound; sources interleaved within a category."""
    order = {op: i for i, op in enumerate(("round16", "halves", "fastmath", "vecwidth", "skiptile", "softcap", "headdim",
                                           "barrier", "accumulate", "init",
                                           "shared", "skipwrite", "index32", "stride", "math", "relop", "bound"))}
    rank = {}
    for m in mutants:
        rank[m.id] = sum(1 for o in mutants if o.op == m.op and o.source == m.source and o.line < m.line)
    return sorted(mutants, key=lambda m: (order[m.op], rank[m.id], m.source))


_DEVICE_FUNCTION = re.compile(r"__device__[^(]*?\b(\w+)\s*\(")


def enclosing_function(text: str, line: int) -> str | None:
    """The name of the __device__ function whose definition starts at or above `line` (1-based)
    last, in a header of device functions (common.cuh); None above the first."""
    for t in reversed(text.splitlines()[:line]):
        m = _DEVICE_FUNCTION.search(t)
        if m:
            return m.group(1)
    return None


def stages_for(m: Mutant) -> list[str]:
    """The stages a mutant runs, in order: STAGES_OF its source; for a common.cuh mutant, the
    stages whose sources call its enclosing function by name first (the rest after, in their
    order). Only the order changes, so only the time a mutant takes to die: it survives only
    if every stage passes either way (the campaign's common.cuh mutants in row_group_reduce_*,
    used by the norms alone, went through four other families' builds and tests first)."""
    stages = STAGES_OF[m.source]
    if m.source != "common.cuh":
        return stages
    name = enclosing_function((KERNELS / m.source).read_text(), m.line)
    if name is None:
        return stages
    texts = {src: (KERNELS / f"{src}.cu").read_text() for stage in stages for src in STAGES[stage][1]}
    users = [st for st in stages if st not in QUICK  # a slow --quick stage keeps its place, last
             and any(re.search(rf"\b{name}\b", texts[src]) for src in STAGES[st][1])]
    return users + [st for st in stages if st not in users]


def run_mutant(box: Path, m: Mutant, per_mutant: float, quick: bool = False,
               launch_timeout: float = LAUNCH_TIMEOUT) -> tuple[str, float, str]:
    """The mutant's stages in its sandbox, until one fails; the source restored after."""
    src = box / "kernels" / m.source
    original = (KERNELS / m.source).read_text()
    src.write_text(apply(m, original))
    total = 0.0
    try:
        for i, stage in enumerate(stages_for(m)):
            tests, sources = stage_tests(stage, quick), STAGES[stage][1]
            status, secs, log = run_tests(box, (AUDIT_TESTS if i == 0 else []) + tests, sources, per_mutant,
                                          launch_timeout)
            total += secs
            if status != "survived":
                break
        return status, total, log
    finally:
        src.write_text(original)


def campaign(mutants, out_dir: Path, max_time: float, per_mutant: float, resume: bool, jobs: int = 1,
             quick: bool = False, launch_timeout: float = LAUNCH_TIMEOUT) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.jsonl"
    done = set()
    if resume and results_path.exists():
        done = {json.loads(line)["id"] for line in results_path.read_text().splitlines() if line.strip()}
    elif results_path.exists():
        results_path.unlink()
    boxes = [make_sandbox() for _ in range(jobs)]
    t_start = time.monotonic()
    try:
        t0 = time.monotonic()
        # every stage of the mutated sources passes on the unmutated sources
        stages = [s for s in STAGES if any(s in STAGES_OF[m.source] for m in mutants)]
        for stage in stages:
            tests, sources = stage_tests(stage, quick), STAGES[stage][1]
            base, dt, out = run_tests(boxes[0], tests + AUDIT_TESTS, sources, 1800, launch_timeout)
            if base != "survived":
                raise SystemExit(f"the kernel tests ({stage}) fail without any mutation ({base}):\n{out}")
            if dt > per_mutant / 2:  # a survivor (same tests, plus a build) past the limit would count as killed
                raise SystemExit(f"the kernel tests ({stage}) take {dt:.0f} s without any mutation: over half of "
                                 f"--per-mutant {per_mutant:.0f} s, a surviving mutant would count as a timeout "
                                 "(killed); raise --per-mutant or choose fewer tests (--quick, --tests)")
        print(f"baseline: the kernel tests pass on the unmutated sources ({time.monotonic() - t0:.0f} s)", flush=True)
        todo = prioritised([m for m in mutants if m.id not in done])
        lock = threading.Lock()
        it = iter(enumerate(todo))
        skipped = []

        def worker(box):
            while True:
                with lock:
                    nxt = next(it, None)
                    if nxt is not None and time.monotonic() - t_start > max_time:
                        skipped.append(nxt[1])
                        continue
                if nxt is None:
                    return
                i, m = nxt
                status, secs, log = run_mutant(box, m, per_mutant, quick, launch_timeout)
                rec = dict(dataclasses.asdict(m), status=status, seconds=round(secs, 1), quick=quick,
                           killed_by=_killing_test(log), log=log[-1500:] if status in ("stillborn", "survived") else "")
                with lock:
                    with results_path.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                    print(f"[{i + 1}/{len(todo)}] {status:9s} {secs:5.1f}s {m.describe()}", flush=True)

        threads = [threading.Thread(target=worker, args=(b,)) for b in boxes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if skipped:
            print(f"time cap of {max_time:.0f} s reached: {len(skipped)} mutants not run", flush=True)
    finally:
        for box in boxes:
            shutil.rmtree(box, ignore_errors=True)


def report(results_path: Path, total_generated: int | None = None) -> str:
    recs = [json.loads(line) for line in results_path.read_text().splitlines() if line.strip()]
    by = {s: [r for r in recs if r["status"] == s] for s in ("killed", "timeout", "survived", "stillborn")}
    live = len(by["killed"]) + len(by["timeout"]) + len(by["survived"])
    killed = len(by["killed"]) + len(by["timeout"])
    lines = [f"# Kernel mutation campaign ({results_path})", ""]
    rate = f"{100 * killed / live:.1f}%" if live else "n/a"
    lines.append(f"mutants run: {len(recs)}" + (f" of {total_generated} generated" if total_generated else "")
                 + f"; stillborn (do not compile): {len(by['stillborn'])}; killed: {killed} "
                 f"(of which timeouts: {len(by['timeout'])}); survived: {len(by['survived'])}; "
                 f"kill rate {killed}/{live} = {rate}")
    lines.append("")
    lines.append("| op | run | killed | survived |")
    lines.append("|---|---|---|---|")
    for op in OPS:
        rs = [r for r in recs if r["op"] == op and r["status"] != "stillborn"]
        if rs:
            k = sum(r["status"] in ("killed", "timeout") for r in rs)
            lines.append(f"| {op} | {len(rs)} | {k} | {len(rs) - k} |")
    lines.append("")
    lines.append("## Survivors")
    for r in by["survived"]:
        lines.append(f"- `{r['id']}` {r['source']}:{r['line']} [{r['op']}] `{r['original'].strip()}` -> "
                     f"`{r['mutated'].strip()}`")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--only", nargs="*", default=None, help="sources to mutate (e.g. softmax.cu common.cuh)")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated operators (default: all)")
    ap.add_argument("--ids", nargs="*", default=None, help="run only these mutant ids")
    ap.add_argument("--since", default=None, metavar="REV",
                    help="only mutants of lines added or changed since git revision REV (ids stay those of the "
                         "whole source)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "mutants")
    ap.add_argument("--max-time", type=float, default=4 * 3600, help="stop starting mutants after this many s")
    ap.add_argument("--per-mutant", type=float, default=300, help="time limit of one mutant's test run (s)")
    ap.add_argument("--launch-timeout", type=float, default=LAUNCH_TIMEOUT,
                    help="a launch past this many s is a hang (default %(default)s; more on a loaded machine)")
    ap.add_argument("--resume", action="store_true", help="skip the mutants already in results.jsonl")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (one sandbox each)")
    ap.add_argument("--quick", action="store_true",
                    help="run each stage's fast selection (QUICK: attention) instead of its whole test file; "
                         "re-run the survivors without it")
    ap.add_argument("--tests", nargs="*", default=None, metavar="NODEID",
                    help="run these tests (pytest node ids under tests/kernels/, in order) for every stage instead "
                         "of its files, as --quick does (e.g. a change's own tests; re-run the survivors without it)")
    ap.add_argument("--stages", nargs="*", default=None, metavar="FAMILY",
                    help="run only these stages (kernel families, e.g. layernorm rmsnorm) of each mutated source, "
                         "in their usual order: a common.cuh change's users (re-run the survivors without it)")
    ap.add_argument("--report", type=Path, default=None, help="summarise a results.jsonl and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    unknown = set(ops) - set(OPS)
    if unknown:
        ap.error(f"unknown operators {sorted(unknown)}; choose from {OPS}")
    mutants = generate(args.only or SOURCES, ops)
    if args.ids:
        mutants = [m for m in mutants if m.id in set(args.ids)]
    if args.since:
        changed = {source: changed_lines(source, args.since) for source in {m.source for m in mutants}}
        mutants = [m for m in mutants if m.line in changed[m.source]]
    if args.list:
        for m in mutants:
            print(f"{m.id:18s} {m.describe()}")
        print(f"{len(mutants)} mutants")
        return 0
    if args.stages:
        unknown = set(args.stages) - set(STAGES)
        if unknown:
            ap.error(f"unknown stages {sorted(unknown)}; choose from {sorted(STAGES)}")
        for source in STAGES_OF:
            STAGES_OF[source] = [name for name in STAGES_OF[source] if name in args.stages]
        mutants = [m for m in mutants if STAGES_OF[m.source]]
    if args.tests:
        for stage in STAGES:
            QUICK[stage] = list(args.tests)
    campaign(mutants, args.out, args.max_time, args.per_mutant, args.resume, args.jobs,
             args.quick or bool(args.tests) or bool(args.stages), args.launch_timeout)
    summary = report(args.out / "results.jsonl", len(mutants))
    (args.out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
