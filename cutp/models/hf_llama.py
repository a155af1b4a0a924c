"""Hugging Face interop for the Llama family: LlamaForCausalLM (Llama 2, 3, 3.1, 3.2, TinyLlama,
SmolLM), Qwen2ForCausalLM, MistralForCausalLM and MixtralForCausalLM directories in and out.

    model = from_hf_llama(ctx, "path/to/Llama-3.2-1B", dtype="bfloat16")   # each TP rank its shards
    save_hf_llama(model, "out/llama")                                      # collective; rank 0 writes

(`cutp.hf.from_hf` / `save_hf` choose this adapter or GPT-2's by config.json's model_type.)

Names and layouts (HF's Linear weights are [out, in], cutp's [in, out]):

    model.embed_tokens.weight                  tok_embed.weight
    model.layers.i.input_layernorm.weight      layers.i.attn_norm.weight
    self_attn.{q,k,v}_proj.{weight,bias}       layers.i.attn.qkv.{weight,bias}: columns [q | k | v]
    self_attn.o_proj.{weight,bias}             layers.i.attn.proj
    post_attention_layernorm.weight            layers.i.mlp_norm.weight
    mlp.{gate,up}_proj                         layers.i.mlp.fc1: columns [gate | up] (each TP rank
                                               then holds [gate_r ; up_r], by the gate_up sharding)
    mlp.down_proj                              layers.i.mlp.fc2
    block_sparse_moe.gate.weight [E, h]        layers.i.mlp.router.weight [h, E]
    block_sparse_moe.experts.e.w1 / w3 / w2    layers.i.mlp.experts.e.fc1 [gate | up] / fc2
    model.norm.weight, lm_head.weight          final_norm.weight, lm_head.weight (absent when tied)

Q and K load unpermuted: cutp's rotary op is HF's rotate_half layout. An old converter's
`rotary_emb.inv_freq` buffers are skipped.

Configuration: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, max_position_embeddings -> block_size, rms_norm_eps -> ln_eps,
rope_theta and rope_scaling (none/default, linear, llama3; top-level as Llama 3.x on the Hub ships
them, or transformers 5's rope_parameters), tie_word_embeddings, attention_bias / mlp_bias
(Llama), Qwen2's q/k/v biases, Mixtral's num_local_experts / num_experts_per_tok /
router_aux_loss_coef (routing: softmax over the router logits, top-k, renormalised). Refused,
naming the field: a sliding_window in use, other rope types, partial rotary, another
hidden_act, router jitter.
"""
from __future__ import annotations

import os
import re

import numpy as np

from ..ops.rotary import RopeScaling
from ..runtime.backend import to_numpy
from ..runtime.errors import ConfigError
from ..runtime.failure import agree_on_error, errors_raised_on_every_rank
from .config import DTYPES, GPTConfig
from .gpt import GPT
from .hf_files import CONFIG_FILE, FLOAT_DTYPES, INDEX_FILE, SAVE_DTYPES, HFFormatError, files
from .hf_files import load_checked, load_streaming, open_weights, read_hf_config, to_save_dtype, write_hf_dir

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
            "mixtral": "MixtralForCausalLM"}
_SKIPPED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


