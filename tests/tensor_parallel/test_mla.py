"""Multi-head latent attention (issue 40): float64, with and without the query's low-rank path,
v's head dim (6) apart from q and k's (8): gradients against central finite differences; at tp 2
the output, the input gradient and every parameter's full gradient equal one rank's within
1e-12; against transformers' DeepseekV3Attention (where torch imports; rope_interleave, its
interleaved rope columns permuted once as a reader would) within 1e-12 and 1e-10. The same
launch runs DeepSeek-shaped models (float64, dropout 0.1, packed rows or not) at tp2 + SP, cp2
ring and all-to-all, full and selective recomputation against one rank (1e-10)."""
import zlib

import numpy as np
import pytest

from cutp import ops
from cutp.tensor_parallel import gather_full
from cutp.tensor_parallel.mla import MultiLatentAttention
from cutp.tensor_parallel.sharding import take_shard
from tests.gradcheck import numeric_grad, relative_error
from tests.mpirun import run_mpi
from tests.tp_utils import self_ctx

SHAPE = dict(n_embd=16, n_head=4, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)


def _mla(ctx, q_lora_rank, seed=0):
    rotary = ops.rope_tables(SHAPE["qk_rope_head_dim"], 16, theta=100.0, dtype=np.float64)
    m = MultiLatentAttention(ctx, SHAPE["n_embd"], SHAPE["n_head"], name="attn", rotary=rotary,
                             q_lora_rank=q_lora_rank, **{k: v for k, v in SHAPE.items() if k not in ("n_embd", "n_head")},
                             seed=seed, dtype=np.float64)
    for p in m.parameters():  # away from the initial scale (norm weights off one)
        full = np.random.default_rng(zlib.crc32(p.name.encode())).standard_normal(p.full_shape) * 0.4
        if p.data.ndim == 1:
            full += 1.0
        p.data[...] = take_shard(full, p.sharding, ctx.tp_rank)
    return m


def _inputs():
    rng = np.random.default_rng(7)
    return rng.standard_normal((2, 8, 16)), rng.standard_normal((2, 8, 16))


@pytest.mark.parametrize("q_lora_rank", [5, None])
def test_mla_gradients_match_finite_differences(q_lora_rank):
    ctx = self_ctx()
    m = _mla(ctx, q_lora_rank).train()
    x, w = _inputs()
    m.forward(x)
    dx = m.backward(w)
    objective = lambda: float((m.forward(x) * w).sum())  # noqa: E731
    idx = np.arange(0, x.size, 7)
    assert relative_error(dx.reshape(-1)[idx], numeric_grad(objective, x, indices=idx).reshape(-1)[idx]) < 1e-7
    for p in m.parameters():
        idx = np.random.default_rng(1).choice(p.data.size, min(10, p.data.size), replace=False)
        num = numeric_grad(objective, p.data, indices=idx).reshape(-1)[idx]
        assert relative_error(p.grad.reshape(-1)[idx], num) < 1e-7, p.name


def _worker_tp2_equals_one_rank(model_cases=()):
    import cutp
    from mpi4py import MPI

    from tests.models.test_local_attention import _worker_layouts_equal_one_rank

    ctx = cutp.init(tp=2, device="cpu")
    x, w = _inputs()
    for q_lora_rank in (5, None):
        ref = _mla(self_ctx(), q_lora_rank).train()
        y_ref, dx_ref = ref.forward(x), None
        dx_ref = ref.backward(w)
        m = _mla(ctx, q_lora_rank).train()
        y = m.forward(x)
        dx = m.backward(w)
        assert np.abs(y - y_ref).max() <= 1e-12 * np.abs(y_ref).max()
        assert np.abs(dx - dx_ref).max() <= 1e-12 * np.abs(dx_ref).max()
        grads = {p.name: p.grad for p in ref.parameters()}
        for p in m.parameters():
            g = np.asarray(gather_full(ctx.tp, p.grad, p.sharding))
            assert np.abs(g - grads[p.name]).max() <= 1e-12 * np.abs(grads[p.name]).max(), (q_lora_rank, p.name)
    MPI.COMM_WORLD.Barrier()
    ctx.close()
    _worker_layouts_equal_one_rank(model_cases)


# DeepSeek-V3-shaped models (tests/models/test_local_attention.py's MLA: float64, dropout 0.1, YaRN,
# DeepSeekMoE), with and without packed rows: sequence parallelism (the latents gathered, the
# down-projections' gradients summed over TP), context parallelism by the ring and the all-to-all
# (k's head dim 8, v's 6), full and selective recomputation, each against one rank (loss and every
# gradient within 1e-10)
MODEL_CASES = [dict(model="mla", packed=False, tp=2, sp=True),
               dict(model="mla", packed=True, tp=2, sp=True),
               dict(model="mla_plain_q", packed=True, tp=2, sp=True),  # (q_proj gathers the hidden state)
               dict(model="mla", packed=False, cp=2),
               dict(model="mla", packed=True, cp=2),
               dict(model="mla", packed=True, cp=2, cp_comm="a2a"),
               dict(model="mla", packed=True, tp=2, recompute="full"),
               dict(model="mla", packed=True, tp=2, sp=True, recompute="selective")]


