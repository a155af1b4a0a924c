"""The activation memory of one cutp training step, simulated array by array (`bench plan`'s model).

`step_peak(shape)` walks one training step in the order cutp's code runs it (cutp/train/step.py,
cutp/model.py, cutp/tensor_parallel/*.py, cutp/ops/*.py) and books every array the step
allocates and frees on a simulated heap; the answer is the heap's high-water mark, i.e. what
`cutp.train.memory.ActivationPeak` measures: the peak above the memory live when the step began.

What it books, per micro-batch of N = b*s rows (act = the activation dtype, c = the compute
dtype: float32 for 16-bit activations, else act's own):

* cached for backward, per layer: the block's input (held by ln_1), ln_1's output and its
  mean/rstd, the fused QKV projection, the attention's probabilities (the CPU keeps only the
  causal query blocks it computed, a GPU the whole [b, heads, s, s] matrix), the attention
  output, the residual sum after attention, ln_2's output and statistics, the MLP's
  pre-activation and GeLU output; then ln_f's output, the logits [N, V/tp] and the loss's per-row
  statistics. Backward frees each layer's share as it leaves the layer.
* transients: each op's outputs and gradients while they are alive (Python drops an array
  when its last name goes), the weight-gradient products [in, out], the row-blocked ops'
  work buffers (`cutp.ops._common.row_blocks`, as many at once as the ops' threads run), the
  blocked attention's per-block scores, the float32 copies of 16-bit operands, NumPy's reuse
  of a temporary operand of `+` (arrays of 256 KiB and more), the optimizer update's blocks.

It reuses the ops' own blocking functions (row blocks, attention pieces and query blocks), so
a change of those constants moves the prediction with the code; a change of the code's order
of allocations needs this walk updated, and tests/test_memory.py says so (measured = planned
within 10% on tiny models on the CPU). Python object headers are not counted (under 1%).
16-bit models (the ops' float32 copies of 16-bit operands, the attention in float32, the float32
weight gradients) are checked on the CPU like the others. The GPU walk (kernels for
float32/bfloat16, the unblocked attention, in-place NCCL collectives, the pool's 512-byte
rounding) follows the same code paths but has not been checked against a GPU measurement.
With several op threads, blocks that may run at once are counted at once (an upper bound: the
measured peak of the optimizer update, for one, depends on how the threads happen to overlap).

The module is over 500 lines because it is one walk through a whole training step (forward,
backward, the optimizer's phase) kept in one place, in the order of the code it follows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..ops import _common
from ..ops import attention as attention_op
from ..ops import softmax as softmax_op
from ..tensor_parallel.sharding import kv_heads_of_rank

ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
ELIDE_BYTES = 256 * 1024  # NumPy reuses a temporary operand of a binary op from this size (NPY_MIN_ELIDE_BYTES)
POOL_ROUND = 512  # CuPy's memory pool rounds every allocation up to this


@dataclass(frozen=True)
class StepShape:
    """What the step's memory depends on. `vocab`: real classes; `padded_vocab`: over all TP
    ranks. `threads`: the ops' CPU threads (cutp.runtime.threads.op_threads)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    hidden: int
    vocab: int
    padded_vocab: int
    micro_batch: int
    seq_len: int
    tp: int = 1
    tp_rank: int = 0
    accum: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    bias: bool = True
    dropout: float = 0.0
    label_smoothing: float = 0.0
    gelu: str = "tanh"
    kernels: bool = True  # GPU: cutp's CUDA kernels (float32/bfloat16) rather than the CuPy composition
    block_size: int = 1024
    tie_embeddings: bool = True
    dp: int = 1
    dp_rank: int = 0
    distributed_optimizer: bool = False

    @classmethod
    def of(cls, config, *, tp=1, tp_rank=0, micro_batch, seq_len, accum=1, dtype=None, device="cpu", threads=1,
           kernels=True, dp=1, dp_rank=0, distributed_optimizer=False):
        """From a GPTConfig."""
        return cls(n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head, n_kv_head=config.kv_heads,
                   hidden=config.hidden, vocab=config.vocab_size, padded_vocab=config.padded_vocab(tp),
                   micro_batch=micro_batch, seq_len=seq_len, tp=tp, tp_rank=tp_rank, accum=accum,
                   dtype=dtype or config.dtype, device=device, threads=threads, bias=config.bias,
                   dropout=config.dropout, label_smoothing=config.label_smoothing, gelu=config.gelu, kernels=kernels,
                   block_size=config.block_size, tie_embeddings=config.tie_embeddings, dp=dp, dp_rank=dp_rank,
                   distributed_optimizer=distributed_optimizer)


