"""Chat data (issue 38): conversations rendered with Llama 3, Qwen2, Qwen3 and Gemma style chat
templates (tests/data/chat_templates.py) give the token ids and assistant masks transformers'
apply_chat_template gives, the prefix method on each family's own template (no {% generation %}
marks) the mask transformers computes from the marks; prepare-data --format chat / instruct
stores them with the shards (counting and dropping what it must); the sampler turns them into
-100 targets; packing places whole documents into windows."""
import io
import json
import os

import numpy as np
import pytest

from cutp.data import BatchSampler, load_dataset
from cutp.data.chat import ChatError, ChatTemplate, encode_chat
from cutp.data.packing import IGNORE, PackedSplit
from cutp.data.prepare import RecordSettings, prepare
from cutp.data.shards import load_side, read_meta
from cutp.data.tokenizer import load_tokenizer
from cutp.runtime.errors import ConfigError
from tests.data.chat_templates import CONVERSATIONS, FAMILIES, chat_tokenizer, conversations_for, write_jsonl

pytest.importorskip("tokenizers", reason="the tokenizers library is not installed (pip install tokenizers)")
pytest.importorskip("jinja2", reason="jinja2 is not installed (pip install jinja2): chat templates are Jinja")


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {(f, m): chat_tokenizer(str(root / f"{f}_{m}"), f, marked=m) for f in FAMILIES for m in (False, True)}


def _targets(tok, ids, mask):
    return "|".join(tok.decode([i]) for i, m in zip(ids, mask) if m)


def test_the_prefix_method_masks_the_assistant_turns_and_their_end_of_turn(tokenizers_dir):
    """Hand-checked: the targets are the assistant contents as the template writes them, each with
    its end-of-turn (and what the template writes after it before the next turn); nothing else."""
    expected = {
        "llama3": ["It is 4.<|eot_id|>", "Blue<|eot_id|>", "Green, or red.<|eot_id|>"],
        "qwen2": ["It is 4.<|im_end|>\n", "Blue<|im_end|>\n", " Green, or red.\n<|im_end|>\n"],
        "gemma": ["It is 4.<end_of_turn>\n", "A function <|eot_id|><end_of_turn>\n",  # (not Gemma's token: text)
                  "<think>\nok\n</think>\n\nYou're welcome<end_of_turn>\n"],
    }
    for family, turns in expected.items():
        d = tokenizers_dir[(family, False)]
        tok, template = load_tokenizer(d), ChatTemplate.from_dir(d)
        assert not template.marked
        got = []
        for conv in conversations_for(family)[:2]:
            ids, mask = encode_chat(tok, template, conv)
            text, spans = template.assistant_spans(conv)
            assert tok.tokenizer.encode(text, add_special_tokens=False).ids == ids
            got += [text[a:b] for a, b in spans]
            assert "".join(tok.decode([i]) for i, m in zip(ids, mask) if m) == "".join(text[a:b] for a, b in spans)
            assert mask.dtype == np.uint8 and 0 < mask.sum() < len(mask)
        assert got == turns, family
        # the role header and the user's turn are no targets; the template's BOS starts the text
        ids, mask = encode_chat(tok, template, CONVERSATIONS[0])
        assert mask[0] == 0 and (tok.bos_id is None or ids[0] == tok.bos_id)
        assert encode_chat(tok, template, CONVERSATIONS[0], "all")[1].all()


def test_qwen3_earlier_turns_are_found_although_rendered_otherwise_when_last(tokenizers_dir):
    """Qwen3's template writes <think>\\n\\n</think> before the last turn's answer only: an earlier
    turn, rendered alone as the last one, has it; in the whole conversation it has not."""
    d = tokenizers_dir[("qwen3", False)]
    tok, template = load_tokenizer(d), ChatTemplate.from_dir(d)
    conv = CONVERSATIONS[1]
    text, spans = template.assistant_spans(conv)
    assert "<think>" in template.render(conv[:3]) and [text[a:b] for a, b in spans] == [
        "Blue<|im_end|>\n", "<think>\n\n</think>\n\n Green, or red.\n<|im_end|>\n"]


# a conversation the assistant opens: its first turn starts after the template's BOS and role header
ASSISTANT_FIRST = [{"role": "assistant", "content": "Hello! What shall we add?"},
                   {"role": "user", "content": "2 and 2."}, {"role": "assistant", "content": "4."}]


