"""What a run reports: the JSONL metrics file and the progress line; the tables (printed aligned,
exported as JSON) and the byte and count formats the benchmarks and the planner report with.

The metrics file holds one JSON object per step (`StepStats.record()`, plus `val_loss` on
evaluation steps), written by rank 0 and flushed after each row, so that a crash loses nothing
already reported. A resumed run first drops the rows after its checkpoint's step (a crashed run
logged them; those steps run again now) and appends after the rest. A last line cut short by a
crash is dropped with a warning; a line that is not JSON anywhere else is refused.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass

import numpy as np

from ..runtime.errors import UserError


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


# A metrics row's scalars as TensorBoard tags (TensorBoardLog): {row key: tag}; the MoE load and the
# memory of the first step by their own keys under moe/ and memory/.
TENSORBOARD_TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                    "loss_scale": "train/loss_scale", "ms": "perf/step_ms", "tokens_per_s": "perf/tokens_per_s",
                    "mfu": "perf/mfu", "comm_mb": "comm/mb", "comm_ms": "comm/ms", "exposed_comm_ms": "comm/exposed_ms",
                    "overlap_fraction": "comm/overlap_fraction", "dp_overlap_fraction": "comm/dp_overlap_fraction",
                    "link_exposed_ms": "comm/link_exposed_ms", "pipeline_wait_ms": "comm/pipeline_wait_ms"}
TENSORBOARD_HINT = "pip install tensorboardX (cutp's extra: pip install -e '.[tensorboard]')"


class TensorBoardLog:
    """Rank 0's TensorBoard event files in `directory` (--tensorboard DIR), through tensorboardX's
    writer: each metrics row's scalars (`TENSORBOARD_TAGS`; MoE load under moe/, memory under
    memory/) at its step. A resumed run first drops the events after its checkpoint's step (a
    crashed run wrote them; those steps run again). The JSONL file (MetricsLog) stays the record."""

    def __init__(self, directory: str | None, rank: int, resumed_step: int | None = None):
        self.writer = None
        if not directory or rank != 0:
            return
        try:
            from tensorboardX import SummaryWriter  # optional: the writer of --tensorboard, an extra
        except ImportError:
            raise UserError(f"--tensorboard needs the tensorboardX package: {TENSORBOARD_HINT}") from None
        # (the file's name holds the first step: tensorboardX names it by the second it opened)
        self.writer = SummaryWriter(directory, purge_step=None if resumed_step is None else resumed_step + 1,
                                    filename_suffix=f".from-step-{(resumed_step or 0) + 1}")

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = record["step"]
        for key, value in tensorboard_scalars(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def tensorboard_scalars(record: dict) -> dict:
    """{tag: value} of a metrics row (TensorBoardLog)."""
    out = {tag: float(record[k]) for k, tag in TENSORBOARD_TAGS.items()
           if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)}
    for k, v in record.items():
        if k.startswith("moe_"):
            if isinstance(v, list) and len(v) == 3:  # tokens per expert: min, mean, max
                out.update({f"moe/{k[4:]}_{n}": float(x) for n, x in zip(("min", "mean", "max"), v)})
            elif isinstance(v, (int, float)):
                out[f"moe/{k[4:]}"] = float(v)
    for k, v in (record.get("memory") or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("ranks", "params_local"):
            out[f"memory/{k}"] = float(v)
    return out


def progress_line(record: dict, steps: int | None = None) -> str:
    """`step    10/200 | loss 4.7489 | lr 2.00e-04 | norm 2.811 |   161.0 ms |    12,720 tok/s | MFU 31.2% |
    comm 18.90 MB | 0:00:02 elapsed, ETA 0:00:30` (MFU and the times where `Progress` added them;
    `| val 2.5989` on evaluation steps, `| scale 65536` with a loss scale, `| skipped` when the step
    was skipped)."""
    r = record
    mfu = "" if "mfu" not in r else " | MFU n/a" if r["mfu"] is None else f" | MFU {100 * r['mfu']:.1f}%"
    times = (f" | {_clock(r['elapsed_s'])} elapsed, ETA {_clock(r['eta_s'])}" if "eta_s" in r else "")
    return (f"step {r['step']:5d}{f'/{steps}' if steps else ''} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"norm {r['grad_norm']:.3f} | {r['ms']:7.1f} ms | {r['tokens_per_s']:9,.0f} tok/s{mfu} | "
            f"comm {r['comm_mb']:.2f} MB{times}"
            + (f" | scale {r['loss_scale']:g}" if "loss_scale" in r else "")
            + (f" | aux {r['moe_aux_loss']:.4f} | dropped {100 * r['moe_dropped']:.1f}%" if "moe_aux_loss" in r else "")
            + (" | skipped" if r.get("skipped") else "")
            + (f" | val {r['val_loss']:.4f}" if "val_loss" in r else ""))


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# Dense peak TFLOP/s of one GPU (the datasheets' SXM figures, without sparsity), by the name's
# model and the GEMMs' precision: 16-bit on tensor cores, float32 as TF32 (--allow-tf32) or plain.
PEAK_TFLOPS = {"H200": {"16": 989.0, "tf32": 494.0, "32": 67.0}, "H100": {"16": 989.0, "tf32": 494.0, "32": 67.0},
               "A100": {"16": 312.0, "tf32": 156.0, "32": 19.5}, "V100": {"16": 125.0, "tf32": 15.7, "32": 15.7}}


def known_peak_tflops(device_name: str | None, dtype: str, tf32: bool) -> float | None:
    """The table's peak for a GPU's name (None: unknown, a CPU, or float64)."""
    kind = "16" if dtype in ("bfloat16", "float16") else ("tf32" if tf32 else "32") if dtype == "float32" else None
    for model, peaks in PEAK_TFLOPS.items():
        if device_name and model in device_name.upper() and kind:
            return peaks[kind]
    return None


def gpu_name(device: str) -> str | None:
    """The GPU's name on a cuda run (None on the CPU or when CuPy cannot say)."""
    if device != "cuda":
        return None
    try:
        import cupy  # optional: the GPU backend, installed only where there is one

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception:  # (the name only serves the MFU's peak: unknown is n/a)
        return None


