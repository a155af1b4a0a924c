"""The GPT model's API refusals on one rank (cutp.models.gpt): a bad `pp_virtual`, CP
communication, gather rank, state dict or generation past block_size is refused naming the
value and what is accepted; `hidden_states` is the output the LM head reads; on the planner's
shape-only arrays, a tp x cp layout's sequence checks and sequence-parallel evaluation."""
import dataclasses

import numpy as np
import pytest

import cutp
from cutp.models import GPT, GPTConfig
from cutp.plan.run import ShapeOnlyContext

TINY = GPTConfig.preset("tiny", n_layer=2, dtype="float64")


@pytest.fixture
def ctx():
    c = cutp.init(device="cpu")
    yield c
    c.close()


def test_pp_virtual_must_be_an_integer_of_at_least_one_and_above_one_only_with_pp(ctx):
    for bad in (0, 2, 1.0):
        with pytest.raises(cutp.ConfigError, match=rf"pp_virtual {bad!r}: model chunks per stage need an integer "
                                                   r">= 1, and more than 1 only with pp > 1"):
            GPT(ctx, TINY, pp_virtual=bad)


def test_context_parallel_communication_is_ring_or_a2a(ctx):
    model = GPT(ctx, TINY)
    with pytest.raises(cutp.ConfigError, match=r"cp_comm 'tree': use one of ring, a2a"):
        model.set_context_parallel_comm("tree")
    model.set_context_parallel_comm("a2a")
    assert {b.attn.cp_comm for b in model.layers} == {"a2a"}


def test_hidden_states_are_what_the_head_turns_into_the_logits(ctx):
    model = GPT(ctx, TINY, seed=3)
    model.eval()
    idx = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 8))
    h = model.hidden_states(idx)
    assert h.shape == (1, 8, TINY.n_embd)
    logits = model.gather_logits(model.forward(idx))
    np.testing.assert_allclose(h @ model.tok_embed.weight.data.T, logits, rtol=1e-12, atol=1e-12)  # (tied head)


def test_gather_rank_must_be_a_tp_rank(ctx):
    model = GPT(ctx, TINY)
    model.eval()
    shard = model.forward(np.zeros((1, 4), dtype=np.int64))
    with pytest.raises(ValueError, match=r"rank must be None or a TP rank in \[0, 1\), got 1"):
        model.gather_logits(shard, rank=1)


def test_generation_past_block_size_is_refused(ctx):
    cfg = dataclasses.replace(TINY, block_size=8)
    model = GPT(ctx, cfg)
    model.eval()
    caches = model.new_kv_cache(1, 16)
    model.forward_cached(np.zeros((1, 6), dtype=np.int64), caches)
    with pytest.raises(ValueError, match=r"generation reached 9 positions; block_size is 8"):
        model.forward_cached(np.zeros((1, 3), dtype=np.int64), caches)


def test_moe_stage_backward_needs_the_auxiliary_losses_weight(ctx):
    model = GPT(ctx, GPTConfig.preset("tiny-moe", n_layer=2, dtype="float64"))
    idx = np.random.default_rng(1).integers(0, 256, (2, 8))
    model.stage_forward(idx, idx)
    with pytest.raises(ValueError, match=r"stage_backward of MoE layers needs aux_grad"):
        model.stage_backward(1.0)


def test_a_state_dict_that_does_not_fit_is_refused_naming_the_tensor(ctx):
    model = GPT(ctx, TINY)
    full = model.gather_state_dict()
    missing = {k: v for k, v in full.items() if k != "final_norm.weight"}
    with pytest.raises(ValueError, match=r"state dict mismatch: missing \['final_norm.weight'\], unexpected \[\]"):
        model.load_full_state_dict(missing)
    extra = dict(full, **{f"x{i}": np.zeros(1) for i in range(9)})
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['x0', .*'x7'\]\.\.\."):
        model.load_full_state_dict(extra)
    wrong = dict(full, **{"final_norm.weight": np.ones(TINY.n_embd + 1)})
    with pytest.raises(ValueError, match=r"final_norm.weight: expected full shape \(128,\), got \(129,\)"):
        model.load_full_state_dict(wrong)
    model.load_full_state_dict(missing, strict=False)  # (the rest loads)


def test_packed_documents_must_be_an_integer_array(ctx):
    model = GPT(ctx, TINY)
    idx = np.zeros((1, 4), dtype=np.int64)
    for bad, kind in (([[0, 0, 1, 1]], "list of dtype None"), (np.zeros((1, 4)), "ndarray of dtype float64")):
        with pytest.raises(ValueError, match=rf"documents must be an integer array \[batch, seq\] of document ids, "
                                             rf"got {kind}"):
            model.forward(idx, idx, documents=bad)


def test_layouts_of_several_ranks_check_the_sequence_on_shape_only_arrays():
    """(The planner's shape-only context: a tp 4 x cp 2 model on one process, no data.)"""
    ctx = ShapeOnlyContext(tp=4, cp=2, rank=0, device="cpu")
    model = GPT(ctx, GPTConfig.preset("tiny", n_layer=1), init=False)
    model.set_sequence_parallel(True)
    model.train()
    idx = ctx.xp.zeros((1, 12), dtype=np.int64)
    with pytest.raises(ValueError, match=r"sequence length 12 / cp 2 = 6 tokens per CP rank is not divisible by "
                                         r"tp=4: sequence parallelism splits them over the TP ranks; use a multiple "
                                         r"of 8"):
        model.forward(idx, idx)
    model.check_inputs(ctx.xp.zeros((1, 16), dtype=np.int64), ctx.xp.zeros((1, 16), dtype=np.int64))  # (the fix)
    two = ShapeOnlyContext(tp=2, rank=0, device="cpu")
    model = GPT(two, GPTConfig.preset("tiny", n_layer=1), init=False)
    model.set_sequence_parallel(True)
    model.eval()
    assert model.hidden_states(two.xp.zeros((1, 4), dtype=np.int64)).shape == (1, 2, 128)  # this rank's tokens
    assert model.hidden_states(two.xp.zeros((1, 5), dtype=np.int64)).shape == (1, 5, 128)  # 5 do not split: whole
