"""What the simulated training step (`cutp.plan.step_memory`) works on: the step's shape
(`StepShape`), the parameters one TP rank holds (`local_parameters`) and the simulated heap."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
    recompute: str = "none"  # "selective" (the core attention) or "full" (whole layers): GPT.set_recompute
    recompute_layers: int | None = None  # with "full": the first N layers (None: all)
    sequence_parallel: bool = False  # GPT.set_sequence_parallel (a no-op at tp 1)
    # a pipeline stage (cutp.plan.step_pipeline): its layers' global indices (None: all), whether
    # it holds the embeddings (first) and ln_f, the LM head and the loss (last; tied: a wte copy)
    layer_ids: tuple | None = None
    first_stage: bool = True
    last_stage: bool = True

    @classmethod
    def of(cls, config, *, tp=1, tp_rank=0, micro_batch, seq_len, accum=1, dtype=None, device="cpu", threads=1,
           kernels=True, dp=1, dp_rank=0, distributed_optimizer=False, recompute="none", recompute_layers=None,
           sequence_parallel=False, layer_ids=None, first_stage=True, last_stage=True):
        """From a GPTConfig."""
        return cls(n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head, n_kv_head=config.kv_heads,
                   hidden=config.hidden, vocab=config.vocab_size, padded_vocab=config.padded_vocab(tp),
                   micro_batch=micro_batch, seq_len=seq_len, tp=tp, tp_rank=tp_rank, accum=accum,
                   dtype=dtype or config.dtype, device=device, threads=threads, bias=config.bias,
                   dropout=config.dropout, label_smoothing=config.label_smoothing, gelu=config.gelu, kernels=kernels,
                   block_size=config.block_size, tie_embeddings=config.tie_embeddings, dp=dp, dp_rank=dp_rank,
                   distributed_optimizer=distributed_optimizer, recompute=recompute, recompute_layers=recompute_layers,
                   sequence_parallel=sequence_parallel,
                   layer_ids=None if layer_ids is None else tuple(layer_ids), first_stage=first_stage,
                   last_stage=last_stage)

    @property
    def layers(self) -> tuple:
        """The global indices of the layers this rank holds (all of them without a pipeline)."""
        return tuple(range(self.n_layer)) if self.layer_ids is None else self.layer_ids

    @property
    def sp(self) -> bool:
        """Whether the step runs sequence-parallel (the model's rule: on, tp > 1, T splits)."""
        return self.sequence_parallel and self.tp > 1 and self.seq_len % self.tp == 0

    def recomputed(self, layer: int) -> bool:
        """Whether layer `layer` is recomputed whole in backward (--recompute full)."""
        return self.recompute == "full" and layer < (self.n_layer if self.recompute_layers is None
                                                     else self.recompute_layers)


class LocalParameter(NamedTuple):
    name: str
    numel: int
    kind: str  # "sharded", "replicated" or "partial" (see local_parameters)
    decays: bool  # AdamW's weight decay applies (matrices: linear layers and embeddings)


def local_parameters(s: StepShape) -> list[LocalParameter]:
    """(name, elements, kind, decays) of every parameter TP rank `s.tp_rank` holds, in the model's order.
    kind: "sharded" (every element this rank's own), "replicated" (the same on every TP rank:
    LayerNorms, the row-parallel layers' biases, the position embeddings) or "partial" (QKV with
    KV heads replicated over several ranks when tp > n_kv_head: only the first holder counts
    them in the gradient norm). Their sum is `GPT.num_parameters_local()`. A pipeline stage
    (`s.layer_ids`): its layers, the embeddings on the first stage, ln_f (and an untied LM head) on
    the last, which with tied embeddings holds its own copy of wte (the model's order: wte first)."""
    h, tp, hd = s.n_embd, s.tp, s.n_embd // s.n_head
    nq, b = s.n_head // tp, 1 if s.bias else 0
    nkv = len(kv_heads_of_rank(s.n_head, s.n_kv_head, tp, s.tp_rank))
    qkv = (nq + 2 * nkv) * hd
    replicas = tp // s.n_kv_head if tp > s.n_kv_head else 1
    qkv_kind = "partial" if s.tp_rank % replicas else "sharded"
    vocab = ("sharded", s.padded_vocab // tp * h)
    out = []
    if s.first_stage or (s.last_stage and s.tie_embeddings):
        out.append(("wte.weight", vocab[1], vocab[0], True))
    if s.first_stage:
        out.append(("wpe.weight", s.block_size * h, "replicated", True))

    def norm(name):
        out.append((f"{name}.weight", h, "replicated", False))
        if b:
            out.append((f"{name}.bias", h, "replicated", False))

    for i in s.layers:
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
    if s.last_stage:
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
