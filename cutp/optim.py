"""AdamW over flat parameter buffers, gradient clipping and the learning-rate schedule.

`FlatParameters` moves every parameter (and its gradient) of one dtype into one contiguous
buffer and leaves each Parameter's `data`/`grad` as a view into it. The optimizer then runs one
fused update over the whole model (one CUDA kernel launch on a GPU, a few cache-sized passes on
the CPU), and the DP gradient all-reduce needs no packing.
"""
from __future__ import annotations

import math

import numpy as np

from . import ops
from .runtime.backend import get_array_module


class FlatParameters:
    def __init__(self, params):
        if not params:
            raise ValueError("no parameters")
        self.params = list(params)
        dtypes = {np.dtype(p.data.dtype) for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"FlatParameters needs one dtype, got {sorted(d.name for d in dtypes)}")
        self.dtype = dtypes.pop()
        xp = get_array_module(self.params[0].data)
        n = sum(p.data.size for p in self.params)
        self.data = xp.empty(n, self.dtype)
        self.grad = xp.zeros(n, self.dtype)
        self.decay_mask = xp.zeros(n, self.dtype)
        self.slices = {}
        off = 0
        for p in self.params:
            k = p.data.size
            self.data[off:off + k] = p.data.reshape(-1)
            self.grad[off:off + k] = p.grad.reshape(-1)
            if p.weight_decay:
                self.decay_mask[off:off + k] = 1
            p.data = self.data[off:off + k].reshape(p.data.shape)
            p.grad = self.grad[off:off + k].reshape(p.grad.shape)
            self.slices[p.name] = slice(off, off + k)
            off += k

    def zero_grad(self):
        self.grad[...] = 0

    @property
    def size(self) -> int:
        return int(self.data.size)


class AdamW:
    """AdamW with decoupled weight decay (PyTorch's formulation), decay only where
    Parameter.weight_decay (weights of linear layers; not biases, LayerNorm or embeddings)."""

    def __init__(self, flat: FlatParameters, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        self.flat = flat
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        xp = get_array_module(flat.data)
        state_dtype = np.float64 if flat.dtype == np.float64 else np.float32
        self.m = xp.zeros(flat.size, state_dtype)
        self.v = xp.zeros(flat.size, state_dtype)
        self.step_count = 0

    def step(self, lr=None, grad_scale=1.0):
        self.step_count += 1
        ops.adamw_update(self.flat.data, self.flat.grad, self.m, self.v, self.flat.decay_mask,
                         lr=self.lr if lr is None else lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                         weight_decay=self.weight_decay, step=self.step_count, grad_scale=grad_scale)

    # ---- state: per parameter, so checkpoints can be resharded like the parameters ---------
    def state_dict(self) -> dict:
        out = {}
        for p in self.flat.params:
            s, name, shape = self.flat.slices[p.name], p.name, p.data.shape
            out[f"exp_avg.{name}"] = self.m[s].reshape(shape)
            out[f"exp_avg_sq.{name}"] = self.v[s].reshape(shape)
        return out

    def hyperparameters(self) -> dict:
        return {"step": self.step_count, "lr": self.lr, "betas": [self.beta1, self.beta2], "eps": self.eps,
                "weight_decay": self.weight_decay}

    def load_state(self, tensors: dict, step: int) -> None:
        for name, s in self.flat.slices.items():
            for key, buf in ((f"exp_avg.{name}", self.m), (f"exp_avg_sq.{name}", self.v)):
                if key not in tensors:
                    raise ValueError(f"optimizer state is missing {key}")
                a = tensors[key]
                if a.size != s.stop - s.start:
                    raise ValueError(f"optimizer state {key} has {a.size} elements, expected {s.stop - s.start}")
                buf[s] = a.reshape(-1)
        self.step_count = int(step)


def clip_scale(grad_norm: float, max_norm: float | None) -> float:
    """Factor that brings the global gradient norm down to max_norm (1.0 if already below)."""
    if not max_norm or max_norm <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))


def lr_schedule(step: int, max_lr: float, warmup: int, total: int, min_lr: float | None = None) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_lr (default max_lr/10) at `total`.

    `step` counts from 0 (the first optimizer step uses lr_schedule(0, ...)).
    """
    min_lr = max_lr * 0.1 if min_lr is None else min_lr
    if warmup > 0 and step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)
