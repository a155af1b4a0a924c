"""`python -m cutp bench plan`: memory and communication per GPU for a model, mesh, dtype and
optimizer, from the model's shape (no hardware).

Model: `--preset NAME [--set k=v]` a cutp GPTConfig, planned exactly as cutp trains it, or
`--params 70B` a standard architecture of that size (ARCHITECTURES: GPT-3 and Llama-2 shapes,
which cutp does not train: their activations come from a published formula).

State per rank (params, grads, optimizer), in bytes, exactly what the run allocates (the
buffer design of `cutp.optim`; `cutp.train.memory.state_bytes` measures the same arrays): n
parameters on the rank (cutp presets: exactly `GPT.num_parameters_local()`: the vocabulary
padded per `GPTConfig.padded_vocab(tp)`, the KV heads split while tp <= n_kv_head, else one
replicated per rank, the LayerNorms, row-parallel biases and position embeddings replicated),
in one flat buffer padded to N = ceil(n / M) * M elements, M = 1 (plain AdamW) or 64 * dp
(distributed optimizer).

  --dtype            params   grads      optimizer, plain         distributed (ZeRO-1 over dp)
  float32            4 B      4 B        m, v fp32: 8 B           8/d
  bfloat16/float16   2 B      4 B (fp32) m, v + fp32 master: 12 B 12/d
  float64            8 B      8 B        m, v fp64: 16 B          16/d

  i.e. 16 B/param (fp32), 18 (bf16), 8 + 8/d and 6 + 12/d distributed: Megatron's table.
  (--precision mixed|fp32, the older flag, means --dtype bfloat16|float32.)

Activations (the peak a training step allocates above the state), cutp presets: cutp's own
training step, run on shape-only arrays (`cutp.plan.run.planned_step`: the model, the optimizer
and `train_step` of the library, their arrays' buffers booked on a heap while they live, so
what the layers cache, each op's outputs and temporaries come in the code's order with the code's
lifetimes; checked against tracemalloc on the CPU by tests/plan/test_memory.py: per layer exact, the
peak within 10%), on a GPU (`--device cuda`, the default: CuPy's pool rounding, NCCL's
collectives, cutp's kernels' launchers; the fused attention keeps o and the rows' log-sum-exp)
or on the CPU (`--device cpu --threads N`); the largest over the TP ranks. `--recompute` and
`--sequence-parallel` run as they run in training. "kept per layer" is what each layer holds for
backward after its forward (`cutp.train.memory.stash_per_layer`, measured on those arrays).
`--params` architectures: Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", Table 2, 16-bit activations, 1-byte dropout masks), per layer and
micro-batch, t = tp, a = heads:

    recompute   without sequence parallelism        with it
    none        s*b*h*(10 + 24/t + 5*a*s/(h*t))     s*b*h*(34/t + 5*a*s/(h*t))
    selective   s*b*h*(10 + 24/t)                   s*b*h*34/t
    full        2*s*b*h (the layer's input)         2*s*b*h/t

summed over the L layers, plus the fp32 logits 4*s*b*V/t; 4-byte activations double all but
the dropout masks (`activation_bytes_per_layer`). The formulas ignore the recomputation's own
transient (one layer's stash, or the attention's probabilities, again during its backward).

Pipeline parallelism (`--pp`, each stage's memory, the p2p bytes, the bubble): `cutp.plan.pipeline`;
the search for the layouts that fit (`--search`): `cutp.plan.search`.
Context parallelism (`--cp N --cp-comm ring|a2a`): s / cp tokens per rank, the gradients and
ZeRO over DP x CP, the ring's or all-to-all's bytes (`cutp.plan.context`).

(The module runs over 500 lines because the plan of one layout, its checks, figures and its
report's tables stay together: each figure next to the formula that makes it.)

Whether the total fits an 80 GB and a 141 GB GPU (GB = 1e9 bytes; the CUDA context, NCCL and
cuBLAS workspaces and the allocator's fragmentation need some GB more).

Communication per optimizer step (Megatron 1D TP, Shoeybi et al. 2019): per layer and micro-batch
2 all-reduces of b*s*h elements forward (attention and MLP output projections) and 2 backward
(the input gradients of the QKV and MLP input projections), i.e. 4 all-reduces per layer; plus
the embedding's all-reduce forward and the LM head's input-gradient all-reduce backward (b*s*h
each), and the vocab-parallel cross-entropy's per-row statistics (1 max + 3 sums of b*s).
DP: one all-reduce of the gradient buffer per step (fp32 for 16-bit parameters); with the
distributed optimizer a reduce-scatter of it and an all-gather of the parameters instead.
"on the wire" is the buffer times nccl-tests' bus factor (2(n-1)/n for all-reduce, (n-1)/n for
reduce-scatter and all-gather): what each GPU sends (and receives) with a ring.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

from ..models import GPTConfig
from ..runtime.errors import ConfigError
from ..tensor_parallel.specs import count, tp_summed
from ..tensor_parallel.validation import check_attention, check_mlp
from ..train.finetune import check_finetune
from ..train.reporting import Report, parse_count
from .moe import (all_to_all_elements, check_moe_layout, dense_mlp_activation_bytes, moe_counts,
                       moe_layer_activation_bytes, moe_layers)
from ..runtime.mesh import Mesh
from . import overlap
from .context import check_cp, cp_comm_bytes, cp_formula, formula_args
from .finetune import DEFAULTS as FINETUNE_DEFAULTS, settings_of, trainable_split
from .mla import mha_attention_bytes, mla_attention_bytes, mla_tp_collectives
from .run import ITEMSIZE, planned_parameters, planned_step
from .zero import gathered_units_bytes, zero_collectives, zero_plan, zero_state_bytes


# `--params SIZE`: published architectures of that size, planned by formula (module docstring):
# their ModelConfig presets (cutp.models.families), and the names the plan shows
ARCHITECTURE_PRESETS = {"7B": ("Llama-2-7B", "llama2-7b"), "8B": ("Llama-3-8B", "llama3-8b"),
                        "13B": ("Llama-2-13B", "llama2-13b"), "70B": ("Llama-2-70B", "llama2-70b"),
                        "175B": ("GPT-3 175B", "gpt3-175b")}
ARCHITECTURES = {size: GPTConfig.preset(preset) for size, (_, preset) in ARCHITECTURE_PRESETS.items()}


def pick_arch(params: str) -> GPTConfig:
    """'70B' (or 70e9, 7e10): the listed architecture of that size (within 15%: 7B is Llama-2-7B's
    6.74B); any other size is refused (planning the nearest one, 54 times larger for 124M,
    printed a plan of a model that was not asked for)."""
    known = ", ".join(ARCHITECTURES)
    try:
        want = parse_count(params)
    except ValueError:
        want = math.nan  # refused below, in the terms of the flag
    if not want > 0 or math.isinf(want):
        raise ConfigError(f"`params` {params!r} is not a parameter count; give one of {known} (or e.g. 7e9)")
    nearest = min(ARCHITECTURES.values(), key=lambda a: abs(a.num_parameters() - want))
    if abs(nearest.num_parameters() - want) > 0.15 * want:
        raise ConfigError(f"`params` {params}: the planner knows the architectures of {known}; for another model "
                          "give `preset` NAME (with --set n_layer=... n_embd=... for another shape)")
    return nearest


def model_name(args) -> str:
    """The name the plan's tables show: the preset's, or the --params architecture's."""
    if args.preset:
        return args.preset
    a = pick_arch(args.params or "70B")
    return next(ARCHITECTURE_PRESETS[k][0] for k, v in ARCHITECTURES.items() if v is a)


