"""`python -m cutp bench kernels`: the memory-bound ops of a GPT step and its attention, per shape and dtype.

For each op the reference implementation is cutp.ops itself: on the CPU as a training step runs
it (its compiled C kernel of kernels/cpu where it has one, else its NumPy code; the table's note
says which), on the GPU the same code on CuPy arrays (a composition of CuPy element-wise kernels and
reductions: the baseline a fused CUDA kernel has to beat). Faster implementations (the CUDA
kernels of kernels/*.cu) plug in as *variants* through a small registry:

    from cutp.bench.kernels import register_variant

    @register_variant("layernorm_fwd", "cuda_fused")          # devices=("cuda",) by default
    def make(inputs, xp):                                     # inputs: the dict the op's setup made
        x, w, b = inputs["x"], inputs["w"], inputs["b"]
        return lambda: my_kernels.layernorm_forward(x, w, b)  # called once per timed repeat

A module that defines ``register_bench_variants(register)`` is loaded automatically when it is
``cutp.bench.kernel_variants`` (cutp's own kernels, variant "cuda_kernels") or listed in
``CUTP_BENCH_PLUGINS`` (comma-separated module names), and calls ``register(op, name, factory)``
for each of its kernels. On the GPU the baseline ("cupy") runs under
``cutp.kernels.use_kernels(False)``, since cutp.ops itself dispatches to the kernels on CuPy
arrays. Every variant's output is checked against the baseline on the same inputs before it is
timed (column "check").

What is reported per op, shape, dtype and implementation: time per call (median of repeats;
CUDA events and an L2 flush between repeats on the GPU), bytes moved (the op's minimal traffic,
formula per op in cutp/bench/kernel_ops.py: each input read once, each output written once), the
achieved GB/s, its percentage of the device's copy bandwidth measured in the same run, and on the
GPU the speed-up over the CuPy-composition baseline. Shapes are GPT-2 small..xl widths (768,
1024, 1280, 1600) with B*T rows; the CPU uses fewer rows so that the suite stays quick.

Attention (ops attention_fwd, attention_bwd, attention_fwd_bwd; ``--ops attention``) is
compute-bound and has its own table: time, TFLOP/s (FlashAttention-2's FLOP convention: forward
4*B*H*T^2*D halved for the causal mask, backward 2.5x, forward + backward 3.5x; H the query
heads), % of the GPU's dense peak, the speed-up over the unfused path (the baseline "unfused":
``causal_attention_forward(blocked=False)`` and its backward, T x T scores through matmuls and
the softmax kernels, which stay on) and the working memory of each path from the shapes (the
unfused path's float32 T x T arrays, the fused kernels' O(T) row statistics). The unfused path
is skipped, with the reason, where its T x T arrays would not fit in the free memory. Variants:
the fused kernels ("cuda_kernels", GPU) and, on the CPU, cutp's blocked NumPy path
("numpy_blocked").
"""
from __future__ import annotations

import contextlib
import importlib
import math
import os
import time

import ml_dtypes
import numpy as np

from ..kernels import use_kernels
from ..ops import compiled
from ..runtime.backend import get_array_module
from ..runtime.errors import ConfigError
from ..train.reporting import Report, human_bytes
from .common import (L2Flusher, copy_bandwidth, device_of, keep_freed_memory, machine_info, peak_tflops,
                     time_cpu, time_gpu)

# The ops measured, with their shapes per size preset (here for the command line and the tests).
from .kernel_ops import (  # noqa: F401
    ATTENTION_OPS,
    ATTENTION_PASSES,
    OP_GROUPS,
    OPS,
    SIZES,
    OpSpec,
    attention_reference,
    attention_flops,
    attention_memory,
)

# ---------------------------------------------------------------------------------------------
# Variants registry
# ---------------------------------------------------------------------------------------------
VARIANTS: dict[str, dict[str, tuple]] = {}  # op -> name -> (factory, devices, dtypes)
PLUGIN_MODULES = ("cutp.bench.kernel_variants",)
_plugin_notes: list[str] = []
_plugins_loaded = False


def register_variant(op: str, name: str, factory=None, *, devices=("cuda",), dtypes=("float32", "bfloat16")):
    """Registers `factory(inputs, xp) -> callable` as implementation `name` of `op`.

    Usable as a decorator (factory omitted) or called directly. The callable runs the variant once
    on the inputs and returns its outputs in the order of the op's reference outputs (for in-place
    ops, such as ce_bwd_fused and adamw, it may return None: the inputs are compared instead).
    """
    if op not in OPS:
        raise KeyError(f"unknown op {op!r}; choose one of {sorted(OPS)}")

    def add(f):
        VARIANTS.setdefault(op, {})[name] = (f, tuple(devices), tuple(dtypes))
        return f

    return add if factory is None else add(factory)


