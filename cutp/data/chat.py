"""Chat templates: a tokenizer directory's Jinja template rendered as transformers'
`apply_chat_template` renders it, the text tokenized, and which tokens are targets.

    template = ChatTemplate.from_dir("path/to/Llama-3.2-1B-Instruct")     # its chat template
    ids, mask = encode_chat(tok, template, messages, train_on="assistant")  # mask[k]: token k is a target
    prompt = template.render(messages, add_generation_prompt=True)          # for generation

The template is read from the directory's chat_template.jinja, else tokenizer_config.json's
`chat_template` (a string, or a list of named templates: "default"). It is compiled in the
environment transformers builds (`transformers.utils.chat_template_utils`): jinja2's
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension and
the {% generation %} block, `raise_exception`, the `tojson` filter (no HTML escaping),
`strftime_now`, `dict` and `namespace`, and the special tokens of tokenizer_config.json
(`bos_token`, `eos_token`, ...) as variables. The rendered text is tokenized with
add_special_tokens=False (the template writes BOS itself), special tokens written in it matched
(transformers' default: a message's "<|eot_id|>" is that token).

Targets (`train_on`): "all" makes every token one. "assistant": the assistant turns' tokens. A
template with {% generation %} blocks marks them: a token is a target when its characters
overlap a block's output (transformers' `return_assistant_tokens_mask`). Without marks (Llama 3's,
Qwen's and Gemma's templates have none) the prefix method finds each assistant message's span:
it starts where the conversation before it, rendered with the generation prompt, ends (so the
role header is no target; a conversation the assistant opens: where its text starts), and ends where the conversation up to and including it ends (so the
end-of-turn the template writes after the message is a target). A template that renders a turn
differently once later turns follow (Qwen3 drops an earlier turn's empty <think></think>) is
aligned by the longest tail of that span which the whole conversation continues with at the
span's start; a message whose span cannot be found so is an error naming it.
"""
from __future__ import annotations

import json
import os
import re
from datetime import datetime

import numpy as np

from ..runtime.errors import ConfigError
from .tokenizer import read_json_object

TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 saves the template here
JINJA_HINT = "pip install jinja2 (or cutp's chat extra; transformers' chat templates are Jinja)"
TRAIN_ON = ("assistant", "all")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' _REASONING_FIELDS
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatError(ValueError):
    """A conversation the template refuses or whose assistant spans cannot be found."""


