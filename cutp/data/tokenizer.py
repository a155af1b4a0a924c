"""Tokenizers for generation: GPT-2's byte-level BPE and a plain UTF-8 byte tokenizer.

    tok = get_tokenizer("path/to/gpt2", vocab_size=50257)   # vocab.json + merges.txt, or tokenizer.json
    ids = tok.encode("Hello world")                         # [15496, 995]
    text = tok.decode(ids)

`GPT2BPETokenizer` is OpenAI's GPT-2 algorithm (the one `transformers.GPT2Tokenizer` follows):
text -> pre-tokens by GPT-2's regex -> each pre-token's UTF-8 bytes mapped to printable
characters (`bytes_to_unicode`) -> merges applied greedily by rank (lowest rank first) ->
vocabulary ids. Special tokens of the vocabulary written `<|...|>` (GPT-2's `<|endoftext|>`)
are matched in the text first and encoded as their own id, as transformers does.
Its files: `vocab.json` + `merges.txt` (`from_dir`), or the `tokenizers` library's
`tokenizer.json` alone, as transformers 5 saves it (`from_tokenizer_json`; its added tokens are
the special ones).

The pre-tokenisation regex uses `\\p{L}` (letters) and `\\p{N}` (numbers), which Python's `re`
lacks. They are built here, exactly, as character classes from `unicodedata` categories
(L* = Lu Ll Lt Lm Lo; N* = Nd Nl No), and `\\s` as the Unicode White_Space set (what the
`regex` module and tokenizers use; Python's `\\s` would also match U+001C..U+001F). The only
possible difference from the `regex` module is the Unicode version of the two libraries'
tables, for characters assigned in between. Building the classes takes a fraction of a second,
once per process, on first use.

`ByteTokenizer` is what cutp's own `tiny` models use: 256 ids, one per UTF-8 byte; decoding
replaces invalid sequences with U+FFFD.
"""
from __future__ import annotations

import json
import os
import re
import sys
import unicodedata
from functools import lru_cache

from ..runtime.errors import ConfigError

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
TOKENIZER_FILE = "tokenizer.json"  # the `tokenizers` library's file (transformers 5 writes only this)

# Unicode White_Space (PropList.txt); U+180E left it in Unicode 6.3
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009" \
               "\u200a\u2028\u2029\u202f\u205f\u3000"


@lru_cache(maxsize=None)
def bytes_to_unicode() -> dict:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _class_ranges(pred) -> str:
    """The body of a regex character class matching exactly the code points where pred(ch)."""
    parts, start, prev = [], None, None
    for cp in range(sys.maxunicode + 1):
        if pred(chr(cp)):
            if start is None:
                start = cp
            prev = cp
        elif start is not None:
            parts.append((start, prev))
            start = None
    if start is not None:
        parts.append((start, prev))

    def esc(cp):
        return "\\U%08x" % cp

    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in parts)


