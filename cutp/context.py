"""The runtime context: mesh (TP x DP), device binding and communicators, with no global state.

`cutp.init(...)` returns a `Context` that owns everything a model needs. Two contexts can live
in one process, and a host code can hand cutp any mpi4py communicator (a sub-communicator of
its own): cutp only ever talks over the communicators it split off that one.

Mesh layout: world rank r = dp_rank * tp + tp_rank. TP ranks are contiguous, so with the usual
rank-by-node placement a TP group stays inside a node (NVLink) and DP crosses nodes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from . import backend
from .comm import CommCounter, CountingCommunicator
from .errors import ConfigError


@dataclass(frozen=True)
class Mesh:
    tp: int
    dp: int

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_group(self, rank: int) -> list[int]:
        base = (rank // self.tp) * self.tp
        return list(range(base, base + self.tp))

    def dp_group(self, rank: int) -> list[int]:
        return list(range(rank % self.tp, self.tp * self.dp, self.tp))


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_mesh(world_size: int, tp, dp) -> Mesh:
    """Checks tp and dp against the world size; returns the mesh. Pure: no communication."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be an integer >= 1, got {tp!r}")
    if dp is None:
        if world_size % tp:
            raise ConfigError(
                f"tp={tp} does not divide the world size {world_size}, so dp cannot be derived; "
                f"use a tp from {_divisors(world_size)} or start a multiple of {tp} ranks"
            )
        dp = world_size // tp
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"dp must be an integer >= 1, got {dp!r}")
    if tp * dp != world_size:
        raise ConfigError(
            f"tp*dp = {tp}*{dp} = {tp * dp} but the communicator has {world_size} ranks; "
            f"start {tp * dp} ranks (mpirun -np {tp * dp}) or choose tp*dp = {world_size}"
        )
    return Mesh(tp, dp)


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


