"""`python -m cutp bench plan`: memory and communication per GPU for a model, tp, dp, micro-batch
and sequence length, from formulas (no hardware).

Model: `--params 70B` picks a standard architecture of that size (ARCHITECTURES: GPT-3 and
Llama-2 shapes), or `--preset NAME [--set k=v]` a cutp GPTConfig (parameter count identical to
``GPTConfig.num_parameters()``).

Precision (--precision):
  mixed (default)  bf16 parameters and gradients (2 B each) + fp32 master weights and Adam m, v
                   (12 B): 16 B per parameter (the ZeRO paper's 2 + 2 + 12); bf16 activations
                   and communication
  fp32             fp32 parameters, gradients, Adam m, v: 16 B per parameter; fp32 activations
                   and communication (what cutp trains in today)
Optimizer state is not sharded over DP (no ZeRO), so only tp divides the model's bytes.

Per-GPU parameters: every TP-split tensor (QKV, attention output, MLP, embeddings and an untied
LM head, split by vocabulary) / tp, plus the replicated ones (norms, row-parallel biases,
position embeddings); KV heads are split while tp <= n_kv_head, else each rank holds one.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Table 2, tensor parallelism without sequence parallelism, 16-bit activations, 1-byte
dropout masks): per layer and micro-batch  s*b*h*(10 + 24/t + 5*a*s/(h*t))  bytes, which is
s*b*h*(34 + 5*a*s/h) at t = 1; times L; plus the fp32 logits of the LM head, vocab-parallel:
4*s*b*V/t. With fp32 activations the 16-bit terms double and the dropout masks (2*s*b*h and
a*s*s*b/t bytes) stay 1 byte. No activation recomputation.

Communication per optimizer step (Megatron 1D TP, Shoeybi et al. 2019): per layer and micro-batch
2 all-reduces of b*s*h elements forward (attention and MLP output projections) and 2 backward
(the input gradients of the QKV and MLP input projections), i.e. 4 all-reduces per layer; plus
the embedding's all-reduce forward and the LM head's input-gradient all-reduce backward (b*s*h
each), and the vocab-parallel cross-entropy's per-row statistics (1 max + 3 sums of b*s).
DP: one all-reduce of this rank's gradient bytes per step. "on the wire" is the buffer times
nccl-tests' bus factor (2(n-1)/n for all-reduce): what each GPU sends (and receives) with a ring.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..model import GPTConfig
from ..runtime.errors import ConfigError
from ..tensor_parallel.validation import check_attention, check_mlp
from .common import Report, parse_count


@dataclass(frozen=True)
class Arch:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    ffn: int
    vocab: int
    seq: int  # the model's context length
    gated_mlp: bool = False  # SwiGLU: three ffn matrices
    bias: bool = False
    tied: bool = False
    layernorm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight)
    pos_emb: bool = False  # learned position embeddings [seq, h]

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


ARCHITECTURES = {
    "7B": Arch("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000, 4096, gated_mlp=True),
    "13B": Arch("Llama-2-13B", 40, 5120, 40, 40, 13824, 32000, 4096, gated_mlp=True),
    "70B": Arch("Llama-2-70B", 80, 8192, 64, 8, 28672, 32000, 4096, gated_mlp=True),
    "175B": Arch("GPT-3 175B", 96, 12288, 96, 96, 4 * 12288, 50257, 2048, bias=True, tied=True, layernorm=True,
                 pos_emb=True),
}


def arch_from_config(name: str, c) -> Arch:
    return Arch(name, c.n_layer, c.n_embd, c.n_head, c.kv_heads, c.hidden, c.vocab_size, c.block_size,
                gated_mlp=False, bias=c.bias, tied=c.tie_embeddings, layernorm=True, pos_emb=True)


def pick_arch(params: str) -> Arch:
    """'70B' (or 70e9, 7e10): the listed architecture nearest in size."""
    want = parse_count(params)
    best = min(ARCHITECTURES.values(), key=lambda a: abs(param_count(a)["total"] - want))
    return best


def param_count(a: Arch, tp: int = 1) -> dict:
    """Parameters of the full model ('total') and of one TP rank ('per_rank'), by component."""
    h, hd, L = a.n_embd, a.head_dim, a.n_layer
    kv_local = max(1, a.n_kv_head // tp) if tp <= a.n_kv_head else 1
    b = 1 if a.bias else 0
    norm = (2 if (a.layernorm and a.bias) else 1) * h  # LayerNorm weight (+ bias) or RMSNorm weight
    qkv_out = (a.n_head + 2 * a.n_kv_head) * hd
    qkv_out_local = (a.n_head // tp + 2 * kv_local) * hd
    mlp_mats = 3 if a.gated_mlp else 2
    full = {
        "attention": h * qkv_out + b * qkv_out + h * h + b * h,
        "mlp": mlp_mats * h * a.ffn + b * ((2 if a.gated_mlp else 1) * a.ffn + h),
        "norms": 2 * norm,
    }
    local = {
        "attention": h * qkv_out_local + b * qkv_out_local + (h // tp) * h + b * h,  # row bias replicated
        "mlp": mlp_mats * h * (a.ffn // tp) + b * ((2 if a.gated_mlp else 1) * a.ffn // tp + h),
        "norms": 2 * norm,
    }
    emb = a.vocab * h
    head = 0 if a.tied else a.vocab * h
    pos = a.seq * h if a.pos_emb else 0
    total = L * sum(full.values()) + emb + head + pos + norm
    per_rank = L * sum(local.values()) + -(-emb // tp) + -(-head // tp) + pos + norm
    return {"total": total, "per_rank": per_rank, "layer": sum(full.values()), "layer_per_rank": sum(local.values()),
            "embedding": emb, "lm_head": head, "position": pos}


PRECISIONS = {
    # bytes per parameter: param, grad, optimizer (master + m + v); bytes per activation element
    "mixed": dict(param=2, grad=2, optim=12, act=2, comm=2, label="bf16 params/grads, fp32 master + Adam m, v"),
    "fp32": dict(param=4, grad=4, optim=8, act=4, comm=4, label="fp32 params/grads/Adam m, v"),
}


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int, act_bytes: int = 2) -> float:
    """Korthikanti et al. 2022, TP without sequence parallelism: s*b*h*(10 + 24/t + 5*a*s/(h*t))
    for 16-bit activations with 1-byte dropout masks. For 4-byte activations the 16-bit terms
    double and the masks (2*s*b*h, the attention one a*s*s*b/t) stay 1 byte."""
    base = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    if act_bytes == 2:
        return base
    masks = 2 * s * b * h + a * s * s * b / t
    return (base - masks) * (act_bytes / 2) + masks


def plan(a: Arch, *, tp: int, dp: int, micro_batch: int, seq_len: int, accum: int = 1,
         precision: str = "mixed") -> dict:
    """Every figure of the plan as plain numbers (bytes, elements, calls). Raises ConfigError,
    naming the tp values that fit, for a mesh the model cannot be split over."""
    check_attention(a.n_embd, a.n_head, a.n_kv_head, tp)  # the rules training applies
    check_mlp(a.n_embd, a.ffn, tp)
    pr = PRECISIONS[precision]
    pc = param_count(a, tp)
    P = pc["per_rank"]
    s, b, h, L = seq_len, micro_batch, a.n_embd, a.n_layer
    per_layer = activation_bytes_per_layer(s, b, h, a.n_head, tp, pr["act"])
    logits = 4 * s * b * a.vocab / tp
    bsh = b * s * h
    tp_calls = (4 * L + 2) * accum if tp > 1 else 0
    tp_elems = bsh * tp_calls
    ce_elems = 3 * b * s * accum if tp > 1 else 0  # max, then (sum of exps, target logit); +b*s with smoothing
    ce_calls = 2 * accum if tp > 1 else 0
    ar_factor = lambda n: 2 * (n - 1) / n  # noqa: E731
    out = {
        "arch": a.__dict__, "tp": tp, "dp": dp, "micro_batch": b, "seq_len": s, "accum": accum,
        "precision": precision, "precision_label": pr["label"],
        "params_total": pc["total"], "params_per_gpu": P,
        "param_bytes": P * pr["param"], "grad_bytes": P * pr["grad"], "optim_bytes": P * pr["optim"],
        "act_bytes_per_layer": per_layer, "act_bytes_layers": per_layer * L, "logit_bytes": logits,
        "act_bytes": per_layer * L + logits,
        "tp_allreduce_calls_per_layer": 4 if tp > 1 else 0,
        "tp_allreduce_elements_per_layer": 4 * bsh if tp > 1 else 0,
        "tp_allreduce": {"calls": tp_calls, "elements": tp_elems, "bytes": tp_elems * pr["comm"],
                         "wire_bytes": tp_elems * pr["comm"] * ar_factor(tp) if tp > 1 else 0},
        "ce_allreduce": {"calls": ce_calls, "elements": ce_elems, "bytes": ce_elems * 4,
                         "wire_bytes": ce_elems * 4 * ar_factor(tp) if tp > 1 else 0},
        "dp_allreduce": {"calls": 1 if dp > 1 else 0, "elements": P if dp > 1 else 0,
                         "bytes": P * pr["grad"] if dp > 1 else 0,
                         "wire_bytes": P * pr["grad"] * ar_factor(dp) if dp > 1 else 0},
    }
    out["model_state_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    out["total_bytes"] = out["model_state_bytes"] + out["act_bytes"]
    return out


def run(args) -> Report:
    if args.params and args.preset:
        raise ConfigError("give --params or --preset, not both")
    if args.preset:
        c = GPTConfig.preset(args.preset).with_overrides(args.set)
        a = arch_from_config(args.preset, c)
    else:
        a = pick_arch(args.params or "70B")
        if args.set:
            a = replace(a, **{k: int(v) for k, v in (item.split("=", 1) for item in args.set)})
    seq = args.seq_len or a.seq
    r = plan(a, tp=args.tp, dp=args.dp, micro_batch=args.micro_batch, seq_len=seq, accum=args.accum,
             precision=args.precision)
    report = Report("plan", {})
    report.extra["plan"] = r
    GB = 1e9
    arch = report.table("model", [("k", "model", "", "<"), ("v", "", "", "<")], title=f"{a.name}")
    for k, v in (("layers x width", f"{a.n_layer} x {a.n_embd}"), ("heads / kv heads", f"{a.n_head} / {a.n_kv_head}"),
                 ("mlp", f"{a.ffn}{' (SwiGLU)' if a.gated_mlp else ''}"), ("vocab", f"{a.vocab:,}"),
                 ("parameters", f"{r['params_total']:,} ({r['params_total'] / 1e9:.2f} B)"),
                 ("per GPU (tp={})".format(args.tp), f"{r['params_per_gpu']:,}"),
                 ("mesh", f"tp {args.tp} x dp {args.dp} = {args.tp * args.dp} GPUs"),
                 ("micro-batch x seq", f"{args.micro_batch} x {seq}, {args.accum} micro-batch(es) per step"),
                 ("precision", r["precision_label"])):
        arch.add(k=k, v=v)
    mem = report.table("memory", [("what", "per GPU", "", "<"), ("gb", "GB", ",.2f"), ("formula", "formula", "", "<")],
                       title="memory per GPU (GB = 1e9 bytes)")
    pr = PRECISIONS[args.precision]
    mem.add(what="parameters", gb=r["param_bytes"] / GB, formula=f"{r['params_per_gpu']:,} x {pr['param']} B")
    mem.add(what="gradients", gb=r["grad_bytes"] / GB, formula=f"params x {pr['grad']} B")
    mem.add(what="optimizer state", gb=r["optim_bytes"] / GB, formula=f"params x {pr['optim']} B")
    mem.add(what="activations, layers", gb=r["act_bytes_layers"] / GB,
            formula=f"L * s*b*h*(10 + 24/t + 5*a*s/(h*t)) [{pr['act']}-byte acts], t={args.tp}")
    mem.add(what="activations, logits", gb=r["logit_bytes"] / GB, formula="4*s*b*V/t (fp32 logits)")
    mem.add(what="total", gb=r["total_bytes"] / GB, formula="no recomputation, no ZeRO")
    cm = report.table("comm", [("what", "collective per step", "", "<"), ("calls", "calls", ",d"),
                               ("elements", "elements", ",d"), ("gb", "GB buffers", ",.3f"), ("wire", "GB on the wire/GPU", ",.3f"),
                               ("formula", "formula", "", "<")], title="communication per optimizer step and GPU")
    L, bsh = a.n_layer, args.micro_batch * seq * a.n_embd
    cm.add(what="TP all-reduce (activations)", calls=r["tp_allreduce"]["calls"], elements=r["tp_allreduce"]["elements"],
           gb=r["tp_allreduce"]["bytes"] / GB, wire=r["tp_allreduce"]["wire_bytes"] / GB,
           formula=f"(4 per layer x {L} + 2) x b*s*h = {bsh:,} elements, x {args.accum} micro-batches")
    cm.add(what="TP all-reduce (CE stats)", calls=r["ce_allreduce"]["calls"], elements=r["ce_allreduce"]["elements"],
           gb=r["ce_allreduce"]["bytes"] / GB, wire=r["ce_allreduce"]["wire_bytes"] / GB,
           formula="max (b*s) + sums (2*b*s; 3*b*s with label smoothing), fp32")
    cm.add(what="DP all-reduce (gradients)", calls=r["dp_allreduce"]["calls"], elements=r["dp_allreduce"]["elements"],
           gb=r["dp_allreduce"]["bytes"] / GB, wire=r["dp_allreduce"]["wire_bytes"] / GB,
           formula=f"params per GPU x {pr['grad']} B, once per step")
    cm.notes.append("wire = buffer x 2(n-1)/n (ring all-reduce; nccl-tests' bus factor)")
    return report
