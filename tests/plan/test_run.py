"""The planned step (cutp.plan.run): cutp's own step on shape-only arrays. Its counters see the
collectives the step makes: they equal the planner's communication formulas."""
import pytest

from cutp.models import GPTConfig
from cutp.plan import layout
from cutp.plan.run import planned_parameters, planned_step


@pytest.mark.parametrize("tp,dp,dist,sp,accum", [(2, 2, False, False, 2), (4, 2, True, False, 1), (2, 1, False, True, 2)])
def test_the_planned_communication_is_what_the_step_counts(tp, dp, dist, sp, accum):
    c = GPTConfig.preset("tiny", n_layer=2)
    kw = dict(tp=tp, dp=dp, micro_batch=2, seq_len=64, accum=accum, dtype="bfloat16", distributed_optimizer=dist,
              sequence_parallel=sp)
    counted = planned_step(c, device="cuda", **kw)["comm"]
    plan = layout.plan(c, config=c, **kw)
    on, act, ce, grads = counted, plan["tp_allreduce"], plan["ce_allreduce"], plan["tp_grad_allreduce"]
    # besides the activations and cross-entropy statistics: the gradient norm's all-reduce of 2
    # float64 and, under sequence parallelism, the replicated parameters used on sequence shards
    assert grads["calls"] == 1 + sp and (grads["elements"] > 2) == sp
    if sp:  # each activation all-reduce is an all-gather of the shards and a reduce-scatter of the whole
        assert on["tp.reduce_scatter"]["calls"] == on["tp.all_gather"]["calls"] == act["calls"]
        assert on["tp.reduce_scatter"]["elements"] == act["elements"] == tp * on["tp.all_gather"]["elements"]
        assert on["tp.all_reduce"]["calls"] == ce["calls"] + grads["calls"]
        assert on["tp.all_reduce"]["elements"] == ce["elements"] + grads["elements"]
        assert on["tp.all_reduce"]["bytes"] == ce["bytes"] + grads["bytes"]
    else:
        assert on["tp.all_reduce"]["calls"] == act["calls"] + ce["calls"] + grads["calls"]
        assert on["tp.all_reduce"]["elements"] == act["elements"] + ce["elements"] + grads["elements"]
        assert on["tp.all_reduce"]["bytes"] == act["bytes"] + ce["bytes"] + grads["bytes"]
    if dist:
        assert on["dp.reduce_scatter"]["elements"] == plan["dp_reduce_scatter"]["elements"]
        assert on["dp.all_gather"]["elements"] == plan["dp_all_gather"]["elements"]
    elif dp > 1:
        assert on["dp.all_reduce"]["elements"] == plan["dp_allreduce"]["elements"]
        assert on["dp.all_reduce"]["bytes"] == plan["dp_allreduce"]["bytes"]


def test_the_plan_of_a_stage_is_that_stages_own_model():
    c = GPTConfig.preset("tiny", n_layer=4)
    whole = planned_parameters(c, tp=2, rank=1)
    stages = [planned_parameters(c, tp=2, pp=2, rank=s * 2 + 1) for s in range(2)]
    first, last = ({p.name for p in st} for st in stages)
    assert first | last == {p.name for p in whole} and len(first & last) == 1  # the tied embedding, on both ends
    shared = next(iter(first & last))
    assert sum(p.numel for p in whole) == sum(p.numel for st in stages for p in st) - next(
        p.numel for p in whole if p.name == shared)


# (gemma-tiny: its four norms per layer, post-branch ones included; the window no shorter than the
# sequence, which the planner's formulas do not read)
GEMMA_TINY = dict(n_layer=2, layer_types=("sliding_attention", "full_attention"), sliding_window=128)


@pytest.mark.parametrize("preset, over, sp", [("qwen3-tiny", dict(n_layer=2), False),
                                              ("qwen3-tiny", dict(n_layer=2), True),
                                              ("gemma-tiny", GEMMA_TINY, True)])
def test_qwen3s_qk_norm_gradients_are_planned_as_the_step_reduces_them(preset, over, sp):
    """The QK-norms' weights (replicated, each TP rank normalising its own heads) are summed over TP
    every step, with or without sequence parallelism: counted = the planner's formula."""
    c = GPTConfig.preset(preset, **over)
    kw = dict(tp=2, dp=1, micro_batch=2, seq_len=32, dtype="float32", sequence_parallel=sp)
    counted = planned_step(c, device="cuda", **kw)["comm"]["tp.all_reduce"]
    plan = layout.plan(c, config=c, **kw)
    grads = plan["tp_grad_allreduce"]
    assert grads["calls"] == 2 and grads["elements"] >= 2 + 2 * 2 * c.head_size  # (the norm's 2 float64 too)
    planned = grads["elements"] + plan["ce_allreduce"]["elements"] + (0 if sp else plan["tp_allreduce"]["elements"])
    assert counted["elements"] == planned
    assert plan["params_per_gpu"] == sum(p.numel for p in planned_parameters(c, tp=2))
