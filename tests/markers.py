"""Opt-in markers: tests a marker names run only when `-m` names it (`pytest -m moe_full ...`);
otherwise they are reported skipped with the reason (how to run them)."""
import pytest


def skip_unless_chosen(config, items, marker: str, reason: str) -> None:
    """pytest_collection_modifyitems' body for an opt-in `marker`."""
    if marker in (config.getoption("markexpr", "") or ""):
        return
    for item in items:
        if item.get_closest_marker(marker):
            item.add_marker(pytest.mark.skip(reason=reason))
