"""The ops' refusals of inputs they cannot take (one exception naming the problem, before any work),
and the small fallbacks beside them (dtype promotion, p = 0, shape-only arrays), each checked
against the op's main path."""
import numpy as np
import pytest

from cutp import ops
from cutp.ops import common
from cutp.ops.cross_entropy import _check_n_valid
from cutp.ops.rotary import RopeScaling, _as_scaling, _check_tables, rope_inv_freq, rope_tables
from cutp.runtime.errors import ConfigError
from cutp.runtime.shape_only import ShapeOnly

R = np.random.default_rng(0)


def a(*shape, dtype=np.float64):
    return R.standard_normal(shape).astype(dtype)


def _attention(**kw):
    q, k = a(1, 1, 1, 4, 8), a(1, 1, 4, 8)
    return ops.causal_attention_forward(q, k, k, **kw)


def _backward_of(forward, args, dy_shape, backward):
    _, ctx = forward(*args)
    return backward(a(*dy_shape), ctx)


REFUSALS = [
    (lambda: ops.adamw_update(a(4), a(4), a(3), a(4), None, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8,
                              weight_decay=0.0, step=1), ValueError, "flat arrays of equal length"),
    (lambda: _attention(fused=True, blocked=False), ValueError, "fused=True excludes blocked=False"),
    (lambda: _attention(softcap=-1.0), ValueError, "softcap must be a positive number or None, got -1.0"),
    (lambda: common.compute_dtype(np.int32), TypeError, "unsupported floating dtype int32"),
    (lambda: _check_n_valid(5, 4), ValueError, r"n_valid=5 outside \[0, 4\]"),
    (lambda: ops.ce_shard_backward(a(2, 4), a(2), a(2), np.zeros(2, np.int64), 4, a(2), label_smoothing=0.1),
     ValueError, "label smoothing needs n_classes"),
    (lambda: ops.ce_shard_backward(a(2, 4), a(2), a(2), np.zeros(2, np.int64), 4, a(2), out=a(2, 3)),
     ValueError, r"out shape \(2, 3\) != logits shape \(2, 4\)"),
    (lambda: ops.cross_entropy_forward(a(2, 4), np.zeros(2, np.int64), reduction="max"), ValueError,
     "reduction must be one of"),
    (lambda: ops.cross_entropy_forward(a(2, 4), np.zeros(2, np.int64), n_classes=5), ValueError,
     r"n_classes=5 outside \[1, 4\]"),
    (lambda: ops.cross_entropy_forward(a(2, 4), np.zeros(3, np.int64)), ValueError,
     r"targets shape \(3,\) does not match logits \(2, 4\)"),
    (lambda: ops.dropout_forward_rows(a(2, 3), 0.5, 0, [0]), ValueError, "1 offsets for 2 rows"),
    (lambda: ops.embedding_forward(np.zeros((2, 3), np.int64), a(5, 4), mask=np.ones((2, 2), bool)), ValueError,
     r"embedding mask shape \(2, 2\) != ids shape \(2, 3\)"),
    (lambda: _backward_of(ops.geglu_forward, (a(2, 6),), (2, 2), ops.geglu_backward), ValueError,
     r"geglu_backward: dy shape \(2, 2\) != output shape \(2, 3\)"),
    (lambda: _backward_of(ops.swiglu_forward, (a(2, 6),), (2, 2), ops.swiglu_backward), ValueError,
     r"swiglu_backward: dy shape \(2, 2\) != output shape \(2, 3\)"),
    (lambda: _backward_of(ops.gelu_forward, (a(2, 3),), (3, 2), ops.gelu_backward), ValueError,
     r"gelu_backward: dy shape \(3, 2\) != x shape \(2, 3\)"),
    (lambda: _backward_of(ops.softcap_forward, (a(2, 3), 5.0), (3, 2), ops.softcap_backward), ValueError,
     r"softcap_backward: dy shape \(3, 2\) != x shape \(2, 3\)"),
    (lambda: _backward_of(ops.softmax_forward, (a(2, 3),), (3, 2), ops.softmax_backward), ValueError,
     r"softmax_backward: dy shape \(3, 2\) != y shape \(2, 3\)"),
    (lambda: ops.softmax_forward(a(3), causal=True), ValueError, r"causal softmax needs x of shape \[..., Tq, Tk\]"),
    (lambda: ops.linear_forward(a(2, 3), a(4, 5)), ValueError, "x has 3 features, w expects 4"),
    (lambda: ops.rmsnorm_forward(a(2, 0)), ValueError, r"non-empty last axis, got shape \(2, 0\)"),
    (lambda: ops.residual_rmsnorm_forward(a(2, 3), a(3, 2)), ValueError,
     r"branch shape \(3, 2\) != x shape \(2, 3\)"),
    # rotary scaling and tables
    (lambda: RopeScaling("linear", factor="2"), ConfigError, "rope scaling factor must be a number, got '2'"),
    (lambda: RopeScaling("yarn", factor=4.0, original_max_position_embeddings=0), ConfigError,
     "yarn rope scaling needs original_max_position_embeddings a positive integer, got 0"),
    (lambda: RopeScaling("llama3", factor=8.0, original_max_position_embeddings=-1), ConfigError,
     "llama3 rope scaling needs original_max_position_embeddings a positive integer, got -1"),
    (lambda: RopeScaling.from_hf([("rope_type", "linear")]), ConfigError, "rope_scaling must be null or an object"),
    (lambda: RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                  "truncate": False}), ConfigError, "attention_factor or truncate=false"),
    (lambda: _as_scaling(4.0), ConfigError, "rope scaling must be None, a RopeScaling or an HF rope_scaling dict"),
    (lambda: rope_inv_freq(8, theta=-1.0), ConfigError, "rope_theta must be a positive number, got -1.0"),
    (lambda: rope_tables(8, 4, rotary_dim=10), ConfigError, r"rotary dim 10 must lie in 1..head_dim \(8\)"),
    (lambda: rope_tables(8, -1), ConfigError, "rope table length must be >= 0, got -1"),
    (lambda: _check_tables((2, 4, 1, 8), a(4, 8), a(4, 8), None, 3), ValueError,
     "seq_axis 3 must lie strictly between the batch axis 0 and the head-dim axis 3"),
    (lambda: _check_tables((2, 4, 1, 8), a(4, 8), a(4, 6), None, 1), ValueError,
     r"cos \(4, 8\) and sin \(4, 6\) differ in shape"),
    (lambda: _check_tables((2, 4, 1, 8), a(2, 4, 8), a(2, 4, 8), np.arange(4), 1), ValueError,
     r"with positions, cos/sin must be \[max_len, rotary_dim\] tables"),
    (lambda: _check_tables((2, 4, 1, 8), a(8), a(8), None, 1), ValueError,
     r"per-token cos/sin must be \[T, rd\] or \[B, T, rd\], got \(8,\)"),
    (lambda: _check_tables((2, 4, 1, 8), a(3, 8), a(3, 8), None, 1), ValueError,
     r"positions/tables \(3,\) do not match x \(2, 4, 1, 8\)"),
    (lambda: ops.rotary_forward(a(2, 4, 1, 8), *rope_tables(8, 4, dtype=np.float64), out=a(2, 4, 1, 6)), ValueError,
     r"out \(2, 4, 1, 6\) float64 must match the input \(2, 4, 1, 8\) float64"),
    (lambda: ops.rotary_backward(a(2, 3, 1, 8), ops.rotary_forward(a(2, 4, 1, 8), *rope_tables(8, 4))[1]), ValueError,
     r"rotary_backward: dy shape \(2, 3, 1, 8\) != x shape \(2, 4, 1, 8\)"),
]


