"""Qwen3-MoE and DeepSeek-V3 against transformers (issue 40): Qwen3MoeForCausalLM with 8 experts
of 16, top-2, norm_topk_prob, one dense layer (mlp_only_layers); DeepseekV3ForCausalLM with MLA
(rope_interleave, YaRN), 8 sigmoid-scored experts in 4 groups with a non-zero correction bias, a shared
expert and a dense first layer; their routers scaled up so that every decision is away from
ties. float32 logits within 1e-5 and greedy generation (32 tokens, with the KV cache, MLA's
holding the compressed latent and rope key per token, and without); float64 logits within 1e-12
and every gradient within 1e-10 (transformers' float32 casts lifted); export-hf loads back as the
same class under save_pretrained's names, at tp 1 and 2 (x dp 2), and at tp 4 the float32 logits,
the float64 logits, loss and every gradient. Skipped with the reason where torch
or transformers do not import (CI)."""
import json
import os

import numpy as np
import pytest

import cutp
from cutp.hf import from_hf, hf_state_dict, save_hf
from cutp.models import GPT, GPTConfig
from tests.models.test_hf_llama import (_file_keys, _greedy, _lift_float32_casts, _logits, _transformers,
                                        check_float64_against)
from tests.mpirun import run_mpi


def _hf_moe(family, torch, transformers, dtype):
    """A random Qwen3-MoE or DeepSeek-V3 model, its routers scaled up so that every decision is
    away from ties, norm weights off one, DeepSeek's correction bias non-zero."""
    common = dict(hidden_size=32, intermediate_size=24, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, vocab_size=97, max_position_embeddings=64, rms_norm_eps=1e-6,
                  num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1000.0,
                  attn_implementation="eager", experts_implementation="eager")
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=12, num_experts=8,
                                          mlp_only_layers=[1])
    else:  # MLA with the low-rank query, 4 groups of 2 experts with 2 kept, a shared expert, layer 0 dense
        # YaRN over 16 original positions (the 24-token inputs reach past them), mscale apart from mscale_all_dim
        yarn = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}
        cfg = transformers.DeepseekV3Config(**{k: v for k, v in common.items() if k != "rope_theta"},
                                            rope_parameters=yarn, num_key_value_heads=4, n_routed_experts=8, n_group=4,
                                            topk_group=2,
                                            first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8,
                                            qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                                            routed_scaling_factor=2.5, n_shared_experts=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm weights away from one, so that each counts
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # decisive routers
                p.mul_(20.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def _margins(hf, torch, ids) -> float:
    """The smallest gap between the 2nd and 3rd router probability over the tokens and layers."""
    gaps = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: gaps.append(out[0].softmax(-1).sort(-1).values))
             for n, m in hf.named_modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    return min(float((p[:, -2] - p[:, -3]).min()) for p in gaps)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_logits_generation_gradients_and_export_equal_transformers(family, tmp_path, monkeypatch):
    torch, transformers = _transformers()
    hf = _hf_moe(family, torch, transformers, torch.float32)
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    idx = np.random.default_rng(1).integers(0, 97, (2, 24))
    ids = torch.from_numpy(idx)
    if family == "qwen3_moe":
        assert _margins(hf, torch, ids) > 1e-4  # (away from ties)
    with torch.no_grad():
        ref = hf(ids).logits.numpy()
        want = hf.generate(ids[:1, :6], max_new_tokens=32, do_sample=False, pad_token_id=0).numpy()
    ctx = cutp.init(device="cpu")
    model = from_hf(ctx, str(tmp_path / "hf"), dtype="float32")
    cfg = model.config
    assert (cfg.family, cfg.n_experts, cfg.moe_top_k, cfg.moe_ffn, cfg.moe_dense_layers, cfg.moe_renormalize) == (
        family, 8, 2, 16, (1,) if family == "qwen3_moe" else (0,), True)
    got = _logits(model, idx)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(got - ref).max()
    for cached in (True, False):
        assert _greedy(model, idx[:1, :6], 32, cached) == list(want[0]), cached
    save_hf(model, str(tmp_path / "cutp"))
    np.save(tmp_path / "idx.npy", idx)
    np.save(tmp_path / "logits.npy", ref)
    np.save(tmp_path / "greedy.npy", want)
    ctx.close()

    # float64, transformers' float32 casts lifted: logits, loss and every gradient
    hf64 = _hf_moe(family, torch, transformers, torch.float64)
    hf64.save_pretrained(str(tmp_path / "hf64"), safe_serialization=True)
    _lift_float32_casts(monkeypatch, torch, hf64)
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    monkeypatch.setattr(m.DeepseekV3TopkRouter, "forward", _router_in_float64)
    ctx = cutp.init(device="cpu")
    model = from_hf(ctx, str(tmp_path / "hf64"), dtype="float64")
    check_float64_against(torch, hf64, model, idx, _fused)
    ctx.close()
    with torch.no_grad():  # (the gradients: check_float64_against's backward)
        logits = hf64(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
        np.save(tmp_path / "logits64.npy", logits.numpy())
        np.save(tmp_path / "loss64.npy", loss.numpy())
    np.savez(tmp_path / "grads64.npz", **{name: p.grad.numpy() for name, p in hf64.named_parameters()})

    # tp 2 x dp 2 and tp 4 in one launch
    run_mpi(4, "tests.models.test_hf_moe:_worker_tp", str(tmp_path), family, timeout=600)
    for out in ("cutp", "cutp-tp2", "cutp-tp4"):
        again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / out), dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
        with torch.no_grad():
            back = again(ids).logits.numpy()
        assert type(again) is type(hf), (out, type(again).__name__)
        assert np.abs(back - ref).max() <= 1e-6 * np.abs(ref).max(), out
        assert _file_keys(tmp_path / out) == _file_keys(tmp_path / "hf"), out


def _fused(tensors: dict, name: str) -> np.ndarray:
    """Module parameter `name` from the file's tensors: the same, or transformers 5's fused
    experts: gate_up_proj [E, 2F, h] = [gate; up] per expert, down_proj [E, h, F]."""
    if name in tensors:
        return tensors[name]
    prefix, _, what = name.rpartition(".")
    n = len({k for k in tensors if k.startswith(prefix + ".") and k.endswith(".down_proj.weight")})
    if what == "gate_up_proj":
        return np.stack([np.concatenate([tensors[f"{prefix}.{e}.{w}_proj.weight"] for w in ("gate", "up")])
                         for e in range(n)])
    assert what == "down_proj", name
    return np.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])


