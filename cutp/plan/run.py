"""A cutp training step planned by running it: the library's own model, optimizer and step on one
rank of a mesh made of shape-only arrays (cutp.runtime.shape_only, cutp.comm.shape_only).

    got = planned_step(GPTConfig.preset("gpt2"), tp=4, micro_batch=4, seq_len=1024, device="cuda")
    got["activations_peak"], got["stash_per_layer"], got["parameters"], got["state"]

Nothing here knows the model: the parameters (names, shapes, shardings, weight decay) are the
model's own `Parameter`s, the bytes they and the optimizer state take are those of the arrays
`cutp.optim` allocates, and the activation peak is what `cutp.train.memory.measure_step`
measures of `cutp.train.train_step` (its heap instead of tracemalloc or CuPy's pool): what each
layer caches for backward, each op's outputs and temporaries, in the order and with the
lifetimes the code gives them. A change to a layer changes the plan with it.

What it cannot know it is told: the ops' CPU threads (`threads`), and whether the GPU runs
cutp's kernels (`kernels`). Data-dependent routing (MoE) is not followed: `planned_step` refuses
MoE models (their layers are planned by formula, cutp.plan.moe).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..comm.shape_only import ShapeOnlyContext
from ..data import BatchSampler, Dataset
from ..kernels import use_kernels
from ..models import DTYPES, GPT, GPTConfig
from ..runtime.errors import ConfigError
from ..tensor_parallel.lora import set_up_trainable
from ..train.config import RunConfig
from ..train.memory import measure_step, state_bytes
from ..train.step import StepHooks, assemble_run


ITEMSIZE = {name: np.dtype(t).itemsize for name, t in DTYPES.items()}  # bytes per element of each model dtype


class _Phases(StepHooks):
    """Names the step's phase on the heap, so that the plan says where its peak was reached."""

    def __init__(self, heap):
        self.heap = heap

    def phase(self, name):
        self.heap.label = name or "the step's end"

    def after_forward(self, run, micro):
        self.heap.label = f"after the forward of micro-batch {micro + 1}"


@dataclasses.dataclass(frozen=True)
class PlannedParameter:
    """One of the rank's parameters, as the model declares it."""

    name: str
    shape: tuple
    numel: int
    kind: str  # "sharded" (this rank's own elements), "replicated" (the same on every TP rank) or "partial"
    decays: bool  # AdamW's weight decay applies
    trainable: bool = True  # False: frozen (--freeze, LoRA's base): no gradient, master or optimizer state


def _kind(p) -> str:
    if p.sharding is None:
        return "replicated"
    return "sharded" if p.norm_mask is None else "partial"


def _tokens(vocab_size: int, seq_len: int, batch: int) -> Dataset:
    """Token streams long enough for the sampler: their values do not change what is allocated."""
    n = max(4 * (seq_len + 2), 2 * batch * (seq_len + 1))
    ids = (np.arange(n, dtype=np.int64) % max(1, vocab_size)).astype(np.int64)
    return Dataset(train=ids, val=ids[: seq_len + 2].copy(), vocab_size=vocab_size, description="planned")


def _planned(params) -> list[PlannedParameter]:
    return [PlannedParameter(p.name, tuple(int(d) for d in p.data.shape), int(p.data.size), _kind(p),
                             bool(p.weight_decay), bool(p.trainable)) for p in params]


def planned_parameters(config: GPTConfig, *, tp: int = 1, pp: int = 1, rank: int = 0, pp_layers=None,
                       pp_virtual: int = 1, finetune: dict | None = None) -> list[PlannedParameter]:
    """The parameters world rank `rank` of a tp x pp mesh holds (TP rank rank % tp, pipeline
    stage rank // tp), as the model declares them: the model built on a shape-only context;
    `finetune`: RunConfig's freeze / lora_* settings applied (LoRA's adapters, frozen groups)."""
    ctx = ShapeOnlyContext(tp=tp, dp=1, pp=pp, rank=rank, device="cpu")
    model = GPT(ctx, config, init=False, pp_layers=pp_layers, pp_virtual=pp_virtual)
    if finetune:
        set_up_trainable(model, finetune)
    return _planned(model.parameters())


