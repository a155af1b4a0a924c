"""Array-module generic error functions :func:`erf` and :func:`erfc` (NumPy has none).

NumPy: W. J. Cody's rational Chebyshev approximations (CALERF, 1969/1985), accurate to about
1e-16 relative in float64, evaluated in CALERF's order of operations; float32 inputs are
evaluated in float32. CuPy: deferred to ``cupyx.scipy.special``. The exact-erf GeLU
(``cutp.ops.gelu``) is their user here.
"""
from __future__ import annotations

import numpy as np

from cutp.runtime.backend import get_array_module
from cutp.runtime.shape_only import ShapeOnly

# Cody's CALERF coefficients
_THRESH = 0.46875
_SQRPI = 5.6418958354775628695e-1  # 1/sqrt(pi)
_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
      3.20937758913846947e03, 1.85777706184603153e-1)
_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
      2.84423683343917062e03)
_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
       2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
       2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
      1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
      3.43936767414372164e03, 1.23033935480374942e03)
_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
      1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1,
      6.05183413124413191e-2, 2.33520497626869185e-3)


def _erf_small(x):
    """erf(x) for |x| <= 0.46875."""
    num = _rational(x * x, _A, _B)
    num *= x
    return num


def _rational(t, p, q):
    """Cody's (p[n+1] t^(n+1) + p[0] t^n + ... + p[n]) / (t^(n+1) + q[0] t^n + ... + q[n]),
    n = len(q) - 1, in CALERF's order of operations (in place on fresh arrays)."""
    n = len(q) - 1
    num = p[n + 1] * t
    den = t.copy()
    for i in range(n):
        num += p[i]
        num *= t
        den += q[i]
        den *= t
    num += p[n]
    den += q[n]
    num /= den
    return num


def _exp_neg_sq(y):
    """exp(-y*y) with y*y split into an exact part and a small remainder (Cody)."""
    ysq = np.floor(y * 16.0)
    ysq /= 16.0
    d = (y - ysq) * (y + ysq)
    ysq *= ysq
    np.negative(ysq, out=ysq)
    np.exp(ysq, out=ysq)
    np.negative(d, out=d)
    np.exp(d, out=d)
    ysq *= d
    return ysq


def _erfc_pos(y):
    """erfc(y) for y > 0.46875 (NaN propagates)."""
    mid = y <= 4.0
    out = np.empty_like(y)
    if mid.any():
        ym = y[mid]
        num = _rational(ym, _C, _D)
        num *= _exp_neg_sq(ym)
        out[mid] = num
    big = ~mid
    if big.any():
        yb = np.minimum(y[big], 30.0)  # erfc(30) underflows to 0; avoids inf - inf
        z = 1.0 / (yb * yb)
        num = _rational(z, _P, _Q)
        num *= z
        np.subtract(_SQRPI, num, out=num)
        num /= yb
        num *= _exp_neg_sq(yb)
        out[big] = num
    return out


def _float_input(x, xp):
    x = xp.asarray(x)
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    return x


def erf(x):
    """Elementwise error function, same dtype as ``x`` (integers become float64).

    NumPy: Cody's CALERF rational approximations (max error ~1e-16 relative in float64;
    float32 inputs are evaluated in float32). CuPy: ``cupyx.scipy.special.erf``.
    """
    xp = get_array_module(x)
    if isinstance(xp, ShapeOnly):  # the planner: the split by magnitude depends on the data; the output stays
        return xp.empty_like(_float_input(x, xp))
    if xp is not np:
        import cupyx.scipy.special  # optional dependency

        return cupyx.scipy.special.erf(x)
    x = _float_input(x, xp)
    ax = np.abs(x)
    small = ax <= _THRESH
    out = np.empty_like(x)
    out[small] = _erf_small(x[small])
    big = ~small
    if big.any():
        xb = x[big]
        r = _erfc_pos(np.abs(xb))
        np.subtract(0.5, r, out=r)
        r += 0.5
        r[xb < 0] *= -1.0
        out[big] = r
    return out


def erfc(x):
    """Elementwise complementary error function 1 - erf(x), accurate in the tails.

    NumPy: Cody's CALERF rational approximations; CuPy: ``cupyx.scipy.special.erfc``.
    """
    xp = get_array_module(x)
    if isinstance(xp, ShapeOnly):  # the planner: the split by magnitude depends on the data; the output stays
        return xp.empty_like(_float_input(x, xp))
    if xp is not np:
        import cupyx.scipy.special  # optional dependency

        return cupyx.scipy.special.erfc(x)
    x = _float_input(x, xp)
    ax = np.abs(x)
    small = ax <= _THRESH
    out = np.empty_like(x)
    s = _erf_small(x[small])
    np.subtract(1.0, s, out=s)
    out[small] = s
    big = ~small
    if big.any():
        xb = x[big]
        r = _erfc_pos(np.abs(xb))
        neg = xb < 0
        r[neg] = 2.0 - r[neg]
        out[big] = r
    return out
