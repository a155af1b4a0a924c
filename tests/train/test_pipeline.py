"""Pipeline parallelism (issue 15, first part): `--pp`, `--pp-layers`, `--pp-schedule 1f1b|gpipe`.

No layout changes the math: float64 losses, every gradient and the updated parameters of a
TP x DP x PP mesh equal one rank's within 1e-10 (dropout, GQA, an odd vocabulary, tied and
untied embeddings, sequence parallelism, recomputation, uneven stages). The tied embedding's two
copies (first and last stage) stay bit-identical; 1F1B keeps at most p - s micro-batches on
stage s, GPipe all m.
"""
import json

import numpy as np
import pytest

import cutp
from cutp.bench.model import random_tokens
from cutp.models import GPT, GPTConfig, stage_layers
from cutp.tensor_parallel import gather_full
from cutp.train import RunConfig, build_run, train_step
from tests.mpirun import SharedLaunch, run_mpi
from tests.tp_utils import on_rank_0

TRAIN = "examples.train_gpt:main"


def _config(tp=1, dp=1, pp=1, micro=2, schedule="1f1b", pp_layers=None, sp=False, recompute="none", zero=False,
            **model):
    m = dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, vocab_size=97, block_size=16, dtype="float64", dropout=0.1)
    m.update(model)
    return RunConfig(model=GPTConfig(**m), tp=tp, dp=dp, pp=pp, pp_layers=pp_layers, pp_schedule=schedule,
                     batch_size=8, micro_batch_size=micro, seq_len=16, steps=4, warmup=1, seed=3,
                     sequence_parallel=sp, recompute=recompute, distributed_optimizer=zero, eval_every=0,
                     quiet=True, save_on_signal=False)


def _train(cfg, comm, steps=2):
    """Losses, and per parameter name (every stage's, gathered on each rank): full gradients
    and full parameters after `steps` steps; the most micro-batches a stage held at once."""
    run = build_run(cfg, comm, dataset=random_tokens(97, 4096, 0))
    losses = [train_step(run).loss for _ in range(steps)]
    ctx = run.ctx
    full = lambda p, a: np.asarray(gather_full(ctx.tp, a, p.sharding))[:p.real_rows]  # noqa: E731
    mine = {p.name: (full(p, p.grad), full(p, p.data)) for p in run.model.parameters()}
    stages = ctx.pp.mpi_comm.allgather(mine)
    in_flight = ctx.pp.mpi_comm.allgather(run.pipeline_in_flight)
    run.close()
    return losses, stages, in_flight


def assert_stages_equal_one_rank(stages, ref, cfg, kw):
    """Every stage's gradients (unless ZeRO-1 kept only a shard) and parameters equal one rank's
    within 1e-10, every parameter is on some stage, and a tied embedding's copies are the same bits."""
    seen = set()
    for stage in stages:
        for name, (g, w) in stage.items():
            seen.add(name)
            rg, rw = ref[name]
            if not cfg.distributed_optimizer:  # (ZeRO-1 keeps only its shard of the reduced gradient)
                assert np.abs(g - rg).max() <= 1e-10 * np.abs(rg).max(), (kw, name)
            assert np.abs(w - rw).max() <= 1e-10 * np.abs(rw).max(), (kw, name)
    assert seen == set(ref), (kw, sorted(set(ref) ^ seen))
    if cfg.model.tie_embeddings:  # the first and the last stage's copies: the same bits
        first, last = stages[0]["tok_embed.weight"], stages[-1]["tok_embed.weight"]
        assert np.array_equal(first[1], last[1]) and np.array_equal(first[0], last[0]), kw


def _worker_equals_one_rank(cases):
    from mpi4py import MPI

    for kw in cases:
        cfg = _config(**kw)
        losses, stages, in_flight = _train(cfg, MPI.COMM_WORLD)
        ref_kw = {k: v for k, v in kw.items() if k in ("tie_embeddings", "bias")}
        ref_losses, ref_stages, _ = on_rank_0(lambda: _train(_config(**ref_kw), MPI.COMM_SELF))
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0, err_msg=str(kw))
        assert_stages_equal_one_rank(stages, ref_stages[0], cfg, kw)
        m, p = 8 // (cfg.dp * cfg.micro_batch_size), cfg.pp
        expect = [m] * p if cfg.pp_schedule == "gpipe" else [min(p - s, m) for s in range(p)]
        assert in_flight == expect, (kw, in_flight, expect)


