"""The mesh of named dimensions: ranks, groups and communicator splits from one ordered list."""
import itertools

import pytest

from cutp.runtime.errors import ConfigError
from cutp.runtime.mesh import Mesh, derive_mesh, validate_mesh


def _layout_before_named_dims(rank, tp, dp, ep):
    """The arithmetic cutp hand-coded before: r = (pp_rank * dp + dp_rank) * tp + tp_rank."""
    return {"tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp), "ep": (rank // tp) % dp % ep,
            "expert_dp": (rank // tp) % dp // ep}


@pytest.mark.parametrize("tp,dp,pp,ep", [(1, 1, 1, 1), (2, 2, 2, 1), (1, 4, 2, 2), (2, 4, 1, 4), (4, 1, 2, 1),
                                         (2, 6, 2, 3)])
def test_coordinates_keep_the_order_tp_fastest_then_dp_then_pp(tp, dp, pp, ep):
    mesh = Mesh(tp, dp, pp, ep)
    assert mesh.size == tp * dp * pp and (mesh.tp, mesh.dp, mesh.pp, mesh.ep) == (tp, dp, pp, ep)
    for rank in range(mesh.size):
        c = mesh.coords(rank)
        assert c == _layout_before_named_dims(rank, tp, dp, ep), rank
        assert mesh.rank_at(tp=c["tp"], dp=c["dp"], pp=c["pp"]) == rank == mesh.rank_of(c["tp"], c["dp"], c["pp"])


def test_groups_hold_the_ranks_that_differ_only_in_their_dimensions():
    mesh = Mesh(2, 4, 2, ep=2)  # 16 ranks
    assert mesh.group(0, "tp") == [0, 1] and mesh.group(13, "tp") == [12, 13]
    assert mesh.group(5, "dp") == [1, 3, 5, 7] and mesh.group(9, "dp") == [9, 11, 13, 15]
    assert mesh.group(3, "pp") == [3, 11]
    # EP groups: ep consecutive DP ranks; expert-DP: the DP ranks of equal ep_rank
    assert mesh.group(5, "ep") == [5, 7] and mesh.group(1, "ep") == [1, 3]
    assert mesh.group(5, "expert_dp") == [1, 5] and mesh.group(7, "expert_dp") == [3, 7]
    assert mesh.group(6, "tp", "dp") == list(range(8))
    assert mesh.group(6, "tp", "dp", "pp") == list(range(16))


@pytest.mark.parametrize("dims", [("tp",), ("dp",), ("pp",), ("ep",), ("expert_dp",), ("tp", "pp"), ("dp", "pp")])
def test_a_split_puts_each_rank_into_its_group_at_its_place(dims):
    """The (colour, key) of Comm.Split: equal colours exactly for the members of one group, and
    the key is the member's place in it."""
    mesh = Mesh(2, 4, 2, ep=2)
    for rank in range(mesh.size):
        group = mesh.group(rank, *dims)
        colour, key = mesh.split(rank, *dims)
        assert group[key] == rank
        assert [r for r in range(mesh.size) if mesh.split(r, *dims)[0] == colour] == group


def test_a_new_dimension_is_one_entry_in_the_list():
    """Context parallelism between tp and dp (size 2 on 8 ranks): groups, coordinates and
    splits follow from the list alone, and the other dimensions move out by its size."""
    mesh = Mesh(dims=(("tp", 2), ("cp", 2), ("dp", 2), ("pp", 1)))
    assert mesh.size == 8 and mesh.cp == 2
    assert [mesh.group(r, "cp") for r in (0, 1, 4, 5)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group(1, "dp") == [1, 5] and mesh.group(6, "tp") == [6, 7]
    assert mesh.group(0, "cp", "dp") == [0, 2, 4, 6]
    assert mesh.coords(7) == {"tp": 1, "cp": 1, "dp": 1, "ep": 0, "expert_dp": 1, "pp": 0}
    for rank, dims in itertools.product(range(8), [("cp",), ("tp", "cp"), ("dp",)]):
        colour, key = mesh.split(rank, *dims)
        assert mesh.group(rank, *dims)[key] == rank
        assert [r for r in range(8) if mesh.split(r, *dims)[0] == colour] == mesh.group(rank, *dims)


def test_with_context_parallelism_each_cp_rank_has_its_own_ep_groups_and_experts_reduce_over_expert_dp_x_cp():
    """MoE with cp: the all-to-all stays inside ranks of one cp_rank; an expert's replicas are
    the expert-DP ranks of every cp_rank. The Context's expert_dp_cp group is split only when
    both cp and ep are > 1 (else it is expert_dp, or dp_cp)."""
    from cutp.comm.shape_only import ShapeOnlyContext

    mesh = Mesh(1, 4, 1, ep=2, cp=2)  # ranks: cp fastest, then ep, then expert_dp
    for rank in range(mesh.size):
        c = mesh.coords(rank)
        assert {mesh.coords(r)["cp"] for r in mesh.group(rank, "ep")} == {c["cp"]}
        replicas = mesh.group(rank, "cp", "expert_dp")
        assert len(replicas) == 4 and {mesh.coords(r)["ep"] for r in replicas} == {c["ep"]}
    assert mesh.group(1, "ep") == [1, 3] and mesh.group(1, "cp", "expert_dp") == [0, 1, 4, 5]
    ctx = ShapeOnlyContext(dp=4, ep=2, cp=2, rank=5)
    assert (ctx.expert_dp_cp.size, ctx.expert_dp_cp.rank, ctx.expert_dp_cp_size) == (4, 3, 4)
    one = ShapeOnlyContext(dp=4, ep=2)
    assert one.expert_dp_cp is one.expert_dp
    dense = ShapeOnlyContext(dp=2, cp=2)
    assert dense.expert_dp_cp is dense.dp_cp


def test_meshes_compare_by_their_dimensions():
    assert Mesh(2, 4) == Mesh(dims=(("tp", 2), ("dp", 4), ("pp", 1))) == validate_mesh(8, 2, None)
    assert Mesh(2, 4) != Mesh(2, 4, ep=2) and Mesh(2, 4) != Mesh(4, 2)
    assert repr(Mesh(2, 4, 1, 2)) == "Mesh(tp=2, dp=4, pp=1, ep=2)"


# ---- sizes derived from the ones given ---------------------------------------------------------
def _pick_largest(n):  # the machine's choice when neither tp nor dp is given
    return n


@pytest.mark.parametrize("world,given,expect", [
    (4, {}, (4, 1, 1, 1)),
    (4, {"tp": 2}, (2, 2, 1, 1)),
    (4, {"dp": 4}, (1, 4, 1, 1)),  # refused before: tp chosen 4, then tp*dp = 16
    (4, {"dp": 2}, (2, 2, 1, 1)),
    (4, {"pp": 2}, (2, 1, 2, 1)),
    (4, {"pp": 2, "dp": 2}, (1, 2, 2, 1)),  # refused before
    (4, {"pp": 2, "tp": 1}, (1, 2, 2, 1)),
    (4, {"tp": 2, "dp": 2}, (2, 2, 1, 1)),
    (4, {"ep": 2}, (2, 2, 1, 2)),  # tp leaves dp a multiple of ep
    (4, {"dp": 2, "ep": 2}, (2, 2, 1, 2)),
    (4, {"tp": 1, "ep": 4}, (1, 4, 1, 4)),
    (4, {"ep": 2, "pp": 2}, (1, 2, 2, 2)),
    (8, {"pp": 2, "ep": 2}, (2, 2, 2, 2)),
    (8, {"tp": 2, "dp": 2, "pp": 2, "ep": 2}, (2, 2, 2, 2)),
    (8, {"dp": 4, "ep": 2}, (2, 4, 1, 2)),
    (8, {"tp": 2, "pp": 2, "ep": 1}, (2, 2, 2, 1)),
])
def test_the_sizes_not_given_are_derived_from_those_given(world, given, expect):
    mesh = derive_mesh(world, pick_tp=_pick_largest, **given)
    assert (mesh.tp, mesh.dp, mesh.pp, mesh.ep) == expect


def test_every_combination_of_given_and_omitted_sizes_gives_a_mesh_of_the_world_or_a_working_fix():
    """All 16 combinations of given/omitted tp, dp, pp, ep, over values 1, 2, 4 on 4 and 8
    ranks: the result has the given sizes and the world's size, or the refusal's first
    proposed fix (changing only one given size, or omitting one) gives such a mesh."""
    for world in (4, 8):
        for values in itertools.product((None, 1, 2, 4), repeat=4):
            given = dict(zip(("tp", "dp", "pp", "ep"), values))
            try:
                mesh = derive_mesh(world, pick_tp=_pick_largest, **given)
            except ConfigError as e:
                assert str(e) and "\n" not in str(e)
                continue
            assert mesh.size == world and mesh.dp % mesh.ep == 0, (world, given)
            for name, v in given.items():
                assert v is None or getattr(mesh, name) == v, (world, given, mesh)


@pytest.mark.parametrize("world,given,message,fixed", [
    (4, {"tp": 4, "dp": 4}, "tp*dp = 4*4 = 16 but the communicator has 4 ranks; start 16 ranks (mpirun -np 16); "
                            "omit dp (it would be 1); omit tp (it would be 1)", [{"dp": None}, {"tp": None}]),
    (4, {"tp": 2, "dp": 1, "pp": 1, "ep": 2}, "tp*dp = 2*1 = 2 but the communicator has 4 ranks; omit dp (it would "
                                              "be 2)", [{"dp": None}]),
    (4, {"tp": 3}, "tp=3 does not divide the world size 4, so dp cannot be derived; use a tp from [1, 2, 4] or "
                   "start a multiple of 3 ranks", [{"tp": 1}, {"tp": 2}, {"tp": 4}]),
    (4, {"tp": 2, "ep": 4}, "ep=4 does not divide dp=2: the expert-parallel groups are carved from the DP group; "
                            "use an ep from [1, 2], or a tp from [1] (dp = 4 / tp)", [{"ep": 1}, {"ep": 2}, {"tp": 1}]),
    (4, {"dp": 3}, "dp=3 does not divide the world size 4, so tp cannot be derived; use a dp from [1, 2, 4]",
     [{"dp": 1}, {"dp": 2}, {"dp": 4}]),
    (4, {"pp": 3}, "pp 3 does not divide the 4 ranks; use a pp from [1, 2, 4]", [{"pp": 1}, {"pp": 2}, {"pp": 4}]),
    (8, {"dp": 2, "ep": 4}, "ep=4 does not divide dp=2", [{"ep": 1}, {"ep": 2}]),
])
def test_a_refusal_names_the_numbers_and_its_fixes_work(world, given, message, fixed):
    with pytest.raises(ConfigError) as e:
        derive_mesh(world, pick_tp=_pick_largest, **given)
    assert str(e.value).startswith(message), str(e.value)
    for change in fixed:
        mesh = derive_mesh(world, pick_tp=_pick_largest, **{**given, **change})
        assert mesh.size == world


def test_a_refusal_names_settings_in_the_callers_terms():
    with pytest.raises(ConfigError) as e:
        derive_mesh(4, tp=4, dp=4)
    flags = e.value.render(lambda name: "--" + name.replace("_", "-"))
    assert "omit --dp (it would be 1); omit --tp (it would be 1)" in flags and "omit dp" in str(e.value)


def test_a_mesh_refuses_what_it_cannot_be_and_hashes_by_its_dimensions():
    with pytest.raises(ValueError, match=r"mesh dimensions named twice: \['tp', 'tp'\]"):
        Mesh(dims=(("tp", 2), ("tp", 2)))
    with pytest.raises(ValueError, match="ep=3 does not divide dp=4"):
        Mesh(dp=4, ep=3)
    mesh = Mesh(tp=2, dp=2)
    with pytest.raises(AttributeError, match=r"this mesh has no dimension .cp. \(it has tp, dp, ep, expert_dp, pp\)"):
        mesh.cp
    with pytest.raises(ValueError, match="rank 4 is outside a mesh of 4 ranks"):
        mesh.coords(4)
    assert {Mesh(tp=2, dp=2): "a"}[mesh] == "a" and hash(mesh) != hash(Mesh(tp=4))
    with pytest.raises(ValueError, match=r"pick_tp\(8\) returned 3, which does not divide 8"):
        derive_mesh(8, pick_tp=lambda n: 3)
