"""Launchers of ``kernels/rotary.cu``: rotary position embedding of q and k heads, forward and backward.

One op, four places:

* CUDA source: ``kernels/rotary.cu``;
* these launchers (argument checks, strides, launch shapes);
* NumPy/CuPy reference: ``cutp/ops/rotary.py`` (``rotary_forward``, ``rotary_backward``), which
  calls these launchers through ``cutp.kernels.dispatch_views`` for the layouts
  :func:`rotary_supported` accepts;
* tests: ``tests/kernels/test_rotary.py``; benchmark case ``rotary`` of ``python -m cutp bench
  kernels`` (declared below, with the family).

Layout: x [B, T, H, D] (the op's ``seq_axis=1``), any non-negative strides in whole elements with a
contiguous head dim, so the Q and K heads of a fused QKV buffer are rotated in place without a
copy; the tables float32 [L, rd] (with position ids [T] or [B, T]) or per-token [T, rd] /
[B, T, rd] (without), C-contiguous.
"""
from __future__ import annotations

import numpy as np

from .family import BenchCase, KernelFamily, Target, Traffic
from .attention import kernel_layout, strided_span
from .runtime import (
    ELEMENTWISE_THREADS,
    KernelArgumentError,
    LauncherBase,
    ceil_div,
    check_array,
    dtype_suffix,
    elements_per_128bit,
    int32_arg,
    is_kernel_dtype,
)


def rotary_supported(x, cos, sin, positions, seq_axis, out) -> str | None:
    """None when the kernel takes these operands, else why not (one line): x [B, T, H, D] of
    float32 or bfloat16 with the sequence on axis 1 and a contiguous head dim, out (if given)
    likewise, the tables float32 and C-contiguous."""
    if x.ndim != 4 or seq_axis != 1:
        return f"the rotary kernel takes x [B, T, heads, head_dim] with seq_axis 1, got {x.ndim}-d, seq_axis {seq_axis}"
    if not is_kernel_dtype(x.dtype):
        return f"the rotary kernel takes float32 or bfloat16 x, got {x.dtype}"
    if not kernel_layout(x) or (out is not None and (out.dtype != x.dtype or not kernel_layout(out, output=True))):
        return "the rotary kernel needs a contiguous head dim and non-negative strides (an output: non-zero ones)"
    for t in (cos, sin):
        if t.dtype != np.float32 or not t.flags.c_contiguous:
            return f"the rotary kernel takes C-contiguous float32 tables, got {t.dtype}"
    if positions is not None and positions.ndim not in (1, 2):
        return f"the rotary kernel takes position ids [T] or [B, T], got shape {tuple(positions.shape)}"
    return None


