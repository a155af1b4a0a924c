"""Hugging Face interop of Gemma 2 and Gemma 3 (issue 37): Gemma2ForCausalLM and Gemma3ForCausalLM
(gemma3_text) directories read into cutp and written back.

Without torch: cutp's Gemma 2 and 3 logits equal a plain float64 NumPy transcription of
transformers' modeling code (1e-12), a cutp Gemma written by save_hf reads back to the same logits
under save_pretrained's names, the Hub's config.json files read as the presets, whose parameter
counts are transformers' (checked against transformers where it imports), and what cutp cannot
compute is refused naming the field.
Against transformers (where torch and transformers import; skipped with the reason otherwise):
random small models with every Gemma piece ((1 + w) norms before and after each branch, GeGLU,
scaled embeddings, query_pre_attn_scalar, the final soft-cap, Gemma 3's QK-norm and two ropes, one
linearly scaled) give cutp's logits (float32 1e-5, float64 1e-12 with transformers' float32 casts
lifted), float64 gradients (1e-10), greedy generation with and without the KV cache, at tp 1, 2
and 4, and export-hf's directory loads as the same class with the same names and logits.

The window and the attention soft-cap are applied by the attention paths (issue 37's other
part): until cutp's config accepts them (test_families.WINDOW_APPLIED), the models here have windows no
shorter than the sequence and no attention soft-cap, and the tests of a window shorter than the
sequence with the attention soft-cap set skip, saying so.
"""
import json
import math

import numpy as np
import pytest

import cutp
from cutp import ops
from cutp.hf import HFFormatError, config_from_hf, from_hf, hf_state_dict, save_hf
from cutp.models import GPT, GPTConfig
from cutp.models.hf import config_to_hf, hf_shapes
from tests.models.test_families import WINDOW_APPLIED
from tests.models.test_hf_llama import _file_keys, _greedy, _logits, _transformers
from tests.mpirun import run_mpi


needs_window = pytest.mark.skipif(not WINDOW_APPLIED, reason="needs the attention window (attn-paths)")

V, T = 97, 24  # vocabulary, the test sequence
WINDOWED = dict(sliding_window=8, attn_logit_softcapping=20.0)  # a window shorter than T, scores capped
UNWINDOWED = dict(sliding_window=64, attn_logit_softcapping=None)  # (the window is max_position_embeddings)


def _hf_config(family, transformers, windowed=False):
    common = dict(hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-5,
                  query_pre_attn_scalar=10, final_logit_softcapping=5.0, attn_implementation="eager",
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  **(WINDOWED if windowed else UNWINDOWED))
    if family != "gemma2":  # (Gemma 3 keeps attn_logit_softcapping in its config but never applies it)
        common["attn_logit_softcapping"] = None
    if family == "gemma2":
        return transformers.Gemma2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    # Gemma 3: the global layers' rope linearly scaled (as gemma-3-4b and larger), the local layers' own theta
    return transformers.Gemma3TextConfig(**common, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})


def _hf_model(family, torch, transformers, dtype, windowed=False):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(family, transformers, windowed)).to(dtype).eval()
    with torch.no_grad():  # the norms' weights (zeros: scale 1) moved, so that each counts
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _cutp_config(family, **over):
    """The cutp config of _hf_config's model (without transformers: its mapping, by hand)."""
    types = ("sliding_attention", "full_attention", "sliding_attention")
    c = dict(n_layer=3, n_head=4, n_kv_head=2, head_dim=12, n_embd=32, mlp_hidden=24, vocab_size=V, block_size=64,
             norm="rmsnorm", positions="rope", mlp="geglu", bias=False, norm_eps=1e-5, norm_offset=True,
             embed_scale=True, post_norms=True, query_pre_attn_scalar=10.0, final_softcap=5.0, sliding_window=64,
             layer_types=types, rope_theta=1000.0, dtype="float64", family=family)
    if family == "gemma3_text":
        c.update(qk_norm=True, rope_theta=5000.0, rope_scaling="linear", rope_factor=4.0, rope_local_theta=100.0)
    return GPTConfig(**dict(c, **over))


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_save_hf_then_from_hf_gives_the_same_model(family, tmp_path):
    cfg = _cutp_config(family)
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, cfg, seed=4).eval()
    for p in model.parameters():  # (the norms start at zero: moved so that a lost one would show)
        if p.data.ndim == 1:
            p.data += np.random.default_rng(len(p.name)).normal(0, 0.1, p.data.shape)
    save_hf(model, str(tmp_path))
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["model_type"] == family
    assert _file_keys(tmp_path) == set(hf_shapes(cfg))
    assert any(k.endswith("pre_feedforward_layernorm.weight") for k in _file_keys(tmp_path))
    back = from_hf(ctx, str(tmp_path), dtype="float64")
    idx = np.random.default_rng(0).integers(0, V, (2, T))
    np.testing.assert_array_equal(_logits(back, idx), _logits(model, idx))
    for k in ("norm_offset", "embed_scale", "post_norms", "query_pre_attn_scalar", "rope_local_theta", "final_softcap",
              "layer_types", "sliding_window", "qk_norm", "rope_scaling", "rope_factor", "mlp", "gelu"):
        assert getattr(back.config, k) == getattr(cfg, k), k
    ctx.close()


