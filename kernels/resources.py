"""Compile-time resources of the kernels: registers, spills and static shared memory as ptxas
reports them for sm_80 and sm_90, each kernel's occupancy target, and the occupancy they give.

What is compiled is what runs: :func:`cutp.kernels.runtime.kernel_source` (common.cuh inlined)
with the NVRTC options' language level (``-std=c++17``), by ``nvcc --fatbin`` for both
architectures, ``--resource-usage`` parsed by :func:`parse_ptxas`. Results are cached on disk by
the hash of the source text, the options and nvcc's version (``$CUTP_CACHE_DIR``), so a test
session compiles each source once.

* ``TARGETS``: per kernel entry point, the largest block its launcher uses and the blocks per SM
  it must keep resident (its occupancy target), as its family declares them (kernels/<op>.py
  FAMILY, :mod:`cutp.kernels.family`); :func:`register_budget` turns that into the registers per
  thread it may use.
* ``LIMITS``: the per-SM and per-block limits of sm_80 (A100) and sm_90 (H100/H200).
* :func:`occupancy`: CUDA's occupancy calculation (threads, blocks, registers, shared memory).

Checked by ``tests/kernel_build/test_resources.py``; the README's resource table is
``python tools/kernel_resources.py`` (kernels/README.md, "Resources").
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .family import DynamicShared, Target, families
from .runtime import SOURCES, kernel_source

ARCHS = ("sm_80", "sm_90")
# The language level of nvrtc_options() (nvcc finds cuda_bf16.h itself), warnings as errors.
NVCC_OPTIONS = ("-std=c++17", "-Werror", "all-warnings")
DEFAULT_SHARED_LIMIT = 48 * 1024  # static + dynamic per block without the opt-in


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM and per-block limits of one compute capability (CUDA C Programming Guide, Table 21)."""

    smem_per_sm: int
    smem_per_block_opt_in: int  # static + dynamic, with cudaFuncAttributeMaxDynamicSharedMemorySize
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256  # registers are allocated per warp, in units of 256
    reserved_smem_per_block: int = 1024  # the system's share of shared memory, per resident block


LIMITS = {
    "sm_80": ArchLimits(smem_per_sm=164 * 1024, smem_per_block_opt_in=163 * 1024),
    "sm_90": ArchLimits(smem_per_sm=228 * 1024, smem_per_block_opt_in=227 * 1024),
}


# Per entry point without _f32 / _bf16 (attention's keep their head dim), from each family's
# declaration (kernels/<op>.py FAMILY). Full occupancy (2048 threads per SM) for the simple
# elementwise and reduction kernels; 50% for the kernels that keep a 128-bit chunk of four or five
# arrays in flight per thread (kernels/README.md, "Registers": that is 2.7x to 5x the bytes in
# flight an H100 SM needs to saturate HBM).
TARGETS: dict[str, Target] = {k: t for f in families() for k, t in f.targets.items()}

