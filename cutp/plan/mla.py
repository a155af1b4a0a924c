"""The planner's multi-head latent attention arithmetic (DeepSeek's MLA, cutp.tensor_parallel.mla).

What an MLA module keeps for backward, per layer of one rank (act: the activation item size, c:
the compute dtype's, 4 for 16-bit and float32, 8 for float64; s the CP rank's tokens, b the
micro-batch, t the TP size, n = n_head / t this rank's heads, d_qk = d_nope + d_rope; s' = s / t
with sequence parallelism, else s: the tokens the down-projections and their norms run on):

    input x                  s' b h act           (q_a and kv_a's input; without q_lora_rank under SP
                                                  also q_proj's gathered s b h act)
    q latent (q_lora_rank)   s' b r_q act + s' b c   (its norm's input and 1 / rms)
                             + s b r_q act           (q_b's input, gathered under SP)
    kv latent                s' b r_kv act + s' b c + s b r_kv act   (likewise, kv_b)
    expanded q, k            2 n s b d_qk act     (the rope key broadcast into every head)
    kv_b's output            n s b (d_nope + d_v) act   (v is a view of it)
    scores (plain path)      n s^2 b c            (probabilities; with dropout the mask, 1 byte, and
                                                  the dropped ones, c, besides; none under selective
                                                  recomputation, which recomputes them)
    or, the ring (CP)        n s b d_v act + n s b c   (o and the log-sum-exp)
    output projection input  n s b d_v act
    CP's rope tables         4 s d_rope c         (this rank's zigzag rows of cos and sin, for q and
                                                  for k; packed rows take position ids instead)

The all-to-all (cp_comm a2a) keeps the whole sequence's q, k, v of n / cp heads (S = s cp tokens:
n S b (2 d_qk + d_v) act / cp) and its scores (n S^2 b c / cp) in place of the expanded q, k, kv_b's
output and the scores, under selective recomputation too (as multi-head attention's all-to-all).
Full recomputation keeps the layer's input only (Korthikanti et al.'s figure, unchanged). The
plain path's figures: with the fused kernels (a GPU, head dims they take) o and the log-sum-exp,
O(s), take the scores' place, which the figure does not model (nor does Korthikanti et al.'s).

`mla_attention_bytes` is that sum; `mha_attention_bytes` the multi-head attention's share of
Korthikanti et al.'s per-layer figure (its input 2 s b h, Q, K, V and the output projection's
input 8 s b h / t, scores, dropout mask and dropped probabilities 5 a s^2 b / t; the mask 1 byte),
which the planner replaces by it. tests/plan/test_mla.py counts the caches of cutp's MLA on
shape-only arrays against them.

TP collectives (`mla_tp_collectives`): where multi-head attention all-reduces b s h twice (the
output projection forward, the QKV input gradient backward), MLA all-reduces b s h forward and,
backward, the input gradients of q_b (b s r_q; q_proj's: b s h), kv_b (b s r_kv) and of the
shared rope key (b s d_rope): 4 collectives. Under sequence parallelism each is a reduce-scatter
and an all-gather of the same size, and the down-projections' weights and their norms, used on
the rank's tokens, join the TP gradient sum (MLASpec declares them `sp`).
"""
from __future__ import annotations


def _compute_bytes(act: int) -> int:
    return 8 if act == 8 else 4


def mla_attention_bytes(a, s: int, b: int, t: int, act: int, sequence_parallel: bool = False, *, cp: int = 1,
                        cp_comm: str = "ring", recompute: str = "none", dropout: bool | None = None,
                        packed: bool = False) -> float:
    """What one MLA module keeps for backward on one rank (module docstring); s: the CP rank's
    tokens (seq_len / cp). recompute: "none" or "selective" (full: the caller's, the layer's
    input); dropout: the attention dropout is on (None: a.dropout > 0); packed: the rows'
    positions come as ids (no CP rope tables)."""
    c = _compute_bytes(act)
    h, n = a.n_embd, a.n_head // t
    dqk, dv, dn = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim, a.qk_nope_head_dim
    sp = t > 1 and sequence_parallel
    local = s // t if sp else s
    drop = (a.dropout > 0) if dropout is None else dropout
    total = local * b * h * act
    if a.q_lora_rank:
        total += local * b * (a.q_lora_rank * act + c) + s * b * a.q_lora_rank * act
    elif sp:
        total += s * b * h * act  # q_proj's gathered input
    total += local * b * (a.kv_lora_rank * act + c) + s * b * a.kv_lora_rank * act
    total += n * s * b * dv * act  # the output projection's input
    if cp > 1 and not packed:
        total += 4 * s * a.qk_rope_head_dim * c
    if cp > 1 and cp_comm == "a2a":
        S = s * cp
        scores = n * S * S * b // cp
        return total + n * S * b * (2 * dqk + dv) * act // cp + scores * (c + (1 + c if drop else 0))
    total += n * s * b * (2 * dqk + dn + dv) * act
    if cp > 1:  # the ring: o and the log-sum-exp
        return total + n * s * b * (dv * act + c)
    if recompute == "selective":
        return total
    return total + n * s * s * b * (c + (1 + c if drop else 0))


def mha_attention_bytes(s: int, b: int, h: int, heads: int, t: int, act: int, recompute: str,
                        sequence_parallel: bool) -> float:
    """Multi-head attention's share of `activation_bytes_per_layer` (module docstring): what the
    planner takes out of Korthikanti et al.'s figure for an MLA layer (`recompute` none or
    selective: under full recomputation the layer keeps its input, and no share is taken)."""
    sbh = s * b * h
    base = sbh * (2 / (t if sequence_parallel else 1) + 8 / t)
    masks = 0.0
    if recompute == "none":
        base += 5 * heads * s * s * b / t
        masks = heads * s * s * b / t
    if act == 2:
        return base
    return (base - masks) * (act / 2) + masks


def mla_tp_collectives(a, tokens: int) -> tuple[int, int]:
    """(calls, elements) of one MLA layer's activation collectives beyond multi-head attention's
    2 of `tokens` x h (module docstring); tokens: b s of the CP rank."""
    q_width = a.q_lora_rank or a.n_embd
    return 2, tokens * (q_width + a.kv_lora_rank + a.qk_rope_head_dim - a.n_embd)

