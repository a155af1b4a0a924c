"""What the device-path tests share: the model shapes, the run settings, and the worker that
trains one layout on the NumPy path and on the device path (the CuPy stand-in) and compares.

The ranks run with the stand-in installed (``$CUTP_CUPY_STANDIN=1`` and the shim on PYTHONPATH,
which :func:`run_device` sets): ``device="cpu"`` takes NumPy, ``device="cuda"`` the stand-in's
``cupy``, in one process, on the same data and seed.
"""
from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager

import numpy as np

from tests.mpirun import ROOT, run_mpi

SHIM = os.path.join(ROOT, "tests", "device_path", "shim")
# $CUTP_DEVICE_PATH=gpu (make gpu-check, on a lent GPU): the same tests on the real CuPy and GPU,
# the stand-in not installed; its own counters (kernel launches, host syncs, races) are then absent
ON_GPU = os.environ.get("CUTP_DEVICE_PATH", "standin") == "gpu"
# $CUTP_DEVICE_PATH_FIGURES: a JSON-lines file rank 0 appends each case's figures to
# (tools/device_path_check.py compares a stand-in run's with a GPU run's)
FIGURES = "CUTP_DEVICE_PATH_FIGURES"

GPT2 = dict(n_layer=2, n_head=2, n_embd=128, vocab_size=61, block_size=16, dropout=0.0, vocab_multiple=1)
LLAMA = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=256, mlp_hidden=64, vocab_size=61, block_size=16, dropout=0.0,
             norm="rmsnorm", positions="rope", mlp="swiglu", bias=False, tie_embeddings=False, rope_theta=500.0,
             vocab_multiple=1)
MIXTRAL = dict(LLAMA, n_experts=4, moe_top_k=2, moe_ffn=16, moe_renormalize=True)
# Gemma 3's block (the (1 + w) norms, GeGLU, QK-norm, two ropes, the scaled embedding, the logits
# soft-capped): its 16-bit norms take the array path (their scale, 1 + w, is float32)
GEMMA = dict(LLAMA, mlp="geglu", norm_offset=True, embed_scale=True, post_norms=True, qk_norm=True,
             query_pre_attn_scalar=48.0, final_softcap=5.0, rope_local_theta=50.0, tie_embeddings=True,
             layer_types=("sliding_attention", "full_attention"), sliding_window=16)
QWEN3 = dict(LLAMA, qk_norm=True, head_dim=32)  # the QK-norm kernels at head-dim rows; head_dim != n_embd / n_head
# local layers (a window shorter than the sequence) and soft-capped scores: the fused kernels' mask
WINDOWED = dict(LLAMA, sliding_window=5, layer_types=("sliding_attention", "full_attention"), attn_softcap=20.0)
# DeepSeek-V3's block (deepseek-tiny's shapes, two layers): MLA (low-rank Q and KV, the decoupled
# rope head, v head dim != q/k's), layer 0 dense, layer 1 one shared + 8 routed experts in 4 groups
# (2 kept), sigmoid scores with the correction bias, run by the grouped pass
DEEPSEEK = dict(LLAMA, n_kv_head=None, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_experts=8, moe_top_k=2, moe_ffn=16, moe_n_group=4, moe_topk_group=2,
                moe_dense_layers=(0,), moe_renormalize=True, moe_scoring="sigmoid", moe_score_bias=True,
                moe_aux_loss_coeff=0.0, moe_routed_scaling=2.5, moe_shared_experts=1, family="deepseek_v3")
FAMILIES = {"gpt2": GPT2, "llama": LLAMA, "mixtral": MIXTRAL, "qwen3": QWEN3, "gemma": GEMMA, "windowed": WINDOWED,
            "deepseek": DEEPSEEK}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
OVERLAP = dict(overlap_grad_reduce=True, bucket_size=600, tp_comm_overlap=True, overlap_param_gather=True,
               distributed_optimizer=True)
# ZeRO-3 with its overlap: each unit gathered before its forward and again before its backward
# (resharded after the forward), the next step's gathers during the forward, the gradient shards'
# reduce-scatters during the backward
ZERO3 = dict(zero=3, reshard_after_forward=True, overlap_param_gather=True, overlap_grad_reduce=True)


