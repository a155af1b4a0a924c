"""`python -m cutp bench moe`: the grouped expert path against the dense SwiGLU MLP of the same
active width, on one rank (issue 40).

    python -m cutp bench moe                      # 4,096 tokens, hidden 1,024, 256 experts of 256, top-8
    python -m cutp bench moe --tokens 512 --experts 16

The MoE layer (router, softmax top-k, the grouped experts of `moe_grouped`, the combine) and a
dense SwiGLU MLP of width top_k x expert width (the FLOPs a token spends in the experts) each run
forward and backward on the same random input, their parameters in the optimizer's flat buffers
as in training (so the experts' stacked weights are views, not copies); reported per path: the time of one forward +
backward (median), the ratio to the dense MLP, and the peak memory the call allocated beyond its
inputs and weights (host: tracemalloc, which NumPy reports to; GPU: the memory pool's peak),
with the tokens x top-k x hidden bytes beside it (what O(tokens x k) means here).
"""
from __future__ import annotations

import numpy as np

import cutp
from ..optim.flat import FlatParameters
from ..tensor_parallel.moe import MoEMLP
from ..tensor_parallel.transformer import ParallelMLP
from ..train.memory import ActivationPeak
from ..train.reporting import Report, human_bytes
from .common import time_cpu


def add_arguments(p) -> None:
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--expert-width", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])


def _peak(ctx, fn) -> int:
    """Bytes allocated at the peak of one fn() beyond what was allocated before it (on a GPU the
    pool's used bytes at each allocation: its total_bytes also counts blocks cached by earlier calls)."""
    with ActivationPeak(ctx) as peak:
        fn()
    return peak.bytes


def run(args) -> Report:
    dtype = np.dtype(args.dtype).type
    ctx = cutp.init(device=args.device)
    N, h, E, F, k = args.tokens, args.hidden, args.experts, args.expert_width, args.top_k
    moe = MoEMLP(ctx, h, n_experts=E, top_k=k, ffn=F, aux_loss_coeff=0.0, renormalize=True, name="moe", bias=False,
                 dtype=dtype, kind="swiglu")
    dense = ParallelMLP(ctx, h, k * F, name="dense", bias=False, dtype=dtype, kind="swiglu")
    for m in (moe, dense):  # training's layout: the experts' stacked weights are views of the flat buffer
        FlatParameters(m.parameters())
    x = ctx.asarray(np.random.default_rng(0).standard_normal((1, N, h)).astype(dtype))
    dy = ctx.asarray(np.random.default_rng(1).standard_normal((1, N, h)).astype(dtype) * 1e-3)
    report = Report("moe", {"tokens": N, "hidden": h, "experts": E, "expert_width": F, "top_k": k,
                            "dtype": args.dtype, "device": ctx.device})
    table = report.table("moe", [("path", "path", "", "<"), ("ms", "fwd+bwd ms", ".1f"),
                                 ("ratio", "x dense", ".2f"), ("peak", "peak memory"), ("rows", "assignments")])
    times = {}
    for name, layer in (("dense SwiGLU", dense), ("grouped experts", moe)):
        def step(layer=layer):
            layer.forward(x)
            layer.backward(dy)
        t = time_cpu(step, warmup=1, repeat=args.repeat)
        times[name] = t.median
        peak = _peak(ctx, step)
        rows = None
        if layer is moe:
            counts = moe.last["assigned"]
            rows = f"{int(counts.min())}..{int(counts.max())} per expert"
        table.add(path=name, ms=1e3 * t.median, ratio=t.median / times["dense SwiGLU"], peak=human_bytes(peak),
                  rows=rows)
    report.notes.append(f"tokens x top-k x hidden = {human_bytes(N * k * h * np.dtype(dtype).itemsize)} "
                        f"(one copy of the routed rows); dense width {k * F}")
    return report
