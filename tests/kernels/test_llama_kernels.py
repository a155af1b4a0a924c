"""A Llama-family model through the kernels: the array-code path and the emulated kernels agree.

A 2-layer ``llama-tiny`` (RMSNorm, rotary positions in GQA attention, SwiGLU, untied head),
forward and backward with every op the kernels cover routed to them -- RMSNorm, SwiGLU and the
rotary embedding of the Q and K heads in place in the fused QKV buffer, cross-entropy, and (at
head dim 64) the fused attention -- against the same model on the reference ops: the loss and
every gradient within float32's 1e-5 (normwise) and bfloat16's 2e-2. Under the emulator NumPy
arrays stand in for CuPy arrays (the GPU's dispatch rule applied to them, as test_dispatch does).
"""
from __future__ import annotations

import importlib
from collections import Counter

import numpy as np
import pytest
from mpi4py import MPI

import cutp
from cutp import kernels
from cutp.models import GPT, GPTConfig

from .helpers import rng

DISPATCHED = ["cutp.ops.gelu", "cutp.ops.softmax", "cutp.ops.layernorm", "cutp.ops.cross_entropy",
              "cutp.ops.adamw", "cutp.ops.dropout", "cutp.ops.rmsnorm", "cutp.ops.swiglu"]
VIEW_DISPATCHED = {"cutp.ops.rotary": "_kernels_views", "cutp.ops.attention": "_attention_kernels"}


@pytest.fixture
def routed(backend, monkeypatch):
    """The ops dispatching to the backend's kernels; returns a function giving the launches so far."""
    if not backend.emulated:
        before = kernels.launch_counts()
        return lambda: kernels.launch_counts() - before
    emulated = backend.launchers("random", 11)

    def dispatch(*arrays):
        ok = kernels.eligible(arrays, lambda a: isinstance(a, np.ndarray))
        return emulated if ok and kernels.kernels_enabled() else None

    def dispatch_views(*arrays):
        given = [a for a in arrays if a is not None]
        ok = given and all(isinstance(a, np.ndarray) for a in given)
        return emulated if ok and kernels.kernels_enabled() else None

    for name in DISPATCHED:
        monkeypatch.setattr(importlib.import_module(name), "_kernels", dispatch)
    for name, attr in VIEW_DISPATCHED.items():
        monkeypatch.setattr(importlib.import_module(name), attr, dispatch_views)
    monkeypatch.setattr(importlib.import_module("cutp.ops.attention"), "_UNFUSED_WARNED", {"(tests)"})
    return lambda: Counter(emulated.launches)


def _loss_and_grads(ctx, cfg, ids, targets):
    model = GPT(ctx, cfg, seed=5)
    loss = model.forward(ctx.asarray(ids), ctx.asarray(targets))
    model.backward()
    return loss, [ctx.to_numpy(p.grad).astype(np.float64) for p in model.parameters()]


def _normwise(got, want):
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# head dim 16 (llama-tiny's 8 heads of 128 / 8: the attention unfused) and 64 (2 query heads on 1
# KV head: the fused attention too); float32 and bfloat16
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype,heads", [("float32", {}), ("float32", dict(n_head=2, n_kv_head=1)),
                                         ("bfloat16", {})], ids=["f32-hd16", "f32-hd64-gqa2", "bf16-hd16"])
def test_llama_tiny_forward_backward_through_the_kernels(backend, routed, dtype, heads):
    if dtype == "bfloat16":
        backend.require_bf16()
    cfg = GPTConfig.preset("llama-tiny", n_layer=2, block_size=64, dtype=dtype, **heads)
    ctx = cutp.init(comm=MPI.COMM_SELF, tp=1, device=backend.device)
    B, T = 2, 12
    ids = rng(90).integers(0, cfg.vocab_size, (B, T))
    targets = rng(91).integers(0, cfg.vocab_size, (B, T))
    try:
        with kernels.use_kernels(True):
            loss_k, grads_k = _loss_and_grads(ctx, cfg, ids, targets)
        launched = {name.rsplit("_", 1)[0] for name in routed()}
        with kernels.use_kernels(False):
            loss_r, grads_r = _loss_and_grads(ctx, cfg, ids, targets)
    finally:
        ctx.close()
    assert {"rmsnorm_forward", "rmsnorm_backward", "swiglu_forward", "swiglu_backward", "rotary", "ce_shard_forward",
            "ce_shard_backward", "column_sum"} <= launched, launched
    if heads:
        assert {"attention_forward_f32", "attention_backward_dq_f32", "attention_backward_dkdv_f32"} <= launched, launched
    bound = 1e-5 if dtype == "float32" else 2e-2
    assert abs(loss_k - loss_r) <= bound * abs(loss_r), (loss_k, loss_r)
    assert len(grads_k) == len(grads_r) > 10
    errors = [_normwise(gk, gr) for gk, gr in zip(grads_k, grads_r)]
    assert max(errors) <= bound, errors
