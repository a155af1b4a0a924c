"""Mixture of experts (issue 18, first step: the model, at expert parallelism 1).

The router's and the experts' gradients, the top-k gates (renormalised or not), the capacity
dropping, the load-balancing and z-losses against central finite differences at points away
from ties; float64 training at TP 2 (tokens split over the ranks, or sequence shards), DP 2 and
4 (the auxiliary losses over the step's global batch), PP 2 and their combinations equal one
rank with the same global batch within 1e-10, losses, auxiliary losses, gradient norms and
parameters; experts identical on every TP and DP rank; the `tiny-moe` preset through the
command line, with its metrics.

Megatron-LM bugs these would catch: PR #5047 (the auxiliary and z-loss gradients changed with
the TP/CP size: the tp 2 cases, with and without sequence parallelism, give one rank's
gradients) and #1628 (with the experts' tokens split over TP at EP 1 the wrong gradients were
synchronised: the tp 2 cases' expert gradients equal one rank's).
"""
import json

import numpy as np
import pytest

import cutp
from cutp.bench.model import random_tokens
from cutp.models import GPT, GPTConfig
from cutp.train import RunConfig, build_run, train_step
from tests.gradcheck import numeric_grad, relative_error
from tests.mpirun import SharedLaunch, run_mpi
from tests.tp_utils import self_ctx

TRAIN = "examples.train_gpt:main"


def _model_config(**kw):
    m = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=97, block_size=16, dtype="float64", dropout=0.1,
             n_experts=4, moe_top_k=2, moe_ffn=48, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3)
    m.update(kw)
    return GPTConfig(**m)


# ---- gradients against finite differences ---------------------------------------------------------
@pytest.mark.parametrize("settings", [dict(), dict(moe_renormalize=True, moe_top_k=3),
                                      dict(moe_capacity_factor=1.0, moe_every=2),
                                      dict(moe_top_k=1, moe_seq_aux_loss=0.5),  # the sequence-wise loss too
                                      # DeepSeekMoE: sigmoid, 2 groups of 2 with 1 kept, scaled, a shared expert,
                                      # DeepSeek-V3's sequence-wise loss (over normalised sigmoid scores)
                                      dict(moe_scoring="sigmoid", moe_n_group=2, moe_topk_group=1, moe_renormalize=True,
                                           moe_routed_scaling=2.5, moe_score_bias=True, moe_shared_experts=1,
                                           moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0, moe_seq_aux_loss=0.5)])
def test_moe_gradients_match_finite_differences(settings):
    ctx = self_ctx()
    model = GPT(ctx, _model_config(dropout=0.0, **settings), seed=1)
    rng = np.random.default_rng(0)
    for m in model.moe_layers:  # decisive routing, so the auxiliary terms matter
        m.router.data[...] = rng.standard_normal(m.router.data.shape) * 0.5
    x, y = rng.integers(0, 97, (2, 8)), rng.integers(0, 97, (2, 8))

    def objective():
        loss = model.forward(x, y)
        aux = model.moe_losses()
        return loss + aux["aux_loss"] + aux["z_loss"] + aux["seq_aux_loss"]

    objective()
    k = model.config.moe_top_k
    for m in model.moe_layers:  # away from ties: the k-th and (k+1)-th probabilities well apart
        p = np.sort(m._cache_moe[0][1], axis=1)[:, ::-1]
        assert k == p.shape[1] or (p[:, k - 1] - p[:, k]).min() > 1e-5
    model.backward(1.0)
    if settings.get("moe_capacity_factor"):
        assert sum(m.last["dropped"] for m in model.moe_layers) > 0  # the capacity drops some
    if settings.get("moe_seq_aux_loss"):
        assert sum(m.last["seq_aux_loss"] for m in model.moe_layers) > 0
    grads = {name: p.grad.copy() for name, p in model.named_parameters().items() if p.trainable}
    model.free_cache()
    checked = 0
    for name, p in model.named_parameters().items():
        if not p.trainable or not (".mlp." in name or name in ("layers.0.mlp_norm.weight", "tok_embed.weight")):
            continue
        idx = np.random.default_rng(2).choice(p.data.size, min(12, p.data.size), replace=False)
        num = numeric_grad(objective, p.data, indices=idx).reshape(-1)[idx]
        err = relative_error(grads[name].reshape(-1)[idx], num)
        assert err < 1e-5, (name, err)
        checked += 1
    assert checked >= 6


