"""Model families (issue 27) on one rank: the Llama- and Qwen2-shaped models compute what a plain
NumPy transcription of Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM computes (RMSNorm,
rotate_half RoPE by position, GQA, SwiGLU, untied or tied head), the KV cache continues the
positions, the spec's bad values are refused naming the field, the presets' parameter counts are
exact, and the fused [gate | up] projection's shards reassemble at any TP."""
import math

import numpy as np
import pytest

import cutp
from cutp import ops
from cutp.models import GPT, GPTConfig, ModelConfig
from cutp.tensor_parallel.sharding import assemble_full, gate_up_sharding, sharding_from_spec, take_shard
from tests.models.test_families import LLAMA, QWEN2


def _plain_loss(c: GPTConfig, sd: dict, idx, targets):
    """The loss, written out from HF's modeling_llama (float64 throughout)."""
    nh, nkv, hd = c.n_head, c.kv_heads, c.head_size
    B, T = idx.shape

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.norm_eps) * w

    inv_freq = ops.rope_inv_freq(hd, c.rope_theta, c.rope, np.float64)
    freqs = np.arange(T)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))

    def rope(x):  # x [B, T, heads, hd]; rotate_half pairs i with i + hd/2
        half = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos[None, :, None] + half * sin[None, :, None]

    x = sd["tok_embed.weight"][idx]
    mask = np.tril(np.ones((T, T), bool))
    for i in range(c.n_layer):
        p = f"layers.{i}."
        a = rms(x, sd[p + "attn_norm.weight"])
        qkv = a @ sd[p + "attn.qkv.weight"] + sd.get(p + "attn.qkv.bias", 0)
        q = rope(qkv[..., : nh * hd].reshape(B, T, nh, hd))
        k = rope(qkv[..., nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd))
        v = qkv[..., (nh + nkv) * hd:].reshape(B, T, nkv, hd)
        k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)  # HF's repeat_kv
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        s = np.where(mask, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", s, v).reshape(B, T, nh * hd)
        x = x + o @ sd[p + "attn.proj.weight"]
        a = rms(x, sd[p + "mlp_norm.weight"])
        gate_up = a @ sd[p + "mlp.fc1.weight"]
        g, u = gate_up[..., : c.hidden], gate_up[..., c.hidden:]
        x = x + (g / (1 + np.exp(-g)) * u) @ sd[p + "mlp.fc2.weight"]
    logits = rms(x, sd["final_norm.weight"]) @ sd["tok_embed.weight" if c.tie_embeddings else "lm_head.weight"].T
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).mean()


@pytest.mark.parametrize("family", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_loss_equals_a_plain_transcription_of_hf(family):
    c = GPTConfig(**dict(family, dropout=0.0))
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, c, seed=1)
    rng = np.random.default_rng(0)
    sd = model.gather_state_dict()
    for name in sd:  # biases and norm weights away from their zeros / ones, so that each one counts
        if not name.endswith("qkv.weight") and sd[name].ndim == 1:
            sd[name] = sd[name] + 0.1 * rng.standard_normal(sd[name].shape)
    model.load_full_state_dict(sd)
    idx, tgt = rng.integers(0, c.vocab_size, (2, 16)), rng.integers(0, c.vocab_size, (2, 16))
    loss = model.forward(idx, tgt)
    ref = _plain_loss(c, sd, idx, tgt)
    assert abs(loss - ref) <= 1e-12 * abs(ref), (loss, ref)
    assert ("layers.0.attn.qkv.bias" in sd) == bool(c.qkv_bias) and "pos_embed.weight" not in sd
    assert not any(n.endswith(("attn.proj.bias", "fc1.bias", "fc2.bias", "attn_norm.bias")) for n in sd)
    ctx.close()