def _environment():
    """transformers' chat-template environment (chat_template_utils._cached_compile_jinja_template)."""
    try:
        import jinja2  # optional: only chat data needs it
        from jinja2.ext import Extension, loopcontrols  # optional (jinja2)
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # optional (jinja2)
    except ImportError:
        raise ConfigError(f"chat templates need the jinja2 library: {JINJA_HINT}") from None

    class GenerationTracker(Extension):
        """{% generation %}...{% endgeneration %}: records the character span of its output."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            out = caller()
            tracking = getattr(self.environment, "cutp_tracking", None)
            if tracking is not None:
                blocks, spans = tracking
                start = sum(map(len, blocks))
                spans.append((start, start + len(out)))
            return out

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=dict, namespace=TemplateNamespace)
    return env, jinja2


class ChatTemplate:
    """A compiled chat template with its special-token variables (bos_token, eos_token, ...)."""

    def __init__(self, source: str, variables: dict | None = None):
        self.source = source
        self.variables = dict(variables or {})
        self.marked = bool(_GENERATION.search(source))  # has {% generation %} blocks
        env, self._jinja = _environment()
        try:
            self._template = env.from_string(source)
        except self._jinja.exceptions.TemplateError as e:
            raise ConfigError(f"the chat template does not compile: {e}") from None
        self._env = env

    @classmethod
    def from_dir(cls, directory: str) -> "ChatTemplate":
        """The template of a tokenizer directory; ConfigError naming the directory when it has none."""
        config = read_json_object(os.path.join(directory, "tokenizer_config.json"))
        source = None
        path = os.path.join(directory, TEMPLATE_FILE)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                source = f.read()
        else:
            found = config.get("chat_template")
            if isinstance(found, list):  # [{"name": ..., "template": ...}]
                named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
                found = named.get("default")
            source = found if isinstance(found, str) else None
        if source is None:
            raise ConfigError(f"{directory} has no chat template ({TEMPLATE_FILE}, or tokenizer_config.json's "
                              "\"chat_template\"); give a tokenizer directory with one, or --format text")
        variables = {}
        for key, value in config.items():
            if key.endswith("_token") and isinstance(value, dict):
                value = value.get("content")
            if key.endswith("_token") and isinstance(value, str):
                variables[key] = value
        return cls(source, variables)

    def render(self, messages: list, add_generation_prompt: bool = False, spans: list | None = None,
               tools: list | None = None, documents: list | None = None) -> str:
        """The conversation as text; `spans` (a list) receives the {% generation %} blocks' spans;
        `tools` and `documents` reach the template as apply_chat_template's tools= and documents=."""
        kw = dict(self.variables, messages=messages, tools=tools, documents=documents,
                  add_generation_prompt=add_generation_prompt)
        try:
            if spans is None:
                return self._template.render(**kw)
            blocks = []
            self._env.cutp_tracking = (blocks, spans)
            try:
                for block in self._template.generate(**kw):
                    blocks.append(block)
            finally:
                self._env.cutp_tracking = None
            return "".join(blocks)
        except self._jinja.exceptions.TemplateError as e:
            raise ChatError(f"the chat template refuses the conversation: {e}") from None
        # the template's own Python errors on a record's values (Qwen's `content + '<|im_end|>'` on a
        # number: TypeError) are the record's problem too, named by its line as the refusals above
        except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as e:
            raise ChatError(f"the chat template fails on the conversation ({type(e).__name__}: {e}); fix the "
                            "record or the template") from None

    def assistant_spans(self, messages: list, tools: list | None = None,
                        documents: list | None = None) -> tuple[str, list]:
        """(the rendered conversation, the character spans of its assistant turns); every partial
        rendering of the prefix method is given the same `tools` and `documents` as the whole."""
        context = dict(tools=tools, documents=documents)
        if self.marked:
            spans = []
            return self.render(messages, spans=spans, **context), spans
        full = self.render(messages, **context)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = self._start_of(messages[:i], full, context)
            content = message.get("content")
            if i == 0 and isinstance(content, str) and content.strip():  # (the template's BOS and role header)
                at = full.find(content, start)
                start = at if at >= 0 else max(start, full.find(content.strip(), start))
            upto = self.render(messages[:i + 1], **context)
            turn = upto[start:] if upto.startswith(full[:start]) else None
            if turn is None:
                raise ChatError(f"message {i} (assistant): the conversation rendered up to it does not begin as the "
                                "whole conversation does; the template cannot be used with --train-on assistant")
            for k in range(len(turn)):  # the longest tail of the turn the conversation continues with
                if full.startswith(turn[k:], start):
                    break
            else:
                k = len(turn)
            if k == len(turn) or k and isinstance(content, str) and content.strip() not in turn[k:]:
                raise ChatError(f"message {i} (assistant): its span in the rendered conversation cannot be found by "
                                "the prefix method; add {% generation %} marks to the template")
            spans.append((start, start + len(turn) - k))
        return full, spans

    def _start_of(self, before: list, full: str, context: dict) -> int:
        """Where an assistant message after `before` starts in `full`: after the generation prompt."""
        refused = False
        for agp in (True, False):
            try:
                text = self.render(before, add_generation_prompt=agp, **context) if before else ""
            except ChatError:  # (refused with the prompt: without it, then)
                refused = True
                continue
            if full.startswith(text):
                return len(text)
        if refused:  # the conversation before it renders in no way that starts the whole: from the start
            return 0
        raise ChatError(f"message {len(before)} (assistant): the conversation before it renders differently from the "
                        "start of the whole conversation; the template cannot be used with --train-on assistant")

    def prompt_ids(self, tok, text: str, system: str | None = None) -> list:
        """The ids of a conversation of one user message (after `system`'s, if given), ready for
        the assistant's answer: rendered with the generation prompt, tokenized as `encode_chat` does."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return tok.tokenizer.encode(self.render(messages, add_generation_prompt=True), add_special_tokens=False).ids

    def end_of_turn(self, tok) -> int | None:
        """The token the template writes right after an assistant message's text (Llama 3's
        <|eot_id|>, Qwen's <|im_end|>, Gemma's <end_of_turn>), or None when it writes none."""
        marker = "cutp end of turn probe"
        text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}])
        at = text.rfind(marker)
        if at < 0:
            return None
        enc = tok.tokenizer.encode(text, add_special_tokens=False)
        after = [i for i, (a, _) in zip(enc.ids, enc.offsets) if a >= at + len(marker)]
        specials = set(tok.tokenizer.get_added_tokens_decoder())
        return after[0] if after and after[0] in specials else None


def encode_chat(tok, template: ChatTemplate, messages: list, train_on: str = "assistant", *,
                tools: list | None = None, documents: list | None = None):
    """(ids, mask): the conversation's token ids (int list) and uint8 mask (1: a target);
    `tools` and `documents` go to the template as apply_chat_template passes them."""
    if train_on == "all":
        text = template.render(messages, tools=tools, documents=documents)
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
        return ids, np.ones(len(ids), np.uint8)
    text, spans = template.assistant_spans(messages, tools=tools, documents=documents)
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    return enc.ids, span_mask(np.asarray(enc.offsets, np.int64).reshape(-1, 2), spans)


def span_mask(offsets: np.ndarray, spans: list) -> np.ndarray:
    """1 for each token (offsets [n, 2]: its characters) overlapping a span, as transformers marks them."""
    mask = np.zeros(len(offsets), np.uint8)
    for a, b in spans:
        if b > a:
            mask |= ((offsets[:, 1] > a) & (offsets[:, 0] < b)).astype(np.uint8)
    return mask


def check_messages(messages, where: str) -> list:
    """`messages` as a list of {role, content} dicts; ConfigError naming `where` otherwise."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ConfigError(f"{where}: \"messages\" must be a non-empty list of objects with a string \"role\"")
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}  # (transformers drops None values)
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:  # and fills the names templates read the reasoning under, as transformers does
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out
