"""`cutp bench plan --pp`: each pipeline stage's memory measured against the plan (parameters,
gradients and optimizer state exactly, the activation peak and each layer's stash within
test_memory's 10%, the micro-batches in flight exactly), the schedules' in-flight counts and
bubble, the layout search (issue 15: TP=8 alone does not fit Llama-2-70B on 80 GB GPUs, TP=8 x
PP=4 with the distributed optimizer does), the command line and its refusals."""
from __future__ import annotations

import json
import re

import pytest
from mpi4py import MPI

from cutp import train
from cutp.plan import layout as plan, pipeline as plan_pp, search as plan_search
from cutp.plan.run import planned_step
from cutp.runtime.mesh import Mesh
from cutp.bench.__main__ import build_parser
from cutp.bench.__main__ import main as bench_main
from cutp.bench.__main__ import run as bench_run
from cutp.models import GPTConfig
from cutp.bench.model import random_tokens
from cutp.runtime.errors import ConfigError
from cutp.train.memory import ActivationPeak, memory_record, stash_per_layer
from cutp.train.pipeline import pipeline_bubble
from cutp.train.pipeline import plan as plan_of
from tests.mpirun import run_mpi
from tests.plan.test_memory import STATE, TOLERANCE


# ---- measured against planned, per stage --------------------------------------------------------
def _worker_stages_measured_equal_planned(cases):
    comm = MPI.COMM_WORLD
    for case in cases:
        tp, pp, B, T, m, dp = case["tp"], case["pp"], case["B"], case["T"], case["m"], case.get("dp", 1)
        layout = {k: case[k] for k in ("sequence_parallel", "recompute", "distributed_optimizer") if k in case}
        pp_layers = case.get("pp_layers")
        virtual = case.get("virtual", 1)
        finetune = case.get("finetune", {})  # what trains (LoRA, --freeze): each stage's state of it
        cfg = train.resolve_run_config(comm, preset="tiny", set=case["set"], dtype=case["dtype"], tp=tp, pp=pp, dp=dp,
                                       pp_schedule=case["schedule"], pp_layers=pp_layers, pp_virtual=virtual, batch_size=B * m * dp, micro_batch_size=B,
                                       seq_len=T, steps=4, device="cpu", eval_every=0, quiet=True,
                                       save_on_signal=False, **layout, **finetune)
        run = train.build_run(cfg, comm, dataset=random_tokens(cfg.model.vocab_size, 1 << 15, 0))
        train.train_step(run)  # (the first step allocates the optimizer's state)
        stash = []
        with ActivationPeak(run.ctx) as peak:
            train.train_step(run, _FirstForward(stash))
        mine = memory_record(run, peak.bytes, stash[0])
        mine.update(stage=run.ctx.pp_rank, in_flight=run.pipeline_in_flight)
        ranks = comm.allgather(mine)
        planned = plan_pp.plan_pipeline(cfg.model, pp=pp, tp=tp, dp=dp,
                                        micro_batch=B, seq_len=T, accum=m, schedule=case["schedule"],
                                        pp_layers=pp_layers, virtual=virtual,
                                        dtype=case["dtype"], config=cfg.model, device="cpu", threads=1,
                                        finetune=finetune or None, **layout)
        run.close()
        for st in planned["stages"]:
            got = [r for r in ranks if r["stage"] == st["stage"]]
            what = f"{case} stage {st['stage']}"
            for key in STATE:
                assert max(r[key] for r in got) == st[key], (what, key, [r[key] for r in got], st[key])
            assert max(r["params_local"] for r in got) == st["params_local"], what
            assert {r["in_flight"] for r in got} == {st["in_flight"]}, what
            measured, p = max(r["activations_peak"] for r in got), st["activations_peak"]
            assert abs(p - measured) <= TOLERANCE * measured, (
                f"{what}: activations planned {p:,} vs measured {measured:,} ({p / measured - 1:+.1%})")
            kept = [max(col) for col in zip(*(r["stash_per_layer"] for r in got))]
            assert len(kept) == len(st["activations"]["stash_per_layer"]), what
            for a, b in zip(kept, st["activations"]["stash_per_layer"]):
                assert abs(b - a) <= TOLERANCE * a, f"{what}: a layer keeps {a:,} bytes, planned {b:,}"


class _FirstForward(train.StepHooks):
    def __init__(self, out):
        self.out = out

    def after_forward(self, run, micro):
        if not self.out:
            self.out.append(stash_per_layer(run.model))


