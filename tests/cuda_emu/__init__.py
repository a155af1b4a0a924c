"""Run cutp's CUDA kernels on the CPU: an emulation of CUDA's execution model for tests.

`EmulatedModule` compiles `.cu` sources with g++ against `cuda_emu.h` (through
kernels/common.cuh) and exposes the kernels with the interface of `cupy.RawModule` /
`cupy.RawKernel`, taking NumPy arrays where CuPy takes CuPy arrays::

    from tests.cuda_emu import EmulatedModule

    mod = EmulatedModule(path=["kernels/gelu.cu"], schedule="reverse")
    gelu = mod.get_function("gelu_forward_f32")
    out = np.empty_like(x)
    gelu(((x.size + 255) // 256,), (256,), (out, x, np.int64(x.size)))

What a launch checks, beyond running the kernel:
  * the arguments against the kernel's C signature (pointer or scalar, dtype, size);
  * the launch configuration against CUDA's limits (block size, grid size, shared memory);
  * reads and writes out of bounds (checked builds, the default): of an array argument (each
    array is staged in a buffer with guard regions before and after it), of a static __shared__
    array or of the dynamic shared memory beyond the launch's shared_mem; OutOfBoundsError names
    the argument or shared variable, the source line, the thread and the address. Unchecked
    builds (checks=False) still catch writes into the guard regions, after the launch;
  * shared-memory races (checked builds): a read-after-write, write-after-read or
    write-after-write of a shared byte by two threads with no barrier (or, within a warp, no warp
    operation on both lanes) between them: SharedMemoryRaceError with both threads, both source
    lines and the address;
  * barrier misuse: divergent `__syncthreads()`, warp operations with missing lanes
    (BarrierError, with a report of which threads wait where);
  * reads of uninitialised shared memory show up as NaN (shared memory is poisoned per block);
  * crashes (SIGSEGV, ...), device asserts and hangs become Python exceptions.

Traffic (checked builds): every launch counts the bytes its kernel read from and wrote to each
array argument (EmulatedKernel.last_traffic; `with record_traffic() as log:` collects a
LaunchTraffic per launch of any module), so a test can assert how many passes a kernel, or a
sequence of launches, makes over an array.

The `schedule` decides the order in which emulated threads run between barriers ("forward",
"reverse", "random" with `seed`: in rounds, every ready thread to its next barrier or warp
operation), or lets one warp at a time run ahead to the next __syncthreads() ("warp-forward",
"warp-reverse", "warp-random"), as a GPU may. A kernel that is missing a barrier gives a wrong
result under at least one of them (and a checked build reports the race under any of them).
The default is $CUTP_EMU_SCHEDULE, else "forward".

Checks: `checks=True` (default; $CUTP_EMU_CHECKS=0 turns it off) compiles the kernels with g++'s
thread-sanitizer instrumentation (-fsanitize=thread at compile time only: no sanitizer runtime is
linked), so that every load and store of kernel code is checked by the emulator
(cuda_emu_runtime.cpp, "Checks").
A report's source lines come from the module's line tables (-g1) through addr2line;
kernels/README.md ("Reading a race or bounds report") explains a report line by line.

kernels/README.md documents the model and its limits. Builds are cached by a hash of every input
in $CUTP_CACHE_DIR/cuda_emu (or a temporary directory).
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import hashlib
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = [
    "EmulatedModule",
    "EmulatedKernel",
    "SCHEDULES",
    "EmulationError",
    "CompileError",
    "KernelArgumentError",
    "LaunchConfigError",
    "BarrierError",
    "OutOfBoundsError",
    "SharedMemoryRaceError",
    "KernelFault",
    "DeviceAssertError",
    "EmulationTimeout",
    "ArrayTraffic",
    "LaunchTraffic",
    "record_traffic",
    "LAUNCH_COUNTS",
]

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
KERNELS_DIR = REPO_ROOT / "kernels"
RUNTIME_SOURCE = HERE / "cuda_emu_runtime.cpp"
HEADER = HERE / "cuda_emu.h"

SCHEDULES = ("forward", "reverse", "random", "warp-forward", "warp-reverse", "warp-random")
_SCHEDULE_CODES = {name: code for code, name in enumerate(SCHEDULES)}

# -Wvla: CUDA has no variable-length arrays. -fno-strict-aliasing: kernels reinterpret_cast
# float/bf16 arrays to float4/int4, which GPUs allow and g++'s aliasing rules would punish.
# -fno-extern-tls-init: `extern __shared__` arrays are TLS and never need dynamic init.
# -ffp-contract: see _fp_flags.
# -Wno-unknown-pragmas: CUDA's `#pragma unroll` is meaningless to g++ but must compile.
# -Wno-volatile: `v[i] += ...` on volatile shared memory is deprecated in C++20 only; NVRTC and
# NVCC compile C++17 by default.
# -fstack-clash-protection: a large local array probes each stack page, so overflowing an
# emulated thread's stack hits its guard page instead of silently landing in a neighbour's stack.
CXX_FLAGS = (
    "-std=c++20",
    "-O2",
    "-fPIC",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wvla",
    "-Wno-unknown-pragmas",
    "-Wno-volatile",
    "-fno-strict-aliasing",
    "-fno-extern-tls-init",
    "-fno-math-errno",
    "-fstack-clash-protection",
    "-fvisibility=hidden",
    "-pthread",
)
# Checked builds: g++'s thread-sanitizer instrumentation makes every load and store of kernel
# code call __tsan_readN / __tsan_writeN(address), which the emulator's runtime defines; the
# module is linked without the sanitizer's own runtime. -g1: line tables for the source lines of
# reports. -fsanitize=bounds with traps (no runtime either): an index past a thread's local array of
# known size (`float v[P]; v[k]` with k == P) executes a trap, reported as a KernelFault (SIGILL);
# such an overrun on a GPU reads or writes another register or local-memory slot, silently.
CHECK_FLAGS = (
    "-fsanitize=thread",
    "--param", "tsan-instrument-func-entry-exit=0",
    "-fsanitize=bounds",
    "-fsanitize-undefined-trap-on-error",
    "-g1",
)
_EMU_VERSION = "cuda_emu-4"  # bump to invalidate every cached build


def _host_has_fma() -> bool:
    import platform

    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " fma" in line for line in f)
    except OSError:
        return False


def _fp_flags() -> tuple[str, ...]:
    """Floating-point contraction as nvcc does it by default (--fmad=true: a multiply feeding an
    add becomes one FMA, also across statements): -ffp-contract=fast with the host's FMA
    instructions (-mfma on x86-64). Without FMA in hardware, no contraction (off), and results
    may differ from the GPU's by the rounding of the products. $CUTP_EMU_FP_CONTRACT=off forces
    that. The __f*_rn intrinsics are never contracted, as with nvcc (cuda_emu.h).

    -fno-tree-slp-vectorize: with AVX enabled (-mfma implies it), g++ 12 merges load_chunk's two
    branches (a 16-byte int4 load when the address is aligned, four float loads when not) into
    one aligned vector load, which faults on the unaligned path (bias_gelu_backward at C=9)."""
    if os.environ.get("CUTP_EMU_FP_CONTRACT", "fast") == "off" or not _host_has_fma():
        return ("-ffp-contract=off",)
    import platform

    if platform.machine().lower() in ("x86_64", "amd64"):
        return ("-ffp-contract=fast", "-mfma", "-fno-tree-slp-vectorize")
    return ("-ffp-contract=fast",)

GUARD_BYTES = 64 * 1024  # poisoned bytes before and after each array argument
_GUARD_PATTERN = np.frombuffer(b"\xa5\xff" * (GUARD_BYTES // 2), dtype=np.uint8)  # NaN as fp32/bf16/fp16
_ALIGN = 256  # cudaMalloc's alignment; views keep their offset modulo this

# CUDA limits (compute capability 8.0 / 9.0).
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIM = (1024, 1024, 64)
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)
# Shared memory per block, static + dynamic, as a device enforces it: 48 KiB unless the kernel's
# cudaFuncAttributeMaxDynamicSharedMemorySize (CuPy: kernel.max_dynamic_shared_size_bytes) is
# raised, and at most the architecture's opt-in maximum (sm_90: 227 KiB; sm_80: 163 KiB) with it.
DEFAULT_MAX_DYNAMIC_SHARED = 48 * 1024  # without cudaFuncAttributeMaxDynamicSharedMemorySize
MAX_DYNAMIC_SHARED_OPT_IN = 227 * 1024  # sm_90 (sm_80: 163 KiB)

DEFAULT_TIMEOUT_S = float(os.environ.get("CUTP_EMU_TIMEOUT", "60"))
DEFAULT_STACK_KB = int(os.environ.get("CUTP_EMU_STACK_KB", "256"))


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
class EmulationError(RuntimeError):
    """Base class of everything the emulator reports about a kernel or its launch."""


class CompileError(EmulationError):
    """g++ rejected the sources (the message holds its diagnostics)."""


class KernelArgumentError(EmulationError, TypeError):
    """An argument does not match the kernel's C signature."""


