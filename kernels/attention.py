"""Launchers of ``kernels/attention.cu``: fused causal attention (FlashAttention-2), forward and
backward, with grouped query heads.

One op, four places:

* CUDA source: ``kernels/attention.cu``;
* these launchers (argument checks, strides, tile sizes and shared memory);
* NumPy reference: ``cutp/ops/attention.py`` (``flash_attention_forward`` /
  ``flash_attention_backward``, the same tiled algorithm; ``causal_attention_forward`` dispatches
  here for CuPy arrays, see :func:`fused_attention_supported`);
* tests: ``tests/kernels/test_attention.py`` (``test_attention_tiles.py``: a ring's tiles;
  ``test_attention_mask.py``: the mask rule and the soft cap; ``test_attention_head_dims.py``:
  MLA's head dims); benchmark case ``attention`` of
  ``python -m cutp bench kernels``.

Layouts (the op's): q [B, Hkv, G, Tq, D] (the G query heads of each KV head), k [B, Hkv, Tk, D],
v [B, Hkv, Tk, DV] (DV = D but for MLA's (192, 128): ``ATTENTION_HEAD_DIMS``), any strides with a contiguous head dim (views of a fused QKV projection's output
go in as they are: no copy); query row i sits at position Tk - Tq + i. The forward allocates only
o, token-major [B, Tq, Hkv, G, DV] (returned as the [B, Hkv, G, Tq, DV] view, so merging the heads
is a view) and the log-sum-exp lse [B, Hkv, G, Tq] in float32: O(T) memory, nothing T x T.

The mask (cutp's attention mask rule): query row i sits at global index ``q_first + i`` (default
Tk - Tq), key j at ``k_first + j`` (default 0); a query at p sees a key at s iff s <= p, and with
``window`` s > p - window, and with ``documents=(q_docs [B, Tq], k_docs [B, Tk])`` (int32 ids,
non-decreasing along the sequence: packed sequences) both carry the same id. ``softcap``: scores
softcap * tanh(scale q.k / softcap) before the mask and the softmax. Tiles wholly outside the
causal band, the window or the documents are skipped in all three tile kernels. A row that sees
no key (a ring tile's, under a window or documents) gets o = 0 and lse = -inf.

One tile of context parallelism's ring attention (``cutp.ops.attention_tiles``) runs on the same
kernels: ``q_first``, ``k_first`` place its queries and keys (q_first == k_first is a diagonal
tile, q_first >= k_first + Tk - 1 a full one), ``drop_strides`` puts the dropout counters at the
whole sequence's places, the backward takes the merged result's ``rowdot`` and lse, and writes
float32 outputs (for bfloat16 inputs too) or adds to them (``accumulate``).
"""
from __future__ import annotations

import numpy as np

from .dropout import MASK64, keep_threshold
from .family import DynamicShared, KernelFamily, Target, Traffic
from .runtime import KernelArgumentError, LauncherBase, ceil_div, dtype_suffix, int32_arg, is_kernel_dtype

# (D of q and k, DV of v and o) pairs with kernels: 64 and 128, and MLA's (DeepSeek-V3: 128 + a
# rotary 64 for q, k; 128 for v)
ATTENTION_HEAD_DIMS = ((64, 64), (128, 128), (192, 128))
ROWDOT_WARPS = 8  # rows (warps) per block of attention_backward_rowdot
MAX_GRID_X, MAX_GRID_Y = 2**31 - 1, 65535  # CUDA's grid limits: heads go on x, tiles on y


def attention_tile_rows(kernel: str, head_dim: int) -> int:
    """R, the query/key rows of a tile (a warp per 16 rows, 2 x R threads) at q's head dim: 64,
    but 32 for the backward beyond head dim 64, whose blocks hold four input tiles, two score
    tiles and accumulators, and for the forward beyond 128 (kernels/attention.cu's entry points
    are instantiated with the same numbers)."""
    return 32 if head_dim > 128 or (kernel != "forward" and head_dim > 64) else 64


def head_dims_suffix(head_dim: int, v_dim: int | None = None) -> str:
    """The entry points' head-dim suffix: d<D>, or d<D>v<DV> where v's head dim differs (MLA)."""
    return f"d{head_dim}" if v_dim in (None, head_dim) else f"d{head_dim}v{v_dim}"


