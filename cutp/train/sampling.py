"""`sample_every` / `sample_prompt`: a greedy generation printed during training.

The prompt is encoded with the data's tokenizer (a prepared directory's, recorded in its
meta.json; the byte tokenizer for byte-level data). For chat data (prepare-data --format chat or
instruct) it is the user's message of a one-turn conversation rendered with the tokenizer's chat
template and its generation prompt, and generation stops at the template's end-of-turn token
(else at EOS), as examples/generate.py --chat does. Collective over the model's TP group
(every DP replica generates the same tokens).
"""
from __future__ import annotations

from ..data.chat import ChatTemplate
from ..data.tokenizer import BYTES, ByteTokenizer, load_tokenizer
from ..generate import check_request, generate
from ..runtime.errors import ConfigError


class PromptSampler:
    """The encoded prompt, its stop token and the tokenizer that decodes the generation."""

    def __init__(self, tok, ids: list, stop: int | None, new_tokens: int, chat: bool):
        self.tok, self.ids, self.stop, self.new_tokens, self.chat = tok, list(ids), stop, new_tokens, chat

    @classmethod
    def for_run(cls, run) -> "PromptSampler | None":
        """The sampler of `run`'s settings (None without `sample_every`); ConfigError when the data's
        tokenizer cannot be found or the prompt does not fit the model."""
        cfg, data = run.config, run.dataset
        if not cfg.sample_every:
            return None
        identity = data.tokenizer or {}
        path = identity.get("path")
        if identity.get("name") == BYTES:
            tok = ByteTokenizer()
        elif path:
            tok = load_tokenizer(path)
        else:
            raise ConfigError("`sample_every` needs the data's tokenizer: give `data` a directory written by python -m "
                              "cutp prepare-data (its meta.json names the tokenizer), or omit `sample_every`")
        chat = bool(data.records) and data.records.get("format") != "text"
        if chat:
            template = ChatTemplate.from_dir(path)
            ids, stop = template.prompt_ids(tok, cfg.sample_prompt), template.end_of_turn(tok)
            stop = tok.eos_id if stop is None else stop
        else:
            ids, stop = tok.encode(cfg.sample_prompt), tok.eos_id
        try:
            check_request(cfg.model, len(ids), cfg.sample_tokens)
        except ValueError as e:
            raise ConfigError(f"`sample_prompt`: {e}") from None
        return cls(tok, ids, stop, cfg.sample_tokens, chat)

    def sample(self, run) -> str:
        """The greedy continuation of the prompt, decoded. Collective over the TP group."""
        run.gather_params()
        return self.tok.decode(generate(run.model, self.ids, self.new_tokens, temperature=0, stop_token=self.stop))
