"""The context of one cutp instance: the mesh, device binding and communicators; no global state.

`cutp.init(...)` returns a `Context` that owns everything a model needs. Two contexts can live
in one process, and a host code can hand cutp any mpi4py communicator (a sub-communicator of
its own): cutp only ever talks over the communicators it split off that one.

Mesh layout: world rank r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. TP ranks are contiguous,
so with the usual rank-by-node placement a TP group stays inside a node (NVLink), and DP and the
pipeline stages cross nodes (`cutp.runtime.mesh`). The mesh's named dimensions give every rank
attribute and every group's colour and key; `Context.GROUPS` lists the groups split off.

The Context lives in `cutp.comm`, above the communicators it owns (MPI or NCCL, each inside a
watchdog and a counter); everything it stands on (mesh arithmetic, device selection, failure
handling, the watchdog, the cross-rank checks) is in `cutp.runtime`.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .. import __version__
from ..runtime import backend
from ..runtime.consistency import check_same_on_all_ranks
from ..runtime.errors import ConfigError
from ..runtime.failure import errors_raised_on_every_rank, install_abort_on_error
from ..runtime.mesh import Mesh, check_gpu_assignment, validate_mesh
from ..runtime.watchdog import Watchdog, check_timeout, configure_host_watchdog, default_timeout
from .counting import CommCounter, CountingCommunicator
from .mpi import MpiCommunicator
from .nccl import NcclCommunicator
from .simulated import Link, SimulatedLinkCommunicator
from .watched import WatchdogCommunicator

__all__ = ["Context", "Mesh", "init"]


class Context:
    """Owns the mesh, the device and the communicators of one cutp instance.

    Attributes: rank, world_size, tp_rank, tp_size, dp_rank, dp_size, pp_rank, pp_size,
    local_rank, local_size, device ('cpu' or 'cuda'), xp (numpy or cupy), world / tp / dp / pp
    (counted communicators; pp: this rank's pipeline, the ranks of equal tp_rank and dp_rank,
    one per stage), embedding (the first and last stages of the pipeline, which both hold a
    tied embedding; None elsewhere and at pp 1), counter (CommCounter over every group).
    Expert parallelism: ep_rank, ep_size, ep (the EP group: ep consecutive ranks of the DP group,
    which split the experts between them; None at ep 1), expert_dp (the DP ranks of equal
    ep_rank, which hold the same experts; the DP group itself at ep 1).
    Context parallelism: cp_rank, cp_size, cp (the ranks of equal tp, dp and pp coordinates,
    which hold the chunks of the same sequences: the ring of `cutp.tensor_parallel.context_parallel`),
    dp_cp (the ranks that hold the same weights and reduce their gradients and shard ZeRO's
    state: DP x CP; the DP group itself at cp 1, dp_cp_rank = cp_rank + cp * dp_rank),
    expert_dp_cp (the ranks that hold the same experts at ep > 1: expert-DP x CP, over which the
    experts' gradients are summed and their ZeRO state sharded; expert_dp itself at cp 1).
    """

    # The communicators of a context, in the order they are split: (attribute, the mesh
    # dimensions its ranks differ in). A new mesh dimension is one entry here (and its place in
    # `cutp.runtime.mesh.ORDER`); its rank and size attributes follow from the mesh.
    GROUPS = (("tp", ("tp",)), ("dp", ("dp",)), ("pp", ("pp",)), ("ep", ("ep",)), ("expert_dp", ("expert_dp",)),
              ("cp", ("cp",)), ("dp_cp", ("cp", "dp")), ("expert_dp_cp", ("cp", "expert_dp")))
    # Groups that exist only when a dimension of theirs has size > 1: at ep 1 there is no EP
    # group and the expert-DP group is the DP group itself; at cp 1 there is no CP group and the
    # DP x CP group is the DP group; the expert-DP x CP group is the expert-DP group at cp 1 and
    # the DP x CP group at ep 1. {group: ((the dimension, the group used instead (None: none)), ...)}
    UNLESS_CARVED = {"ep": (("ep", None),), "expert_dp": (("ep", "dp"),), "cp": (("cp", None),),
                     "dp_cp": (("cp", "dp"),), "expert_dp_cp": (("cp", "expert_dp"), ("ep", "dp_cp"))}

    def __init__(self, comm=None, tp: int = 1, dp: int | None = None, device: str = "auto",
                 abort_on_error: bool = True, collective_timeout: float | None = None, device_id: int | None = None,
                 pp: int = 1, ep: int = 1, mesh: Mesh | None = None, cp: int = 1):
        if abort_on_error:
            install_abort_on_error()
        self.mpi_comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.mpi_comm.Get_rank()
        self.world_size = self.mpi_comm.Get_size()
        with errors_raised_on_every_rank(self.mpi_comm):  # a device missing on one node stops every rank
            self.mesh = validate_mesh(self.world_size, tp, dp, pp, ep, cp) if mesh is None else _check_mesh(mesh,
                                                                                                        self.world_size)
            self.device = backend.resolve_device(device)
            timeout = default_timeout() if collective_timeout is None else check_timeout(collective_timeout)
        configure_host_watchdog(timeout)
        check_same_on_all_ranks(self.mpi_comm, {"mesh": repr(self.mesh),
                                                "device": self.device, "cutp": __version__}, "cutp.init arguments")
        set_rank_attributes(self, self.mesh, self.rank, self.GROUPS)

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
            import cupy  # optional dependency: device == "cuda" means it imports

            self.device_id = int(device_id)
            cupy.cuda.Device(self.device_id).use()  # before any NCCL call
        else:
            local.Free()
        self.xp = backend.array_module_for(self.device)

        self.counter = CommCounter()
        self.watchdog = Watchdog(timeout, self.rank)
        world_mpi = self.mpi_comm.Dup()
        self._owned_mpi = [world_mpi]
        self.world = self._wrap(self._make_comm(world_mpi, "world"))
        for name, dims in self.GROUPS:
            unsplit, instead = stand_in(self.mesh, name)
            if unsplit:
                setattr(self, name, None if instead is None else getattr(self, instead))
                continue
            colour, key = self.mesh.split(self.rank, *dims)
            setattr(self, name, self._split(name, colour, key))
        # the first and last stages of each pipeline, which both hold the tied embedding
        ends = self.pp_size > 1 and self.pp_rank in (0, self.pp_size - 1)
        colour, key = self.mesh.split(self.rank, "pp")
        self.embedding = self._split("embedding", colour if ends else MPI.UNDEFINED, key)
        self._extra_groups = {}
        self.link = None  # a simulated interconnect (simulate_link)
        self.closed = False

    def _split(self, name, colour, key):
        """A counted communicator over the ranks of equal `colour` (None where MPI.UNDEFINED)."""
        mpi = self.mpi_comm.Split(color=colour, key=key)
        if mpi == MPI.COMM_NULL:
            return None
        self._owned_mpi.append(mpi)
        return self._wrap(self._make_comm(mpi, name))

    def _make_comm(self, mpi_comm, name):
        if self.device == "cuda":
            return NcclCommunicator(mpi_comm, name)
        return MpiCommunicator(mpi_comm, name)

    def _wrap(self, comm):
        """Counting outside, watchdog inside: both see every collective of the group."""
        if self.watchdog.enabled:
            comm = WatchdogCommunicator(comm, self.watchdog)
        return CountingCommunicator(comm, self.counter)

    def subgroup(self, name: str, color: int, key: int, of=None, expect: tuple | None = None):
        """A counted communicator over the ranks of equal `color` of group `of` (default the TP
        group; collective over it). `expect`: the (rank, size) it must have (checked here; what
        the planner's shape-only context makes it).

        Used for GQA, where a KV head replicated on several TP ranks has its gradient summed over
        exactly those ranks, and for HSDP's shard and replica groups inside DP x CP. Cached by name.
        """
        if name not in self._extra_groups:
            mpi = (self.tp if of is None else of).mpi_comm.Split(color=color, key=key)
            self._owned_mpi.append(mpi)
            self._extra_groups[name] = self._wrap(self._make_comm(mpi, name))
        group = self._extra_groups[name]
        if expect is not None and (group.rank, group.size) != tuple(expect):
            raise ValueError(f"group {name}: rank {group.rank} of {group.size}, expected {tuple(expect)}")
        return group

    def simulate_link(self, bandwidth_gbs: float, latency_us: float) -> None:
        """Every group's collectives timed as over one link of this rank of `bandwidth_gbs` GB/s
        and `latency_us` microseconds (cutp.comm.simulated: benchmarks of overlap on one machine)."""
        self.link = link = Link(bandwidth_gbs, latency_us)
        groups = [self.world] + [getattr(self, name) for name, _ in self.GROUPS]
        groups += [self.embedding] + list(self._extra_groups.values())
        done = set()
        for comm in groups:
            if comm is None or id(comm) in done:
                continue
            done.add(id(comm))
            comm.inner = SimulatedLinkCommunicator(comm.inner, link)  # inside the counting

    # ---- arrays ----------------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Moves/wraps a host array (or anything with DLPack / __cuda_array_interface__)."""
        return backend.as_array(self.xp, a, dtype)

    def to_numpy(self, a):
        return backend.to_numpy(a)

    def synchronize(self) -> None:
        """Waits until the device has finished the work queued so far (a no-op on the CPU)."""
        if self.device == "cuda":
            self.xp.cuda.get_current_stream().synchronize()

    def describe(self) -> str:
        pp = f" x pp={self.pp_size}" if self.pp_size > 1 else ""
        pp += f" (ep={self.ep_size})" if self.ep_size > 1 else ""
        pp_rank = f", pp_rank {self.pp_rank}" if self.pp_size > 1 else ""
        cp, cp_rank = (f" x cp={self.cp_size}", f", cp_rank {self.cp_rank}") if self.cp_size > 1 else ("", "")
        return (f"rank {self.rank}/{self.world_size} mesh tp={self.tp_size}{cp} x dp={self.dp_size}{pp} "
                f"(tp_rank {self.tp_rank}{cp_rank}, dp_rank {self.dp_rank}{pp_rank}) device={self.device}"
                + (f":{self.device_id}" if self.device_id is not None else "")
                + f" comm={self.tp.kind}"
                + (f" watchdog={self.watchdog.timeout:g}s" if self.watchdog.enabled else " watchdog=off"))

    def close(self):
        if getattr(self, "closed", True):
            return
        groups = [getattr(self, name) for name, _ in reversed(self.GROUPS)]
        for group in dict.fromkeys(g for g in (*self._extra_groups.values(), self.embedding, *groups, self.world)
                                   if g is not None):
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


def set_rank_attributes(ctx, mesh: Mesh, rank: int, groups) -> None:
    """ctx.tp_rank, ctx.tp_size, ctx.dp_rank, ...: every dimension's coordinate and size, and
    every group's rank and size in it (a group of several dimensions, dp_cp: its rank in the
    group's communicator; a dimension the mesh lacks: rank 0, size 1)."""
    coords = mesh.coords(rank)
    for name in coords:
        setattr(ctx, f"{name}_rank", coords[name])
        setattr(ctx, f"{name}_size", mesh.size_of(name))
    for name, dims in groups:
        setattr(ctx, f"{name}_rank", mesh.split(rank, *dims)[1])
        setattr(ctx, f"{name}_size", mesh.size_of(*dims))


def stand_in(mesh: Mesh, name: str) -> tuple[bool, str | None]:
    """(True, the group used instead, or None) when group `name` is not split off on `mesh`
    (`Context.UNLESS_CARVED`: a dimension of it has size 1); else (False, None)."""
    for dim, instead in Context.UNLESS_CARVED.get(name, ()):
        if mesh.size_of(dim) == 1:
            return True, instead
    return False, None


def _check_mesh(mesh: Mesh, world_size: int) -> Mesh:
    if mesh.size != world_size:
        raise ConfigError(f"{mesh} has {mesh.size} ranks but the communicator has {world_size}; "
                          f"start {mesh.size} ranks (mpirun -np {mesh.size})")
    return mesh


def init(comm=None, tp: int = 1, dp: int | None = None, device: str = "auto", abort_on_error: bool = True,
         collective_timeout: float | None = None, device_id: int | None = None, pp: int = 1, ep: int = 1,
         mesh: Mesh | None = None, cp: int = 1) -> Context:
    """Creates a cutp context over `comm` (default MPI.COMM_WORLD). Collective over comm.

    tp*dp*pp must equal comm's size (dp defaults to size // (tp*pp)); pp is the number of
    pipeline stages; ep (dividing dp) the expert-parallel size (MoE experts split over ep
    consecutive DP ranks); cp the context-parallel size (each sequence split over cp ranks
    between tp and dp: world = tp*cp*dp*pp). device is 'cpu', 'cuda' or 'auto'.
    With abort_on_error (default), an uncaught exception on any rank aborts the whole MPI job
    after printing that rank's traceback. collective_timeout (seconds; default
    $CUTP_COLLECTIVE_TIMEOUT or 600, 0 = off) aborts the job when a collective stalls.
    device_id picks the GPU (default: the launcher's node-local rank modulo the visible GPUs).
    mesh (a `cutp.Mesh` of comm's size) replaces tp, dp, pp and ep.
    """
    return Context(comm=comm, tp=tp, dp=dp, device=device, abort_on_error=abort_on_error,
                   collective_timeout=collective_timeout, device_id=device_id, pp=pp, ep=ep, mesh=mesh, cp=cp)