def _worker_tp(root, family):
    """tp 2 x dp 2 and tp 4: the float32 logits, the greedy tokens (cached and not) and export-hf
    from the shards; tp 4: the float64 logits (1e-12), loss (1e-12) and every gradient (1e-10) of
    transformers with its float32 casts lifted (the main process's)."""
    from cutp.tensor_parallel import gather_full, tp_grad_sync

    idx = np.load(os.path.join(root, "idx.npy"))
    for tp in (2, 4):
        ctx = cutp.init(tp=tp, device="cpu")
        model = from_hf(ctx, os.path.join(root, "hf"), dtype="float32")
        ref = np.load(os.path.join(root, "logits.npy"))
        got = _logits(model, idx)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (tp, np.abs(got - ref).max())
        want = list(np.load(os.path.join(root, "greedy.npy"))[0])
        for cached in (True, False):
            assert _greedy(model, np.array([want[:6]]), 32, cached) == want, (tp, cached)
        save_hf(model, os.path.join(root, f"cutp-tp{tp}"))
        if tp == 2:
            ctx.close()
            continue
        model = from_hf(ctx, os.path.join(root, "hf64"), dtype="float64")
        ref = np.load(os.path.join(root, "logits64.npy"))
        got = _logits(model, idx)
        assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max(), np.abs(got - ref).max()
        model.train()
        loss = model.forward(idx, model.targets_from_labels(idx))
        ref_loss = float(np.load(os.path.join(root, "loss64.npy")))
        assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss), (loss, ref_loss)
        model.backward(aux_dloss=0.0)  # (transformers adds no auxiliary loss without output_router_logits)
        tp_grad_sync(model.parameters(), ctx.tp)  # (as a step: replicated KV heads' and the experts' TP sums)
        full = {p.name: np.asarray(gather_full(ctx.tp, p.data * 0 if p.grad is None else p.grad, p.sharding))
                [:p.real_rows] for p in model.parameters()}
        grads = hf_state_dict(model.config, full)
        hf_grads = np.load(os.path.join(root, "grads64.npz"))
        assert len(hf_grads.files) > 20
        for name in hf_grads.files:
            g, rg = _fused(grads, name), hf_grads[name]
            assert np.abs(g - rg).max() <= 1e-10 * np.abs(rg).max(), (tp, name)
        ctx.close()


def test_qwen3_30b_a3b_preset_counts_transformers_parameters():
    torch, transformers = _transformers()
    hf = transformers.Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, tie_word_embeddings=False, norm_topk_prob=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert GPTConfig.preset("qwen3-30b-a3b").num_parameters() == sum(p.numel() for p in model.parameters())