def test_pp2_1f1b_and_gpipe_untied_equal_one_rank():
    TWO_RANKS.check("pp2")


def test_uneven_stages_pp3():
    run_mpi(3, "tests.train.test_pipeline:_worker_equals_one_rank", [dict(pp=3, pp_layers=(1, 2, 1), micro=1)],
            timeout=240)


def test_pp4_tp2_pp2_with_sequence_parallelism_and_dp2_pp2():
    FOUR_RANKS.check("pp4 tp2_pp2 dp2_pp2")


def test_tp2_dp2_pp2_with_the_distributed_optimizer():
    run_mpi(8, "tests.train.test_pipeline:_worker_equals_one_rank",
            [dict(tp=2, dp=2, pp=2, micro=2, zero=True, sp=True)], timeout=300)


# ---- settings ----------------------------------------------------------------------------------
def test_stage_layers_and_the_settings_a_pipeline_refuses():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 3, (1, 3, 1)) == [range(0, 1), range(1, 4), range(4, 5)]
    with pytest.raises(cutp.ConfigError, match=r"n_layer=5 does not split evenly over pp=2 stages; .*pp_layers \(e.g. 2,3\)"):
        stage_layers(5, 2)
    with pytest.raises(cutp.ConfigError, match=r"pp_layers 2,2,2: needs pp=3 counts >= 1 that add up to n_layer=5"):
        stage_layers(5, 3, (2, 2, 2))
    with pytest.raises(cutp.ConfigError, match=r"1F1B schedule needs at least pp=4 micro-batches per step.* gives 2"):
        _config(pp=4, micro=4)
    _config(pp=4, micro=4, schedule="gpipe")  # GPipe runs any number
    with pytest.raises(cutp.ConfigError, match="pp_schedule must be one of 1f1b, gpipe"):
        _config(pp=2, schedule="zigzag")


def _worker_whole_model_calls_refused():
    ctx = cutp.init(pp=2)
    model = GPT(ctx, GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=8), seed=0)
    assert [b.attn.qkv.weight.name for b in model.layers] == [f"layers.{ctx.pp_rank}.attn.qkv.weight"]
    assert (model.pos_embed is not None) == (ctx.pp_rank == 0) and (model.final_norm is not None) == (ctx.pp_rank == 1)
    assert model.tok_embed is not None  # tied: both stages hold the table
    with pytest.raises(cutp.ConfigError, match="pipeline stage .* load the checkpoint with pp=1"):
        model.forward(np.zeros((1, 4), np.int64))
    ctx.close()


def test_a_stage_refuses_whole_model_calls():
    TWO_RANKS.check("whole_model_calls_refused")


# ---- point to point, counted -------------------------------------------------------------------
def _worker_p2p_bytes():
    from mpi4py import MPI

    for sp in (False, True):
        cfg = _config(tp=2, pp=2, micro=2, sp=sp)
        run = build_run(cfg, MPI.COMM_WORLD, dataset=random_tokens(97, 4096, 0))
        before = run.ctx.counter.summary()
        train_step(run)
        after = run.ctx.counter.summary()
        sent = after.get("pp.send", {}).get("bytes", 0) - before.get("pp.send", {}).get("bytes", 0)
        # 4 micro-batches of 2 x 16 tokens x 32 features, float64, one way each: activations
        # forward on the first stage, their gradients backward on the second; 1/tp under SP
        expect = 4 * 2 * 16 * 32 * 8 // (2 if sp else 1)
        assert sent == expect, (sp, run.ctx.pp_rank, sent, expect)
        run.close()


def test_each_stage_sends_one_activation_or_gradient_per_micro_batch_sp_sends_a_shard():
    FOUR_RANKS.check("p2p_bytes")


