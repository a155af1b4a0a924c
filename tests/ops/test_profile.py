"""The ops' timing hook (cutp.ops.profile): on only inside its `with`, every op of a kind counted
once (nested ops in the outer one), the package's functions back as they were after it."""
from __future__ import annotations

import types

import numpy as np
import pytest

from cutp import ops
from cutp.ops.profile import KIND_OF, OP_KINDS, OpTimer, breakdown


def test_every_kind_names_ops_of_the_package():
    for name in KIND_OF:
        assert callable(getattr(ops, name, None)), name
    assert len(KIND_OF) == sum(len(v) for v in OP_KINDS.values())  # no op in two kinds


def test_timer_wraps_only_inside_and_restores_the_package():
    before = {name: getattr(ops, name) for name in KIND_OF}
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    w = np.ones((16, 4), np.float32)
    with OpTimer(ops) as t:
        assert ops.linear_forward is not before["linear_forward"]
        y, lctx = ops.linear_forward(x, w)
        ops.linear_backward(np.ones_like(y), lctx)
        ops.gelu_forward(x)
    assert {name: getattr(ops, name) for name in KIND_OF} == before
    assert t.calls == {"gemm": 2, "activations": 1}
    assert t.seconds["gemm"] > 0 and t.seconds["activations"] > 0
    np.testing.assert_array_equal(y, x @ w)  # the wrapper returns what the op returns
    ops.linear_forward(x, w)  # off: nothing more counted
    assert t.calls == {"gemm": 2, "activations": 1}


def test_an_op_called_inside_another_counts_once_in_the_outer():
    calls = []

    def inner(a):
        calls.append("inner")
        return a

    pkg = types.SimpleNamespace(gemm=inner)
    pkg.linear_forward = lambda a: pkg.gemm(a)  # an op that reaches another through the package
    with OpTimer(pkg) as t:
        pkg.linear_forward(1)
    assert calls == ["inner"] and t.calls == {"gemm": 1}


def test_breakdown_is_the_step_split_with_the_rest_outside_the_ops():
    rows = dict(breakdown(1.0, {"gemm": 0.5, "norms": 0.1}, 0.2))
    assert list(rows) == [*OP_KINDS, "communication", "outside the ops"]
    assert rows["gemm"] == 0.5 and rows["communication"] == 0.2 and rows["attention"] == 0.0
    assert rows["outside the ops"] == pytest.approx(0.2)
    assert dict(breakdown(0.5, {"gemm": 0.5}, 0.2))["outside the ops"] == 0.0  # overlap: never negative


def test_the_device_is_synchronised_before_and_after_each_timed_op():
    events = []
    x = np.ones((2, 3), np.float32)
    with OpTimer(ops, sync=lambda: events.append("sync")) as t:
        ops.gelu_forward(x)
        ops.linear_forward(x, np.ones((3, 2), np.float32))
    assert events == ["sync"] * 4 and t.calls == {"activations": 1, "gemm": 1}
