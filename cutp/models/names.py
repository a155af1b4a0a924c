"""cutp's parameter names, and GPT-2's, which cutp used before it had other families.

cutp names a parameter by where it sits in the model, the same for every family:

    tok_embed.weight                       token embedding [vocab, n_embd]
    pos_embed.weight                       learned positions [block_size, n_embd] (GPT-2)
    layers.{i}.attn_norm.{weight,bias}     the norm before attention (LayerNorm or RMSNorm)
    layers.{i}.attn.qkv.{weight,bias}      fused [q | k | v] projection [n_embd, (nq + 2 nkv) hd]
    layers.{i}.attn.proj.{weight,bias}     attention output projection [nq hd, n_embd]
    layers.{i}.mlp_norm.{weight,bias}      the norm before the MLP
    layers.{i}.mlp.fc1.{weight,bias}       MLP input: [n_embd, F] (GeLU) or [gate | up] (SwiGLU)
    layers.{i}.mlp.fc2.{weight,bias}       MLP output [F, n_embd]
    layers.{i}.mlp.router.weight           MoE router; experts: layers.{i}.mlp.experts.{e}.fc1 / fc2
    final_norm.{weight,bias}               the norm after the last layer
    lm_head.weight                         untied output head

(Megatron-core's linear_qkv / linear_proj / linear_fc1 / linear_fc2, shortened.) Each family's
Hugging Face adapter maps these to its own names and layouts. GPT-2's names are also the ones
checkpoints written before this naming carry (wte, h.{i}.attn.c_attn, ...): `from_gpt2` reads
them, so those checkpoints still load.
"""
from __future__ import annotations

import re

# (GPT-2 pattern, cutp replacement), the first match wins; and the reverse
_FROM_GPT2 = (
    (r"wte\.(.*)", r"tok_embed.\1"),
    (r"wpe\.(.*)", r"pos_embed.\1"),
    (r"ln_f\.(.*)", r"final_norm.\1"),
    (r"h\.(\d+)\.ln_1\.(.*)", r"layers.\1.attn_norm.\2"),
    (r"h\.(\d+)\.ln_2\.(.*)", r"layers.\1.mlp_norm.\2"),
    (r"h\.(\d+)\.attn\.c_attn\.(.*)", r"layers.\1.attn.qkv.\2"),
    (r"h\.(\d+)\.attn\.c_proj\.(.*)", r"layers.\1.attn.proj.\2"),
    (r"h\.(\d+)\.mlp\.((?:experts\.\d+\.)?)c_fc\.(.*)", r"layers.\1.mlp.\2fc1.\3"),
    (r"h\.(\d+)\.mlp\.((?:experts\.\d+\.)?)c_proj\.(.*)", r"layers.\1.mlp.\2fc2.\3"),
    (r"h\.(\d+)\.(.*)", r"layers.\1.\2"),
)
_TO_GPT2 = (
    (r"tok_embed\.(.*)", r"wte.\1"),
    (r"pos_embed\.(.*)", r"wpe.\1"),
    (r"final_norm\.(.*)", r"ln_f.\1"),
    (r"layers\.(\d+)\.attn_norm\.(.*)", r"h.\1.ln_1.\2"),
    (r"layers\.(\d+)\.mlp_norm\.(.*)", r"h.\1.ln_2.\2"),
    (r"layers\.(\d+)\.attn\.qkv\.(.*)", r"h.\1.attn.c_attn.\2"),
    (r"layers\.(\d+)\.attn\.proj\.(.*)", r"h.\1.attn.c_proj.\2"),
    (r"layers\.(\d+)\.mlp\.((?:experts\.\d+\.)?)fc1\.(.*)", r"h.\1.mlp.\2c_fc.\3"),
    (r"layers\.(\d+)\.mlp\.((?:experts\.\d+\.)?)fc2\.(.*)", r"h.\1.mlp.\2c_proj.\3"),
    (r"layers\.(\d+)\.(.*)", r"h.\1.\2"),
)
_FROM = tuple((re.compile(a), b) for a, b in _FROM_GPT2)
_TO = tuple((re.compile(a), b) for a, b in _TO_GPT2)


def _rename(name: str, rules) -> str:
    for pattern, replacement in rules:
        m = pattern.fullmatch(name)
        if m:
            return m.expand(replacement)
    return name


def from_gpt2(name: str) -> str:
    """cutp's name of the parameter GPT-2 (and checkpoints before the neutral names) call `name`;
    a name that is not GPT-2's is returned as it is (lm_head.weight is the same in both)."""
    return _rename(name, _FROM)


def to_gpt2(name: str) -> str:
    """GPT-2's name of cutp's parameter `name` (the inverse of `from_gpt2`)."""
    return _rename(name, _TO)


def is_gpt2_name(name: str) -> bool:
    """Whether `name` is in GPT-2's naming and not cutp's (so a checkpoint holding it is older
    than the neutral names)."""
    return from_gpt2(name) != name
