"""The compiled CPU kernels (kernels/cpu/*.c, cutp.ops.compiled): each against its NumPy reference,
forward and backward, float32 and float64, odd shapes; bit-identical at any thread count; the
vectorised exp against libm in ulps; the loader's cache (a second load compiles nothing, a
corrupt file is built again) and its fallbacks (CUTP_CPU_KERNELS=0, no compiler, a failed build:
one line, the NumPy path).

Tolerances: a kernel and its reference sum the same terms in other orders (and the kernels
contract a * b + c into one rounding). The error of a sum of n terms is at most ~n eps, typically
~sqrt(n) eps, so normwise relative differences within 64 eps cover the sums of <= 64 terms here
(rows of <= 50 keys, head dims <= 16; the elementwise ops' few roundings: a few eps)."""
import numpy as np
import pytest

import cutp.ops.adamw as adamw_op
import cutp.ops.attention as attention_op
import cutp.ops.cblas as cblas_op
import cutp.ops.cross_entropy as ce_op
import cutp.ops.gelu as gelu_op
import cutp.ops.layernorm as layernorm_op
import cutp.ops.rmsnorm as rmsnorm_op
import cutp.ops.rotary as rotary_op
import cutp.ops.swiglu as swiglu_op
import cutp.tensor_parallel.parameter as parameter_mod
from cutp.ops import causal_attention_backward, causal_attention_forward, compiled, gemm
from tests.gradcheck import check_gradients

LIB = compiled.library("attention", attention_op._ATTENTION_SYMBOLS)
needs_kernels = pytest.mark.skipif(LIB is None, reason="the compiled CPU kernels are not built here (no C compiler "
                                                       "or CUTP_CPU_KERNELS=0): the NumPy path runs")

# (B, nkv, g, Tq, Tk, hd): GQA, head dims below / at / above one vector, Tq < Tk (a KV cache's rows)
SHAPES = [(2, 2, 2, 40, 40, 8), (3, 2, 1, 50, 50, 16), (1, 1, 3, 37, 37, 5), (2, 2, 2, 5, 23, 8), (1, 2, 1, 1, 9, 4),
          (1, 1, 1, 9, 9, 12)]
IDS = [f"B{b}-nkv{h}-g{g}-Tq{tq}-Tk{tk}-hd{d}" for b, h, g, tq, tk, d in SHAPES]


def normwise(a, b):
    a, b = (np.asarray(v, np.float64).ravel() for v in (a, b))  # (float32 squares of 1e34 overflow)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def qkv_views(shape, dtype, seed=0):
    """q, k, v as the layer makes them: strided views of one [B, T, (nq + 2 nkv) hd] buffer (Tq ==
    Tk), else separate arrays."""
    B, nkv, g, Tq, Tk, hd = shape
    rng = np.random.default_rng(seed)
    if Tq == Tk:
        buf = rng.standard_normal((B, Tq, (nkv * g + 2 * nkv) * hd)).astype(dtype)
        q = buf[..., : nkv * g * hd].reshape(B, Tq, nkv, g, hd).transpose(0, 2, 3, 1, 4)
        k = buf[..., nkv * g * hd:(nkv * g + nkv) * hd].reshape(B, Tq, nkv, hd).transpose(0, 2, 1, 3)
        v = buf[..., (nkv * g + nkv) * hd:].reshape(B, Tq, nkv, hd).transpose(0, 2, 1, 3)
        return q, k, v
    return (rng.standard_normal((B, nkv, g, Tq, hd)).astype(dtype), rng.standard_normal((B, nkv, Tk, hd)).astype(dtype),
            rng.standard_normal((B, nkv, Tk, hd)).astype(dtype))


