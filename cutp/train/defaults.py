"""The defaults `resolve_run_config` derives from what was given (cutp.train.config): the
tensor-parallel size for the machine, the batch and micro-batch a pipeline schedule needs, the
preset; and the refusal of a layout setting that would do nothing. Pure."""
from __future__ import annotations

import dataclasses

from ..models import GPTConfig
from ..runtime.errors import ConfigError

# The largest tp `resolve_run_config` picks by itself: a node's GPUs; on the CPU at most 4 ranks,
# so that some data parallelism remains on a few cores.
MAX_DEFAULT_TP = {"cuda": 8, "cpu": 4}


def default_preset(device: str) -> str:
    """gpt2 on GPUs, the tiny model on the CPU."""
    return "gpt2" if device == "cuda" else "tiny"


def choose_tp(world: int, local: int, config: GPTConfig, device: str) -> int:
    """Largest tp that fits in a node (`MAX_DEFAULT_TP`), divides the world and satisfies the
    model's shape rules."""
    for tp in range(min(world, local, MAX_DEFAULT_TP[device]), 0, -1):
        if world % tp:
            continue
        try:
            config.validate(tp)
            return tp
        except ConfigError:
            continue
    return 1


def schedule_takes(kind: str, pp: int, m: int) -> bool:
    """Whether pipeline schedule `kind` over pp stages runs m micro-batches per step: 1F1B needs
    at least pp (its warm-up fills the pipeline), the interleaved schedule groups of pp; GPipe
    takes any number."""
    if kind == "1f1b":
        return m >= pp
    if kind == "interleaved":
        return m % pp == 0
    return True


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def either(options: list[str]) -> str:
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


def _wanted(kind: str, pp: int, m: int) -> bool:
    """Whether m micro-batches keep every stage of the schedule busy: at least pp for 1F1B and
    GPipe (GPipe runs fewer, idle), a multiple of pp for the interleaved schedule."""
    return m % pp == 0 if kind == "interleaved" else m >= pp


