"""`cutp plan` at zero 2 and 3 with expert parallelism (issue 39, review finding 4): the experts'
segments sharded over the expert-DP ranks as cutp.optim.sharded shards them. Measured = planned
at dp4 x ep2 (zero 2, zero 3 with prefetch, zero 3 in 2 HSDP replicas) and tp2 x dp2 x ep2
zero 3 (two micro-batches: the MoE counting pass's forwards gather too): each rank's state bytes,
its peak of whole units and the collectives of its sharding groups, to the byte, from
`cutp.plan.zero` and from `cutp plan` itself. The planner's flags that describe the same layout as
a run: --batch-size (the micro-batches training derives), --overlap-param-gather; `bench model`
takes --ep."""
import numpy as np

from cutp.bench.model import random_tokens
from cutp.models import GPTConfig
from cutp.train import RunConfig, build_run
from tests.mpirun import run_mpi
from tests.optim.test_zero import measured_for_the_plan

MOE = dict(n_head=4, n_embd=16, n_experts=4, moe_top_k=2, moe_ffn=32, n_layer=2, vocab_size=61, block_size=16)
LAYOUTS = [  # (dtype, layout) on 4 ranks
    ("float32", dict(dp=4, ep=2, zero=2)),
    ("bfloat16", dict(dp=4, ep=2, zero=3, overlap_param_gather=True)),
    ("float32", dict(dp=4, ep=2, zero=3, dp_replicate=2, micro_batch_size=1)),
    ("float32", dict(tp=2, dp=2, ep=2, zero=3)),
]
SHARDING = ("dp", "expert_dp", "hsdp_shard", "hsdp_replicas", "hsdp_expert_shard", "hsdp_expert_replicas")


def _worker():
    from mpi4py import MPI

    from cutp.plan.layout import plan
    from cutp.plan.zero import zero_plan

    for dtype, layout in LAYOUTS:
        layout = {"micro_batch_size": 2, **layout}
        cfg = RunConfig(model=GPTConfig(**MOE, dtype=dtype), batch_size=8, seq_len=16, steps=4, warmup=1, seed=3,
                        eval_every=0, quiet=True, save_on_signal=False, **layout)
        run = build_run(cfg, MPI.COMM_WORLD, dataset=random_tokens(61, 4096, 0))
        mem, comm = measured_for_the_plan(run)
        rank = run.ctx.rank
        run.close()
        got = zero_plan(cfg.model, tp=cfg.tp, dp=cfg.dp, ep=cfg.ep, rank=rank, zero=cfg.zero, accum=cfg.accum_steps,
                        prefetch=cfg.overlap_param_gather, dp_replicate=cfg.dp_replicate)
        state = {k: mem[k] for k in ("params", "grads", "optimizer")}
        assert state == got["state"], (layout, state, got["state"])
        assert mem.get("gathered_units_peak", 0) == got["gathered_peak"], (layout, mem, got["gathered_peak"])
        # the sharding groups' collectives; dp's all-reduces left out: the MoE layers' step statistics
        # use the DP group too (the norm's is on hsdp_shard with replicas, and counted there)
        measured = {k: v for k, v in comm.items() if k.split(".")[0] in SHARDING and k != "dp.all_reduce"}
        planned = {k: v for k, v in got["comm"].items() if k != "dp.all_reduce"}
        assert measured == planned, (layout, measured, planned)
        assert any(k.startswith(("expert_dp.", "hsdp_expert_")) for k in measured), measured
        # `cutp plan`'s figures: the largest rank's state, every rank's the same here
        whole = plan(cfg.model, config=cfg.model, tp=cfg.tp, dp=cfg.dp, ep=cfg.ep, micro_batch=cfg.micro_batch_size,
                     seq_len=16, accum=cfg.accum_steps, dtype=dtype, zero=cfg.zero, dp_replicate=cfg.dp_replicate,
                     overlap_param_gather=cfg.overlap_param_gather, device="cpu")
        sizes = MPI.COMM_WORLD.allgather(sum(state.values()))
        if sum(state.values()) == max(sizes):
            assert {k: whole["memory"][k] for k in state} == state, (layout, whole["memory"], state)
        group = "hsdp_expert_shard" if cfg.dp_replicate > 1 else "expert_dp"
        for key, op in (("expert_dp_reduce_scatter", "reduce_scatter"), ("expert_dp_all_gather", "all_gather")):
            want = measured.get(f"{group}.{op}", {"calls": 0, "bytes": 0})
            assert (whole[key]["calls"], whole[key]["bytes"]) == (want["calls"], want["bytes"]), (layout, key)


