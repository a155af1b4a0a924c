"""tests/mpirun.py's pool of ranks: a launch finds the ranks as a launch of its own would, whatever
the launches before it did (patched the test modules, changed the environment or the working
directory, failed). The harness's failure and timeout messages: tests/comm/test_collectives.py."""
import os
import sys

import pytest
from mpi4py import MPI

from tests import mpirun
from tests.mpirun import POOLED, ROOT, MpiRunError, run_mpi

SETTING = "as imported"
HERE = "tests.test_mpirun"


def _change_the_process():
    os.environ["CUTP_TEST_LEFT_BEHIND"] = "1"
    os.chdir("/")


def _patch_a_module():
    global SETTING
    SETTING = "patched"


def _worker_sees_a_clean_rank(path, same_process):
    """Rank 0 writes its pid to `path` the first time; later, same_process says whether this
    launch must run in that process (the pool put it back) or in another (the pool was retired)."""
    assert SETTING == "as imported", SETTING
    assert "CUTP_TEST_LEFT_BEHIND" not in os.environ
    assert os.getcwd() == ROOT, os.getcwd()
    if MPI.COMM_WORLD.Get_rank() == 0:
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        elif POOLED:
            with open(path) as f:
                assert (int(f.read()) == os.getpid()) == same_process, same_process


def _worker_say_my_rank():
    sys.stdout.write(f"rank {MPI.COMM_WORLD.Get_rank()}\n")  # (one write: print's two can interleave)


def _worker_raise_on_rank1():
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")


def test_a_launch_sees_nothing_an_earlier_one_changed(tmp_path):
    pool = mpirun._POOLS.pop(2, None)
    if pool is not None:
        pool.stop()  # (a fresh pool: none of its launches before this test's)
    pid = str(tmp_path / "pid")
    run_mpi(2, f"{HERE}:_worker_sees_a_clean_rank", pid, True, timeout=60)
    run_mpi(2, f"{HERE}:_change_the_process", timeout=60)
    run_mpi(2, f"{HERE}:_worker_sees_a_clean_rank", pid, True, timeout=60)  # put back in the same process
    run_mpi(2, f"{HERE}:_patch_a_module", timeout=60)
    run_mpi(2, f"{HERE}:_worker_sees_a_clean_rank", pid, False, timeout=60)  # that pool retired


def test_a_failing_launch_names_its_rank_and_the_next_one_runs():
    with pytest.raises(MpiRunError, match=r"(?s)failed \(exit.*\[rank 1\] RuntimeError: deliberate failure on rank 1"):
        run_mpi(2, f"{HERE}:_worker_raise_on_rank1", timeout=60)
    res = run_mpi(2, f"{HERE}:_worker_say_my_rank", timeout=60)
    assert sorted(res.stdout.splitlines()) == ["rank 0", "rank 1"], res.stdout
