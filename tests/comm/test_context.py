"""The Context's groups come from its mesh's named dimensions (`Context.GROUPS`)."""
import numpy as np
import pytest
from mpi4py import MPI

import cutp
from cutp.comm.context import Context
from cutp.runtime.mesh import Mesh
from tests.mpirun import run_mpi


def _members(comm):
    """The world ranks of a counted communicator, in its rank order."""
    return [int(r) for r in comm.all_gather(np.array([MPI.COMM_WORLD.Get_rank()]))]


def _worker_groups_match_the_mesh(tp, dp, pp, ep):
    ctx = cutp.init(tp=tp, dp=dp, pp=pp, ep=ep, device="cpu")
    mesh = ctx.mesh
    assert (ctx.tp_size, ctx.dp_size, ctx.pp_size, ctx.ep_size) == (tp, dp, pp, ep)
    c = mesh.coords(ctx.rank)
    assert (ctx.tp_rank, ctx.dp_rank, ctx.pp_rank, ctx.ep_rank) == (c["tp"], c["dp"], c["pp"], c["ep"])
    assert ctx.rank == (ctx.pp_rank * dp + ctx.dp_rank) * tp + ctx.tp_rank
    for name in ("tp", "dp", "pp"):
        assert _members(getattr(ctx, name)) == mesh.group(ctx.rank, name), name
    if ep > 1:
        assert _members(ctx.ep) == mesh.group(ctx.rank, "ep")
        assert _members(ctx.expert_dp) == mesh.group(ctx.rank, "expert_dp")
    else:
        assert ctx.ep is None and ctx.expert_dp is ctx.dp
    assert _members(ctx.world) == list(range(ctx.world_size))
    if pp > 1 and ctx.pp_rank in (0, pp - 1):
        assert _members(ctx.embedding) == [mesh.group(ctx.rank, "pp")[0], mesh.group(ctx.rank, "pp")[-1]]
    else:
        assert ctx.embedding is None
    ctx.close()


def test_groups_of_tp2_dp2_and_pp2_dp1_ep2_on_4_ranks():
    run_mpi(4, "tests.comm.test_context:_worker_groups_match_the_mesh", 2, 2, 1, 2, timeout=120)
    run_mpi(4, "tests.comm.test_context:_worker_groups_match_the_mesh", 1, 2, 2, 1, timeout=120)


class _ContextWithCP(Context):
    """A context-parallel group is one more entry in the list; nothing else of Context changes."""

    GROUPS = Context.GROUPS + (("cp", ("cp",)),)


def _worker_a_new_dimension():
    mesh = Mesh(dims=(("tp", 2), ("cp", 2), ("dp", 2), ("pp", 1)))
    ctx = _ContextWithCP(mesh=mesh, device="cpu")
    assert (ctx.cp_size, ctx.tp_size, ctx.dp_size) == (2, 2, 2)
    assert ctx.cp_rank == (ctx.rank // 2) % 2 and ctx.dp_rank == ctx.rank // 4
    assert _members(ctx.cp) == [ctx.rank - 2 * ctx.cp_rank + 2 * i for i in range(2)]
    assert _members(ctx.dp) == [ctx.rank % 4, ctx.rank % 4 + 4]
    assert _members(ctx.tp) == [ctx.rank - ctx.tp_rank, ctx.rank - ctx.tp_rank + 1]
    # the sum over the CP group is the sum over its members
    assert ctx.cp.all_reduce(np.array([float(ctx.rank)]))[0] == sum(_members(ctx.cp))
    ctx.close()


# (_worker_a_new_dimension runs in the 8-rank launch of
# tests/comm/test_collectives.py::test_collectives_mesh_2x4_and_a_new_dimension_on_8_ranks)


def test_a_mesh_of_another_size_than_the_communicator_is_refused():
    with pytest.raises(cutp.ConfigError, match=r"^Mesh\(tp=2, dp=1, pp=1\) has 2 ranks but the communicator has 1; "
                                               r"start 2 ranks \(mpirun -np 2\)$"):
        cutp.init(mesh=Mesh(2, 1), device="cpu")
    ctx = cutp.init(mesh=Mesh(dims=(("tp", 1), ("cp", 1), ("dp", 1))), device="cpu")
    assert ctx.pp_size == 1 and ctx.pp_rank == 0 and ctx.pp.size == 1  # a dimension the mesh lacks: size 1
    ctx.close()


def test_a_simulated_link_wraps_every_group_once_inside_the_counting():
    from cutp.comm.simulated import SimulatedLinkCommunicator

    ctx = cutp.init(comm=MPI.COMM_SELF, tp=1, device="cpu")
    try:
        gqa = ctx.subgroup("gqa", 0, 0, expect=(0, 1))
        with pytest.raises(ValueError, match=r"group gqa: rank 0 of 1, expected \(0, 2\)"):
            ctx.subgroup("gqa", 0, 0, expect=(0, 2))
        ctx.simulate_link(100.0, 5.0)
        groups = [ctx.world, gqa] + [getattr(ctx, name) for name, _ in Context.GROUPS]
        for group in (g for g in groups if g is not None):
            assert isinstance(group.inner, SimulatedLinkCommunicator) and group.inner.link is ctx.link
            assert not isinstance(group.inner.inner, SimulatedLinkCommunicator)  # (shared groups: wrapped once)
        x = np.arange(4.0)
        np.testing.assert_array_equal(ctx.world.all_reduce(x, "sum"), x)  # one rank: nothing sent
        assert repr(ctx) == f"<cutp.Context {ctx.describe()}>" and "mesh tp=1" in repr(ctx)
    finally:
        ctx.close()
    ctx.close()  # a second close does nothing
    assert ctx.closed
    with cutp.init(comm=MPI.COMM_SELF, tp=1, device="cpu") as ctx:  # a with block closes it
        assert not ctx.closed
    assert ctx.closed