# Every kernel family that launches with dynamic shared memory (the others pass shared_mem=0;
# tests/kernel_build/test_resources.py checks that no other launcher passes it).
DYNAMIC_SHARED: dict[str, DynamicShared] = {k: d for f in families() for k, d in f.dynamic_shared.items()}


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one entry point on one architecture."""

    kernel: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int
    barriers: int


def family(kernel: str) -> str:
    """The TARGETS key of an entry point: its name without the storage suffix (attention's keep
    their head dim: attention_forward_f32_d64 -> attention_forward_d64)."""
    return re.sub(r"_(f32|bf16)(_d\d+(?:v\d+)?)?$", r"\2", kernel)


# ------------------------------------------------------------------------------------------------
# Occupancy
# ------------------------------------------------------------------------------------------------
def _regs_per_warp(registers: int, lim: ArchLimits) -> int:
    return -(-max(1, registers) * 32 // lim.reg_alloc_unit) * lim.reg_alloc_unit


def blocks_per_sm(arch: str, threads: int, registers: int, smem_per_block: int = 0) -> int:
    """Resident blocks per SM (CUDA's occupancy calculation): the least of the limits by
    threads, blocks, registers (allocated per warp) and shared memory (+1 KiB reserved per block)."""
    lim = LIMITS[arch]
    warps = -(-threads // 32)
    by_regs = lim.regs_per_sm // (warps * _regs_per_warp(registers, lim))
    by_threads = lim.threads_per_sm // (warps * 32)
    by_smem = lim.smem_per_sm // (smem_per_block + lim.reserved_smem_per_block)
    return min(lim.blocks_per_sm, by_threads, by_regs, by_smem)


def occupancy(arch: str, threads: int, registers: int, smem_per_block: int = 0) -> float:
    """Resident threads per SM over the SM's maximum (theoretical occupancy)."""
    n = blocks_per_sm(arch, threads, registers, smem_per_block)
    return n * -(-threads // 32) * 32 / LIMITS[arch].threads_per_sm


def register_budget(arch: str, target: Target) -> int:
    """The most registers per thread with which target.blocks_per_sm blocks of target.threads
    still fit one SM (registers only), in the allocation's granularity (a multiple of 8)."""
    lim = LIMITS[arch]
    fits = [r for r in range(8, lim.max_regs_per_thread + 1, 8)
            if blocks_per_sm(arch, target.threads, r) >= target.blocks_per_sm]
    return max(fits) if fits else 0


# ------------------------------------------------------------------------------------------------
# ptxas
# ------------------------------------------------------------------------------------------------
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+a?)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> list[KernelResources]:
    """The entry points of a ``ptxas -v`` / ``nvcc --resource-usage`` log, in order. Raises
    ValueError on an entry without its "Used N registers" line (a log this parser misreads)."""
    out: list[KernelResources] = []
    cur: dict | None = None

    def close():
        if cur is not None:
            if "registers" not in cur:
                raise ValueError(f"ptxas log: no register count for {cur['kernel']} ({cur['arch']})")
            out.append(KernelResources(**cur))

    for line in text.splitlines():
        if m := _ENTRY.search(line):
            close()
            cur = dict(kernel=m.group(1), arch=m.group(2), spill_stores=0, spill_loads=0, stack_frame=0,
                       static_smem=0, barriers=0)
        elif cur is not None and (m := _FRAME.search(line)):
            cur.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif cur is not None and (m := _USED.search(line)):
            b, smem = _BARRIERS.search(line), _SMEM.search(line)
            cur.update(registers=int(m.group(1)), barriers=int(b.group(1)) if b else 0,
                       static_smem=int(smem.group(1)) if smem else 0)
    close()
    return out


def find_nvcc() -> str | None:
    """nvcc on $PATH or in /usr/local/cuda*/bin, or None."""
    found = shutil.which("nvcc")
    if found:
        return found
    cands = sorted(Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True)
    return str(cands[0]) if cands else None


def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def nvcc_release(nvcc: str | None = None) -> str:
    """'13.0 (V13.0.88)': the release line of ``nvcc --version`` (registers depend on it)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found on $PATH or in /usr/local/cuda*/bin")
    m = re.search(r"release ([\d.]+), (V[\d.]+)", _nvcc_version(nvcc))
    return f"{m.group(1)} ({m.group(2)})" if m else "unknown"


def _cache_dir() -> Path:
    base = os.environ.get("CUTP_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "cutp-cache")
    d = Path(base) / "kernel_resources"
    d.mkdir(parents=True, exist_ok=True)
    return d


def compile_source(name: str, nvcc: str, archs=ARCHS, version: str = "") -> list[KernelResources]:
    """ptxas resources of every entry point of kernels/<name>.cu (as NVRTC compiles it) for
    `archs`, from the disk cache when this text, these options and this nvcc were seen before."""
    src = kernel_source(name)
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    opts = [*NVCC_OPTIONS, *gencode, "--resource-usage"]
    key = hashlib.sha256("\0".join([src, *opts, version or _nvcc_version(nvcc)]).encode()).hexdigest()[:32]
    cached = _cache_dir() / f"{name}-{key}.json"
    if cached.exists():
        return [KernelResources(**r) for r in json.loads(cached.read_text())]
    with tempfile.TemporaryDirectory(prefix="cutp-res-") as tmp:
        cu = Path(tmp) / f"{name}.cu"
        cu.write_text(src)
        p = subprocess.run([nvcc, "--fatbin", *opts, "-o", str(Path(tmp) / f"{name}.fatbin"), str(cu)],
                           capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"nvcc failed on {name}.cu:\n{p.stderr}{p.stdout}")
    res = parse_ptxas(p.stdout + p.stderr)
    tmp_file = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp_file.write_text(json.dumps([asdict(r) for r in res]))
    os.replace(tmp_file, cached)
    return res


def compile_all(nvcc: str | None = None, sources=SOURCES, archs=ARCHS) -> dict[tuple[str, str], KernelResources]:
    """{(kernel, arch): resources} of every entry point of `sources`; nvcc runs two at a time."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found on $PATH or in /usr/local/cuda*/bin")
    version = _nvcc_version(nvcc)
    with ThreadPoolExecutor(max_workers=2) as pool:
        lists = list(pool.map(lambda s: compile_source(s, nvcc, archs, version), sources))
    return {(r.kernel, r.arch): r for res in lists for r in res}
