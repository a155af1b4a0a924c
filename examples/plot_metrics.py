"""Turn a training run's JSONL metrics into a loss-curve PNG, or several runs into one comparison.

    python examples/plot_metrics.py out/tiny/metrics.jsonl out/tiny/loss.png
    python examples/plot_metrics.py fp32.jsonl bf16.jsonl compare.png      # curves of each run

Needs matplotlib (`pip install cutp[plot]`).
"""
from __future__ import annotations

import json
import sys


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(rows, out_png, title=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("no metrics to plot")
    steps = [r["step"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(steps, [r["loss"] for r in rows], lw=1, alpha=0.6, label="train loss")
    k = max(1, len(rows) // 50)  # a moving average shows the trend through batch noise
    smooth = [sum(r["loss"] for r in rows[max(0, i - k):i + 1]) / len(rows[max(0, i - k):i + 1])
              for i in range(len(rows))]
    ax.plot(steps, smooth, lw=2, label=f"train loss (mean of {k + 1})")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", lw=2, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax2.plot(steps, [r["tokens_per_s"] for r in rows], lw=1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s")
    ax2.set_title("throughput")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def compare(runs: dict, out_png, title=None):
    """Train (moving average) and validation loss of each run ({label: rows}) in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, rows) in enumerate(runs.items()):
        color = f"C{i}"
        steps = [r["step"] for r in rows]
        k = max(1, len(rows) // 30)
        smooth = [sum(r["loss"] for r in rows[max(0, j - k):j + 1]) / len(rows[max(0, j - k):j + 1])
                  for j in range(len(rows))]
        ax.plot(steps, smooth, lw=1.5, color=color, alpha=0.7, label=f"{label} train (mean of {k + 1})")
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o-", lw=2, ms=3, color=color, label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or (len(argv) > 2 and not argv[-1].endswith(".png")):
        print(__doc__, file=sys.stderr)
        return 2
    if len(argv) > 2:  # several runs, labelled by their file names
        runs = {src.rsplit("/", 1)[-1].rsplit(".", 1)[0]: load(src) for src in argv[:-1]}
        print(compare(runs, argv[-1]))
        return 0
    src = argv[0]
    dst = argv[1] if len(argv) == 2 else src.rsplit(".", 1)[0] + ".png"
    print(plot(load(src), dst, title=src))
    return 0


if __name__ == "__main__":
    sys.exit(main())
