"""Hugging Face interop for every family: read a model directory straight into this rank's shards,
write one that transformers loads as the source's class.

    model = from_hf(ctx, "path/to/Llama-3.2-1B", dtype="bfloat16")   # each TP rank keeps its shards
    save_hf(model, "out/llama")                                      # collective; world rank 0 writes

The family comes from config.json's model_type (cutp.models.families: gpt2, llama, qwen2,
mistral, mixtral); its module declares the config mapping and the tensor recipes, and this
module does the rest once for all of them:

- reading: config.json, then model.safetensors or the shards model.safetensors.index.json names
  (every file inside the directory), each key, dtype and shape checked from the files' headers
  before any tensor is read; float16/bfloat16/float32/float64 tensors read one recipe at a time
  and converted to the model's dtype, each rank keeping its shard (peak host memory: one full
  tensor), or one parameter when asked (`hf_shards`: ZeRO-3's deferred parameters); a tied head
  saved anyway must equal the embedding (compared a block of rows at a time);
- writing: the TP groups gather the full tensors, world rank 0 writes config.json,
  generation_config.json, model.safetensors (save_pretrained's names) and, when given, the
  tokenizer files, each to a temporary name, fsynced and renamed into place; every rank returns
  once the files exist or raises with rank 0's reason.

No torch is needed: the tensors go through safetensors' NumPy API. What cutp cannot compute is
refused with an HFFormatError naming the field, never ignored.
"""
from __future__ import annotations

import os

import numpy as np

from ..runtime.backend import to_numpy
from ..runtime.errors import ConfigError
from ..runtime.failure import agree_on_error, errors_raised_on_every_rank
from ..tensor_parallel.sharding import pad_rows, take_shard
from .config import DTYPES, GPTConfig
from .families import FAMILIES, family_for_hf, family_of
from .gpt import GPT
from .hf_files import (CONFIG_FILE, FLOAT_DTYPES, INDEX_FILE, SAVE_DTYPES, HFFormatError, check_same_fields, files,
                       load_checked, load_streaming, open_weights, read_hf_config, to_save_dtype, write_hf_dir)

__all__ = ["HFFormatError", "check_state_dict", "config_from_hf", "config_to_hf", "expected_shapes",
           "from_hf", "generation_config", "hf_shapes", "hf_shards", "hf_state_dict", "load_hf", "load_hf_into",
           "read_hf_config", "save_hf"]


# ---- configuration ---------------------------------------------------------------------------
def config_from_hf(hf: dict, dtype: str = "float32", dropout: float = 0.0, where: str = "config.json") -> GPTConfig:
    """The ModelConfig of a config.json dict, of any family cutp reads (by its model_type); raises
    HFFormatError for what cutp cannot compute, naming the field."""
    family = family_for_hf(hf, where)
    fields = family.config_from_hf(hf, where)
    if dtype not in DTYPES:
        raise HFFormatError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    tokens = {k: v for k, v in family.special_tokens(hf).items() if _token_ids(v, fields["vocab_size"])}
    cfg = GPTConfig(**fields, dtype=dtype, dropout=float(dropout), family=family.name, **tokens)
    try:
        cfg.validate(1)
    except ConfigError as e:
        raise HFFormatError(f"{where}: {e}") from None
    return cfg


def _token_ids(v, vocab_size: int) -> bool:
    """Whether config.json's special-token value is one cutp keeps: an id of the vocabulary or a
    list of them (Llama 3's eos). Others (GPT-2 test configs whose 50256 is past a small
    vocabulary) are left out."""
    ids = v if isinstance(v, list) else [v]
    return bool(ids) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)


def config_to_hf(cfg: GPTConfig, dtype: str | None = None) -> dict:
    """config.json of the family that computes cfg (`families.family_of`), as its transformers
    config class writes it; HFFormatError (naming why) when no family can express cfg."""
    family = family_of(cfg)
    hf = family.config_to_hf(cfg)
    hf[family.dtype_key] = dtype or cfg.dtype
    return hf


def generation_config(cfg: GPTConfig) -> dict:
    """generation_config.json as save_pretrained writes it from a model config (the special ids)."""
    out = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = config_to_hf(cfg).get(k)
        if v is not None:
            out[k] = v
    return out