class LaunchConfigError(EmulationError, ValueError):
    """Grid, block or shared memory size outside CUDA's limits."""


class BarrierError(EmulationError):
    """Divergent __syncthreads(), a warp operation with missing or diverging lanes."""


class OutOfBoundsError(EmulationError):
    """The kernel read or wrote outside an array argument, a static __shared__ array or its
    dynamic shared memory."""


class SharedMemoryRaceError(EmulationError):
    """Two threads accessed a shared byte, at least one writing, with no barrier between them."""


class KernelFault(EmulationError):
    """The kernel crashed (SIGSEGV, SIGBUS, SIGFPE, ...) or a C++ exception escaped it."""


class DeviceAssertError(EmulationError):
    """A device-side assert() failed or __trap() was called."""


class EmulationTimeout(EmulationError):
    """The launch did not finish in time (an infinite loop or a spin-wait)."""


_RUNTIME_ERRORS = {
    1: BarrierError,
    2: KernelFault,
    3: DeviceAssertError,
    4: EmulationTimeout,
    5: OutOfBoundsError,
    6: LaunchConfigError,
    7: KernelFault,
    8: SharedMemoryRaceError,
}


# ------------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------------
def _cache_dir() -> Path:
    base = os.environ.get("CUTP_CACHE_DIR")
    root = Path(base) if base else Path(tempfile.gettempdir()) / f"cutp-cache-{os.getuid()}"
    d = root / "cuda_emu"
    d.mkdir(parents=True, exist_ok=True)
    return d


_compiler_id_cache: dict[str, str] = {}


def _compiler_id(cxx: str) -> str:
    if cxx not in _compiler_id_cache:
        try:
            out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise CompileError(f"the C++ compiler {cxx!r} does not run ({e}); the CUDA emulator needs g++ >= 12 "
                               "(apt install g++, dnf install gcc-c++, or point CUTP_EMU_CXX at one)") from e
        _compiler_id_cache[cxx] = out.splitlines()[0] if out else cxx
    return _compiler_id_cache[cxx]


# The compiler runs in progress (the session's warm-up thread's among them). Each runs in a process
# group of its own, so that stopping it stops the cc1plus / as its driver started too.
_compiling: set = set()
_compiling_lock = threading.Lock()
_stopping = False  # (set on the way out: no compile starts after the last ones were stopped)


@atexit.register
def _stop_compiling() -> None:
    """A session that ends early (pytest -x, a failure, SIGTERM / SIGHUP: `stop_compiles_on_signals`)
    stops the compiles still running: the warm-up thread is a daemon and dies with the process,
    its compiler would not (each was left running, orphaned; a mutation campaign's runs piled up
    33 of them)."""
    global _stopping
    with _compiling_lock:
        _stopping = True
        running = list(_compiling)
    for proc in running:
        _kill_group(proc)


def _kill_group(proc) -> None:
    if proc.returncode is None:  # (a reaped process's group id may belong to another by now)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)


def stop_compiles_on_signals(signals=(signal.SIGTERM, signal.SIGHUP)) -> None:
    """Makes these signals stop the compiles first, then act as they did (the handler that was
    there, or the default: end the process). A compile's own process group no longer gets the
    signals its session's group gets (`timeout`, a hang-up, a cancelled CI job), so they are
    passed on here. A signal the process ignores (nohup's SIGHUP) stays ignored. Main thread only
    (Python's signal handlers)."""
    for sig in signals:
        before = signal.getsignal(sig)
        if before == signal.SIG_IGN:
            continue

        def handler(signum, frame, before=before):
            _stop_compiling()
            if callable(before):
                before(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> str:
    with _compiling_lock:
        if _stopping:
            raise CompileError(f"{what}: not started, the process is ending")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                start_new_session=True)
        _compiling.add(proc)
    try:
        out, err = proc.communicate()
    except BaseException:  # (Ctrl-C: its own process group does not get the terminal's signal)
        _kill_group(proc)
        proc.wait()
        raise
    finally:
        with _compiling_lock:
            _compiling.discard(proc)
    if proc.returncode != 0:
        diag = (err or out).strip()
        if len(diag) > 12000:
            diag = diag[:12000] + "\n... (truncated)"
        raise CompileError(f"{what} failed:\n{diag}\n\ncommand: {' '.join(cmd)}")
    return out


def _atomic_write_bytes(dest: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, dest)


_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.M)


def _hash_included_files(h: "hashlib._Hash", sources: Sequence[Path], include_dirs: Sequence[Path]) -> None:
    """Hashes every file the sources include, transitively: each `#include "..."` or `<...>` that
    resolves against the including file's directory or an include directory (system headers do
    not resolve there; the compiler's id covers them). A textual scan, so a header included under
    a disabled #if is hashed too: that can only cost an extra build, never reuse a stale one."""
    seen: set[Path] = set()
    stack = list(sources)
    while stack:
        f = stack.pop()
        for name in _INCLUDE_RE.findall(f.read_text(errors="replace")):
            for d in (f.parent, *include_dirs):
                p = d / name
                if p.is_file():
                    p = p.resolve()
                    if p not in seen:
                        seen.add(p)
                        stack.append(p)
                    break
    for p in sorted(seen):
        h.update(str(p).encode() + b"\0" + p.read_bytes() + b"\0")


_build_lock = threading.Lock()  # loading a library
# One build per cache key at a time: a second thread asking for a build in progress waits for it
# and then finds it in the cache; builds of different keys run side by side (tests/conftest.py's
# warm-up builds in a thread while the tests build what they need now).
_key_locks: dict[str, threading.Lock] = {}
_key_locks_guard = threading.Lock()


def _key_lock(name: str) -> threading.Lock:
    with _key_locks_guard:
        return _key_locks.setdefault(name, threading.Lock())