def test_generation_marks_and_the_prefix_method_agree(tokenizers_dir):
    for family in FAMILIES:
        marked, plain = (ChatTemplate.from_dir(tokenizers_dir[(family, m)]) for m in (True, False))
        tok = load_tokenizer(tokenizers_dir[(family, False)])
        assert marked.marked
        for conv in conversations_for(family) + [ASSISTANT_FIRST]:
            try:
                a = encode_chat(tok, marked, conv)
            except ChatError:  # (Gemma's template refuses a conversation the user does not open)
                assert conv is ASSISTANT_FIRST and family == "gemma"
                continue
            b = encode_chat(tok, plain, conv)
            assert a[0] == b[0] and np.array_equal(a[1], b[1]), family
            if conv is ASSISTANT_FIRST:  # (BOS and the first role header are no targets)
                assert not b[1][:3].any() and b[1].sum() > 0, family
        assert plain.end_of_turn(tok) == tok.tokenizer.token_to_id(FAMILIES[family][2] if family != "gemma"
                                                                   else "<end_of_turn>")


def test_ids_and_masks_equal_transformers_apply_chat_template(tokenizers_dir):
    """transformers' return_assistant_tokens_mask needs {% generation %} marks: its mask on the marked
    template is the reference for ours on both; its ids on the family's own template equal ours."""
    pytest.importorskip("transformers", reason="transformers is not installed: the comparison with "
                                               "apply_chat_template needs it")
    from tests.transformers_compat import hide_cutp_kernels_from_transformers

    hide_cutp_kernels_from_transformers()
    from transformers import PreTrainedTokenizerFast  # (the directories' tokenizer_class: AutoTokenizer's choice)

    for family in FAMILIES:
        hf_marked = PreTrainedTokenizerFast.from_pretrained(tokenizers_dir[(family, True)])
        hf_plain = PreTrainedTokenizerFast.from_pretrained(tokenizers_dir[(family, False)])
        tok = load_tokenizer(tokenizers_dir[(family, False)])
        for marked in (False, True):
            template = ChatTemplate.from_dir(tokenizers_dir[(family, marked)])
            for conv in conversations_for(family):
                ids, mask = encode_chat(tok, template, conv)
                ref = hf_marked.apply_chat_template(conv, tokenize=True, return_assistant_tokens_mask=True,
                                                    return_dict=True)
                assert ids == list(ref["input_ids"]), family
                assert mask.tolist() == list(ref["assistant_masks"]), (family, marked)
                assert ids == list(hf_plain.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"])
                assert template.prompt_ids(tok, conv[-2]["content"]) == list(hf_plain.apply_chat_template(
                    [conv[-2]], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])


@pytest.fixture(scope="module")
def prepared(tokenizers_dir, tmp_path_factory):
    """Llama 3 style chat records: 3 conversations x 8, one without an assistant turn, one too long."""
    root = tmp_path_factory.mktemp("chat_data")
    records = [{"messages": c} for c in CONVERSATIONS] * 8
    records.insert(5, {"messages": [{"role": "user", "content": "no answer"}]})
    records.insert(9, {"messages": [{"role": "user", "content": "long " * 300},
                                    {"role": "assistant", "content": "ok"}]})
    src = write_jsonl(root / "chat.jsonl", records)
    tok_dir = tokenizers_dir[("llama3", False)]
    stream = io.StringIO()
    meta = prepare([src], tok_dir, str(root / "out"), val_fraction=0.2, workers=1, stream=stream,
                   records=RecordSettings("chat", max_seq_len=96))
    return root, tok_dir, meta, records, stream.getvalue()


def test_prepare_data_chat_stores_masks_beside_the_shards(prepared):
    root, tok_dir, meta, records, said = prepared
    tok, template = load_tokenizer(tok_dir), ChatTemplate.from_dir(tok_dir)
    assert meta["version"] == 2 and meta["records"]["format"] == "chat"
    assert meta["dropped"] == {"no_target": 1, "too_long": 1, "truncated": 0}
    assert "1 record(s) with no target token dropped; 1 longer than --max-seq-len 96 (0 truncated, 1 dropped)" in said
    kept = [i for i, r in enumerate(records) if i not in (5, 9)]
    assert meta["documents"] == len(kept)
    val = [i for i in range(len(records)) if i in kept and int(np.ceil((i + 1) * 0.2)) > int(np.ceil(i * 0.2))]
    for split, chosen in (("val", val), ("train", [i for i in kept if i not in val])):
        d = load_dataset(str(root / "out"))
        tokens, masks = np.asarray(d.split(split)[:]), np.asarray(d.masks[split][:])
        want = [encode_chat(tok, template, records[i]["messages"]) for i in chosen]
        np.testing.assert_array_equal(tokens, np.concatenate([w[0] for w in want]))
        np.testing.assert_array_equal(masks, np.concatenate([w[1] for w in want]))
        np.testing.assert_array_equal(d.doc_lengths[split], [len(w[0]) for w in want])
    assert "chat records, targets: assistant" in load_dataset(str(root / "out")).description


def test_truncation_instruct_records_and_refusals(prepared, tmp_path):
    root, tok_dir, _, records, _ = prepared
    meta = prepare([str(root / "chat.jsonl")], tok_dir, str(tmp_path / "t"), val_fraction=0.2, workers=1,
                   stream=io.StringIO(), records=RecordSettings("chat", max_seq_len=96, too_long="truncate"))
    # truncated to its prompt, no target is left: dropped, counted with those without one
    assert meta["dropped"] == {"no_target": 2, "too_long": 1, "truncated": 1}
    assert max(load_side(str(tmp_path / "t"), meta, "train", "docs")) <= 96
    src = write_jsonl(tmp_path / "inst.jsonl", [{"q": "Say hi", "a": "hi", "s": "Be kind."}] * 4)
    meta = prepare([src], tok_dir, str(tmp_path / "i"), val_fraction=0.25, workers=1, stream=io.StringIO(),
                   records=RecordSettings("instruct", prompt_key="q", response_key="a", system_key="s"))
    tok, template = load_tokenizer(tok_dir), ChatTemplate.from_dir(tok_dir)
    want = encode_chat(tok, template, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Say hi"},
                                       {"role": "assistant", "content": "hi"}])
    d = load_dataset(str(tmp_path / "i"))
    np.testing.assert_array_equal(np.asarray(d.masks["val"][:]), want[1])
    assert meta["splits"]["train"]["documents"] == 3
    with pytest.raises(ConfigError, match=r"inst.jsonl:1: no string 'response'"):
        prepare([src], tok_dir, str(tmp_path / "j"), workers=1, stream=io.StringIO(),
                records=RecordSettings("instruct", prompt_key="q"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "system", "content": "x"}]}])
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: the chat template refuses the conversation: System role"):
        prepare([bad], chat_tokenizer(str(tmp_path / "g"), "gemma"), str(tmp_path / "k"), workers=1,
                stream=io.StringIO(), records=RecordSettings("chat"))
    with pytest.raises(ConfigError, match="has no chat template"):
        prepare([src], load_tokenizer_dir_without_template(tmp_path, tok_dir), str(tmp_path / "l"), workers=1,
                stream=io.StringIO(), records=RecordSettings("instruct", prompt_key="q", response_key="a"))