PP2 = [  # untied (the head's own weight) and tied (the last stage's embedding copy), 1F1B, GPipe, interleaved
    dict(tp=1, pp=2, B=2, T=64, m=4, dtype="float32", schedule="1f1b", set=["n_layer=2", "tie_embeddings=false"]),
    dict(tp=1, pp=2, B=2, T=64, m=4, dtype="float32", schedule="interleaved", virtual=2, set=["n_layer=4"]),
    dict(tp=1, pp=2, B=2, T=64, m=3, dtype="float64", schedule="gpipe", pp_layers=(1, 2),
         set=["n_layer=3", "dropout=0.1"]),
]
PP2_TP2 = [dict(tp=2, pp=2, B=2, T=64, m=2, dtype="float32", schedule="1f1b", sequence_parallel=True,
                set=["n_layer=2", "dropout=0.1"]),
           dict(tp=1, dp=2, pp=2, B=2, T=64, m=2, dtype="bfloat16", schedule="1f1b", distributed_optimizer=True,
                recompute="full", set=["n_layer=2"]),  # (ZeRO-1: each stage's buffer padded to 64 x dp)
           dict(tp=2, pp=2, B=2, T=64, m=2, dtype="bfloat16", schedule="1f1b", set=["n_layer=2"],
                finetune=dict(lora_rank=4, lora_alpha=8.0, lora_targets="q,v,o,down"))]  # LoRA's state per stage


def test_each_stage_measured_equals_the_plan_pp2():
    run_mpi(2, "tests.plan.test_pipeline:_worker_stages_measured_equal_planned", PP2, timeout=120,
            env={"CUTP_OP_THREADS": "1"})


def test_each_stage_measured_equals_the_plan_pp2_tp2_sequence_parallel_and_dp2_distributed():
    run_mpi(4, "tests.plan.test_pipeline:_worker_stages_measured_equal_planned", PP2_TP2, timeout=120,
            env={"CUTP_OP_THREADS": "1"})


# ---- the schedules: cutp's order, Megatron's counts, the bubble ----------------------------------
def test_the_planned_schedules_are_cutps_and_megatrons():
    for p in (2, 3, 4, 5):
        for m in range(1, 10):
            for stage in range(p):
                for kind in ("gpipe", "1f1b"):
                    if kind == "1f1b" and m < p:
                        continue
                    events = plan_pp.schedule_events(kind, p, stage, m)
                    assert events == [op for op in plan_of(kind, p, stage, m) if op[0] != "X"]
                    assert plan_pp.in_flight(events) == (
                        m if kind == "gpipe" else min(p - stage, m))
                for v in (2, 3):  # Megatron: min(total, 2(p - s - 1) + (V - 1)p + 1) chunk forwards
                    if m % p:
                        continue
                    events = plan_pp.schedule_events("interleaved", p, stage, m, v)
                    assert sorted(events) == sorted([(k, i, c) for k in "BF" for i in range(m) for c in range(v)])
                    for i in range(m):  # every chunk's forward before the next chunk's, backwards in reverse
                        f = [events.index(("F", i, c)) for c in range(v)]
                        b = [events.index(("B", i, c)) for c in reversed(range(v))]
                        assert f == sorted(f) and b == sorted(b) and f[-1] < b[0], (p, stage, m, v, i)
                    assert plan_pp.in_flight(events) == (m * v if m == p else  # (all forwards first at m = p)
                                                         min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1))
    assert pipeline_bubble(4, 12) == pytest.approx(3 / 15)
    assert pipeline_bubble(4, 12, 2) == pytest.approx(3 / 27)


def test_every_planned_stage_frees_what_it_allocates():
    """Each schedule, each stage (first, middle, last; interleaved chunks), with dropout,
    recomputation and sequence parallelism: nothing of the step is left, and the micro-batches
    held at once are the schedule's."""
    config = GPTConfig.preset("tiny").with_overrides(["n_layer=6", "dropout=0.1", "n_kv_head=2"])
    for kind, v, m in (("1f1b", 1, 4), ("gpipe", 1, 3), ("interleaved", 2, 3)):
        _, chunks = plan_pp.check_pipeline(n_layer=6, pp=3, m=m, schedule=kind, virtual=v)
        for stage, mine in enumerate(chunks):
            for device, layout in (("cpu", dict(recompute="full", recompute_layers=3, sequence_parallel=True)),
                                   ("cuda", dict(recompute="selective"))):
                out = planned_step(config, tp=2, pp=3, rank=Mesh(2, 1, 3).rank_of(1, 0, stage), micro_batch=2,
                                   seq_len=32, accum=m, device=device, pp_schedule=kind, pp_virtual=v, **layout)
                events = plan_pp.schedule_events(kind, 3, stage, m, v)
                assert out["left"] == 0, (kind, stage, device, out["left"])
                assert out["in_flight"] == plan_pp.in_flight(events), (kind, stage)
                mine_layers = {n for ch in mine for n in ch.layers}
                assert all((b > 0) == (n in mine_layers) for n, b in enumerate(out["stash_per_layer"])), out


