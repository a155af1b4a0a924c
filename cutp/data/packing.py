"""Packing (`--pack`, at load time): whole documents placed into windows of seq_len tokens.

A split's documents (their lengths, meta.json's `.docs` of prepare-data's format version 2) are
laid in their stream order into windows, next-fit: a window takes the following documents while
they fit in seq_len tokens, and the rest of it is padding. A window is then one contiguous slice
of the split's token stream, and its rows are:

    x[t]          the window's tokens, then padding (id 0)
    y[t]          the next token of the same document; IGNORE (-100) at each document's last
                  position (the next token belongs to another document), on padding, and where
                  the next token is no target (chat data's mask)
    documents[t]  0 for the first document, 1 for the next, ...; the padding one more id

(contract 2: GPT.forward(..., documents=) restarts positions at each document's first token and
keeps attention inside documents). No document is split: one longer than seq_len is refused
with the fix (prepare-data --max-seq-len seq_len --too-long drop|truncate decides, counted and
reported there). Packing is a function of the lengths and seq_len alone: the same windows on
every rank and at every resume; the sampler draws the step's windows from them by (seed, step).
"""
from __future__ import annotations

import numpy as np

from ..runtime.errors import ConfigError

IGNORE = -100


class PackedSplit:
    """The windows of one split: each window's first document and its count of documents."""

    def __init__(self, lengths: np.ndarray, seq_len: int, split: str):
        lengths = np.asarray(lengths, np.int64)
        if len(lengths) and int(lengths.max()) > seq_len:
            n = int((lengths > seq_len).sum())
            raise ConfigError(f"`pack`: the {split} split holds {n:,} document(s) longer than `seq_len` {seq_len} (up "
                              f"to {int(lengths.max()):,} tokens); packing places documents whole: prepare the data "
                              f"with --max-seq-len {seq_len} (--too-long drop or truncate), or use a longer `seq_len`")
        self.seq_len = seq_len
        self.starts = np.concatenate([[0], np.cumsum(lengths)])  # each document's first token in the stream
        first, used = [], seq_len + 1
        for i, n in enumerate(lengths.tolist()):  # next-fit, in stream order
            if used + n > seq_len:
                first.append(i)
                used = 0
            used += n
        self.first = np.array(first, np.int64)
        self.count = np.diff(np.concatenate([self.first, [len(lengths)]]))
        if not len(self.first):
            raise ConfigError(f"`pack`: the {split} split has no documents; give more data")

    def __len__(self) -> int:
        return len(self.first)

    def span(self, w: int) -> tuple[int, int]:
        """The window's slice [a, b) of the split's token stream."""
        f = int(self.first[w])
        return int(self.starts[f]), int(self.starts[f + int(self.count[w])])

    def row(self, tokens, masks, w: int):
        """(x, y, documents) of window w: int64, int64, int32 arrays [seq_len]."""
        T = self.seq_len
        a, b = self.span(w)
        f, c = int(self.first[w]), int(self.count[w])
        x = np.zeros(T, np.int64)
        x[:b - a] = np.asarray(tokens[a:b], np.int64)
        y = np.full(T, IGNORE, np.int64)
        y[:b - a - 1] = x[1:b - a]
        if masks is not None:
            y[:b - a - 1][np.asarray(masks[a + 1:b]) == 0] = IGNORE
        ends = self.starts[f + 1:f + c + 1] - a  # each document's end within the window
        y[ends - 1] = IGNORE  # its last position: the next token is another document's
        docs = np.full(T, c, np.int32)
        docs[:b - a] = np.repeat(np.arange(c, dtype=np.int32), np.diff(self.starts[f:f + c + 1]))
        return x, y, docs