def device_env(extra: dict | None = None) -> dict:
    env = {"CUTP_CUPY_STANDIN": "0" if ON_GPU else "1",
           "PYTHONPATH": os.pathsep.join(p for p in (SHIM, ROOT, os.environ.get("PYTHONPATH", "")) if p)}
    env.update(extra or {})
    return env


def record(case: str, **figures) -> None:
    """Appends {"case": case, **figures} to $CUTP_DEVICE_PATH_FIGURES (when set)."""
    import json

    path = os.environ.get(FIGURES)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(case=case, **figures)) + "\n")


def run_device(nprocs: int, target: str, *args, timeout: float = 300, env: dict | None = None, **kw):
    """run_mpi with the stand-in installed in every rank."""
    return run_mpi(nprocs, target, *args, timeout=timeout, env=device_env(env), **kw)


def run_config(family: str, dtype: str, device: str, layout: dict, steps: int = 2, **extra):
    from cutp.models import GPTConfig
    from cutp.train import RunConfig

    extra = dict(dict(micro_batch_size=2), **extra)
    model = GPTConfig(**dict(FAMILIES[family], dropout=extra.pop("dropout", 0.0)), dtype=dtype)
    return RunConfig(model=model, device=device, batch_size=4, seq_len=8, steps=steps, warmup=1,
                     seed=3, eval_every=0, quiet=True, save_on_signal=False, **layout, **extra)


def train(cfg, comm, steps: int = 2, out: dict | None = None):
    """(losses, grad norms, {name: (gradient after the first step, parameter after the last)} as
    host float64 arrays); `out`: the run is kept there (key "run") for further use, else closed.
    The first step's gradients are compared: from the second step on, AdamW has amplified the
    paths' rounding differences in the parameters (it divides by sqrt(v)) and the gradients
    follow them."""
    import cupy

    from cutp.train import build_run, train_step
    from tests.device_path.standin.tracking import SYNCS

    standin = cfg.device == "cuda" and not ON_GPU
    run = build_run(cfg, comm, dataset=dataset(cfg))
    ctx = run.ctx
    losses, norms, grads = [], [], None
    for _ in range(steps):
        stats = train_step(run)
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        if standin:
            cupy.__standin_mark_step__()
            SYNCS.paused = True  # (this test's own reads are no part of the step)
        if cfg.device == "cuda":
            cupy.cuda.Device().synchronize()  # (the comparison below reads every buffer)
        if grads is None:
            grads = rank_grads(run)
        SYNCS.paused = False
    run.gather_params()  # (--overlap-param-gather: the last update's broadcasts come with the next forward)
    state = {p.name: (grads.get(p.name), ctx.to_numpy(p.data).astype(np.float64)) for p in run.model.parameters()}
    if out is not None:
        out["run"] = run
    else:
        run.close()
    return losses, norms, state


def dataset(cfg):
    """Random tokens; with `pack`, in documents of 1 to seq_len tokens (packed rows: the
    attention's document mask and the positions restarting at each document)."""
    from cutp.bench.model import random_tokens

    data = random_tokens(61, 4096, 0)
    if cfg.pack:
        lengths = np.random.default_rng(1).integers(1, cfg.seq_len + 1, 4096)
        lengths = lengths[:np.searchsorted(np.cumsum(lengths), 4096, side="right")]
        data.doc_lengths = {"train": lengths, "val": lengths}
    return data


