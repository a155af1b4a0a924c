"""`python -m cutp export-hf RUN_OR_CHECKPOINT --out DIR [--dtype bfloat16]`: a cutp run (its
newest checkpoint) or checkpoint, at whatever layout it was trained, written as a Hugging Face
directory that `AutoModelForCausalLM.from_pretrained` loads as the family's class and
`AutoTokenizer.from_pretrained` loads the tokenizer of:

    config.json                the family's (cutp.models.families), bos/eos/pad ids included
    generation_config.json     the source model's when it had one, else made from the ids
    model.safetensors          save_pretrained's names, the weights from the fp32 masters if saved
    tokenizer.json, tokenizer_config.json (its chat template), special_tokens_map.json, ...
                               copied from where the run's tokens came from: the Hugging Face
                               model it was initialised from (`--init-from`, followed through
                               cutp checkpoints), else the tokenizer its prepared data names

A LoRA run (cutp.checkpoint.adapters): `--merge-lora` writes the weights with the adapters merged;
without it DIR holds the frozen base model and DIR/adapter the adapters in PEFT's format
(`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR), DIR + "/adapter")`).

A byte-level model (the embedded corpus) has no tokenizer: it is exported without tokenizer
files, said in one line. One process, no MPI; DIR must not exist (nothing is overwritten): the
files are written into DIR.tmp-export-hf and renamed to DIR when all are complete.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

from ..data.shards import META_FILE
from ..data.shards import read_meta as read_data_meta
from ..data.tokenizer import MERGES_FILE, TOKENIZER_FILE, VOCAB_FILE
from ..models.families import family_of
from ..models.hf import generation_config, save_hf
from ..models.hf_files import GENERATION_FILE, SAVE_DTYPES
from ..runtime.errors import ConfigError, UserError
from .adapters import full_tensors, trained_model, write_peft_adapter
from .export import in_dtype, model_tensors
from .files import is_cutp_checkpoint, read_meta
from .run_dir import resolve_checkpoint

# what AutoTokenizer reads from a model directory (those present are copied)
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", VOCAB_FILE, MERGES_FILE,
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja")
_WORK = ".tmp-export-hf"
ADAPTER_DIR = "adapter"  # a LoRA run's adapters (PEFT's adapter_config.json, adapter_model.safetensors)


def tokenizer_source(ckpt: str, seen=()) -> str | None:
    """The directory holding the tokenizer files of the tokens checkpoint `ckpt` was trained on:
    its `--init-from` Hugging Face directory (through cutp checkpoints it started from), else the
    tokenizer directory its prepared data names; None for byte-level data (no tokenizer)."""
    args = read_meta(ckpt).get("train_args") or {}
    init_from, data = args.get("init_from"), args.get("data")
    if isinstance(init_from, str) and os.path.isdir(init_from) and init_from not in seen:
        if is_cutp_checkpoint(init_from):
            found = tokenizer_source(resolve_checkpoint(init_from), seen + (init_from,))
            if found:
                return found
        elif os.path.isfile(os.path.join(init_from, TOKENIZER_FILE)) or os.path.isfile(
                os.path.join(init_from, VOCAB_FILE)):
            return init_from
    if isinstance(data, str) and os.path.isfile(os.path.join(data, META_FILE)):
        path = (read_data_meta(data).get("tokenizer") or {}).get("path")
        if isinstance(path, str) and os.path.isdir(path):
            return path
        if isinstance(path, str) and os.path.isfile(path):  # a tokenizer.json given as a file
            return os.path.dirname(path)
    return None


def unfound_tokenizer_records(ckpt: str, seen=()) -> list:
    """The paths the run of `ckpt` recorded that could name its tokenizer (its init_from, its
    data, the data's tokenizer, through cutp checkpoints it started from) and that are not found
    from here: a relative path of a run started elsewhere, or a directory since moved. When
    `tokenizer_source` finds nothing, these say why, rather than "byte-level data"."""
    args = read_meta(ckpt).get("train_args") or {}
    out = []
    for path in (args.get("init_from"), args.get("data")):
        if isinstance(path, str) and not os.path.exists(path):
            out.append(path)
    init_from, data = args.get("init_from"), args.get("data")
    if isinstance(init_from, str) and init_from not in seen and is_cutp_checkpoint(init_from):
        out += unfound_tokenizer_records(resolve_checkpoint(init_from), seen + (init_from,))
    if isinstance(data, str) and os.path.isfile(os.path.join(data, META_FILE)):
        path = (read_data_meta(data).get("tokenizer") or {}).get("path")
        if isinstance(path, str) and not os.path.exists(path):
            out.append(path)
    return out


def _special_token_texts(tokenizer_json: str, cfg) -> dict:
    """{"bos_token": text, "eos_token": text, ...} of cfg's ids, looked up in tokenizer.json."""
    with open(tokenizer_json) as f:
        tok = json.load(f)
    text_of = {t["id"]: t["content"] for t in tok.get("added_tokens") or []}
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        text_of = {**{i: t for t, i in vocab.items()}, **text_of}
    out = {}
    for what, ids in (("bos_token", cfg.bos_token_id), ("eos_token", cfg.eos_token_id), ("pad_token", cfg.pad_token_id)):
        first = ids[0] if isinstance(ids, list) and ids else ids
        if isinstance(first, int) and first in text_of:
            out[what] = text_of[first]
    return out


def ids_from_tokenizer(found: dict, cfg):
    """cfg with the bos/eos/pad ids it lacks filled from the tokenizer's tokenizer_config.json
    (its special tokens' texts, looked up in tokenizer.json): a model trained from a preset knows no
    ids, and without an eos id transformers' generate would run past the end of a turn."""
    config_json, tokenizer_json = found.get("tokenizer_config.json"), found.get(TOKENIZER_FILE)
    if not (config_json and tokenizer_json):
        return cfg
    with open(config_json) as f:
        special = json.load(f)
    with open(tokenizer_json) as f:
        tok = json.load(f)
    id_of = {t["content"]: t["id"] for t in tok.get("added_tokens") or []}
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        id_of = {**vocab, **id_of}
    filled = {}
    for what in ("bos", "eos", "pad"):
        text = special.get(f"{what}_token")
        text = text.get("content") if isinstance(text, dict) else text
        if getattr(cfg, f"{what}_token_id") is None and isinstance(text, str) and id_of.get(text) is not None \
                and 0 <= id_of[text] < cfg.vocab_size:
            filled[f"{what}_token_id"] = int(id_of[text])
    return dataclasses.replace(cfg, **filled) if filled else cfg


def _tokenizer_files(source: str, cfg, work: str) -> dict:
    """{file name: path} to copy from `source`; a tokenizer_config.json and special_tokens_map.json
    written into `work` when the source (a prepare-data tokenizer.json alone) has none."""
    found = {name: os.path.join(source, name) for name in TOKENIZER_FILES
             if os.path.isfile(os.path.join(source, name))}
    tokenizer_json = found.get(TOKENIZER_FILE)
    if tokenizer_json and "tokenizer_config.json" not in found:
        special = _special_token_texts(tokenizer_json, cfg)
        made = {"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces":
                                          False, "model_max_length": cfg.block_size, **special},
                "special_tokens_map.json": special}
        for name, content in made.items():
            if name not in found:
                path = os.path.join(work, name)
                with open(path, "w") as f:
                    json.dump(content, f, indent=2)
                found[name] = path
    return found


