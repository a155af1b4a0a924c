"""`python -m cutp bench plan --pp P`: memory per pipeline stage, the point-to-point bytes and the
predicted bubble (`cutp.plan.layout` plans one rank of a pipeline-free mesh; this plans each stage).

Stages (cutp/models/stages.py): the layers split evenly over the P stages, or `--pp-layers a,b,..`; the
embeddings on the first stage, the final norm, the LM head and the loss on the last, which with tied
embeddings holds its own copy of the token embedding (its parameters, gradients and optimizer
state count there too). `--pp-virtual V` (the interleaved schedule, Megatron's interleaved 1F1B):
the layers split into P*V virtual stages (`--pp-layers` then gives P*V counts), virtual stage
c*P + s is model chunk c of rank s; the first virtual stage holds the embeddings, the last one
the head.

State per stage: `plan.state_bytes` of the stage's parameters (the same buffers as a whole model's).

Activations per stage: the micro-batches its schedule keeps in flight, each with what the
stage's layers keep for backward (m = --accum micro-batches per step):

    gpipe          m on every stage
    1f1b           min(p - s, m) on stage s: the first stage holds the most
    interleaved    min(m*V, 2*(p - s - 1) + (V - 1)*p + 1) chunk forwards on rank s (m*V when
                   m = p: all forwards first), each of one chunk's layers (Megatron's
                   get_num_warmup_microbatches, plus the steady state's one forward before its
                   backward; cutp.train.pipeline.plan)

A cutp preset's stage is cutp's own step of that pipeline rank, run on shape-only arrays (cutp.plan.run);
a --params architecture's stage holds, at the schedule's worst moment, the in-flight micro-batches'
stashes (Korthikanti et al.'s per-layer formula, `plan.activation_bytes_per_layer`) and the last
stage's fp32 logits for each of its own in flight.

Point to point: one [b, s, h] activation per micro-batch forward to the next stage and one
gradient back (the [b, s/t, h] sequence shard under sequence parallelism), in the activation dtype.

Bubble: the idle fraction of the ideal schedule's step, (p - 1) / (V m + p - 1) with V model
chunks per stage (`cutp.train.pipeline.pipeline_bubble`; `cutp bench model --pp` prints it next to
the measured one).
"""
from __future__ import annotations

import dataclasses
import functools

from ..models import GPTConfig, stage_layers
from ..runtime.errors import ConfigError
from ..train.pipeline import SCHEDULES, pipeline_bubble
from ..train.pipeline import plan as schedule_plan
from ..train.reporting import Report
from .layout import (GPUS, ITEMSIZE, check_positive, model_name, model_of_args, planned_ranks, check_layout,
                     layer_activation_bytes,
                   param_count, plan, resolve_dtype, state_bytes, state_bytes_ep)
from .finetune import settings_of
from .moe import dense_mlp_activation_bytes, moe_counts, moe_layer_activation_bytes
from ..runtime.mesh import Mesh
from .run import planned_parameters, planned_step
from .zero import gathered_units_bytes, zero_state_bytes

class Chunk:
    """One model chunk of a rank: its layers' global indices, whether it holds the embedding
    (the first virtual stage) and the head (the last)."""

    def __init__(self, layers, first: bool, last: bool):
        self.layers, self.first, self.last = tuple(layers), first, last


def schedule_events(kind: str, p: int, stage: int, m: int, v: int = 1) -> list[tuple[str, int, int]]:
    """The order of ("F" | "B", micro-batch, chunk) one rank runs: cutp's own schedule
    (`cutp.train.pipeline.plan`) without its exchanges."""
    return list(_schedule_events(kind, p, stage, m, v))


@functools.lru_cache(maxsize=1024)
def _schedule_events(kind: str, p: int, stage: int, m: int, v: int) -> tuple[tuple[str, int, int], ...]:
    # memoised: a layout search (`cutp.plan.search`) plans the same schedules hundreds of times
    return tuple(op for op in schedule_plan(kind, p, stage, m, v) if op[0] != "X")