def _runtime_object(cxx: str, extra_flags: Sequence[str]) -> Path:
    """The runtime compiled once per flag set; every module links it."""
    h = hashlib.sha256()
    for part in (_EMU_VERSION, _compiler_id(cxx), *CXX_FLAGS, *extra_flags):
        h.update(part.encode() + b"\0")
    h.update(RUNTIME_SOURCE.read_bytes() + HEADER.read_bytes())
    obj = _cache_dir() / f"runtime-{h.hexdigest()[:24]}.o"
    with _key_lock(obj.name):
        if not obj.exists():
            with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
                out = Path(tmp) / "runtime.o"
                _run(
                    [cxx, *CXX_FLAGS, *extra_flags, "-U_FORTIFY_SOURCE", "-I", str(HERE), "-c", str(RUNTIME_SOURCE),
                     "-o", str(out)],
                    "compiling the emulator runtime",
                )
                os.replace(out, obj)
    return obj


def _balanced(text: str, pos: int) -> tuple[str, int]:
    """text[pos] == '(' -> (inside, index after the matching ')')."""
    depth = 0
    for i in range(pos, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : i], i + 1
    raise CompileError("unbalanced parentheses in __launch_bounds__")


_LB_RE = re.compile(r"\s*__cuda_emu_launch_bounds__\s*(?=\()")
_KERNEL_RE = re.compile(r'extern\s*"C"\s*__cuda_emu_global__\b')
_VOID_RE = re.compile(r"\s*void\b")
_NAME_RE = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")


def _int_expr(expr: str) -> int | None:
    """Value of a literal integer expression such as `256` or `(2*128)`, else None."""
    expr = re.sub(r"(?<=\d)[uUlL]+\b", "", expr.strip())
    if not re.fullmatch(r"[\d\s()+\-*/%]+", expr):
        return None
    try:
        return int(eval(expr.replace("/", "//"), {"__builtins__": {}}))  # digits and operators only
    except Exception:
        return None


def _launch_bounds(text: str, pos: int) -> tuple[int | None, int]:
    m = _LB_RE.match(text, pos)
    if not m:
        return None, pos
    inside, end = _balanced(text, m.end())
    depth, first = 0, inside
    for i, c in enumerate(inside):  # first top-level argument
        depth += c == "("
        depth -= c == ")"
        if c == "," and depth == 0:
            first = inside[:i]
            break
    return _int_expr(first), end


def _scan_kernels(preprocessed: str) -> dict[str, int | None]:
    """{kernel name: maxThreadsPerBlock from __launch_bounds__ or None}, in source order."""
    found: dict[str, int | None] = {}
    for m in _KERNEL_RE.finditer(preprocessed):
        bounds, pos = _launch_bounds(preprocessed, m.end())
        v = _VOID_RE.match(preprocessed, pos)
        if not v:
            continue  # not a kernel definition we can register; g++ reports real mistakes
        bounds2, pos = _launch_bounds(preprocessed, v.end())
        n = _NAME_RE.match(preprocessed, pos)
        if n:
            name = n.group(1)
            b = bounds if bounds is not None else bounds2
            if found.get(name) is None:
                found[name] = b
    return found


_UND_TLS_RE = re.compile(r"^\s*\d+:\s+[0-9a-fA-F]+\s+\d+\s+TLS\s+\w+\s+\w+\s+UND\s+(\S+)\s*$", re.M)

# NVRTC options that have no meaning for the emulation and are accepted silently.
_IGNORED_OPTION_PREFIXES = (
    "-std=", "--std=", "-arch", "--gpu-architecture", "-use_fast_math", "--use_fast_math", "-lineinfo",
    "--generate-line-info", "-G", "--device-debug", "--fmad", "-fmad", "-ftz", "--ftz", "-prec-div", "--prec-div",
    "-prec-sqrt", "--prec-sqrt", "--extra-device-vectorization", "-extra-device-vectorization", "-default-device",
    "--device-as-default-execution-space", "-restrict", "--restrict", "-maxrregcount", "--maxrregcount", "-dopt",
    "--dopt", "-w", "--disable-warnings", "--diag-suppress", "-diag-suppress", "-Xptxas", "--ptxas-options",
    "-dw", "--dw", "-default-device", "-rdc=false", "--relocatable-device-code=false",
)


def _translate_options(options: Iterable[str]) -> list[str]:
    """NVRTC options -> g++ options: -D/-U/-I pass through, code-generation options are dropped."""
    out: list[str] = []
    opts = list(options)
    i = 0
    while i < len(opts):
        o = str(opts[i])
        if o in ("-D", "-U", "-I", "--define-macro", "--undefine-macro", "--include-path"):
            if i + 1 >= len(opts):
                raise CompileError(f"option {o} needs a value")
            flag = {"--define-macro": "-D", "--undefine-macro": "-U", "--include-path": "-I"}.get(o, o)
            out += [flag, str(opts[i + 1])]
            i += 2
            continue
        for long, short in (("--define-macro=", "-D"), ("--undefine-macro=", "-U"), ("--include-path=", "-I")):
            if o.startswith(long):
                out.append(short + o[len(long):])
                break
        else:
            if o.startswith(("-D", "-U", "-I")):
                out.append(o)
            elif not o.startswith(_IGNORED_OPTION_PREFIXES):
                raise CompileError(
                    f"option {o!r} is not understood by the CUDA emulator; it accepts -D/-U/-I and ignores NVRTC "
                    "code-generation options (pass g++ flags through cxx_flags=)"
                )
        i += 1
    return out


@dataclass(frozen=True)
class _Build:
    library: Path
    kernels: dict[str, int | None]
    shared_vars: list  # [name, offset in the TLS block, size] of each static __shared__ variable
    static_smem: dict[str, int]  # kernel name: bytes of static __shared__ variables it reaches


# readelf -sW -C: "  12: 0000000000001000   128 TLS     LOCAL  DEFAULT   22 name"
_TLS_SYM_RE = re.compile(r"^\s*\d+:\s+([0-9a-fA-F]+)\s+(\d+)\s+TLS\s+\w+\s+\w+\s+\d+\s+(.+?)\s*$", re.M)


_SYM_RE = re.compile(r"^\s*\d+:\s+[0-9a-fA-F]+\s+(\d+)\s+(\w+)\s+\w+\s+\w+\s+(\w+)\s+(\S+)\s*$")
_RELA_SECTION_RE = re.compile(r"^Relocation section '\.rela(\.text\.[^']+)'")


def _static_shared_bytes(readelf: str, kernels) -> dict[str, int]:
    """Bytes of static __shared__ variables each kernel reaches through its calls, as the GPU
    counts a kernel's static shared memory: from `readelf -sW -rW` of an object compiled with
    -ffunction-sections -fdata-sections (a .rela.text.F section lists what function F refers to:
    functions it calls, thread-local variables it addresses)."""
    tls: dict[str, int] = {}
    refs: dict[str, set[str]] = {}
    current = None
    for line in readelf.splitlines():
        m = _RELA_SECTION_RE.match(line)
        if m:
            current = refs.setdefault(m.group(1), set())
            continue
        if line.startswith(("Relocation section", "Symbol table")):
            current = None
        sym = _SYM_RE.match(line)
        if sym and sym.group(2) == "TLS" and sym.group(3) != "UND":
            tls[sym.group(4)] = int(sym.group(1))
            continue
        parts = line.split()
        if current is not None and len(parts) >= 5 and parts[2].startswith("R_"):
            current.add(parts[4])

    def node(name: str) -> str:
        for prefix in (".tbss.", ".tdata."):
            if name.startswith(prefix) and name[len(prefix):] in tls:
                return name[len(prefix):]
        return name if name in tls or name.startswith(".text.") else ".text." + name

    out = {}
    for k in kernels:
        seen, stack = set(), [".text." + k]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack += [node(r) for r in refs.get(n, ())]
        out[k] = sum(tls[n] for n in seen if n in tls)
    return out


