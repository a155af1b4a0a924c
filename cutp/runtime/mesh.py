"""The mesh of named parallel dimensions: which rank holds which part, and the checks a layout must pass. Pure.

A `Mesh` is one ordered list of dimensions, fastest first (Megatron's parallel_state order,
torchtitan's ParallelDims). cutp's order is tp, cp, dp, pp (Megatron's "tp-cp-ep-dp-pp"):

    world rank r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

TP fastest, so with the usual rank-by-node placement a TP group stays inside a node (NVLink);
context parallelism (cp) next, because its ring exchanges K and V at every layer (a volume that
does not shrink with cp), so a CP group should stay inside the node too when tp * cp fits; DP
and the pipeline stages cross nodes. Every rank number, group and communicator split is derived
from that list (`coords`, `group`, `split`). At cp 1 the formula is the one of tp, dp, pp.

A dimension may be carved out of another (`CARVED`): expert parallelism (ep) is the fastest
factor of dp, so the EP groups are ep consecutive DP ranks (ep_rank = dp_rank % ep), and the
rest of dp, the DP ranks of equal ep_rank (expert_dp_rank = dp_rank // ep), is the expert-DP
group, over which an expert's replicas reduce their gradients.
"""
from __future__ import annotations

import os

from .errors import ConfigError

# The dimensions of a training mesh, fastest first (a Mesh made from sizes takes this order).
ORDER = ("tp", "cp", "dp", "pp")
# (dimension, the dimension it is carved from, the name of the rest): the carved part is the
# fastest factor of its parent.
CARVED = (("ep", "dp", "expert_dp"),)