@pytest.mark.parametrize("call,exc,match", REFUSALS, ids=[m[:40] for _, _, m in REFUSALS])
def test_an_op_refuses_what_it_cannot_take(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_compute_dtype_of_an_unhashable_dtype_like():
    class Unhashable:  # np.dtype() reads its .dtype
        __hash__ = None
        dtype = np.dtype(np.float32)

    assert common.compute_dtype(Unhashable()) == np.float32
    assert common.compute_dtype(Unhashable()) == np.float32  # (not cached: asked again the same way)


def test_rope_scaling_takes_numpy_numbers_as_python_ones():
    sc = RopeScaling("llama3", factor=np.float32(8.0), low_freq_factor=np.int64(1), high_freq_factor=4.0,
                     original_max_position_embeddings=np.int64(8192))
    assert sc == RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, original_max_position_embeddings=8192)
    assert type(sc.original_max_position_embeddings) is int and type(sc.low_freq_factor) is float


def test_rotary_backward_takes_dy_of_another_dtype_in_xs():
    cos, sin = rope_tables(8, 4, dtype=np.float64)
    _, ctx = ops.rotary_forward(a(2, 4, 1, 8), cos, sin)
    dy = a(2, 4, 1, 8)
    dx = ops.rotary_backward(dy.astype(np.float32), ctx)
    assert dx.dtype == np.float64
    assert np.array_equal(dx, ops.rotary_backward(dy.astype(np.float32).astype(np.float64), ctx))


def test_dropout_with_a_given_mask_at_p_zero_is_the_identity():
    x = a(3, 4)
    y, ctx = ops.dropout_forward_mask(x, 0.0, np.zeros((3, 4), bool))
    assert y is x and ctx.scale == 1.0
    assert np.array_equal(ops.dropout_backward(x, ctx), x)


@pytest.mark.parametrize("fn", [ops.erf, ops.erfc])
def test_erf_of_integers_and_of_shape_only_arrays(fn):
    ints = np.array([-2, 0, 1, 3])
    assert fn(ints).dtype == np.float64
    np.testing.assert_array_equal(fn(ints), fn(ints.astype(np.float64)))
    xp = ShapeOnly("cpu")
    y = fn(xp.zeros((5, 3), np.float32))
    assert (y.shape, y.dtype) == ((5, 3), np.float32)
    assert fn(xp.zeros(4, np.int32)).dtype == np.float64