# ---- DeepSeekMoE: transformers' DeepseekV3MoE block -------------------------------------------
def _router_in_float64(self, hidden_states):
    """DeepseekV3TopkRouter.forward without its float32 casts (transformers 5.25's code otherwise)."""
    import torch

    hidden_states = hidden_states.view(-1, self.hidden_dim)
    scores = torch.nn.functional.linear(hidden_states, self.weight).sigmoid()
    choice = scores + self.e_score_correction_bias
    group_scores = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(
        -1, self.num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return None, topk_weights * self.routed_scaling_factor, topk_indices


def test_deepseek_moe_block_equals_transformers_in_float64(monkeypatch):
    """Sigmoid scores, a non-zero correction bias, 4 groups of 4 with 2 kept, top-4 renormalised
    and scaled by 2.5, one shared expert: the output, the input gradient and every weight's
    gradient within 1e-12 of DeepseekV3MoE's (its router's float32 casts lifted)."""
    torch, transformers = _transformers()
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    hf_cfg = transformers.DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16,
                                           num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                           norm_topk_prob=True, n_shared_experts=1, experts_implementation="eager")
    torch.manual_seed(0)
    block = m.DeepseekV3MoE(hf_cfg).to(torch.float64)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        block.gate.e_score_correction_bias.normal_(0, 0.1)
    monkeypatch.setattr(m.DeepseekV3TopkRouter, "forward", _router_in_float64)
    from cutp.models import GPT

    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=16, block_size=8, dtype="float64", norm="rmsnorm",
                    positions="rope", mlp="swiglu", bias=False, n_experts=16, moe_top_k=4, moe_ffn=16,
                    moe_renormalize=True, moe_scoring="sigmoid", moe_n_group=4, moe_topk_group=2,
                    moe_routed_scaling=2.5, moe_score_bias=True, moe_shared_experts=1, moe_aux_loss_coeff=0.0)
    ctx = cutp.init(device="cpu")
    moe = GPT(ctx, cfg, seed=0).moe_layers[0]
    moe.router.data[...] = block.gate.weight.detach().numpy().T
    moe.score_bias.data[...] = block.gate.e_score_correction_bias.numpy()
    for e, ex in enumerate(moe.experts):
        ex.fc1.data[...] = block.experts.gate_up_proj[e].detach().numpy().T
        ex.fc2.data[...] = block.experts.down_proj[e].detach().numpy().T
    s = block.shared_experts
    moe.shared_experts.fc1.weight.data[...] = torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach().numpy().T
    moe.shared_experts.fc2.weight.data[...] = s.down_proj.weight.detach().numpy().T
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((2, 8, 32)), rng.standard_normal((2, 8, 32))
    xt = torch.from_numpy(x).requires_grad_(True)
    ref = block(xt)
    ref.backward(torch.from_numpy(dy))
    moe.train()
    y = moe.forward(x)
    dx = moe.backward(dy)
    assert np.abs(y - ref.detach().numpy()).max() <= 1e-12 * np.abs(y).max()
    assert np.abs(dx - xt.grad.numpy()).max() <= 1e-12 * np.abs(dx).max()
    pairs = [(moe.router.grad.T, block.gate.weight.grad),
             (np.stack([ex.fc1.grad.T for ex in moe.experts]), block.experts.gate_up_proj.grad),
             (np.stack([ex.fc2.grad.T for ex in moe.experts]), block.experts.down_proj.grad),
             (moe.shared_experts.fc1.weight.grad.T, torch.cat([s.gate_proj.weight.grad, s.up_proj.weight.grad])),
             (moe.shared_experts.fc2.weight.grad.T, s.down_proj.weight.grad)]
    for got, want in pairs:
        want = want.numpy()
        assert np.abs(got - want).max() <= 1e-10 * np.abs(want).max()
    ctx.close()


