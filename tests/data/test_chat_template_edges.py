"""Chat templates at their edges (issue 41's coverage), on small templates written for each case:
where the template is read from (chat_template.jinja, a list of named templates, special tokens
as {"content": ...}); what the environment provides (tojson, namespace without private names) and
refuses (a template that does not compile, a missing jinja2); each way the prefix method cannot
find an assistant turn's span, named by message; a template that writes no assistant text has no
end-of-turn token."""
import json
import sys

import pytest

from cutp.data.chat import TEMPLATE_FILE, ChatError, ChatTemplate
from cutp.runtime.errors import ConfigError

pytest.importorskip("jinja2", reason="jinja2 is not installed (pip install jinja2): chat templates are Jinja")

TURNS = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
USER, ASSISTANT = {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}


def test_the_template_is_read_from_its_file_or_the_default_of_a_named_list(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TURNS}],
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "pad_token": None}))
    t = ChatTemplate.from_dir(str(tmp_path))
    assert t.source == TURNS and t.variables == {"bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / TEMPLATE_FILE).write_text("{{ bos_token }}" + TURNS)  # the file wins over tokenizer_config.json
    t = ChatTemplate.from_dir(str(tmp_path))
    assert t.render([USER, ASSISTANT]) == "<s>user:U;assistant:A;"


def test_tojson_writes_unescaped_json_and_a_namespace_takes_no_private_names():
    t = ChatTemplate("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=1, sort_keys=True) }}")
    m = {"role": "user", "content": "é <b>"}
    assert t.render([m]) == json.dumps(m, ensure_ascii=False) + "|" + json.dumps(m, ensure_ascii=False, indent=1,
                                                                                 sort_keys=True)
    ok = ChatTemplate("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                      "{{ ns.n }}")
    assert ok.render([USER, ASSISTANT]) == "2"
    for source in ("{% set ns = namespace(_n=0) %}", "{% set ns = namespace(n=0) %}{% set ns._n = 1 %}"):
        with pytest.raises(ChatError, match=r"^the chat template refuses the conversation: chat templates cannot set "
                                            r"'_n' on a namespace$"):
            ChatTemplate(source).render([USER])


def test_a_template_that_does_not_compile_or_no_jinja2_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"^the chat template does not compile: .*"):
        ChatTemplate("{% if %}")
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ConfigError, match=r"^chat templates need the jinja2 library: pip install jinja2 "):
        ChatTemplate(TURNS)


def test_each_way_the_prefix_method_fails_names_the_message():
    # the conversation before the turn renders differently from the whole conversation's start
    reverse = ChatTemplate("{% for m in messages|reverse %}{{ m.role }}:{{ m.content }};{% endfor %}")
    with pytest.raises(ChatError, match=r"^message 1 \(assistant\): the conversation before it renders differently "
                                        "from the start of the whole conversation; the template cannot be used with "
                                        "--train-on assistant$"):
        reverse.assistant_spans([USER, ASSISTANT])
    # the conversation up to the turn begins otherwise than the whole one (its header names the last role)
    header = ChatTemplate("{% if messages[-1].role == 'assistant' %}A{% else %}B{% endif %}|" + TURNS)
    with pytest.raises(ChatError, match=r"^message 1 \(assistant\): the conversation rendered up to it does not begin "
                                        "as the whole conversation does; "):
        header.assistant_spans([USER, ASSISTANT, {"role": "user", "content": "V"}])
    # the turn renders to nothing: no span to find
    silent = ChatTemplate("{% for m in messages if m.role == 'user' %}{{ m.content }};{% endfor %}")
    with pytest.raises(ChatError, match=r"^message 1 \(assistant\): its span in the rendered conversation cannot be "
                                        r"found by the prefix method; add \{% generation %\} marks to the template$"):
        silent.assistant_spans([USER, ASSISTANT])
    assert silent.end_of_turn(None) is None  # (no assistant text: nothing after it to look at)


def test_a_conversation_before_the_turn_that_the_template_refuses_starts_the_turn_at_the_beginning():
    """A template that refuses a conversation not ending with the assistant: the conversation before
    the turn cannot be rendered, so the turn's span starts at the text's start (everything up to the
    turn's end is a target: more than the turn, never less)."""
    t = ChatTemplate("{% if messages[-1].role != 'assistant' %}{{ raise_exception('end with the assistant') }}"
                     "{% endif %}" + TURNS)
    text, spans = t.assistant_spans([USER, ASSISTANT])
    assert text == "user:U;assistant:A;" and spans == [(0, len(text))]


def test_a_template_that_refuses_the_generation_prompt_starts_the_turn_after_the_conversation_before_it():
    """(rendered without the prompt, the conversation before the turn is the start of the whole one: the
    turn starts there, not at the text's start, which would make the user's turn a target)"""
    t = ChatTemplate("{% if add_generation_prompt %}{{ raise_exception('no generation prompt') }}{% endif %}" + TURNS)
    text, spans = t.assistant_spans([USER, ASSISTANT])
    assert [text[a:b] for a, b in spans] == ["assistant:A;"]
