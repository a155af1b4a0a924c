"""cutp.bench.gemm's CPU side: the step's GEMM shapes are the model's own weights (each 2-D
parameter but the position and untied embedding tables, once per layer, at every TP size), their
FLOPs are 6 x tokens x those weights, the operands shapes give op(a) [m, k] and op(b) [k, n], and
the report line names the peak it divides by. (The timing needs a GPU: `make gpu-check`.)"""
from collections import Counter

import numpy as np
import pytest

from cutp.bench.gemm import line, operand_shapes, step_gemms, throughput
from cutp.models import GPTConfig
from cutp.plan.run import planned_parameters


@pytest.mark.parametrize("preset,tp", [("tiny", 1), ("tiny", 2), ("llama-tiny", 1), ("llama-tiny", 2)])
def test_the_step_gemms_are_the_models_weights(preset, tp):
    config = GPTConfig.preset(preset, n_layer=2)
    tokens = 48
    gemms = step_gemms(config, tokens, tp)
    weights = Counter()
    for g in gemms:
        if g.name.endswith("forward"):
            weights[(g.n, g.k) if g.trans_b else (g.k, g.n)] += g.count
    params = Counter(p.shape for p in planned_parameters(config, tp=tp) if len(p.shape) == 2)
    if config.positions == "learned":
        params[(config.block_size, config.n_embd)] -= 1
    if not config.tie_embeddings:  # the input embedding's table: a gather, no GEMM
        params[(config.padded_vocab(tp) // tp, config.n_embd)] -= 1
    assert +params == weights
    n_weights = sum(a * b * c for (a, b), c in weights.items())
    assert sum(g.flops for g in gemms) == 6 * tokens * n_weights
    for g in gemms:
        sa, sb = operand_shapes(g)
        a, b = np.zeros(sa), np.zeros(sb)  # (the shapes are checked; zeros: no garbage values for matmul to warn about)
        assert ((a.T if g.trans_a else a) @ (b.T if g.trans_b else b)).shape == (g.m, g.n)
    assert all(g.accumulate == g.name.endswith("dW") for g in gemms)


def test_the_report_line_says_tflops_and_the_peak():
    r = throughput(2e12, 0.01, 989.4)
    assert r == {"tflops": 200.0, "pct_peak": 20.2, "peak_tflops": 989.4}
    assert line("bfloat16", r) == "bfloat16: 200.0 TFLOP/s (20% of the dense peak 989.4)"
    assert line("float32", throughput(1e12, 1.0, None)) == "float32: 1.0 TFLOP/s (no peak known for this GPU)"
    with pytest.raises(ValueError, match="dense models only"):
        step_gemms(GPTConfig.preset("tiny-moe"), 8)