def load_tokenizer_dir_without_template(tmp_path, tok_dir):
    d = tmp_path / "plain"
    d.mkdir()
    for name in os.listdir(tok_dir):
        data = json.loads(open(os.path.join(tok_dir, name), encoding="utf-8").read())
        data.pop("chat_template", None)
        (d / name).write_text(json.dumps(data), encoding="utf-8")
    return str(d)


def test_an_old_reader_refuses_a_newer_format_by_name(prepared, tmp_path):
    root = prepared[0]
    meta = json.loads((root / "out" / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "version": 3}))
    with pytest.raises(ConfigError, match=r"format version 3, this cutp reads 1 and 2; prepare the data again"):
        read_meta(str(tmp_path))


def test_the_sampler_ignores_the_targets_that_are_not_trained_on(prepared):
    root = prepared[0]
    d = load_dataset(str(root / "out"))
    sampler = BatchSampler(d, 32, 8, 1, 0, 4, seed=1)
    offs = sampler.global_offsets(3)
    rows = [y for _, y in sampler.micro_batches(3)]
    ys = np.concatenate(rows)
    for r, o in enumerate(offs):
        flags = np.asarray(d.masks["train"][o + 1:o + 33])
        tokens = np.asarray(d.train[o + 1:o + 33], np.int64)
        np.testing.assert_array_equal(ys[r], np.where(flags == 1, tokens, IGNORE))
    assert (ys == IGNORE).any() and (ys != IGNORE).any()


