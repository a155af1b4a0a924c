"""Which model a run's choices describe (cutp.train.config): a preset with overrides, a
GPTConfig given whole, a resumed checkpoint's (the choices must agree with it), or the model of
an `init_from` directory (fine-tuning: Hugging Face GPT-2 or cutp)."""
from __future__ import annotations

import dataclasses
import os

from ..checkpoint import ARCH_FIELDS, read_meta, resolve_checkpoint
from ..checkpoint.files import is_cutp_checkpoint
from ..models import PRESETS, GPTConfig
from ..models.hf import config_from_hf, read_hf_config
from ..runtime.errors import ConfigError
from .defaults import default_preset


def model_config(c: dict, dropout: float, device: str, meta: dict | None) -> tuple[GPTConfig, str | None]:
    """(the model's config, the preset it came from)."""
    if meta is not None:
        config = GPTConfig.from_dict({**meta["config"], "dropout": dropout})
        preset = (meta.get("train_args") or {}).get("preset") or default_preset(device)
        if c["model"] is not None or c["preset"] or c["dtype"] or c["set"]:
            # the same choices again: they must describe this model (a dtype alone: its dtype)
            described = c["model"] is not None or c["preset"] or c["set"]
            asked = (asked_model(c, dropout, c["preset"] or preset, c["dtype"] or config.dtype) if described
                     else dataclasses.replace(config, dtype=c["dtype"]))
            diff = [f"{k}: checkpoint {getattr(config, k)!r}, flags {getattr(asked, k)!r}"
                    for k in ARCH_FIELDS + ("dtype",) if getattr(config, k) != getattr(asked, k)]
            if diff:
                raise ConfigError("`preset`/`set`/`dtype` describe another model than the checkpoint: "
                                  + "; ".join(diff) + ". Omit them when resuming.")
        return config, preset
    preset = None if c["model"] is not None else (c["preset"] or default_preset(device))
    return asked_model(c, dropout, preset, c["dtype"] or "float32"), preset


def init_from_model(c: dict, dropout: float) -> tuple[str, GPTConfig]:
    """(the directory, its model's config) for init_from: a cutp checkpoint or run directory (its
    newest checkpoint), else a Hugging Face GPT-2 directory. preset/model/set may not change the
    architecture; dropout, dtype and the other fields may change."""
    path = c["init_from"]
    if not os.path.isdir(path):
        raise ConfigError(f"`init_from` {path}: not a directory; give a Hugging Face GPT-2 directory or a cutp "
                          "checkpoint or run directory")
    dtype = {"dtype": c["dtype"]} if c["dtype"] else {}
    if is_cutp_checkpoint(path):
        path = resolve_checkpoint(path)
        config = GPTConfig.from_dict({**read_meta(path)["config"], "dropout": dropout, **dtype})
    else:
        config = config_from_hf(read_hf_config(path), dtype=c["dtype"] or "float32", dropout=dropout,
                                where=f"`init_from` {path}")
    asked = (asked_model(c, dropout, c["preset"], config.dtype) if c["model"] is not None or c["preset"]
             else config.with_overrides(c["set"]))
    diff = [f"{k} {getattr(config, k)!r} (flags: {getattr(asked, k)!r})" for k in ARCH_FIELDS
            if getattr(config, k) != getattr(asked, k)]
    if diff:
        raise ConfigError(f"`preset`/`set` change the model of `init_from` {path}: " + "; ".join(diff)
                          + "; omit them (dropout, dtype and label_smoothing may change)")
    # absolute: the run's checkpoints record it, and a resume or export from another directory
    # must find the same base (and tokenizer), not whatever that relative path names there
    return os.path.abspath(path), asked


def asked_model(c: dict, dropout: float, preset: str | None, dtype: str) -> GPTConfig:
    if c["model"] is not None:
        model = as_gpt_config(c["model"])
        model = dataclasses.replace(model, dropout=dropout, **({"dtype": c["dtype"]} if c["dtype"] else {}))
        return model.with_overrides(c["set"])
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return GPTConfig.preset(preset, dtype=dtype, dropout=dropout).with_overrides(c["set"])


def as_gpt_config(model) -> GPTConfig:
    """A GPTConfig, or a dict of its fields (e.g. read from JSON)."""
    if isinstance(model, GPTConfig):
        return model
    if isinstance(model, dict):
        return GPTConfig.from_dict(model)
    raise ConfigError(f"model must be a GPTConfig or a dict of its fields, got {type(model).__name__}")
