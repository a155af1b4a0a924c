"""`python -m cutp info`: what a bug report needs, and why a backend is or is not usable."""
from __future__ import annotations

import importlib
import os
import platform
import sys

import cutp
from cutp.ops import cblas, compiled
from cutp.runtime import backend
from cutp.runtime.threads import blas_library


def _version(module: str) -> str:
    try:
        m = importlib.import_module(module)
    except Exception as e:
        return f"not importable ({type(e).__name__}: {e})"
    return str(getattr(m, "__version__", "unknown"))


def collect() -> dict:
    """Every fact as a string, in print order. Never raises: failures become the value."""
    info = {
        "cutp": f"{cutp.__version__} ({os.path.dirname(cutp.__file__)})",
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "numpy": _version("numpy"),
        "ml_dtypes": _version("ml_dtypes"),
        "safetensors": _version("safetensors"),
        "tokenizers": _version("tokenizers"),
        "mpi4py": _version("mpi4py"),
    }
    try:
        from mpi4py import MPI  # late: a broken MPI is reported here, not a crash at start-up

        info["MPI library"] = MPI.Get_library_version().strip().splitlines()[0]
        info["MPI standard"] = "%d.%d" % MPI.Get_version()
        info["MPI world size"] = str(MPI.COMM_WORLD.Get_size())
    except Exception as e:
        info["MPI library"] = f"unusable ({type(e).__name__}: {e})"
    info["cupy"] = _version("cupy")
    ok, why = backend.cupy_status()
    if ok:
        import cupy  # optional dependency

        rt = cupy.cuda.runtime
        info["CUDA runtime"] = _cuda_version(rt.runtimeGetVersion())
        info["CUDA driver"] = _cuda_version(rt.driverGetVersion())
        n = rt.getDeviceCount()
        for i in range(n):
            p = rt.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
            info[f"GPU {i}"] = f"{name}, {p['totalGlobalMem'] / 2**30:.1f} GiB, sm_{p['major']}{p['minor']}"
    else:
        info["CUDA"] = why
    nccl_ok, nccl_why = backend.nccl_status()
    info["NCCL"] = nccl_why
    info["backend cpu"] = "usable (NumPy + MPI)"
    info["backend cuda"] = "usable (CuPy + NCCL)" if (ok and nccl_ok) else f"not usable: {nccl_why if ok else why}"
    # the CPU's speed: the compiled kernels (kernels/cpu) and the BLAS the GEMMs run on
    info["cpu kernels"] = _fact(lambda: compiled.describe(build=True))
    info["BLAS"] = _fact(_blas)
    # what compare-torch needs (optional extras)
    info["torch"] = _version("torch")
    info["transformers"] = _version("transformers")
    for var in ("CUTP_DEVICE", "CUTP_CPU_KERNELS", "CUTP_KERNELS"):
        info[var] = os.environ.get(var, "(unset)")
    return info


def _fact(fn) -> str:
    try:
        return fn()
    except Exception as e:  # (info never raises: the failure is the fact)
        return f"unknown ({type(e).__name__}: {e})"


def _blas() -> str:
    """NumPy's BLAS library, its threads, and whether the GEMM that accumulates into its output
    (cblas with beta = 1, cutp.ops.cblas) is found."""
    lib = blas_library()
    if lib is None:
        return "not found in the process (thread count not settable)"
    accumulate = "found" if cblas.found("float32") else "not found: the ops add the GEMM's result in NumPy"
    return f"{os.path.basename(lib.path)}, {lib.get()} thread(s); its cblas sgemm with beta = 1 {accumulate}"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def main(argv=None) -> int:
    for k, v in collect().items():
        print(f"{k:>16}: {v}")
    return 0