def _shared_vars(library: Path) -> list:
    syms = _run(["readelf", "-sW", "-C", str(library)], "reading the module's symbols")
    found = {}
    for value, size, name in _TLS_SYM_RE.findall(syms):
        if int(size) > 0 and name != "cuda_emu_dynamic_smem":
            found[int(value, 16)] = [name, int(value, 16), int(size)]
    return [found[k] for k in sorted(found)]


def _build(sources: list[Path], defines: list[str], cxx_flags: list[str], cxx: str, checks: bool = True) -> _Build:
    include_dirs = [KERNELS_DIR, HERE]
    for i, f in enumerate(defines):
        if f == "-I":
            include_dirs.append(Path(defines[i + 1]))
        elif f.startswith("-I") and len(f) > 2:
            include_dirs.append(Path(f[2:]))
    h = hashlib.sha256()
    for part in (_EMU_VERSION, _compiler_id(cxx), *CXX_FLAGS, *_fp_flags(), *defines, "|", *cxx_flags,
                 f"checks={checks}"):
        h.update(part.encode() + b"\0")
    for s in sources:
        h.update(str(s).encode() + b"\0" + s.read_bytes() + b"\0")
    _hash_included_files(h, sources, include_dirs)
    h.update(RUNTIME_SOURCE.read_bytes() + HEADER.read_bytes())
    key = h.hexdigest()[:24]
    cache = _cache_dir()
    lib, meta = cache / f"module-{key}.so", cache / f"module-{key}.json"
    with _key_lock(key):
        if lib.exists() and meta.exists():
            m = json.loads(meta.read_text())
            return _Build(lib, m["kernels"], m["shared_vars"], m["static_smem"])
        return _build_into(sources, defines, cxx_flags, cxx, checks, lib, meta)


def _build_into(sources: list[Path], defines: list[str], cxx_flags: list[str], cxx: str, checks: bool,
                lib: Path, meta: Path) -> _Build:
    cache = lib.parent
    runtime = _runtime_object(cxx, cxx_flags)
    incs = ["-I", str(KERNELS_DIR), "-I", str(HERE)]
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        t = Path(tmp)
        # One translation unit for all sources, as NVRTC compiles one (concatenated) program.
        includes = "".join(f'#include "{s}"\n' for s in sources)
        (t / "scan.cpp").write_text(includes)
        pre = _run(
            [cxx, "-std=c++20", "-E", "-P", "-DCUDA_EMU_SCAN", *incs, *defines, str(t / "scan.cpp")],
            "preprocessing the kernel sources",
        )
        kernels = _scan_kernels(pre)
        unit = includes + "\n// Generated by tests/cuda_emu: exported descriptions of the kernels found above.\n"
        unit += "".join(f"CUDA_EMU_REGISTER_KERNEL({k})\n" for k in kernels)
        (t / "unit.cpp").write_text(unit)
        check_flags = CHECK_FLAGS if checks else ()
        # A section per function and variable: the relocations then tell which static shared
        # variables each kernel reaches (_static_shared_bytes).
        _run([cxx, *CXX_FLAGS, *_fp_flags(), *check_flags, "-ffunction-sections", "-fdata-sections", *cxx_flags,
              *incs, *defines,
              "-c", str(t / "unit.cpp"), "-o", str(t / "unit.o")],
             "compiling the kernels with g++")
        # Every undefined thread-local symbol is an `extern __shared__` array: alias it to the
        # runtime's dynamic shared memory buffer.
        syms = _run(["readelf", "-sW", "-rW", str(t / "unit.o")], "reading the kernel object's symbols")
        smem = sorted(set(_UND_TLS_RE.findall(syms)))
        static_smem = _static_shared_bytes(syms, kernels)
        link = [cxx, "-shared", "-pthread", "-o", str(t / "module.so"), str(t / "unit.o"), str(runtime),
                "-Wl,-z,defs", *(f"-Wl,--defsym={n}=cuda_emu_dynamic_smem" for n in smem)]
        try:
            _run(link, "linking the emulated module")
        except CompileError as e:
            raise CompileError(
                f"{e}\n\n(An `extern __shared__` array must be declared in a function of the global namespace.)"
            ) from None
        shared_vars = _shared_vars(t / "module.so")
        os.replace(t / "module.so", lib)
        _atomic_write_bytes(meta, json.dumps({"kernels": kernels, "sources": [str(s) for s in sources],
                                              "shared_vars": shared_vars, "static_smem": static_smem}).encode())
    return _Build(lib, kernels, shared_vars, static_smem)


# ------------------------------------------------------------------------------------------------
# The loaded library
# ------------------------------------------------------------------------------------------------
class _ParamDesc(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_char),
        ("is_pointer", ctypes.c_ubyte),
        ("is_const", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte),
        ("size", ctypes.c_uint32),
        ("elem_size", ctypes.c_uint32),
        ("elem_count", ctypes.c_uint32),
        ("type_name", ctypes.c_char_p),
    ]


class _KernelDesc(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("nparams", ctypes.c_uint32),
        ("name", ctypes.c_char_p),
        ("invoke", ctypes.c_void_p),
        ("params", ctypes.POINTER(_ParamDesc)),
    ]


_ABI_VERSION = 1
_loaded: dict[Path, ctypes.CDLL] = {}
# One launch at a time in the whole process: the runtime installs process-wide signal handlers
# for the duration of a launch, and emulation is single-threaded anyway.
_launch_lock = threading.Lock()


