"""The ops `python -m cutp bench kernels` measures: shapes per size preset, inputs, reference, bytes moved.

Each :class:`OpSpec` says how to make an op's inputs on the device (NumPy or CuPy arrays), run
its reference (cutp.ops itself), count the bytes it must move at least (each input read once,
each output written once) and read its outputs for the check of a variant against the
reference. The compute-bound attention ops also count their FLOPs (:func:`attention_flops`)
and the working memory of the unfused and fused paths (:func:`attention_memory`).
``cutp.bench.kernels`` runs them; ``cutp.bench.kernel_variants`` registers the CUDA kernels of
``cutp.kernels`` as variants of these ops, by name. A kernel family may declare its ops with
itself (``kernels/<op>.py`` FAMILY.bench, :class:`cutp.kernels.family.BenchCase`: SwiGLU, rotary):
they are added here, after the others.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops
from ..kernels.family import families

WIDTHS = (768, 1024, 1280, 1600)
VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128
LLAMA3_VOCAB = 128256  # Llama 3's vocabulary (a multiple of 128 and of 8: tp=8 shards of 16,032)
STAT = 4  # bytes of a float32 statistic (means, rstd, row max, sums)
IDX = 8  # bytes of an int64 target

# rows (B*T) per size preset and device; "tiny" is for the tests
SIZES = {
    "tiny": dict(widths=(64, 96), rows=(64,), seq=32, vocab=1000, ce_rows=(32,), adam=(1 << 14,)),
    "cpu": dict(widths=WIDTHS, rows=(256, 1024), seq=256, vocab=VOCAB, ce_rows=(64, 256),
                adam=(1 << 20, 1 << 23), llama_widths=(2048,), ce_llama=((64, LLAMA3_VOCAB),)),
    # Llama's: RMSNorm at 2048 (3.2-1B) and 4096 (3-8B), SwiGLU at 8192 / 14336 wide, CE at the whole
    # 128,256 vocabulary and at its tp=8 shard
    "gpu": dict(widths=WIDTHS, rows=(1024, 8192), seq=1024, vocab=VOCAB, ce_rows=(1024, 8192),
                adam=(124_439_808,), llama_widths=(2048, 4096),
                ce_llama=((8192, LLAMA3_VOCAB // 8), (4096, LLAMA3_VOCAB))),
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
    # compute-bound ops (attention): (shape) -> FLOPs, reported as TFLOP/s in their own table
    flops: object = None
    memory: object = None  # (shape) -> {"unfused": bytes, "fused": bytes}: working memory per path
    baseline: str | None = None  # the baseline's name (default "cupy" on the GPU, "reference" on the CPU)
    # the cutp.kernels switch of the GPU baseline: False (the CuPy composition), None (leave it on)
    baseline_switch: object = False

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
    return [dict(N=n, V=sz["vocab"]) for n in sz["ce_rows"]] + [dict(N=n, V=v) for n, v in sz.get("ce_llama", ())]


def _llama_rows_width(sz):
    """RMSNorm's shapes: GPT-2's widths and (cpu, gpu) Llama's model widths."""
    return _rows_width(sz) + [dict(N=n, C=c) for c in sz.get("llama_widths", ()) for n in sz["rows"][-1:]]


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


def _setup_rms(xp, s, dt, rng, backward=False):
    d = dict(x=_normal(xp, rng, (s["N"], s["C"]), dt), w=_normal(xp, rng, (s["C"],), dt, 0.1) + 1)
    if backward:
        _, d["ctx"] = ops.rmsnorm_forward(d["x"], d["w"])
        d["dy"] = _normal(xp, rng, (s["N"], s["C"]), dt)
    return d


def _setup_residual_rms(xp, s, dt, rng):
    d = _setup_rms(xp, s, dt, rng)
    d["branch"] = _normal(xp, rng, (s["N"], s["C"]), dt)
    return d


