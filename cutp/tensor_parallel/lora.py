"""LoRA adapters on the tensor-parallel linears, and freezing (`Parameter.trainable`).

`apply_lora(model, LoraSpec(rank, alpha, dropout, targets))` freezes every parameter of the model
and gives each targeted Hugging Face projection (q, k, v, o, gate, up, down) one trainable pair,
as PEFT's LoraModel does:

    y = base(x) + (alpha / r) * B(A(dropout(x)))        A [in, r], B [r, out] (cutp's [in, out])

A is drawn as PEFT draws lora_A (kaiming uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in)),
from the pair's own seeded generator, so at any layout), B is zero. The fused linears hold
several pairs: attn.qkv one for each of q, k, v targeted (its columns [q | k | v]), mlp.fc1 of
a SwiGLU MLP gate and up ([gate | up]); a GeLU MLP's fc1 is "up", fc2 "down"; MoE experts'
fc1 / fc2 likewise (their weights are replicated over TP).

Sharding follows PEFT's LoraParallelLinear for Megatron layers:
- column-parallel base (qkv, fc1): A replicated, B split like the base's output columns (this
  rank's heads' q / k / v columns, GQA-replicated KV heads included: their B columns summed over
  the ranks holding them, as the base's). The low-rank input gradient joins the base's dx before
  its TP all-reduce (or reduce-scatter), so it costs no collective; A's gradient, each rank's
  columns' part, is summed over TP (`tp_partial`).
- row-parallel base (proj, fc2): A split by input rows like the base, B replicated; each rank's
  low-rank product x_r A_r B is added to its partial output before the base's all-reduce (or
  reduce-scatter): sum_r (x_r A_r) B = (sum_r x_r A_r) B, one collective for both. B's gradient,
  each rank's part, is summed over TP (`tp_partial`).
- experts: A and B replicated over TP like the expert (`tp_partial`), held by its EP rank
  (`expert_parallel`).
- multi-head latent attention (cutp.tensor_parallel.mla; PEFT's DeepseekV3 targets q_a_proj,
  q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj: `--lora-targets q_a,q_b,kv_a,kv_b,o`):
  q_b / q_proj and kv_b are column-parallel, o_proj row-parallel, as above; on the replicated
  down-projections q_a and kv_a, A and B are replicated too, their gradients whole on every TP
  rank (the up-projections' backward all-reduces the latents' gradients), so nothing is summed.

Dropout on the adapter input draws by global position (a site per pair, the element's global
token and input feature: `Dropout.draw_rows`, `cutp.ops.dropout_mask_at`), so TP, SP, CP, DP and
recomputation all give the same masks. Adapters on MoE experts take no dropout (their rows are
routed tokens: refused by name).

`freeze(model, groups)`: --freeze's groups (embeddings, norms, head, attention, mlp) or name
globs, each refused by name when it matches nothing.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..runtime.errors import ConfigError
from .attention import ParallelAttention
from .context_parallel import local_segments
from .grads import sum_grad_over
from .layers import Dropout, with_weight, without_weight
from .mla import MultiLatentAttention
from .moe import MoEMLP
from .moe_experts import ExpertMLP
from .parameter import Module, make_parameter, zeros_init
from .random import REPLICATED
from .sharding import contiguous, part_sharding
from .transformer import ParallelMLP

DENSE_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
MLA_TARGETS = ("q_a", "q_b", "kv_a", "kv_b")  # DeepSeek's q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj
TARGETS = DENSE_TARGETS + MLA_TARGETS
DEFAULT_TARGETS = ",".join(DENSE_TARGETS)
FREEZE_GROUPS = {  # --freeze GROUP: the parameter names it covers (fnmatch globs)
    "embeddings": ("tok_embed.*", "pos_embed.*"),
    "norms": ("*norm.*",),
    "head": ("lm_head.*", "final_norm.*"),
    "attention": ("layers.*.attn.*",),
    "mlp": ("layers.*.mlp.*",),
}


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = TARGETS

    def __post_init__(self):
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ConfigError(f"`lora_rank` {self.rank!r}: the adapters' rank is an integer >= 1, e.g. 8")
        if not self.alpha > 0:
            raise ConfigError(f"`lora_alpha` {self.alpha!r}: use a number > 0 (PEFT's default is 8; alpha / rank "
                              "scales the adapters' output)")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"`lora_dropout` {self.dropout!r}: use a probability in [0, 1)")
        if not self.targets:  # (`--lora-targets ""`: not "all of them", which is what omitting it means)
            raise ConfigError(f"`lora_targets` is empty: give the projections to adapt, some of {','.join(TARGETS)} "
                              f"(e.g. q,v), or omit `lora_targets` for {DEFAULT_TARGETS}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad:
            raise ConfigError(f"`lora_targets` {','.join(self.targets)}: {bad or 'none given'} is no projection; "
                              f"use some of {','.join(TARGETS)} (Hugging Face's q_proj ... down_proj)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def spec_of(settings: dict) -> LoraSpec | None:
    """The LoRA of a run's settings (RunConfig's fields, or a checkpoint's train_args): None
    without lora_rank; alpha defaults to the rank (scale 1)."""
    rank = settings.get("lora_rank")
    if rank is None:
        return None
    alpha, targets = settings.get("lora_alpha"), settings.get("lora_targets")
    return LoraSpec(int(rank), float(rank if alpha is None else alpha), float(settings.get("lora_dropout") or 0.0),
                    parse_targets(DEFAULT_TARGETS if targets is None else targets))  # ("": refused, not the default)


def freeze_groups(settings: dict) -> tuple:
    """--freeze's groups of a run's settings ("embeddings,norms" -> ("embeddings", "norms"))."""
    return tuple(g.strip() for g in (settings.get("freeze") or "").split(",") if g.strip())


def set_up_trainable(model, settings: dict, seed: int | None = None) -> list:
    """The adapters (`apply_lora`) and frozen groups (`freeze`, each allowed to match nothing on
    this pipeline stage) of a run's settings; returns how many parameters each group froze here."""
    spec = spec_of(settings)
    if spec is not None:
        apply_lora(model, spec, seed=seed)
    return [len(freeze(model, [g], missing_ok=True)) for g in freeze_groups(settings)]


