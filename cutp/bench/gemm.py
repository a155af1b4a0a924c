"""GEMM throughput at a training step's shapes, on a GPU: TFLOP/s and % of the dense peak.

    python -m cutp.bench.gemm --preset gpt2-medium --tokens 8192 [--tp 1] [--json PATH]

The shapes are one transformer layer's four projections (fused QKV, attention output, MLP in with
SwiGLU's [gate | up], MLP out) and the LM head, each forward (``y = x W``), input gradient
(``dx = dy W^T``) and weight gradient (``dW += x^T dy`` into the float32 main_grad), as cutp's
layers call :func:`cutp.ops.gemm` (cuBLAS with float32 accumulation), a layer's products counted
n_layer times. Measured with CUDA events after warm-up calls, in bfloat16, in float32 and in
float32 with TF32 (``--allow-tf32``), with CuPy's own matmul on the bfloat16 forward shapes beside
for comparison. Dense models only (an MoE model's experts run other shapes).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import ml_dtypes
import numpy as np

from .. import ops
from ..models import GPTConfig
from .common import gpu_info, peak_tflops


@dataclass(frozen=True)
class Gemm:
    """``op(a) @ op(b)``, [m, n] from k, as cutp.ops.gemm takes it; `count` calls per step."""

    name: str
    m: int
    n: int
    k: int
    trans_a: bool = False
    trans_b: bool = False
    accumulate: bool = False  # into a float32 main_grad (beta = 1)
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count


def step_gemms(config: GPTConfig, tokens: int, tp: int = 1) -> list[Gemm]:
    """The GEMMs of one training step of `config` on one TP rank, for `tokens` tokens per forward."""
    if config.n_experts:
        raise ValueError("step_gemms: dense models only (an MoE layer's experts see other shapes)")
    h, heads = config.n_embd, config.n_head
    hd = config.head_dim or h // heads
    kv = config.n_kv_head or heads
    ffn = config.mlp_hidden or 4 * h
    projections = [("qkv", h, (heads + 2 * kv) * hd // tp), ("attn_out", heads * hd // tp, h),
                   ("mlp_in", h, (2 if config.mlp in ("swiglu", "geglu") else 1) * ffn // tp), ("mlp_out", ffn // tp, h)]
    out = []
    for name, k_in, n_out in projections:
        L = config.n_layer
        out += [Gemm(f"{name} forward", tokens, n_out, k_in, count=L),
                Gemm(f"{name} dx", tokens, k_in, n_out, trans_b=True, count=L),
                Gemm(f"{name} dW", k_in, n_out, tokens, trans_a=True, accumulate=True, count=L)]
    vocab = config.padded_vocab(tp) // tp
    out += [Gemm("lm_head forward", tokens, vocab, h, trans_b=True),
            Gemm("lm_head dx", tokens, h, vocab),
            Gemm("lm_head dW", vocab, h, tokens, trans_a=True, accumulate=True)]
    return out


def operand_shapes(g: Gemm) -> tuple[tuple[int, int], tuple[int, int]]:
    """The row-major shapes of a and b that give op(a) [m, k] and op(b) [k, n]."""
    return ((g.k, g.m) if g.trans_a else (g.m, g.k)), ((g.n, g.k) if g.trans_b else (g.k, g.n))


def throughput(flops: float, seconds: float, peak: float | None) -> dict:
    """TFLOP/s and its percentage of `peak` (TFLOP/s; None: unknown)."""
    tflops = flops / seconds / 1e12 if seconds > 0 else float("nan")
    return {"tflops": round(tflops, 1), "pct_peak": round(100.0 * tflops / peak, 1) if peak else None,
            "peak_tflops": peak}


def line(label: str, r: dict) -> str:
    pct = f" ({r['pct_peak']:.0f}% of the dense peak {r['peak_tflops']:g})" if r["pct_peak"] is not None else \
        " (no peak known for this GPU)"
    return f"{label}: {r['tflops']:.1f} TFLOP/s{pct}"


def time_gemm(cupy, g: Gemm, dtype, repeat: int, warmup: int, use_cupy_matmul: bool = False) -> float:
    """Seconds per call of `g` in `dtype` on the current GPU (CUDA events around `repeat` calls)."""
    sa, sb = operand_shapes(g)
    a = (0.02 * cupy.random.standard_normal(sa, dtype=np.float32)).astype(dtype)
    b = (0.02 * cupy.random.standard_normal(sb, dtype=np.float32)).astype(dtype)
    out = cupy.zeros((g.m, g.n), np.float32 if g.accumulate else dtype)

    def call():
        if use_cupy_matmul:
            return cupy.matmul(a.T if g.trans_a else a, b.T if g.trans_b else b, out=out)
        return ops.gemm(a, b, trans_a=g.trans_a, trans_b=g.trans_b, out=out, accumulate=g.accumulate)

    for _ in range(warmup):
        call()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeat):
        call()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / repeat


def measure(config: GPTConfig, tokens: int, tp: int = 1, repeat: int = 10, warmup: int = 3) -> dict:
    import cupy  # optional dependency: a GPU machine's

    gemms = step_gemms(config, tokens, tp)
    peak = gpu_info(cupy)["peak"]
    result = {"gpu": gpu_info(cupy)["gpu"], "tokens": tokens, "tp": tp, "per_gemm": {}}
    tf32_before = ops.tf32_allowed()
    try:
        for label, dtype, tf32 in (("bfloat16", np.dtype(ml_dtypes.bfloat16), False),
                                   ("float32", np.dtype(np.float32), False), ("float32+tf32", np.dtype(np.float32), True)):
            ops.allow_tf32(tf32)
            seconds = {g.name: time_gemm(cupy, g, dtype, repeat, warmup) for g in gemms}
            total = sum(seconds[g.name] * g.count for g in gemms)
            result[label] = throughput(sum(g.flops for g in gemms), total, peak_tflops(peak, dtype.name, tf32=tf32))
            result["per_gemm"][label] = {g.name: throughput(g.flops / g.count, seconds[g.name], None)["tflops"]
                                         for g in gemms}
        forward = [g for g in gemms if g.name.endswith("forward") and not g.trans_b]
        bf16 = np.dtype(ml_dtypes.bfloat16)
        t = sum(time_gemm(cupy, g, bf16, repeat, warmup, use_cupy_matmul=True) * g.count for g in forward)
        t_cutp = sum(time_gemm(cupy, g, bf16, repeat, warmup) * g.count for g in forward)
        flops = sum(g.flops for g in forward)
        result["cupy.matmul bfloat16 (forward shapes)"] = throughput(flops, t, peak_tflops(peak, "bfloat16"))
        result["cutp.ops.gemm bfloat16 (forward shapes)"] = throughput(flops, t_cutp, peak_tflops(peak, "bfloat16"))
    finally:
        ops.allow_tf32(tf32_before)
    return result


LABELS = ("bfloat16", "float32", "float32+tf32", "cutp.ops.gemm bfloat16 (forward shapes)",
          "cupy.matmul bfloat16 (forward shapes)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutp.bench.gemm", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt2-medium")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per forward (micro-batch x sequence)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    config = GPTConfig.preset(args.preset)
    r = measure(config, args.tokens, args.tp, args.repeat, args.warmup)
    print(f"GEMMs of a {args.preset} step, {args.tokens} tokens, tp {args.tp}, on {r['gpu']}:")
    for label in LABELS:
        print("  " + line(label, r[label]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**r, "gemms": [asdict(g) for g in step_gemms(config, args.tokens, args.tp)]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