def _plain_logits(c: GPTConfig, sd: dict, idx) -> np.ndarray:
    """The logits, written out from transformers' modeling_gemma2 / modeling_gemma3 (float64)."""
    nh, nkv, hd, B, T = c.n_head, c.kv_heads, c.head_size, idx.shape[0], idx.shape[1]

    def rms(x, w):  # Gemma's: scale 1 + w
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.norm_eps) * (1.0 + w)

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    def rope(x, inv_freq):  # x [B, T, heads, hd]; rotate_half pairs i with i + hd/2
        freqs = np.arange(T)[:, None] * inv_freq[None, :]
        cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
        half = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos[None, :, None] + half * sin[None, :, None]

    x = sd["tok_embed.weight"][idx] * math.sqrt(c.n_embd)
    pos = np.arange(T)
    for i in range(c.n_layer):
        p, local = f"layers.{i}.", c.is_local_layer(i)
        inv_freq = (ops.rope_inv_freq(hd, c.rope_local_theta, None, np.float64) if local and c.rope_local_theta
                    else ops.rope_inv_freq(hd, c.rope_theta, c.rope, np.float64))
        qkv = rms(x, sd[p + "attn_norm.weight"]) @ sd[p + "attn.qkv.weight"]
        q = qkv[..., : nh * hd].reshape(B, T, nh, hd)
        k = qkv[..., nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd)
        v = qkv[..., (nh + nkv) * hd:].reshape(B, T, nkv, hd)
        if c.qk_norm:
            q, k = rms(q, sd[p + "attn.q_norm.weight"]), rms(k, sd[p + "attn.k_norm.weight"])
        q, k = rope(q, inv_freq), rope(k, inv_freq)
        k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) * c.query_pre_attn_scalar ** -0.5
        if c.attn_softcap:
            s = c.attn_softcap * np.tanh(s / c.attn_softcap)
        see = pos[None, :] <= pos[:, None]
        if local and c.sliding_window:
            see &= pos[None, :] > pos[:, None] - c.sliding_window
        s = np.where(see, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", s, v).reshape(B, T, nh * hd)
        x = x + rms(o @ sd[p + "attn.proj.weight"], sd[p + "post_attn_norm.weight"])
        gate_up = rms(x, sd[p + "mlp_norm.weight"]) @ sd[p + "mlp.fc1.weight"]
        m = (gelu_tanh(gate_up[..., : c.hidden]) * gate_up[..., c.hidden:]) @ sd[p + "mlp.fc2.weight"]
        x = x + rms(m, sd[p + "post_mlp_norm.weight"])
    logits = rms(x, sd["final_norm.weight"]) @ sd["tok_embed.weight"].T
    return c.final_softcap * np.tanh(logits / c.final_softcap) if c.final_softcap else logits


@pytest.mark.parametrize("family, over", [
    ("gemma2", {}), ("gemma3_text", {}),
    pytest.param("gemma2", dict(sliding_window=4, attn_softcap=3.0), marks=needs_window, id="gemma2-windowed"),
    pytest.param("gemma3_text", dict(sliding_window=4), marks=needs_window, id="gemma3-windowed")])
def test_logits_equal_a_plain_transcription_of_transformers_gemma(family, over):
    c = _cutp_config(family, **over)
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, c, seed=1).eval()
    rng = np.random.default_rng(0)
    sd = {k: v + (0.1 * rng.standard_normal(v.shape) if v.ndim == 1 else 0)  # norms away from zero
          for k, v in model.gather_state_dict().items()}
    model.load_full_state_dict(sd)
    idx = rng.integers(0, V, (2, 16))
    got, ref = _logits(model, idx), _plain_logits(c, sd, idx)
    assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max(), np.abs(got - ref).max()
    ctx.close()