class Progress:
    """Adds to each step's metrics row the time since this invocation's first step began
    (`elapsed_s`), the estimated time to the last step (`eta_s`, from the mean step time after the
    first, which includes warm-ups) and the MFU (`mfu`: tokens/s x the model's training FLOPs per
    token / (peak FLOP/s x ranks); None when the peak is unknown)."""

    def __init__(self, flops_per_token: float, peak_tflops: float | None, ranks: int, start_step: int, end_step: int):
        self.flops, self.peak, self.ranks = flops_per_token, peak_tflops, ranks
        self.start_step, self.end_step = start_step, end_step
        self.begin = None
        self.first_end = None

    def start(self, now: float) -> None:
        self.begin = now

    def add(self, record: dict, now: float) -> dict:
        done = record["step"] - self.start_step
        if self.first_end is None:
            self.first_end = now
        elapsed = now - self.begin
        per_step = (now - self.first_end) / (done - 1) if done > 1 else elapsed / max(done, 1)
        record["elapsed_s"] = elapsed
        record["eta_s"] = per_step * max(self.end_step - record["step"], 0)
        record["mfu"] = (None if not self.peak else
                         record["tokens_per_s"] * self.flops / (self.peak * 1e12 * self.ranks))
        return record


def model_summary(config) -> str:
    """The model in one line, only what its family uses: `4 layers, n_embd 128, 4 heads (2 KV) of
    32, MLP swiglu 352, RMSNorm, RoPE (theta 500000), vocab 256, block 256, float32` (the MoE's
    experts on an MoE model, GeLU's approximation on a GeLU MLP, biases and tying where they differ
    from GPT-2's)."""
    c = config
    heads = f"{c.n_head} heads" + (f" ({c.kv_heads} KV)" if c.kv_heads != c.n_head else "") + f" of {c.head_size}"
    mlp = f"MLP {c.mlp} {c.hidden}" + (f" ({c.gelu})" if c.mlp == "gelu" else "")
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.n_layer))
    parts = [f"{c.n_layer} layer{'s' if c.n_layer != 1 else ''}", f"n_embd {c.n_embd}", heads] + ([mlp] if moe_layers < c.n_layer else [])
    if moe_layers:
        parts.append(f"MoE: {c.n_experts} {c.mlp} experts of {c.moe_ffn or c.hidden}, top-{c.moe_top_k}"
                     + (f", in {moe_layers} of {c.n_layer} layers" if moe_layers < c.n_layer else "")
                     + (f", capacity {c.moe_capacity_factor:g}" if c.moe_capacity_factor else ", dropless"))
    parts.append("RMSNorm" if c.norm == "rmsnorm" else "LayerNorm")
    if c.positions == "rope":
        parts.append(f"RoPE (theta {c.rope_theta:g}" + (f", {c.rope_scaling} x{c.rope_factor:g}"
                                                       if c.rope_scaling != "none" else "") + ")")
    else:
        parts.append("learned positions")
    parts += [f"vocab {c.vocab_size:,}", f"block {c.block_size}", c.dtype]
    parts += (["no biases"] if not c.bias else []) + (["untied head"] if not c.tie_embeddings else [])
    parts += [f"dropout {c.dropout:g}"] if c.dropout else []
    return ", ".join(parts)


