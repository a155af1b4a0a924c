"""The planner's multi-head latent attention (issue 40): what cutp's MLA keeps for backward, counted
from its caches after a training forward on shape-only arrays (the rope tables, the model's, left
out), equals `cutp.plan.mla.mla_attention_bytes` to the byte at tp 1 and 2, with and without
sequence parallelism, the low-rank query or not, dropout, selective recomputation, cp 2 ring and
all-to-all, float32,
bfloat16 and float64; the planner's per-layer figure of an MLA model is Korthikanti et al.'s with
that in place of multi-head attention's share; the CP traffic formula counts MLA's head dims."""
import dataclasses

import numpy as np
import pytest

from cutp.comm.shape_only import ShapeOnlyContext
from cutp.models import GPT, GPTConfig
from cutp.plan import layout
from cutp.plan.mla import mha_attention_bytes, mla_attention_bytes
from cutp.plan.context import cp_comm_bytes
from cutp.plan.run import ITEMSIZE, planned_step
from cutp.train.memory import cached_activation_bytes

# DeepSeek-V3-shaped, dense: q's and k's head dim 24 apart from v's 16
MLA = GPTConfig(n_layer=1, n_head=8, n_embd=64, mlp_hidden=96, vocab_size=128, block_size=64, norm="rmsnorm",
                positions="rope", mlp="swiglu", bias=False, tie_embeddings=False, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, family="deepseek_v3")


def _counted(config, *, tp=1, sp=False, cp=1, cp_comm="ring", recompute="none", b=2, s=32):
    ctx = ShapeOnlyContext(tp=tp, cp=cp, rank=0, device="cpu")
    model = GPT(ctx, config, init=False)
    model.train()
    model.set_sequence_parallel(sp)
    model.set_recompute(recompute)
    if cp > 1:
        model.set_context_parallel_comm(cp_comm)
    idx = np.zeros((b, s), np.int64)
    model.forward(idx, idx)
    tables = list(model.rotary)
    return cached_activation_bytes(model.layers[0].attn, exclude=[p.data for p in model.parameters()] + tables)


CASES = [dict(), dict(tp=2), dict(tp=2, sp=True), dict(tp=2, sp=True, q_lora_rank=None), dict(q_lora_rank=None),
         dict(tp=2, dropout=0.1), dict(tp=2, dropout=0.1, recompute="selective"), dict(cp=2),
         dict(tp=2, sp=True, cp=2, recompute="selective"), dict(cp=2, dropout=0.1), dict(cp=2, cp_comm="a2a"),
         dict(tp=2, cp=2, cp_comm="a2a", dropout=0.1, recompute="selective")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_mla_keeps_what_the_planner_s_formula_says(dtype):
    for case in CASES:
        case = dict(case)
        layout_kw = {k: case.pop(k) for k in ("tp", "sp", "cp", "cp_comm", "recompute") if k in case}
        config = dataclasses.replace(MLA, dtype=dtype, **case)
        counted = _counted(config, **layout_kw)
        tp, cp = layout_kw.get("tp", 1), layout_kw.get("cp", 1)
        planned = mla_attention_bytes(config, 32 // cp, 2, tp, ITEMSIZE[dtype], layout_kw.get("sp", False), cp=cp,
                                      cp_comm=layout_kw.get("cp_comm", "ring"),
                                      recompute=layout_kw.get("recompute", "none"))
        assert counted == planned, (dtype, layout_kw, case, counted, planned)


def test_an_mla_layer_is_planned_with_its_own_attention():
    """Korthikanti et al.'s per-layer figure with MLA's attention in place of multi-head attention's
    share; full recomputation keeps the layer's input whatever its attention."""
    mha = dataclasses.replace(MLA, q_lora_rank=None, kv_lora_rank=None, qk_nope_head_dim=None,
                              qk_rope_head_dim=None, v_head_dim=None, family=None)
    for mode, sp in (("none", False), ("selective", True), ("full", True)):
        got = layout.layer_activation_bytes(MLA, 64, 2, 2, 2, mode, sp)
        plain = layout.layer_activation_bytes(mha, 64, 2, 2, 2, mode, sp)
        if mode == "full":
            assert got == plain
            continue
        share = mha_attention_bytes(64, 2, 64, 8, 2, 2, mode, sp)
        assert 0 < share < plain and got == plain - share + mla_attention_bytes(MLA, 64, 2, 2, 2, sp, recompute=mode)
    # at tp 1: Table 2's attention block (11 s b h + 5 a s^2 b) but its residual dropout's mask (s b h)
    assert mha_attention_bytes(64, 2, 64, 8, 1, 2, "none", False) == 64 * 2 * 64 * 10 + 5 * 8 * 64 * 64 * 2


@pytest.mark.parametrize("comm", ["ring", "a2a"])
def test_the_cp_formula_counts_what_mla_sends(comm):
    """Every head's k (d_qk) and v (d_v) round the ring, or q, k, v and o through the all-to-all:
    the formula equals what the planned step's counters count."""
    got = planned_step(MLA, tp=2, cp=2, cp_comm=comm, micro_batch=2, seq_len=32, device="cpu")["comm"]
    sent = got["cp.send" if comm == "ring" else "cp.all_to_all"]
    formula = cp_comm_bytes(MLA, s=32, b=2, tp=2, cp=2, cp_comm=comm, layers=1, accum=1, itemsize=4)
    assert formula["bytes"] == sent["bytes"] > 0 and formula["calls"] == sent["calls"]


@pytest.mark.parametrize("sp, q_lora_rank", [(False, 32), (True, None)])
def test_the_tp_collectives_of_mla_are_planned_as_the_step_counts_them(sp, q_lora_rank):
    """One all-reduce of b s h forward and the input gradients of q_b (or q_proj), kv_b and the
    rope key backward per MLA layer (under SP: a reduce-scatter and an all-gather each), and the
    down-projections' and their norms' gradients summed over TP under SP: formula = counted."""
    c = dataclasses.replace(MLA, q_lora_rank=q_lora_rank, n_layer=2)
    kw = dict(tp=2, dp=1, micro_batch=2, seq_len=32, accum=2, dtype="float32", sequence_parallel=sp)
    on = planned_step(c, device="cpu", **kw)["comm"]
    plan = layout.plan(c, config=c, device="cpu", **kw)
    act, ce, grads = plan["tp_allreduce"], plan["ce_allreduce"], plan["tp_grad_allreduce"]
    if sp:
        assert on["tp.reduce_scatter"]["calls"] == on["tp.all_gather"]["calls"] == act["calls"]
        assert on["tp.reduce_scatter"]["elements"] == act["elements"] == 2 * on["tp.all_gather"]["elements"]
        act = {"calls": 0, "elements": 0}
    assert grads["elements"] > 2 * sp * 64 * 16  # (under SP: kv_a's weights at least)
    assert on["tp.all_reduce"]["calls"] == act["calls"] + ce["calls"] + grads["calls"]
    assert on["tp.all_reduce"]["elements"] == act["elements"] + ce["elements"] + grads["elements"]
