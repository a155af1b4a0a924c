"""Linear layer in GPT-2's Conv1D layout: ``y = x @ w + b`` with ``w`` of shape [in, out].

Its products go through :mod:`cutp.ops.gemm`: cuBLAS with 16-bit operands and float32
accumulation on a GPU (the weight gradient accumulated straight into a float32 main_grad), the
float32 upcast-and-round emulation of it on the CPU.
"""
from __future__ import annotations

from .common import as_dtype, compute_dtype
from .gemm import column_sums, gemm, operand


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

    All float inputs share a dtype; bfloat16 is computed in float32 (one GEMM accumulating in
    float32) and the result rounded to bfloat16 once; a bias is added to the float32 product
    before that rounding. The leading dimensions are flattened into one GEMM.
    Inputs are never modified.
    """
    cdt = compute_dtype(x.dtype)
    n_in, n_out = w.shape
    if x.shape[-1] != n_in:
        raise ValueError(f"linear_forward: x has {x.shape[-1]} features, w expects {n_in}")
    x2 = x.reshape(-1, n_in)
    if b is None:
        y = gemm(operand(x2), operand(w), out_dtype=x.dtype)
    else:
        y = gemm(operand(x2), operand(w), out_dtype=cdt)
        y += as_dtype(b, cdt)
        y = as_dtype(y, x.dtype)
    return y.reshape(x.shape[:-1] + (n_out,)), LinearCtx(x, w, None if b is None else b.dtype)


def linear_backward(dy, ctx: LinearCtx, need_dx: bool = True, wgrad_dtype=None, wgrad_out=None, need_dw: bool = True):
    """Gradients of :func:`linear_forward`.

    Args:
        dy: [..., out] upstream gradient (same leading shape as the forward's ``x``).
        ctx: the forward's :class:`LinearCtx`.
        need_dx: when False, ``dx`` is not computed (e.g. the first layer).
        wgrad_dtype: the dtype of ``dw`` (default ``w``'s). A bfloat16/float16 layer whose
            gradient accumulates in a float32 buffer (Megatron's main_grad) passes float32: the
            product computed in float32 is kept as it is, never rounded to 16 bits first (what
            cuBLAS with float32 output does on a GPU).
        wgrad_out: the weight's gradient buffer [in, out]: ``dw`` is added into it (on a GPU
            with a float32 buffer in the GEMM itself, beta = 1: Megatron's
            gradient_accumulation_fusion, no [in, out] temporary) and returned as ``dw``.
        need_dw: when False (a frozen weight), ``dw`` is not computed (None).

    Returns:
        ``(dx, dw, db)``: ``dx`` [..., in] in ``x``'s dtype (None unless ``need_dx``),
        ``dw = x2.T @ dy2`` [in, out] in ``w``'s dtype, ``db = dy2.sum(0)`` [out] in the
        bias dtype (None when the forward had no bias; computed as ``ones @ dy2``). ``x2``/``dy2`` are the 2-D views with
        all leading dimensions flattened, so the parameter gradients are summed over them.
    """
    x, w = ctx.x, ctx.w
    n_in, n_out = w.shape
    dy2 = operand(dy.reshape(-1, n_out))
    x2 = operand(x.reshape(-1, n_in))
    if not need_dw:
        dw = None
    elif wgrad_out is not None:
        dw = gemm(x2, dy2, trans_a=True, out=wgrad_out, accumulate=True)
    else:
        dw = gemm(x2, dy2, trans_a=True, out_dtype=w.dtype if wgrad_dtype is None else wgrad_dtype)
    db = None
    if ctx.bias_dtype is not None:
        db = as_dtype(column_sums(dy2), ctx.bias_dtype)
    dx = None
    if need_dx:
        dx = gemm(dy2, operand(w), trans_b=True, out_dtype=x.dtype).reshape(x.shape)
    return dx, dw, db
