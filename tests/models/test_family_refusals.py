"""What each Hugging Face family refuses to write or read (cutp.models.families): a config the
family's class cannot compute is refused before anything is written, naming the field; where the
message names the family that writes the model, that family accepts it. config.json values a
family cannot read are refused naming the field; the registry refuses a second reader of a
model_type or a preset."""
import dataclasses

import pytest

from cutp.hf import HFFormatError, config_from_hf
from cutp.models import GPTConfig
from cutp.models.blocks import DEFAULT, blocks_of
from cutp.models.config import PRESETS
from cutp.models.families import FAMILIES, family_of, register
from cutp.models.families.base import Family
from cutp.models.families.llama import Llama

GPT2 = GPTConfig.preset("tiny")
LLAMA = GPTConfig.preset("llama-tiny")
MOE = dataclasses.replace(LLAMA, n_experts=4, moe_top_k=2, moe_renormalize=True, moe_capacity_factor=None)
GEMMA3 = GPTConfig.preset("gemma-tiny")
GEMMA2 = dataclasses.replace(GEMMA3, family="gemma2", qk_norm=False, rope_local_theta=None)
QWEN3_MOE = GPTConfig.preset("qwen3-moe-tiny")
DEEPSEEK = GPTConfig.preset("deepseek-tiny")


@pytest.mark.parametrize("family, base, change, message, writer", [
    ("gpt2", GPT2, dict(sliding_window=16), r"sliding_window=16, attn_softcap=None: GPT-2's attention is global", None),
    ("gpt2", GPT2, dict(norm="rmsnorm"), r"norm=rmsnorm, positions=learned, mlp=gelu: GPT-2 is layernorm", None),
    ("gpt2", GPT2, dict(head_dim=8), r"GPT-2's config has no head_dim: head_dim=8 must be n_embd / n_head", None),
    ("gpt2", GPT2, dict(gelu="relu"), r"gelu='relu' has no GPT-2 activation_function", None),
    ("llama", LLAMA, dict(norm="layernorm"), r"norm=layernorm, positions=rope, mlp=swiglu is not a Llama-family", None),
    ("llama", MOE, dict(), r"a mixture-of-experts model \(n_experts=4\) is written as Mixtral, not llama", "mixtral"),
    ("llama", LLAMA, dict(qk_norm=True), r"qk_norm=True: LlamaForCausalLM has no query and key heads "
                                         r"\(a QK-norm model is written as Qwen3, with experts Qwen3-MoE\)", "qwen3"),
    ("mixtral", MOE, dict(qk_norm=True), r"qk_norm=True: MixtralForCausalLM has no query and key heads", "qwen3_moe"),
    ("llama", LLAMA, dict(qkv_bias=True, attn_out_bias=False), r"qkv_bias=True with attn_out_bias=False: Llama's "
                                                               r"attention_bias sets all four", "qwen2"),
    ("mistral", LLAMA, dict(qkv_bias=True), r"MistralForCausalLM has no biases; this model has qkv_bias=True", None),
    ("mixtral", MOE, dict(attn_softcap=20.0), r"attn_softcap=20.0: MixtralForCausalLM has no attention soft-capping",
     None),
    ("mixtral", MOE, dict(norm="layernorm"), r"norm=layernorm, .* is not a Llama-family model", None),
    ("mixtral", LLAMA, dict(), r"Mixtral's MLPs are mixtures of experts; a dense model is written as Llama", "llama"),
    ("qwen2", LLAMA, dict(), r"Qwen2 has biases on q, k and v only; this model has qkv_bias=False", None),
    ("qwen3", LLAMA, dict(qk_norm=True, mlp_bias=True), r"Qwen3's MLP has no biases; this model has mlp_bias=True",
     None),
    ("qwen3_moe", QWEN3_MOE, dict(n_experts=0, moe_dense_layers=None),
     r"Qwen3-MoE's sparse layers are mixtures of experts; a dense model is written as Qwen3", "qwen3"),
    ("qwen3_moe", QWEN3_MOE, dict(qk_norm=False), r"qk_norm=False: Qwen3MoeForCausalLM normalises query and key", None),
    ("qwen3_moe", QWEN3_MOE, dict(moe_capacity_factor=1.25), r"Qwen3-MoE is dropless: set moe_capacity_factor to None",
     None),
    ("deepseek_v3", DEEPSEEK, dict(moe_dense_layers=(1,)), r"DeepSeek-V3's dense layers are the first ones", None),
    ("deepseek_v3", DEEPSEEK, dict(mlp_bias=True), r"DeepSeek-V3 has no biases and default, linear or yarn rope", None),
    ("gemma2", LLAMA, dict(), r"norm=rmsnorm, positions=rope, mlp=swiglu, norm_offset=False, .* is not a Gemma model",
     None),
    ("gemma2", GEMMA2, dict(n_experts=4), r"a mixture-of-experts model \(n_experts=4\) cannot be written as "
                                          r"Gemma2ForCausalLM", None),
    ("gemma2", GEMMA2, dict(qk_norm=True), r"qk_norm=True: Gemma2ForCausalLM has no query and key heads \(a QK-norm "
                                           r"Gemma is written as Gemma 3\)", "gemma3_text"),
    ("gemma2", GEMMA2, dict(qkv_bias=True), r"qkv_bias=True, attn_out_bias=False, mlp_bias=False: Gemma's "
                                            r"attention_bias sets", None),
    ("gemma3_text", GEMMA3, dict(attn_softcap=20.0), r"attn_softcap=20.0: Gemma3ForCausalLM does not soft-cap .* "
                                                     r"Gemma2ForCausalLM, which does, has no QK-norm; set "
                                                     r"attn_softcap=None", None),
    ("gemma3_text", GEMMA3, dict(rope_local_theta=None, rope_scaling="linear", rope_factor=2.0),
     r"rope_scaling=linear on every layer: Gemma 3's local layers .* set rope_local_theta", None),
])
def test_a_model_its_family_cannot_write_is_refused_naming_why(family, base, change, message, writer):
    cfg = dataclasses.replace(base, **change, family=family)
    with pytest.raises(HFFormatError, match=message):
        family_of(cfg)
    if "set attn_softcap=None" in message:  # (the fix it names: accepted; before, it named Gemma 2, which refused)
        family_of(dataclasses.replace(cfg, attn_softcap=None))
    if writer is not None:  # the family the message names writes it
        assert family_of(dataclasses.replace(cfg, family=writer)) is FAMILIES[writer]
        FAMILIES[writer].config_to_hf(cfg)


