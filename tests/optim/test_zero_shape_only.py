"""ZeRO-3's paths that only several ranks take, run in one process on the planner's shape-only
context (cutp.comm.shape_only: every collective counted, no values): HSDP's replica all-reduce in
the gradient-reduction dtype, and the prefetch of a first unit that trains nothing (frozen
embeddings), counted against the same step without them; the reductions polled between layers;
a state dict of several ranks refused."""
import pytest

from cutp.comm.counting import TimedRequest
from cutp.comm.shape_only import ShapeOnlyContext
from cutp.data import BatchSampler
from cutp.models import GPT, GPTConfig
from cutp.optim.sharded import ShardedAdamW
from cutp.plan.run import _tokens
from cutp.train.config import RunConfig
from cutp.train.step import assemble_run, train_step

LLAMA = GPTConfig.preset("llama-tiny", n_layer=2)


def _second_step_collectives(dp: int, **settings) -> dict:
    settings = {"zero": 3, **settings}
    cfg = RunConfig(model=LLAMA, device="cpu", tp=1, dp=dp, micro_batch_size=1, batch_size=2 * dp, seq_len=16,
                    steps=2, warmup=0, eval_every=0, quiet=True, save_on_signal=False, collective_timeout=0, **settings)
    ctx = ShapeOnlyContext(dp=dp, rank=0, device="cpu")
    data = _tokens(LLAMA.vocab_size, 16, cfg.batch_size)
    run = assemble_run(cfg, ctx, data, BatchSampler(data, 16, cfg.batch_size, dp, ctx.dp_rank, 1, seed=0), init=False)
    train_step(run)
    ctx.counter.reset()
    assert not train_step(run).skipped
    return ctx.counter.summary()


def test_hsdp_all_reduces_its_replicas_in_the_reduction_dtype():
    low = _second_step_collectives(4, dp_replicate=2, grad_reduce_dtype="bfloat16")
    full = _second_step_collectives(4, dp_replicate=2)
    for op in ("hsdp_replicas.all_reduce", "hsdp_shard.reduce_scatter"):
        assert low[op]["elements"] == full[op]["elements"] and 2 * low[op]["bytes"] == full[op]["bytes"], op
    assert low["hsdp_shard.all_gather"] == full["hsdp_shard.all_gather"]  # (parameters gathered in their dtype)


def test_a_first_unit_that_trains_nothing_is_still_gathered_ahead():
    overlap = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    frozen = _second_step_collectives(2, freeze="embeddings", **overlap)
    trained = _second_step_collectives(2, **overlap)
    assert frozen["dp.all_gather"] == trained["dp.all_gather"]  # every unit gathered, the first one too
    embedding = LLAMA.vocab_size * LLAMA.n_embd  # (not reduced: 2 micro-batches of it fewer)
    assert trained["dp.reduce_scatter"]["calls"] - frozen["dp.reduce_scatter"]["calls"] == 2
    assert trained["dp.reduce_scatter"]["elements"] - frozen["dp.reduce_scatter"]["elements"] == 2 * embedding


def test_overlapped_reductions_are_polled_between_layers(monkeypatch):
    """(MPI progresses a request only inside MPI calls: each unit's backward tests the reductions
    in flight, as the DDP buckets do. ZeRO's poll was written but never called.)"""
    polled = []
    test = TimedRequest.test
    monkeypatch.setattr(TimedRequest, "test", lambda self: polled.append(self.op) or test(self))
    _second_step_collectives(2, zero=2, overlap_grad_reduce=True)
    assert polled and set(polled) == {"reduce_scatter"}
    polled.clear()
    _second_step_collectives(2, zero=2)  # (without overlap each reduction is waited for at once)
    assert not polled


def test_a_state_dict_of_several_ranks_names_state_pieces():
    ctx = ShapeOnlyContext(dp=2, rank=0, device="cpu")
    opt = ShardedAdamW(GPT(ctx, LLAMA, init=False), ctx, zero=2)
    with pytest.raises(ValueError, match=r"ShardedAdamW.state_dict needs a group of one rank: use state_pieces"):
        opt.state_dict()
    pieces, _ = opt.state_pieces()
    assert {k.split(".", 1)[0] for k in pieces} == {"exp_avg", "exp_avg_sq"}