def _setup_ce(xp, s, dt, rng, stage="forward"):
    N, V = s["N"], s["V"]
    logits = _normal(xp, rng, (N, V), dt, 2.0)
    t = rng.integers(0, V, N).astype(np.int64)
    d = dict(logits=logits, targets=t if xp is np else xp.asarray(t), n_valid=V)
    if stage == "backward":
        d["row_max"], d["sum_exp"] = ops.ce_shard_forward(logits, d["targets"], V)[:2]
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
    "rmsnorm_fwd", "y = round(x * rstd) * w (HF's order), saves rstd (fp32)",
    "read x, w; write y, rstd: 2*N*C*s + C*s + N*4",
    _llama_rows_width, lambda xp, s, dt, rng: _setup_rms(xp, s, dt, rng),
    lambda d: (lambda: ops.rmsnorm_forward(d["x"], d["w"])),
    lambda s, it: 2 * s["N"] * s["C"] * it + s["C"] * it + s["N"] * STAT,
    outputs=lambda d, r: (r[0], r[1].rstd)))
_add(OpSpec(
    "residual_rmsnorm_fwd", "s = x + branch; y = rmsnorm(s) (one kernel on the GPU)",
    "read x, branch, w; write s, y, rstd: 4*N*C*s + C*s + N*4",
    _llama_rows_width, _setup_residual_rms,
    lambda d: (lambda: ops.residual_rmsnorm_forward(d["x"], d["branch"], d["w"])),
    lambda s, it: 4 * s["N"] * s["C"] * it + s["C"] * it + s["N"] * STAT,
    outputs=lambda d, r: (r[0], r[1], r[2].rstd)))
_add(OpSpec(
    "rmsnorm_bwd", "dx, dw of the RMSNorm", "read dy, x, w, rstd; write dx, dw: 3*N*C*s + 2*C*s + N*4",
    _llama_rows_width, lambda xp, s, dt, rng: _setup_rms(xp, s, dt, rng, True),
    lambda d: (lambda: ops.rmsnorm_backward(d["dy"], d["ctx"])),
    lambda s, it: 3 * s["N"] * s["C"] * it + 2 * s["C"] * it + s["N"] * STAT))
_add(OpSpec(
    "ce_fwd", "vocab-parallel CE forward, one pass: row max, sum exp, target logit, sum of logits",
    "read logits (once), targets; write 4 stats: N*V*s + N*8 + 4*N*4",
    _ce_cases, lambda xp, s, dt, rng: _setup_ce(xp, s, dt, rng, "forward"),
    lambda d: (lambda: ops.ce_shard_forward(d["logits"], d["targets"], d["n_valid"])),
    lambda s, it: s["N"] * s["V"] * it + s["N"] * (IDX + 4 * STAT)))
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

# the ops the kernel families declare with themselves (kernels/<op>.py FAMILY.bench)
for _family in families():
    for _case in _family.bench:
        _add(OpSpec(_case.name, _case.what, _case.formula, _case.cases,
                    lambda xp, s, dt, rng, c=_case: c.setup(ops, _normal, xp, s, dt, rng),
                    lambda d, c=_case: c.reference(ops, d), _case.nbytes, outputs=_case.outputs, label=_case.label))


# ---- attention: compute-bound (TFLOP/s, not GB/s) -------------------------------------------
# Shapes (B, Hkv, G, T, D): B sequences of T tokens, Hkv KV heads of G query heads each (H = Hkv * G
# query heads), head dim D. GPU: GPT-2 small's attention (12 heads of 64, T = 1024) and a GQA
# layer of 128-wide heads at T = 4096; "tiny" is for the tests (the emulated kernels).
ATTENTION_SHAPES = {
    "tiny": ((1, 2, 1, 64, 64), (1, 1, 2, 32, 128)),
    "cpu": ((4, 12, 1, 256, 64), (1, 4, 2, 512, 128)),
    "gpu": ((8, 12, 1, 1024, 64), (4, 4, 2, 4096, 128)),
}
for _name, _shapes in ATTENTION_SHAPES.items():
    SIZES[_name]["attention"] = _shapes

# FLOPs of the backward and of forward + backward in forward units: FlashAttention-2's benchmark
# convention (benchmarks/benchmark_flash_attention.py: the backward counts 2.5 forwards, its five
# T x T x D matrix products against the forward's two; the recomputation of the scores not counted).
ATTENTION_PASSES = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
F32_BYTES = 4  # the unfused path's score matrices are float32 whatever the inputs' dtype


def attention_flops(B: int, H: int, T: int, D: int, kind: str = "fwd", causal: bool = True) -> float:
    """FLOPs of causal attention over H query heads: forward 4*B*H*T^2*D (the products q k^T and
    p v, 2*T^2*D each), halved when causal (the masked half of the score matrix is skipped);
    backward 2.5 times the forward, forward + backward 3.5 times (:data:`ATTENTION_PASSES`)."""
    fwd = 4.0 * B * H * T * T * D
    return ATTENTION_PASSES[kind] * (fwd / 2 if causal else fwd)