def stderr_line(text: str) -> None:
    """text and its newline to stderr in one write (print writes them apart, and mpiexec's
    forwarding put the stdout progress line between them: "...scale now 2.7e+11step  3/6 | ...")."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def parameter_counts(config, model) -> str:
    """`500,544 total, 500,544 on this rank (vocab padded to 256; ...)`: both counts of parameters
    (transformers' count: the rank's counted the buffer too, so a rank seemed to hold more than the
    model); the rank's buffers (DeepSeek's correction biases, which no gradient trains) said apart."""
    params = model.parameters()
    mine = sum(int(p.data.size) for p in params if not p.buffer)
    buffers = sum(int(p.data.size) for p in params if p.buffer)
    return (f"{config.num_parameters():,} total, {mine:,} on this rank (vocab padded to {model.padded_vocab}"
            + (f"; the correction biases' {buffers:,} values, buffers, not counted" if buffers else "") + ")")


def bucket_line(run) -> str | None:
    """How many DP gradient buckets --overlap-grad-reduce cut (None without it)."""
    buckets = getattr(getattr(run, "grad_buckets", None), "buckets", None)
    if not buckets:
        return None
    sizes = [b.size for b in buckets]
    return (f"overlap: the DP gradient reduction in {len(sizes)} bucket{'s' if len(sizes) > 1 else ''} of "
            f"{min(sizes):,} to {max(sizes):,} elements, started during the backward"
            + (" (one bucket: it waits for the whole backward, nothing hidden; a smaller --bucket-size cuts more)"
               if len(sizes) == 1 else ""))


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------
@dataclass
class Column:
    key: str
    title: str
    fmt: str = ""  # format spec for numbers, e.g. ".2f"; strings are printed as they are
    align: str = ">"


class Table:
    """Rows of dicts with named columns: printed aligned, exported as JSON."""

    def __init__(self, name: str, columns: list, title: str | None = None, notes: list | None = None):
        self.name = name
        self.title = title or name
        self.columns = [c if isinstance(c, Column) else Column(*c) for c in columns]
        self.rows: list[dict] = []
        self.notes = list(notes or [])

    def add(self, **row) -> dict:
        self.rows.append(row)
        return row

    @staticmethod
    def cell(value, fmt: str) -> str:
        if value is None:
            return "-"
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            return "-" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and fmt:
            return format(value, fmt)
        return str(value)

    def render(self) -> str:
        heads = [c.title for c in self.columns]
        body = [[self.cell(r.get(c.key), c.fmt) for c in self.columns] for r in self.rows]
        widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(heads)]
        lines = [f"== {self.title} =="]
        lines.append("  ".join(format(h, f"{c.align}{w}") for h, c, w in zip(heads, self.columns, widths)))
        lines.append("  ".join("-" * w for w in widths))
        for b in body:
            lines.append("  ".join(format(v, f"{c.align}{w}") for v, c, w in zip(b, self.columns, widths)))
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"title": self.title, "columns": [{"key": c.key, "title": c.title} for c in self.columns],
                "rows": [_jsonable(r) for r in self.rows], "notes": self.notes}


class Report:
    """What one suite produces: tables, notes and machine facts (for stdout, JSON and plots)."""

    def __init__(self, suite: str, meta: dict | None = None):
        self.suite = suite
        self.meta = dict(meta or {})
        self.tables: list[Table] = []
        self.notes: list[str] = []
        self.extra: dict = {}

    def table(self, *args, **kwargs) -> Table:
        t = Table(*args, **kwargs)
        self.tables.append(t)
        return t

    def get(self, name: str) -> Table:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def render(self) -> str:
        parts = [f"### cutp bench {self.suite}"]
        parts += [t.render() for t in self.tables]
        parts += [f"note: {n}" for n in self.notes]
        return "\n\n".join(parts)

    def as_dict(self) -> dict:
        return {"suite": self.suite, "meta": _jsonable(self.meta), "notes": self.notes,
                "tables": {t.name: t.as_dict() for t in self.tables}, **_jsonable(self.extra)}

    def publish(self, json_path: str | None = None, quiet: bool = False) -> None:
        """What a command prints of its report (its Markdown, where it made one, else the tables)
        unless quiet, and the JSON file it writes."""
        if not quiet:
            print(self.extra.get("markdown") or self.render(), flush=True)
        if json_path:
            self.write_json(json_path)
            if not quiet:
                print(f"wrote {json_path}")

    def write_json(self, path: str) -> None:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.as_dict(), f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)


def _jsonable(v):
    """Plain JSON types (NaN/inf become None, NumPy scalars Python numbers, tuples lists)."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return f if math.isfinite(f) else None
    if v is None or isinstance(v, str):
        return v
    return str(v)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (powers of two)."""
    n, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            break
        n, unit = n / 1024, larger
    return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"


def parse_size(text: str) -> int:
    """'4K', '256M', '1G', '4096' -> bytes (K/M/G are powers of two; a trailing B or iB is allowed)."""
    s = str(text).strip().upper().replace("IB", "").rstrip("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    value = float(s)
    if value < 0:
        raise ValueError(f"negative size {text!r}")
    return int(value * mult)


def parse_count(text: str) -> float:
    """'70B' -> 7e10, '124M' -> 1.24e8, '1.5T' -> 1.5e12 (decimal, for parameter counts)."""
    s = str(text).strip().upper()
    for suffix, m in (("K", 1e3), ("M", 1e6), ("B", 1e9), ("G", 1e9), ("T", 1e12)):
        if s.endswith(suffix):
            return float(s[:-1]) * m
    return float(s)
