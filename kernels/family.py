"""A kernel family declared once: what each ``kernels/<op>.py`` says about itself, and the registry.

Each kernel family's launcher module (``kernels/<op>.py``; the shared column sum's in
``kernels/runtime.py``) ends with ``FAMILY = KernelFamily(...)``: its CUDA sources, its
launchers class, its entry points' occupancy targets, memory traffic and dynamic shared memory,
its kernel test files and the mutation classes that apply to its source. :func:`families` is
every declaration, found by scanning this package's modules for ``FAMILY``, and the registries
iterate over it:

* ``cutp.kernels.Launchers`` combines the ``launchers`` classes;
* ``cutp.kernels.resources.TARGETS`` / ``DYNAMIC_SHARED`` (tests/kernel_build, the README's
  resource table) and ``tools/kernel_resources.py``'s ``TRAFFIC`` merge ``targets``,
  ``dynamic_shared`` and ``traffic``;
* ``tools/mutate_kernels.py`` runs, for a mutant of a source, the ``tests`` of every family whose
  ``sources`` name it (``mutation_classes``: the source-specific bug classes that apply,
  ``quick_tests``: the fast selection of ``--quick``);
* ``cutp/bench/kernel_ops.py`` and ``kernel_variants.py`` add each ``bench`` case to
  ``python -m cutp bench kernels`` (its reference and its kernel variant).

So a new kernel family touches its ``.cu``, its ``kernels/<op>.py`` (launchers and FAMILY), its op
(``cutp/ops/<op>.py``) and its tests; nothing here names a family.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Target:
    """A kernel family's launch shape and occupancy target.

    threads: the largest block its launcher uses (= its ``__launch_bounds__``);
    blocks_per_sm: resident blocks per SM it must reach at that block size (its register budget
        follows: :func:`cutp.kernels.resources.register_budget`).
    """

    threads: int
    blocks_per_sm: int
    why: str


@dataclass(frozen=True)
class DynamicShared:
    """A kernel family's dynamic shared memory: the launcher's formula of the row width C."""

    formula: str
    bytes_of: Callable[[int], int]
    typical_c: int  # the width the README's occupancy is given at
    biggest_c: int  # the widest row checked against the limits
    width: str = "C"  # what the width is (attention: the head dim, fixed per entry point)


@dataclass(frozen=True)
class Traffic:
    """Global-memory traffic and arithmetic per element of the kernel's main tensor (the roofline
    of tools/kernel_resources.py).

    t: accesses of storage-type (T) elements (a re-read of the row by a later pass counts again);
    f32: accesses of float32 elements; u8: accesses of one-byte elements (masks);
    ops: arithmetic per element (a special function counted as ~8), int: ops are integer.
    Per-row and per-column vectors (weights, statistics, partial sums) are left out: they are
    amortised over the rows."""

    t: int
    f32: int = 0
    u8: int = 0
    ops: int = 1
    int: bool = False
    what: str = ""

    def bytes_per_element(self, itemsize: int) -> int:
        return self.t * itemsize + 4 * self.f32 + self.u8


@dataclass(frozen=True)
class BenchCase:
    """One op of ``python -m cutp bench kernels`` (cutp/bench/kernel_ops.py ``OpSpec``), declared by
    the family that runs it. The callables that need ``cutp.ops`` (the reference, ctx objects)
    receive it as their ``ops`` argument (``cutp.kernels`` must not import it); ``normal(xp, rng,
    shape, dtype, scale=1.0)`` draws the inputs on the device.

    cases(size preset dict) -> shape dicts; setup(ops, normal, xp, shape, dtype, rng) -> inputs;
    reference(ops, inputs) -> zero-argument callable; kernel(launchers, inputs, ops) -> what the
    reference returns (the benchmark's variant "cuda_kernels"); nbytes(shape, itemsize) -> the
    bytes it must move at least; outputs(inputs, returned) -> the arrays compared (default: the
    returned ones); label(shape) -> str."""

    name: str
    what: str
    formula: str
    cases: Callable
    setup: Callable
    reference: Callable
    kernel: Callable
    nbytes: Callable
    outputs: Callable | None = None
    label: Callable | None = None


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family, declared once in its ``kernels/<op>.py``.

    name: the family (its source's name for most);
    sources: the kernel sources (``kernels/<name>.cu``) its launchers launch, its own first;
    launchers: its launchers class (a LauncherBase subclass), one method per operation;
    targets: per entry point (the name without _f32 / _bf16), its block size and occupancy target;
    traffic: per memory-bound entry point, its bytes and operations per element (the roofline);
        the others are compute-bound (``compute_bound``);
    dynamic_shared: the entry points that launch with dynamic shared memory, with its formula;
    tests: its kernel test files under tests/kernels/ (the mutation campaign's stage);
    mutation_classes: the source-specific mutation classes of tools/mutate_kernels.py that apply
        to its own source (``OP_SOURCES``);
    quick_tests: ``--quick``'s fast selection of its tests (pytest node ids under tests/kernels/),
        for a family whose files are too slow per mutant;
    bench: its ops in ``python -m cutp bench kernels`` (:class:`BenchCase`; the fused attention's
        compute-bound ops, with FLOPs and working memory, are written out in cutp/bench/kernel_ops.py).
    """

    name: str
    sources: tuple[str, ...]
    launchers: type
    targets: dict[str, Target]
    traffic: dict[str, Traffic] = field(default_factory=dict)
    compute_bound: frozenset[str] = frozenset()
    dynamic_shared: dict[str, DynamicShared] = field(default_factory=dict)
    tests: tuple[str, ...] = ()
    mutation_classes: tuple[str, ...] = ()
    quick_tests: tuple[str, ...] = ()
    bench: tuple[BenchCase, ...] = ()


def _declarations() -> tuple[KernelFamily, ...]:
    """Every module of this package that declares FAMILY, in module-name order."""
    found = []
    package = importlib.import_module(__package__)  # (already in sys.modules: this module's own package)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__package__}.{info.name}")
        declared = getattr(module, "FAMILY", None)
        if isinstance(declared, KernelFamily):
            found.append(declared)
    return tuple(found)


def families() -> tuple[KernelFamily, ...]:
    """Every declaration, built on first use (the family modules import this one)."""
    global _FAMILIES
    if _FAMILIES is None:
        _FAMILIES = _declarations()
    return _FAMILIES


_FAMILIES: tuple[KernelFamily, ...] | None = None


def family_of_source(source: str) -> list[KernelFamily]:
    """The families that launch kernels/<source>.cu (with tests: the mutation stages of a mutant of it)."""
    return [f for f in families() if source in f.sources]
