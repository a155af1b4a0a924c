"""cutp.bench.plot: each suite's figure from a small report of the suite's own table layout (as
`--plot` draws it): the PNG's size, and what the figure holds (one bar per timed kernel row, one
line per collective, compute and communication stacked per phase, a pair of bars per compared
model); a suite without a figure is refused by name. (The plan's figure: test_suites.py.)"""
from __future__ import annotations

import struct

import pytest

from cutp.bench import plot
from cutp.train.reporting import Report

pytest.importorskip("matplotlib", reason="the figures need matplotlib, the `plot` extra, not installed here")


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions close (after saving), to look inside."""
    plt = plot._plt()
    closed, close = [], plt.close

    def keep(fig=None):
        closed.append(fig)
        close(fig)

    monkeypatch.setattr(plt, "close", keep)
    return closed


def _kernels(n: int) -> Report:
    r = Report("kernels", {"gpu": "test GPU"})
    t = r.table("kernels", [("op", "op")])
    for i in range(n):
        t.add(op=f"op{i}", shape="4x4", dtype="float32", impl="reference" if i % 2 else "cuda_kernels", gbs=1.0 + i)
    t.add(op="untimed", shape="4x4", dtype="float32", impl="reference", gbs=None)  # no bar
    r.table("attention", [("op", "op")]).add(op="attention_fwd", shape="x", dtype="float32", impl="unfused", gbs=9.0)
    r.extra["copy"] = {"gbs": 5.0}
    return r


def test_each_suite_has_its_figure(tmp_path, figures):
    path = plot.plot_report(_kernels(10), str(tmp_path / "sub" / "kernels.png"))  # (the directory is made)
    assert _png_size(tmp_path / "sub" / "kernels.png") == (1080, 384)  # 9 x (0.22 x 10 rows + 1) inches at 120 dpi
    ax = figures[-1].axes[0]
    assert path.endswith("kernels.png") and len(ax.patches) == 10 and len(ax.lines) == 1  # the copy's line

    comm = Report("comm", {"communicator": "mpi", "ranks": 2, "device": "cpu"})
    rows = comm.table("comm", [("op", "op")])
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for size in (4096, 16384):
            rows.add(op=op, size=size, busbw=size / 4096)
    plot.plot_report(comm, str(tmp_path / "comm.png"))
    assert _png_size(tmp_path / "comm.png") == (840, 540)
    assert [len(line.get_xdata()) for line in figures[-1].axes[0].lines] == [2, 2, 2]

    model = Report("model")
    phases = model.table("phases", [("phase", "phase")])
    for phase, comp, comm_ms in (("forward", 3.0, 1.0), ("backward", 6.0, None), ("optimizer", 1.0, 0.0),
                                 ("step", 10.0, 1.0)):
        phases.add(phase=phase, compute_ms=comp, comm_ms=comm_ms)
    model.table("step", [("preset", "preset")]).add(preset="tiny", mesh="2 x 1", tok_s=1234.5)
    plot.plot_report(model, str(tmp_path / "model.png"))
    assert _png_size(tmp_path / "model.png") == (720, 420)
    ax = figures[-1].axes[0]
    assert len(ax.patches) == 6 and "1,234 tokens/s" in ax.get_title()  # 3 phases (not the step) x 2

    compare = Report("compare-torch")
    c = compare.table("compare", [("preset", "preset")])
    c.add(preset="tiny", shape="2x16", cutp_ms=2.0, torch_ms=1.0, ratio=2.0)
    c.add(preset="tiny", shape="2x64", cutp_ms=None, torch_ms=1.0, ratio=None)  # not timed: no bars
    plot.plot_report(compare, str(tmp_path / "compare.png"))
    assert _png_size(tmp_path / "compare.png") == (720, 420) and len(figures[-1].axes[0].patches) == 2

    moe = Report("moe")
    m = moe.table("moe", [("path", "path")])
    m.add(path="dense SwiGLU", ms=2.0, ratio=1.0, peak="1 KiB")
    m.add(path="grouped experts", ms=3.0, ratio=1.5, peak="2 KiB")
    plot.plot_report(moe, str(tmp_path / "moe.png"))
    assert _png_size(tmp_path / "moe.png") == (720, 300) and len(figures[-1].axes[0].patches) == 2

    with pytest.raises(ValueError, match="no plot for suite 'nope'"):
        plot.plot_report(Report("nope"), str(tmp_path / "nope.png"))
    assert not (tmp_path / "nope.png").exists()