# cutp's CPU attention (the blocked NumPy path) next to the unfused one it replaces on the CPU
for _kind in ("fwd", "bwd", "fwd_bwd"):
    register_variant(f"attention_{_kind}", "numpy_blocked",
                     lambda d, xp, make=attention_reference(_kind, blocked=True): make(d), devices=("cpu",),
                     dtypes=("float32", "float64"))


def _kernel_switch(enabled):
    """cutp.kernels.use_kernels(enabled) as a context (a null context for None: leave the switch)."""
    if enabled is None:
        return contextlib.nullcontext()
    return use_kernels(enabled)


def load_plugins() -> list[str]:
    """Imports the kernel plug-in modules once; returns notes on what was (not) loaded."""
    global _plugins_loaded
    if _plugins_loaded:
        return _plugin_notes
    _plugins_loaded = True
    names = list(PLUGIN_MODULES) + [m for m in os.environ.get("CUTP_BENCH_PLUGINS", "").split(",") if m.strip()]
    for name in names:
        name = name.strip()
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name and not name.startswith(str(e.name)):
                _plugin_notes.append(f"plug-in {name} failed to import: {e}")
            continue  # not there (yet)
        except Exception as e:  # a broken plug-in must not stop the suite
            _plugin_notes.append(f"plug-in {name} failed to import: {type(e).__name__}: {e}")
            continue
        hook = getattr(mod, "register_bench_variants", None)
        if hook is None:
            continue
        try:
            before = {(op, v) for op, vs in VARIANTS.items() for v in vs}
            hook(register_variant)
            added = sorted({(op, v) for op, vs in VARIANTS.items() for v in vs} - before)
            devices = sorted({d for op, v in added for d in VARIANTS[op][v][1]})
            _plugin_notes.append(f"plug-in {name}: {len(added)} variant(s) registered, for {', '.join(devices) or '-'}")
        except Exception as e:
            _plugin_notes.append(f"plug-in {name}: register_bench_variants failed: {type(e).__name__}: {e}")
    return _plugin_notes


# ---------------------------------------------------------------------------------------------
# Maths of the table (device independent, tested without a GPU)
# ---------------------------------------------------------------------------------------------
def bandwidth_row(nbytes: int, seconds: float, copy_gbs: float | None, baseline_s: float | None = None) -> dict:
    """GB/s (1e9 bytes/s), % of the copy bandwidth, and speed-up over the baseline time."""
    gbs = nbytes / seconds / 1e9 if seconds > 0 else None
    return {"gbs": gbs, "pct_copy": (100.0 * gbs / copy_gbs) if (gbs is not None and copy_gbs) else None,
            "speedup": (baseline_s / seconds) if (baseline_s and seconds > 0) else None}


def flops_row(flops: float, seconds: float, peak: float | None = None, baseline_s: float | None = None) -> dict:
    """TFLOP/s (1e12 FLOP/s), its percentage of the device's dense peak, and the speed-up over
    the baseline time (the attention table's numbers)."""
    tflops = flops / seconds / 1e12 if seconds > 0 else None
    return {"tflops": tflops, "pct_peak": (100.0 * tflops / peak) if (tflops is not None and peak) else None,
            "speedup": (baseline_s / seconds) if (baseline_s and seconds > 0) else None}


# the unfused attention runs where its T x T arrays need at most this share of the free memory
UNFUSED_MEMORY_FRACTION = 0.7


def unfused_skip_reason(need_bytes: int, free_bytes: int | None) -> str | None:
    """Why the unfused attention is not run (its T x T arrays would not fit), or None."""
    if free_bytes is None or need_bytes <= UNFUSED_MEMORY_FRACTION * free_bytes:
        return None
    return (f"skipped: its T x T arrays need {need_bytes / 2**30:.1f} GiB, more than "
            f"{UNFUSED_MEMORY_FRACTION:.0%} of the {free_bytes / 2**30:.1f} GiB free")


def free_memory(xp) -> int | None:
    """Bytes free on the device (after releasing CuPy's pool) or in the host's RAM; None if unknown."""
    try:
        if xp is np:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        xp.get_default_memory_pool().free_all_blocks()
        return int(xp.cuda.runtime.memGetInfo()[0])
    except (ValueError, OSError, AttributeError):
        return None