def attention_memory(shape: dict, kind: str) -> dict:
    """Working memory (bytes, beyond the inputs and outputs) of each attention path at its peak:
    "unfused", the T x T float32 arrays of causal_attention_forward(blocked=False) and its
    backward (forward: the scores and the probabilities; backward: the probabilities the forward
    kept, dP and dS; forward + backward: the backward's three); "fused", the kernels' float32 row
    statistics, O(T) (forward: lse; backward: lse and the rows' sum(dO * O))."""
    rows = shape["B"] * shape["Hkv"] * shape["G"] * shape["T"]
    tt = rows * shape["T"] * F32_BYTES
    return {"unfused": (2 if kind == "fwd" else 3) * tt, "fused": (1 if kind == "fwd" else 2) * rows * F32_BYTES}


def _attention_cases(sz):
    return [dict(B=b, Hkv=h, G=g, T=t, D=d) for b, h, g, t, d in sz["attention"]]


def _setup_attention(xp, s, dt, rng):
    B, Hkv, G, T, D = s["B"], s["Hkv"], s["G"], s["T"], s["D"]
    return dict(q=_normal(xp, rng, (B, Hkv, G, T, D), dt), k=_normal(xp, rng, (B, Hkv, T, D), dt),
                v=_normal(xp, rng, (B, Hkv, T, D), dt), do=_normal(xp, rng, (B, Hkv, G, T, D), dt),
                scale=1.0 / D ** 0.5)


def attention_reference(kind, blocked=False):
    """The unfused path (blocked=False: the T x T composition; True: the blocked NumPy path) as
    a factory of the benchmark's callables; the backward's forward runs once, untimed."""

    def make(d):
        def fwd():
            return ops.causal_attention_forward(d["q"], d["k"], d["v"], scale=d["scale"], blocked=blocked)

        if kind == "fwd":
            return fwd
        if kind == "bwd":
            ctx = fwd()[1]
            return lambda: ops.causal_attention_backward(d["do"], ctx)

        def fwd_bwd():
            o, ctx = fwd()
            return (o, *ops.causal_attention_backward(d["do"], ctx))

        return fwd_bwd

    return make


def _attention_label(s):
    heads = f"{s['Hkv']}" if s["G"] == 1 else f"{s['Hkv']}x{s['G']}"
    return f"B{s['B']} H{heads} T{s['T']} D{s['D']}"


ATTENTION_WHAT = {"fwd": "o = softmax(scale * q k^T, causal) v, GQA (q [B, Hkv, G, T, D], k, v [B, Hkv, T, D])",
                  "bwd": "dq, dk, dv of the forward (the forward's outputs given, untimed)",
                  "fwd_bwd": "the forward, then its backward (a training step's attention)"}
for _kind in ("fwd", "bwd", "fwd_bwd"):
    _add(OpSpec(
        f"attention_{_kind}", ATTENTION_WHAT[_kind],
        f"{ATTENTION_PASSES[_kind]:g} x 4*B*H*T^2*D / 2 (H = Hkv*G query heads; causal: half the products)",
        _attention_cases, _setup_attention, attention_reference(_kind),
        # the minimal traffic: q, k, v (+ do) read once, o (+ dq, dk, dv) written once
        lambda s, it, k=_kind: it * s["B"] * s["Hkv"] * s["T"] * s["D"] * (
            2 * s["G"] + 2 if k == "fwd" else 4 * s["G"] + 4),
        outputs=(lambda d, r: (r[0],)) if _kind == "fwd" else None, label=_attention_label,
        flops=lambda s, k=_kind: attention_flops(s["B"], s["Hkv"] * s["G"], s["T"], s["D"], k),
        memory=lambda s, k=_kind: attention_memory(s, k), baseline="unfused", baseline_switch=None))
ATTENTION_OPS = tuple(f"attention_{k}" for k in ("fwd", "bwd", "fwd_bwd"))
# --ops takes these group names too
OP_GROUPS = {"attention": ATTENTION_OPS, "memory-bound": tuple(o for o in OPS if o not in ATTENTION_OPS)}
