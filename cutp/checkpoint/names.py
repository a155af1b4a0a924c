"""Checkpoints written before cutp's neutral parameter names (GPT-2's wte, h.{i}.attn.c_attn, ...;
`cutp.models.names`): read under today's names.

`read_meta` passes meta.json through `stored_names_view`: for such a checkpoint its parameters
are renamed and `meta["stored_names"]` keeps {cutp name: the name in its files}; the header checks
see the files' tensors through `neutral_key`, and readers look tensors up by `stored_key`. Saving
again writes today's names.
"""
from __future__ import annotations

from ..models.names import from_gpt2, is_gpt2_name


def stored_names_view(meta: dict) -> dict:
    """`meta` itself, or for a checkpoint whose parameters carry GPT-2's names a copy under cutp's,
    with "stored_names" {cutp name: the name in its files}."""
    params = meta.get("params")
    if not isinstance(params, dict) or not any(isinstance(n, str) and is_gpt2_name(n) for n in params):
        return meta
    renamed = {from_gpt2(n) if isinstance(n, str) else n: n for n in params}
    if len(renamed) != len(params):  # both namings of one parameter: left for _meta_problem's checks
        return meta
    return {**meta, "params": {new: params[old] for new, old in renamed.items()}, "stored_names": renamed}


def stored_key(meta: dict, key: str, name: str) -> str:
    """The key under which a checkpoint's files hold tensor `key` of parameter `name` (key is
    name itself, or "exp_avg." / "exp_avg_sq." / "master." + name)."""
    stored = meta.get("stored_names", {}).get(name, name)
    return key[:len(key) - len(name)] + stored


def neutral_key(key: str, kind: str) -> str:
    """An older checkpoint's tensor key (a GPT-2 name, after "exp_avg." etc. in an optim file) under cutp's name."""
    if kind == "model":
        return from_gpt2(key)
    prefix, _, name = key.partition(".")
    return f"{prefix}.{from_gpt2(name)}"