def param_count(a: GPTConfig, tp: int = 1, ep: int = 1) -> dict:
    """Parameters of the full model ('total'), of one TP (and EP) rank ('per_rank': its shards, the
    vocabulary padded as `padded_vocab(tp)` pads it) and those a token runs through ('active'), by
    component ('layer': a dense layer's); each `*_per_rank` one rank's. The sums of the model's
    declarations (`GPTConfig.declarations`, cutp.tensor_parallel.specs): no array is built.
    (Kept per config and layout: the search asks for the same counts thousands of times.)"""
    key = (repr(a), tp, ep)
    if key not in _PARAM_COUNTS:
        if len(_PARAM_COUNTS) >= 256:
            _PARAM_COUNTS.clear()
        _PARAM_COUNTS[key] = _param_count(a, tp, ep)
    return dict(_PARAM_COUNTS[key])


_PARAM_COUNTS: dict = {}


def _param_count(a: GPTConfig, tp: int, ep: int) -> dict:
    decls = a.declarations()
    layer = dataclasses.replace(a, n_experts=0).block_spec(0).parameters()  # (a dense layer)
    out = {"total": count(decls), "per_rank": count(decls, tp=tp, ep=ep), "active": a.num_active_parameters(),
           "layer": count(layer), "layer_per_rank": count(layer, tp=tp)}
    for key, prefix in (("embedding", "tok_embed."), ("head", "lm_head."), ("position", "pos_embed."),
                        ("final_norm", "final_norm.")):
        out[key] = count(decls, where=lambda d: d.name.startswith(prefix))
        out[f"{key}_per_rank"] = count(decls, tp=tp, where=lambda d: d.name.startswith(prefix))
    return out


def tp_gradient_elements(a: GPTConfig, tp: int, sequence_parallel: bool, ep: int = 1) -> int:
    """Elements of the one TP all-reduce of gradients per step (`tp_grad_sync`): the parameters
    declared `tp_partial` (the MoE experts and the QK-norms, which each TP rank runs on its own
    tokens or heads) and, under sequence parallelism, those declared `sp` (the replicated
    parameters used on sequence shards: the norms, the row biases, the MoE routers, learned
    positions). 0 at tp 1."""
    if tp == 1:
        return 0
    return count(a.declarations(), tp=tp, ep=ep, where=lambda d: tp_summed(d, sequence_parallel))


DTYPES = ("float32", "bfloat16", "float16", "float64")
PRECISION_DTYPE = {"mixed": "bfloat16", "fp32": "float32"}  # the older --precision flag
GPUS = (("80 GB", 80e9), ("141 GB", 141e9))  # H100/A100 80GB, H200 (GB = 1e9 bytes)
DIST_ALIGN = 64  # the distributed optimizer pads the flat buffer to a multiple of 64 * dp elements