def test_the_kv_cache_continues_rotary_positions():
    c = GPTConfig(**dict(LLAMA, dropout=0.0))
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, c, seed=2).eval()
    idx = np.random.default_rng(3).integers(0, c.vocab_size, (2, 12))
    whole = model.forward(idx)
    caches = model.new_kv_cache(2, 12)
    steps = [model.forward_cached(idx[:, :5], caches)]  # a prompt, then one token at a time
    steps += [model.forward_cached(idx[:, t:t + 1], caches) for t in range(5, 12)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=1e-12, atol=1e-12)
    ctx.close()


def test_preset_parameter_counts_are_exact():
    # Meta's and Hugging Face's published counts
    assert GPTConfig.preset("llama3-8b").num_parameters() == 8_030_261_248
    assert GPTConfig.preset("llama3-70b").num_parameters() == 70_553_706_496
    assert GPTConfig.preset("llama3.2-1b").num_parameters() == 1_235_814_400  # tied
    assert GPTConfig.preset("qwen2-0.5b").num_parameters() == 494_032_768  # q/k/v biases, tied
    assert GPTConfig.preset("tinyllama-1.1b").num_parameters() == 1_100_048_384
    assert GPTConfig.preset("mistral-7b").num_parameters() == 7_248_023_552
    mixtral = GPTConfig.preset("mixtral-8x7b")
    assert (mixtral.num_parameters(), mixtral.num_active_parameters()) == (46_702_792_704, 12_879_925_248)
    # the model's own parameters agree with the formula
    for name in ("llama-tiny", "tiny"):
        ctx = cutp.init(device="cpu")
        assert GPT(ctx, GPTConfig.preset(name)).num_parameters_local() == GPTConfig.preset(name).num_parameters()
        ctx.close()
    assert GPTConfig.preset("llama-tiny").num_parameters() <= GPTConfig.preset("tiny").num_parameters()
    assert ModelConfig is GPTConfig
    # transformers' counts (tests/models/test_hf_moe.py checks them against its classes), DeepSeek-V3
    # without its multi-token prediction layer; the correction bias (a buffer there) not counted
    assert GPTConfig.preset("qwen3-30b-a3b").num_parameters() == 30_532_122_624
    v3 = GPTConfig.preset("deepseek-v3")
    assert (v3.num_parameters(), v3.num_active_parameters()) == (671_026_404_352, 37_552_282_624)
    # generation's cache per token: MLA's 512-value latent and 64-value rope key (DeepSeek-V2's 576 per layer)
    assert v3.kv_cache_values_per_token() == 61 * 576
    assert GPTConfig.preset("llama3-8b").kv_cache_values_per_token() == 32 * 2 * 8 * 128
    for name in ("qwen3-moe-tiny", "deepseek-tiny"):
        ctx = cutp.init(device="cpu")
        params, cfg = GPT(ctx, GPTConfig.preset(name, dropout=0.0)).parameters(), GPTConfig.preset(name)
        assert sum(p.data.size for p in params if not p.name.endswith("score_bias")) == cfg.num_parameters(), name
        assert sum(p.data.size for p in params) == cfg.num_stored_values(), name
        ctx.close()


@pytest.mark.parametrize("change, tp, message", [
    (dict(head_dim=7), 1, r"head_dim=7 is odd"),
    (dict(n_kv_head=3), 1, r"n_kv_head=3 must divide n_head=4"),
    (dict(n_head=8, n_kv_head=4), 3, r"tp=3 does not divide n_head=8"),
    (dict(n_head=12, n_kv_head=4, head_dim=8), 6, r"tp=6 and n_kv_head=4: KV heads are either split"),
    (dict(norm="batchnorm"), 1, r"norm must be one of layernorm, rmsnorm"),
    (dict(positions="alibi"), 1, r"positions must be one of learned, rope"),
    (dict(mlp="reglu"), 1, r"mlp must be one of gelu, swiglu, geglu"),
    (dict(norm="layernorm", norm_offset=True), 1, r"norm_offset=True scales an RMSNorm"),
    (dict(mlp="geglu", n_experts=4), 1, r"mlp=geglu with experts"),
    (dict(positions="learned", rope_local_theta=10.0), 1, r"rope_local_theta is the local layers' rotary theta"),
    (dict(rope_scaling="dynamic"), 1, r"rope scaling type 'dynamic' is not supported"),
    (dict(mlp_hidden=25), 2, r"tp=2 does not divide the MLP width 25"),
])
def test_bad_specs_are_refused_naming_the_field(change, tp, message):
    with pytest.raises(cutp.ConfigError, match=message):
        GPTConfig(**dict(LLAMA, **change)).validate(tp)


