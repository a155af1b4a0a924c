"""PNG figures of the suites' results (matplotlib, the `plot` extra; imported only for --plot)."""
from __future__ import annotations

import os


def _plt():
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib  # optional dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency

    return plt


def plot_report(report, path: str) -> str:
    """Writes the figure that fits report.suite to `path`; returns the path."""
    fn = {"kernels": plot_kernels, "comm": plot_comm, "model": plot_model, "compare-torch": plot_compare,
          "plan": plot_plan, "moe": plot_moe}.get(report.suite)
    if fn is None:
        raise ValueError(f"no plot for suite {report.suite!r}")
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fn(report, path)
    return path


def plot_kernels(report, path):
    plt = _plt()
    rows = [r for t in report.tables if t.name == "kernels" for r in t.rows if r.get("gbs")]  # not the attention
    copy = report.extra.get("copy", {}).get("gbs")
    labels = [f"{r['op']} {r['shape']} {r['dtype']} {r['impl']}" for r in rows]
    vals = [r["gbs"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, max(3, 0.22 * len(rows) + 1)))
    colors = ["C0" if r["impl"] in ("reference", "cutp.ops", "cupy") else "C1" for r in rows]
    ax.barh(range(len(rows)), vals, color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.invert_yaxis()
    if copy:
        ax.axvline(copy, color="C3", linestyle="--", label=f"copy {copy:.0f} GB/s")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("achieved GB/s (bytes moved / time)")
    ax.set_title(f"cutp kernels on {report.meta.get('gpu') or report.meta.get('cpu', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comm(report, path):
    plt = _plt()
    rows = report.get("comm").rows
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op]
        ax.plot([r["size"] for r in rs], [r["busbw"] for r in rs], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{report.meta.get('communicator', '')} over {report.meta.get('ranks')} ranks ({report.meta.get('device')})",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_model(report, path):
    plt = _plt()
    rows = [r for r in report.get("phases").rows if r["phase"] != "step"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    comp = [r["compute_ms"] for r in rows]
    comm = [r["comm_ms"] or 0.0 for r in rows]
    x = range(len(rows))
    ax.bar(x, comp, label="compute")
    ax.bar(x, comm, bottom=comp, label="communication")
    ax.set_xticks(list(x), [r["phase"] for r in rows])
    ax.set_ylabel("ms per step")
    step = report.get("step").rows[0]
    ax.set_title(f"{step['preset']} tp x dp {step['mesh']}: {step['tok_s']:,.0f} tokens/s", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compare(report, path):
    plt = _plt()
    rows = [r for r in report.get("compare").rows if r.get("cutp_ms")] if report.tables else []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["cutp_ms"] for r in rows], width=0.4, label="cutp")
    ax.bar([i + 0.2 for i in x], [r["torch_ms"] for r in rows], width=0.4, label="torch")
    ax.set_xticks(list(x), [f"{r['preset']} {r['shape']}\ncutp/torch {r['ratio']:.2f}" for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per forward+backward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_plan(report, path):
    plt = _plt()
    if any(t.name == "stages" for t in report.tables):  # --pp: each stage's state and activations
        rows = report.get("stages").rows
        fig, ax = plt.subplots(figsize=(6, 3.5))
        y = range(len(rows))
        ax.barh(y, [r["state"] for r in rows], label="params, grads, optimizer")
        ax.barh(y, [r["act"] for r in rows], left=[r["state"] for r in rows], label="activations")
        ax.set_yticks(y, [f"stage {r['stage']}" for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("GB per GPU")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return
    rows = [r for r in report.get("memory").rows if r["what"] != "total"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh(range(len(rows)), [r["gb"] for r in rows])
    ax.set_yticks(range(len(rows)), [r["what"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB per GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_moe(report, path):
    """The grouped experts' and the dense MLP's fwd+bwd time, each labelled with its peak memory."""
    plt = _plt()
    rows = report.get("moe").rows
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.barh(range(len(rows)), [r["ms"] for r in rows])
    ax.set_yticks(range(len(rows)), [f"{r['path']}\n{r['ratio']:.2f}x dense, peak {r['peak']}" for r in rows],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per forward+backward")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