# ---- tensors and their shapes ------------------------------------------------------------------
def expected_shapes(cfg: GPTConfig) -> dict:
    """Full (unpadded) shape of every parameter of cfg's model, under cutp's names."""
    return {r.name: r.full_shape for r in family_of(cfg).recipes(cfg)}


def hf_shapes(cfg: GPTConfig) -> dict:
    """Every tensor of cfg's Hugging Face checkpoint, {key save_pretrained writes: shape}."""
    family = family_of(cfg)
    return {family.file_key(k): tuple(s) for r in family.recipes(cfg) for k, s in zip(r.keys, r.shapes)}


def check_state_dict(cfg: GPTConfig, sd: dict, where: str = "state dict") -> None:
    """Raises HFFormatError naming each missing/unexpected key (cutp's names) and each shape that
    differs from the config."""
    _check_shapes(cfg, expected_shapes(cfg), {k: tuple(np.shape(v)) for k, v in sd.items()}, where)


def _check_shapes(cfg: GPTConfig, want: dict, shapes: dict, where: str, where_of=None) -> None:
    missing = [k for k in want if k not in shapes]
    unexpected = sorted(k for k in shapes if k not in want)
    if missing or unexpected:
        raise HFFormatError(f"{where}: tensors do not match the config (n_layer={cfg.n_layer}, "
                            f"tie_word_embeddings={cfg.tie_embeddings}): missing {missing[:8]}"
                            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                            f"{'...' if len(unexpected) > 8 else ''}")
    for k, shape in want.items():
        got = tuple(shapes[k])
        if got != tuple(shape):
            raise HFFormatError(f"{(where_of or {}).get(k, where)}: {k} has shape {got}, but the config "
                                f"(n_embd={cfg.n_embd}, n_head={cfg.n_head}, n_kv_head={cfg.kv_heads}, "
                                f"vocab_size={cfg.vocab_size}, block_size={cfg.block_size}, mlp width {cfg.hidden}) "
                                f"needs {tuple(shape)}")


def hf_state_dict(cfg: GPTConfig, full: dict) -> dict:
    """cutp's full tensors -> {HF key: array} in the family's layouts and save_pretrained's names."""
    family = family_of(cfg)
    out = {}
    for r in family.recipes(cfg):
        if r.name not in full:
            raise HFFormatError(f"the state dict has no {r.name}")
        out.update({family.file_key(k): a for k, a in r.split(np.asarray(full[r.name])).items()})
    return out


# ---- reading ---------------------------------------------------------------------------------
def _plan(path: str, dtype: str, dropout: float):
    """(cfg, recipes, {recipe key: (file, file key)}, tied head (file, key) or None): the config and
    the weights' headers read, every key, dtype and shape checked, no tensor data read."""
    cfg_file, w_files, index = files(path)
    cfg = config_from_hf(read_hf_config(path), dtype=dtype, dropout=dropout, where=cfg_file)
    family = FAMILIES[cfg.family]
    recipes = family.recipes(cfg)
    family.reading(cfg)
    where_of, shapes, tied_head, found = {}, {}, None, set()
    for w_file in w_files:
        with open_weights(w_file) as f:
            for file_key in f.keys():
                if index is not None and index.get(file_key) != w_file:
                    raise HFFormatError(f"{w_file} holds {file_key}, but {path}/{INDEX_FILE} "
                                        f"{'places it in ' + repr(index[file_key]) if file_key in index else 'does not list it'}")
                found.add(file_key)
                key = family.key_of(file_key)
                if key is None:  # a buffer, not a parameter
                    continue
                sl = f.get_slice(file_key)
                if sl.get_dtype() not in FLOAT_DTYPES:
                    raise HFFormatError(f"{w_file}: {file_key} has dtype {sl.get_dtype()}; expected one of "
                                        f"{FLOAT_DTYPES}")
                if key in where_of or (key == family.head_key and tied_head is not None):
                    raise HFFormatError(f"{w_file}: {key} appears twice ({file_key} and "
                                        f"{(where_of.get(key) or tied_head)[1]})")
                if key == family.head_key and cfg.tie_embeddings:
                    tied_head = (w_file, file_key)
                    continue
                where_of[key], shapes[key] = (w_file, file_key), tuple(sl.get_shape())
    if index is not None:
        absent = sorted(set(index) - found)
        if absent:
            raise HFFormatError(f"{path}/{INDEX_FILE} lists {absent[:4]} in files that do not hold them")
    want = {k: s for r in recipes for k, s in zip(r.keys, r.shapes)}
    _check_shapes(cfg, want, shapes, where=w_files[0] if len(w_files) == 1 else f"{path}/{INDEX_FILE}",
                  where_of={k: w for k, (w, _) in where_of.items()})
    return cfg, recipes, where_of, tied_head