def test_zero_2_and_3_at_ep_2_measure_as_planned():
    run_mpi(4, "tests.plan.test_zero_ep:_worker", timeout=300, env={"CUTP_OP_THREADS": "1"})


def test_plan_takes_zero_at_ep_and_the_run_s_batch_and_prefetch(tmp_path, capsys):
    import json

    from cutp.plan.cli import main

    def planned(*argv):
        out = tmp_path / "plan.json"
        assert main(["--preset", "tiny", "--set", "n_layer=2", "--tp", "1", "--dp", "4", "--seq-len", "32",
                     "--device", "cpu", "--json", str(out), "--quiet", *argv]) == 0, capsys.readouterr().err
        return json.loads(out.read_text())["plan"]

    # the micro-batches training runs: batch / (dp x micro-batch), as --accum says them
    by_batch = planned("--zero", "3", "--batch-size", "8", "--micro-batch-size", "1")
    by_accum = planned("--zero", "3", "--accum", "2", "--micro-batch-size", "1")
    assert by_batch["accum"] == 2 and by_batch["dp_all_gather"] == by_accum["dp_all_gather"]
    assert by_batch["dp_reduce_scatter"]["calls"] == 2 * planned("--zero", "3")["dp_reduce_scatter"]["calls"]
    # zero 3's prefetch: the next unit whole too, in the step's peak
    ahead = planned("--zero", "3", "--overlap-param-gather")
    assert ahead["memory"]["activations_peak"] > planned("--zero", "3")["memory"]["activations_peak"]
    # an MoE model at ep 2: planned (was refused), the experts' shards over expert-DP (dp 4 / ep 2)
    moe = tmp_path / "moe.json"
    assert main(["--preset", "tiny-moe", "--tp", "1", "--dp", "4", "--ep", "2", "--zero", "3", "--seq-len", "32",
                 "--device", "cpu", "--json", str(moe), "--quiet"]) == 0
    r = json.loads(moe.read_text())["plan"]
    assert r["expert_dp_all_gather"]["calls"] > 0 and r["activations"]["gathered_units"] > 0


def test_bench_model_takes_ep():
    from cutp.bench.__main__ import build_parser

    args = build_parser().parse_args(["model", "--preset", "tiny-moe", "--ep", "2", "--zero", "3"])
    assert args.ep == 2


def test_two_zero_stages_are_refused_and_a_zero_that_shards_nothing_is_said(capsys):
    """--zero 3 with --distributed-optimizer (zero 1): one line; zero at dp 1, or in replicas of one
    rank: it runs, with one warning line."""
    from types import SimpleNamespace

    import pytest
    from mpi4py import MPI

    from cutp.bench.model import _shards
    from cutp.optim import ShardedAdamW
    from cutp.runtime.errors import ConfigError
    from cutp.train import resolve_run_config
    from cutp.train.config import derive_run_config

    common = dict(preset="tiny", set=["n_layer=1"], device="cpu", steps=1, quiet=True, save_on_signal=False)
    with pytest.raises(ConfigError, match=r"^distributed_optimizer is zero 1, and zero 3 is given too: two ZeRO "
                                          r"stages; omit distributed_optimizer"):
        derive_run_config(dict(common, zero=3, distributed_optimizer=True), 1, 1)
    assert derive_run_config(dict(common, zero=1, distributed_optimizer=True), 1, 1).zero == 1
    capsys.readouterr()
    resolve_run_config(MPI.COMM_SELF, **common, zero=3)
    err = capsys.readouterr().err
    assert err == "warning: zero 3 shards over dp x cp, which is 1 here (tp 1 x dp 1): nothing is sharded\n", err
    resolve_run_config(MPI.COMM_SELF, **common)
    assert capsys.readouterr().err == ""
    # bench model's memory table: the state over one HSDP replica's ranks (ZeRO 2/3), else DP x CP
    sharded = object.__new__(ShardedAdamW)
    sharded.group = SimpleNamespace(size=2)
    assert _shards(sharded, SimpleNamespace(dp_cp_size=4, dp_size=4)) == 2
    assert _shards(SimpleNamespace(), SimpleNamespace(dp_cp_size=8, dp_size=4)) == 8
