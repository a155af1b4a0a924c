"""Packed sequences at model level (issue 38, contract 2): several documents in one row.

`documents` [B, T] holds each token's document id, non-decreasing along the row (a new id starts
a new document). The model then restarts positions at 0 at each document's first token (RoPE
turns Q and K by them, learned positions take their rows) and the attention never crosses a
document (`cutp.ops.attention`'s mask rule; the ring and the all-to-all of context parallelism
take the whole rows' ids). The data side sets the target of each document's last token to -100.
"""
from __future__ import annotations

import numpy as np

from ..runtime.backend import to_numpy


def check_documents(documents, idx) -> np.ndarray:
    """The ids as a host int32 array [B, T], after ValueError naming what is wrong: not an integer
    array shaped like the token ids, or ids that decrease along a row."""
    if not isinstance(getattr(documents, "dtype", None), np.dtype) or documents.dtype.kind not in "iu":
        raise ValueError(f"documents must be an integer array [batch, seq] of document ids, got "
                         f"{type(documents).__name__} of dtype {getattr(documents, 'dtype', None)}")
    if tuple(documents.shape) != tuple(idx.shape):
        raise ValueError(f"documents shape {tuple(documents.shape)} differs from the token ids' {tuple(idx.shape)}")
    host = to_numpy(documents).astype(np.int32)
    if host.shape[1] > 1 and (np.diff(host, axis=1) < 0).any():
        b, t = np.argwhere(np.diff(host, axis=1) < 0)[0]
        raise ValueError(f"document ids must be non-decreasing along each row (a new id starts a new document); row "
                         f"{b} goes from {host[b, t]} to {host[b, t + 1]} at position {t + 1}")
    return host


def document_positions(documents: np.ndarray) -> np.ndarray:
    """Each token's position inside its document [B, T] (int64): 0 at each document's first token."""
    B, T = documents.shape
    t = np.broadcast_to(np.arange(T), (B, T))
    starts = np.zeros((B, T), bool)
    starts[:, 0] = True
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = np.maximum.accumulate(np.where(starts, t, 0), axis=1)
    return (t - first).astype(np.int64)