def default_batch(dp: int, pp: int, schedule: str, micro: int | None) -> int:
    """At least 8 sequences, a multiple of dp; with pp > 1 and no micro-batch size given, the
    smallest such batch that some micro-batch size splits into enough micro-batches. (A
    micro-batch size given does not change the batch: RunConfig says what would do.)"""
    per_rank = -(-8 // dp)
    while pp > 1 and micro is None and not any(_wanted(schedule, pp, per_rank // d) for d in divisors(per_rank)):
        per_rank += 1
    return per_rank * dp


def default_micro_batch(per_rank: int, pp: int, schedule: str) -> int:
    """The whole per-DP-rank batch, or with pp > 1 the largest micro-batch that gives the
    schedule enough micro-batches (else the whole batch: RunConfig says what would do)."""
    fits = [d for d in divisors(per_rank) if pp == 1 or _wanted(schedule, pp, per_rank // d)]
    return max(fits) if fits else per_rank


def refuse_sequence_parallel(world: int, mesh, model: GPTConfig, tp_chosen: bool, dp_given: bool, cp: int = 1) -> None:
    """sequence_parallel at tp 1 would do nothing: refused, with the tp sizes that would work
    (world: the ranks cp left for tp x dp x pp)."""
    per_stage = world // mesh.pp
    options = []
    for t in divisors(per_stage)[1:]:
        try:
            model.validate(t)
        except ConfigError:
            continue
        if (per_stage // t) % mesh.ep == 0:
            options.append(f"`tp` {t} with `dp` {per_stage // t}" if dp_given else f"`tp` {t}")
    ranks = f"{world} rank{'s' if world > 1 else ''}" if cp == 1 else f"{world * cp} ranks / cp {cp} = {world}"
    why = f"tp is 1 (chosen for {ranks})" if tp_chosen else "tp is 1"
    fix = f"give {either(options)}, or omit `sequence_parallel`" if options else \
        f"omit `sequence_parallel` (no tp > 1 suits the model and the mesh on {ranks})"
    raise ConfigError(f"`sequence_parallel` needs tp > 1 (it splits the activations over the TP ranks), but {why}; "
                      f"{fix}")


# What a resumed run keeps from its checkpoint's settings when they are not given again (besides
# the run settings, which it always keeps): its layout, taken whole when no mesh size is given and
# the world has the run's size (a layout given, or a world of another size: derived as for a new
# run, and said in one line, `resume_note`); with that layout its overlap settings; its precision
# and memory choices; its cadence of evaluation, checkpoints and logs.
RESUME_MESH = ("tp", "dp", "pp", "cp", "ep")
RESUME_LAYOUT = RESUME_MESH + ("cp_comm", "pp_layers", "pp_schedule", "pp_virtual", "micro_batch_size",
                               "sequence_parallel", "overlap_grad_reduce", "bucket_size", "overlap_param_gather",
                               "tp_comm_overlap", "dp_replicate")
# The loss scaler's settings: kept on resume by `resumed_choices` as a whole (not in RESUME_KEPT:
# train_args records the dynamic ones' defaults for every dtype, and they are refused for a model
# other than float16 or beside a static scale).
LOSS_SCALE = ("loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale")
RESUME_KEPT = ("distributed_optimizer", "zero", "reshard_after_forward", "grad_reduce_dtype", "recompute",
               "recompute_layers", "save_every", "keep", "eval_every", "eval_batches", "log_every", "metrics", "tensorboard", "peak_tflops", "max_skips")


def saved_world(saved: dict) -> int | None:
    """The ranks of a checkpoint's layout (tp x dp x pp x cp), None when it does not record it."""
    sizes = [saved.get(k) for k in ("tp", "dp", "pp", "cp")]
    if not all(isinstance(v, int) for v in sizes[:3]):
        return None
    return sizes[0] * sizes[1] * sizes[2] * (sizes[3] if isinstance(sizes[3], int) else 1)


def resumed_choices(choices: dict, saved: dict, world: int) -> dict:
    """`choices` with what a resumed run keeps from its checkpoint's settings (`saved`, its
    train_args) filled in where not given (None). The ZeRO stage is `zero` and
    `distributed_optimizer` together: either given, neither is taken from the checkpoint (a
    zero 3 run resumed with --distributed-optimizer continues at zero 1; at zero 0 or 2, without
    the checkpoint's --overlap-param-gather, which they do not take; below zero 3 without its
    reshard choice, below zero 2 without its HSDP replicas)."""
    out, drop = dict(choices), set()
    keep = list(RESUME_KEPT)
    if choices.get("zero") is not None or choices.get("distributed_optimizer"):  # one setting: the given wins
        keep = [k for k in keep if k not in ("zero", "distributed_optimizer")]  # (--distributed-optimizer: zero 1)
        stage = choices["zero"] if choices.get("zero") is not None else 1
        if stage in (0, 2):
            drop.add("overlap_param_gather")  # (the checkpoint's: zero 0 and 2 gather no parameters to overlap)
        if stage != 3:
            keep.remove("reshard_after_forward")  # (only zero 3 gathers parameters to reshard)
        if stage < 2:
            drop.add("dp_replicate")  # (HSDP's replicas shard the gradients or parameters: zero 2 and 3)
    if not any(choices.get(k) is not None for k in RESUME_MESH) and saved_world(saved) == world:
        keep += [k for k in RESUME_LAYOUT if k not in drop]
    for k in keep:
        if out.get(k) is None and saved.get(k) is not None:
            out[k] = saved[k]
    # The loss scaling goes on as it ran (the checkpoint's scaler state is of that kind): a static
    # scale stays static; a float16 run's dynamic settings stay, each unless given again. A static
    # `loss_scale` given switches a dynamic run to it, a dynamic setting given a static run to a
    # dynamic scale (`cutp.train.step.resume` says so in one line).
    same_dtype = choices.get("dtype") in (None, saved.get("dtype"))
    if saved.get("loss_scale") is not None:
        if same_dtype and not any(choices.get(k) is not None for k in LOSS_SCALE):
            out["loss_scale"] = saved["loss_scale"]
    elif same_dtype and saved.get("dtype") == "float16" and choices.get("loss_scale") is None:
        for k in LOSS_SCALE[1:]:
            if out.get(k) is None and saved.get(k) is not None:
                out[k] = saved[k]
    return out


def layout_text(settings) -> str:
    """`tp 2 x dp 2` (and the cp, pp and ep sizes above 1) of a RunConfig or a settings dict."""
    get = settings.get if isinstance(settings, dict) else (lambda k: getattr(settings, k, None))
    return " x ".join(f"{k} {get(k) or 1}" for k in ("tp", "cp", "dp", "pp", "ep") if k in ("tp", "dp") or (get(k) or 1) > 1)


# Settings that do nothing without another: given alone, refused by name (`refuse_ignored`), so that
# no choice is silently dropped. {setting: (what it needs, checked on the resolved RunConfig; the fix)}
NEEDS = {
    "link_latency": (lambda c: c.link_bandwidth is not None, "the latency of the link `link_bandwidth` simulates, "
                     "and none is simulated", "give `link_bandwidth` GB/s too, or omit `link_latency`"),
    "cp_comm": (lambda c: c.cp > 1, "context parallelism's attention, and `cp` is 1",
                "give `cp` 2 or more, or omit `cp_comm`"),
    "save_every": (lambda c: c.out is not None, "when checkpoints go into `out`, and no `out` is given",
                   "give `out` DIR, or omit `save_every`"),
    "keep": (lambda c: c.out is not None, "how many checkpoints `out` keeps, and no `out` is given",
             "give `out` DIR, or omit `keep`"),
    "overwrite": (lambda c: c.out is not None, "whether `out` may hold another run, and no `out` is given",
                  "give `out` DIR, or omit `overwrite`"),
    # (1f1b at pp 1 is what runs anyway, and what a printed config of a pp 1 run says; eval_batches
    # with eval_every 0 is not here: a library caller's evaluate(run) takes that many batches)
    "pp_schedule": (lambda c: c.pp > 1 or c.pp_schedule == "1f1b", "the order of the pipeline stages' "
                    "micro-batches, and `pp` is 1", "give `pp` 2 or more, or omit `pp_schedule`"),
    "sample_prompt": (lambda c: c.sample_every > 0, "the prompt of `sample_every`'s generations, and `sample_every` "
                      "is 0 (none)", "give `sample_every` N, or omit `sample_prompt`"),
    "sample_tokens": (lambda c: c.sample_every > 0, "the length of `sample_every`'s generations, and `sample_every` "
                      "is 0 (none)", "give `sample_every` N, or omit `sample_tokens`"),
    # (a dense model builds no MoE layer: their fields are never read; 0 is what happens anyway)
    "moe_bias_update_rate": (lambda c: c.model.n_experts > 0 or not c.model.moe_bias_update_rate,
                             "the step of a mixture-of-experts model's correction bias, and the model is dense "
                             "(n_experts 0)", "use a model with a correction bias (moe_score_bias=true, e.g. `preset` "
                             "deepseek-tiny), or omit `moe_bias_update_rate`"),
    "moe_seq_aux_loss": (lambda c: c.model.n_experts > 0 or not c.model.moe_seq_aux_loss,
                         "the sequence-wise balance loss of a mixture-of-experts model, and the model is dense "
                         "(n_experts 0)", "use a mixture-of-experts model (e.g. `preset` tiny-moe), or omit "
                         "`moe_seq_aux_loss`"),
    "set": (lambda c: not _dense_moe_fields(c), "a field of the mixture-of-experts layers, and the model is dense "
            "(n_experts 0)", lambda c: "use a mixture-of-experts model (n_experts=E in `set`, or e.g. `preset` "
            "tiny-moe), or take " + " and ".join(_dense_moe_fields(c)) + " out of `set`",
            lambda c: f"`set` {_dense_moe_fields(c)[0]}"),
    # (a DP x CP group of one reduces nothing, so nothing is rounded: AdamW.reduce_gradients)
    "grad_reduce_dtype": (lambda c: c.dp * c.cp > 1 or c.grad_reduce_dtype == "float32",
                          "the dtype of the DP gradient reduction, and there is none (dp 1, cp 1)",
                          "give `dp` 2 or more, or omit `grad_reduce_dtype`"),
    # (column-parallel backwards overlap their TP collective, pipelines their receives: neither at tp 1, pp 1)
    "tp_comm_overlap": (lambda c: c.tp > 1 or c.pp > 1, "the overlap of the TP collectives and pipeline receives, "
                        "and tp and pp are 1", "give `tp` 2 or more, or omit `tp_comm_overlap`"),
}
_MOE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.name.startswith("moe_")}


def _dense_moe_fields(cfg) -> list[str]:
    """The `set` entries of a dense model's MoE fields other than their defaults ("moe_capacity_factor=1.0")."""
    if cfg.model.n_experts > 0:
        return []
    keys = [o.partition("=")[0].strip() for o in cfg.overrides]
    return [f"{k}={getattr(cfg.model, k)!r}" for k in dict.fromkeys(keys)
            if k in _MOE_DEFAULTS and getattr(cfg.model, k) != _MOE_DEFAULTS[k]]


def refuse_ignored(given: set, cfg) -> None:
    """Raises ConfigError naming a setting given (`given`: the names the user gave) that the
    resolved config `cfg` would ignore (`NEEDS`: what it sets and the fix, or functions of `cfg`
    giving them; and what is named, when not the setting)."""
    for name, (ok, what, fix, *named) in NEEDS.items():
        if name in given and not ok(cfg):
            words = [w(cfg) if callable(w) else w for w in [what, fix] + named]
            subject = words[2] if named else f"`{name}`"
            raise ConfigError(f"{subject} would be ignored: it sets {words[0]}; {words[1]}")
