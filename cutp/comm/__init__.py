"""Communicators: the collectives cutp needs, over MPI (NumPy) or NCCL (CuPy), and a counter.

`MpiCommunicator` and `NcclCommunicator` load lazily so that importing cutp never initialises
MPI or CUDA by itself (`python -m cutp info` must work when either is broken).
"""
from .base import REDUCE_OPS, SUPPORTED_DTYPES, CommError, Communicator
from .counting import CommCounter, CommEvent, CountingCommunicator

__all__ = [
    "REDUCE_OPS", "SUPPORTED_DTYPES", "CommError", "Communicator", "CommCounter", "CommEvent",
    "CountingCommunicator", "MpiCommunicator", "NcclCommunicator",
]


def __getattr__(name):
    if name == "MpiCommunicator":
        from .mpi import MpiCommunicator

        return MpiCommunicator
    if name == "NcclCommunicator":
        from .nccl import NcclCommunicator

        return NcclCommunicator
    raise AttributeError(name)
