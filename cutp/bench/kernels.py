"""`python -m cutp bench kernels`: the memory-bound ops of a GPT step, per shape and dtype.

For each op the reference implementation is cutp.ops itself: on the CPU the NumPy code, on
the GPU the same code on CuPy arrays (a composition of CuPy element-wise kernels and
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
from ..runtime.backend import get_array_module
from .common import (
    L2Flusher,
    Report,
    copy_bandwidth,
    device_of,
    keep_freed_memory,
    machine_info,
    time_cpu,
    time_gpu,
)
# The ops measured, with their shapes per size preset (here for the command line and the tests).
from .kernel_ops import OPS, SIZES, OpSpec  # noqa: F401

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
    selected = [o for o in (args.ops or list(OPS)) if o in OPS]
    unknown = [o for o in (args.ops or []) if o not in OPS]
    if unknown:
        raise SystemExit(f"unknown op(s) {unknown}; choose from {sorted(OPS)}")
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
    copy = copy_bandwidth(xp, args.copy_mib << 20)
    report.extra["copy"] = copy
    if xp is np:
        how = (f"the faster of np.copyto on one thread ({copy['one_thread_gbs']:.1f} GB/s) and split over "
               f"{copy['threads']} threads ({copy['threaded_gbs']:.1f} GB/s)")
    else:
        how = "cupy.copyto, a device-to-device copy"
    report.notes.append(f"copy bandwidth: {copy['gbs']:.1f} GB/s, {how}, of {args.copy_mib} MiB (2 x size moved per copy)")
    gpu = xp is not np
    cols = [("op", "op", "", "<"), ("dtype", "dtype", "", "<"), ("shape", "shape", "", "<"), ("impl", "impl", "", "<"),
            ("us", "time us", ",.1f"), ("mb", "MB moved", ",.2f"), ("gbs", "GB/s", ".1f"), ("pct_copy", "% copy", ".0f")]
    if gpu:
        cols.append(("speedup", "speed-up", ".2f"))
    cols.append(("check", "check", "", "<"))
    t = report.table("kernels", cols, title=f"kernels on {device} ({'CUDA events, L2 flushed' if gpu else 'perf_counter'}, "
                                            "median of repeats)")
    formulas = report.table("formulas", [("op", "op", "", "<"), ("what", "computes", "", "<"),
                                         ("bytes", "bytes moved (s = dtype size)", "", "<")], title="bytes moved per op")
    for name in selected:
        spec = OPS[name]
        formulas.add(op=name, what=spec.what, bytes=spec.formula)
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
        for row in _run_case(OPS[name], name, dt_name, shape, xp, device, args, copy["gbs"], flusher):
            row["_order"] = (order[1], order[2], order[0])
            t.add(**row)
    t.rows.sort(key=lambda r: r.pop("_order"))
    if skipped:
        report.notes.append(f"time budget of {budget:g} s reached: {skipped} case(s) not run (--budget 0 runs all)")
    if not gpu:
        t.notes.append("CPU: the NumPy reference is the only implementation (no speed-up column); its ops split "
                       "row blocks over the BLAS thread count (cutp.ops._common.parallel_map)")
    t.notes.append("GB/s = bytes moved / time (1e9 B/s); % copy = GB/s / copy bandwidth. Working sets that fit in the "
                   "CPU's caches can exceed 100%.")
    return report


def _run_case(spec, name, dt_name, shape, xp, device, args, copy_gbs, flusher) -> list[dict]:
    """Rows of one (op, dtype, shape): the baseline, then each variant (checked, then timed)."""
    gpu = xp is not np
    dt = _dtype(dt_name)
    label = spec.shape_label(shape)
    inputs = spec.setup(xp, shape, dt, np.random.default_rng(0))
    # (name, factory(inputs) -> callable, cutp.kernels switch: None (leave), False, True)
    impls = [("cupy" if gpu else "reference", spec.reference, False if gpu else None)]
    for vname, (factory, devices, vdtypes) in VARIANTS.get(name, {}).items():
        if device in devices and dt_name in vdtypes:
            impls.append((vname, lambda d, f=factory: f(d, xp), None))
    nbytes = spec.nbytes(shape, np.dtype(dt).itemsize)
    rows, base_s, ref_out = [], None, None
    for i, (impl_name, make, switch) in enumerate(impls):
        check = "ref"
        try:
            with _kernel_switch(switch):
                if i > 0:  # a variant: its outputs against the baseline's, on fresh identical inputs
                    fresh = spec.setup(xp, shape, dt, np.random.default_rng(0))
                    got = _outputs(spec, fresh, make(fresh)())
                    del fresh
                    if ref_out is None:
                        with _kernel_switch(False if gpu else None):
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
        bw = bandwidth_row(nbytes, sec, copy_gbs, base_s if gpu else None)
        rows.append(dict(op=name, dtype=dt_name, shape=label, impl=impl_name, us=sec * 1e6, mb=nbytes / 1e6,
                         check=check, **bw, timing=timing.as_dict(), bytes=nbytes))
    del inputs, ref_out
    if gpu:
        xp.get_default_memory_pool().free_all_blocks()
    return rows


def _dtype(name):
    if name == "bfloat16":
        return ml_dtypes.bfloat16
    return np.dtype(name).type