def test_the_pieces_change_the_function_and_norms_start_at_scale_one():
    """Each Gemma piece is computed (turning it off changes the logits), and a (1 + w) norm's
    weight is initialised to zeros, as transformers stores it."""
    ctx = cutp.init(device="cpu")
    idx = np.random.default_rng(0).integers(0, V, (1, 16))
    base = _cutp_config("gemma3_text")
    ref = _logits(GPT(ctx, base, seed=1).eval(), idx)
    for change in (dict(embed_scale=False), dict(post_norms=False), dict(query_pre_attn_scalar=None),
                   dict(final_softcap=None), dict(rope_local_theta=None), dict(mlp="swiglu")):
        other = _logits(GPT(ctx, GPTConfig(**dict(base.to_dict(), **change)), seed=1).eval(), idx)
        assert np.abs(other - ref).max() > 1e-6, change
    model = GPT(ctx, base, seed=1)
    assert all(not p.data.any() for p in model.parameters() if "norm" in p.name)
    assert np.abs(ref).max() < 5.0  # soft-capped at 5
    ctx.close()


GEMMA_HF = dict(model_type="gemma2", hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=64,
                sliding_window=64, attn_logit_softcapping=None)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_activation="silu"), r"hidden_activation='silu' is not supported"),
    (dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True"),
    (dict(model_type="gemma3_text", rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     r"rope_parameters.sliding_attention=.* is not supported"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0}), r"rope_scaling type 'dynamic' is not supported"),
])
def test_what_cutp_cannot_compute_is_refused_naming_the_field(change, message):
    with pytest.raises(HFFormatError, match=message):
        config_from_hf(dict(GEMMA_HF, **change))


def test_the_other_families_refuse_gemma_s_pieces():
    # (Llama without the window, which it refuses first: it attends globally)
    for family, over in (("llama", dict(mlp="swiglu", norm_offset=False, post_norms=False, qk_norm=False,
                                        sliding_window=None, layer_types=None)),
                         ("qwen3", dict(mlp="swiglu", norm_offset=False, post_norms=False, qk_norm=True)),
                         ("gemma2", dict(qk_norm=False))):
        cfg = _cutp_config(family, **dict(over, rope_local_theta=100.0, rope_scaling="none"))
        with pytest.raises(HFFormatError, match=r"rope_local_theta"):
            config_to_hf(cfg)


PRESET_HF = {"gemma2-2b": ("gemma2", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                          num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                          vocab_size=256000)),
             "gemma3-1b": ("gemma3_text", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                               num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                               vocab_size=262144))}
# transformers' counts of the configs above (torch's meta device: shapes only), kept so the CPU suite
# checks them too; the transformers test below recomputes them
PRESET_COUNTS = {"gemma2-2b": 2614341888, "gemma3-1b": 999885952}


@pytest.mark.parametrize("preset", sorted(PRESET_HF))
def test_presets_count_transformers_parameters(preset):
    cfg = GPTConfig.preset(preset)
    assert cfg.num_parameters() == PRESET_COUNTS[preset]
    family, fields = PRESET_HF[preset]
    assert cfg.family == family and (cfg.n_layer, cfg.n_embd, cfg.hidden) == (
        fields["num_hidden_layers"], fields["hidden_size"], fields["intermediate_size"])