def planned_step(config: GPTConfig, *, tp: int = 1, dp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, rank: int = 0,
                 micro_batch: int, seq_len: int, accum: int = 1, dtype: str | None = None, device: str = "cuda",
                 threads: int = 1, kernels: bool = True, distributed_optimizer: bool = False,
                 recompute: str = "none", recompute_layers: int | None = None, sequence_parallel: bool = False,
                 pp_layers=None, pp_schedule: str | None = None, pp_virtual: int = 1, cp_comm: str = "ring",
                 zero: int = 0, reshard_after_forward: bool = True, dp_replicate: int = 1,
                 overlap_param_gather: bool = False, finetune: dict | None = None) -> dict:
    """One training step of `config` on world rank `rank` of the mesh tp x cp x dp x pp, planned by
    running it on shape-only arrays. Returns {"activations_peak", "where", "stash_per_layer" (by
    global layer index; 0 for another stage's layers), "parameters" ([PlannedParameter], this
    rank's, in the model's order), "params_local", "state" ({"params", "grads", "optimizer"}
    bytes), "comm" (this step's collectives, `CommCounter.summary()`), "in_flight" (a pipeline
    stage's most micro-batches in flight), "left" (bytes still live after the step, other than
    the state), "seconds"}. `finetune`: RunConfig's freeze / lora_* settings (cutp.train.finetune):
    frozen parameters then count in "params" only (no gradients, masters or optimizer state).
    `overlap_param_gather`: zero 3's prefetch of the next unit (its whole units in the peak)."""
    if config.n_experts:
        raise ConfigError("planned_step does not follow MoE routing (data-dependent shapes); MoE layers are "
                          "planned by formula (cutp.plan.moe)")
    t0 = time.perf_counter()
    model = dataclasses.replace(config, dtype=dtype or config.dtype)
    schedule = pp_schedule or ("interleaved" if pp_virtual > 1 else "1f1b")
    cfg = RunConfig(model=model, device=device, tp=tp, dp=dp, pp=pp, ep=ep, cp=cp, cp_comm=cp_comm,
                    micro_batch_size=micro_batch,
                    batch_size=micro_batch * accum * dp, seq_len=seq_len, steps=2, warmup=0,
                    distributed_optimizer=distributed_optimizer, zero=zero, reshard_after_forward=reshard_after_forward,
                    dp_replicate=dp_replicate, overlap_param_gather=overlap_param_gather, recompute=recompute,
                    recompute_layers=recompute_layers, sequence_parallel=sequence_parallel,
                    pp_layers=None if pp_layers is None else tuple(pp_layers), pp_schedule=schedule,
                    pp_virtual=pp_virtual, eval_every=0, quiet=True, save_on_signal=False, collective_timeout=0,
                    **(finetune or {}))
    ctx = ShapeOnlyContext(tp=tp, dp=dp, pp=pp, ep=ep, cp=cp, rank=rank, device=device, threads=threads)
    dataset = _tokens(model.vocab_size, seq_len, cfg.batch_size)
    sampler = BatchSampler(dataset, seq_len, cfg.batch_size, dp, ctx.dp_rank, micro_batch, seed=cfg.seed)
    with use_kernels(kernels):
        run = assemble_run(cfg, ctx, dataset, sampler, init=False)
        state = state_bytes(run)
        live = ctx.xp.heap.cur
        ctx.counter.reset()
        stats, peak, stash = measure_step(run, _Phases(ctx.xp.heap))
        if stats.skipped:  # the optimizer's update would be missing from the plan
            raise RuntimeError(f"the planned step of {model} was skipped (loss {stats.loss}, grad norm "
                               f"{stats.grad_norm}): a value the shape-only arrays computed is not finite")
        comm = ctx.counter.summary()
    heap = ctx.xp.heap
    params = _planned(run.model.parameters())
    out = {"activations_peak": int(peak), "where": heap.where, "stash_per_layer": [int(b) for b in stash],
           "parameters": params, "params_local": int(run.model.num_parameters_local()), "state": state,
           "comm": comm, "in_flight": getattr(run, "pipeline_in_flight", None), "left": int(heap.cur - live),
           "seconds": time.perf_counter() - t0}
    return out
