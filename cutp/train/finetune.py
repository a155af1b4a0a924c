"""What trains: --freeze's groups and LoRA's adapters (cutp.tensor_parallel.lora) on a run's model.

    --freeze embeddings,norms          those parameters frozen (no gradient, master or state)
    --lora-rank 8 --lora-alpha 16      every parameter frozen, rank-8 adapters on --lora-targets
    --lora-dropout 0.05 --lora-targets q,k,v,o,gate,up,down

Both are run settings (a resumed run keeps them). A run with frozen parameters saves only the
trainable ones in its checkpoints (`trainable_only` in meta.json, with `base`: where the frozen
weights come from, the run's init_from or None for the seed's initial weights); resuming or
exporting reads the base from there and the trainable tensors from the checkpoint.
"""
from __future__ import annotations

import fnmatch
import os

import numpy as np

from ..checkpoint import CheckpointError, read_meta, resolve_checkpoint
from ..checkpoint.base_identity import base_record, check_same_base
from ..models.hf import expected_shapes
from ..models.hf_files import HFFormatError
from ..runtime.errors import ConfigError
from ..tensor_parallel.lora import (DEFAULT_TARGETS, DENSE_TARGETS, FREEZE_GROUPS, TARGETS, LoraPair, LoraSpec,
                                    freeze_groups, set_up_trainable as set_up, spec_of)

FINETUNE_SETTINGS = ("freeze", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
# their values when not given (what another command's flags default to: `cutp plan`, `cutp bench model`)
FINETUNE_DEFAULTS = {"freeze": None, "lora_rank": None, "lora_alpha": None, "lora_dropout": 0.0,
                     "lora_targets": DEFAULT_TARGETS}


def settings_of(cfg) -> dict:
    return {k: getattr(cfg, k) for k in FINETUNE_SETTINGS}


def lora_spec(cfg) -> LoraSpec | None:
    """The run's LoRA (None without `lora_rank`)."""
    return spec_of(settings_of(cfg))


def check_finetune(cfg) -> None:
    """ConfigError naming the setting: LoRA settings without `lora_rank`, bad values, dropout on
    MoE experts' adapters."""
    if cfg.lora_rank is None:
        given = [k for k, default in (("lora_alpha", None), ("lora_dropout", 0.0), ("lora_targets", DEFAULT_TARGETS))
                 if getattr(cfg, k) != default]
        if given:
            raise ConfigError(f"`{given[0]}` sets up LoRA adapters, which need `lora_rank`: give `lora_rank` R "
                              f"(e.g. 8), or omit `{given[0]}`")
    spec = lora_spec(cfg)
    if spec is not None:
        _check_targets(cfg.model, spec)
    if cfg.freeze is not None and not freeze_groups(settings_of(cfg)):
        raise ConfigError(f"`freeze` {cfg.freeze!r} names no group; give some of embeddings, norms, head, attention, "
                          "mlp or parameter-name globs, comma-separated")
    _check_freeze_names(cfg, spec)
    if spec is not None and spec.dropout and cfg.model.n_experts and {"gate", "up", "down"} & set(spec.targets):
        raise ConfigError(f"`lora_dropout` {spec.dropout}: adapters on MoE experts take no dropout (their inputs are "
                          "routed tokens); use `lora_dropout` 0, or `lora_targets` q,k,v,o on an MoE model")
    if spec is not None and spec.dropout and cfg.sequence_parallel and {"q_a", "kv_a"} & set(spec.targets):
        # (the layer refuses it too, MultiLatentAttention.lay_out_sequence: here before anything is built, on every rank)
        raise ConfigError(f"`lora_dropout` {spec.dropout} on q_a / kv_a of multi-head latent attention runs on each "
                          "rank's tokens under sequence parallelism; set `lora_dropout` 0, or drop q_a,kv_a from "
                          "`lora_targets`, or omit `sequence_parallel`")


def _check_targets(model, spec) -> None:
    """`lora_targets` against the model's attention: q, k, v, o, or multi-head latent attention's
    q_a, q_b (q without q_lora_rank), kv_a, kv_b, o (PEFT's names for DeepseekV3, less `_proj`)."""
    if model.kv_lora_rank is None:
        own, kind = DENSE_TARGETS, "has no multi-head latent attention"
    else:
        own = ("q_a", "q_b") if model.q_lora_rank else ("q",)
        own, kind = own + ("kv_a", "kv_b", "o", "gate", "up", "down"), "has multi-head latent attention"
    bad = [t for t in spec.targets if t not in own]
    if bad:
        raise ConfigError(f"`lora_targets` {','.join(spec.targets)}: {','.join(bad)} is no projection of this model "
                          f"(it {kind}); use some of {','.join(own)}, e.g. `lora_targets` {','.join(own)}")


def _check_freeze_names(cfg, spec) -> None:
    """--freeze's groups against the model's parameter names, before anything is built (a model no
    Hugging Face family lists, such as GPT-2 with experts, is checked once built instead)."""
    groups = freeze_groups(settings_of(cfg))
    try:
        names = list(expected_shapes(cfg.model))
    except HFFormatError:
        return
    frozen = set()
    for g in groups:
        hit = {n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in FREEZE_GROUPS.get(g, (g,)))}
        if not hit:
            raise ConfigError(f"`freeze` {g!r} matches no parameter of this model; use a group of "
                              f"{', '.join(FREEZE_GROUPS)}, or a glob of parameter names such as 'layers.0.*'")
        frozen |= hit
    if groups and spec is None and frozen == set(names):
        raise ConfigError(f"`freeze` {cfg.freeze} leaves no parameter to train; freeze fewer groups")