# ---- the plan of a whole model and of its stages agree ------------------------------------------
def test_one_stage_is_the_whole_model_and_the_stages_add_up():
    a = plan.pick_arch("175B")  # tied embeddings: the last stage's embedding copy
    kw = dict(tp=8, dp=4, micro_batch=1, seq_len=2048, dtype="bfloat16", distributed_optimizer=True,
              recompute="selective", sequence_parallel=True)
    whole = plan.plan(a, accum=1, **kw)
    one = plan_pp.plan_pipeline(a, pp=1, accum=1, **kw)["stages"][0]
    assert one["params_local"] == whole["params_per_gpu"] and one["state"] == whole["model_state_bytes"]
    assert one["activations_peak"] == pytest.approx(whole["act_bytes"])
    r = plan_pp.plan_pipeline(a, pp=4, accum=8, **kw)
    emb = a.padded_vocab(8) // 8 * a.n_embd  # (the vocabulary padded as cutp pads it)
    assert sum(st["params_local"] for st in r["stages"]) == whole["params_per_gpu"] + emb
    assert [st["in_flight"] for st in r["stages"]] == [4, 3, 2, 1] and r["largest_stage"] == 0
    assert r["p2p_bytes_per_micro_batch"] == 2048 * 12288 * 2 // 8 and r["bubble"] == pytest.approx(3 / 11)
    config = GPTConfig.preset("tiny").with_overrides(["n_layer=4"])
    arch = config
    stages = plan_pp.plan_pipeline(arch, pp=2, tp=2, dp=1, micro_batch=2, seq_len=32, accum=2, config=config,
                                   device="cpu")["stages"]
    tied = config.padded_vocab(2) // 2 * config.n_embd
    assert sum(st["params_local"] for st in stages) == plan.parameters_per_rank(config, 2) + tied


def test_tp8_alone_does_not_fit_70b_on_80gb_tp8_pp4_with_the_distributed_optimizer_does():
    """Issue 15's claim, from the planner (bf16, sequence parallelism, selective recomputation,
    micro-batch 1 x 4096)."""
    a = plan.pick_arch("70B")
    kw = dict(tp=8, dp=1, micro_batch=1, seq_len=4096, dtype="bfloat16", distributed_optimizer=True,
              recompute="selective", sequence_parallel=True)
    for recompute in plan.RECOMPUTE:  # (at dp=1 the distributed optimizer shards nothing)
        assert not plan.plan(a, accum=8, **{**kw, "recompute": recompute})["fits"]["80 GB"], recompute
    r = plan_pp.plan_pipeline(a, pp=4, accum=8, **kw)
    assert r["fits"]["80 GB"] and r["largest_stage"] == 0
    rows = {(row["tp"], row["pp"]): row["fit"][80e9] for row in plan_search.search(a, capacities=(80e9,))}
    assert rows[(8, 1)]["dp"] > 1  # TP=8 alone (8 GPUs) does not fit; more DP ranks shard the optimizer
    assert rows[(8, 4)]["fits"] and rows[(8, 4)]["dp"] == 1


def test_the_search_tries_zero_2_between_zero_1_and_zero_3():
    """ZeRO-2 (gradients sharded too) is the search's choice where ZeRO-1 does not fit and ZeRO-2
    does, before ZeRO-3 (more communication): Llama-2-70B at tp 2 x pp 4 on 80 GB GPUs."""
    a, plans = plan.pick_arch("70B"), {}
    found = plan_search.fewest_gpus(a, tp=2, pp=4, gpus=64, capacity=80e9, dtype="bfloat16", micro_batch=1,
                                    seq_len=4096, batch_size=1024, plans=plans)
    assert found["fits"] and found["zero"] == 2 and found["dp"] == 4, {k: found[k] for k in ("zero", "dp")}
    same = [r for k, r in plans.items() if k[2] == 4 and k[5] == found["recompute"] and k[10] == 1]
    assert same and all(r["stages"][r["largest_stage"]]["total"] > 80e9 for r in same)  # ZeRO-1 at dp 4 did not


