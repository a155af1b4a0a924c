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
formula per op below: each input read once, each output written once), the achieved GB/s, its
percentage of the device's copy bandwidth measured in the same run, and on the GPU the speed-up
over the CuPy-composition baseline. Shapes are GPT-2 small..xl widths (768, 1024, 1280, 1600)
with B*T rows; the CPU uses fewer rows so that the suite stays quick.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..kernels import use_kernels
from .common import Report, copy_bandwidth, machine_info, time_cpu, time_gpu

WIDTHS = (768, 1024, 1280, 1600)
VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128
STAT = 4  # bytes of a float32 statistic (means, rstd, row max, sums)
IDX = 8  # bytes of an int64 target

# rows (B*T) per size preset and device; "tiny" is for the tests
SIZES = {
    "tiny": dict(widths=(64, 96), rows=(64,), seq=32, vocab=1000, ce_rows=(32,), adam=(1 << 14,)),
    "cpu": dict(widths=WIDTHS, rows=(256, 1024), seq=256, vocab=VOCAB, ce_rows=(64, 256),
                adam=(1 << 20, 1 << 23)),
    "gpu": dict(widths=WIDTHS, rows=(1024, 8192), seq=1024, vocab=VOCAB, ce_rows=(1024, 8192),
                adam=(124_439_808,)),
}


@dataclass
class OpSpec:
    """One op: how to make its inputs, run the reference, count its bytes, and read its outputs."""

    name: str
    what: str
    formula: str  # bytes moved, in words
    cases: object  # (size preset dict) -> list of shape dicts
    setup: object  # (xp, shape, dtype, rng) -> inputs dict
    reference: object  # (inputs) -> zero-arg callable returning the outputs
    nbytes: object  # (shape, itemsize) -> int
    outputs: object = None  # (inputs, returned) -> tuple of arrays to compare (default: returned)
    label: object = None  # (shape) -> str

    def shape_label(self, shape) -> str:
        return self.label(shape) if self.label else "x".join(str(v) for v in shape.values())


def _normal(xp, rng, shape, dtype, scale=1.0):
    """Normal(0, scale) values in `dtype`, drawn on the device (CuPy's generator seeded from rng)."""
    if xp is np:
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(scale)
        return a.astype(dtype, copy=False)
    a = xp.random.default_rng(int(rng.integers(2**31))).standard_normal(shape, dtype=xp.float32)
    a *= np.float32(scale)
    return a.astype(dtype, copy=False)


def _rows_width(sz):
    return [dict(N=n, C=c) for c in sz["widths"] for n in sz["rows"]]


def _gelu_cases(sz):
    return [dict(N=n, H=4 * c) for c in sz["widths"] for n in sz["rows"]]


