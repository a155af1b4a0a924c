"""The learning-rate schedule and the clipping factor: pure functions of a step and a norm."""
from __future__ import annotations

import math


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