# ---- configuration ---------------------------------------------------------------------------
def _rope_of(hf: dict, where: str):
    """(rope_theta, RopeScaling) from config.json: top-level rope_theta / rope_scaling (transformers
    4.x, the Hub's Llama 3.x files) or rope_parameters (transformers 5)."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling")
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    try:
        return float(theta), RopeScaling.from_hf(scaling)
    except ConfigError as e:
        raise HFFormatError(f"{where}: {e}") from None


def config_from_hf_llama(hf: dict, dtype: str = "float32", dropout: float = 0.0,
                         where: str = "config.json") -> GPTConfig:
    """GPTConfig from a Llama/Qwen2/Mistral/Mixtral config.json dict; HFFormatError for what cutp
    cannot compute, naming the field."""
    mt = hf.get("model_type")
    if mt not in FAMILIES:
        raise HFFormatError(f"{where}: model_type is {mt!r}; this adapter reads {sorted(FAMILIES)}")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if k not in hf]
    if missing:
        raise HFFormatError(f"{where}: required {mt} fields {missing} are missing")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported; cutp's SwiGLU is silu")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFFormatError(f"{where}: partial_rotary_factor={hf['partial_rotary_factor']!r} is not supported; "
                            "cutp rotates the whole head")
    window = hf.get("sliding_window")
    in_use = bool(hf.get("use_sliding_window", False)) if mt == "qwen2" else window is not None
    if in_use:
        raise HFFormatError(f"{where}: sliding_window={window!r} is set; cutp's attention is full causal "
                            "(set sliding_window to null, or use_sliding_window to false, for a model trained without "
                            "it)")
    if float(hf.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
        raise HFFormatError(f"{where}: router_jitter_noise={hf['router_jitter_noise']!r} is not supported; cutp's "
                            "router is deterministic")
    if dtype not in DTYPES:
        raise HFFormatError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    theta, sc = _rope_of(hf, where)
    h, n_head = hf["hidden_size"], hf["num_attention_heads"]
    if mt == "qwen2":  # q/k/v biases, no o_proj or MLP bias (Qwen2's modelling code)
        qkv_bias, out_bias, mlp_bias = True, False, False
    else:
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    moe = {}
    if mt == "mixtral":
        moe = dict(n_experts=hf.get("num_local_experts", 8), moe_top_k=hf.get("num_experts_per_tok", 2),
                   moe_renormalize=True, moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.02)))
    cfg = GPTConfig(
        n_layer=hf["num_hidden_layers"], n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head,
        n_embd=h, mlp_hidden=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        block_size=hf.get("max_position_embeddings", 2048), dropout=float(dropout), bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype,
        ln_eps=float(hf.get("rms_norm_eps", 1e-6)), norm="rmsnorm", positions="rope", mlp="swiglu",
        head_dim=hf.get("head_dim") or h // n_head, rope_theta=theta, rope_scaling=sc.rope_type,
        rope_factor=sc.factor, rope_low_freq_factor=sc.low_freq_factor, rope_high_freq_factor=sc.high_freq_factor,
        rope_original_max_positions=sc.original_max_position_embeddings, qkv_bias=qkv_bias, attn_out_bias=out_bias,
        mlp_bias=mlp_bias, **moe)
    try:
        cfg.validate(1)
    except ConfigError as e:
        raise HFFormatError(f"{where}: {e}") from None
    return cfg


def is_llama_family(cfg: GPTConfig) -> bool:
    return (cfg.norm, cfg.positions, cfg.mlp) == ("rmsnorm", "rope", "swiglu")


def family_of(cfg: GPTConfig) -> str:
    """The HF model_type that computes cfg's function (HFFormatError when none does)."""
    if not is_llama_family(cfg):
        raise HFFormatError(f"norm={cfg.norm}, positions={cfg.positions}, mlp={cfg.mlp} is not a Llama-family model "
                            "(rmsnorm, rope, swiglu); GPT-2's adapter writes layernorm/learned/gelu models")
    qkv, out, mlp = cfg._bias("qkv_bias"), cfg._bias("attn_out_bias"), cfg._bias("mlp_bias")
    if cfg.n_experts:
        if (qkv, out, mlp) != (False, False, False) or cfg.moe_every != 1 or not cfg.moe_renormalize \
                or cfg.moe_capacity_factor is not None or (cfg.moe_ffn not in (None, cfg.hidden)):
            raise HFFormatError("a mixture-of-experts model is written as Mixtral, which needs no biases, an MoE MLP "
                                "in every layer (moe_every=1), moe_renormalize=true, no moe_capacity_factor and "
                                "moe_ffn equal to mlp_hidden")
        return "mixtral"
    if (qkv, out, mlp) == (True, False, False):
        if cfg.head_size * cfg.n_head != cfg.n_embd:
            raise HFFormatError(f"Qwen2's config has no head_dim: head_dim={cfg.head_size} must be n_embd / n_head")
        return "qwen2"
    if qkv != out:
        raise HFFormatError(f"qkv_bias={qkv} with attn_out_bias={out}: Llama's attention_bias sets all four "
                            "projections' biases, Qwen2 has q/k/v biases only (and no MLP bias)")
    return "llama"


def _rope_to_hf(cfg: GPTConfig):
    if cfg.rope_scaling == "none":
        return None
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    return {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions}


