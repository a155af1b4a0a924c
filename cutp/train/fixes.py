"""Refusals whose fixes work: every fix a refusal of `derive_run_config` proposes is checked by
deriving the settings with it, and only the ones that are then accepted are proposed.

A refusal names the problem, then its fixes after the first "; ", in a few forms this module
reads (`proposed`): "use a `cp` from [1, 2]", "use tp in [1, 2]", "omit `dp`", "omit both `tp` and `cp`", "start 8 ranks",
"start a multiple of 4 ranks", "a `seq_len` that is a multiple of 8", "`batch_size` 2",
"`tp` 2 with `dp` 2". When each of them works the refusal is left as written. Otherwise the fixes
are written again (`with_working_fixes`): those proposed that work, and what a search finds: each
mesh size or sequence length given, changed alone (`SEARCHED`) or omitted, and the smallest
number of ranks that runs the settings as given; when none of those runs, two given settings
omitted together, or a proposed fix on the smallest number of ranks that runs it ("`tp` 2 on 2
ranks"). (Checked: tests/train/test_refusal_fixes.py
over a grid of rank counts x tp x cp x pp x dp x seq-len x heads.)
"""
from __future__ import annotations

import re

from ..runtime.errors import ConfigError

SEARCHED = ("tp", "cp", "dp", "pp", "ep", "seq_len")
MESH = ("tp", "cp", "dp", "pp")
_VALUE = r"[0-9]+(?:[.,][0-9]+)*(?:e[+-]?[0-9]+)?|gpipe|1f1b|interleaved|ring|a2a|none|selective|full"
_COMBO = re.compile(rf"(?:use|give|or|,) `(\w+)` ({_VALUE})((?: with `\w+` (?:{_VALUE}))*)")