class LocalParameter(NamedTuple):
    name: str
    numel: int
    kind: str  # "sharded", "replicated" or "partial" (see local_parameters)
    decays: bool  # AdamW's weight decay applies (the weights of the linear layers)


def local_parameters(s: StepShape) -> list[LocalParameter]:
    """(name, elements, kind, decays) of every parameter TP rank `s.tp_rank` holds, in the model's order.
    kind: "sharded" (every element this rank's own), "replicated" (the same on every TP rank:
    LayerNorms, the row-parallel layers' biases, the position embeddings) or "partial" (QKV with
    KV heads replicated over several ranks when tp > n_kv_head: only the first holder counts
    them in the gradient norm). Their sum is `GPT.num_parameters_local()`."""
    h, tp, hd = s.n_embd, s.tp, s.n_embd // s.n_head
    nq, b = s.n_head // tp, 1 if s.bias else 0
    nkv = len(kv_heads_of_rank(s.n_head, s.n_kv_head, tp, s.tp_rank))
    qkv = (nq + 2 * nkv) * hd
    replicas = tp // s.n_kv_head if tp > s.n_kv_head else 1
    qkv_kind = "partial" if s.tp_rank % replicas else "sharded"
    vocab = ("sharded", s.padded_vocab // tp * h)
    out = [("wte.weight", vocab[1], vocab[0], False), ("wpe.weight", s.block_size * h, "replicated", False)]

    def norm(name):
        out.append((f"{name}.weight", h, "replicated", False))
        if b:
            out.append((f"{name}.bias", h, "replicated", False))

    for i in range(s.n_layer):
        p = f"h.{i}"
        norm(f"{p}.ln_1")
        out.append((f"{p}.attn.c_attn.weight", h * qkv, qkv_kind, True))
        if b:
            out.append((f"{p}.attn.c_attn.bias", qkv, qkv_kind, False))
        out.append((f"{p}.attn.c_proj.weight", nq * hd * h, "sharded", True))
        if b:
            out.append((f"{p}.attn.c_proj.bias", h, "replicated", False))
        norm(f"{p}.ln_2")
        out.append((f"{p}.mlp.c_fc.weight", h * (s.hidden // tp), "sharded", True))
        if b:
            out.append((f"{p}.mlp.c_fc.bias", s.hidden // tp, "sharded", False))
        out.append((f"{p}.mlp.c_proj.weight", s.hidden // tp * h, "sharded", True))
        if b:
            out.append((f"{p}.mlp.c_proj.bias", h, "replicated", False))
    norm("ln_f")
    if not s.tie_embeddings:
        out.append(("lm_head.weight", vocab[1], vocab[0], True))
    return [LocalParameter(*p) for p in out]


class Heap:
    """A simulated heap: named live arrays, the current total and its high-water mark."""

    def __init__(self, round_to: int = 1):
        self.round_to = round_to
        self.live: dict[str, int] = {}
        self.cur = 0
        self.peak = 0
        self.where = ""  # the step of the walk where the peak was reached

    def size(self, nbytes) -> int:
        n = int(nbytes)
        r = self.round_to
        return n if r <= 1 or n == 0 else -(-n // r) * r

    def alloc(self, key: str, nbytes) -> None:
        if key in self.live:
            raise KeyError(f"simulated array {key!r} allocated twice")
        n = self.size(nbytes)
        self.live[key] = n
        self.cur += n
        self._mark(key)

    def free(self, *keys: str) -> None:
        for k in keys:
            self.cur -= self.live.pop(k)

    def has(self, key: str) -> bool:
        return key in self.live

    def temp(self, *nbytes, what: str = "") -> None:
        """Arrays allocated together and freed again within an op (the peak counts them)."""
        extra = sum(self.size(n) for n in nbytes)
        if self.cur + extra > self.peak:
            self.peak = self.cur + extra
            self.where = what

    def _mark(self, what):
        if self.cur > self.peak:
            self.peak = self.cur
            self.where = what


class _Walk:
    """One training step of a GPT on one rank, booked on a Heap (see the module docstring)."""

    def __init__(self, s: StepShape):
        self.s = s
        self.cpu = s.device == "cpu"
        self.heap = Heap(1 if self.cpu else POOL_ROUND)
        self.a = ITEMSIZE[s.dtype]
        self.c = 8 if s.dtype == "float64" else 4
        self.direct = self.a == self.c
        self.kern = (not self.cpu) and s.kernels and s.dtype in ("float32", "bfloat16")
        self.N = s.micro_batch * s.seq_len
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

    # ---- helpers --------------------------------------------------------------------------
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

    # ---- ops --------------------------------------------------------------------------------
    def layernorm_fwd(self, k):
        H, N, h, c = self.heap, self.N, self.h, self.c
        H.alloc(f"{k}.y", N * h * self.a)
        H.alloc(f"{k}.stats", 2 * N * (4 if self.kern else c))
        if self.kern:
            return
        rows, par = self.blocks(N, h)
        per = 2 * rows * c + h * c + (0 if self.direct else 2 * rows * h * c)
        H.temp(par * per, what=f"{k} forward")

    def layernorm_bwd(self, k, dx):
        H, N, h, c = self.heap, self.N, self.h, self.c
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

    def dropout_fwd(self, key, n, itemsize=None):
        """y = dropout(x) of n elements: a new y and a kept bool mask (p > 0 only)."""
        H = self.heap
        a = self.a if itemsize is None else itemsize
        if self.kern:
            H.alloc(key, n * a)
            H.alloc(key + ".mask", n)
            return
        H.alloc(key + ".mask", n)
        if self.cpu:
            H.temp(2 * 8 * min(n, _common.ELEMENTWISE_BLOCK), what=f"{key} mask")
        else:
            H.temp(2 * 8 * n, what=f"{key} mask")
        if a != self.c:
            H.temp(n * self.c, what=key)
        H.alloc(key, n * a)

    # ---- layers -------------------------------------------------------------------------------
    def embedding(self):
        H, N, h = self.heap, self.N, self.h
        if self.s.tp > 1:
            H.temp(3 * N, what="embedding mask")
            H.alloc("emb.mask", N)
            H.temp(8 * N, what="embedding ids")
            H.alloc("emb.ids", 8 * N)
        H.alloc("emb.y", N * h * self.a)
        if self.s.tp > 1:
            H.temp(N, what="embedding ~mask")
        if not self.drop:
            return "emb.y"
        self.dropout_fwd("emb.drop", N * h)
        H.free("emb.y")
        return "emb.drop"

    def attention_fwd(self, L):
        """After c_attn: the attention op; returns c_proj's input (kept for backward). 16-bit
        q, k, v are multiplied in float32: each piece (or the whole op) works on float32 copies,
        and the probabilities it keeps are float32."""
        s, H = self.s, self.heap
        B, T, a, e = s.micro_batch, s.seq_len, self.a, self.c
        if self.cpu and not self.drop:
            H.alloc(f"{L}.o", self.N * self.nq * self.hd * a)
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
            self.dropout_fwd(f"{L}.pdrop", S, itemsize=e)
        if not self.direct:
            H.temp(qh * e, what=f"{L} attention output")
        H.alloc(f"{L}.o_heads", qh * a)
        H.free(f"{L}.scores", f"{L}.copies")
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

    def block_fwd(self, L, x):
        """Returns the block's output (x stays alive: ln_1 keeps it)."""
        H, N, h = self.heap, self.N, self.h
        self.layernorm_fwd(f"{L}.ln1")
        self.linear_fwd(f"{L}.qkv", h, self.qkvw)
        self.attention_fwd(L)
        self.linear_fwd(f"{L}.attn_out", self.nq * self.hd, h)
        if H.has(f"{L}.o_heads"):
            H.free(f"{L}.o_heads")  # the plain path's output before merging the heads
        y = f"{L}.attn_out"
        if self.drop:
            self.dropout_fwd(f"{L}.attn_drop", N * h)
            H.free(y)
            y = f"{L}.attn_drop"
        self.add_residual(f"{L}.x1", x, y)
        self.layernorm_fwd(f"{L}.ln2")
        self.linear_fwd(f"{L}.fc", h, self.f)
        self.gelu_fwd(L)
        self.linear_fwd(f"{L}.mlp_out", self.f, h)
        if self.s.bias:
            H.free(f"{L}.fc")  # the matmul output: the GeLU kept x + b instead
        y = f"{L}.mlp_out"
        if self.drop:
            self.dropout_fwd(f"{L}.mlp_drop", N * h)
            H.free(y)
            y = f"{L}.mlp_drop"
        self.add_residual(f"{L}.out", f"{L}.x1", y)
        return f"{L}.out"

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

    def head_and_loss(self, x_last):
        H, N, h, c = self.heap, self.N, self.h, self.c
        self.layernorm_fwd("lnf")
        self.linear_fwd("logits", h, self.vl)
        # the cross-entropy: targets (on the CPU a copy: a view of the batch window), per-row statistics
        H.alloc("ce.t", 8 * N if self.cpu else 0)
        H.alloc("ce.valid", N)
        H.alloc("ce.local_t0", 8 * N)
        H.temp(3 * N, 8 * N, what="ce targets")
        H.alloc("ce.local_t", 8 * N)
        H.free("ce.local_t0")
        H.alloc("ce.row_max", N * (4 if self.kern else c))
        if self.s.tp > 1:
            H.temp(N * c, what="ce row max all-reduce")
        k = 3 if self.s.label_smoothing > 0 else 2
        if self.kern:
            H.alloc("ce.parts", k * N * 4)
        else:
            H.alloc("ce.parts", k * N * c)
            rows, par = self.blocks(N, self.n_valid)
            work = rows * self.n_valid * c
            H.temp(par * (work + rows * c), 4 * N * 8, what="ce statistics")
        H.alloc("ce.stats", k * N * c)
        H.temp(6 * N * c, what="ce loss")
        H.free("ce.parts", "ce.t")
        # backward
        H.temp(2 * N * c, what="ce row scale")
        H.alloc("ce.bwd", 6 * N * c)
        if not self.kern:
            rows, par = self.blocks(N, self.n_valid)
            work = 0 if self.direct else rows * self.n_valid * c
            H.temp(par * (work + 3 * rows * 8), what="ce backward")
        H.free("ce.bwd", "ce.row_max", "ce.stats", "ce.local_t", "ce.valid")
        # the LM head: dW [V/tp, h], then dx; the logits (now their gradient) and ln_f's output go
        self.linear_bwd("head.dx", h, self.vl)
        H.free("logits", "lnf.y")
        self.layernorm_bwd("lnf", "lnf.dx")
        H.free("head.dx", "lnf.stats", x_last)
        return "lnf.dx"

    def block_bwd(self, L, dy, x):
        H, N, h = self.heap, self.N, self.h
        # MLP
        d = dy
        if self.drop:
            H.alloc(f"{L}.d_mlp_drop", N * h * self.a)
            H.free(f"{L}.mlp_drop.mask")
            d = f"{L}.d_mlp_drop"
        H.temp(h * self.c, what=f"{L} mlp bias grad")
        self.linear_bwd(f"{L}.da", self.f, h)
        H.free(f"{L}.act")
        if self.s.bias:
            self.gelu_bwd(L, f"{L}.dh")
            H.free(f"{L}.pre")
        else:
            self.gelu_bwd(L, f"{L}.dh")
            H.free(f"{L}.fc")
        self.linear_bwd(f"{L}.dx_mlp", h, self.f)
        H.free(f"{L}.ln2.y", f"{L}.da", f"{L}.dh")
        if self.drop:
            H.free(d)
        self.layernorm_bwd(f"{L}.ln2", f"{L}.dx_ln2")
        H.free(f"{L}.dx_mlp", f"{L}.x1", f"{L}.ln2.stats")
        self.add_residual(f"{L}.dx1", dy, f"{L}.dx_ln2")
        # attention
        d = f"{L}.dx1"
        if self.drop:
            H.alloc(f"{L}.d_attn_drop", N * h * self.a)
            H.free(f"{L}.attn_drop.mask")
            d = f"{L}.d_attn_drop"
        H.temp(h * self.c, what=f"{L} attention bias grad")
        self.linear_bwd(f"{L}.do", h, self.nq * self.hd)
        H.free(f"{L}.o")
        H.alloc(f"{L}.dqkv", N * self.qkvw * self.a)
        self.attention_bwd(L)
        self.linear_bwd(f"{L}.dx_attn", h, self.qkvw, bias=self.s.bias)
        H.free(f"{L}.ln1.y", f"{L}.do", f"{L}.dqkv", f"{L}.qkv", f"{L}.probs")
        for k in (f"{L}.pdrop", f"{L}.pdrop.mask"):
            if H.has(k):
                H.free(k)
        if self.drop:
            H.free(d)
        self.layernorm_bwd(f"{L}.ln1", f"{L}.dx_ln1")
        H.free(f"{L}.dx_attn", x, f"{L}.ln1.stats")
        self.add_residual(f"{L}.dx", f"{L}.dx1", f"{L}.dx_ln1")
        H.free(f"{L}.dx1", dy)
        return f"{L}.dx"

    def embedding_bwd(self, dy):
        H, N, h, c = self.heap, self.N, self.h, self.c
        if self.drop:
            H.alloc("emb.d_drop", N * h * self.a)
            H.free("emb.drop.mask", dy)
            dy = "emb.d_drop"
        H.temp(self.s.seq_len * h * self.a, what="wpe gradient")
        # the rows of dy gathered in id order and summed per id (CPU), or the selected rows (GPU)
        H.temp(6 * 8 * N + 3 * N * h * c if self.cpu else 2 * 8 * N + N * h * c, what="embedding backward")
        H.free(dy)
        for k in ("emb.mask", "emb.ids"):
            if H.has(k):
                H.free(k)

    def micro_batch(self):
        x = self.embedding()
        inputs = []
        for i in range(self.s.n_layer):
            inputs.append(x)
            x = self.block_fwd(f"h{i}", x)
        d = self.head_and_loss(x)
        for i in reversed(range(self.s.n_layer)):
            d = self.block_bwd(f"h{i}", d, inputs[i])
        self.embedding_bwd(d)

    def optimizer_phase(self):
        """After the micro-batches (cutp/optim/adamw.py): the GQA gradient sums, the DP reduction,
        the global gradient norm and the AdamW update with its blocks."""
        s, H = self.s, self.heap
        gb = 4 if self.a == 2 else self.a  # gradients: float32 for 16-bit parameters
        sd = 8 if s.dtype == "float64" else 4
        params = local_parameters(s)
        n = sum(p.numel for p in params)
        dist = s.distributed_optimizer
        align = 64 * s.dp if dist else 1
        N = -(-n // align) * align
        lo, hi = (s.dp_rank * (N // s.dp), (s.dp_rank + 1) * (N // s.dp)) if dist else (0, N)
        if s.tp > s.n_kv_head:
            H.temp(self.h * 2 * self.nkv * self.hd * gb, what="GQA gradient sum")
        if dist and s.dp > 1 and self.cpu:
            H.temp(N * gb, what="gradient reduce-scatter (MPI: a copy of the buffer)")
        H.temp(self._norm_temp(params, gb, lo, hi, dist), what="gradient norm")
        if self.kern:
            return  # one fused kernel per range, in place
        # per block of ELEMENTWISE_BLOCK elements (the whole range on a GPU): a state-dtype copy of
        # the gradient and one state-dtype term; weight decay ([0, n_decay) of the flat buffer,
        # decayed parameters first) and the rest are separate ranges
        n_decay = sum(p.numel for p in params if p.decays)
        worst = 0
        for a_, b_ in ((max(lo, 0), min(hi, n_decay)), (max(lo, n_decay), min(hi, n))):
            if b_ > a_:
                k = b_ - a_
                blk = min(k, _common.ELEMENTWISE_BLOCK) if self.cpu else k
                worst = max(worst, self.conc(-(-k // _common.ELEMENTWISE_BLOCK)) * blk * 2 * sd)
        H.temp(worst, what="AdamW update")

    def _norm_temp(self, params, gb, lo, hi, dist):
        """The largest temporary of the global gradient norm. Plain: per parameter the squares of
        the entries this rank counts (CPU: float64 blocks on the ops' threads; GPU: a float64
        copy and its square), a copy of the owned columns of a partly owned QKV, and two bool
        arrays of the non-finite test for parameters counted elsewhere. Distributed: per
        parameter its part of this rank's shard in float64 (partly owned: its owned entries,
        chosen through int64 and bool index arrays), then the non-finite test of the shard."""
        s = self.s
        sq = _common.ELEMENTWISE_BLOCK // 2  # cutp.tensor_parallel.parameter._SQ_BLOCK
        worst = 0
        if dist:
            off = 0
            for p in sorted(params, key=lambda p: not p.decays):  # the flat buffer's order
                a_, b_ = max(off, lo), min(off + p.numel, hi)
                off += p.numel
                k = b_ - a_
                if k <= 0 or (p.kind == "replicated" and s.tp_rank > 0):
                    continue
                owned = k * self.nq // (self.nq + 2 * self.nkv) if p.kind == "partial" else k
                index = 2 * 8 * k + k + owned * gb if p.kind == "partial" else 0
                worst = max(worst, index + owned * 8)
            return max(worst, 2 * (hi - lo))
        for p in params:
            owned = p.numel if p.kind != "partial" else p.numel * self.nq // (self.nq + 2 * self.nkv)
            copy = owned * gb if p.kind == "partial" else 0
            if self.cpu:
                squares = copy + self.conc(-(-owned // sq)) * min(owned, sq) * 8
            else:
                squares = copy + owned * 8 * (1 if gb == 8 else 2)
            elsewhere = p.kind == "partial" or (p.kind == "replicated" and s.tp_rank > 0)
            worst = max(worst, 0 if (p.kind == "replicated" and s.tp_rank > 0) else squares,
                        2 * p.numel if elsewhere else 0)
        return worst

    def step(self):
        s, H = self.s, self.heap
        if self.cpu:  # the step's token windows, read up front (host memory: not in a GPU's pool)
            H.alloc("batches", s.accum * s.micro_batch * (s.seq_len + 1) * 8)
            H.temp(s.micro_batch * (s.seq_len + 1) * 8 + 4 * self.N, what="batch")
        for _ in range(s.accum):
            if not self.cpu:
                H.alloc("ids", 2 * 8 * self.N)  # ids and targets copied to the device
            self.micro_batch()
            if not self.cpu:
                H.free("ids")
        self.optimizer_phase()
        return H


def _piece_dims(piece):
    """(batch rows, KV heads) of an attention piece."""
    bs, hs = piece
    return bs.stop - bs.start, hs.stop - hs.start


def _flat(walk, n):
    if not walk.cpu:
        return n, 1
    bl = _common.flat_blocks(np, n)
    return max(b.stop - b.start for b in bl), walk.conc(len(bl))


def step_peak(shape: StepShape) -> dict:
    """{"activations_peak": bytes, "where": the part of the step it was reached in, "left":
    the simulated arrays still live at the end (the step's token windows only: a walk that
    leaves more has lost track of an array)}."""
    heap = _Walk(shape).step()
    return {"activations_peak": heap.peak, "where": heap.where, "left": sorted(heap.live)}
