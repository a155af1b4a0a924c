"""The CUDA kernels of ``cutp.kernels`` as variant "cuda_kernels" of ``python -m cutp bench kernels``.

``cutp.bench.kernels`` loads this module as a plug-in (its ``PLUGIN_MODULES``) and calls
:func:`register_bench_variants`; the op names are those of ``cutp.bench.kernel_ops.OPS``, and
each kernel family's module (``kernels/<op>.py``) declares its own (FAMILY.bench: the kernel call
of each, registered here; the fused attention's are written out below). It lives in
the benchmark, not in ``cutp.kernels``, because it builds the ops' ctx objects (``cutp.ops``),
which the kernels below the ops must not import.
"""
from __future__ import annotations

from cutp import ops
from cutp.kernels import cupy_launchers
from cutp.kernels.family import families
from cutp.runtime.errors import BackendError


def register_bench_variants(register) -> None:
    """Registers the kernels as variant "cuda_kernels" of each op of cutp.bench.kernels.

    Each factory ``make(inputs, xp)`` returns a zero-argument callable that runs the kernel once
    on the op's inputs through the current device's launchers (whatever the switch says) and
    returns what the op of cutp.ops returns (the same structure, ctx objects included; None for
    the in-place ops), so the benchmark reads and checks its outputs as the reference's.

    Note for the benchmark: on CuPy arrays cutp.ops itself dispatches to these kernels, so a
    baseline of "the CuPy composition" must run under ``use_kernels(False)``.
    """

    def variant(op, run):
        def make(inputs, xp):
            k = cupy_launchers() if getattr(xp, "__name__", "") == "cupy" else _bench_launchers(xp)
            return lambda: run(k, inputs)

        register(op, "cuda_kernels", make)

    # the ops the kernel families declare with themselves (kernels/<op>.py FAMILY.bench)
    for family in families():
        for case in family.bench:
            variant(case.name, lambda k, d, case=case: case.kernel(k, d, ops))

    # fused causal attention (kernels/attention.cu); the backward's forward runs once, untimed
    def attention(kind):
        def make(inputs, xp):
            k = cupy_launchers() if getattr(xp, "__name__", "") == "cupy" else _bench_launchers(xp)
            q, kk, v, do, scale = (inputs[n] for n in ("q", "k", "v", "do", "scale"))
            if kind == "fwd":
                return lambda: k.attention_forward(q, kk, v, scale)
            if kind == "bwd":
                o, lse = k.attention_forward(q, kk, v, scale)
                return lambda: k.attention_backward(do, q, kk, v, o, lse, scale)

            def fwd_bwd():
                o, lse = k.attention_forward(q, kk, v, scale)
                return (o, *k.attention_backward(do, q, kk, v, o, lse, scale))

            return fwd_bwd

        register(f"attention_{kind}", "cuda_kernels", make)

    for kind in ("fwd", "bwd", "fwd_bwd"):
        attention(kind)


def _bench_launchers(xp):  # replaced in tests (emulated kernels on NumPy arrays)
    raise BackendError(f"the CUDA kernels run on CuPy arrays, not {getattr(xp, '__name__', xp)}")
