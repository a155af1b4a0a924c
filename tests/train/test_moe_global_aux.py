"""MoE auxiliary losses over the step's global batch (issue 26): neither the micro-batch size nor
dp changes the math.

float64, dropout on, load-balancing and z-loss coefficients not 0: three training steps at
micro-batch 2 and 1 on one rank (with and without full recomputation; with the z-loss alone),
at dp 2 and 4 (with one micro-batch per rank, and several: the counting pass), at tp 2 (rows
split; sequence parallelism with dp 2), ep 2 and pp 2 (GPipe, 1F1B and interleaved: the
counting pass through the pipeline) give the losses, auxiliary and z-losses included, the
gradient norms and every gradient of one rank running the global batch as one micro-batch,
within 1e-10. Before, each micro-batch's own statistics made micro-batch 8 and 2 differ by
about 1e-3 in the losses.
"""
import numpy as np

from cutp.bench.model import random_tokens
from cutp.models import GPTConfig
from cutp.train import RunConfig, build_run, train_step
from tests.mpirun import run_mpi

BATCH = 8


def _config(micro, **kw):
    layout = {k: kw.pop(k) for k in ("tp", "dp", "pp", "ep", "sp", "recompute", "pp_schedule", "pp_virtual")
              if k in kw}
    model = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=97, block_size=16, dtype="float64", dropout=0.1,
                 n_experts=4, moe_top_k=2, moe_ffn=48, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-2)
    model.update(kw)
    return RunConfig(model=GPTConfig(**model), tp=layout.get("tp", 1), dp=layout.get("dp", 1),
                     pp=layout.get("pp", 1), ep=layout.get("ep", 1), batch_size=BATCH, micro_batch_size=micro,
                     seq_len=16, steps=4, warmup=1, seed=3, sequence_parallel=layout.get("sp", False),
                     recompute=layout.get("recompute", "none"), pp_schedule=layout.get("pp_schedule", "1f1b"),
                     pp_virtual=layout.get("pp_virtual", 1), eval_every=0, quiet=True, save_on_signal=False)


def _train(cfg, comm, steps=3):
    """Per step: (loss, grad norm, aux loss, z-loss) and {name: full gradient} of every parameter
    this rank's part of the world holds (pipeline stages and EP ranks merged)."""
    from cutp.tensor_parallel import gather_full

    run = build_run(cfg, comm, dataset=random_tokens(97, 4096, 0))
    losses, grads = [], []
    for _ in range(steps):
        s = train_step(run)
        losses.append((s.loss, s.grad_norm, s.moe["aux_loss"], s.moe["z_loss"]))
        mine = {p.name: np.asarray(gather_full(run.ctx.tp, p.grad, p.sharding))[:p.real_rows]
                for p in run.model.parameters()}
        merged = {}
        for rank in comm.allgather(mine):
            merged.update(rank)
        grads.append(merged)
    run.close()
    return np.array(losses), grads


def _assert_same(case, got, ref):
    (losses, grads), (ref_losses, ref_grads) = got, ref
    assert (ref_losses[:, 3] > 0).all()  # the auxiliary terms at work
    assert (ref_losses[:, 2] > 0).all() or case.get("moe_aux_loss_coeff") == 0
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0, err_msg=str(case))
    for step, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert set(g) == set(rg), (case, set(rg) ^ set(g))
        for name, r in rg.items():
            assert np.abs(g[name] - r).max() <= 1e-10 * np.abs(r).max(), (case, step, name)


_MODEL_KEYS = ("n_layer", "moe_aux_loss_coeff")


def _reference(case=None, cache={}):
    """One rank, the global batch as one micro-batch, the case's model (computed once per model)."""
    from mpi4py import MPI

    model = {k: v for k, v in (case or {}).items() if k in _MODEL_KEYS}
    key = tuple(sorted(model.items()))
    if key not in cache:
        cache[key] = _train(_config(BATCH, **model), MPI.COMM_SELF)
    return cache[key]