# config.json of google/gemma-2-2b and google/gemma-3-1b-pt as the Hub ships them (transformers 4.x:
# top-level rope fields, no layer_types, sliding_window_pattern)
HUB = {"gemma2-2b": dict(architectures=["Gemma2ForCausalLM"], attention_bias=False, attention_dropout=0.0,
                         attn_logit_softcapping=50.0, bos_token_id=2, cache_implementation="hybrid", eos_token_id=1,
                         final_logit_softcapping=30.0, head_dim=256, hidden_act="gelu_pytorch_tanh",
                         hidden_activation="gelu_pytorch_tanh", hidden_size=2304, initializer_range=0.02,
                         intermediate_size=9216, max_position_embeddings=8192, model_type="gemma2",
                         num_attention_heads=8, num_hidden_layers=26, num_key_value_heads=4, pad_token_id=0,
                         query_pre_attn_scalar=256, rms_norm_eps=1e-06, rope_theta=10000.0, sliding_window=4096,
                         torch_dtype="float32", use_cache=True, vocab_size=256000),
       "gemma3-1b": dict(architectures=["Gemma3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
                         attn_logit_softcapping=None, bos_token_id=2, cache_implementation="hybrid", eos_token_id=1,
                         final_logit_softcapping=None, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                         hidden_size=1152, initializer_range=0.02, intermediate_size=6912,
                         max_position_embeddings=32768, model_type="gemma3_text", num_attention_heads=4,
                         num_hidden_layers=26, num_key_value_heads=1, pad_token_id=0, query_pre_attn_scalar=256,
                         rms_norm_eps=1e-06, rope_local_base_freq=10000, rope_scaling=None, rope_theta=1000000,
                         sliding_window=512, sliding_window_pattern=6, torch_dtype="bfloat16", use_cache=True,
                         vocab_size=262144)}


@pytest.mark.parametrize("preset", sorted(HUB))
def test_the_hub_s_config_json_reads_as_the_preset_and_writes_back(preset):
    from cutp.models.families import family_for_hf

    hub = HUB[preset]
    family = family_for_hf(hub)
    fields = dict(family.config_from_hf(hub, "config.json"), **family.special_tokens(hub), family=family.name)
    assert GPTConfig(**fields) == GPTConfig.preset(preset)
    back = family.config_to_hf(GPTConfig.preset(preset))
    for k in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
              "hidden_activation", "head_dim", "tie_word_embeddings" if "tie_word_embeddings" in hub else "vocab_size"):
        assert back[k] == hub[k], k
    again = dict(family.config_from_hf(back, "config.json"), **family.special_tokens(back), family=family.name)
    assert GPTConfig(**again) == GPTConfig.preset(preset)


def test_preset_counts_are_transformers_own():
    torch, transformers = _transformers()
    for preset, (family, fields) in PRESET_HF.items():
        config, model = ((transformers.Gemma2Config, transformers.Gemma2ForCausalLM) if family == "gemma2" else
                         (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM))
        with torch.device("meta"):  # (shapes only; the class itself: from_config is a minute slower)
            model = model(config(**fields))
        assert sum(p.numel() for p in model.parameters()) == PRESET_COUNTS[preset], preset


# ---- against transformers ---------------------------------------------------------------------
FAMILIES = ["gemma2", "gemma3"]


def _check_export(transformers, torch, model, hf, src, out, idx, ref):
    """save_hf's directory (from any layout) loads as hf's class, with its names and its logits."""
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    with torch.no_grad():
        got = again(torch.from_numpy(idx)).logits.numpy()
    assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()
    assert type(again) is type(hf), f"exported as {type(again).__name__}, not {type(hf).__name__}"
    assert _file_keys(out) == _file_keys(src)  # the names save_pretrained writes
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "sliding_window", "layer_types",
              "final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar"):
        assert getattr(again.config, k) == getattr(hf.config, k), k


def _float32_and_generation(family, tmp_path, windowed):
    torch, transformers = _transformers()
    hf = _hf_model(family, torch, transformers, torch.float32, windowed)
    hf.save_pretrained(str(tmp_path / "hf"))
    ctx = cutp.init(device="cpu")
    model = from_hf(ctx, str(tmp_path / "hf"), dtype="float32")
    idx = np.random.default_rng(1).integers(0, V, (2, T))
    with torch.no_grad():
        ref = hf(torch.from_numpy(idx)).logits.numpy()
        want = hf.generate(torch.from_numpy(idx[:1, :6]), max_new_tokens=32, do_sample=False, pad_token_id=0)
    got = _logits(model, idx)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(got - ref).max()
    for cached in (True, False):  # greedy, 32 tokens (past the window when windowed)
        assert _greedy(model, idx[:1, :6], 32, cached) == list(want[0].numpy()), cached
    save_hf(model, str(tmp_path / "cutp"))
    _check_export(transformers, torch, model, hf, tmp_path / "hf", tmp_path / "cutp", idx, ref)
    ctx.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_generation_and_export_equal_transformers(family, tmp_path):
    _float32_and_generation(family, tmp_path, windowed=False)


@needs_window
@pytest.mark.parametrize("family", FAMILIES)
def test_with_a_window_shorter_than_the_sequence_and_attention_softcap(family, tmp_path):
    _float32_and_generation(family, tmp_path, windowed=True)