class RotaryLaunchers(LauncherBase):
    """rotary."""

    def rotary(self, x, cos, sin, positions=None, *, out=None, transpose: bool = False):
        """out = R x (R^T x with transpose) over the head dim of x [B, T, H, D]; out may be x (in
        place) or None (a new C-contiguous array). positions: int64-convertible ids [T] or
        [B, T] into tables [L, rd] (the caller checks they lie in [0, L)), or None with per-token
        tables [T, rd] / [B, T, rd]. Returns out."""
        xp = self.xp
        why = rotary_supported(x, cos, sin, positions, 1, out)
        if why is not None:
            raise KernelArgumentError(why)
        B, T, H, D = x.shape
        for what, t in (("cos", cos), ("sin", sin)):
            check_array(xp, what, t, dtype=np.float32)
        if cos.shape != sin.shape:
            raise KernelArgumentError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
        rd = cos.shape[-1]
        if rd % 2 or not 0 < rd <= D:
            raise KernelArgumentError(f"table width {rd} must be even and at most the head dim {D}")
        if positions is not None:
            if cos.ndim != 2:
                raise KernelArgumentError(f"with positions, cos/sin must be [max_len, rd] tables, got {cos.shape}")
            if positions.shape[-1] != T or (positions.ndim == 2 and positions.shape[0] not in (1, B)):
                raise KernelArgumentError(f"positions {tuple(positions.shape)} do not match x [B, T] = [{B}, {T}]")
            pos = xp.ascontiguousarray(positions, dtype=np.int64)
            pos_bs, tab_bs = (T if positions.ndim == 2 and positions.shape[0] == B > 1 else 0), 0
        else:
            if cos.ndim not in (2, 3) or cos.shape[-2] != T or (cos.ndim == 3 and cos.shape[0] not in (1, B)):
                raise KernelArgumentError(f"per-token tables {tuple(cos.shape)} do not match x [B, T] = [{B}, {T}]")
            pos, pos_bs = None, 0
            tab_bs = T if cos.ndim == 3 and cos.shape[0] == B > 1 else 0
        if out is None:
            out = xp.empty(x.shape, dtype=x.dtype)
        elif tuple(out.shape) != tuple(x.shape):
            raise KernelArgumentError(f"out has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
        in_place = out is x
        if not x.size:
            return out
        xs, xst = strided_span(xp, x)
        os_, ost = (xs, xst) if in_place else strided_span(xp, out)
        P = elements_per_128bit(x.dtype)
        nc = ceil_div(rd // 2, P) + (0 if in_place else ceil_div(D - rd, P))  # in place: the tail stays
        n = B * T * H * nc
        self._launch("rotary", f"rotary_{dtype_suffix(x.dtype)}", (ceil_div(n, ELEMENTWISE_THREADS),),
                     (ELEMENTWISE_THREADS,),
                     (os_, xs, cos, sin, pos, np.int64(n), int32_arg("T", T), int32_arg("heads", H),
                      int32_arg("head dim", D), np.int32(rd), *xst[:3], *ost[:3], np.int64(pos_bs), np.int64(tab_bs),
                      np.int32(bool(transpose)), np.int32(not in_place)))
        return out


def _bench_cases(sz):
    """q and k heads of a fused QKV buffer [B, T, (nq + 2 nkv) hd]: GQA 4 at head dims 64 and 128."""
    T = sz["seq"]
    return [dict(B=max(1, n // T), T=T, nq=nq, nkv=nq // 4, hd=hd) for n in sz["rows"]
            for nq, hd in ((16, 64), (32, 128))]


def _bench_setup(ops, normal, xp, s, dt, rng):
    B, T, nq, nkv, hd = (s[k] for k in ("B", "T", "nq", "nkv", "hd"))
    qkv = normal(xp, rng, (B, T, (nq + 2 * nkv) * hd), dt)
    cos, sin = ops.rope_tables(hd, T, theta=500000.0, scaling=ops.RopeScaling("llama3", factor=8.0), xp=xp)
    return dict(qkv=qkv, heads=qkv[..., :(nq + nkv) * hd].reshape(B, T, nq + nkv, hd), cos=cos, sin=sin)


BENCH = (BenchCase(
    "rotary_qk", "RoPE of the q and k heads in place in a fused QKV buffer (llama3 tables)",
    "read and write the q, k heads: 2*B*T*(nq+nkv)*hd*s (the tables stay in L2)", _bench_cases, _bench_setup,
    lambda ops, d: (lambda: ops.rotary_forward(d["heads"], d["cos"], d["sin"], out=d["heads"])),
    lambda k, d, ops: k.rotary(d["heads"], d["cos"], d["sin"], out=d["heads"]),
    lambda s, it: 2 * s["B"] * s["T"] * (s["nq"] + s["nkv"]) * s["hd"] * it, outputs=lambda d, r: (d["heads"],),
    label=lambda s: f"{s['B']}x{s['T']}x({s['nq']}+{s['nkv']})x{s['hd']}"),)

FAMILY = KernelFamily(
    "rotary", ("rotary",), RotaryLaunchers,
    targets={"rotary": Target(256, 4, "6 chunks in flight (2 of x, 4 of the float tables: 48 floats in bf16): 50%")},
    traffic={"rotary": Traffic(2, f32=2, ops=3, what="read x, cos, sin; write y (per element)")},
    tests=("test_rotary.py",), mutation_classes=("halves",), bench=BENCH)
