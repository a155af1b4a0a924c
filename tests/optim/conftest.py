"""Marker ``zero_full``: the whole ZeRO layout grid (tests/optim/test_zero.py), run with
``pytest -m zero_full tests/optim``; `make test` runs its representative part and reports the
rest skipped."""
from tests.markers import skip_unless_chosen

REASON = "the whole ZeRO layout grid: pytest -m zero_full tests/optim"


def pytest_configure(config):
    config.addinivalue_line("markers", "zero_full: the whole ZeRO layout grid (pytest -m zero_full tests/optim)")


def pytest_collection_modifyitems(config, items):
    skip_unless_chosen(config, items, "zero_full", REASON)
