"""NCCL communicator: bootstrap on the CPU (MPI only, fake NCCL), real collectives on a GPU."""
import os

import numpy as np
import pytest

from cutp.runtime import backend
from cutp.comm import CommError
from tests.mpirun import run_mpi

HAVE_GPU = backend.cuda_device_count() > 0
gpu_only = pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU with CuPy and NCCL; the bootstrap "
                              "is covered on the CPU by the fake-NCCL tests in this file")


class _FakeNccl:
    """Stands in for cupy.cuda.nccl: records the communicator construction."""

    def __init__(self, fail=False):
        self.fail = fail
        self.made = []

    def get_unique_id(self):
        if self.fail:
            raise RuntimeError("ncclGetUniqueId: unhandled system error (simulated)")
        return bytes(range(128))

    def NcclCommunicator(self, n, uid, rank):
        self.made.append((n, uid, rank))
        return ("comm", n, rank)


def _worker_bootstrap(fail_on_root):
    from mpi4py import MPI

    from cutp.comm.nccl import NcclCommunicator

    world = MPI.COMM_WORLD
    sub = world.Split(color=world.rank % 2, key=world.rank)  # two groups, each with its own id
    fake = _FakeNccl(fail=fail_on_root and sub.rank == 0)
    try:
        c = NcclCommunicator(sub, "tp", nccl_module=fake)
    except CommError as e:
        assert fail_on_root, e
        assert "making the NCCL unique id failed on the group's first rank" in str(e)
        assert "unhandled system error (simulated)" in str(e)
        return
    assert not fail_on_root, "a failing unique id must raise on every rank"
    assert fake.made == [(sub.size, bytes(range(128)), sub.rank)]
    assert c.rank == sub.rank and c.size == sub.size and c.kind == "nccl"
    with pytest.raises(CommError, match="takes CuPy arrays"):
        c.all_reduce(np.ones(3))


def test_nccl_bootstrap_broadcasts_the_unique_id():
    run_mpi(4, "tests.comm.test_nccl:_worker_bootstrap", False, timeout=60)


def test_nccl_bootstrap_failure_reaches_every_rank():
    # Without the error sentinel the non-root ranks would hang in the broadcast (timeout).
    run_mpi(4, "tests.comm.test_nccl:_worker_bootstrap", True, timeout=30)


def test_nccl_dtype_and_op_maps_match_nccl_enums():
    from cutp.comm import nccl as ours

    assert ours._NCCL_DTYPES == {"int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
    assert ours._NCCL_OPS == {"sum": 0, "max": 2, "avg": 4}
    try:
        from cupy.cuda import nccl
    except Exception:
        return  # the enum values above are NCCL's documented ones; checked against CuPy where present
    if nccl.available:
        assert nccl.NCCL_FLOAT32 == 7 and nccl.NCCL_BFLOAT16 == 9 and nccl.NCCL_INT64 == 4
        assert nccl.NCCL_AVG == 4 and nccl.NCCL_MAX == 2


def _worker_nccl_collectives():
    import ml_dtypes

    import cupy
    import cutp

    ctx = cutp.init(tp=2, device="cuda")
    for dt in (np.float32, np.float64, ml_dtypes.bfloat16, np.float16, np.int32, np.int64):
        x = cupy.asarray((np.arange(6) + ctx.rank).astype(dt))
        y = ctx.tp.all_reduce(x)
        np.testing.assert_array_equal(cupy.asnumpy(y).astype(np.float64), (2 * np.arange(6) + 1).astype(np.float64))
        g = ctx.tp.all_gather(x)
        assert g.shape == (12,)
        rs = ctx.tp.reduce_scatter(cupy.asarray(np.arange(4).astype(dt)))
        np.testing.assert_array_equal(cupy.asnumpy(rs).astype(np.float64), 2 * np.arange(4)[2 * ctx.rank: 2 * ctx.rank + 2])
    ctx.close()


@gpu_only
def test_nccl_collectives_two_ranks_on_gpu():
    from cupy.cuda import nccl

    n_gpus = backend.cuda_device_count()
    if n_gpus < 2 and nccl.get_version() < 23000:
        pytest.skip(f"one GPU and NCCL {backend.nccl_version_string()} < 2.30: two ranks cannot share a GPU")
    run_mpi(2, "tests.comm.test_nccl:_worker_nccl_collectives", timeout=120,
            env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if n_gpus < 2 else None)
