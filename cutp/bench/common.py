"""Shared pieces of the benchmark suites: timing, machine facts, GPU peaks (the tables, JSON and
size formats are cutp.train.reporting's, shared with the planner).

Timing
    CPU: ``time.perf_counter`` around each call, after warm-up calls; the summary statistic is
    the median of the repeats (robust to the other processes of a shared machine).
    GPU: CUDA events around each call on the current stream, after warm-up calls, with an
    L2-sized buffer zeroed before every repeat (outside the timed region) so that no repeat
    finds its inputs in L2 (as llm.c's dev/cuda ``benchmark_kernel`` does); the median of the
    per-call event times is reported.

Units: GB is 1e9 bytes, GB/s 1e9 bytes per second (as nccl-tests and llm.c report them);
sizes given in KiB/MiB are powers of two.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import ctypes
import ctypes.util

import numpy as np
from mpi4py import MPI

from ..runtime import backend
from ..runtime.threads import available_cores, get_blas_threads, op_threads, parallel_map

# ---------------------------------------------------------------------------------------------
# Peak dense throughput of common NVIDIA GPUs (TFLOP/s, no sparsity) and their memory bandwidth
# (GB/s), from the vendors' data sheets. "fp32" is the CUDA-core FP32 rate (what a float32 GEMM
# gets without TF32); "tf32" and "bf16" are tensor-core rates. Matched against the device name
# in order: the first pattern contained in the lower-cased name wins.
# ---------------------------------------------------------------------------------------------
GPU_PEAKS = [
    # pattern,        label,              bf16,   tf32,  fp32,  mem GB/s
    ("h200",          "H200 SXM",         989.4,  494.7, 66.9,  4800),
    ("gh200",         "GH200",            989.4,  494.7, 66.9,  4000),
    ("h100 pcie",     "H100 PCIe",        756.0,  378.0, 51.2,  2000),
    ("h100 nvl",      "H100 NVL",         835.0,  417.5, 60.0,  3900),
    ("h100",          "H100 SXM",         989.4,  494.7, 66.9,  3350),
    ("h800",          "H800 SXM",         989.4,  494.7, 66.9,  3350),
    ("b200",          "B200",             2250.0, 1100.0, 80.0, 8000),
    ("a100-pcie",     "A100 PCIe",        312.0,  156.0, 19.5,  1935),
    ("a100 80gb pcie", "A100 PCIe",       312.0,  156.0, 19.5,  1935),
    ("a100-sxm4-40gb", "A100 SXM 40GB",   312.0,  156.0, 19.5,  1555),
    ("a100",          "A100 SXM",         312.0,  156.0, 19.5,  2039),
    ("a800",          "A800",             312.0,  156.0, 19.5,  2039),
    ("l40s",          "L40S",             362.1,  183.0, 91.6,  864),
    ("l40",           "L40",              181.0,  90.5,  90.5,  864),
    ("l4",            "L4",               121.0,  60.0,  30.3,  300),
    ("a10g",          "A10G",             70.0,   35.0,  31.2,  600),
    ("a10",           "A10",              125.0,  62.5,  31.2,  600),
    ("rtx 4090",      "RTX 4090",         165.2,  82.6,  82.6,  1008),
    ("rtx 3090",      "RTX 3090",         71.0,   35.6,  35.6,  936),
    ("v100",          "V100 SXM",         0.0,    0.0,   15.7,  900),  # no bf16 / tf32
    ("t4",            "T4",               0.0,    0.0,   8.1,   320),
]


def gpu_peak(name: str) -> dict | None:
    """Peak figures for a device name such as 'NVIDIA H100 80GB HBM3' (None if unknown)."""
    n = name.lower()
    for pattern, label, bf16, tf32, fp32, mem in GPU_PEAKS:
        if pattern in n:
            return {"label": label, "bf16_tflops": bf16, "tf32_tflops": tf32, "fp32_tflops": fp32,
                    "mem_gbs": mem}
    return None


def peak_tflops(peak: dict, dtype: str, tf32: bool = False) -> float | None:
    """The dense peak that applies to GEMMs in `dtype` (float32 uses TF32 only when enabled)."""
    if peak is None:
        return None
    if dtype in ("bfloat16", "float16"):
        v = peak["bf16_tflops"]
    elif dtype == "float32":
        v = peak["tf32_tflops"] if tf32 else peak["fp32_tflops"]
    else:  # float64 is not in the table (consumer parts run it at 1/32-1/64 of fp32)
        return None
    return v or None


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """Per-call times in seconds."""

    times: list = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the repeats were."""
        if len(self.times) < 3:
            return 0.0
        q = statistics.quantiles(self.times, n=10)
        return (q[-1] - q[0]) / self.median if self.median > 0 else 0.0

    def as_dict(self) -> dict:
        return {"median_s": self.median, "mean_s": self.mean, "min_s": self.min, "repeats": len(self.times),
                "spread": self.spread}