def _load(path: Path, shared_vars: list = ()) -> ctypes.CDLL:
    lib = _loaded.get(path)
    if lib is None:
        lib = ctypes.CDLL(str(path))
        lib.cuda_emu_runtime_abi.restype = ctypes.c_uint32
        if lib.cuda_emu_runtime_abi() != _ABI_VERSION:
            raise EmulationError(f"{path}: runtime ABI {lib.cuda_emu_runtime_abi()} != {_ABI_VERSION}")
        lib.cuda_emu_launch.restype = ctypes.c_int
        lib.cuda_emu_launch.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint64,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_double, ctypes.c_uint64, ctypes.c_char_p,
            ctypes.c_uint64,
        ]
        lib.cuda_emu_static_smem_bytes.restype = ctypes.c_uint64
        lib.cuda_emu_set_buffers.restype = None
        lib.cuda_emu_set_buffers.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.cuda_emu_buffer_traffic.restype = ctypes.c_uint64
        lib.cuda_emu_buffer_traffic.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
        n = len(shared_vars)
        names = (ctypes.c_char_p * max(1, n))(*(v[0].encode() for v in shared_vars))
        lib.cuda_emu_set_shared_vars.restype = None
        lib.cuda_emu_set_shared_vars(ctypes.c_uint64(n), (ctypes.c_uint64 * max(1, n))(*(v[1] for v in shared_vars)),
                                     (ctypes.c_uint64 * max(1, n))(*(v[2] for v in shared_vars)), names)
        _loaded[path] = lib
    return lib


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One kernel parameter as g++ sees it."""

    index: int
    type_name: str
    kind: str  # f float, B bf16, i/u int, b bool, c char (raw bytes), v void, o other
    is_pointer: bool
    is_const: bool
    size: int
    elem_size: int
    elem_count: int

    def __str__(self) -> str:
        return f"argument {self.index} ({self.type_name})"


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _expected_dtypes(p: Param) -> str:
    k, s = p.kind, p.elem_size
    names = {
        ("f", 4): "float32", ("f", 8): "float64", ("B", 2): "ml_dtypes.bfloat16", ("b", 1): "bool",
        ("i", 1): "int8", ("i", 2): "int16", ("i", 4): "int32", ("i", 8): "int64",
        ("u", 1): "uint8", ("u", 2): "uint16", ("u", 4): "uint32", ("u", 8): "uint64",
    }
    return names.get((k, s), f"a {s}-byte {k!r} type")


def _dtype_matches(p: Param, dt: np.dtype) -> bool:
    if p.kind in ("v", "c"):
        return True  # void*, char*, unsigned char*: raw bytes of any array
    if p.kind == "B":
        return dt == _bfloat16()
    if p.kind == "o":
        return dt.itemsize == p.elem_size * p.elem_count or dt.kind == "V"
    if dt.itemsize != p.elem_size:
        return False
    return {"f": dt.kind == "f", "b": dt.kind == "b", "i": dt.kind == "i", "u": dt.kind == "u"}[p.kind]


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"ndarray(dtype={x.dtype}, shape={x.shape})"
    if isinstance(x, np.generic):
        return f"np.{type(x).__name__}({x!r})"
    return f"{type(x).__name__} {x!r}"


def _scalar_bytes(kname: str, p: Param, x: Any) -> bytes:
    """The bytes CuPy would pass for scalar x, after checking they fit parameter p."""
    where = f"{kname}: {p}"
    if isinstance(x, np.ndarray):
        raise KernelArgumentError(f"{where} is passed by value but got {_describe(x)}; pass a NumPy scalar such as np.{_numpy_scalar_for(p)}(...)")
    if p.is_pointer:
        raise KernelArgumentError(f"{where} is a pointer: pass a NumPy array (or None for a null pointer), not {_describe(x)}")
    # CuPy's conversion of Python scalars (cupy/cuda/function.pyx, _pointer).
    if isinstance(x, np.generic):
        v = x
    elif isinstance(x, int):  # bool included, as in CuPy
        v = np.int64(x)
    elif isinstance(x, float):
        v = np.float64(x)
    else:
        raise KernelArgumentError(f"{where}: unsupported argument type {_describe(x)}")
    dt = v.dtype
    hint = f"pass np.{_numpy_scalar_for(p)}(...)"
    pyhint = " (CuPy passes a Python int as int64 and a float as float64)" if not isinstance(x, np.generic) else ""
    if p.kind in ("B", "o") or p.elem_count != 1:
        raise KernelArgumentError(f"{where}: CuPy cannot pass this type by value; pass a float/int and convert in the kernel")
    if p.kind == "f":
        if dt.kind != "f" or dt.itemsize != p.size:
            raise KernelArgumentError(f"{where} expects a {p.size}-byte float, got {_describe(x)}{pyhint}; {hint}")
    elif p.kind == "b":
        if dt.kind != "b":
            raise KernelArgumentError(f"{where} expects a bool, got {_describe(x)}{pyhint}; {hint}")
    elif p.kind in ("i", "u", "c"):
        if dt.kind not in "iu" or dt.itemsize != p.size:
            raise KernelArgumentError(f"{where} expects a {p.size}-byte integer, got {_describe(x)}{pyhint}; {hint}")
        signed = p.kind == "i" or (p.kind == "c" and "unsigned" not in p.type_name)
        info = np.iinfo(f"{'i' if signed else 'u'}{p.size}")
        iv = int(v)
        if not info.min <= iv <= info.max:
            raise KernelArgumentError(f"{where}: value {iv} does not fit the parameter type; {hint}")
        return iv.to_bytes(p.size, "little", signed=signed)
    else:
        raise KernelArgumentError(f"{where}: unsupported parameter kind {p.kind!r}")
    return v.tobytes()


def _numpy_scalar_for(p: Param) -> str:
    k, s = p.kind, p.size if not p.is_pointer else p.elem_size
    return {
        ("f", 4): "float32", ("f", 8): "float64", ("b", 1): "bool_", ("i", 1): "int8", ("i", 2): "int16",
        ("i", 4): "int32", ("i", 8): "int64", ("u", 1): "uint8", ("u", 2): "uint16", ("u", 4): "uint32",
        ("u", 8): "uint64", ("c", 1): "int8",
    }.get((k, s), "<matching type>")


def _root_address(a: np.ndarray) -> int:
    base = a
    while isinstance(base.base, np.ndarray):
        base = base.base
    return base.__array_interface__["data"][0]


class _Group:
    """Arrays whose memory overlaps share one guarded buffer, so aliasing is preserved."""

    def __init__(self, start: int, end: int, align_offset: int):
        self.start, self.end = start, end
        self.align_offset = align_offset
        self.members: list[tuple[Param, np.ndarray]] = []
        self.buffer: np.ndarray | None = None
        self.data_offset = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def host_view(self) -> np.ndarray:
        if self.nbytes == 0:
            return np.empty(0, np.uint8)
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.start))

    def stage(self) -> None:
        n = self.nbytes
        buf = np.empty(2 * GUARD_BYTES + n + _ALIGN, np.uint8)
        addr = buf.ctypes.data
        lo = addr + GUARD_BYTES
        data = lo + ((self.align_offset - lo) % _ALIGN)
        self.data_offset = data - addr
        buf[self.data_offset - GUARD_BYTES : self.data_offset] = _GUARD_PATTERN
        buf[self.data_offset : self.data_offset + n] = self.host_view()
        buf[self.data_offset + n : self.data_offset + n + GUARD_BYTES] = _GUARD_PATTERN
        self.buffer = buf

    def device_address(self, a: np.ndarray) -> int:
        return self.buffer.ctypes.data + self.data_offset + (a.__array_interface__["data"][0] - self.start)

    def data(self) -> np.ndarray:
        return self.buffer[self.data_offset : self.data_offset + self.nbytes]

    def damaged_guard(self) -> tuple[str, int] | None:
        """('before', d): the damaged guard byte nearest the data is d bytes before it (d >= 1);
        ('after', d): it is d bytes after the last byte of the data (d >= 0)."""
        pre = self.buffer[self.data_offset - GUARD_BYTES : self.data_offset]
        bad = np.flatnonzero(pre != _GUARD_PATTERN)
        if bad.size:
            return "before", GUARD_BYTES - int(bad[-1])
        post = self.buffer[self.data_offset + self.nbytes : self.data_offset + self.nbytes + GUARD_BYTES]
        bad = np.flatnonzero(post != _GUARD_PATTERN)
        if bad.size:
            return "after", int(bad[0])
        return None


def _buffer_table(groups: list[_Group]):
    """The runtime's view of the staged arrays: per group its data, guard regions, item size and
    a name for reports (cuda_emu_set_buffers)."""
    ranges = (ctypes.c_uint64 * max(1, 5 * len(groups)))()
    names = (ctypes.c_char_p * max(1, len(groups)))()
    for i, g in enumerate(groups):
        lo = g.buffer.ctypes.data + g.data_offset
        ranges[5 * i : 5 * i + 5] = [lo, lo + g.nbytes, lo - GUARD_BYTES, lo + g.nbytes + GUARD_BYTES,
                                     max(1, g.members[0][1].itemsize)]
        names[i] = ", ".join(f"{p} [{a.dtype}, {a.size} elements]" for p, a in g.members).encode()
    return ranges, names


_PC_RE = re.compile(r"\{pc:([0-9a-f]+)\}")


def _resolve_pcs(message: str, library: Path) -> str:
    """Replaces the runtime's {pc:OFFSET} tokens with source lines (addr2line on the module's
    line tables): 'common.cuh:66, inlined at layernorm.cu:98'."""
    pcs = sorted(set(_PC_RE.findall(message)))
    if not pcs:
        return message
    try:
        out = subprocess.run(["addr2line", "-i", "-a", "-e", str(library), *(hex(int(p, 16) - 1) for p in pcs)],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return message
    where: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("0x"):
            current = where.setdefault(format(int(line, 16) + 1, "x"), [])
        elif current is not None and ":" in line and not line.startswith("??"):
            path, _, rest = line.partition(":")
            current.append(f"{Path(path).name}:{rest.split(' ')[0]}")
    def text(m):
        lines = where.get(m.group(1)) or []
        # The generated unit and the emulator's kernel invoker are the outer frames of every access.
        lines = [w for w in lines if not w.startswith(("unit.cpp:", "cuda_emu.h:"))] or lines
        return ", inlined at ".join(lines) if lines else f"code offset 0x{m.group(1)} (no line table: checks off?)"
    return _PC_RE.sub(text, message)


def _group_arrays(arrays: list[tuple[Param, np.ndarray]]) -> list[_Group]:
    spans = []
    for p, a in arrays:
        start = a.__array_interface__["data"][0]
        spans.append((start, start + a.nbytes, p, a))
    spans.sort(key=lambda s: (s[0], s[1]))
    groups: list[_Group] = []
    for start, end, p, a in spans:
        g = groups[-1] if groups else None
        if g is not None and a.nbytes > 0 and g.nbytes > 0 and start < g.end:
            g.end = max(g.end, end)
        else:
            g = _Group(start, end, (start - _root_address(a)) % _ALIGN)
            groups.append(g)
        g.members.append((p, a))
    return groups


# ------------------------------------------------------------------------------------------------
# Traffic counting
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArrayTraffic:
    """The global-memory traffic of one launch to one array: the bytes its accesses read and
    wrote (each access its size: a 128-bit load counts 16 bytes, a bf16 load 2; an atomic counts
    as a read and a write). Arguments whose memory overlaps (out=logits in place) share one
    entry: params lists them all. host_address / nbytes: the host array's memory."""

    params: tuple[int, ...]
    names: tuple[str, ...]
    host_address: int
    nbytes: int
    read: int
    written: int

    def overlaps(self, a: np.ndarray) -> bool:
        lo = a.__array_interface__["data"][0]
        return lo < self.host_address + self.nbytes and self.host_address < lo + a.nbytes