@lru_cache(maxsize=None)
def gpt2_pretokenize_pattern() -> re.Pattern:
    """GPT-2's pattern `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+` for `re`."""
    cats = {}
    for cp in range(sys.maxunicode + 1):
        c = unicodedata.category(chr(cp))[0]
        if c in "LN":
            cats.setdefault(c, set()).add(cp)
    letters, numbers = cats["L"], cats["N"]
    L = _class_ranges(lambda ch: ord(ch) in letters)
    N = _class_ranges(lambda ch: ord(ch) in numbers)
    S = "".join("\\U%08x" % ord(c) for c in _WHITE_SPACE)
    pat = (rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+""")
    return re.compile(pat)


def _get_pairs(word):
    return {(word[i], word[i + 1]) for i in range(len(word) - 1)}


class GPT2BPETokenizer:
    """Byte-level BPE from a GPT-2 `vocab.json` (token -> id) and `merges.txt` (one "a b" merge a line)."""

    def __init__(self, encoder: dict, merges: list, special_tokens: list | None = None, cache_size: int = 100_000):
        self.encoder = dict(encoder)
        self.decoder = {v: k for k, v in self.encoder.items()}
        if len(self.decoder) != len(self.encoder):
            raise ConfigError("vocab.json maps two tokens to the same id")
        self.bpe_ranks = {tuple(m): i for i, m in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        if special_tokens is None:
            special_tokens = [t for t in self.encoder if t.startswith("<|") and t.endswith("|>") and len(t) > 4]
        self.special_tokens = {t: self.encoder[t] for t in special_tokens}
        self._special_re = (re.compile("(" + "|".join(re.escape(t) for t in sorted(self.special_tokens, key=len,
                                                                                    reverse=True)) + ")")
                            if self.special_tokens else None)
        self.pattern = gpt2_pretokenize_pattern()
        self.cache = {}
        self.cache_size = cache_size

    @classmethod
    def from_dir(cls, path: str) -> "GPT2BPETokenizer":
        vf, mf = os.path.join(path, VOCAB_FILE), os.path.join(path, MERGES_FILE)
        for f in (vf, mf):
            if not os.path.isfile(f):
                raise ConfigError(f"{f} not found: a GPT-2 tokenizer needs {VOCAB_FILE} and {MERGES_FILE}")
        with open(vf, encoding="utf-8") as f:
            encoder = json.load(f)
        merges = []
        with open(mf, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\n").rstrip("\r")
                if not line or (n == 1 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ConfigError(f"{mf}:{n}: expected two tokens separated by one space, got {line!r}")
                merges.append(tuple(parts))
        return cls(encoder, merges)

    @classmethod
    def from_tokenizer_json(cls, path: str) -> "GPT2BPETokenizer":
        """GPT-2's byte-level BPE from a `tokenizers` tokenizer.json (what transformers 5 saves
        alone): "model" {"type": "BPE", "vocab": {token: id}, "merges": ["a b", ...] or [["a", "b"],
        ...]}, its "added_tokens" (e.g. <|endoftext|>) matched in the text first. Refuses (ConfigError)
        a tokenizer that is not GPT-2's byte-level BPE (another model type, a normalizer, a prefix
        space, subword prefixes), which this encoder would get silently wrong."""
        f = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
        try:
            with open(f, encoding="utf-8") as fh:
                spec = json.load(fh)
            model = spec["model"]
            kind, encoder, raw = model.get("type"), model["vocab"], model["merges"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{f} is not a readable tokenizer.json with a BPE model "
                              f"({type(e).__name__}: {e})") from None
        pre = json.dumps(spec.get("pre_tokenizer"))
        why = (f"its model type is {kind!r}" if kind != "BPE" else
               "it has a normalizer" if spec.get("normalizer") else
               "its pre-tokenizer is not ByteLevel" if '"ByteLevel"' not in pre else
               "its ByteLevel pre-tokenizer adds a prefix space" if '"add_prefix_space": true' in pre else
               "its BPE has a subword prefix/suffix" if model.get("continuing_subword_prefix")
               or model.get("end_of_word_suffix") else None)
        if why:
            raise ConfigError(f"{f}: {why}; cutp reads GPT-2's byte-level BPE only (or give vocab.json + "
                              f"merges.txt, or --prompt-ids)")
        merges = []
        for n, m in enumerate(raw):
            parts = m.split(" ") if isinstance(m, str) else m
            if not isinstance(parts, list) or len(parts) != 2 or not all(isinstance(p, str) for p in parts):
                raise ConfigError(f"{f}: merge {n} is {m!r}; expected \"a b\" or [\"a\", \"b\"]")
            merges.append(tuple(parts))
        added = {t["content"]: t["id"] for t in spec.get("added_tokens") or ()}
        clash = [t for t, i in added.items() if encoder.get(t, i) != i]
        if clash:
            raise ConfigError(f"{f}: added token {clash[0]!r} has another id than in the vocabulary")
        return cls({**encoder, **added}, merges, special_tokens=list(added) or None)

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eot_id(self) -> int | None:
        return self.special_tokens.get("<|endoftext|>")

    def bpe(self, token: str) -> tuple:
        """Merges of one pre-token (already mapped by bytes_to_unicode): its BPE pieces, cached."""
        hit = self.cache.get(token)
        if hit is not None:
            return hit
        word = tuple(token)
        pairs = _get_pairs(word)
        ranks = self.bpe_ranks
        while pairs:
            bigram = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if bigram not in ranks:
                break
            first, second = bigram
            new_word, i = [], 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = _get_pairs(word)
        if len(self.cache) >= self.cache_size:
            self.cache.clear()
        self.cache[token] = word
        return word

    def _encode_ordinary(self, text: str, out: list) -> None:
        be = self.byte_encoder
        for piece in self.pattern.findall(text):
            mapped = "".join(be[b] for b in piece.encode("utf-8"))
            for t in self.bpe(mapped):
                i = self.encoder.get(t)
                if i is None:
                    raise ValueError(f"BPE piece {t!r} (from {piece!r}) is not in the vocabulary; "
                                     f"vocab.json must contain all 256 byte tokens")
                out.append(i)

    def encode(self, text: str) -> list:
        out = []
        if self._special_re is None:
            self._encode_ordinary(text, out)
            return out
        for k, part in enumerate(self._special_re.split(text)):
            if k % 2:
                out.append(self.special_tokens[part])
            elif part:
                self._encode_ordinary(part, out)
        return out

    def decode(self, ids) -> str:
        pieces = []
        for i in ids:
            t = self.decoder.get(int(i))
            if t is None:
                raise ValueError(f"token id {int(i)} is not in the tokenizer's vocabulary (size {self.vocab_size})")
            pieces.append(t)
        return self._decode_pieces(pieces)

    def _decode_pieces(self, pieces) -> str:
        """Bytes of the pieces decoded as UTF-8 (invalid sequences -> U+FFFD); special tokens verbatim."""
        out, buf = [], bytearray()
        for t in pieces:
            if t in self.special_tokens:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(t)
                continue
            try:
                buf.extend(self.byte_decoder[c] for c in t)
            except KeyError:
                raise ValueError(f"vocabulary token {t!r} is not byte-level BPE (characters outside "
                                 f"bytes_to_unicode)") from None
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class ByteTokenizer:
    """256 ids, one per UTF-8 byte (cutp's `tiny` models and their byte-level corpus)."""

    vocab_size = 256
    eot_id = None

    def encode(self, text: str) -> list:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"token id {bad[0]} is not a byte (ByteTokenizer ids are 0..255)")
        return bytes(ids).decode("utf-8", errors="replace")