def config_to_hf_llama(cfg: GPTConfig, dtype: str | None = None) -> dict:
    """The config.json of the family that computes cfg (`family_of`), as transformers 4.57 writes it."""
    mt = family_of(cfg)
    d = {"architectures": [FAMILIES[mt]], "model_type": mt, "hidden_size": cfg.n_embd,
         "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
         "num_key_value_heads": cfg.kv_heads, "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.ln_eps,
         "rope_theta": cfg.rope_theta, "rope_scaling": _rope_to_hf(cfg), "vocab_size": cfg.vocab_size,
         "tie_word_embeddings": bool(cfg.tie_embeddings), "hidden_act": "silu", "attention_dropout": 0.0,
         "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype or cfg.dtype}
    if mt != "qwen2":
        d["head_dim"] = cfg.head_size
    if mt == "llama":
        d.update(attention_bias=cfg._bias("qkv_bias"), mlp_bias=cfg._bias("mlp_bias"), pretraining_tp=1)
    if mt == "qwen2":
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layer)
    if mt == "mixtral":
        d.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                 router_aux_loss_coef=cfg.moe_aux_loss_coeff, output_router_logits=False, sliding_window=None,
                 router_jitter_noise=0.0)
    return d


# ---- names and layouts -----------------------------------------------------------------------
def hf_shapes(cfg: GPTConfig) -> dict:
    """Every tensor of the HF checkpoint of cfg, {HF key: shape}."""
    h, V, F, hd = cfg.n_embd, cfg.vocab_size, cfg.hidden, cfg.head_size
    q, kv = cfg.n_head * hd, cfg.kv_heads * hd
    s = {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,)}
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        s.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                  p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                  p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        if cfg._bias("qkv_bias"):
            s.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,)})
        if cfg._bias("attn_out_bias"):
            s[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.is_moe_layer(i):
            s[p + "block_sparse_moe.gate.weight"] = (cfg.n_experts, h)
            for e in range(cfg.n_experts):
                x = f"{p}block_sparse_moe.experts.{e}."
                s.update({x + "w1.weight": (F, h), x + "w3.weight": (F, h), x + "w2.weight": (h, F)})
        else:
            s.update({p + "mlp.gate_proj.weight": (F, h), p + "mlp.up_proj.weight": (F, h),
                      p + "mlp.down_proj.weight": (h, F)})
            if cfg._bias("mlp_bias"):
                s.update({p + "mlp.gate_proj.bias": (F,), p + "mlp.up_proj.bias": (F,), p + "mlp.down_proj.bias": (h,)})
    if not cfg.tie_embeddings:
        s["lm_head.weight"] = (V, h)
    return s


def _recipes(cfg: GPTConfig):
    """(cutp name, [HF keys], how) per cutp parameter. how: "same"; "T" (transposed); "cat" the
    keys' [out, in] weights transposed and concatenated by columns ([q | k | v], [gate | up]);
    "catb" their biases concatenated."""
    out = [("tok_embed.weight", ["model.embed_tokens.weight"], "same"),
           ("final_norm.weight", ["model.norm.weight"], "same")]
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", ["lm_head.weight"], "same"))
    for i in range(cfg.n_layer):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        out += [(c + "attn_norm.weight", [p + "input_layernorm.weight"], "same"),
                (c + "mlp_norm.weight", [p + "post_attention_layernorm.weight"], "same"),
                (c + "attn.qkv.weight", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], "cat"),
                (c + "attn.proj.weight", [a + "o_proj.weight"], "T")]
        if cfg._bias("qkv_bias"):
            out.append((c + "attn.qkv.bias", [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], "catb"))
        if cfg._bias("attn_out_bias"):
            out.append((c + "attn.proj.bias", [a + "o_proj.bias"], "same"))
        if cfg.is_moe_layer(i):
            m = p + "block_sparse_moe."
            out.append((c + "mlp.router.weight", [m + "gate.weight"], "T"))
            for e in range(cfg.n_experts):
                x, y = f"{m}experts.{e}.", f"{c}mlp.experts.{e}."
                out += [(y + "fc1.weight", [x + "w1.weight", x + "w3.weight"], "cat"),
                        (y + "fc2.weight", [x + "w2.weight"], "T")]
        else:
            m = p + "mlp."
            out += [(c + "mlp.fc1.weight", [m + "gate_proj.weight", m + "up_proj.weight"], "cat"),
                    (c + "mlp.fc2.weight", [m + "down_proj.weight"], "T")]
            if cfg._bias("mlp_bias"):
                out += [(c + "mlp.fc1.bias", [m + "gate_proj.bias", m + "up_proj.bias"], "catb"),
                        (c + "mlp.fc2.bias", [m + "down_proj.bias"], "same")]
    return out


