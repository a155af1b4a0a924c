"""Damaged prepared data, one problem at a time (issue 41's coverage): verify-data names each
(a missing, cut or recounted shard; an id outside the vocabulary under an intact digest; side
files cut, recounted or holding a flag of 2); opening the data refuses what meta.json does not
say, naming the file and the fix; a shard's index and slice reads, empty shards and side files,
and a split's sampled fingerprint beyond FULL_HASH_BYTES."""
import hashlib
import json
import runpy
import shutil
import sys
import warnings

import numpy as np
import pytest

from cutp.data import dataset as dataset_module
from cutp.data.dataset import Dataset, default_corpus
from cutp.data.shards import (DOCS_EXT, HEADER_BYTES, MASK_EXT, ShardedTokens, _header_bytes, is_shard, load_side,
                              load_split, read_meta, read_shard, read_side, write_shard)
from cutp.data.verify import main as verify_main
from cutp.data.verify import shard_problem, side_problem
from cutp.runtime.errors import ConfigError


def _digest(values) -> str:
    return hashlib.blake2b(np.ascontiguousarray(values).tobytes(), digest_size=16).hexdigest()


def _side(path, ext, values) -> str:
    values = np.asarray(values, {MASK_EXT: np.uint8, DOCS_EXT: np.uint32}[ext])
    path.write_bytes(_header_bytes(values.dtype, values.size, ext) + values.astype(values.dtype.newbyteorder("<"),
                                                                                    copy=False).tobytes())
    return str(path)


def test_verify_names_each_problem_of_a_shard(tmp_path):
    ids = np.array([1, 2, 300, 4, 500], np.uint16)
    path = str(tmp_path / "s.bin")
    digest = write_shard(path, ids)
    entry = {"tokens": 5, "blake2b": digest}
    assert shard_problem(path, entry, 1000) is None
    # an id outside the vocabulary, the digest intact: its position and value named
    assert shard_problem(path, entry, 256) == f"{path}: token 2 is id 300, outside the vocabulary of 256"
    # the digest differs too: the first bad id is named as the likely change
    assert shard_problem(path, dict(entry, blake2b="0" * 32), 256) == (
        f"{path}: its blake2b digest differs from meta.json's (the shard was changed after prepare-data; token 2 is "
        "id 300, outside the vocabulary of 256)")
    assert shard_problem(path, dict(entry, tokens=6), 1000) == f"{path}: 5 tokens, meta.json says 6"
    assert shard_problem(str(tmp_path / "none.bin"), entry, 1000) == f"{tmp_path / 'none.bin'}: missing"
    with open(path, "r+b") as f:  # cut: the header's count no longer matches the size
        f.truncate(HEADER_BYTES + 6)
    assert shard_problem(path, entry, 1000) == f"{path}: not a complete token shard (its header or its size is wrong)"
    assert not is_shard(path) and not is_shard(str(tmp_path / "none.bin"))


def test_verify_names_each_problem_of_a_side_file(tmp_path):
    mask = _side(tmp_path / "m.mask", MASK_EXT, [0, 1, 1, 0])
    entry = {"tokens": 4, "blake2b": _digest(np.array([0, 1, 1, 0], np.uint8))}
    assert side_problem(mask, entry, MASK_EXT) is None
    assert side_problem(mask, dict(entry, tokens=3), MASK_EXT) == f"{mask}: 4 entries, meta.json says 3"
    bad = _side(tmp_path / "b.mask", MASK_EXT, [0, 2, 1, 0])
    assert side_problem(bad, {"tokens": 4, "blake2b": _digest(np.array([0, 2, 1, 0], np.uint8))}, MASK_EXT) == (
        f"{bad}: a target flag is 2, not 0 or 1")
    docs = _side(tmp_path / "d.docs", DOCS_EXT, [3, 4])
    with open(docs, "r+b") as f:
        f.truncate(HEADER_BYTES + 5)
    # read_side's refusal, without its fix (verify-data prints one fix for all)
    assert side_problem(docs, {"tokens": 2}, DOCS_EXT) == (
        f"{docs} is not a complete {DOCS_EXT} file of prepare-data (header or size wrong)")


