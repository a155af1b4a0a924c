"""What a run reports: the JSONL metrics file and the progress line.

The metrics file holds one JSON object per step (`StepStats.record()`, plus `val_loss` on
evaluation steps), written by rank 0 and flushed after each row, so that a crash loses nothing
already reported. A resumed run first drops the rows after its checkpoint's step (a crashed run
logged them; those steps run again now) and appends after the rest. A last line cut short by a
crash is dropped with a warning; a line that is not JSON anywhere else is refused.
"""
from __future__ import annotations

import json
import os
import sys


class MetricsLog:
    """Rank 0's JSONL metrics file (no file on other ranks, or without a path)."""

    def __init__(self, path: str | None, rank: int, resumed_step: int | None = None):
        self.file = None
        if not path or rank != 0:
            return
        if resumed_step is not None:
            keep_rows = []
            if os.path.exists(path):
                with open(path) as f:
                    lines = f.readlines()
                for i, ln in enumerate(lines):
                    if not ln.strip():
                        continue
                    try:
                        rec = json.loads(ln)
                    except ValueError:
                        if i < len(lines) - 1:
                            raise ValueError(f"{path}: line {i + 1} is not JSON (the file is corrupt, not just cut "
                                             "short); move it aside or pass another --metrics") from None
                        print(f"warning: {path}: its last line was cut short (a crash while writing it): "
                              "dropped", file=sys.stderr, flush=True)
                        continue
                    if rec.get("step", 0) <= resumed_step:
                        keep_rows.append(ln if ln.endswith("\n") else ln + "\n")
            with open(path + ".tmp", "w") as f:
                f.writelines(keep_rows)
            os.replace(path + ".tmp", path)
        self.file = open(path, "a" if resumed_step is not None else "w")

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def progress_line(record: dict) -> str:
    """`step    10 | loss 4.7489 | lr 2.00e-04 | norm 2.811 |   161.0 ms |    12,720 tok/s | comm 18.90 MB`
    (and `| val 2.5989` on evaluation steps, `| scale 65536` with a loss scale, `| skipped` when
    the step was skipped)."""
    r = record
    return (f"step {r['step']:5d} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | norm {r['grad_norm']:.3f} | "
            f"{r['ms']:7.1f} ms | {r['tokens_per_s']:9,.0f} tok/s | comm {r['comm_mb']:.2f} MB"
            + (f" | scale {r['loss_scale']:g}" if "loss_scale" in r else "")
            + (f" | aux {r['moe_aux_loss']:.4f} | dropped {100 * r['moe_dropped']:.1f}%" if "moe_aux_loss" in r else "")
            + (" | skipped" if r.get("skipped") else "")
            + (f" | val {r['val_loss']:.4f}" if "val_loss" in r else ""))