def test_deepseek_multi_token_prediction_layers_are_skipped_with_one_line(tmp_path, capfd):
    """A DeepSeek-V3 directory with the MTP layer's tensors (model.layers.{n_layer}.*) reads,
    without them, saying so once; the correction biases are written and read back."""
    from safetensors.numpy import load_file, save_file

    from cutp.models import GPT
    from tests.models.test_hf_llama import SPECS

    ctx = cutp.init(device="cpu")
    model = GPT(ctx, GPTConfig(**SPECS["deepseek_v3"]), seed=1).eval()
    for m in model.moe_layers:  # a trained correction bias: exported (e_score_correction_bias) and read back
        m.score_bias.data[...] = np.random.default_rng(2).standard_normal(m.score_bias.data.shape) * 0.1
    save_hf(model, str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    L = model.config.n_layer
    tensors.update({f"model.layers.{L}.eh_proj.weight": np.ones((32, 64), np.float64),
                    f"model.layers.{L}.mlp.experts.0.up_proj.weight": np.ones((16, 32), np.float64)})
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    back = from_hf(ctx, str(tmp_path), dtype="float64")
    idx = np.random.default_rng(0).integers(0, 97, (1, 8))
    np.testing.assert_array_equal(_logits(back, idx), _logits(model, idx))
    for m, b in zip(model.moe_layers, back.moe_layers):
        np.testing.assert_array_equal(b.score_bias.data, m.score_bias.data)
    said = [line for line in capfd.readouterr().err.splitlines() if "multi-token prediction" in line]
    assert len(said) == 1, said
    half = from_hf(ctx, str(tmp_path), dtype="bfloat16")  # the bias stays float32, as transformers keeps it
    for m, b in zip(model.moe_layers, half.moe_layers):
        assert b.score_bias.data.dtype == np.float32
        np.testing.assert_array_equal(b.score_bias.data, m.score_bias.data.astype(np.float32))
    ctx.close()


def test_deepseek_rope_columns_as_rope_interleave_says(tmp_path):
    """transformers' DeepseekV3 with rope_interleave false rotates q_b's and kv_a's rope columns as
    they are (rotate-half), true as interleaved pairs: cutp reads either as the config says (the
    float32 logits within 1e-5; read with the other layout they differ), and export writes the flag
    and the columns back as they were (the same bytes)."""
    from safetensors.numpy import load_file

    torch, transformers = _transformers()
    idx = np.random.default_rng(2).integers(0, 97, (1, 12))
    for interleave in (False, True):
        cfg = transformers.DeepseekV3Config(
            hidden_size=32, intermediate_size=24, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=97, max_position_embeddings=64,
            num_experts_per_tok=2, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
            tie_word_embeddings=False, rope_interleave=interleave, attn_implementation="eager")
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        src = tmp_path / f"hf-{interleave}"
        hf.save_pretrained(str(src), safe_serialization=True)
        with torch.no_grad():
            ref = hf(torch.from_numpy(idx)).logits.numpy()
        ctx = cutp.init(device="cpu")
        model = from_hf(ctx, str(src), dtype="float32")
        assert model.config.rope_interleave is interleave
        got = _logits(model, idx)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (interleave, np.abs(got - ref).max())
        save_hf(model, str(tmp_path / f"out-{interleave}"))
        ctx.close()
        assert json.loads((tmp_path / f"out-{interleave}" / "config.json").read_text())["rope_interleave"] is interleave
        before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / f"out-{interleave}" /
                                                                                    "model.safetensors"))
        for key in ("model.layers.0.self_attn.q_b_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):
            assert np.array_equal(before[key], after[key]), (interleave, key)
        # the other layout's reading is another model
        with cutp.init(device="cpu") as ctx:
            cfg_json = json.loads((src / "config.json").read_text())
            (src / "config.json").write_text(json.dumps(dict(cfg_json, rope_interleave=not interleave)))
            wrong = _logits(from_hf(ctx, str(src), dtype="float32"), idx)
        assert np.abs(wrong - ref).max() > 1e-4 * np.abs(ref).max(), interleave  # (ten times the tolerance)


def test_rope_interleave_is_refused_without_latent_attention():
    with pytest.raises(cutp.ConfigError, match=r"^rope_interleave=False is the layout of multi-head latent "
                                               r"attention's rope columns in a checkpoint, and this model has none"):
        GPTConfig.preset("llama-tiny", rope_interleave=False).validate(1)


def test_a_16_bit_deepseek_export_keeps_the_router_in_float32(tmp_path):
    """transformers keeps DeepSeek-V3's router weight and correction bias in float32
    (_keep_in_fp32_modules_strict); a bfloat16 export writes them so, the rest in bfloat16 (a bias
    rounded to 8 bits can change which experts a token gets)."""
    from safetensors import safe_open

    from tests.models.test_families import DEEPSEEK_V3

    with cutp.init(device="cpu") as ctx:
        model = GPT(ctx, GPTConfig(**DEEPSEEK_V3), seed=1)
        save_hf(model, str(tmp_path), dtype="bfloat16")
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        kinds = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
    router = {k for k in kinds if k.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))}
    assert router and {kinds[k] for k in router} == {"F32"}, kinds
    assert {v for k, v in kinds.items() if k not in router} == {"BF16"}