def _combine(how: str, arrays: list) -> np.ndarray:
    """HF's arrays of one recipe -> cutp's full array."""
    if how == "same":
        return arrays[0]
    if how == "T":
        return arrays[0].T
    if how == "cat":
        return np.concatenate([a.T for a in arrays], axis=1)
    return np.concatenate(arrays)


def _split(how: str, full: np.ndarray, keys: list, shapes: dict) -> dict:
    """The inverse of `_combine`: cutp's full array -> {HF key: array}."""
    if how in ("same", "T"):
        return {keys[0]: np.ascontiguousarray(full.T if how == "T" else full)}
    parts = np.split(full, np.cumsum([shapes[k][0] for k in keys])[:-1], axis=full.ndim - 1)
    return {k: np.ascontiguousarray(a.T if how == "cat" else a) for k, a in zip(keys, parts)}


# ---- loading ----------------------------------------------------------------------------------
def _plan(path: str, dtype: str, dropout: float):
    """(cfg, {HF key: file}, tied lm_head (file) or None), every key, dtype and shape checked from
    the files' headers before any tensor is read."""
    cfg_file, w_files, index = files(path)
    cfg = config_from_hf_llama(read_hf_config(path), dtype=dtype, dropout=dropout, where=cfg_file)
    want = hf_shapes(cfg)
    where_of, shapes, tied_head = {}, {}, None
    for w_file in w_files:
        with open_weights(w_file) as f:
            for key in f.keys():
                if index is not None and index.get(key) != w_file:
                    raise HFFormatError(f"{w_file} holds {key}, but {path}/{INDEX_FILE} does not place it there")
                if _SKIPPED.match(key):
                    continue
                sl = f.get_slice(key)
                if sl.get_dtype() not in FLOAT_DTYPES:
                    raise HFFormatError(f"{w_file}: {key} has dtype {sl.get_dtype()}; expected one of {FLOAT_DTYPES}")
                if key == "lm_head.weight" and cfg.tie_embeddings:
                    tied_head = w_file
                    continue
                where_of[key], shapes[key] = w_file, tuple(sl.get_shape())
    missing = [k for k in want if k not in shapes]
    unexpected = sorted(set(shapes) - set(want))
    if missing or unexpected:
        raise HFFormatError(f"{path}: tensors do not match {cfg_file} (num_hidden_layers={cfg.n_layer}, "
                            f"tie_word_embeddings={cfg.tie_embeddings}): missing {missing[:6]}, unexpected "
                            f"{unexpected[:6]}")
    for k, shape in want.items():
        if shapes[k] != shape:
            raise HFFormatError(f"{where_of[k]}: {k} has shape {shapes[k]}, but {cfg_file} needs {shape}")
    return cfg, where_of, tied_head


def _iter_tensors(path: str, dtype: str, dropout: float):
    """(cfg, generator of (cutp name, full array in dtype)): a few HF tensors in memory at a time."""
    cfg, where_of, tied_head = _plan(path, dtype, dropout)
    target = DTYPES[dtype]

    def read(key):
        with open_weights(where_of.get(key, tied_head)) as f:
            return f.get_tensor(key)

    def tensors():
        if tied_head is not None:  # a tied head saved anyway must be the embedding
            if not np.array_equal(read("model.embed_tokens.weight"), read("lm_head.weight")):
                raise HFFormatError(f"{tied_head}: lm_head.weight differs from model.embed_tokens.weight but "
                                    f"tie_word_embeddings is true in {path}/{CONFIG_FILE}; set it to false")
        for name, keys, how in _recipes(cfg):
            full = _combine(how, [read(k) for k in keys])
            yield name, np.ascontiguousarray(full.astype(target, copy=False))

    return cfg, tensors()


def load_hf_llama(path: str, dtype: str = "float32", dropout: float = 0.0) -> tuple[GPTConfig, dict]:
    """(GPTConfig, {cutp name: full array}) of a Llama-family directory."""
    cfg, tensors = _iter_tensors(path, dtype, dropout)
    return cfg, dict(tensors)