# ---- the command line ---------------------------------------------------------------------------
def test_plan_pp_command_line(tmp_path, capsys):
    path = tmp_path / "pp.json"
    assert bench_main(["plan", "--params", "70B", "--tp", "8", "--pp", "4", "--accum", "8", "--distributed-optimizer",
                       "--dp", "2", "--sequence-parallel", "--recompute", "selective", "--json", str(path),
                       "--plot", str(tmp_path / "stages.png")]) == 0
    out = capsys.readouterr().out
    assert "stage 0 holds the most" in out and "predicted bubble" in out
    r = json.loads(path.read_text())["plan"]
    assert [st["in_flight"] for st in r["stages"]] == [4, 3, 2, 1] and r["fits"]["80 GB"]
    assert (tmp_path / "stages.png").stat().st_size > 0
    assert bench_main(["plan", "--params", "70B", "--tp", "8", "--pp", "4", "--pp-virtual", "2", "--accum", "8",
                       "--quiet", "--json", str(path)]) == 0
    r = json.loads(path.read_text())["plan"]
    assert r["schedule"] == "interleaved" and [st["in_flight"] for st in r["stages"]] == [11, 9, 7, 5]
    assert bench_main(["plan", "--params", "175B", "--search", "--gpus", "64", "--gpu-memory", "80",
                       "--batch-size", "256", "--markdown"]) == 0  # (256 sequences: up to 256 micro-batches)
    table = capsys.readouterr().out
    assert table.startswith("| TP | PP | layers/stage | 80 GB: fewest GPUs (DP) |") and "| 8 | 8 | 12 |" in table


@pytest.mark.parametrize("argv,message", [
    (["--pp", "4", "--accum", "2"], "needs at least pp=4 micro-batches"),
    (["--pp", "4", "--pp-virtual", "2", "--accum", "6"], "multiple of pp=4"),
    (["--pp", "2", "--pp-virtual", "2", "--pp-schedule", "gpipe"], "--pp-virtual 2"),
    (["--pp", "2", "--pp-virtual", "2", "--pp-layers", "40,40"], "one per virtual stage"),
    (["--pp", "3"], "does not split evenly over pp=3"),
    (["--pp", "2", "--pp-layers", "40,x"], "--pp-layers '40,x'"),
    (["--search", "--gpu-memory", "0"], "--gpu-memory 0"),
    (["--search", "--plot", "x.png"], "--search lists layouts"),
])
def test_plan_pp_refuses_what_cannot_run(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        bench_run(build_parser().parse_args(["plan", "--params", "70B", "--tp", "8"] + argv))
    with pytest.raises(ConfigError, match="--search plans --params"):
        bench_run(build_parser().parse_args(["plan", "--preset", "tiny", "--search"]))


def test_train_cli_memory_record_with_uneven_stages(tmp_path):
    """The first step's memory record under --pp with uneven stages: each layer's stash from the
    stage that holds it (the records' reduction over the ranks used to fail on lists of different
    lengths), and the largest stage's figures the plan's."""
    path = tmp_path / "m.jsonl"
    run_mpi(2, "examples.train_gpt:main", ["--preset", "tiny", "--set", "n_layer=3", "--pp", "2", "--pp-layers", "1,2",
                                           "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "32",
                                           "--steps", "1", "--eval-every", "0", "--device", "cpu", "--quiet",
                                           "--metrics", str(path)], timeout=120, env={"CUTP_OP_THREADS": "1"})
    memory = json.loads(path.read_text().splitlines()[0])["memory"]
    config = GPTConfig.preset("tiny").with_overrides(["n_layer=3"])
    planned = plan_pp.plan_pipeline(config, pp=2, tp=1, dp=1, micro_batch=2,
                                    seq_len=32, accum=2, pp_layers=(1, 2), dtype=config.dtype, config=config,
                                    device="cpu")
    stash = [b for st in planned["stages"] for b in st["activations"]["stash_per_layer"]]
    assert len(memory["stash_per_layer"]) == 3
    for m, p in zip(memory["stash_per_layer"], stash):
        assert abs(p - m) <= TOLERANCE * m, (memory["stash_per_layer"], stash)
    for key in STATE:
        assert memory[key] == max(st[key] for st in planned["stages"]), key