def attention_shared_bytes(kernel: str, dtype, head_dim: int, v_dim: int | None = None) -> int:
    """Dynamic shared memory of a block of attention_{forward,backward_dq,backward_dkdv}: the
    layout of kernels/attention.cu (input tiles of rows D + 1 floats or D + 8 bf16, float score
    tiles of R + 4, bf16 probability tiles of R + 8, float accumulators of D + 4, R int32
    document ids; D of q and k, DV = v_dim (default D) of v, dO and their accumulators)."""
    D = head_dim
    DV = D if v_dim is None else v_dim
    R = attention_tile_rows(kernel, D)
    bf16 = np.dtype(dtype).itemsize == 2

    def tile(d):
        return R * (d + 8 if bf16 else d + 1) * (2 if bf16 else 4)

    score, prob, docs = R * (R + 4) * 4, R * (R + 8) * 2, R * 4

    def accum(d):
        return R * (d + 4) * 4

    if kernel == "forward":  # Q, K, V, S, O (+ P), the key tile's document ids
        return 2 * tile(D) + tile(DV) + score + accum(DV) + (prob if bf16 else 0) + docs
    if kernel == "backward_dq":  # Q, dO, K, V, S, dP, dQ (+ dS), the key tile's document ids
        return 2 * tile(D) + 2 * tile(DV) + 2 * score + accum(D) + (prob if bf16 else 0) + docs
    if kernel == "backward_dkdv":  # K, V, Q, dO, S^T, dP^T, dK, dV, lse, D (+ P^T, dS^T), query document ids
        return (2 * tile(D) + 2 * tile(DV) + 2 * score + accum(D) + accum(DV) + 2 * R * 4 + (2 * prob if bf16 else 0)
                + docs)
    raise ValueError(f"unknown attention kernel {kernel!r}")


def mask_band(Tq: int, Tk: int, diag: int, window: int | None) -> tuple[int, int]:
    """The kernels' (diag, window) int32 arguments for query row i seeing key j iff
    diag + i - window < j <= diag + i (window None: no lower bound), 0 <= i < Tq, 0 <= j < Tk:
    the same visible pairs with both in [-Tq, Tk + Tq] (positions of any size, no overflow in the
    kernels' int arithmetic; a window no row reaches is passed as one)."""
    if window is not None and window < 1:
        raise KernelArgumentError(f"window={window}: a window holds at least the query's own key (window >= 1)")
    if window is None or window >= diag + Tq:  # no row's window starts after key 0
        diag = max(-Tq, min(diag, Tk))  # <= -Tq: no row sees a key; >= Tk: every row every key
        return diag, max(diag + Tq, 1)
    if diag - window >= Tk - 1:  # every row's window starts after the last key
        return -Tq, 1
    if diag > Tk:  # the causal bound past the last key for every row: shift it with the window
        window -= diag - Tk
        diag = Tk
    return diag, window


def kernel_layout(a, output: bool = False) -> bool:
    """Whether the kernels take array a as it is: a contiguous last (head) axis and non-negative
    strides in whole elements (any other strides: views of a fused QKV buffer), and for an output
    no zero stride (a broadcast view: several blocks would write each element). Empty: yes."""
    if not a.size:
        return True
    if a.strides[-1] != a.itemsize or any(s < 0 or s % a.itemsize for s in a.strides):
        return False
    return not output or all(s or d == 1 for s, d in zip(a.strides, a.shape))


def fused_attention_supported(q, k, v) -> str | None:
    """None when the fused kernels take these operands, else why not (one line): (q/k, v) head
    dims of ATTENTION_HEAD_DIMS (64, 128; MLA's 192 and 128), float32 or bfloat16, one dtype, a
    contiguous head dim."""
    if not (q.dtype == k.dtype == v.dtype) or not is_kernel_dtype(q.dtype):
        return f"the fused attention takes float32 or bfloat16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if (q.shape[-1], v.shape[-1]) not in ATTENTION_HEAD_DIMS:
        return (f"the fused attention takes (q/k, v) head dims {', '.join(f'({d}, {dv})' for d, dv in ATTENTION_HEAD_DIMS)}"
                f", got ({q.shape[-1]}, {v.shape[-1]})")
    if not all(kernel_layout(a) for a in (q, k, v)):
        return "the fused attention needs a contiguous head dim and non-negative strides"
    return None


