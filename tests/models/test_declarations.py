"""Parameter declarations (cutp.tensor_parallel.specs) are what the built model allocates.

`ModelConfig.declarations()` is what the parameter counts, the planner's per-rank count and its TP
gradient all-reduce sum without building arrays; here each family's model is built on shape-only
arrays at several TP and EP sizes and every parameter is compared with its declaration: name,
full shape, this rank's elements, the TP split, and the sequence-parallel / tp_partial marks
that decide which gradients `tp_grad_sync` sums.
"""
import math

import pytest

from cutp.comm.shape_only import ShapeOnlyContext
from cutp.models import GPT, GPTConfig
from cutp.models.families import FAMILIES, family_of
from cutp.runtime.errors import ConfigError
from cutp.plan import layout
from cutp.plan.moe import moe_counts
from cutp.tensor_parallel.specs import count, tp_summed

# every kind of submodule: LayerNorm/RMSNorm (+ offset), MHA/GQA (KV heads copied at tp > n_kv_head),
# biases, QK-norm, post-norms, MLA (with and without q_lora_rank), GeLU/SwiGLU/GeGLU, MoE (biases,
# shared experts, correction bias), learned positions, tied and untied heads, padded vocabularies
MODELS = [("tiny", ["vocab_size=250"]), ("llama-tiny", ["n_kv_head=1", "qkv_bias=true", "mlp_bias=true"]),
          ("gemma-tiny", []), ("qwen3-tiny", []), ("tiny-moe", []), ("qwen3-moe-tiny", []), ("deepseek-tiny", []),
          ("deepseek-tiny", ["q_lora_rank=none", "mlp_bias=true"])]
SPLIT_OF = {"column": ("contiguous", -1), "row": ("contiguous", 0), "vocab": ("contiguous", 0), "qkv": ("qkv", -1),
            "gate_up": ("gate_up", -1)}


def _expanded(decls, ep_rank, ep):
    """name -> declaration, a routed expert's named for each expert this EP rank holds."""
    out = {}
    for d in decls:
        if d.split == "expert":
            local = d.count // ep
            for e in range(ep_rank * local, (ep_rank + 1) * local):
                out[d.name.replace(".*.", f".{e}.")] = d
        else:
            out[d.name] = d
    return out


@pytest.mark.parametrize("preset,overrides", MODELS, ids=[f"{p}{'+' if o else ''}" for p, o in MODELS])
def test_every_parameter_is_declared_as_the_model_allocates_it(preset, overrides):
    config = GPTConfig.preset(preset).with_overrides(overrides)
    for tp, ep in ((1, 1), (2, 1), (4, 2)):
        if ep > 1 and not config.n_experts:
            continue
        ctx = ShapeOnlyContext(tp=tp, dp=ep, ep=ep, rank=tp - 1 + tp * (ep - 1), device="cpu")
        model = GPT(ctx, config, init=False)
        if tp > 1 and config.kv_lora_rank is None:  # (MLA refuses sequence parallelism)
            model.set_sequence_parallel(True)
        declared = _expanded(config.declarations(), ctx.ep_rank, ep)
        params = {p.name: p for p in model.parameters()}
        assert sorted(params) == sorted(declared), (tp, ep)
        for name, p in params.items():
            d = declared[name]
            assert (p.real_rows or p.full_shape[0], *p.full_shape[1:]) == d.shape, name
            assert p.data.size == d.local_numel(tp, ep) // (d.count // ep if d.split == "expert" else 1), name
            kind = None if p.sharding is None or p.sharding.tp == 1 else (p.sharding.spec["kind"], p.sharding.axis)
            want = SPLIT_OF.get(d.split)
            assert kind == (None if want is None or tp == 1 else (want[0], want[1] % len(d.shape))), name
            assert (p.tp_partial, p.sequence_parallel and tp > 1) == (d.tp_partial, d.sp and tp > 1
                                                                       and config.kv_lora_rank is None), name
            assert d.grad == (not name.endswith("score_bias")), name
        local = sum(p.data.size for p in params.values() if not p.name.endswith("score_bias"))
        assert count(config.declarations(), tp=tp, ep=ep) == local == layout.param_count(config, tp, ep)["per_rank"]
        summed = sum(p.data.size for p in params.values() if tp_summed(declared[p.name], tp > 1))
        if tp > 1 and config.kv_lora_rank is None:
            assert layout.tp_gradient_elements(config, tp, True, ep) == summed