BUFFER_SUFFIXES = (".router.score_bias",)  # the parameters made by `make_buffer`: kept in float32


def _source(path: str, dtype: str, dropout: float):
    """(cfg, {cutp name: recipe}, full(name): that recipe's full array in dtype, read when called): the
    headers checked (`_plan`), and a tied head saved anyway compared with the embedding, a block of
    rows at a time."""
    cfg, recipes, where_of, tied_head = _plan(path, dtype, dropout)
    family, target = FAMILIES[cfg.family], DTYPES[dtype]
    if tied_head is not None and not _same_tensor(where_of[family.embedding_key], tied_head):
        raise HFFormatError(f"{tied_head[0]}: {tied_head[1]} differs from {family.embedding_key} but "
                            f"tie_word_embeddings is true in {path}/{CONFIG_FILE}; set it to false to load "
                            "an untied head")

    def read(w_file, file_key):
        with open_weights(w_file) as f:
            return f.get_tensor(file_key)

    by_name = {r.name: r for r in recipes}

    def full(name):
        r = by_name[name]
        a = r.combine([read(*where_of[k]) for k in r.keys])
        # (a buffer, DeepSeek's correction bias, stays float32 in a 16-bit model, as transformers keeps it)
        kept = np.float32 if r.name.endswith(BUFFER_SUFFIXES) and target != np.float64 else target
        return np.ascontiguousarray(a.astype(kept, copy=False))

    return cfg, by_name, full


