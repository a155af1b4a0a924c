"""Launchers of ``kernels/cross_entropy.cu``: the local pieces of the vocab-parallel cross-entropy.

Each rank holds a shard of the logits' vocabulary; these kernels compute, in one pass, its row
max and softmax statistics and, in a second pass in place over the logits, its gradient (the
collectives between them are ``cutp.ops.cross_entropy``'s). One op, four places:

* CUDA source: ``kernels/cross_entropy.cu``;
* these launchers (argument checks, launch shapes);
* NumPy/CuPy reference: ``cutp/ops/cross_entropy.py`` (``ce_shard_forward``,
  ``ce_shard_backward``), which calls these launchers through ``cutp.kernels.dispatch``;
* tests: ``tests/kernels/test_cross_entropy.py``; benchmark cases ``ce_fwd`` and
  ``ce_bwd_fused`` of ``python -m cutp bench kernels`` (declared below, with the family).
"""
from __future__ import annotations

import numpy as np

from .family import BenchCase, KernelFamily, Target, Traffic
from .runtime import (
    WARP,
    KernelArgumentError,
    LauncherBase,
    ceil_div,
    check_array,
    clamp,
    dtype_suffix,
    elements_per_128bit,
    int32_arg,
    round_up,
    row_vector,
)


class CrossEntropyLaunchers(LauncherBase):
    """ce_shard_forward, ce_shard_backward."""

    def _logits_2d(self, logits, n_valid: int):
        xp = self.xp
        check_array(xp, "logits", logits, float_data=True)
        if logits.ndim < 1:
            raise KernelArgumentError("logits must have a last (vocabulary) axis")
        W = logits.shape[-1]
        if not 0 <= int(n_valid) <= W:
            raise ValueError(f"n_valid={n_valid} outside [0, {W}]")
        return logits.reshape(-1, W) if logits.ndim != 2 else logits, W

    def _row_block(self, width: int, dtype) -> int:
        """Threads of a block-per-row kernel over `width` columns: ~4 chunks per thread, 32..1024."""
        return clamp(round_up(ceil_div(max(width, 1), elements_per_128bit(dtype) * 4), WARP), WARP, 1024)

    def ce_shard_forward(self, logits, local_targets, n_valid: int, need_sum_logits: bool = True):
        """(row_max, sum_exp, target_logit, sum_logits), float32 [N] each (sum_logits None unless
        need_sum_logits), in one pass over the logits [..., W]: per row the max over the first
        n_valid columns (-inf when n_valid is 0), the sum of exp(logit - that max) (0 then), the
        logit at local_targets[i] (0 where it is -1 or outside the shard) and the sum of the
        logits. local_targets: integer [N] (any shape with N elements). One block per row: an
        online softmax per thread, merged over the block."""
        xp = self.xp
        L, W = self._logits_2d(logits, n_valid)
        N = L.shape[0]
        targets = row_vector(xp, "local_targets", local_targets, N, np.int64, "i")
        row_max = xp.empty(N, dtype=np.float32)
        sum_exp = xp.empty(N, dtype=np.float32)
        target_logit = xp.empty(N, dtype=np.float32)
        sum_logits = xp.empty(N, dtype=np.float32) if need_sum_logits else None
        self._launch("cross_entropy", f"ce_shard_forward_{dtype_suffix(L.dtype)}", (N,),
                     (self._row_block(n_valid, L.dtype),),
                     (row_max, sum_exp, target_logit, sum_logits, L, targets, np.int64(N), int32_arg("W", W),
                      int32_arg("n_valid", int(n_valid))))
        return row_max, sum_exp, target_logit, sum_logits

    def ce_shard_backward(self, logits, row_max, sum_exp, local_targets, n_valid: int, row_scale,
                          label_smoothing: float = 0.0, n_classes=None, out=None):
        """The gradient of the cross-entropy w.r.t. a logits shard (cutp.ops.ce_shard_backward):
        row_scale * (softmax - (1 - eps) onehot - eps / n_classes) over the valid columns, 0 on
        padded columns and on rows with row_scale 0. Written into `out` (a new array in logits'
        dtype when None; out=logits works in place) and returned. row_scale: float with N
        elements or one (broadcast). One block per row, streaming 128-bit loads and stores."""
        xp = self.xp
        eps = float(label_smoothing)
        if eps != 0.0 and not n_classes:
            raise ValueError("label smoothing needs n_classes")
        L, W = self._logits_2d(logits, n_valid)
        N = L.shape[0]
        if out is None:
            out = xp.empty(logits.shape, dtype=logits.dtype)
        else:
            check_array(xp, "out", out, dtype=logits.dtype, shape=logits.shape)
        O = out.reshape(N, W)
        row_max = row_vector(xp, "row_max", row_max, N, np.float32, "f")
        sum_exp = row_vector(xp, "sum_exp", sum_exp, N, np.float32, "f")
        targets = row_vector(xp, "local_targets", local_targets, N, np.int64, "i")
        rs = xp.asarray(row_scale)
        if rs.size == 1:  # one scale for every row
            rs = xp.broadcast_to(rs.reshape(-1), (N,))
        row_scale = row_vector(xp, "row_scale", rs, N, np.float32, "f")
        smooth = np.float32(eps / n_classes) if eps != 0.0 else np.float32(0.0)
        self._launch("cross_entropy", f"ce_shard_backward_{dtype_suffix(L.dtype)}", (N,),
                     (self._row_block(W, L.dtype),),
                     (O, L, row_max, sum_exp, targets, row_scale, np.int64(N), int32_arg("W", W),
                      int32_arg("n_valid", int(n_valid)), smooth, np.float32(1.0 - eps)))
        return out