def _value(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def proposed(message: str) -> list[tuple[int | None, dict]]:
    """The fixes a refusal proposes, as (rank count or None, changed settings; None: omitted)."""
    head, sep, fixes = message.partition("; ")
    if not sep:
        return []
    out = []
    for name, options in re.findall(r"an? `(\w+)` from \[([0-9, ]*)\]", fixes):
        out += [(None, {name: int(v)}) for v in options.split(",") if v.strip()]
    for options in re.findall(r"use tp in \[([0-9, ]*)\]", fixes):
        out += [(None, {"tp": int(v)}) for v in options.split(",") if v.strip()]
    for name, more in re.findall(r"omit (?:both )?`(\w+)`((?: and `\w+`)*)", fixes):
        out.append((None, {name: None, **{k: None for k in re.findall(r"`(\w+)`", more)}}))
    for multiple, n in re.findall(r"start (a multiple of )?(\d+) ranks", fixes):
        out += [(int(n), {})] + ([(2 * int(n), {})] if multiple else [])
    out += [(None, {"seq_len": int(n)}) for n in re.findall(r"`seq_len` that is a multiple of (\d+)", fixes)]
    for name, value, rest in _COMBO.findall(fixes):
        change = {name: _value(value)}
        change.update({k: _value(v) for k, v in re.findall(rf"with `(\w+)` ({_VALUE})", rest)})
        out.append((None, change))
    return out


def _works(derive, choices: dict, world: int, ranks_per_node: int, fix) -> bool:
    ranks, change = fix
    n = ranks or world
    try:
        derive({**choices, **change}, n, ranks_per_node if ranks is None else min(ranks_per_node, n))
        return True
    except (ConfigError, TypeError, ValueError):  # (a value read wrongly from the text: not a fix)
        return False


def _searched(derive, choices: dict, world: int, ranks_per_node: int, model_block: int | None) -> list:
    """Fixes found by trying: each given mesh size or sequence length omitted or changed alone,
    and the smallest rank count that runs the settings as given."""
    out = []
    for name in SEARCHED:
        given = choices.get(name)
        if given is None:
            continue
        out.append((None, {name: None}))
        if name == "seq_len":
            limit = model_block or 4 * given
            steps = sorted({2 ** k for k in range(1, 11)})
            values = sorted({v for s in steps for v in (given - given % s, given - given % s + s) if 0 < v <= limit})
        else:
            values = [d for d in range(1, world + 1) if world % d == 0]
        out += [(None, {name: v}) for v in values if v != given]
    product = 1
    for name in MESH:
        product *= choices.get(name) or 1
    out += [(n, {}) for n in range(product, 4097, product) if n != world][:64]
    return out


def _render(fixes: list) -> str:
    parts, lists = [], {}
    ranks_shown = False
    for ranks, change in fixes:
        if ranks is not None and change:  # a change on another number of ranks
            parts.append(" with ".join(f"`{k}` {v}" for k, v in change.items()) + f" on {ranks} rank"
                         + ("s" if ranks > 1 else "") + f" (mpirun -np {ranks})")
            continue
        if ranks is not None and ranks_shown:
            continue  # the smallest rank count only (the fixes come sorted)
        if ranks is not None:
            ranks_shown = True
            parts.append(f"start {ranks} ranks (mpirun -np {ranks})")
        elif len(change) == 1 and next(iter(change.values())) is None:
            parts.append(f"omit `{next(iter(change))}`")
        elif len(change) == 1:
            (name, value), = change.items()
            lists.setdefault(name, []).append(value)
        elif all(v is None for v in change.values()):
            parts.append("omit both " + " and ".join(f"`{k}`" for k in change))
        else:
            parts.append("use " + " with ".join(f"`{k}` {v}" for k, v in change.items()))
    for name, values in lists.items():
        parts.insert(0, f"use `{name}` {values[0]}" if len(values) == 1 else
                     f"use a `{name}` from [{', '.join(map(str, sorted(set(values))))}]")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def with_working_fixes(error: ConfigError, derive, choices: dict, world: int, ranks_per_node: int,
                       model_block: int | None = None) -> ConfigError:
    """`error` when every fix it proposes is accepted (or it proposes none), else the same problem
    with the fixes that work: the proposed ones that do, the searched ones, at most one rank
    count (the smallest)."""
    message = error.args[0] if error.args else ""
    fixes = proposed(message)
    if not fixes:
        return error
    good = [f for f in fixes if _works(derive, choices, world, ranks_per_node, f)]
    if len(good) == len(fixes):
        return error
    seen = {(r, tuple(sorted(c.items()))) for r, c in good}
    ranks_found = any(r is not None for r, _ in good)
    for fix in _searched(derive, choices, world, ranks_per_node, model_block):
        key = (fix[0], tuple(sorted(fix[1].items())))
        if key in seen or (fix[0] is not None and ranks_found):
            continue
        if _works(derive, choices, world, ranks_per_node, fix):
            good.append(fix)
            seen.add(key)
            ranks_found = ranks_found or fix[0] is not None
    if not good:  # two given settings omitted together
        given = [n for n in SEARCHED if choices.get(n) is not None]
        good = [f for f in ((None, {a: None, b: None}) for i, a in enumerate(given) for b in given[i + 1:])
                if _works(derive, choices, world, ranks_per_node, f)]
    if not good:  # a proposed fix on another number of ranks (the smallest that runs it)
        for _, change in fixes:
            if change:
                n = next((n for n in range(1, 65) if n != world and _works(derive, choices, world, ranks_per_node,
                                                                            (n, change))), None)
                if n is not None:
                    good.append((n, change))
    head = message.partition("; ")[0]
    if not good:
        text = f"{head}; no one change of the given settings or of the rank count runs: revise the layout"
    else:
        rendered = _render(sorted(good, key=lambda f: (f[0] is not None, f[0] or 0)))
        text = f"{head}; {'use ' if rendered.startswith('`') else ''}{rendered}"
    rebuilt = type(error)(text)
    rebuilt.__dict__.update(error.__dict__)
    return rebuilt