@dataclass(frozen=True)
class LaunchTraffic:
    """One launch of a checked build: the kernel, its grid and block, and per array argument
    its traffic (an ArrayTraffic per distinct piece of memory)."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    arrays: tuple[ArrayTraffic, ...]

    def param(self, index: int) -> ArrayTraffic:
        """The traffic of the array passed as parameter `index` (shared with its aliases)."""
        for t in self.arrays:
            if index in t.params:
                return t
        raise KeyError(f"{self.kernel}: parameter {index} is not an array of this launch (or was null)")

    def of(self, a: np.ndarray) -> tuple[int, int]:
        """(bytes read, bytes written) of the memory of host array `a` (0, 0 if not an argument)."""
        hits = [t for t in self.arrays if t.overlaps(a)]
        return sum(t.read for t in hits), sum(t.written for t in hits)


_recorders: list[list[LaunchTraffic]] = []
# Completed launches of every EmulatedModule of this process, by kernel name (tests/kernels/conftest.py
# notes which test launched each kernel: the check that every kernel ran in an emulated test).
LAUNCH_COUNTS: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def record_traffic():
    """``with record_traffic() as log:`` appends a LaunchTraffic to `log` for every launch of any
    checked EmulatedModule of this process inside the block (launches are serialized). Launches
    of an unchecked build (checks=False: no instrumentation, nothing to count) raise
    EmulationError inside the block instead of recording zeros."""
    log: list[LaunchTraffic] = []
    _recorders.append(log)
    try:
        yield log
    finally:
        _recorders.remove(log)


def _read_traffic(lib, name: str, groups: list["_Group"], g3, b3) -> LaunchTraffic:
    counts = (ctypes.c_uint64 * max(2, 2 * len(groups)))()
    n = lib.cuda_emu_buffer_traffic(len(groups), counts)
    if n != len(groups):
        raise EmulationError(f"kernel {name}: the runtime counted {n} buffers, the launch staged {len(groups)}")
    arrays = tuple(
        ArrayTraffic(tuple(p.index for p, _ in g.members), tuple(str(p) for p, _ in g.members), g.start, g.nbytes,
                     int(counts[2 * i]), int(counts[2 * i + 1]))
        for i, g in enumerate(groups))
    return LaunchTraffic(name, tuple(g3), tuple(b3), arrays)


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------
def _dim3(v: Any, what: str) -> tuple[int, int, int]:
    # cupy.cuda.function.Function.__call__(self, tuple grid, tuple block, ...):
    #     grid = (grid + (1, 1))[:3]; launch with max(1, grid[i])
    if not isinstance(v, tuple):
        raise TypeError(
            f"{what} must be a tuple of 1 to 3 ints, as cupy.RawKernel requires (got {type(v).__name__} {v!r})"
        )
    if not 1 <= len(v) <= 3:
        # CuPy silently drops dimensions beyond 3, and fails with an IndexError on ().
        raise LaunchConfigError(f"{what} {v!r} must have 1 to 3 dimensions")
    dims = []
    for x in (v + (1, 1))[:3]:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{what} {v!r} must contain ints, got {type(x).__name__}")
        dims.append(max(1, int(x)))
    return dims[0], dims[1], dims[2]


class EmulatedKernel:
    """A kernel of an EmulatedModule; called like cupy.RawKernel:
    `kernel(grid, block, args, shared_mem=0)`."""

    def __init__(self, module: "EmulatedModule", name: str, desc: "ctypes._Pointer[_KernelDesc]",
                 launch_bounds: int | None):
        self.module = module
        self.name = name
        self._desc = desc
        d = desc.contents
        if d.abi_version != _ABI_VERSION:
            raise EmulationError(f"kernel {name}: descriptor ABI {d.abi_version} != {_ABI_VERSION}")
        params = []
        for i in range(d.nparams):
            pd = d.params[i]
            m = re.search(r"\[with T = (.*)\]$", pd.type_name.decode())
            params.append(Param(i, m.group(1) if m else "?", pd.kind.decode(), bool(pd.is_pointer), bool(pd.is_const),
                                pd.size, pd.elem_size, pd.elem_count))
        self.params: tuple[Param, ...] = tuple(params)
        self.launch_bounds = launch_bounds
        self._static_shared = int(module._static_smem.get(name, 0))
        self._max_dynamic_shared: int | None = None  # the opt-in attribute, once set
        # the last successful launch's LaunchTraffic (checked builds; None before or unchecked)
        self.last_traffic: LaunchTraffic | None = None

    # Attributes of cupy.RawKernel that host code may consult.
    @property
    def max_threads_per_block(self) -> int:
        return self.launch_bounds or MAX_THREADS_PER_BLOCK

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        """cudaFuncAttributeMaxDynamicSharedMemorySize: 48 KiB minus the kernel's static shared
        memory until raised (as CUDA reports it)."""
        if self._max_dynamic_shared is None:
            return DEFAULT_MAX_DYNAMIC_SHARED - self._static_shared
        return self._max_dynamic_shared

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        # cuFuncSetAttribute fails when static + dynamic would exceed the opt-in maximum.
        if not 0 <= int(value) <= MAX_DYNAMIC_SHARED_OPT_IN - self._static_shared:
            raise LaunchConfigError(
                f"{self.name}: max_dynamic_shared_size_bytes {value} outside [0, "
                f"{MAX_DYNAMIC_SHARED_OPT_IN - self._static_shared}] (the device allows {MAX_DYNAMIC_SHARED_OPT_IN} "
                f"bytes of shared memory per block, and the kernel has {self._static_shared} bytes of static "
                "__shared__ variables)")
        self._max_dynamic_shared = int(value)

    @property
    def shared_size_bytes(self) -> int:
        """Static __shared__ bytes of this kernel: the variables it reaches through its calls
        (from the object's relocations), as CUDA counts them."""
        return self._static_shared

    num_regs = 0
    local_size_bytes = 0
    const_size_bytes = 0

    @property
    def signature(self) -> str:
        return f"{self.name}({', '.join(p.type_name for p in self.params)})"

    def __repr__(self) -> str:
        return f"<EmulatedKernel {self.signature}>"

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None,
                 enable_cooperative_groups: bool = False) -> None:
        del stream  # launches are synchronous; any stream is accepted, as CuPy does
        g3, b3 = _dim3(grid, "grid"), _dim3(block, "block")
        self._check_config(g3, b3, shared_mem, enable_cooperative_groups)
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"{self.name}: args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.params):
            raise KernelArgumentError(
                f"{self.name} takes {len(self.params)} arguments ({self.signature}), got {len(args)}"
            )

        slots = (ctypes.c_uint64 * (2 * max(1, len(args))))()  # 16 bytes per parameter value
        arrays: list[tuple[Param, np.ndarray]] = []
        for p, x in zip(self.params, args):
            if p.is_pointer and x is None:
                continue  # null pointer: the slot stays 0
            if p.is_pointer:
                arrays.append((p, self._check_array(p, x)))
            else:
                raw = _scalar_bytes(self.name, p, x)
                ctypes.memmove(ctypes.addressof(slots) + 16 * p.index, raw, len(raw))

        groups = _group_arrays(arrays)
        for g in groups:
            g.stage()
            for p, a in g.members:
                slots[2 * p.index] = g.device_address(a)
        argv = (ctypes.c_void_p * max(1, len(args)))(*(ctypes.addressof(slots) + 16 * i for i in range(len(args))))

        err = ctypes.create_string_buffer(16384)
        grid_c = (ctypes.c_uint32 * 3)(*g3)
        block_c = (ctypes.c_uint32 * 3)(*b3)
        mod = self.module
        ranges, names = _buffer_table(groups)
        with _launch_lock:
            mod._lib.cuda_emu_set_buffers(len(groups), ranges, names, int(mod.detect_races))
            rc = mod._lib.cuda_emu_launch(
                ctypes.cast(self._desc, ctypes.c_void_p), grid_c, block_c, int(shared_mem), argv,
                _SCHEDULE_CODES[mod.schedule], mod.seed & (2**64 - 1), float(mod.timeout), mod.stack_kb * 1024,
                err, len(err),
            )
            traffic = _read_traffic(mod._lib, self.name, groups, g3, b3) if mod.checks else None
        if rc != 0:
            cls = _RUNTIME_ERRORS.get(rc, EmulationError)
            msg = _resolve_pcs(err.value.decode(errors="replace"), mod.library_path)
            raise cls(f"kernel {self.name} (grid {g3}, block {b3}, {mod.schedule} schedule): {msg}")
        self._finish(groups, g3, b3)
        LAUNCH_COUNTS[self.name] += 1
        self.last_traffic = traffic
        if _recorders:
            if traffic is None:
                raise EmulationError(f"kernel {self.name}: traffic is counted by checked builds only (this module "
                                     "has checks=False)")
            for log in _recorders:
                log.append(traffic)

    def _check_config(self, g3, b3, shared_mem, coop) -> None:
        if coop:
            raise LaunchConfigError("cooperative launches are not emulated")
        for i, (b, lim) in enumerate(zip(b3, MAX_BLOCK_DIM)):
            if b > lim:
                raise LaunchConfigError(f"{self.name}: block dimension {'xyz'[i]} = {b} exceeds CUDA's limit {lim}")
        nthreads = b3[0] * b3[1] * b3[2]
        if nthreads > self.max_threads_per_block:
            why = "its __launch_bounds__" if self.launch_bounds else "CUDA's limit"
            raise LaunchConfigError(
                f"{self.name}: block {b3} has {nthreads} threads, more than {why} ({self.max_threads_per_block})"
            )
        for i, (gd, lim) in enumerate(zip(g3, MAX_GRID_DIM)):
            if gd > lim:
                raise LaunchConfigError(f"{self.name}: grid dimension {'xyz'[i]} = {gd} exceeds CUDA's limit {lim}")
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer)) or shared_mem < 0:
            raise LaunchConfigError(f"{self.name}: shared_mem must be a non-negative int, got {shared_mem!r}")
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise LaunchConfigError(
                f"{self.name}: shared_mem={shared_mem} bytes of dynamic shared memory exceed the "
                f"{self.max_dynamic_shared_size_bytes} bytes allowed; the kernel also has {self._static_shared} bytes "
                "of static __shared__ variables (a device allows 48 KiB of static + dynamic shared memory per block unless the kernel's "
                "max_dynamic_shared_size_bytes attribute is raised, and at most "
                f"{MAX_DYNAMIC_SHARED_OPT_IN // 1024} KiB with it)"
            )

    def _check_array(self, p: Param, x: Any) -> np.ndarray:
        where = f"{self.name}: {p}"
        if not isinstance(x, np.ndarray):
            raise KernelArgumentError(
                f"{where} is a pointer: pass a NumPy array (standing in for a CuPy array) or None, got {_describe(x)}"
            )
        if not x.flags.c_contiguous:
            raise KernelArgumentError(
                f"{where}: the array is not C-contiguous (shape {x.shape}, strides {x.strides}); a kernel sees only a "
                "base pointer, so CuPy would silently pass the wrong layout. Use np.ascontiguousarray"
            )
        if not _dtype_matches(p, x.dtype):
            raise KernelArgumentError(f"{where} expects an array of {_expected_dtypes(p)}, got {_describe(x)}")
        return x

    def _finish(self, groups: list[_Group], g3, b3) -> None:
        for g in groups:
            damage = g.damaged_guard()
            if damage is not None:
                side, dist = damage
                names = ", ".join(
                    f"{p} [{a.dtype}, {a.size} elements]" for p, a in g.members
                )
                last = g.members[-1][1] if side == "after" else g.members[0][1]
                itemsize = max(1, last.itemsize)
                if side == "after":
                    detail = f"a write {dist} byte(s) after the end"
                    if len(g.members) == 1:
                        detail += f" (element index {last.size + dist // itemsize} of a {last.size}-element array)"
                else:
                    detail = f"a write {dist} byte(s) before the start (element index {-((dist + itemsize - 1) // itemsize)})"
                raise OutOfBoundsError(
                    f"kernel {self.name} (grid {g3}, block {b3}) wrote out of bounds of {names}: {detail}. "
                    "Out-of-bounds reads go unnoticed unless they return the guard pattern (NaN)"
                )
        for g in groups:
            new = g.data()
            if g.nbytes == 0 or np.array_equal(new, g.host_view()):
                continue
            if all(p.is_const for p, _ in g.members):
                raise EmulationError(
                    f"kernel {self.name} modified memory it received only through const pointers: "
                    + ", ".join(str(p) for p, _ in g.members)
                )
            readonly = [p for p, a in g.members if not a.flags.writeable]
            if readonly:
                raise EmulationError(
                    f"kernel {self.name} wrote into read-only NumPy array(s): " + ", ".join(map(str, readonly))
                )
            g.host_view()[:] = new


