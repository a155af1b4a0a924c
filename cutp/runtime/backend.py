"""The one place that decides the array module.

cutp runs the same code on NumPy arrays (CPU, MPI) and on CuPy arrays (NVIDIA GPUs, NCCL).
Every op asks `get_array_module(x)` which module its inputs belong to; a context asks
`resolve_device(...)` once which backend it runs on. CuPy is an optional dependency: it
is imported (inside the functions below) only when a CuPy array or the CUDA backend is
actually used, so CPU-only machines never pay for it.
"""
from __future__ import annotations

import importlib
import os
import types

import numpy as np

from .errors import BackendError
from .shape_only import ShapeArray, ShapeOnly

DEVICES = ("cpu", "cuda", "auto")


def is_cupy_array(x) -> bool:
    # Compare by module name so that NumPy-only code paths never import cupy.
    return type(x).__module__.split(".")[0] == "cupy"


def is_device_array(x) -> bool:
    """A GPU array: CuPy's, or the planner's shape-only stand-in of one (cutp.runtime.shape_only)."""
    return is_cupy_array(x) or (isinstance(x, ShapeArray) and x.xp.device == "cuda")


def on_host(xp) -> bool:
    """Whether arrays of module xp live in host memory and take the CPU code paths (NumPy, or the
    planner's shape-only stand-in of it)."""
    return xp is np or getattr(xp, "host", False)


def get_array_module(*arrays) -> types.ModuleType:
    """numpy, or cupy if any argument is a CuPy array (the shape-only module of the planner's
    arrays for those)."""
    for a in arrays:
        if isinstance(a, ShapeArray):
            return a.xp
        if is_cupy_array(a):
            import cupy  # optional dependency

            return cupy
    return np


def to_numpy(x) -> np.ndarray:
    """A host copy (or the array itself, if it already lives on the host)."""
    if isinstance(x, ShapeArray):
        return x.xp.to_numpy(x)
    if is_cupy_array(x):
        return x.get()
    return np.asarray(x)


def host_values(a) -> list:
    """A small array's values as Python numbers in ONE device-to-host copy (a float() of each
    entry would be a synchronization each). Shape-only arrays without values (the planner's) give
    each entry's hint, as float() of it would."""
    if isinstance(a, ShapeArray) and a.values is None:
        return [a[i].item() for i in range(a.shape[0])]
    return to_numpy(a).tolist()


def cupy_status() -> tuple[bool, str]:
    """(usable, reason): whether CuPy imports and sees at least one GPU."""
    try:
        cupy = importlib.import_module("cupy")
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        return False, f"cupy does not import ({type(e).__name__}: {e}); install cutp[cuda12] or cutp[cuda13]"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"cupy imports but the CUDA runtime sees no usable GPU ({type(e).__name__}: {e})"
    if n < 1:
        return False, "cupy imports but the CUDA runtime reports 0 GPUs"
    return True, f"{n} GPU(s) visible"


def cuda_device_count() -> int:
    """GPUs visible to this process (0 when CUDA is unusable). Tests replace this to simulate nodes."""
    ok, _ = cupy_status()
    if not ok:
        return 0
    import cupy  # optional dependency

    return int(cupy.cuda.runtime.getDeviceCount())


def cuda_pci_bus_id(index: int) -> str:
    """The PCI bus id of visible GPU `index` (tells apart GPUs that several ranks see under one
    index, e.g. when each rank is given its own GPU with CUDA_VISIBLE_DEVICES). Tests replace it."""
    import cupy  # optional dependency

    return str(cupy.cuda.Device(index).pci_bus_id)


_LAUNCHER_LOCAL_RANK = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK", "SLURM_LOCALID",
                        "MV2_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK")


def launcher_local_rank() -> int | None:
    """This process's index among the processes its launcher started on this node (MPICH, Open MPI,
    PMIx, Slurm, MVAPICH), or None. Unlike a rank in the communicator given to cutp, it differs
    between two cutp contexts of different processes sharing a node."""
    for var in _LAUNCHER_LOCAL_RANK:
        v = os.environ.get(var)
        if v is not None and v.strip().isdigit():
            return int(v)
    return None


def nccl_status() -> tuple[bool, str]:
    ok, why = cupy_status()
    if not ok:
        return False, why
    try:
        from cupy.cuda import nccl  # optional dependency
    except Exception as e:
        return False, f"cupy.cuda.nccl does not import ({e})"
    if not getattr(nccl, "available", False):
        return False, "libnccl.so.2 cannot be loaded; install nvidia-nccl-cu12 (or -cu13)"
    return True, f"NCCL {nccl_version_string()}"


def nccl_version_string() -> str:
    try:
        from cupy.cuda import nccl  # optional dependency

        v = nccl.get_version()
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    except Exception as e:
        return f"unknown ({e})"


def resolve_device(device: str = "auto") -> str:
    """'cpu' or 'cuda'. 'auto' picks cuda when a GPU is usable; 'cuda' without one raises."""
    if device not in DEVICES:
        raise BackendError(f"device={device!r} is not one of {DEVICES}")
    env = os.environ.get("CUTP_DEVICE")
    if device == "auto" and env in ("cpu", "cuda"):
        device = env
    if device == "cpu":
        return "cpu"
    count = cuda_device_count()
    if device == "auto":
        return "cuda" if count > 0 else "cpu"
    if count == 0:
        _, why = cupy_status()
        raise BackendError(
            f"device='cuda' was requested but no GPU is usable here: {why}. "
            "Use device='cpu' (NumPy + MPI) or device='auto', or run on a machine with an NVIDIA GPU."
        )
    return "cuda"


def array_module_for(device: str) -> types.ModuleType:
    if device == "cuda":
        import cupy  # optional dependency

        return cupy
    return np


def as_array(xp, a, dtype=None):
    """`a` as an array of module xp, without a copy where the memory already fits.

    Accepts NumPy and CuPy arrays, objects exporting `__cuda_array_interface__` (Numba, PyTorch
    CUDA tensors, ...) or DLPack (`__dlpack__`), and anything `asarray` takes. This is how a host
    code hands its own arrays to cutp; cutp's arrays export both protocols in return.
    """
    if isinstance(xp, ShapeOnly):
        return xp.asarray(a, dtype)
    if xp is np:
        if is_cupy_array(a):
            a = a.get()
        elif not isinstance(a, np.ndarray) and hasattr(a, "__dlpack__"):
            try:
                a = np.from_dlpack(a)
            except (TypeError, RuntimeError, BufferError):
                pass  # a device array: fall through to asarray, which raises a clear error
        return np.asarray(a, dtype=dtype)
    if not is_cupy_array(a) and not isinstance(a, np.ndarray):
        if hasattr(a, "__cuda_array_interface__"):
            a = xp.asarray(a)
        elif hasattr(a, "__dlpack__"):
            # cupy.from_dlpack refuses host memory ("CPU arrays cannot be directly imported to
            # CuPy"): a host DLPack array (a torch CPU tensor, ...) goes through NumPy first.
            a = np.from_dlpack(a) if _dlpack_on_host(a) else xp.from_dlpack(a)
    return xp.asarray(a, dtype=dtype)


_DLPACK_HOST_DEVICES = (1, 3)  # DLPack kDLCPU, kDLCUDAHost (pinned host memory)


def _dlpack_on_host(a) -> bool:
    try:
        return int(a.__dlpack_device__()[0]) in _DLPACK_HOST_DEVICES
    except Exception:  # no __dlpack_device__ (a bare capsule exporter): let from_dlpack decide
        return False
