"""Hugging Face interop of the Llama family (issues 27, 37): LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM, MixtralForCausalLM and Qwen3ForCausalLM directories read into cutp and written back.

Without torch: a cutp model written by save_hf reads back (at tp 1 and 2) to the same logits,
under save_pretrained's tensor names, and what cutp cannot compute is refused naming the field.
Against transformers (where torch and transformers import; skipped with the reason otherwise):
random small models of each family built from configs give cutp's logits (float32 within 1e-5
relative) and greedy generations, and save_hf's directories load into transformers.
"""
import json

import numpy as np
import pytest

import cutp
from cutp.hf import HFFormatError, config_from_hf, from_hf, hf_state_dict, save_hf
from cutp.models import GPT, GPTConfig
from cutp.models.hf import hf_shapes
from tests.models.test_families import DEEPSEEK_V3, LLAMA, MIXTRAL, QWEN2, QWEN3, QWEN3_MOE
from tests.mpirun import run_mpi

SPECS = {"llama": dict(LLAMA, dropout=0.0),
         "qwen2": dict(QWEN2, dropout=0.0),  # (head_dim 12 apart from n_embd / n_head: config.json's head_dim)
         "mixtral": dict(MIXTRAL, dropout=0.0, moe_ffn=None),
         "qwen3": dict(QWEN3, dropout=0.0),
         "qwen3_moe": dict(QWEN3_MOE, dropout=0.0),
         "deepseek_v3": DEEPSEEK_V3}


def _logits(model, idx):
    return model.gather_logits(model.forward(idx))


@pytest.mark.parametrize("family", sorted(SPECS))
def test_save_hf_then_from_hf_gives_the_same_model(family, tmp_path):
    cfg = GPTConfig(**SPECS[family])
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, cfg, seed=4).eval()
    save_hf(model, str(tmp_path))
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["model_type"] == family
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    assert names == set(hf_shapes(cfg))  # save_pretrained's names (lm_head left out when tied)
    assert ("lm_head.weight" in names) == (not cfg.tie_embeddings)
    back = from_hf(ctx, str(tmp_path), dtype="float64")
    idx = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    np.testing.assert_array_equal(_logits(back, idx), _logits(model, idx))
    for k in ("norm", "positions", "mlp", "kv_heads", "head_size", "rope_scaling", "n_experts", "moe_renormalize",
              "moe_dense_layers"):
        assert getattr(back.config, k) == getattr(cfg, k), k
    assert back.config._bias("qkv_bias") == cfg._bias("qkv_bias")
    assert cfg.rope_scaling == "none" or back.config.rope == cfg.rope
    ctx.close()


def _worker_reads_at_tp2(path, expect_path):
    ctx = cutp.init(tp=2, device="cpu")
    model = from_hf(ctx, path, dtype="float64")
    got = _logits(model, np.random.default_rng(0).integers(0, 97, (2, 16)))
    np.testing.assert_allclose(got, np.load(expect_path), rtol=1e-12, atol=1e-12)
    ctx.close()


def test_a_directory_reads_into_tp2_shards(tmp_path):
    cfg = GPTConfig(**SPECS["llama"])  # 2 KV heads at tp 2; [gate_r ; up_r] shards
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, cfg, seed=5).eval()
    save_hf(model, str(tmp_path / "m"))
    np.save(tmp_path / "logits.npy", _logits(model, np.random.default_rng(0).integers(0, 97, (2, 16))))
    ctx.close()
    run_mpi(2, "tests.models.test_hf_llama:_worker_reads_at_tp2", str(tmp_path / "m"), str(tmp_path / "logits.npy"),
            timeout=120)


def test_bfloat16_files_read_into_a_float32_model(tmp_path):
    """The Hub ships Llama 3.x in bfloat16 (torch_dtype bfloat16): read, converted to the dtype asked for."""
    import ml_dtypes

    cfg = GPTConfig(**dict(SPECS["llama"], dtype="float32"))
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, cfg, seed=6).eval()
    save_hf(model, str(tmp_path), dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = from_hf(ctx, str(tmp_path), dtype="float32")
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in model.gather_state_dict().items()}
    assert all(np.array_equal(back.gather_state_dict()[k], v) for k, v in rounded.items())
    ctx.close()