def test_mla_tp2_and_deepseek_shaped_models_on_every_layout_equal_one_rank():
    run_mpi(2, "tests.tensor_parallel.test_mla:_worker_tp2_equals_one_rank", MODEL_CASES, timeout=240)


def interleaved_rope_columns(d_rope: int) -> np.ndarray:
    """The permutation a reader applies to an interleaved rope part's columns (DeepSeek's
    `rope_interleave`): evens then odds, the rotate-half layout transformers rotates."""
    return np.concatenate([np.arange(0, d_rope, 2), np.arange(1, d_rope, 2)])


def test_mla_equals_transformers_deepseek_v3_attention_in_float64(monkeypatch):
    try:
        import torch
        import transformers
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mod
    except ImportError as e:
        pytest.skip(f"torch and transformers do not import here ({e})")
    cfg = transformers.DeepseekV3Config(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=5,
                                        kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                                        rope_interleave=True, attn_implementation="eager")
    torch.manual_seed(0)
    hf = hf_mod.DeepseekV3Attention(cfg, 0).to(torch.float64)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.4)
            if p.ndim == 1:
                p.add_(1.0)
    softmax = torch.nn.functional.softmax  # (the eager softmax's float32 lifted, as tests/models/test_hf_llama.py)
    monkeypatch.setattr(torch.nn.functional, "softmax",
                        lambda x, dim=None, _stacklevel=3, dtype=None: softmax(x, dim=dim, dtype=x.dtype))
    for norm in (hf.q_a_layernorm, hf.kv_a_layernorm):  # (their float32 rounding lifted)
        norm.forward = (lambda n: lambda x: n.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                         + n.variance_epsilon)))(norm)
    ctx = self_ctx()
    m = _mla(ctx, 5).train()
    H, dn, dr = 4, 4, 4
    perm = interleaved_rope_columns(dr)
    q_cols = np.concatenate([np.r_[h * (dn + dr):h * (dn + dr) + dn, h * (dn + dr) + dn + perm] for h in range(H)])
    t = lambda a: a.detach().numpy()  # noqa: E731
    m.q_a.data[...] = t(hf.q_a_proj.weight).T
    m.q_a_norm.weight.data[...] = t(hf.q_a_layernorm.weight)
    m.q_b.weight.data[...] = t(hf.q_b_proj.weight).T[:, q_cols]
    m.kv_a.data[...] = t(hf.kv_a_proj_with_mqa.weight).T[:, np.r_[np.arange(6), 6 + perm]]
    m.kv_a_norm.weight.data[...] = t(hf.kv_a_layernorm.weight)
    m.kv_b.weight.data[...] = t(hf.kv_b_proj.weight).T
    m.proj.weight.data[...] = t(hf.o_proj.weight).T
    x, w = _inputs()
    cos, sin = m.rotary
    xt = torch.from_numpy(x).requires_grad_(True)
    mask = torch.triu(torch.full((8, 8), float("-inf"), dtype=torch.float64), 1)[None, None]
    tables = (torch.from_numpy(cos[:8])[None].expand(2, -1, -1), torch.from_numpy(sin[:8])[None].expand(2, -1, -1))
    y_ref = hf(xt, tables, mask)[0]
    y_ref.backward(torch.from_numpy(w))
    y = m.forward(x)
    dx = m.backward(w)
    assert np.abs(y - t(y_ref)).max() <= 1e-12 * np.abs(y).max()
    assert np.abs(dx - xt.grad.numpy()).max() <= 1e-12 * np.abs(dx).max()
    pairs = [(m.q_a.grad, hf.q_a_proj.weight.grad.numpy().T), (m.kv_b.weight.grad, hf.kv_b_proj.weight.grad.numpy().T),
             (m.q_b.weight.grad, hf.q_b_proj.weight.grad.numpy().T[:, q_cols]),
             (m.kv_a.grad, hf.kv_a_proj_with_mqa.weight.grad.numpy().T[:, np.r_[np.arange(6), 6 + perm]]),
             (m.proj.weight.grad, hf.o_proj.weight.grad.numpy().T),
             (m.kv_a_norm.weight.grad, hf.kv_a_layernorm.weight.grad.numpy())]
    for got, want in pairs:
        assert np.abs(got - want).max() <= 1e-10 * np.abs(want).max()


def test_the_compressed_kv_cache_gives_the_whole_sequence_s_outputs():
    """Eval: 3 then 5 tokens through the cache (the latent and the rope key per token, nothing
    per head) equal the forward of all 8."""
    m = _mla(self_ctx(), 5).eval()
    x, _ = _inputs()
    cache = m.new_kv_cache(2, 16, np.float64)
    assert cache["latent"].shape[2] + cache["k_rope"].shape[2] == SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"]
    y = np.concatenate([m.forward_cached(x[:, :3], cache), m.forward_cached(x[:, 3:], cache)], axis=1)
    np.testing.assert_allclose(y, m.forward(x), rtol=0, atol=1e-13)
