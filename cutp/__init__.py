"""cutp: SPMD tensor-parallel transformer training on CuPy + mpi4py + NCCL.

    import cutp
    ctx = cutp.init(tp=2)            # collective over MPI.COMM_WORLD
    print(ctx.describe())

Packages, each importing only those before it (README, "Architecture"): runtime, comm, ops and
kernels, tensor_parallel, the model (model, optim, data, checkpoint, hf, generate), train, bench.
"""
import importlib

__version__ = "0.1.0"

from .runtime.backend import get_array_module  # noqa: E402
from .runtime.errors import BackendError, ConfigError  # noqa: E402
from .runtime.mesh import Mesh  # noqa: E402

# `import cutp` must work where MPI is broken (`python -m cutp info` says why), so what needs
# mpi4py is loaded at first use (PEP 562) rather than here.
_LAZY = {"init": "cutp.comm.context", "Context": "cutp.comm.context"}

__all__ = ["__version__", "init", "Context", "Mesh", "ConfigError", "BackendError", "get_array_module"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cutp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