def parse_targets(text) -> tuple:
    """"q,k,v" (or a sequence) -> ("q", "k", "v"): TARGETS' order, each once; unknown names after
    them (LoraSpec refuses them by name)."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    return tuple(t for t in TARGETS if t in items) + tuple(t for t in items if t not in TARGETS)


def kaiming_uniform_init(fan_in: int):
    """PEFT's lora_A: torch's kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(rng, shape, dtype):
        gen_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        return rng.uniform(-bound, bound, shape).astype(gen_dtype)

    init.describe = f"uniform(-1/sqrt({fan_in}), 1/sqrt({fan_in}))"
    return init


class LoraPair(Module):
    """One projection's A and B on a base weight (module docstring). `kind`: column, row or
    expert; `cols`: the base's full output columns [start, stop) the pair adds to."""

    def __init__(self, ctx, base, proj: str, kind: str, cols: tuple, spec: LoraSpec, rng, *, seed, dtype):
        name = base.name[:-len(".weight")] if base.name.endswith(".weight") else base.name
        n_in = base.full_shape[0]
        r = spec.rank
        self.proj, self.kind, self.scale = proj, kind, spec.scale
        self.n_in, self.n_out, self.ctx = n_in, cols[1] - cols[0], ctx
        a_sharding = contiguous((n_in, r), 0, ctx.tp_size) if kind == "row" else None
        if kind == "column":
            b_sharding = part_sharding(base.sharding, cols[0], cols[1], r)
            mine = np.asarray(base.sharding.indices[ctx.tp_rank])
            at = np.nonzero((mine >= cols[0]) & (mine < cols[1]))[0]
            if at.size == 0 or at[-1] - at[0] + 1 != at.size:
                raise ConfigError(f"{base.name}: the columns of {proj} are not one run of this rank's shard")
            self.out = slice(int(at[0]), int(at[-1]) + 1)
        else:
            b_sharding, self.out = None, slice(cols[0], cols[1])
        self.A = make_parameter(ctx, f"{name}.lora_A.{proj}", (n_in, r), kaiming_uniform_init(n_in), a_sharding,
                                seed=seed, dtype=dtype, weight_decay=True)
        self.B = make_parameter(ctx, f"{name}.lora_B.{proj}", (r, cols[1] - cols[0]), zeros_init, b_sharding,
                                seed=0, dtype=dtype, weight_decay=True)
        # the replicated factor sees part of the use on each TP rank: its gradient summed over TP
        if kind != "replicated":  # (a replicated base sees its whole use on every rank: nothing to sum)
            (self.B if kind == "row" else self.A).tp_partial = True
        if kind == "expert":
            self.B.tp_partial = True
            self.A.expert_parallel = self.B.expert_parallel = base.expert_parallel
        self.f0 = ctx.tp_rank * (n_in // ctx.tp_size) if kind == "row" else 0  # first input feature here
        self.dropout = Dropout(spec.dropout, rng, REPLICATED, site=f"{name}.lora_dropout.{proj}")
        self.context_shard: tuple[int, int] | None = None

    def lay_out_context(self, shard):
        self.context_shard = shard

    def _drop(self, x):
        """x [B, T, F_here] (this rank's input features [f0, f0 + F_here) of F), masked at the
        tokens' global positions (context parallelism: this rank's zigzag chunks)."""
        d = self.dropout
        if not d.training or d.p == 0.0:
            return x, None
        B, T, F_here = x.shape
        cp_rank, cp = self.context_shard or (0, 1)
        p, seed, offsets = d.draw_rows(B, T * self.n_in, 0, T * cp * self.n_in)
        xp = self.ctx.xp
        runs = [(0, 0, T)] if cp == 1 else local_segments(T, cp, cp_rank, 0, T)
        tokens = np.concatenate([np.arange(first, first + n) for _, first, n in runs]).astype(np.uint64)
        counters = (np.asarray(offsets, np.uint64)[:, None, None] + tokens[None, :, None] * np.uint64(self.n_in)
                    + np.arange(self.f0, self.f0 + F_here, dtype=np.uint64)[None, None, :])
        mask = ops.dropout_mask_at(xp, xp.asarray(counters), p, seed)
        return ops.dropout_forward_mask(x, p, mask)

    def forward(self, x):
        """(scale * B(A(dropout(x))), what backward needs)."""
        xd, dctx = self._drop(x)
        h, a_ctx = ops.linear_forward(xd, self.A.data)
        y, b_ctx = ops.linear_forward(h, self.B.data)
        y *= self.scale
        return y, (dctx, without_weight(a_ctx), without_weight(b_ctx))

    def backward(self, dy, saved, need_dx=True):
        """dy: the gradient of this pair's output columns. Returns its part of dx (or None)."""
        dctx, a_ctx, b_ctx = saved
        dy = dy * self.scale
        dh, _, _ = ops.linear_backward(dy, with_weight(b_ctx, self.B.data), wgrad_out=self.B.grad,
                                       need_dw=self.B.trainable)
        dx, _, _ = ops.linear_backward(dh, with_weight(a_ctx, self.A.data), need_dx=need_dx, wgrad_out=self.A.grad,
                                       need_dw=self.A.trainable)
        if dx is not None and dctx is not None:
            dx = ops.dropout_backward(dx, dctx)
        return dx


class LoraAdapter(Module):
    """The pairs on one base linear (`base.lora`), added into its output and its input gradient."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def forward(self, x, y):
        """Adds every pair's output into y's columns (in place); returns what backward needs."""
        saved = []
        for pair in self.pairs:
            out, s = pair.forward(x)
            y[..., pair.out] += out
            saved.append(s)
        return saved

    def backward(self, dy, saved, need_dx=True):
        """The pairs' part of the base's dx (None without need_dx), their A and B gradients."""
        dx = None
        for pair, s in zip(self.pairs, saved):
            d = pair.backward(dy[..., pair.out], s, need_dx)
            if d is not None:
                dx = d if dx is None else dx + d
        return dx


def _column_pairs(base, projections, spec, ctx, rng, seed, dtype, attn=None):
    """(proj, kind, cols) of the targeted projections of a column-parallel base."""
    out = []
    for proj, cols in projections:
        if proj in spec.targets:
            out.append(LoraPair(ctx, base.weight, proj, "column", cols, spec, rng, seed=seed, dtype=dtype))
            if attn is not None and proj in ("k", "v") and base.weight.grad_sync is not None:
                # GQA with tp > n_kv_head: a KV head's B columns on several ranks, summed over them
                replicas = ctx.subgroup(f"tp_kv{attn[0]}", color=attn[1], key=ctx.tp_rank)
                out[-1].B.grad_sync = sum_grad_over(replicas)  # (all of B's columns are KV's)
    return out


def apply_lora(model, spec: LoraSpec, seed: int | None = None) -> list:
    """Freezes every parameter of `model` and adds the adapters of `spec` (module docstring).
    Call before any layout is set (sequence or context parallelism, recompute) and before the
    optimizer takes the parameters. Returns the pairs. Collective over TP (GQA's subgroups)."""
    ctx, rng = model.ctx, model.rng
    dtype = next(iter(model.parameters())).data.dtype
    seed = getattr(model, "seed", 0) if seed is None else seed
    for p in model.parameters():
        p.trainable = False
    pairs = []
    for m in list(model.modules()):
        if isinstance(m, ParallelAttention):
            hd, n_head = m.hd, m.n_head
            n_kv = (m.qkv.weight.full_shape[1] // hd - n_head) // 2
            q, k = n_head * hd, n_kv * hd
            new = _column_pairs(m.qkv, (("q", (0, q)), ("k", (q, q + k)), ("v", (q + k, q + 2 * k))), spec, ctx, rng,
                                seed, dtype, attn=(n_kv, m.kv_heads[0]))
            _attach(m.qkv, new)
            _attach(m.proj, _row_pair(m.proj, "o", spec, ctx, rng, seed, dtype))
            pairs += [p for a in (m.qkv, m.proj) if a.lora is not None for p in a.lora.pairs]
        elif isinstance(m, MultiLatentAttention):
            pairs += _mla_pairs(m, spec, ctx, rng, seed, dtype)
        elif isinstance(m, ParallelMLP):
            names = _fc1_projections(m.fc1.weight, m.fc2.weight)
            _attach(m.fc1, _column_pairs(m.fc1, names, spec, ctx, rng, seed, dtype))
            _attach(m.fc2, _row_pair(m.fc2, "down", spec, ctx, rng, seed, dtype))
            pairs += [p for a in (m.fc1, m.fc2) if a.lora is not None for p in a.lora.pairs]
        elif isinstance(m, MoEMLP):
            for expert in m.experts:
                pairs += _expert_pairs(expert, spec, ctx, rng, seed, dtype)
    if not pairs:
        raise ConfigError(f"`lora_targets` {','.join(spec.targets)} matches no projection of this model")
    return pairs


def _mla_pairs(m, spec, ctx, rng, seed, dtype) -> list:
    """Multi-head latent attention's pairs (PEFT's names for DeepseekV3): the replicated
    down-projections q_a and kv_a (A and B replicated; their input and output gradients are whole
    on every TP rank, so are theirs), the column-parallel q_b (q_proj without q_lora_rank) and
    kv_b, the row-parallel o_proj."""
    pairs = []
    q = "q_b" if m.q_a is not None else "q"
    for base, proj in ((m.q_b, q), (m.kv_b, "kv_b")):
        _attach(base, _column_pairs(base, ((proj, (0, base.weight.full_shape[1])),), spec, ctx, rng, seed, dtype))
    _attach(m.proj, _row_pair(m.proj, "o", spec, ctx, rng, seed, dtype))
    for weight, proj in ((m.q_a, "q_a"), (m.kv_a, "kv_a")):
        if weight is not None and proj in spec.targets:
            pair = LoraPair(ctx, weight, proj, "replicated", (0, weight.full_shape[1]), spec, rng, seed=seed,
                            dtype=dtype)
            setattr(m, f"{proj}_lora", LoraAdapter([pair]))
            pairs.append(pair)
    return pairs + [p for a in (m.q_b, m.kv_b, m.proj) if a.lora is not None for p in a.lora.pairs]


def _fc1_projections(fc1, fc2) -> tuple:
    """An MLP's first linear: a fused [gate | up] (twice the width fc2 takes: SwiGLU, GeGLU) holds
    gate and up; else it is "up" (GPT-2's GeLU MLP)."""
    width = fc1.full_shape[1]
    if width == 2 * fc2.full_shape[0]:
        return ("gate", (0, width // 2)), ("up", (width // 2, width))
    return (("up", (0, width)),)


def _row_pair(base, proj, spec, ctx, rng, seed, dtype):
    if proj not in spec.targets:
        return []
    return [LoraPair(ctx, base.weight, proj, "row", (0, base.weight.full_shape[1]), spec, rng, seed=seed,
                     dtype=dtype)]


def _attach(base, pairs) -> None:
    if pairs:
        base.lora = LoraAdapter(pairs)


def _expert_pairs(expert: ExpertMLP, spec, ctx, rng, seed, dtype) -> list:
    if spec.dropout and {"gate", "up", "down"} & set(spec.targets):
        raise ConfigError(f"`lora_dropout` {spec.dropout}: adapters on MoE experts take no dropout (their inputs "
                          "are routed tokens); use `lora_dropout` 0, or leave gate, up and down out of "
                          "`lora_targets` on an MoE model")
    names = _fc1_projections(expert.fc1, expert.fc2)
    fc1 = [LoraPair(ctx, expert.fc1, p, "expert", c, spec, rng, seed=seed, dtype=dtype)
           for p, c in names if p in spec.targets]
    fc2 = [LoraPair(ctx, expert.fc2, "down", "expert", (0, expert.fc2.full_shape[1]), spec, rng, seed=seed,
                    dtype=dtype)] if "down" in spec.targets else []
    expert.fc1_lora = LoraAdapter(fc1) if fc1 else None
    expert.fc2_lora = LoraAdapter(fc2) if fc2 else None
    return fc1 + fc2


def freeze(model, groups, missing_ok: bool = False) -> list:
    """Freezes the parameters of each --freeze group (FREEZE_GROUPS' names, or fnmatch globs of
    parameter names); returns the names frozen. A group matching nothing is refused by name
    (unless `missing_ok`: a pipeline stage may hold none of a group's parameters)."""
    names = [p.name for p in model.parameters()]
    frozen = set()
    for g in groups:
        globs = FREEZE_GROUPS.get(g, (g,))
        hit = {n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in globs)}
        if not hit and not missing_ok:
            raise ConfigError(f"`freeze` {g!r} matches no parameter of this model; use a group of "
                              f"{', '.join(FREEZE_GROUPS)} or a glob of parameter names such as 'layers.0.*'")
        frozen |= hit
    for p in model.parameters():
        if p.name in frozen:
            p.trainable = False
    return sorted(frozen)