def set_up_trainable(model, cfg) -> None:
    """Freezes `cfg.freeze`'s groups and adds `cfg`'s LoRA adapters (before any layout is set and
    before the optimizer takes the parameters). A group matching no parameter of any pipeline
    stage, or nothing left to train, is refused on every rank. Collective over TP and PP."""
    groups, spec = freeze_groups(settings_of(cfg)), lora_spec(cfg)
    hits = np.array(set_up(model, settings_of(cfg), seed=cfg.seed), np.int64)
    ctx = model.ctx
    if groups:
        if ctx.pp_size > 1:
            ctx.pp.mpi_comm.Allreduce(hits.copy(), hits)
        none = [g for g, n in zip(groups, hits) if n == 0]
        if none:
            raise ConfigError(f"`freeze` {none[0]!r} matches no parameter of this model; use a group of "
                              "embeddings, norms, head, attention, mlp, or a glob of parameter names such as "
                              "'layers.0.*'")
    if not (groups or spec is not None):
        return
    mine = (sum(p.trainable for p in model.parameters()), list(model.layer_ids))
    every = model.ctx.pp.mpi_comm.allgather(mine) if ctx.pp_size > 1 else [mine]
    counts = [n for n, _ in every]
    if sum(counts) == 0:
        raise ConfigError(f"`freeze` {cfg.freeze} leaves no parameter to train; freeze fewer groups")
    if 0 in counts:  # (its optimizer would hold nothing: not supported)
        stage = counts.index(0)
        raise ConfigError(f"`freeze` {cfg.freeze} leaves pipeline stage {stage} (layers {every[stage][1]}) nothing "
                          "to train; freeze fewer of its parameters, or use fewer pipeline stages (`pp`)")


def resumed_without_base(resume: str) -> bool:
    """Whether checkpoint (or run directory) `resume` holds only what its run trained."""
    try:
        return bool(read_meta(resolve_checkpoint(resume)).get("trainable_only"))
    except (OSError, ValueError, ConfigError, CheckpointError):  # (not a cutp checkpoint: the refusal names both)
        return False


def check_base_of(ckpt: str, meta: dict, init_from: str | None) -> str | None:
    """The frozen base of a resumed checkpoint holding only what trained, as an absolute path:
    `init_from` when given (the base moved there), else its run's init_from (None: the seed's
    initial weights; an older checkpoint's relative path is resolved from here). Refused in one
    line naming the fix when that directory is gone, or holds other weights than the run's base
    (the fingerprint its run recorded, cutp.checkpoint.base_identity)."""
    args = meta.get("train_args") or {}
    base = init_from if init_from is not None else args.get("init_from")
    if base is None:
        return None
    if not os.path.isdir(base):
        fix = ("give the directory it moved to as `init_from` together with `resume`" if init_from is None
               else "give the directory that holds it")
        relative = ("; a relative path, found from the directory the run was started in" if init_from is None
                    and not os.path.isabs(base) else "")
        raise ConfigError(f"`resume` {ckpt} holds only what its run trained; its frozen base {base} is not a "
                          f"directory (moved or deleted{relative}): {fix}")
    check_same_base(f"`resume` {ckpt}", args, base,
                    "give the directory that holds the run's base as `init_from` together with `resume`, or put "
                    f"the run's base back at {args.get('init_from')}")
    return os.path.abspath(base)