def _lift_float32_casts(monkeypatch, torch, hf):
    """transformers' Gemma computes its norms, rotary tables and attention softmax in float32 even
    in a float64 model, and keeps sqrt(hidden_size) as a float32 buffer; cutp computes them in
    float64. These patches run them in the model's dtype (the rotary tables from float64 inverse
    frequencies), so that float64 is compared with float64."""
    from cutp import ops

    softmax = torch.nn.functional.softmax

    def softmax_in_dtype(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax_in_dtype)

    def rmsnorm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def rotary(self, x, position_ids, layer_type=None):
        inv_freq = getattr(self, f"{layer_type}_inv_freq") if layer_type else self.inv_freq
        freqs = position_ids[..., None].to(torch.float64) * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    c = hf.config
    for module in hf.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            monkeypatch.setattr(type(module), "forward", rmsnorm)
        elif name.endswith("ScaledWordEmbedding"):
            module.embed_scale = torch.tensor(c.hidden_size ** 0.5, dtype=torch.float64)
        elif name.endswith("RotaryEmbedding"):
            monkeypatch.setattr(type(module), "forward", rotary)
            params = c.rope_parameters
            for layer_type in ("full_attention", "sliding_attention"):
                rope = params.get(layer_type, params)
                scaling = rope if rope.get("rope_type", "default") != "default" else None
                inv = torch.from_numpy(ops.rope_inv_freq(c.head_dim, rope["rope_theta"], scaling, np.float64))
                setattr(module, f"{layer_type}_inv_freq" if layer_type in params else "inv_freq", inv)


@pytest.mark.parametrize("windowed", [False, pytest.param(True, marks=needs_window)])
@pytest.mark.parametrize("family", FAMILIES)
def test_float64_logits_and_gradients_equal_transformers_without_its_float32_casts(family, windowed, tmp_path,
                                                                                     monkeypatch):
    torch, transformers = _transformers()
    hf = _hf_model(family, torch, transformers, torch.float64, windowed)
    hf.save_pretrained(str(tmp_path))
    _lift_float32_casts(monkeypatch, torch, hf)
    ctx = cutp.init(device="cpu")
    model = from_hf(ctx, str(tmp_path), dtype="float64")
    # (ids from 1: transformers' embedding gives the pad id's row (0) no gradient, padding_idx, as
    # Llama's does; cutp's embedding, of every family, does not single it out)
    idx = np.random.default_rng(2).integers(1, V, (2, T))
    ids = torch.from_numpy(idx)
    logits = hf(ids).logits
    hf_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    hf_loss.backward()
    got, ref = _logits(model, idx), logits.detach().numpy()
    assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max(), np.abs(got - ref).max()
    model.train()
    loss = model.forward(idx, model.targets_from_labels(idx))
    assert abs(loss - hf_loss.item()) <= 1e-12 * abs(hf_loss.item())
    model.backward()
    grads = hf_state_dict(model.config, {p.name: p.grad[:p.real_rows] for p in model.parameters()})
    for name, p in hf.named_parameters():
        g, rg = grads[name], p.grad.numpy()
        assert np.abs(g - rg).max() <= 1e-10 * np.abs(rg).max(), name
    ctx.close()


def _tp_against_transformers(tmp_path, windowed):
    torch, transformers = _transformers()
    idx = np.random.default_rng(1).integers(0, V, (2, T))
    models = {}
    for family in FAMILIES:
        hf = models[family] = _hf_model(family, torch, transformers, torch.float32, windowed)
        d = tmp_path / family
        hf.save_pretrained(str(d / "hf"))
        np.save(d / "idx.npy", idx)
        with torch.no_grad():
            np.save(d / "logits.npy", hf(torch.from_numpy(idx)).logits.numpy())
            np.save(d / "greedy.npy", hf.generate(torch.from_numpy(idx[:1, :6]), max_new_tokens=32, do_sample=False,
                                                  pad_token_id=0).numpy())
    run_mpi(4, "tests.models.test_hf_llama:_worker_tp_against_transformers", str(tmp_path), FAMILIES, timeout=600)
    for family, hf in models.items():
        ref = np.load(tmp_path / family / "logits.npy")
        for tp in (2, 4):
            _check_export(transformers, torch, None, hf, tmp_path / family / "hf", tmp_path / family / f"cutp-tp{tp}",
                          idx, ref)


def test_tp2_and_tp4_logits_generation_and_export_equal_transformers(tmp_path):
    _tp_against_transformers(tmp_path, windowed=False)


@needs_window
def test_tp2_and_tp4_with_a_window_shorter_than_the_sequence_and_attention_softcap(tmp_path):
    _tp_against_transformers(tmp_path, windowed=True)
