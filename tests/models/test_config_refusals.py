"""ModelConfig's checks one field at a time (cutp.models.config `validate`, `preset`, `from_dict`):
each bad value is refused with a ConfigError naming the field and what it accepts, the same
config with the field left as the preset has it passes; and the small accessors the rest of the
suite never calls (`ln_eps`, `__str__`, `is_local_layer` without layer_types, the declarations'
bounded cache)."""
import dataclasses
import json

import pytest

import cutp
from cutp.models import GPTConfig
from cutp.models import config as config_module

LLAMA = GPTConfig.preset("llama-tiny")
MLA = GPTConfig.preset("deepseek-tiny")


@pytest.mark.parametrize("base, change, tp, message", [
    (LLAMA, dict(dropout=1.0), 1, r"dropout must be in \[0, 1\), got 1.0"),
    (LLAMA, dict(gelu="erf"), 1, r"gelu must be 'tanh' \(GPT-2\) or 'none' \(exact erf\), got 'erf'"),
    (LLAMA, dict(post_norms="yes"), 1, r"post_norms must be true or false, got 'yes'"),
    (LLAMA, dict(query_pre_attn_scalar=0.0), 1, r"query_pre_attn_scalar must be a positive number or None"),
    (LLAMA, dict(mlp_bias="no"), 1, r"mlp_bias must be true, false or None \(follow .?bias.?\), got 'no'"),
    (LLAMA, dict(head_dim=0), 1, r"head_dim must be a positive integer or None \(n_embd // n_head\), got 0"),
    (LLAMA, dict(rope_theta=-1.0), 1, r"rope_theta must be a positive number, got -1.0"),
    (LLAMA, dict(family="bert"), 1, r"family 'bert' is not one of cutp's families \[.*'llama'.*\] \(or None"),
    (LLAMA, dict(bos_token_id=256), 1, r"bos_token_id must be a token id in \[0, 256\) or None, got 256"),
    (LLAMA, dict(pad_token_id=True), 1, r"pad_token_id must be a token id"),
    (LLAMA, dict(sliding_window=0), 1, r"sliding_window must be a positive integer or None \(global attention\)"),
    (LLAMA, dict(sliding_window=8, layer_types=("sliding_attention",)), 1,
     r"layer_types must list n_layer=4 entries, each one of \('full_attention', 'sliding_attention'\)"),
    (LLAMA, dict(layer_types=("local",) * 4), 1, r"layer_types must list n_layer=4 entries"),
    (LLAMA, dict(final_softcap=-3.0), 1, r"final_softcap must be a positive number or None \(no soft-capping\)"),
    (MLA, dict(qk_rope_head_dim=None), 1, r"qk_rope_head_dim must be a positive integer with kv_lora_rank set"),
    (LLAMA, dict(kv_lora_rank=8), 1, r"qk_nope_head_dim must be a positive integer with kv_lora_rank set"),
    (MLA, dict(q_lora_rank=0), 1, r"q_lora_rank must be a positive integer with kv_lora_rank set .* or None"),
    (MLA, dict(positions="learned"), 1, r"multi-head latent attention rotates its rope part: set positions=rope"),
    (MLA, dict(), 3, r"tp=3 must divide n_head=8 \(MLA splits its heads over TP\)"),
])
def test_each_bad_field_is_refused_naming_it(base, change, tp, message):
    with pytest.raises(cutp.ConfigError, match=message):
        dataclasses.replace(base, **change).validate(tp)
    base.validate(1)  # (the preset itself passes: the change alone is refused)


def test_the_good_neighbours_of_the_refused_values_pass():
    for base, change, tp in ((LLAMA, dict(dropout=0.5, bos_token_id=255, pad_token_id=0, final_softcap=30.0,
                                          sliding_window=8, layer_types=("sliding_attention", "full_attention") * 2,
                                          query_pre_attn_scalar=16, mlp_bias=None, head_dim=16), 2),
                             (MLA, dict(q_lora_rank=None), 2)):
        dataclasses.replace(base, **change).validate(tp)


def test_unknown_preset_and_unknown_fields_name_the_choices():
    with pytest.raises(cutp.ConfigError, match=r"unknown preset 'llama-huge'; choose one of \[.*'llama-tiny'"):
        GPTConfig.preset("llama-huge")
    d = dict(LLAMA.to_dict(), n_layers=4)
    with pytest.raises(cutp.ConfigError, match=r"unknown ModelConfig fields \['n_layers'\]; the fields are .*"
                                               r"\(a checkpoint or config written by another cutp version\?\)"):
        GPTConfig.from_dict(d)


def test_old_field_names_and_the_printed_form_read_back():
    old = dict(LLAMA.to_dict(), ln_eps=1e-3)
    del old["norm_eps"]
    cfg = GPTConfig.from_dict(old)
    assert cfg.norm_eps == cfg.ln_eps == 1e-3
    assert GPTConfig.from_dict(json.loads(str(cfg))) == cfg  # str is the config's JSON


def test_local_layers_without_layer_types_are_every_layer_with_a_window():
    assert [LLAMA.is_local_layer(i) for i in range(4)] == [False] * 4
    windowed = dataclasses.replace(LLAMA, sliding_window=8)
    assert [windowed.is_local_layer(i) for i in range(4)] == [True] * 4
    assert LLAMA.mla_settings() is None and MLA.mla_settings()["kv_lora_rank"] == 32


def test_declarations_cache_stays_bounded_and_answers_the_same(monkeypatch):
    monkeypatch.setattr(config_module, "_DECLARED", {})
    first = LLAMA.declarations()
    for n in range(63):  # with 63 other configs the cache is full; the next new one empties it first
        dataclasses.replace(LLAMA, vocab_size=300 + n).declarations()
    assert len(config_module._DECLARED) == 64 and LLAMA.declarations() == first
    other = dataclasses.replace(LLAMA, vocab_size=299)
    assert other.declarations()[0].shape == (299, 128) and len(config_module._DECLARED) == 1
    assert LLAMA.declarations() == first
