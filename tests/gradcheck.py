"""Central finite-difference gradient checks for hand-written backward passes (float64).

Two entry points:

* :func:`numeric_grad` -- the central-difference gradient of a scalar function of one array,
  at all or some of its elements.
* :func:`check_gradients` -- compares a forward/backward pair against central differences of
  the scalar loss ``sum_k sum(out_k * W_k)`` with fixed random weights ``W_k`` for every
  output, for each named input; raises ``AssertionError`` with a per-input report when the
  relative error exceeds ``tol``.

Error metric (per input, over the checked elements ``S``), chosen by ``metric``:

* ``"norm"`` (default): ``||a_S - n_S||_2 / max(||a_S||_2, ||n_S||_2, tiny)`` -- robust to
  elements whose gradient is (near) zero, where finite differences have only absolute
  accuracy;
* ``"max"``: ``max_{i in S} |a_i - n_i| / max(|a_i|, |n_i|, atol)`` -- per-element relative
  error with an absolute floor ``atol`` below which differences count as absolute ones.

Finite differences: element i of input x is perturbed by ``h_i = eps * max(1, |x_i|)`` and
``dL/dx_i ~= sum_k sum((out_k(x + h e_i) - out_k(x - h e_i)) * W_k) / (2 h_i)``; the two
outputs are subtracted elementwise before weighting, so untouched outputs cancel exactly and
the rounding error stays near ``1e-16 * |out| / h``. With float64 and the default
``eps = 1e-6`` the truncation error is ~``1e-12 * |f'''|``: relative errors of analytic
gradients are typically 1e-9..1e-10.

Works with NumPy arrays (and CuPy arrays, slowly: every perturbation is a device write).
"""
from __future__ import annotations

import numpy as np

from cutp.runtime.backend import get_array_module, to_numpy

__all__ = ["numeric_grad", "check_gradients", "relative_error", "pick_indices"]


def pick_indices(size: int, max_elements: int | None, rng) -> np.ndarray:
    """All flat indices when ``size <= max_elements`` (or no limit), else a random subset."""
    if max_elements is None or size <= max_elements:
        return np.arange(size)
    return np.sort(rng.choice(size, size=max_elements, replace=False))


def relative_error(a, n, metric: str = "norm", atol: float = 1e-9) -> float:
    """Relative error between analytic ``a`` and numeric ``n`` (see the module docstring)."""
    a = np.asarray(to_numpy(a), dtype=np.float64).ravel()
    n = np.asarray(to_numpy(n), dtype=np.float64).ravel()
    if a.shape != n.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {n.shape}")
    if a.size == 0:
        return 0.0
    if metric == "norm":
        den = max(np.linalg.norm(a), np.linalg.norm(n), 1e-300)
        return float(np.linalg.norm(a - n) / den)
    if metric == "max":
        den = np.maximum(np.maximum(np.abs(a), np.abs(n)), atol)
        return float(np.max(np.abs(a - n) / den))
    raise ValueError(f"unknown metric {metric!r}")


def _outputs(out):
    """A forward's output as a list of arrays (tuples/lists flattened, None dropped)."""
    if isinstance(out, (tuple, list)):
        res = []
        for o in out:
            res.extend(_outputs(o))
        return res
    return [] if out is None else [out]


def numeric_grad(f, x, eps: float = 1e-6, indices=None):
    """Central-difference gradient of the scalar ``f()`` w.r.t. the array ``x``.

    ``f`` takes no argument and reads ``x`` (which is perturbed in place, element by element,
    and restored bit-exactly afterwards). ``indices``: flat indices to differentiate (default
    all). Returns a float64 NumPy array shaped like ``x`` with NaN at unchecked elements when
    ``indices`` is given.
    """
    if not x.flags.c_contiguous:
        raise ValueError("numeric_grad needs a C-contiguous x (it perturbs x in place)")
    xf = x.reshape(-1)  # a view
    idx = np.arange(x.size) if indices is None else np.asarray(indices)
    g = np.full(x.size, np.nan) if indices is not None else np.empty(x.size)
    for i in idx:
        i = int(i)
        old = xf[i].item()
        h = eps * max(1.0, abs(old))
        xf[i] = old + h
        fp = float(f())
        xf[i] = old - h
        fm = float(f())
        xf[i] = old
        g[i] = (fp - fm) / (2.0 * h)
    return g.reshape(x.shape)


