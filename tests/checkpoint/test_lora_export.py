"""Exporting a LoRA run (issue 38; cutp.checkpoint.adapters): `export-hf` writes the frozen base
model and the adapters in PEFT's format, `export-hf --merge-lora` the merged weights.

Without torch: a float64 llama-tiny LoRA run fine-tuned from a Hugging Face directory exports
its base bit for bit, the adapters under PEFT's names and shapes, and merged weights that equal
W + (alpha / r) B A per projection (a NumPy transcription) and give the trained model's logits;
adapters on MoE experts export merged only. Against peft + transformers (skipped with the reason
without them): a PEFT LoraModel holding the same A and B gives cutp's float64 logits and adapter
gradients within 1e-12, and the exported adapter loads with PeftModel.from_pretrained to the same
logits.
"""
import json
import os

import numpy as np
import pytest
from mpi4py import MPI
from safetensors.numpy import load_file

import cutp
from cutp.bench.model import random_tokens
from cutp.checkpoint.adapters import lora_pairs, trained_model, write_peft_adapter
from cutp.checkpoint.export_hf import export_hf, main
from cutp.checkpoint import load_model
from cutp.checkpoint.files import read_meta
from cutp.hf import from_hf, save_hf
from cutp.models.hf import config_from_hf
from cutp.models.hf_files import read_hf_config
from cutp.models import GPT, GPTConfig
from cutp.runtime.errors import ConfigError
from cutp.tensor_parallel.lora import LoraSpec, apply_lora
from cutp.train import RunConfig, build_run, train_step
from cutp.train.step import save
from cutp.models.families import family_of
from tests.models.test_hf_llama import SPECS, _hf_model, _lift_float32_casts, _transformers
from tests.models.test_hf_moe import _hf_moe, _router_in_float64

