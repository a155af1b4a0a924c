"""Communicators, meshes, refusals and failure handling (the foundation issue's acceptance)."""
import sys
import time

import ml_dtypes
import numpy as np
import pytest

import cutp
from cutp.comm import CommCounter, CommError
from cutp.comm.context import check_gpu_assignment, validate_mesh
from tests.comm.test_context import _worker_a_new_dimension
from tests.mpirun import MpiRunError, SharedLaunch, run_mpi

DTYPES = [np.float32, np.float64, ml_dtypes.bfloat16, np.float16, np.int32, np.int64]


def _data(world_rank, group, dtype, shape=(4, 3)):
    """Deterministic small integers (exact in every dtype, bf16 included) per rank and group."""
    n = int(np.prod(shape))
    vals = (np.arange(n) * 3 + world_rank * 7 + len(group)) % 13 - 4
    return vals.reshape(shape).astype(dtype)


def _members(ctx, name):
    if name in ("tp", "dp"):
        return ctx.mesh.group(ctx.rank, name)
    return list(range(ctx.world_size))


def _check_group(ctx, comm, members):
    counter = ctx.counter
    me = members.index(ctx.rank)
    assert comm.rank == me and comm.size == len(members)
    for dtype in DTYPES:
        every = [_data(r, comm.name, dtype) for r in members]
        stacked = np.stack([e.astype(np.float64) for e in every])
        x = _data(ctx.rank, comm.name, dtype)
        nb = x.nbytes

        def counted(op, expect_bytes, fn):
            before = counter.bytes(comm.name, op), counter.calls(comm.name, op)
            res = fn()
            after = counter.bytes(comm.name, op), counter.calls(comm.name, op)
            assert after[0] - before[0] == expect_bytes, (op, dtype, after, before)
            assert after[1] - before[1] == 1
            return res

        # all_reduce: sum / max / avg, out of place and in place
        for op, ref in (("sum", stacked.sum(0)), ("max", stacked.max(0)), ("avg", None)):
            if op == "avg":
                s = stacked.sum(0)
                ref = np.trunc(s / len(members)) if np.dtype(dtype).kind == "i" else s / len(members)
            y = counted("all_reduce", nb, lambda: comm.all_reduce(x, op))
            assert y.dtype == x.dtype and y.shape == x.shape
            np.testing.assert_array_equal(y.astype(np.float64), ref.astype(dtype).astype(np.float64), err_msg=f"{op} {dtype}")
            z = x.copy()
            r = counted("all_reduce", nb, lambda: comm.all_reduce(z, op, out=z))
            assert r is z
            np.testing.assert_array_equal(z.astype(np.float64), ref.astype(dtype).astype(np.float64))
        np.testing.assert_array_equal(x, _data(ctx.rank, comm.name, dtype))  # input untouched

        # all_gather along axis 0, with and without out
        g = counted("all_gather", nb, lambda: comm.all_gather(x))
        np.testing.assert_array_equal(g, np.concatenate(every, 0))
        out = np.empty((x.shape[0] * len(members), 3), dtype)
        assert counted("all_gather", nb, lambda: comm.all_gather(x, out=out)) is out
        np.testing.assert_array_equal(out, np.concatenate(every, 0))

        # reduce_scatter: axis 0 split into size chunks; sum / max / avg, allocated and into out
        n = len(members)
        big = np.concatenate([_data(ctx.rank + k, comm.name, dtype) for k in range(n)], 0)
        big_before = big.copy()
        bigs = np.stack([np.concatenate([_data(r + k, comm.name, dtype) for k in range(n)], 0).astype(np.float64)
                         for r in members])
        for op in ("sum", "max", "avg"):
            if op == "max":
                red = bigs.max(0)
            else:
                red = bigs.sum(0)
                if op == "avg":  # integers: toward zero (the groups' data has negative sums not divisible by n)
                    red = np.trunc(red / n) if np.dtype(dtype).kind == "i" else red / n
            chunk = red.reshape(n, -1, 3)[me].astype(dtype).astype(np.float64)
            rs = counted("reduce_scatter", big.nbytes, lambda: comm.reduce_scatter(big, op))
            assert rs.dtype == big.dtype and rs.shape == x.shape, (op, dtype, rs.dtype, rs.shape)
            np.testing.assert_array_equal(rs.astype(np.float64), chunk, err_msg=f"reduce_scatter {op} {dtype}")
            out = np.full(x.shape, 99, dtype)  # stale contents must be overwritten, not accumulated into
            assert counted("reduce_scatter", big.nbytes, lambda: comm.reduce_scatter(big, op, out=out)) is out
            np.testing.assert_array_equal(out.astype(np.float64), chunk, err_msg=f"reduce_scatter {op} out= {dtype}")
        np.testing.assert_array_equal(big, big_before)  # input untouched

        # aliased buffers: NCCL's in-place layouts (x is this rank's slot of out for all_gather,
        # out is this rank's slot of x for reduce_scatter), a view of the same memory, and an overlap
        # that is neither; each gives the out-of-place result
        rows = x.shape[0]
        gathered = np.zeros((rows * n, 3), dtype)
        gathered[me * rows:(me + 1) * rows] = x
        assert comm.all_gather(gathered[me * rows:(me + 1) * rows], out=gathered) is gathered
        np.testing.assert_array_equal(gathered, np.concatenate(every, 0), err_msg=f"in-place all_gather {dtype}")
        shifted = np.zeros((rows * n + 1, 3), dtype)
        shifted[:rows] = x  # x overlaps out's first slot, shifted by one row
        np.testing.assert_array_equal(comm.all_gather(shifted[:rows], out=shifted[1:]), np.concatenate(every, 0))
        chunk = bigs.sum(0).reshape(n, -1, 3)[me].astype(dtype).astype(np.float64)
        scratch = big.copy()
        mine = scratch[me * rows:(me + 1) * rows]
        assert comm.reduce_scatter(scratch, "sum", out=mine) is mine
        np.testing.assert_array_equal(mine.astype(np.float64), chunk, err_msg=f"in-place reduce_scatter {dtype}")
        scratch = big.copy()
        first = scratch[:rows]  # out at another rank's slot than NCCL's in-place one (for me > 0)
        np.testing.assert_array_equal(comm.reduce_scatter(scratch, "sum", out=first).astype(np.float64), chunk)
        z = x.copy()
        np.testing.assert_array_equal(comm.all_reduce(z, "sum", out=z.reshape(z.shape)).astype(np.float64),
                                      stacked.sum(0).astype(dtype).astype(np.float64))

        # broadcast from the last rank of the group, in place
        b = x.copy()
        assert counted("broadcast", nb, lambda: comm.broadcast(b, root=len(members) - 1)) is b
        np.testing.assert_array_equal(b, every[-1])

        # send / recv around a ring (even ranks send first, so no deadlock on blocking sends)
        if len(members) > 1:
            nxt, prv = (me + 1) % len(members), (me - 1) % len(members)
            got = np.empty_like(x)
            if me % 2 == 0:
                counted("send", nb, lambda: comm.send(x, nxt))
                counted("recv", nb, lambda: comm.recv(got, prv))
            else:
                counted("recv", nb, lambda: comm.recv(got, prv))
                counted("send", nb, lambda: comm.send(x, nxt))
            np.testing.assert_array_equal(got, every[prv])
        comm.barrier()

    # errors before any communication
    with pytest.raises(CommError, match="C-contiguous"):
        comm.all_reduce(np.ones((4, 4))[:, ::2])
    with pytest.raises(CommError, match="dtype"):
        comm.all_reduce(np.ones(3, np.int8))
    with pytest.raises(CommError, match="reduce op"):
        comm.all_reduce(np.ones(3), "prod")
    with pytest.raises(CommError, match="out has shape"):
        comm.all_reduce(np.ones(3), out=np.ones(4))
    n = comm.size
    with pytest.raises(CommError, match=rf"all_gather.*out has shape \({2 * n + 1}, 3\).*expected \({2 * n}, 3\)"):
        comm.all_gather(np.ones((2, 3)), out=np.ones((2 * n + 1, 3)))
    wrong_dtype = rf"out has shape \({n}, 3\) and dtype float32; expected \({n}, 3\) and float64"
    with pytest.raises(CommError, match=wrong_dtype):
        comm.all_gather(np.ones((1, 3)), out=np.ones((n, 3), np.float32))
    with pytest.raises(CommError, match=r"reduce_scatter.*out has shape \(3, 3\).*expected \(2, 3\)"):
        comm.reduce_scatter(np.ones((2 * n, 3)), "max", out=np.ones((3, 3)))
    with pytest.raises(CommError, match=r"out is not C-contiguous"):
        comm.reduce_scatter(np.ones((2 * n, 3)), out=np.ones((3, 2)).T)
    with pytest.raises(CommError, match="reduce op"):
        comm.reduce_scatter(np.ones((n, 3)), "min")
    if n > 1:
        with pytest.raises(CommError, match=rf"needs axis 0 divisible by {n}; got shape \({n + 1}, 3\)"):
            comm.reduce_scatter(np.ones((n + 1, 3)))