def test_packing_places_whole_documents_with_their_ids(prepared):
    root = prepared[0]
    d = load_dataset(str(root / "out"))
    T = 128
    lengths = np.asarray(d.doc_lengths["train"])
    packed = PackedSplit(lengths, T, "train")
    assert packed.count.sum() == len(lengths) and len(packed) < len(lengths)
    for w in range(len(packed)):
        a, b = packed.span(w)
        assert b - a <= T and (w + 1 == len(packed) or b - a + lengths[packed.first[w + 1]] > T)  # next-fit
    sampler = BatchSampler(d, T, 4, 2, 1, 2, seed=0, pack=True)
    batch = next(sampler.micro_batches(0))
    x, y = batch
    for r, w in enumerate(sampler.global_offsets(0)[2:4]):
        a, b = packed.span(int(w))
        f, c = int(packed.first[w]), int(packed.count[w])
        n = b - a
        np.testing.assert_array_equal(x[r, :n], np.asarray(d.train[a:b]))
        docs = batch.documents[r]
        assert batch.documents.dtype == np.int32 and (np.diff(docs) >= 0).all() and docs[-1] == c  # padding: id c
        np.testing.assert_array_equal(np.bincount(docs[:n], minlength=c), lengths[f:f + c])
        mask = np.asarray(d.masks["train"][a:b])
        want = np.full(T, IGNORE)
        for k in range(n - 1):
            if docs[k + 1] == docs[k] and mask[k + 1]:
                want[k] = x[r, k + 1]
        np.testing.assert_array_equal(y[r], want)  # -100 at each document's last token, padding, untrained
    with pytest.raises(ConfigError, match=r"longer than seq_len 64 .* --max-seq-len 64"):
        BatchSampler(d, 64, 4, 1, 0, 4, pack=True)


def test_verify_data_checks_the_masks_and_document_lengths(prepared, tmp_path):
    import shutil

    from cutp.data.verify import verify_prepared

    root = prepared[0]
    shutil.copytree(root / "out", tmp_path / "out")
    assert verify_prepared(str(tmp_path / "out")) == ([], 2, prepared[2]["tokens"])
    mask = tmp_path / "out" / "train_000000.mask"
    raw = bytearray(mask.read_bytes())
    raw[-1] ^= 1  # one target flag flipped
    mask.write_bytes(bytes(raw))
    problems, _, _ = verify_prepared(str(tmp_path / "out"))
    assert problems == [f"{mask}: its blake2b digest differs from meta.json's (the file was changed after prepare-data)"]


def test_a_killed_chat_preparation_resumes_to_the_same_files(prepared, tmp_path):
    """Masks and document lengths resume with the tokens: the same bytes as an uninterrupted run."""
    root, tok_dir = prepared[0], prepared[1]
    settings = dict(val_fraction=0.2, shard_tokens=300, batch_bytes=2000, stream=io.StringIO(),
                    records=RecordSettings("chat", max_seq_len=96))
    prepare([str(root / "chat.jsonl")], tok_dir, str(tmp_path / "ref"), workers=1, **settings)
    finished = []

    def kill_at_the_second(name):
        finished.append(name)
        if len(finished) == 2:
            raise KeyboardInterrupt  # after the rename, before progress.json records the shard

    with pytest.raises(KeyboardInterrupt):
        prepare([str(root / "chat.jsonl")], tok_dir, str(tmp_path / "out"), workers=1, after_shard=kill_at_the_second,
                **settings)
    meta = prepare([str(root / "chat.jsonl")], tok_dir, str(tmp_path / "out"), workers=1, **settings)
    files = {p.name: p.read_bytes() for p in sorted((tmp_path / "ref").iterdir())}
    assert len(meta["splits"]["train"]["masks"]) >= 3 and any(n.endswith(".mask") for n in files)
    assert {p.name: p.read_bytes() for p in sorted((tmp_path / "out").iterdir())} == files


def test_the_command_line_takes_the_chat_flags(prepared, tmp_path, capsys):
    from cutp.data.prepare import main

    root, tok_dir = prepared[0], prepared[1]
    out = str(tmp_path / "cli")
    assert main([str(root / "chat.jsonl"), "--format", "chat", "--tokenizer", tok_dir, "--out", out, "--workers", "1",
                 "--train-on", "all", "--max-seq-len", "50", "--too-long", "truncate", "--val-fraction", "0.2"]) == 0
    meta = read_meta(out)
    assert meta["records"] == {**RecordSettings("chat", train_on="all", max_seq_len=50, too_long="truncate").__dict__}
    assert np.asarray(load_dataset(out).masks["train"][:]).all()  # every token a target
    assert main([str(root / "chat.jsonl"), "--format", "chat", "--tokenizer", "bytes", "--out", str(tmp_path / "b")]) \
        == 2 and "give a tokenizer directory with one, not 'bytes'" in capsys.readouterr().err
