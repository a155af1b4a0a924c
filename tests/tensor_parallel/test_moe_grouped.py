"""The grouped expert computation (issue 40): all local experts in batched passes equal each
expert's own MLP run on its rows, forward and backward, SwiGLU and biased GeLU experts, with the
load balanced (one padded pass) or collapsed (passes by row-count class), the weights stacked as
a strided view of one buffer (the optimizer's) or copied."""
import numpy as np
import pytest

from cutp import ops
from cutp.tensor_parallel.moe_experts import ExpertMLP
from cutp.tensor_parallel.moe_grouped import GroupedExperts, groups, stacked
from tests.tp_utils import self_ctx


def _experts(kind, bias, E=5, h=6, F=4, flat=False):
    ctx = self_ctx()
    experts = [ExpertMLP(ctx, h, F, name=f"m.experts.{e}", n_layer=2, bias=bias, gelu="tanh", seed=e,
                         dtype=np.float64, kind=kind) for e in range(E)]
    if flat:  # the optimizer's layout: every parameter a view of one buffer, expert after expert
        params = [p for x in experts for p in x.own_parameters()]
        data = np.zeros(sum(p.data.size for p in params))
        grad = np.zeros_like(data)
        off = 0
        for p in params:
            data[off:off + p.data.size] = p.data.reshape(-1)
            p.data = data[off:off + p.data.size].reshape(p.data.shape)
            p.grad = grad[off:off + p.data.size].reshape(p.data.shape)
            off += p.data.size
    rng = np.random.default_rng(1)
    for p in (p for x in experts for p in x.own_parameters()):
        p.data[...] = rng.standard_normal(p.data.shape) * 0.5
    return experts


def _reference(experts, x, bounds, dy):
    """Each expert's MLP on its rows, one at a time: (y, dx, {name: grad})."""
    y, dx, grads = np.zeros_like(x), np.zeros_like(x), {}
    for e, ex in enumerate(experts):
        a, b = bounds[e], bounds[e + 1]
        b1 = None if ex.fc1_bias is None else ex.fc1_bias.data
        b2 = None if ex.fc2_bias is None else ex.fc2_bias.data
        h, c1 = ops.linear_forward(x[a:b], ex.fc1.data, b1)
        act, ca = ops.swiglu_forward(h) if ex.kind == "swiglu" else ops.gelu_forward(h, approximate="tanh")
        y[a:b], c2 = ops.linear_forward(act, ex.fc2.data, b2)
        dact, dw2, db2 = ops.linear_backward(dy[a:b], c2)
        dh = ops.swiglu_backward(dact, ca) if ex.kind == "swiglu" else ops.gelu_backward(dact, ca)
        dx[a:b], dw1, db1 = ops.linear_backward(dh, c1)
        grads.update({ex.fc1.name: dw1, ex.fc2.name: dw2})
        if b1 is not None:
            grads.update({ex.fc1_bias.name: db1, ex.fc2_bias.name: db2})
    return y, dx, grads


@pytest.mark.parametrize("kind,bias,flat", [("swiglu", False, True), ("swiglu", False, False), ("gelu", True, True),
                                            ("gelu", True, False)])
@pytest.mark.parametrize("counts", [[3, 2, 3, 0, 2], [17, 1, 0, 2, 5]])  # balanced; collapsed onto expert 0
def test_grouped_experts_equal_each_expert_on_its_rows(kind, bias, flat, counts):
    experts = _experts(kind, bias, flat=flat)
    assert stacked([x.fc1.data for x in experts])[1] is flat  # a view of the flat buffer, else a copy
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((bounds[-1], 6))
    dy = rng.standard_normal(x.shape)
    y_ref, dx_ref, g_ref = _reference(experts, x, bounds, dy)
    grouped = GroupedExperts(experts)
    y, saved = grouped.forward(x, bounds)
    assert len(saved) == (1 if counts[0] < 10 else 4)  # collapsed: passes of 1, 2, 5 and 17 rows
    dx = grouped.backward(dy, saved)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(dx, dx_ref, rtol=0, atol=1e-13)
    for p in (p for x in experts for p in x.own_parameters()):
        np.testing.assert_allclose(p.grad, g_ref[p.name], rtol=0, atol=1e-12, err_msg=p.name)


def test_padding_stays_within_twice_the_rows():
    rng = np.random.default_rng(0)
    for _ in range(50):
        counts = rng.integers(0, 40, 16) * (rng.random(16) < 0.5) ** rng.integers(0, 2)
        padded = sum((len(counts) if ids is None else len(ids)) * C for ids, C in groups(counts))
        assert padded <= 2 * counts.sum() + len(counts)


@pytest.mark.parametrize("kind,bias", [("gelu", True), ("gelu", False), ("swiglu", True), ("swiglu", False)])
def test_an_experts_own_pass_equals_its_mlp(kind, bias):
    """ExpertMLP's own forward and backward (the path LoRA adapters and frozen weights take, one
    expert at a time) equal the expert's MLP: GeLU with and without biases, SwiGLU with them."""
    expert = _experts(kind, bias, E=1)[0]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 6))
    dy = rng.standard_normal(x.shape)
    y_ref, dx_ref, g_ref = _reference([expert], x, [0, 7], dy)
    y, saved = expert.forward(x)
    dx = expert.backward(dy, saved)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(dx, dx_ref, rtol=0, atol=1e-13)
    params = list(expert.own_parameters())
    assert len(params) == (4 if bias else 2)
    for p in params:
        np.testing.assert_allclose(p.grad, g_ref[p.name], rtol=0, atol=1e-12, err_msg=p.name)