def test_verify_data_names_an_unreadable_meta_json_in_one_line(prepared, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    (data / "meta.json").write_text("{not json")
    assert verify_main([str(data)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"verify-data: error: data {data}: meta.json is not readable JSON (")
    assert err[0].endswith("); prepare the data again")
    # python -m cutp.data.verify runs the same main
    with pytest.raises(SystemExit) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (runpy: the module is imported already)
        sys_argv = sys.argv
        sys.argv = ["verify", str(prepared)]
        try:
            runpy.run_module("cutp.data.verify", run_name="__main__")
        finally:
            sys.argv = sys_argv
    assert e.value.code == 0 and "every digest matches meta.json" in capsys.readouterr().out


def test_opening_data_refuses_what_meta_json_does_not_say(prepared, tmp_path):
    meta = read_meta(str(prepared))
    d = str(prepared)
    train = load_split(d, meta, "train")
    assert len(train) == meta["splits"]["train"]["tokens"]
    first = meta["splits"]["train"]["shards"][0]
    recounted = json.loads(json.dumps(meta))
    recounted["splits"]["train"]["shards"][0]["tokens"] += 1
    n = first["tokens"]
    with pytest.raises(ConfigError, match=rf"^{prepared / first['file']} holds {n:,} tokens, meta.json says {n + 1:,}; "
                                          "prepare the data again$"):
        load_split(d, recounted, "train")
    total = json.loads(json.dumps(meta))
    total["splits"]["train"]["tokens"] += 7
    with pytest.raises(ConfigError, match=rf"the train shards hold {len(train):,} tokens, meta.json says "
                                          rf"{len(train) + 7:,}; prepare the data again$"):
        load_split(d, total, "train")
    docs = json.loads(json.dumps(meta))
    docs["splits"]["val"]["docs"][0]["tokens"] += 1
    with pytest.raises(ConfigError, match=r"val_000000\.docs holds 2 entries, meta\.json says 3; prepare the data again$"):
        load_side(d, docs, "val", "docs")
    for text, problem in (("[1, 2]", 'meta.json is not prepare-data\'s \\(no "format": "cutp-token-shards"\\)$'),
                          ("{", "meta.json is not readable JSON .*; prepare the data again$"),
                          ('{"format": "cutp-token-shards", "version": 99}',
                           "format version 99, this cutp reads .*; prepare the data again with this version$")):
        bad = tmp_path / f"bad{len(text)}"
        bad.mkdir()
        (bad / "meta.json").write_text(text)
        with pytest.raises(ConfigError, match=rf"^data {bad}: " + problem):
            read_meta(str(bad))
    with pytest.raises(ConfigError, match=r"none\.bin is not a complete token shard .*prepare-data$"):
        read_shard(str(tmp_path / "none.bin"))


def test_empty_shards_and_side_files_read_as_empty_arrays(tmp_path):
    write_shard(str(tmp_path / "e.bin"), np.zeros(0, np.uint32))
    out = read_shard(str(tmp_path / "e.bin"))
    assert out.dtype == np.uint32 and out.size == 0
    side = read_side(_side(tmp_path / "e.docs", DOCS_EXT, []), DOCS_EXT)
    assert side.dtype == np.uint32 and side.size == 0


def test_sharded_tokens_reads_an_index_or_a_contiguous_slice_only():
    parts = [np.arange(0, 5, dtype=np.uint16), np.arange(5, 12, dtype=np.uint16)]
    tokens = ShardedTokens(parts)
    whole = np.concatenate(parts)
    assert [int(tokens[i]) for i in (0, 4, 5, 11, -1, -12)] == [int(whole[i]) for i in (0, 4, 5, 11, -1, -12)]
    assert np.array_equal(tokens[3:9], whole[3:9]) and tokens[7:7].size == 0
    # in memory (no files): the fingerprint hashes each part's digest, length, first and last block
    assert ShardedTokens(parts, ["d0", "d1"]).fingerprint_bytes() == (
        b"<u2:12;d0:5;" + parts[0].tobytes() * 2 + b"d1:7;" + parts[1].tobytes() * 2)
    for i in (12, -13):
        with pytest.raises(IndexError, match=f"token {i} of a split of 12"):
            tokens[i]
    for key in (slice(0, 8, 2), "3"):
        with pytest.raises(TypeError, match="ShardedTokens takes an index or a contiguous slice"):
            tokens[key]


def test_a_split_beyond_full_hash_bytes_is_fingerprinted_by_sampled_blocks(monkeypatch):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 256, 1 << 18).astype(np.uint8), rng.integers(0, 256, 1000).astype(np.uint8)
    full = Dataset(train, val, 256, "x").fingerprint()
    monkeypatch.setattr(dataset_module, "FULL_HASH_BYTES", 1 << 16)
    sampled = Dataset(train, val, 256, "x").fingerprint()
    assert sampled != full  # (the sampled blocks and the length, not every byte)
    changed = train.copy()
    changed[0] ^= 1  # the first block is always sampled
    assert Dataset(changed, val, 256, "x").fingerprint() != sampled
    with pytest.raises(ValueError, match="split must be 'train' or 'val', got 'test'"):
        Dataset(train, val, 256, "x").split("test")


def test_the_default_corpus_skips_unreadable_files_and_refuses_too_few(monkeypatch, tmp_path):
    files = dataset_module.stdlib_source_files()[:200]
    monkeypatch.setattr(dataset_module, "stdlib_source_files", lambda: [str(tmp_path / "gone.py")] + files)
    got = default_corpus()
    assert "(200 files," in got.description and len(got.train) + len(got.val) > 0
    monkeypatch.setattr(dataset_module, "stdlib_source_files", lambda: [])
    with pytest.raises(RuntimeError, match="has too few source files for a corpus; pass a text file as data$"):
        default_corpus()
