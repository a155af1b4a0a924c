"""Hugging Face GPT-2 interop: load a `GPT2LMHeadModel` directory into cutp, write one back.

    from cutp.hf import from_hf_gpt2, save_hf_gpt2
    model = from_hf_gpt2(ctx, "path/to/gpt2")        # each TP rank keeps its shard
    save_hf_gpt2(model, None, "out/gpt2")             # collective; TP rank 0 of DP replica 0 writes

A directory holds `config.json` (a GPT2Config) and `model.safetensors`, or sharded weights
(`model.safetensors.index.json`, whose "weight_map" names the file of each tensor, all inside
the directory), read tensor by tensor either way. No torch is needed: the tensors are read and
written with safetensors' NumPy API.

Names and layouts: cutp uses GPT-2's layouts (Conv1D weights [in, out]; `h.{i}.attn.c_attn.weight`
[n_embd, 3*n_embd] with columns [q | k | v], heads in order) under its own names
(`cutp.models.names`: h.{i}.attn.c_attn is layers.{i}.attn.qkv), so the mapping is a renaming
(`names.to_gpt2` / `from_gpt2`) plus the `transformer.` prefix that `GPT2LMHeadModel` adds (a
`GPT2Model` checkpoint, such as the original `gpt2` upload, has none; both are read), the
non-parameter buffers that old checkpoints carry (`h.N.attn.bias`, `h.N.attn.masked_bias`:
skipped), and `lm_head.weight`, which is tied to `wte.weight` in GPT-2: `save_pretrained` leaves
it out, and so does `save_hf_gpt2` unless the embeddings are untied.

Configuration fields: n_layer, n_head, n_embd, n_positions -> block_size, vocab_size,
layer_norm_epsilon -> ln_eps, n_inner -> mlp_hidden (None: 4*n_embd), activation_function
("gelu_new" / "gelu_pytorch_tanh" -> gelu "tanh", "gelu" -> gelu "none", i.e. exact erf) and
tie_word_embeddings. HF's three dropout probabilities (resid/embd/attn_pdrop) are training
settings, not part of the function: loading sets cutp's single `dropout` from the `dropout`
argument (default 0.0), and saving writes cutp's dropout into all three.
What cutp cannot compute is refused with a ConfigError: scale_attn_by_inverse_layer_idx,
reorder_and_upcast_attn, scale_attn_weights=False, add_cross_attention, another activation.
"""
from __future__ import annotations

import os
import re

import numpy as np

from .config import DTYPES, GPTConfig
from .gpt import GPT
from .hf_files import (CONFIG_FILE, INDEX_FILE, HFFormatError, load_checked, load_streaming, read_hf_config,
                       write_hf_dir)
from .hf_llama import FAMILIES as LLAMA_FAMILIES
from .hf_llama import config_from_hf_llama, from_hf_llama, is_llama_family, load_hf_llama_into, save_hf_llama
from .names import from_gpt2, to_gpt2
from .hf_files import FLOAT_DTYPES as _FLOAT_DTYPES
from .hf_files import SAVE_DTYPES as _SAVE_DTYPES
from .hf_files import files as _files
from .hf_files import open_weights as _open_weights
from .hf_files import to_save_dtype as _to_save_dtype
from ..runtime.backend import to_numpy
from ..runtime.errors import ConfigError
from ..runtime.failure import errors_raised_on_every_rank
from ..runtime.failure import agree_on_error

_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
# (field, value cutp computes): anything else in the config cannot be represented
_REFUSED = (
    ("scale_attn_by_inverse_layer_idx", False, "cutp scales attention scores by 1/sqrt(head_dim) only"),
    ("reorder_and_upcast_attn", False, "cutp has no reordered/upcast attention path"),
    ("scale_attn_weights", True, "cutp always scales attention scores by 1/sqrt(head_dim)"),
    ("add_cross_attention", False, "cutp's GPT is decoder-only, without cross-attention"),
)