LLAMA_HF = dict(model_type="llama", hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, rms_norm_eps=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gemma"), r"model_type is 'gemma'"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=32, layer_types=["sliding"] * 2),
     r"layer_types \['sliding', 'sliding'\] must list"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), r"rope_scaling type 'dynamic' is not supported"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
    (dict(num_key_value_heads=3), r"n_kv_head=3 must divide n_head=4"),
    (dict(head_dim=7), r"head_dim=7 is odd"),
])
def test_what_cutp_cannot_compute_is_refused_naming_the_field(change, message):
    with pytest.raises(HFFormatError, match=message):
        config_from_hf(dict(LLAMA_HF, **change))


def test_the_hub_s_llama3_config_layout_and_transformers5_rope_parameters():
    old = dict(LLAMA_HF, rope_theta=500000.0, torch_dtype="bfloat16",
               rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    new = dict(LLAMA_HF, rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0,
                                          "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                          "original_max_position_embeddings": 8192})
    for d in (old, new):
        c = config_from_hf(d)
        assert (c.rope_theta, c.rope_scaling, c.rope_factor, c.rope_original_max_positions) == (
            500000.0, "llama3", 32.0, 8192)
    assert config_from_hf(dict(LLAMA_HF, model_type="qwen2")).qkv_bias is True


def test_a_yarn_rope_scaling_reads_and_writes_back_unchanged():
    from cutp.models.families.base import rope_to_hf

    yarn = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 24.0, "beta_slow": 2.0, "mscale": 1.0,
            "mscale_all_dim": 0.5, "original_max_position_embeddings": 4096}
    c = config_from_hf(dict(LLAMA_HF, rope_scaling=yarn))
    assert (c.rope_scaling, c.rope_factor, c.rope_beta_fast, c.rope_beta_slow, c.rope_mscale, c.rope_mscale_all_dim,
            c.rope_original_max_positions) == ("yarn", 40.0, 24.0, 2.0, 1.0, 0.5, 4096)
    assert rope_to_hf(c) == yarn


# ---- against transformers ---------------------------------------------------------------------
def _transformers():
    try:
        import torch  # optional: only the parity tests against transformers use it
        import transformers  # optional
    except ImportError as e:
        pytest.skip(f"torch and transformers do not import here ({e}); run this file with a Python that has "
                    "them (e.g. /work/venv-torch/bin/python -m pytest, PYTHONPATH=the checkout)")
    return torch, transformers


def _hf_model(family, torch, transformers, dtype):
    common = dict(hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, attn_implementation="eager")
    if family == "llama":  # llama3 rope scaling with its bands inside the head
        cfg = transformers.LlamaConfig(**common, rope_theta=500.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8})
    elif family == "qwen2":
        # layer 0 global, layer 1 local with a 7-token window (use_sliding_window from max_window_layers on)
        cfg = transformers.Qwen2Config(**dict(common, tie_word_embeddings=True), rope_theta=1000.0,
                                       use_sliding_window=True, sliding_window=7, max_window_layers=1)
    elif family == "mistral":
        # Mistral v0.1's window, shorter than the tests' 24 tokens and their 38 of generation
        cfg = transformers.MistralConfig(**common, sliding_window=7, head_dim=8)
    elif family == "qwen3":  # head_dim 12, apart from hidden_size / heads (8)
        cfg = transformers.Qwen3Config(**common, head_dim=12, rope_theta=1000.0)
    else:
        # (eager experts: transformers 5's grouped GEMM refuses float64)
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                         experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():  # biases and norm weights away from zero and one, so that each counts
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "mixtral", "qwen3"])
def test_logits_and_greedy_generation_equal_transformers(family, tmp_path):
    torch, transformers = _transformers()
    hf = _hf_model(family, torch, transformers, torch.float32)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    ctx = cutp.init(device="cpu")
    model = from_hf(ctx, str(tmp_path), dtype="float32")
    idx = np.random.default_rng(1).integers(0, 97, (2, 24))
    with torch.no_grad():
        ref = hf(torch.from_numpy(idx)).logits.numpy()
    got = _logits(model, idx)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(got - ref).max()
    # greedy, 32 tokens, through cutp's KV cache
    prompt = idx[:1, :6]
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(prompt), max_new_tokens=32, do_sample=False, pad_token_id=0).numpy()
    caches = model.new_kv_cache(1, 6 + 32)
    out, step = list(prompt[0]), prompt
    for _ in range(32):
        nxt = int(np.argmax(model.gather_logits(model.forward_cached(step, caches))[0, -1]))
        out.append(nxt)
        step = np.array([[nxt]])
    assert out == list(want[0]), (out, list(want[0]))
    # and back: save_hf's directory loads into transformers to the same logits, the same names
    save_hf(model, str(tmp_path / "cutp"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "cutp"), torch_dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    with torch.no_grad():
        ref2 = again(torch.from_numpy(idx)).logits.numpy()
    assert np.abs(ref2 - ref).max() <= 1e-6 * np.abs(ref).max()
    assert type(again) is type(hf), f"{family}: exported as {type(again).__name__}, not {type(hf).__name__}"
    assert _file_keys(tmp_path / "cutp") == _file_keys(tmp_path)  # the names save_pretrained writes
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(again.config, k) == getattr(hf.config, k), k
        assert getattr(again.generation_config, k) == getattr(hf.generation_config, k), k
    ctx.close()


def _file_keys(path) -> set:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return set(f.keys())


def _lift_float32_casts(monkeypatch, torch, hf):
    """transformers' Llama-family code rounds RMSNorm statistics, the rotary tables, the attention
    softmax and the router softmax to float32 even in a float64 model (~3e-7 from float64);
    cutp computes them in float64. These patches run them in the model's dtype, with the float64
    inv_freq, so that float64 is compared with float64."""
    from cutp import ops

    softmax = torch.nn.functional.softmax

    def softmax_in_dtype(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax_in_dtype)

    def rmsnorm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (YaRN's attention factor as transformers applies it)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def router(self, hidden_states):  # transformers 5's MixtralTopKRouter, softmax in the model's dtype
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        top, indices = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), indices

    c = hf.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    for module in hf.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            monkeypatch.setattr(type(module), "forward", rmsnorm)
        elif name == "MixtralTopKRouter":
            monkeypatch.setattr(type(module), "forward", router)
        elif name.endswith("RotaryEmbedding"):
            monkeypatch.setattr(type(module), "forward", rotary)
            # (transformers 5 keeps theta and the scaling in rope_parameters; 4.x at the top level)
            rope = getattr(c, "rope_parameters", None) or {}
            theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
            scaling = rope if rope.get("rope_type", "default") != "default" else getattr(c, "rope_scaling", None)
            module.inv_freq = torch.from_numpy(ops.rope_inv_freq(hd, theta, scaling, np.float64))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "mixtral", "qwen3"])
