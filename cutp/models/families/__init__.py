"""The model families cutp builds, one module each, in a registry keyed by Hugging Face model_type.

    gpt2     GPT2LMHeadModel (and cutp's tiny presets)
    llama    LlamaForCausalLM (Llama 2/3/3.1/3.2, TinyLlama)
    qwen2    Qwen2ForCausalLM
    qwen3    Qwen3ForCausalLM (QK-norm)
    gemma2   Gemma2ForCausalLM
    gemma3_text  Gemma3ForCausalLM (text)
    qwen3_moe  Qwen3MoeForCausalLM (QK-norm, many narrow experts)
    deepseek_v3  DeepseekV3ForCausalLM (multi-head latent attention, DeepSeekMoE)
    mistral  MistralForCausalLM
    mixtral  MixtralForCausalLM

A family module declares its HF names, its config mapping both ways, its tensor recipes both ways,
its presets and the submodules of its block (`base.Family`, a `cutp.models.blocks.Blocks`); `cutp.models.hf` reads and writes every family's directories
from those declarations. Adding a family: docs/extending.md.
"""
from __future__ import annotations

from ..blocks import CHOOSERS
from ..config import FAMILY_NAMES, PRESETS
from ..hf_files import HFFormatError
from .base import Family, Recipe
from .gemma2 import Gemma2
from .gemma3 import Gemma3
from .deepseek_v3 import DeepseekV3
from .gpt2 import GPT2
from .llama import Llama
from .mistral import Mistral
from .mixtral import Mixtral
from .qwen2 import Qwen2
from .qwen3 import Qwen3
from .qwen3_moe import Qwen3Moe

FAMILIES: dict[str, Family] = {}  # family name -> its declarations
_BY_MODEL_TYPE: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds a family: its model_types to the HF registry, its presets to `--preset`'s."""
    for mt in family.reads():
        if mt in _BY_MODEL_TYPE:
            raise ValueError(f"model_type {mt!r} is read by {_BY_MODEL_TYPE[mt].name} already")
    clash = sorted(set(family.presets) & set(PRESETS))
    if clash:
        raise ValueError(f"presets {clash} of {family.name} exist already")
    FAMILIES[family.name] = family
    _BY_MODEL_TYPE.update({mt: family for mt in family.reads()})
    PRESETS.update(family.presets)
    FAMILY_NAMES.add(family.name)
    CHOOSERS[family.name] = family
    return family


for _family in (GPT2(), Llama(), Qwen2(), Qwen3(), Mistral(), Mixtral(), Gemma2(), Gemma3(), Qwen3Moe(),
                DeepseekV3()):
    register(_family)


def model_types() -> list:
    return sorted(_BY_MODEL_TYPE)


def family_for_hf(hf: dict, where: str = "config.json") -> Family:
    """The family that reads a config.json (by its model_type; GPT-2's files of old have none)."""
    mt = hf.get("model_type", "gpt2")
    if mt not in _BY_MODEL_TYPE:
        archs = ", ".join(f.architecture for f in FAMILIES.values())
        raise HFFormatError(f"{where}: model_type is {mt!r}; cutp reads {model_types()} ({archs})")
    return _BY_MODEL_TYPE[mt]


def family_of(cfg) -> Family:
    """The family that computes cfg's function: cfg.family when set, else the one its spec implies
    (hand-built configs, checkpoints from before the field). HFFormatError when none can express
    it (naming why), so an export is refused before anything is written."""
    if cfg.family is not None:
        family = FAMILIES.get(cfg.family)
        if family is None:
            raise HFFormatError(f"family {cfg.family!r} is not one of cutp's families {sorted(FAMILIES)}")
    else:
        implied = [f for f in FAMILIES.values() if f.implies(cfg)]
        if not implied:
            raise HFFormatError(f"norm={cfg.norm}, positions={cfg.positions}, mlp={cfg.mlp}: no Hugging Face family "
                                "computes this model (GPT-2 is layernorm/learned/gelu, the Llama family "
                                "rmsnorm/rope/swiglu)")
        family = implied[0]
    why = family.refusal(cfg) or family.pieces_refusal(cfg)
    if why:
        raise HFFormatError(why)
    return family


def export_refusal(cfg) -> str | None:
    """Why `family_of(cfg)` would refuse cfg (an export-hf of the run would), None when it would not."""
    try:
        family_of(cfg)
    except HFFormatError as e:
        return str(e)
    return None


__all__ = ["FAMILIES", "Family", "Recipe", "export_refusal", "family_for_hf", "family_of", "model_types", "register"]
