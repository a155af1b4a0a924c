"""What the device-path tests share: the model shapes, the run settings, and the worker that
trains one layout on the NumPy path and on the device path (the CuPy stand-in) and compares.

The ranks run with the stand-in installed (``$CUTP_CUPY_STANDIN=1`` and the shim on PYTHONPATH,
which :func:`run_device` sets): ``device="cpu"`` takes NumPy, ``device="cuda"`` the stand-in's
``cupy``, in one process, on the same data and seed.
"""
from __future__ import annotations

import os

import numpy as np

from tests.mpirun import ROOT, run_mpi

SHIM = os.path.join(ROOT, "tests", "device_path", "shim")

GPT2 = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=61, block_size=16, dropout=0.0, vocab_multiple=1)
LLAMA = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=24, vocab_size=61, block_size=16, dropout=0.0,
             norm="rmsnorm", positions="rope", mlp="swiglu", bias=False, tie_embeddings=False, rope_theta=500.0,
             vocab_multiple=1)
MIXTRAL = dict(LLAMA, n_experts=4, moe_top_k=2, moe_ffn=16, moe_renormalize=True)
FAMILIES = {"gpt2": GPT2, "llama": LLAMA, "mixtral": MIXTRAL}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
OVERLAP = dict(overlap_grad_reduce=True, bucket_size=600, tp_comm_overlap=True, overlap_param_gather=True,
               distributed_optimizer=True)


def device_env(extra: dict | None = None) -> dict:
    env = {"CUTP_CUPY_STANDIN": "1", "PYTHONPATH": SHIM + os.pathsep + ROOT}
    env.update(extra or {})
    return env


def run_device(nprocs: int, target: str, *args, timeout: float = 300, env: dict | None = None, **kw):
    """run_mpi with the stand-in installed in every rank."""
    return run_mpi(nprocs, target, *args, timeout=timeout, env=device_env(env), **kw)


def run_config(family: str, dtype: str, device: str, layout: dict, steps: int = 2, **extra):
    from cutp.models import GPTConfig
    from cutp.train import RunConfig

    model = GPTConfig(**FAMILIES[family], dtype=dtype)
    return RunConfig(model=model, device=device, batch_size=4, micro_batch_size=2, seq_len=8, steps=steps, warmup=1,
                     seed=3, eval_every=0, quiet=True, save_on_signal=False, **layout, **extra)


def train(cfg, comm, steps: int = 2, out: dict | None = None):
    """(losses, grad norms, {name: (gradient, parameter)} as host arrays) after `steps` steps;
    `out`: the run is kept there (key "run") for further use, else closed."""
    import cupy

    from cutp.bench.model import random_tokens
    from cutp.train import build_run, train_step

    run = build_run(cfg, comm, dataset=random_tokens(61, 4096, 0))
    losses, norms = [], []
    for _ in range(steps):
        stats = train_step(run)
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        if cfg.device == "cuda":
            cupy.cuda.Device().synchronize()  # (the comparison below reads every buffer)
            cupy.__standin_mark_step__()
    ctx = run.ctx
    state = {p.name: (ctx.to_numpy(p.grad).astype(np.float64), ctx.to_numpy(p.data).astype(np.float64))
             for p in run.model.parameters()}
    if out is not None:
        out["run"] = run
    else:
        run.close()
    return losses, norms, state


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare(name, cpu, dev, tol):
    (l0, n0, s0), (l1, n1, s1) = cpu, dev
    for i, (a, b) in enumerate(zip(l1, l0)):
        assert abs(a - b) <= tol * abs(b), f"{name}: step {i + 1} loss {a} on the device path, {b} on NumPy's"
    for i, (a, b) in enumerate(zip(n1, n0)):
        assert abs(a - b) <= tol * abs(b), f"{name}: step {i + 1} grad norm {a} on the device path, {b} on NumPy's"
    assert s0.keys() == s1.keys()
    worst = 0.0
    for k in s0:
        g = rel(s1[k][0], s0[k][0])
        assert g <= tol, f"{name}: gradient of {k} differs by {g:.2e} (normwise) between the device path and NumPy's"
        worst = max(worst, g)
        # AdamW divides by sqrt(v): a gradient element near 0 turns a tiny difference into a visible
        # one in its update, so the parameters get 100 x the gradients' tolerance
        w = rel(s1[k][1], s0[k][1])
        assert w <= 100 * tol, f"{name}: parameter {k} differs by {w:.2e} after the steps"
    return worst


def worker_compare(cases):
    """cases: [(family, dtype, layout, extra)]; each trained on both paths and compared."""
    from mpi4py import MPI

    for family, dtype, layout, extra in cases:
        name = f"{family} {dtype} {layout} {sorted(extra)}"
        cpu = train(run_config(family, dtype, "cpu", layout, **extra), MPI.COMM_WORLD)
        dev = train(run_config(family, dtype, "cuda", layout, **extra), MPI.COMM_WORLD)
        worst = compare(name, cpu, dev, TOLERANCE[dtype])
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"device path = NumPy path: {name}: losses {dev[0]}, largest gradient difference {worst:.1e}")