def has_bpe_files(path: str | None) -> bool:
    """vocab.json + merges.txt, or tokenizer.json, in `path`."""
    return bool(path) and (os.path.isfile(os.path.join(path, VOCAB_FILE)) and os.path.isfile(
        os.path.join(path, MERGES_FILE)) or os.path.isfile(os.path.join(path, TOKENIZER_FILE)))


def get_tokenizer(path: str | None, vocab_size: int):
    """The tokenizer for a model: GPT-2 BPE if `path` has vocab.json + merges.txt (else
    tokenizer.json), else the byte tokenizer for a 256-token vocabulary. Raises ConfigError when
    neither fits."""
    if has_bpe_files(path):
        slow = os.path.isfile(os.path.join(path, VOCAB_FILE)) and os.path.isfile(os.path.join(path, MERGES_FILE))
        tok = GPT2BPETokenizer.from_dir(path) if slow else GPT2BPETokenizer.from_tokenizer_json(path)
        top = max(tok.decoder)
        if top >= vocab_size:
            raise ConfigError(f"the tokenizer in {path} has ids up to {top}, but the model's vocabulary has "
                              f"{vocab_size} tokens")
        return tok
    if vocab_size == 256:
        return ByteTokenizer()
    where = f"{path} has no {VOCAB_FILE} + {MERGES_FILE} or {TOKENIZER_FILE}" if path else "no tokenizer directory was given"
    raise ConfigError(f"no tokenizer for a vocabulary of {vocab_size} tokens: {where}, and the byte tokenizer "
                      f"needs vocab_size 256; pass token ids instead (e.g. --prompt-ids)")
