"""Checkpoints of the model families (issue 27): a Llama-shaped run (SwiGLU's [gate_r ; up_r]
shards, GQA, untied head, dropout) saved at tp 2 resumes at tp 2 and, resharded, at tp 1 with
the float64 losses of the run that never stopped (1e-10)."""
import os

import numpy as np

from cutp.bench.model import random_tokens
from cutp.models import GPTConfig
from cutp.train import RunConfig, build_run, save, train_step
from tests.models.test_families import LLAMA
from tests.mpirun import run_mpi


def _config(tp=1, **run):
    return RunConfig(model=GPTConfig(**LLAMA), tp=tp, batch_size=4, micro_batch_size=2, seq_len=16, steps=4,
                     warmup=1, seed=3, eval_every=0, quiet=True, save_on_signal=False, **run)


def _run(cfg, comm, steps, save_at=None):
    run = build_run(cfg, comm, dataset=random_tokens(97, 4096, 0))
    losses = []
    try:
        for i in range(steps):
            if save_at is not None and i == save_at:
                save(run)
            losses.append(train_step(run).loss)
    finally:
        run.close()
    return losses


def _worker(tmp):
    from mpi4py import MPI

    out = os.path.join(tmp, "llama")
    whole = _run(_config(tp=2, out=out), MPI.COMM_WORLD, 4, save_at=2)
    ckpt = os.path.join(out, "step-00000002")
    again = _run(_config(tp=2, resume=ckpt, resumed_step=2), MPI.COMM_WORLD, 2)
    assert again == whole[2:], (again, whole)  # the same mesh: bit for bit
    resharded = _run(_config(tp=1, resume=ckpt, resumed_step=2), MPI.COMM_SELF, 2)
    np.testing.assert_allclose(resharded, whole[2:], rtol=1e-10, atol=0)


def test_a_llama_checkpoint_resumes_and_reshards(tmp_path):
    run_mpi(2, "tests.models.test_family_checkpoints:_worker", str(tmp_path), timeout=240)
