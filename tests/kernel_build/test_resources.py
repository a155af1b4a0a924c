"""Compile-time resources of kernels/*.cu (kernels/resources.py) for sm_80 and sm_90: no spills,
registers within each kernel's occupancy budget (resources.TARGETS), static + dynamic shared
memory within the default 48 KiB or opted in and within the hardware's limit, at the biggest
shapes the launchers support; LayerNorm backward at C = 6144 (48 KiB dynamic + 256 B static)
launches and is correct under the emulator with a device's shared-memory rules; kernels/README.md
holds exactly the table tools/kernel_resources.py prints.

ptxas results are cached on disk per source text and nvcc version ($CUTP_CACHE_DIR, per test
session): the first compile of all sources takes ~10 s on 2 cores, later ones nothing.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from cutp import ops
from cutp.kernels import Launchers
from cutp.kernels import resources as kr
from cutp.kernels.layernorm import (
    LAYERNORM_BACKWARD_MAX_C,
    LAYERNORM_BACKWARD_THREADS,
    layernorm_backward_rows_per_block,
)
from cutp.kernels.runtime import SOURCES, KernelArgumentError
from tests.cuda_emu import KERNELS_DIR, EmulatedModule
from tests.kernels.helpers import DT_IDS, DTYPES, F32, close, randn

ROOT = Path(__file__).resolve().parents[2]
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\(([^)]*)\)\s+)?(\w+)\s*\(')


def _entry_points() -> dict[str, int | None]:
    """{kernel: first __launch_bounds__ argument or None} of every kernels/*.cu."""
    out = {}
    for src in sorted((ROOT / "kernels").glob("*.cu")):
        for bounds, name in _ENTRY.findall(src.read_text()):
            out[name] = int(bounds.split(",")[0]) if bounds else None
    return out


@pytest.fixture(scope="module")
def res():
    nvcc = kr.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed (neither on $PATH nor in /usr/local/cuda*/bin): the kernels' "
                    "registers, spills and shared memory cannot be read")
    return kr.compile_all(nvcc)


# ------------------------------------------------------------------------------------------------
# The parser and the occupancy arithmetic
# ------------------------------------------------------------------------------------------------
PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_spills' for 'sm_80'
ptxas info    : Function properties for k_spills
    88 bytes stack frame, 180 bytes spill stores, 188 bytes spill loads
