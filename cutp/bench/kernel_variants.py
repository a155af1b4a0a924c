"""The CUDA kernels of ``cutp.kernels`` as variant "cuda_kernels" of ``python -m cutp bench kernels``.

``cutp.bench.kernels`` loads this module as a plug-in (its ``PLUGIN_MODULES``) and calls
:func:`register_bench_variants`; the op names are those of ``cutp.bench.kernel_ops.OPS``, and
each kernel family's module (``kernels/<op>.py``) says which of them are its own. It lives in
the benchmark, not in ``cutp.kernels``, because it builds the ops' ctx objects (``cutp.ops``),
which the kernels below the ops must not import.
"""
from __future__ import annotations

from cutp import ops
from cutp.kernels import cupy_launchers
from cutp.kernels.family import families
from cutp.ops.gelu import GeluCtx
from cutp.ops.layernorm import LayerNormCtx
from cutp.ops.rmsnorm import RMSNormCtx
from cutp.ops.softmax import SoftmaxCtx
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

    def gelu_fwd(k, d):
        y, pre = k.bias_gelu_forward(d["x"], d["b"])
        return y, GeluCtx(pre, "tanh")

    def softmax_fwd(k, d):
        y = k.softmax_forward(d["x"], d["scale"], True)
        return y, SoftmaxCtx(y, d["scale"])

    def ln_fwd(k, d):
        y, mean, rstd = k.layernorm_forward(d["x"], d["w"], d["b"])
        return y, LayerNormCtx(d["x"], d["w"], d["b"].dtype, mean, rstd)

    def ln_bwd(k, d):
        c = d["ctx"]
        return k.layernorm_backward(d["dy"], c.x, c.weight, c.mean.reshape(-1), c.rstd.reshape(-1), c.bias_dtype)

    def ce_bwd(k, d):
        k.ce_shard_backward(d["logits"], d["row_max"], d["sum_exp"], d["targets"], d["n_valid"], d["row_scale"],
                            out=d["logits"])

    def adamw(k, d):
        k.adamw_update(d["p"], d["g"], d["m"], d["v"], d["mask"], lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                       weight_decay=0.1, step=10)

    variant("bias_gelu_fwd", gelu_fwd)
    variant("bias_gelu_bwd", lambda k, d: k.bias_gelu_backward(d["dy"], d["ctx"].x, d["ctx"].approximate))
    variant("softmax_fwd", softmax_fwd)
    variant("softmax_bwd", lambda k, d: k.softmax_backward(d["dy"], d["ctx"].y, d["ctx"].scale))
    variant("layernorm_fwd", ln_fwd)
    variant("layernorm_bwd", ln_bwd)
    variant("ce_fwd", lambda k, d: k.ce_shard_forward(d["logits"], d["targets"], d["n_valid"]))
    variant("ce_bwd_fused", ce_bwd)
    variant("adamw", adamw)

    def rms_fwd(k, d):
        y, rstd = k.rmsnorm_forward(d["x"], d["w"])
        return y, RMSNormCtx(d["x"], d["w"], rstd)

    def residual_rms_fwd(k, d):
        s, y, rstd = k.residual_rmsnorm_forward(d["x"], d["branch"], d["w"])
        return s, y, RMSNormCtx(s, d["w"], rstd)

    def rms_bwd(k, d):
        c = d["ctx"]
        return k.rmsnorm_backward(d["dy"], c.x, c.weight, c.rstd.reshape(-1))

    variant("rmsnorm_fwd", rms_fwd)
    variant("residual_rmsnorm_fwd", residual_rms_fwd)
    variant("rmsnorm_bwd", rms_bwd)
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
