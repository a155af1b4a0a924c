"""The TP x DP x PP mesh: which rank holds which part, and the checks a layout must pass. Pure.

Expert parallelism (ep) splits each DP group into groups of `ep` consecutive DP ranks (the EP
groups: dp_rank // ep equal, ep_rank = dp_rank % ep); the DP ranks of equal ep_rank form the
expert-DP group, over which an expert's replicas reduce their gradients.

World rank r = (pp_rank * dp + dp_rank) * tp + tp_rank: TP fastest, then DP, then PP. TP ranks
are contiguous, so with the usual rank-by-node placement a TP group stays inside a node
(NVLink), and DP and the pipeline stages cross nodes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Mesh:
    tp: int
    dp: int
    pp: int = 1
    ep: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.dp * self.pp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.dp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.dp)

    def ep_rank(self, rank: int) -> int:
        return self.dp_rank(rank) % self.ep

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def tp_group(self, rank: int) -> list[int]:
        base = (rank // self.tp) * self.tp
        return list(range(base, base + self.tp))

    def dp_group(self, rank: int) -> list[int]:
        t, p = self.tp_rank(rank), self.pp_rank(rank)
        return [self.rank_of(t, d, p) for d in range(self.dp)]

    def pp_group(self, rank: int) -> list[int]:
        t, d = self.tp_rank(rank), self.dp_rank(rank)
        return [self.rank_of(t, d, p) for p in range(self.pp)]


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_mesh(world_size: int, tp, dp, pp=1, ep=1) -> Mesh:
    """Checks tp, dp, pp and ep against the world size; returns the mesh. Pure: no communication."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be an integer >= 1, got {tp!r}")
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ConfigError(f"pp must be an integer >= 1, got {pp!r}")
    if dp is None:
        if world_size % (tp * pp):
            what = f"tp={tp}" if pp == 1 else f"tp*pp = {tp}*{pp}"
            raise ConfigError(
                f"{what} does not divide the world size {world_size}, so dp cannot be derived; "
                f"use a tp from {_divisors(world_size // pp if world_size % pp == 0 else world_size)} "
                f"or start a multiple of {tp * pp} ranks"
            )
        dp = world_size // (tp * pp)
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"dp must be an integer >= 1, got {dp!r}")
    if tp * dp * pp != world_size:
        if pp == 1:
            raise ConfigError(
                f"tp*dp = {tp}*{dp} = {tp * dp} but the communicator has {world_size} ranks; "
                f"start {tp * dp} ranks (mpirun -np {tp * dp}) or choose tp*dp = {world_size}"
            )
        raise ConfigError(
            f"tp*dp*pp = {tp}*{dp}*{pp} = {tp * dp * pp} but the communicator has {world_size} ranks; "
            f"start {tp * dp * pp} ranks (mpirun -np {tp * dp * pp}) or choose tp*dp*pp = {world_size}"
        )
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ConfigError(f"ep must be an integer >= 1, got {ep!r}")
    if dp % ep:
        raise ConfigError(f"ep={ep} does not divide dp={dp}: the expert-parallel groups are carved from the DP group; "
                          f"use an ep from {_divisors(dp)}")
    return Mesh(tp, dp, pp, ep)


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