def _worker_collectives(meshes):
    for tp, dp in meshes:
        ctx = cutp.init(tp=tp, dp=dp, device="cpu")
        assert (ctx.tp_size, ctx.dp_size) == (tp, dp)
        assert ctx.tp_rank == ctx.rank % tp and ctx.dp_rank == ctx.rank // tp
        assert ctx.tp.size == tp and ctx.dp.size == dp and ctx.world.size == tp * dp
        for name, comm in (("tp", ctx.tp), ("dp", ctx.dp), ("world", ctx.world)):
            _check_group(ctx, comm, _members(ctx, name))
        ctx.close()


def test_collectives_meshes_2x2_4x1_1x4():
    FOUR_RANKS.check("collectives")


def _worker_eight_ranks():
    """One 8-rank job: the collectives on a 2 x 4 mesh, then a mesh dimension between tp and dp
    (tests/comm/test_context.py)."""
    _worker_collectives([[2, 4]])
    _worker_a_new_dimension()


def test_collectives_mesh_2x4_and_a_new_dimension_on_8_ranks():
    run_mpi(8, "tests.comm.test_collectives:_worker_eight_ranks", timeout=180)


def test_collectives_single_rank():
    _worker_collectives([[1, 1]])


def test_counter_recording_and_summary():
    c = CommCounter()
    x = np.ones((2, 3), np.float32)
    with c.recording() as ev:
        c.record("tp", "all_reduce", x)
    c.record("tp", "all_reduce", x)
    assert len(ev) == 1 and ev[0].numel == 6 and ev[0].nbytes == 24 and ev[0].shape == (2, 3)
    assert c.calls("tp", "all_reduce") == 2 and c.bytes() == 48 and c.elements(op="all_reduce") == 12
    assert c.summary() == {"tp.all_reduce": {"calls": 2, "elements": 12, "bytes": 48}}


