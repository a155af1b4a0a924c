"""What a model family declares: its Hugging Face names, its config mapping both ways, its tensor
recipes both ways, its presets. `cutp.models.hf` reads and writes every family's directories
with these declarations alone (shared code, written once); `cutp.models.families` keeps the
registry.

A family module subclasses `Family` and registers one instance:

    class Qwen2(LlamaLike):
        name = "qwen2"                       # the model_type it writes (and reads)
        architecture = "Qwen2ForCausalLM"
        presets = {"qwen2-0.5b": dict(...)}
        def config_from_hf(self, hf, where): ...   # ModelConfig fields; refusals name the field
        def config_to_hf(self, cfg): ...           # config.json as transformers writes it
        def recipes(self, cfg): ...                # [Recipe(cutp name, HF keys, how, HF shapes)]
    register(Qwen2())
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ops.rotary import RopeScaling
from ...runtime.errors import ConfigError
from ..blocks import Blocks
from ..hf_files import HFFormatError

# How a cutp tensor is made from its HF tensors (HF's Linear weights are [out, in], cutp's [in, out]):
SAME = "same"  # one HF tensor, as it is
TRANSPOSED = "T"  # one HF [out, in] weight, transposed
CONCAT_WEIGHTS = "cat"  # several HF [out, in] weights transposed and side by side: [q | k | v], [gate | up]
CONCAT_BIASES = "catb"  # several HF biases one after the other


# ModelConfig fields of Gemma's block that no other family computes (`Family.pieces_refusal`)
GEMMA_PIECES = ("norm_offset", "embed_scale", "post_norms", "query_pre_attn_scalar", "rope_local_theta",
                "final_softcap")


@dataclass(frozen=True)
class Recipe:
    """One cutp parameter (its full, unpadded tensor) and the HF tensors it is made of."""

    name: str  # cutp's name (cutp.models.names)
    keys: tuple  # the HF keys, in the order `how` joins them
    how: str  # SAME, TRANSPOSED, CONCAT_WEIGHTS or CONCAT_BIASES
    shapes: tuple  # each key's shape in the HF file
    columns: tuple | None = None  # cutp's column j is the joined tensor's columns[j] (DeepSeek's interleaved rope)

    @property
    def full_shape(self) -> tuple:
        """cutp's full tensor's shape."""
        if self.how == SAME:
            return tuple(self.shapes[0])
        if self.how == TRANSPOSED:
            return tuple(reversed(self.shapes[0]))
        if self.how == CONCAT_WEIGHTS:
            return (self.shapes[0][1], sum(s[0] for s in self.shapes))
        return (sum(s[0] for s in self.shapes),)

    def combine(self, arrays: list) -> np.ndarray:
        """The HF arrays (in `keys` order) -> cutp's full array."""
        if self.columns is not None:
            joined = Recipe(self.name, self.keys, self.how, self.shapes).combine(arrays)
            return np.ascontiguousarray(joined[:, self.columns])
        if self.how == SAME:
            return arrays[0]
        if self.how == TRANSPOSED:
            return arrays[0].T
        if self.how == CONCAT_WEIGHTS:
            return np.concatenate([a.T for a in arrays], axis=1)
        return np.concatenate(arrays)

    def split(self, full: np.ndarray) -> dict:
        """cutp's full array -> {HF key: array} (the inverse of `combine`)."""
        if self.columns is not None:
            return Recipe(self.name, self.keys, self.how, self.shapes).split(full[:, np.argsort(self.columns)])
        if self.how in (SAME, TRANSPOSED):
            return {self.keys[0]: np.ascontiguousarray(full.T if self.how == TRANSPOSED else full)}
        parts = np.split(full, np.cumsum([s[0] for s in self.shapes])[:-1], axis=full.ndim - 1)
        return {k: np.ascontiguousarray(a.T if self.how == CONCAT_WEIGHTS else a) for k, a in zip(self.keys, parts)}


