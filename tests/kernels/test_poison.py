"""The kernel tests' poisoning of outputs (tests/kernels/helpers.py): every array a launcher
allocates starts as poison (NaN floats, sentinel integers, bool bytes that are neither 0 nor 1),
so a kernel that skips part of its writes fails the comparison instead of passing on whatever
``empty`` happened to hold.

Here the launchers run over kernels that do nothing: every output must come back poisoned, and
the comparisons the tests use must reject it.
"""
from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from cutp.kernels import Launchers

from .helpers import BF16, F32, POISON8, PoisonedAllocations, close, is_poison, poison, randn

KERNELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "kernels"


class _NoopModule:
    """A module whose kernels launch and write nothing (a kernel that skips all its writes)."""

    def get_function(self, name):
        def launch(grid, block, args, shared_mem=0):
            return None

        return launch


@pytest.fixture
def noop():
    return Launchers(lambda name: _NoopModule(), PoisonedAllocations(np), description="no-op kernels")


def test_the_backends_launchers_allocate_poisoned_outputs(backend, k):
    assert isinstance(k.xp, PoisonedAllocations)
    before = k.xp.allocated
    y = k.gelu_forward(backend.to_device(randn((3, 5), F32)))
    assert k.xp.allocated == before + 1
    assert not is_poison(backend.host(y)).any()  # the kernel overwrote the poison


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_every_launcher_output_is_poison_until_a_kernel_writes_it(noop, dtype):
    x = randn((6, 40), dtype, seed=1)
    w = randn((40,), dtype, seed=2)
    rows = np.zeros(6, np.float32)
    t = np.zeros(6, np.int64)
    outs = [noop.gelu_forward(x), noop.gelu_backward(x, x), *noop.bias_gelu_forward(x, w),
            *noop.bias_gelu_backward(x, x), noop.softmax_forward(x), noop.softmax_backward(x, x),
            *noop.layernorm_forward(x, w, w), *noop.layernorm_backward(x, x, w, rows, rows + 1, dtype),
            *noop.ce_shard_forward(x, t, 40),
            noop.ce_shard_backward(x, rows, rows + 1, t, 40, 1.0),
            *noop.dropout_forward(x, 0.5, 1, 2), noop.dropout_apply(x, np.ones(x.shape, bool), 2.0),
            noop.dropout_mask((3, 7), 0.5, 1, 2)]
    for i, out in enumerate(outs):
        assert out.size and is_poison(out).all(), (i, out.dtype, out.shape)
        if out.dtype != np.bool_:
            assert np.isnan(out.astype(np.float32)).all(), (i, out.dtype)
    for out in outs:
        if out.dtype == np.bool_:
            assert (out.view(np.uint8) == POISON8).all()
        else:
            with pytest.raises(AssertionError, match="poison of an unwritten output"):
                close(out, np.full(out.shape, np.nan, out.dtype), out.dtype)  # even where the reference is NaN


def test_the_comparisons_reject_poison(backend):
    partly = np.zeros(10, np.float32)
    poison(partly[3:5])
    with pytest.raises(AssertionError, match="2 of 10 elements"):
        close(partly, np.zeros(10, np.float32), F32, atol=np.inf)
    mask = np.ones(9, bool)
    poison(mask[4:])
    with pytest.raises(AssertionError, match="5 elements never written"):
        backend.host(backend.to_device(mask))
    ints = poison(np.empty(4, np.int32))
    assert (ints == -5898331).all() and is_poison(ints).all()
    assert is_poison(poison(np.empty(2, np.int64))).all()
    assert not is_poison(np.array([np.nan, -np.nan, 0.0], np.float32)).any()  # a computed NaN is not poison
    assert not is_poison(np.array([np.nan], np.float32).astype(BF16)).any()


def test_launchers_allocate_through_their_array_module():
    """Outputs come from ``self.xp`` / ``xp`` (poisoned in the tests), never from NumPy directly."""
    offenders = []
    for path in sorted(KERNELS_DIR.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(np|numpy|cupy|cp)\.(empty|zeros|ones|full|ndarray\()", line):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert not offenders, offenders
