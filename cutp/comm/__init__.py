"""Communicators: the collectives cutp needs, over MPI (NumPy) or NCCL (CuPy), and the Context.

base      the interface every implementation follows (dtypes, shapes, in-place layouts)
mpi       MpiCommunicator: NumPy arrays over mpi4py's buffer interface
nccl      NcclCommunicator: CuPy arrays through cupy.cuda.nccl
counting  CommCounter and the wrapper that counts every collective per group and operation
watched   the wrapper that registers every collective with the collective watchdog
context   Context / init: the mesh's groups (world, tp, dp) of one cutp instance

`MpiCommunicator`, `NcclCommunicator` and the Context load at first use (PEP 562), so that
importing cutp never initialises MPI or CUDA by itself (`python -m cutp info` must work when
either is broken).
"""
import importlib

from .base import REDUCE_OPS, SUPPORTED_DTYPES, CommError, Communicator
from .counting import CommCounter, CommEvent, CountingCommunicator

_LAZY = {"MpiCommunicator": "cutp.comm.mpi", "NcclCommunicator": "cutp.comm.nccl",
         "Context": "cutp.comm.context", "init": "cutp.comm.context"}

__all__ = [
    "REDUCE_OPS", "SUPPORTED_DTYPES", "CommError", "Communicator", "CommCounter", "CommEvent",
    "CountingCommunicator", "MpiCommunicator", "NcclCommunicator", "Context", "init",
]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cutp.comm' has no attribute {name!r}")
