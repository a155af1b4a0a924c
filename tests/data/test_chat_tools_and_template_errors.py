"""Chat records beyond their messages (fine-tuning review, findings 2 and 3).

A record's `tools` and `documents` reach the chat template as apply_chat_template(messages,
tools=, documents=) passes them: a template that writes them shows them in the text (every
partial rendering of the prefix method given them too, so the masks stay on the assistant
turns), and the ids equal transformers' (skipped with the reason without it); prepare-data
stores them so, and refuses a record whose `tools` is no list in one line. A template raising an
ordinary Python error on a record (Qwen's `content + '<|im_end|>'` on a number: TypeError) is one
line naming the record's file and line, with one worker or several, no traceback.
"""
import io
import json

import numpy as np
import pytest

from cutp.data import load_dataset
from cutp.data.chat import TEMPLATE_FILE, ChatError, ChatTemplate, encode_chat
from cutp.data.prepare import RecordSettings, main, prepare
from cutp.data.tokenizer import load_tokenizer
from cutp.runtime.errors import ConfigError
from tests.data.chat_templates import chat_tokenizer, write_jsonl

pytest.importorskip("tokenizers", reason="the tokenizers library is not installed (pip install tokenizers)")
pytest.importorskip("jinja2", reason="jinja2 is not installed (pip install jinja2): chat templates are Jinja")

# Qwen2.5's way with tools (a system block listing them) and a documents block, then ChatML turns
WITH_TOOLS = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{ '\\n' + tool | tojson }}"
    "{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- if documents %}{{ '<|im_start|>system\\n' }}"
    "{%- for d in documents %}{{ '[' + d.title + '] ' + d.text + '\\n' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
DOCUMENTS = [{"title": "Paris", "text": "Sunny, 21 degrees."}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny, 21."},
            {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You are welcome."}]


@pytest.fixture(scope="module")
def tools_tokenizer(tmp_path_factory):
    """A ChatML tokenizer directory whose template writes the tools and documents."""
    d = chat_tokenizer(str(tmp_path_factory.mktemp("tools") / "qwen"), "qwen2")
    config_file = f"{d}/tokenizer_config.json"
    config = json.load(open(config_file))
    config["chat_template"] = WITH_TOOLS  # (transformers and cutp both read it from here)
    json.dump(config, open(config_file, "w"))
    return d


def _targets(tok, ids, mask):
    return "".join(tok.decode([i]) for i, m in zip(ids, mask) if m)


def test_tools_and_documents_reach_the_template_and_the_masks_stay_on_the_assistant_turns(tools_tokenizer):
    tok, template = load_tokenizer(tools_tokenizer), ChatTemplate.from_dir(tools_tokenizer)
    text, spans = template.assistant_spans(MESSAGES, tools=TOOLS, documents=DOCUMENTS)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>")
    assert "[Paris] Sunny, 21 degrees." in text
    assert [text[a:b] for a, b in spans] == ["Sunny, 21.<|im_end|>\n", "You are welcome.<|im_end|>\n"]
    ids, mask = encode_chat(tok, template, MESSAGES, tools=TOOLS, documents=DOCUMENTS)
    assert tok.tokenizer.decode(ids, skip_special_tokens=False).count("get_weather") == 1
    assert _targets(tok, ids, mask) == "Sunny, 21.<|im_end|>\nYou are welcome.<|im_end|>\n"
    plain, _ = encode_chat(tok, template, MESSAGES)
    assert len(ids) > len(plain)  # (without them: the turns alone)
    all_ids, all_mask = encode_chat(tok, template, MESSAGES, "all", tools=TOOLS, documents=DOCUMENTS)
    assert all_ids == ids and all_mask.all()


def test_ids_with_tools_equal_transformers_apply_chat_template(tools_tokenizer):
    pytest.importorskip("transformers", reason="transformers is not installed: the comparison with "
                                               "apply_chat_template needs it")
    from tests.transformers_compat import hide_cutp_kernels_from_transformers

    hide_cutp_kernels_from_transformers()
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(tools_tokenizer)
    tok, template = load_tokenizer(tools_tokenizer), ChatTemplate.from_dir(tools_tokenizer)
    for kw in (dict(tools=TOOLS), dict(documents=DOCUMENTS), dict(tools=TOOLS, documents=DOCUMENTS)):
        ref = hf.apply_chat_template(MESSAGES, tokenize=True, return_dict=True, **kw)["input_ids"]
        assert encode_chat(tok, template, MESSAGES, **kw)[0] == list(ref), kw


def test_prepare_data_renders_a_records_tools_and_refuses_tools_that_are_no_list(tools_tokenizer, tmp_path):
    src = write_jsonl(tmp_path / "tools.jsonl", [{"messages": MESSAGES, "tools": TOOLS, "documents": DOCUMENTS},
                                                 {"messages": MESSAGES}] * 2)
    prepare([src], tools_tokenizer, str(tmp_path / "out"), val_fraction=0.5, workers=1, stream=io.StringIO(),
            records=RecordSettings("chat"))
    tok, template = load_tokenizer(tools_tokenizer), ChatTemplate.from_dir(tools_tokenizer)
    d = load_dataset(str(tmp_path / "out"))
    ids, mask = encode_chat(tok, template, MESSAGES, tools=TOOLS, documents=DOCUMENTS)  # records 0, 2: validation
    np.testing.assert_array_equal(np.asarray(d.split("val")[:]), ids * 2)
    np.testing.assert_array_equal(np.asarray(d.masks["val"][:]), np.concatenate([mask, mask]))
    np.testing.assert_array_equal(np.asarray(d.split("train")[:]), encode_chat(tok, template, MESSAGES)[0] * 2)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": MESSAGES}, {"messages": MESSAGES, "tools": "get_weather"}])
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: 'tools' is a str; the chat template takes a record's tools "
                                          r"as a list .*: fix the record"):
        prepare([bad], tools_tokenizer, str(tmp_path / "bad"), workers=1, stream=io.StringIO(),
                records=RecordSettings("chat"))


def test_a_python_error_inside_the_template_names_the_record():
    template = ChatTemplate("{% for m in messages %}{{ m.content + '<|im_end|>' }}{% endfor %}")
    with pytest.raises(ChatError, match=r"^the chat template fails on the conversation \(TypeError: unsupported "
                                        r"operand type\(s\) for \+: 'int' and 'str'\); fix the record or the "
                                        "template$"):
        template.render([{"role": "user", "content": 5}])
    with pytest.raises(ChatError, match=r"\(ZeroDivisionError: integer division or modulo by zero\)"):
        ChatTemplate("{{ 1 // (messages | length - 1) }}").render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_prepare_data_says_a_python_error_in_the_template_in_one_line(tools_tokenizer, tmp_path, capfd, workers):
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (d / name).write_bytes(open(f"{tools_tokenizer}/{name}", "rb").read())
    (d / TEMPLATE_FILE).write_text("{% for m in messages %}{{ m.content + '<|im_end|>' }}{% endfor %}")
    src = write_jsonl(tmp_path / "num.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "ok"}]},
                                               {"messages": [{"role": "user", "content": 5},
                                                             {"role": "assistant", "content": "ok"}]}])
    assert main([src, "--format", "chat", "--tokenizer", str(d), "--out", str(tmp_path / "out"),
                 "--workers", workers]) == 2
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    assert err.strip().splitlines() == [
        f"prepare-data: error: {src}:2: the chat template fails on the conversation (TypeError: unsupported operand "
        "type(s) for +: 'int' and 'str'); fix the record or the template"], err
