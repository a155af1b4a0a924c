"""The planner's context parallelism (`python -m cutp plan --cp N --cp-comm ring|a2a`).

The ring's and the all-to-all's bytes by formula (cutp.plan.context) equal what the counters
count when the planner runs cutp's own step at that cp; the activations per rank shrink with
cp; the gradients and ZeRO's shards are over DP x CP; --search tries the CP sizes up to --cp;
the refusals name the planner's flags.
"""
import dataclasses

import pytest

from cutp.models import GPTConfig
from cutp.plan import cli
from cutp.plan.context import cp_comm_bytes
from cutp.plan.layout import pick_arch, plan
from cutp.plan.run import planned_step

TINY = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=512, block_size=1024, dtype="float32")


@pytest.mark.parametrize("comm,recompute,cp", [("ring", "none", 2), ("a2a", "none", 2), ("ring", "full", 2),
                                               ("a2a", "full", 2), ("a2a", "none", 4)])  # cp 4: 2 copies of a KV head
def test_the_formula_counts_what_the_planned_step_sends(comm, recompute, cp):
    a = TINY
    got = planned_step(TINY, cp=cp, cp_comm=comm, micro_batch=2, seq_len=256, device="cpu", recompute=recompute,
                       recompute_layers=1 if recompute == "full" else None)["comm"]
    sent = got["cp.send" if comm == "ring" else "cp.all_to_all"]
    formula = cp_comm_bytes(a, s=256, b=2, tp=1, cp=cp, cp_comm=comm, layers=2, accum=1, itemsize=4,
                            recomputed=int(recompute == "full"))
    assert formula["bytes"] == sent["bytes"] > 0 and formula["calls"] == sent["calls"]
    assert got.get("cp.recv", {"bytes": 0})["bytes"] == (sent["bytes"] if comm == "ring" else 0)  # as much arrives


def test_the_ring_with_dropout_is_planned():
    """The ring draws each tile's dropout mask at its global positions (`dropout_mask_at` copies the
    counters with np.array(copy=True)): the shape-only arrays follow that path too."""
    drop = dataclasses.replace(TINY, dropout=0.1)
    got = planned_step(drop, cp=2, cp_comm="ring", micro_batch=2, seq_len=64, device="cpu")
    plain = planned_step(TINY, cp=2, cp_comm="ring", micro_batch=2, seq_len=64, device="cpu")
    assert got["comm"]["cp.send"] == plain["comm"]["cp.send"]
    assert got["left"] == 0 and sum(got["stash_per_layer"]) > sum(plain["stash_per_layer"])  # the masks kept


def test_activations_per_rank_shrink_with_cp_and_the_state_shards_over_dp_x_cp():
    a = pick_arch("8B")
    one = plan(a, tp=8, dp=1, micro_batch=1, seq_len=131072, sequence_parallel=True, distributed_optimizer=True)
    eight = plan(a, tp=8, dp=1, cp=8, micro_batch=1, seq_len=131072, sequence_parallel=True,
                 distributed_optimizer=True)
    assert eight["act_bytes"] <= one["act_bytes"] / 8
    assert eight["optim_bytes"] * 8 == pytest.approx(one["optim_bytes"], rel=1e-3)  # ZeRO over dp x cp = 8
    assert eight["dp_reduce_scatter"]["calls"] == 1 and one["dp_reduce_scatter"]["calls"] == 0
    assert eight["cp_exchange"]["calls"] == 32 * (7 + 7 + 8)


def test_the_command_line_plans_and_searches_cp_and_refuses_with_its_flags(capsys):
    assert cli.main(["--params", "8B", "--seq-len", "131072", "--tp", "8", "--cp", "8", "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    assert "tp 8 x cp 8 (ring) x dp 1 = 64 GPUs" in out and "CP ring send/recv (K,V; dK,dV)" in out
    assert cli.main(["--params", "8B", "--seq-len", "32768", "--tp", "8", "--cp", "4", "--pp", "2", "--accum", "8",
                     "--sequence-parallel"]) == 0  # a stage sends its CP rank's SP share: 32768 / (cp 4 x tp 8)
    assert "8.39 MB each way ([1, 32768/32, 4096] bfloat16)" in capsys.readouterr().out
    assert cli.main(["--params", "8B", "--seq-len", "131072", "--search", "--cp", "8", "--gpus", "64",
                     "--batch-size", "16", "--gpu-memory", "80", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | 8 | 1 | 32 | 64 (1) | none |" in out  # tp 8 x cp 8: no recomputation at 128K
    assert cli.main(["--params", "8B", "--seq-len", "1000", "--cp", "8"]) == 2
    assert "--seq-len 1000 is not divisible by 2*cp = 16" in capsys.readouterr().err
    assert cli.main(["--params", "8B", "--tp", "8", "--cp", "8", "--cp-comm", "a2a"]) == 2  # 4 query heads a TP rank
    assert ("--cp-comm a2a splits each TP rank's query heads over the CP ranks, with their KV heads (or copies of "
            "one): n_head 32 and n_kv_head 8 / tp 8 leave 4 query and 1 KV head(s) a rank, and --cp 8 does not divide "
            "4; use a --cp from [1, 2, 4] or --cp-comm ring" in capsys.readouterr().err)


def test_an_moe_model_at_cp_2_plans_half_the_all_to_all_and_its_experts_state_over_expert_dp_x_cp(capsys):
    config = GPTConfig.preset("tiny-moe")
    a = config
    kw = dict(tp=1, ep=2, micro_batch=2, seq_len=64, config=config, dtype="float32", distributed_optimizer=True)
    one, two = plan(a, dp=2, **kw), plan(a, dp=2, cp=2, **kw)
    assert two["ep_all_to_all"]["bytes"] * 2 == one["ep_all_to_all"]["bytes"] > 0  # each rank routes s / cp tokens
    # ZeRO: the dense state over DP x CP, the experts' over expert-DP x CP: as dp 4's (4 and 2 shards)
    assert two["optim_bytes"] == plan(a, dp=4, **kw)["optim_bytes"] < one["optim_bytes"]
    assert cli.main(["--preset", "tiny-moe", "--tp", "1", "--dp", "2", "--ep", "2", "--cp", "2",
                     "--seq-len", "64"]) == 0
    assert "tp 1 x cp 2 (ring) x dp 2 = 4 GPUs" in capsys.readouterr().out


def test_the_search_leaves_out_the_tp_x_cp_that_training_refuses():
    # seq 1000 splits into 2cp chunks at cp <= 4, but 1000 / cp over tp with sequence parallelism
    # fails at tp 8 x cp 2 and tp 4 x cp 4 (the search once stopped there with the refusal); the
    # all-to-all at tp 8 (4 query heads a TP rank) takes cp <= 4
    from cutp.plan import search as plan_search

    a = pick_arch("8B")
    rows = plan_search.search(a, gpus=64, capacities=(80e9,), seq_len=1000, batch_size=16, max_cp=8)
    pairs = {(r["tp"], r["cp"]) for r in rows}
    assert (8, 1) in pairs and (4, 2) in pairs and (1, 4) in pairs
    assert not {(8, 2), (8, 4), (4, 4), (1, 8)} & pairs
    rows = plan_search.search(a, gpus=64, capacities=(80e9,), seq_len=131072, batch_size=16, max_cp=8,
                              cp_comm="a2a")
    assert max(r["cp"] for r in rows if r["tp"] == 8) == 4
    assert max(r["cp"] for r in rows if r["tp"] == 1) == 8
