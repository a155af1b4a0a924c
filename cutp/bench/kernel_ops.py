"""The ops `python -m cutp bench kernels` measures: shapes per size preset, inputs, reference, bytes moved.

Each :class:`OpSpec` says how to make an op's inputs on the device (NumPy or CuPy arrays), run
its reference (cutp.ops itself), count the bytes it must move at least (each input read once,
each output written once) and read its outputs for the check of a variant against the
reference. ``cutp.bench.kernels`` runs them; ``cutp.bench.kernel_variants`` registers the CUDA
kernels of ``cutp.kernels`` as variants of these ops, by name.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops

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
