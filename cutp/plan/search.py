"""`python -m cutp bench plan --params 70B --search [--gpus 64] [--gpu-memory 80]`: the TP x PP x
DP layouts of up to --gpus GPUs on which a --params architecture trains within a GPU's memory
(with `--cp N`: TP x CP x PP x DP, CP sizes the powers of two up to N, with --cp-comm's attention,
ring by default; a (TP, CP) that training refuses, `check_cp`, is left out).

For each TP size in 1, 2, 4, 8 (inside a node; those the heads split over) and each PP size that
divides the layers or is a power of two (then the layers split near-evenly, the larger stages
last: the first stage keeps the most micro-batches in flight under 1F1B), the fewest GPUs that fit: DP = 1, 2,
4, ... with tp * pp * dp <= --gpus, the least recomputation that fits (none, then selective,
then full), the least sharding that fits (ZeRO-1 over DP, then ZeRO-3 in replicas of a node
(HSDP) when DP spans nodes, then ZeRO-3 over all DP; under PP the gathered units kept from the
forward to the backward first, as torchtitan, then resharded: "kept" in the ZeRO column),
sequence parallelism (when tp > 1) and the 1F1B schedule, micro-batch --micro-batch x the
model's context, bf16 (--dtype).
A layout fits when its largest stage (`plan_pp.plan_pipeline`) fits --gpu-memory GB (1e9 bytes;
the CUDA context, NCCL and the allocator need some GB more). m = --batch-size / (dp x
micro-batch) micro-batches per step (default 4M tokens: Llama-2's batch), at least pp for 1F1B;
the bubble (p-1)/(m+p-1) follows from it.
"""
from __future__ import annotations

from ..models import near_even
from ..runtime.errors import ConfigError
from ..tensor_parallel.validation import check_attention, check_mlp
from ..train.reporting import Report
from .context import check_cp
from .layout import check_positive, model_name, model_of_args
from .pipeline import plan_pipeline

TPS = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")


