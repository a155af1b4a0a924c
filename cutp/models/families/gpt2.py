"""GPT-2 (`GPT2LMHeadModel`): LayerNorm, learned positions, a GeLU MLP, biases everywhere, tied
embeddings. cutp's defaults are GPT-2's, and so are its tensor layouts (Conv1D weights are
[in, out]; `h.{i}.attn.c_attn.weight` [n_embd, 3*n_embd] with columns [q | k | v], heads in
order): a GPT-2 file's tensors load as they are, under GPT-2's names (`names.to_gpt2`), with
the `transformer.` prefix that `GPT2LMHeadModel` adds (a `GPT2Model` checkpoint, such as the
original `gpt2` upload, has none: both are read). The non-parameter buffers of old checkpoints
(`h.N.attn.bias`, `h.N.attn.masked_bias`) are skipped; `lm_head.weight` is tied to `wte.weight`:
save_pretrained leaves it out, and so does cutp unless the embeddings are untied.

Configuration: n_layer, n_head, n_embd, n_positions -> block_size, vocab_size,
layer_norm_epsilon -> norm_eps, n_inner -> mlp_hidden (None: 4*n_embd), activation_function
("gelu_new" / "gelu_pytorch_tanh" -> gelu "tanh", "gelu" -> "none", exact erf),
tie_word_embeddings. HF's three dropout probabilities are training settings: loading sets cutp's
single `dropout` from the caller, saving writes cutp's into all three. Refused by name:
scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn, scale_attn_weights=False,
add_cross_attention, another activation.
"""
from __future__ import annotations

import re

from ..hf_files import HFFormatError
from ..names import to_gpt2
from .base import SAME, Family, Recipe, require

_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
# (field, the value cutp computes, why): anything else cannot be represented
_REFUSED = (
    ("scale_attn_by_inverse_layer_idx", False, "cutp scales attention scores by 1/sqrt(head_dim) only"),
    ("reorder_and_upcast_attn", False, "cutp has no reordered/upcast attention path"),
    ("scale_attn_weights", True, "cutp always scales attention scores by 1/sqrt(head_dim)"),
    ("add_cross_attention", False, "cutp's GPT is decoder-only, without cross-attention"),
)
_PREFIX = "transformer."


