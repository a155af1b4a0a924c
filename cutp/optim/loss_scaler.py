"""Loss scaling for float16 training (bfloat16 has float32's exponent range and needs none).

The loss's gradient is multiplied by `scale` before backward, so that small float16 gradients do
not flush to zero; the optimizer divides it out again (folded into AdamW's grad_scale). A step
whose gradients overflowed (inf/NaN anywhere, decided from all-reduced values, so on every rank
alike) is skipped and the scale shrinks; after `growth_interval` clean steps in a row it grows.

DynamicLossScaler follows Megatron-LM's DynamicGradScaler (optimizer/grad_scaler.py), with
DeepSpeed's initial scale 2^16: on an overflow the growth count restarts and the hysteresis
count drops by one; at zero the scale is multiplied by `backoff_factor` (not below `min_scale`).
After `growth_interval` clean steps the scale is multiplied by `growth_factor` and the
hysteresis count is reset. Its state (scale and both counts) goes into checkpoints.
"""
from __future__ import annotations

import math


class LossScaler:
    """A constant scale (1.0: no scaling; `--loss-scale S`: a static scale)."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scale must be a finite number > 0, got {scale}")
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        """Called once per step, after every rank has agreed whether the step overflowed."""

    def state_dict(self) -> dict:
        return {"kind": "static", "scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """The float16 scale that shrinks on overflows and grows after clean runs (module docstring)."""

    dynamic = True

    def __init__(self, initial_scale: float = 2.0 ** 16, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0):
        super().__init__(initial_scale)
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1 and hysteresis >= 1
                and 0 < min_scale <= initial_scale):
            raise ValueError("dynamic loss scaler: need growth_factor > 1, 0 < backoff_factor < 1, "
                             "growth_interval >= 1, hysteresis >= 1 and 0 < min_scale <= initial_scale")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    @property
    def at_floor(self) -> bool:
        return self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"kind": "dynamic", "scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def describe_scaler(state: dict) -> str:
    """A scaler's state_dict in words: "dynamic loss scale (at 65536)", "static loss scale of 128"."""
    if state.get("kind") == "dynamic":
        return f"dynamic loss scale (at {state['scale']:g})"
    return "static loss scale of 1 (no scaling)" if state.get("scale") == 1.0 else \
        f"static loss scale of {state['scale']:g}"
