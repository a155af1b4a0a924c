"""python -m cutp prepare-data (cutp.data.prepare) and its shards (cutp.data.shards): a folder of
text files and JSONL, a 70,000-token Llama-3-style tokenizer (uint32 tokens), counts in meta.json
equal to what the shards hold, the same bytes for 1 and 2 workers, a run killed after a shard
and run again identical to an uninterrupted one, and the loader's memory-mapped view."""
import io
import json
import math
import os

import numpy as np
import pytest

from cutp.data import BatchSampler, ShardedTokens, load_dataset, read_shard, write_shard
from cutp.data.prepare import prepare
from cutp.data.shards import HEADER_BYTES, is_shard, load_side
from cutp.data.tokenizer import load_tokenizer
from cutp.runtime.errors import ConfigError
from tests.data import tokenizer_files

pytest.importorskip("tokenizers", reason="the tokenizers library is not installed (pip install tokenizers)")

N_TEXT, N_JSONL, VAL = 24, 60, 0.05
SETTINGS = dict(shard_tokens=30_000, val_fraction=VAL, batch_bytes=40_000)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~1 MB: 24 text files (one nested), a JSONL file of 60 documents, a hidden file (skipped)."""
    root = tmp_path_factory.mktemp("corpus")
    lines = tokenizer_files.corpus_lines(1 << 20)
    (root / "in" / "nested").mkdir(parents=True)
    for i in range(N_TEXT):
        text = "".join(lines[i * 300:(i + 1) * 300])
        (root / "in" / ("nested" if i == 5 else "") / f"f{i:02d}.txt").write_text(text, encoding="utf-8")
    with open(root / "in" / "zz.jsonl", "w", encoding="utf-8") as f:
        for i in range(N_JSONL):
            f.write(json.dumps({"id": i, "text": "".join(lines[8000 + i * 40:8000 + (i + 1) * 40])}) + "\n")
            if i == 7:
                f.write("\n")  # blank lines are skipped
    (root / "in" / ".hidden.txt").write_text("never read")
    tok = tokenizer_files.llama3_style(str(root / "llama3"), vocab_size=70_000)
    ref = root / "ref"
    meta = prepare([str(root / "in")], tok, str(ref), workers=2, stream=io.StringIO(), **SETTINGS)
    return root, tok, ref, meta


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _documents_in_order(root):
    """The documents as prepare-data reads them: the folder walked sorted (files before nested/)."""
    from cutp.data.prepare import documents, input_files

    return [t for t, _ in documents(input_files([str(root / "in")]), "text")]


def test_shards_hold_what_meta_json_counts(corpus):
    root, tok_dir, ref, meta = corpus
    tok = load_tokenizer(tok_dir)
    docs = _documents_in_order(root)
    n = len(docs)
    assert n == N_TEXT + N_JSONL == meta["documents"]
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000  # BOS 69998 / EOS 69999 need 32 bits
    assert meta["tokenizer"] == {**tok.identity(), "path": tok_dir}
    val_docs = [i for i in range(n) if math.ceil((i + 1) * VAL) > math.ceil(i * VAL)]
    assert meta["splits"]["val"]["documents"] == len(val_docs) == math.ceil(n * VAL)
    assert meta["splits"]["train"]["documents"] == n - len(val_docs)
    for split in ("train", "val"):
        info = meta["splits"][split]
        arrays = [read_shard(str(ref / s["file"])) for s in info["shards"]]
        assert [len(a) for a in arrays[:-1]] == [SETTINGS["shard_tokens"]] * (len(arrays) - 1)
        assert [len(a) for a in arrays] == [s["tokens"] for s in info["shards"]]
        stream = np.concatenate(arrays)
        assert len(stream) == info["tokens"] and all(a.dtype == np.uint32 for a in arrays)
        # each document: BOS (the template's), its text's ids, EOS
        assert int((stream == 69999).sum()) == int((stream == 69998).sum()) == info["documents"]
        chosen = val_docs if split == "val" else [i for i in range(n) if i not in val_docs]
        want = np.concatenate([tok.encode(docs[i]) + [69999] for i in chosen])
        np.testing.assert_array_equal(stream, want)
    assert meta["tokens"] == meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    assert len(meta["splits"]["train"]["shards"]) >= 4 and sorted(_files(ref)) == sorted(
        ["meta.json"] + [s["file"] for sp in meta["splits"].values() for s in sp["shards"] + sp["docs"]])
    for split in ("train", "val"):  # each document's length beside the tokens (version 2), no masks for text
        info = meta["splits"][split]
        lengths = load_side(str(ref), meta, split, "docs")
        assert len(lengths) == info["documents"] and int(lengths.sum()) == info["tokens"] and "masks" not in info


def test_the_loader_maps_the_shards_as_one_stream(corpus):
    _, tok_dir, ref, meta = corpus
    d = load_dataset(str(ref))
    assert isinstance(d.train, ShardedTokens) and all(isinstance(s, np.memmap) for s in d.train.shards)
    assert d.vocab_size == 70_000 and d.tokenizer == meta["tokenizer"] and len(d.train) == meta["splits"]["train"]["tokens"]
    whole = np.concatenate([np.asarray(s) for s in d.train.shards])
    S = SETTINGS["shard_tokens"]
    for a, b in ((S - 5, S + 7), (0, 3), (S - 1, 3 * S + 2), (len(whole) - 4, len(whole)), (S, S)):
        np.testing.assert_array_equal(d.train[a:b], whole[a:b])  # windows cross shard boundaries
    assert d.train[S] == whole[S] and d.train[-1] == whole[-1]
    x, y = next(BatchSampler(d, 64, 8, 1, 0, 8, seed=1).micro_batches(0))
    assert x.shape == (8, 64) and x.dtype == np.int64 and x.max() < 70_000
    assert d.fingerprint() == load_dataset(str(ref)).fingerprint()


def test_one_and_two_workers_write_the_same_bytes(corpus, tmp_path):
    root, tok, ref, _ = corpus
    prepare([str(root / "in")], tok, str(tmp_path / "w1"), workers=1, stream=io.StringIO(), **SETTINGS)
    assert _files(tmp_path / "w1") == _files(ref)


def test_killed_after_a_shard_then_rerun_is_complete_and_identical(corpus, tmp_path):
    root, tok, ref, _ = corpus
    out = tmp_path / "out"
    finished = []

    def kill_at_the_third(name):
        finished.append(name)
        if len(finished) == 3:
            raise KeyboardInterrupt  # after the rename, before progress.json records the shard

    with pytest.raises(KeyboardInterrupt):
        prepare([str(root / "in")], tok, str(out), workers=2, after_shard=kill_at_the_third, stream=io.StringIO(),
                **SETTINGS)
    assert not (out / "meta.json").exists() and (out / "progress.json").exists()
    with pytest.raises(ConfigError, match="unfinished preparation: run the same prepare-data command again"):
        load_dataset(str(out))
    (out / "train_000009.bin.tmp").write_bytes(b"half a shard")  # a leftover the rerun must not keep
    log = io.StringIO()
    meta = prepare([str(root / "in")], tok, str(out), workers=1, stream=log, **SETTINGS)
    assert "resumed:" in log.getvalue() and " 0.0 MB skipped" not in log.getvalue()  # not encoded again
    assert _files(out) == _files(ref) and meta == json.loads((ref / "meta.json").read_text())


def test_output_directory_rules(corpus, tmp_path):
    root, tok = corpus[0], "bytes"
    inputs = [str(root / "in" / "f00.txt"), str(root / "in" / "f01.txt")]
    out = str(tmp_path / "o")
    prepare(inputs, tok, out, workers=1, stream=io.StringIO(), val_fraction=0.5)
    with pytest.raises(ConfigError, match="already holds prepared data.*add overwrite to replace it"):
        prepare(inputs, tok, out, workers=1, stream=io.StringIO(), val_fraction=0.5)
    meta = prepare(inputs[::-1], tok, out, workers=1, stream=io.StringIO(), val_fraction=0.5, overwrite=True)
    assert meta["documents"] == 2 and meta["inputs"] == inputs[::-1]
    os.remove(os.path.join(out, "meta.json"))
    (tmp_path / "o" / "progress.json").write_text(json.dumps({"settings": {"other": 1}}))
    with pytest.raises(ConfigError, match="unfinished preparation with other inputs or settings"):
        prepare(inputs, tok, out, workers=1, stream=io.StringIO(), val_fraction=0.5)
    inside = tmp_path / "texts"
    inside.mkdir()
    for i in range(3):
        (inside / f"{i}.txt").write_text(f"document {i}")
    for _ in range(2):  # the output inside the input folder is not read as input
        assert prepare([str(inside)], tok, str(inside / "tokens"), workers=1, val_fraction=0.5, overwrite=True,
                       stream=io.StringIO())["documents"] == 3
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="holds files prepare-data did not write"):
        prepare(inputs, tok, str(tmp_path / "mine"), workers=1, overwrite=True, stream=io.StringIO())
    # an existing file as `out`: a FileExistsError traceback before (found by a review helper, F6)
    with pytest.raises(ConfigError, match="notes.txt is a file, not a directory; choose a new or empty directory"):
        prepare(inputs, tok, str(tmp_path / "mine" / "notes.txt"), workers=1, stream=io.StringIO())


def test_a_preparation_refused_on_its_inputs_leaves_no_half_made_out(corpus, tmp_path):
    """It left progress.json (and shards): the corrected command was then refused as "an unfinished
    preparation with other inputs", and --data called the directory unfinished (found by a review
    helper, F6). A directory that was there stays, emptied of what this run wrote."""
    root, tok = corpus[0], "bytes"
    one = [str(root / "in" / "f00.txt")]  # one document: the train split has none
    with pytest.raises(ConfigError, match="the train split has no documents"):
        prepare(one, tok, str(tmp_path / "new"), workers=1, stream=io.StringIO())
    assert not os.path.exists(tmp_path / "new")
    (tmp_path / "there").mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    with pytest.raises(ConfigError, match="not a JSON object with a string 'text'"):
        prepare([str(bad)], tok, str(tmp_path / "there"), workers=1, stream=io.StringIO())
    assert os.listdir(tmp_path / "there") == []
    inputs = one + [str(root / "in" / "f01.txt")]  # corrected: it starts afresh
    assert prepare(inputs, tok, str(tmp_path / "new"), workers=1, stream=io.StringIO(), val_fraction=0.5)["documents"] == 2


def test_bad_inputs_are_named(corpus, tmp_path, capsys):
    root, tok = corpus[0], "bytes"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    from cutp.__main__ import main as cutp_main  # python -m cutp prepare-data

    assert cutp_main(["prepare-data", str(bad), "--tokenizer", tok, "--out", str(tmp_path / "o1"), "--workers", "1"]) == 2
    assert capsys.readouterr().err.strip() == (f"prepare-data: error: {bad}:2: not a JSON object with a string "
                                               "'text'; fix the line or give the key with --text-key")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    for args, message in (([str(tmp_path / "latin1.txt")], r"latin1.txt is not UTF-8 text \(byte 3\)"),
                          ([str(tmp_path / "nothing")], "no such file or folder"),
                          ([str(root / "in" / "f00.txt")], "the train split has no documents")):
        with pytest.raises(ConfigError, match=message):
            prepare(args, tok, str(tmp_path / "o3"), workers=1, stream=io.StringIO(), overwrite=True)
    with pytest.raises(ConfigError, match=r"val_fraction must be in \(0, 1\)"):
        prepare(args, tok, str(tmp_path / "o3"), val_fraction=0.0)


def test_bytes_tokenizer_and_llm_c_files(tmp_path):
    docs = ["héllo\n", "<|endoftext|> is text here", "third"]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d, encoding="utf-8")
    meta = prepare([str(tmp_path / f"{i}.txt") for i in range(3)], "bytes", str(tmp_path / "out"), workers=1,
                   val_fraction=0.4, shard_tokens=8, stream=io.StringIO())
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["name"] == "bytes" and meta["vocab_size"] == 256
    d = load_dataset(str(tmp_path / "out"))
    # no EOS in 256 byte ids: documents concatenated as they are (doc 0 and 2 validation at 0.4)
    assert bytes(d.val[0:len(d.val)].astype(np.uint8)) == (docs[0] + docs[2]).encode()
    assert bytes(d.train[0:len(d.train)].astype(np.uint8)) == docs[1].encode()
    # one llm.c-style shard given as --data FILE: its header read, its tokens uint32
    tokens = np.arange(70_000, 72_000, dtype=np.uint32)
    write_shard(str(tmp_path / "one.bin"), tokens)
    raw = (tmp_path / "one.bin").read_bytes()
    assert np.frombuffer(raw[:16], "<i4").tolist() == [20240801, 7, 2000, 4] and len(raw) == HEADER_BYTES + 8000
    assert is_shard(str(tmp_path / "one.bin")) and not is_shard(str(tmp_path / "0.txt"))
    d = load_dataset(str(tmp_path / "one.bin"))
    assert d.vocab_size == 71_999 + 1 and int(d.train[0]) == 70_000 and len(d.train) + len(d.val) == 2000
    (tmp_path / "one.bin").write_bytes(raw[:-4])  # cut short: a raw uint16 file now, read as nanoGPT's
    assert not is_shard(str(tmp_path / "one.bin"))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_one_line_otherwise_and_special_tokens_as_text(corpus, tmp_path):
    _, tok_dir, _, _ = corpus
    docs = ["a <|end_of_text|> b", "<|begin_of_text|>", "plain"]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    files = [str(tmp_path / f"{i}.txt") for i in range(3)]
    term, log = _Terminal(), io.StringIO()
    prepare(files, tok_dir, str(tmp_path / "a"), workers=1, val_fraction=0.3, stream=term)
    assert term.getvalue().startswith("\rprepare-data: ") and " tokens/s, ETA " in term.getvalue()
    meta = prepare(files, tok_dir, str(tmp_path / "b"), workers=1, val_fraction=0.3, stream=log)
    assert log.getvalue().count("\n") == 1 and log.getvalue().startswith(
        f"prepare-data: {meta['tokens']:,} uint32 tokens of 3 documents (train ")
    d = load_dataset(str(tmp_path / "b"))
    both = np.concatenate([d.val[0:len(d.val)], d.train[0:len(d.train)]])
    # one BOS and one EOS per document: the special tokens written in the texts are text
    assert int((both == 69998).sum()) == int((both == 69999).sum()) == 3
