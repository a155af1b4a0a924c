"""ZeRO-2/3's state per parameter (cutp.optim.sharded.ShardedAdamW's): what it holds, the pieces of
each parameter's state this rank owns, written and read by checkpoints (cutp.checkpoint) as
DistributedAdamW's are, so that a checkpoint loads at any layout and stage.

A mixin: it reads ShardedAdamW's segments (`_by_name`: the trainable parameters'), its shard
buffers (`m`, `v`, `master`, `grad`, `data`) and `_mine`; a zero 3 save gathers each unit in
turn through its `_acquire` and `_release`.
"""
from __future__ import annotations


class ShardState:
    """The per-parameter view of a ShardedAdamW's shards (module docstring)."""

    holds_frozen = True  # (memory_bytes' params count the frozen parameters' shards: cutp.train.memory)

    def memory_bytes(self) -> dict:
        optim = self.m.nbytes + self.v.nbytes + (self.master.nbytes if self.master is not None else 0)
        return {"params": int(self.data.nbytes), "grads": int(self.grad.nbytes), "optimizer": int(optim)}

    def _state_buffers(self) -> dict:
        out = {"exp_avg.": self.m, "exp_avg_sq.": self.v}
        if self.master is not None:
            out["master."] = self.master
        return out

    def owned_part(self, name: str) -> tuple[int, int]:
        s, p = self._by_name[name]
        a0, b0 = s.where[id(p)]
        a, b = self._mine(s, a0, b0)
        if b <= a:
            return 0, 0
        first = a - s.shard_at + s.group.rank * s.chunk - a0
        return first, first + (b - a)

    def group_of(self, name: str):
        """The communicator parameter `name` is sharded over (an expert's: expert-DP x CP)."""
        return self._by_name[name][0].group

    def owned_grad(self, name: str):
        """This rank's piece of parameter `name`'s reduced gradient: the elements `owned_part`
        names (a view of the gradient shard)."""
        s, p = self._by_name[name]
        a, b = self.owned_part(name)
        at = s.shard_at + s.where[id(p)][0] + a - s.group.rank * s.chunk
        return self.grad[at:at + b - a]

    def state_pieces(self) -> tuple[dict, dict]:
        """This rank's pieces of the state, per parameter, with their [a, b) (as DistributedAdamW's:
        a checkpoint of them loads at any layout and stage). HSDP: the first replica's only."""
        pieces, offsets = {}, {}
        if self.replicas is not None and self.replicas.rank != 0:
            return pieces, offsets
        for name, (s, p) in self._by_name.items():
            a, b = self.owned_part(name)
            if b > a:
                offsets[name] = [a, b]
                at = s.shard_at + s.where[id(p)][0] + a - s.group.rank * s.chunk
                for prefix, buf in self._state_buffers().items():
                    pieces[prefix + name] = buf[at:at + b - a]
        return pieces, offsets

    def state_dict(self) -> dict:
        """Per parameter, at a group of one rank (the shard is everything); a group of several
        writes `state_pieces` (cutp.checkpoint)."""
        if any(s.group.size != 1 for s in self.segments):
            raise ValueError("ShardedAdamW.state_dict needs a group of one rank: use state_pieces")
        pieces, _ = self.state_pieces()
        return {k: v.reshape(self._by_name[k.split(".", 1)[1]][1].data.shape) for k, v in pieces.items()}

    def load_state(self, tensors: dict, step: int) -> None:
        for name, (s, p) in self._by_name.items():
            a, b = self.owned_part(name)
            n = s.where[id(p)][1] - s.where[id(p)][0]
            at = s.shard_at + s.where[id(p)][0] + a - s.group.rank * s.chunk
            for prefix, buf in self._state_buffers().items():
                key = prefix + name
                if key not in tensors:
                    raise ValueError(f"optimizer state is missing {key}")
                t = tensors[key].reshape(-1)
                if t.size == n:
                    t = t[a:b]
                elif t.size != b - a:
                    raise ValueError(f"optimizer state {key} has {t.size} elements, expected {n} "
                                     f"(or this rank's {b - a})")
                if b > a:
                    buf[at:at + b - a] = t
        self.step_count = int(step)

    def nonfinite_parameter(self, names) -> str | None:
        """zero 3: a parameter of `names` with a non-finite entry in this rank's pieces, or None
        (every rank checks its own shard: the whole is finite when every shard is)."""
        for s in self.segments:
            for p in s.params:
                a, b = self._mine(s, *s.where[id(p)]) if p.name in names else (0, 0)
                if b > a and not bool(self.xp.isfinite(self.data[a:b]).all()):
                    return p.name
        return None

    def whole_parameters(self, names):
        """zero 3 outside a step: yields (name, whole values) of the parameters of `names`, each
        segment holding one gathered in turn (a collective over its group, the same segments in
        the same order on each of its ranks) and freed after its parameters were taken: one
        unit whole at a time (a checkpoint's save)."""
        for s in self.segments:
            mine = [p for p in s.params if p.name in names]
            if not mine:
                continue
            self._acquire(s)
            try:
                for p in mine:
                    yield p.name, p.data
            finally:
                self._release(s)

    def leads_its_groups(self) -> bool:
        """Whether this rank is rank 0 of every group it shards over (each segment's, and the
        replicas'): the rank a checkpoint's model file is written by (DP x CP rank 0) must be."""
        groups = [s.group for s in self.segments] + [g for g in (self.replicas, self.expert_replicas) if g is not None]
        return all(g.rank == 0 for g in groups)

    @property
    def params_sharded(self) -> bool:
        """zero 3 with no parameter whole (outside `gather_all`): a checkpoint loads into the shards."""
        return self.zero == 3 and not self.all_gathered

    def piece_of(self, p, values):
        """zero 3: this rank's piece of parameter p's whole `values` (flat, a copy), or None for a
        parameter in no segment (a buffer: whole on every rank)."""
        s = self._segment_of.get(id(p))
        if s is None:
            return None
        a0, b0 = s.where[id(p)]
        a, b = self._mine(s, a0, b0)
        lo = a - s.shard_at + s.group.rank * s.chunk - a0 if b > a else 0
        return values.reshape(-1)[lo:lo + max(0, b - a)].copy()

    def put_piece(self, p, piece) -> None:
        """The piece `piece_of` took, written into this rank's parameter shard."""
        s = self._segment_of[id(p)]
        a, b = self._mine(s, *s.where[id(p)])
        if b > a:
            self.data[a:b] = piece

    def hyperparameters(self) -> dict:
        return {"step": self.step_count, "lr": self.lr, "betas": [self.beta1, self.beta2], "eps": self.eps,
                "weight_decay": self.weight_decay, "distributed": True, "master_weights": self.master is not None,
                "dp": self.ctx.dp_size, "zero": self.zero,
                "dp_replicate": 1 if self.replicas is None else self.replicas.size}
