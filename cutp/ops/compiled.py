"""The compiled CPU kernels: C sources in ``kernels/cpu/`` (one per family), built at first use
with the system C compiler and loaded with ctypes.

Why C: the NumPy ops make one pass over memory per ufunc, and a step of the small presets is
bound by those passes (attention's scores, GeLU's polynomial, the norms' statistics), not by the
arithmetic. A C loop makes one pass where NumPy made five. Each op keeps its NumPy code as the
reference beside the call (llm.c's habit), and takes the C path only for float32 / float64 host
arrays of the layouts the kernel handles; everything else (bfloat16, the planner's shape-only
arrays, CuPy) stays on the array code.

Build: ``$CC`` (else ``cc``) with :data:`FLAGS`: ``-O3 -march=native`` for the vector units of
this machine, ``-fno-math-errno`` so that a comparison or a square root needs no errno handling;
NOT ``-ffast-math``: that would let the compiler reassociate sums, whose order we fix (the
kernels sum in written orders, so a result never depends on the thread count). The library goes
to a per-user cache, ``$CUTP_CACHE_DIR``, else ``$XDG_CACHE_HOME/cutp`` or ``~/.cache/cutp``, named by a hash of the
source, its headers, the compiler, the flags and this CPU's feature flags (``-march=native``), so a
changed source or machine builds anew and a second load compiles nothing. It is written under a
temporary name and renamed into place: ranks that build at once never load a half-written file;
a file that fails to load (corrupt, truncated by a crash) is built again.

Off: ``CUTP_CPU_KERNELS=0``, or no compiler, or a failed build: the NumPy path, with one line on
stderr saying so (once per process), never a traceback. ctypes releases the GIL during a call,
so the ops' thread pool (:func:`cutp.runtime.threads.parallel_map`) runs chunks of one kernel on
several cores.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from cutp import kernels as _kernel_package
from cutp.runtime.backend import get_array_module, on_host

from .common import parallel_map, row_blocks

SOURCE_DIR = Path(_kernel_package.__file__).resolve().parent / "cpu"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC")

_lock = threading.Lock()
_loaded: dict = {}  # (source name, cache path) -> the CDLL, or None when it cannot be had
_said: set = set()


def enabled() -> bool:
    """Whether the compiled kernels may be used (``CUTP_CPU_KERNELS`` is not ``0``)."""
    return os.environ.get("CUTP_CPU_KERNELS", "1") != "0"


def cache_dir() -> Path:
    """``$CUTP_CACHE_DIR`` (cutp's cache setting, as for the CUDA resources: the tests point it at
    their session's directory), else the per-user ``$XDG_CACHE_HOME/cutp`` (``~/.cache/cutp``)."""
    if os.environ.get("CUTP_CACHE_DIR"):
        return Path(os.environ["CUTP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cutp"


def compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def describe(build: bool = False) -> str:
    """What the CPU ops run, in one line (`python -m cutp info`, `bench kernels`' note): the
    compiled kernels, by which compiler into which cache, or why not. build=True builds (or
    loads) one library to say whether the build works here (seconds the first time)."""
    if not enabled():
        return "off (CUTP_CPU_KERNELS=0): the CPU ops run their NumPy code"
    cc = compiler()
    if cc is None:
        return (f"off: no C compiler ({os.environ.get('CC') or 'cc'}) found: the CPU ops run their NumPy code "
                "(install one, or set CC)")
    if build and library("activations") is None:
        return f"off: the build by {cc} failed (said above): the CPU ops run their NumPy code"
    return f"on: kernels/cpu compiled by {cc} into {cache_dir()}"


def _say_once(line: str):
    if line not in _said:
        _said.add(line)
        print(f"cutp: {line}", file=sys.stderr, flush=True)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def source_flags(name: str) -> tuple:
    """Flags a source asks for beyond :data:`FLAGS`, on a line ``/* cflags: ... */`` of its own
    (rotary.c: ``-ffp-contract=off``, so that its two products and one sum round as NumPy's do)."""
    for line in (SOURCE_DIR / f"{name}.c").read_text().splitlines():
        if line.startswith("/* cflags:") and line.endswith("*/"):
            return tuple(line[len("/* cflags:"):-2].split())
    return ()


def library_path(name: str, cc: str) -> Path:
    """The cache file of source ``kernels/cpu/<name>.c`` built by ``cc``: named by the hash of
    everything that makes the binary what it is."""
    h = hashlib.sha256()
    for p in [SOURCE_DIR / f"{name}.c"] + sorted(SOURCE_DIR.glob("*.h")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update("\0".join((cc, *FLAGS, platform.machine(), _cpu_flags())).encode())
    return cache_dir() / f"cpu-{name}-{h.hexdigest()[:20]}.so"


def _build(name: str, cc: str, path: Path):
    """Compiles into a temporary file beside ``path`` and renames it there (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, *source_flags(name), "-o", tmp, str(SOURCE_DIR / f"{name}.c")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[:200])
            raise OSError(f"{cc} failed on kernels/cpu/{name}.c: {first}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(path: Path, symbols) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    return lib if all(hasattr(lib, s) for s in symbols) else None


def library(name: str, symbols=()) -> ctypes.CDLL | None:
    """The loaded library of ``kernels/cpu/<name>.c`` (built into the cache first if needed), or
    None (off, no compiler, a failed build: said once on stderr). ``symbols``: entry points it must
    export (a cached file without them is built again). The ops ask on every call: after the first
    answer for a name (and the same CC, cache and source directories) a dict lookup."""
    if not enabled():
        _say_once("CUTP_CPU_KERNELS=0: the CPU ops run their NumPy code")
        return None
    key = (name, os.environ.get("CC"), os.environ.get("CUTP_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"), SOURCE_DIR)
    try:
        return _loaded[key]
    except KeyError:
        pass
    with _lock:
        if key not in _loaded:
            _loaded[key] = _find_or_build(name, symbols)
    return _loaded[key]


def _find_or_build(name: str, symbols) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        _say_once(f"no C compiler ({os.environ.get('CC') or 'cc'}) found: the CPU ops run their NumPy code "
                  "(install one, or set CC, for the compiled kernels)")
        return None
    path = library_path(name, cc)
    lib = _open(path, symbols) if path.exists() else None
    if lib is None:  # absent, or corrupt / half written by a crashed build: build it (again)
        try:
            _build(name, cc, path)
            lib = _open(path, symbols)
            if lib is None:
                raise OSError(f"the built {path} does not load or lacks {', '.join(symbols)}")
        except OSError as e:
            _say_once(f"{e}; the CPU ops run their NumPy code")
    return lib


# ---- calling ------------------------------------------------------------------------------------
def host_library(name: str, symbols, *arrays) -> ctypes.CDLL | None:
    """The library of ``kernels/cpu/<name>.c`` when ``arrays`` are C-contiguous host arrays (NumPy,
    or the planner's shape-only ones: their ops book the same buffers and make no call) of one
    dtype, float32 or float64; else None (the op's array code runs)."""
    dtype = arrays[0].dtype
    if suffix(dtype) is None or any(a.dtype != dtype or not a.flags.c_contiguous or a.size == 0 for a in arrays):
        return None  # (empty arrays too: nothing to compute, and their rows do not reshape)
    if not on_host(get_array_module(*arrays)):
        return None
    return library(name, symbols)


def entry(lib, name: str, dtype):
    """The entry point ``<name>_f32`` / ``_f64`` of ``lib`` for ``dtype``."""
    return getattr(lib, f"{name}_{suffix(dtype)}")


def pointers(*arrays):
    """ctypes pointers to the arrays' data (None: a NULL pointer)."""
    return [ctypes.c_void_p(None) if a is None else ctypes.c_void_p(a.ctypes.data) for a in arrays]


_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
_REAL = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def suffix(dtype) -> str | None:
    """The entry points' suffix for arrays of ``dtype`` (None: not a compiled dtype)."""
    return _SUFFIX.get(np.dtype(dtype))


def real(dtype, x):
    """A Python number as the kernel's REAL of ``dtype``."""
    return _REAL[np.dtype(dtype)](x)


def int64s(*values):
    """Python ints as the kernels' int64_t arguments (ctypes would pass a plain int as a C int)."""
    return [ctypes.c_int64(int(x)) for x in values]


def ptr(a) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def strides(a, ndim: int | None = None):
    """``a``'s strides in elements (the leading ``ndim`` - 1; the last must be 1) as int64[]."""
    st = [s // a.itemsize for s in a.strides]
    st = st[:-1] if ndim is None else st[: ndim - 1]
    return (ctypes.c_int64 * max(len(st), 1))(*st)


def writable(*outputs) -> bool:
    """Whether the kernels may write each of ``outputs``: writeable, and no axis of more than one
    element at stride 0 (a broadcast view: threads would race on its one element). Otherwise the
    NumPy path runs, which raises where NumPy does."""
    return all(getattr(a.flags, "writeable", True)  # (the planner's shape-only arrays: nothing is written)
               and all(st != 0 for n, st in zip(a.shape, a.strides) if n > 1) for a in outputs)


def rows_contiguous(*arrays) -> bool:
    """Whether each array's last axis is contiguous and its strides are whole elements (what the
    kernels' stride arguments describe)."""
    return all(a.shape[-1] <= 1 or a.strides[-1] == a.itemsize for a in arrays) and all(
        s % a.itemsize == 0 for a in arrays for s in a.strides)


def run_rows(xp, lib, name, dtype, arrays, scalars, N, C, parts=(), width=None, part_dtype=None):
    """The kernel ``name`` of ``lib`` over the row blocks of N rows in the ops' pool (NumPy only:
    shape-only arrays book their buffers and stop here), called as ``name(*arrays, *parts, C,
    *scalars, first_row, end_row)``; ``width``: the row width that sizes the blocks (default C).
    ``parts``: one flag per parameter-gradient argument after ``arrays`` (False: NULL, the
    parameter is absent); each present one gets a [blocks, C] array of the blocks' parts, summed
    in block order (so the result never depends on the thread count): returns those sums, None
    for the absent ones. ``part_dtype``: the parts' and their sum's dtype (the kernel's; default
    ``dtype``), the sums returned rounded to ``dtype``."""
    blocks = row_blocks(xp, N, C if width is None else width)
    wide = dtype if part_dtype is None else part_dtype
    part_arrays = [xp.empty((len(blocks), C), wide) if present else None for present in parts]
    if xp is np:
        fn = entry(lib, name, dtype)
        args = pointers(*arrays)
        tail = [real(dtype, v) for v in scalars]

        def run(i):
            own = pointers(*(None if p is None else p[i] for p in part_arrays))
            fn(*args, *own, *int64s(C), *tail, *int64s(blocks[i].start, blocks[i].stop))

        parallel_map(xp, run, range(len(blocks)))
    sums = []
    for p in part_arrays:
        total = None if p is None else xp.zeros(C, wide)
        for part in () if p is None else p:  # in block order
            total += part
        sums.append(None if total is None else total.astype(dtype, copy=False))
    return sums
