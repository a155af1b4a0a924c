"""The tensor-parallel layers' refusals of what they cannot take, called as an API caller would
(the run's settings refuse most of these earlier: GPTConfig, the mesh, the LoRA settings), and
their small fallbacks (one TP rank, a parameter unfrozen, a non-contiguous gradient, many
buckets) checked against what the main path gives."""
import types

import numpy as np
import pytest

from cutp import ops
from cutp.runtime.errors import ConfigError
from cutp.runtime.shape_only import ShapeOnly
from cutp.tensor_parallel import context_parallel, grads, mappings
from cutp.tensor_parallel.attention import ParallelAttention
from cutp.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from cutp.tensor_parallel.declare import below
from cutp.tensor_parallel.lora import LoraPair, LoraSpec
from cutp.tensor_parallel.mla import MultiLatentAttention
from cutp.tensor_parallel.moe import MoEMLP, check_moe
from cutp.tensor_parallel.moe_experts import expert_parameters
from cutp.tensor_parallel.parameter import Parameter
from cutp.tensor_parallel.random import RNGTracker
from cutp.tensor_parallel.sharding import Sharding, assemble_full, contiguous, sharding_from_spec
from cutp.tensor_parallel.specs import AttentionSpec, MLPSpec
from cutp.tensor_parallel.validation import check_attention, check_routing, check_vocab
from tests.tp_utils import self_ctx

TWO = types.SimpleNamespace(size=2, rank=1)  # a TP group's shape: the refusals come before any collective
ONE = types.SimpleNamespace(size=1, rank=0)
ROUTING = dict(E=4, k=2, aux_coeff=0.0, z_coeff=0.0, scoring="softmax", n_group=1, topk_group=1, score_bias=False,
               rate=0.0, shared=0)
MOE = dict(n_experts=4, top_k=2, every=1, ffn=8, capacity_factor=None, aux_coeff=0.0, z_coeff=0.0)


def _attention(training=False):
    m = ParallelAttention(self_ctx(), 8, 2, 2, name="attn", rng=RNGTracker(0), dtype=np.float64, seed=1,
                          rotary=ops.rope_tables(4, 4, dtype=np.float64))
    return m if training else m.eval()


def _mla(training=False):
    m = MultiLatentAttention(self_ctx(), 16, 4, name="attn", rotary=ops.rope_tables(4, 4, theta=100.0, dtype=np.float64),
                             q_lora_rank=5, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                             dtype=np.float64)
    return m if training else m.eval()


def _x(n_embd, T):
    return np.random.default_rng(0).standard_normal((1, T, n_embd))


def _lora_on_interleaved_columns():
    """A column layer whose shard interleaves its projections' columns (no layer of cutp does):
    a LoRA B cannot cover one projection's columns as one run."""
    interleaved = Sharding(1, (4, 6), (np.array([0, 3, 1, 4, 2, 5]),), {"kind": "interleaved"})
    base = Parameter("attn.qkv.weight", np.zeros((4, 6)), interleaved, 0, weight_decay=False)
    LoraPair(self_ctx(), base, "q", "column", (0, 3), LoraSpec(2, 4.0), RNGTracker(0), seed=0, dtype=np.float64)


def _cache_then(m, n_embd, first, then, max_len):
    cache = m.new_kv_cache(1, max_len, np.float64)
    m.forward_cached(_x(n_embd, first), cache)
    m.forward_cached(_x(n_embd, then), cache)