# ---- configuration ---------------------------------------------------------------------------
def config_from_hf(hf: dict, dtype: str = "float32", dropout: float = 0.0, where: str = "config.json") -> GPTConfig:
    """GPTConfig from a config.json dict (GPT-2's here, the Llama family's by cutp.models.hf_llama);
    raises HFFormatError for what cutp cannot represent."""
    model_type = hf.get("model_type", "gpt2")
    if model_type in LLAMA_FAMILIES:
        return config_from_hf_llama(hf, dtype=dtype, dropout=dropout, where=where)
    if model_type != "gpt2":
        raise HFFormatError(f"{where}: model_type is {model_type!r}; cutp reads {['gpt2'] + sorted(LLAMA_FAMILIES)} "
                            "(GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, "
                            "MixtralForCausalLM)")
    for field, ours, why in _REFUSED:
        if field in hf and hf[field] is not None and bool(hf[field]) != ours:
            raise HFFormatError(f"{where}: {field}={hf[field]!r} is not supported ({why}); "
                                f"only {field}={ours} models can be loaded")
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise HFFormatError(f"{where}: activation_function {act!r} is not supported; cutp computes "
                            f"{sorted(_ACTIVATIONS)} (tanh-approximate GeLU or exact erf GeLU)")
    missing = [k for k in ("n_layer", "n_head", "n_embd", "vocab_size") if k not in hf]
    if missing:
        raise HFFormatError(f"{where}: required GPT-2 fields {missing} are missing")
    block = hf.get("n_positions", hf.get("n_ctx"))
    if block is None:
        raise HFFormatError(f"{where}: n_positions is missing")
    if dtype not in DTYPES:
        raise HFFormatError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    n_inner = hf.get("n_inner")
    cfg = GPTConfig(
        n_layer=hf["n_layer"], n_head=hf["n_head"], n_kv_head=None, n_embd=hf["n_embd"],
        mlp_hidden=None if n_inner is None else n_inner, vocab_size=hf["vocab_size"], block_size=block,
        dropout=float(dropout), bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)), dtype=dtype,
        ln_eps=float(hf.get("layer_norm_epsilon", 1e-5)), gelu=_ACTIVATIONS[act],
    )
    try:
        cfg.validate(1)
    except ConfigError as e:
        raise HFFormatError(f"{where}: {e}") from None
    return cfg


