"""The ops `python -m cutp bench kernels` measures: shapes per size preset, inputs, reference, bytes moved.

Each :class:`OpSpec` says how to make an op's inputs on the device (NumPy or CuPy arrays), run
its reference (cutp.ops itself), count the bytes it must move at least (each input read once,
each output written once) and read its outputs for the check of a variant against the
reference. The compute-bound attention ops also count their FLOPs (:func:`attention_flops`)
and the working memory of the unfused and fused paths (:func:`attention_memory`).
``cutp.bench.kernels`` runs them; ``cutp.bench.kernel_variants`` registers the CUDA kernels of
``cutp.kernels`` as variants of these ops, by name. A kernel family may declare its ops with
itself (``kernels/<op>.py`` FAMILY.bench, :class:`cutp.kernels.family.BenchCase`): every
memory-bound op is declared so and added here; the compute-bound attention ops (FLOPs, working
memory, their unfused baseline) are below.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops
from ..kernels.family import families

WIDTHS = (768, 1024, 1280, 1600)
VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128
LLAMA3_VOCAB = 128256  # Llama 3's vocabulary (a multiple of 128 and of 8: tp=8 shards of 16,032)

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
    baseline: str | None = None  # the baseline's name (default "cupy" on the GPU, "cutp.ops" on the CPU)
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


OPS: dict[str, OpSpec] = {}


def _add(spec: OpSpec):
    OPS[spec.name] = spec


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