def max_rel_error(ref, got) -> float:
    """max |got - ref| / max(max |ref|, tiny) over all arrays, computed where the arrays live
    (float32, float64 for float64 data); inf when the shapes or the number of outputs differ."""
    ref, got = tuple(ref), tuple(got)
    if len(ref) != len(got):
        return math.inf
    worst = 0.0
    for a, b in zip(ref, got):
        if tuple(a.shape) != tuple(b.shape):
            return math.inf
        if a.size == 0:
            continue
        xp = get_array_module(a, b)
        wide = np.float64 if (np.dtype(a.dtype) == np.float64 or np.dtype(b.dtype) == np.float64) else np.float32
        a = a.astype(wide)
        b = xp.asarray(b).astype(wide)
        scale = max(float(xp.max(xp.abs(a))), 1e-30)
        diff = float(xp.max(xp.abs(a - b)))
        if diff != diff:  # NaN
            return math.inf
        worst = max(worst, diff / scale)
    return worst


TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float64": 1e-10}


def _as_tuple(r):
    if r is None:
        return ()
    return tuple(r) if isinstance(r, (tuple, list)) else (r,)


def _outputs(spec, inputs, ret):
    if spec.outputs is not None:
        return tuple(spec.outputs(inputs, ret))
    return tuple(a for a in _as_tuple(ret) if a is not None)


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------
def bf16_supported(xp) -> tuple[bool, str]:
    if xp is np:
        return False, ("bfloat16 skipped on the CPU: NumPy has no native bfloat16 (ml_dtypes emulates it, "
                       "timing the emulation would mean nothing)")
    try:
        xp.zeros(4, dtype=ml_dtypes.bfloat16) + 1
    except Exception as e:
        return False, f"bfloat16 skipped: this CuPy has no bfloat16 arrays ({type(e).__name__}: {e}); CuPy >= 14"
    return True, ""


