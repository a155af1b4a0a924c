"""Mixture-of-experts MLP: router, top-k, load-balancing and z-losses, capacity, experts.

MoEMLP replaces a block's MLP (GPTConfig.n_experts > 0, every `moe_every`-th layer). Input and
output: replicated [B, T, h], or the [B, T/tp, h] sequence shard under sequence parallelism.

    router     logits = x @ W_r (W_r [h, E], replicated, computed in float32 (float64 for float64
               models)), probs = softmax(logits), the top-k experts of each token (ties to the
               lower expert index); gates = their probabilities (renormalised to sum to 1 with
               moe_renormalize). DeepSeekMoE (`_route`): sigmoid scores, a correction bias
               added only to choose (moved after each step by `apply_score_bias`), the choice
               limited to the best groups, the gates scaled; shared experts (a dense MLP the
               block builds) added to the routed output. docs/moe.md
    losses     load balancing (Switch/GShard): coeff * E * sum_i f_i * P_i, f_i the fraction of
               the k * N assignments routed to expert i, P_i the mean probability of expert i;
               z-loss: coeff * mean(logsumexp(logits)^2); DeepSeek-V3's sequence-wise loss
               (`moe_seq_aux`: its sequences' statistics, exact at any layout). N: every token of the optimizer step
               (all its micro-batches, over the whole DP group (DP x CP with context
               parallelism), and the TP group's shards under sequence parallelism), so the
               losses, and their gradients, are those of one rank
               running the global batch as one micro-batch (what Megatron's global_aux_loss
               approximates): "The step's statistics" below. A forward outside a training step
               (no `begin_step`): N is that forward's tokens over the DP group
    capacity   with moe_capacity_factor cf, expert i takes at most ceil(cf * n * k / E) of the
               assignments of the n tokens of one DP rank's micro-batch (its source rank): the
               ones with the highest probability (ties, and values equal but for rounding, as
               `moe_capacity` ranks them: the earlier token, then the lower slot);
               a dropped assignment adds nothing (the token passes through the residual). The
               micro-batch's TP shards (SP) and CP chunks gather their top-k to decide it in
               token order, so neither SP nor CP changes what is dropped
    experts    E GPT-2 MLPs (h -> moe_ffn -> h, bias + GeLU), or with kind "swiglu" E Llama
               MLPs (Mixtral: a fused [gate | up] h -> 2 moe_ffn, silu(gate) * up, down to h),
               run together over their tokens sorted by expert (`moe_grouped`: batched matmuls,
               not a loop over the experts);
               y = sum over the k slots, in slot order, of gate * expert output

With tensor parallelism the experts are replicated and the tokens split over the TP ranks
(without sequence parallelism: rows [r * c, (r + 1) * c) of the B*T, c = ceil(B*T / tp),
all-gathered after the combine; with it: each rank's sequence shard), so no token is computed
twice, and the experts' gradients, each rank's partial sum, are summed over TP (`tp_partial`).
The router runs on every token a rank holds: replicated without sequence parallelism (identical
gradients), on the shard with it (partial gradients, summed over TP like the LayerNorms').

Backward: the combine, each expert's MLP, the gates (renormalisation), the load-balancing and
z-loss terms scaled by `aux_grad` (the loss scale of the auxiliary terms, set by GPT before each
backward), the softmax and the router.

The step's statistics. With T the step's tokens and c_i its assignments to expert i (both over
all micro-batches and DP ranks), the load-balancing loss is coeff * E / (k T^2) * sum_i c_i *
sum_x p_xi and its gradient for token x is coeff * E / (k T^2) * sum_i c_i dp_xi (c_i is not
differentiated, as Switch's f_i): every micro-batch's backward needs the whole step's c, which
is not known when the first backward runs (forwards and backwards alternate). So the training
step (cutp.train.moe.moe_step) first runs a counting pass when it has more than one
micro-batch: a training-mode forward of every micro-batch that keeps nothing for backward
(`not_stashed`; the same dropout masks, drawn by position), in which each MoE layer only adds up
its assignments per expert (`start_counting` / `finish_counting`: one all-reduce per layer over
the DP group (DP x CP), and TP under sequence parallelism). It gives c exactly, since the real forwards
then route the same tokens the same way. It costs one more forward of the blocks (not the LM
head) per micro-batch, with its all-to-alls at ep > 1 (tiny-moe on the CPU, 4 micro-batches of
2 x 128 tokens: 207 ms a step instead of 142), and only for steps of several micro-batches whose
load-balancing coefficient is not 0 (the z-loss needs only T, known up front; with one
micro-batch a forward's own counts over the DP group are the step's). Megatron's
global_aux_loss (router.py: global_tokens_per_expert summed over the micro-batches seen so far,
ga_steps) costs nothing but is not exact: micro-batch 1's backward sees only its own counts.
Each forward then reports its part of the step's losses (coeff * E / (k T^2) * sum_i c_i *
sum_x p_xi over its tokens; coeff * sum_x lse_x^2 / T): the parts add up to the step's losses.
Capacity stays per DP rank's micro-batch (above): with moe_capacity_factor set, dp and the
micro-batch size change which assignments are dropped.

Expert parallelism (ctx.ep_size > 1): this rank holds only experts [ep_rank * E/ep,
(ep_rank + 1) * E/ep) (named by their global index, so initialised and checkpointed alike at
any ep). Routing and capacity are decided at the source as above; the kept assignments' rows
travel to the EP rank owning their expert and back by all-to-all (`moe_dispatch`), each local
expert runs once over the rows of every source of its EP group, and the combine is the same.
With TP, each TP rank exchanges its own rows within the EP group of its tp_rank. The experts
are `expert_parallel`: the optimizer reduces them over the expert-DP group (expert-DP x CP).

Context parallelism (GPT sets `context_shard` on training forwards): the input is a CP rank's
zigzag chunks; the statistics are summed over DP x CP instead of DP, and the EP group is the
one of this rank's cp_rank (the experts are replicated over CP, so the tokens need not cross).
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..ops.common import as_dtype, compute_dtype
from ..runtime.errors import ConfigError
from . import moe_capacity, moe_stats
from .context_parallel import zigzag_positions
from .declare import below, build_parameters
from .moe_dispatch import assignments, combine, dispatch, dispatch_rows
from .moe_experts import ExpertMLP, moe_parameters
from .moe_grouped import GroupedExperts
from .moe_seq_aux import seq_balance, seq_balance_grad
from .parameter import Module
from .validation import check_routing


def check_moe(n_experts, top_k, every, ffn, capacity_factor, aux_coeff, z_coeff, *, scoring="softmax", n_group=1,
              topk_group=1, score_bias=False, bias_update_rate=0.0, shared=0, seq_aux=0.0) -> None:
    """GPTConfig's MoE fields; raises ConfigError naming the fix."""
    if not (isinstance(n_experts, int) and n_experts >= 0):
        raise ConfigError(f"n_experts must be an integer >= 0 (0: a dense MLP), got {n_experts!r}")
    if n_experts == 0:
        return
    if not (isinstance(top_k, int) and 1 <= top_k <= n_experts):
        raise ConfigError(f"moe_top_k must be an integer in [1, n_experts={n_experts}], got {top_k!r}")
    if not (isinstance(every, int) and every >= 1):
        raise ConfigError(f"moe_every must be an integer >= 1 (1: every layer), got {every!r}")
    if ffn is not None and not (isinstance(ffn, int) and ffn >= 1):
        raise ConfigError(f"moe_ffn must be a positive integer or None (the MLP width), got {ffn!r}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ConfigError(f"moe_capacity_factor must be > 0, or None (no dropping), got {capacity_factor!r}")
    for name, v in (("moe_aux_loss_coeff", aux_coeff), ("moe_z_loss_coeff", z_coeff), ("moe_seq_aux_loss", seq_aux)):
        if not v >= 0:
            raise ConfigError(f"{name} must be >= 0, got {v!r}")
    check_routing(n_experts, top_k, aux_coeff, z_coeff, scoring, n_group, topk_group, score_bias, bias_update_rate,
                  shared)


class MoEMLP(Module):
    def __init__(self, ctx, n_embd, *, n_experts, top_k, ffn, capacity_factor=None, aux_loss_coeff=1e-2,
                 z_loss_coeff=0.0, renormalize=False, name, n_layer=1, bias=True, gelu="tanh", seed=0,
                 dtype=np.float32, kind="gelu", scoring="softmax", n_group=1, topk_group=1, routed_scaling=1.0,
                 score_bias=False, bias_update_rate=0.0, shared_experts=None, seq_aux_coeff=0.0, params=None):
        """shared_experts: DeepSeekMoE's shared experts, a dense MLP the caller builds (one
        SwiGLU of their total width, split over TP), run on every token beside the routed ones.
        seq_aux_coeff: DeepSeek-V3's sequence-wise balance loss's alpha (`moe_seq_aux`). params: its
        router's and routed experts' parameters, built from `moe_parameters` (None: built here)."""
        self.ctx = ctx
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff, self.renormalize = aux_loss_coeff, z_loss_coeff, renormalize
        self.scoring, self.n_group, self.topk_group = scoring, n_group, topk_group
        self.routed_scaling, self.bias_update_rate, self.seq_aux_coeff = routed_scaling, bias_update_rate, seq_aux_coeff
        ep = ctx.ep_size
        if n_experts % ep:
            raise ConfigError(f"ep={ep} does not divide n_experts={n_experts}: each EP rank holds n_experts / ep "
                              f"experts; use an ep that divides both dp={ctx.dp_size} and {n_experts}")
        if params is None:
            params = build_parameters(ctx, moe_parameters(n_embd, n_experts=n_experts, ffn=ffn, kind=kind, bias=bias,
                                      n_layer=n_layer, score_bias=score_bias), name, seed=seed, dtype=dtype)
        self.router = params["router.weight"]
        # DeepSeek-V3's correction bias: added to the scores to choose the experts, never to weigh them;
        # a buffer (float32, outside the optimizer), moved after each step by `apply_score_bias`
        self.score_bias = params.get("router.score_bias")
        self.shared_experts = shared_experts
        self._bias_move = None  # the step's planned correction-bias move (`plan_score_bias`)
        local = n_experts // ep
        self.expert_lo = ctx.ep_rank * local  # this rank's experts: [expert_lo, expert_lo + local)
        self.experts = [ExpertMLP(ctx, n_embd, ffn, name=f"{name}.experts.{e}", n_layer=n_layer, bias=bias, gelu=gelu,
                                  seed=seed, dtype=dtype, kind=kind, params=below(params, f"experts.{e}"))
                        for e in range(self.expert_lo, self.expert_lo + local)]
        self.grouped = GroupedExperts(self.experts)
        self.sequence_parallel = False  # the input is this rank's sequence shard (GPT sets it)
        self.context_shard = None  # (cp_rank, cp): the input is a CP rank's zigzag chunks (GPT sets it)
        self.aux_grad = 1.0  # d(objective)/d(auxiliary losses) for the next backward (GPT sets it)
        self.last = {}  # the last forward's losses and counts (the metrics)
        # the optimizer step's statistics (`begin_step`; None: each forward's own)
        self.step_tokens: float | None = None  # T, the step's tokens over the DP group
        self.step_fractions = None  # (f on the device, f on the host): c_i / (k T), the step's
        self._tally = None  # inside the counting pass: [assignments per expert, tokens] (float64)
        self.reset_step_stats()

    # ---- metrics ---------------------------------------------------------------------------------
    pending: tuple = ()  # the step's forwards' statistics still on the device (moe_stats)

    def reset_step_stats(self) -> None:
        """Sums over one optimizer step's training forwards (train_step reads and resets them)."""
        self.step_stats = {"aux_loss": 0.0, "z_loss": 0.0, "seq_aux_loss": 0.0, "assigned": np.zeros(self.n_experts),
                           "dropped": 0.0, "forwards": 0}

    # ---- the step's statistics (module docstring) ------------------------------------------------
    def begin_step(self, tokens: float) -> None:
        """The next forwards belong to one optimizer step of `tokens` tokens over the DP group
        (those of all its CP ranks together; `step_fractions` from the counting pass, else each
        forward's own: exact with one micro-batch, or with a load-balancing coefficient of 0)."""
        self.step_tokens = float(tokens)

    def end_step(self) -> None:
        self.step_tokens = self.step_fractions = self._tally = None

    def start_counting(self) -> None:
        """The counting pass begins: the next training forwards only add up their assignments."""
        self._tally = 0.0

    def finish_counting(self) -> None:
        """The counting pass ends: the step's assignment fractions, summed over the DP (x CP)
        group (and TP under sequence parallelism). Collective over those groups
        (`moe_stats.finish_counting` does every layer's in one host read)."""
        moe_stats.finish_counting([self])

    @property
    def last(self) -> dict:
        """The last forward's losses and counts (the metrics): read from the device now if the
        step has not read them yet (`moe_stats.read_pending`)."""
        if self.pending:
            moe_stats.read_pending([self])
        return self._last

    @last.setter
    def last(self, value: dict) -> None:
        self._last = value

    # ---- the token layout --------------------------------------------------------------------
    def _split_rows(self, n) -> tuple[int, int, int] | None:
        """Without sequence parallelism at tp > 1: this rank's rows [lo, hi) of n and the padded
        count per rank; None when this rank runs every row."""
        tp = self.ctx.tp_size
        if tp == 1 or self.sequence_parallel:
            return None
        c = -(-n // tp)
        lo = min(n, self.ctx.tp_rank * c)
        return lo, min(n, lo + c), c

    def _stats_groups(self):
        groups = [self.ctx.tp] if self.sequence_parallel and self.ctx.tp_size > 1 else []
        # the ranks holding the step's tokens: DP, and CP with its sequences split (training)
        ctx = self.ctx
        dp, size = (ctx.dp, ctx.dp_size) if self.context_shard is None else (ctx.dp_cp, ctx.dp_cp_size)
        if self.training and size > 1:  # (evaluation: this rank's tokens; no collective)
            groups.append(dp)
        return groups

    # ---- forward -------------------------------------------------------------------------------
    def lay_out_sequence(self, on, shard):
        self.sequence_parallel = on  # (the router, used on this rank's tokens, is declared `sp`)

    def lay_out_context(self, shard):
        self.context_shard = shard  # (the statistics over DP x CP)

    def forward(self, x):
        xp = self.ctx.xp
        shape, h = x.shape, x.shape[-1]
        x2 = x.reshape(-1, h)
        n, E, k = x2.shape[0], self.n_experts, self.top_k
        cdt = compute_dtype(x.dtype)
        logits = as_dtype(x2, cdt) @ as_dtype(self.router.data, cdt)
        probs, lse, idx, top_p, gates = self._route(logits)
        keep = self._capacity_keep(top_p, idx, shape)
        counts = xp.bincount(idx.reshape(-1), minlength=E)
        if self._tally is not None:  # the counting pass: only the assignments (module docstring)
            mine = xp.concatenate([counts.astype(np.float64), xp.full(1, n, np.float64)])
            self._tally = mine + self._tally
            return self._experts_output(x2, idx, gates, keep, shape)[0]
        # statistics over the micro-batch of the whole DP group: [assigned per expert, probability sums,
        # tokens, sum of lse^2, dropped assignments, sequences' sum f_i P_i] (SP: each rank its shard's)
        seq = (xp.zeros((), cdt), None, None) if not (self.seq_aux_coeff and self.training) else \
            seq_balance(self, probs, idx, shape)
        scalars = [xp.asarray(n, cdt), (lse * lse).sum().astype(cdt), (~keep).sum().astype(cdt),  # (device arrays:
                   seq[0].astype(cdt)]
        stats = xp.concatenate([counts.astype(cdt), probs.sum(axis=0),  # CuPy builds no array from a list
                                xp.stack(scalars)])  # mixing host numbers and arrays)
        for g in self._stats_groups():
            g.all_reduce(stats, "sum", out=stats)
        # inside a training step the statistics stay on the device until the step reads every
        # layer's at once (moe_stats); elsewhere the token count n_all is one of them: read now
        host = None if self.training and self.step_tokens is not None else self.ctx.to_numpy(stats)
        n_all = self.step_tokens if host is None else float(host[2 * E])
        if self.step_fractions is not None and self.training:
            f, f_host = self.step_fractions
        else:
            f, f_host = stats[:E] / (n_all * k), None  # (f on the device: the backward's)
        record = (stats, n_all, f_host, None if seq[1] is None else seq[2], self.training and self.stash)
        if host is None:
            self.pending += (record,)
        else:
            moe_stats.settle(self, host, *record[1:])
        y, saved = self._experts_output(x2, idx, gates, keep, shape)
        self._save("moe", (x2, probs, lse, idx, top_p, gates, keep, f, n_all, saved, seq[1:]))
        if self.shared_experts is not None:
            y = y + self.shared_experts.forward(x)
        return y

    def _route(self, logits):
        """(scores [n, E], lse [n], the top-k experts [n, k], their scores, the gates): softmax
        over the logits, or (sigmoid) the logits' sigmoids with the correction bias added to
        choose (and with n_group > 1 only among the topk_group groups whose two best biased
        scores sum highest); ties to the lower index; the gates renormalised (sigmoid: over the
        sum + 1e-20, as DeepSeek-V3) and scaled by routed_scaling."""
        xp, k = self.ctx.xp, self.top_k
        if self.scoring == "sigmoid":
            probs = 1.0 / (1.0 + xp.exp(-logits))
            lse = xp.zeros(logits.shape[0], logits.dtype)
            choice = probs if self.score_bias is None else probs + as_dtype(self.score_bias.data, logits.dtype)
            if self.n_group > 1:
                n, E = logits.shape
                by_group = choice.reshape(n, self.n_group, E // self.n_group)
                best2 = xp.sort(by_group, axis=2)[:, :, -2:].sum(axis=2)
                chosen = xp.argsort(-best2, axis=1, kind="stable")[:, :self.topk_group]
                allowed = xp.zeros(best2.shape, bool)
                allowed[xp.arange(n)[:, None], chosen] = True
                choice = xp.where(xp.repeat(allowed, E // self.n_group, axis=1), choice, -xp.inf)
            idx = xp.argsort(-choice, axis=1, kind="stable")[:, :k]
        else:
            top = logits.max(axis=1, keepdims=True)
            ex = xp.exp(logits - top)
            total = ex.sum(axis=1, keepdims=True)
            probs = ex / total
            lse = top[:, 0] + xp.log(total[:, 0])
            idx = xp.argsort(-probs, axis=1, kind="stable")[:, :k]
        top_p = xp.take_along_axis(probs, idx, axis=1)
        gates = top_p
        if self.renormalize:
            gates = top_p / (top_p.sum(axis=1, keepdims=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        if self.routed_scaling != 1.0:
            gates = gates * self.routed_scaling
        return probs, lse, idx, top_p, gates

    def plan_score_bias(self, assigned) -> None:
        """The step's bias move, rate * sign(mean load - load), `assigned` the step's assignments
        per expert over its whole global batch (the same on every rank of every layout); applied
        by `apply_score_bias` once the optimizer has stepped (a skipped step moves nothing)."""
        self._bias_move = None
        if self.score_bias is not None and self.bias_update_rate:
            load = np.asarray(assigned, np.float64)
            self._bias_move = self.bias_update_rate * np.sign(load.mean() - load)

    def apply_score_bias(self) -> None:
        move, self._bias_move = self._bias_move, None
        if move is not None:
            self.score_bias.data += self.ctx.asarray(move.astype(self.score_bias.data.dtype))

    def _experts_output(self, x2, idx, gates, keep, shape):
        """(y [shape], what the experts' backward needs): this rank's rows through their experts,
        all-gathered over TP when the rows are split."""
        n = x2.shape[0]
        rows = self._split_rows(n)
        lo, hi = (0, n) if rows is None else rows[:2]
        y, saved = self._experts_forward(x2[lo:hi], idx[lo:hi], gates[lo:hi], keep[lo:hi])
        if rows is not None:
            y = self._gather_rows(y, rows, n)
        return y.reshape(shape), saved

    def _capacity_keep(self, top_p, idx, shape):
        """[n, k] bool: which assignments their expert accepts (all without a capacity factor)."""
        xp = self.ctx.xp
        if self.capacity_factor is None:
            return xp.ones(idx.shape, bool)
        k, E = self.top_k, self.n_experts
        B, T_mine = shape[:2]
        shard = self.sequence_parallel and self.ctx.tp_size > 1
        # the DP rank's whole micro-batch decides, in its token order: the TP shards ([tp, B,
        # T/tp, k] -> [B, T, k]), then the CP ranks' zigzag chunks put back in place
        p_all, i_all = self._whole_micro_batch(top_p, B, T_mine, shard), self._whole_micro_batch(idx, B, T_mine, shard)
        n = i_all.shape[0]
        capacity = math.ceil(self.capacity_factor * n * k / E)
        # (ranked on the probabilities in a narrower float, so that values equal but for the
        # layout's rounding tie and go in token order: moe_capacity)
        accepted = moe_capacity.accepted(xp, i_all.reshape(-1), p_all.reshape(-1), E, capacity).reshape(B, -1, k)
        if self.context_shard is not None:  # this CP rank's tokens
            cp_rank, cp = self.context_shard
            accepted = accepted[:, xp.asarray(zigzag_positions(accepted.shape[1], cp, cp_rank))]
        if shard:
            tp, r = self.ctx.tp_size, self.ctx.tp_rank
            return accepted.reshape(B, tp, T_mine, k)[:, r].reshape(-1, k)
        return accepted.reshape(-1, k)

    def _whole_micro_batch(self, a, B, T_mine, shard):
        """[B * T_mine, k] of this rank's tokens -> [B * T, k] of the DP rank's micro-batch, in
        its token order: gathered over TP (sequence shards) and CP (zigzag chunks)."""
        xp, k = self.ctx.xp, a.shape[1]
        a = a.reshape(B, T_mine, k)
        if shard:
            tp = self.ctx.tp_size
            a = self.ctx.tp.all_gather(xp.ascontiguousarray(a)).reshape(tp, B, T_mine, k)
            a = a.transpose(1, 0, 2, 3).reshape(B, tp * T_mine, k)
        if self.context_shard is not None:
            cp, T_local = self.ctx.cp_size, a.shape[1]
            every = self.ctx.cp.all_gather(xp.ascontiguousarray(a)).reshape(cp, B, T_local, k)
            a = xp.empty((B, cp * T_local, k), a.dtype)
            for r in range(cp):
                a[:, xp.asarray(zigzag_positions(cp * T_local, cp, r))] = every[r]
        return a.reshape(-1, k)

    def _experts_forward(self, x, idx, gates, keep):
        """This rank's tokens through their experts, combined in slot order: y [n, h]. The kept
        assignments sorted by expert (and at ep > 1 sent to the experts' EP ranks and back) run
        through the local experts in one grouped pass (`moe_grouped`)."""
        xp = self.ctx.xp
        n, k = idx.shape
        outs = xp.zeros((n, k, x.shape[1]), x.dtype)
        rows, slots, counts = assignments(xp, idx, keep, self.n_experts)
        if self.ctx.ep_size > 1:  # the rows travel to their experts' EP ranks and back
            xe, ex = dispatch(self.ctx.ep, x[rows], counts, xp)
            bounds = ex.bounds
        else:
            xe, ex = x[rows], None
            bounds = np.concatenate([[0], np.cumsum(self.ctx.to_numpy(counts))]).tolist()
        ye, cache = self._run_experts(xe, bounds)
        outs[rows, slots] = ye if ex is None else combine(self.ctx.ep, ye, ex, xp)
        return _combine(outs, gates), (outs, (rows, slots, ex, cache))

    def _run_experts(self, xe, bounds):
        """The rows sorted by local expert (expert i's are xe[bounds[i]:bounds[i + 1]]) through
        their experts: in one grouped pass, or expert by expert where adapters or frozen weights
        (LoRA, --freeze) change an expert's own forward and backward (`ExpertMLP.forward`)."""
        if not any(e.fc1_lora is not None or e.fc2_lora is not None or not all(p.trainable for p in e.own_parameters())
                   for e in self.experts):
            return self.grouped.forward(xe, bounds)
        ye, caches = self.ctx.xp.empty_like(xe), []
        for i, expert in enumerate(self.experts):
            a, b = bounds[i], bounds[i + 1]
            caches.append(None)
            if b > a:
                ye[a:b], caches[i] = expert.forward(xe[a:b])
        return ye, ("expert by expert", bounds, caches)

    def _run_experts_backward(self, do, cache):
        if not (isinstance(cache, tuple) and cache and cache[0] == "expert by expert"):
            return self.grouped.backward(do, cache)
        _, bounds, caches = cache
        dxe = self.ctx.xp.empty_like(do)
        for i, (expert, saved) in enumerate(zip(self.experts, caches)):
            if saved is not None:
                dxe[bounds[i]:bounds[i + 1]] = expert.backward(do[bounds[i]:bounds[i + 1]], saved)
        return dxe

    def _gather_rows(self, part, rows, n):
        """The TP ranks' row blocks (each padded to c rows) all-gathered: [n, h] on every rank."""
        lo, hi, c = rows
        if hi - lo < c:
            part = self.ctx.xp.concatenate([part, self.ctx.xp.zeros((c - (hi - lo), part.shape[1]), part.dtype)])
        return self.ctx.tp.all_gather(self.ctx.xp.ascontiguousarray(part))[:n]

    # ---- backward ------------------------------------------------------------------------------
    def backward(self, dy):
        d_shared = None if self.shared_experts is None else self.shared_experts.backward(dy)
        x2, probs, lse, idx, top_p, gates, keep, f, n_all, (outs, saved), (seq_f, seq_T) = self._load("moe")
        xp = self.ctx.xp
        shape, h = dy.shape, dy.shape[-1]
        dy2 = dy.reshape(-1, h)
        n = dy2.shape[0]
        cdt = probs.dtype
        rows = self._split_rows(n)
        lo, hi = (0, n) if rows is None else rows[:2]
        dy_mine = dy2[lo:hi]
        # the combine: y = sum_j gates_j * outs_j
        d_gates = xp.einsum("nkh,nh->nk", as_dtype(outs, cdt), as_dtype(dy_mine, cdt))
        dx_slots = xp.zeros(outs.shape, dy.dtype)
        r, j, ex, cache = saved
        do = as_dtype(gates[lo:hi][r, j][:, None] * as_dtype(dy_mine[r], cdt), dy.dtype)
        if ex is not None:  # output gradients to the experts' EP ranks, input gradients back
            do = dispatch_rows(self.ctx.ep, do, ex, xp)
        dxe = self._run_experts_backward(do, cache)
        dx_slots[r, j] = dxe if ex is None else combine(self.ctx.ep, dxe, ex, xp)
        dx_experts = _sum_slots(dx_slots)
        if rows is not None:
            dx_experts = self._gather_rows(dx_experts, rows, n)
            d_gates = self._gather_rows(d_gates, rows, n)
        # the gates (renormalised: g_j = r p_j / S, r the routed scaling), then the scores of the k experts
        r = self.routed_scaling
        if self.renormalize:
            S = top_p.sum(axis=1, keepdims=True) + (1e-20 if self.scoring == "sigmoid" else 0.0)
            d_top = (r * d_gates - (d_gates * gates).sum(axis=1, keepdims=True)) / S
        else:
            d_top = r * d_gates if r != 1.0 else d_gates
        d_probs = xp.zeros_like(probs)
        d_probs[xp.arange(n)[:, None], idx] = d_top
        E = self.n_experts
        if seq_f is not None:  # the sequence-wise loss over the step's n_all / T sequences
            d_probs += seq_balance_grad(self, probs, seq_f, seq_T, self.aux_grad * self.seq_aux_coeff * seq_T / n_all)
        if self.scoring == "sigmoid":  # (no load-balancing or z-losses: check_moe)
            d_logits = d_probs * probs * (1.0 - probs)
        else:
            d_probs += self.aux_grad * self.aux_loss_coeff * E / n_all * f[None, :]  # load balancing: f_i P_i
            d_logits = probs * (d_probs - (d_probs * probs).sum(axis=1, keepdims=True))
            d_logits += (self.aux_grad * self.z_loss_coeff * 2.0 / n_all) * lse[:, None] * probs  # z-loss
        if self.router.trainable:
            self.router.grad += as_dtype(as_dtype(x2, cdt).T @ d_logits, self.router.grad.dtype)
        dx = as_dtype(d_logits @ as_dtype(self.router.data, cdt).T, dy.dtype) + dx_experts
        return dx.reshape(shape) if d_shared is None else dx.reshape(shape) + d_shared


def _combine(outs, gates):
    """sum_j gates[:, j] * outs[:, j], the slots added in order (the same bits at any layout)."""
    cdt = gates.dtype
    y = gates[:, 0, None] * as_dtype(outs[:, 0], cdt)
    for j in range(1, outs.shape[1]):
        y += gates[:, j, None] * as_dtype(outs[:, j], cdt)
    return as_dtype(y, outs.dtype)


def _sum_slots(a):
    y = a[:, 0].copy()
    for j in range(1, a.shape[1]):
        y += a[:, j]
    return y