ptxas info    : Used 48 registers, used 1 barriers, 48 bytes cumulative stack size, 1056 bytes smem, 440 bytes cmem[0]
ptxas info    : Compiling entry function 'k_plain' for 'sm_90'
ptxas info    : Function properties for k_plain
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers
"""


def test_parse_ptxas_reads_registers_spills_and_shared_memory():
    a, b = kr.parse_ptxas(PTXAS_LOG)
    assert a == kr.KernelResources("k_spills", "sm_80", registers=48, spill_stores=180, spill_loads=188,
                                   stack_frame=88, static_smem=1056, barriers=1)
    assert b == kr.KernelResources("k_plain", "sm_90", registers=12, spill_stores=0, spill_loads=0, stack_frame=0,
                                   static_smem=0, barriers=0)
    with pytest.raises(ValueError, match="no register count for k_plain"):
        kr.parse_ptxas(PTXAS_LOG.rsplit("\n", 2)[0])


def test_occupancy_arithmetic():
    # 64 registers x 512 threads = half the register file: 2 blocks, 50%.
    assert kr.blocks_per_sm("sm_90", 512, 64) == 2 and kr.occupancy("sm_90", 512, 64) == 0.5
    # 62 registers are allocated as 64 (256 per warp); 39 as 40.
    assert kr.blocks_per_sm("sm_90", 256, 62) == 4 and kr.blocks_per_sm("sm_90", 256, 39) == 6
    # threads and blocks per SM cap it; so does shared memory, with 1 KiB reserved per block.
    assert kr.blocks_per_sm("sm_90", 32, 8) == 32 and kr.blocks_per_sm("sm_90", 1024, 8) == 2
    assert kr.blocks_per_sm("sm_80", 128, 32, 80 * 1024) == 2 and kr.blocks_per_sm("sm_80", 128, 32, 81 * 1024 + 1) == 1
    assert kr.register_budget("sm_90", kr.Target(256, 8, "")) == 32
    assert kr.register_budget("sm_90", kr.Target(512, 2, "")) == 64
    assert kr.register_budget("sm_90", kr.Target(256, 5, "")) == 48
    assert kr.register_budget("sm_90", kr.Target(1024, 3, "")) == 0  # 3072 threads do not fit an SM


def test_every_kernel_has_a_target_matching_its_launch_bounds():
    entries = _entry_points()
    assert len(entries) >= 29
    wrong = [f"{k}: __launch_bounds__({lb}) but TARGETS says {kr.TARGETS[kr.family(k)].threads} threads"
             for k, lb in entries.items() if kr.family(k) in kr.TARGETS and lb != kr.TARGETS[kr.family(k)].threads]
    missing = sorted(k for k in entries if kr.family(k) not in kr.TARGETS)
    assert not missing, f"kernels without an occupancy target in kernels/resources.py TARGETS: {missing}"
    assert not wrong, "\n".join(wrong)
    assert set(kr.TARGETS) == {kr.family(k) for k in entries}, "TARGETS names a kernel that does not exist"
    assert kr.TARGETS["layernorm_backward"].threads == LAYERNORM_BACKWARD_THREADS


# ------------------------------------------------------------------------------------------------
# ptxas's figures against the budgets
# ------------------------------------------------------------------------------------------------
def test_every_entry_point_was_compiled_for_both_architectures(res):
    assert {k for k, _ in res} == set(_entry_points())
    assert {a for _, a in res} == set(kr.ARCHS)
    assert len(res) == 2 * len(_entry_points())


def test_no_kernel_spills(res):
    spills = [f"{k} ({a}): {r.spill_stores} B spill stores, {r.spill_loads} B spill loads, {r.stack_frame} B stack"
              for (k, a), r in sorted(res.items()) if r.spill_stores or r.spill_loads or r.stack_frame]
    assert not spills, "\n".join(spills)


def test_registers_within_the_occupancy_budget(res):
    over = []
    for (k, a), r in sorted(res.items()):
        t = kr.TARGETS[kr.family(k)]
        budget = kr.register_budget(a, t)
        if r.registers > budget:
            over.append(f"{k} ({a}): {r.registers} registers, budget {budget} for {t.blocks_per_sm} blocks of "
                        f"{t.threads} threads per SM (occupancy {kr.occupancy(a, t.threads, r.registers):.0%})")
    assert not over, "\n".join(over)


def test_static_shared_memory_fits_the_default_limit(res):
    """Static __shared__ arrays cannot be opted in past 48 KiB: only dynamic shared memory can."""
    over = [f"{k} ({a}): {r.static_smem} B" for (k, a), r in res.items() if r.static_smem > kr.DEFAULT_SHARED_LIMIT]
    assert not over, over


def test_only_the_listed_launchers_use_dynamic_shared_memory():
    """DYNAMIC_SHARED lists every family whose launcher passes shared_mem; a new one must be added
    there (and is then checked below)."""
    users = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        if path.name != "runtime.py" and re.search(r"\bshared_mem=(?!0\b)\w", path.read_text()):
            users.add(path.stem)
    assert users == {fam.split("_")[0] for fam in kr.DYNAMIC_SHARED}


# ------------------------------------------------------------------------------------------------
# The launcher's shared memory at the biggest shapes, as a device would see it
# ------------------------------------------------------------------------------------------------
class DeviceRules:
    """A kernel function with a device's shared-memory rules (cuFuncSetAttribute / cuLaunchKernel):
    static shared memory as ptxas reports it; max_dynamic_shared_size_bytes defaults to 48 KiB
    less the static part and may be raised up to the architecture's opt-in limit less the static
    part; a launch with more dynamic shared memory than that fails. Delegates to `inner` (an
    emulated kernel) when given, else only records the launch."""

    def __init__(self, name: str, static: int, arch: str, inner=None):
        self.name, self.shared_size_bytes, self.arch, self.inner = name, static, arch, inner
        self._max_dynamic = kr.DEFAULT_SHARED_LIMIT - static
        self.launches: list[tuple] = []

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dynamic

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        if self.shared_size_bytes + value > kr.LIMITS[self.arch].smem_per_block_opt_in:
            raise RuntimeError(f"CUDA_ERROR_INVALID_VALUE: {value} + {self.shared_size_bytes} static > "
                               f"{kr.LIMITS[self.arch].smem_per_block_opt_in} ({self.arch})")
        self._max_dynamic = int(value)
        if self.inner is not None:
            self.inner.max_dynamic_shared_size_bytes = int(value)

    def __call__(self, grid, block, args, shared_mem=0):
        if shared_mem > self._max_dynamic:
            raise RuntimeError(f"{self.name}: launch with {shared_mem} B of dynamic shared memory, "
                               f"{self.shared_size_bytes} B static, limit {self._max_dynamic} B: "
                               "CUDA_ERROR_INVALID_VALUE")
        self.launches.append((grid, block, shared_mem))
        if self.inner is not None:
            self.inner(grid, block, args, shared_mem=shared_mem)


class DeviceModule:
    def __init__(self, res, arch: str, inner=None):
        self.res, self.arch, self.inner, self.functions = res, arch, inner, {}

    def get_function(self, name: str) -> DeviceRules:
        inner = self.inner.get_function(name) if self.inner is not None else None
        fn = self.functions[name] = DeviceRules(name, self.res[(name, self.arch)].static_smem, self.arch, inner)
        return fn


def _layernorm_backward(k, C: int, dtype, rows: int = 1):
    x = randn((rows, C), dtype, seed=31)
    dy = randn((rows, C), dtype, seed=32)
    w = randn((C,), dtype, seed=33)
    mean = np.zeros(rows, np.float32)
    rstd = np.ones(rows, np.float32)
    return k.layernorm_backward(dy, x, w, mean, rstd, dtype)


@pytest.mark.parametrize("arch", kr.ARCHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("C", [768, 6144, LAYERNORM_BACKWARD_MAX_C])
def test_layernorm_backward_launch_fits_the_device(res, arch, dtype, C):
    """The launcher's formula at its biggest supported shape: opted in past 48 KiB (static +
    dynamic), within the architecture's limit, at least one block per SM, block within bounds."""
    mod = DeviceModule(res, arch)
    k = Launchers(lambda source: mod, np)
    _layernorm_backward(k, C, dtype)
    fn = mod.functions[f"layernorm_backward_{'f32' if dtype == F32 else 'bf16'}"]
    (_, block, smem), = fn.launches
    static = fn.shared_size_bytes
    assert static == res[(fn.name, arch)].static_smem > 0
    R = layernorm_backward_rows_per_block(C, dtype)
    assert smem == kr.DYNAMIC_SHARED["layernorm_backward"].bytes_of(C, True, dtype) == 8 * C * R
    assert block[1] == R and (R > 1) == (C == 768)  # row groups where a row's block is small
    if static + smem > kr.DEFAULT_SHARED_LIMIT:
        assert fn.max_dynamic_shared_size_bytes >= smem
    assert static + fn.max_dynamic_shared_size_bytes <= kr.LIMITS[arch].smem_per_block_opt_in
    assert block[0] * block[1] <= LAYERNORM_BACKWARD_THREADS
    assert kr.blocks_per_sm(arch, block[0] * block[1], res[(fn.name, arch)].registers, static + smem) >= 1