def run(args) -> Report:
    device, xp = device_of(args.device)
    sizes = args.size or ("gpu" if device == "cuda" else "cpu")
    sz = SIZES[sizes]
    report = Report("kernels", machine_info(xp))
    report.meta.update(device=device, size=sizes)
    report.notes += load_plugins()
    requested = [o for name in (args.ops or list(OPS)) for o in OP_GROUPS.get(name, (name,))]
    selected = [o for o in dict.fromkeys(requested) if o in OPS]
    unknown = [o for o in requested if o not in OPS]
    if unknown:
        raise ConfigError(f"`ops`: unknown op(s) {unknown}; choose from {sorted(OPS)} or the groups "
                          f"{sorted(OP_GROUPS)}")
    memory_bound = [o for o in selected if OPS[o].flops is None]
    dtypes = []
    for d in args.dtypes:
        if d == "bfloat16":
            ok, why = bf16_supported(xp)
            if not ok:
                report.notes.append(why)
                continue
        dtypes.append(d)
    if xp is np and getattr(args, "keep_freed_memory", False):  # set by the CLI (process-wide)
        how = keep_freed_memory()
        if how:
            report.notes.append(how)
    gpu = xp is not np
    timer = "CUDA events, L2 flushed" if gpu else "perf_counter"
    copy, t, att = {"gbs": None}, None, None
    if memory_bound:  # the copy bandwidth is the memory-bound ops' yardstick only
        copy = copy_bandwidth(xp, args.copy_mib << 20)
        report.extra["copy"] = copy
        if xp is np:
            how = (f"the faster of np.copyto on one thread ({copy['one_thread_gbs']:.1f} GB/s) and split over "
                   f"{copy['threads']} threads ({copy['threaded_gbs']:.1f} GB/s)")
        else:
            how = "cupy.copyto, a device-to-device copy"
        report.notes.append(f"copy bandwidth: {copy['gbs']:.1f} GB/s, {how}, of {args.copy_mib} MiB (2 x size moved "
                            "per copy)")
        cols = [("op", "op", "", "<"), ("dtype", "dtype", "", "<"), ("shape", "shape", "", "<"),
                ("impl", "impl", "", "<"), ("us", "time us", ",.1f"), ("mb", "MB moved", ",.2f"), ("gbs", "GB/s", ".1f"),
                ("pct_copy", "% copy", ".0f")]
        if gpu:
            cols.append(("speedup", "speed-up", ".2f"))
        cols.append(("check", "check", "", "<"))
        t = report.table("kernels", cols, title=f"kernels on {device} ({timer}, median of repeats)")
        formulas = report.table("formulas", [("op", "op", "", "<"), ("what", "computes", "", "<"),
                                             ("bytes", "bytes moved (s = dtype size)", "", "<")], title="bytes moved per op")
        for name in memory_bound:
            spec = OPS[name]
            formulas.add(op=name, what=spec.what, bytes=spec.formula)
    if len(memory_bound) < len(selected):
        att = _attention_table(report, device, gpu, timer)
    t_start = time.perf_counter()
    budget = float(getattr(args, "budget", 0.0) or 0.0)
    skipped = 0
    flusher = None
    if gpu:
        flusher = L2Flusher(xp)
    # every (op, dtype, shape) case, the smallest shapes of all ops first: a time budget that cuts
    # the run short still covers every op
    cases = []
    for oi, name in enumerate(selected):
        spec = OPS[name]
        shapes = []
        for shape in spec.cases(sz):
            if shape not in shapes:
                shapes.append(shape)
        shapes.sort(key=lambda sh, spec=spec: spec.nbytes(sh, 4))
        for di, dt_name in enumerate(dtypes):
            for si, shape in enumerate(shapes):
                cases.append(((si, oi, di), name, dt_name, shape))
    cases.sort(key=lambda c: c[0])
    if cases and not gpu:  # process warm-up (thread pool, BLAS workers, allocator): the first case twice
        _run_case(OPS[cases[0][1]], cases[0][1], cases[0][2], cases[0][3], xp, device, args, copy["gbs"], flusher)
    for order, name, dt_name, shape in cases:
        if budget and time.perf_counter() - t_start > budget:
            skipped += 1
            continue
        table = att if OPS[name].flops is not None else t
        for row in _run_case(OPS[name], name, dt_name, shape, xp, device, args, copy["gbs"], flusher,
                             peak=report.meta.get("peak")):
            row["_order"] = (order[1], order[2], order[0])
            table.add(**row)
    for table in (t, att):
        if table is not None:
            table.rows.sort(key=lambda r: r.pop("_order"))
    if skipped:
        report.notes.append(f"time budget of {budget:g} s reached: {skipped} case(s) not run (--budget 0 runs all)")
    if t is not None:
        if not gpu:
            t.notes.append(f"CPU: cutp.ops as a training step runs them (no speed-up column): compiled kernels "
                           f"{compiled.describe()}, where an op has one, else its NumPy code; CUTP_CPU_KERNELS=0 "
                           "times the NumPy code alone. Rows split over the BLAS thread count "
                           "(cutp.ops.common.parallel_map)")
        t.notes.append("GB/s = bytes moved / time (1e9 B/s); % copy = GB/s / copy bandwidth. Working sets that fit in "
                       "the CPU's caches can exceed 100%.")
    return report


def _attention_table(report, device, gpu, timer):
    """The compute-bound table: attention's TFLOP/s, speed-up over the unfused path, working memory."""
    cols = [("op", "op", "", "<"), ("dtype", "dtype", "", "<"), ("shape", "shape", "", "<"), ("impl", "impl", "", "<"),
            ("us", "time us", ",.1f"), ("tflops", "TFLOP/s", ".3g")]
    if gpu:
        cols.append(("pct_peak", "% peak", ".0f"))
    cols += [("speedup", "vs unfused", ".2f"), ("work", "work memory", ""), ("check", "check", "", "<")]
    att = report.table("attention", cols, title=f"causal attention on {device} ({timer}, median of repeats)")
    att.notes.append("FLOPs, FlashAttention-2's convention: forward 4*B*H*T^2*D / 2 (H = Hkv*G query heads; causal: "
                     "half of the q k^T and p v products), backward 2.5 x that (timed alone, the forward's outputs "
                     "given), fwd_bwd 3.5 x. Every implementation is credited with these FLOPs (the unfused path "
                     "computes the whole T x T square: twice the work). TFLOP/s = FLOPs / time / 1e12" +
                     ("; % peak: of the GPU's dense peak for the dtype (fp32 without TF32)" if gpu else ""))
    att.notes.append("vs unfused: the time of the unfused path, causal_attention_forward(blocked=False) and "
                     "causal_attention_backward (T x T scores through " +
                     ("cuBLAS matmuls and cutp's softmax kernels" if gpu else "NumPy matmuls and softmax") +
                     "), over this implementation's")
    att.notes.append("work memory: beyond inputs and outputs, at the peak, from the shapes: unfused, its float32 "
                     "T x T arrays (forward: scores + probabilities; backward: the kept probabilities, dP, dS); "
                     "cuda_kernels (fused), O(T) float32 row statistics (forward: lse; backward: lse, sum(dO * O))")
    if not gpu:
        att.notes.append("CPU: numpy_blocked is cutp's CPU path (blocks of query rows, the masked half skipped); the "
                         "fused CUDA kernels (cuda_kernels) run on a GPU (the tests run them under the emulator)")
    return att


