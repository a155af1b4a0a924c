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
(It runs over 500 lines on purpose: every setting is declared here once, each field its flag, default,
check and help line, so one file lists all of them.)

Each setting is declared once, as a `setting(...)` field of RunConfig (or in EXTRA_CHOICES for
the few choices that are no field): its type, default, allowed values, help and check. The
checks, `CHOICES`, `RUN_SETTINGS`, examples/train_gpt.py's parser (`command_line_parser`) and
the flag names of its error messages (`flag_name`) all come from those declarations
(cutp.train.settings). Errors name settings by field (`micro_batch_size`); a command line
renders them as its flags. Derived defaults: the mesh from any of tp, dp, pp and ep given
(`cutp.runtime.mesh.derive_mesh`), the batch and micro-batch a pipeline schedule needs
(cutp.train.defaults).

Run settings (`RUN_SETTINGS`: steps, batch, sequence length, learning-rate schedule, seed, data,
dropout) define the training itself. A resumed run takes them from the checkpoint, and a choice
that contradicts the checkpoint is refused (the run would silently change its math), except
`steps`, which may extend or shorten the run. The mesh may change on resume: checkpoints load at
any TP, DP and PP size (and any pp_layers).

`init_from` (a Hugging Face GPT-2 directory, or a cutp checkpoint or run directory) starts a new
run, fine-tuning: step 0, a fresh optimizer and schedule, the run settings as chosen; the model
config is the directory's (dropout and dtype as chosen; a preset or `set` overrides that change
its shapes are refused), and `build_run` loads its weights.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
from dataclasses import dataclass

from mpi4py import MPI

from ..checkpoint import read_meta, resolve_checkpoint
from ..data import micro_batches
from ..data.verify import fix_line, verify_prepared
from ..models import DTYPES, GPT, PRESETS, GPTConfig, stage_layers
from ..models.families import export_refusal
from ..optim import GRAD_REDUCE_DTYPES
from ..runtime.backend import resolve_device
from ..runtime.consistency import check_same_on_all_ranks
from ..runtime.errors import ConfigError
from ..runtime.failure import errors_raised_on_every_rank
from ..runtime.mesh import derive_mesh, with_context_parallel
from ..tensor_parallel.context_parallel import check_context_parallel
from ..runtime.watchdog import check_timeout
from .model_choice import as_gpt_config, init_from_model, model_config
from .finetune import FINETUNE_SETTINGS, check_base_of, check_finetune, resumed_without_base
from .moe import check_expert_parallel
from .overlap import OVERLAP_SETTINGS, check_overlap
from .zero import check_one_stage, check_zero, normalise_zero, sharding_nothing
from .fixes import with_working_fixes
from .defaults import (MAX_DEFAULT_TP, RESUME_MESH, choose_tp, default_batch, default_micro_batch, divisors, either,
                       layout_text, refuse_ignored, refuse_sequence_parallel, resumed_choices, saved_world, schedule_takes)
from .pipeline import SCHEDULES
from .reporting import TENSORBOARD_HINT
from .settings import Setting, add_flag, declared, flag_of, setting
from .settings import command_line_parser as command_line_parser_of



