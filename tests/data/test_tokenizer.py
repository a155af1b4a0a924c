"""Tokenizers through the `tokenizers` library (cutp.data.tokenizer): GPT-2-, Llama-3- and
SentencePiece-style tokenizer.json files trained offline (tests/data/tokenizer_files.py) give
transformers' AutoTokenizer ids and text, BOS/EOS from the directories' config files, and an
identity that is the file's SHA-256."""
import hashlib

import pytest

from cutp.data.tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer, load_tokenizer, tokenizer_files_sha256
from cutp.runtime.errors import ConfigError
from tests.data import tokenizer_files

pytest.importorskip("tokenizers", reason="the tokenizers library is not installed (pip install tokenizers)")

STYLES = {"gpt2": tokenizer_files.gpt2_style, "llama3": tokenizer_files.llama3_style,
          "sentencepiece": tokenizer_files.sentencepiece_style}
TEXTS = [tokenizer_files.SAMPLE, "", " leading space", "def main():\n    return 0\n", "x" * 300]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: build(str(root / name)) for name, build in STYLES.items()}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_ids_and_text_are_autotokenizers(tokenizer_dirs, style):
    tok = load_tokenizer(tokenizer_dirs[style])
    assert isinstance(tok, HFTokenizer)
    ours = [tok.encode(t) for t in TEXTS]
    assert tok.encode_batch(TEXTS) == ours
    try:
        from transformers import AutoTokenizer
    except ImportError:
        pytest.skip("transformers is not installed: the ids were checked by the library alone")
    theirs = AutoTokenizer.from_pretrained(tokenizer_dirs[style])
    for text, ids in zip(TEXTS, ours):
        assert ids == theirs(text)["input_ids"], (style, text)
        assert tok.decode(ids) == theirs.decode(ids), (style, text)
    assert (tok.bos_id, tok.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)


def test_special_tokens_from_the_model_files(tokenizer_dirs):
    gpt2, llama, sp = (load_tokenizer(tokenizer_dirs[s]) for s in ("gpt2", "llama3", "sentencepiece"))
    text = "Hello world"
    # GPT-2: no BOS, <|endoftext|> (the last id) ends documents; its text round-trips
    assert gpt2.eos_id == gpt2.vocab_size - 1 and gpt2.encode(text)[0] != gpt2.eos_id
    assert gpt2.decode(gpt2.encode(tokenizer_files.SAMPLE)) == tokenizer_files.SAMPLE
    # Llama 3: the template prepends <|begin_of_text|>; BOS/EOS at the end of the vocabulary
    assert (llama.bos_id, llama.eos_id, llama.vocab_size) == (998, 999, 1000)
    assert llama.encode(text)[0] == 998 and llama.decode(llama.encode(text)) == "<|begin_of_text|>" + text
    # SentencePiece: <s> first, a leading "▁" from the normalizer, bytes it lacks as <0xXX>
    assert (sp.bos_id, sp.eos_id) == (1, 2) and sp.encode(text)[0] == 1
    ids = sp.encode("三")
    assert [sp.tokenizer.id_to_token(i) for i in ids[2:]] == ["<0xE4>", "<0xB8>", "<0x89>"]
    assert sp.decode(ids[1:]) == "三"
    # <|endoftext|> in the text is the special token (as transformers encodes it)
    assert gpt2.encode("a<|endoftext|>")[-1] == gpt2.eos_id


def test_identity_is_the_files_hash(tokenizer_dirs, tmp_path):
    d = tokenizer_dirs["llama3"]
    tok = load_tokenizer(d)
    with open(f"{d}/tokenizer.json", "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert tok.identity() == {"name": "llama3", "sha256": digest, "vocab_size": 1000, "bos_id": 998, "eos_id": 999}
    assert tokenizer_files_sha256(d) == digest and tokenizer_files_sha256(str(tmp_path)) is None
    assert load_tokenizer(f"{d}/tokenizer.json").identity()["sha256"] == digest
    assert ByteTokenizer().identity()["sha256"] is None and isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_unusable_tokenizers_are_refused(tokenizer_dirs, tmp_path):
    with pytest.raises(ConfigError, match="no such directory.*'bytes' for the byte tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ConfigError, match="has ids up to 999, but the model's vocabulary has 500 tokens"):
        get_tokenizer(tokenizer_dirs["llama3"], 500)
    assert get_tokenizer(tokenizer_dirs["llama3"], 1024).vocab_size == 1000  # a padded model vocabulary
    with pytest.raises(ValueError, match="token id 1000 is not in the tokenizer's vocabulary"):
        load_tokenizer(tokenizer_dirs["llama3"]).decode([5, 1000])


def test_missing_library_is_named(monkeypatch, tokenizer_dirs):
    import builtins

    real = builtins.__import__

    def no_tokenizers(name, *args, **kw):
        if name == "tokenizers":
            raise ImportError("No module named 'tokenizers'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    with pytest.raises(ConfigError, match=r"needs the tokenizers library: pip install tokenizers"):
        load_tokenizer(tokenizer_dirs["gpt2"])