SPEC = dict(SPECS["llama"], rope_scaling="none")
HF_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def _lora_run(tmp_path, spec=SPEC, **kw):
    """A base written as a Hugging Face directory, two LoRA steps from it, the checkpoint."""
    ctx = cutp.init(comm=MPI.COMM_SELF, device="cpu")
    save_hf(GPT(ctx, GPTConfig(**spec), seed=7), str(tmp_path / "base"))
    ctx.close()
    model = config_from_hf(read_hf_config(str(tmp_path / "base")), dtype="float64")  # (the directory's config)
    cfg = RunConfig(model=model, init_from=str(tmp_path / "base"), batch_size=2,
                    micro_batch_size=2, seq_len=16, steps=2, warmup=1, lr=3e-2, seed=3, eval_every=0, quiet=True,
                    save_on_signal=False, out=str(tmp_path / "run"), lora_rank=4, lora_alpha=8.0, **kw)
    run = build_run(cfg, MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
    for _ in range(2):
        train_step(run)
    path = save(run)
    run.close()
    return path


def test_export_writes_the_base_the_peft_adapter_and_the_merged_weights(tmp_path):
    ckpt = _lora_run(tmp_path)
    export_hf(ckpt, str(tmp_path / "hf"))
    assert main([ckpt, "--out", str(tmp_path / "merged"), "--merge-lora"]) == 0
    base, merged = load_file(str(tmp_path / "base" / "model.safetensors")), load_file(
        str(tmp_path / "merged" / "model.safetensors"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(base) and all(np.array_equal(exported[k], base[k]) for k in base)
    adapter = load_file(str(tmp_path / "hf" / "adapter" / "adapter_model.safetensors"))
    config = json.load(open(tmp_path / "hf" / "adapter" / "adapter_config.json"))
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(p.split(".")[1] for p in HF_PROJ.values())
    assert len(adapter) == SPEC["n_layer"] * 7 * 2
    for layer in range(SPEC["n_layer"]):
        for proj in HF_PROJ.values():
            name = f"model.layers.{layer}.{proj}.weight"
            a = adapter[f"base_model.model.{name[:-len('.weight')]}.lora_A.weight"]
            b = adapter[f"base_model.model.{name[:-len('.weight')]}.lora_B.weight"]
            assert a.shape == (4, base[name].shape[1]) and b.shape == (base[name].shape[0], 4)
            assert np.abs(b).max() > 0  # (trained away from PEFT's zero start)
            np.testing.assert_allclose(merged[name], base[name] + 2.0 * b @ a, rtol=0, atol=1e-13)
    untouched = [k for k in base if not any(p in k for p in HF_PROJ.values())]
    assert untouched and all(np.array_equal(merged[k], base[k]) for k in untouched)
    # the merged directory is the trained model
    model = trained_model(ckpt, read_meta(ckpt))
    ctx = cutp.init(comm=MPI.COMM_SELF, device="cpu")
    again = from_hf(ctx, str(tmp_path / "merged"), dtype="float64")
    idx = np.random.default_rng(1).integers(0, 97, (2, 16))
    want = model.gather_logits(model.forward(idx))
    assert np.abs(again.gather_logits(again.forward(idx)) - want).max() <= 1e-12 * np.abs(want).max()
    loaded, _ = load_model(ckpt, ctx)  # (the library's loader: the base from init_from, the adapters from the run)
    assert np.array_equal(loaded.gather_logits(loaded.forward(idx)), want)
    ctx.close()
    _peft_loads_the_adapter(str(tmp_path / "hf"), want, idx)


def _peft_loads_the_adapter(hf_dir, want, idx):
    torch, transformers = _transformers()
    peft = pytest.importorskip("peft", reason="peft not installed: the adapter's files were checked above")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float64,
                                                             attn_implementation="eager").eval()
    model = peft.PeftModel.from_pretrained(base, os.path.join(hf_dir, "adapter")).eval()
    with torch.no_grad():
        got = model(torch.from_numpy(idx)).logits.numpy()
    # (transformers rounds norms and rotary tables to float32 inside a float64 model: 1e-6 here,
    # the float64 comparison without those casts below)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_adapters_on_moe_experts_export_merged_only(tmp_path):
    moe = dict(SPECS["mixtral"], rope_scaling="none")
    ckpt = _lora_run(tmp_path, moe, lora_targets="q,down")
    with pytest.raises(ConfigError, match="adapters on MoE experts.*merged with export-hf --merge-lora"):
        export_hf(ckpt, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


# DeepSeek-V3: multi-head latent attention's projections (the low-rank query; rope columns
# interleaved in the file), PEFT's names q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj
MLA_PROJ = {"q_a": "self_attn.q_a_proj", "q_b": "self_attn.q_b_proj", "kv_a": "self_attn.kv_a_proj_with_mqa",
            "kv_b": "self_attn.kv_b_proj", "o": "self_attn.o_proj"}


def test_deepseek_adapters_write_b_rows_in_the_files_interleaved_rope_order(tmp_path):
    """(Without torch: the rows PEFT's comparison below checks.) The rope rows of q_b's and kv_a's
    B are written in the file's order, the others as cutp holds them."""
    ctx = cutp.init(comm=MPI.COMM_SELF, device="cpu")
    model = GPT(ctx, GPTConfig(**dict(SPECS["deepseek_v3"], dtype="float64")), seed=1)
    save_hf(model, str(tmp_path / "base"))
    apply_lora(model, LoraSpec(4, 8.0, targets=tuple(MLA_PROJ)))
    rng = np.random.default_rng(0)
    for p in model.parameters():
        if p.trainable:
            p.data[...] = rng.standard_normal(p.data.shape)
    write_peft_adapter(model, {"train_args": {"lora_rank": 4, "lora_alpha": 8.0}}, "deepseek_v3",
                       str(tmp_path / "adapter"), str(tmp_path / "base"))
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    columns = {r.name: r.columns for r in family_of(model.config).recipes(model.config) if r.columns is not None}
    permuted = 0
    for base_name, pair in lora_pairs(model):
        prefix = f"base_model.model.model.layers.{base_name.split('.')[1]}.{MLA_PROJ[pair.proj]}"
        b = saved[prefix + ".lora_B.weight"]
        np.testing.assert_array_equal(saved[prefix + ".lora_A.weight"], pair.A.data.T)
        if base_name in columns:
            np.testing.assert_array_equal(b[np.asarray(columns[base_name])], pair.B.data.T)
            permuted += not np.array_equal(b, pair.B.data.T)
        else:
            np.testing.assert_array_equal(b, pair.B.data.T)
    assert permuted == len(columns) > 0
    ctx.close()


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_peft_lora_model_equals_cutp_in_float64(family, tmp_path, monkeypatch):
    torch, transformers = _transformers()
    peft = pytest.importorskip("peft", reason="peft not installed: the comparison with PEFT's LoraModel needs it")
    if family == "llama":
        hf, projections = _hf_model("llama", torch, transformers, torch.float64), HF_PROJ
    else:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        hf, projections = _hf_moe(family, torch, transformers, torch.float64), MLA_PROJ
        monkeypatch.setattr(m.DeepseekV3TopkRouter, "forward", _router_in_float64)
    hf.save_pretrained(str(tmp_path / "base"), safe_serialization=True)
    _lift_float32_casts(monkeypatch, torch, hf)
    ctx = cutp.init(comm=MPI.COMM_SELF, device="cpu")
    model = from_hf(ctx, str(tmp_path / "base"), dtype="float64")
    apply_lora(model, LoraSpec(4, 8.0, targets=tuple(projections)))
    rng = np.random.default_rng(0)
    for p in model.parameters():
        if p.trainable:
            p.data[...] = 0.3 * rng.standard_normal(p.data.shape)
    write_peft_adapter(model, {"train_args": {"lora_rank": 4, "lora_alpha": 8.0}}, family, str(tmp_path / "adapter"),
                       str(tmp_path / "base"))
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=sorted(
        p.split(".")[1] for p in projections.values())))
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.from_numpy(saved[name.replace(".default", "")]))
    idx = np.random.default_rng(2).integers(0, 97, (2, 24))
    ids = torch.from_numpy(idx)
    logits = lora(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    loss.backward()
    ref = logits.detach().numpy()
    got = model.gather_logits(model.forward(idx))
    assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max(), np.abs(got - ref).max()
    model.train()
    assert abs(model.forward(idx, model.targets_from_labels(idx)) - loss.item()) <= 1e-12 * loss.item()
    model.backward()
    grads = dict(lora.named_parameters())
    columns = {r.name: r.columns for r in family_of(model.config).recipes(model.config) if r.columns is not None}
    for base_name, pair in lora_pairs(model):
        prefix = f"base_model.model.model.layers.{base_name.split('.')[1]}.{projections[pair.proj]}"
        mine_b = pair.B.grad.T.copy()
        if base_name in columns:  # (DeepSeek's rope rows: the file's interleaved order)
            mine_b[np.asarray(columns[base_name])] = pair.B.grad.T
        for mine, theirs in ((pair.A.grad.T, grads[prefix + ".lora_A.default.weight"].grad.numpy()),
                             (mine_b, grads[prefix + ".lora_B.default.weight"].grad.numpy())):
            assert np.abs(mine - theirs).max() <= 1e-12 * np.abs(theirs).max(), prefix
    ctx.close()
    if family != "llama":  # (PEFT's model above already held the saved file's A and B)
        return
    # the adapter as saved loads onto the base with PeftModel.from_pretrained: the same logits
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), torch_dtype=torch.float64,
                                                              attn_implementation="eager").eval()
    _lift_float32_casts(monkeypatch, torch, fresh)  # (its rotary tables in float64 too)
    loaded = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        again = loaded(ids).logits.numpy()
    assert np.abs(again - ref).max() <= 1e-12 * np.abs(ref).max()

