"""Pipeline bugs Megatron-LM users hit that must not happen here (issue 15), and a dead stage.

- #656, #4641: the last stage's LM head (its copy of a tied embedding) drifted away from the first
  stage's embedding. Here the two copies are the same bits after every step, through the
  optimizer, with weight decay and clipping, under 1F1B and the interleaved schedule.
- #1012: the embedding gradient's all-reduce (first + last stage) ran after the gradient sync, so
  the norm and the clipping saw half of it. Here the gradient norm of every pipeline layout
  equals one rank's (clipping active), which it would not if the sum came late.
- #5100, PR #5240: deadlocks from a fixed send/receive order at PP >= 4 and from pairwise
  communicators created in different orders. Here every schedule at pp 4 and 8 is simulated for
  deadlocks (tests/train/test_pipeline_interleaved.py), a pp 4 run finishes, and all its point-to-point
  traffic goes over the one pp communicator every rank split off in the same order.
- A stage that stops answering ends the job (the watchdog covers the point-to-point exchanges):
  never a hang.
"""
import time

import numpy as np

from cutp.bench.model import random_tokens
from cutp.models import GPTConfig
from cutp.train import RunConfig, StepHooks, build_run, train_step
from tests.mpirun import run_mpi
from tests.tp_utils import on_rank_0


def _config(pp=1, virtual=1, schedule="1f1b", micro=1, **kw):
    model = GPTConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, vocab_size=97, block_size=16, dtype="float64",
                      dropout=0.1)
    return RunConfig(model=model, pp=pp, pp_virtual=virtual, pp_schedule=schedule, batch_size=8,
                     micro_batch_size=micro, seq_len=16, steps=6, warmup=1, seed=3, lr=3e-2, weight_decay=0.1,
                     grad_clip=0.05, eval_every=0, quiet=True, save_on_signal=False, **kw)


def _steps(cfg, comm, n=3):
    run = build_run(cfg, comm, dataset=random_tokens(97, 4096, 0))
    out, copies = [], []
    try:
        for _ in range(n):
            s = train_step(run)
            out.append((s.loss, s.grad_norm))
            embed = run.model.tok_embed
            copies.append(None if embed is None else run.ctx.to_numpy(embed.weight.data).copy())
        p2p = {k: v for k, v in run.ctx.counter.summary().items() if k.endswith((".send", ".recv"))}
    finally:
        run.close()
    return out, copies, p2p


def _worker_tied_copies_and_the_norm(cases):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ref, _, _ = on_rank_0(lambda: _steps(_config(), MPI.COMM_SELF))
    assert all(norm > 0.05 for _, norm in ref), ref  # the clipping is active: a half-summed gradient would show
    for kw in cases:
        got, copies, p2p = _steps(_config(**kw), world)
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-10, atol=0, err_msg=str(kw))
        every = world.allgather(copies)  # the first and the last stage's tables after every step
        for step, (first, last) in enumerate(zip(every[0], every[-1])):
            assert np.array_equal(first, last), (kw, step)
        keys = {k.split(".")[0] for k in p2p}  # the groups that carried point-to-point messages
        assert keys == {"pp"}, (kw, sorted(p2p))


def test_tied_copies_stay_identical_and_the_norm_sees_the_summed_embedding_gradient_pp2():
    run_mpi(2, "tests.train.test_pipeline_megatron_bugs:_worker_tied_copies_and_the_norm",
            [dict(pp=2), dict(pp=2, virtual=2, schedule="interleaved", micro=2)], timeout=180)


def test_pp4_runs_with_one_communicator_for_every_message():
    run_mpi(4, "tests.train.test_pipeline_megatron_bugs:_worker_tied_copies_and_the_norm",
            [dict(pp=4, micro=2), dict(pp=4, schedule="gpipe")], timeout=240)


class _StuckStage(StepHooks):
    """The last stage stops answering in the middle of a step (a hung process, a dead GPU)."""

    def after_forward(self, run, micro):
        if run.ctx.pp_rank == run.ctx.pp_size - 1 and micro == 1:
            time.sleep(600)


def _worker_stuck_stage():
    from mpi4py import MPI

    run = build_run(_config(pp=2, collective_timeout=3.0), MPI.COMM_WORLD, dataset=random_tokens(97, 4096, 0))
    train_step(run, _StuckStage())
    raise AssertionError("the step finished although a stage never answered")


def test_a_stage_that_stops_answering_ends_the_job():
    t0 = time.monotonic()
    res = run_mpi(2, "tests.train.test_pipeline_megatron_bugs:_worker_stuck_stage", timeout=90, expect_failure=True)
    assert time.monotonic() - t0 < 60, "the job hung until the test's timeout"
    # whichever watchdog fires first ends the job: the waiting stage's, on its exchange with the
    # stuck one, or the stuck stage's own progress watchdog
    assert "cutp watchdog" in res.stdout and ("exchange on group 'pp'" in res.stdout
                                              or "has made no progress" in res.stdout), res.stdout[-3000:]
