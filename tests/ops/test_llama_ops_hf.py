"""The Llama-family ops against transformers: against numbers transformers computed
(tests/fixtures/hf_llama_ops_reference.safetensors, made by make_hf_llama_ops_fixture.py), and,
where torch and transformers import, against transformers itself, live."""
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from cutp.ops import rmsnorm_backward, rmsnorm_forward, rope_inv_freq, rope_tables, rotary_backward, rotary_forward
from cutp.ops import swiglu_backward, swiglu_forward
from tests.ops.test_llama_ops import BF16, LLAMA31, LLAMA32, bits


@pytest.fixture
def rng():
    return np.random.default_rng(27)


# ---------------------------------------------------------------------------------------
# against transformers itself (where torch and transformers import)
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf():
    """(torch, transformers' Llama modelling module, its rope utils), or a skip saying why."""
    try:
        import torch  # optional: only the parity tests against transformers use it
        from transformers import LlamaConfig  # optional
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # optional
        from transformers.models.llama import modeling_llama  # optional
    except ImportError as e:
        pytest.skip(f"torch and transformers do not import here ({e}); run this file with a Python that has "
                    "both (pip install torch transformers) to compare against transformers itself")
    if "default" not in ROPE_INIT_FUNCTIONS:  # transformers 5: the default lives in the rotary class
        default = modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters
        ROPE_INIT_FUNCTIONS = {**ROPE_INIT_FUNCTIONS, "default": lambda config, device: default(config)}
    return torch, LlamaConfig, ROPE_INIT_FUNCTIONS, modeling_llama


def _hf_config(hf, head_dim, theta, rope_scaling, heads=4):
    _, LlamaConfig, _, _ = hf
    config = LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=2,
                         head_dim=head_dim, rope_theta=theta, rope_scaling=rope_scaling,
                         max_position_embeddings=131072, intermediate_size=32, rms_norm_eps=1e-5)
    if isinstance(getattr(config, "rope_parameters", None), dict):  # transformers 5 reads theta and scaling there
        config.rope_parameters = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": theta}
    return config


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA31, LLAMA32],
                         ids=["default", "linear", "llama3.1", "llama3.2"])
@pytest.mark.parametrize("head_dim,theta", [(128, 500000.0), (64, 10000.0)])
def test_inv_freq_and_tables_match_transformers(hf, scaling, head_dim, theta):
    torch, _, ROPE_INIT_FUNCTIONS, modeling_llama = hf
    config = _hf_config(hf, head_dim, theta, scaling)
    kind = "default" if scaling is None else scaling["rope_type"]
    inv_hf, attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    assert attention_scaling == 1.0  # none of these types scales cos/sin
    ours = rope_inv_freq(head_dim, theta, scaling, np.float32)
    theirs = inv_hf.numpy()
    assert theirs.dtype == np.float32
    # every step is the same float32 operation in the same order, except the pow: torch's float32
    # pow is within an ulp of a correctly rounded one (ours). Where the default inv_freq agree, the
    # scaling's result agrees bit for bit; elsewhere within an ulp or two
    default_hf = ROPE_INIT_FUNCTIONS["default"](_hf_config(hf, head_dim, theta, None), "cpu")[0].numpy()
    same = rope_inv_freq(head_dim, theta, None, np.float32) == default_hf
    assert same.mean() > 0.9
    assert np.array_equal(bits(ours[same]), bits(theirs[same]))
    np.testing.assert_array_max_ulp(ours, theirs, maxulp=2)
    differ = ours != theirs
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    positions = np.array([[0, 1, 2, 8191, 8192, 100000], [5, 6, 7, 20000, 65536, 131071]])
    cos_hf, sin_hf = rotary(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions))
    cos, sin = rope_tables(head_dim, positions, theta, scaling, np.float32)
    assert cos.shape == tuple(cos_hf.shape)
    # where inv_freq agrees the float32 angles agree bit for bit and the two float32 cos/sin are
    # within an ulp or two; an ulp of inv_freq moves the angle by position * ulp (up to 1e-2 rad at
    # position 131071, as much in HF itself as here)
    h = head_dim // 2
    angle_gap = positions[..., None] * np.abs(ours.astype(np.float64) - theirs)
    atol = 1e-6 + 1.01 * np.concatenate([angle_gap, angle_gap], -1)
    assert np.all(np.abs(cos - cos_hf.numpy()) <= atol) and np.all(np.abs(sin - sin_hf.numpy()) <= atol)
    assert np.abs(cos - cos_hf.numpy())[..., :h][..., ~differ].max() <= 1e-6