def rank_grads(run) -> dict:
    """This rank's gradients, as host float64: the parameters' own, or under ZeRO 2/3 (where the
    parameters hold none) the part of each reduced gradient the rank's optimizer shard owns; none
    for a frozen parameter (LoRA's base)."""
    from cutp.optim import ShardedAdamW

    opt = run.optimizer
    return {p.name: run.ctx.to_numpy(opt.owned_grad(p.name) if isinstance(opt, ShardedAdamW) else p.grad)
            .astype(np.float64) for p in run.model.parameters() if p.trainable}


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare(name, cpu, dev, tol):
    (l0, n0, s0), (l1, n1, s1) = cpu, dev
    for i, (a, b) in enumerate(zip(l1, l0)):
        assert abs(a - b) <= tol * abs(b), f"{name}: step {i + 1} loss {a} on the device path, {b} on NumPy's"
    assert abs(n1[0] - n0[0]) <= tol * abs(n0[0]), f"{name}: step 1 grad norm {n1[0]} on the device path, {n0[0]} on NumPy's"
    assert s0.keys() == s1.keys()
    assert [k for k in s0 if s0[k][0] is None] == [k for k in s1 if s1[k][0] is None], f"{name}: the frozen parameters"
    assert any(s0[k][0] is not None for k in s0), f"{name}: nothing trains"
    worst = 0.0
    for k in (k for k in s0 if s0[k][0] is not None):
        g = rel(s1[k][0], s0[k][0])
        assert g <= tol, f"{name}: step 1 gradient of {k} differs by {g:.2e} (normwise) between the device path and NumPy's"
        worst = max(worst, g)
    # the parameters after the steps, all together: AdamW moves every entry by about lr whatever its
    # gradient, so an entry whose gradient is near 0 (a zero-initialised bias) may move either way on
    # the two paths; over the whole model that stays within 100 x the gradients' tolerance
    diff = sum(float(np.sum((s1[k][1] - s0[k][1]) ** 2)) for k in s0) ** 0.5
    norm = sum(float(np.sum(s0[k][1] ** 2)) for k in s0) ** 0.5
    assert diff <= 100 * tol * norm, f"{name}: the parameters differ by {diff / norm:.2e} (normwise) after the steps"
    return worst


@contextmanager
def _counting_fused_documents():
    """[n]: how many fused attention forwards got a document mask (packed rows) meanwhile."""
    from cutp.ops import attention

    seen, real = [], attention._fused_mask

    def counting(xp, window, softcap, q_first, k_first, documents):
        if documents is not None:
            seen.append(1)
        return real(xp, window, softcap, q_first, k_first, documents)

    attention._fused_mask = counting
    try:
        yield seen
    finally:
        attention._fused_mask = real


def worker_compare(cases):
    """cases: [(family, dtype, layout, extra)]; each trained on both paths and compared."""
    from mpi4py import MPI

    for family, dtype, layout, extra in cases:
        name = f"{family} {dtype} {layout} {sorted(extra)}"
        cpu = train(run_config(family, dtype, "cpu", layout, **extra), MPI.COMM_WORLD)
        from tests.device_path.standin.tracking import CALLS

        CALLS.clear()
        with _counting_fused_documents() as documents:
            dev = train(run_config(family, dtype, "cuda", layout, **extra), MPI.COMM_WORLD)
        assert not extra.get("pack") or documents, f"{name}: packed rows never reached the fused attention kernels"
        kernels = sum(v for k, v in CALLS.items() if k.startswith("kernel "))
        counts = {} if ON_GPU else dict(kernel_launches=kernels, gemms=CALLS["cublas gemmEx"],
                                        nccl_calls=sum(v for k, v in CALLS.items() if k.startswith("nccl")))
        assert ON_GPU or (kernels and CALLS["cublas gemmEx"]), f"{name}: the device path ran no kernels or GEMMs: {dict(CALLS)}"
        worst = compare(name, cpu, dev, TOLERANCE[dtype])
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"device path = NumPy path: {name}: losses {dev[0]}, largest gradient difference {worst:.1e}; "
                  + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items()))
            record(name, losses=dev[0], numpy_losses=cpu[0], grad_norm=dev[1][0], largest_gradient_difference=worst,
                   **counts)


# ---- planted bugs: each must make the device path fail, naming the place ---------------------
def _plant_missing_event_wait():
    """NcclRequest.wait without `compute.wait_event(done)`: the compute stream reads a bucket's
    reduction (or a parameter broadcast) that the communication stream may still be writing."""
    from cutp.comm import nccl

    def wait(self):
        self._keep = None
        return self.result

    nccl.NcclRequest.wait = wait


def _plant_wrong_leading_dimension():
    """gemm's lda/ldb one element too long."""
    import importlib

    gemm = importlib.import_module("cutp.ops.gemm")
    right = gemm.leading_dimension
    gemm.leading_dimension = lambda x: right(x) + 1


def _plant_missing_group_end():
    """The exchange's NCCL group never ended."""
    import types

    from cutp.comm import nccl

    real = nccl.NcclCommunicator._group(None)
    nccl.NcclCommunicator._group = lambda self: types.SimpleNamespace(groupStart=real.groupStart,
                                                                     groupEnd=lambda: None)


