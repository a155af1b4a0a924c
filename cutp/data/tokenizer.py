"""Tokenizers: any Hugging Face model directory's through the `tokenizers` library, and a built-in
byte tokenizer.

    tok = load_tokenizer("path/to/Llama-3.2-1B")  # its tokenizer.json (or GPT-2's vocab.json + merges.txt)
    ids = tok.encode("Hello world")               # BOS first where the tokenizer's template adds it
    text = tok.decode(ids)
    tok = load_tokenizer("bytes")                 # 256 ids, one per UTF-8 byte (cutp's `tiny` models)

`HFTokenizer` wraps `tokenizers.Tokenizer` (the optional extra `pip install tokenizers`; no torch):
the library runs the file's normalizer, pre-tokenizer, model (BPE with byte fallback, WordPiece,
Unigram), post-processor (the template that prepends BOS, as Llama's and Mistral's do) and
decoder, so GPT-2, Llama 3, Qwen2, Mistral and SmolLM directories give the ids transformers'
`AutoTokenizer` gives. A directory with only GPT-2's `vocab.json` + `merges.txt` is built as
GPT-2's byte-level BPE. BOS and EOS come from the directory's tokenizer_config.json
(`bos_token`, `eos_token`), else config.json / generation_config.json (`bos_token_id`,
`eos_token_id`; the first of a list), else a special token named <|endoftext|>, </s> or
<|end_of_text|>.

A tokenizer's identity (`identity()`, written into prepared data's meta.json and compared with
the model's at training start) is the SHA-256 of its file(s) (`tokenizer_files_sha256`, which
needs no `tokenizers`), its vocabulary size and its BOS/EOS ids.

`ByteTokenizer` has no BOS or EOS (its 256 ids are the bytes); decoding replaces invalid UTF-8
with U+FFFD.
"""
from __future__ import annotations

import hashlib
import json
import os

from ..runtime.errors import ConfigError

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
TOKENIZER_FILE = "tokenizer.json"  # the `tokenizers` library's file (transformers 5 writes only this)
BYTES = "bytes"  # the name of the built-in byte tokenizer wherever a tokenizer directory is asked for
INSTALL_HINT = "pip install tokenizers (cutp's extra: pip install -e '.[tokenizers]')"
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>")


class ByteTokenizer:
    """256 ids, one per UTF-8 byte (cutp's `tiny` models and their byte-level corpus)."""

    name = BYTES
    vocab_size = 256
    bos_id = None
    eos_id = None

    def encode(self, text: str) -> list:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts) -> list:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"token id {bad[0]} is not a byte (ByteTokenizer ids are 0..255)")
        return bytes(ids).decode("utf-8", errors="replace")

    def identity(self) -> dict:
        return {"name": BYTES, "sha256": None, "vocab_size": 256, "bos_id": None, "eos_id": None}


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the BOS/EOS ids of its model directory."""

    def __init__(self, tokenizer, name: str, sha256: str | None, bos_id: int | None = None,
                 eos_id: int | None = None):
        self.tokenizer = tokenizer
        self.name, self.sha256 = name, sha256
        self.bos_id, self.eos_id = bos_id, eos_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str) -> "HFTokenizer":
        """The tokenizer of a model directory (or of a tokenizer.json file). Raises ConfigError
        when `tokenizers` is missing or the directory has no tokenizer files."""
        tokenizers = _import_tokenizers()
        directory = os.path.dirname(path) if os.path.isfile(path) else path
        json_file = path if os.path.isfile(path) else os.path.join(path, TOKENIZER_FILE)
        try:
            if os.path.isfile(json_file):
                tok = tokenizers.Tokenizer.from_file(json_file)
            elif has_tokenizer_files(directory):
                tok = _gpt2_from_vocab_merges(tokenizers, directory)
            else:
                raise ConfigError(f"{path} has no {TOKENIZER_FILE} (nor GPT-2's {VOCAB_FILE} + {MERGES_FILE}); "
                                  f"give a model directory with its tokenizer files, or {BYTES!r}")
        except (ConfigError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # the library's errors, and its Rust panics (not Exceptions): a file it cannot read
            raise ConfigError(f"{path}: the tokenizers library cannot read its tokenizer ({type(e).__name__}: "
                              f"{e})") from None
        bos, eos = _special_ids(directory, tok)
        return cls(tok, os.path.basename(os.path.normpath(directory)) or directory,
                   tokenizer_files_sha256(directory if not os.path.isfile(path) else path), bos, eos)

    def encode(self, text: str) -> list:
        """The ids of `text`, special tokens written in it matched (as transformers does), and
        the template's BOS where it adds one."""
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts) -> list:
        return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts))]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is not in the tokenizer's vocabulary (size {self.vocab_size})")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def identity(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id}


