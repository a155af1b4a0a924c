"""Every parameter and gradient of a rank in one flat buffer each.

`FlatParameters` moves the parameters into one contiguous buffer of their dtype and the
gradients into one of the gradient dtype, and leaves each Parameter's `data`/`grad` as a view
into them. The optimizer then runs a few fused updates over whole ranges (one CUDA launch per
range on a GPU), and the DP reduction needs no packing.

Layout: the parameters that weight decay applies to first, then the others (each group in the
model's order), so weight decay is one range [0, n_decay) of the buffer, never a mask the size
of the model. With expert parallelism, the expert-parallel parameters (each EP rank's own
experts, reduced over another group) follow as a range of their own, [expert_start, size),
again decayed ones first. The buffers may be padded (zeros, never trained) to a multiple of `pad_to`: the
distributed optimizer splits them into dp equal shards.

Gradient dtype: float32 for bfloat16/float16 parameters (Megatron's `main_grad`: micro-batch
gradients accumulate in float32, and the DP reduction runs in float32), else the parameters'.
"""
from __future__ import annotations

import numpy as np

from ..ops.common import is_low_precision
from ..runtime.backend import get_array_module


def grad_dtype_for(param_dtype) -> np.dtype:
    """float32 for 16-bit parameters (the fp32 main_grad), else the parameters' dtype."""
    return np.dtype(np.float32) if is_low_precision(param_dtype) else np.dtype(param_dtype)


def state_dtype_for(param_dtype) -> np.dtype:
    """The dtype of AdamW's moments and master weights: float64 for float64 models, else float32."""
    return np.dtype(np.float64) if np.dtype(param_dtype) == np.float64 else np.dtype(np.float32)


class FlatParameters:
    """params: a model's parameters (one dtype). pad_to: the buffers' length is a multiple of it."""

    def __init__(self, params, *, pad_to: int = 1):
        if not params:
            raise ValueError("no parameters")
        params = list(params)
        dtypes = {np.dtype(p.data.dtype) for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"FlatParameters needs one dtype, got {sorted(d.name for d in dtypes)}")
        self.dtype = dtypes.pop()
        self.grad_dtype = grad_dtype_for(self.dtype)
        self.model_order = params  # (sums over parameters keep the model's order: same rounding as before)
        # weight-decayed parameters first: decay is the single range [0, n_decay) (then the experts')
        self.params = []
        for expert in (False, True):
            group = [p for p in params if p.expert_parallel == expert]
            self.params += [p for p in group if p.weight_decay] + [p for p in group if not p.weight_decay]
        xp = get_array_module(params[0].data)
        self.size = n = sum(p.data.size for p in self.params)
        self.padded_size = -(-n // pad_to) * pad_to
        self.data = xp.zeros(self.padded_size, self.dtype)
        self.grad = xp.zeros(self.padded_size, self.grad_dtype)
        self.slices = {}
        off = 0
        for p in self.params:
            k = p.data.size
            self.data[off:off + k] = p.data.reshape(-1)
            self.grad[off:off + k] = p.grad.reshape(-1)
            p.data = self.data[off:off + k].reshape(p.data.shape)
            p.grad = self.grad[off:off + k].reshape(p.data.shape)
            self.slices[p.name] = slice(off, off + k)
            off += k
        dense = [p for p in self.params if not p.expert_parallel]
        self.n_decay = sum(p.data.size for p in dense if p.weight_decay)
        self.expert_start = sum(p.data.size for p in dense)  # == size without expert parallelism
        self._segments = [(0, self.n_decay, True), (self.n_decay, self.expert_start, False)]
        if self.expert_start < self.size:
            e_decay = self.expert_start + sum(p.data.size for p in self.params if p.expert_parallel and p.weight_decay)
            self._segments += [(self.expert_start, e_decay, True), (e_decay, self.size, False)]

    def decay_ranges(self, lo: int = 0, hi: int | None = None):
        """[(start, stop, decays)] covering [lo, hi) of the buffer (default: its real part),
        split where weight decay starts or stops applying; empty ranges left out."""
        hi = self.size if hi is None else hi
        cuts = [(max(lo, a), min(hi, b), d) for a, b, d in self._segments]
        return [(a, b, d) for a, b, d in cuts if b > a]

    def zero_grad(self):
        self.grad[...] = 0
