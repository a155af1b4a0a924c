"""Every setting of a training run in one frozen `RunConfig`, derived in one place.

    cfg = resolve_run_config(preset="tiny", steps=200, batch_size=16)        # collective over comm
    cfg = resolve_run_config(comm=my_comm, model=GPTConfig(...), tp=2, data="corpus.txt")

`resolve_run_config` is the only place where defaults are filled in: from the user's choices
(the keyword arguments, `None` meaning "the default"), the world (its size, the ranks per node,
the device this machine has) and, on resume, the checkpoint. It compares the choices across
ranks, derives and validates everything inside one block whose error (on any rank) is raised
on every rank, then compares the result across ranks once more, all before the first collective
of the run itself. A `RunConfig` made directly (every field explicit) is checked by its own
constructor for what needs no world (ranges, divisibility, the model's shape rules at its tp).

Run settings (`RUN_SETTINGS`: steps, batch, sequence length, learning-rate schedule, seed, data,
dropout) define the training itself. A resumed run takes them from the checkpoint, and a choice
that contradicts the checkpoint is refused (the run would silently change its math), except
`steps`, which may extend or shorten the run. The mesh may change on resume: checkpoints load at
any TP, DP and PP size (and any --pp-layers).

`init_from` (a Hugging Face GPT-2 directory, or a cutp checkpoint or run directory) starts a new
run, fine-tuning: step 0, a fresh optimizer and schedule, the run settings as chosen; the model
config is the directory's (dropout and dtype as chosen; a preset or --set that changes its
shapes is refused), and `build_run` loads its weights.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from mpi4py import MPI

from ..checkpoint import ARCH_FIELDS, read_meta, resolve_checkpoint
from ..checkpoint.files import is_cutp_checkpoint
from ..models.hf import config_from_hf, read_hf_config
from ..models import GPT, PRESETS, GPTConfig, stage_layers
from ..optim import GRAD_REDUCE_DTYPES
from ..runtime.backend import resolve_device
from ..runtime.consistency import check_same_on_all_ranks
from ..runtime.errors import ConfigError
from ..runtime.failure import errors_raised_on_every_rank
from ..runtime.mesh import validate_mesh
from ..runtime.watchdog import check_timeout
from .moe import check_expert_parallel
from .pipeline import SCHEDULES

# The run settings and their defaults (None: derived, see resolve_run_config).
RUN_SETTINGS = {"steps": 200, "batch_size": None, "seq_len": None, "lr": None, "min_lr": None, "warmup": None,
                "weight_decay": 0.1, "grad_clip": 1.0, "dropout": 0.0, "seed": 1337, "data": None}

# What a caller may choose, with the defaults of the settings that are not run settings: the
# only place these defaults are written (examples/train_gpt.py's flags default to None). The
# names are those of its flags ("set" is --set: KEY=VALUE model overrides).
CHOICES = {
    **RUN_SETTINGS,
    "model": None, "preset": None, "set": (), "dtype": None,
    "device": "auto", "tp": None, "dp": None, "pp": None, "ep": None, "pp_layers": None, "pp_schedule": None,
    "pp_virtual": None,
    "micro_batch_size": None,
    "run_steps": None, "max_skips": 5,
    "distributed_optimizer": False, "grad_reduce_dtype": "float32",
    "recompute": "none", "recompute_layers": None, "sequence_parallel": False,
    "loss_scale": None, "initial_loss_scale": 2.0 ** 16, "loss_scale_window": 1000, "hysteresis": 2,
    "min_loss_scale": 1.0,
    "eval_every": 50, "eval_batches": 4,
    "out": None, "resume": None, "overwrite": False, "init_from": None, "save_every": 0, "keep": 3,
    "metrics": None, "log_every": 1, "quiet": False, "save_on_signal": True, "collective_timeout": None,
}

# The largest tp `resolve_run_config` picks by itself: a node's GPUs; on the CPU at most 4 ranks,
# so that some data parallelism remains on a few cores.
MAX_DEFAULT_TP = {"cuda": 8, "cpu": 4}


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a run. Make one with `resolve_run_config` (defaults, resume, checks
    across ranks), or directly with every field given."""

    model: GPTConfig  # its dropout is a run setting too
    # the mesh, the device, and how a step is split (none of them changes the math)
    device: str = "cpu"
    tp: int = 1
    dp: int = 1
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert parallelism: MoE experts split over ep consecutive DP ranks (cutp.train.moe)
    pp_layers: tuple | None = None  # layers per stage (None: n_layer / pp each)
    pp_schedule: str = "1f1b"  # or "gpipe", "interleaved" (cutp.train.pipeline)
    pp_virtual: int = 1  # model chunks per stage (the interleaved schedule)
    micro_batch_size: int = 8  # sequences per forward on one DP rank
    # the optimizer's layout and precision (model.dtype is the parameters'; 16-bit models train
    # through float32 master weights and float32 gradients)
    distributed_optimizer: bool = False  # optimizer state sharded over DP (ZeRO-1)
    grad_reduce_dtype: str = "float32"  # "bfloat16": half the DP bytes, less precise sums
    loss_scale: float | None = None  # a static loss scale; None: dynamic for float16, else none
    initial_loss_scale: float = 2.0 ** 16  # the dynamic scaler's (float16)
    loss_scale_window: int = 1000  # clean steps before the dynamic scale doubles
    hysteresis: int = 2  # overflows before the dynamic scale halves
    min_loss_scale: float = 1.0
    recompute: str = "none"  # activation recomputation: "selective" (core attention) or "full" (layers)
    recompute_layers: int | None = None  # with "full": the first N layers (None: all)
    sequence_parallel: bool = False  # activations between the TP regions split along the sequence
    # run settings (RUN_SETTINGS): the training itself, kept by checkpoints, fixed on resume
    # except steps
    steps: int = 200
    batch_size: int = 8  # sequences per optimizer step over all DP ranks
    seq_len: int = 128
    lr: float = 1e-3
    min_lr: float | None = None  # None: lr / 10
    warmup: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: no clipping
    seed: int = 1337
    data: str | None = None  # text file or uint16 .bin; None: the Python standard library's sources
    # this invocation: how far, what stops it, evaluation, checkpoints, logging
    run_steps: int | None = None  # stop (and checkpoint) after this many steps of this invocation
    max_skips: int = 5  # consecutive non-finite steps before the run stops
    eval_every: int = 50
    eval_batches: int = 4
    out: str | None = None
    overwrite: bool = False  # `out` may hold another run's checkpoints: this run's replace them
    save_every: int = 0
    keep: int = 3  # checkpoints kept in out (0: all)
    resume: str | None = None  # the checkpoint directory this run continues from
    resumed_step: int | None = None  # its step
    init_from: str | None = None  # a new run (step 0, fresh optimizer) from these weights: an HF GPT-2
    #                               directory or a cutp checkpoint; the model config is theirs
    metrics: str | None = None
    log_every: int = 1
    quiet: bool = False
    save_on_signal: bool = True
    collective_timeout: float | None = None  # None: $CUTP_COLLECTIVE_TIMEOUT or 600 s
    # where the model came from, for the banner and for a later resume
    preset: str | None = None
    overrides: tuple = ()

    def __post_init__(self):
        if not isinstance(self.model, GPTConfig):
            raise ConfigError(f"RunConfig.model must be a GPTConfig, got {type(self.model).__name__}")
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
        for name in ("tp", "dp", "pp", "ep", "pp_virtual", "batch_size", "micro_batch_size", "seq_len", "eval_batches",
                     "log_every"):
            _positive_int(name, getattr(self, name))
        for name in ("steps", "warmup", "eval_every", "save_every", "keep", "max_skips", "seed"):
            _int_at_least(name, getattr(self, name), 0)
        if self.run_steps is not None:
            _int_at_least("run_steps", self.run_steps, 0)
        _one_start(self.resume, self.init_from)
        if self.resume is not None and self.resumed_step is None:
            raise ConfigError("RunConfig.resume is set but resumed_step is not; resolve_run_config(resume=...) "
                              "fills in both from the checkpoint")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda' in a RunConfig, got {self.device!r} "
                              "(resolve_run_config turns 'auto' into one of them)")
        for name in ("lr", "weight_decay", "grad_clip") + (("min_lr",) if self.min_lr is not None else ()):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0) or (name == "lr" and v == 0):
                raise ConfigError(f"--{_flag(name)} must be a finite number {'> 0' if name == 'lr' else '>= 0'}, "
                                  f"got {v!r}")
        if self.collective_timeout is not None:
            check_timeout(self.collective_timeout, "--collective-timeout")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ConfigError(f"--grad-reduce-dtype must be one of {', '.join(GRAD_REDUCE_DTYPES)}, "
                              f"got {self.grad_reduce_dtype!r}")
        for name in ("initial_loss_scale", "min_loss_scale") + (("loss_scale",) if self.loss_scale is not None else ()):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise ConfigError(f"--{_flag(name)} must be a finite number > 0, got {v!r}")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"--min-loss-scale {self.min_loss_scale:g} exceeds --initial-loss-scale "
                              f"{self.initial_loss_scale:g}")
        if self.recompute not in GPT.RECOMPUTE:
            raise ConfigError(f"--recompute must be one of {', '.join(GPT.RECOMPUTE)}, got {self.recompute!r}")
        if self.recompute_layers is not None and (
                self.recompute != "full" or not isinstance(self.recompute_layers, int)
                or isinstance(self.recompute_layers, bool) or not 1 <= self.recompute_layers <= self.model.n_layer):
            raise ConfigError(f"--recompute-layers {self.recompute_layers!r} needs --recompute full and an integer "
                              f"in [1, n_layer={self.model.n_layer}]")
        _positive_int("loss_scale_window", self.loss_scale_window)
        _positive_int("hysteresis", self.hysteresis)
        self.model.validate(self.tp)
        if self.seq_len > self.model.block_size:
            raise ConfigError(f"--seq-len {self.seq_len} exceeds the model's block_size {self.model.block_size}; "
                              f"use --seq-len <= {self.model.block_size}")
        if self.sequence_parallel and self.seq_len % self.tp:
            raise ConfigError(f"--seq-len {self.seq_len} is not divisible by --tp {self.tp}: --sequence-parallel "
                              f"splits each sequence over the TP ranks; use a multiple of {self.tp}")
        if self.batch_size % self.dp:
            raise ConfigError(f"--batch-size {self.batch_size} must be divisible by dp={self.dp} (each DP rank "
                              f"takes an equal share); use a multiple of {self.dp}")
        per_rank = self.batch_size // self.dp
        if per_rank % self.micro_batch_size:
            raise ConfigError(f"--micro-batch-size {self.micro_batch_size} must divide the per-DP-rank batch "
                              f"{per_rank} (= batch-size {self.batch_size} / dp {self.dp})")
        self._check_pipeline()
        check_expert_parallel(self)

    def _check_pipeline(self) -> None:
        if self.pp_schedule not in SCHEDULES:
            raise ConfigError(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {self.pp_schedule!r}")
        if self.pp_layers is not None and self.pp == 1 and len(self.pp_layers) != 1:
            raise ConfigError(f"--pp-layers {','.join(map(str, self.pp_layers))} needs --pp {len(self.pp_layers)}")
        V = self.pp_virtual
        if (V > 1) != (self.pp_schedule == "interleaved"):
            raise ConfigError(f"--pp-virtual {V} with --pp-schedule {self.pp_schedule}: the interleaved schedule "
                              "runs V >= 2 model chunks per stage, the others one; give --pp-schedule interleaved "
                              "with --pp-virtual 2 or more, or neither")
        if V > 1 and self.pp == 1:
            raise ConfigError(f"--pp-virtual {V} needs pipeline stages: add --pp 2 or more")
        stage_layers(self.model.n_layer, self.pp, self.pp_layers, V)
        if self.pp == 1:
            return
        m = self.accum_steps
        how = (f"--batch-size {self.batch_size} / (dp {self.dp} x --micro-batch-size {self.micro_batch_size}) "
               f"gives {m}")
        if self.pp_schedule == "1f1b" and m < self.pp:
            raise ConfigError(f"the 1F1B schedule needs at least pp={self.pp} micro-batches per step, and {how}; "
                              "use a smaller --micro-batch-size, a larger --batch-size, or --pp-schedule gpipe")
        if self.pp_schedule == "interleaved" and m % self.pp:
            raise ConfigError(f"the interleaved schedule needs a multiple of pp={self.pp} micro-batches per step, "
                              f"and {how}; change --batch-size or --micro-batch-size so that pp divides it")

    # ---- derived quantities --------------------------------------------------------------------
    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step on each DP rank."""
        return self.batch_size // self.dp // self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    # ---- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready: the model config nested, tuples as lists."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["model"] = self.model.to_dict()
        d["overrides"] = list(self.overrides)
        return d

    def checkpoint_settings(self) -> dict:
        """What a checkpoint records as `train_args`: the run settings (`RUN_SETTINGS`, dropout
        included), where the model came from, and the rest of this run's settings for reference."""
        d = self.to_dict()
        del d["model"]
        d.update(dropout=self.model.dropout, dtype=self.model.dtype, set=d.pop("overrides"))
        return d


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _positive_int(name, v):
    _int_at_least(name, v, 1)


def _int_at_least(name, v, low):
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ConfigError(f"--{_flag(name)} must be an integer >= {low}, got {v!r}")


def _one_start(resume, init_from) -> None:
    if resume is not None and init_from is not None:
        raise ConfigError(f"--init-from {init_from} starts a new run from its weights, --resume {resume} continues "
                          "a run; give only one of them")


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


def resolve_run_config(comm=None, *, source: str = "run settings", **choices) -> RunConfig:
    """The RunConfig of `choices` (see `CHOICES`; None means the default) on the ranks of `comm`
    (default MPI.COMM_WORLD). Collective over comm; raises on every rank (ConfigError naming the
    problem and its fix) when a choice is invalid or differs between ranks. `source` names the
    choices in that message (examples/train_gpt.py says "command line")."""
    comm = MPI.COMM_WORLD if comm is None else comm
    # the same choices on every rank first: one given to some ranks only is named as such
    # (rather than surfacing as whatever it breaks on those ranks)
    check_same_on_all_ranks(comm, {k: _comparable(v) for k, v in choices.items()}, source)
    local_ranks = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    ranks_per_node = local_ranks.Get_size()
    local_ranks.Free()
    # An error in the derivation, on any rank, is raised on every rank (so the job ends at once,
    # with one traceback, whether every rank or only one node sees the problem).
    with errors_raised_on_every_rank(comm):
        cfg = _derive(choices, comm.Get_size(), ranks_per_node)
    # and the same result (a stale `latest` read on one node would resume another step)
    check_same_on_all_ranks(comm, cfg.to_dict(), "training configuration")
    return cfg


def _comparable(value):
    if isinstance(value, GPTConfig):
        return value.to_dict()
    return list(value) if isinstance(value, tuple) else value


def _derive(choices: dict, world: int, ranks_per_node: int) -> RunConfig:
    unknown = sorted(set(choices) - set(CHOICES))
    if unknown:
        raise ConfigError(f"unknown run settings {unknown}; the settings are {sorted(CHOICES)}")
    c = {k: (v if v is not None else CHOICES[k]) for k, v in {**CHOICES, **choices}.items()}
    c["set"] = tuple(c["set"] or ())
    if c["metrics"]:  # its directory now, not at the first write after minutes of setup
        parent = os.path.dirname(os.path.abspath(c["metrics"]))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--metrics {c['metrics']}: cannot create its directory {parent} ({e.strerror}); "
                              "choose a writable path") from None
    device = resolve_device(c["device"])

    _one_start(c["resume"], c["init_from"])
    resume_dir, meta = None, None
    if c["resume"]:
        resume_dir = resolve_checkpoint(c["resume"])
        meta = read_meta(resume_dir)
    run = _run_settings(choices, meta)
    d = run["dropout"]
    if not (isinstance(d, (int, float)) and not isinstance(d, bool) and 0.0 <= d < 1.0):
        raise ConfigError(f"--dropout must be in [0, 1), got {d!r}")
    if meta is None and c["model"] is not None and choices.get("dropout") is None:
        run["dropout"] = _as_gpt_config(c["model"]).dropout  # a model given whole keeps its dropout
    init_from = None
    if c["init_from"]:
        init_from, model = _init_from_model(c, run["dropout"])
        preset = None
    else:
        model, preset = _model_config(c, run["dropout"], device, meta)

    dynamic = [k for k in ("initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale")
               if choices.get(k) is not None]
    if dynamic and (model.dtype != "float16" or c["loss_scale"] is not None):
        why = "a static --loss-scale is set" if c["loss_scale"] is not None else f"the model is {model.dtype}"
        raise ConfigError(f"--{_flag(dynamic[0])} {choices[dynamic[0]]} sets the dynamic float16 loss scale, "
                          f"but {why}; omit it")
    # None is "not given" (the default is derived); any value given, 0 included, is checked as given
    given = {k: v for k, v in (("tp", c["tp"]), ("dp", c["dp"]), ("micro_batch_size", c["micro_batch_size"]),
                               ("batch_size", run["batch_size"]), ("seq_len", run["seq_len"])) if v is not None}
    for name, v in given.items():
        _positive_int(name, v)
    pp = 1 if c["pp"] is None else c["pp"]
    _positive_int("pp", pp)
    if world % pp:
        raise ConfigError(f"--pp {pp} does not divide the {world} ranks; start a multiple of {pp} ranks")
    tp = given.get("tp") or choose_tp(world // pp, ranks_per_node, model, device)
    model.validate(tp)  # (RunConfig checks it again; here its message comes before the mesh's)
    mesh = validate_mesh(world, tp, c["dp"], pp, 1 if c["ep"] is None else c["ep"])
    seq_len = given.get("seq_len") or (min(model.block_size, 256) if device == "cpu" else model.block_size)
    batch = given.get("batch_size") or -(-8 // mesh.dp) * mesh.dp  # at least 8 sequences, a multiple of dp
    steps = run["steps"]
    return RunConfig(
        model=model, device=device, tp=tp, dp=mesh.dp, pp=pp, ep=mesh.ep, pp_layers=_layer_counts(c["pp_layers"]),
        pp_schedule=c["pp_schedule"] or ("interleaved" if (c["pp_virtual"] or 1) > 1 else "1f1b"),
        pp_virtual=1 if c["pp_virtual"] is None else c["pp_virtual"],
        steps=steps, batch_size=batch, micro_batch_size=given.get("micro_batch_size") or batch // mesh.dp,
        seq_len=seq_len, lr=(1e-3 if model.n_embd <= 256 else 6e-4) if run["lr"] is None else run["lr"],
        min_lr=run["min_lr"],
        warmup=run["warmup"] if run["warmup"] is not None else max(1, steps // 20),
        weight_decay=run["weight_decay"], grad_clip=run["grad_clip"], seed=run["seed"], data=run["data"],
        distributed_optimizer=bool(c["distributed_optimizer"]), grad_reduce_dtype=c["grad_reduce_dtype"],
        recompute=c["recompute"], recompute_layers=c["recompute_layers"],
        sequence_parallel=bool(c["sequence_parallel"]),
        loss_scale=c["loss_scale"], initial_loss_scale=c["initial_loss_scale"],
        loss_scale_window=c["loss_scale_window"], hysteresis=c["hysteresis"], min_loss_scale=c["min_loss_scale"],
        max_skips=c["max_skips"], run_steps=c["run_steps"], eval_every=c["eval_every"],
        eval_batches=c["eval_batches"], out=c["out"], overwrite=bool(c["overwrite"]), save_every=c["save_every"],
        keep=c["keep"],
        resume=resume_dir, resumed_step=None if meta is None else int(meta["step"]), init_from=init_from,
        metrics=c["metrics"],
        log_every=c["log_every"], quiet=bool(c["quiet"]), save_on_signal=bool(c["save_on_signal"]),
        collective_timeout=c["collective_timeout"], preset=preset, overrides=c["set"])


def _layer_counts(value):
    """--pp-layers "5,6,6,5" (or a sequence of ints) -> (5, 6, 6, 5)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return tuple(int(v) for v in value.split(","))
        except ValueError:
            raise ConfigError(f"--pp-layers {value!r}: expected comma-separated layer counts, e.g. 5,6,6,5") from None
    return tuple(int(v) for v in value)


def _run_settings(choices: dict, meta: dict | None) -> dict:
    """The run settings: the choice, else (on resume) the checkpoint's, else the default. A choice
    that contradicts the checkpoint is refused, except steps."""
    saved = (meta or {}).get("train_args") or {}
    out = {}
    for key, default in RUN_SETTINGS.items():
        value, before = choices.get(key), saved.get(key)
        if value is None:
            value = before if meta is not None and key in saved else default
        elif meta is not None and key in saved and before is not None and value != before and key != "steps":
            raise ConfigError(f"--{_flag(key)} {value} differs from the resumed run's {before}; a resumed run "
                              f"continues the same training: omit --{_flag(key)}")
        out[key] = value
    return out


def _model_config(c: dict, dropout: float, device: str, meta: dict | None) -> tuple[GPTConfig, str | None]:
    """(the model's config, the preset it came from)."""
    if meta is not None:
        config = GPTConfig.from_dict({**meta["config"], "dropout": dropout})
        preset = (meta.get("train_args") or {}).get("preset") or default_preset(device)
        if c["model"] is not None or c["preset"] or c["dtype"] or c["set"]:
            # the same choices again: they must describe this model (a dtype alone: its dtype)
            described = c["model"] is not None or c["preset"] or c["set"]
            asked = (_asked_model(c, dropout, c["preset"] or preset, c["dtype"] or config.dtype) if described
                     else dataclasses.replace(config, dtype=c["dtype"]))
            diff = [f"{k}: checkpoint {getattr(config, k)!r}, flags {getattr(asked, k)!r}"
                    for k in ARCH_FIELDS + ("dtype",) if getattr(config, k) != getattr(asked, k)]
            if diff:
                raise ConfigError("--preset/--set/--dtype describe another model than the checkpoint: "
                                  + "; ".join(diff) + ". Omit them when resuming.")
        return config, preset
    preset = None if c["model"] is not None else (c["preset"] or default_preset(device))
    return _asked_model(c, dropout, preset, c["dtype"] or "float32"), preset


def _init_from_model(c: dict, dropout: float) -> tuple[str, GPTConfig]:
    """(the directory, its model's config) for init_from: a cutp checkpoint or run directory (its
    newest checkpoint), else a Hugging Face GPT-2 directory. preset/model/set may not change the
    architecture; dropout, dtype and the other fields may change."""
    path = c["init_from"]
    if not os.path.isdir(path):
        raise ConfigError(f"--init-from {path}: not a directory; give a Hugging Face GPT-2 directory or a cutp "
                          "checkpoint or run directory")
    dtype = {"dtype": c["dtype"]} if c["dtype"] else {}
    if is_cutp_checkpoint(path):
        path = resolve_checkpoint(path)
        config = GPTConfig.from_dict({**read_meta(path)["config"], "dropout": dropout, **dtype})
    else:
        config = config_from_hf(read_hf_config(path), dtype=c["dtype"] or "float32", dropout=dropout,
                                where=f"--init-from {path}")
    asked = (_asked_model(c, dropout, c["preset"], config.dtype) if c["model"] is not None or c["preset"]
             else config.with_overrides(c["set"]))
    diff = [f"{k} {getattr(config, k)!r} (flags: {getattr(asked, k)!r})" for k in ARCH_FIELDS
            if getattr(config, k) != getattr(asked, k)]
    if diff:
        raise ConfigError(f"--preset/--set change the model of --init-from {path}: " + "; ".join(diff)
                          + "; omit them (dropout, dtype and label_smoothing may change)")
    return path, asked


def _asked_model(c: dict, dropout: float, preset: str | None, dtype: str) -> GPTConfig:
    if c["model"] is not None:
        model = _as_gpt_config(c["model"])
        model = dataclasses.replace(model, dropout=dropout, **({"dtype": c["dtype"]} if c["dtype"] else {}))
        return model.with_overrides(c["set"])
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return GPTConfig.preset(preset, dtype=dtype, dropout=dropout).with_overrides(c["set"])


def _as_gpt_config(model) -> GPTConfig:
    """A GPTConfig, or a dict of its fields (e.g. read from JSON)."""
    if isinstance(model, GPTConfig):
        return model
    if isinstance(model, dict):
        return GPTConfig.from_dict(model)
    raise ConfigError(f"model must be a GPTConfig or a dict of its fields, got {type(model).__name__}")


def checkpoint_conflicts(config: RunConfig, meta: dict) -> list[str]:
    """The run settings in which `config` contradicts a checkpoint's (steps may differ), as
    "--flag value (the checkpoint's before)" strings; empty when the run continues that one."""
    saved = meta.get("train_args") or {}
    mine = {**{k: getattr(config, k) for k in RUN_SETTINGS if k != "dropout"}, "dropout": config.model.dropout}
    return [f"--{_flag(k)} {mine[k]} (the checkpoint's {saved[k]})" for k in RUN_SETTINGS
            if k != "steps" and saved.get(k) is not None and mine[k] != saved[k]]
