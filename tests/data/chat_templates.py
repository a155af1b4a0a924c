"""Chat templates as the model families ship them in tokenizer_config.json (Llama 3, Qwen2.5, Qwen3,
Gemma; tools and images left out), each also with {% generation %} marks around what an
assistant turn writes (transformers' return_assistant_tokens_mask needs them), and a small
byte-level BPE tokenizer directory holding each family's special tokens, trained offline."""
from __future__ import annotations

import json
from functools import lru_cache

from tests.data import tokenizer_files

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_MARKED = ("{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
                 "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
                 "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
                 "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN2 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{ message.content + '<|im_end|>' + '\\n' }}{% endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3 = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' }}{% generation %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- content }}
            {%- endif %}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}{% endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

GEMMA_MARKED = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
                "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
                "{% endif %}{{ '<start_of_turn>' + role + '\n' }}{% if role == 'model' %}{% generation %}"
                "{{ message['content'] | trim + '<end_of_turn>\n' }}{% endgeneration %}{% else %}"
                "{{ message['content'] | trim + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def unmarked(template: str) -> str:
    """The template without its {% generation %} marks (as the families ship it)."""
    for mark in ("{% generation %}", "{% endgeneration %}"):
        template = template.replace(mark, "")
    return template


# family: (marked template, BOS, EOS, the other special tokens)
FAMILIES = {
    "llama3": (LLAMA3_MARKED, "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>",
                                                                   "<|end_of_text|>"]),
    "qwen2": (QWEN2, None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "qwen3": (QWEN3, None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "gemma": (GEMMA_MARKED, "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>", "<pad>"]),
}


@lru_cache(maxsize=None)
def _trained(vocab_size: int) -> str:
    """A byte-level BPE trained once per test process (as JSON text: each directory edits a copy)."""
    from tokenizers import models, pre_tokenizers

    return json.dumps(tokenizer_files._train(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False),
                                             vocab_size))


def chat_tokenizer(d, family: str, marked: bool = False, vocab_size: int = 500) -> str:
    """A byte-level BPE tokenizer directory with `family`'s special tokens and chat template
    (with {% generation %} marks when `marked`; the family's own template otherwise)."""
    template, bos, eos, others = FAMILIES[family]
    spec = json.loads(_trained(vocab_size))
    n = len(spec["model"]["vocab"])
    specials = [t for t in [bos, eos] + others if t]
    spec["added_tokens"] = [tokenizer_files._added(n + i, t) for i, t in enumerate(specials)]
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "chat_template": template if marked else unmarked(template)}
    if bos:
        config["bos_token"] = bos
    out = tokenizer_files._write(d, spec, {"model_type": "llama", "eos_token_id": n + specials.index(eos)}, config)
    return out


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue"}, {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": " Green, or red.\n"}],
    [{"role": "user", "content": "def f(x):\n    return x"}, {"role": "assistant", "content": "A function <|eot_id|>"},
     {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "<think>\nok\n</think>\n\nYou're welcome"}],
]


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def conversations_for(family: str) -> list:
    """CONVERSATIONS the family's template accepts (Gemma's refuses a system turn)."""
    return [c for c in CONVERSATIONS if family != "gemma" or c[0]["role"] != "system"]

