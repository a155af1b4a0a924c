"""Tokenizer directories built offline, as Hugging Face model directories hold them.

- `gpt2_style`: GPT-2's byte-level BPE (ByteLevel pre-tokenizer, <|endoftext|> last, no BOS);
- `llama3_style`: Llama 3's (its Split regex then ByteLevel, ignore_merges, BOS prepended by a
  TemplateProcessing post-processor, BOS/EOS ids at the end of a `vocab_size` vocabulary: 70,000
  puts them above 65,535);
- `sentencepiece_style`: Llama 2's / Mistral's SentencePiece conversion (a Prepend("▁") +
  Replace(" ", "▁") normalizer, no pre-tokenizer, BPE with byte fallback over <0xXX> tokens,
  <unk> <s> </s>, BOS by the template).

Each is trained with the `tokenizers` library's BpeTrainer on a slice of the embedded corpus
(the Python standard library's sources) and written as tokenizer.json with config.json and
tokenizer_config.json, so transformers' AutoTokenizer reads the directory as it reads a model's.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SAMPLE = ("Hello world! It's 2024, isn't it?\n\n  Tabs\tand   spaces  def f(x): return x ** 2\n"
          "naïve café — ½ ² Ⅻ 三 ١٢٣ émoji 😀👍🏽 I'M 'll 've're <|endoftext|> <s> end\r\n")


@lru_cache(maxsize=None)
def corpus_lines(max_bytes: int = 300_000) -> tuple:
    from cutp.data import default_corpus

    text = bytes(default_corpus(max_bytes=1 << 20).train[:max_bytes]).decode("utf-8", "replace")
    return tuple(text.splitlines(keepends=True))


def bytes_to_unicode() -> dict:
    """GPT-2's reversible map from the 256 byte values to printable characters (vocab.json's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _write(d, spec: dict, config: dict, tokenizer_config: dict) -> str:
    os.makedirs(d, exist_ok=True)
    for name, data in (("tokenizer.json", spec), ("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        with open(os.path.join(d, name), "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False)
    return str(d)


def _added(i, content):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def _template(bos: str, bos_id: int) -> dict:
    return {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def _train(model, pre_tokenizer, vocab_size: int, special_tokens=()) -> dict:
    from tokenizers import Tokenizer, pre_tokenizers, trainers

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, (pre_tokenizers.ByteLevel,
                                                                                  pre_tokenizers.Sequence)) else []
    tok.train_from_iterator(corpus_lines(), trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                                                special_tokens=list(special_tokens),
                                                                show_progress=False))
    return json.loads(tok.to_str())


def gpt2_style(d, vocab_size: int = 600) -> str:
    from tokenizers import models, pre_tokenizers

    spec = _train(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), vocab_size)
    eot = len(spec["model"]["vocab"])
    spec["added_tokens"] = [_added(eot, "<|endoftext|>")]
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return _write(d, spec, {"model_type": "gpt2", "bos_token_id": eot, "eos_token_id": eot},
                  {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                   "unk_token": "<|endoftext|>", "add_prefix_space": False, "model_max_length": 1024})


def llama3_style(d, vocab_size: int = 1000, trained: int = 600) -> str:
    """BOS = vocab_size - 2, EOS = vocab_size - 1; the ids between the trained tokens and them are
    unused vocabulary entries (Llama 3's reserved tokens, here without merges reaching them)."""
    from tokenizers import Regex, models, pre_tokenizers

    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                            use_regex=False)])
    spec = _train(models.BPE(ignore_merges=True), pre, trained)
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), vocab_size - 2):
        vocab[f"<|reserved_{i}|>"] = i
    bos, eos = vocab_size - 2, vocab_size - 1
    spec["added_tokens"] = [_added(bos, "<|begin_of_text|>"), _added(eos, "<|end_of_text|>")]
    spec["post_processor"] = _template("<|begin_of_text|>", bos)
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return _write(d, spec, {"model_type": "llama", "bos_token_id": bos, "eos_token_id": eos},
                  {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|end_of_text|>", "model_max_length": 131072})


def sentencepiece_style(d, vocab_size: int = 600) -> str:
    from tokenizers import models, pre_tokenizers

    spec = _train(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True),
                  pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"), vocab_size,
                  special_tokens=["<unk>", "<s>", "</s>"])
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["added_tokens"] = [_added(i, t) for i, t in enumerate(["<unk>", "<s>", "</s>"])]
    spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                              {"type": "Replace", "pattern": {"String": " "},
                                                               "content": "▁"}]}
    spec["pre_tokenizer"] = None
    spec["post_processor"] = _template("<s>", 1)
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return _write(d, spec, {"model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2},
                  {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": False})