def config_to_hf(cfg: GPTConfig) -> dict:
    """A GPT2Config dict (as `GPT2Config.to_dict()` writes it) for a cutp config that GPT-2 can express."""
    if cfg.kv_heads != cfg.n_head:
        raise HFFormatError(f"a grouped-query attention model (n_kv_head={cfg.n_kv_head} != n_head={cfg.n_head}) "
                            f"cannot be exported as GPT-2, whose attention has one K/V head per query head")
    if cfg.n_experts:
        raise HFFormatError(f"a mixture-of-experts model (n_experts={cfg.n_experts}) cannot be exported as GPT-2, "
                            "whose MLPs are dense; keep its cutp checkpoint (examples/generate.py reads it)")
    if not cfg.bias:
        raise HFFormatError("a model without biases (bias=False) cannot be exported as GPT-2, which has biases "
                            "in every linear layer and LayerNorm")
    act = {"tanh": "gelu_new", "none": "gelu"}.get(cfg.gelu)
    if act is None:
        raise HFFormatError(f"gelu={cfg.gelu!r} has no GPT-2 activation_function")
    special = 50256 if cfg.vocab_size > 50256 else cfg.vocab_size - 1  # GPT-2's <|endoftext|>, else the last id
    return {
        "activation_function": act,
        "add_cross_attention": False,
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": cfg.dropout,
        "bos_token_id": special,
        "dtype": cfg.dtype,
        "embd_pdrop": cfg.dropout,
        "eos_token_id": special,
        "initializer_range": 0.02,
        "layer_norm_epsilon": cfg.ln_eps,
        "model_type": "gpt2",
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "n_inner": cfg.mlp_hidden if cfg.mlp_hidden not in (None, 4 * cfg.n_embd) else None,
        "n_layer": cfg.n_layer,
        "n_positions": cfg.block_size,
        "pad_token_id": None,
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


def expected_shapes(cfg: GPTConfig) -> dict:
    """Full (unpadded) shape of every parameter of a GPT-2 model, under cutp's names."""
    h, V, hid = cfg.n_embd, cfg.vocab_size, cfg.hidden
    qkv = (cfg.n_head + 2 * cfg.kv_heads) * (h // cfg.n_head)
    s = {"tok_embed.weight": (V, h), "pos_embed.weight": (cfg.block_size, h)}
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        s.update({p + "attn_norm.weight": (h,), p + "attn_norm.bias": (h,),
                  p + "attn.qkv.weight": (h, qkv), p + "attn.qkv.bias": (qkv,),
                  p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
                  p + "mlp_norm.weight": (h,), p + "mlp_norm.bias": (h,),
                  p + "mlp.fc1.weight": (h, hid), p + "mlp.fc1.bias": (hid,),
                  p + "mlp.fc2.weight": (hid, h), p + "mlp.fc2.bias": (h,)})
    s["final_norm.weight"] = (h,)
    s["final_norm.bias"] = (h,)
    if not cfg.tie_embeddings:
        s["lm_head.weight"] = (V, h)
    return s


def check_state_dict(cfg: GPTConfig, sd: dict, where: str = "state dict") -> None:
    """Raises HFFormatError naming each missing/unexpected key (cutp's names) and each shape that
    differs from the config."""
    _check_shapes(cfg, {k: tuple(np.shape(v)) for k, v in sd.items()}, where)


def _check_shapes(cfg: GPTConfig, shapes: dict, where: str, naming=lambda name: name) -> None:
    """`shapes` under the names `naming` gives cutp's (GPT-2's for a file, so the message names
    what the file holds)."""
    want = {naming(k): shape for k, shape in expected_shapes(cfg).items()}
    missing = [k for k in want if k not in shapes]
    unexpected = sorted(k for k in shapes if k not in want)
    if missing or unexpected:
        raise HFFormatError(f"{where}: tensors do not match the config (n_layer={cfg.n_layer}, "
                            f"tie_word_embeddings={cfg.tie_embeddings}): missing {missing[:8]}"
                            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                            f"{'...' if len(unexpected) > 8 else ''}")
    for k, shape in want.items():
        got = tuple(shapes[k])
        if got != shape:
            raise HFFormatError(f"{where}: {k} has shape {got}, but the config (n_embd={cfg.n_embd}, "
                                f"n_head={cfg.n_head}, vocab_size={cfg.vocab_size}, n_positions={cfg.block_size}, "
                                f"mlp width {cfg.hidden}) needs {shape}")


# ---- loading ----------------------------------------------------------------------------------
def _plan(path: str, dtype: str, dropout: float):
    """Reads the config and the weights' headers (no tensor data) and checks every key, dtype and
    shape. Returns (cfg, {cutp name: (file, key)}, (file, key) of an lm_head to compare with the
    embedding or None)."""
    cfg_file, w_files, index = _files(path)
    cfg = config_from_hf(read_hf_config(path), dtype=dtype, dropout=dropout, where=cfg_file)
    keys, shapes, tied_head, found = {}, {}, None, set()
    for w_file in w_files:
        with _open_weights(w_file) as f:
            for key in f.keys():
                if index is not None and index.get(key) != w_file:
                    raise HFFormatError(f"{w_file} holds {key}, but {path}/{INDEX_FILE} "
                                        f"{'places it in ' + repr(index[key]) if key in index else 'does not list it'}")
                found.add(key)
                name = key[len("transformer."):] if key.startswith("transformer.") else key
                if _BUFFER.match(name):
                    continue
                sl = f.get_slice(key)
                if sl.get_dtype() not in _FLOAT_DTYPES:
                    raise HFFormatError(f"{w_file}: {key} has dtype {sl.get_dtype()}; expected one of {_FLOAT_DTYPES}")
                if name in keys or (name == "lm_head.weight" and tied_head is not None):
                    raise HFFormatError(f"{w_file}: {name} appears twice (with and without the 'transformer.' prefix)")
                if name == "lm_head.weight" and cfg.tie_embeddings:
                    tied_head = (w_file, key)
                    continue
                keys[name] = (w_file, key)
                shapes[name] = tuple(sl.get_shape())
    if index is not None:
        absent = sorted(set(index) - found)
        if absent:
            raise HFFormatError(f"{path}/{INDEX_FILE} lists {absent[:4]} in files that do not hold them")
    _check_shapes(cfg, shapes, where=w_files[0] if len(w_files) == 1 else f"{path}/{INDEX_FILE}", naming=to_gpt2)
    return cfg, {from_gpt2(name): where for name, where in keys.items()}, tied_head


def _iter_tensors(path: str, dtype: str, dropout: float):
    """(cfg, generator of (cutp name, full array in dtype)), one tensor in memory at a time."""
    cfg, keys, tied_head = _plan(path, dtype, dropout)
    target = DTYPES[dtype]

    def read(w_file, key):
        with _open_weights(w_file) as f:
            return f.get_tensor(key)

    def tensors():
        if tied_head is not None:  # a tied head that was saved anyway must equal the embedding
            wte, head = read(*keys["tok_embed.weight"]), read(*tied_head)
            if wte.shape != head.shape or not np.array_equal(wte, head):
                raise HFFormatError(f"{tied_head[0]}: lm_head.weight differs from wte.weight but tie_word_embeddings "
                                    f"is true in {path}/{CONFIG_FILE}; set it to false to load an untied head")
            del wte, head
        for w_file in dict.fromkeys(w for w, _ in keys.values()):  # each file opened once
            with _open_weights(w_file) as f:
                for name, (w, key) in keys.items():
                    if w == w_file:
                        yield name, np.ascontiguousarray(f.get_tensor(key).astype(target, copy=False))

    return cfg, tensors()


def load_hf_gpt2(path: str, dtype: str = "float32", dropout: float = 0.0) -> tuple[GPTConfig, dict]:
    """Reads a Hugging Face GPT-2 directory: (GPTConfig, {cutp name: full float NumPy array}), the
    names cutp's (`cutp.models.names`: wte.weight is tok_embed.weight).

    Keys may carry the `transformer.` prefix or not; buffers (h.N.attn.bias / masked_bias) are
    skipped; a tied `lm_head.weight` equal to `wte.weight` is dropped. float16/bfloat16/float32/
    float64 tensors are converted to `dtype` ("float32" or "float64"). Every key, dtype and shape
    is checked against the config (from the file's header, before any tensor is read). Raises
    HFFormatError.
    """
    cfg, tensors = _iter_tensors(path, dtype, dropout)
    return cfg, dict(tensors)


_ARCH_FIELDS = ("n_layer", "n_head", "kv_heads", "n_embd", "hidden", "vocab_size", "block_size", "bias",
                "tie_embeddings", "ln_eps", "gelu")


def load_hf_into(model: GPT, path: str) -> GPTConfig:
    """Loads a Hugging Face GPT-2 directory into an existing model (each rank keeps its shard).

    No communication: every rank reads the files. The model's architecture must match the
    directory's config (HFFormatError names the fields that differ). Returns the file's config.
    A Llama-family directory goes to its adapter (`hf_llama.load_hf_llama_into`).
    """
    if read_hf_config(path).get("model_type", "gpt2") in LLAMA_FAMILIES:
        return load_hf_llama_into(model, path)
    cfg, tensors = _iter_tensors(path, model.config.dtype, model.config.dropout)
    load_checked(model, path, cfg, tensors, _ARCH_FIELDS)
    return cfg


def from_hf_gpt2(ctx, path: str, dtype: str = "float32", dropout: float = 0.0, **overrides) -> GPT:
    """Builds a GPT at the context's TP size from a Hugging Face GPT-2 directory and loads its weights.

    `overrides` set other GPTConfig fields that do not change the function (e.g. vocab_multiple,
    label_smoothing). The model is returned in eval mode, as transformers' `from_pretrained`
    returns it: no dropout, and forward keeps nothing for backward. To fine-tune, call
    `model.train()` first (cutp.train's `init_from` builds its own training-mode model).
    """
    with errors_raised_on_every_rank(ctx.world.mpi_comm):  # a bad directory stops every rank alike
        cfg, tensors = _iter_tensors(path, dtype, dropout)
    if overrides:
        bad = sorted(set(overrides) & {"n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "vocab_size",
                                       "block_size", "bias", "tie_embeddings", "ln_eps", "gelu", "dtype"})
        if bad:
            raise ConfigError(f"{bad} are fixed by the checkpoint and cannot be overridden")
        cfg = GPTConfig.from_dict({**cfg.to_dict(), **overrides})
    model = GPT(ctx, cfg, seed=0, init=False)  # every weight is loaded next
    load_streaming(model, tensors)
    return model.eval()


# ---- saving ----------------------------------------------------------------------------------
def _write_dir(full: dict, cfg: GPTConfig, path: str, dtype) -> None:
    hf_cfg = config_to_hf(cfg)
    if dtype is not None:
        hf_cfg["dtype"] = dtype
    else:
        kinds = {np.asarray(a).dtype for a in full.values()}
        hf_cfg["dtype"] = str(kinds.pop()) if len(kinds) == 1 else cfg.dtype
    tensors = {}
    for name, a in full.items():
        key = name if name == "lm_head.weight" else "transformer." + to_gpt2(name)
        tensors[key] = _to_save_dtype(np.asarray(a), dtype)
    write_hf_dir(tensors, hf_cfg, path)


def save_hf_gpt2(model_or_state_dict, config: GPTConfig | str | None = None, path: str | None = None,
                 dtype: str | None = None) -> None:
    """Writes a Hugging Face GPT-2 directory: config.json (a GPT2Config) and model.safetensors.

    `model_or_state_dict` is a cutp GPT (then `config` may be None: the model's is used, and
    `save_hf_gpt2(model, path)` works) or a dict of full, unpadded arrays under cutp's names (then
    `config` is required). Keys are
    written as `GPT2LMHeadModel.save_pretrained` writes them: `transformer.`-prefixed, without
    `lm_head.weight` when tied (transformers re-ties it on load), with it when untied.
    `dtype` None keeps the arrays' dtype (exact round trip); or one of float32, float64,
    float16, bfloat16.

    With a model this is collective over the model's context: the TP groups gather the full
    tensors, world rank 0 alone writes (temporary files renamed into place, so an interrupted
    save never leaves a half-written file), and every rank returns once the files exist or
    raises RuntimeError (with rank 0's reason) if rank 0 could not write them. With a dict,
    nothing is communicated. Refuses (before any communication) what GPT-2 cannot express:
    GQA, bias=False.
    """
    if path is None and isinstance(config, (str, os.PathLike)):  # save_hf_gpt2(model, "dir")
        config, path = None, config
    if path is None:
        raise ConfigError("save_hf_gpt2 needs the directory to write: save_hf_gpt2(model, path)")
    if dtype is not None and dtype not in _SAVE_DTYPES:
        raise ConfigError(f"dtype {dtype!r} cannot be saved; use one of {_SAVE_DTYPES} or None (keep)")
    if isinstance(model_or_state_dict, GPT):
        model = model_or_state_dict
        cfg = config or model.config
        config_to_hf(cfg)  # refuse GQA / bias=False on every rank before any collective
        ctx = model.ctx
        full = model.gather_state_dict(rank=0)
        err = None
        if ctx.rank == 0:
            try:
                check_state_dict(cfg, full, where="model")
                _write_dir(full, cfg, path, dtype)
            except Exception as e:  # every rank raises it below (none is left waiting)
                err = f"save_hf_gpt2 could not write {path}: {type(e).__name__}: {e}"
        agree_on_error(ctx.world.mpi_comm, err, RuntimeError)
        return
    if config is None:
        raise ConfigError("save_hf_gpt2 needs the GPTConfig when given a state dict")
    full = {k: to_numpy(v) for k, v in model_or_state_dict.items()}
    check_state_dict(config, full, where="state dict")
    _write_dir(full, config, path, dtype)


# ---- any family --------------------------------------------------------------------------------
def from_hf(ctx, path: str, dtype: str = "float32", dropout: float = 0.0, **overrides) -> GPT:
    """A model from a Hugging Face directory of any family cutp reads, by config.json's
    model_type: gpt2 (`from_hf_gpt2`), llama, qwen2, mistral, mixtral (`hf_llama.from_hf_llama`)."""
    with errors_raised_on_every_rank(ctx.world.mpi_comm):
        model_type = read_hf_config(path).get("model_type", "gpt2")
        if model_type != "gpt2" and model_type not in LLAMA_FAMILIES:  # refused by name, as config_from_hf does
            config_from_hf({"model_type": model_type}, where=f"{path}/{CONFIG_FILE}")
    if model_type in LLAMA_FAMILIES:
        return from_hf_llama(ctx, path, dtype=dtype, dropout=dropout, **overrides)
    return from_hf_gpt2(ctx, path, dtype=dtype, dropout=dropout, **overrides)


def save_hf(model_or_state_dict, config: GPTConfig | str | None = None, path: str | None = None,
            dtype: str | None = None) -> None:
    """Writes the Hugging Face directory of the family that computes the model: GPT-2's for
    layernorm/learned/gelu models (`save_hf_gpt2`), the Llama family's (llama, qwen2, mixtral)
    for rmsnorm/rope/swiglu ones (`hf_llama.save_hf_llama`). Same arguments as those."""
    if path is None and isinstance(config, (str, os.PathLike)):
        config, path = None, config
    cfg = config or getattr(model_or_state_dict, "config", None)
    if cfg is not None and is_llama_family(cfg):
        return save_hf_llama(model_or_state_dict, config, path, dtype)
    return save_hf_gpt2(model_or_state_dict, config, path, dtype)
