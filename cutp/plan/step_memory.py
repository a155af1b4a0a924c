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
* sequence parallelism (`sequence_parallel`, tp > 1): LayerNorms, dropouts and residual adds
  on this rank's N/tp rows; each column projection (and the LM head) keeps its all-gathered
  input [N, h] instead of the LayerNorm's output; each row projection's partial sums [N, h]
  are reduce-scattered into a new shard; the collectives' copies (the sequence axis moved to
  the front and back when b > 1; 16-bit reduce-scatters in float32); each dropout of a shard
  draws its batch rows apart and stacks them.
* recomputation: "selective" drops the attention's probabilities after its forward and books
  them again (with the op's output, kept to the end of the attention's backward) before the
  output projection's backward; "full" runs the first `recompute_layers` layers' forward
  keeping only their input (everything else dies where the code drops it) and, in backward,
  their whole forward again (stashed, its output dropped) right before their backward, so a
  recomputed layer's whole stash exists during its own backward.
* the per-layer stash (`stash_per_layer`): after the first micro-batch's forward, the arrays
  each layer holds (its input and its own cached arrays), what `cutp.train.memory.stash_per_layer`
  measures.
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

The ops' own bookings live in `cutp.plan.step_ops` (OpWalk), the shapes and the heap in
`cutp.plan.step_shape`; this module puts them in the order of the model's step.
"""
from __future__ import annotations

from ..ops import _common
from .step_ops import OpWalk
from .step_shape import ITEMSIZE, Heap, LocalParameter, StepShape, local_parameters

__all__ = ["ITEMSIZE", "Heap", "LocalParameter", "StepShape", "local_parameters", "step_peak"]


class _Walk(OpWalk):
    """One training step of a GPT on one rank, booked on a Heap (see the module docstring): the
    model's order of the ops `OpWalk` books."""

    def __init__(self, s: StepShape):
        super().__init__(s)
        self.stash: list[int] | None = None  # bytes each layer keeps after the first forward
        self.head_x = ""  # the LM head's input, kept for its backward (ln_f's output, or gathered)

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
        y = self.row_out("emb.y")
        if not self.drop:
            return y
        self.dropout_fwd("emb.drop", self.Ns * h)
        H.free(y)
        return "emb.drop"

    def block_fwd(self, L, x, keep=True):
        """Returns the block's output. keep: what the layer caches stays for backward (x too: ln_1
        keeps it); False (full recomputation's first pass, not stashed): each array dies where the
        code drops it, and only the output is left (x is kept by the block itself). Selective
        recomputation keeps Q, K, V (views of the QKV output) and drops the probabilities."""
        H, h = self.heap, self.h
        drop_probs = not keep or self.s.recompute == "selective"
        x_in = self.layernorm_and_gather(f"{L}.ln1", keep)
        self.linear_fwd(f"{L}.qkv", h, self.qkvw)
        if self.sp and not keep:
            H.free(x_in)  # c_attn's gathered input: its ctx is not kept
        self.attention_fwd(L)
        self.linear_fwd(f"{L}.attn_out", self.nq * self.hd, h)
        y = self.row_out(f"{L}.attn_out")
        # attn.forward returns: its locals go (the plain path's unmerged output, the op's ctx)
        gone = [f"{L}.o_heads"] + ([f"{L}.probs", f"{L}.pdrop", f"{L}.pdrop.mask"] if drop_probs else [])
        gone += [f"{L}.qkv", f"{L}.o", f"{L}.lse"] if not keep else []  # (the fused context is O(T): kept)
        gone += [f"{L}.ln1.y"] if (self.sp or not keep) else []  # attn.forward's argument (a shard under SP)
        H.free(*(k for k in gone if H.has(k)))
        if self.drop:
            self.dropout_fwd(f"{L}.attn_drop", self.Ns * h, keep=keep)
            H.free(y)
            y = f"{L}.attn_drop"
        self.add_residual(f"{L}.x1", x, y)
        x_in = self.layernorm_and_gather(f"{L}.ln2", keep)
        self.linear_fwd(f"{L}.fc", h, self.f)
        if self.sp and not keep:
            H.free(x_in)
        self.gelu_fwd(L)
        self.linear_fwd(f"{L}.mlp_out", self.f, h)
        y = self.row_out(f"{L}.mlp_out")
        # mlp.forward returns: the matmul output goes when the GeLU kept x + b instead
        gone = [f"{L}.fc"] if (self.s.bias or not keep) else []
        gone += [f"{L}.pre", f"{L}.act"] if not keep else []
        gone += [f"{L}.ln2.y"] if (self.sp or not keep) else []
        H.free(*(k for k in gone if H.has(k)))
        if self.drop:
            self.dropout_fwd(f"{L}.mlp_drop", self.Ns * h, keep=keep)
            H.free(y)
            y = f"{L}.mlp_drop"
        self.add_residual(f"{L}.out", f"{L}.x1", y)
        if not keep:
            H.free(f"{L}.x1")
        return f"{L}.out"

    def head_fwd(self):
        """ln_f, the LM head (under SP on the gathered ln_f output, the shard dropped) and the loss."""
        H, N, h, c = self.heap, self.N, self.h, self.c
        x_in = self.layernorm_and_gather("lnf", True)
        if self.sp:
            H.free("lnf.y")
        self.linear_fwd("logits", h, self.vl)
        self.head_x = x_in
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

    def head_bwd(self, x_last):
        H, N, h, c = self.heap, self.N, self.h, self.c
        H.temp(2 * N * c, what="ce row scale")
        H.alloc("ce.bwd", 6 * N * c)
        if not self.kern:
            rows, par = self.blocks(N, self.n_valid)
            work = 0 if self.direct else rows * self.n_valid * c
            H.temp(par * (work + 3 * rows * 8), what="ce backward")
        H.free("ce.bwd", "ce.row_max", "ce.stats", "ce.local_t", "ce.valid")
        # the LM head: dW [V/tp, h], then dx; the logits (now their gradient) and ln_f's output go
        self.head_linear_bwd()
        dx = self.column_in("head.dx")
        H.free("logits", self.head_x)
        self.layernorm_bwd("lnf", "lnf.dx")
        H.free(dx, "lnf.stats", x_last)
        return "lnf.dx"

    def head_linear_bwd(self):
        """ParallelLMHead.backward: dW = d2^T x2 [V/tp, h] added into the gradient and dropped,
        then dx = d2 W [N, h] (16-bit: d2, x2 and W in float32, dx rounded)."""
        H, N, h, vl, a, c = self.heap, self.N, self.h, self.vl, self.a, self.c
        d2 = 0 if self.direct else N * vl * c  # the logits' gradient in float32, alive to the end
        H.temp(d2, 0 if self.direct else N * h * c, vl * h * c, what="head.dx (dW)")
        H.temp(d2, 0 if self.direct else vl * h * c + N * h * c, N * h * a, what="head.dx (dx)")
        H.alloc("head.dx", N * h * a)

    def block_bwd(self, L, dy, x, recomputed=False):
        H, Ns, N, h = self.heap, self.Ns, self.N, self.h
        if recomputed:  # full recomputation: the first pass again, stashed; its output dropped at once
            self.block_fwd(L, x)
            H.free(f"{L}.out")
        ln1_in, ln2_in = (f"{L}.ln1.g", f"{L}.ln2.g") if self.sp else (f"{L}.ln1.y", f"{L}.ln2.y")
        # MLP
        d = dy
        if self.drop:
            H.alloc(f"{L}.d_mlp_drop", Ns * h * self.a)
            H.free(f"{L}.mlp_drop.mask")
            d = f"{L}.d_mlp_drop"
        H.temp(h * self.c, what=f"{L} mlp bias grad")
        d_full = self.row_in(d, f"{L}.d_mlp.g")
        self.linear_bwd(f"{L}.da", self.f, h)
        if d_full != d:
            H.free(d_full)
        H.free(f"{L}.act")
        if self.s.bias:
            self.gelu_bwd(L, f"{L}.dh")
            H.free(f"{L}.pre")
        else:
            self.gelu_bwd(L, f"{L}.dh")
            H.free(f"{L}.fc")
        self.linear_bwd(f"{L}.dx_mlp", h, self.f)
        H.free(ln2_in)
        dx_mlp = self.column_in(f"{L}.dx_mlp")
        H.free(f"{L}.da", f"{L}.dh")
        if self.drop:
            H.free(d)
        self.layernorm_bwd(f"{L}.ln2", f"{L}.dx_ln2")
        H.free(dx_mlp, f"{L}.x1", f"{L}.ln2.stats")
        self.add_residual(f"{L}.dx1", dy, f"{L}.dx_ln2")
        # attention (selective recomputation: the core attention again first; its output and
        # probabilities live to the end of the attention's backward)
        d = f"{L}.dx1"
        if self.drop:
            H.alloc(f"{L}.d_attn_drop", Ns * h * self.a)
            H.free(f"{L}.attn_drop.mask")
            d = f"{L}.d_attn_drop"
        again = self.s.recompute == "selective" and not self.fused  # the fused context was kept
        if again:
            self.attention_fwd(L, again=True)
        H.temp(h * self.c, what=f"{L} attention bias grad")
        d_full = self.row_in(d, f"{L}.d_attn.g")
        self.linear_bwd(f"{L}.do", h, self.nq * self.hd)
        if d_full != d:
            H.free(d_full)
        H.free(f"{L}.o")
        H.alloc(f"{L}.dqkv", N * self.qkvw * self.a)
        self.attention_bwd(L)
        self.linear_bwd(f"{L}.dx_attn", h, self.qkvw, bias=self.s.bias)
        H.free(ln1_in)
        dx_attn = self.column_in(f"{L}.dx_attn")
        H.free(f"{L}.do", f"{L}.dqkv", f"{L}.qkv", f"{L}.lse" if self.fused else f"{L}.probs")
        for k in (f"{L}.pdrop", f"{L}.pdrop.mask", f"{L}.o2"):
            if H.has(k):
                H.free(k)
        if self.drop:
            H.free(d)
        self.layernorm_bwd(f"{L}.ln1", f"{L}.dx_ln1")
        H.free(dx_attn, x, f"{L}.ln1.stats")
        self.add_residual(f"{L}.dx", f"{L}.dx1", f"{L}.dx_ln1")
        H.free(f"{L}.dx1", dy)
        return f"{L}.dx"

    def embedding_bwd(self, dy):
        H, N, h, c = self.heap, self.N, self.h, self.c
        if self.drop:
            H.alloc("emb.d_drop", self.Ns * h * self.a)
            H.free("emb.drop.mask", dy)
            dy = "emb.d_drop"
        H.temp(self.Ns // self.s.micro_batch * h * self.a, what="wpe gradient")
        d_full = self.row_in(dy, "emb.d.g")  # the embedding's backward of a reduce-scatter: an all-gather
        # the rows of dy gathered in id order and summed per id (CPU), or the selected rows (GPU)
        H.temp(6 * 8 * N + 3 * N * h * c if self.cpu else 2 * 8 * N + N * h * c, what="embedding backward")
        H.free(*{dy, d_full})
        for k in ("emb.mask", "emb.ids"):
            if H.has(k):
                H.free(k)

    def micro_batch(self):
        s = self.s
        x = self.embedding()
        inputs = []
        for i in range(s.n_layer):
            inputs.append(x)
            x = self.block_fwd(f"h{i}", x, keep=not s.recomputed(i))
        self.head_fwd()
        if self.stash is None:  # what each layer keeps for backward (what stash_per_layer measures)
            self.stash = [self.heap.live[inputs[i]] + sum(n for k, n in self.heap.live.items()
                                                          if k.startswith(f"h{i}.") and k != f"h{i}.out")
                          for i in range(s.n_layer)]
        d = self.head_bwd(x)
        for i in reversed(range(s.n_layer)):
            d = self.block_bwd(f"h{i}", d, inputs[i], recomputed=s.recomputed(i))
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


def step_peak(shape: StepShape) -> dict:
    """{"activations_peak": bytes, "where": the part of the step it was reached in, "left":
    the simulated arrays still live at the end (the step's token windows only: a walk that
    leaves more has lost track of an array), "stash_per_layer": the bytes each layer keeps for
    backward after the first micro-batch's forward (`cutp.train.memory.stash_per_layer`)}."""
    walk = _Walk(shape)
    heap = walk.step()
    return {"activations_peak": heap.peak, "where": heap.where, "left": sorted(heap.live),
            "stash_per_layer": walk.stash}