class GPT2(Family):
    name = "gpt2"
    architecture = "GPT2LMHeadModel"
    embedding_key = "wte.weight"
    dtype_key = "dtype"
    spec_fields = ("n_layer", "n_head", "kv_heads", "n_embd", "hidden", "vocab_size", "block_size", "bias",
                   "tie_embeddings", "norm_eps", "gelu")
    presets = {
        # trains on a 2-core CPU in minutes (byte-level vocabulary)
        "tiny": dict(n_layer=4, n_head=8, n_embd=128, vocab_size=256, block_size=128, vocab_multiple=1),
        # tiny with 8 experts of width 256 in every layer, 2 per token: tiny's active parameters
        # (cutp's own MoE on GPT-2's block: no Hugging Face class computes it)
        "tiny-moe": dict(n_layer=4, n_head=8, n_embd=128, vocab_size=256, block_size=128, vocab_multiple=1,
                         n_experts=8, moe_top_k=2, moe_ffn=256),
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
        "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
        "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
        "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
        # GPT-3 175B's shape (Brown et al. 2020; the planner's --params 175B)
        "gpt3-175b": dict(n_layer=96, n_head=96, n_embd=12288, block_size=2048),
    }

    def implies(self, cfg) -> bool:
        return (cfg.norm, cfg.positions, cfg.mlp) == ("layernorm", "learned", "gelu")

    def config_from_hf(self, hf: dict, where: str) -> dict:
        for field, ours, why in _REFUSED:
            if field in hf and hf[field] is not None and bool(hf[field]) != ours:
                raise HFFormatError(f"{where}: {field}={hf[field]!r} is not supported ({why}); "
                                    f"only {field}={ours} models can be loaded")
        act = hf.get("activation_function", "gelu_new")
        if act not in _ACTIVATIONS:
            raise HFFormatError(f"{where}: activation_function {act!r} is not supported; cutp computes "
                                f"{sorted(_ACTIVATIONS)} (tanh-approximate GeLU or exact erf GeLU)")
        require(hf, ("n_layer", "n_head", "n_embd", "vocab_size"), "GPT-2", where)
        block = hf.get("n_positions", hf.get("n_ctx"))
        if block is None:
            raise HFFormatError(f"{where}: n_positions is missing")
        return dict(n_layer=hf["n_layer"], n_head=hf["n_head"], n_kv_head=None, n_embd=hf["n_embd"],
                    mlp_hidden=hf.get("n_inner"), vocab_size=hf["vocab_size"], block_size=block, bias=True,
                    tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                    norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), gelu=_ACTIVATIONS[act])

    def refusal(self, cfg) -> str | None:
        if cfg.sliding_window is not None or cfg.attn_softcap is not None:
            return (f"sliding_window={cfg.sliding_window}, attn_softcap={cfg.attn_softcap}: GPT-2's attention is "
                    "global and uncapped")
        if not self.implies(cfg):
            return (f"norm={cfg.norm}, positions={cfg.positions}, mlp={cfg.mlp}: GPT-2 is layernorm, learned "
                    "positions and a GeLU MLP")
        if cfg.kv_heads != cfg.n_head:
            return (f"a grouped-query attention model (n_kv_head={cfg.n_kv_head} != n_head={cfg.n_head}) cannot be "
                    "exported as GPT-2, whose attention has one K/V head per query head")
        if cfg.n_experts:
            return (f"a mixture-of-experts model (n_experts={cfg.n_experts}) cannot be exported as GPT-2, whose MLPs "
                    "are dense; keep its cutp checkpoint (examples/generate.py reads it)")
        if not cfg.bias or not all(cfg._bias(f) for f in ("qkv_bias", "attn_out_bias", "mlp_bias")):
            return ("a model without biases (bias=False) cannot be exported as GPT-2, which has biases in every "
                    "linear layer and LayerNorm")
        if cfg.head_size * cfg.n_head != cfg.n_embd:
            return f"GPT-2's config has no head_dim: head_dim={cfg.head_size} must be n_embd / n_head"
        if cfg.gelu not in ("tanh", "none"):
            return f"gelu={cfg.gelu!r} has no GPT-2 activation_function"
        return None

    def config_to_hf(self, cfg) -> dict:
        # GPT-2's <|endoftext|> when the vocabulary has it, else the last id (as before the token fields)
        special = 50256 if cfg.vocab_size > 50256 else cfg.vocab_size - 1
        bos = special if cfg.bos_token_id is None else cfg.bos_token_id
        eos = special if cfg.eos_token_id is None else cfg.eos_token_id
        return {
            "activation_function": {"tanh": "gelu_new", "none": "gelu"}[cfg.gelu],
            "add_cross_attention": False,
            "architectures": [self.architecture],
            "attn_pdrop": cfg.dropout,
            "bos_token_id": bos,
            "embd_pdrop": cfg.dropout,
            "eos_token_id": eos,
            "initializer_range": 0.02,
            "layer_norm_epsilon": cfg.norm_eps,
            "model_type": self.name,
            "n_embd": cfg.n_embd,
            "n_head": cfg.n_head,
            "n_inner": cfg.mlp_hidden if cfg.mlp_hidden not in (None, 4 * cfg.n_embd) else None,
            "n_layer": cfg.n_layer,
            "n_positions": cfg.block_size,
            "pad_token_id": cfg.pad_token_id,
            "reorder_and_upcast_attn": False,
            "resid_pdrop": cfg.dropout,
            "scale_attn_by_inverse_layer_idx": False,
            "scale_attn_weights": True,
            "summary_activation": None,
            "summary_first_dropout": 0.1,
            "summary_proj_to_labels": True,
            "summary_type": "cls_index",
            "summary_use_proj": True,
            "tie_word_embeddings": bool(cfg.tie_embeddings),
            "use_cache": True,
            "vocab_size": cfg.vocab_size,
        }

    def recipes(self, cfg) -> list:
        h, V, hid = cfg.n_embd, cfg.vocab_size, cfg.hidden
        qkv = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_size
        shapes = {"tok_embed.weight": (V, h), "pos_embed.weight": (cfg.block_size, h)}
        for i in range(cfg.n_layer):
            p = f"layers.{i}."
            shapes.update({p + "attn_norm.weight": (h,), p + "attn_norm.bias": (h,),
                           p + "attn.qkv.weight": (h, qkv), p + "attn.qkv.bias": (qkv,),
                           p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
                           p + "mlp_norm.weight": (h,), p + "mlp_norm.bias": (h,),
                           p + "mlp.fc1.weight": (h, hid), p + "mlp.fc1.bias": (hid,),
                           p + "mlp.fc2.weight": (hid, h), p + "mlp.fc2.bias": (h,)})
        shapes.update({"final_norm.weight": (h,), "final_norm.bias": (h,)})
        if not cfg.tie_embeddings:
            shapes["lm_head.weight"] = (V, h)
        return [Recipe(name, (to_gpt2(name),), SAME, (shape,)) for name, shape in shapes.items()]

    def key_of(self, file_key: str) -> str | None:
        key = file_key[len(_PREFIX):] if file_key.startswith(_PREFIX) else file_key
        return None if _BUFFER.match(key) else key

    def file_key(self, key: str) -> str:
        return key if key == self.head_key else _PREFIX + key
