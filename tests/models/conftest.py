"""Marker ``moe_full``: the MoE families' whole layout grid (tests/models/test_moe_layouts.py), run
with ``pytest -m moe_full tests/models``; `make test` runs its representative part (in
tests/models/test_families.py's launch) and reports the rest skipped."""
from tests.markers import skip_unless_chosen

REASON = "the MoE families' whole layout grid: pytest -m moe_full tests/models"


def pytest_configure(config):
    config.addinivalue_line("markers", f"moe_full: {REASON}")


def pytest_collection_modifyitems(config, items):
    skip_unless_chosen(config, items, "moe_full", REASON)
