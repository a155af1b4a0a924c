"""Gemma's ops (issue 37): GeGLU with tanh GeLU on the fused [gate | up] layout, and soft-capping
cap * tanh(x / cap); each against its plain formula and finite differences in float64, and in
16-bit against float32, rounded as transformers rounds them."""
import math

import ml_dtypes
import numpy as np
import pytest

from cutp.ops import geglu_backward, geglu_forward, softcap_backward, softcap_forward
from tests.gradcheck import check_gradients


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_geglu_is_gelu_of_the_gate_times_up_and_its_gradient(rng):
    a = rng.standard_normal((3, 4, 10)) * 2
    y, _ = geglu_forward(a)
    np.testing.assert_allclose(y, gelu_tanh(a[..., :5]) * a[..., 5:], rtol=1e-13, atol=1e-15)
    check_gradients(geglu_forward, {"gate_up": a}, lambda dy, ctx: {"gate_up": geglu_backward(dy, ctx)},
                    tol=1e-7, max_elements=None)
    with pytest.raises(ValueError, match="must be even"):
        geglu_forward(np.ones((2, 5)))


def test_geglu_16bit_rounds_the_gelu_then_the_product_as_transformers(rng):
    a = (rng.standard_normal((4, 16)) * 2).astype(ml_dtypes.bfloat16)
    dy = rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    y, ctx = geglu_forward(a)
    d = geglu_backward(dy, ctx)
    assert y.dtype == d.dtype == ml_dtypes.bfloat16
    f = a.astype(np.float32)
    act = gelu_tanh(f[:, :8].astype(np.float64)).astype(np.float32).astype(ml_dtypes.bfloat16)  # act_fn, in bf16
    assert np.array_equal(y, (act.astype(np.float32) * f[:, 8:]).astype(ml_dtypes.bfloat16))
    y32, c32 = geglu_forward(f)
    np.testing.assert_allclose(d.astype(np.float32), geglu_backward(dy.astype(np.float32), c32), rtol=3e-2, atol=3e-2)


def test_softcap_is_cap_tanh_of_x_over_cap_and_its_gradient(rng):
    x = rng.standard_normal((3, 5, 7)) * 20
    y, _ = softcap_forward(x, 5.0)
    np.testing.assert_allclose(y, 5.0 * np.tanh(x / 5.0), rtol=1e-15, atol=0)
    assert np.abs(y).max() < 5.0
    check_gradients(lambda x: softcap_forward(x, 5.0), {"x": x},
                    lambda dy, ctx: {"x": softcap_backward(dy.copy(), ctx)}, tol=1e-7, max_elements=None)
    with pytest.raises(ValueError, match="cap must be > 0"):
        softcap_forward(x, 0.0)


def test_softcap_16bit_agrees_with_float32(rng):
    x = (rng.standard_normal((6, 9)) * 40).astype(ml_dtypes.bfloat16)
    y, ctx = softcap_forward(x, 30.0)
    dy = rng.standard_normal((6, 9)).astype(ml_dtypes.bfloat16)
    d = softcap_backward(dy, ctx)
    assert y.dtype == d.dtype == ml_dtypes.bfloat16
    y32, c32 = softcap_forward(x.astype(np.float32), 30.0)
    assert np.array_equal(y, y32.astype(ml_dtypes.bfloat16))  # computed in float32, rounded once
    np.testing.assert_allclose(d.astype(np.float32), softcap_backward(dy.astype(np.float32), c32), rtol=1e-2, atol=1e-2)


def hf_gemma_rmsnorm(x, weight, eps):
    """transformers' Gemma2RMSNorm / Gemma3RMSNorm.forward, line by line, in NumPy + ml_dtypes."""
    x32 = x.astype(np.float32)
    output = x32 * (1.0 / np.sqrt(np.mean(x32 ** 2, axis=-1, keepdims=True) + eps))  # torch.rsqrt
    output = output * (1.0 + weight.astype(np.float32))
    return output.astype(x.dtype)


def test_gemma_rmsnorm_16bit_scales_by_one_plus_w_and_rounds_once_as_transformers(rng):
    """The (1 + w) norm in bfloat16: bit for bit transformers' (not Llama's order, which rounds
    the normalised value first); its gradients agree with float32's."""
    import cutp
    from cutp.tensor_parallel import RMSNorm

    ctx = cutp.init(device="cpu")
    norm = RMSNorm(ctx, 64, name="n", eps=1e-5, dtype=ml_dtypes.bfloat16, offset=True)
    assert not norm.weight.data.any()  # zeros: scale 1
    norm.weight.data[...] = (0.5 * rng.standard_normal(64)).astype(ml_dtypes.bfloat16)
    x = (rng.standard_normal((6, 5, 64)) * 3).astype(ml_dtypes.bfloat16)
    y = norm.forward(x)
    assert y.dtype == ml_dtypes.bfloat16
    assert np.array_equal(y.view(np.uint16), hf_gemma_rmsnorm(x, norm.weight.data, 1e-5).view(np.uint16))
    dy = rng.standard_normal(x.shape).astype(ml_dtypes.bfloat16)
    dx = norm.backward(dy)
    ref = RMSNorm(ctx, 64, name="r", eps=1e-5, dtype=np.float32, offset=True)
    ref.weight.data[...] = norm.weight.data.astype(np.float32)
    ref.forward(x.astype(np.float32))
    np.testing.assert_allclose(dx.astype(np.float32), ref.backward(dy.astype(np.float32)), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(norm.weight.grad.astype(np.float32), ref.weight.grad, rtol=1e-2, atol=1e-2)
    ctx.close()