PLANTS = {"missing event wait": _plant_missing_event_wait, "wrong leading dimension": _plant_wrong_leading_dimension,
          "missing group end": _plant_missing_group_end}


def worker_planted(plant, case):
    """Trains `case` on the device path with the bug `plant` planted (expected to fail)."""
    from mpi4py import MPI

    family, dtype, layout, extra = case
    PLANTS[plant]()
    train(run_config(family, dtype, "cuda", layout, **extra), MPI.COMM_WORLD)


def _host_params(run) -> dict:
    run.gather_params()
    return {p.name: run.ctx.to_numpy(p.data).copy() for p in run.model.parameters()}


def _same_bits(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), f"{what}: {k}"


def _tensors(directory: str) -> dict:
    """Every tensor of every safetensors file under `directory`, by (file, name)."""
    import glob

    from safetensors.numpy import load_file

    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "**", "*.safetensors"), recursive=True)):
        for k, v in load_file(path).items():
            out[(os.path.relpath(path, directory), k)] = v
    return out


def worker_checkpoint(tmp, family, dtype, layout=None, extra=None):
    """A checkpoint saved on the device path loads on the NumPy path bit for bit, and the NumPy
    path's save of it loads on the device path bit for bit; the files hold the same tensors
    (at `layout` with `extra` settings: tp 2 by default)."""
    from mpi4py import MPI

    from cutp.bench.model import random_tokens
    from cutp.train import build_run, save, train_step

    comm, data = MPI.COMM_WORLD, random_tokens(61, 4096, 0)
    dev_dir, cpu_dir = os.path.join(tmp, "device"), os.path.join(tmp, "cpu")
    layout, extra = layout or {"tp": 2}, extra or {}
    run = build_run(run_config(family, dtype, "cuda", layout, out=dev_dir, **extra), comm, dataset=data)
    for _ in range(2):
        train_step(run)
    saved = save(run)
    dev = _host_params(run)
    run.close()
    run = build_run(run_config(family, dtype, "cpu", layout, resume=saved, resumed_step=2, out=cpu_dir, overwrite=True,
                               **extra), comm, dataset=data)
    _same_bits(_host_params(run), dev, "device checkpoint loaded on the CPU")
    run.last_saved = None
    saved_cpu = save(run)
    run.close()
    run = build_run(run_config(family, dtype, "cuda", layout, resume=saved_cpu, resumed_step=2, **extra), comm,
                    dataset=data)
    _same_bits(_host_params(run), dev, "the CPU's checkpoint loaded back on the device")
    run.close()
    comm.Barrier()
    if comm.Get_rank() == 0:
        a, b = _tensors(saved), _tensors(saved_cpu)
        assert a.keys() == b.keys() and a, (sorted(a)[:4], sorted(b)[:4])
        _same_bits({str(k): v for k, v in a.items()}, {str(k): v for k, v in b.items()}, "checkpoint files")
        print(f"checkpoint: {len(a)} tensors saved on the device path, loaded on the CPU, saved again: same bits")


def worker_generate(family, dtype):
    """Greedy and seeded generation with the sharded KV cache: the device path draws the NumPy
    path's tokens (and the cache the uncached forward's)."""
    from mpi4py import MPI

    from cutp.generate import generate

    tokens = {}
    for device in ("cpu", "cuda"):
        out: dict = {}
        train(run_config(family, dtype, device, {"tp": 2}), MPI.COMM_WORLD, out=out)
        model = out["run"].model
        greedy = generate(model, [[1, 2, 3], [4, 5, 6]], 6, temperature=0)
        sampled = generate(model, [7, 8], 6, seed=5, top_k=10)
        uncached = generate(model, [7, 8], 6, seed=5, top_k=10, use_cache=False)
        assert sampled == uncached, (device, sampled, uncached)
        tokens[device] = (greedy, sampled)
        out["run"].close()
    assert tokens["cuda"] == tokens["cpu"], tokens