REFUSALS = [
    (lambda: check_attention(8, 0, 1, 1), ConfigError, "n_head=0 and n_kv_head=1 must be >= 1"),
    (lambda: check_vocab(0, 8, 1), ConfigError, "vocab_size=0 must be >= 1"),
    (lambda: check_vocab(10, 11, 2), ConfigError,
     r"padded vocabulary 11 must be >= vocab_size=10 and divisible by tp=2; use cutp.tensor_parallel.pad_vocab\(10, 2\)"),
    (lambda: check_routing(**dict(ROUTING, scoring="tanh")), ConfigError, "moe_scoring must be softmax or sigmoid"),
    (lambda: check_routing(**dict(ROUTING, n_group=2)), ConfigError,
     r"group-limited routing \(moe_n_group > 1\) is DeepSeek's, with moe_scoring=sigmoid"),
    (lambda: check_routing(**dict(ROUTING, shared=-1)), ConfigError, "moe_shared_experts must be an integer >= 0"),
    (lambda: check_moe(**dict(MOE, n_experts=-1)), ConfigError, "n_experts must be an integer >= 0"),
    (lambda: check_moe(**dict(MOE, every=0)), ConfigError, "moe_every must be an integer >= 1"),
    (lambda: check_moe(**dict(MOE, ffn=0)), ConfigError, "moe_ffn must be a positive integer or None"),
    (lambda: MoEMLP(types.SimpleNamespace(ep_size=3, dp_size=3), 8, n_experts=4, top_k=2, ffn=8, name="moe"),
     ConfigError, "ep=3 does not divide n_experts=4: .* use an ep that divides both dp=3 and 4"),
    (lambda: contiguous((10, 4), 0, 3), ConfigError,
     r"cannot split a dimension of 10 evenly over tp=3; use a tp in \[1, 2, 5, 10\]"),
    (lambda: sharding_from_spec({"kind": "diagonal"}, (4, 4)), ValueError, "unknown sharding kind 'diagonal'"),
    (lambda: RNGTracker(0).load_state_dict({"seed": 0, "offsets": {"replicated": 0}}), ValueError,
     r"RNG state has streams \['replicated'\], expected \['replicated', 'sharded'\]"),
    (lambda: RNGTracker(0).load_state_dict({"seed": 1, "offsets": {"replicated": 0, "sharded": 4}}), ValueError,
     "RNG state was saved with seed 1, this tracker has seed 0"),
    (lambda: mappings._last_dim_slice(TWO, np.zeros((2, 3))), ValueError, "last dimension 3 does not split over 2 TP"),
    (lambda: mappings.sequence_shard(TWO, 5), ValueError,
     r"sequence length 5 does not split over 2 TP ranks \(sequence parallelism needs a multiple of 2\)"),
    (lambda: VocabParallelCrossEntropy(None, 8, 8, label_smoothing=1.0), ValueError,
     r"label_smoothing must be in \[0, 1\), got 1.0"),
    (lambda: context_parallel.check_sequence_splits(6, 2), ValueError,
     "sequence length 6 is not divisible by 2[*]cp = 4: .* use a multiple of 4"),
    (lambda: AttentionSpec(8, 2, 2, 4, rope=True).build(None, name="a", rng=None, seed=0, dtype=np.float64, rotary=None),
     ValueError, "a rotary block needs the model's rotary tables"),
    (lambda: MultiLatentAttention(types.SimpleNamespace(tp_size=3), 16, 4, name="attn", rotary=None, q_lora_rank=5,
                                  kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6),
     ConfigError, "tp=3 must divide n_head=4: MLA splits its heads over the TP ranks"),
    (lambda: _attention(training=True).forward_cached(_x(8, 2), None), RuntimeError,
     r"forward_cached is for generation: call model.eval\(\) first"),
    (lambda: _attention().forward_cached(_x(8, 4), _attention().new_kv_cache(1, 3, np.float64)), ValueError,
     "KV cache holds 3 positions; 4 requested"),
    (lambda: _cache_then(_attention(), 8, 4, 2, 8), ValueError, r"rotary positions 4..5 lie past the tables' 4"),
    (lambda: _mla(training=True).forward_cached(_x(16, 2), None), RuntimeError,
     r"forward_cached is for generation: call model.eval\(\) first"),
    (lambda: _mla().forward_cached(_x(16, 4), _mla().new_kv_cache(1, 3, np.float64)), ValueError,
     "KV cache holds 3 positions; 4 requested"),
    (lambda: _cache_then(_mla(), 16, 4, 2, 8), ValueError, r"rotary positions 4..5 lie past the tables' 4"),
    (_lora_on_interleaved_columns, ConfigError, "attn.qkv.weight: the columns of q are not one run of this rank's shard"),
]