@functools.lru_cache(maxsize=1024)
def _held_after_forwards(events: tuple) -> tuple[tuple[int, ...], ...]:
    """The distinct per-chunk counts of micro-batches held (forwards run, backwards not yet) just
    after each forward of `events`: the only moments a held total can peak. Memoised on the
    (memoised) schedule, so a layout search walks each schedule once, not per layer weight."""
    held, seen = [0] * (1 + max((c for _, _, c in events), default=0)), set()
    for kind, _, c in events:
        held[c] += 1 if kind == "F" else -1
        if kind == "F":
            seen.add(tuple(held))
    return tuple(seen) or ((0,) * len(held),)


def peak_held(events: tuple, chunk_weights) -> float:
    """`in_flight(events, lambda i, c: chunk_weights[c])`, from `_held_after_forwards`."""
    return max(sum(n * w for n, w in zip(counts, chunk_weights)) for counts in _held_after_forwards(events))


def in_flight(events, weight=lambda i, c: 1) -> float:
    """The most (weighted) micro-batch chunks held at once: forwards run, backwards not yet."""
    held, worst = 0, 0
    for kind, i, c in events:
        held += weight(i, c) if kind == "F" else -weight(i, c)
        worst = max(worst, held)
    return worst


def check_pipeline(*, n_layer: int, pp: int, m: int, schedule: str | None, virtual: int = 1,
                   pp_layers=None) -> tuple[str, list[list[Chunk]]]:
    """(the schedule, each rank's model chunks), or ConfigError naming the numbers: the rules of
    cutp's training (m >= pp for 1F1B) and Megatron's interleaved schedule (V >= 2, m a multiple
    of pp)."""
    check_positive("pp", pp)
    check_positive("pp_virtual", virtual)
    check_positive("accum", m)
    kind = schedule or ("interleaved" if virtual > 1 else "1f1b")
    if kind not in SCHEDULES:
        raise ConfigError(f"--pp-schedule {kind!r}: use one of {', '.join(SCHEDULES)}")
    if (kind == "interleaved") != (virtual > 1):
        raise ConfigError(f"--pp-schedule {kind} with --pp-virtual {virtual}: the interleaved schedule runs V >= 2 "
                          "model chunks per rank and the others one; give --pp-schedule interleaved with "
                          "--pp-virtual 2 or more, or drop --pp-virtual")
    if pp > 1 and kind == "1f1b" and m < pp:
        raise ConfigError(f"the 1F1B schedule needs at least pp={pp} micro-batches per step, got --accum {m}; "
                          f"use --accum {pp} or more, or --pp-schedule gpipe")
    if kind == "interleaved" and m % pp:
        raise ConfigError(f"the interleaved schedule needs a multiple of pp={pp} micro-batches per step, got "
                          f"--accum {m}; use --accum {m - m % pp or pp} or {m - m % pp + pp}")
    if pp_layers is not None and kind == "interleaved" and len(pp_layers) != pp * virtual:
        raise ConfigError(f"--pp-layers gives {len(pp_layers)} counts; the interleaved schedule needs one per virtual "
                          f"stage: pp x pp-virtual = {pp * virtual}")
    vstages = stage_layers(n_layer, pp * virtual, pp_layers)
    chunks = [[Chunk(vstages[c * pp + s], c == 0 and s == 0, c == virtual - 1 and s == pp - 1)
               for c in range(virtual)] for s in range(pp)]
    return kind, chunks


def stage_parameters(a: GPTConfig, tp: int, n_layers: int, first: bool, last: bool) -> int:
    """Parameters of one TP rank of a --params architecture's stage of n_layers layers."""
    pc = param_count(a, tp)
    n = n_layers * pc["layer_per_rank"]
    emb = pc["embedding_per_rank"]
    if first:
        n += emb + pc["position"]
    if last:
        n += pc["final_norm"] + (pc["head_per_rank"] if not a.tie_embeddings else (0 if first else emb))
    return n


