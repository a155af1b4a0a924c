"""Issue 30: overlapping communication with computation changes no bit. At tp2 x dp2, dp4 with
the distributed optimizer, tp2 + sequence parallelism (x dp2) and pp2 x dp2, in float32 and
bfloat16, two steps with --overlap-grad-reduce (small buckets: several per rank),
--overlap-param-gather and --tp-comm-overlap give the losses and the weights of the same run
without them, tolerance 0; and the buckets did start during the backward (not all at its end)."""
import numpy as np

from cutp.bench.model import random_tokens
from cutp.models import GPTConfig
from cutp.train import RunConfig, build_run, train_step
from tests.mpirun import run_mpi

LAYOUTS = {  # name: RunConfig settings (4 ranks)
    "tp2 x dp2": dict(tp=2, dp=2),
    "dp4 + ZeRO": dict(dp=4, distributed_optimizer=True),
    "tp2 + SP x dp2": dict(tp=2, dp=2, sequence_parallel=True, distributed_optimizer=True),
    "pp2 x dp2": dict(pp=2, dp=2),
}
N_LAYER = {"pp2 x dp2": 4}  # (two blocks per stage: a stage's buckets can start before its last unit)
OVERLAP = dict(overlap_grad_reduce=True, bucket_size=600, tp_comm_overlap=True)


def _config(dtype, layout, n_layer=2, **overlap):
    model = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=61, block_size=8, dtype=dtype, vocab_multiple=1)
    return RunConfig(model=model, batch_size=8, micro_batch_size=2, seq_len=8, steps=3, warmup=1, seed=3,
                     eval_every=0, quiet=True, save_on_signal=False, **layout, **overlap)


def _train(cfg, comm, data):
    run = build_run(cfg, comm, dataset=data)
    losses = [train_step(run).loss for _ in range(2)]
    starts = list(run.grad_buckets.started_log) if run.grad_buckets is not None else []
    run.gather_params()
    weights = [run.ctx.to_numpy(p.data).copy() for p in run.model.parameters()]
    run.close()
    return losses, weights, starts


def _worker():
    from mpi4py import MPI

    data = random_tokens(61, 4096, 0)
    for dtype in ("float32", "bfloat16"):
        for name, layout in LAYOUTS.items():
            extra = dict(OVERLAP, overlap_param_gather=bool(layout.get("distributed_optimizer")))
            n = N_LAYER.get(name, 2)
            off_losses, off_weights, _ = _train(_config(dtype, layout, n), MPI.COMM_WORLD, data)
            on_losses, on_weights, starts = _train(_config(dtype, layout, n, **extra), MPI.COMM_WORLD, data)
            assert on_losses == off_losses, (name, dtype, on_losses, off_losses)
            for a, b in zip(on_weights, off_weights):
                assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), (name, dtype)
            assert len(starts) > 2, (name, starts)
            # some bucket started before the backward's last unit (the embeddings) had run
            assert min(units for _, units in starts) < max(units for _, units in starts), (name, starts)


def test_overlap_on_and_off_give_the_same_bits():
    run_mpi(4, "tests.train.test_overlap:_worker", timeout=300)