def test_moe_settings_are_checked():
    with pytest.raises(cutp.ConfigError, match=r"moe_top_k must be an integer in \[1, n_experts=4\], got 5"):
        _model_config(moe_top_k=5).validate()
    with pytest.raises(cutp.ConfigError, match="moe_capacity_factor must be > 0"):
        _model_config(moe_capacity_factor=0.0).validate()
    # DeepSeekMoE's routing fields
    sigmoid = dict(moe_scoring="sigmoid", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    for change, message in ((dict(moe_scoring="sigmoid"), "have no load-balancing or z-loss here"),
                            (dict(sigmoid, moe_n_group=3), "moe_n_group=3 must divide n_experts=4"),
                            (dict(sigmoid, moe_n_group=2, moe_topk_group=3), r"moe_topk_group=3 must be in \[1, "),
                            (dict(moe_score_bias=True), "chooses among sigmoid scores"),
                            (dict(sigmoid, moe_bias_update_rate=1e-3), "needs moe_score_bias=true"),
                            (dict(moe_seq_aux_loss=-1.0), "moe_seq_aux_loss must be >= 0"),
                            (dict(moe_dense_layers=(5,)), r"moe_dense_layers must be a tuple of layer indices")):
        with pytest.raises(cutp.ConfigError, match=message):
            _model_config(**change).validate()
    assert GPTConfig.preset("tiny-moe").with_overrides(["moe_dense_layers=0,2"]).moe_dense_layers == (0, 2)
    cfg = GPTConfig.preset("tiny").with_overrides(["n_experts=8", "moe_capacity_factor=1.25", "moe_renormalize=true"])
    assert (cfg.n_experts, cfg.moe_capacity_factor, cfg.moe_renormalize) == (8, 1.25, True)
    tiny, moe = GPTConfig.preset("tiny"), GPTConfig.preset("tiny-moe")
    assert moe.num_active_parameters() == tiny.num_parameters() + 4 * (128 * 8 + 128)  # + routers, 2nd fc2 bias
    assert moe.num_parameters() - moe.num_active_parameters() == 4 * 6 * (2 * 128 * 256 + 256 + 128)
    assert sum(p.data.size for p in GPT(self_ctx(), moe.with_overrides(["dtype=float32"])).parameters()) == \
        moe.num_parameters()


# ---- layouts: equal to one rank ------------------------------------------------------------------
def _config(tp=1, dp=1, pp=1, micro=2, sp=False, recompute="none", zero=False, ep=1, **model):
    return RunConfig(model=_model_config(**model), tp=tp, dp=dp, pp=pp, ep=ep, batch_size=8, micro_batch_size=micro,
                     seq_len=16, steps=4, warmup=1, seed=3, sequence_parallel=sp, recompute=recompute,
                     distributed_optimizer=zero, eval_every=0, quiet=True, save_on_signal=False)


def _train(cfg, comm, steps=2):
    from cutp.tensor_parallel import gather_full

    run = build_run(cfg, comm, dataset=random_tokens(97, 4096, 0))
    stats = [train_step(run) for _ in range(steps)]
    ctx = run.ctx
    full = lambda p, a: np.asarray(gather_full(ctx.tp, a, p.sharding))[:p.real_rows]  # noqa: E731
    mine = {p.name: (full(p, p.grad), full(p, p.data)) for p in run.model.parameters()}
    everyone = ctx.world.mpi_comm.allgather(mine)
    run.close()
    return [(s.loss, s.grad_norm, s.moe["aux_loss"], s.moe["z_loss"]) for s in stats], everyone, stats[-1].moe


def _worker_equals_one_rank(cases):
    from mpi4py import MPI

    for kw in cases:
        cfg = _config(**kw)
        got, everyone, moe = _train(cfg, MPI.COMM_WORLD)
        model_kw = {k: v for k, v in kw.items() if k.startswith("moe_") or k == "n_experts"}
        ref, ref_ranks, ref_moe = _train(_config(micro=cfg.micro_batch_size * cfg.dp, **model_kw), MPI.COMM_SELF)
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-10, atol=1e-14, err_msg=str(kw))
        assert moe["tokens_per_expert"] == ref_moe["tokens_per_expert"] and moe["dropped"] == ref_moe["dropped"], kw
        ref_params = ref_ranks[0]
        holders = {}
        for rank in everyone:
            for name, (g, w) in rank.items():
                holders.setdefault(name, []).append(w)
                rg, rw = ref_params[name]
                if not cfg.distributed_optimizer:
                    assert np.abs(g - rg).max() <= 1e-10 * np.abs(rg).max(), (kw, name)
                assert np.abs(w - rw).max() <= 1e-10 * np.abs(rw).max(), (kw, name)
        assert set(holders) == set(ref_params), kw
        for name, copies in holders.items():  # every replica (TP, DP) of a parameter: the same bits
            assert all(np.array_equal(c, copies[0]) for c in copies), (kw, name)


