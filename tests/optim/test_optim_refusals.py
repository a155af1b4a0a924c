"""The optimizers' refusals and one-rank paths the rest of the suite never reaches (cutp.optim),
in process: FlatParameters, the loss scaler, AdamW / DistributedAdamW and ShardedAdamW refuse bad
arguments and state naming them; a ZeRO state dict on one rank reads back what was loaded;
ZeRO-3's per-parameter helpers (the non-finite check, one unit whole at a time, a buffer's piece);
ExpertParallelAdamW's parts summed; a parameter no unit holds; the groups of buckets (ep > 1)
numbering their members' buckets in order."""
import types

import ml_dtypes
import numpy as np
import pytest

from cutp.models import GPT, GPTConfig
from cutp.optim import AdamW, FlatParameters
from cutp.optim.adamw import DistributedAdamW
from cutp.optim.buckets import GradBucketGroups, ParamGathers, cut_buckets
from cutp.optim.expert_parallel import ExpertParallelAdamW
from cutp.optim.loss_scaler import DynamicLossScaler
from cutp.optim.sharded import ShardedAdamW
from cutp.optim.units import unit_layout
from cutp.runtime.errors import ConfigError
from tests.tp_utils import self_ctx

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=4, dtype="float64")


@pytest.fixture
def ctx():
    c = self_ctx()
    yield c
    c.close()


def test_flat_parameters_need_parameters_of_one_dtype(ctx):
    with pytest.raises(ValueError, match=r"no parameters"):
        FlatParameters([])
    params = GPT(ctx, TINY).parameters()
    params[0].data = params[0].data.astype(np.float32)
    with pytest.raises(ValueError, match=r"FlatParameters needs one dtype, got \['float32', 'float64'\]"):
        FlatParameters(params)


@pytest.mark.parametrize("change", [dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_interval=0),
                                    dict(hysteresis=0), dict(min_scale=2.0 ** 17)])
def test_the_dynamic_loss_scaler_refuses_factors_that_would_not_scale(change):
    with pytest.raises(ValueError, match=r"dynamic loss scaler: need growth_factor > 1, 0 < backoff_factor < 1"):
        DynamicLossScaler(2.0 ** 16, **change)


def test_adamw_state_must_name_every_parameter_at_its_size(ctx):
    opt = AdamW(FlatParameters(GPT(ctx, TINY).parameters()))
    state = {k: v + 1 for k, v in opt.state_dict().items()}
    name = "exp_avg.final_norm.weight"
    with pytest.raises(ValueError, match=rf"optimizer state is missing {name}"):
        opt.load_state({k: v for k, v in state.items() if k != name}, 1)
    with pytest.raises(ValueError, match=rf"optimizer state {name} has 9 elements, expected 8 \(or this rank's 8\)"):
        opt.load_state(dict(state, **{name: np.zeros(9)}), 1)
    opt.load_state(state, 2)
    assert all(np.array_equal(v, state[k]) for k, v in opt.state_dict().items()) and opt.step_count == 2


def test_the_distributed_optimizer_refuses_experts_and_an_unpadded_buffer(ctx):
    params = GPT(ctx, TINY).parameters()
    params[-1].expert_parallel = True  # (what ep > 1 marks: a range of their own, reduced over expert-DP)
    with pytest.raises(ConfigError, match=r"the distributed optimizer shards the experts .* use "
                                          r"cutp.optim.ExpertParallelAdamW"):
        DistributedAdamW(FlatParameters(params), ctx)
    params[-1].expert_parallel = False
    flat = FlatParameters(params)
    five = types.SimpleNamespace(size=5, rank=0)
    assert flat.padded_size % 5
    with pytest.raises(ValueError, match=rf"the flat buffer \({flat.padded_size} elements\) must be padded to a "
                                         r"multiple of the group size 5: FlatParameters\(params, "
                                         r"pad_to=DistributedAdamW.pad_multiple\(5\)\)"):
        DistributedAdamW(flat, ctx, group=five)


def test_sharded_adamw_refuses_other_zero_stages_and_reduce_dtypes(ctx):
    model = GPT(ctx, TINY)
    with pytest.raises(ValueError, match=r"ShardedAdamW is ZeRO 2 or 3, got 1"):
        ShardedAdamW(model, ctx, zero=1)
    with pytest.raises(ValueError, match=r"grad_reduce_dtype must be one of .*, got 'int8'"):
        ShardedAdamW(model, ctx, zero=2, grad_reduce_dtype="int8")


def test_a_zero_state_dict_on_one_rank_reads_back_what_was_loaded(ctx):
    opt = ShardedAdamW(GPT(ctx, TINY), ctx, zero=2)
    rng = np.random.default_rng(0)
    state = {k: rng.standard_normal(v.shape) for k, v in opt.state_dict().items()}
    opt.load_state(state, 3)
    got = opt.state_dict()
    assert set(got) == set(state) and all(np.array_equal(got[k], state[k]) for k in state) and opt.step_count == 3
    name = "exp_avg_sq.layers.0.mlp.fc1.weight"
    with pytest.raises(ValueError, match=rf"optimizer state is missing {name}"):
        opt.load_state({k: v for k, v in state.items() if k != name}, 3)
    with pytest.raises(ValueError, match=rf"optimizer state {name} has 5 elements, expected 256 \(or this rank's 256\)"):
        opt.load_state(dict(state, **{name: np.zeros(5)}), 3)


