"""Marker ``zero_full``: the whole ZeRO layout grid (tests/optim/test_zero.py), run with
``pytest -m zero_full tests/optim``; `make test` runs its representative part and reports the
rest skipped."""
import pytest

REASON = "the whole ZeRO layout grid: pytest -m zero_full tests/optim"


def pytest_configure(config):
    config.addinivalue_line("markers", "zero_full: the whole ZeRO layout grid (pytest -m zero_full tests/optim)")


def pytest_collection_modifyitems(config, items):
    if "zero_full" in (config.getoption("markexpr", "") or ""):
        return
    for item in items:
        if item.get_closest_marker("zero_full"):
            item.add_marker(pytest.mark.skip(reason=REASON))
