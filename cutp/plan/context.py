"""Context parallelism in the plan (`--cp N`, `--cp-comm ring|a2a`): what it changes in the formulas
for --params architectures (a cutp --preset is planned by running its step, cutp.plan.run,
which runs the ring or the all-to-all itself).

Each rank holds s / cp tokens of every sequence, so every per-token activation of Korthikanti
et al.'s per-layer formula is taken at s / cp. The attention's s x s part: the ring keeps
nothing of it (each step's tile is recomputed in backward from q, k, v, o and the log-sum-exp,
FlashAttention-style: the "selective" amount), the all-to-all keeps the whole sequence's scores
of a cp-th of the heads (the formula at s / cp tokens and cp times the heads gives exactly
a * s^2 * b / (t * cp)). The gradients and ZeRO's shards are over DP x CP (an expert-parallel
model's experts: over expert-DP x CP); an MoE layer routes, keeps and all-to-alls s / cp tokens.

Communication per layer and micro-batch (K,V of the TP rank's KV heads, h_kv = n_kv_head/t x
head dim, or one replicated head when t > n_kv_head):
    ring, forward:  cp - 1 sends of the local K,V, 2 b (s/cp) h_kv elements each: (cp-1)/cp of
                    a sequence's K,V leave the rank, as many arrive
    ring, backward: cp - 1 sends of K,V and cp of dK,dV (float32 for 16-bit models)
    a2a, each way:  q, k, v (forward; do in backward) and o (forward; dq, dk, dv in backward) of
                    the local tokens, (cp-1)/cp of them leaving; two all-to-alls (q, k, v in
                    one). Where cp is a multiple of the TP rank's KV heads, each KV head's K,V
                    (and dK,dV) go to the cp / (its KV heads) CP ranks of its query heads: k, v
                    that many times
Multi-head latent attention: every head's k (d_nope + d_rope, the shared rope key broadcast) and
v (d_v) travel, and q of d_qk, o of d_v (cutp.tensor_parallel.mla).
"""
from __future__ import annotations

from ..runtime.errors import ConfigError
from ..tensor_parallel.context_parallel import COMMS, check_context_parallel, ulysses_heads


def check_cp(a, *, cp: int, cp_comm: str, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """The training rules (`check_context_parallel`), named by the planner's flags."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ConfigError(f"--cp must be an integer >= 1, got {cp!r}")
    if cp_comm not in COMMS:
        raise ConfigError(f"--cp-comm {cp_comm!r}: use one of {', '.join(COMMS)}")
    check_context_parallel(seq_len, cp, tp, sequence_parallel, cp_comm, a.n_head, a.kv_heads)


def formula_args(s: int, heads: int, mode: str, cp: int, cp_comm: str) -> tuple[int, int, str]:
    """(tokens, heads, recompute mode) for `activation_bytes_per_layer` of a CP rank."""
    if cp == 1:
        return s, heads, mode
    if cp_comm == "a2a":
        return s // cp, heads * cp, mode
    return s // cp, heads, "selective" if mode == "none" else mode


def kv_width(a, tp: int) -> int:
    """The K (or V) columns of one TP rank: its KV heads x the head dim."""
    return (a.kv_heads // tp if tp <= a.kv_heads else 1) * a.head_size


def cp_comm_bytes(a, *, s: int, b: int, tp: int, cp: int, cp_comm: str, layers: int, accum: int,
                  itemsize: int, recomputed: int = 0) -> dict:
    """The CP group's point-to-point (ring) or all-to-all (a2a) traffic of a step on one rank:
    {"calls", "elements", "bytes", "wire_bytes"} (module docstring); `recomputed` of the layers
    run their forward again in backward (full recomputation: its exchanges too)."""
    if cp == 1:
        return {"calls": 0, "elements": 0, "bytes": 0, "wire_bytes": 0.0}
    local = b * (s // cp)
    mla = a.kv_lora_rank is not None  # (multi-head latent attention: every head's k of d_qk, v of d_v)
    kv = local * (a.n_head // tp * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) if mla
                  else 2 * kv_width(a, tp))
    forwards = (layers + recomputed) * accum
    if cp_comm == "ring":
        backward = layers * accum
        calls = forwards * (cp - 1) + backward * ((cp - 1) + cp)
        elements = (forwards * (cp - 1) + backward * (cp - 1)) * kv + backward * cp * kv
        nbytes = (forwards * (cp - 1) + backward * (cp - 1)) * kv * itemsize + backward * cp * kv * max(itemsize, 4)
        return {"calls": calls, "elements": elements, "bytes": nbytes, "wire_bytes": float(nbytes)}
    heads, kv_heads = a.n_head // tp, kv_width(a, tp) // a.head_size
    q_and_o = local * heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim if mla else 2 * a.head_size)
    copies = 1 if mla else ulysses_heads(cp, kv_heads, heads // kv_heads)[2]  # of each of the TP rank's KV heads
    per_way = q_and_o + copies * kv  # q, k, v, then o (forward); do, then dq, dk, dv (backward)
    elements = (forwards + layers * accum) * per_way
    nbytes = elements * itemsize
    return {"calls": (forwards + layers * accum) * 2, "elements": elements, "bytes": nbytes,
            "wire_bytes": nbytes * (cp - 1) / cp}


def cp_formula(cp_comm: str) -> str:
    """The per-layer traffic in words, for the plan's table."""
    if cp_comm == "ring":
        return "forward cp-1 sends of the local K,V, backward cp-1 of K,V and cp of dK,dV"
    return "q, k, v and o of the local tokens each way (k, v copied where cp > KV heads), (cp-1)/cp of them leaving"
