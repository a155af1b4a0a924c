"""Every rank must run the same configuration: compare a hash across ranks, name what differs.

A mistyped flag on one node, or a script edited between launches, otherwise surfaces as a hang
or as silently wrong gradients. `check_same_on_all_ranks` costs one all-gather of 32 bytes per
rank; only when hashes differ does it gather per-field hashes and values to name the fields
and which ranks hold which value.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
from mpi4py import MPI

from .errors import ConfigError
from .failure import mark_raised_on_every_rank
from .watchdog import host_watchdog

_VALUE_BYTES = 96


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, default=str).encode()


def config_hash(config: dict) -> bytes:
    return hashlib.sha256(_canonical(config)).digest()


def flatten(config: dict, prefix: str = "") -> dict:
    """Nested dicts become dotted keys, so a difference is named down to the leaf field."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def check_same_on_all_ranks(mpi_comm, config: dict, what: str = "configuration") -> None:
    """Collective over mpi_comm. Raises ConfigError on every rank if any rank's config differs."""
    config = flatten(config)
    n = mpi_comm.Get_size()
    if n == 1:
        return
    with host_watchdog().guard(f"the cross-rank check of the {what} (host all-gather)"):
        _check(mpi_comm, config, what, n)


def _check(mpi_comm, config: dict, what: str, n: int) -> None:
    mine = np.frombuffer(config_hash(config), np.uint8).copy()
    every = np.empty((n, 32), np.uint8)
    mpi_comm.Allgather([mine, MPI.UINT8_T], [every, MPI.UINT8_T])
    if (every == every[0]).all():
        return
    # Something differs: find the fields. Field names are compared as a set first.
    keys = sorted(config)
    key_hash = np.frombuffer(hashlib.sha256(_canonical(keys)).digest(), np.uint8).copy()
    all_key_hashes = np.empty((n, 32), np.uint8)
    mpi_comm.Allgather([key_hash, MPI.UINT8_T], [all_key_hashes, MPI.UINT8_T])
    if not (all_key_hashes == all_key_hashes[0]).all():
        groups = _group_ranks(all_key_hashes)
        raise mark_raised_on_every_rank(ConfigError(
            f"the {what} has different fields on different ranks (rank groups {groups}); "
            "launch the same cutp version and script on every rank"), mpi_comm, 0)
    values = np.zeros((len(keys), _VALUE_BYTES), np.uint8)
    for i, k in enumerate(keys):
        text = _canonical(config[k])[:_VALUE_BYTES]
        values[i, : len(text)] = np.frombuffer(text, np.uint8)
    every_values = np.empty((n,) + values.shape, np.uint8)
    mpi_comm.Allgather([values, MPI.UINT8_T], [every_values, MPI.UINT8_T])
    problems = []
    for i, k in enumerate(keys):
        column = every_values[:, i]
        if (column == column[0]).all():
            continue
        by_value = {}
        for r in range(n):
            by_value.setdefault(bytes(column[r]).rstrip(b"\0").decode(errors="replace"), []).append(r)
        problems.append(f"{k}: " + ", ".join(f"ranks {_ranges(rs)} have {v}" for v, rs in by_value.items()))
    if not problems:
        problems = ["values differ beyond their first %d bytes" % _VALUE_BYTES]
    raise mark_raised_on_every_rank(ConfigError(
        f"the {what} differs across ranks: " + "; ".join(problems) + ". Every rank must get the same arguments."),
        mpi_comm, 0)


def _group_ranks(rows):
    groups = {}
    for r, row in enumerate(rows):
        groups.setdefault(bytes(row), []).append(r)
    return [_ranges(g) for g in groups.values()]


def _ranges(ranks) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)
