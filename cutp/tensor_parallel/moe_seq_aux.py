"""DeepSeek-V3's sequence-wise balance loss (Megatron's seq_aux_loss), for MoEMLP.

For each sequence of T tokens, with E experts and top-k routing:

    f_i = E / (k T) * (the sequence's picks of expert i)      (not differentiated)
    P_i = (1 / T) * sum over the sequence's tokens of s_i / sum_j s_j
    L   = alpha * sum_i f_i P_i,  averaged over the step's sequences

s the router's scores (softmax: the probabilities, whose sum is 1; sigmoid: the sigmoids, as
DeepSeek-V3 normalises them, over their sum + 1e-20). A sequence split over ranks (sequence
parallelism's TP shards, context parallelism's zigzag chunks) has its counts and score sums
added over those ranks first (`sequence_groups`), so each of them holds the sequence's f and
P and no layout changes the loss or its gradient. The step's sequences: its tokens (MoEMLP's
n_all, over the DP group) / T.

`seq_balance` gives the forward's part (summed over this rank's sequences, divided by how many
ranks share them, so that the statistics' sum over the DP group's ranks is the micro-batch's
sum) and `seq_balance_grad` the gradient it adds to the scores.
"""
from __future__ import annotations


def sequence_groups(layer) -> list:
    """The groups over which a sequence's tokens are split: TP under sequence parallelism, CP
    with the context split (training)."""
    ctx = layer.ctx
    groups = [ctx.tp] if layer.sequence_parallel and ctx.tp_size > 1 else []
    if layer.context_shard is not None and ctx.cp_size > 1:
        groups.append(ctx.cp)
    return groups


def seq_balance(layer, probs, idx, shape):
    """(this rank's sum over its sequences of sum_i f_i P_i divided by the ranks sharing them,
    f [B, E], the sequence length T). Collective over `sequence_groups`."""
    xp = layer.ctx.xp
    B, T_mine = shape[0], shape[1]
    E, k = layer.n_experts, layer.top_k
    rows = xp.arange(B)[:, None] * E + idx.reshape(B, T_mine * k)
    counts = xp.bincount(rows.reshape(-1), minlength=B * E).reshape(B, E).astype(probs.dtype)
    stats = xp.concatenate([counts, _normalised(layer, probs).reshape(B, T_mine, E).sum(axis=1)], axis=1)
    groups, T, share = sequence_groups(layer), T_mine, 1
    for g in groups:
        g.all_reduce(stats, "sum", out=stats)
        T, share = T * g.size, share * g.size
    f = stats[:, :E] * (E / (k * T))
    return (f * stats[:, E:]).sum() / (T * share), f, T


def seq_balance_grad(layer, probs, f, T, coeff):
    """d(coeff * sum over this rank's sequences of sum_i f_i P_i)/d(scores) [n, E]: coeff f_i / T
    for each of the sequence's tokens, through the normalisation (sigmoid)."""
    xp = layer.ctx.xp
    B = f.shape[0]
    g = xp.repeat(f * (coeff / T), probs.shape[0] // B, axis=0)
    if layer.scoring != "sigmoid":
        return g  # (softmax: the probabilities sum to 1)
    total = probs.sum(axis=1, keepdims=True) + 1e-20
    return (g - (g * probs).sum(axis=1, keepdims=True) / total) / total


def _normalised(layer, probs):
    if layer.scoring != "sigmoid":
        return probs
    return probs / (probs.sum(axis=1, keepdims=True) + 1e-20)