# The library tests above on 4 and on 2 ranks, each set in one launch (the ranks' start-up is a good
# part of each one's time); each test checks its case.
FOUR_RANKS = SharedLaunch(4, {
    "pp4 tp2_pp2 dp2_pp2": ("tests.train.test_pipeline:_worker_equals_one_rank", [[
        dict(pp=4, micro=1),
        dict(tp=2, pp=2, sp=True, recompute="full", micro=1),
        dict(dp=2, pp=2, schedule="gpipe", recompute="selective", micro=1)]]),
    "p2p_bytes": ("tests.train.test_pipeline:_worker_p2p_bytes", []),
}, timeout=420)
TWO_RANKS = SharedLaunch(2, {
    "pp2": ("tests.train.test_pipeline:_worker_equals_one_rank",
            [[dict(pp=2), dict(pp=2, schedule="gpipe", tie_embeddings=False, micro=1)]]),
    "whole_model_calls_refused": ("tests.train.test_pipeline:_worker_whole_model_calls_refused", []),
}, timeout=300)


# ---- the command line --------------------------------------------------------------------------
def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_cli_losses_with_pipeline_parallelism_equal_one_rank(tmp_path):
    base = ["--preset", "tiny", "--set", "n_layer=4", "--set", "n_kv_head=2", "--set", "vocab_size=259",
            "--dtype", "float64", "--seq-len", "32", "--batch-size", "8", "--dropout", "0.1", "--steps", "8",
            "--eval-every", "4", "--eval-batches", "1", "--quiet"]
    layouts = {"tp1": ["--tp", "1"],
               "pp2tp2": ["--tp", "2", "--pp", "2", "--micro-batch-size", "2", "--sequence-parallel"],
               "pp4": ["--tp", "1", "--pp", "4", "--micro-batch-size", "1", "--pp-schedule", "gpipe",
                       "--pp-layers", "1,1,1,1"]}
    argv = {name: base + ["--metrics", str(tmp_path / f"{name}.jsonl")] + extra for name, extra in layouts.items()}
    run_mpi(1, TRAIN, argv["tp1"], timeout=300)
    run_mpi(4, "tests.acceptance.test_mixed_precision:_worker_two_mains", str(tmp_path / "h.json"),
            [(name, argv[name]) for name in ("pp2tp2", "pp4")], timeout=600)  # the 4-rank runs in one launch
    rows = {name: _metrics(tmp_path / f"{name}.jsonl") for name in layouts}
    ref = [r["loss"] for r in rows["tp1"]]
    ref_val = [r["val_loss"] for r in rows["tp1"] if "val_loss" in r]
    assert len(ref) == 8 and len(ref_val) == 2
    for name in ("pp2tp2", "pp4"):
        np.testing.assert_allclose([r["loss"] for r in rows[name]], ref, rtol=1e-10, atol=0, err_msg=name)
        np.testing.assert_allclose([r["val_loss"] for r in rows[name] if "val_loss" in r], ref_val, rtol=1e-10)


# ---- the bubble, measured -----------------------------------------------------------------------
def _worker_bench_model_pp3(path):
    from cutp.bench.__main__ import main

    main(["model", "--preset", "tiny", "--device", "cpu", "--set", "n_layer=3", "--set", "n_embd=32", "--set",
          "n_head=2", "--pp", "3", "--batch-size", "6", "--micro-batch-size", "1", "--seq-len", "16", "--timed-steps", "2",
          "--untimed-steps", "1", "--quiet", "--json", path])


def test_bench_model_reports_each_stage_and_the_bubble(tmp_path):
    """3 stages (the middle one has no embedding group: the report's reductions must not assume
    every rank ran the same collectives; that hung)."""
    path = tmp_path / "pp3.json"
    run_mpi(3, "tests.train.test_pipeline:_worker_bench_model_pp3", str(path), timeout=120)
    d = json.loads(path.read_text())
    pipe = d["pipeline"]
    assert len(pipe["wait_ms"]) == 3 and all(w >= 0 for w in pipe["wait_ms"])
    assert pipe["ideal_bubble"] == pytest.approx(2 / (6 + 2)) and 0 < pipe["bubble"] < 1
    assert [r["stage"] for r in d["tables"]["pipeline"]["rows"]] == [0, 1, 2]
    assert "embedding.all_reduce" in {r["key"] for r in d["tables"]["comm"]["rows"]}