# ---- refusals --------------------------------------------------------------------------------
def test_mesh_validation_messages():
    with pytest.raises(cutp.ConfigError, match=r"tp\*dp = 2\*2 = 4 but the communicator has 8 ranks"):
        validate_mesh(8, 2, 2)
    with pytest.raises(cutp.ConfigError, match="tp must be an integer >= 1"):
        validate_mesh(4, 0, None)
    with pytest.raises(cutp.ConfigError, match="tp must be an integer >= 1"):
        validate_mesh(4, -2, 2)
    with pytest.raises(cutp.ConfigError, match=r"tp=3 does not divide the world size 4.*\[1, 2, 4\]"):
        validate_mesh(4, 3, None)
    with pytest.raises(cutp.ConfigError, match="dp must be an integer"):
        validate_mesh(4, 2, 0)
    assert validate_mesh(8, 2, None) == cutp.Mesh(2, 4)


def test_init_refuses_bad_mesh_in_process():
    with pytest.raises(cutp.ConfigError, match=r"tp\*dp"):
        cutp.init(tp=2, dp=1, device="cpu")
    with pytest.raises(cutp.ConfigError, match="tp must be"):
        cutp.init(tp=0, device="cpu")


def test_cuda_requested_without_gpu(monkeypatch):
    import cutp.runtime.backend as backend

    monkeypatch.setattr(backend, "cuda_device_count", lambda: 0)
    with pytest.raises(cutp.BackendError, match="device='cuda' was requested but no GPU is usable.*device='cpu'"):
        cutp.init(device="cuda")
    with pytest.raises(cutp.BackendError, match="device='tpu' is not one of"):
        cutp.init(device="tpu")
    # auto falls back to the CPU
    ctx = cutp.init(device="auto")
    assert ctx.device == "cpu" and ctx.xp is np
    ctx.close()


