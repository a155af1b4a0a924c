"""GPT: the decoder-only transformer of every family (GPT-2, Llama, Qwen2, Mistral, Mixtral),
built from cutp's tensor-parallel layers by its config's spec; the whole model in one file.

(It runs over 500 lines on purpose: the model, its pipeline stages, its sequence-parallel layout and its
generation path stay together, readable in one sitting as nanoGPT's model.py is.)

    ctx = cutp.init(tp=2)
    model = GPT(ctx, GPTConfig.preset("tiny"), seed=0)
    loss = model.forward(idx, targets)     # idx, targets: [B, T] int, identical on TP ranks
    model.backward()                       # accumulates into every Parameter.grad

Layouts: token ids and targets are replicated over the TP group; activations between blocks
are replicated [B, T, n_embd] (with `set_sequence_parallel()`: this rank's tokens [B, T/tp,
n_embd], so LayerNorm, dropout and the residual adds run on T/tp tokens); the logits stay
sharded over the vocabulary (`gather_logits` gathers them for a caller; the loss never does).
With context parallelism (ctx.cp_size > 1) a training forward takes the whole sequences and
keeps its CP rank's zigzag chunks of them (`cutp.tensor_parallel.context_parallel`): every
layer runs on T/cp tokens at their global positions, the attention meets the other chunks by
the ring (or the all-to-all), and the loss is the mean over this rank's targets; evaluation,
logits and generation run whole sequences on every CP rank.
Parameters have cutp's neutral names (`cutp.models.names`); `gather_state_dict` returns full, unpadded
tensors under them.
Rotary models (positions="rope") have no position table: the model builds the (cos, sin)
tables once (`rotary`, [block_size, head_dim] in the model's table dtype; with rope_local_theta,
Gemma 3, a second one, `rotary_local`, for the local layers) and every block's attention turns Q
and K by the tokens' global positions. Gemma: the embedding scaled by sqrt(n_embd)
(`embed_scale`), and the logits soft-capped on each rank's vocabulary shard (`final_softcap`).
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import ops
from ..ops.common import as_dtype, compute_dtype
from ..runtime.backend import get_array_module, to_numpy
from ..runtime.consistency import check_same_on_all_ranks
from ..runtime.errors import ConfigError
from ..runtime.failure import errors_raised_on_every_rank
from ..tensor_parallel import (
    REPLICATED,
    ColumnParallelLinear,
    Dropout,
    LogitSoftcap,
    Module,
    ParallelLMHead,
    ParallelTransformerBlock,
    RNGTracker,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    gather_full,
    make_norm,
    pad_rows,
    sum_grad_over,
    take_shard,
)
from ..tensor_parallel.declare import below, build_parameters
from ..tensor_parallel.context_parallel import (COMMS, check_context_parallel, check_sequence_splits, local_segments,
                                                take_local)
from ..tensor_parallel.mappings import gather_from_tp_forward
from ..tensor_parallel.moe import MoEMLP
from .config import DTYPES, GPTConfig
from .packing import check_documents, document_positions
from .stages import stage_layers, virtual_stage_layers


class PositionEmbedding(Module):
    """Learned positions, replicated on every TP rank. Input: T. Output: [T, n_embd], or with
    `sequence_shard = (rank, size)` this rank's positions [T/size, n_embd] of the T."""

    def __init__(self, params):
        """params: {"weight"} built from the model's declarations (`pos_embed.weight`: replicated,
        decayed as in nanoGPT, Megatron and HF, summed over TP under sequence parallelism)."""
        self.weight = params["weight"]
        self.sequence_shard: tuple[int, int] | None = None
        self.context_shard: tuple[int, int] | None = None  # (cp_rank, cp): T is a CP rank's local sequence

    def lay_out_sequence(self, on, shard):
        self.sequence_shard = shard

    def lay_out_context(self, shard):
        self.context_shard = shard

    def forward(self, T, ids=None):
        """ids: None (positions 0..T-1) or the tokens' own positions [B, T] (packed sequences:
        restarting at each document; a CP rank's local sequence's), this rank's taken under SP."""
        if ids is not None:
            if self.sequence_shard is not None:
                rank, size = self.sequence_shard
                ids = ids[:, rank * T // size:(rank + 1) * T // size]
            y, ectx = ops.embedding_forward(ids, self.weight.data)
            self._save("rows", ectx)
            return y
        start, stop = 0, T
        if self.sequence_shard is not None:
            rank, size = self.sequence_shard
            start, stop = rank * T // size, (rank + 1) * T // size
        if self.context_shard is not None:  # the zigzag chunks' global rows
            cp_rank, cp = self.context_shard
            runs = local_segments(T, cp, cp_rank, start, stop)
            self._save("rows", runs)
            xp = get_array_module(self.weight.data)
            return xp.concatenate([self.weight.data[first:first + n] for _, first, n in runs])
        self._save("rows", [(0, start, stop - start)])
        return self.weight.data[start:stop]

    def backward(self, dy):
        runs = self._load("rows")
        if not self.weight.trainable:
            return
        if isinstance(runs, ops.EmbeddingCtx):  # per-token rows
            ops.embedding_backward(dy, runs, self.weight.grad)
            return
        dy = as_dtype(dy, compute_dtype(dy.dtype))  # 16-bit dy: summed over the batch in float32
        dy = dy.reshape(-1, sum(n for _, _, n in runs), dy.shape[-1]).sum(axis=0)
        for at, first, n in runs:
            self.weight.grad[first:first + n] += dy[at:at + n]



class GPT(Module):
    def __init__(self, ctx, config: GPTConfig, seed: int = 0, init: bool = True, pp_layers=None,
                 pp_virtual: int = 1):
        """seed: initialisation and dropout streams. init=False allocates zeros instead of drawing
        the initial weights (for models whose weights are loaded right after).

        With pipeline parallelism (ctx.pp_size > 1) the model is this rank's stage: the layers
        `stage_layers(n_layer, pp, pp_layers)` gives it (named by their global index), the
        embeddings on the first stage, the final LayerNorm, LM head and loss on the last (with
        tied embeddings the last stage holds its own copy of the token embedding, whose gradient
        is summed with the first stage's over ctx.embedding). It runs micro-batches through
        `stage_forward` / `stage_backward` (cutp.train's pipeline schedules do). With pp_virtual
        = V > 1 (the interleaved schedule) the stage holds V model chunks, chunk c being the
        layers of virtual stage c * pp + pp_rank (`virtual_stage_layers`): the embeddings come
        before chunk 0 of the first stage, the head after chunk V - 1 of the last.

        Collective over ctx's communicator: every rank must build the same model (a config or seed
        that differs on one rank would otherwise give silently wrong gradients or a hang)."""
        world = ctx.world.mpi_comm  # cutp talks only over the communicators it split off
        check_same_on_all_ranks(world, {"config": config.to_dict(), "seed": seed, "init": init,
                                        "pp_layers": None if pp_layers is None else list(pp_layers),
                                        "pp_virtual": pp_virtual},
                                "GPT model configuration")
        with errors_raised_on_every_rank(world):
            config.validate(ctx.tp_size)
            if not (isinstance(pp_virtual, int) and pp_virtual >= 1 and (pp_virtual == 1 or ctx.pp_size > 1)):
                raise ConfigError(f"`pp_virtual` {pp_virtual!r}: model chunks per stage need an integer >= 1, "
                                  "and more than 1 only with `pp` > 1")
            chunks = virtual_stage_layers(config.n_layer, ctx.pp_size, pp_layers, pp_virtual)
        self.ctx = ctx
        self.config = config
        self.seed = seed
        self.pp_virtual = pp_virtual
        self.chunks = chunks[ctx.pp_rank::ctx.pp_size]  # this stage's model chunks' global layer indices
        self.layer_ids = stage_layers(config.n_layer, ctx.pp_size, pp_layers, pp_virtual)[ctx.pp_rank]
        self.first_stage, self.last_stage = ctx.pp_rank == 0, ctx.pp_rank == ctx.pp_size - 1
        self.ignore_index = -100
        c, dt = config, DTYPES[config.dtype]
        self.padded_vocab = c.padded_vocab(ctx.tp_size)
        self.rng = RNGTracker(seed, ctx.tp_rank, ctx.dp_rank)
        seed = seed if init else None
        self.tok_embed = self.pos_embed = self.drop = self.final_norm = self.lm_head = self.loss_fn = None
        outer = c.outer_declarations()  # the embeddings', the final norm's and the untied head's

        def declared(module):  # that module's parameters, built from its declarations
            return below(build_parameters(ctx, [d for d in outer if d.name.startswith(module + ".")], "", seed=seed,
                                          dtype=dt), module)

        if self.first_stage or (self.last_stage and c.tie_embeddings):
            self.tok_embed = VocabParallelEmbedding(ctx, c.vocab_size, self.padded_vocab, c.n_embd, name="tok_embed",
                                                    scale=c.n_embd ** 0.5 if c.embed_scale else None,
                                                    params=declared("tok_embed"))
        if self.first_stage:
            if c.positions == "learned":
                self.pos_embed = PositionEmbedding(declared("pos_embed"))
            self.drop = Dropout(c.dropout, self.rng, REPLICATED, site="drop")
        # rotary positions: one (cos, sin) table for every layer, positions 0..block_size-1
        # (Gemma 3: the local layers' own, rope_local_theta unscaled)
        self.rotary = self.rotary_local = None
        if c.positions == "rope":
            self.rotary = ops.rope_tables(c.rope_dim, c.block_size, c.rope_theta, c.rope, dt, xp=ctx.xp)
            if c.rope_local_theta is not None:
                self.rotary_local = ops.rope_tables(c.rope_dim, c.block_size, c.rope_local_theta, None, dt,
                                                    xp=ctx.xp)
        self.layers = [ParallelTransformerBlock(ctx, c.block_spec(i), layer=i, rng=self.rng, seed=seed, dtype=dt,
                                                rotary=self._layer_rotary(i))
                       for i in self.layer_ids]
        self.moe_layers = [b.mlp for b in self.layers if isinstance(b.mlp, MoEMLP)]
        self._chunk_blocks, at = [], 0  # each chunk's blocks, out of self.layers
        for r in self.chunks:
            self._chunk_blocks.append(self.layers[at:at + len(r)])
            at += len(r)
        if self.last_stage:
            norm = c.blocks().norm_spec(c)
            self.final_norm = make_norm(ctx, norm.kind, c.n_embd, name="final_norm", eps=norm.eps, bias=norm.bias,
                                        offset=norm.offset, seed=seed, dtype=dt, params=declared("final_norm"))
            if c.tie_embeddings:
                self.lm_head = ParallelLMHead(ctx, self.tok_embed)
            else:
                self.lm_head = ParallelLMHead(ctx, vocab_size=c.vocab_size, padded_vocab=self.padded_vocab,
                                              dim=c.n_embd, params=declared("lm_head"))
            self.loss_fn = VocabParallelCrossEntropy(ctx, c.vocab_size, self.padded_vocab,
                                                     ignore_index=self.ignore_index, label_smoothing=c.label_smoothing)
        self.logit_softcap = LogitSoftcap(c.final_softcap) if self.last_stage and c.final_softcap else None
        if c.tie_embeddings and ctx.pp_size > 1 and self.tok_embed is not None:
            # the tied table on the first and the last stage: one gradient, summed over both
            self.tok_embed.weight.grad_sync = sum_grad_over(ctx.embedding)
            if not self.first_stage:
                self.tok_embed.weight.norm_mask = False  # counted in the norm on the first stage only
        self.sequence_parallel = False
        # overlap of communication (cutp.optim.buckets): called with each unit of `units(chunk)`
        # (a list of modules) after its backward / before its forward; None: nothing to call
        self.after_unit_backward = None
        self.before_unit_forward = None
        # ZeRO 2/3 (cutp.optim.sharded): an object whose before_forward, after_forward,
        # before_backward and after_backward take each unit; None: no sharding
        self.unit_hooks = None

        self._context_parallel = False

    def _layer_rotary(self, i: int):
        """Layer i's (cos, sin) tables: the local layers' own when the config has them."""
        if self.rotary_local is not None and self.config.is_local_layer(i):
            return self.rotary_local
        return self.rotary

    def _head(self, x):
        """The final norm, the LM head and (Gemma) the logits' soft-cap: this rank's logit shard."""
        logits = self.lm_head.forward(self.final_norm.forward(x))
        return logits if self.logit_softcap is None else self.logit_softcap.forward(logits)

    # ---- units: the steps of a chunk's forward, whose parameters the overlap hooks follow --------
    def units(self, chunk: int = 0) -> list[list]:
        """Model chunk `chunk`'s modules in forward order, grouped as its forward runs them: the
        embeddings (where the model starts), each block, the final norm with the LM head (where it
        ends). Backward runs them in reverse. A tied parameter is in two units."""
        out = []
        if self.takes_tokens(chunk):
            out.append([m for m in (self.tok_embed, self.pos_embed, self.drop) if m is not None])
        out += [[block] for block in self._chunk_blocks[chunk]]
        if self.gives_loss(chunk):
            out.append([self.final_norm, self.lm_head])
        return out

    def _unit_done(self, unit) -> None:
        if self.unit_hooks is not None:
            self.unit_hooks.after_backward(unit)
        if self.after_unit_backward is not None:
            self.after_unit_backward(unit)

    def _unit_next(self, unit) -> None:
        if self.before_unit_forward is not None:
            self.before_unit_forward(unit)
        if self.unit_hooks is not None:
            self.unit_hooks.before_forward(unit)

    def _unit_forward_done(self, unit) -> None:
        if self.unit_hooks is not None:
            self.unit_hooks.after_forward(unit)

    def _unit_backward_next(self, unit) -> None:
        if self.unit_hooks is not None:
            self.unit_hooks.before_backward(unit)

    # ---- sequence parallelism ------------------------------------------------------------------
    def set_sequence_parallel(self, on: bool = True) -> None:
        """Between the tensor-parallel regions, keep each sequence split over the TP ranks
        (Korthikanti et al. 2022): the embedding reduce-scatters along the sequence, each column
        projection all-gathers before its matmul, each row projection reduce-scatters after it,
        the LM head gathers; LayerNorm, dropout and residual adds run on T/tp tokens. The same
        bytes as the all-reduces it replaces; the replicated parameters (LayerNorms, row biases,
        positions) are summed over TP by `tp_grad_sync`. Training sequences must split over tp;
        other forwards whose length does not (evaluation, logits), and generation, run without it. A no-op at
        tp 1. Changes memory, never the math."""
        self.sequence_parallel = bool(on)
        self._lay_out_sequence(self.sequence_parallel)

    def _lay_out_sequence(self, on: bool) -> None:
        on = on and self.ctx.tp_size > 1
        shard = (self.ctx.tp_rank, self.ctx.tp_size) if on else None
        for m in self.modules():  # each layer lays itself out
            m.lay_out_sequence(on, shard)
        for p in self.parameters():  # the parameters declared `sp` (used on this rank's tokens: summed over TP)
            if p.sp:
                p.sequence_parallel = on

    def set_tp_comm_overlap(self, on: bool = True) -> None:
        """Column-parallel backwards start their dX collective before the weight-gradient GEMM
        and wait after it (cutp.tensor_parallel.layers). Changes time, never the math."""
        for m in self.modules():
            if isinstance(m, ColumnParallelLinear):
                m.comm_overlap = bool(on)

    # ---- context parallelism -------------------------------------------------------------------
    def _lay_out_context(self, on: bool) -> None:
        """Context parallelism on (ctx.cp_size > 1, training forwards) or off (evaluation,
        logits, generation: whole sequences on every CP rank): the attention's ring, the
        positions' and the dropouts' global places (cutp.tensor_parallel.context_parallel)."""
        on = on and self.ctx.cp_size > 1
        if on == self._context_parallel:
            return
        self._context_parallel = on
        shard = (self.ctx.cp_rank, self.ctx.cp_size) if on else None
        for m in self.modules():  # each layer follows its chunks (Module.lay_out_context)
            m.lay_out_context(shard)

    def set_context_parallel_comm(self, comm: str = "ring") -> None:
        """How context parallelism's attention meets the whole sequence: "ring" (K,V round the CP
        ranks) or "a2a" (all-to-all to a cp-th of the heads; the TP-local query heads must split
        over cp, and their KV heads too or be copied to cp / n of them). Changes communication and
        memory, never the math."""
        check_context_parallel(2 * self.ctx.cp_size, self.ctx.cp_size, self.ctx.tp_size, False, comm,
                               self.config.n_head, self.config.n_kv_head)
        if comm not in COMMS:
            raise ConfigError(f"`cp_comm` {comm!r}: use one of {', '.join(COMMS)}")
        for b in self.layers:
            b.attn.cp_comm = comm

    @contextlib.contextmanager
    def without_sequence_parallel(self):
        """Runs the block's forwards with whole sequences on every TP rank (generation)."""
        was = self.sequence_parallel
        self.set_sequence_parallel(False)
        try:
            yield
        finally:
            self.set_sequence_parallel(was)

    def _splits_sequence(self, T: int) -> bool:
        return self.sequence_parallel and self.ctx.tp_size > 1 and T % self.ctx.tp_size == 0

    # ---- activation recomputation --------------------------------------------------------------
    RECOMPUTE = ("none", "selective", "full")

    def set_recompute(self, mode: str = "none", layers: int | None = None) -> None:
        """What backward recomputes instead of keeping: "selective" the core attention of every
        layer (its T x T probabilities), "full" whole layers (each keeps only its input), the
        first `layers` of them (default all). Changes memory and time, never the gradients."""
        n = self.config.n_layer
        if mode not in self.RECOMPUTE:
            raise ConfigError(f"`recompute` {mode!r}: use one of {', '.join(self.RECOMPUTE)}")
        if layers is not None and (mode != "full" or not (isinstance(layers, int) and 1 <= layers <= n)):
            raise ConfigError(f"`recompute_layers` {layers!r} needs `recompute` full and 1 <= N <= n_layer ({n})")
        for i, block in zip(self.layer_ids, self.layers):  # i: the global layer index (pipeline stages)
            block.attn.recompute_core = mode == "selective"
            block.recompute = mode == "full" and i < (n if layers is None else layers)

    # ---- inputs --------------------------------------------------------------------------------
    def check_inputs(self, idx, targets=None):
        """Raises ValueError naming the offending value and the limit (before any collective)."""
        c = self.config
        for what, a in (("token ids", idx), ("targets", targets)):
            if a is not None and not isinstance(getattr(a, "dtype", None), np.dtype):
                raise TypeError(f"{what} must be a NumPy (or CuPy) integer array, got {type(a).__module__}."
                                f"{type(a).__name__}; convert it first (e.g. np.asarray(t.cpu()) for a torch tensor)")
        if idx.ndim != 2:
            raise ValueError(f"token ids must be [batch, seq], got shape {tuple(idx.shape)}")
        if idx.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {idx.dtype}")
        if idx.shape[1] > c.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size {c.block_size}; "
                             f"use sequences of at most {c.block_size} tokens or a model with a larger block_size")
        tp = self.ctx.tp_size
        cp = self.ctx.cp_size
        if self.training and targets is not None and cp > 1:
            check_sequence_splits(idx.shape[1], cp)
            if self.sequence_parallel and tp > 1 and (idx.shape[1] // cp) % tp:
                raise ValueError(f"sequence length {idx.shape[1]} / cp {cp} = {idx.shape[1] // cp} tokens per CP rank "
                                 f"is not divisible by tp={tp}: sequence parallelism splits them over the TP ranks; "
                                 f"use a multiple of {cp * tp}")
        if self.sequence_parallel and self.training and targets is not None and tp > 1 and idx.shape[1] % tp:
            raise ValueError(f"sequence length {idx.shape[1]} is not divisible by tp={tp}: sequence parallelism "
                             f"splits each sequence over the TP ranks; use a multiple of {tp}")
        if idx.size:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= c.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {c.vocab_size})")
        if targets is not None:
            if tuple(targets.shape) != tuple(idx.shape):
                raise ValueError(f"targets shape {tuple(targets.shape)} differs from ids shape {tuple(idx.shape)}")
            ok = (targets >= 0) & (targets < c.vocab_size) | (targets == self.ignore_index)
            if not bool(ok.all()):
                bad = int(targets[~ok].reshape(-1)[0])
                raise ValueError(f"target id {bad} is outside the vocabulary [0, {c.vocab_size}) "
                                 f"and is not ignore_index ({self.ignore_index})")

    # ---- forward / backward ------------------------------------------------------------------
    def _whole_model(self, what: str) -> None:
        if self.ctx.pp_size > 1:
            raise ConfigError(f"{what} needs the whole model on each rank, and this one is pipeline stage "
                              f"{self.ctx.pp_rank} of {self.ctx.pp_size}: run micro-batches through stage_forward/"
                              "stage_backward (cutp.train's schedules), or load the checkpoint with pp=1")

    def hidden_states(self, idx):
        """Final-LayerNorm output [B, T, n_embd], replicated ([B, T/tp, n_embd], this rank's
        tokens, under sequence parallelism). Never context-parallel: whole sequences."""
        self._whole_model("hidden_states")
        self._lay_out_context(False)
        T = idx.shape[1]
        if self.sequence_parallel and not self._splits_sequence(T) and not self.training:
            with self.without_sequence_parallel():  # an evaluation forward whose T does not split
                return self.hidden_states(idx)
        return self.final_norm.forward(self._blocks(self._embed(idx)))

    def _embed(self, idx, positions=None):
        x = self.tok_embed.forward(idx)
        if self.pos_embed is not None:  # (rotary models turn Q and K in the attention instead)
            x += self.pos_embed.forward(idx.shape[1], positions)
        return self.drop.forward(x)

    def _blocks(self, x):
        for block in self.layers:
            x = block.forward(x)
        return x

    def _packing(self, documents, context: bool):
        """(positions, documents) for the blocks of packed rows (cutp.models.packing): the tokens'
        positions inside their documents (this CP rank's tokens' under context parallelism) and the
        whole rows' document ids, on the model's device; (None, None) for one document a row."""
        if documents is None:
            return None, None
        host = to_numpy(documents).astype(np.int32)
        positions = document_positions(host)
        if context:
            positions = take_local(positions, self.ctx.cp_size, self.ctx.cp_rank)
        return self.ctx.asarray(positions), self.ctx.asarray(host)

    def takes_tokens(self, chunk: int = 0) -> bool:
        """Whether model chunk `chunk` of this stage starts the model (embeds token ids)."""
        return self.first_stage and chunk == 0

    def gives_loss(self, chunk: int = 0) -> bool:
        """Whether model chunk `chunk` of this stage ends the model (LM head and loss)."""
        return self.last_stage and chunk == self.pp_virtual - 1

    def stage_forward(self, inp, targets=None, chunk: int = 0, *, head: bool = True, documents=None):
        """One micro-batch through this pipeline stage (its model chunk `chunk` with
        --pp-virtual): `inp` is the token ids [B, T] where the model starts (`takes_tokens`),
        else the previous chunk's output (replicated [B, T, h], or [B, T/tp, h] under sequence
        parallelism). Returns the output for the next chunk, or where the model ends
        (`gives_loss`) the mean loss (with targets, replicated over TP) or the logits shard.
        At pp 1, `forward`. `head=False`: the blocks only, the last one's output where the model
        ends (the MoE counting pass of cutp.train.moe needs no LM head). documents: the
        micro-batch's document ids [B, T] (packed rows, `forward`; every stage gets them)."""
        units = self.units(chunk) if (self.before_unit_forward or self.unit_hooks) is not None else None
        # (CP off only for the logits of whole sequences; the MoE counting pass, head=False, runs
        # on the CP chunks as the step's forwards do)
        context = self.ctx.cp_size > 1 and self.training and (targets is not None or not self.gives_loss(chunk)
                                                              or not head)
        self._lay_out_context(context)
        if context and self.takes_tokens(chunk):  # this CP rank's zigzag chunks of the sequences
            inp = take_local(inp, self.ctx.cp_size, self.ctx.cp_rank)
        if context and targets is not None:
            targets = take_local(targets, self.ctx.cp_size, self.ctx.cp_rank)
        positions, documents = self._packing(documents, context)
        if self.takes_tokens(chunk):
            if units:
                self._unit_next(units[0])
            x = self._embed(inp, positions)
            if units:
                self._unit_forward_done(units[0])
        else:
            x = inp
        for block in self._chunk_blocks[chunk]:
            if units:
                self._unit_next([block])
            x = block.forward(x, positions, documents)
            if units:
                self._unit_forward_done([block])
        if not self.gives_loss(chunk) or not head:
            return x
        if units:
            self._unit_next(units[-1])
        logits = self._head(x)
        if targets is not None:
            logits = self.loss_fn.forward(logits, targets, inplace_backward=True)  # (the loss)
        if units:
            self._unit_forward_done(units[-1])
        return logits

    def stage_backward(self, grad, chunk: int = 0, aux_grad: float | None = None):
        """Backward of the micro-batch whose stage_forward (of `chunk`) ran last (its activations
        restored with `restore_activations` when several are in flight): `grad` is d(loss) (a
        float) where the model ends, else the gradient of the chunk's output. Returns the
        gradient of the chunk's input for the previous one (None where the model starts).

        `aux_grad`: the weight of the MoE layers' load-balancing and z-losses in the objective
        (each rank's share of it: see `backward`); needed where the chunk has MoE layers."""
        blocks = self._chunk_blocks[chunk]
        moe = [b.mlp for b in blocks if isinstance(b.mlp, MoEMLP)]
        if moe and aux_grad is None:
            raise ValueError("stage_backward of MoE layers needs aux_grad (the auxiliary losses' weight)")
        for m in moe:
            m.aux_grad = aux_grad
        if self.gives_loss(chunk):
            self._unit_backward_next([self.final_norm, self.lm_head])
            dlogits = self.loss_fn.backward(grad)
            if self.logit_softcap is not None:
                dlogits = self.logit_softcap.backward(dlogits)
            dx = self.final_norm.backward(self.lm_head.backward(dlogits))
            self._unit_done([self.final_norm, self.lm_head])
        else:
            dx = grad
        frozen = self._frozen_lead(chunk)  # leading blocks nothing before trains: no gradient flows back to them
        for i in reversed(range(len(blocks))):
            self._unit_backward_next([blocks[i]])
            if i >= frozen:
                dx = blocks[i].backward(dx)
            else:
                blocks[i].free_cache()
            self._unit_done([blocks[i]])
        if not self.takes_tokens(chunk):
            return dx
        embeddings = [m for m in (self.tok_embed, self.pos_embed, self.drop) if m is not None]
        self._unit_backward_next(embeddings)
        if frozen:
            for m in embeddings:
                m.free_cache()
        else:
            dx = self.drop.backward(dx)
            if self.pos_embed is not None:
                self.pos_embed.backward(dx)
            self.tok_embed.backward(dx)
        self._unit_done(embeddings)
        return None

    def _frozen_lead(self, chunk: int) -> int:
        """How many of the chunk's first blocks have no trainable parameter when the embeddings
        before them have none either (--freeze, LoRA on later layers): their backward would only
        carry dx to nothing that trains, so it is skipped (the gradients are bit-identical)."""
        if not self.takes_tokens(chunk) or any(p.trainable for m in (self.tok_embed, self.pos_embed) if m is not None
                                               for p in m.parameters()):
            return 0
        n = 0
        for block in self._chunk_blocks[chunk]:
            if any(p.trainable for p in block.parameters()) or (
                    self.ctx.ep_size > 1 and isinstance(block.mlp, MoEMLP)):  # (EP ranks hold other experts:
                break                                                         # their all-to-alls must pair)
            n += 1
        return n

    def take_activations(self) -> list:
        """Everything the stage keeps for one micro-batch's backward, taken out of its modules (a
        pipeline schedule holds several micro-batches' at once; `restore_activations` puts them
        back before that micro-batch's stage_backward)."""
        kept = []
        for m in self.modules():
            for k, v in vars(m).items():
                if k.startswith("_cache_") and v is not None:
                    kept.append((m, k, v))
        for m, k, _ in kept:
            setattr(m, k, None)
        return kept

    @staticmethod
    def restore_activations(kept: list) -> None:
        for m, k, v in kept:
            setattr(m, k, v)

    def forward(self, idx, targets=None, check=True, *, documents=None):
        """Sharded logits [B, T, padded_vocab/tp] when targets is None (this rank's columns of
        the padded vocabulary, the padding columns -inf; `gather_logits` gives [B, T, vocab_size]),
        else the mean loss (float) over the targets that are not ignore_index (-100). (An MoE model's
        auxiliary losses are apart: `moe_losses()`; `backward` includes them.)

        `targets` are already shifted: targets[:, t] is the token that follows idx[:, t] (nanoGPT's
        convention). Hugging Face's `labels=input_ids` are not: pass
        `targets=model.targets_from_labels(labels)`.

        `documents`: None (one document a row) or packed rows' document ids [B, T], non-decreasing
        along each row (cutp.models.packing): positions restart at each document, the attention
        never crosses one."""
        self._whole_model("GPT.forward")
        if check:
            self.check_inputs(idx, targets)
            if documents is not None:
                check_documents(documents, idx)
        idx = self.ctx.asarray(idx)  # host ids on a GPU model: moved once here (a no-op on the CPU)
        if self.sequence_parallel and not self._splits_sequence(idx.shape[1]) and not (self.training and targets
                                                                                        is not None):
            with self.without_sequence_parallel():  # the LM head's input is whole then too
                return self.forward(idx, targets, check=False, documents=documents)
        if targets is None:
            return self._mask_padding(self.stage_forward(idx, documents=documents))
        return self.stage_forward(idx, self.ctx.asarray(targets), documents=documents)

    def _mask_padding(self, logits):
        """Sets this rank's vocabulary-padding columns to -inf (in place; the loss masks its own)."""
        per = self.padded_vocab // self.ctx.tp_size
        real = min(max(self.config.vocab_size - self.ctx.tp_rank * per, 0), per)
        if real < per:
            logits[..., real:] = -np.inf
        return logits

    def gather_logits(self, logits_shard, rank: int | None = None):
        """This rank's logits [..., padded_vocab/tp] (from `forward` or `forward_cached`) -> the
        full logits [..., vocab_size] of the real vocabulary (padding dropped), an array of the
        model's device (`ctx.to_numpy` for the host). Collective over the TP group: returns them on
        TP rank `rank` (None: on every TP rank) and None elsewhere.

            logits = model.gather_logits(model.forward(idx))       # [B, T, vocab_size]
        """
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < self.ctx.tp_size):
            raise ValueError(f"rank must be None or a TP rank in [0, {self.ctx.tp_size}), got {rank!r}")
        per = self.padded_vocab // self.ctx.tp_size
        if logits_shard.shape[-1] != per:
            raise ValueError(f"logits_shard has {logits_shard.shape[-1]} columns; this rank's shard of the padded "
                             f"vocabulary has {per} (pass what forward(idx) returned, unsliced)")
        full = gather_from_tp_forward(self.ctx.tp, self.ctx.xp.ascontiguousarray(logits_shard))
        if rank is not None and self.ctx.tp_rank != rank:
            return None
        return full[..., : self.config.vocab_size]

    def backward(self, dloss: float = 1.0, aux_dloss: float | None = None):
        """Gradients of dloss * (the last forward's loss) + aux_dloss * (its MoE layers' auxiliary
        losses, `moe_losses()`), accumulated into each parameter's grad. The auxiliary losses
        are computed over the whole DP group's micro-batch (inside cutp.train's step: over the
        step's global batch, cutp.tensor_parallel.moe), and each rank's gradient holds its
        own tokens' part of theirs: with gradients averaged over DP x CP (the optimizers),
        aux_dloss = dloss * dp * cp gives those of the objective loss + aux (the default)."""
        self._whole_model("GPT.backward")
        self.stage_backward(dloss, aux_grad=dloss * self.ctx.dp_cp_size if aux_dloss is None else aux_dloss)

    def moe_losses(self) -> dict:
        """The last forward's auxiliary losses of this stage's MoE layers, summed: {"aux_loss",
        "z_loss"} (zeros for a dense model). Training forwards: over the DP group's micro-batch
        (inside cutp.train's step: that micro-batch's part of the step's losses)."""
        return {k: sum(m.last.get(k, 0.0) for m in self.moe_layers) for k in ("aux_loss", "z_loss", "seq_aux_loss")}

    def targets_from_labels(self, labels):
        """Hugging Face-style labels (the input ids themselves, -100 where ignored) -> `forward`'s
        targets: shifted left by one, the last position ignored. forward(ids, targets_from_labels(
        ids)) is the loss GPT2LMHeadModel(input_ids=ids, labels=ids) computes."""
        xp = self.ctx.xp if not isinstance(labels, np.ndarray) else np
        targets = xp.full(labels.shape, self.ignore_index, dtype=np.int64)
        targets[:, :-1] = labels[:, 1:]
        return targets

    # ---- generation ---------------------------------------------------------------------------
    def new_kv_cache(self, batch: int, max_len: int):
        dt = DTYPES[self.config.dtype]
        return [b.attn.new_kv_cache(batch, max_len, dt) for b in self.layers]

    def forward_cached(self, idx, caches):
        """Eval-mode logits (sharded, padding -inf, as `forward`'s) for new tokens idx [B, Tn] after
        caches' positions; never sequence-parallel (one new token does not split over the TP ranks)."""
        self._whole_model("generation")
        self._lay_out_context(False)
        with self.without_sequence_parallel():
            return self._forward_cached(idx, caches)

    def _forward_cached(self, idx, caches):
        n0 = caches[0]["len"]
        idx = self.ctx.asarray(idx)
        T = idx.shape[1]
        if n0 + T > self.config.block_size:
            raise ValueError(f"generation reached {n0 + T} positions; block_size is {self.config.block_size}")
        x = self.tok_embed.forward(idx)
        if self.pos_embed is not None:
            x += self.pos_embed.weight.data[n0:n0 + T]
        for block, cache in zip(self.layers, caches):
            x = block.forward_cached(x, cache)
        return self._mask_padding(self._head(x))

    # ---- state -------------------------------------------------------------------------------
    def named_parameters(self) -> dict:
        return {p.name: p for p in self.parameters()}

    def state_dict(self) -> dict:
        """This rank's shards, by parameter name (arrays of the backend: NumPy or CuPy)."""
        return {p.name: p.data for p in self.parameters()}

    def gather_state_dict(self, rank: int | None = 0) -> dict | None:
        """Full, unsharded tensors under GPT-2's names, vocabulary padding removed.

        Collective over the TP group. Returns host NumPy arrays on TP rank `rank` (None: on every
        TP rank) and None elsewhere.
        """
        out = {}
        for p in self.parameters():
            full = gather_full(self.ctx.tp, p.data, p.sharding)
            if rank is None or self.ctx.tp_rank == rank:
                full = self.ctx.to_numpy(full)
                if p.real_rows is not None:
                    full = full[: p.real_rows]
                if isinstance(full, np.ndarray) and np.may_share_memory(full, p.data):
                    full = full.copy()  # a replicated parameter's own array: a copy, never a live view
                out[p.name] = np.ascontiguousarray(full)
        return out if (rank is None or self.ctx.tp_rank == rank) else None

    def load_full_state_dict(self, full: dict, strict: bool = True) -> None:
        """Loads full (unsharded, unpadded) tensors, keeping this rank's shard of each. No communication."""
        params = self.named_parameters()
        missing = sorted(set(params) - set(full))
        unexpected = sorted(set(full) - set(params))
        if strict and (missing or unexpected):
            raise ValueError(f"state dict mismatch: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                             f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
        for name, p in params.items():
            if name not in full:
                continue
            a = to_numpy(full[name])  # host arrays, or a device state dict (np.asarray refuses CuPy arrays)
            if p.real_rows is not None and a.shape[0] == p.real_rows:
                a = pad_rows(a, p.full_shape[0])
            if tuple(a.shape) != tuple(p.full_shape):
                raise ValueError(f"{name}: expected full shape {tuple(p.full_shape)}, got {tuple(a.shape)}")
            shard = np.ascontiguousarray(take_shard(a, p.sharding, self.ctx.tp_rank), dtype=p.data.dtype)
            p.data[...] = self.ctx.asarray(shard)

    def num_parameters_local(self) -> int:
        return int(sum(p.data.size for p in self.parameters()))