def test_a_family_by_name_or_by_fields_must_exist():
    with pytest.raises(HFFormatError, match=r"family 'bert' is not one of cutp's families \[.*'gpt2'"):
        family_of(dataclasses.replace(LLAMA, family="bert"))
    odd = dataclasses.replace(LLAMA, norm="layernorm", family=None)  # rope with a LayerNorm: no HF class
    with pytest.raises(HFFormatError, match=r"norm=layernorm, positions=rope, mlp=swiglu: no Hugging Face family "
                                            r"computes this model"):
        family_of(odd)
    assert blocks_of(odd) is DEFAULT and not DEFAULT.implies(odd)  # (built by the default blocks)


LLAMA_HF = dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
GPT2_HF = dict(model_type="gpt2", n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=64)
DEEPSEEK_HF = dict(model_type="deepseek_v3", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, vocab_size=64, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                   qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16)


@pytest.mark.parametrize("hf, drop, message", [
    (dict(GPT2_HF, n_ctx=None), "n_positions", r"config.json: n_positions is missing"),
    (GPT2_HF, "n_embd", r"config.json: required GPT-2 fields \['n_embd'\] are missing"),
    (dict(LLAMA_HF, model_type="mistral", sliding_window=0), None,
     r"config.json: sliding_window=0 must be a positive integer or null"),
    (dict(LLAMA_HF, model_type="mixtral", router_jitter_noise=0.1), None,
     r"router_jitter_noise=0.1 is not supported; cutp's router is deterministic"),
    (dict(LLAMA_HF, model_type="qwen3_moe", num_experts=0), None,
     r"num_experts=0: a Qwen3-MoE model without experts is written as Qwen3"),
    (dict(DEEPSEEK_HF, scoring_func="softmax"), None,
     r"config.json: scoring_func='softmax' is not supported \(DeepSeek-V3's router scores are sigmoids\)"),
])
def test_config_json_values_a_family_cannot_read_are_refused(hf, drop, message):
    hf = {k: v for k, v in hf.items() if k != drop}
    with pytest.raises(HFFormatError, match=message):
        config_from_hf(hf)


def test_qwen2_windows_on_no_layer_read_as_global_attention():
    types = ["full_attention"] * 2
    cfg = config_from_hf(dict(LLAMA_HF, model_type="qwen2", use_sliding_window=True, sliding_window=8,
                              layer_types=types))
    assert (cfg.sliding_window, cfg.layer_types) == (None, None)
    local = config_from_hf(dict(LLAMA_HF, model_type="qwen2", use_sliding_window=True, sliding_window=8,
                                layer_types=["full_attention", "sliding_attention"]))
    assert (local.sliding_window, local.layer_types) == (8, ("full_attention", "sliding_attention"))


def test_the_registry_refuses_a_second_reader_of_a_model_type_or_preset():
    before = (dict(FAMILIES), dict(PRESETS))
    with pytest.raises(ValueError, match=r"model_type 'llama' is read by llama already"):
        register(Llama())

    class Llama2(Llama):  # reads a new model_type, but declares Llama's presets again
        name = "llama2_copy"

        def reads(self):
            return ("llama2_copy",)

    with pytest.raises(ValueError, match=r"presets \[.*'llama-tiny'.*\] of llama2_copy exist already"):
        register(Llama2())
    assert (dict(FAMILIES), dict(PRESETS)) == before  # nothing added


def test_a_family_without_its_own_key_mapping_reads_keys_as_written():
    class Minimal(Family):
        name = "minimal"

    assert Minimal().key_of("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
