"""README's table of activation memory: measured next to predicted, for --recompute none /
selective / full x --sequence-parallel off / on at several TP sizes.

    python tools/memory_table.py                          # gpt2, 2 layers, micro-batch 1 x 1024, TP 1 2 4
    python tools/memory_table.py --tp 1 2 --seq-len 256 --json out/memory_table.json

For each TP size it launches `mpiexec -n TP python tools/memory_table.py --worker ...`, which
trains one step of each setting on the CPU in float32 (`cutp.train.measured_step`, ops on one
thread: CUTP_OP_THREADS=1) and records, as the first step's memory record does, the bytes each
layer keeps for backward after its forward (the largest layer on the largest rank) and the
step's activation peak (the largest rank). The predictions are `cutp bench plan --device cpu
--threads 1`'s for the same settings (`cutp.plan.layout.plan`), plus its peak for the preset's
own layer count (the per-layer figures do not depend on it) and Korthikanti et al. 2022's
Table 2 per-layer figure (4-byte activations). Prints a Markdown table (and writes JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from mpi4py import MPI

from cutp import train
from cutp.plan import layout as plan
from cutp.bench.model import random_tokens
from cutp.models import GPTConfig

SETTINGS = [(rc, sp) for rc in ("none", "selective", "full") for sp in (False, True)]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--layers", type=int, default=2, help="layers of the measured model (default 2)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: this rank measures; rank 0 writes here
    return p.parse_args(argv)


def measure(args) -> None:
    """Under mpiexec: one step of each setting, the largest figures over the ranks to args.worker."""
    comm = MPI.COMM_WORLD
    tp = comm.Get_size()
    rows = []
    for rc, sp in SETTINGS:
        if sp and tp == 1:
            continue  # a no-op at tp 1
        cfg = train.resolve_run_config(comm, preset=args.preset, set=[f"n_layer={args.layers}"], dtype="float32",
                                       tp=tp, dp=1, batch_size=args.micro_batch, micro_batch_size=args.micro_batch,
                                       seq_len=args.seq_len, steps=1, device="cpu", eval_every=0, quiet=True,
                                       save_on_signal=False, recompute=rc, sequence_parallel=sp)
        run = train.build_run(cfg, comm, dataset=random_tokens(cfg.model.vocab_size, 1 << 14, 0))
        _, mem = train.measured_step(run)
        run.close()
        rows.append({"tp": tp, "recompute": rc, "sequence_parallel": sp, "stash": max(mem["stash_per_layer"]),
                     "peak": mem["activations_peak"]})
    if comm.Get_rank() == 0:
        with open(args.worker, "w") as f:
            json.dump(rows, f)


def predict(args, row) -> dict:
    full = GPTConfig.preset(args.preset)
    small = GPTConfig.preset(args.preset, n_layer=args.layers)
    kw = dict(tp=row["tp"], dp=1, micro_batch=args.micro_batch, seq_len=args.seq_len, dtype="float32", device="cpu",
              threads=1, recompute=row["recompute"], sequence_parallel=row["sequence_parallel"])
    mine = plan.plan(plan.arch_from_config(args.preset, small), config=small, **kw)
    whole = plan.plan(plan.arch_from_config(args.preset, full), config=full, **kw)
    korthikanti = plan.activation_bytes_per_layer(args.seq_len, args.micro_batch, full.n_embd, full.n_head, row["tp"], 4,
                                                  row["recompute"], row["sequence_parallel"])
    return {"stash_pred": max(mine["activations"]["stash_per_layer"]), "peak_pred": mine["act_bytes"],
            "peak_pred_full": whole["act_bytes"], "korthikanti": korthikanti}


def table(args, rows) -> str:
    mb = 1e6
    out = [f"| TP | recompute | SP | kept per layer: measured | predicted | Korthikanti (fp32) | "
           f"peak, {args.layers} layers: measured | predicted | peak, {_layers(args)} layers: predicted |",
           "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['tp']} | {r['recompute']} | {'on' if r['sequence_parallel'] else 'off'} | "
                   f"{r['stash'] / mb:.1f} MB | {r['stash_pred'] / mb:.1f} MB ({r['stash_pred'] / r['stash'] - 1:+.1%}) | "
                   f"{r['korthikanti'] / mb:.1f} MB | {r['peak'] / mb:.1f} MB | "
                   f"{r['peak_pred'] / mb:.1f} MB ({r['peak_pred'] / r['peak'] - 1:+.1%}) | {r['peak_pred_full'] / mb:.1f} MB |")
    return "\n".join(out)


def _layers(args) -> int:
    return GPTConfig.preset(args.preset).n_layer


def main(argv=None) -> int:
    args = _args(argv)
    if args.worker:
        measure(args)
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            path = os.path.join(tmp, f"tp{tp}.json")
            cmd = [mpiexec, "-n", str(tp), sys.executable, os.path.join(here, "memory_table.py"), "--worker", path,
                   "--preset", args.preset, "--layers", str(args.layers), "--micro-batch", str(args.micro_batch),
                   "--seq-len", str(args.seq_len)]
            subprocess.run(cmd, check=True, env=dict(os.environ, CUTP_OP_THREADS="1",
                                                     PYTHONPATH=os.path.dirname(here)))
            with open(path) as f:
                rows += json.load(f)
    for r in rows:
        r.update(predict(args, r))
    print(table(args, rows))
    worst = max(max(abs(r["stash_pred"] / r["stash"] - 1), abs(r["peak_pred"] / r["peak"] - 1)) for r in rows)
    print(f"\nworst error of a prediction: {worst:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