def test_zero_3_finds_non_finite_parameters_gathers_units_and_leaves_buffers_whole(ctx):
    model = GPT(ctx, GPTConfig.preset("deepseek-tiny", n_layer=2, dtype="float64"))
    opt = ShardedAdamW(model, ctx, zero=3)
    names = {p.name for p in model.parameters()}
    assert opt.nonfinite_parameter(names) is None
    whole = dict(opt.whole_parameters({"final_norm.weight"}))  # (one segment gathered; the others skipped)
    assert list(whole) == ["final_norm.weight"] and whole["final_norm.weight"].shape == (128,)
    name = "layers.1.mlp.router.weight"
    opt.gather_all()  # (whole parameters, written outside the optimizer, then taken back into the shards)
    params = {p.name: p for p in model.parameters()}
    params[name].data[0, 0] = np.nan
    opt.resync_masters()
    assert opt.nonfinite_parameter(names) == name and opt.nonfinite_parameter(names - {name}) is None
    buffer = next(p for p in model.parameters() if p.name.endswith("score_bias"))
    assert opt.piece_of(buffer, np.zeros(buffer.data.size)) is None  # (a buffer: in no segment)


def test_expert_parallel_adamw_sums_its_parts_and_resyncs_their_masters(ctx):
    model = GPT(ctx, GPTConfig.preset("tiny-moe", n_layer=1, dtype="bfloat16"))
    opt = ExpertParallelAdamW(model.parameters(), ctx)  # (ep 1: the dense part only)
    assert opt.flat.size == sum(part.flat.size for part in opt.parts) == opt.dense.flat.size
    opt.flat.parts[0].data[...] = np.asarray(1.5, dtype=ml_dtypes.bfloat16)  # (weights loaded outside the optimizer)
    opt.resync_masters()
    assert np.all(opt.dense.master == 1.5) and opt.step_count == opt.dense.step_count == 0


def test_a_parameter_no_unit_holds_still_gets_a_segment(ctx, monkeypatch):
    model = GPT(ctx, TINY)
    units = model.units()
    monkeypatch.setattr(model, "units", lambda chunk=0: units[:-1] + [[model.lm_head]])  # (the final norm left out)
    segments = unit_layout(model, 2, set())[0]
    held = [p.name for s in segments for p in s.params]
    assert sorted(held) == sorted(p.name for p in model.parameters() if not p.buffer)
    assert [p.name for p in segments[-1].params] == ["final_norm.bias"]  # (each alone, after the units')


def test_bucket_groups_number_their_members_buckets_in_order(ctx):
    flat = FlatParameters(GPT(ctx, TINY).parameters())
    with pytest.raises(ValueError, match=r"a distributed optimizer's buckets cover its whole buffer \(its shards\)"):
        cut_buckets(flat, 64, shards=2, region=(0, 8))
    calls = []

    def member(name, n_buckets, log):
        return types.SimpleNamespace(buckets=[f"{name}{k}" for k in range(n_buckets)], started_log=log,
                                     grads_final=lambda unit: calls.append(("grads_final", name, unit)),
                                     before_forward=lambda unit: calls.append(("before_forward", name, unit)))

    groups = GradBucketGroups([member("dense", 3, [(2, ["u0"]), (0, ["u1"])]), member("experts", 2, [(1, ["u1"])])])
    assert groups.buckets == ["dense0", "dense1", "dense2", "experts0", "experts1"]
    assert groups.started_log == [(2, ["u0"]), (0, ["u1"]), (4, ["u1"])]  # (the experts' after the dense 3)
    groups.grads_final("u1")  # (each member's grads_final polls its own requests)
    ParamGathers(groups.members).before_forward("u0")
    assert calls == [("grads_final", "dense", "u1"), ("grads_final", "experts", "u1"),
                     ("before_forward", "dense", "u0"), ("before_forward", "experts", "u0")]


def test_a_zero_norm_counts_only_the_entries_a_norm_mask_owns(ctx):
    """(At TP, a parameter's copies of replicated KV heads enter the norm once: `norm_mask` marks
    the indices along its split axis this rank counts. Here one rank, the mask set by hand.)"""
    model = GPT(ctx, TINY)
    opt = ShardedAdamW(model, ctx, zero=2)
    opt.grad[...] = np.random.default_rng(1).standard_normal(opt.grad.shape)
    split = [p for p in model.parameters() if p.sharding is not None and p.data.ndim == 2]
    for axis in (0, 1):  # (a row- and a column-parallel weight)
        p = next(p for p in split if p.sharding.axis == axis)
        p.norm_mask = np.arange(p.data.shape[axis]) % 3 == 0
        s = opt._segment_of[id(p)]
        a0, b0 = s.where[id(p)]
        g = opt.grad[s.shard_at + a0:s.shard_at + b0].reshape(p.data.shape)
        want = float((np.compress(p.norm_mask, g, axis=axis) ** 2).sum())
        assert opt._square_sums(s)[s.index, id(p)] == pytest.approx(want, rel=1e-12), p.name
        assert want < float((g ** 2).sum())
