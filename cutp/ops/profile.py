"""Where a step's time goes, per op kind: a timing hook on the ops' dispatch, on only while a
benchmark asks for it (`cutp bench model`).

The layers reach every op through the package, ``ops.linear_forward(...)`` (an attribute lookup
on ``cutp.ops`` at each call), so timing them needs no hook in the ops themselves:
:class:`OpTimer` replaces the package's attributes named in :data:`OP_KINDS` with timed wrappers
while it is entered and puts the originals back on exit. Off (not entered), nothing is wrapped and
nothing costs anything. On, a call costs two ``perf_counter`` reads and a dict update (~1 us, a
few hundred calls per step). Calls made by an op to another op (through their modules, not the
package) are part of the outer op; a timed op called inside another timed op is counted once,
in the outer one.

On a GPU the device is synchronised before and after each timed call (``sync``), so the times
are the ops' own, at the price of the overlap between launches: a profiling mode, not a speed.
What no op accounts for (the residual adds, the gradient-norm and zero-grad NumPy calls of the
layers and the optimizer, Python between the ops) is the step's time minus the ops' and the
communication's: :func:`breakdown` reports it as its own kind.
"""
from __future__ import annotations

import functools
import time

# the op kinds of the breakdown, in the order printed; each of cutp.ops' entry points in one
OP_KINDS = {
    "gemm": ("linear_forward", "linear_backward", "gemm", "column_sums"),
    "attention": ("causal_attention_forward", "causal_attention_backward", "flash_attention_forward",
                  "flash_attention_backward", "rotary_forward", "rotary_backward", "softmax_forward",
                  "softmax_backward"),
    "norms": ("layernorm_forward", "layernorm_backward", "rmsnorm_forward", "rmsnorm_backward",
              "residual_rmsnorm_forward"),
    "activations": ("gelu_forward", "gelu_backward", "bias_gelu_forward", "bias_gelu_backward", "swiglu_forward",
                    "swiglu_backward"),
    "cross-entropy": ("cross_entropy_forward", "cross_entropy_backward", "ce_shard_forward", "ce_shard_backward",
                      "ce_rescale_sum"),
    "embedding+dropout": ("embedding_forward", "embedding_backward", "dropout_forward", "dropout_backward",
                          "dropout_forward_rows", "dropout_forward_mask"),
    "optimizer": ("adamw_update",),
}
KIND_OF = {name: kind for kind, names in OP_KINDS.items() for name in names}


class OpTimer:
    """``with OpTimer(cutp.ops) as t: ...`` times every op of :data:`OP_KINDS` called through
    the package: ``t.seconds[kind]``, ``t.calls[kind]``, and per op ``t.by_op[name]`` (seconds;
    reset with :meth:`reset`). ``sync``: a
    callable run before and after each timed call (the GPU's synchronisation; None on the CPU)."""

    def __init__(self, package, sync=None):
        self.package = package
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.by_op: dict[str, float] = {}
        self._saved: dict = {}
        self._depth = 0

    def reset(self):
        self.seconds, self.calls, self.by_op = {}, {}, {}

    def _wrap(self, name, fn):
        kind = KIND_OF[name]

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._depth:  # inside another timed op: that one's time
                return fn(*args, **kwargs)
            self._depth += 1
            try:
                if self.sync is not None:
                    self.sync()
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                if self.sync is not None:
                    self.sync()
                dt = time.perf_counter() - t0
            finally:
                self._depth -= 1
            self.seconds[kind] = self.seconds.get(kind, 0.0) + dt
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.by_op[name] = self.by_op.get(name, 0.0) + dt
            return out

        return timed

    def __enter__(self):
        for name in KIND_OF:
            fn = getattr(self.package, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(self.package, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self.package, name, fn)
        self._saved = {}
        return False


def breakdown(step_s: float, op_seconds: dict, comm_s: float) -> list[tuple[str, float]]:
    """[(kind, seconds)] of one step: the op kinds (in :data:`OP_KINDS`' order), communication,
    and the rest ("outside the ops": Python and the NumPy calls between the ops), which is the
    step minus the others (never below 0: with overlapped communication the parts may exceed it)."""
    rows = [(kind, op_seconds.get(kind, 0.0)) for kind in OP_KINDS]
    rows.append(("communication", comm_s))
    rows.append(("outside the ops", max(0.0, step_s - sum(s for _, s in rows))))
    return rows