@dataclass(frozen=True)
class RunConfig:
    """Every setting of a run. Make one with `resolve_run_config` (defaults, resume, checks
    across ranks), or directly with every field given. Each field made by `setting` is declared
    once there: its check, its default, its flag and --help line (cutp.train.settings)."""

    model: GPTConfig  # its dropout is a run setting too
    # where the model came from, for the banner and for a later resume
    preset: str | None = setting(
        None, "the model's size", "model", choices=tuple(sorted(PRESETS)), optional=True,
        derived="gpt2 on GPUs, tiny on the CPU; on resume the checkpoint's")
    # the mesh, the device, and how a step is split (none of them changes the math)
    device: str = setting("cpu", "where the run computes (auto: cuda when a GPU is usable, else cpu)", "mesh",
                          choices=("cpu", "cuda", "auto"), omitted="auto")
    tp: int = setting(1, "tensor-parallel size: each layer's weights split over tp ranks", "mesh", kind=int,
                      at_least=1, derived="world / (dp * pp) with --dp, else chosen for the machine: the largest "
                      f"that fits a node ({MAX_DEFAULT_TP['cuda']} GPUs, {MAX_DEFAULT_TP['cpu']} CPU ranks), "
                      "divides the ranks and suits the model's heads")
    dp: int = setting(1, "data-parallel size: each DP rank takes an equal share of the batch", "mesh", kind=int,
                      at_least=1, derived="world / (tp * cp * pp)")
    cp: int = setting(1, "context parallelism: each sequence split over cp ranks (the mesh: tp, cp, dp, pp), every "
                      "layer on seq-len/cp tokens; --seq-len a multiple of 2*cp", "mesh", kind=int, at_least=1)
    cp_comm: str = setting("ring", "context parallelism's attention: ring (K,V round the CP ranks, overlapped) or a2a "
                           "(Ulysses: the query heads per TP rank split over cp, their KV heads split or copied)",
                           "mesh", choices=("ring", "a2a"))
    pp: int = setting(1, "pipeline stages: the layers split over pp ranks", "pipeline", kind=int, at_least=1)
    ep: int = setting(1, "expert parallelism: an MoE model's experts split over ep consecutive DP ranks (ep divides "
                      "dp and n_experts), tokens sent to them by all-to-all", "mesh", kind=int, at_least=1)
    sequence_parallel: bool = setting(
        False, "split the activations between the TP regions along the sequence (LayerNorm, dropout and residuals "
        "on seq-len/tp tokens per rank; needs tp > 1 and a --seq-len that tp divides)", "mesh", kind=bool)
    pp_layers: tuple | None = setting(
        None, "layers of each stage, e.g. 5,6,6,5; with --pp-virtual V, of each of the pp * V model chunks in the "
        "model's order", "pipeline", optional=True, metavar="N,N,...", derived="n_layer / pp each")
    pp_schedule: str = setting(
        "1f1b", "pipeline schedule: 1f1b keeps at most pp - stage micro-batches in flight, gpipe all of them, "
        "interleaved is Megatron's interleaved 1F1B over --pp-virtual chunks (bubble / V)", "pipeline",
        choices=SCHEDULES, derived="1f1b; interleaved with --pp-virtual 2 or more")
    pp_virtual: int = setting(1, "model chunks per pipeline stage (the interleaved schedule: 2 or more implies "
                              "--pp-schedule interleaved)", "pipeline", kind=int, at_least=1)
    micro_batch_size: int = setting(
        8, "sequences per forward on one DP rank: trades memory for speed, never changes the math", "pipeline",
        kind=int, at_least=1, derived="the whole per-DP-rank batch; with --pp, the largest that gives the schedule "
        "its micro-batches (1f1b, gpipe: at least pp; interleaved: a multiple of pp)")
    # the optimizer's layout and precision (model.dtype is the parameters'; 16-bit models train
    # through float32 master weights and float32 gradients)
    distributed_optimizer: bool = setting(
        False, "shard the optimizer state (fp32 master weights, Adam moments) over DP (ZeRO-1)", "memory", kind=bool)
    zero: int = setting(
        0, "ZeRO stage: 1 shards the optimizer state over DP (as --distributed-optimizer), 2 the fp32 gradients "
        "too (reduce-scattered unit by unit in every micro-batch's backward), 3 the parameters too (each unit "
        "all-gathered before its forward and its backward)", "memory", kind=int, choices=(0, 1, 2, 3))
    reshard_after_forward: bool = setting(
        True, "zero 3: free each unit's gathered parameters after its forward (off: kept to its backward, one "
        "gather per micro-batch instead of two)", "memory", kind=bool)
    dp_replicate: int = setting(
        1, "HSDP: DP split into R replicas of dp/R ranks; zero 2 and 3 shard inside a replica, the gradients are "
        "all-reduced across replicas (the big collectives stay inside a node)", "memory", kind=int, at_least=1)
    grad_reduce_dtype: str = setting(
        "float32", "dtype of the DP gradient reduction: bfloat16 halves the bytes, with sums rounded to bf16",
        "memory", choices=GRAD_REDUCE_DTYPES)
    allow_tf32: bool = setting(
        False, "float32 models on GPUs: GEMMs may round their operands to TF32 on tensor cores (faster, changes "
        "results; the CPU keeps full float32)", "memory", kind=bool)
    # overlap of communication with computation (cutp.train.overlap; none of it changes the math)
    overlap_grad_reduce: bool = setting(False, "start each DP gradient bucket's reduction in the last micro-batch's "
                                        "backward, once its gradients are final", "mesh", kind=bool)
    bucket_size: int | None = setting(None, "elements per DP gradient bucket", "mesh", kind=int, at_least=1,
                                      optional=True, derived="max(40M, 1M x dp) (Megatron's), at most an eighth of the rank's gradient buffer, so "
                                      "that some buckets reduce during the backward")
    overlap_param_gather: bool = setting(False, "ZeRO: each bucket's updated parameters gathered during the next "
                                         "forward, waited for before the first layer using them", "mesh", kind=bool)
    tp_comm_overlap: bool = setting(False, "column-parallel backward: the dX all-reduce (SP: reduce-scatter) runs "
                                    "under the weight-gradient GEMM; pipeline receives posted early", "mesh", kind=bool)
    link_bandwidth: float | None = setting(None, "simulate an interconnect of this many GB/s under every group "
                                           "(benchmarks)", "mesh", kind=float, above=0, optional=True, metavar="GB/s")
    link_latency: float = setting(5.0, "the simulated link's latency", "mesh", kind=float, at_least=0, metavar="us")
    loss_scale: float | None = setting(None, "a static loss scale", "memory", kind=float, above=0, optional=True,
                                       derived="dynamic for float16, else none")
    initial_loss_scale: float = setting(2.0 ** 16, "the dynamic loss scale's start (float16)", "memory", kind=float,
                                        above=0)
    loss_scale_window: int = setting(1000, "clean steps before the dynamic scale doubles", "memory", kind=int,
                                     at_least=1)
    hysteresis: int = setting(2, "overflows before the dynamic scale halves", "memory", kind=int, at_least=1)
    min_loss_scale: float = setting(1.0, "the dynamic scale's floor", "memory", kind=float, above=0)
    recompute: str = setting(
        "none", "activation recomputation: selective recomputes the core attention in backward, full whole layers "
        "(each keeps only its input); the math is unchanged", "memory", choices=GPT.RECOMPUTE)
    recompute_layers: int | None = setting(None, "with --recompute full: the first N layers", "memory", kind=int,
                                           at_least=1, optional=True, derived="all")
    # run settings (RUN_SETTINGS): the training itself, kept by checkpoints, fixed on resume
    # except steps
    steps: int = setting(200, "optimizer steps of the whole run (sets the learning-rate schedule)", "run", kind=int,
                         at_least=0, run=True)
    batch_size: int = setting(
        8, "global sequences per optimizer step over all DP ranks (changing tp, dp or pp never changes the math)",
        "run", kind=int, at_least=1, run=True,
        derived="8, rounded up to a multiple of dp; with --pp and no --micro-batch-size, up to what gives the "
        "schedule its micro-batches")
    seq_len: int = setting(128, "tokens per sequence", "run", kind=int, at_least=1, run=True,
                           derived="the model's block size, at most 256 on the CPU")
    lr: float = setting(1e-3, "peak learning rate", "run", kind=float, above=0, run=True,
                        derived="1e-3 for n_embd <= 256, else 6e-4")
    min_lr: float | None = setting(None, "the learning rate the cosine decay ends at", "run", kind=float, at_least=0,
                                   optional=True, run=True, derived="lr / 10")
    warmup: int = setting(10, "linear warmup steps", "run", kind=int, at_least=0, run=True,
                          derived="steps / 20, at least 1")
    weight_decay: float = setting(0.1, "AdamW's weight decay", "run", kind=float, at_least=0, run=True)
    grad_clip: float = setting(1.0, "global gradient-norm clipping (0: none)", "run", kind=float, at_least=0, run=True)
    # what trains (cutp.train.finetune): frozen groups, LoRA adapters on the frozen base
    freeze: str | None = setting(None, "freeze parameter groups (no gradients, masters or optimizer state): "
                                 "embeddings, norms, head, attention, mlp, or name globs, comma-separated",
                                 "run", optional=True, run=True, metavar="GROUP,...")
    lora_rank: int | None = setting(None, "LoRA: freeze the model and train rank-R adapters on --lora-targets "
                                    "(PEFT's LoraModel)", "run", kind=int, at_least=1, optional=True, run=True,
                                    metavar="R")
    lora_alpha: float | None = setting(None, "LoRA's alpha: the adapters' output scaled by alpha / rank", "run",
                                       kind=float, above=0, optional=True, run=True, derived="the rank (scale 1)")
    lora_dropout: float = setting(0.0, "LoRA: dropout on the adapters' input", "run", kind=float, at_least=0,
                                  below=1, run=True)
    lora_targets: str = setting("q,k,v,o,gate,up,down", "LoRA: the Hugging Face projections that get adapters",
                                "run", run=True, metavar="PROJ,...")
    seed: int = setting(1337, "seed of the initial weights, the batches and dropout", "run", kind=int, at_least=0,
                        run=True)
    data: str | None = setting(None, "a directory written by `python -m cutp prepare-data` (its shards "
                               "memory-mapped), a text file (byte-level tokens), or a .bin of token ids (nanoGPT's "
                               "uint16, or one llm.c shard)", "run", optional=True, run=True, metavar="PATH|DIR",
                               derived="the Python standard library's sources")
    pack: bool = setting(False, "place whole documents into each sequence (a prepared `data` directory's document "
                         "lengths), positions restarting and attention kept inside each document; the target at a "
                         "document's last token ignored (cutp.data.packing)", "run", kind=bool, run=True)
    verify_data: bool = setting(False, "before training, read every shard of a prepared --data whole and check it "
                                "against meta.json's digests (as python -m cutp verify-data DIR; opening the data "
                                "always checks each shard's header and size)", "invocation", kind=bool)
    # this invocation: how far, what stops it, evaluation, checkpoints, logging
    run_steps: int | None = setting(
        None, "stop (and checkpoint) after this many steps of this invocation, e.g. to fit a job's time limit",
        "invocation", kind=int, at_least=0, optional=True, derived="until --steps")
    max_skips: int = setting(5, "stop after this many consecutive non-finite steps", "invocation", kind=int,
                             at_least=0)
    eval_every: int = setting(50, "validation every N steps and at the last (0: never)", "invocation", kind=int,
                              at_least=0)
    eval_batches: int = setting(4, "validation batches", "invocation", kind=int, at_least=1)
    out: str | None = setting(None, "run directory for the checkpoints", "invocation", optional=True, metavar="DIR",
                              derived="with --resume, the resumed run's directory (the command line's); else none: no checkpoints")
    overwrite: bool = setting(False, "--out may hold another run's checkpoints: they are removed once this run's "
                              "first one is saved", "invocation", kind=bool)
    save_every: int = setting(0, "a checkpoint every N steps (0: only at the end)", "invocation", kind=int,
                              at_least=0)
    keep: int = setting(3, "the newest healthy checkpoints kept in --out (0: all)", "invocation", kind=int,
                        at_least=0)
    resume: str | None = setting(None, "run or checkpoint directory to continue from: the run goes on as it was (its "
                                 "layout when the ranks are as many and no --tp/--dp/--pp/--cp/--ep is given, its "
                                 "cadence, its directory for the checkpoints)", "invocation", optional=True,
                                 metavar="DIR")
    resumed_step: int | None = None  # its step
    init_from: str | None = setting(
        None, "fine-tune: a new run (step 0, fresh optimizer and schedule) from the weights of a Hugging Face GPT-2 "
        "directory or a cutp checkpoint or run directory; the model is DIR's (--dropout and --dtype may change; "
        "--preset and --set may not change its shapes)", "invocation", optional=True, metavar="DIR")
    save_on_signal: bool = setting(True, "on SIGTERM/SIGINT finish the step, checkpoint, exit", "invocation",
                                   kind=bool)
    collective_timeout: float | None = setting(
        None, "seconds a collective may wait for a peer, and a training step may go without progress (no collective "
        "or micro-batch completing), before the job is aborted (0: the watchdog off)", "invocation", kind=float,
        optional=True, metavar="SECONDS", derived="$CUTP_COLLECTIVE_TIMEOUT or 600")
    metrics: str | None = setting(None, "JSONL file, one object per step (rank 0 writes)", "logging", optional=True,
                                  metavar="PATH")
    tensorboard: str | None = setting(None, "TensorBoard event files of each step's scalars (loss, val loss, lr, "
                                      "grad norm, tokens/s, MFU, memory, MoE load, exposed communication), written "
                                      "by rank 0 through tensorboardX (pip install -e '.[tensorboard]')", "logging",
                                      optional=True, metavar="DIR")
    log_every: int = setting(1, "a progress line every N steps", "logging", kind=int, at_least=1)
    sample_every: int = setting(0, "print a generation from `sample_prompt` every N steps and at the last (0: "
                                "never); chat data's prompt goes through the tokenizer's chat template", "logging",
                                kind=int, at_least=0)
    sample_prompt: str | None = setting(None, "the prompt of `sample_every`'s generations (chat data: the user's "
                                        "message)", "logging", optional=True, metavar="TEXT")
    sample_tokens: int = setting(48, "new tokens of each `sample_every` generation (greedy)", "logging", kind=int,
                                 at_least=1)
    quiet: bool = setting(False, "no progress lines (warnings are still printed)", "logging", kind=bool)
    peak_tflops: float | None = setting(
        None, "one device's peak TFLOP/s at the model's precision, for the MFU of the progress lines", "logging",
        kind=float, above=0, optional=True, metavar="TFLOPS",
        derived="known for H200, H100, A100 and V100 GPUs; else none: MFU n/a")
    overrides: tuple = ()  # the --set choices

    def __post_init__(self):
        if not isinstance(self.model, GPTConfig):
            raise ConfigError(f"RunConfig.model must be a GPTConfig, got {type(self.model).__name__}")
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
        for name, (declaration, _) in declared(type(self)).items():
            declaration.check(name, getattr(self, name))
        _one_start(self.resume, self.init_from)
        if self.resume is not None and self.resumed_step is None:
            raise ConfigError("RunConfig.resume is set but resumed_step is not; resolve_run_config(resume=...) "
                              "fills in both from the checkpoint")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda' in a RunConfig, got {self.device!r} "
                              "(resolve_run_config turns 'auto' into one of them)")
        if self.collective_timeout is not None:
            check_timeout(self.collective_timeout, "`collective_timeout`")
        if self.allow_tf32 and self.model.dtype != "float32":
            raise ConfigError(f"`allow_tf32` rounds float32 GEMM operands to TF32; a {self.model.dtype} model's GEMMs "
                              "already run on tensor cores: omit `allow_tf32`, or train in float32")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"`min_loss_scale` {self.min_loss_scale:g} exceeds `initial_loss_scale` "
                              f"{self.initial_loss_scale:g}")
        if self.recompute_layers is not None and (self.recompute != "full"
                                                  or not self.recompute_layers <= self.model.n_layer):
            raise ConfigError(f"`recompute_layers` {self.recompute_layers!r} needs `recompute` full and an integer "
                              f"in [1, n_layer={self.model.n_layer}]")
        self.model.validate(self.tp)
        if self.seq_len > self.model.block_size:
            raise ConfigError(f"`seq_len` {self.seq_len} exceeds the model's block_size {self.model.block_size}; "
                              f"use `seq_len` <= {self.model.block_size}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("`sequence_parallel` needs tp > 1 (it splits the activations over the TP ranks), but tp "
                              "is 1: give `tp` 2 or more, or omit `sequence_parallel`")
        if self.sequence_parallel and self.seq_len % self.tp and self.cp == 1:  # (cp > 1: check_context_parallel)
            raise ConfigError(f"`seq_len` {self.seq_len} is not divisible by `tp` {self.tp}: `sequence_parallel` "
                              f"splits each sequence over the TP ranks; use a multiple of {self.tp}")
        if self.sample_every and self.sample_prompt is None:
            raise ConfigError("`sample_every` prints a generation from `sample_prompt`: give `sample_prompt` TEXT too")
        if self.sample_every and max(self.pp, self.cp, self.ep) > 1:
            raise ConfigError(f"`sample_every` generates on each TP group with the whole model, which pp {self.pp} / cp "
                              f"{self.cp} / ep {self.ep} split; omit both `sample_every` and `sample_prompt` (then sample "
                              "after training with examples/generate.py)")
        normalise_zero(self)
        check_overlap(self)
        check_zero(self)
        check_context_parallel(self.seq_len, self.cp, self.tp, self.sequence_parallel, self.cp_comm,
                               self.model.n_head, self.model.n_kv_head, ranks=self.cp * self.dp)
        micro_batches(self.batch_size, self.dp, self.micro_batch_size)
        self._check_pipeline()
        check_expert_parallel(self)
        check_finetune(self)

    def _check_pipeline(self) -> None:
        if self.pp_layers is not None and self.pp == 1 and len(self.pp_layers) != 1:
            raise ConfigError(f"`pp_layers` {','.join(map(str, self.pp_layers))} needs `pp` {len(self.pp_layers)}")
        V = self.pp_virtual
        if (V > 1) != (self.pp_schedule == "interleaved"):
            raise ConfigError(f"`pp_virtual` {V} with `pp_schedule` {self.pp_schedule}: the interleaved schedule "
                              "runs V >= 2 model chunks per stage, the others one; give `pp_schedule` interleaved "
                              "with `pp_virtual` 2 or more, or neither")
        if V > 1 and self.pp == 1:
            raise ConfigError(f"`pp_virtual` {V} needs pipeline stages: add `pp` 2 or more")
        stage_layers(self.model.n_layer, self.pp, self.pp_layers, V)
        if self.pp == 1 or schedule_takes(self.pp_schedule, self.pp, self.accum_steps):
            return
        m, per_rank, mb = self.accum_steps, self.batch_size // self.dp, self.micro_batch_size
        how = f"`batch_size` {self.batch_size} / (dp {self.dp} x `micro_batch_size` {mb}) gives {m}"
        smaller = [d for d in divisors(per_rank) if schedule_takes(self.pp_schedule, self.pp, per_rank // d)]
        fixes = ([f"`micro_batch_size` {max(smaller)}" + (" (or smaller)" if max(smaller) > 1 else "")]
                 if smaller else [])
        enough = -(-m // self.pp) * self.pp  # the micro-batches at this micro-batch size that would do
        fixes.append(f"`batch_size` {enough * mb * self.dp}")
        if self.pp_schedule == "1f1b":
            fixes.append("`pp_schedule` gpipe")
            raise ConfigError(f"the 1F1B schedule needs at least pp={self.pp} micro-batches per step, and {how}; "
                              f"use {either(fixes)}")
        raise ConfigError(f"the interleaved schedule needs a multiple of pp={self.pp} micro-batches per step, and "
                          f"{how}; use {either(fixes)}")

    # ---- derived quantities --------------------------------------------------------------------
    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step on each DP rank."""
        return micro_batches(self.batch_size, self.dp, self.micro_batch_size)

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


# The choices that are not RunConfig fields of their own, declared as the fields are.
EXTRA_CHOICES = {
    "model": (Setting("a GPTConfig (or a dict of its fields) instead of a preset", "model", flag=False), None),
    "set": (Setting("override a model field of the preset, e.g. --set n_layer=2 --set n_kv_head=2 (a resumed or "
                    "fine-tuned run's model may not change its shapes)", "model", metavar="KEY=VALUE", repeat=True,
                    omitted=()), ()),
    "dtype": (Setting("parameters and activations: bfloat16 and float16 train through fp32 master weights and fp32 "
                      "gradients, float16 with a dynamic loss scale", "model", choices=tuple(DTYPES),
                      derived="float32; on resume or fine-tuning the checkpoint's"), None),
    "dropout": (Setting("dropout probability of the attention, residual and embedding dropouts", "run", kind=float,
                        at_least=0, below=1, run=True), 0.0),
    # the MoE model fields with a flag of their own (each as --set FIELD=VALUE: MOE_FLAGS)
    "moe_bias_update_rate": (Setting(
        "DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every MoE layer's correction bias "
        "moves by R x sign(mean load - expert load), from the step's global counts (a model with moe_score_bias)",
        "model", kind=float, at_least=0, metavar="R", derived="the preset's"), None),
    "moe_seq_aux_loss": (Setting(
        "DeepSeek-V3's sequence-wise balance loss: ALPHA x sum_i f_i P_i per sequence, averaged over the step's "
        "sequences (docs/moe.md)", "model", kind=float, at_least=0, metavar="ALPHA", derived="the preset's"),
        None),
}
MOE_FLAGS = ("moe_bias_update_rate", "moe_seq_aux_loss")
FIELD_SETTINGS = declared(RunConfig)
# Every setting, in --help's order within each group (an extra choice after the field it goes
# with): {name: (Setting, default)}.
_AFTER = {"preset": ("model", "set", "dtype") + MOE_FLAGS, "grad_clip": ("dropout",)}
SETTINGS = {k: v for name, entry in FIELD_SETTINGS.items()
            for k, v in ((name, entry), *((e, EXTRA_CHOICES[e]) for e in _AFTER.get(name, ())))}
# What resolve_run_config takes, and its value when not given (None: derived, see derive_run_config).
CHOICES = {name: None if s.derived else (s.omitted if s.omitted is not None else default)
           for name, (s, default) in SETTINGS.items()}
# The run settings (the training itself: kept by checkpoints, fixed on resume except steps).
RUN_SETTINGS = {name: CHOICES[name] for name, (s, _) in SETTINGS.items() if s.run}


def flag_name(name: str) -> str:
    """How the command line names a setting in messages: its flag (micro_batch_size ->
    --micro-batch-size); a name that is no flag as it is."""
    declaration = SETTINGS.get(name)
    return flag_of(name) if declaration is not None and declaration[0].flag else name


def command_line_parser(**parser_args) -> argparse.ArgumentParser:
    """The argparse parser of every setting (examples/train_gpt.py's): `--field-name`, each
    defaulting to None (not given); `vars(parser.parse_args())` goes to resolve_run_config.
    ConfigErrors name the flags when rendered with `flag_name`."""
    return command_line_parser_of(SETTINGS, **parser_args)


def add_setting_flags(parser, defaults: dict, aliases: dict | None = None) -> None:
    """Another command's flags for the training settings it takes (`cutp bench model`, `cutp
    plan`): declared here once, so each has one name and one meaning in all of them; `defaults`:
    {setting: that command's default} (None: not given), `aliases`: {setting: older spellings}."""
    for name, default in defaults.items():
        s, declared_default = SETTINGS[name]
        add_flag(parser, name, s, declared_default, default, (aliases or {}).get(name, ()))


def _one_start(resume, init_from) -> None:
    """Refuses `init_from` with `resume`, unless the resumed checkpoint holds only what its run
    trained (--freeze, LoRA): `init_from` then says where its frozen base is now (it moved)."""
    if resume is not None and init_from is not None and not resumed_without_base(resume):
        raise ConfigError(f"`init_from` {init_from} starts a new run from its weights, `resume` {resume} continues "
                          "a run; give only one of them")


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
    ranks_per_node, local_rank = local_ranks.Get_size(), local_ranks.Get_rank()
    local_ranks.Free()
    # An error in the derivation, on any rank, is raised on every rank (so the job ends at once,
    # with one traceback, whether every rank or only one node sees the problem).
    with errors_raised_on_every_rank(comm):
        cfg = derive_run_config(choices, comm.Get_size(), ranks_per_node)
        if cfg.verify_data and local_rank == 0:  # one reader per node (the files may be a node's own)
            check_prepared_data(cfg.data)
    # and the same result (a stale `latest` read on one node would resume another step)
    check_same_on_all_ranks(comm, cfg.to_dict(), "training configuration")
    idle = sharding_nothing(cfg)
    if idle and comm.Get_rank() == 0:  # (it runs: a layout that may be meant, said once)
        print(idle, file=sys.stderr, flush=True)
    # a model of a named family that the family cannot write (export-hf refuses it at the end): it
    # trains, as cutp computes it, and is said now rather than after the training
    unexportable = export_refusal(cfg.model) if cfg.model.family is not None else None
    if unexportable and comm.Get_rank() == 0:
        print(f"warning: export-hf will refuse this {cfg.model.family} model: {unexportable}", file=sys.stderr,
              flush=True)
    return cfg


def check_prepared_data(data: str) -> None:
    """`verify_data`: raises ConfigError naming the first damaged shard (cutp.data.verify)."""
    problems, shards, _ = verify_prepared(data)
    if problems:
        more = f" (and {len(problems) - 1} more: python -m cutp verify-data {data})" if len(problems) > 1 else ""
        raise ConfigError(f"{problems[0]}{more}; {fix_line(data)}")


def _comparable(value):
    if isinstance(value, GPTConfig):
        return value.to_dict()
    return list(value) if isinstance(value, tuple) else value


def derive_run_config(choices: dict, world: int, ranks_per_node: int) -> RunConfig:
    """The RunConfig of `choices` on `world` ranks, `ranks_per_node` of them per node: every
    default derived from what was given. No communication (resolve_run_config's core; it reads
    a checkpoint to resume). Raises ConfigError naming the settings by field, proposing only
    fixes that are accepted (cutp.train.fixes)."""
    try:
        return _derive_and_refuse_ignored(choices, world, ranks_per_node)
    except ConfigError as e:
        raise with_working_fixes(e, _derive_and_refuse_ignored, choices, world, ranks_per_node) from None


def _derive_and_refuse_ignored(choices: dict, world: int, ranks_per_node: int) -> RunConfig:
    """`_derive_run_config`, then a setting given that the result would ignore refused (a fix is
    tried through both: one that leaves a given setting ignored is no fix)."""
    cfg = _derive_run_config(choices, world, ranks_per_node)
    # a setting given other than its default (the default is what happens anyway)
    refuse_ignored({k for k, v in choices.items() if v not in (None, [], False) and v != CHOICES.get(k)}, cfg)
    return cfg


def _derive_run_config(choices: dict, world: int, ranks_per_node: int) -> RunConfig:
    unknown = sorted(set(choices) - set(CHOICES))
    if unknown:
        raise ConfigError(f"unknown run settings {unknown}; the settings are {sorted(CHOICES)}")
    _one_start(choices.get("resume"), choices.get("init_from"))
    check_one_stage(choices.get("zero"), choices.get("distributed_optimizer"))
    resume_dir, meta = None, None
    if choices.get("resume"):  # the run goes on as it was: its layout, cadence and run directory
        resume_dir = resolve_checkpoint(choices["resume"])
        meta = read_meta(resume_dir)
        choices = resumed_choices(choices, meta.get("train_args") or {}, world)
    c = {k: (v if v is not None else CHOICES[k]) for k, v in {**CHOICES, **choices}.items()}
    c["set"] = tuple(c["set"] or ()) + tuple(f"{k}={c[k]!r}" for k in MOE_FLAGS if c[k] is not None)
    if c["metrics"]:  # its directory now, not at the first write after minutes of setup
        parent = os.path.dirname(os.path.abspath(c["metrics"]))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"`metrics` {c['metrics']}: cannot create its directory {parent} ({e.strerror}); "
                              "choose a writable path") from None
    device = resolve_device(c["device"])

    run = _run_settings(choices, meta)
    if c["tensorboard"] and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError(f"`tensorboard` writes through the tensorboardX package, which is not installed: "
                          f"{TENSORBOARD_HINT}, or omit `tensorboard`")
    if c["verify_data"] and not (isinstance(run["data"], str) and os.path.isdir(run["data"])):
        raise ConfigError(f"`verify_data` checks the digests of a directory written by python -m cutp prepare-data, "
                          f"and `data` is {run['data'] or 'not given (the embedded corpus)'}: omit `verify_data`")
    SETTINGS["dropout"][0].check("dropout", run["dropout"])
    if meta is None and c["model"] is not None and choices.get("dropout") is None:
        run["dropout"] = as_gpt_config(c["model"]).dropout  # a model given whole keeps its dropout
    init_from = None
    if c["init_from"] and meta is None:
        init_from, model = init_from_model(c, run["dropout"])
        preset = None
    else:
        model, preset = model_config(c, run["dropout"], device, meta)
    if meta is not None and meta.get("trainable_only"):  # the frozen base: where the run's is, or `init_from`
        init_from = check_base_of(resume_dir, meta, c["init_from"])

    dynamic = [k for k in ("initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale")
               if choices.get(k) is not None]
    if dynamic and (model.dtype != "float16" or c["loss_scale"] is not None):
        why = "a static `loss_scale` is set" if c["loss_scale"] is not None else f"the model is {model.dtype}"
        raise ConfigError(f"`{dynamic[0]}` {choices[dynamic[0]]} sets the dynamic float16 loss scale, "
                          f"but {why}; omit it")
    # None is "not given" (the default is derived); any value given, 0 included, is checked as given
    for name in ("micro_batch_size", "batch_size", "seq_len", "pp_virtual", "steps", "warmup"):
        value = run[name] if name in run else c[name]
        if value is not None:
            SETTINGS[name][0].check(name, value)
    tp_chosen = c["tp"] is None and c["dp"] is None  # by choose_tp, for this machine

    def pick_tp(n):
        return choose_tp(n, ranks_per_node, model, device)

    if c["tp"] is not None:  # the model's message about a tp given comes before the layout's
        SETTINGS["tp"][0].check("tp", c["tp"])
        model.validate(c["tp"])
    def tp_suits(t):
        try:
            model.validate(t)
            return True
        except ConfigError:
            return False

    cp = c["cp"]
    world = with_context_parallel(world, cp)  # the ranks of tp x dp x pp (cp takes its factor first; checked)
    mesh = derive_mesh(world, c["tp"], c["dp"], c["pp"], c["ep"], pick_tp=pick_tp, tp_suits=tp_suits, cp=cp)
    tp, dp, pp = mesh.tp, mesh.dp, mesh.pp
    if c["tp"] is None and c["dp"] is not None and not tp_suits(tp):  # tp = world / (dp * pp) cannot be
        per_stage = world // pp
        options = [d for d in divisors(per_stage) if d % mesh.ep == 0 and tp_suits(per_stage // d)]
        if not options:  # no dp helps: the model's own error, as without --dp
            model.validate(tp)
        try:
            model.validate(tp)
        except ConfigError as e:
            why = str(e).split(";")[0]
        cp_x = f"cp {cp} x " if cp > 1 else ""
        raise ConfigError(f"`dp` {dp} leaves tp = {world * cp} / ({cp_x}dp {dp} x pp {pp}) = {tp}, but {why}; use a "
                          f"`dp` from {options}")
    model.validate(tp)  # (RunConfig checks it again; here its message comes before the rest)
    if c["sequence_parallel"] and tp == 1:
        refuse_sequence_parallel(world, mesh, model, tp_chosen, c["dp"] is not None, cp)
    virtual = 1 if c["pp_virtual"] is None else c["pp_virtual"]
    schedule = c["pp_schedule"] or ("interleaved" if virtual > 1 else "1f1b")
    seq_len = run["seq_len"] or (min(model.block_size, 256) if device == "cpu" else model.block_size)
    batch = run["batch_size"] or default_batch(dp, pp, schedule, c["micro_batch_size"])
    micro = c["micro_batch_size"] or default_micro_batch(batch // dp if batch % dp == 0 else batch, pp, schedule)
    steps = run["steps"]
    lr = (1e-3 if model.n_embd <= 256 else 6e-4) if run["lr"] is None else run["lr"]
    if run["min_lr"] is not None and run["min_lr"] > lr:  # the "decay" would raise the learning rate
        raise ConfigError(f"`min_lr` {run['min_lr']:g} is above `lr` {lr:g}: the cosine decay ends at `min_lr`; "
                          f"give `min_lr` <= {lr:g}, or omit it (lr / 10)")
    if meta is not None and steps <= int(meta["step"]):  # it exited 0 having done nothing (and rewrote config.toml)
        raise ConfigError(f"the resumed run is at step {int(meta['step'])}, and `steps` {steps} leaves nothing to "
                          f"train; give `steps` above {int(meta['step'])} to continue it")
    return RunConfig(
        model=model, device=device, tp=tp, dp=dp, pp=pp, ep=mesh.ep, cp=cp, cp_comm=c["cp_comm"],
        pp_layers=_layer_counts(c["pp_layers"]),
        pp_schedule=schedule, pp_virtual=virtual, steps=steps, batch_size=batch, micro_batch_size=micro,
        seq_len=seq_len, lr=lr,
        min_lr=run["min_lr"],
        warmup=run["warmup"] if run["warmup"] is not None else max(1, steps // 20),
        weight_decay=run["weight_decay"], grad_clip=run["grad_clip"], seed=run["seed"], data=run["data"],
        pack=bool(run["pack"]), sample_every=c["sample_every"], sample_prompt=c["sample_prompt"],
        sample_tokens=c["sample_tokens"],
        **{k: run[k] for k in FINETUNE_SETTINGS},
        distributed_optimizer=bool(c["distributed_optimizer"]), grad_reduce_dtype=c["grad_reduce_dtype"],
        zero=c["zero"], reshard_after_forward=bool(c["reshard_after_forward"]), dp_replicate=c["dp_replicate"],
        allow_tf32=bool(c["allow_tf32"]),
        recompute=c["recompute"], recompute_layers=c["recompute_layers"],
        sequence_parallel=bool(c["sequence_parallel"]),
        loss_scale=c["loss_scale"], initial_loss_scale=c["initial_loss_scale"],
        loss_scale_window=c["loss_scale_window"], hysteresis=c["hysteresis"], min_loss_scale=c["min_loss_scale"],
        max_skips=c["max_skips"], run_steps=c["run_steps"], eval_every=c["eval_every"],
        eval_batches=c["eval_batches"], out=c["out"], overwrite=bool(c["overwrite"]), save_every=c["save_every"],
        keep=c["keep"],
        resume=resume_dir, resumed_step=None if meta is None else int(meta["step"]), init_from=init_from,
        verify_data=bool(c["verify_data"]),
        metrics=c["metrics"],
        tensorboard=c["tensorboard"], log_every=c["log_every"], quiet=bool(c["quiet"]), peak_tflops=c["peak_tflops"],
        save_on_signal=bool(c["save_on_signal"]),
        collective_timeout=c["collective_timeout"], preset=preset,
        # a resume given no `set` keeps the checkpoint's: its config.toml and checkpoints name the model as it was made
        overrides=c["set"] if meta is None or c["set"] else tuple((meta.get("train_args") or {}).get("set") or ()),
        **{k: c[k] for k in OVERLAP_SETTINGS})


def resume_out(choices: dict) -> dict:
    """A command line's `resume` without `out` (examples/train_gpt.py): the checkpoints go on into
    the resumed run's directory (the step-* checkpoint's parent). A library caller's `out` None
    stays None: no checkpoints (two sub-communicators may resume one checkpoint side by side)."""
    if not choices.get("resume") or choices.get("out") is not None:
        return choices
    checkpoint = os.path.normpath(resolve_checkpoint(choices["resume"]))
    if not re.fullmatch(r"step-\d+", os.path.basename(checkpoint)):
        return choices
    return {**choices, "out": os.path.dirname(checkpoint)}


def resume_note(cfg: RunConfig) -> str | None:
    """One line when a resumed run runs in another layout than the run it resumes (allowed: no
    layout changes the math), else None."""
    if cfg.resume is None:
        return None
    saved = read_meta(cfg.resume).get("train_args") or {}
    if saved_world(saved) is None or all(saved.get(k, 1) == getattr(cfg, k) for k in RESUME_MESH):
        return None
    return f"layout: {layout_text(cfg)}, the resumed run's was {layout_text(saved)} (the math is the same)"


def _layer_counts(value):
    """--pp-layers "5,6,6,5" (or a sequence of ints) -> (5, 6, 6, 5)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return tuple(int(v) for v in value.split(","))
        except ValueError:
            raise ConfigError(f"`pp_layers` {value!r}: expected comma-separated layer counts, e.g. 5,6,6,5") from None
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
            raise ConfigError(f"`{key}` {value} differs from the resumed run's {before}; a resumed run "
                              f"continues the same training: omit `{key}`")
        out[key] = value
    return out


def checkpoint_conflicts(config: RunConfig, meta: dict) -> list[str]:
    """The run settings in which `config` contradicts a checkpoint's (steps may differ), as
    "`name` value (the checkpoint's before)" strings (ConfigError's way of naming a setting);
    empty when the run continues that one."""
    saved = meta.get("train_args") or {}
    mine = {**{k: getattr(config, k) for k in RUN_SETTINGS if k != "dropout"}, "dropout": config.model.dropout}
    return [f"`{k}` {mine[k]} (the checkpoint's {saved[k]})" for k in RUN_SETTINGS
            if k != "steps" and saved.get(k) is not None and mine[k] != saved[k]]