def resumed_base(cfg) -> tuple[bool, str | None]:
    """(init, init_from) of the model a run builds: a resumed checkpoint saved with frozen
    parameters (`trainable_only`) holds only what trains, so the frozen base comes from
    `cfg.init_from` (given with the resume: the base moved there), else the resumed run's
    init_from (checked as `check_base_of` checks it), or, without one, its seed's initial weights."""
    if cfg.resume is None:
        return cfg.init_from is None, cfg.init_from
    meta = read_meta(cfg.resume)
    if not meta.get("trainable_only"):
        return False, None
    base = check_base_of(cfg.resume, meta, cfg.init_from)
    return base is None, base


def frozen_base_record(cfg, base: str | None) -> dict:
    """What a run with frozen parameters records in its checkpoints' train_args about `base`, the
    directory its frozen weights were read from: its absolute path and weights' fingerprint
    (cutp.checkpoint.base_identity), so a resume or export finds that base or refuses another.
    Empty for a run without frozen parameters (its checkpoints are whole) or without a base."""
    if base is None or not (cfg.freeze or cfg.lora_rank is not None):
        return {}
    return base_record(base)


def oversized_rank_line(cfg, model) -> str | None:
    """A warning line (None without cause) when `lora_rank` exceeds min(in, out) of targeted
    projections, naming them and their layers: PEFT accepts such a rank, and so does cutp, but
    the update B A of such a projection cannot exceed rank min(in, out), so the rest of its
    adapter is memory and compute for nothing (a typo's `--lora-rank 256` for 16). Collective
    over PP (each stage holds its own layers' projections)."""
    spec = lora_spec(cfg)
    if spec is None:
        return None
    mine = sorted({(p.proj, p.n_in, p.n_out, _layer_of(p.A.name)) for p in model.modules()
                   if isinstance(p, LoraPair) and spec.rank > min(p.n_in, p.n_out)})
    if model.ctx.pp_size > 1:
        mine = sorted({x for stage in model.ctx.pp.mpi_comm.allgather(mine) for x in stage})
    if not mine:
        return None
    layers = {}
    for proj, n_in, n_out, layer in mine:
        layers.setdefault((proj, n_in, n_out), set()).add(layer)
    named = [f"{proj} ({n_in} -> {n_out}) of layers {_ranges(sorted(at))}" for (proj, n_in, n_out), at in
             sorted(layers.items(), key=lambda kv: TARGETS.index(kv[0][0]))]
    return (f"warning: --lora-rank {spec.rank} exceeds min(in, out) of {', '.join(named)}: their updates cannot "
            f"exceed that rank, so the rest of those adapters is memory and compute for nothing; --lora-rank "
            f"{min(min(n_in, n_out) for _, n_in, n_out, _ in mine)} or less avoids it")


def _layer_of(name: str) -> int:
    """The layer index of a parameter name (layers.3.attn.qkv.lora_A.q -> 3)."""
    return int(name.split(".")[1])


def _ranges(numbers: list) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], numbers[0]
    for prev, n in zip(numbers, numbers[1:] + [None]):
        if n is None or n != prev + 1:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = n
    return ", ".join(out)


def trainable_line(cfg, model) -> str | None:
    """The banner's line of a run with frozen parameters (None without): what trains on this rank."""
    params = model.parameters()
    frozen = [p for p in params if not p.trainable]
    if not frozen:
        return None
    spec = lora_spec(cfg)
    what = [f"LoRA rank {spec.rank}, alpha {spec.alpha:g} on {','.join(spec.targets)}"] if spec else []
    what += [f"--freeze {cfg.freeze}"] if cfg.freeze else []
    n = sum(p.data.size for p in params if p.trainable)
    return (f"trainable: {n:,} of {n + sum(p.data.size for p in frozen):,} parameters on this rank ({'; '.join(what)});"
            " the frozen ones have no gradients, masters or optimizer state")
