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


def test_moe_bench_has_no_figure_and_refuses_plot_before_running(capsys):
    """The moe suite draws no figure: --plot is refused by the parser, before any work (it used to
    run the benchmark, then end in a ValueError traceback)."""
    with pytest.raises(SystemExit) as e:
        main(["moe", "--tokens", "16", "--plot", "x.png"])
    assert e.value.code == 2 and "unrecognized arguments: --plot" in capsys.readouterr().err