def _powers(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _sharding(inner: int, dp: int, pp: int) -> list[tuple[int, int, bool]]:
    """(zero, dp_replicate, reshard_after_forward) to try, the least communication first: ZeRO-1,
    ZeRO-2 (the gradients sharded too: a reduce-scatter per micro-batch), ZeRO-3 with HSDP replicas of one node (8 GPUs: dp / R x tp x cp = 8) when DP spans nodes,
    ZeRO-3 over all DP; under PP without resharding first (torchtitan's default there), then with."""
    out = [(1, 1, True)]
    if dp > 1:
        out.append((2, 1, True))
        per_node = max(1, 8 // inner)
        for replicas in ([dp // per_node] if dp > per_node and dp % per_node == 0 else []) + [1]:
            out += [(3, replicas, False), (3, replicas, True)] if pp > 1 else [(3, replicas, True)]
    return out


def _zero2_may_fit(zero1: dict | None, shards: int, capacity: float) -> bool:
    """Whether ZeRO-2 could fit where ZeRO-1 did not: it keeps 1/shards of ZeRO-1's gradient
    buffer and the rest as ZeRO-1 (1% slack for the shards' padding); no ZeRO-1 plan: try it."""
    if zero1 is None:
        return True
    st = zero1["stages"][zero1["largest_stage"]]
    return st["total"] - st["grads"] * (1 - 1 / shards) <= capacity * 1.01


def fewest_gpus(a, *, tp: int, pp: int, gpus: int, capacity: float, dtype: str, micro_batch: int, seq_len: int,
                batch_size: int, cp: int = 1, cp_comm: str = "ring", plans: dict | None = None) -> dict:
    """The smallest DP (and the least recomputation) at which tp x pp fits `capacity` bytes:
    {"fits": bool, "dp", "recompute", "plan"}; when nothing fits, the layout that came closest.
    plans: a dict to keep the layouts' plans in, shared by calls that differ only in capacity
    (the plans do not depend on it)."""
    plans = {} if plans is None else plans
    layers = None if a.n_layer % pp == 0 else tuple(near_even(a.n_layer, pp))
    best = None
    for dp in _powers(gpus // (tp * cp * pp)):
        m = batch_size // (dp * micro_batch)
        if m < pp:
            break
        for recompute, (zero, replicas, reshard) in ((r, z) for r in RECOMPUTE for z in _sharding(tp * cp, dp, pp)):
            key = (tp, pp, dp, cp, cp_comm, recompute, micro_batch, seq_len, m, dtype, zero, replicas, reshard)
            if zero == 2 and key not in plans and not _zero2_may_fit(plans.get(key[:10] + (1, 1, True)), dp * cp,
                                                                     capacity):
                continue  # ZeRO-1 minus the gradients' (dp-1)/dp shares still over: not worth a plan
            if key not in plans:
                plans[key] = plan_pipeline(a, pp=pp, tp=tp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, accum=m,
                                           pp_layers=layers, dtype=dtype, distributed_optimizer=True,
                                           recompute=recompute, sequence_parallel=tp > 1, cp=cp,
                                           cp_comm=cp_comm, zero=zero, dp_replicate=replicas,
                                           reshard_after_forward=reshard)
            r = plans[key]
            peak = r["stages"][r["largest_stage"]]["total"]
            found = {"fits": peak <= capacity, "dp": dp, "recompute": recompute, "plan": r, "peak": peak,
                     "zero": zero, "dp_replicate": replicas, "reshard": reshard}
            if found["fits"]:
                return found
            if best is None or peak < best["peak"]:
                best = found
    return best or {"fits": False, "dp": None, "recompute": None, "plan": None, "peak": None}


def search(a, *, gpus: int = 64, capacities=(80e9, 141e9), dtype: str = "bfloat16", micro_batch: int = 1,
           seq_len: int | None = None, batch_size: int | None = None, max_cp: int = 1,
           cp_comm: str = "ring") -> list[dict]:
    """One row per (tp, cp, pp) of up to `gpus` GPUs (cp: the powers of two up to `max_cp` that
    training takes at that tp, `_trains`): for each capacity its fewest-GPU fit (`fewest_gpus`)."""
    seq = seq_len or a.block_size
    batch = batch_size or max(1, (1 << 22) // seq)
    rows = []
    for tp in TPS:
        if tp > gpus or not _splits(a, tp):
            continue
        for cp in [c for c in _powers(min(max_cp, gpus // tp)) if _trains(a, tp, c, cp_comm, seq)]:
            top = min(a.n_layer, gpus // (tp * cp))
            for pp in sorted(set(_powers(top)) | {d for d in range(1, top + 1) if a.n_layer % d == 0}):
                counts = near_even(a.n_layer, pp)
                row = {"tp": tp, "pp": pp, "layers": f"{counts[0]}" if a.n_layer % pp == 0 else
                       f"{counts[0]}-{counts[-1]}", "fit": {}, **({"cp": cp} if max_cp > 1 else {})}
                plans = {}  # (the capacities share the plans of the layouts they try)
                for cap in capacities:
                    row["fit"][cap] = fewest_gpus(a, tp=tp, pp=pp, gpus=gpus, capacity=cap, dtype=dtype,
                                                  micro_batch=micro_batch, seq_len=seq, batch_size=batch, cp=cp,
                                                  cp_comm=cp_comm, plans=plans)
                rows.append(row)
    return rows


def _trains(a, tp: int, cp: int, cp_comm: str, seq: int) -> bool:
    """Whether training takes tp x cp on `seq` tokens with the search's sequence parallelism (tp
    > 1): the 2cp chunks, seq / cp over tp, a2a's heads over cp (`check_cp`)."""
    if tp > 1 and seq % tp:  # (cp 1: sequence parallelism alone)
        return False
    try:
        check_cp(a, cp=cp, cp_comm=cp_comm, tp=tp, seq_len=seq, sequence_parallel=tp > 1)
    except ConfigError:
        return False
    return True


def _splits(a, tp: int) -> bool:
    """Whether training splits the model's heads and MLP over tp (the rules `plan` applies)."""
    try:
        check_attention(a.n_embd, a.n_head, a.kv_heads, tp)
        check_mlp(a.n_embd, a.hidden, tp)
    except ConfigError:
        return False
    return True


def _cells(f: dict, tp: int, pp: int, cp: int = 1) -> dict:
    if f["plan"] is None:
        return {"dp": None, "gpus": None, "recompute": "-", "zero": "-", "first": None, "last": None, "bubble": None,
                "ok": "no"}
    st, r = f["plan"]["stages"], f["plan"]
    zero = (f"{f['zero']}" + (f" (HSDP x{f['dp_replicate']})" if f["dp_replicate"] > 1 else "")
            + ("" if f["reshard"] or f["zero"] < 3 else ", kept"))
    return {"dp": f["dp"], "gpus": tp * cp * pp * f["dp"], "recompute": f["recompute"], "zero": zero,
            "first": st[0]["total"] / 1e9,
            "last": st[-1]["total"] / 1e9, "bubble": 100 * r["bubble"], "ok": "fits" if f["fits"] else "no"}


def markdown(a, rows, capacities, gpus: int) -> str:
    """The search as a Markdown table (README)."""
    with_cp = any("cp" in row for row in rows)
    head = ["TP"] + (["CP"] if with_cp else []) + ["PP", "layers/stage"]
    for cap in capacities:
        g = f"{cap / 1e9:g} GB"
        head += [f"{g}: fewest GPUs (DP)", "recompute", "stage 0 / last GB", "bubble", "ZeRO"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [str(row["tp"])] + ([str(row["cp"])] if with_cp else []) + [str(row["pp"]), row["layers"]]
        for cap in capacities:
            c = _cells(row["fit"][cap], row["tp"], row["pp"], row.get("cp", 1))
            if c["ok"] != "fits":
                cells += [f"no (> {gpus})", "-", "-" if c["first"] is None else
                          f"{c['first']:.0f} / {c['last']:.0f} at {c['gpus']}", "-", "-"]
            else:
                cells += [f"{c['gpus']} ({c['dp']})", c["recompute"], f"{c['first']:.1f} / {c['last']:.1f}",
                          f"{c['bubble']:.1f}%", c["zero"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args) -> Report:
    if args.preset:
        raise ConfigError("--search plans --params architectures (70B, 175B, ...); for a --preset give its layout "
                          "with --tp, --pp and --dp")
    if getattr(args, "plot", None):  # (`python -m cutp bench plan` has --plot; `python -m cutp plan` not)
        raise ConfigError("--plot draws one layout's memory; --search lists layouts (use --json or --markdown)")
    check_positive("gpus", args.gpus)
    caps = tuple(g * 1e9 for g in (args.gpu_memory or (80, 141)))
    if min(caps) <= 0:
        raise ConfigError(f"--gpu-memory {min(caps) / 1e9:g}: give the GB of one GPU, e.g. 80")
    a, _ = model_of_args(args)
    dtype = args.dtype or "bfloat16"
    max_cp = getattr(args, "cp", 1)  # with --search: the largest CP size tried
    check_positive("cp", max_cp)
    rows = search(a, gpus=args.gpus, capacities=caps, dtype=dtype, micro_batch=args.micro_batch,
                  seq_len=args.seq_len, batch_size=args.batch_size, max_cp=max_cp,
                  cp_comm=getattr(args, "cp_comm", "ring"))
    report = Report("plan", {})
    report.extra["search"] = [{**{k: v for k, v in r.items() if k != "fit"},
                               "fit": {f"{c / 1e9:g} GB": _cells(f, r["tp"], r["pp"], r.get("cp", 1))
                                       for c, f in r["fit"].items()}}
                              for r in rows]
    if args.markdown:
        report.extra["markdown"] = markdown(a, rows, caps, args.gpus)
    seq = args.seq_len or a.block_size
    for cap in caps:
        g = f"{cap / 1e9:g} GB"
        t = report.table(f"layouts {g}", [("tp", "TP", "d"), *([("cp", "CP", "d")] if max_cp > 1 else []),
                                          ("pp", "PP", "d"), ("layers", "layers/stage", "", ">"),
                                          ("gpus", "GPUs", "d"), ("dp", "DP", "d"), ("recompute", "recompute", "", ">"),
                                          ("zero", "ZeRO", "", ">"), ("first", "stage 0 GB", ",.1f"),
                                          ("last", "last stage GB", ",.1f"),
                                          ("bubble", "bubble %", ".1f"), ("ok", g, "", ">")],
                         title=f"{model_name(args)} on {g} GPUs: the fewest GPUs (up to {args.gpus}) per TP x "
                               + ("CP x " if max_cp > 1 else "") + "PP")
        for r in rows:
            t.add(tp=r["tp"], pp=r["pp"], layers=r["layers"], **({"cp": r["cp"]} if "cp" in r else {}),
                  **_cells(r["fit"][cap], r["tp"], r["pp"], r.get("cp", 1)))
        comm = f", CP's {getattr(args, 'cp_comm', 'ring')} attention" if max_cp > 1 else ""
        t.notes.append(f"{dtype}, distributed optimizer, sequence parallelism at tp > 1, 1F1B{comm}, micro-batch "
                       f"{args.micro_batch} x {seq}; the least recomputation that fits; 'no': the closest layout")
    return report
