"""Checkpoints of runs with frozen parameters (--freeze, LoRA): the whole model put back together,
merged, or the adapters alone in PEFT's format (`export-hf`, `export-hf --merge-lora`).

Such a checkpoint (`trainable_only` in meta.json) holds only what trained; the frozen base comes
from the run's init_from (a Hugging Face directory or a cutp checkpoint), or, without one, from
its seed's initial weights. `trained_model` builds that model on one process (TP 1), adds the
run's adapters and frozen groups (its train_args), and loads the checkpoint's tensors into it.

PEFT's adapter format (adapter_config.json + adapter_model.safetensors), which
`PeftModel.from_pretrained(base, DIR)` loads onto the Hugging Face model: each pair under the
name of the projection it adapts, lora_A.weight [r, in] and lora_B.weight [out, r] (torch's
[out, in] of cutp's [in, out] A and B):

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
    base_model.model.model.layers.{i}.self_attn.{q_a,q_b,kv_a,kv_b}_proj.lora_{A,B}.weight   (DeepSeek-V3's
        multi-head latent attention; kv_a_proj_with_mqa for kv_a, rope rows of q_b's and kv_a's B interleaved
        back as the base weights are)

PEFT has no format for adapters on MoE experts, nor for GPT-2's fused c_attn: those export
merged only (refused by name otherwise).
"""
from __future__ import annotations

import json
import os

import numpy as np
from mpi4py import MPI

from ..comm.context import init
from ..models import GPT
from ..models.families import family_of
from ..runtime.errors import ConfigError
from ..tensor_parallel.lora import LoraAdapter, LoraPair, spec_of
from .files import write_safetensors
from .load import model_with_base

HF_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
           # multi-head latent attention (DeepseekV3)
           "q_a": "self_attn.q_a_proj", "q_b": "self_attn.q_b_proj", "kv_a": "self_attn.kv_a_proj_with_mqa",
           "kv_b": "self_attn.kv_b_proj"}
PEFT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "deepseek_v3")  # HF's q_proj ... down_proj names


def trained_model(ckpt: str, meta: dict) -> GPT:
    """The run's model on this process alone (TP 1): its base (init_from, or the seed's weights),
    its adapters and frozen groups, the checkpoint's trainable tensors loaded."""
    return model_with_base(ckpt, meta, init(comm=MPI.COMM_SELF, tp=1, device="cpu"))


def lora_pairs(model) -> list[tuple[str, LoraPair]]:
    """(the base weight's name, pair) of every adapter of a model, in the model's order."""
    out = []
    for m in model.modules():
        for attr, weight in (("lora", "weight"), ("fc1_lora", "fc1"), ("fc2_lora", "fc2"), ("q_a_lora", "q_a"),
                             ("kv_a_lora", "kv_a")):
            adapter = getattr(m, attr, None)
            if isinstance(adapter, LoraAdapter):
                out += [(getattr(m, weight).name, pair) for pair in adapter.pairs]
    return out


def full_tensors(model, merge: bool) -> dict:
    """{cutp name: full array} of a TP-1 model's base; with `merge` each pair folded into its
    base weight's columns: W[:, cols] += (alpha / r) A @ B (in float64, then W's dtype)."""
    full = model.gather_state_dict(rank=0)
    pairs = lora_pairs(model)
    out = {k: v for k, v in full.items() if ".lora_A." not in k and ".lora_B." not in k}
    if merge:
        for name, pair in pairs:
            w = out[name]
            delta = pair.scale * (np.asarray(pair.A.data, np.float64) @ np.asarray(pair.B.data, np.float64))
            w[:, pair.out] = (w[:, pair.out].astype(np.float64) + delta).astype(w.dtype)
    return out


def write_peft_adapter(model, meta: dict, family: str, path: str, base_path: str) -> None:
    """adapter_config.json and adapter_model.safetensors of the model's adapters in `path`."""
    pairs = lora_pairs(model)
    experts = sorted({name for name, pair in pairs if pair.kind == "expert"})
    if experts:
        raise ConfigError(f"the run has LoRA adapters on MoE experts ({experts[0]}, ...), which PEFT's adapter format "
                          "cannot hold: export them merged with export-hf --merge-lora")
    if family not in PEFT_FAMILIES:
        raise ConfigError(f"PEFT names the adapters of a {family} model's fused projections otherwise than cutp's "
                          "q, k, v, o, gate, up, down: export the run merged with export-hf --merge-lora")
    spec = spec_of(meta.get("train_args") or {})
    # (DeepSeek's rope columns: cutp's column j of a base is the file's columns[j], so are B's rows)
    columns = {r.name: r.columns for r in family_of(model.config).recipes(model.config) if r.columns is not None}
    tensors, targets = {}, []
    for name, pair in pairs:
        layer = name.split(".")[1]
        prefix = f"base_model.model.model.layers.{layer}.{HF_PROJ[pair.proj]}"
        b = np.asarray(pair.B.data).T
        if name in columns:
            b = np.empty_like(b)
            b[np.asarray(columns[name])] = np.asarray(pair.B.data).T
        tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(np.asarray(pair.A.data).T)
        tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(b)
        targets.append(HF_PROJ[pair.proj].split(".")[1])
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "lora_dropout": spec.dropout, "target_modules": sorted(set(targets)), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
              "alpha_pattern": {}, "base_model_name_or_path": base_path}
    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors, {"format": "pt"})