def test_set_overrides_parse_the_spec_fields():
    c = GPTConfig.preset("tiny").with_overrides(["norm=rmsnorm", "qkv_bias=true", "rope_theta=5e5", "head_dim=32"])
    assert (c.norm, c.qkv_bias, c.rope_theta, c.head_dim) == ("rmsnorm", True, 500000.0, 32)
    assert GPTConfig.from_dict(c.to_dict()) == c


def test_gate_up_shards_are_gate_r_then_up_r_and_reshard_exactly():
    full = np.arange(3 * 16, dtype=np.float64).reshape(3, 16)  # [in, gate (8) | up (8)]
    for tp in (1, 2, 4, 8):
        s = gate_up_sharding(full.shape, 1, tp)
        shards = [take_shard(full, s, r) for r in range(tp)]
        k = 8 // tp
        for r, shard in enumerate(shards):  # never a slice of [gate ; up] (Megatron-LM #360)
            np.testing.assert_array_equal(shard[:, :k], full[:, r * k:(r + 1) * k])
            np.testing.assert_array_equal(shard[:, k:], full[:, 8 + r * k:8 + (r + 1) * k])
        np.testing.assert_array_equal(assemble_full(shards, s), full)
        rebuilt = sharding_from_spec(s.spec, full.shape)  # as a checkpoint's metadata rebuilds it
        assert all(np.array_equal(a, b) for a, b in zip(rebuilt.indices, s.indices))
    with pytest.raises(cutp.ConfigError, match="tp=3 does not divide the SwiGLU MLP width 8"):
        gate_up_sharding(full.shape, 1, 3)


def test_rotary_attention_takes_global_position_ids():
    """What context parallelism will pass: per-token global ids ([T] or [B, T]) turn Q and K as
    the default arange(T) does, and an offset as the ids it stands for."""
    from cutp.tensor_parallel import BlockSpec, ParallelTransformerBlock, RNGTracker
    from cutp.tensor_parallel.specs import AttentionSpec, MLPSpec, NormSpec

    ctx = cutp.init(device="cpu")
    spec = BlockSpec(32, NormSpec("rmsnorm"), AttentionSpec(32, 4, 2, 8, qkv_bias=True, out_bias=False, rope=True),
                     MLPSpec(32, 24, "swiglu", bias=False))
    tables = ops.rope_tables(8, 64, 500.0, None, np.float64)
    block = ParallelTransformerBlock(ctx, spec, layer=0, rng=RNGTracker(0), seed=1, dtype=np.float64,
                                     rotary=tables).eval()
    x = np.random.default_rng(0).standard_normal((2, 12, 32))
    default = block.forward(x)
    np.testing.assert_array_equal(block.forward(x, np.arange(12)), default)
    np.testing.assert_array_equal(block.forward(x, np.tile(np.arange(12), (2, 1))), default)
    np.testing.assert_array_equal(block.forward(x, 5), block.forward(x, np.arange(5, 17)))
    # RoPE scores depend on i - j only: a shift of every position changes nothing but rounding,
    # and positions in another order do count
    np.testing.assert_allclose(block.forward(x, 5), default, rtol=0, atol=1e-12)
    assert np.abs(block.forward(x, np.arange(12)[::-1].copy()) - default).max() > 1e-5
    ctx.close()