def export_hf(src: str, out: str, dtype: str | None = None, stream=None, merge_lora: bool = False) -> str:
    """Writes checkpoint (or run directory) `src` as a Hugging Face directory `out` (module
    docstring). Returns `out`; raises ConfigError (HFFormatError, CheckpointError) naming the
    problem and the fix before anything is written."""
    stream = sys.stdout if stream is None else stream
    if dtype is not None and dtype not in SAVE_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(SAVE_DTYPES)} (or omit it: the run's dtype)")
    if os.path.lexists(out):
        raise ConfigError(f"--out {out} exists; export-hf writes a new directory and never overwrites one: "
                          "choose another --out or remove it")
    ckpt = resolve_checkpoint(src)
    meta, model = read_meta(ckpt), None
    has_lora = (meta.get("train_args") or {}).get("lora_rank") is not None
    if merge_lora and not has_lora:
        raise ConfigError(f"--merge-lora: {ckpt} is not of a LoRA run (no adapters to merge); omit --merge-lora")
    if meta.get("trainable_only"):  # its frozen base from the run's init_from (cutp.checkpoint.adapters)
        model = trained_model(ckpt, meta)
        cfg = dataclasses.replace(model.config, dtype=dtype or model.config.dtype)
        tensors = {k: in_dtype(v, cfg.dtype, k) for k, v in full_tensors(model, merge_lora).items()}
    else:
        cfg, tensors = model_tensors(ckpt, dtype)
    cfg.validate(1)
    family = family_of(cfg)  # refused here, naming why, when no family computes the model
    work = out.rstrip("/") + _WORK
    shutil.rmtree(work, ignore_errors=True)  # a previous, interrupted export's
    os.makedirs(work)
    try:
        source = tokenizer_source(ckpt)
        tokenizer = _tokenizer_files(source, cfg, work) if source else {}
        cfg = ids_from_tokenizer(tokenizer, cfg)
        save_hf(tensors, cfg, os.path.join(work, "model"), dtype, tokenizer_files=tokenizer)
        model_dir = os.path.join(work, "model")
        if has_lora and not merge_lora:  # the base as it was, and the adapters alone in PEFT's format
            write_peft_adapter(model, meta, family.name, os.path.join(model_dir, ADAPTER_DIR), os.path.abspath(out))
        source_generation = os.path.join(source or "", GENERATION_FILE)
        if source and os.path.isfile(source_generation) and _same_ids(source_generation, cfg):
            shutil.copyfile(source_generation, os.path.join(model_dir, GENERATION_FILE))  # (sampling defaults too)
        os.replace(model_dir, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    what = f"{family.architecture} ({cfg.num_parameters():,} parameters, {dtype or cfg.dtype})"
    if has_lora:
        what += (", LoRA merged" if merge_lora else f", the frozen base; LoRA adapters in {out}/{ADAPTER_DIR} "
                 "(PEFT's format)")
    lost = [] if source else unfound_tokenizer_records(ckpt)
    if source:
        print(f"exported {ckpt} to {out}: {what}, tokenizer from {source}", file=stream)
    elif lost:  # (not byte-level: the run names where its tokens came from, which is not found from here)
        print(f"exported {ckpt} to {out}: {what}; no tokenizer files: {', '.join(lost)}, recorded by the run, not "
              f"found from {os.getcwd()}: export from the directory the run was started in, or copy the tokenizer "
              f"files into {out}", file=stream)
    else:
        print(f"exported {ckpt} to {out}: {what}; no tokenizer files: the model was trained on byte-level "
              "data (token id = byte value), which has no Hugging Face tokenizer", file=stream)
    return out


def _same_ids(path: str, cfg) -> bool:
    """Whether a source's generation_config.json names the ids the export writes (else the export's own)."""
    try:
        with open(path) as f:
            theirs = json.load(f)
    except (OSError, ValueError):
        return False
    ours = generation_config(cfg)
    return all(theirs.get(k) == ours.get(k) for k in ("bos_token_id", "eos_token_id"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutp export-hf",
                                description="Write a cutp run or checkpoint as a Hugging Face model directory "
                                            "(config, weights, generation config, tokenizer files).")
    p.add_argument("src", metavar="RUN_OR_CHECKPOINT", help="a run directory (its newest checkpoint) or a checkpoint")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to create (must not exist)")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run: the adapters merged into the weights (default: the base model, and the "
                        f"adapters in DIR/{ADAPTER_DIR} in PEFT's format)")
    p.add_argument("--dtype", choices=SAVE_DTYPES, default=None,
                   help="the weights' dtype (default: the run's; from the fp32 master weights when saved)")
    args = p.parse_args(argv)
    try:
        export_hf(args.src, args.out, args.dtype, merge_lora=args.merge_lora)
    except UserError as e:  # (ConfigError, HFFormatError, CheckpointError): one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


__all__ = ["export_hf", "tokenizer_source", "TOKENIZER_FILES"]