def test_float64_logits_and_gradients_equal_transformers_without_its_float32_casts(family, tmp_path, monkeypatch):
    torch, transformers = _transformers()
    hf = _hf_model(family, torch, transformers, torch.float64)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    _lift_float32_casts(monkeypatch, torch, hf)
    ctx = cutp.init(device="cpu")
    model = from_hf(ctx, str(tmp_path), dtype="float64")
    check_float64_against(torch, hf, model, np.random.default_rng(2).integers(0, 97, (2, 24)), _in_module_layout)
    ctx.close()


def check_float64_against(torch, hf, model, idx, layout):
    """float64 logits (1e-12), the loss (1e-12) and every gradient (1e-10) of cutp's `model`
    against transformers' `hf`; `layout(file tensors, module parameter name)` finds a module
    parameter's tensor among the file's."""
    ids = torch.from_numpy(idx)
    logits = hf(ids).logits
    # (transformers' own loss upcasts the logits to float32: the shifted cross-entropy in float64 here)
    hf_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, hf.config.vocab_size),
                                                ids[:, 1:].reshape(-1))
    hf_loss.backward()
    got = _logits(model, idx)
    ref = logits.detach().numpy()
    assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max(), np.abs(got - ref).max()
    model.train()
    loss = model.forward(idx, model.targets_from_labels(idx))
    assert abs(loss - hf_loss.item()) <= 1e-12 * abs(hf_loss.item())
    model.backward(aux_dloss=0.0)  # (transformers adds the MoE auxiliary loss only with output_router_logits)
    grads = hf_state_dict(model.config, {p.name: (p.data * 0 if p.grad is None else p.grad)[:p.real_rows]
                                         for p in model.parameters()})  # (a buffer has no gradient)
    for name, p in hf.named_parameters():
        g, rg = layout(grads, name), p.grad.numpy()
        assert np.abs(g - rg).max() <= 1e-10 * np.abs(rg).max(), name