def test_cuda_refused_on_this_machine_for_real():
    """No monkeypatching: this CPU-only machine (no GPU, maybe no cupy) refuses device='cuda'."""
    if cutp.runtime.backend.cuda_device_count() > 0:
        pytest.skip("a GPU is visible here; the refusal is covered by test_cuda_requested_without_gpu")
    with pytest.raises(cutp.BackendError, match="no GPU is usable"):
        cutp.init(device="cuda")


def test_gpu_assignment_check(monkeypatch):
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    check_gpu_assignment(["0:1", "0:2", "0:3", "0:4"], 4)
    # each rank given its own GPU (CUDA_VISIBLE_DEVICES per rank): one visible, all different
    check_gpu_assignment(["0:1", "0:2", "0:3", "0:4"], 1)
    with pytest.raises(cutp.ConfigError, match=r"8 ranks run on this node but they see 4 GPU\(s\) \(node-local ranks "
                                               r"\[0, 4\] would share GPU 0:0\).*at most 4 ranks per node"):
        check_gpu_assignment([f"0:{r % 4}" for r in range(8)], 4)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    check_gpu_assignment(["0:0", "0:0"], 1)


def _worker_nccl_more_ranks_than_gpus(bus_ids):
    import cutp.runtime.backend as backend

    backend.cuda_device_count = lambda: 1  # simulate a node where each rank sees one GPU...
    me = __import__("mpi4py.MPI", fromlist=["MPI"]).COMM_WORLD.rank
    backend.cuda_pci_bus_id = lambda i: bus_ids[me]  # ...the same one, or its own
    try:
        cutp.init(tp=2, device="cuda")
    except cutp.ConfigError as e:
        assert bus_ids[0] == bus_ids[1], f"refused although the ranks have their own GPUs: {e}"
        assert "2 ranks run on this node but they see 1 GPU(s)" in str(e), e
        assert "cupy" not in sys.modules, "refused only after touching CUDA"
    except Exception as e:  # accepted: it went on to CUDA itself, which this machine does not have
        assert bus_ids[0] != bus_ids[1], f"not refused with a shared GPU: {e!r}"
        assert "cupy" in str(e) or "CUDA" in str(e) or isinstance(e, ImportError), repr(e)
    else:
        raise AssertionError("init went through without CUDA")


def test_nccl_refused_when_ranks_would_share_a_gpu():
    run_mpi(2, "tests.comm.test_collectives:_worker_nccl_more_ranks_than_gpus", ["0000:01:00.0", "0000:01:00.0"], timeout=60,
            env={"NCCL_MULTI_RANK_GPU_ENABLE": "0"})


def test_one_gpu_per_rank_by_visibility_is_accepted():
    run_mpi(2, "tests.comm.test_collectives:_worker_nccl_more_ranks_than_gpus", ["0000:01:00.0", "0000:02:00.0"], timeout=60,
            env={"NCCL_MULTI_RANK_GPU_ENABLE": "0"})