# ---- host synchronizations per training step ---------------------------------------------------
# Every host synchronization a training step makes on the device path, by where it happens (line
# numbers dropped), with the reason; a new one fails test_host_syncs_per_step_are_the_known_ones.
KNOWN_SYNCS = {
    "cutp/comm/context.py in synchronize (from cutp/train/step.py in train_step)":
        "the end of the step: train_step waits for the device before it returns (its time)",
    "cutp/train/step.py in train_step": "the loss: the micro-batches' losses summed on the device "
        "(VocabParallelCrossEntropy.defer_loss), read once, after the gradient norm",
    "cutp/runtime/backend.py in to_numpy (from cutp/tensor_parallel/grads.py in global_grad_norm)":
        "the gradient norm: its sum of squares and non-finite count, one read of the pair",
    "cutp/runtime/backend.py in to_numpy (from cutp/optim/adamw.py in finish_norm)":
        "the gradient norm under the distributed optimizer (and ZeRO 2/3): one read of the pair, as above",
    "cutp/runtime/backend.py in to_numpy (from cutp/tensor_parallel/moe_stats.py in read_pending)":
        "MoE: the routing statistics (losses, assignments, drops) of every MoE layer and forward of the step, one "
        "read per step, after the loss (cutp/tensor_parallel/moe_stats.py)",
    "cutp/runtime/backend.py in to_numpy (from cutp/tensor_parallel/moe_stats.py in finish_counting)":
        "MoE with several micro-batches: the counting pass's tallies of every MoE layer, one read per step",
    "cutp/runtime/backend.py in to_numpy (from cutp/tensor_parallel/moe_dispatch.py in dispatch)":
        "expert parallelism: the sent and received row counts of the all-to-all (they size its buffers), one read",
    "cutp/runtime/backend.py in to_numpy (from cutp/tensor_parallel/moe.py in _experts_forward)":
        "MoE without expert parallelism: each expert's row count (they bound the grouped pass's GEMMs), one read",
}
# read at most once per step: all but the row counts (once per MoE layer and forward: the all-to-all's
# at ep > 1, the grouped pass's at ep 1);
# a step without MoE layers reads only the loss, the norm and the step's end
ONCE_PER_STEP = [k for k in KNOWN_SYNCS if "moe_dispatch" not in k and "_experts_forward" not in k]
DENSE = [k for k in KNOWN_SYNCS if "moe" not in k]


def sync_key(place: str) -> str:
    import re

    return re.sub(r":\d+ in ", " in ", place)


def worker_syncs(cases):
    """The host synchronizations of each case's second step on the device path (rank 0 prints
    the table); each one's place must be in KNOWN_SYNCS."""
    from mpi4py import MPI

    from tests.device_path.standin import tracking

    for family, dtype, layout, extra in cases:
        train(run_config(family, dtype, "cuda", layout, steps=2, **extra), MPI.COMM_WORLD)
        step = tracking.SYNCS.steps[-1]
        unknown = [(r, p) for (r, p) in step if sync_key(p) not in KNOWN_SYNCS]
        assert not unknown, f"{family} {layout}: host synchronizations not in KNOWN_SYNCS: {unknown}"
        assert step, "no host synchronization counted: the step's loss and norm must reach the host"
        per_place = Counter()
        for (_, where), n in step.items():
            per_place[sync_key(where)] += n
        assert max(per_place[k] for k in ONCE_PER_STEP) == 1, \
            f"{family} {layout}: a read meant to happen once per step happened more often: {per_place}"
        if not FAMILIES[family].get("n_experts"):
            assert set(per_place) <= set(DENSE), \
                f"{family} {layout}: a step without MoE reads the host more than the loss and the norm once: {per_place}"
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"host syncs of one step, {family} {dtype} {layout} {sorted(extra)}, rank 0: {sum(step.values())}")
            record(f"host syncs {family} {dtype} {layout} {sorted(extra)}", host_syncs_rank0=sum(step.values()))
            for (reason, where), n in sorted(step.items(), key=lambda kv: kv[0][1]):
                print(f"  {n} x {reason} at {where}")


def worker_train(cases):
    """Each case trained two steps on the device path, nothing compared: a test reads what ran
    from the stand-in's report ($CUTP_STANDIN_REPORT)."""
    from mpi4py import MPI

    for family, dtype, layout, extra in cases:
        train(run_config(family, dtype, "cuda", layout, steps=2, **extra), MPI.COMM_WORLD)
