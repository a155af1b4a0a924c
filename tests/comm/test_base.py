"""The communicators' shared parts on one rank, in this process: the package's lazy names, the
interface's defaults (close, repr, a wrapper's pass-through start), the all-to-all counts'
refusal, MPI's exchange request and outputs it allocates, the rank-ordered max, and NCCL's set-up
refusals (no libnccl, a unique id of the wrong size, a second close) without a GPU."""
import re
import sys
import types

import numpy as np
import pytest
from mpi4py import MPI

import cutp.comm
from cutp.comm import mpi as comm_mpi, nccl as comm_nccl
from cutp.comm.base import CommError, Communicator, WrappedCommunicator


def test_the_lazy_names_load_their_modules():
    assert cutp.comm.MpiCommunicator is comm_mpi.MpiCommunicator
    assert cutp.comm.NcclCommunicator is comm_nccl.NcclCommunicator
    with pytest.raises(AttributeError, match="module 'cutp.comm' has no attribute 'Nccl'"):
        cutp.comm.Nccl


class _PassThrough(WrappedCommunicator):
    """A wrapper that adds nothing: the defaults of WrappedCommunicator."""


def test_the_interfaces_defaults():
    base = Communicator(1, 2, "dp")
    assert base.close() is None and repr(base) == "<Communicator dp rank 1/2>"
    mpi = comm_mpi.MpiCommunicator(MPI.COMM_SELF.Dup(), "tp")
    wrapped = _PassThrough(mpi)
    x = np.arange(4.0)
    assert np.array_equal(wrapped.start_all_reduce(x, "sum").wait(), x)  # the inner request, as it is
    assert wrapped.kind == mpi.kind  # anything else: the inner communicator's
    bare = object.__new__(_PassThrough)  # (before __init__, or while unpickling: no recursion)
    with pytest.raises(AttributeError, match="inner"):
        bare.inner
    wrapped.close()


@pytest.mark.parametrize("send,recv", [([1, 2], [3]), ([3], [-1]), ([4, 0], [2, 2])])
def test_all_to_all_refuses_counts_that_do_not_fit_the_group(send, recv):
    comm = comm_mpi.MpiCommunicator(MPI.COMM_SELF.Dup(), "ep")
    try:
        with pytest.raises(CommError, match=re.escape(f"all_to_all on ep: send_counts {send} and recv_counts {recv} "
                                                      "must be 1 counts >= 0 each")):
            comm.all_to_all(np.zeros((3, 2)), send, recv)
    finally:
        comm.close()


def test_mpi_requests_on_one_rank():
    comm = comm_mpi.MpiCommunicator(MPI.COMM_SELF.Dup(), "pp")
    try:
        x = np.arange(6.0).reshape(2, 3)
        got = np.zeros_like(x)
        request = comm.start_exchange([(x, 0, 7)], [(got, 0, 7)])
        while not request.test():
            pass
        assert request.wait()[0] is got and np.array_equal(got, x)
        out = comm.start_all_reduce(x, "max").wait()  # (an output it allocates)
        assert out is not x and np.array_equal(out, x)
        assert np.array_equal(comm.start_all_gather(x).wait(), x)
    finally:
        comm.close()


def test_the_rank_ordered_max_is_numpys():
    rows = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    assert np.array_equal(comm_mpi._ordered_sum(rows, "max", 3, np.float32), rows.max(axis=0))


def test_nccls_set_up_refusals_without_a_gpu(monkeypatch):
    cuda = types.SimpleNamespace(nccl=types.SimpleNamespace(available=False))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    with pytest.raises(CommError, match=r"NCCL is not available \(libnccl.so.2 not found\); install nvidia-nccl-cu12"):
        comm_nccl._load_nccl()
    with pytest.raises(CommError, match="making the NCCL unique id failed on the group's first rank: CommError: NCCL "
                                        "unique id has 5 bytes, expected 128"):
        comm_nccl.broadcast_unique_id(MPI.COMM_SELF, lambda: [1, 2, 3, 4, 5])
    closed = object.__new__(comm_nccl.NcclCommunicator)
    closed.nccl_comm = None  # (what close leaves: a second close does nothing)
    assert closed.close() is None
