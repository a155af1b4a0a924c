"""Launcher of ``kernels/adamw.cu``: the AdamW update of the whole flat parameter buffer.

One op, four places:

* CUDA source: ``kernels/adamw.cu``;
* this launcher (argument checks, the host-side constants of the update);
* NumPy/CuPy reference: ``cutp/ops/adamw.py`` (``adamw_update``), which calls this launcher
  through ``cutp.kernels.dispatch``;
* tests: ``tests/kernels/test_adamw.py``; benchmark case ``adamw`` of
  ``python -m cutp bench kernels`` (declared below, with the family).
"""
from __future__ import annotations

import numpy as np

from .family import BenchCase, KernelFamily, Target, Traffic
from .runtime import KernelArgumentError, LauncherBase, check_array, dtype_suffix


class AdamWLaunchers(LauncherBase):
    """adamw_update."""

    def adamw_update(self, p, g, m, v, decay_mask, *, lr, beta1, beta2, eps, weight_decay, step,
                     grad_scale=1.0) -> None:
        """In-place AdamW over flat buffers (cutp.ops.adamw_update): p, g, decay_mask of one dtype
        (float32 or bfloat16), m and v float32, all 1-D of one length; decay_mask None: every
        element decays (by weight_decay; none when it is 0). One launch per range of the flat
        buffer; elementwise, one 128-bit chunk per thread per array."""
        xp = self.xp
        check_array(xp, "p", p, float_data=True)
        if p.ndim != 1:
            raise KernelArgumentError(f"adamw_update takes flat arrays; p has shape {tuple(p.shape)}")
        check_array(xp, "g", g, dtype=p.dtype, shape=p.shape)
        check_array(xp, "m", m, dtype=np.float32, shape=p.shape)
        check_array(xp, "v", v, dtype=np.float32, shape=p.shape)
        decay = bool(weight_decay)
        if decay_mask is not None:
            check_array(xp, "decay_mask", decay_mask, dtype=p.dtype, shape=p.shape)
        bc1 = 1.0 - beta1 ** step
        bc2 = 1.0 - beta2 ** step
        n = p.size
        grid, block = self._elementwise_grid(n, p.dtype)
        f = np.float32
        self._launch("adamw", f"adamw_update_{dtype_suffix(p.dtype)}", grid, block,
                     (p, m, v, g, decay_mask if decay else None, np.int64(n), f(beta1), f(1.0 - beta1), f(beta2),
                      f(1.0 - beta2), f(lr * weight_decay), np.int32(decay), f(eps), f(lr / bc1),
                      f(1.0 / np.sqrt(bc2)), f(grad_scale)))


_BENCH_KW = dict(lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10)


def _bench_setup(ops, normal, xp, s, dt, rng):
    n = s["n"]
    state = np.float32 if np.dtype(dt) != np.float64 else np.float64
    v = normal(xp, rng, (n,), state, 1e-3)
    v *= v
    return dict(p=normal(xp, rng, (n,), dt, 0.02), g=normal(xp, rng, (n,), dt, 1e-3),
                m=normal(xp, rng, (n,), state, 1e-3), v=v, mask=(xp.arange(n) % 3 != 0).astype(dt))


BENCH = (BenchCase(
    "adamw", "AdamW over flat buffers (fp32 m, v)",
    "read p, g, mask (s each), m, v (4 each); write p (s), m, v (4 each): n*(4*s + 16)",
    lambda sz: [dict(n=n) for n in sz["adam"]], _bench_setup,
    lambda ops, d: (lambda: ops.adamw_update(d["p"], d["g"], d["m"], d["v"], d["mask"], **_BENCH_KW)),
    lambda k, d, ops: k.adamw_update(d["p"], d["g"], d["m"], d["v"], d["mask"], **_BENCH_KW),
    lambda s, it: s["n"] * (4 * it + 16), outputs=lambda d, r: (d["p"], d["m"], d["v"]),
    label=lambda s: f"{s['n']:,}"),)


FAMILY = KernelFamily(
    "adamw", ("adamw",), AdamWLaunchers,
    targets={"adamw_update": Target(256, 4, "5 arrays x 128 bit in flight per thread; 50%")},
    traffic={"adamw_update": Traffic(3, f32=4, ops=16, what="read p, g, m, v; write p, m, v (no decay mask)")},
    tests=("test_adamw.py",), bench=BENCH)
