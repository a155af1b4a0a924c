"""The MoE families on every layout (issue 40's acceptance): DeepSeek-V3 (MLA, DeepSeekMoE routing,
the correction bias), a DeepSeekMoE-routed model on Llama's attention (where MLA has no sequence
or context parallelism yet) and Qwen3-MoE, float64, 3 steps: the losses (the sequence-wise
balance loss's too), every gradient (unless ZeRO kept only its shard) and every parameter, the
correction biases included, equal one rank's within 1e-10.

    ep 4; pp 2 (x ep 2); ep 2 with tp 2 + SP; dp 2 x ep 2 + ZeRO-1 and ZeRO-3 (the bias a buffer
    outside the units); cp 2 (ring, and all-to-all x tp 2)

Behind the marker `moe_full` (pytest -m moe_full tests/models: 2 minutes on 2 busy cores);
`make test` runs tests/models/test_families.py's MoE cases (tp2 x dp2 x ep2 + SP + ZeRO-1, tp2 x
pp2 with MLA, dp2 x ep2 x cp2 with the bias and the sequence-wise loss).
"""
import pytest

from tests.mpirun import run_mpi

SEQ = dict(moe_seq_aux_loss=0.01)
CASES = [dict(family="deepseek_v3", dp=4, ep=4, micro=1, **SEQ),
         dict(family="deepseek_v3", dp=2, ep=2, pp=2, micro=1),
         dict(family="deepseek_v3", tp=2, dp=2, ep=2, zero=3, micro=1, **SEQ),
         dict(family="deepseek_moe", tp=2, dp=2, ep=2, sp=True, micro=1, **SEQ),
         dict(family="deepseek_moe", cp=2, dp=2, zero=1, micro=1, **SEQ),
         dict(family="deepseek_moe", tp=2, cp=2, cp_comm="a2a", sp=True, **SEQ),
         dict(family="qwen3_moe", dp=4, ep=4, micro=1, **SEQ),
         dict(family="qwen3_moe", dp=2, ep=2, pp=2, micro=1, schedule="interleaved", virtual=2, **SEQ),
         dict(family="qwen3_moe", tp=2, dp=2, ep=2, zero=3, micro=1),
         dict(family="qwen3_moe", cp=2, dp=2, ep=2, micro=1, **SEQ)]


@pytest.mark.moe_full
def test_the_moe_families_on_every_layout_equal_one_rank():
    run_mpi(4, "tests.models.test_families:_worker_layouts_equal_one_rank", CASES, 3, timeout=1200)
