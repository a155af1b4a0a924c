"""Issue 16: with ignored targets (ignore_index) the step's loss is the mean over every target of
the global batch that is not ignored, whatever the DP size and the micro-batching (Hugging Face
fixed the same gradient-accumulation bug with num_items_in_batch in 2024): DP 2 with 4
micro-batches per rank equals one rank, float64, within 1e-12, loss and every gradient, with
ranks and micro-batches holding very different numbers of ignored targets."""
import numpy as np

from cutp.bench.model import random_tokens
from cutp.models import GPTConfig
from cutp.train import RunConfig, build_run, train_step
from tests.mpirun import run_mpi
from tests.tp_utils import on_rank_0

IGNORE = -100


def _config(dp, micro):
    model = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=61, block_size=16, dtype="float64",
                      vocab_multiple=1)
    return RunConfig(model=model, dp=dp, batch_size=8, micro_batch_size=micro, seq_len=16, steps=3, warmup=1,
                     seed=2, eval_every=0, quiet=True, save_on_signal=False)


def _with_ignored_targets(sampler):
    """Global row g of every step ignores its first 2 * g targets (row 7: 14 of 16), and row 1 all."""
    plain = sampler.micro_batches

    def micro_batches(step, split="train"):
        for k, (x, y) in enumerate(plain(step, split)):
            y = y.copy()
            for j in range(y.shape[0]):
                g = sampler.first_row(k) + j
                y[j, : 2 * g] = IGNORE
                if g == 1:
                    y[j] = IGNORE
            yield x, y

    sampler.micro_batches = micro_batches


def _train(cfg, comm):
    run = build_run(cfg, comm, dataset=random_tokens(61, 4096, 0))
    _with_ignored_targets(run.sampler)
    losses = [train_step(run).loss for _ in range(2)]  # the second after an update
    grads = {p.name: p.grad.copy() for p in run.model.parameters()}
    run.close()
    return losses, grads


def _worker():
    from mpi4py import MPI

    losses, grads = _train(_config(dp=2, micro=1), MPI.COMM_WORLD)
    ref_losses, ref_grads = on_rank_0(lambda: _train(_config(dp=1, micro=8), MPI.COMM_SELF))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12, atol=0)
    for name, g in ref_grads.items():
        scale = float(np.abs(g).max())
        assert float(np.abs(grads[name] - g).max()) <= 1e-12 * scale, name
    # the old per-micro-batch mean would differ: the comparison is not vacuous
    per_micro = []
    cfg = _config(dp=1, micro=1)
    run = build_run(cfg, MPI.COMM_SELF, dataset=random_tokens(61, 4096, 0))
    _with_ignored_targets(run.sampler)
    for x, y in run.sampler.micro_batches(0):
        valid = y != IGNORE
        per_micro.append(valid.sum())
    run.close()
    assert len(set(int(c) for c in per_micro)) > 2 and min(per_micro) == 0


def test_loss_and_gradients_average_over_the_global_batch_targets():
    run_mpi(2, "tests.train.test_loss_average:_worker", timeout=120)


def test_without_ignored_targets_the_weights_are_one_over_accum():
    from mpi4py import MPI

    import cutp
    from cutp.train.reductions import loss_weights

    ctx = cutp.init(comm=MPI.COMM_SELF)
    ys = [np.zeros((2, 8), np.int64)] * 3
    assert loss_weights(ctx, ys, IGNORE) == [1 / 3] * 3
    ys = [np.full((2, 8), IGNORE)] * 2
    assert loss_weights(ctx, ys, IGNORE) == [0.0, 0.0]
    ctx.close()