def _source_paths(code: str | None, path) -> list[Path]:
    """The .cu files of EmulatedModule(code=, path=): path's files (relative to the working
    directory, else to the repository), then code written to a file of the cache named by its hash."""
    paths: list[Path] = []
    if path is not None:
        for p in [path] if isinstance(path, (str, os.PathLike)) else list(path):
            pp = Path(p)
            if not pp.is_absolute():
                pp = (Path.cwd() / pp) if (Path.cwd() / pp).exists() else REPO_ROOT / pp
            if not pp.is_file():
                raise FileNotFoundError(f"kernel source {p} not found")
            paths.append(pp.resolve())
    if code is not None:
        src = _cache_dir() / f"code-{hashlib.sha256(code.encode()).hexdigest()[:24]}.cu"
        if not src.exists():
            _atomic_write_bytes(src, code.encode())
        paths.append(src)
    if not paths:
        raise ValueError("EmulatedModule needs code= or path=")
    return paths


def prebuild(code: str | None = None, path=None, options: Sequence[str] = (), cxx_flags: Sequence[str] = (),
             checks: bool | None = None) -> None:
    """Builds into the cache what EmulatedModule with the same arguments loads, without loading
    it: the test session's background warm-up (tests/conftest.py), so a test's module is built
    while earlier tests run. A build in progress makes another of the same key wait for it."""
    if checks is None:
        checks = os.environ.get("CUTP_EMU_CHECKS", "1").strip().lower() not in ("0", "false", "no", "off")
    _build(_source_paths(code, path), _translate_options(options), list(cxx_flags),
           os.environ.get("CUTP_EMU_CXX", "g++"), bool(checks))