def test_micro_batch_size_changes_nothing_on_one_rank():
    from mpi4py import MPI

    for case in (dict(micro=2), dict(micro=1), dict(micro=2, recompute="full"),
                 dict(micro=2, moe_aux_loss_coeff=0.0)):  # (the z-loss alone: no counting pass)
        _assert_same(case, _train(_config(**case), MPI.COMM_SELF), _reference(case))


def test_a_forward_outside_the_step_keeps_its_own_statistics():
    """After a step (a counting pass among it), a plain forward's losses are its micro-batch's
    own again: the step's statistics do not outlive it."""
    from mpi4py import MPI

    run = build_run(_config(2), MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
    train_step(run)
    x, y = next(iter(run.sampler.micro_batches(5)))
    model = run.model
    model.forward(x, y)
    layer = model.moe_layers[0]
    assert layer.step_tokens is None and layer.step_fractions is None
    last = dict(layer.last)
    probs = layer._cache_moe[0][1]
    f = last["assigned"] / (x.size * 2)
    aux = 0.1 * 4 * float((f * probs.sum(axis=0)).sum()) / x.size
    assert abs(last["aux_loss"] - aux) <= 1e-12 * aux
    run.close()


def _worker_layouts_equal_one_rank(halves):
    """World of 4: the whole-world cases, then each half of it (2 ranks) its own list at once."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    for case in ([dict(dp=4, micro=1), dict(dp=4, micro=2), dict(dp=4, ep=2, micro=1),
                  dict(dp=2, tp=2, sp=True, micro=1)]):
        _assert_same(case, _train(_config(**case), world), _reference(case))
    half = world.Split(world.rank // 2, world.rank)
    for case in halves[world.rank // 2]:
        _assert_same(case, _train(_config(**case), half), _reference(case))
    half.Free()


def test_dp_tp_ep_and_pp_change_nothing():
    run_mpi(4, "tests.train.test_moe_global_aux:_worker_layouts_equal_one_rank",
            [[dict(dp=2, micro=1), dict(dp=2, micro=4), dict(tp=2, micro=2),
              dict(pp=2, micro=1, pp_schedule="gpipe")],
             [dict(pp=2, micro=2), dict(pp=2, micro=1, n_layer=4, pp_schedule="interleaved", pp_virtual=2)]],
            timeout=600)


def test_not_stashed_nests():
    """The counting pass runs the whole model not stashed; a fully recomputed block inside runs
    its own not_stashed: leaving it must not stash the rest of the pass."""
    from cutp.models import GPT
    from cutp.tensor_parallel.parameter import not_stashed
    from tests.tp_utils import self_ctx

    model = GPT(self_ctx(), _config(2).model)
    block = model.layers[0]
    with not_stashed(model):
        with not_stashed(block):
            assert not block.stash
        assert not block.stash and not block.mlp.stash and not model.stash
    assert block.stash and block.mlp.stash and "stash" not in vars(block)


def test_the_planner_books_the_counting_pass_point_to_point():
    """At pp > 1 the counting pass sends every micro-batch's activations forward once more; not
    with one micro-batch per step, nor without a load-balancing loss."""
    from cutp.plan import layout as plan
    from cutp.plan.pipeline import plan_pipeline

    def p2p(accum, **kw):
        cfg = _config(2, **kw).model
        r = plan_pipeline(cfg, pp=2, tp=1, dp=1, micro_batch=2, seq_len=16,
                          accum=accum, config=cfg, dtype="float64", schedule="gpipe")
        return r["p2p_bytes_per_step"]["forward"], r["p2p_bytes_per_step"]["backward"]

    message = 2 * 16 * 32 * 8
    assert p2p(4) == (8 * message, 4 * message)
    assert p2p(1) == (message, message)
    assert p2p(4, moe_aux_loss_coeff=0.0) == (4 * message, 4 * message)