def _run_case(spec, name, dt_name, shape, xp, device, args, copy_gbs, flusher, peak=None) -> list[dict]:
    """Rows of one (op, dtype, shape): the baseline, then each variant (checked, then timed)."""
    gpu = xp is not np
    dt = _dtype(dt_name)
    label = spec.shape_label(shape)
    base_switch = spec.baseline_switch if gpu else None
    memory = spec.memory(shape) if spec.memory else {}
    # the unfused attention's T x T arrays may not fit: then it is skipped, and the variants unchecked
    base_skip = unfused_skip_reason(memory["unfused"], free_memory(xp)) if memory else None
    inputs = spec.setup(xp, shape, dt, np.random.default_rng(0))
    # (name, factory(inputs) -> callable, cutp.kernels switch: None (leave), False, True)
    # (on the CPU the ops as training runs them, the compiled C kernels where they apply: "reference"
    # read as NumPy code, 2 to 7 times slower)
    impls = [(spec.baseline or ("cupy" if gpu else "cutp.ops"), spec.reference, base_switch)]
    for vname, (factory, devices, vdtypes) in VARIANTS.get(name, {}).items():
        if device in devices and dt_name in vdtypes:
            impls.append((vname, lambda d, f=factory: f(d, xp), None))
    nbytes = spec.nbytes(shape, np.dtype(dt).itemsize)
    flops = spec.flops(shape) if spec.flops else None
    rows, base_s, ref_out = [], None, None
    for i, (impl_name, make, switch) in enumerate(impls):
        check = "ref"
        if i == 0 and base_skip:
            rows.append(dict(op=name, dtype=dt_name, shape=label, impl=impl_name, check=base_skip, flops=flops,
                             work_bytes=memory["unfused"], work=human_bytes(memory["unfused"])))
            continue
        try:
            with _kernel_switch(switch):
                if i > 0 and base_skip:
                    check = "unchecked (no baseline)"
                elif i > 0:  # a variant: its outputs against the baseline's, on fresh identical inputs
                    fresh = spec.setup(xp, shape, dt, np.random.default_rng(0))
                    got = _outputs(spec, fresh, make(fresh)())
                    del fresh
                    if ref_out is None:
                        with _kernel_switch(base_switch):
                            ref_in = spec.setup(xp, shape, dt, np.random.default_rng(0))
                            ref_out = _outputs(spec, ref_in, spec.reference(ref_in)())
                            del ref_in
                    err = max_rel_error(ref_out, got)
                    del got
                    check = f"ok {err:.0e}" if err <= TOLERANCE.get(dt_name, 1e-4) else f"FAIL {err:.1e}"
                fn = make(inputs)
                if gpu:
                    timing = time_gpu(fn, warmup=args.warmup, repeat=args.repeat, flush=flusher)
                else:
                    timing = time_cpu(fn, warmup=args.warmup, repeat=args.repeat, min_time=args.min_time)
        except Exception as e:  # one failing case must not end the suite
            rows.append(dict(op=name, dtype=dt_name, shape=label, impl=impl_name,
                             check=f"ERROR {type(e).__name__}: {e}"[:80]))
            continue
        sec = timing.median
        if i == 0:
            base_s = sec
        row = dict(op=name, dtype=dt_name, shape=label, impl=impl_name, us=sec * 1e6, check=check,
                   timing=timing.as_dict(), bytes=nbytes)
        if flops is not None:  # compute-bound: TFLOP/s and the speed-up over the unfused path, CPU or GPU
            work = memory.get("unfused" if i == 0 else "fused" if impl_name == "cuda_kernels" else "")
            row.update(flops_row(flops, sec, peak_tflops(peak, dt_name) if peak else None, base_s),
                       flops=flops, work_bytes=work, work=None if work is None else human_bytes(work))
        else:
            row.update(bandwidth_row(nbytes, sec, copy_gbs, base_s if gpu else None), mb=nbytes / 1e6)
        rows.append(row)
    del inputs, ref_out
    if gpu:
        xp.get_default_memory_pool().free_all_blocks()
    return rows


def _dtype(name):
    if name == "bfloat16":
        return ml_dtypes.bfloat16
    return np.dtype(name).type