SPEC_FIELDS = ("n_layer", "n_head", "kv_heads", "n_embd", "hidden", "head_size", "vocab_size", "block_size",
               "tie_embeddings", "ln_eps", "norm", "positions", "mlp", "rope_theta", "rope_scaling", "rope_factor",
               "n_experts", "moe_top_k")


def load_hf_llama_into(model: GPT, path: str) -> GPTConfig:
    """Loads a Llama-family directory into an existing model (`--init-from`); the architectures
    must agree (HFFormatError naming the fields that differ). No communication."""
    cfg, tensors = _iter_tensors(path, model.config.dtype, model.config.dropout)
    load_checked(model, path, cfg, tensors, SPEC_FIELDS)
    return cfg


def from_hf_llama(ctx, path: str, dtype: str = "float32", dropout: float = 0.0, **overrides) -> GPT:
    """A GPT at the context's layout with a Llama-family directory's weights, in eval mode (as
    `from_pretrained` returns it; `model.train()` to fine-tune). `overrides`: GPTConfig fields
    that do not change the function (vocab_multiple, label_smoothing, ...)."""
    with errors_raised_on_every_rank(ctx.world.mpi_comm):
        cfg, tensors = _iter_tensors(path, dtype, dropout)
        fixed = sorted(set(overrides) & (set(SPEC_FIELDS) | {"n_kv_head", "mlp_hidden", "head_dim", "dtype", "bias",
                                                               "qkv_bias", "attn_out_bias", "mlp_bias"}))
        if fixed:
            raise ConfigError(f"{fixed} are fixed by the checkpoint and cannot be overridden")
    if overrides:
        cfg = GPTConfig.from_dict({**cfg.to_dict(), **overrides})
    model = GPT(ctx, cfg, seed=0, init=False)
    load_streaming(model, tensors)
    return model.eval()


# ---- saving ----------------------------------------------------------------------------------
def hf_state_dict(cfg: GPTConfig, full: dict) -> dict:
    """cutp's full tensors -> {HF key: array} in HF's layouts (what save_pretrained writes)."""
    shapes = hf_shapes(cfg)
    out = {}
    for name, keys, how in _recipes(cfg):
        if name not in full:
            raise HFFormatError(f"the state dict has no {name}")
        out.update(_split(how, np.asarray(full[name]), keys, shapes))
    return out


def _write_dir(tensors: dict, hf_cfg: dict, path: str, dtype) -> None:
    write_hf_dir({k: to_save_dtype(a, dtype) for k, a in tensors.items()}, hf_cfg, path)


def save_hf_llama(model_or_state_dict, config: GPTConfig | str | None = None, path: str | None = None,
                  dtype: str | None = None) -> None:
    """Writes a directory `AutoModelForCausalLM.from_pretrained` loads: config.json of the family
    that computes the model (`family_of`: llama, qwen2 or mixtral) and model.safetensors under
    save_pretrained's names (lm_head.weight left out when tied). A model: collective over its
    context (the TP groups gather, world rank 0 writes, every rank returns once the files exist
    or raises with rank 0's reason). A dict of full tensors under cutp's names: with `config`.
    dtype None keeps the arrays' dtype; or float32, float64, float16, bfloat16."""
    if path is None and isinstance(config, (str, os.PathLike)):
        config, path = None, config
    if path is None:
        raise ConfigError("save_hf_llama needs the directory to write: save_hf_llama(model, path)")
    if dtype is not None and dtype not in SAVE_DTYPES:
        raise ConfigError(f"dtype {dtype!r} cannot be saved; use one of {SAVE_DTYPES} or None (keep)")
    if isinstance(model_or_state_dict, GPT):
        model = model_or_state_dict
        cfg = config or model.config
        hf_cfg = config_to_hf_llama(cfg, dtype)  # refused on every rank before any collective
        full = model.gather_state_dict(rank=0)
        err = None
        if model.ctx.rank == 0:
            try:
                _write_dir(hf_state_dict(cfg, full), hf_cfg, path, dtype)
            except Exception as e:  # every rank raises it below
                err = f"save_hf_llama could not write {path}: {type(e).__name__}: {e}"
        agree_on_error(model.ctx.world.mpi_comm, err, RuntimeError)
        return
    if config is None:
        raise ConfigError("save_hf_llama needs the GPTConfig when given a state dict")
    full = {k: to_numpy(v) for k, v in model_or_state_dict.items()}
    _write_dir(hf_state_dict(config, full), config_to_hf_llama(config, dtype), path, dtype)