def test_rotary_and_its_gradient_match_transformers(hf, rng):
    torch, _, _, modeling_llama = hf
    B, H, T, hd = 2, 4, 6, 16
    config = _hf_config(hf, hd, 500000.0, LLAMA32)
    positions = np.array([[0, 1, 2, 3, 4, 5], [100, 101, 102, 103, 104, 105]])
    cos_hf, sin_hf = modeling_llama.LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float64),
                                                                 torch.from_numpy(positions))
    q = rng.standard_normal((B, H, T, hd))  # HF's [B, heads, T, hd]
    k = rng.standard_normal((B, 2, T, hd))
    qt, kt = torch.tensor(q, requires_grad=True), torch.tensor(k, requires_grad=True)
    q_hf, k_hf = modeling_llama.apply_rotary_pos_emb(qt, kt, cos_hf.double(), sin_hf.double())
    # HF computes its tables in float32 even for a float64 model: use float32 tables to compare
    cos, sin = rope_tables(hd, 256, 500000.0, LLAMA32, np.float32)
    yq, cq = rotary_forward(q, cos, sin, positions, seq_axis=2)
    yk, ck = rotary_forward(k, cos, sin, positions, seq_axis=2)
    np.testing.assert_allclose(yq, q_hf.detach().numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(yk, k_hf.detach().numpy(), rtol=0, atol=1e-6)
    dq, dk = rng.standard_normal(q.shape), rng.standard_normal(k.shape)
    ((q_hf * torch.from_numpy(dq)).sum() + (k_hf * torch.from_numpy(dk)).sum()).backward()
    np.testing.assert_allclose(rotary_backward(dq, cq), qt.grad.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(rotary_backward(dk, ck), kt.grad.numpy(), rtol=0, atol=1e-6)


def test_rmsnorm_matches_transformers(hf, rng):
    torch, _, _, modeling_llama = hf
    x = rng.standard_normal((3, 5, 32)) * 2
    w = 1 + 0.3 * rng.standard_normal(32)
    norm = modeling_llama.LlamaRMSNorm(32, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
    xt = torch.tensor(x, requires_grad=True)
    y_hf = norm(xt)
    dy = rng.standard_normal(x.shape)
    (y_hf * torch.from_numpy(dy)).sum().backward()
    y, ctx = rmsnorm_forward(x, w, 1e-5)
    dx, dw = rmsnorm_backward(dy, ctx)
    # HF normalises in float32 even for a float64 model (`x.to(torch.float32)`); here float64 is
    # float64 throughout, so the two agree to float32's precision only
    np.testing.assert_allclose(y, y_hf.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, norm.weight.grad.numpy(), rtol=1e-5, atol=1e-5)
    # bfloat16, the module in bfloat16 as a bfloat16 model has it: HF's rounding order
    norm16 = modeling_llama.LlamaRMSNorm(32, eps=1e-5).to(torch.bfloat16)
    wb = w.astype(BF16)
    with torch.no_grad():
        norm16.weight.copy_(torch.from_numpy(wb.astype(np.float32)).to(torch.bfloat16))
        xb = x.astype(BF16)
        y16_hf = norm16(torch.from_numpy(xb.astype(np.float32)).to(torch.bfloat16)).float().numpy().astype(BF16)
    y16, _ = rmsnorm_forward(xb, wb, 1e-5)
    # torch sums the squares in another order than NumPy; where rstd agrees the results agree bit for bit
    same = np.mean(bits(y16) == bits(y16_hf))
    assert same > 0.999, f"only {same:.1%} of the bfloat16 outputs equal transformers' bit for bit"
    np.testing.assert_array_max_ulp(y16.astype(np.float32), y16_hf.astype(np.float32), maxulp=1 << 16)


def test_swiglu_matches_transformers_mlp_activation(hf, rng):
    torch, _, _, _ = hf
    g, u = rng.standard_normal((2, 3, 8)) * 3, rng.standard_normal((2, 3, 8))
    gt, ut = torch.tensor(g, requires_grad=True), torch.tensor(u, requires_grad=True)
    y_hf = torch.nn.functional.silu(gt) * ut  # LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x))
    dy = rng.standard_normal(y_hf.shape)
    (y_hf * torch.from_numpy(dy)).sum().backward()
    y, ctx = swiglu_forward(np.concatenate([g, u], -1))
    d = swiglu_backward(dy, ctx)
    np.testing.assert_allclose(y, y_hf.detach().numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(d[..., :8], gt.grad.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(d[..., 8:], ut.grad.numpy(), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------
# against numbers transformers computed (tests/fixtures/make_hf_llama_ops_fixture.py), without torch
# ---------------------------------------------------------------------------------------
REFERENCE = Path(__file__).resolve().parent.parent / "fixtures" / "hf_llama_ops_reference.safetensors"
FIXTURE_SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3.1": LLAMA31,
                    "llama3.2": LLAMA32}
FIXTURE_SHAPES = {"hd128_theta5e5": (128, 500000.0), "hd64_theta1e4": (64, 10000.0), "hd16_theta5e5": (16, 500000.0)}
FIXTURE_POSITIONS = np.array([[0, 1, 2, 8191, 8192, 100000], [5, 6, 7, 20000, 65536, 131071]])


@pytest.fixture(scope="module")
def hf_numbers():
    return load_file(str(REFERENCE))


@pytest.mark.parametrize("shape", list(FIXTURE_SHAPES))
@pytest.mark.parametrize("scaling", list(FIXTURE_SCALINGS))
def test_inv_freq_and_tables_equal_transformers_recorded_numbers(hf_numbers, scaling, shape):
    head_dim, theta = FIXTURE_SHAPES[shape]
    case = f"{scaling}_{shape}"
    theirs = hf_numbers[f"inv_freq/{case}"]
    ours = rope_inv_freq(head_dim, theta, FIXTURE_SCALINGS[scaling], np.float32)
    # torch's float32 pow is within an ulp of the correctly rounded one used here; every other step
    # is the same float32 operation (see test_inv_freq_and_tables_match_transformers)
    np.testing.assert_array_max_ulp(ours, theirs, maxulp=2)
    assert np.mean(ours == theirs) > 0.9
    cos, sin = rope_tables(head_dim, FIXTURE_POSITIONS, theta, FIXTURE_SCALINGS[scaling], np.float32)
    gap = FIXTURE_POSITIONS[..., None] * np.abs(ours.astype(np.float64) - theirs)
    atol = 1e-6 + 1.01 * np.concatenate([gap, gap], -1)
    assert np.all(np.abs(cos - hf_numbers[f"cos/{case}"]) <= atol)
    assert np.all(np.abs(sin - hf_numbers[f"sin/{case}"]) <= atol)


def test_rotary_and_rmsnorm_equal_transformers_recorded_numbers(hf_numbers):
    q, k = hf_numbers["rotary/q"], hf_numbers["rotary/k"]
    positions = FIXTURE_POSITIONS[:, : q.shape[2]]
    cos, sin = rope_tables(16, 131072, 500000.0, LLAMA32, np.float32)
    for x, name in ((q, "q"), (k, "k")):
        y, _ = rotary_forward(x, cos, sin, positions, seq_axis=2)  # HF's [B, heads, T, hd]
        np.testing.assert_allclose(y, hf_numbers[f"rotary/{name}_out"], rtol=0, atol=1e-6)
    x, w, y_hf = (hf_numbers[f"rmsnorm/{n}"].view(BF16) for n in ("x", "weight", "y"))
    y, _ = rmsnorm_forward(x, w, 1e-5)
    assert np.array_equal(bits(y), bits(y_hf))
