"""The op-level half of `cutp.plan.step_memory`'s walk of a training step: what cutp's ops and
collectives allocate, keep for backward and free (LayerNorm, the linear layers, dropout, the
attention op's plain and blocked paths, GeLU, the all-gathers and reduce-scatters of sequence
parallelism), booked on the simulated heap in the order of their code (cutp/ops/*.py,
cutp/tensor_parallel/mappings.py, cutp/comm/mpi.py). step_memory calls them in the order of the
model's forward and backward.
"""
from __future__ import annotations

import numpy as np

from ..kernels.attention import ATTENTION_HEAD_DIMS
from ..ops import _common
from ..ops import attention as attention_op
from ..tensor_parallel.sharding import kv_heads_of_rank
from .step_shape import ELIDE_BYTES, ITEMSIZE, POOL_ROUND, Heap, StepShape


class OpWalk:
    """The ops of one rank's training step on a Heap; `cutp.plan.step_memory._Walk` adds the model."""

    def __init__(self, s: StepShape):
        self.s = s
        self.cpu = s.device == "cpu"
        self.heap = Heap(1 if self.cpu else POOL_ROUND)
        self.a = ITEMSIZE[s.dtype]
        self.c = 8 if s.dtype == "float64" else 4
        self.direct = self.a == self.c
        self.kern = (not self.cpu) and s.kernels and s.dtype in ("float32", "bfloat16")
        self.N = s.micro_batch * s.seq_len
        self.sp = s.sp
        self.Ns = self.N // s.tp if self.sp else self.N  # token rows between the TP regions (a shard under SP)
        self.h = s.n_embd
        self.nq = s.n_head // s.tp
        self.hd = s.n_embd // s.n_head
        self.nkv = len(kv_heads_of_rank(s.n_head, s.n_kv_head, s.tp, s.tp_rank))
        self.g = self.nq // self.nkv
        self.qkvw = (self.nq + 2 * self.nkv) * self.hd
        self.f = s.hidden // s.tp
        self.vl = s.padded_vocab // s.tp
        self.n_valid = max(0, min(s.vocab - s.tp_rank * self.vl, self.vl))
        self.drop = s.dropout > 0
        # a GPU's attention: the fused kernels (kernels/attention.cu) where they apply
        self.fused = self.kern and self.hd in ATTENTION_HEAD_DIMS

    def blocks(self, n_rows, width):
        """(largest block rows, blocks in flight at once) of a row-blocked op."""
        if not self.cpu:
            return n_rows, 1
        bl = _common.row_blocks(np, n_rows, width)
        return max(b.stop - b.start for b in bl), self.conc(len(bl))

    def conc(self, n_items):
        return min(self.s.threads, n_items) if (self.cpu and n_items >= 2) else 1

    def add_residual(self, out, x, y):
        """out = x + y, y a temporary: NumPy reuses y's buffer from ELIDE_BYTES (then y is out)."""
        H = self.heap
        n = H.live[y]
        if self.cpu and n >= ELIDE_BYTES:
            H.live[out] = H.live.pop(y)
        else:
            H.alloc(out, n)
            H.free(y)

    def layernorm_fwd(self, k, keep=True):
        """LayerNorm of the Ns rows between the TP regions; its statistics die with its ctx unless kept."""
        self._layernorm_fwd(k)
        if not keep:
            self.heap.free(f"{k}.stats")

    def _layernorm_fwd(self, k):
        H, N, h, c = self.heap, self.Ns, self.h, self.c
        H.alloc(f"{k}.y", N * h * self.a)
        H.alloc(f"{k}.stats", 2 * N * (4 if self.kern else c))
        if self.kern:
            return
        rows, par = self.blocks(N, h)
        per = 2 * rows * c + h * c + (0 if self.direct else 2 * rows * h * c)
        H.temp(par * per, what=f"{k} forward")

    def layernorm_bwd(self, k, dx):
        H, N, h, c = self.heap, self.Ns, self.h, self.c
        H.alloc(dx, N * h * self.a)
        if self.kern:
            H.temp(2 * 64 * h * 4, what=f"{k} backward")
            return
        rows, par = self.blocks(N, h)
        per = rows * h * c * (1 if self.direct else 4) + 3 * rows * c + 3 * h * c
        H.temp(2 * h * c + par * per, what=f"{k} backward")

    def linear_fwd(self, key, n_in, n_out):
        """y = x @ w (+ b) into a new array `key` [N, n_out]."""
        H, N, a, c = self.heap, self.N, self.a, self.c
        if self.direct:
            H.alloc(key, N * n_out * a)
            return
        H.temp(N * n_in * c, n_in * n_out * c, N * n_out * c, what=f"{key} (float32 copies)")
        H.temp(N * n_out * c, N * n_out * a, what=key)
        H.alloc(key, N * n_out * a)

    def linear_bwd(self, key, n_in, n_out, dx=True, bias=False):
        """dw (a temporary [n_in, n_out]), db, and dx [N, n_in] into `key` (when dx)."""
        H, N, a, c = self.heap, self.N, self.a, self.c
        small = (N + n_out) * c if bias else 0
        if self.direct:
            dw = n_in * n_out * a
            if dx:
                H.temp(dw, small, N * n_in * a, what=f"{key} (dW, dx)")
                H.alloc(key, N * n_in * a)
            else:
                H.temp(dw, small, what=f"{key} (dW)")
            return
        copies = N * n_out * c + N * n_in * c  # dy and x in float32, alive through the function
        dw = n_in * n_out * c  # kept in float32 for the float32 gradient buffer (main_grad)
        H.temp(copies, dw, small, what=f"{key} (dW)")
        if dx:  # w in float32, dx in float32, then rounded
            H.temp(copies, dw, small, n_in * n_out * c, N * n_in * (c + a), what=f"{key} (dx)")
            H.alloc(key, N * n_in * a)

    def dropout_fwd(self, key, n, itemsize=None, keep=True, part_of_rows=None):
        """y = dropout(x) of n elements: a new y and a bool mask (p > 0 only), kept unless `keep`
        is False. When this rank holds a part of each batch row (`part_of_rows`; default: the
        sequence shards of SP), the rows are not contiguous in the counter space: with B > 1
        each row's mask is drawn apart, then they are stacked."""
        H = self.heap
        a = self.a if itemsize is None else itemsize
        if self.kern:
            H.alloc(key, n * a)
            H.alloc(key + ".mask", n)
        else:
            self._dropout_fwd(key, n, a, self.sp if part_of_rows is None else part_of_rows)
        if not keep:
            H.free(key + ".mask")

    def _dropout_fwd(self, key, n, a, part_of_rows):
        H, B = self.heap, self.s.micro_batch
        if part_of_rows and B > 1:
            row = n // B
            blk = min(row, _common.ELEMENTWISE_BLOCK) if self.cpu else row
            H.temp(n, 2 * 8 * blk, what=f"{key} row masks")  # the rows drawn so far and the last row's blocks
            H.temp(2 * n, what=f"{key} masks stacked")
            H.alloc(key + ".mask", n)
        else:
            H.alloc(key + ".mask", n)
            H.temp(2 * 8 * (min(n, _common.ELEMENTWISE_BLOCK) if self.cpu else n), what=f"{key} mask")
        if a != self.c:
            H.temp(n * self.c, what=key)
        H.alloc(key, n * a)

    def sp_gather(self, src, out, width):
        """gather_from_sp_forward of `src` [Ns, width] into a new `out` [N, width] (src stays):
        with B > 1 the shard is copied sequence-first, gathered, and the result copied back."""
        H, a = self.heap, self.a
        if self.s.micro_batch > 1:
            H.alloc(f"{out}.moved", self.Ns * width * a)
            H.alloc(f"{out}.g", self.N * width * a)
            H.free(f"{out}.moved")
            H.alloc(out, self.N * width * a)
            H.free(f"{out}.g")
        else:  # [T, 1, w] is already contiguous both ways: the gathered array itself
            H.alloc(out, self.N * width * a)

    def sp_reduce_scatter(self, src, out, width):
        """reduce_scatter_to_sp_forward of `src` [N, width] into a new `out` [Ns, width] (src stays);
        16-bit: reduced in float32 (a float32 copy of the input, a float32 result, rounded)."""
        H, a = self.heap, self.a
        moved = self.s.micro_batch > 1
        if moved:
            H.alloc(f"{out}.moved", self.N * width * a)
        if a == 2:
            H.alloc(f"{out}.acc", self.Ns * width * 4)
            H.temp(self.N * width * 4, what=f"{out} reduce-scatter (float32)")
            H.alloc(f"{out}.r", self.Ns * width * a)
            H.free(f"{out}.acc")
        else:
            H.alloc(f"{out}.r", self.Ns * width * a)
        if moved:
            H.free(f"{out}.moved")
            H.alloc(out, self.Ns * width * a)
            H.free(f"{out}.r")
        else:
            H.live[out] = H.live.pop(f"{out}.r")

    def row_out(self, key):
        """A row projection's output `key` (partial sums [N, h]) into what follows it: all-reduced
        in place, or reduce-scattered along the sequence into `key`.rs (the partial sums dropped)."""
        if not self.sp:
            return key
        self.sp_reduce_scatter(key, f"{key}.rs", self.h)
        self.heap.free(key)
        return f"{key}.rs"

    def column_in(self, dx):
        """A column projection's input gradient `dx` [N, h]: all-reduced in place, or
        reduce-scattered into its shard (returned key; dx dropped)."""
        if not self.sp:
            return dx
        self.sp_reduce_scatter(dx, f"{dx}.rs", self.h)
        self.heap.free(dx)
        return f"{dx}.rs"

    def attention_fwd(self, L, again=False):
        """After c_attn: the attention op; returns c_proj's input (kept for backward). 16-bit
        q, k, v are multiplied in float32: each piece (or the whole op) works on float32 copies,
        and the probabilities it keeps are float32. `again`: selective recomputation's second
        forward in backward (its output, `L`.o2, is not merged and lives to the end of backward)."""
        s, H = self.s, self.heap
        B, T, a, e = s.micro_batch, s.seq_len, self.a, self.c
        if self.fused:  # o (token-major: merging the heads is a view) and the rows' log-sum-exp
            H.alloc(f"{L}.o", self.N * self.nq * self.hd * a)
            H.alloc(f"{L}.lse", B * self.nq * T * 4)
            if self.drop:
                H.temp(8 * B, what=f"{L} attention dropout offsets")
            return f"{L}.o"
        if self.cpu and not self.drop:
            H.alloc(f"{L}.o2" if again else f"{L}.o", self.N * self.nq * self.hd * a)
            pieces = attention_op._pieces(B, self.nkv, self.g, T, T)
            probs, worst = 0, 0
            for piece in pieces:
                p_bytes, p_worst = self._attention_piece_fwd(piece, T)
                probs += p_bytes
                worst = max(worst, p_worst)
            H.alloc(f"{L}.probs", probs)
            H.temp(self.conc(len(pieces)) * worst, what=f"{L} attention forward")
            return f"{L}.o"
        # the plain composition: whole score matrices (a GPU, or attention dropout)
        S = B * self.nq * T * T
        qh, kvh = self.N * self.nq * self.hd, self.N * self.nkv * self.hd
        copies = 0 if self.direct else (qh + 2 * kvh) * e
        H.alloc(f"{L}.copies", copies)
        H.alloc(f"{L}.scores", S * e)
        if not self.kern:
            H.temp(T * T * (self.c + 1), 2 * B * self.nq * T * self.c, what=f"{L} softmax")
        H.alloc(f"{L}.probs", S * e)
        if self.drop:
            self.dropout_fwd(f"{L}.pdrop", S, itemsize=e, part_of_rows=self.s.tp > 1)
        if not self.direct:
            H.temp(qh * e, what=f"{L} attention output")
        H.alloc(f"{L}.o2" if again else f"{L}.o_heads", qh * a)
        H.free(f"{L}.scores", f"{L}.copies")
        if again:
            return f"{L}.o2"
        H.alloc(f"{L}.o", qh * a)  # merging the heads copies
        return f"{L}.o"

    def _attention_piece_fwd(self, piece, T):
        """(probabilities kept, the largest transient) of one piece of the blocked forward."""
        e, hd = self.c, self.hd  # inside the op everything is in the compute dtype
        b, hc = _piece_dims(piece)
        m = b * hc * self.g
        copies = 0 if self.direct else (m * T * hd + 2 * b * hc * T * hd) * e  # q, k, v of the piece
        kept, worst = 0, 0
        prev_s = prev_o = 0
        for r0, r1 in attention_op._query_blocks(m * T * T, T, T):
            rows, keys = r1 - r0, r1  # a block's last query sees keys [0, r1) (Tq == Tk)
            s_ = m * rows * keys * e
            o_ = m * rows * hd * e
            worst = max(worst,
                        kept + prev_s + prev_o + s_,
                        kept + prev_o + s_ + rows * keys * (self.c + 1) + s_,
                        kept + s_ + s_ + prev_o + o_)
            kept += s_
            prev_s, prev_o = s_, o_
        return kept, copies + worst - kept

    def attention_bwd(self, L):
        """The op's backward into dqkv (allocated by the caller)."""
        s, H = self.s, self.heap
        B, T, e = s.micro_batch, s.seq_len, self.c
        if self.fused:  # the rows' sum(do * o); dq, dk, dv go straight into dqkv
            H.temp(B * self.nq * T * 4 + (8 * B if self.drop else 0), what=f"{L} attention backward")
            return
        if self.cpu and not self.drop:
            pieces = attention_op._pieces(B, self.nkv, self.g, T, T)
            worst = max(self._attention_piece_bwd(p, T) for p in pieces)
            H.temp(self.conc(len(pieces)) * worst, what=f"{L} attention backward")
            return
        S = B * self.nq * T * T * e
        qh = self.N * self.nq * self.hd * e
        kvh = self.N * self.nkv * self.hd * e
        copies = 0 if self.direct else 2 * qh + 2 * kvh  # q, k, v, do in float32
        # dv (from a [.., g, ..] product), dp (and dropout's copy of it), ds, dq, dk (from a product):
        # the locals live to the end of the function
        H.temp(copies + max(qh + kvh, kvh + 2 * S if self.drop else 0, 2 * kvh + 2 * S + 2 * qh),
               what=f"{L} attention backward")

    def _attention_piece_bwd(self, piece, T):
        e, hd, g = self.c, self.hd, self.g
        b, hc = _piece_dims(piece)
        m = b * hc * g
        base = 2 * b * hc * T * hd * e  # dk, dv of the piece
        if not self.direct:
            base += (2 * m * T * hd + 2 * b * hc * T * hd) * e  # q, k, v, do of the piece in float32
        worst = 0
        prev_pk = prev_ds = 0
        for r0, r1 in attention_op._query_blocks(m * T * T, T, T):
            rows, keys = r1 - r0, r1
            pv = m * keys * hd * e
            gsum = b * hc * keys * hd * e if g > 1 else 0
            sc = m * rows * keys * e
            dq = m * rows * hd * e
            worst = max(worst,
                        prev_pk + prev_ds + pv + gsum,
                        prev_ds + pv + sc + sc,
                        pv + sc + dq,
                        pv + sc + pv + gsum)
            prev_pk, prev_ds = pv, sc
        return base + worst

    def layernorm_and_gather(self, k, keep):
        """A LayerNorm and, under SP, the all-gather of its output before the column projection:
        returns the key of the projection's input (`k`.y, or the gathered `k`.g)."""
        self.layernorm_fwd(k, keep)
        if not self.sp:
            return f"{k}.y"
        self.sp_gather(f"{k}.y", f"{k}.g", self.h)
        return f"{k}.g"

    def row_in(self, d, key):
        """A row projection's output gradient as its backward uses it: `d` itself, or under SP
        `d` all-gathered along the sequence into `key`."""
        if not self.sp:
            return d
        self.sp_gather(d, key, self.h)
        return key

    def gelu_fwd(self, L):
        H, N, f, a, c = self.heap, self.N, self.f, self.a, self.c
        if self.s.bias:
            H.alloc(f"{L}.pre", N * f * a)
        H.alloc(f"{L}.act", N * f * a)
        if self.kern:
            return
        rows, par = self.blocks(N, f) if self.s.bias else _flat(self, N * f)
        width = f if self.s.bias else 1
        per = rows * width * c
        k = (0 if self.direct else 2) + (4 if self.s.gelu != "tanh" else 0)
        H.temp(par * k * per, what=f"{L} GeLU forward")

    def gelu_bwd(self, L, dh):
        H, N, f, c = self.heap, self.N, self.f, self.c
        H.alloc(dh, N * f * self.a)
        if self.kern:
            H.temp(64 * f * 4 + f * 4, what=f"{L} GeLU backward")
            return
        k = (1 if self.direct else 4) + (4 if self.s.gelu != "tanh" else 0)
        if self.s.bias:  # row blocks, each with its bias-gradient column sum
            rows, par = self.blocks(N, f)
            H.temp(f * c + par * (k * rows * f * c + rows * c + f * c), what=f"{L} GeLU backward")
        else:  # flat blocks
            n, par = _flat(self, N * f)
            H.temp(par * k * n * c, what=f"{L} GeLU backward")


def _piece_dims(piece):
    """(batch rows, KV heads) of an attention piece."""
    bs, hs = piece
    return bs.stop - bs.start, hs.stop - hs.start


def _flat(walk, n):
    if not walk.cpu:
        return n, 1
    bl = _common.flat_blocks(np, n)
    return max(b.stop - b.start for b in bl), walk.conc(len(bl))