def plan_pipeline(a: GPTConfig, *, pp: int, tp: int, dp: int, micro_batch: int, seq_len: int, accum: int,
                  schedule: str | None = None, virtual: int = 1, pp_layers=None, dtype: str | None = None,
                  precision: str | None = None, distributed_optimizer: bool = False,
                  config: GPTConfig | None = None, device: str = "cuda", threads: int = 1, recompute: str = "none",
                  recompute_layers: int | None = None, sequence_parallel: bool = False, ep: int = 1, cp: int = 1,
                  cp_comm: str = "ring", zero: int = 0, reshard_after_forward: bool = True,
                  dp_replicate: int = 1, overlap_param_gather: bool = False,
                  finetune: dict | None = None) -> dict:
    """Each stage's memory (state exact, activations per the schedule), the point-to-point bytes
    and the bubble (the module docstring). The mesh, recomputation and dtype checks are
    `plan.plan`'s (run at pp 1 first, on the whole model). An MoE model's stages: their dense
    parameters exact, their MoE layers' from `plan_moe`, the activations by the formula.
    `finetune`: RunConfig's freeze / lora_* settings: each stage's state of what trains there, from
    cutp's step on that stage (a dense cutp model; MoE and --params architectures are refused)."""
    dtype = resolve_dtype(dtype, precision)
    kind, chunks = check_pipeline(n_layer=a.n_layer, pp=pp, m=accum, schedule=schedule, virtual=virtual,
                                  pp_layers=pp_layers)
    check_layout(n_layer=a.n_layer, tp=tp, seq_len=seq_len, recompute=recompute, recompute_layers=recompute_layers,
                 sequence_parallel=sequence_parallel)
    layout = dict(recompute=recompute, recompute_layers=recompute_layers, sequence_parallel=sequence_parallel)
    sharding = dict(zero=max(zero, int(bool(distributed_optimizer))), reshard_after_forward=reshard_after_forward,
                    dp_replicate=dp_replicate, overlap_param_gather=bool(overlap_param_gather))
    distributed_optimizer = sharding["zero"] >= 1
    if finetune and (config is None or a.n_experts):
        raise ConfigError("--pp with --lora-rank or --freeze is planned stage by stage from cutp's own dense models; "
                          "plan this one without --pp (or fine-tune a dense --preset)")
    whole = plan(a, tp=tp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, accum=1, dtype=dtype,
                 distributed_optimizer=distributed_optimizer, config=config, device=device, threads=threads, ep=ep,
                 cp=cp, cp_comm=cp_comm, finetune=finetune, **sharding, **layout)  # (the mesh's and the model's checks)
    moe = moe_counts(a, tp, ep) if a.n_experts else None
    moe_delta = 0 if moe is None else moe["per_rank"] // moe["layers"]  # per MoE layer, in place of a dense MLP
    s, b, h = seq_len, micro_batch, a.n_embd
    act_bytes = ITEMSIZE[dtype]
    sp = sequence_parallel and tp > 1
    stages = []
    for rank, mine in enumerate(chunks):
        events = _schedule_events(kind, pp, rank, accum, virtual)
        layers = [n for ch in mine for n in ch.layers]
        first, last = mine[0].first, mine[-1].last
        n_moe = sum(1 for n in layers if a.is_moe_layer(n))
        if config is not None and moe is not None:  # the dense stage's exact shards, the MoE layers' own
            dense = dataclasses.replace(config, n_experts=0)
            n_local = max(sum(p.numel for p in planned_parameters(dense, tp=tp, pp=pp, rank=rank * tp + r,
                                                                  pp_layers=pp_layers, pp_virtual=virtual))
                          for r in planned_ranks(tp)) + n_moe * moe_delta
        if config is not None and moe is None:
            mesh = Mesh(tp, dp, pp, cp=cp)
            walks = [planned_step(config, tp=tp, dp=dp, pp=pp, cp=cp, cp_comm=cp_comm, rank=mesh.rank_of(r, d, rank),
                                  micro_batch=b,
                                  seq_len=s, accum=accum, dtype=dtype, device=device, threads=threads,
                                  distributed_optimizer=distributed_optimizer, pp_layers=pp_layers,
                                  pp_schedule=kind, pp_virtual=virtual, finetune=finetune, **sharding, **layout)
                     for r in planned_ranks(tp) for d in (planned_ranks(dp) if distributed_optimizer else (0,))]
            n_local = max(w["params_local"] for w in walks)
            worst = max(walks, key=lambda w: w["activations_peak"])
            act = {"bytes": worst["activations_peak"], "where": worst["where"],
                   "stash_per_layer": [max(w["stash_per_layer"][n] for w in walks) for n in layers],
                   "in_flight": worst["in_flight"]}
        else:
            if config is None:
                n_local = stage_parameters(a, tp, len(layers), first, last) + n_moe * moe_delta
            full = a.n_layer if recompute_layers is None else recompute_layers
            modes = {n: recompute if (recompute != "full" or n < full) else "none" for n in layers}
            per_layer = {n: layer_activation_bytes(a, s, b, tp, act_bytes, modes[n], sequence_parallel, cp, cp_comm)
                         for n in layers}
            for n in layers:  # an MoE layer's MLP in place of the dense one
                if moe is not None and a.is_moe_layer(n) and modes[n] != "full":
                    per_layer[n] += (moe_layer_activation_bytes(a, s // cp, b, tp, act_bytes, sequence_parallel)
                                     - dense_mlp_activation_bytes(a, s // cp, b, tp, act_bytes, sequence_parallel))
            logits = 4 * (s // cp) * b * a.vocab_size / tp
            weights = [sum(per_layer[n] for n in ch.layers) + (logits if ch.last else 0) for ch in mine]
            count = peak_held(events, [1] * len(weights))
            act = {"bytes": peak_held(events, weights),
                   "stash_per_layer": [per_layer[n] for n in layers], "in_flight": count,
                   "stash_per_micro_batch": max(weights)}
        st = state_bytes_ep(a, n_local, n_moe, dtype=dtype, dp=dp * cp, ep=ep,  # (ZeRO over DP x CP)
                            distributed_optimizer=distributed_optimizer)
        if sharding["zero"] >= 2:  # (the stage's parameters as one segment: cutp.plan.zero)
            st = zero_state_bytes(n_local, dtype=dtype, d=dp * cp // dp_replicate, zero=sharding["zero"])
            if sharding["zero"] == 3 and config is None:  # whole units held in the step (a preset's walk has them)
                act["bytes"] += gathered_units_bytes(param_count(a, tp, ep)["layer_per_rank"], n_local, dtype=dtype,
                                                     reshard_after_forward=reshard_after_forward)
        if finetune:  # (what trains on the stage: its step's own state, the rank holding the most)
            st = dict(st, **max((w["state"] for w in walks), key=lambda x: sum(x.values())))
        state = st["params"] + st["grads"] + st["optimizer"]
        stages.append({"stage": rank, "layers": [len(ch.layers) for ch in mine], "first": first, "last": last,
                       "params_local": n_local, "padded_params": st["padded"], "params": st["params"],
                       "grads": st["grads"], "optimizer": st["optimizer"], "state": state,
                       "activations_peak": act["bytes"], "activations": act, "in_flight": act["in_flight"],
                       "total": state + act["bytes"], "fits": {n: state + act["bytes"] <= cap for n, cap in GPUS}})
    largest = max(range(pp), key=lambda i: (stages[i]["total"], -i))
    message = b * (s // cp) * h * act_bytes // (tp if sp else 1)
    counted = int(bool(a.n_experts) and (a.moe_aux_loss_coeff > 0) and accum > 1)  # cutp.train.moe's counting pass:
    # every micro-batch forward through the stages once more before the schedule
    return {"arch": a.to_dict(), "pp": pp, "tp": tp, "dp": dp, "cp": cp, "cp_comm": cp_comm, "gpus": pp * tp * cp * dp,
            "schedule": kind,
            "virtual": virtual, "micro_batches": accum, "micro_batch": b, "seq_len": s, "dtype": dtype,
            "distributed_optimizer": bool(distributed_optimizer), "device": device, **layout, **sharding,
            "params_total": whole["params_total"], "params_per_gpu_pp1": whole["params_per_gpu"],
            "stages": stages, "largest_stage": largest, "bubble": pipeline_bubble(pp, accum, virtual),
            "p2p_bytes_per_micro_batch": message,
            "p2p_bytes_per_step": {"forward": (1 + counted) * accum * virtual * message,
                                   "backward": accum * virtual * message},
            "fits": {n: all(st["fits"][n] for st in stages) for n, _ in GPUS}}



def parse_pp_layers(text: str | None):
    """'5,6,6,5' -> (5, 6, 6, 5); None stays None."""
    if text is None:
        return None
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ConfigError(f"--pp-layers {text!r}: give the layers of each stage as integers, e.g. 5,6,6,5") from None


def micro_batches(args) -> int:
    """--accum; from --batch-size as training derives it (batch / (dp x micro-batch size), which must
    divide it); by default 1 without a pipeline and pp (the fewest 1F1B runs) with one."""
    batch = getattr(args, "batch_size", None)
    if batch is None:
        return args.accum if args.accum is not None else (args.pp if args.pp > 1 or args.pp_virtual > 1 else 1)
    per = args.dp * args.micro_batch_size
    check_positive("batch_size", batch)
    if batch % per:
        raise ConfigError(f"--batch-size {batch} is not a multiple of --dp {args.dp} x --micro-batch-size "
                          f"{args.micro_batch_size} = {per} (a step runs batch / (dp x micro-batch) micro-batches per "
                          f"DP rank); use --batch-size {max(per, batch - batch % per)} or {batch - batch % per + per}")
    if args.accum is not None and args.accum != batch // per:
        raise ConfigError(f"--batch-size {batch} at --dp {args.dp} x --micro-batch-size {args.micro_batch_size} is "
                          f"{batch // per} micro-batches per step, and --accum {args.accum} is given; give one of them")
    return batch // per


def run(args) -> Report:
    a, config = model_of_args(args)
    seq = args.seq_len or a.block_size
    r = plan_pipeline(a, pp=args.pp, tp=args.tp, dp=args.dp, micro_batch=args.micro_batch, seq_len=seq,
                      accum=micro_batches(args), schedule=args.pp_schedule, virtual=args.pp_virtual,
                      pp_layers=parse_pp_layers(args.pp_layers), dtype=args.dtype, precision=args.precision,
                      distributed_optimizer=args.distributed_optimizer, config=config, device=args.device,
                      threads=args.threads, recompute=args.recompute, recompute_layers=args.recompute_layers, ep=args.ep,
                      sequence_parallel=args.sequence_parallel, cp=getattr(args, "cp", 1),
                      cp_comm=getattr(args, "cp_comm", "ring"), zero=getattr(args, "zero", 0),
                      reshard_after_forward=getattr(args, "reshard_after_forward", True),
                      dp_replicate=getattr(args, "dp_replicate", 1),
                      overlap_param_gather=getattr(args, "overlap_param_gather", False), finetune=settings_of(args))
    report = Report("plan", {})
    report.extra["plan"] = r
    GB = 1e9
    p, v, m = r["pp"], r["virtual"], r["micro_batches"]
    sp = args.sequence_parallel and args.tp > 1
    cp = r["cp"]
    optimizer = (f"distributed AdamW (ZeRO-1 over dp={args.dp}" + (f" x cp {cp})" if cp > 1 else ")")
                 if r["distributed_optimizer"] else "AdamW")
    t = report.table("model", [("k", "model", "", "<"), ("v", "", "", "<")], title=model_name(args))
    for k, val in (("layers x width", f"{a.n_layer} x {a.n_embd}"),
                   ("parameters", f"{r['params_total']:,} ({r['params_total'] / 1e9:.2f} B)"),
                   ("mesh", f"tp {args.tp}" + (f" x cp {cp} ({r['cp_comm']})" if cp > 1 else "")
                    + f" x dp {args.dp} x pp {p} = {r['gpus']} GPUs"),
                   ("schedule", f"{r['schedule']}" + (f", {v} model chunks per rank" if v > 1 else "")
                    + f", {m} micro-batches of {args.micro_batch} x {seq} per step"),
                   ("dtype, optimizer", f"{r['dtype']}, {optimizer}"),
                   ("recompute, SP", f"{args.recompute}" + (f" (first {args.recompute_layers} layers)"
                                                            if args.recompute_layers else "")
                    + (", sequence parallel" if sp else ", no sequence parallelism"))):
        t.add(k=k, v=val)
    st = report.table("stages", [("stage", "stage", "d"), ("layers", "layers", "", ">"), ("params", "params/GPU", ",d"),
                                 ("state", "state GB", ",.2f"), ("in_flight", "in flight", "d"),
                                 ("act", "activations GB", ",.2f"), ("total", "total GB", ",.2f"),
                                 ("fits80", "80 GB", "", ">"), ("fits141", "141 GB", "", ">")],
                      title="memory per pipeline stage and GPU (GB = 1e9 bytes)")
    for s in r["stages"]:
        what = "+".join(map(str, s["layers"])) + (" +emb" if s["first"] else "") + (" +head" if s["last"] else "")
        st.add(stage=s["stage"], layers=what, params=s["params_local"], state=s["state"] / GB, in_flight=s["in_flight"],
               act=s["activations_peak"] / GB, total=s["total"] / GB,
               fits80="fits" if s["fits"]["80 GB"] else "no", fits141="fits" if s["fits"]["141 GB"] else "no")
    big = r["stages"][r["largest_stage"]]
    st.notes.append(f"stage {big['stage']} holds the most: {big['total'] / GB:,.2f} GB"
                    + (" (1F1B: the first stage keeps the most micro-batches in flight)"
                       if r["schedule"] != "gpipe" and big["stage"] == 0 else ""))
    st.notes.append("state: parameters, gradients and optimizer state of the stage's layers (+ the embeddings on the "
                    "first stage, the final norm and the LM head on the last; tied: the last stage's own copy of the token embedding)")
    unit = "chunk forwards" if v > 1 else "micro-batches"
    st.notes.append(f"in flight: the {unit} whose activations a stage holds at once ({r['schedule']}); activations: "
                    + ("cutp's step on that stage, simulated in the schedule's order" if config is not None
                       and not a.n_experts
                       else "that many stashes of the stage's layers (Korthikanti et al.; MoE layers with balanced "
                            "routing), + the fp32 logits on the last stage"))
    for name, cap in GPUS:
        verdict = "every stage fits" if r["fits"][name] else "does not fit"
        st.notes.append(f"{name} GPU: {verdict} (the largest {big['total'] / GB:,.1f} GB of {cap / GB:,.0f})")
    pipe = report.table("pipeline", [("what", "pipeline", "", "<"), ("value", "", "", "<")],
                        title="point to point and bubble")
    msg = r["p2p_bytes_per_micro_batch"]
    split = cp * (args.tp if sp else 1)  # (this rank's tokens: the CP rank's chunks, then SP's TP share)
    pipe.add(what="p2p per micro-batch", value=f"{msg / 1e6:,.2f} MB each way ([{args.micro_batch}, {seq}"
             + (f"/{split}" if split > 1 else "") + f", {a.n_embd}] {r['dtype']})")
    counted = r["p2p_bytes_per_step"]["forward"] > r["p2p_bytes_per_step"]["backward"]
    pipe.add(what="p2p per step and stage", value=f"{m * v} sends forward, {m * v} backward (the last stage "
             f"{m * (v - 1)} forward, the first {m * (v - 1)} backward): {r['p2p_bytes_per_step']['backward'] / 1e9:,.3f} GB each way"
             + (" (and forward as much again: the MoE counting pass)" if counted else ""))
    pipe.add(what="predicted bubble", value=f"{100 * r['bubble']:.1f}% = " + ("(p-1)/(V*m+p-1)" if v > 1 else "(p-1)/(m+p-1)")
             + f" with p={p}, m={m}" + (f", V={v}" if v > 1 else ""))
    return report
