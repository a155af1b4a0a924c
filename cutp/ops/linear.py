"""Linear layer in GPT-2's Conv1D layout: ``y = x @ w + b`` with ``w`` of shape [in, out]."""
from __future__ import annotations

from cutp.runtime.backend import get_array_module

from .common import as_dtype, col_sum, compute_dtype


class LinearCtx:
    """What ``linear_backward`` needs: the input, the weight, and the bias dtype (None: no bias)."""

    __slots__ = ("x", "w", "bias_dtype")

    def __init__(self, x, w, bias_dtype):
        self.x = x
        self.w = w
        self.bias_dtype = bias_dtype


def linear_forward(x, w, b=None):
    """``y = x @ w (+ b)``.

    Args:
        x: [..., in] activations.
        w: [in, out] weight (GPT-2 Conv1D layout, i.e. the transpose of ``torch.nn.Linear``'s).
        b: optional [out] bias.

    Returns:
        ``(y, ctx)`` with ``y`` of shape [..., out] and ``x``'s dtype; ``ctx`` is a
        :class:`LinearCtx` holding references to ``x`` and ``w`` (no copies).

    All float inputs share a dtype; bfloat16 is computed in float32 (one float32 matmul) and
    the result rounded to bfloat16. The leading dimensions are flattened into one GEMM.
    Inputs are never modified.
    """
    xp = get_array_module(x, w, b)
    cdt = compute_dtype(x.dtype)
    n_in, n_out = w.shape
    if x.shape[-1] != n_in:
        raise ValueError(f"linear_forward: x has {x.shape[-1]} features, w expects {n_in}")
    x2 = x.reshape(-1, n_in)
    y = xp.matmul(as_dtype(x2, cdt), as_dtype(w, cdt))
    if b is not None:
        y += as_dtype(b, cdt)
    y = as_dtype(y, x.dtype).reshape(x.shape[:-1] + (n_out,))
    return y, LinearCtx(x, w, None if b is None else b.dtype)


def linear_backward(dy, ctx: LinearCtx, need_dx: bool = True, wgrad_dtype=None):
    """Gradients of :func:`linear_forward`.

    Args:
        dy: [..., out] upstream gradient (same leading shape as the forward's ``x``).
        ctx: the forward's :class:`LinearCtx`.
        need_dx: when False, ``dx`` is not computed (e.g. the first layer).
        wgrad_dtype: the dtype of ``dw`` (default ``w``'s). A bfloat16/float16 layer whose
            gradient accumulates in a float32 buffer (Megatron's main_grad) passes float32: the
            product computed in float32 is kept as it is, never rounded to 16 bits first (what
            cuBLAS with float32 output does on a GPU: gradient-accumulation fusion).

    Returns:
        ``(dx, dw, db)``: ``dx`` [..., in] in ``x``'s dtype (None unless ``need_dx``),
        ``dw = x2.T @ dy2`` [in, out] in ``w``'s dtype, ``db = dy2.sum(0)`` [out] in the
        bias dtype (None when the forward had no bias; computed as ``ones @ dy2``). ``x2``/``dy2`` are the 2-D views with
        all leading dimensions flattened, so the parameter gradients are summed over them.
    """
    x, w = ctx.x, ctx.w
    xp = get_array_module(dy, x, w)
    cdt = compute_dtype(x.dtype)
    n_in, n_out = w.shape
    dy2 = as_dtype(dy.reshape(-1, n_out), cdt)
    x2 = as_dtype(x.reshape(-1, n_in), cdt)
    dw = as_dtype(x2.T @ dy2, w.dtype if wgrad_dtype is None else wgrad_dtype)
    db = None
    if ctx.bias_dtype is not None:
        db = as_dtype(col_sum(xp, dy2), ctx.bias_dtype)
    dx = None
    if need_dx:
        dx = as_dtype(dy2 @ as_dtype(w, cdt).T, x.dtype).reshape(x.shape)
    return dx, dw, db