@needs_kernels
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_compiled_attention_equals_the_numpy_path(shape, dtype):
    q, k, v = qkv_views(shape, dtype)
    do = np.random.default_rng(1).standard_normal(q.shape).astype(dtype)
    o, ctx = causal_attention_forward(q, k, v)
    o_ref, ctx_ref = causal_attention_forward(q, k, v, blocked=True)
    assert ctx.compiled and not ctx.blocked and o.dtype == dtype
    grads = causal_attention_backward(do, ctx)
    grads_ref = causal_attention_backward(do, ctx_ref)
    eps = np.finfo(dtype).eps
    for what, a, b in zip(("o", "dq", "dk", "dv"), (o,) + tuple(grads), (o_ref,) + tuple(grads_ref)):
        assert a.shape == b.shape and a.dtype == dtype
        assert normwise(a, b) <= 64 * eps, (what, normwise(a, b))
    # the packed probabilities: row i keeps its Tk - Tq + i + 1 keys, and each row sums to 1
    B, nkv, g, Tq, Tk, _ = shape
    assert ctx.packed.shape == (B, nkv, g, Tq * (Tk - Tq + 1) + Tq * (Tq - 1) // 2)
    ends = np.cumsum(Tk - Tq + 1 + np.arange(Tq))
    np.testing.assert_allclose(np.add.reduceat(ctx.packed, np.r_[0, ends[:-1]], axis=-1), 1.0, rtol=64 * eps)


@needs_kernels
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3]], ids=[IDS[0], IDS[3]])
def test_compiled_attention_backward_against_central_differences(shape):
    q, k, v = qkv_views(shape, np.float64)
    q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))

    def backward(do, ctx):
        assert ctx.compiled
        return dict(zip("qkv", causal_attention_backward(do, ctx)))

    check_gradients(lambda q, k, v: causal_attention_forward(q, k, v), dict(q=q, k=k, v=v), backward, tol=1e-7,
                    max_elements=48)


@needs_kernels
def test_compiled_attention_writes_strided_outputs_and_is_the_same_at_any_thread_count(monkeypatch):
    """Gradients written straight into strided views of one packed buffer (the layer's dqkv), and the
    same bits with 1 or 2 pool threads (each KV head computed alone, in a fixed order)."""
    shape = (3, 2, 2, 33, 33, 16)
    B, nkv, g, T, _, hd = shape
    q, k, v = qkv_views(shape, np.float32)
    do = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    runs = []
    for threads in ("1", "2"):
        monkeypatch.setenv("CUTP_OP_THREADS", threads)
        o, ctx = causal_attention_forward(q, k, v)
        buf = np.full((B, T, (nkv * g + 2 * nkv) * hd), np.nan, np.float32)
        out = (buf[..., : nkv * g * hd].reshape(B, T, nkv, g, hd).transpose(0, 2, 3, 1, 4),
               buf[..., nkv * g * hd:(nkv * g + nkv) * hd].reshape(B, T, nkv, hd).transpose(0, 2, 1, 3),
               buf[..., (nkv * g + nkv) * hd:].reshape(B, T, nkv, hd).transpose(0, 2, 1, 3))
        causal_attention_backward(do, ctx, out=out)
        assert not np.isnan(buf).any()
        runs.append((o.copy(), buf))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))
    ref = causal_attention_backward(do, causal_attention_forward(q, k, v, blocked=True)[1])
    assert all(normwise(a, b) <= 64 * np.finfo(np.float32).eps for a, b in zip(out, ref))


@needs_kernels
def test_compiled_attention_takes_a_strided_do_fills_outputs_of_another_dtype_and_names_a_failed_allocation(
        monkeypatch):
    """A do whose rows are not contiguous is copied first; out arrays of another dtype get the
    gradients copied in (and are returned); a kernel that could not allocate its scratch rows
    (non-zero return) is a MemoryError naming it, forward and backward."""
    shape = SHAPES[0]
    q, k, v = qkv_views(shape, np.float32)
    wide = np.random.default_rng(3).standard_normal(q.shape + (2,)).astype(np.float32)
    do = wide[..., 0]  # (each element 8 bytes from the next)
    assert not compiled.rows_contiguous(do)
    o, ctx = causal_attention_forward(q, k, v)
    assert ctx.compiled
    ref = causal_attention_backward(np.ascontiguousarray(do), ctx)
    out = tuple(np.full(a.shape, np.nan, np.float64) for a in (q, k, v))
    got = causal_attention_backward(do, ctx, out=out)
    assert all(g is o_ for g, o_ in zip(got, out))
    assert all(np.array_equal(g, r.astype(np.float64)) for g, r in zip(got, ref))
    monkeypatch.setattr(compiled, "entry", lambda lib, name, dtype: lambda *args: 1)
    with pytest.raises(MemoryError, match=r"^the compiled attention could not allocate its scratch rows$"):
        causal_attention_forward(q, k, v)
    with pytest.raises(MemoryError, match=r"^the compiled attention could not allocate its scratch rows$"):
        causal_attention_backward(do, ctx)