def _softmax_cases(sz):
    T = sz["seq"]
    out = []
    for c in sz["widths"]:
        for n in sz["rows"]:
            out.append(dict(B=max(1, n // T), heads=max(1, c // 64), T=T))
    return out


def _ce_cases(sz):
    return [dict(N=n, V=sz["vocab"]) for n in sz["ce_rows"]]


def _adam_cases(sz):
    return [dict(n=n) for n in sz["adam"]]


# ---- setups --------------------------------------------------------------------------------
def _setup_gelu(xp, s, dt, rng, backward=False):
    d = dict(x=_normal(xp, rng, (s["N"], s["H"]), dt), b=_normal(xp, rng, (s["H"],), dt, 0.1))
    if backward:
        _, d["ctx"] = ops.bias_gelu_forward(d["x"], d["b"])
        d["dy"] = _normal(xp, rng, (s["N"], s["H"]), dt)
    return d


def _setup_softmax(xp, s, dt, rng, backward=False):
    shape = (s["B"], s["heads"], s["T"], s["T"])
    d = dict(x=_normal(xp, rng, shape, dt), scale=1.0 / 8.0)
    if backward:
        _, d["ctx"] = ops.softmax_forward(d["x"], d["scale"], causal=True)
        d["dy"] = _normal(xp, rng, shape, dt)
    return d


def _setup_ln(xp, s, dt, rng, backward=False):
    d = dict(x=_normal(xp, rng, (s["N"], s["C"]), dt), w=_normal(xp, rng, (s["C"],), dt, 0.1) + 1,
             b=_normal(xp, rng, (s["C"],), dt, 0.1))
    if backward:
        _, d["ctx"] = ops.layernorm_forward(d["x"], d["w"], d["b"])
        d["dy"] = _normal(xp, rng, (s["N"], s["C"]), dt)
    return d


def _setup_ce(xp, s, dt, rng, stage="max"):
    N, V = s["N"], s["V"]
    logits = _normal(xp, rng, (N, V), dt, 2.0)
    t = rng.integers(0, V, N).astype(np.int64)
    d = dict(logits=logits, targets=t if xp is np else xp.asarray(t), n_valid=V)
    if stage in ("stats", "backward"):
        d["row_max"] = ops.ce_shard_max(logits, V)
    if stage == "backward":
        d["sum_exp"] = ops.ce_shard_stats(logits, d["row_max"], d["targets"], V)[0]
        d["row_scale"] = xp.full(N, 1.0 / N, dtype=np.float32)
    return d


def _setup_adam(xp, s, dt, rng):
    n = s["n"]
    state = np.float32 if np.dtype(dt) != np.float64 else np.float64
    v = _normal(xp, rng, (n,), state, 1e-3)
    v *= v
    return dict(p=_normal(xp, rng, (n,), dt, 0.02), g=_normal(xp, rng, (n,), dt, 1e-3),
                m=_normal(xp, rng, (n,), state, 1e-3), v=v, mask=(xp.arange(n) % 3 != 0).astype(dt))


def _adam_ref(d):
    return lambda: ops.adamw_update(d["p"], d["g"], d["m"], d["v"], d["mask"], lr=6e-4, beta1=0.9, beta2=0.95,
                                    eps=1e-8, weight_decay=0.1, step=10)


OPS: dict[str, OpSpec] = {}


def _add(spec: OpSpec):
    OPS[spec.name] = spec


_add(OpSpec(
    "bias_gelu_fwd", "y = gelu_tanh(x + b), saves x + b", "read x, b; write y and x + b: 3*N*H*s + H*s",
    _gelu_cases, lambda xp, s, dt, rng: _setup_gelu(xp, s, dt, rng),
    lambda d: (lambda: ops.bias_gelu_forward(d["x"], d["b"])),
    lambda s, it: 3 * s["N"] * s["H"] * it + s["H"] * it,
    outputs=lambda d, r: (r[0], r[1].x), label=lambda s: f"{s['N']}x{s['H']}"))
_add(OpSpec(
    "bias_gelu_bwd", "dx = dy * gelu'(x + b), db = sum(dx)", "read dy, x + b; write dx, db: 3*N*H*s + H*s",
    _gelu_cases, lambda xp, s, dt, rng: _setup_gelu(xp, s, dt, rng, True),
    lambda d: (lambda: ops.bias_gelu_backward(d["dy"], d["ctx"])),
    lambda s, it: 3 * s["N"] * s["H"] * it + s["H"] * it, label=lambda s: f"{s['N']}x{s['H']}"))
_add(OpSpec(
    "softmax_fwd", "causal softmax(scale * x) over [B, heads, T, T]",
    "read x, write y over the full T x T square: 2*B*heads*T*T*s",
    _softmax_cases, lambda xp, s, dt, rng: _setup_softmax(xp, s, dt, rng),
    lambda d: (lambda: ops.softmax_forward(d["x"], d["scale"], causal=True)),
    lambda s, it: 2 * s["B"] * s["heads"] * s["T"] ** 2 * it,
    outputs=lambda d, r: (r[0],), label=lambda s: f"{s['B']}x{s['heads']}x{s['T']}x{s['T']}"))
_add(OpSpec(
    "softmax_bwd", "dx = scale * y * (dy - sum(dy * y))", "read y, dy; write dx: 3*B*heads*T*T*s",
    _softmax_cases, lambda xp, s, dt, rng: _setup_softmax(xp, s, dt, rng, True),
    lambda d: (lambda: ops.softmax_backward(d["dy"], d["ctx"])),
    lambda s, it: 3 * s["B"] * s["heads"] * s["T"] ** 2 * it,
    label=lambda s: f"{s['B']}x{s['heads']}x{s['T']}x{s['T']}"))
_add(OpSpec(
    "layernorm_fwd", "y = (x - mean) * rstd * w + b, saves mean, rstd (fp32)",
    "read x, w, b; write y, mean, rstd: 2*N*C*s + 2*C*s + 2*N*4",
    _rows_width, lambda xp, s, dt, rng: _setup_ln(xp, s, dt, rng),
    lambda d: (lambda: ops.layernorm_forward(d["x"], d["w"], d["b"])),
    lambda s, it: 2 * s["N"] * s["C"] * it + 2 * s["C"] * it + 2 * s["N"] * STAT,
    outputs=lambda d, r: (r[0], r[1].mean, r[1].rstd)))
_add(OpSpec(
    "layernorm_bwd", "dx, dw, db of the LayerNorm", "read dy, x, w, mean, rstd; write dx, dw, db: "
    "3*N*C*s + 3*C*s + 2*N*4",
    _rows_width, lambda xp, s, dt, rng: _setup_ln(xp, s, dt, rng, True),
    lambda d: (lambda: ops.layernorm_backward(d["dy"], d["ctx"])),
    lambda s, it: 3 * s["N"] * s["C"] * it + 3 * s["C"] * it + 2 * s["N"] * STAT))
_add(OpSpec(
    "ce_max", "vocab-parallel CE step 1: row max of the logits shard", "read logits; write max: N*V*s + N*4",
    _ce_cases, lambda xp, s, dt, rng: _setup_ce(xp, s, dt, rng, "max"),
    lambda d: (lambda: ops.ce_shard_max(d["logits"], d["n_valid"])),
    lambda s, it: s["N"] * s["V"] * it + s["N"] * STAT, outputs=lambda d, r: (r,)))
_add(OpSpec(
    "ce_stats", "vocab-parallel CE step 2: sum exp, target logit, sum of logits",
    "read logits, max, targets; write 3 stats: N*V*s + N*4 + N*8 + 3*N*4",
    _ce_cases, lambda xp, s, dt, rng: _setup_ce(xp, s, dt, rng, "stats"),
    lambda d: (lambda: ops.ce_shard_stats(d["logits"], d["row_max"], d["targets"], d["n_valid"])),
    lambda s, it: s["N"] * s["V"] * it + s["N"] * (STAT + IDX + 3 * STAT)))
_add(OpSpec(
    "ce_bwd_fused", "CE gradient written over the logits in place (llm.c's fused classifier)",
    "read logits, max, sum, scale, targets; write dlogits: 2*N*V*s + 3*N*4 + N*8",
    _ce_cases, lambda xp, s, dt, rng: _setup_ce(xp, s, dt, rng, "backward"),
    lambda d: (lambda: ops.ce_shard_backward(d["logits"], d["row_max"], d["sum_exp"], d["targets"], d["n_valid"],
                                             d["row_scale"], out=d["logits"])),
    lambda s, it: 2 * s["N"] * s["V"] * it + s["N"] * (3 * STAT + IDX), outputs=lambda d, r: (d["logits"],)))
_add(OpSpec(
    "adamw", "AdamW over flat buffers (fp32 m, v)",
    "read p, g, mask (s each), m, v (4 each); write p (s), m, v (4 each): n*(4*s + 16)",
    _adam_cases, _setup_adam, _adam_ref, lambda s, it: s["n"] * (4 * it + 16),
    outputs=lambda d, r: (d["p"], d["m"], d["v"]), label=lambda s: f"{s['n']:,}"))

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
    import contextlib

    if enabled is None:
        return contextlib.nullcontext()
    return use_kernels(enabled)


def load_plugins() -> list[str]:
    """Imports the kernel plug-in modules once; returns notes on what was (not) loaded."""
    global _plugins_loaded
    if _plugins_loaded:
        return _plugin_notes
    _plugins_loaded = True
    import importlib

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
    from cutp.runtime.backend import get_array_module

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
    import ml_dtypes

    if xp is np:
        return False, ("bfloat16 skipped on the CPU: NumPy has no native bfloat16 (ml_dtypes emulates it, "
                       "timing the emulation would mean nothing)")
    try:
        xp.zeros(4, dtype=ml_dtypes.bfloat16) + 1
    except Exception as e:
        return False, f"bfloat16 skipped: this CuPy has no bfloat16 arrays ({type(e).__name__}: {e}); CuPy >= 14"
    return True, ""


def run(args) -> Report:
    from .common import device_of

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
        from .common import keep_freed_memory

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
        from .common import L2Flusher

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
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name).type