class EmulatedModule:
    """Stand-in for cupy.RawModule that runs the kernels on the CPU.

    code / path: CUDA source text, or one or more .cu files (compiled together as one program,
        like a concatenation passed to NVRTC); both may be given (path first).
    options: NVRTC options; -D/-U/-I are honoured, code-generation options ignored.
    schedule: order of emulated threads between barriers, one of SCHEDULES (default
        $CUTP_EMU_SCHEDULE or "forward"); the warp-* schedules let a warp run ahead of the others.
    seed: for the random schedules (also shuffles the order of blocks).
    checks: compile with access checks (out-of-bounds accesses, shared-memory races); default
        $CUTP_EMU_CHECKS or on. detect_races: False keeps the bounds checks only.
    timeout: seconds a launch may run before EmulationTimeout (default $CUTP_EMU_TIMEOUT or 60).
    cxx_flags: extra g++ flags, e.g. ("-O0", "-g") to debug a kernel with gdb.
    """

    def __init__(self, code: str | None = None, path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                 options: Sequence[str] = (), schedule: str | None = None, seed: int = 0, *,
                 name_expressions: Sequence[str] | None = None, timeout: float | None = None,
                 cxx_flags: Sequence[str] = (), stack_kb: int | None = None, backend: str = "nvrtc",
                 translate_cucomplex: bool = False, enable_cooperative_groups: bool = False, jitify: bool = False,
                 checks: bool | None = None, detect_races: bool = True):
        del backend, translate_cucomplex  # accepted for signature compatibility with cupy.RawModule
        if name_expressions:
            raise EmulationError("name_expressions are not supported: kernels are extern \"C\" entry points "
                                 "(see kernels/README.md)")
        if enable_cooperative_groups or jitify:
            raise EmulationError("cooperative groups and jitify are not emulated")
        if schedule is None:
            schedule = os.environ.get("CUTP_EMU_SCHEDULE", "forward")
        if schedule not in _SCHEDULE_CODES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if checks is None:
            checks = os.environ.get("CUTP_EMU_CHECKS", "1").strip().lower() not in ("0", "false", "no", "off")
        paths = _source_paths(code, path)
        self.code = code
        self.sources = tuple(paths)
        self.options = tuple(options)
        self.schedule = schedule
        self.seed = int(seed)
        self.checks = bool(checks)
        self.detect_races = bool(detect_races) and self.checks
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
        self.stack_kb = DEFAULT_STACK_KB if stack_kb is None else int(stack_kb)
        cxx = os.environ.get("CUTP_EMU_CXX", "g++")
        build = _build(list(paths), _translate_options(options), list(cxx_flags), cxx, self.checks)
        with _build_lock:
            self._lib = _load(build.library, build.shared_vars)
        self.library_path = build.library
        self._kernels_found = dict(build.kernels)
        self._static_smem = dict(build.static_smem)
        self._functions: dict[str, EmulatedKernel] = {}

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return tuple(self._kernels_found)

    def get_function(self, name: str) -> EmulatedKernel:
        fn = self._functions.get(name)
        if fn is None:
            if name not in self._kernels_found:
                defined = ", ".join(self._kernels_found) or 'no extern "C" __global__ functions'
                raise EmulationError(f"no kernel named {name!r} (CUDA_ERROR_NOT_FOUND); the module defines {defined}")
            getter = getattr(self._lib, f"cuda_emu_kernel__{name}")
            getter.restype = ctypes.POINTER(_KernelDesc)
            fn = EmulatedKernel(self, name, getter(), self._kernels_found[name])
            self._functions[name] = fn
        return fn

    def with_schedule(self, schedule: str, seed: int = 0) -> "EmulatedModule":
        """The same compiled module under another thread order (no recompilation)."""
        other = object.__new__(EmulatedModule)
        other.__dict__.update(self.__dict__)
        if schedule not in _SCHEDULE_CODES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        other.schedule, other.seed, other._functions = schedule, int(seed), {}
        return other

    def get_global(self, name: str):
        raise EmulationError("get_global (__device__/__constant__ variables set from the host) is not emulated")

    def __getattr__(self, name: str):
        """`module.gelu_forward(grid, block, shared_mem, *args)`: a kernel as a plain function,
        for tests that call kernels directly (the launchers use get_function, as with CuPy)."""
        if name.startswith("_") or name not in self.__dict__.get("_kernels_found", {}):
            raise AttributeError(f"{type(self).__name__} has no attribute or kernel {name!r}")
        kernel = self.get_function(name)

        def launch(grid, block, shared_mem, *args):
            return kernel(grid, block, args, shared_mem=shared_mem)

        launch.__name__ = name
        return launch

    def __repr__(self) -> str:
        return f"<EmulatedModule {[s.name for s in self.sources]} schedule={self.schedule} seed={self.seed}>"