def time_cpu(fn, *, warmup: int = 2, repeat: int = 10, min_time: float = 0.0, max_time: float = 1e9,
             setup=None) -> Timing:
    """Times fn() on the host: `warmup` untimed calls, then at least `repeat` timed calls (more
    until `min_time` seconds are spent, stopping early after `max_time`). `setup()` runs before
    every call, untimed (e.g. to restore an input that fn overwrites)."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    t = Timing()
    spent = 0.0
    while (len(t.times) < repeat or spent < min_time) and (spent < max_time or not t.times):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        t.times.append(dt)
        spent += dt
    return t


class L2Flusher:
    """Zeroes a buffer as large as the GPU's L2 cache (llm.c dev/cuda's cache flush)."""

    def __init__(self, cupy):
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        self.nbytes = int(props.get("l2CacheSize", 0)) or (50 << 20)
        self.buf = cupy.empty(self.nbytes, dtype=cupy.uint8)

    def __call__(self):
        self.buf.fill(0)


def time_gpu(fn, *, warmup: int = 5, repeat: int = 50, flush: L2Flusher | None = None, setup=None) -> Timing:
    """Times fn() with CUDA events on the current stream (each repeat: setup, L2 flush, then
    start event, fn, stop event). Returns per-call times in seconds."""
    import cupy  # optional dependency

    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    stream.synchronize()
    starts = [cupy.cuda.Event() for _ in range(repeat)]
    stops = [cupy.cuda.Event() for _ in range(repeat)]
    for i in range(repeat):
        if setup is not None:
            setup()
        if flush is not None:
            flush()
        starts[i].record(stream)
        fn()
        stops[i].record(stream)
    stops[-1].synchronize()
    return Timing([cupy.cuda.get_elapsed_time(a, b) / 1e3 for a, b in zip(starts, stops)])


def keep_freed_memory() -> str | None:
    """Makes glibc keep freed memory for reuse (mallopt: mmap threshold 1 GiB, no trimming), so
    that an op's freshly allocated outputs are not page-faulted in anew on every call: the kernels
    suite then measures the op, not the kernel's page-fault handling (measured: the first bias+GeLU
    cases 4x slower otherwise, with 200k page faults, depending on what ran before). A training
    step is not affected this way (glibc's dynamic thresholds settle after a few steps). Returns
    a description, or None where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1 and libc.mallopt(m_trim_threshold, (1 << 31) - 1) == 1
    except (OSError, AttributeError):
        return None
    return "glibc mallopt: freed memory kept for reuse (M_MMAP_THRESHOLD 1 GiB, no trim)" if ok else None


def copy_bandwidth(xp, nbytes: int = 256 << 20, *, repeat: int = 10, warmup: int = 2) -> dict:
    """Device copy bandwidth: a buffer of `nbytes` copied into another; each copy moves
    2 * nbytes (one read, one write). On the GPU a device-to-device copy timed with events
    (``cupy.copyto``, a D2D memcpy); on the CPU ``np.copyto``, both on one thread and split in
    4 MiB blocks over the ops' threads (as the ops run); the faster one is the reference."""
    n = nbytes // 4
    src = xp.ones(n, dtype=xp.float32)
    dst = xp.empty_like(src)
    fn = lambda: xp.copyto(dst, src)  # noqa: E731
    moved = 2 * n * 4
    out = {"bytes": n * 4, "moved_bytes": moved}
    if xp is np:
        t = time_cpu(fn, warmup=warmup, repeat=repeat)
        step = 1 << 20
        blocks = [slice(i, min(i + step, n)) for i in range(0, n, step)]

        def block(sl):
            np.copyto(dst[sl], src[sl])

        tp = time_cpu(lambda: parallel_map(np, block, blocks), warmup=warmup, repeat=repeat)
        out.update(one_thread_gbs=moved / t.median / 1e9, threads=op_threads(),
                   threaded_gbs=moved / tp.median / 1e9)
        t = t if t.median <= tp.median else tp
    else:
        t = time_gpu(fn, warmup=warmup, repeat=repeat)
    out.update(time_s=t.median, gbs=moved / t.median / 1e9)
    return out


# ---------------------------------------------------------------------------------------------
# Machine facts
# ---------------------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(xp=np) -> dict:
    info = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpu": cpu_name(),
        "cores": available_cores(),
        "blas_threads": get_blas_threads(),
        "platform": platform.platform(),
        "argv": " ".join(sys.argv),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        info["loadavg"] = os.getloadavg()[0]
    except OSError:
        pass
    if xp is not np:
        info.update(gpu_info(xp))
    return info


def gpu_info(cupy) -> dict:
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {"gpu": name, "gpu_id": dev.id, "cupy": cupy.__version__,
            "gpu_mem_gib": props["totalGlobalMem"] / 2**30, "l2_bytes": props.get("l2CacheSize"),
            "sm": f"{props['major']}{props['minor']}", "peak": gpu_peak(name)}


def device_of(name: str):
    """(device, xp) for 'cpu' | 'cuda' | 'auto'."""
    device = backend.resolve_device(name)
    return device, backend.array_module_for(device)


def reduce_scalar(mpi_comm, value: float, op: str = "max") -> float:
    """A float reduced over the ranks through a buffer (no pickling), e.g. the slowest rank's time."""
    buf = np.array([float(value)])
    mpi_comm.Allreduce(MPI.IN_PLACE, buf, op={"max": MPI.MAX, "min": MPI.MIN, "sum": MPI.SUM}[op])
    return float(buf[0])