def test_the_device_rules_refuse_what_a_device_refuses(res):
    """Guards the check above: without the opt-in, 48 KiB dynamic + 256 B static fails to launch,
    and past the opt-in limit the launcher raises KernelArgumentError."""
    fn = DeviceRules("layernorm_backward_f32", res[("layernorm_backward_f32", "sm_80")].static_smem, "sm_80")
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE"):
        fn((1,), (512,), (), shared_mem=8 * 6144)
    mod = DeviceModule(res, "sm_80")
    k = Launchers(lambda source: mod, np)
    with pytest.raises(KernelArgumentError, match="more than this device allows"):
        _layernorm_backward(k, 21000, F32)  # 168,000 B: over sm_80's 163 KiB


@pytest.fixture(scope="module")
def emulated():
    if shutil.which("g++") is None:
        pytest.skip("the CUDA emulator needs g++ (>= 12)")
    return EmulatedModule(path=[KERNELS_DIR / f"{s}.cu" for s in SOURCES])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_layernorm_backward_at_6144_runs_under_the_device_rules(res, emulated, dtype):
    """C = 6144: 48 KiB of dynamic shared memory + 256 B static. Emulated, with sm_80's rules on
    every launch, against the NumPy reference."""
    mod = DeviceModule(res, "sm_80", emulated)
    k = Launchers(lambda source: mod, np)
    C = 6144
    x = randn((3, C), dtype, seed=41, scale=2.0)
    w = randn((C,), dtype, seed=42)
    b = randn((C,), dtype, seed=43)
    dy = randn((3, C), dtype, seed=44)
    _, mean, rstd = k.layernorm_forward(x, w, b)
    _, lctx = ops.layernorm_forward(x, w, b, 1e-5)
    dx, dw, db = k.layernorm_backward(dy, x, w, mean, rstd, b.dtype)
    dx_ref, dw_ref, db_ref = ops.layernorm_backward(dy, lctx)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == F32 else {}
    close(dx, dx_ref, dtype, **tol)
    close(dw, dw_ref, dtype, **tol)
    close(db, db_ref, dtype, **tol)
    fn = mod.functions[f"layernorm_backward_{'f32' if dtype == F32 else 'bf16'}"]
    assert fn.launches[0][2] == 8 * C and fn.max_dynamic_shared_size_bytes == 8 * C


# ------------------------------------------------------------------------------------------------
# The README's table
# ------------------------------------------------------------------------------------------------
def _tool():
    spec = importlib.util.spec_from_file_location("kernel_resources_tool", ROOT / "tools" / "kernel_resources.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_readme_table_is_what_the_tool_prints(res):
    tool = _tool()
    readme = (ROOT / "kernels" / "README.md").read_text()
    assert readme.count(tool.BEGIN) == 1 and readme.count(tool.END) == 1, "kernels/README.md lost its table markers"
    current = readme[readme.index(tool.BEGIN):readme.index(tool.END) + len(tool.END)]
    release = kr.nvcc_release()
    m = re.search(r"ptxas of nvcc (.*):", current)
    assert m, "kernels/README.md's resource table does not say which nvcc it is from"
    if m.group(1) != release:
        pytest.skip(f"kernels/README.md's resource table is from nvcc {m.group(1)}, this machine has {release}: "
                    "registers differ between releases (the budgets above are still checked)")
    want = tool.markdown(res, release)
    assert current == want, "kernels/README.md's resource table is stale: run `python tools/kernel_resources.py --write`"
    assert tool.replace_table(readme, want) == readme
    assert set(tool.TRAFFIC) | tool.COMPUTE_BOUND == set(kr.TARGETS)
    assert not set(tool.TRAFFIC) & tool.COMPUTE_BOUND