def test_the_planners_moe_counts_are_the_moe_layers_declarations():
    """plan/moe.py's figures, from the MoE layers' declarations alone (no model built): a dense
    model's count plus the MoE deltas is the MoE model's, total and active, at any TP and EP."""
    for name in ("tiny-moe", "qwen3-moe-tiny", "deepseek-tiny"):
        c = GPTConfig.preset(name)
        dense = GPTConfig.preset(name, n_experts=0)
        m = moe_counts(c, tp=4, ep=2)
        assert dense.num_parameters() + m["total"] == c.num_parameters()
        assert dense.num_parameters() + m["active"] == c.num_active_parameters() < c.num_parameters()
        assert layout.param_count(dense, 4)["per_rank"] + m["per_rank"] == layout.param_count(c, 4, 2)["per_rank"]
        last = c.block_spec(c.n_layer - 2).mlp  # (an MoE layer in all three)
        assert m["expert"] == sum(math.prod(d.shape) for d in last.expert.parameters()) > 0
        assert m["router"] == c.n_embd * c.n_experts and m["layers"] == sum(map(c.is_moe_layer, range(c.n_layer)))
    v3 = GPTConfig.preset("deepseek-v3")  # (its counts: tests/models/test_family_math.py)
    assert v3.num_stored_values() == v3.num_parameters() + 58 * 256  # the correction biases


def _named(decls):
    """name -> declaration, a routed expert's named for every expert."""
    return _expanded(decls, 0, 1)


# each family's smallest preset, and the biases, heads and attentions the presets leave out
RECIPE_MODELS = [(min(f.presets, key=lambda p: GPTConfig.preset(p).num_parameters()), []) for f in FAMILIES.values()] + \
    [("llama-tiny", ["n_kv_head=1", "tie_embeddings=true", "rope_scaling=llama3"]), ("llama-tiny", ["qkv_bias=true"]),
     ("llama-tiny", ["bias=true"]), ("deepseek-tiny", ["q_lora_rank=none"]), ("qwen3-tiny", ["tie_embeddings=false"]),
     ("mixtral-8x7b", ["n_layer=2"]), ("gpt2", ["n_layer=2"])]


def test_every_family_reads_and_writes_exactly_the_declared_parameters():
    """Each family's HF tensor recipes against the declarations: every declared parameter has
    exactly one recipe and every recipe makes a declared parameter, of the declared shape (so a
    family's recipes cannot drift from its block); every HF key is in one recipe only; and at tp
    1, 2 and 4 the declared split of that shape is what each rank's shard is read into."""
    for preset, overrides in RECIPE_MODELS:
        cfg = GPTConfig.preset(preset).with_overrides(overrides)
        family = family_of(cfg)
        recipes = family.recipes(cfg)
        declared = _named(cfg.declarations())
        by_name = {r.name: r for r in recipes}
        assert len(by_name) == len(recipes), (preset, overrides, "two recipes make one parameter")
        assert sorted(by_name) == sorted(declared), (preset, overrides, sorted(set(by_name) ^ set(declared))[:4])
        keys = [k for r in recipes for k in r.keys]
        assert len(keys) == len(set(keys)), (preset, overrides, "an HF tensor in two recipes")
        for name, d in declared.items():
            assert tuple(by_name[name].full_shape) == tuple(d.shape), (preset, name)
        for tp in (1, 2, 4):
            try:
                cfg.validate(tp)
            except ConfigError:
                continue  # (a shape this tp does not split: refused before any read)
            for d in set(declared.values()):  # (each kind of tensor once)
                s, full = d.sharding(tp), d.full_shape(tp)
                assert full[1:] == tuple(d.shape[1:]) and full[0] >= d.shape[0], (preset, d.name, tp)
                assert s is None or (s.full_shape == full and sum(len(i) for i in s.indices) >= full[s.axis]), d.name


def test_counts_are_the_published_ones():
    """The declarations' sums against the counts the models' authors and transformers report (the
    figures a family's presets must reproduce)."""
    published = {"gpt2": 124_439_808, "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248,
                 "mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624, "deepseek-v3": 671_026_404_352}
    assert {p: GPTConfig.preset(p).num_parameters() for p in published} == published