def check_gradients(forward, inputs: dict, backward, *, wrt=None, eps: float = 1e-6,
                    tol: float = 1e-6, metric: str = "norm", atol: float = 1e-9,
                    max_elements: int | None = 128, seed: int = 0, weights=None,
                    raise_on_fail: bool = True) -> dict:
    """Check ``backward`` against central differences of ``forward``.

    Args:
        forward: ``forward(**inputs) -> (out, state)``; ``out`` is an array or a (nested)
            tuple/list of arrays (``None`` entries ignored), ``state`` anything ``backward``
            needs (the op's ctx). It must not modify its inputs.
        inputs: name -> array. Float64 arrays are the candidates for checking; others
            (integer ids, masks) are passed through unchanged.
        backward: ``backward(dout, state) -> {name: grad}``; ``dout`` has the structure of
            ``out`` (a single array, or a list of arrays when ``out`` was a tuple/list). A
            missing or None gradient for a checked input counts as zeros.
        wrt: names to check (default: every float64 input).
        eps: relative finite-difference step (``h = eps * max(1, |x_i|)``).
        tol: maximum allowed relative error per input.
        metric / atol: see :func:`relative_error`.
        max_elements: per input, check at most this many randomly chosen elements (None:
            all).
        seed: seeds the output weights and the element subsets.
        weights: optional explicit output weights (same structure as ``dout``).
        raise_on_fail: raise ``AssertionError`` when some error exceeds ``tol``.

    Returns ``{name: relative_error}``.
    """
    rng = np.random.default_rng(seed)
    work = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in inputs.items()}
    if wrt is None:
        wrt = [k for k, v in work.items() if getattr(v, "dtype", None) == np.float64]
    for k in wrt:
        if getattr(work[k], "dtype", None) != np.float64:
            raise TypeError(f"check_gradients: input {k!r} must be float64, got "
                            f"{getattr(work[k], 'dtype', type(work[k]))}")

    out, state = forward(**work)
    outs = _outputs(out)
    structured = isinstance(out, (tuple, list))
    if weights is None:
        ws = []
        for o in outs:
            xp = get_array_module(o)
            ws.append(xp.asarray(rng.standard_normal(o.shape)))
    else:
        ws = _outputs(weights)
    if len(ws) != len(outs):
        raise ValueError("weights do not match the forward's outputs")
    dout = list(ws) if structured else ws[0]
    grads = backward(dout, state) or {}

    def weighted_diff(op, om):
        return sum(float(((a - b) * w).sum()) for a, b, w in zip(op, om, ws))

    report = {}
    for name in wrt:
        x = work[name]
        xf = x.reshape(-1)
        idx = pick_indices(x.size, max_elements, rng)
        num = np.empty(idx.size)
        for j, i in enumerate(idx):
            i = int(i)
            old = xf[i].item()
            h = eps * max(1.0, abs(old))
            xf[i] = old + h
            op = [o.copy() for o in _outputs(forward(**work)[0])]
            xf[i] = old - h
            om = _outputs(forward(**work)[0])
            xf[i] = old
            num[j] = weighted_diff(op, om) / (2.0 * h)
        g = grads.get(name)
        if g is None:
            ana = np.zeros(idx.size)
        else:
            if tuple(g.shape) != tuple(x.shape):
                raise AssertionError(f"grad of {name!r} has shape {g.shape}, input {x.shape}")
            ana = np.asarray(to_numpy(g), dtype=np.float64).reshape(-1)[idx]
        report[name] = relative_error(ana, num, metric=metric, atol=atol)
    bad = {k: v for k, v in report.items() if not v <= tol}
    if bad and raise_on_fail:
        raise AssertionError(f"gradient check failed (tol={tol}, metric={metric}): "
                             + ", ".join(f"{k}: {v:.3e}" for k, v in report.items()))
    return report