def _in_module_layout(tensors: dict, name: str) -> np.ndarray:
    """The tensor of module parameter `name` from tensors under the file's names: the same, or
    (transformers 5's Mixtral) the experts fused: gate_up_proj [E, 2F, h] = [w1; w3] per expert,
    down_proj [E, h, F] = w2, mlp.gate = block_sparse_moe.gate."""
    if name in tensors:
        return tensors[name]
    layer, _, what = name.partition(".mlp.")
    moe = layer + ".block_sparse_moe."
    if what == "gate.weight":
        return tensors[moe + "gate.weight"]
    n = len({k.split(".experts.")[1].split(".")[0] for k in tensors if k.startswith(moe + "experts.")})
    if what == "experts.gate_up_proj":
        return np.stack([np.concatenate([tensors[f"{moe}experts.{e}.w1.weight"], tensors[f"{moe}experts.{e}.w3.weight"]])
                         for e in range(n)])
    assert what == "experts.down_proj", name
    return np.stack([tensors[f"{moe}experts.{e}.w2.weight"] for e in range(n)])


FAMILIES = ["llama", "qwen2", "mistral", "mixtral", "qwen3"]


def _greedy(model, prompt, n, cached):
    """n greedy tokens after prompt [1, t]: through the KV cache, or a whole forward per token."""
    out = list(prompt[0])
    caches = model.new_kv_cache(1, prompt.shape[1] + n) if cached else None
    step = prompt
    for _ in range(n):
        if cached:
            logits = model.gather_logits(model.forward_cached(step, caches))
        else:
            logits = model.gather_logits(model.forward(np.array([out])))
        out.append(int(np.argmax(logits[0, -1])))
        step = np.array([[out[-1]]])
    return out


def _worker_tp_against_transformers(root, families=None):
    """At tp 2 (x dp 2) and tp 4 (2 KV heads: replicated), each family's HF directory gives the
    logits and the greedy tokens transformers gave, and save_hf writes it back from the shards
    (families: FAMILIES, or test_hf_gemma's)."""
    import os

    for tp in (2, 4):
        ctx = cutp.init(tp=tp, device="cpu")
        for family in families or FAMILIES:
            d = os.path.join(root, family)
            model = from_hf(ctx, os.path.join(d, "hf"), dtype="float32")
            ref = np.load(os.path.join(d, "logits.npy"))
            got = _logits(model, np.load(os.path.join(d, "idx.npy")))
            assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (family, tp, np.abs(got - ref).max())
            want = list(np.load(os.path.join(d, "greedy.npy"))[0])
            prompt = np.array([want[:6]])
            for cached in (True, False):
                assert _greedy(model, prompt, 32, cached) == want, (family, tp, cached)
            save_hf(model, os.path.join(d, f"cutp-tp{tp}"))
        ctx.close()


def test_tp2_and_tp4_logits_generation_and_export_equal_transformers(tmp_path):
    torch, transformers = _transformers()
    idx = np.random.default_rng(1).integers(0, 97, (2, 24))
    models = {}
    for family in FAMILIES:
        hf = models[family] = _hf_model(family, torch, transformers, torch.float32)
        d = tmp_path / family
        hf.save_pretrained(str(d / "hf"), safe_serialization=True)
        np.save(d / "idx.npy", idx)
        with torch.no_grad():
            np.save(d / "logits.npy", hf(torch.from_numpy(idx)).logits.numpy())
            np.save(d / "greedy.npy", hf.generate(torch.from_numpy(idx[:1, :6]), max_new_tokens=32, do_sample=False,
                                                  pad_token_id=0).numpy())
    run_mpi(4, "tests.models.test_hf_llama:_worker_tp_against_transformers", str(tmp_path), timeout=600)

    for family, hf in models.items():
        ref = np.load(tmp_path / family / "logits.npy")
        for tp in (2, 4):
            out = str(tmp_path / family / f"cutp-tp{tp}")
            again = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
            with torch.no_grad():
                got = again(torch.from_numpy(idx)).logits.numpy()
            assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max(), (family, tp)
            assert type(again) is type(hf), (family, tp, type(again).__name__)
            # the names save_pretrained writes
            assert _file_keys(tmp_path / family / f"cutp-tp{tp}") == _file_keys(tmp_path / family / "hf"), (family, tp)