class Mesh:
    """Ranks laid out over named dimensions.

        Mesh(2, 4)                                   # tp=2, dp=4, pp=1
        Mesh(2, 4, 1, ep=2)                          # and ep=2 carved out of dp
        Mesh(2, 2, cp=2)                             # tp=2, cp=2, dp=2: context parallelism
        Mesh(dims=(("tp", 2), ("cp", 2), ("dp", 2)))  # any ordered dimensions, fastest first

    `coords(rank)` gives every dimension's coordinate (the carved ones included), `group(rank,
    *dims)` the ranks that differ from `rank` only in `dims` (in the order of their coordinates),
    `split(rank, *dims)` the (colour, key) of a communicator split into those groups.
    """

    def __init__(self, tp: int = 1, dp: int = 1, pp: int = 1, ep: int = 1, *, cp: int = 1, dims=None):
        if dims is None:
            # (a mesh without context parallelism has no cp dimension: the one it always had)
            dims = tuple((n, s) for n, s in zip(ORDER, (tp, cp, dp, pp)) if n != "cp" or cp != 1)
        self.dims = tuple((str(name), int(size)) for name, size in dims)
        names = [name for name, _ in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh dimensions named twice: {names}")
        carved = {name: (parent, rest, ep if name == "ep" else 1) for name, parent, rest in CARVED if parent in names}
        # the factors every dimension is made of, fastest first: a carved dimension and its rest
        # replace their parent
        self._factors: list[tuple[str, int]] = []
        self._spans: dict[str, tuple[str, ...]] = {}
        for name, size in self.dims:
            self._spans[name] = (name,)
            for part, (parent, rest, part_size) in carved.items():
                if parent == name:
                    if part_size < 1 or size % part_size:
                        raise ValueError(f"{part}={part_size} does not divide {name}={size}")
                    self._factors += [(part, part_size), (rest, size // part_size)]
                    self._spans.update({name: (part, rest), part: (part,), rest: (rest,)})
                    break
            else:
                self._factors.append((name, size))
        self._size_of = dict(self._factors)
        self._size_of.update(self.dims)

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        n = 1
        for _, s in self.dims:
            n *= s
        return n

    def size_of(self, *dims: str) -> int:
        """The product of these dimensions' sizes (1 for a dimension this mesh does not have)."""
        n = 1
        for f in self._factors_of(dims):
            n *= self._size_of[f]
        return n

    def __getattr__(self, name):  # mesh.tp, mesh.dp, mesh.pp, mesh.ep, ...: a dimension's size
        if name.startswith("_") or name not in self._spans:
            raise AttributeError(f"this mesh has no dimension {name!r} (it has {', '.join(self._spans)})")
        return self.size_of(name)

    def _factors_of(self, dims) -> list[str]:
        """The factors the dimensions span, in the mesh's order (unknown names: none, size 1)."""
        wanted = {f for d in dims for f in self._spans.get(d, ())}
        return [f for f, _ in self._factors if f in wanted]

    # ---- ranks ---------------------------------------------------------------------------------
    def _factor_coords(self, rank: int) -> dict[str, int]:
        out = {}
        for f, s in self._factors:
            out[f], rank = rank % s, rank // s
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """Every dimension's coordinate of `rank` (a dimension of several factors counts them in
        the mesh's order: dp_rank = ep_rank + ep * expert_dp_rank)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        fc = self._factor_coords(rank)
        return {name: self._index(fc, self._factors_of((name,))) for name in self._spans}

    def _index(self, fc: dict, factors: list[str]) -> int:
        index, stride = 0, 1
        for f in factors:
            index += fc[f] * stride
            stride *= self._size_of[f]
        return index

    def rank_at(self, **coords: int) -> int:
        """The world rank of these coordinates (the listed dimensions; missing ones 0)."""
        rank, stride = 0, 1
        for name, size in self.dims:
            rank += coords.get(name, 0) * stride
            stride *= size
        return rank

    def group(self, rank: int, *dims: str) -> list[int]:
        """The world ranks that differ from `rank` only in `dims`, ordered by their coordinate
        over `dims` (which is their rank in the group's communicator)."""
        inside = self._factors_of(dims)
        fc = self._factor_coords(rank)
        members = []
        for i in range(self.size_of(*dims)):
            for f in inside:
                fc[f], i = i % self._size_of[f], i // self._size_of[f]
            members.append(self._rank_of_factors(fc))
        return members

    def _rank_of_factors(self, fc: dict) -> int:
        rank, stride = 0, 1
        for f, s in self._factors:
            rank += fc[f] * stride
            stride *= s
        return rank

    def split(self, rank: int, *dims: str) -> tuple[int, int]:
        """(colour, key) for MPI's Comm.Split into the groups over `dims`: the colour numbers
        the coordinates outside them, the key is the coordinate inside."""
        inside = self._factors_of(dims)
        fc = self._factor_coords(rank)
        outside = [f for f, _ in self._factors if f not in inside]
        return self._index(fc, outside), self._index(fc, inside)

    # ---- the names cutp used before the dimensions were named ----------------------------------
    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)["dp"]

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> int:
        return self.rank_at(tp=tp_rank, dp=dp_rank, pp=pp_rank)

    # ---- value semantics -----------------------------------------------------------------------
    def _key(self):
        return self.dims, tuple(self._factors)

    def __eq__(self, other):
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        rests = {rest for _, _, rest in CARVED}
        listed = dict(self.dims)
        sizes = [f"{n}={s}" for n, s in self.dims if n != "cp" or s > 1] + [f"{f}={s}" for f, s in self._factors
                                                       if f not in listed and f not in rests and s > 1]
        return f"Mesh({', '.join(sizes)})"


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _size(name, v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"`{name}` must be an integer >= 1, got {v!r}")
    return v


def derive_mesh(world_size: int, tp=None, dp=None, pp=None, ep=None, pick_tp=None, tp_suits=None, cp: int = 1) -> Mesh:
    """The mesh of `world_size` ranks from the sizes given (None: derived). Pure.

    cp: the context-parallel factor already taken from the ranks (`with_context_parallel`):
    world_size is what it left for tp x dp x pp, and the refusals name the whole world
    (world_size x cp) and cp, as the user started and gave them. The mesh returned has no cp.

    pp and ep default to 1; dp = world / (tp * pp) when tp is given; tp = world / (dp * pp) when
    dp is given; when neither is, tp = pick_tp(n), a divisor of n = world / (pp * ep) (the
    machine's choice: `cutp.train.defaults.choose_tp`; default 1), so that ep divides dp. Every
    refusal names the numbers and proposes only fixes that work: a tp it proposes passes
    `tp_suits(tp)` (the model's shape rules; default: any).
    """
    suits = tp_suits or (lambda t: True)
    pp = 1 if pp is None else _size("pp", pp)
    ep = 1 if ep is None else _size("ep", ep)
    if tp is not None:
        _size("tp", tp)
    if dp is not None:
        _size("dp", dp)
    if world_size % pp:
        raise ConfigError(f"`pp` {pp} does not divide the {_ranks(world_size, cp)}; use a `pp` from "
                          f"{_divisors(world_size)} or start a multiple of {pp * cp} ranks")
    dp_derived = dp is None
    if tp is not None and dp is not None:
        if tp * dp * pp != world_size:
            raise ConfigError(_product_mismatch(world_size, tp, dp, pp, ep, suits, cp))
    elif tp is not None:
        if world_size % (tp * pp):
            raise ConfigError(_undividable(world_size, "tp", tp, pp, ep, suits, cp))
        dp = world_size // (tp * pp)
    elif dp is not None:
        if world_size % (dp * pp):
            raise ConfigError(_undividable(world_size, "dp", dp, pp, ep, suits, cp))
        tp = world_size // (dp * pp)
    else:
        if (world_size // pp) % ep:
            options = [e for e in _divisors(world_size // pp)]
            raise ConfigError(f"`ep` {ep} does not divide the {world_size // pp} ranks of each pipeline stage "
                              f"(world {world_size * cp}{f' / cp {cp}' if cp > 1 else ''} / pp {pp}), so no dp is "
                              f"a multiple of it; use an `ep` from {options} or start a multiple of {ep * pp * cp} "
                              "ranks")
        n = world_size // (pp * ep)
        tp = 1 if pick_tp is None else pick_tp(n)
        if n % tp:
            raise ValueError(f"pick_tp({n}) returned {tp}, which does not divide {n}")
        dp = world_size // (tp * pp)
    if dp % ep:
        raise ConfigError(f"`ep`={ep} does not divide dp={dp}: the expert-parallel groups are carved from the DP "
                          f"group; use an `ep` from {_divisors(dp)}"
                          + (_ep_fix(world_size, pp, ep, suits) if dp_derived else ""))
    return Mesh(tp, dp, pp, ep)


def _ranks(world: int, cp: int) -> str:
    """The ranks left for tp x dp x pp, named from the world started (`derive_mesh`'s cp)."""
    return f"{world} ranks" if cp == 1 else f"{world * cp} ranks / cp {cp} = {world}"


def _product(tp, dp, pp, cp=1) -> str:
    sizes = [("tp", tp)] + [("cp", cp)] * (cp > 1) + [("dp", dp)] + [("pp", pp)] * (pp > 1)  # the mesh's order
    return (f"{'*'.join(n for n, _ in sizes)} = {'*'.join(str(v) for _, v in sizes)} = "
            f"{tp * cp * dp * pp}")


def _product_mismatch(world, tp, dp, pp, ep, suits, cp=1) -> str:
    n = tp * cp * dp * pp
    fixes = []
    if dp % ep == 0:
        fixes.append(f"start {n} ranks (mpirun -np {n})")
    if world % (tp * pp) == 0 and (world // (tp * pp)) % ep == 0:
        fixes.append(f"omit `dp` (it would be {world // (tp * pp)})")
    if world % (dp * pp) == 0 and dp % ep == 0 and suits(world // (dp * pp)):
        fixes.append(f"omit `tp` (it would be {world // (dp * pp)})")
    fix = "; ".join(fixes) if fixes else f"choose sizes whose product is {world * cp}"
    return f"{_product(tp, dp, pp, cp)} but the communicator has {world * cp} ranks; {fix}"


def _undividable(world, name, value, pp, ep, suits, cp=1) -> str:
    """`name` (tp or dp) given alone does not divide the world: the other cannot be derived."""
    other = "dp" if name == "tp" else "tp"
    sizes = [(name, value)] + [("cp", cp)] * (cp > 1) + [("pp", pp)] * (pp > 1)
    what = (f"{name}={value}" if len(sizes) == 1 else
            f"{'*'.join(n for n, _ in sizes)} = {'*'.join(str(v) for _, v in sizes)}")
    per_stage = world // pp
    if name == "tp":
        options = [t for t in _divisors(per_stage) if (per_stage // t) % ep == 0 and suits(t)]
    else:
        options = [d for d in _divisors(per_stage) if d % ep == 0 and suits(per_stage // d)]
    start = f"start a multiple of {value * pp * cp * (ep if name == 'tp' else 1)} ranks"
    return (f"{what} does not divide the world size {world * cp}, so {other} cannot be derived; "
            + (f"use a `{name}` from {options} or {start}" if options else start))


def _ep_fix(world, pp, ep, suits) -> str:
    tps = [t for t in _divisors(world // pp) if (world // pp // t) % ep == 0 and suits(t)]
    return f", or a `tp` from {tps} (dp = {world // pp} / tp)" if (world // pp) % ep == 0 and tps else ""


def with_context_parallel(world_size: int, cp) -> int:
    """The ranks left for tp x dp x pp once context parallelism takes its factor cp (which must
    divide the world): world / cp. Pure."""
    _size("cp", cp)
    if world_size % cp:
        raise ConfigError(f"`cp` {cp} does not divide the {world_size} ranks; use a `cp` from "
                          f"{_divisors(world_size)} or start a multiple of {cp} ranks")
    return world_size // cp


def add_context_parallel(mesh: Mesh, cp: int) -> Mesh:
    """`mesh` (tp, dp, pp, ep) with a cp dimension between tp and dp."""
    return mesh if cp == 1 else Mesh(mesh.tp, mesh.dp, mesh.pp, mesh.ep, cp=cp)


def validate_mesh(world_size: int, tp, dp, pp=1, ep=1, cp=1) -> Mesh:
    """Checks tp, cp, dp, pp and ep against the world size; returns the mesh (dp None: derived).
    Pure: no communication. (`cutp.init`'s check; `derive_mesh` also derives tp.)"""
    _size("tp", tp)
    return add_context_parallel(derive_mesh(with_context_parallel(world_size, cp), tp, dp, pp, ep, cp=cp), cp)


def check_gpu_assignment(bus_ids: list, n_gpus: int) -> None:
    """NCCL needs one GPU per rank: refuse when ranks of one node (in rank order, with the PCI
    bus id of the GPU each would use) would share a GPU. Pure: every rank gets the same verdict."""
    if len(set(bus_ids)) == len(bus_ids):
        return
    if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1":
        return  # NCCL >= 2.30 can share a GPU between ranks when asked explicitly
    shared = {}
    for r, b in enumerate(bus_ids):
        shared.setdefault(b, []).append(r)
    example = next(rs for rs in shared.values() if len(rs) > 1)
    local_size = len(bus_ids)
    raise ConfigError(
        f"{local_size} ranks run on this node but they see {n_gpus} GPU(s) (node-local ranks {example} would share "
        f"GPU {bus_ids[example[0]]}), and NCCL needs one GPU per rank. Start at most {len(shared)} ranks per node "
        f"(e.g. mpirun -np {len(shared)} or --map-by ppr:{len(shared)}:node), hand cutp.init a communicator with "
        f"at most that many ranks per node, or use device='cpu'."
    )