def _same_tensor(a: tuple, b: tuple, block: int = 1 << 20) -> bool:
    """Whether two (file, key) tensors are equal, compared ~`block` elements at a time."""
    with open_weights(a[0]) as fa, open_weights(b[0]) as fb:
        sa, sb = fa.get_slice(a[1]), fb.get_slice(b[1])
        shape = tuple(sa.get_shape())
        if shape != tuple(sb.get_shape()):
            return False
        if not shape:
            return np.array_equal(fa.get_tensor(a[1]), fb.get_tensor(b[1]))
        n, step = shape[0], max(1, block // max(1, int(np.prod(shape[1:]))))
        return all(np.array_equal(sa[i:min(i + step, n)], sb[i:min(i + step, n)]) for i in range(0, n, step))


def _iter_tensors(path: str, dtype: str, dropout: float):
    """(cfg, generator of (cutp name, full array in dtype)): one recipe's tensors in memory at a time."""
    cfg, recipes, full = _source(path, dtype, dropout)
    return cfg, ((name, full(name)) for name in recipes)


def load_hf(path: str, dtype: str = "float32", dropout: float = 0.0) -> tuple[GPTConfig, dict]:
    """Reads a Hugging Face directory of any family: (its ModelConfig, {cutp name: full NumPy
    array in dtype}). Raises HFFormatError. (For a model of this rank's shards: `from_hf`.)"""
    cfg, tensors = _iter_tensors(path, dtype, dropout)
    return cfg, dict(tensors)


def hf_shards(model: GPT, path: str):
    """`load_hf_into` read one parameter at a time when asked: the directory checked against the
    model now (HFFormatError on every rank alike, as `load_hf_into`), then shard(p) reads p's
    tensors (its recipe's: a fused qkv's q, k and v) and returns this rank's TP shard of p in p's
    dtype, on the host (peak: the recipe's tensors and one full tensor). No communication. A
    ZeRO-3 run's deferred parameters draw so (cutp.checkpoint.load_weights)."""
    with errors_raised_on_every_rank(model.ctx.world.mpi_comm):
        cfg, recipes, full = _source(path, model.config.dtype, model.config.dropout)
        check_same_fields(model, path, cfg, FAMILIES[cfg.family].spec_fields)
        missing = sorted(p.name for p in model.parameters() if p.name not in recipes)
        if missing:
            raise HFFormatError(f"the checkpoint has no tensors for {missing[:8]}{'...' if len(missing) > 8 else ''}")
    tp_rank = model.ctx.tp_rank

    def shard(p):
        a = full(p.name)
        if p.real_rows is not None and a.shape[0] == p.real_rows:
            a = pad_rows(a, p.full_shape[0])
        if tuple(a.shape) != tuple(p.full_shape):
            raise HFFormatError(f"{p.name}: expected full shape {tuple(p.full_shape)}, got {tuple(a.shape)}")
        return np.ascontiguousarray(take_shard(a, p.sharding, tp_rank), dtype=p.data.dtype)

    return shard


def load_hf_into(model: GPT, path: str) -> GPTConfig:
    """Loads a Hugging Face directory into an existing model (each rank keeps its shard; no
    communication: every rank reads the files). The model's architecture must match the
    directory's (HFFormatError names the fields that differ). Returns the directory's config."""
    cfg, tensors = _iter_tensors(path, model.config.dtype, model.config.dropout)
    load_checked(model, path, cfg, tensors, FAMILIES[cfg.family].spec_fields)
    return cfg


# fields an override may not change: they are the checkpoint's function
_FIXED = {"n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "vocab_size", "block_size", "bias",
          "tie_embeddings", "norm_eps", "gelu", "dtype", "head_dim", "qkv_bias", "attn_out_bias", "mlp_bias", "norm",
          "positions", "mlp", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
          "rope_high_freq_factor", "rope_original_max_positions", "n_experts", "moe_top_k", "moe_renormalize",
          "family"}


def from_hf(ctx, path: str, dtype: str = "float32", dropout: float = 0.0, family: str | None = None,
            **overrides) -> GPT:
    """Returns a GPT (cutp's model of every family) at the context's layout, holding this rank's
    shards of a Hugging Face directory's weights, in eval mode as transformers' `from_pretrained`
    returns it (`model.train()` to fine-tune). `family`: refuse a directory of another family
    (the GPT-2- and Llama-only entry points pass it). `overrides`: ModelConfig fields that do not
    change the function (vocab_multiple, label_smoothing, ...)."""
    with errors_raised_on_every_rank(ctx.world.mpi_comm):  # a bad directory stops every rank alike
        if family is not None:
            found = family_for_hf(read_hf_config(path), f"{path}/{CONFIG_FILE}").name
            if found not in (family,) + _GROUPS.get(family, ()):
                raise HFFormatError(f"{path}/{CONFIG_FILE}: model_type {found!r} is not {family}'s; use cutp.hf.from_hf, "
                                    "which reads every family")
        cfg, tensors = _iter_tensors(path, dtype, dropout)
        fixed = sorted(set(overrides) & _FIXED)
        if fixed:
            raise ConfigError(f"{fixed} are fixed by the checkpoint and cannot be overridden")
    if overrides:
        cfg = GPTConfig.from_dict({**cfg.to_dict(), **overrides})
    model = GPT(ctx, cfg, seed=0, init=False)  # every weight is loaded next
    load_streaming(model, tensors)
    return model.eval()


_GROUPS = {"llama": ("qwen2", "mistral", "mixtral")}  # from_hf_llama reads the Llama-like families


# ---- writing ---------------------------------------------------------------------------------
def _hf_files(cfg: GPTConfig, full: dict, dtype: str | None) -> tuple[dict, dict]:
    """(HF tensors in the save dtype, config.json) of cfg's full tensors."""
    if dtype is None:  # the arrays' dtype when they share one, else the config's
        kinds = {np.asarray(a).dtype for a in full.values()}
        saved = str(kinds.pop()) if len(kinds) == 1 else cfg.dtype
    else:
        saved = dtype
    keep = family_of(cfg).keep_in_float32 if saved in ("bfloat16", "float16") else ()
    tensors = {k: to_save_dtype(np.asarray(a), "float32" if k.endswith(keep) else dtype)
               for k, a in hf_state_dict(cfg, full).items()}
    return tensors, config_to_hf(cfg, saved)


def save_hf(model_or_state_dict, config: GPTConfig | str | None = None, path: str | None = None,
            dtype: str | None = None, *, tokenizer_files: dict | None = None) -> None:
    """Writes a directory `AutoModelForCausalLM.from_pretrained` loads as the class of the model's
    family (`families.family_of`): config.json, generation_config.json, model.safetensors under
    save_pretrained's names (a tied head left out), and `tokenizer_files` ({file name: source
    path}, copied) when given.

    `model_or_state_dict` is a cutp GPT (`config` may then be None, and `save_hf(model, path)`
    works) or a dict of full, unpadded arrays under cutp's names (then `config` is required).
    `dtype` None keeps the arrays' dtype (an exact round trip); or float32, float64, float16,
    bfloat16. With a model this is collective over its context; with a dict nothing is
    communicated. What the family cannot express is refused on every rank before any collective."""
    if path is None and isinstance(config, (str, os.PathLike)):  # save_hf(model, "dir")
        config, path = None, config
    if path is None:
        raise ConfigError("save_hf needs the directory to write: save_hf(model, path)")
    cfg = _config_of(model_or_state_dict, config, "save_hf")  # (refuses a (model, meta) tuple by name)
    if dtype is not None and dtype not in SAVE_DTYPES:
        raise ConfigError(f"dtype {dtype!r} cannot be saved; use one of {SAVE_DTYPES} or None (keep)")
    if isinstance(model_or_state_dict, GPT):
        model = model_or_state_dict
        config_to_hf(cfg)  # refused on every rank before any collective
        full = model.gather_state_dict(rank=0)
        err = None
        if model.ctx.rank == 0:
            try:
                check_state_dict(cfg, full, where="model")
                tensors, hf_cfg = _hf_files(cfg, full, dtype)
                write_hf_dir(tensors, hf_cfg, path, generation_config(cfg), tokenizer_files)
            except Exception as e:  # every rank raises it below (none is left waiting)
                err = f"save_hf could not write {path}: {type(e).__name__}: {e}"
        agree_on_error(model.ctx.world.mpi_comm, err, RuntimeError)
        return
    full = {k: to_numpy(v) for k, v in model_or_state_dict.items()}
    check_state_dict(cfg, full, where="state dict")
    tensors, hf_cfg = _hf_files(cfg, full, dtype)
    write_hf_dir(tensors, hf_cfg, path, generation_config(cfg), tokenizer_files)


def _config_of(model_or_state_dict, config, who: str) -> GPTConfig:
    if isinstance(model_or_state_dict, tuple):
        raise ConfigError(f"{who} got a tuple: cutp.checkpoint.load_model returns (model, meta); pass the model "
                          f"(model, meta = load_model(...); {who}(model, path))")
    cfg = config if isinstance(config, GPTConfig) else getattr(model_or_state_dict, "config", None)
    if cfg is None:
        raise ConfigError(f"{who} needs the GPTConfig when given a state dict")
    return cfg


# ---- the entry points of one family (earlier releases' names) -----------------------------------
def _only(family: str, cfg: GPTConfig) -> None:
    found = family_of(cfg).name
    if found not in (family,) + _GROUPS.get(family, ()):
        raise HFFormatError(f"this model is written as {found}, not {family}; use cutp.hf.save_hf")


def from_hf_gpt2(ctx, path: str, dtype: str = "float32", dropout: float = 0.0, **overrides) -> GPT:
    """`from_hf` of a GPT-2 directory (another family's is refused by name)."""
    return from_hf(ctx, path, dtype, dropout, family="gpt2", **overrides)


def from_hf_llama(ctx, path: str, dtype: str = "float32", dropout: float = 0.0, **overrides) -> GPT:
    """`from_hf` of a Llama-family directory (llama, qwen2, mistral, mixtral)."""
    return from_hf(ctx, path, dtype, dropout, family="llama", **overrides)


def save_hf_gpt2(model_or_state_dict, config: GPTConfig | str | None = None, path: str | None = None,
                 dtype: str | None = None) -> None:
    """`save_hf` of a model GPT-2 computes (refused otherwise, naming why)."""
    cfg = _config_of(model_or_state_dict, config, "save_hf_gpt2")
    why = FAMILIES["gpt2"].refusal(cfg)
    if why:
        raise HFFormatError(why)
    return save_hf(model_or_state_dict, config, path, dtype)


def save_hf_llama(model_or_state_dict, config: GPTConfig | str | None = None, path: str | None = None,
                  dtype: str | None = None) -> None:
    """`save_hf` of a Llama-family model (llama, qwen2, mistral or mixtral, by `family_of`)."""
    cfg = _config_of(model_or_state_dict, config, "save_hf_llama")
    _only("llama", cfg)
    return save_hf(model_or_state_dict, config, path, dtype)


load_hf_gpt2 = load_hf_llama = load_hf  # (their names in earlier releases; every family is read)
config_from_hf_llama = config_from_hf
config_to_hf_llama = config_to_hf