def _worker_mesh_refused_on_every_rank():
    try:
        cutp.init(tp=3, device="cpu")
    except cutp.ConfigError as e:
        assert "tp=3 does not divide the world size 4" in str(e)
    else:
        raise AssertionError("not refused")
    # nothing was left half-initialised: a valid init still works on the same ranks
    ctx = cutp.init(tp=2, device="cpu")
    assert ctx.tp.all_reduce(np.ones(2))[0] == 2
    ctx.close()


def test_mesh_refused_on_every_rank():
    FOUR_RANKS.check("mesh_refused_on_every_rank")


# ---- failure handling --------------------------------------------------------------------------
def _worker_raise_on_rank1():
    ctx = cutp.init(tp=2, device="cpu")
    if ctx.rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    ctx.world.all_reduce(np.ones(4))  # the other ranks wait here for rank 1, forever without Abort
    time.sleep(60)


def test_exception_on_one_rank_ends_the_job():
    t0 = time.monotonic()
    res = run_mpi(4, "tests.comm.test_collectives:_worker_raise_on_rank1", timeout=30, expect_failure=True)
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"the job took {elapsed:.1f} s to end"
    assert "[rank 1] RuntimeError: deliberate failure on rank 1" in res.stdout
    assert "[rank 1] Traceback (most recent call last):" in res.stdout


def _worker_rank2_hangs():
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 2:
        time.sleep(120)


def test_harness_names_ranks_that_time_out():
    with pytest.raises(MpiRunError, match=r"timed out after 5 s; ranks that did not finish: \[2\]"):
        run_mpi(4, "tests.comm.test_collectives:_worker_rank2_hangs", timeout=5)


def _worker_assertion_fails():
    from mpi4py import MPI

    assert MPI.COMM_WORLD.Get_rank() != 0, "rank 0 disagrees"


def test_harness_reports_failing_rank():
    with pytest.raises(MpiRunError, match=r"(?s)failed \(exit.*\[rank 0\] AssertionError: rank 0 disagrees"):
        run_mpi(2, "tests.comm.test_collectives:_worker_assertion_fails", timeout=30)


# ---- two contexts in one process, on a host code's own communicator ------------------------
def _worker_two_contexts():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    half = world.Split(color=world.rank // 2, key=world.rank)
    a = cutp.init(comm=half, tp=2, device="cpu")
    b = cutp.init(comm=world, tp=2, dp=2, device="cpu")
    assert a.world_size == 2 and b.world_size == 4
    ya = a.tp.all_reduce(np.full(3, float(world.rank)))
    yb = b.world.all_reduce(np.full(3, float(world.rank)))
    base = (world.rank // 2) * 2
    assert ya[0] == base + base + 1 and yb[0] == 6
    assert a.counter.calls() == 1 and b.counter.calls() == 1  # separate counters, no shared state
    a.close()
    b.close()
    half.Free()


def test_two_contexts_coexist():
    FOUR_RANKS.check("two_contexts")


def test_embed_example_runs_two_independent_contexts_at_4_ranks():
    import os
    import subprocess

    from tests.mpirun import ROOT, find_mpiexec

    out = subprocess.run([find_mpiexec(), "-n", "4", sys.executable, os.path.join(ROOT, "examples", "embed.py")],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 4 and all("matches TP=1: True" in ln for ln in lines), out.stdout
    assert "transformer block, TP=2" in lines[0] and "MLP, TP=2" in lines[3]
    # the two halves ran different layers on different data
    assert lines[0].split("|y|_1 = ")[1] != lines[3].split("|y|_1 = ")[1]


# The passing 4-rank tests above in one launch (the ranks' start-up is most of each one's time);
# each test checks its case.
FOUR_RANKS = SharedLaunch(4, {
    "collectives": ("tests.comm.test_collectives:_worker_collectives", [[[2, 2], [4, 1], [1, 4]]]),
    "mesh_refused_on_every_rank": ("tests.comm.test_collectives:_worker_mesh_refused_on_every_rank", []),
    "two_contexts": ("tests.comm.test_collectives:_worker_two_contexts", []),
}, timeout=240)
