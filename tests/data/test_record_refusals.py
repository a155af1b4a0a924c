"""prepare-data's refusals one at a time (issue 41's coverage), each one line naming the problem
and the fix: its settings (by the command line where a flag reaches them, by the API where
argparse's choices already refuse), its inputs and their records, an unreadable progress.json or
a resumed shard file that is gone, an unreadable tokenizer_config.json; and what it does beside:
`after_shard` sees every shard, a worker process runs one tokenizer thread, older tokenizer
configs' {"content": ...} special tokens, packing without document lengths or documents."""
import io
import json
import os

import numpy as np
import pytest

from cutp.data import prepare as prepare_module
from cutp.data.chat import check_messages
from cutp.data.dataset import BatchSampler, Dataset
from cutp.data.packing import PackedSplit
from cutp.data.prepare import main as prepare_main
from cutp.data.prepare import prepare
from cutp.data.records import RecordSettings, documents, input_files, records_of
from cutp.data.shards import ShardWriter
from cutp.data.tokenizer import ByteTokenizer, _special_ids, read_json_object
from cutp.runtime.errors import ConfigError


@pytest.mark.parametrize("flag, value, message", [
    ("--max-seq-len", "1", "--max-seq-len must be an integer >= 2, got 1"),
    ("--shard-tokens", "0", "--shard-tokens must be an integer >= 1, got 0"),
    ("--workers", "0", "--workers must be >= 1, got 0"),
])
def test_prepare_data_refuses_a_bad_count_in_one_line(tmp_path, capsys, flag, value, message):
    (tmp_path / "a.txt").write_text("text")
    out = tmp_path / "out"
    assert prepare_main([str(tmp_path / "a.txt"), "--tokenizer", "bytes", "--out", str(out), flag, value]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"prepare-data: error: {message}"]
    assert not out.exists()


@pytest.mark.parametrize("field, value", [("format", "csv"), ("train_on", "user"), ("too_long", "split"),
                                          ("max_seq_len", 2.5)])
def test_record_settings_refuse_what_the_command_line_choices_refuse(field, value):
    """(argparse's choices refuse the first three before them: these checks are for API callers)"""
    with pytest.raises(ConfigError, match=rf"^{field} must be .*, got {value!r}$"):
        RecordSettings(**{field: value}).check()


def _write(path, lines) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_inputs_and_records_that_cannot_be_read_are_named_by_file_and_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=rf"^input folder {tmp_path / 'empty'} holds no files$"):
        input_files([str(tmp_path / "empty")])
    texts = _write(tmp_path / "t.jsonl", ['{"text": "a"}', '{"text": 3}'])
    with pytest.raises(ConfigError, match=rf"^{texts}:2: 'text' is a int, not a string$"):
        list(documents([texts], "text"))
    chat = RecordSettings(format="chat")
    with pytest.raises(ConfigError, match=r"^input .*t\.txt: --format chat reads JSONL files \(one record a line\); "
                                          r"give \.jsonl files or --format text$"):
        list(records_of([_write(tmp_path / "t.txt", ["hello"])], chat))
    good = '{"messages": [{"role": "user", "content": "hi"}]}'
    for n, (bad, problem) in enumerate([("{oops", "not a JSON object; fix the line"),
                                        ("[1, 2]", "not a JSON object; fix the line"),
                                        ('{"turns": []}', "no 'messages' key; give the messages' key with messages_key"),
                                        ('{"messages": []}', '"messages" must be a non-empty list of objects with a '
                                                             'string "role"')]):
        path = _write(tmp_path / f"c{n}.jsonl", [good, "", "  ", bad])  # blank lines are skipped, and counted
        with pytest.raises(ConfigError) as e:
            list(records_of([path], chat))
        assert str(e.value) == f"{path}:4: {problem}"
    path = _write(tmp_path / "ok.jsonl", [good, "", good])
    assert [where for _, _, where in records_of([path], chat)] == [f"{path}:1", f"{path}:3"]


def test_a_message_s_reasoning_is_filled_under_every_name_templates_read(tmp_path):
    out = check_messages([{"role": "assistant", "content": "4", "reasoning": "2+2", "tool_calls": None}], "x")
    assert out == [{"thinking": "2+2", "role": "assistant", "content": "4", "reasoning": "2+2",
                    "reasoning_content": "2+2"}]


def test_after_shard_sees_every_shard_the_last_one_at_close(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(4):
        (tmp_path / "in" / f"{i}.txt").write_text(f"doc {i} " + "words " * 100)
    seen = []
    meta = prepare([str(tmp_path / "in")], "bytes", str(tmp_path / "out"), shard_tokens=1000, val_fraction=0.3,
                   workers=1, after_shard=seen.append, stream=io.StringIO())
    written = [s["file"] for split in ("train", "val") for s in meta["splits"][split]["shards"]]
    assert sorted(seen) == sorted(written) and len(written) >= 3
    # the last shard of each split (a partial one) is finished by close, and reported there too
    assert {f"train_{len(meta['splits']['train']['shards']) - 1:06d}.bin", "val_000000.bin"} <= set(seen)


def test_an_unreadable_progress_json_is_refused_with_the_fix(tmp_path):
    (tmp_path / "a.txt").write_text("text " * 50)
    out = tmp_path / "out"
    out.mkdir()
    (out / "progress.json").write_text("{cut")
    with pytest.raises(ConfigError, match=rf"^out {out}: progress.json is unreadable \(.*\); add overwrite to "
                                          "start again$"):
        prepare([str(tmp_path / "a.txt")], "bytes", str(out), workers=1, val_fraction=0.5, stream=io.StringIO())


def test_a_resumed_shard_file_that_is_gone_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"train_000001\.bin\.tmp is missing or shorter than progress\.json says; "
                                          "start again with overwrite$"):
        ShardWriter(str(tmp_path), "train", np.dtype(np.uint16), 100, state={"shards": ["x"], "tmp_tokens": 5})


def test_a_worker_process_runs_one_tokenizer_thread(monkeypatch):
    """(--workers N: each worker loads the tokenizer by its argument and stops its own thread pool)"""
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setattr(prepare_module, "_WORKER", {})
    prepare_module._init_worker("bytes", "uint16")
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    assert isinstance(prepare_module._WORKER["tok"], ByteTokenizer) and prepare_module._WORKER["dtype"] == np.uint16
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    prepare_module._init_worker(ByteTokenizer(), "uint16")  # one worker: this process, its environment untouched
    assert "TOKENIZERS_PARALLELISM" not in os.environ


class _Vocab:
    ids = {"<s>": 1, "</s>": 2}

    def token_to_id(self, token):
        return self.ids.get(token)


def test_tokenizer_configs_special_tokens_as_content_objects_and_unreadable_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>", "lstrip": False},
                                                                "eos_token": "</s>"}))
    assert _special_ids(str(tmp_path), _Vocab()) == (1, 2)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'config.json'} is not readable JSON \(.*\); fix or remove it$"):
        read_json_object(str(tmp_path / "config.json"))


def test_packing_needs_document_lengths_and_documents():
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(ConfigError, match=r"^pack needs each document's length: give data a directory written by "):
        BatchSampler(Dataset(tokens, tokens, 256, "x"), 8, 2, 1, 0, 2, pack=True)
    with pytest.raises(ConfigError, match=r"^pack: the val split has no documents; give more data$"):
        PackedSplit(np.zeros(0, np.int64), 8, "val")