def strided_span(xp, a):
    """(a 1-D C-contiguous array over a's memory from its first element to its last, a's strides
    in elements): how a strided view reaches a kernel, which sees one base pointer."""
    if not kernel_layout(a):
        raise KernelArgumentError(f"an attention operand of shape {a.shape} has strides {a.strides}: the kernels "
                                  "need non-negative strides and a contiguous last (head) axis (pass a copy)")
    n = 1 + sum((d - 1) * (s // a.itemsize) for d, s in zip(a.shape, a.strides)) if a.size else 0
    span = xp.lib.stride_tricks.as_strided(a, shape=(n,), strides=(a.itemsize,))
    return span, [np.int64(s // a.itemsize) for s in a.strides]


class AttentionLaunchers(LauncherBase):
    """attention_forward, attention_backward.

    Dropout of the probabilities (``dropout_p > 0``): the masks of
    ``cutp.ops.dropout_forward_rows(probs, dropout_p, seed, offsets)`` over the probabilities
    [B, Hkv, G, Tq, Tk], batch row b drawn from counter ``offsets[b]`` (an int: offsets[b] =
    offsets + b * Hkv * G * Tq * Tk), evaluated in the kernels (forward and backward alike): no
    mask is stored.
    """

    def _attention_dropout_args(self, dropout_p, seed, offsets, dims, firsts, drop_strides):
        """The kernels' dropout arguments (offsets, seed, threshold, scale, head stride, row stride):
        counter offsets[b] + h head_stride + i row_stride + j of probability (h, i, j) of batch row
        b; drop_strides None: (Tq Tk, Tk), the [H, Tq, Tk] probabilities' own places; given: the
        whole sequence's, with the tile's first query's and key's global indices firsts = (q_first,
        k_first) folded into offsets[b] (q_first row_stride + k_first). offsets an int: batch rows
        follow each other (H head_stride apart)."""
        B, Hkv, G, Tq, Tk, _, _ = dims
        p = float(dropout_p)
        if not 0.0 <= p <= 1.0:
            raise KernelArgumentError(f"dropout_p={p} outside [0, 1]")
        head_stride, row_stride = (Tq * Tk, Tk) if drop_strides is None else (int(s) for s in drop_strides)
        if p == 0.0:
            return None, np.uint64(0), np.uint32(0), np.float32(1.0), np.int64(0), np.int64(0)
        row_elems = Hkv * G * head_stride
        rows = list(offsets) if isinstance(offsets, (list, tuple)) else [int(offsets) + b * row_elems for b in range(B)]
        if len(rows) != B:
            raise KernelArgumentError(f"{len(rows)} dropout offsets for {B} batch rows")
        if drop_strides is not None:
            rows = [int(o) + int(firsts[0]) * row_stride + int(firsts[1]) for o in rows]
        wrapped = np.array([int(o) & MASK64 for o in rows], dtype=np.uint64).view(np.int64)
        return (self.xp.asarray(wrapped), np.uint64(int(seed) & MASK64), np.uint32(keep_threshold(p)),
                np.float32(0.0 if p == 1.0 else 1.0 / (1.0 - p)), np.int64(head_stride), np.int64(row_stride))

    def _mask(self, dims, q_first, k_first, window, softcap, documents):
        """((q_first, k_first), the kernels' mask arguments (diag, window, softcap, q_docs,
        k_docs)) of the module docstring's rule; defaults: the last Tq of Tk positions."""
        B, _, _, Tq, Tk, _, _ = dims
        if q_first is None and k_first is None and Tq > Tk:
            raise KernelArgumentError(f"causal attention needs Tq <= Tk, got Tq={Tq}, Tk={Tk} (or q_first, k_first)")
        q_first = Tk - Tq if q_first is None else int(q_first)
        k_first = 0 if k_first is None else int(k_first)
        diag, win = mask_band(Tq, Tk, q_first - k_first, None if window is None else int(window))
        if softcap is not None and not float(softcap) > 0.0:
            raise KernelArgumentError(f"softcap={softcap}: the soft cap is a positive number (or None)")
        docs = (None, None)
        if documents is not None:
            xp = self.xp
            docs = tuple(documents)
            for name, d, n in zip(("q_docs", "k_docs"), docs, (Tq, Tk)):
                if not isinstance(d, xp.ndarray) or d.dtype != np.int32 or d.shape != (B, n) \
                        or not d.flags.c_contiguous:
                    raise KernelArgumentError(f"documents: {name} must be a contiguous int32 {xp.__name__} array of "
                                              f"shape {(B, n)} (ids non-decreasing along the sequence), got "
                                              f"{getattr(d, 'dtype', type(d).__name__)} {getattr(d, 'shape', '')}")
        return (q_first, k_first), (np.int32(diag), np.int32(win), np.float32(softcap or 0.0), *docs)

    @staticmethod
    def _outputs(xp, name, a, like):
        """(the T pointer, the float32 pointer, strides) of output a: one pointer is None."""
        if not isinstance(a, xp.ndarray) or a.shape != like.shape or a.dtype not in (like.dtype, np.float32):
            raise KernelArgumentError(f"out {name} must be a {xp.__name__} array of shape {like.shape} and dtype "
                                      f"{like.dtype} or float32")
        if not kernel_layout(a, output=True):
            raise KernelArgumentError(f"out {name} has strides {a.strides}: the kernels write a contiguous head "
                                      "dim at non-negative, non-zero strides (a broadcast view would have several "
                                      "blocks write each element); pass out=None and copy")
        span, strides = strided_span(xp, a)
        return (span, None, strides) if a.dtype == like.dtype else (None, span, strides)

    def _check(self, q, k, v):
        xp = self.xp
        for name, a in (("q", q), ("k", k), ("v", v)):
            if not isinstance(a, xp.ndarray):
                raise KernelArgumentError(f"{name} must be a {xp.__name__} array, got {type(a).__name__}")
        if q.ndim != 5 or k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3] or q.shape[:2] != k.shape[:2] \
                or q.shape[4] != k.shape[3]:
            raise KernelArgumentError(f"attention needs q [B, Hkv, G, Tq, D], k [B, Hkv, Tk, D] and v [B, Hkv, Tk, DV]; "
                                      f"got q {q.shape}, k {k.shape}, v {v.shape}")
        why = fused_attention_supported(q, k, v)
        if why:
            raise KernelArgumentError(why)
        B, Hkv, G, Tq, D = q.shape
        Tk = k.shape[2]
        # grids (B * Hkv * G, query tiles) and (B * Hkv, key tiles)
        if B * Hkv * G > MAX_GRID_X or max(ceil_div(Tq, attention_tile_rows("forward", D)),
                                           ceil_div(Tk, attention_tile_rows("backward_dkdv", D))) > MAX_GRID_Y:
            raise KernelArgumentError(f"attention of {B * Hkv * G} heads of Tq={Tq}, Tk={Tk} exceeds the kernels' "
                                      "grid limits")
        return q.shape[:4] + (k.shape[2], q.shape[4], v.shape[3])

    def attention_forward(self, q, k, v, scale: float, dropout_p: float = 0.0, seed: int = 0, offsets=0, *,
                          q_first=None, k_first=None, window=None, softcap=None, documents=None,
                          drop_strides=None, out_dtype=None):
        """(o, lse): o = dropout(softmax(scores, masked)) v in q's dtype (out_dtype float32: in
        float32), [B, Hkv, G, Tq, DV] (a view of token-major memory [B, Tq, Hkv, G, DV]), lse
        [B, Hkv, G, Tq] float32, the rows' log-sum-exp of the (capped) scaled scores (what the
        backward recomputes the probabilities from). q_first, k_first, window, softcap, documents:
        the mask (module docstring); drop_strides: a tile's (:meth:`_attention_dropout_args`).
        Allocates o and lse (and, with dropout, the B offsets)."""
        xp = self.xp
        dims = B, Hkv, G, Tq, Tk, D, DV = self._check(q, k, v)
        firsts, mask = self._mask(dims, q_first, k_first, window, softcap, documents)
        out_dtype = q.dtype if out_dtype is None else np.dtype(out_dtype)
        if out_dtype not in (q.dtype, np.float32):
            raise KernelArgumentError(f"out_dtype {out_dtype}: the forward writes o in q's dtype {q.dtype} or float32")
        drop = self._attention_dropout_args(dropout_p, seed, offsets, dims, firsts, drop_strides)
        o_tokens = xp.empty((B, Tq, Hkv, G, DV), dtype=out_dtype)
        lse = xp.empty((B, Hkv, G, Tq), dtype=np.float32)
        if o_tokens.size:
            qs, q_st = strided_span(xp, q)
            ks, k_st = strided_span(xp, k)
            vs, v_st = strided_span(xp, v)
            R = attention_tile_rows("forward", D)
            self._launch("attention", f"attention_forward_{dtype_suffix(q.dtype)}_{head_dims_suffix(D, DV)}",
                         (B * Hkv * G, ceil_div(Tq, R)),
                         (2 * R,),
                         (*((o_tokens, None) if out_dtype == q.dtype else (None, o_tokens)), lse, qs, ks, vs,
                          int32_arg("Hkv", Hkv), int32_arg("G", G), int32_arg("Tq", Tq), int32_arg("Tk", Tk),
                          *mask, *q_st[:4], *k_st[:3], *v_st[:3], np.float32(scale), *drop),
                         shared_mem=attention_shared_bytes("forward", q.dtype, D, DV))
        return o_tokens.transpose(0, 2, 3, 1, 4), lse

    def attention_backward(self, do, q, k, v, o, lse, scale: float, out=None, dropout_p: float = 0.0, seed: int = 0,
                           offsets=0, *, rowdot=None, q_first=None, k_first=None, window=None, softcap=None,
                           documents=None, drop_strides=None, accumulate: bool = False):
        """(dq, dk, dv) of attention_forward's (o, lse) for do shaped like o ([B, Hkv, G, Tq, DV]; any strides with a
        contiguous head dim), with the forward's dropout, mask and drop_strides. out:
        optional (dq, dk, dv) arrays of q's, k's, v's shapes, each in q's dtype or float32, to
        write (views of one packed buffer are fine) or, with accumulate, to add the gradients to;
        new contiguous arrays otherwise. rowdot: the rows' sum(do * o), float32 [B, Hkv, G, Tq]
        contiguous (a ring tile's: of the merged o; o is then unused, may be None); without it
        the launcher computes it (scratch of that shape) from o."""
        xp = self.xp
        dims = B, Hkv, G, Tq, Tk, D, DV = self._check(q, k, v)
        firsts, mask = self._mask(dims, q_first, k_first, window, softcap, documents)
        o_shape = q.shape[:4] + (DV,)
        rows_shape = (B, Hkv, G, Tq)
        for name, a in (("do", do), ("o", o)):
            if name == "o" and rowdot is not None:
                continue
            if not isinstance(a, xp.ndarray) or a.shape != o_shape or a.dtype != q.dtype:
                raise KernelArgumentError(f"{name} must be a {xp.__name__} array of o's shape {o_shape} and q's dtype "
                                          f"{q.dtype}, got {getattr(a, 'shape', type(a).__name__)}")
        for name, a in (("lse", lse), ("rowdot", rowdot)):
            if name == "rowdot" and a is None:
                continue
            if not isinstance(a, xp.ndarray) or a.dtype != np.float32 or a.shape != rows_shape \
                    or not a.flags.c_contiguous:
                raise KernelArgumentError(f"{name} must be a contiguous float32 array of shape {rows_shape}")
        if out is None:
            if accumulate:
                raise KernelArgumentError("accumulate adds the gradients to out: pass out=(dq, dk, dv)")
            out = (xp.empty(q.shape, q.dtype), xp.empty(k.shape, k.dtype), xp.empty(v.shape, v.dtype))
        (dq_t, dq_f, dq_st), (dk_t, dk_f, dk_st), (dv_t, dv_f, dv_st) = (
            self._outputs(xp, name, a, like) for name, a, like in zip(("dq", "dk", "dv"), out, (q, k, v)))
        dq, dk, dv = out
        if dq.size == 0 or dk.size == 0:
            if dk.size and not accumulate:
                dk[...] = 0
                dv[...] = 0
            return out
        drop = self._attention_dropout_args(dropout_p, seed, offsets, dims, firsts, drop_strides)
        sfx = f"{dtype_suffix(q.dtype)}_{head_dims_suffix(D, DV)}"
        dims = (int32_arg("Hkv", Hkv), int32_arg("G", G), int32_arg("Tq", Tq))
        (qs, q_st), (ks, k_st), (vs, v_st) = strided_span(xp, q), strided_span(xp, k), strided_span(xp, v)
        dos, do_st = strided_span(xp, do)
        if rowdot is None:
            n_rows = B * Hkv * G * Tq
            rowdot = xp.empty(rows_shape, dtype=np.float32)
            os_, o_st = strided_span(xp, o)
            self._launch("attention", f"attention_backward_rowdot_{dtype_suffix(q.dtype)}_d{DV}",
                         (ceil_div(n_rows, ROWDOT_WARPS),),
                         (32 * ROWDOT_WARPS,), (rowdot, os_, dos, *dims, *o_st[:4], *do_st[:4], np.int64(n_rows)))
        common = (qs, ks, vs, dos, lse, rowdot, *dims, int32_arg("Tk", Tk), *mask, *q_st[:4], *k_st[:3],
                  *v_st[:3], *do_st[:4])
        acc = np.int32(bool(accumulate))
        R = attention_tile_rows("backward_dq", D)
        self._launch("attention", f"attention_backward_dq_{sfx}", (B * Hkv * G, ceil_div(Tq, R)), (2 * R,),
                     (dq_t, dq_f, acc, *common, *dq_st[:4], np.float32(scale), *drop),
                     shared_mem=attention_shared_bytes("backward_dq", q.dtype, D, DV))
        R = attention_tile_rows("backward_dkdv", D)
        self._launch("attention", f"attention_backward_dkdv_{sfx}", (B * Hkv, ceil_div(Tk, R)), (2 * R,),
                     (dk_t, dv_t, dk_f, dv_f, acc, *common, *dk_st[:3], *dv_st[:3], np.float32(scale), *drop),
                     shared_mem=attention_shared_bytes("backward_dkdv", q.dtype, D, DV))
        return out


# The mutation campaign's --quick selection (tools/mutate_kernels.py), pytest node ids under
# tests/kernels/ run in this order: with -x a mutant stops at its first failure, so the checked
# build's tests come first and the grid, which needs the second, unchecked build, last. ~10 s of
# tests plus two 5 s builds, against ~40 s plus builds for the files; a mutant that survives it is
# re-run on the files (--ids, without --quick) before it counts as a survivor.
_ATT = "test_attention.py::"


def _scheduled(schedule):  # (pytest drops an id that a later whole-function id repeats: ids only)
    return [f"{_ATT}test_attention_under_each_schedule[emulated-{schedule}-{case}-{dt}]"
            for case in ("B2-kv1-g2-T17-d64", "B1-kv2-g1-T70-d64", "B1-kv1-g2-T33-d128", "B1-kv1-g1-T70-d128")
            for dt in ("f32", "bf16")]


_MASK = "test_attention_mask.py::"

QUICK_TESTS = (
    # tests written for survivors of the first attention campaign (cheap, checked build)
    _ATT + "test_scores_far_below_zero",
    # the mask rule (window, soft cap, documents, ring tiles; tiles skipped, not masked)
    _MASK + "test_tiles_outside_the_window_are_skipped",
    _MASK + "test_tiles_above_the_diagonal_are_skipped",
    _MASK + "test_tiles_of_other_documents_are_skipped",
    *[f"{_MASK}test_the_mask_rule_on_the_kernels[emulated-{case}]"
      for case in ("ring-rows-see-nothing-f32", "documents-ring-tile-f32", "window37-T70-gqa-f32",
                   "window30-dropout-kvcache-20x129-f32", "softcap-T70-d128-f32",
                   "documents-window-softcap-dropout-d128-f32", "documents-T130-f32", "window70-softcap-T100-f32",
                   "ring-window-40x40-f32", "documents-negative-ids-full-tile-f32", "window37-T70-gqa-bf16",
                   "softcap-T70-d128-bf16", "documents-T130-bf16")],
    # checked build (race detector, bounds): tile edges at head dims 64 / 128, the forward
    # schedule first (most mutants die there), the other schedules after the launcher tests
    *_scheduled("forward"),
    # dropout in all three kernels (per-row offsets, Tq < Tk, p = 1), one schedule
    *[f"{_ATT}test_attention_dropout[emulated-forward-{case}-{dt}]"
      for case in ("p0.1-70x70-d64", "p0.5-33x33-d128", "p0.3-20x50-d64", "p1.0-24x24-d64")
      for dt in ("f32", "bf16")],
    _ATT + "test_strided_operands_and_packed_gradients",
    _ATT + "test_fewer_queries_than_keys",
    _ATT + "test_scores_far_apart",
    # a ring tile's arguments: diagonal shifts, global dropout counters, float32 accumulation
    "test_attention_tiles.py::test_a_ring_tile_pair_on_the_kernels",
    "test_attention_tiles.py::test_diagonal_shifts",
    *_scheduled("warp-reverse"), *_scheduled("random"),
    # MLA's head dims (q, k 192; v 128): every kernel's D / DV tiles, the mask, a ring tile
    *[f"test_attention_head_dims.py::test_mla_head_dims_on_the_kernels[emulated-{case}]"
      for case in ("gqa-T40-f32", "window-documents-dropout-T70-f32", "softcap-kvcache-20x50-f32", "gqa-T40-bf16",
                   "window-documents-dropout-T70-bf16")],
    "test_attention_head_dims.py::test_mla_head_dims_under_each_schedule",
    "test_attention_head_dims.py::test_a_ring_tile_at_mla_head_dims",
    # unchecked build: issue 42's element-wise class (fastmath), a few grid cases (one query row;
    # GQA 4 at 200 rows; 513 rows)
    _ATT + "test_probabilities_within_ulps_of_expf",
    *[f"{_ATT}test_attention_grid[emulated-{case}-{dt}]"
      for case in ("B2-kv4-g1-T1-d64", "B2-kv1-g4-T1-d128", "B1-kv1-g4-T200-d128", "B1-kv1-g4-T200-d64",
                   "B1-kv1-g1-T513-d64")
      for dt in ("f32", "bf16")],
)

# Fused attention: shared memory (tiles of Q, K, V, scores, float accumulators) decides how many
# blocks fit, 1-2 per SM; the targets say registers must not lower that. The tile kernels are
# compute-bound (4 T^2 D / 2 multiply-adds per head against O(T D) bytes): their bound is TFLOP/s,
# measured by `cutp bench kernels --ops attention`.
_TILE_KERNELS = ("forward", "backward_dq", "backward_dkdv")
_DIMS = {head_dims_suffix(d, dv): (d, dv) for d, dv in ATTENTION_HEAD_DIMS}  # d64, d128, d192v128
FAMILY = KernelFamily(
    "attention", ("attention",), AttentionLaunchers,
    targets={
        "attention_forward_d64": Target(128, 2, "84 KiB (f32) / 60 KiB (bf16) of tiles: 2 blocks per SM on sm_80"),
        "attention_forward_d128": Target(128, 1, "150 KiB (f32) / 112 KiB (bf16) of tiles: 1 block per SM"),
        "attention_forward_d192v128": Target(64, 2, "86 KiB (f32) / 57 KiB (bf16) of 32-row tiles: 2 blocks on sm_90"),
        "attention_backward_rowdot_d64": Target(256, 8, "a warp per row, elementwise"),
        "attention_backward_rowdot_d128": Target(256, 8, "a warp per row, elementwise"),
        "attention_backward_dq_d64": Target(128, 1, "119 KiB (f32) / 98 KiB (bf16) of tiles: 1 block per SM"),
        "attention_backward_dq_d128": Target(64, 2, "92 KiB (f32) / 73 KiB (bf16) of 32-row tiles: 2 blocks on sm_90"),
        "attention_backward_dq_d192v128": Target(64, 1, "114 KiB (f32) / 78 KiB (bf16) of 32-row tiles: 1 block per SM"),
        "attention_backward_dkdv_d64": Target(128, 1, "136 KiB (f32) / 125 KiB (bf16) of tiles: 1 block per SM"),
        "attention_backward_dkdv_d128": Target(64, 2, "109 KiB (f32) / 83 KiB (bf16) of 32-row tiles: 2 on sm_90"),
        "attention_backward_dkdv_d192v128": Target(64, 1, "131 KiB (f32) / 97 KiB (bf16) of 32-row tiles: 1 per SM"),
    },
    traffic={f"attention_backward_rowdot_d{d}": Traffic(2, ops=2, what="read o, do; a float per row")
             for d in (64, 128)},
    compute_bound=frozenset(f"attention_{kernel}_{sfx}" for kernel in _TILE_KERNELS for sfx in _DIMS),
    dynamic_shared={f"attention_{kernel}_{sfx}": DynamicShared(
        "attention_shared_bytes", lambda _d, kernel=kernel, d=d, dv=dv: max(
            attention_shared_bytes(kernel, np.float32, d, dv), attention_shared_bytes(kernel, np.uint16, d, dv)), d, d,
        width="head dim") for kernel in _TILE_KERNELS for sfx, (d, dv) in _DIMS.items()},
    tests=("test_attention.py", "test_attention_tiles.py", "test_attention_mask.py", "test_attention_head_dims.py"),
    mutation_classes=("skiptile", "softcap", "fastmath", "headdim"), quick_tests=QUICK_TESTS)