def test_moe_tp2_dp2_pp2_equal_one_rank():
    TWO_RANKS.check("tp2 dp2 pp2")


def test_moe_tp2_sequence_parallel_with_dp2_and_the_distributed_optimizer_equal_one_rank():
    FOUR_RANKS.check("tp2_sp dp2 dp4_zero")


def test_dropping_is_per_source_rank_the_same_at_any_tp():
    """With a capacity, each DP rank's micro-batch decides what it drops: tp 2 (with and without
    sequence parallelism) drops what tp 1 drops (the test above checks losses and parameters)."""
    TWO_RANKS.check("dropping")


# ---- the command line ----------------------------------------------------------------------------
def test_tiny_moe_preset_trains_from_the_command_line(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run_mpi(2, TRAIN, ["--preset", "tiny-moe", "--tp", "2", "--steps", "3", "--batch-size", "4", "--seq-len", "32",
                       "--set", "moe_capacity_factor=1.0", "--eval-every", "0", "--metrics", str(metrics), "--quiet"],
            timeout=240)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["moe_aux_loss"] > 0 and r["moe_z_loss"] == 0.0 and 0 <= r["moe_dropped"] < 1
        lo, mean, hi = r["moe_tokens_per_expert"]
        assert lo <= mean <= hi and mean == 4 * 32 * 2 / 8  # k assignments of each token, over 8 experts


def _worker_generation_and_checkpoints(tmp):
    import os

    from mpi4py import MPI

    from cutp.checkpoint import load_model
    from cutp.generate import generate
    from cutp.hf import HFFormatError, save_hf_gpt2
    from cutp.train import save

    world = MPI.COMM_WORLD
    cfg = _config(tp=2, moe_capacity_factor=1.0)
    cfg = RunConfig(**{**cfg.__dict__, "out": os.path.join(tmp, "run")})
    run = build_run(cfg, world, dataset=random_tokens(97, 4096, 0))
    train_step(run)
    save(run)
    from cutp.plan import layout as plan  # the planner's parameters per rank: what the model holds

    planned = plan.plan(cfg.model, tp=2, dp=1, micro_batch=2, seq_len=16,
                        config=cfg.model, dtype="float64")
    assert planned["params_per_gpu"] == run.model.num_parameters_local(), planned["params_per_gpu"]
    with pytest.raises(HFFormatError, match="a mixture-of-experts model .* cannot be exported as GPT-2"):
        save_hf_gpt2(run.model, os.path.join(tmp, "hf"))
    run.close()
    ckpt = os.path.join(tmp, "run")
    ctx = cutp.init(comm=world, tp=2)
    at_tp2 = generate(load_model(ckpt, ctx)[0], [1, 2, 3], 6, temperature=0)
    one = generate(load_model(ckpt, self_ctx())[0], [1, 2, 3], 6, temperature=0)
    assert at_tp2 == one, (at_tp2, one)
    ctx.close()


def test_moe_checkpoint_loads_at_tp1_generation_and_no_gpt2_export(tmp_path):
    run_mpi(2, "tests.tensor_parallel.test_moe:_worker_generation_and_checkpoints", str(tmp_path), timeout=180)


# ---- the planner --------------------------------------------------------------------------------
def test_planner_counts_moe_parameters_per_rank_and_the_all_to_all():
    from cutp.plan import layout as plan, moe as plan_moe

    config = GPTConfig.preset("tiny-moe")
    a = config
    for tp in (1, 2):
        r = plan.plan(a, tp=tp, dp=1, micro_batch=2, seq_len=64, config=config, dtype="float32")
        assert r["params_total"] == config.num_parameters() and r["params_active"] == config.num_active_parameters()
        assert plan.param_count(a, tp)["total"] == config.num_parameters()
        assert plan.param_count(a, tp)["active"] == config.num_active_parameters()
        model = GPT(self_ctx(), config.with_overrides(["dtype=float32"])) if tp == 1 else None
        if model is not None:  # (tp 2: the experts are replicated, the rest as the dense model's)
            assert r["params_per_gpu"] == model.num_parameters_local()
    dense = plan.plan(GPTConfig.preset("tiny"), tp=2, dp=1, micro_batch=2, seq_len=64,
                      config=GPTConfig.preset("tiny"), dtype="float32")
    per_expert = 2 * 128 * 256 + 256 + 128
    r2 = plan.plan(a, tp=2, dp=2, ep=2, micro_batch=2, seq_len=64, config=config, dtype="float32")
    r1 = plan.plan(a, tp=2, dp=2, ep=1, micro_batch=2, seq_len=64, config=config, dtype="float32")
    assert r1["params_per_gpu"] - r2["params_per_gpu"] == 4 * 4 * per_expert  # 4 layers, 4 experts elsewhere
    assert r1["params_per_gpu"] - dense["params_per_gpu"] == 4 * (128 * 8 + 8 * per_expert - (2 * 128 * 256 + 256 + 128))
    # all-to-all: 2 x k x (b s / tp) x h x 4 bytes per MoE layer and direction (half on the wire), 2 directions
    assert r2["ep_all_to_all"]["bytes"] == 4 * 2 * 2 * 2 * (2 * 64 // 2) * 128 * 4
    assert r2["ep_all_to_all"]["wire_bytes"] == r2["ep_all_to_all"]["bytes"] / 2
    assert r1["ep_all_to_all"]["bytes"] == 0
    full = plan.plan(a, tp=2, dp=2, ep=2, micro_batch=2, seq_len=64, config=config, dtype="float32", recompute="full")
    assert full["ep_all_to_all"]["bytes"] == 3 * r2["ep_all_to_all"]["bytes"] // 2  # dispatch + combine again
    assert (r2["ep_all_to_all"]["calls"], full["ep_all_to_all"]["calls"]) == (4 * 5, 4 * 8)
    assert plan_moe.moe_layers(plan.replace(a, moe_every=3)) == 2  # layers 0 and 3
    with pytest.raises(cutp.ConfigError, match="--ep 3 does not divide n_experts=8"):
        plan.plan(a, tp=1, dp=3, ep=3, micro_batch=1, seq_len=64, config=config)
    with pytest.raises(cutp.ConfigError, match="--ep 2 does not divide --dp 1"):
        plan.plan(a, tp=1, dp=1, ep=2, micro_batch=1, seq_len=64, config=config)


def _worker_pipeline_stages_planned(case):
    from mpi4py import MPI

    from cutp.plan import layout as plan, pipeline as plan_pp
    from cutp.train.memory import memory_record

    cfg = _config(**case)
    run = build_run(cfg, MPI.COMM_WORLD, dataset=random_tokens(97, 4096, 0))
    train_step(run)  # (the first step allocates the optimizer's state)
    mine = memory_record(run)
    every = MPI.COMM_WORLD.allgather((run.ctx.pp_rank, mine))
    run.close()
    planned = plan_pp.plan_pipeline(cfg.model, pp=cfg.pp, tp=cfg.tp, dp=cfg.dp,
                                    ep=cfg.ep, micro_batch=cfg.micro_batch_size, seq_len=cfg.seq_len,
                                    accum=cfg.accum_steps, config=cfg.model, dtype="float64",
                                    distributed_optimizer=cfg.distributed_optimizer)
    for stage, got in every:
        st = planned["stages"][stage]
        assert st["params_local"] == got["params_local"], (case, stage, st["params_local"], got["params_local"])
        for key in ("params", "grads", "optimizer"):
            assert st[key] == got[key], (case, stage, key, st[key], got[key])


PLANNED_STAGES = [dict(pp=2, moe_every=3, n_layer=4, tie_embeddings=False),
                  dict(pp=2, dp=2, ep=2, zero=True, micro=1, n_layer=4, moe_every=4)]


@pytest.mark.parametrize("case", PLANNED_STAGES)
def test_planned_pipeline_stages_of_an_moe_model_hold_what_training_holds(case):
    """The planner's state per stage (the dense part exact, the MoE layers' routers and this
    rank's experts) equals what each stage of a training run holds, at EP 1 and 2 (there with
    the distributed optimizer and a stage without MoE layers: no expert part at all)."""
    (FOUR_RANKS if case.get("dp", 1) == 2 else TWO_RANKS).check(f"planned stages {PLANNED_STAGES.index(case)}")


# The library tests above on 2 and on 4 ranks, each set in one launch (the ranks' start-up is a good
# part of each one's time); each test checks its case.
HERE = "tests.tensor_parallel.test_moe"
TWO_RANKS = SharedLaunch(2, {
    "tp2 dp2 pp2": (f"{HERE}:_worker_equals_one_rank", [[
        dict(tp=2), dict(tp=2, moe_capacity_factor=1.0, moe_top_k=1), dict(dp=2, micro=1),
        dict(pp=2, moe_every=2, recompute="full")]]),
    "dropping": (f"{HERE}:_worker_equals_one_rank", [[dict(tp=2, sp=True, moe_capacity_factor=0.75)]]),
    "planned stages 0": (f"{HERE}:_worker_pipeline_stages_planned", [PLANNED_STAGES[0]]),
}, timeout=600)
FOUR_RANKS = SharedLaunch(4, {
    "tp2_sp dp2 dp4_zero": (f"{HERE}:_worker_equals_one_rank", [[
        dict(tp=2, dp=2, sp=True, micro=1, moe_renormalize=True),
        dict(tp=2, sp=True, pp=2, moe_capacity_factor=1.25, recompute="selective"),
        dict(dp=4, micro=1, zero=True)]]),
    "planned stages 1": (f"{HERE}:_worker_pipeline_stages_planned", [PLANNED_STAGES[1]]),
}, timeout=420)


def test_a_layers_counting_pass_and_metrics_on_one_rank():
    """A layer driven alone (no train_step): its counting pass's fractions, its metrics read when
    asked (`last`), and a counting pass that routed nothing refused naming both counts."""
    from cutp.tensor_parallel.moe import MoEMLP

    m = MoEMLP(self_ctx(), 8, n_experts=4, top_k=2, ffn=8, name="moe", dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((2, 4, 8))
    m.reset_step_stats()
    m.begin_step(8)
    m.start_counting()
    m.forward(x)
    tally = np.array(m._tally)
    assert tally[:4].sum() == 8 * 2 and tally[4] == 8
    m.finish_counting()
    np.testing.assert_array_equal(m.step_fractions[1], tally[:4] / 16)
    m.forward(x)
    assert len(m.pending) == 1
    last = m.last  # read from the device now
    assert m.pending == () and np.array_equal(last["assigned"], tally[:4]) and last["dropped"] == 0.0
    assert m.step_stats["forwards"] == 1 and last["aux_loss"] > 0
    m.end_step()
    m.begin_step(8)
    m.start_counting()
    with pytest.raises(RuntimeError, match="the counting pass routed 0 tokens; the step has 8"):
        m.finish_counting()