@needs_kernels
@pytest.mark.parametrize("dtype,lo", [(np.float32, -87.0), (np.float64, -708.0)])
def test_the_kernels_exp_is_within_one_ulp_of_the_true_exp(dtype, lo):
    """exp_vec (kernels/cpu/vec.h) over its whole range, against exp in long double: <= 1 ulp
    (measured 0.91 and 0.87); below the range 0, NaN stays NaN."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(lo, -lo, 200_001), rng.uniform(-20, 5, 20_000), [0.0, -0.0, 1.0]]).astype(dtype)
    y = np.empty_like(x)
    fn = getattr(LIB, "exp_array_" + compiled.suffix(dtype))
    fn(compiled.ptr(x), compiled.ptr(y), *compiled.int64s(x.size))
    ref = np.exp(x.astype(np.longdouble))
    ulps = np.abs(y - ref) / np.spacing(ref.astype(dtype)).astype(np.longdouble)
    assert ulps.max() <= 1.0, (float(ulps.max()), x[ulps.argmax()])
    edge = np.array([lo - 1, -1e30, -np.inf, np.nan], dtype)
    out = np.empty_like(edge)
    fn(compiled.ptr(edge), compiled.ptr(out), *compiled.int64s(edge.size))
    assert out[:3].tolist() == [0.0, 0.0, 0.0] and np.isnan(out[3])


# ---- GeLU and SwiGLU (kernels/cpu/activations.c) -------------------------------------------------
ACT = compiled.library("activations", gelu_op._GELU_SYMBOLS + swiglu_op._SYMBOLS)
needs_activations = pytest.mark.skipif(ACT is None, reason="the compiled CPU kernels are not built here (no C "
                                                           "compiler or CUTP_CPU_KERNELS=0): the NumPy path runs")


def numpy_path(monkeypatch, fn):
    """fn() on the NumPy reference path (the compiled kernels off for the call)."""
    monkeypatch.setenv("CUTP_CPU_KERNELS", "0")
    monkeypatch.setattr(compiled, "_said", {"CUTP_CPU_KERNELS=0: the CPU ops run their NumPy code"})
    try:
        return fn()
    finally:
        monkeypatch.delenv("CUTP_CPU_KERNELS")


@needs_activations
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,cols", [(37, 53), (1, 7), (300, 520)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_compiled_gelu_equals_the_numpy_path(rows, cols, dtype, bias, monkeypatch):
    """Forward, the kept tanh, dx and db (summed over the row blocks in order) of the tanh form; x
    spread to where tanh saturates (|x| up to ~12)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows, cols)) * 4).astype(dtype)
    b = rng.standard_normal(cols).astype(dtype)
    dy = rng.standard_normal((rows, cols)).astype(dtype)

    def run():
        if bias:
            y, ctx = gelu_op.bias_gelu_forward(x, b)
            return (y, ctx.tanh) + tuple(gelu_op.bias_gelu_backward(dy, ctx))
        y, ctx = gelu_op.gelu_forward(x)
        return y, ctx.tanh, gelu_op.gelu_backward(dy, ctx)

    ours, ref = run(), numpy_path(monkeypatch, run)
    assert ref[1] is None or not bias or ref[1].shape == x.shape
    eps = np.finfo(dtype).eps
    for what, a, r in zip(("y", "tanh", "dx", "db"), ours, ref):
        if r is None:  # (the NumPy gelu_forward keeps no tanh; the compiled one does: np.tanh is the reference)
            r = np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))
        assert a.dtype == dtype and a.shape == r.shape and normwise(a, r) <= 64 * eps, (what, normwise(a, r))


@needs_activations
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,F", [(37, 53), (1, 3), (300, 392)])
def test_compiled_swiglu_equals_the_numpy_path(rows, F, dtype, monkeypatch):
    """Forward, the kept exp(-gate) and both halves of the backward; gates out to +-100 (the clamp)."""
    rng = np.random.default_rng(1)
    gate_up = (rng.standard_normal((rows, 2 * F)) * 6).astype(dtype)
    gate_up[0, 0], gate_up[-1, 0] = -100, 100
    dy = rng.standard_normal((rows, F)).astype(dtype)

    def run():
        y, ctx = swiglu_op.swiglu_forward(gate_up)
        return y, ctx.exp_neg, swiglu_op.swiglu_backward(dy, ctx)

    eps = np.finfo(dtype).eps
    for what, a, r in zip(("y", "exp(-gate)", "d"), run(), numpy_path(monkeypatch, run)):
        assert a.dtype == dtype and a.shape == r.shape and normwise(a, r) <= 64 * eps, (what, normwise(a, r))