def _import_tokenizers():
    try:
        import tokenizers  # optional: the extra cutp[tokenizers]
    except ImportError:
        raise ConfigError(f"reading a model's tokenizer needs the tokenizers library: {INSTALL_HINT}") from None
    return tokenizers


def _gpt2_from_vocab_merges(tokenizers, directory: str):
    """GPT-2's byte-level BPE from vocab.json + merges.txt (what transformers' GPT2TokenizerFast
    converts them to); its <|...|> tokens are special."""
    from tokenizers import decoders, models, pre_tokenizers  # optional: the extra cutp[tokenizers]

    tok = tokenizers.Tokenizer(models.BPE.from_file(os.path.join(directory, VOCAB_FILE),
                                                    os.path.join(directory, MERGES_FILE)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in tok.get_vocab() if t.startswith("<|") and t.endswith("|>") and len(t) > 4]
    tok.add_special_tokens(sorted(specials))
    return tok


def read_json_object(path: str) -> dict:
    """A JSON file's object ({} when the file is absent or not an object); ConfigError when unreadable."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}); fix or remove it") from None
    return data if isinstance(data, dict) else {}


def _special_ids(directory: str, tok) -> tuple:
    """(BOS id, EOS id) of a model directory: tokenizer_config.json's tokens, else config.json's
    or generation_config.json's ids, else a special token with a usual EOS name."""
    tcfg = read_json_object(os.path.join(directory, "tokenizer_config.json"))
    cfgs = [read_json_object(os.path.join(directory, f)) for f in ("config.json", "generation_config.json")]

    def find(kind):
        token = tcfg.get(f"{kind}_token")
        if isinstance(token, dict):  # {"content": "<s>", ...}, as older transformers wrote it
            token = token.get("content")
        if isinstance(token, str) and tok.token_to_id(token) is not None:
            return tok.token_to_id(token)
        for cfg in cfgs:
            v = cfg.get(f"{kind}_token_id")
            v = v[0] if isinstance(v, list) and v else v
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    bos, eos = find("bos"), find("eos")
    if eos is None:
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        eos = next((tok.token_to_id(n) for n in _EOS_NAMES if n in specials), None)
    return bos, eos


def has_tokenizer_files(path: str | None) -> bool:
    """tokenizer.json, or vocab.json + merges.txt, in directory `path`."""
    return bool(path) and os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, TOKENIZER_FILE))
        or os.path.isfile(os.path.join(path, VOCAB_FILE)) and os.path.isfile(os.path.join(path, MERGES_FILE)))


def tokenizer_files_sha256(path: str) -> str | None:
    """SHA-256 of a directory's tokenizer.json (or of a tokenizer.json file), else of its
    vocab.json and merges.txt together; None without tokenizer files. Needs no `tokenizers`."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        files = [os.path.join(path, TOKENIZER_FILE)]
    elif has_tokenizer_files(path):
        files = [os.path.join(path, VOCAB_FILE), os.path.join(path, MERGES_FILE)]
    else:
        return None
    h = hashlib.sha256()
    for i, f in enumerate(files):
        if i:
            h.update(b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def load_tokenizer(spec: str):
    """`"bytes"`: the byte tokenizer; a model directory or tokenizer.json: its HFTokenizer."""
    if spec == BYTES:
        return ByteTokenizer()
    if not os.path.exists(spec):
        raise ConfigError(f"`tokenizer` {spec}: no such directory; give a model directory with its tokenizer.json, "
                          f"or {BYTES!r} for the byte tokenizer")
    return HFTokenizer.from_dir(spec)


def get_tokenizer(path: str | None, vocab_size: int):
    """The tokenizer for a model of `vocab_size` tokens in directory `path`: its tokenizer files'
    (HFTokenizer), else the byte tokenizer for a 256-token vocabulary (or `path` "bytes"). Raises
    ConfigError when neither fits."""
    if path == BYTES or has_tokenizer_files(path) or path and os.path.isfile(path):
        tok = load_tokenizer(path)
        if tok.vocab_size > vocab_size:
            raise ConfigError(f"the tokenizer in {path} has ids up to {tok.vocab_size - 1}, but the model's "
                              f"vocabulary has {vocab_size} tokens")
        return tok
    if vocab_size == 256:
        return ByteTokenizer()
    where = f"{path} has no {TOKENIZER_FILE} or {VOCAB_FILE} + {MERGES_FILE}" if path else "no tokenizer directory was given"
    raise ConfigError(f"no tokenizer for a vocabulary of {vocab_size} tokens: {where}, and the byte tokenizer "
                      f"needs vocab_size 256; pass token ids instead (e.g. --prompt-ids)")
