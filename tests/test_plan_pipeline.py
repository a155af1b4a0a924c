"""`cutp bench plan --pp`: each pipeline stage's memory measured against the plan (parameters,
gradients and optimizer state exactly, the activation peak and each layer's stash within
test_memory's 10%, the micro-batches in flight exactly), the schedules' in-flight counts and
bubble, the layout search (issue 15: TP=8 alone does not fit Llama-2-70B on 80 GB GPUs, TP=8 x
PP=4 with the distributed optimizer does), the command line and its refusals."""
from __future__ import annotations

import json

import pytest
from mpi4py import MPI

from cutp import train
from cutp.bench import plan, plan_pp
from cutp.bench.__main__ import main as bench_main
from cutp.bench.model import random_tokens
from cutp.runtime.errors import ConfigError
from cutp.train.memory import ActivationPeak, memory_record, stash_per_layer
from tests.mpirun import run_mpi
from tests.test_memory import STATE, TOLERANCE


# ---- measured against planned, per stage --------------------------------------------------------
def _worker_stages_measured_equal_planned(cases):
    comm = MPI.COMM_WORLD
    for case in cases:
        tp, pp, B, T, m = case["tp"], case["pp"], case["B"], case["T"], case["m"]
        layout = {k: case[k] for k in ("sequence_parallel", "recompute") if k in case}
        pp_layers = case.get("pp_layers")
        cfg = train.resolve_run_config(comm, preset="tiny", set=case["set"], dtype=case["dtype"], tp=tp, pp=pp,
                                       pp_schedule=case["schedule"], pp_layers=pp_layers, batch_size=B * m, micro_batch_size=B,
                                       seq_len=T, steps=4, device="cpu", eval_every=0, quiet=True,
                                       save_on_signal=False, **layout)
        run = train.build_run(cfg, comm, dataset=random_tokens(cfg.model.vocab_size, 1 << 15, 0))
        train.train_step(run)  # (the first step allocates the optimizer's state)
        stash = []
        with ActivationPeak(run.ctx) as peak:
            train.train_step(run, _FirstForward(stash))
        mine = memory_record(run, peak.bytes, stash[0])
        mine.update(stage=run.ctx.pp_rank, in_flight=run.pipeline_in_flight)
        ranks = comm.allgather(mine)
        planned = plan_pp.plan_pipeline(plan.arch_from_config("tiny", cfg.model), pp=pp, tp=tp, dp=1,
                                        micro_batch=B, seq_len=T, accum=m, schedule=case["schedule"],
                                        pp_layers=pp_layers,
                                        dtype=case["dtype"], config=cfg.model, device="cpu", threads=1, **layout)
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


PP2 = [  # untied (the head's own weight) and tied (the last stage's wte copy), 1F1B and GPipe
    dict(tp=1, pp=2, B=2, T=64, m=4, dtype="float32", schedule="1f1b", set=["n_layer=2", "tie_embeddings=false"]),
    dict(tp=1, pp=2, B=2, T=64, m=3, dtype="float64", schedule="gpipe", pp_layers=(1, 2),
         set=["n_layer=3", "dropout=0.1"]),
]
PP2_TP2 = [dict(tp=2, pp=2, B=2, T=64, m=2, dtype="float32", schedule="1f1b", sequence_parallel=True,
                set=["n_layer=2", "dropout=0.1"])]


def test_each_stage_measured_equals_the_plan_pp2():
    run_mpi(2, "tests.test_plan_pipeline:_worker_stages_measured_equal_planned", PP2, timeout=120,
            env={"CUTP_OP_THREADS": "1"})


def test_each_stage_measured_equals_the_plan_pp2_tp2_sequence_parallel():
    run_mpi(4, "tests.test_plan_pipeline:_worker_stages_measured_equal_planned", PP2_TP2, timeout=120,
            env={"CUTP_OP_THREADS": "1"})