# ---- LayerNorm and RMSNorm (kernels/cpu/norms.c) -------------------------------------------------
NORMS = compiled.library("norms", layernorm_op.NORM_SYMBOLS)
needs_norms = pytest.mark.skipif(NORMS is None, reason="the compiled CPU kernels are not built here (no C "
                                                       "compiler or CUTP_CPU_KERNELS=0): the NumPy path runs")


@needs_norms
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,cols", [(37, 53), (3, 5), (600, 768)])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_compiled_norms_equal_the_numpy_path(rows, cols, dtype, affine, monkeypatch):
    """LayerNorm (weight and bias, or neither; weight without bias) and RMSNorm: y, the statistics,
    dx and the parameter gradients (each row block's part, added in block order); rows whose mean
    is far from 0 (LayerNorm's centring matters)."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((rows, cols)) * 2 + 3).astype(dtype)
    w, b = (rng.standard_normal(cols).astype(dtype) if affine else None for _ in range(2))
    dy = rng.standard_normal((rows, cols)).astype(dtype)

    def run():
        y, ln = layernorm_op.layernorm_forward(x, w, b)
        y_nb, ln_nb = layernorm_op.layernorm_forward(x, w, None)  # (a weight, no bias)
        z, rms = rmsnorm_op.rmsnorm_forward(x, w)
        return (y, ln.mean, ln.rstd, *layernorm_op.layernorm_backward(dy, ln), y_nb,
                *layernorm_op.layernorm_backward(dy, ln_nb), z, rms.rstd, *rmsnorm_op.rmsnorm_backward(dy, rms))

    ours, ref = run(), numpy_path(monkeypatch, run)
    eps = np.finfo(dtype).eps
    for i, (a, r) in enumerate(zip(ours, ref)):
        assert (a is None) == (r is None), i
        if r is not None:
            assert a.dtype == dtype and a.shape == r.shape and normwise(a, r) <= 64 * eps, (i, normwise(a, r))


@needs_norms
def test_compiled_norms_sum_float32_parameter_gradients_in_double():
    """dw and db of float32 LayerNorm / RMSNorm over 5,000 rows: within 1 eps (normwise) of the same
    products summed in float64 (measured 0.22-0.26 eps: the final rounding): each row's product
    rounds to float32, its sum over rows does not. Summed in float32, LayerNorm's dw was 4.8 eps
    off here (NumPy's GEMV column sums: 4.6)."""
    rng = np.random.default_rng(11)
    rows, cols = 5000, 96
    x = (rng.standard_normal((rows, cols)) + 2).astype(np.float32)
    w, b = rng.standard_normal(cols).astype(np.float32), rng.standard_normal(cols).astype(np.float32)
    dy = (rng.standard_normal((rows, cols)) + 1).astype(np.float32)
    _, ln = layernorm_op.layernorm_forward(x, w, b)
    _, dw, db = layernorm_op.layernorm_backward(dy, ln)
    xh = (x - ln.mean.reshape(-1, 1)) * ln.rstd.reshape(-1, 1)  # float32 as the kernel forms it
    eps = np.finfo(np.float32).eps
    exact = (dy * xh).astype(np.float64).sum(axis=0)
    assert normwise(dw, exact) <= eps and normwise(db, dy.astype(np.float64).sum(axis=0)) <= eps
    _, rms = rmsnorm_op.rmsnorm_forward(x, w)
    _, dw = rmsnorm_op.rmsnorm_backward(dy, rms)
    assert normwise(dw, (dy * (x * rms.rstd.reshape(-1, 1))).astype(np.float64).sum(axis=0)) <= eps


# ---- rotary (kernels/cpu/rotary.c) ----------------------------------------------------------------
ROT = compiled.library("rotary", rotary_op._SYMBOLS)


@pytest.mark.skipif(ROT is None, reason="the compiled CPU kernels are not built here (no C compiler or "
                                        "CUTP_CPU_KERNELS=0): the NumPy path runs")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("B,T,heads,hd,rd", [(2, 7, 3, 16, 16), (3, 5, 2, 12, 8), (1, 9, 4, 64, 64)])
def test_compiled_rotary_equals_the_numpy_path(B, T, heads, hd, rd, dtype, monkeypatch):
    """In place on the heads of a QKV-like buffer (a KV cache's offset tables), the backward into a
    new array, and gathered position ids; partial rotary (rd < hd) leaves the rest as it was. Bit for
    bit: rotary.c is built without fused multiply-adds, so its two products and one sum are NumPy's."""
    cos, sin = rotary_op.rope_tables(rd, 32, dtype=dtype)
    buf0 = np.random.default_rng(3).standard_normal((B, T, (heads + 2) * hd)).astype(dtype)
    dy = np.random.default_rng(4).standard_normal((B, T, heads, hd)).astype(dtype)

    def run():
        buf = buf0.copy()
        q = buf[..., : heads * hd].reshape(B, T, heads, hd)
        _, ctx = rotary_op.rotary_forward(q, cos[3:3 + T], sin[3:3 + T], out=q)
        back = rotary_op.rotary_backward(dy, ctx)
        y, _ = rotary_op.rotary_forward(buf0[..., : heads * hd].reshape(B, T, heads, hd), cos, sin,
                                        np.arange(T)[::-1] + 2)
        return buf, back, y

    ours = run()
    assert np.array_equal(ours[0][..., heads * hd:], buf0[..., heads * hd:])  # K/V columns untouched
    for what, a, r in zip(("in place", "backward", "positions"), ours, numpy_path(monkeypatch, run)):
        assert a.dtype == dtype and np.array_equal(a, r), what


# ---- the loader ---------------------------------------------------------------------------------
@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """A cache in tmp_path, a one-function source in its own directory, nothing loaded or said yet."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "one.c").write_text("int one(void) { return 1; }\n")
    monkeypatch.setattr(compiled, "SOURCE_DIR", src)
    monkeypatch.setattr(compiled, "_loaded", {})
    monkeypatch.setattr(compiled, "_said", set())
    monkeypatch.delenv("CUTP_CACHE_DIR", raising=False)  # (the per-user default; CUTP_CACHE_DIR: below)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTP_CPU_KERNELS", raising=False)
    return src


@pytest.mark.skipif(compiled.compiler() is None, reason="no C compiler (cc or $CC) on this machine")
def test_the_cache_builds_once_and_rebuilds_a_corrupt_file(fresh_loader, monkeypatch, tmp_path):
    lib = compiled.library("one", ("one",))
    assert lib is not None and lib.one() == 1
    path = compiled.library_path("one", compiled.compiler())
    assert path.exists() and path.parent == tmp_path / "cache" / "cutp"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    built = []
    real_build = compiled._build
    monkeypatch.setattr(compiled, "_build", lambda *a: (built.append(a), real_build(*a)))
    monkeypatch.setattr(compiled, "_loaded", {})  # a new process: the cached file is loaded, not built
    assert compiled.library("one", ("one",)).one() == 1 and built == []
    # a crashed writer's leftovers under the final name (of a library this process has not loaded:
    # dlopen would hand back the loaded one by its name)
    (fresh_loader / "two.c").write_text("int two(void) { return 2; }\n")
    other = compiled.library_path("two", compiled.compiler())
    other.write_bytes(b"half a library")
    assert compiled.library("two", ("two",)).two() == 2 and len(built) == 1
    assert other.read_bytes()[:4] == b"\x7fELF"
    (fresh_loader / "one.c").write_text("int one(void) { return 3; }\n")  # a changed source: another file
    monkeypatch.setattr(compiled, "_loaded", {})  # (seen by a new process)
    assert compiled.library_path("one", compiled.compiler()) != path
    assert compiled.library("one", ("one",)).one() == 3 and len(built) == 2


@pytest.mark.parametrize("why", ["off", "no compiler", "build fails", "lacks a symbol"])
def test_without_the_kernels_the_ops_run_numpy_and_say_so_once(why, fresh_loader, monkeypatch, capsys):
    if why == "off":
        monkeypatch.setenv("CUTP_CPU_KERNELS", "0")
        expect = "CUTP_CPU_KERNELS=0"
    elif why == "no compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
        expect = "no C compiler (/nonexistent/cc)"
    else:
        if compiled.compiler() is None:
            pytest.skip("no C compiler (cc or $CC) on this machine")
        (fresh_loader / "one.c").write_text("int one(void) { return }\n" if why == "build fails" else
                                            "int one(void) { return 1; }\n")
        expect = "failed on kernels/cpu/one.c" if why == "build fails" else "does not load or lacks one, two"
    symbols = ("one", "two") if why == "lacks a symbol" else ("one",)
    assert compiled.library("one", symbols) is None
    assert compiled.library("one", symbols) is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and expect in err[0] and "NumPy" in err[0], err
    if why in ("off", "no compiler"):  # the attention then takes the blocked NumPy path
        q, k, v = qkv_views(SHAPES[0], np.float32)
        _, ctx = causal_attention_forward(q, k, v)
        assert ctx.blocked and not ctx.compiled



def test_a_machine_without_proc_cpuinfo_names_its_cache_files_without_cpu_flags(monkeypatch):
    def no_file(*args, **kwargs):
        raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr(compiled, "open", no_file, raising=False)  # (the module's open: builtins' elsewhere)
    assert compiled._cpu_flags() == ""
    assert compiled.library_path("attention", "cc").name.startswith("cpu-attention-")


def test_the_cache_follows_cutp_cache_dir(monkeypatch, tmp_path):
    """CUTP_CACHE_DIR (cutp's cache setting, the tests' session directory) wins over the per-user
    default, as it does for the CUDA resources."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("CUTP_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("CUTP_CACHE_DIR")
    assert compiled.cache_dir() == tmp_path / "xdg" / "cutp"


@needs_kernels
def test_outputs_the_kernels_must_not_write_take_the_numpy_path():
    """A read-only out, or a broadcast one (stride 0: the threads would race on one element), is
    left to the NumPy path, which refuses it as NumPy does; the kernels never write it."""
    shape = (1, 2, 1, 9, 9, 4)
    q, k, v = qkv_views(shape, np.float64)
    do = np.random.default_rng(1).standard_normal(q.shape)
    _, ctx = causal_attention_forward(q, k, v)
    assert compiled.writable(np.empty((2, 3))) and not compiled.writable(np.broadcast_to(np.empty(3), (2, 3)))
    frozen = [np.zeros(a.shape) for a in (q, k, v)]
    for a in frozen:
        a.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        causal_attention_backward(do, ctx, out=tuple(frozen))
    assert all(not a.any() for a in frozen)
    x = np.random.default_rng(2).standard_normal((2, 5, 3, 8))
    cos, sin = (np.random.default_rng(3).standard_normal((5, 8)) for _ in range(2))
    out = np.zeros_like(x)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        rotary_op.rotary_forward(x, cos, sin, out=out)
    assert not out.any()


@pytest.mark.parametrize("shape", [(0,), (0, 8), (3, 0)], ids=["empty", "no-rows", "no-columns"])
def test_empty_arrays_take_the_numpy_path(shape):
    """Nothing to compute: the ops answer empty arrays of the right shapes (the compiled path is not
    asked: empty rows do not reshape)."""
    x = np.zeros(shape, np.float32)
    y, ctx = gelu_op.gelu_forward(x)
    assert y.shape == shape and gelu_op.gelu_backward(y, ctx).shape == shape
    if len(shape) == 2 and shape[1] > 0:
        h, sctx = swiglu_op.swiglu_forward(x)
        assert h.shape == (shape[0], shape[1] // 2) and swiglu_op.swiglu_backward(h, sctx).shape == shape
    if len(shape) == 2 and shape[1] > 0:
        w = np.ones(shape[1], np.float32)
        y, lctx = layernorm_op.layernorm_forward(x, w, w)
        assert y.shape == shape and layernorm_op.layernorm_backward(y, lctx)[0].shape == shape
        y, rctx = rmsnorm_op.rmsnorm_forward(x, w)
        assert y.shape == shape and rmsnorm_op.rmsnorm_backward(y, rctx)[0].shape == shape


# ---- the weight gradient accumulated by the BLAS itself (cutp.ops.cblas) ---------------------------
CBLAS = cblas_op._routine(np.float32) is not None
needs_cblas = pytest.mark.skipif(not CBLAS, reason="NumPy's BLAS has no ILP64 cblas_sgemm symbol here (not "
                                                   "scipy-openblas): gemm accumulates through NumPy")


@needs_cblas
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a,trans_b", [(True, False), (False, False), (False, True), (True, True)])
@pytest.mark.parametrize("k", [37, 700])
def test_gemm_accumulates_in_the_blas_as_numpy_does(dtype, trans_a, trans_b, k, monkeypatch):
    """out += op(a) @ op(b) with beta = 1: within the rounding of a sum of k terms of NumPy's
    out += a.T @ b (the reference, CUTP_CPU_KERNELS=0), and to the bit while k fits one of the
    BLAS's K blocks (k = 37; 700 is past them here: other bits); added to what out held, not
    written over it."""
    rng = np.random.default_rng(k)
    m, n = 29, 45
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    start = rng.standard_normal((m, n)).astype(dtype)
    out = start.copy()
    assert cblas_op.accumulates(a, b, out)
    assert gemm(a, b, trans_a=trans_a, trans_b=trans_b, out=out, accumulate=True) is out
    ref = start.copy()
    numpy_path(monkeypatch, lambda: gemm(a, b, trans_a=trans_a, trans_b=trans_b, out=ref, accumulate=True))
    assert np.array_equal(ref, start + (a.T if trans_a else a) @ (b.T if trans_b else b))
    if k == 37:
        assert np.array_equal(out, ref)
    else:
        assert normwise(out, ref) <= 8 * np.finfo(dtype).eps


@needs_cblas
def test_gemm_reads_strided_operands_and_leaves_the_rest_to_numpy():
    """Row-major operands with a row stride longer than their columns (a slice of columns) go to
    the BLAS as they are; a column stride, another dtype (bfloat16's float32 main_grad), a
    non-contiguous or read-only out, an out that is an operand take NumPy's path, with the same
    result."""
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((64, 50))
    a, b = wide[:, :20], wide[:, 30:]
    out = np.zeros((20, 20))
    assert cblas_op.accumulates(a, b, out)
    gemm(a, b, trans_a=True, out=out, accumulate=True)
    np.testing.assert_allclose(out, a.T @ b, rtol=1e-13, atol=1e-13)
    every_other = wide[:, ::2][:, :20]
    frozen = np.zeros((20, 20))
    frozen.flags.writeable = False
    square = rng.standard_normal((20, 20))
    for args in ((every_other, b, np.zeros((20, 20))), (a.astype(np.float32), b.astype(np.float32), np.zeros((20, 20))),
                 (a, b, np.zeros((20, 40))[:, ::2]), (a, b, frozen), (square, square, square)):
        assert not cblas_op.accumulates(*args)
    expected = square + square.T @ square
    gemm(square, square, trans_a=True, out=square, accumulate=True)  # out is an operand: NumPy's product first
    np.testing.assert_allclose(square, expected, rtol=1e-13, atol=1e-13)
    out = np.zeros((20, 40))[:, ::2]
    gemm(every_other, b, trans_a=True, out=out, accumulate=True)
    np.testing.assert_allclose(out, every_other.T @ b, rtol=1e-13, atol=1e-13)


def test_gemm_accumulates_through_numpy_with_the_kernels_off(monkeypatch):
    monkeypatch.setenv("CUTP_CPU_KERNELS", "0")
    a = np.ones((4, 3), np.float32)
    assert not cblas_op.accumulates(a, a, np.zeros((3, 3), np.float32))


# ---- cross-entropy and AdamW (kernels/cpu/cross_entropy.c, adamw.c) --------------------------------
CE = compiled.library("cross_entropy", ce_op._SYMBOLS)
ADAMW = compiled.library("adamw", adamw_op._SYMBOLS)
needs_ce = pytest.mark.skipif(CE is None, reason="the compiled CPU kernels are not built here (no C compiler or "
                                                 "CUTP_CPU_KERNELS=0): the NumPy path runs")
needs_adamw = pytest.mark.skipif(ADAMW is None, reason="the compiled CPU kernels are not built here (no C compiler "
                                                       "or CUTP_CPU_KERNELS=0): the NumPy path runs")


@needs_ce
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,V,n_classes,eps", [(37, 101, 101, 0.0), (16, 5003, 5000, 0.1), (5, 7, 5, 0.0)])
def test_compiled_cross_entropy_equals_the_numpy_path(N, V, n_classes, eps, dtype, monkeypatch):
    """Loss, row statistics and dlogits (in place over the logits, as the head calls it) against
    the NumPy path; ignored rows and padded columns exactly 0; a row of -inf logits in a shard
    (another shard holds its classes) gives max -inf and sum 0, never NaN."""
    rng = np.random.default_rng(N)
    logits = (rng.standard_normal((N, V)) * 4).astype(dtype)
    t = rng.integers(0, n_classes, N)
    t[::4] = -100

    def run():
        loss, ctx = ce_op.cross_entropy_forward(logits, t, n_classes=n_classes, label_smoothing=eps)
        d = ce_op.cross_entropy_backward(np.asarray(1.7, dtype), ctx, out=ctx.logits.copy())
        return loss, ctx.row_max, ctx.sum_exp, d

    got, ref = run(), numpy_path(monkeypatch, run)
    e = np.finfo(dtype).eps
    assert np.array_equal(got[1], ref[1])  # the max: exact
    assert normwise(got[0], ref[0]) <= 8 * e and normwise(got[2], ref[2]) <= 8 * e and normwise(got[3], ref[3]) <= 8 * e
    assert not got[3][::4].any() and not got[3][:, n_classes:].any()
    shard = np.full((3, 9), -np.inf, dtype)
    m, s, _, _ = ce_op.ce_shard_forward(shard, np.full(3, -1), 9)
    assert np.all(m == -np.inf) and not s.any()


@needs_ce
def test_cross_entropy_logits_the_kernel_cannot_read_take_the_numpy_path(monkeypatch):
    """Logits whose columns are strided (a view of every other column) or an `out` that is not
    writable: the NumPy code runs (the C kernel reads rows of unit stride and writes `out`), with
    the NumPy path's results; a read-only `out` is refused by NumPy, not written through."""
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((7, 22)).astype(np.float32)
    strided, t = wide[:, ::2], rng.integers(0, 11, 7)
    got = ce_op.ce_shard_forward(strided, t, 11)
    ref = numpy_path(monkeypatch, lambda: ce_op.ce_shard_forward(np.ascontiguousarray(strided), t, 11))
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r)
    scale = np.full(7, 0.5, np.float32)
    ref_d = numpy_path(monkeypatch, lambda: ce_op.ce_shard_backward(strided.copy(), *ref[:2], t, 11, scale))
    np.testing.assert_array_equal(ce_op.ce_shard_backward(strided, *got[:2], t, 11, scale), ref_d)
    frozen = np.zeros_like(ref_d)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ce_op.ce_shard_backward(strided.copy(), *got[:2], t, 11, scale, out=frozen)


@needs_ce
def test_compiled_cross_entropy_sums_a_wide_row_in_double():
    """A row of 50,257 float32 logits: sum_exp within 2 eps of the float64 sum (a float sum over 8
    lanes of 6,282 terms each would drift further), and the same bits at 1 and 2 pool threads."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 50257)).astype(np.float32)
    m, s, _, _ = ce_op.ce_shard_forward(logits, np.zeros(6, np.int64), 50257)
    exact = np.exp(logits.astype(np.float64) - m[:, None].astype(np.float64)).sum(axis=1)
    assert np.abs(s / exact - 1).max() <= 4 * np.finfo(np.float32).eps
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUTP_OP_THREADS", "2")
        assert np.array_equal(ce_op.ce_shard_forward(logits, np.zeros(6, np.int64), 50257)[1], s)


@needs_adamw
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("grad_scale,weight_decay", [(1.0, 0.1), (0.37, 0.0)])
def test_compiled_adamw_is_the_numpy_path_to_the_bit(dtype, grad_scale, weight_decay, monkeypatch):
    """The same operations in the same order, each rounded once, no fused multiply-adds: p, m and v
    equal the NumPy path's bits over three steps (so make train's curve keeps its optimizer bits)."""
    rng = np.random.default_rng(7)
    monkeypatch.setattr(adamw_op, "ADAMW_BLOCK", 1024)
    n = 5 * 1024 + 7  # six of the pool's blocks, the last one short
    start = [rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype),
             (rng.standard_normal(n) * 0.1).astype(dtype), (np.abs(rng.standard_normal(n)) * 0.01).astype(dtype)]

    def run():
        p, g, m, v = (a.copy() for a in start)
        for step in (1, 2, 3):
            adamw_op.adamw_update(p, g, m, v, None, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                                  weight_decay=weight_decay, step=step, grad_scale=grad_scale)
        return p, m, v

    got, ref = run(), numpy_path(monkeypatch, run)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    assert not np.array_equal(got[0], start[0])


@needs_adamw
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_sum_of_squares_is_the_gradient_norms_sum(dtype, monkeypatch):
    """The gradient norm's sum of squares (cutp.tensor_parallel.parameter._sq_sum_host): the NumPy
    path's float64 sum within float64 rounding, the same bits at 1 and 2 pool threads."""
    monkeypatch.setattr(adamw_op, "ADAMW_BLOCK", 1000)
    g = np.random.default_rng(9).standard_normal((37, 171)).astype(dtype) * 1e3
    got = parameter_mod._sq_sum_host(g)
    ref = numpy_path(monkeypatch, lambda: parameter_mod._sq_sum_host(g))
    assert got.dtype == np.float64 and abs(got - ref) <= 1e-14 * ref
    assert abs(got - float((g.astype(np.float64) ** 2).sum())) <= 1e-14 * ref
    monkeypatch.setenv("CUTP_OP_THREADS", "2")
    assert parameter_mod._sq_sum_host(g) == got