class Family(Blocks):
    """A model family's declarations (subclassed once per family, registered by
    `cutp.models.families.register`), and its blocks' submodules (`Blocks`: the choice from the
    config's fields, which a family with a new piece overrides in its module)."""

    name: str = ""  # the HF model_type written; also what ModelConfig.family holds
    model_types: tuple = ()  # the HF model_types read (default: (name,))
    architecture: str = ""  # config.json's architectures[0]
    presets: dict = {}  # --preset name -> ModelConfig fields
    embedding_key: str = ""  # the HF key of the token embedding (a tied head saved anyway must equal it)
    head_key: str = "lm_head.weight"
    dtype_key: str = "torch_dtype"  # config.json's dtype field, as the family's transformers config writes it
    # HF keys (by suffix) written in float32 when the rest is saved in 16 bits: the modules the family's
    # transformers model keeps in float32 (its _keep_in_fp32_modules_strict)
    keep_in_float32: tuple = ()
    # the pieces of the block beyond Llama's and GPT-2's (`GEMMA_PIECES`) this family computes
    pieces: tuple = ()
    # ModelConfig fields an `init_from` directory must agree on with the model it loads into
    spec_fields: tuple = ("n_layer", "n_head", "kv_heads", "n_embd", "hidden", "head_size", "vocab_size",
                          "block_size", "tie_embeddings", "norm_eps", "norm", "positions", "mlp")

    def reads(self) -> tuple:
        return self.model_types or (self.name,)

    # ---- configuration ---------------------------------------------------------------------------
    def config_from_hf(self, hf: dict, where: str) -> dict:
        """ModelConfig fields (all but dtype and dropout) from a config.json dict; HFFormatError
        naming the field for what cutp cannot compute."""
        raise NotImplementedError

    def config_to_hf(self, cfg) -> dict:
        """config.json (as this family's transformers config writes it) for `cfg`; call
        `refusal(cfg)` first."""
        raise NotImplementedError

    def refusal(self, cfg) -> str | None:
        """Why this family cannot express `cfg` (None: it can)."""
        raise NotImplementedError

    def pieces_refusal(self, cfg) -> str | None:
        """Why this family cannot compute cfg's Gemma pieces (None: it computes those cfg uses)."""
        used = [f for f in GEMMA_PIECES if f not in self.pieces and getattr(cfg, f) not in (None, False)]
        if used:
            return (f"{self.architecture} has no {', '.join(used)} (Gemma's: a model with them is written as "
                    "Gemma2ForCausalLM or Gemma3ForCausalLM)")
        return None

    # ---- tensors -----------------------------------------------------------------------------
    def recipes(self, cfg) -> list:
        """[Recipe] for every parameter of the model `cfg` describes."""
        raise NotImplementedError

    def key_of(self, file_key: str) -> str | None:
        """The key `recipes` use for a key found in a file; None: not a parameter, skipped (buffers
        old converters saved)."""
        return file_key

    def reading(self, cfg) -> None:
        """A directory of config `cfg` is about to be read (its keys next go through `key_of`)."""

    def file_key(self, key: str) -> str:
        """The key written for a recipe's key (what save_pretrained writes)."""
        return key

    # ---- tokens ------------------------------------------------------------------------------
    @staticmethod
    def special_tokens(hf: dict) -> dict:
        """bos/eos/pad ids of config.json (ModelConfig's token fields)."""
        return {k: hf.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


# ---- helpers the families share ---------------------------------------------------------------
def require(hf: dict, fields, family: str, where: str) -> None:
    missing = [k for k in fields if k not in hf]
    if missing:
        raise HFFormatError(f"{where}: required {family} fields {missing} are missing")


def refuse_unless(hf: dict, field: str, allowed, why: str, where: str, default=None) -> None:
    """HFFormatError naming `field` when config.json sets it to something outside `allowed`."""
    value = hf.get(field, default)
    if value not in allowed:
        raise HFFormatError(f"{where}: {field}={value!r} is not supported ({why})")


def rope_from_hf(hf: dict, where: str) -> dict:
    """ModelConfig's rope fields from config.json: top-level rope_theta / rope_scaling (transformers
    4.x, the Hub's Llama 3.x files) or rope_parameters (transformers 5)."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling")
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    try:
        sc = RopeScaling.from_hf(scaling)
    except ConfigError as e:
        raise HFFormatError(f"{where}: {e}") from None
    out = dict(rope_theta=float(theta), rope_scaling=sc.rope_type, rope_factor=sc.factor,
               rope_low_freq_factor=sc.low_freq_factor, rope_high_freq_factor=sc.high_freq_factor,
               rope_original_max_positions=sc.original_max_position_embeddings)
    if sc.rope_type == "yarn":
        out.update(rope_beta_fast=sc.beta_fast, rope_beta_slow=sc.beta_slow, rope_mscale=sc.mscale,
                   rope_mscale_all_dim=sc.mscale_all_dim)
    return out


def rope_to_hf(cfg) -> dict | None:
    """config.json's rope_scaling for cfg's (None: no scaling)."""
    if cfg.rope_scaling == "none":
        return None
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.rope_scaling == "yarn":
        return {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.rope_beta_fast,
                "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim,
                "original_max_position_embeddings": cfg.rope_original_max_positions}
    return {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions}