def state_bytes(n_local: int, *, dtype: str = "float32", dp: int = 1, distributed_optimizer: bool = False) -> dict:
    """Bytes of one rank's parameters, gradients and optimizer state for n_local parameters
    (module docstring): {"params", "grads", "optimizer", "padded" (N elements), "shard" (the
    elements whose optimizer state this rank keeps)}."""
    pb = ITEMSIZE[dtype]
    low = pb == 2
    align = DIST_ALIGN * dp if distributed_optimizer else 1
    n = -(-int(n_local) // align) * align
    shard = n // dp if distributed_optimizer else n
    sb = 8 if dtype == "float64" else 4
    return {"params": n * pb, "grads": n * (4 if low else pb), "optimizer": shard * (2 * sb + (4 if low else 0)),
            "padded": n, "shard": shard}


def state_bytes_ep(a: GPTConfig, n_local: int, n_moe: int, *, dtype: str, dp: int, ep: int,
                   distributed_optimizer: bool) -> dict:
    """`state_bytes` of n_local parameters among which the experts of n_moe MoE layers: with
    expert parallelism and the distributed optimizer, the experts' state is sharded over their
    expert-DP group (dp / ep ranks), the rest over DP (cutp.optim.expert_parallel)."""
    st = state_bytes(n_local, dtype=dtype, dp=dp, distributed_optimizer=distributed_optimizer)
    if ep == 1 or not distributed_optimizer or not n_moe:
        return st
    experts = n_moe * (a.n_experts // ep) * moe_counts(a)["expert"]
    dense, own = (state_bytes(n, dtype=dtype, dp=d, distributed_optimizer=True)
                  for n, d in ((n_local - experts, dp), (experts, dp // ep)))
    return {k: dense[k] + own[k] for k in st}


def state_bytes_trainable(trains: dict, n_local: int, *, dtype: str, dp: int, ep: int,
                          distributed_optimizer: bool) -> dict:
    """`state_bytes` of a rank holding n_local parameters of which trains["trainable"] train
    (trains["experts"] of them on routed experts: with expert parallelism and the distributed
    optimizer their state sharded over expert-DP): gradients, masters and moments of those, the
    frozen rest counted in "params" only (outside the flat buffers: cutp.train.memory.state_bytes)."""
    n, experts = trains["trainable"], trains["experts"] if ep > 1 and distributed_optimizer else 0
    dense, own = (state_bytes(k, dtype=dtype, dp=d, distributed_optimizer=distributed_optimizer)
                  for k, d in ((n - experts, dp), (experts, max(1, dp // ep))))
    st = {k: dense[k] + own[k] for k in dense}
    st["params"] += (n_local - n) * ITEMSIZE[dtype]
    return st


def coll(calls: int, elems: int, itemsize: int, factor: float) -> dict:
    """A collective's figures: calls, elements and bytes passed, and bytes on the wire (factor)."""
    return {"calls": calls, "elements": elems, "bytes": elems * itemsize, "wire_bytes": elems * itemsize * factor}


def _gradient_reduction(group: str, size: int, n: int, grad_bytes: int, param_bytes: int, zero: bool) -> dict:
    """The step's reduction of a gradient buffer of n (padded) elements over a group of `size`
    ranks: an all-reduce, or with ZeRO a reduce-scatter and the all-gather of the updated
    parameters (counted as the communicators count them: the buffer a rank passes, for the
    all-gather its 1/size shard, which a ring sends size - 1 times). Keys {group}_allreduce,
    {group}_reduce_scatter, {group}_all_gather."""
    on = size > 1 and n > 0
    one = (size - 1) / size
    return {f"{group}_allreduce": coll(int(on and not zero), n if on and not zero else 0, grad_bytes, 2 * one),
            f"{group}_reduce_scatter": coll(int(on and zero), n if on and zero else 0, grad_bytes, one),
            f"{group}_all_gather": coll(int(on and zero), n // size if on and zero else 0, param_bytes, size - 1)}


def table_bytes_per_param(dtype: str, dp: int = 1, distributed_optimizer: bool = False, zero: int = 0) -> float:
    """Megatron's bytes/param without padding: 16 (fp32), 18 (bf16), 8 + 8/d, 6 + 12/d; zero 2:
    2 + 16/d, zero 3: 18/d (bf16)."""
    pb = ITEMSIZE[dtype]
    grad, state = (4, 12) if pb == 2 else (pb, 2 * pb)
    if zero >= 2:
        return (pb if zero == 2 else pb / dp) + (grad + state) / dp
    return pb + grad + (state / dp if distributed_optimizer else state)


def _expert_counted(comm: dict, size: int, replicas: int, cp: int) -> dict:
    """zero 2/3 at ep > 1: the experts' collectives of a `zero_plan` (its `comm`), under the keys of
    `_gradient_reduction("expert_dp", ...)`, and expert_dp_replicas_allreduce (HSDP)."""
    group = "hsdp_expert_shard" if replicas > 1 else ("expert_dp_cp" if cp > 1 else "expert_dp")
    none = {"calls": 0, "elements": 0, "bytes": 0}

    def of(key, factor):
        c = comm.get(key, none)
        return {**c, "wire_bytes": c["bytes"] * factor}

    return {"expert_dp_allreduce": of("", 0), "expert_dp_reduce_scatter": of(f"{group}.reduce_scatter", (size - 1) / size),
            "expert_dp_all_gather": of(f"{group}.all_gather", size - 1),
            "expert_dp_replicas_allreduce": of("hsdp_expert_replicas.all_reduce", 2 * (replicas - 1) / replicas)}


def _shard_group(cp: int, dp_replicate: int) -> str:
    return "hsdp_shard" if dp_replicate > 1 else ("dp_cp" if cp > 1 else "dp")


def parameters_per_rank(config: GPTConfig, tp: int) -> int:
    """Parameters on one TP rank (they all hold the same number): what `GPT(ctx,
    config).num_parameters_local()` counts there, summed from the model's declarations."""
    return count(config.declarations(), tp=tp)


def planned_ranks(n: int, every: int = 16) -> list[int]:
    """The ranks of a group whose walks are computed: all of a small group, else the first and
    the last few (where the vocabulary's and the buffer's padding end up)."""
    return list(range(n)) if n <= every else [0, 1, n - 2, n - 1]


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int, act_bytes: int = 2, recompute: str = "none",
                               sequence_parallel: bool = False) -> float:
    """What one layer keeps for backward, Korthikanti et al. 2022 Table 2 (16-bit activations,
    1-byte dropout masks; SP = sequence parallelism):

        none        s*b*h*(10 + 24/t + 5*a*s/(h*t))     SP: s*b*h*(34/t + 5*a*s/(h*t))
        selective   s*b*h*(10 + 24/t)                   SP: s*b*h*34/t
        full        2*s*b*h (the layer's input)         SP: 2*s*b*h/t

    For wider activations the 16-bit terms scale with the element size and the masks (2*s*b*h
    of the two residual dropouts, /t with SP, and the attention's a*s*s*b/t) stay 1 byte."""
    sbh = s * b * h
    split = t if sequence_parallel else 1  # the parts outside the TP regions
    if recompute == "full":
        return sbh * act_bytes / split
    base = sbh * (34 / t if sequence_parallel else 10 + 24 / t)
    masks = 2 * sbh / split
    if recompute == "none":
        base += 5 * a * s * s * b / t
        masks += a * s * s * b / t
    if act_bytes == 2:
        return base
    return (base - masks) * (act_bytes / 2) + masks


def layer_activation_bytes(a, s, b, tp, act_bytes, mode, sequence_parallel, cp=1, cp_comm="ring") -> float:
    """`activation_bytes_per_layer` of one of a CP rank's layers (cutp.plan.context); with
    multi-head latent attention, its own figure in place of the attention's (cutp.plan.mla)."""
    tokens, heads, kept = formula_args(s, a.n_head, mode, cp, cp_comm)
    layer = activation_bytes_per_layer(tokens, b, a.n_embd, heads, tp, act_bytes, kept, sequence_parallel)
    if a.kv_lora_rank is None or mode == "full":
        return layer
    return (layer - mha_attention_bytes(tokens, b, a.n_embd, heads, tp, act_bytes, kept, sequence_parallel)
            + mla_attention_bytes(a, s // cp, b, tp, act_bytes, sequence_parallel, cp=cp, cp_comm=cp_comm,
                                  recompute=mode))


RECOMPUTE = ("none", "selective", "full")


def check_layout(*, n_layer: int, tp: int, seq_len: int, recompute: str = "none", recompute_layers: int | None = None,
                 sequence_parallel: bool = False) -> None:
    """Refuses, in one line naming the numbers, a recomputation or sequence-parallel setting that
    cannot run (the rules of `RunConfig`)."""
    if recompute not in RECOMPUTE:
        raise ConfigError(f"--recompute {recompute!r}: use one of {', '.join(RECOMPUTE)}")
    if recompute_layers is not None and (recompute != "full" or not isinstance(recompute_layers, int)
                                         or isinstance(recompute_layers, bool) or not 1 <= recompute_layers <= n_layer):
        raise ConfigError(f"--recompute-layers {recompute_layers!r} needs --recompute full (got {recompute}) and "
                          f"1 <= N <= n_layer ({n_layer})")
    if sequence_parallel and seq_len % tp:
        raise ConfigError(f"--seq-len {seq_len} is not divisible by --tp {tp}: --sequence-parallel splits each "
                          f"sequence over the TP ranks; use a multiple of {tp}")


def check_positive(name: str, value, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")


def resolve_dtype(dtype: str | None, precision: str | None) -> str:
    """--dtype, or the dtype of the older --precision (mixed: bfloat16, fp32: float32); default
    bfloat16. Both given must agree."""
    if precision is not None and precision not in PRECISION_DTYPE:
        raise ConfigError(f"--precision {precision!r}: use one of {sorted(PRECISION_DTYPE)} (or --dtype)")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {list(DTYPES)}")
    if dtype and precision and PRECISION_DTYPE[precision] != dtype:
        raise ConfigError(f"--precision {precision} means --dtype {PRECISION_DTYPE[precision]}, not {dtype}; "
                          "give one of them")
    return dtype or PRECISION_DTYPE[precision or "mixed"]


def plan(a: GPTConfig, *, tp: int, dp: int, micro_batch: int, seq_len: int, accum: int = 1, precision: str | None = None,
         dtype: str | None = None, distributed_optimizer: bool = False, config: GPTConfig | None = None,
         device: str = "cuda", threads: int = 1, recompute: str = "none", recompute_layers: int | None = None,
         sequence_parallel: bool = False, ep: int = 1, cp: int = 1, cp_comm: str = "ring", zero: int = 0,
         reshard_after_forward: bool = True, dp_replicate: int = 1, overlap_param_gather: bool = False,
         finetune: dict | None = None) -> dict:
    """Every figure of the plan as plain numbers (bytes, elements, calls). `config`: the cutp
    model `a` describes (exact parameters, simulated activations); None: a --params
    architecture. Raises ConfigError (one line naming the fix) for settings that cannot run,
    e.g. a mesh the model cannot be split over. `zero` 2 or 3 (`dp_replicate` R: HSDP): the
    state, the gathered units and the DP collectives of cutp.plan.zero. `finetune`: RunConfig's
    freeze / lora_* settings: the state of the trainable elements only (cutp.plan.finetune)."""
    zero = max(zero, int(bool(distributed_optimizer)))
    distributed_optimizer = zero >= 1
    if dp % dp_replicate or (dp_replicate > 1 and zero < 2):
        raise ConfigError(f"--dp-replicate {dp_replicate} needs --zero 2 or 3 and must divide --dp {dp}; use --zero 3 "
                          "with a --dp it divides, or omit --dp-replicate")
    prefetch = bool(overlap_param_gather) and zero == 3  # (zero 3's: the next unit gathered ahead)
    sharding = dict(zero=zero, reshard_after_forward=reshard_after_forward, dp_replicate=dp_replicate,
                    overlap_param_gather=bool(overlap_param_gather))
    for name, v in (("tp", tp), ("dp", dp), ("micro_batch", micro_batch), ("seq_len", seq_len), ("accum", accum),
                    ("threads", threads)):
        check_positive(name, v)
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device {device!r}: use cuda or cpu")
    dtype = resolve_dtype(dtype, precision)
    if finetune:  # training's rules (cutp.train.finetune)
        finetune = {**FINETUNE_DEFAULTS, **finetune}
        check_finetune(SimpleNamespace(model=a, zero=zero, **finetune))
    check_moe_layout(a, ep, dp)
    check_attention(a.n_embd, a.n_head, a.kv_heads, tp)  # the rules training applies
    check_mlp(a.n_embd, a.hidden, tp)
    check_layout(n_layer=a.n_layer, tp=tp, seq_len=seq_len, recompute=recompute, recompute_layers=recompute_layers,
                 sequence_parallel=sequence_parallel)
    check_cp(a, cp=cp, cp_comm=cp_comm, tp=tp, seq_len=seq_len, sequence_parallel=sequence_parallel)
    layout = dict(recompute=recompute, recompute_layers=recompute_layers, sequence_parallel=sequence_parallel)
    pb = ITEMSIZE[dtype]
    s, b, h, L = seq_len, micro_batch, a.n_embd, a.n_layer
    if config is not None:
        dataclasses.replace(config, dtype="float32").validate(tp)  # the vocabulary rule too (any dtype plans)
        if seq_len > config.block_size:
            raise ConfigError(f"--seq-len {seq_len} exceeds the model's block_size {config.block_size}")
    if config is not None and not a.n_experts:  # (the simulated step has no MoE layers: those use the formula)
        P = parameters_per_rank(config, tp)
        mesh = Mesh(tp, dp, cp=cp)  # (every CP rank holds as much: its zigzag chunks)
        peaks = [planned_step(config, tp=tp, dp=dp, ep=ep, cp=cp, cp_comm=cp_comm, rank=mesh.rank_of(r, d),
                              micro_batch=b, seq_len=s, accum=accum, dtype=dtype, device=device, threads=threads,
                              distributed_optimizer=distributed_optimizer, finetune=finetune, **sharding, **layout)
                 for r in planned_ranks(tp) for d in (planned_ranks(dp) if distributed_optimizer else (0,))]
        worst = max(peaks, key=lambda p: p["activations_peak"])
        stash = [max(col) for col in zip(*(p["stash_per_layer"] for p in peaks))]
        act = {"bytes": worst["activations_peak"], "where": worst["where"], "stash_per_layer": stash,
               "source": f"cutp's training step, run on shape-only arrays ({'GPU' if device == 'cuda' else f'CPU, {threads} thread(s)'})"}
    else:
        P = param_count(a, tp, ep)["per_rank"]  # (the declarations' sum: exact for any model)
        full = L if recompute_layers is None else recompute_layers
        modes = [recompute if (recompute != "full" or i < full) else "none" for i in range(L)]
        stash = [layer_activation_bytes(a, s, b, tp, pb, mode, sequence_parallel, cp, cp_comm) for mode in modes]
        for i, mode in enumerate(modes):  # an MoE layer's MLP in place of the dense one
            if a.is_moe_layer(i) and mode != "full":
                stash[i] += (moe_layer_activation_bytes(a, s // cp, b, tp, pb, sequence_parallel)
                             - dense_mlp_activation_bytes(a, s // cp, b, tp, pb, sequence_parallel))
        logits = 4 * (s // cp) * b * a.vocab_size / tp
        act = {"bytes": sum(stash) + logits, "stash_per_layer": stash, "layers": sum(stash), "logits": logits,
               "source": ("Korthikanti et al. 2022, Table 2, MoE layers with balanced routing (plan_moe)"
                          if a.n_experts else "Korthikanti et al. 2022, Table 2; not a cutp model")
               + (", multi-head latent attention's own (plan.mla)" if a.kv_lora_rank is not None else "")}
    dpg = dp * cp  # the gradients' and ZeRO's group: DP x CP
    st = state_bytes_ep(a, P, moe_layers(a), dtype=dtype, dp=dpg, ep=ep, distributed_optimizer=distributed_optimizer)
    trains = None
    if finetune:  # gradients, masters and moments of the trainable elements; the frozen ones held only
        moe_share = moe_counts(a, tp, ep)["per_rank"] if a.n_experts else 0
        trains = trainable_split(a, config, finetune, tp=tp, ep=ep, params=P, ranks=planned_ranks(tp),
                                 moe_per_rank=moe_share)
        P = trains["params"]
        st = state_bytes_trainable(trains, P, dtype=dtype, dp=dpg, ep=ep, distributed_optimizer=distributed_optimizer)
    zplan = None
    if zero >= 2:  # sharded unit by unit over one replica's ranks (cutp.plan.zero)
        d = dpg // dp_replicate
        st = zero_state_bytes(P, dtype=dtype, d=d, zero=zero)
        if trains is not None:  # (the frozen parameters sharded or whole alike, their state none)
            st = dict(st, **{k: zero_state_bytes(trains["trainable"], dtype=dtype, d=d, zero=zero)[k]
                             for k in ("grads", "optimizer")})
        elif ep > 1 and a.n_experts:  # the experts over a replica's expert-DP x CP ranks (d / ep), apart
            local = moe_counts(a, tp, ep)["per_rank"]
            dense, experts = (zero_state_bytes(n, dtype=dtype, d=k, zero=zero)
                              for n, k in ((P - local, d), (local, d // ep)))
            st = {k: dense[k] + experts[k] for k in dense}
        if config is not None:  # exact: the model's own units (and experts), the largest rank's
            mesh = Mesh(tp, dp, ep=ep, cp=cp)
            planned = dataclasses.replace(config, dtype=dtype)
            zplan = max((zero_plan(planned, tp=tp, dp=dp, cp=cp, ep=ep, rank=mesh.rank_of(r, 0), zero=zero,
                                   accum=accum, reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                                   dp_replicate=dp_replicate, finetune=finetune) for r in planned_ranks(tp)),
                        key=lambda z: sum(z["state"].values()))
            st = dict(zplan["state"], padded=zplan["whole_elements"], shard=zplan["shard_elements"])
            if zero == 3 and a.n_experts:  # (an MoE model's step is planned by formula: its whole units added)
                act["gathered_units"] = zplan["gathered_peak"]
                act["bytes"] += act["gathered_units"]
        elif zero == 3:  # whole units held in the step (the simulated step has them in its peak)
            unit = param_count(a, tp, ep)["layer_per_rank"]
            act["gathered_units"] = gathered_units_bytes(unit, st["padded"], dtype=dtype,
                                                         reshard_after_forward=reshard_after_forward)
            act["bytes"] += act["gathered_units"]
    N = st["padded"]
    gb = 4 if pb == 2 else pb  # (the gradients' itemsize: fp32 main grads of 16-bit models; ZeRO 2/3 shard them)
    bsh = b * (s // cp) * h  # this CP rank's tokens
    tp_calls = (4 * L + 2) * accum if tp > 1 else 0
    tp_elems = bsh * tp_calls
    if tp > 1 and a.kv_lora_rank is not None:  # multi-head latent attention's own (cutp.plan.mla)
        calls, elems = mla_tp_collectives(a, b * (s // cp))
        tp_calls, tp_elems = tp_calls + calls * L * accum, tp_elems + elems * L * accum
    ce_elems = 3 * b * (s // cp) * accum if tp > 1 else 0  # max, then (sum of exps, target logit); +b*s with smoothing
    ce_calls = 2 * accum if tp > 1 else 0

    # each MoE layer: 1 if full recomputation dispatches and combines its rows again in backward;
    # `counted` 1 if the step's counting pass (cutp.train.moe: several micro-batches) does it first
    moe_recomputed = [int(recompute == "full" and i < (L if recompute_layers is None else recompute_layers))
                      for i in range(L) if a.is_moe_layer(i)]
    counted = int(accum > 1 and (a.moe_aux_loss_coeff > 0))
    ring_ar = 2 * (tp - 1) / tp
    # the gradient buffers: at ep > 1 the experts' apart from the rest (cutp.optim.expert_parallel)
    expert_n = moe_layers(a) * (a.n_experts // ep) * moe_counts(a)["expert"] if ep > 1 else 0
    reduced = P  # (the gradients' elements)
    if trains is not None:
        reduced, expert_n = trains["trainable"], trains["experts"] if ep > 1 else 0
    dense_n = state_bytes(reduced - expert_n, dtype=dtype, dp=dpg, distributed_optimizer=distributed_optimizer)["padded"]
    if expert_n:
        expert_n = state_bytes(expert_n, dtype=dtype, dp=dpg // ep, distributed_optimizer=distributed_optimizer)["padded"]
    tp_grads = tp_gradient_elements(a, tp, sequence_parallel, ep)
    if trains is not None and trains["tp_partial"] is not None and tp > 1:  # LoRA: the adapters' summed factors
        tp_grads = trains["tp_partial"]
    out = {
        "arch": a.to_dict(), "tp": tp, "dp": dp, "micro_batch": b, "seq_len": s, "accum": accum, "dtype": dtype,
        "precision": precision, "distributed_optimizer": bool(distributed_optimizer), "device": device, **layout,
        "cp": cp, "cp_comm": cp_comm,
        "cp_exchange": cp_comm_bytes(a, s=s, b=b, tp=tp, cp=cp, cp_comm=cp_comm, layers=L, accum=accum, itemsize=pb,
                                     recomputed=(L if recompute_layers is None else recompute_layers)
                                     if recompute == "full" else 0),
        "params_total": a.num_parameters(), "params_active": a.num_active_parameters(), "ep": ep,
        "ep_all_to_all": coll(sum(5 + 3 * (r + counted) for r in moe_recomputed) * accum if ep > 1 else 0,
                              sum(2 + r + counted for r in moe_recomputed) * accum
                              * all_to_all_elements(a, s // cp, b, tp, ep), pb, (ep - 1) / ep),
        "params_per_gpu": P, "padded_params": N,
        "param_bytes": st["params"], "grad_bytes": st["grads"], "optim_bytes": st["optimizer"],
        "act_bytes": act["bytes"], "activations": act,
        "tp_allreduce_calls_per_layer": 4 if tp > 1 else 0,
        "tp_allreduce_elements_per_layer": 4 * bsh if tp > 1 else 0,
        "tp_allreduce": coll(tp_calls, tp_elems, pb, ring_ar),
        "ce_allreduce": coll(ce_calls, ce_elems, 4, ring_ar),
        # once per step: the gradient norm's [sum of squares, non-finite count] (float64) and the
        # gradients tp_grad_sync sums over TP (the gradients' dtype)
        "tp_grad_allreduce": {**coll((1 + bool(tp_grads)) if tp > 1 else 0, tp_grads + 2 * (tp > 1), gb, ring_ar),
                              "bytes": tp_grads * gb + 16 * (tp > 1),
                              "wire_bytes": (tp_grads * gb + 16 * (tp > 1)) * ring_ar},
        **(_gradient_reduction("dp", dpg, dense_n, gb, pb, distributed_optimizer) if zero < 2 else zero_collectives(
            st["padded"], d=dpg // dp_replicate, replicas=dp_replicate, zero=zero, accum=accum, dtype=dtype,
            units=L + 2, reshard_after_forward=reshard_after_forward,
            counted=None if zplan is None else zplan["comm"], group=_shard_group(cp, dp_replicate))),
        # at ep > 1 the experts' own buffer, over expert-DP (x CP); zero 2/3: their segments, counted
        **(_gradient_reduction("expert_dp", dpg // ep, expert_n, gb, pb, distributed_optimizer) if zplan is None
           else _expert_counted(zplan["comm"], dpg // ep // dp_replicate, dp_replicate, cp)),
    }
    state = st["params"] + st["grads"] + st["optimizer"]
    out["model_state_bytes"] = state
    out["total_bytes"] = state + act["bytes"]
    out["bytes_per_param"] = state / P
    out["table_bytes_per_param"] = table_bytes_per_param(dtype, dpg // dp_replicate, distributed_optimizer, zero)
    out.update(zero=zero, reshard_after_forward=reshard_after_forward, dp_replicate=dp_replicate)
    out["trainable_per_gpu"] = P if trains is None else trains["trainable"]
    out["memory"] = {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"],
                     "activations_peak": act["bytes"], "params_local": P, "stash_per_layer": act["stash_per_layer"]}
    out["fits"] = {name: out["total_bytes"] <= cap for name, cap in GPUS}
    for key in ("init_above_state", "load_above_state"):  # (zero 3's setup: drawn, or read from --init-from)
        out[key] = None if zplan is None else zplan[key]
    return out


def _what_trains(args) -> str:
    spec = f"LoRA rank {args.lora_rank}, alpha {args.lora_alpha or args.lora_rank:g} on {args.lora_targets}" \
        if args.lora_rank is not None else ""
    return "; ".join(w for w in (spec, f"--freeze {args.freeze}" if args.freeze else "") if w)


def model_of_args(args) -> tuple[GPTConfig, GPTConfig | None]:
    """(the model, the same config when it is planned by running cutp's step (--preset), None
    when by formula (--params: architectures cutp does not train as such))."""
    if args.params and args.preset:
        raise ConfigError("give --params or --preset, not both")
    if args.preset:
        c = GPTConfig.preset(args.preset).with_overrides(args.set)
        return c, c
    return pick_arch(args.params or "70B").with_overrides(args.set), None


def run(args) -> Report:
    a, config = model_of_args(args)
    seq = args.seq_len or a.block_size
    r = plan(a, tp=args.tp, dp=args.dp, micro_batch=args.micro_batch, seq_len=seq, accum=args.accum,
             precision=args.precision, dtype=args.dtype, distributed_optimizer=args.distributed_optimizer,
             config=config, device=args.device, threads=args.threads, recompute=args.recompute,
             recompute_layers=args.recompute_layers, sequence_parallel=args.sequence_parallel, ep=args.ep,
             cp=getattr(args, "cp", 1), cp_comm=getattr(args, "cp_comm", "ring"), zero=getattr(args, "zero", 0),
             reshard_after_forward=getattr(args, "reshard_after_forward", True),
             dp_replicate=getattr(args, "dp_replicate", 1),
             overlap_param_gather=getattr(args, "overlap_param_gather", False), finetune=settings_of(args))
    args.cp, args.cp_comm = r["cp"], r["cp_comm"]
    report = Report("plan", {})
    report.extra["plan"] = r
    GB = 1e9
    dt, dist = r["dtype"], r["distributed_optimizer"]
    over = f"dp={args.dp}" if args.cp == 1 else f"dp x cp = {args.dp * args.cp}"
    z = r["zero"]
    optimizer = (f"ZeRO-{z} over {over}" + (f" in {r['dp_replicate']} replicas (HSDP)" if r["dp_replicate"] > 1 else "")
                 + (", gradients" if z == 2 else ", gradients and parameters by unit") if z >= 2 else
                 f"distributed AdamW (ZeRO-1 over {over})" if dist else "AdamW (state on every DP rank)")
    arch = report.table("model", [("k", "model", "", "<"), ("v", "", "", "<")], title=model_name(args))
    for k, v in (("layers x width", f"{a.n_layer} x {a.n_embd}"), ("heads / kv heads", f"{a.n_head} / {a.kv_heads}"),
                 ("mlp", f"{a.hidden}{' (SwiGLU)' if a.mlp == 'swiglu' else ''}"), ("vocab", f"{a.vocab_size:,}"),
                 ("parameters", f"{r['params_total']:,} ({r['params_total'] / 1e9:.2f} B)"
                  + (f", {r['params_active']:,} active per token" if a.n_experts else "")),
                 *([("experts", f"{a.n_experts} of width {a.moe_ffn or a.hidden} in "
                     + ("every layer" if a.moe_every == 1 else f"layers 0, {a.moe_every}, {2 * a.moe_every}, ...")
                     + (f" but {len(a.moe_dense_layers)} dense" if a.moe_dense_layers else "")
                     + (f", {a.moe_shared_experts} shared" if a.moe_shared_experts else "")
                     + f", top {a.moe_top_k}; ep {args.ep}: {a.n_experts // args.ep} per GPU")] if a.n_experts else []),
                 (f"per GPU (tp={args.tp})", f"{r['params_per_gpu']:,}"),
                 *([("trains per GPU", f"{r['trainable_per_gpu']:,} ({_what_trains(args)}); the frozen "
                     f"{r['params_per_gpu'] - r['trainable_per_gpu']:,}: no gradients, masters or moments")]
                   if settings_of(args) else []),
                 ("KV cache / token", f"{a.kv_cache_values_per_token() * ITEMSIZE[dt]:,} bytes ({dt}, all layers"
                  + (", MLA's latent + rope key)" if a.kv_lora_rank is not None else ")")),
                 ("mesh", f"tp {args.tp}" + (f" x cp {args.cp} ({args.cp_comm})" if args.cp > 1 else "")
                  + f" x dp {args.dp} = {args.tp * args.cp * args.dp} GPUs"),
                 ("micro-batch x seq", f"{args.micro_batch} x {seq}, {args.accum} micro-batch(es) per step"),
                 ("dtype, optimizer", f"{dt}, {optimizer}"),
                 ("recompute, SP", f"{args.recompute}"
                  + (f" (first {args.recompute_layers} layers)" if args.recompute_layers else "")
                  + (", sequence parallel" if args.sequence_parallel and args.tp > 1 else ", no sequence parallelism"))):
        arch.add(k=k, v=v)
    mem = report.table("memory", [("what", "per GPU", "", "<"), ("gb", "GB", ",.2f"), ("bpp", "B/param", ".2f"),
                                  ("formula", "how", "", "<")],
                       title="memory per GPU (GB = 1e9 bytes)")
    P, N, pb = r["params_per_gpu"], r["padded_params"], ITEMSIZE[dt]
    low = pb == 2
    T = r["trainable_per_gpu"]
    pad = "" if N == T else f", padded to {N:,}" if T == P else f", the trainable padded to {N:,}"
    shard = f" of a 1/{args.dp * args.cp // r['dp_replicate']} shard" if dist else ""
    sd = "fp64" if dt == "float64" else "fp32"
    whole = "" if z < 3 else f", a 1/{args.dp * args.cp // r['dp_replicate']} shard"
    mem.add(what="parameters", gb=r["param_bytes"] / GB, bpp=r["param_bytes"] / P,
            formula=f"{P:,}{pad} x {pb} B ({dt}){whole}")
    of = "" if T == P else f"the {T:,} trainable "
    mem.add(what="gradients", gb=r["grad_bytes"] / GB, bpp=r["grad_bytes"] / P,
            formula=f"{of}x {4 if low else pb} B ({'fp32 main grads' if low else dt})"
            + (f", a 1/{args.dp * args.cp // r['dp_replicate']} shard" if z >= 2 else ""))
    mem.add(what="optimizer state", gb=r["optim_bytes"] / GB, bpp=r["optim_bytes"] / P,
            formula=f"{of}Adam m, v ({sd}){' + fp32 master' if low else ''}{shard}")
    mem.add(what="activations (peak)", gb=r["act_bytes"] / GB, bpp=None, formula=r["activations"]["source"])
    kept = r["activations"]["stash_per_layer"]
    lo, hi = min(kept), max(kept)
    mem.add(what="kept per layer", gb=hi / GB, bpp=None,
            formula=("each layer" if lo == hi else f"the largest layer ({lo / GB:,.3f} GB the smallest)")
            + " keeps this for backward after its forward")
    mem.add(what="total", gb=r["total_bytes"] / GB, bpp=r["bytes_per_param"],
            formula=f"B/param: state only (table: {r['table_bytes_per_param']:g} + padding)")
    for name, cap in GPUS:
        verdict = "fits" if r["fits"][name] else "does not fit"
        article = "an" if name.startswith("8") else "a"
        mem.notes.append(f"{verdict} {article} {name} GPU: {r['total_bytes'] / GB:,.1f} GB of {cap / GB:,.0f}"
                         + ("" if r["fits"][name] else f" ({(r['total_bytes'] - cap) / GB:,.1f} GB over)"))
    mem.notes.append("the CUDA context, NCCL and cuBLAS workspaces and fragmentation need some GB more")
    if "where" in r["activations"]:
        mem.notes.append(f"activation peak reached in: {r['activations']['where']}")
    if r.get("init_above_state") is not None:
        mem.notes.append(f"setup (zero 3, built unit by unit): at most {r['init_above_state'] / GB:,.3f} GB above the "
                         "state, one unit whole and one parameter drawn (with --init-from, read: "
                         f"{r['load_above_state'] / GB:,.3f} GB)")
    cm = report.table("comm", [("what", "collective per step", "", "<"), ("calls", "calls", ",d"),
                               ("elements", "elements", ",d"), ("gb", "GB buffers", ",.3f"), ("wire", "GB on the wire/GPU", ",.3f"),
                               ("formula", "formula", "", "<")], title="communication per optimizer step and GPU")
    L, bsh = a.n_layer, args.micro_batch * (seq // args.cp) * a.n_embd
    sp = args.sequence_parallel and args.tp > 1
    rows = [("TP all-gather + reduce-scatter (activations; counted as the all-reduces they replace)" if sp
             else "TP all-reduce (activations)", "tp_allreduce",
             f"(4 per layer x {L} + 2) x b*s*h = {bsh:,} elements, x {args.accum} micro-batches"
             + ("; MLA: + 2 a layer, its q_b, kv_b and rope-key input gradients (b*s*(r_q + r_kv + d_rope)) in "
                "place of QKV's b*s*h" if a.kv_lora_rank is not None else "")
             + ("; sequence parallel: each is an all-gather and a reduce-scatter, the same wire bytes" if sp else "")),
            ("TP all-reduce (CE stats)", "ce_allreduce", "max (b*s) + sums (2*b*s; 3*b*s with label smoothing), fp32"),
            ("TP all-reduce (gradients)", "tp_grad_allreduce", "; ".join(
                ["the gradient norm's 2 float64"] + (["the norms, row biases, routers, positions on sequence shards"]
                                                     if sp else []) + (["the experts' (each TP rank's tokens)"]
                                                                       if a.n_experts else [])) + ", once per step")]
    if z >= 2:
        rows += [("DP reduce-scatter (gradients)", "dp_reduce_scatter", "each unit's, in every micro-batch"),
                 ("DP all-gather (parameters)", "dp_all_gather",
                  f"each unit before its forward and backward, {dt}" if z == 3 else f"after the update, {dt}")]
        if r["dp_replicate"] > 1:
            rows += [("HSDP all-reduce (gradient shards)", "dp_replicas_allreduce", "across the replicas, once")]
    elif dist:
        rows += [("DP reduce-scatter (gradients)", "dp_reduce_scatter", "padded gradient buffer, once per step"),
                 ("DP all-gather (parameters)", "dp_all_gather", f"this rank's 1/dp of the padded parameters, {dt}")]
    else:
        rows += [("DP all-reduce (gradients)", "dp_allreduce", "the gradient buffer, once per step")]
    if z >= 2 and r["ep"] > 1 and a.n_experts:
        rows += [("expert-DP reduce-scatter (experts' gradients)", "expert_dp_reduce_scatter",
                  "each MoE layer's experts, in every micro-batch, over dp x cp / ep"),
                 ("expert-DP all-gather (experts)", "expert_dp_all_gather",
                  f"each MoE layer's experts before its forward and backward, {dt}" if z == 3 else
                  f"after the update, {dt}")]
        if r["dp_replicate"] > 1:
            rows += [("HSDP all-reduce (experts' gradient shards)", "expert_dp_replicas_allreduce",
                      "across the replicas, once")]
    elif r["expert_dp_allreduce"]["calls"] + r["expert_dp_reduce_scatter"]["calls"]:
        rows += ([("expert-DP reduce-scatter (experts' gradients)", "expert_dp_reduce_scatter",
                   "the experts' padded gradient buffer, over dp x cp / ep"),
                  ("expert-DP all-gather (experts)", "expert_dp_all_gather", "this rank's 1/(dp cp / ep) of them")]
                 if dist else [("expert-DP all-reduce (experts' gradients)", "expert_dp_allreduce",
                                "the experts' gradient buffer, over dp x cp / ep")])
    if args.cp > 1:
        rows += [(f"CP {'ring send/recv (K,V; dK,dV)' if args.cp_comm == 'ring' else 'all-to-all (q,k,v,o)'}",
                  "cp_exchange", f"per layer: {cp_formula(args.cp_comm)}, x {args.accum} micro-batches "
                  "(cutp.plan.context)")]
    if args.ep > 1:
        rows += [("EP all-to-all (MoE dispatch + combine)", "ep_all_to_all",
                  f"2 per MoE layer and direction (dispatch, combine; +2 recomputed) x k*b*s*h/tp elements (balanced "
                  f"routing; (ep-1)/ep of them leave the rank), x {args.accum} micro-batches; calls include the "
                  "per-expert counts sent before each dispatch (E int64, not in the bytes)")]
    for what, key, formula in rows:
        c = r[key]
        cm.add(what=what, calls=c["calls"], elements=c["elements"], gb=c["bytes"] / GB, wire=c["wire_bytes"] / GB,
               formula=formula)
    cm.notes.append("wire = buffer x 2(n-1)/n (ring all-reduce), (n-1)/n (reduce-scatter), n-1 (all-gather: the buffer "
                    "is this rank's shard)")
    overlap.add_table(report, a, args, param_count)  # with --link-bandwidth
    return report
