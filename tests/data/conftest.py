import io

import pytest

from cutp.data.prepare import prepare


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared directory of six byte-level documents (format version 2), in shards of 5,000 tokens."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "in").mkdir()
    for i in range(6):
        (root / "in" / f"{i}.txt").write_text(f"document {i}: " + "some words of text, " * 200)
    prepare([str(root / "in")], "bytes", str(root / "data"), shard_tokens=5_000, val_fraction=0.3, workers=1,
            stream=io.StringIO())
    return root / "data"