class Context:
    """Owns the mesh, the device and the communicators of one cutp instance.

    Attributes: rank, world_size, tp_rank, tp_size, dp_rank, dp_size, local_rank, local_size,
    device ('cpu' or 'cuda'), xp (numpy or cupy), world / tp / dp (counted communicators),
    counter (CommCounter over all three groups).
    """

    def __init__(self, comm=None, tp: int = 1, dp: int | None = None, device: str = "auto",
                 abort_on_error: bool = True, collective_timeout: float | None = None, device_id: int | None = None):
        from mpi4py import MPI

        from . import __version__
        from .consistency import check_same_on_all_ranks
        from .failure import errors_raised_on_every_rank, install_abort_on_error
        from .watchdog import Watchdog, check_timeout, configure_host_watchdog, default_timeout

        if abort_on_error:
            install_abort_on_error()
        self.mpi_comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.mpi_comm.Get_rank()
        self.world_size = self.mpi_comm.Get_size()
        with errors_raised_on_every_rank(self.mpi_comm):  # a device missing on one node stops every rank
            self.mesh = validate_mesh(self.world_size, tp, dp)
            self.device = backend.resolve_device(device)
            timeout = default_timeout() if collective_timeout is None else check_timeout(collective_timeout)
        configure_host_watchdog(timeout)
        check_same_on_all_ranks(self.mpi_comm, {"tp": tp, "dp": self.mesh.dp, "device": self.device,
                                                "cutp": __version__}, "cutp.init arguments")
        self.tp_size, self.dp_size = self.mesh.tp, self.mesh.dp
        self.tp_rank = self.mesh.tp_rank(self.rank)
        self.dp_rank = self.mesh.dp_rank(self.rank)

        self._owned_mpi = []
        local = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()

        self.device_id = None
        if self.device == "cuda":
            n_gpus = backend.cuda_device_count()
            # The GPU follows the process (its launcher's node-local index), not its rank in `comm`:
            # two contexts of different processes on one node must not pick the same GPU.
            if device_id is None:
                node_index = backend.launcher_local_rank()
                device_id = (self.local_rank if node_index is None else node_index) % n_gpus
            bus = np.zeros(64, np.uint8)
            text = backend.cuda_pci_bus_id(device_id).encode()[:64]
            bus[: len(text)] = np.frombuffer(text, np.uint8)
            every = np.empty((self.local_size, 64), np.uint8)
            local.Allgather([bus, MPI.UINT8_T], [every, MPI.UINT8_T])
            local.Free()
            check_gpu_assignment([bytes(row).rstrip(b"\0").decode() for row in every], n_gpus)
            import cupy

            self.device_id = int(device_id)
            cupy.cuda.Device(self.device_id).use()  # before any NCCL call
        else:
            local.Free()
        self.xp = backend.array_module_for(self.device)

        tp_mpi = self.mpi_comm.Split(color=self.dp_rank, key=self.tp_rank)
        dp_mpi = self.mpi_comm.Split(color=self.tp_rank, key=self.dp_rank)
        world_mpi = self.mpi_comm.Dup()
        self._owned_mpi = [tp_mpi, dp_mpi, world_mpi]
        self.counter = CommCounter()
        self.watchdog = Watchdog(timeout, self.rank)
        self.world = self._wrap(self._make_comm(world_mpi, "world"))
        self.tp = self._wrap(self._make_comm(tp_mpi, "tp"))
        self.dp = self._wrap(self._make_comm(dp_mpi, "dp"))
        self._extra_groups = {}
        self.closed = False

    def _make_comm(self, mpi_comm, name):
        if self.device == "cuda":
            from .comm.nccl import NcclCommunicator

            return NcclCommunicator(mpi_comm, name)
        from .comm.mpi import MpiCommunicator

        return MpiCommunicator(mpi_comm, name)

    def _wrap(self, comm):
        """Counting outside, watchdog inside: both see every collective of the group."""
        from .watchdog import WatchdogCommunicator

        if self.watchdog.enabled:
            comm = WatchdogCommunicator(comm, self.watchdog)
        return CountingCommunicator(comm, self.counter)

    def subgroup(self, name: str, color: int, key: int):
        """A counted communicator over the TP group's ranks of equal `color` (collective over TP).

        Used for GQA, where a KV head replicated on several TP ranks has its gradient summed over
        exactly those ranks. Cached by name.
        """
        if name not in self._extra_groups:
            mpi = self.tp.mpi_comm.Split(color=color, key=key)
            self._owned_mpi.append(mpi)
            self._extra_groups[name] = self._wrap(self._make_comm(mpi, name))
        return self._extra_groups[name]

    # ---- arrays ----------------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Moves/wraps a host array (or anything with DLPack / __cuda_array_interface__)."""
        return backend.as_array(self.xp, a, dtype)

    def to_numpy(self, a):
        return backend.to_numpy(a)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} mesh tp={self.tp_size} x dp={self.dp_size} "
                f"(tp_rank {self.tp_rank}, dp_rank {self.dp_rank}) device={self.device}"
                + (f":{self.device_id}" if self.device_id is not None else "")
                + f" comm={self.tp.kind}"
                + (f" watchdog={self.watchdog.timeout:g}s" if self.watchdog.enabled else " watchdog=off"))

    def close(self):
        if getattr(self, "closed", True):
            return
        for group in (*self._extra_groups.values(), self.dp, self.tp, self.world):
            group.close()
        for c in self._owned_mpi:
            c.Free()
        self._owned_mpi = []
        self.watchdog.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<cutp.Context {self.describe()}>"


def init(comm=None, tp: int = 1, dp: int | None = None, device: str = "auto", abort_on_error: bool = True,
         collective_timeout: float | None = None, device_id: int | None = None) -> Context:
    """Creates a cutp context over `comm` (default MPI.COMM_WORLD). Collective over comm.

    tp*dp must equal comm's size (dp defaults to size // tp). device is 'cpu', 'cuda' or 'auto'.
    With abort_on_error (default), an uncaught exception on any rank aborts the whole MPI job
    after printing that rank's traceback. collective_timeout (seconds; default
    $CUTP_COLLECTIVE_TIMEOUT or 600, 0 = off) aborts the job when a collective stalls.
    device_id picks the GPU (default: the launcher's node-local rank modulo the visible GPUs).
    """
    return Context(comm=comm, tp=tp, dp=dp, device=device, abort_on_error=abort_on_error,
                   collective_timeout=collective_timeout, device_id=device_id)
