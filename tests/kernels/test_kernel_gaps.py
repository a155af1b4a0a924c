"""Classes of planted kernel bugs that slipped past the other kernel tests (issue 28), each closed here.

* Attention dropout with more than one KV head AND more than one query head per KV head: a mask
  drawn at the wrong head index (kv * G + g swapped for g * Hkv + kv, or either index dropped)
  agrees with the reference when Hkv or G is 1, the layouts test_attention's dropout cases use.
* bfloat16, bit for bit: the saved pre-activation is the value the activation was computed
  from (bias_gelu_forward: y == gelu(pre) of the rounded pre), so the backward differentiates at
  the forward's point (residual_rmsnorm_forward's saved sum: tests/kernels/test_rmsnorm.py).

(The misaligned-vector trap of the emulator: tests/cuda_emu/test_alignment.py; reductions called
back to back: tests/cuda_emu/test_back_to_back_reductions.py.)
"""
from __future__ import annotations

import pytest

from .helpers import BF16, DT_IDS, DTYPES, bits, randn
from .test_attention import attention_inputs, check_against_reference


# (B, Hkv, G, Tq, Tk, D): 2 KV heads of 2 query heads; 2 of 3 with per-row offsets (a rank's heads)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,drop", [((1, 2, 2, 16, 16, 64), (0.3, 11, 100)),
                                        ((2, 2, 3, 5, 5, 64), (0.5, 4, [7, 2 ** 33 + 1]))],
                         ids=["kv2-g2", "kv2-g3-offsets"])
def test_attention_dropout_with_several_kv_heads_and_groups(backend, ks, dtype, shape, drop):
    check_against_reference(ks, backend, *attention_inputs(*shape, dtype, seed=40), dtype, drop=drop)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bf16_bias_gelu_is_computed_from_the_saved_pre_activation(backend, k, approximate):
    backend.require_bf16()
    x = randn((5, 67), BF16, seed=41, scale=3.0)
    b = randn((67,), BF16, seed=42, scale=3.0)
    y, pre = k.bias_gelu_forward(backend.to_device(x), backend.to_device(b), approximate)
    assert (bits(k.gelu_forward(pre, approximate)) == bits(y)).all()
