"""Expert parallelism's token exchange: rows to the EP rank that owns their expert and back.

With ep > 1 the EP group's ranks split the E experts: rank r owns [r * E/ep, (r + 1) * E/ep).
A source rank orders its kept assignments by (expert, row, slot) (`assignments`), so the rows
for each owner are consecutive; the per-expert counts go first (a small all-to-all of ints),
then the rows (`dispatch`). The owner regroups what it received from every source by local
expert (sources in rank order), runs each of its experts once, and `combine` sends the output
rows back in the order they came, so the source finds them where it sent them from. Backward
moves the output gradients the same way (`dispatch_rows`) and the input gradients back
(`combine`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.backend import to_numpy


def assignments(xp, idx, keep, n_experts):
    """(rows, slots, counts): the kept assignments of idx [n, k] ordered by (expert, row, slot),
    and the number per expert [E] (int64, on the device)."""
    k = idx.shape[1]
    pos = xp.nonzero(keep.reshape(-1))[0]
    e = idx.reshape(-1)[pos]
    pos = pos[xp.argsort(e, kind="stable")]
    return pos // k, pos % k, xp.bincount(e, minlength=n_experts).astype(np.int64)


@dataclass
class Exchange:
    """One MoE layer's layout over the EP group: rows sent to / received from each rank, and
    the permutation of the received rows into local-expert order with each expert's bounds."""

    send: list
    recv: list
    order: object  # xp int array: received row positions in (local expert, source) order
    bounds: list  # local expert i's rows: [bounds[i], bounds[i + 1]) of the permuted rows


def dispatch(ep, rows_x, counts, xp):
    """Sends the source-ordered rows to their owners; returns (their rows grouped by local
    expert, the Exchange for `combine` and the backward)."""
    size = ep.size
    local = counts.shape[0] // size
    counts = xp.ascontiguousarray(counts)
    got = ep.all_to_all(counts, [local] * size, [local] * size)
    both = to_numpy(xp.concatenate([counts, got]))  # (one device-to-host copy: the sent and received counts)
    got = both[counts.shape[0]:].reshape(size, local)
    send = both[:counts.shape[0]].reshape(size, local).sum(axis=1).tolist()
    recv = got.sum(axis=1).tolist()
    start = np.cumsum(np.concatenate([[0], got.reshape(-1)]))[:-1].reshape(size, local)  # in the received rows
    order = [np.arange(start[s, i], start[s, i] + got[s, i]) for i in range(local) for s in range(size)]
    order = np.concatenate(order).astype(np.int64) if order else np.zeros(0, np.int64)
    bounds = np.concatenate([[0], np.cumsum(got.sum(axis=0))]).tolist()
    ex = Exchange(send, recv, xp.asarray(order), bounds)
    return dispatch_rows(ep, rows_x, ex, xp), ex


def dispatch_rows(ep, rows_x, ex: Exchange, xp):
    """Rows in the source's order to the owners, grouped there by local expert."""
    return ep.all_to_all(xp.ascontiguousarray(rows_x), ex.send, ex.recv)[ex.order]


def combine(ep, expert_rows, ex: Exchange, xp):
    """Rows in local-expert order back to their sources, in the order each source sent them."""
    back = xp.empty_like(expert_rows)
    back[ex.order] = expert_rows
    return ep.all_to_all(back, ex.recv, ex.send)