IDX, STAT = 8, 4  # bytes of an int64 target and of a float32 row statistic (the benchmark's byte counts)


def _bench_cases(sz):
    return [dict(N=n, V=sz["vocab"]) for n in sz["ce_rows"]] + [dict(N=n, V=v) for n, v in sz.get("ce_llama", ())]


def _bench_setup(stage):
    def setup(ops, normal, xp, s, dt, rng):
        N, V = s["N"], s["V"]
        logits = normal(xp, rng, (N, V), dt, 2.0)
        t = rng.integers(0, V, N).astype(np.int64)
        d = dict(logits=logits, targets=t if xp is np else xp.asarray(t), n_valid=V)
        if stage == "backward":
            d["row_max"], d["sum_exp"] = ops.ce_shard_forward(logits, d["targets"], V)[:2]
            d["row_scale"] = xp.full(N, 1.0 / N, dtype=np.float32)
        return d

    return setup


def _bench_bwd(k, d, ops):
    k.ce_shard_backward(d["logits"], d["row_max"], d["sum_exp"], d["targets"], d["n_valid"], d["row_scale"],
                        out=d["logits"])


BENCH = (
    BenchCase("ce_fwd", "vocab-parallel CE forward, one pass: row max, sum exp, target logit, sum of logits",
              "read logits (once), targets; write 4 stats: N*V*s + N*8 + 4*N*4", _bench_cases, _bench_setup("forward"),
              lambda ops, d: (lambda: ops.ce_shard_forward(d["logits"], d["targets"], d["n_valid"])),
              lambda k, d, ops: k.ce_shard_forward(d["logits"], d["targets"], d["n_valid"]),
              lambda s, it: s["N"] * s["V"] * it + s["N"] * (IDX + 4 * STAT)),
    BenchCase("ce_bwd_fused", "CE gradient written over the logits in place (llm.c's fused classifier)",
              "read logits, max, sum, scale, targets; write dlogits: 2*N*V*s + 3*N*4 + N*8", _bench_cases,
              _bench_setup("backward"),
              lambda ops, d: (lambda: ops.ce_shard_backward(d["logits"], d["row_max"], d["sum_exp"], d["targets"],
                                                            d["n_valid"], d["row_scale"], out=d["logits"])),
              _bench_bwd, lambda s, it: 2 * s["N"] * s["V"] * it + s["N"] * (3 * STAT + IDX),
              outputs=lambda d, r: (d["logits"],)),
)


FAMILY = KernelFamily(
    "cross_entropy", ("cross_entropy",), CrossEntropyLaunchers,
    targets={
        "ce_shard_forward": Target(1024, 2, "block per row"),
        "ce_shard_backward": Target(1024, 2, "block per row"),
    },
    traffic={
        "ce_shard_forward": Traffic(1, ops=14, what="read a logit once (online max and sum of exp, sum, target)"),
        "ce_shard_backward": Traffic(2, ops=14, what="read a logit, write its gradient"),
    },
    tests=("test_cross_entropy.py",), mutation_classes=("fastmath",), bench=BENCH)
