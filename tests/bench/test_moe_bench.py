"""`cutp bench moe` (cutp.bench.moe) at a tiny size on the CPU: both paths timed against the dense
SwiGLU MLP, their peak memory measured, every expert's assignments counted, the JSON written.
(No timing assertions; the GPU side, the memory pool's peak: tests/device_path/test_device_edges.py.)"""
import json

import pytest

from cutp.bench.__main__ import main


def test_moe_bench_tiny_on_the_cpu(tmp_path, capsys):
    path = tmp_path / "moe.json"
    assert main(["moe", "--tokens", "16", "--hidden", "8", "--experts", "4", "--expert-width", "4", "--top-k", "2",
                 "--repeat", "1", "--json", str(path)]) == 0
    assert "grouped experts" in capsys.readouterr().out
    d = json.loads(path.read_text())
    assert d["meta"] == {"tokens": 16, "hidden": 8, "experts": 4, "expert_width": 4, "top_k": 2, "dtype": "float32",
                         "device": "cpu"}
    dense, moe = d["tables"]["moe"]["rows"]
    assert (dense["path"], dense["ratio"], dense["rows"]) == ("dense SwiGLU", 1.0, None)
    assert moe["path"] == "grouped experts" and moe["ms"] > 0 and moe["ratio"] == moe["ms"] / dense["ms"]
    lo, hi = (int(n) for n in moe["rows"].removesuffix(" per expert").split(".."))
    assert 0 <= lo <= 16 * 2 / 4 <= hi <= 16  # 32 assignments over 4 experts; a token picks an expert once
    assert all(r["peak"].endswith(("B", "KiB")) and float(r["peak"].split()[0]) > 0 for r in (dense, moe))
    assert d["notes"] == ["tokens x top-k x hidden = 1 KiB (one copy of the routed rows); dense width 8"]


def test_moe_bench_draws_its_figure(tmp_path, capsys):
    """Every suite has --plot, as `python -m cutp bench --help` says (moe's was refused)."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "moe.png"
    assert main(["moe", "--tokens", "16", "--hidden", "8", "--experts", "4", "--expert-width", "4", "--top-k", "2",
                 "--repeat", "1", "--quiet", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--experts", "0"], "--experts 0 is below 1: give --experts 1 or more"),
    (["--tokens", "0"], "--tokens 0 is below 1: give --tokens 1 or more"),
    (["--top-k", "0"], "--top-k 0 is below 1"),
    (["--repeat", "0"], "--repeat 0 is below 1"),
    (["--top-k", "5"], "--top-k 5 is more than --experts 4: each token picks top_k different experts; give --top-k <= 4"),
])
def test_moe_bench_refuses_numbers_it_cannot_run_in_one_line(argv, message, capsys):
    assert main(["moe", "--tokens", "16", "--hidden", "8", "--experts", "4", "--expert-width", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"python -m cutp bench moe: error: {message}" + err[err.index(message) + len(message):]
    assert err.count("\n") == 1 and "Traceback" not in err
