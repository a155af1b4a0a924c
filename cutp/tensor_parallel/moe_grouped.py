"""Grouped expert computation: every local expert's rows in one pass, not a loop over experts.

The caller hands the assignments' rows sorted by local expert (`bounds[e]:bounds[e + 1]` are
expert e's, as `moe_dispatch` orders them). Each row goes to its slot of a padded batch
[E, C, h] (C: the most rows any expert got), and the experts' MLPs run as batched matmuls over
the stacked weights [E, h, fc] and [E, F, h]: a fixed number of array operations at any E
(Megatron's GroupedMLP; torchtitan's grouped_mm), memory O(E C h), which is O(n k h) while the
load is balanced. When it is not (E C > 2 n k + E, e.g. a collapsed router), the experts are
grouped by the power of two of their row counts, each group padded to its own most: at most
twice the rows, in at most log2(n k) + 1 passes. Padding rows are zero; their outputs are never
read and their gradients are zero, so they add nothing to the weights' gradients.

Stacked weights: inside a training run the optimizer keeps every parameter in one flat buffer
(cutp.optim.flat), each expert's fc1 then fc2 (then biases), expert after expert, so each of
them is evenly spaced there and the stack is a strided view (`stacked`): no copy, and the
weight gradients are accumulated into the gradient buffer in place. Elsewhere (a model with no
optimizer yet) the stack is a copy and the gradients are added to each expert's own.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..ops.common import as_dtype, compute_dtype
from ..runtime.backend import get_array_module, on_host
from ..runtime.threads import op_threads, parallel_map


def _address(a) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def _root(a):
    while a.base is not None:
        a = a.base
    return a


def stacked(arrays):
    """(one [E, *shape] array of the equally shaped `arrays`, whether it is a view of them): a
    strided view when they lie evenly spaced in one buffer, else a copy."""
    xp = get_array_module(arrays[0])
    first = arrays[0]
    if len(arrays) > 1 and all(a.flags.c_contiguous and a.shape == first.shape and a.dtype == first.dtype
                               for a in arrays):
        root = _root(first)
        addresses = [_address(a) for a in arrays]
        step = addresses[1] - addresses[0]
        if (step >= first.nbytes and step % first.itemsize == 0 and all(_root(a) is root for a in arrays)
                and all(b - a == step for a, b in zip(addresses, addresses[1:]))):
            strided = np.lib.stride_tricks if on_host(xp) else xp.lib.stride_tricks
            return strided.as_strided(first, (len(arrays),) + first.shape, (step,) + first.strides), True
    if len(arrays) == 1:
        return first[None], True
    return xp.stack(arrays), False


def _bmm(a, b, dtype, accumulate=None):
    """a @ b batched, in the compute dtype (float32 for 16-bit), the result in `dtype`; with
    `accumulate` (an array of the result's shape) added into it instead, a part at a time, so that
    no full-size temporary is made (the experts' weight gradients: E x h x 2F). On the host the
    batch is split over the ops' threads, each running single-threaded BLAS: a multi-threaded
    OpenBLAS synchronises its workers on every one of the E small GEMMs (measured on 2 busy cores:
    0.2 GFLOP/s for [32, 1024] x [1024, 512], against 14 for one [4096, 1024] x [1024, 512])."""
    xp = get_array_module(a)
    a, b = as_dtype(a, compute_dtype(a.dtype)), as_dtype(b, compute_dtype(b.dtype))
    if not on_host(xp):
        if accumulate is None:
            return as_dtype(a @ b, dtype)
        accumulate += as_dtype(a @ b, accumulate.dtype)
        return accumulate
    out = np.empty(a.shape[:-1] + b.shape[-1:], dtype) if accumulate is None else accumulate

    def part(sl):
        if accumulate is None:
            out[sl] = a[sl] @ b[sl]
        else:
            out[sl] += a[sl] @ b[sl]

    step = max(1, -(-a.shape[0] // (4 * op_threads())))
    parallel_map(xp, part, [slice(i, i + step) for i in range(0, a.shape[0], step)])
    return out


def groups(counts: np.ndarray) -> list:
    """[(local expert ids, or None for all of them, C)] the passes over the experts (module docstring)."""
    E, n = len(counts), int(counts.sum())
    most = int(counts.max()) if E else 0
    if E * most <= 2 * n + E:
        return [(None, most)] if most else []
    busy = np.nonzero(counts)[0]
    cls = np.ceil(np.log2(counts[busy])).astype(int)
    return [(busy[cls == c], int(counts[busy[cls == c]].max())) for c in np.unique(cls)]


class GroupedExperts:
    """The local experts (ExpertMLP parameter holders, same kind) computed together."""

    def __init__(self, experts):
        self.experts = experts
        self.kind = experts[0].kind
        self.gelu = experts[0].gelu
        self.bias = experts[0].fc1_bias is not None

    def _weights(self, attr):
        return stacked([getattr(e, attr).data for e in self.experts])[0]

    def forward(self, x, bounds):
        """x [m, h]: the rows sorted by local expert (`bounds`, host ints); returns (y [m, h], saved)."""
        xp = get_array_module(x)
        counts = np.diff(np.asarray(bounds, np.int64))
        m, h = x.shape
        y = xp.empty_like(x)
        e_row = np.repeat(np.arange(len(counts)), counts)
        pos = xp.asarray(np.arange(m) - np.asarray(bounds[:-1], np.int64)[e_row])
        e_row = xp.asarray(e_row)
        w1, w2 = self._weights("fc1"), self._weights("fc2")
        b1 = self._weights("fc1_bias") if self.bias else None
        b2 = self._weights("fc2_bias") if self.bias else None
        saved = []
        for ids, C in groups(counts):
            if ids is None:
                sel, slot, g1, g2, gb1, gb2 = slice(None), e_row, w1, w2, b1, b2
            else:
                where = np.full(len(counts), -1)
                where[ids] = np.arange(len(ids))
                member = xp.asarray(where)[e_row]
                sel = xp.nonzero(member >= 0)[0]
                slot = member[sel]
                d_ids = xp.asarray(ids)
                g1, g2 = w1[d_ids], w2[d_ids]
                gb1, gb2 = (None, None) if b1 is None else (b1[d_ids], b2[d_ids])
            p = pos[sel]
            X = xp.zeros((g1.shape[0], C, h), x.dtype)
            X[slot, p] = x[sel]
            H = _bmm(X, g1, x.dtype)
            if gb1 is not None:
                H += gb1[:, None]
            if self.kind == "swiglu":
                A, act = ops.swiglu_forward(H)
            else:
                A, act = ops.gelu_forward(H, approximate=self.gelu)
            Y = _bmm(A, g2, x.dtype)
            if gb2 is not None:
                Y += gb2[:, None]
            y[sel] = Y[slot, p]
            saved.append((ids, sel, slot, p, X, act, A))
        return y, saved

    def backward(self, dy, saved):
        """dy [m, h] of the rows `forward` returned; accumulates the experts' gradients and
        returns dx [m, h]."""
        xp = get_array_module(dy)
        dx = xp.zeros_like(dy)
        w1, w2 = self._weights("fc1"), self._weights("fc2")
        grads = {a: stacked([getattr(e, a).grad for e in self.experts])
                 for a in ("fc1", "fc2") + (("fc1_bias", "fc2_bias") if self.bias else ())}
        for ids, sel, slot, p, X, act, A in saved:
            g1, g2 = (w1, w2) if ids is None else (w1[xp.asarray(ids)], w2[xp.asarray(ids)])
            dY = xp.zeros((g2.shape[0], X.shape[1], dy.shape[1]), dy.dtype)
            dY[slot, p] = dy[sel]
            dA = _bmm(dY, g2.transpose(0, 2, 1), dy.dtype)
            self._add_product(grads, "fc2", ids, A.transpose(0, 2, 1), dY)
            dH = ops.swiglu_backward(dA, act) if self.kind == "swiglu" else ops.gelu_backward(dA, act)
            if self.bias:
                self._add(grads, "fc2_bias", ids, as_dtype(dY.sum(axis=1), grads["fc2_bias"][0].dtype))
                self._add(grads, "fc1_bias", ids, as_dtype(dH.sum(axis=1), grads["fc1_bias"][0].dtype))
            self._add_product(grads, "fc1", ids, X.transpose(0, 2, 1), dH)
            dx[sel] = _bmm(dH, g1.transpose(0, 2, 1), dy.dtype)[slot, p]
        return dx

    def _add_product(self, grads, attr, ids, a, b):
        """a @ b (batched over the group's experts) into their `attr` gradients: in place in the
        gradient buffer when the stack is a view of it and the group is every expert."""
        stack, view = grads[attr]
        if view and ids is None:
            _bmm(a, b, stack.dtype, accumulate=stack)
        else:
            self._add(grads, attr, ids, _bmm(a, b, stack.dtype))

    def _add(self, grads, attr, ids, d):
        """The group's gradients d [G, ...] into experts `ids` (None: all) of attribute `attr`."""
        stack, view = grads[attr]
        xp = get_array_module(d)
        if view:
            if ids is None:
                stack += d
            else:
                stack[xp.asarray(ids)] += d  # (distinct ids: no two updates of one expert)
            return
        for i, e in enumerate(range(len(self.experts)) if ids is None else ids):
            getattr(self.experts[int(e)], attr).grad += d[i]
