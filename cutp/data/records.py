"""prepare-data's inputs: the files of the command line, and their records, as --format says.

- text: each text file is one document, each line of a JSONL file one (its `text_key` string);
- chat: each line of a JSONL file is a record whose `messages_key` holds [{role, content}, ...];
- instruct: each line holds a prompt and a response (and optionally a system message) under the
  keys given, made into the messages system / user / assistant.

A chat or instruct record's `tools` (function schemas) and `documents` (lists), when it has them,
go to the template with its messages, as transformers' apply_chat_template(messages, tools=...,
documents=...) and TRL's SFT pass a dataset's columns of those names (`Conversation`).

Chat and instruct records are rendered by the tokenizer's chat template (cutp.data.chat) in the
workers; `RecordSettings` also says which tokens are targets and what happens to a record longer
than `max_seq_len`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..runtime.errors import ConfigError
from .chat import TRAIN_ON, check_messages

FORMATS = ("text", "chat", "instruct")
TOO_LONG = ("drop", "truncate")
CONTEXT_KEYS = ("tools", "documents")  # a record's keys the template is given besides the messages


@dataclass(frozen=True)
class Conversation:
    """A chat or instruct record: its messages, and its `tools` and `documents` (None when it has
    none), which the template renders as apply_chat_template(messages, tools=, documents=) does."""

    messages: list
    tools: list | None = None
    documents: list | None = None


def input_files(inputs: list, exclude: str | None = None) -> list:
    """The files of `inputs` in order: each file as given, each folder's files walked sorted
    (but not folder `exclude`: the output, when it lies inside an input folder)."""
    out, exclude = [], os.path.abspath(exclude) if exclude else None
    for path in inputs:
        if os.path.isfile(path):
            out.append(os.path.abspath(path))
        elif os.path.isdir(path):
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                                     and os.path.abspath(os.path.join(dirpath, d)) != exclude)
                found += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
            if not found:
                raise ConfigError(f"input folder {path} holds no files")
            out += [os.path.abspath(f) for f in found]
        else:
            raise ConfigError(f"input {path}: no such file or folder")
    return out


def documents(files: list, text_key: str):
    """(text, bytes read) of each document of the files, in order."""
    for path in files:
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[text_key]
                    except (ValueError, KeyError, TypeError, IndexError):
                        raise ConfigError(f"{path}:{n}: not a JSON object with a string {text_key!r}; fix the "
                                          f"line or give the key with `text_key`") from None
                    if not isinstance(text, str):
                        raise ConfigError(f"{path}:{n}: {text_key!r} is a {type(text).__name__}, not a string")
                    yield text, len(line)
        else:
            with open(path, "rb") as f:
                raw = f.read()
            try:
                yield raw.decode("utf-8"), len(raw)
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); convert it or leave it out") from None


@dataclass(frozen=True)
class RecordSettings:
    """What a record is (--format and its keys) and which of its tokens are kept and trained on."""

    format: str = "text"
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"
    system_key: str | None = None
    train_on: str = "assistant"
    max_seq_len: int | None = None
    too_long: str = "drop"

    def check(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"`format` must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.train_on not in TRAIN_ON:
            raise ConfigError(f"`train_on` must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}")
        if self.too_long not in TOO_LONG:
            raise ConfigError(f"`too_long` must be one of {', '.join(TOO_LONG)}, got {self.too_long!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 2):
            raise ConfigError(f"`max_seq_len` must be an integer >= 2, got {self.max_seq_len!r}")

    @property
    def chat(self) -> bool:
        return self.format != "text"


def records_of(files: list, rs: RecordSettings, text_key: str = "text"):
    """(record, bytes read, where) of each record of the files, in order: a text (--format
    text), or a Conversation (chat; instruct: its system, prompt and response as messages)."""
    if not rs.chat:
        for text, nbytes in documents(files, text_key):
            yield text, nbytes, None
        return
    for path in files:
        if not path.endswith(".jsonl"):
            raise ConfigError(f"input {path}: --format {rs.format} reads JSONL files (one record a line); give .jsonl "
                              "files or --format text")
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise ConfigError(f"{where}: not a JSON object; fix the line") from None
                if not isinstance(obj, dict):
                    raise ConfigError(f"{where}: not a JSON object; fix the line")
                yield _conversation(obj, rs, where), len(line), where


def _conversation(obj: dict, rs: RecordSettings, where: str) -> Conversation:
    for key in CONTEXT_KEYS:
        if obj.get(key) is not None and not isinstance(obj[key], list):
            raise ConfigError(f"{where}: {key!r} is a {type(obj[key]).__name__}; the chat template takes a record's "
                              f"{key} as a list (of JSON objects, as apply_chat_template's {key}=): fix the record")
    return Conversation(_messages(obj, rs, where), **{k: obj.get(k) for k in CONTEXT_KEYS})


def _messages(obj: dict, rs: RecordSettings, where: str) -> list:
    if rs.format == "chat":
        if rs.messages_key not in obj:
            raise ConfigError(f"{where}: no {rs.messages_key!r} key; give the messages' key with `messages_key`")
        return check_messages(obj[rs.messages_key], where)
    out = []
    for key, role in ((rs.system_key, "system"), (rs.prompt_key, "user"), (rs.response_key, "assistant")):
        if key is None:
            continue
        if not isinstance(obj.get(key), str):
            raise ConfigError(f"{where}: no string {key!r} (the {role} message); give its key with "
                              f"`{dict(system='system_key', user='prompt_key', assistant='response_key')[role]}`")
        out.append({"role": role, "content": obj[key]})
    return out
