"""Prepared data against the model it trains: the same tokenizer, a vocabulary that holds its ids.

`check_data_fits_model(dataset, model_config, init_from, data)`, on every rank before any collective:
- data prepared by `python -m cutp prepare-data` records its tokenizer's identity (the SHA-256 of
  its tokenizer.json, cutp.data.tokenizer); the embedded corpus and a text file are bytes; with
  `--init-from` a directory holding tokenizer files (a Hugging Face model), or a cutp checkpoint
  whose run trained on prepared data still on disk (or on bytes), the two must be the same
  tokenizer: the error names both and the prepare-data command (a BPE model fine-tuned on the
  byte corpus learns nothing it can use);
- every id the data may hold (below its vocabulary size: the tokenizer's for prepared data, the
  largest id + 1 for a `.bin`, 256 for bytes) must be below the model's vocab_size (which may be
  padded beyond the tokenizer's, as Qwen2's is).
"""
from __future__ import annotations

import os

from ..checkpoint import read_meta, resolve_checkpoint
from ..checkpoint.files import is_cutp_checkpoint
from ..data import Dataset
from ..data.shards import META_FILE
from ..data.shards import read_meta as read_data_meta
from ..data.tokenizer import BYTES, ByteTokenizer, has_tokenizer_files, tokenizer_files_sha256
from ..models import GPTConfig
from ..runtime.errors import ConfigError


def _describe(identity: dict) -> str:
    if identity.get("sha256") is None:
        return f"{identity.get('name', BYTES)} (the byte tokenizer)"
    size = identity.get("vocab_size")
    return f"{identity['name']} (sha256 {identity['sha256'][:12]}" + (f", {size:,} tokens)" if size else ")")


def model_tokenizer(init_from: str | None) -> dict | None:
    """The tokenizer identity of the weights a run starts from: an HF directory's tokenizer files,
    or the prepared data a cutp checkpoint's run trained on; None when unknown."""
    if init_from is None:
        return None
    if is_cutp_checkpoint(init_from):
        data = (read_meta(resolve_checkpoint(init_from)).get("train_args") or {}).get("data")
        if isinstance(data, str) and os.path.isfile(os.path.join(data, META_FILE)):
            return read_data_meta(data)["tokenizer"]
        if data is None or (isinstance(data, str) and not data.endswith(".bin") and not os.path.isdir(data)):
            return ByteTokenizer().identity()  # the embedded corpus or a text file: bytes
        return None
    if has_tokenizer_files(init_from):
        return {"name": os.path.basename(os.path.normpath(init_from)), "sha256": tokenizer_files_sha256(init_from),
                "path": init_from}
    return None


def check_data_fits_model(dataset: Dataset, model: GPTConfig, init_from: str | None, data: str | None) -> None:
    """Raises ConfigError naming both tokenizers when prepared data and --init-from's differ, and
    when the data's ids do not fit the model's vocabulary."""
    data_tok = dataset.tokenizer
    model_tok = model_tokenizer(init_from) if data_tok is not None else None
    if model_tok is not None and model_tok.get("sha256") != data_tok.get("sha256"):
        what = f"`data` {data}" if data is not None else "the embedded corpus (no `data` given)"
        raise ConfigError(f"{what} was tokenized by {_describe(data_tok)}, but "
                          f"`init_from` {init_from} uses {_describe(model_tok)}; prepare the data with that model's "
                          f"tokenizer: python -m cutp prepare-data ... --tokenizer {model_tok.get('path', 'DIR')} --out DIR")
    if dataset.vocab_size > model.vocab_size:
        what = (f"was tokenized by {_describe(data_tok)}, whose ids go up to {dataset.vocab_size - 1}"
                if data_tok is not None else f"has token ids up to {dataset.vocab_size - 1}")
        raise ConfigError(f"the data {what} but the model's vocabulary is {model.vocab_size}; use a model with "
                          f"vocab_size >= {dataset.vocab_size}")