@pytest.mark.parametrize("call,exc,match", REFUSALS, ids=[m[:40] for _, _, m in REFUSALS])
def test_a_layer_refuses_what_it_cannot_take(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_mappings_on_one_tp_rank_return_their_input():
    x = np.arange(6.0).reshape(1, 2, 3)
    assert mappings.gather_from_sp_forward(ONE, x) is x
    assert mappings.reduce_scatter_to_sp_forward(ONE, x) is x
    assert mappings.start_input_grad_sum(ONE, x, sequence_parallel=True)() is x


def test_small_helpers_answer_as_their_full_forms():
    assert below(None, "attn") is None and below({"attn.w": 1, "mlp.w": 2}, "attn") == {"w": 1}
    x = np.arange(6.0).reshape(2, 3)
    assert assemble_full([x], None) is x
    swiglu, gelu = MLPSpec(8, 16, kind="swiglu", bias=False), MLPSpec(8, 16)
    assert swiglu.gated and MLPSpec(8, 16, kind="geglu").gated and not gelu.gated
    assert swiglu.expert_parameters(4) == expert_parameters(8, 16, kind="swiglu", bias=False, n_layer=1, n_experts=4)


def test_a_device_documents_array_is_read_to_the_host_once():
    xp = ShapeOnly("cpu")
    ids = np.array([[0, 0, 1, 1]])
    dev = xp.asarray(ids)  # (not a NumPy array: as CuPy's, read through to_numpy)
    first = context_parallel._host_ids(dev)
    assert isinstance(first, np.ndarray) and np.array_equal(first, ids)
    assert context_parallel._host_ids(dev) is first  # the same array again: not read again
    assert context_parallel._host_ids(ids) is ids


def test_a_parameter_unfrozen_gets_a_zero_gradient():
    p = Parameter("w", np.ones((2, 3)), None, 0, weight_decay=False)
    assert p.shape == (2, 3) and repr(p) == "Parameter(w, shard (2, 3), replicated)"
    p.trainable = False
    p.zero_grad()  # frozen: nothing to zero
    assert p.grad is None
    p.trainable = True
    assert p.grad is not None and np.array_equal(p.grad, np.zeros((2, 3)))
    split = Parameter("v", np.ones((2, 3)), contiguous((2, 6), 1, 2), 1, weight_decay=False)
    assert repr(split) == "Parameter(v, shard (2, 3), split axis 1 of (2, 6))"


class _Pair:
    """Two ranks holding the same gradients: "sum" doubles, "avg" keeps (a contract fake: the
    collectives' own tests are tests/comm's)."""
    size = 2

    def __init__(self):
        self.calls = []

    def all_reduce(self, x, op, out):
        assert x.flags.c_contiguous and out is x
        self.calls.append((op, x.size))
        if op == "sum":
            out *= 2


def _param(name, data, trainable=True):
    """A replicated parameter whose gradient is its data + 1 (None when frozen)."""
    p = Parameter(name, np.asarray(data, np.float64), None, 0, weight_decay=False)
    p.trainable = trainable
    if trainable:
        p.grad = p.data + 1.0
    return p


def test_sum_grad_over_a_non_contiguous_gradient():
    group = _Pair()
    p = _param("tied", np.arange(6.0).reshape(2, 3))
    p.grad = np.asfortranarray(p.grad)  # a view that is not C-contiguous: summed through a copy
    want = 2 * p.grad
    grads.sum_grad_over(group)(p)
    assert np.array_equal(p.grad, want) and group.calls == [("sum", 6)]
    for skip in (None, ONE):
        grads.sum_grad_over(skip)(p)
    frozen = _param("frozen", np.zeros(2), trainable=False)
    grads.sum_grad_over(group)(frozen)
    assert frozen.grad is None and len(group.calls) == 1


def _replicas(group):
    return types.SimpleNamespace(tp=ONE, tp_size=1, dp=group, dp_size=2)


def test_finish_grad_sync_in_buckets_and_on_a_flat_buffer(monkeypatch):
    group = _Pair()
    params = [_param(f"p{i}", np.full(3, float(i))) for i in range(3)]
    want = [p.grad.copy() for p in params]
    monkeypatch.setattr(grads, "BUCKET_ELEMENTS", 5)  # 3 + 3 > 5: a bucket per parameter
    grads.finish_grad_sync(params, _replicas(group))
    assert group.calls == [("avg", 3)] * 3 and all(np.array_equal(p.grad, w) for p, w in zip(params, want))
    flat = types.SimpleNamespace(grad=np.ones(9))
    grads.finish_grad_sync(params, _replicas(group), flat=flat)
    assert group.calls[-1] == ("avg", 9)


def test_finish_grad_sync_refuses_expert_parallel_experts():
    p = _param("experts.0.fc1.weight", np.zeros(2))
    p.expert_parallel = True
    with pytest.raises(ConfigError, match="expert-parallel experts .* use cutp.optim's AdamW.reduce_gradients"):
        grads.finish_grad_sync([p], _replicas(_Pair()))


def test_the_grad_norm_leaves_frozen_parameters_out():
    ctx = self_ctx()
    live, frozen = _param("a", [3.0, 0.0]), _param("b", [1.0, 1.0], trainable=False)
    live.grad = np.array([3.0, 4.0])
    assert grads.global_grad_norm([live, frozen], ctx) == 5.0
