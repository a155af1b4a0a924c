"""cutp: SPMD tensor-parallel transformer training on CuPy + mpi4py + NCCL.

    import cutp
    ctx = cutp.init(tp=2)            # collective over MPI.COMM_WORLD
    print(ctx.describe())
"""
__version__ = "0.1.0"

from .backend import get_array_module  # noqa: E402
from .context import Context, Mesh, init  # noqa: E402
from .errors import BackendError, ConfigError  # noqa: E402

__all__ = ["__version__", "init", "Context", "Mesh", "ConfigError", "BackendError", "get_array_module"]
