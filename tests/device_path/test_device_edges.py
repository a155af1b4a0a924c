"""The device path's edge cases that no training run reaches (found by `make coverage`):

- `cutp.ops.gemm` on cuBLAS (the stand-in's gemmEx, in this process): empty products (m == 0,
  k == 0, with and without accumulate), a 16-bit gradient buffer accumulated through an unfused
  product, an `out` cuBLAS cannot write, the 32-bit dimension limit, `column_sums` into a buffer
  that is not float32;
- CuPy present without a usable GPU (`cupy_status`), NVRTC without the tensor-core header;
- the kernels' dispatch with CuPy (`dispatch_xp`, `launch_counts` over devices), the SM count
  when the device cannot say, the module loader's CUDA headers with and without NVRTC's version;
- `cutp.runtime.backend` with CuPy present: NCCL's status and version, `as_array` of another
  library's device array (`__cuda_array_interface__`), of a host DLPack exporter, and of a
  device array for the host;
- `python -m cutp info` with CuPy present (the CUDA runtime and driver versions, the devices,
  NCCL);
- `cutp bench kernels --device cuda` (every op, float32 and bfloat16, tiny shapes): each CUDA
  kernel variant agrees with its CuPy reference, and the GPU timing path (events, the copy
  bandwidth) runs;
- `python -m cutp.bench.gemm` (the step's GEMMs timed in bfloat16, float32 and TF32, cuBLAS
  against `cupy.matmul`), `cutp bench moe --device cuda` (the memory pool's peak of each path)
  and `cutp bench model --device cuda` (per-op CUDA events, the pool's high-water mark, MFU on a
  device the peak table knows) at tiny sizes;
- `cutp.ops.erf` / `erfc` of device arrays (cupyx.scipy.special) and the rotary kernel's refusal
  of an `out` of another shape;
- `cutp.comm.nccl` on 2 ranks (NCCL over MPI): broadcast, send and receive, barrier, close and
  abort, a host array refused, and a unique id whose making failed on the first rank reported on
  every rank.
"""
import json
import os
import runpy
import subprocess
import sys
import time
import types

import ml_dtypes
import numpy as np
import pytest

from tests.device_path.harness import ON_GPU, ROOT, device_env, run_device
from tests.device_path.standin import build

pytestmark = [pytest.mark.device_path]
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def cp(monkeypatch):
    """The stand-in as `cupy` for this test only (cutp's gemm imports cupy.cuda.cublas)."""
    mods = build()
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    return mods["cupy"]


@pytest.mark.device_path_default
@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_the_benchmarks_comm_clock_times_collectives_by_gpu_events(cp):
    """On CuPy a collective is timed by an event pair on the current stream, read at `collect`
    (after synchronising), into the phase it ran in and its group.op."""
    from cutp.bench.comm_timing import CommClock, TimedCommunicator

    def all_reduce(x, op="sum"):
        time.sleep(0.02)  # (the stand-in's events: the host time between the records)
        return x * 2

    inner = types.SimpleNamespace(name="dp", rank=0, size=1, kind="nccl", all_reduce=all_reduce)
    clock = CommClock(cp)
    timed = TimedCommunicator(inner, clock)
    clock.phase = "backward"
    assert timed.all_reduce(3, op="sum") == 6
    assert clock.seconds == {} and len(clock._events) == 1  # (read only at collect)
    clock.collect()
    assert set(clock.seconds) == {"backward"} and set(clock.by_op) == {"dp.all_reduce"}
    assert 0.02 <= clock.seconds["backward"] == clock.by_op["dp.all_reduce"] < 1.0 and clock._events == []
    clock.collect()  # nothing new: nothing added
    assert set(clock.seconds) == {"backward"}


@pytest.mark.device_path_default
@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_the_benchmarks_comm_clock_times_a_non_blocking_collective_at_its_wait(cp):
    """On CuPy a start_* collective's start is not timed (it only queues the collective); its wait
    is, by an event pair on the current stream (the stall of the computation), into the phase
    current at the wait and the blocking collective's group.op."""
    from cutp.bench.comm_timing import CommClock, TimedCommunicator

    class Request:
        op, result = "all_gather", "gathered"

        def test(self):
            return True

        def wait(self):
            time.sleep(0.02)  # (the stand-in's events: the host time between the records)
            return self.result

    def start_all_gather(x, out=None):
        time.sleep(0.02)  # not timed on the GPU: a start returns at once there
        return Request()

    inner = types.SimpleNamespace(name="dp", rank=0, size=2, kind="nccl", start_all_gather=start_all_gather)
    clock = CommClock(cp)
    timed = TimedCommunicator(inner, clock)
    clock.phase = "forward"
    request = timed.start_all_gather(3)
    assert clock._events == [] and request.op == "all_gather" and request.test()
    clock.phase = "backward"
    assert request.wait() == "gathered" and request.result == "gathered"
    clock.collect()
    assert set(clock.seconds) == {"backward"} and set(clock.by_op) == {"dp.all_gather"}
    assert 0.02 <= clock.seconds["backward"] == clock.by_op["dp.all_gather"] < 0.04


@pytest.mark.device_path_default
@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_gemm_edge_cases_on_cublas(cp):
    from cutp.ops.gemm import INT_MAX, column_sums, gemm, on_cublas

    rng = np.random.default_rng(0)
    a_h, b_h = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 5)).astype(np.float32)
    a, b = cp.asarray(a_h), cp.asarray(b_h)
    assert on_cublas(a, b)
    np.testing.assert_allclose(gemm(a, b).get(), a_h @ b_h, rtol=1e-6)
    # empty products: nothing to compute (gemmEx is not called with a zero dimension)
    assert gemm(cp.zeros((0, 4), np.float32), b).shape == (0, 5)
    assert float(abs(gemm(cp.zeros((3, 0), np.float32), cp.zeros((0, 5), np.float32))).sum()) == 0.0
    out = cp.ones((3, 5), np.float32)
    gemm(cp.zeros((3, 0), np.float32), cp.zeros((0, 5), np.float32), out=out, accumulate=True)
    assert out.get().tolist() == np.ones((3, 5)).tolist()  # k == 0 adds nothing
    # a bfloat16 gradient buffer: the product rounded to bfloat16, then added (not fused)
    a16, b16 = a.astype(BF16), b.astype(BF16)
    grad = cp.asarray(np.full((3, 5), 0.5, BF16))
    gemm(a16, b16, out=grad, accumulate=True)
    want = (np.full((3, 5), 0.5, np.float32) + (a16.get().astype(np.float32) @ b16.get().astype(np.float32))
            .astype(BF16).astype(np.float32)).astype(BF16)
    assert grad.get().tolist() == want.tolist()
    # what cuBLAS cannot write, and what it cannot address
    with pytest.raises(ValueError, match="C-contiguous"):
        gemm(a, b, out=cp.zeros((5, 3), np.float32).T)
    with pytest.raises(ValueError, match="op\\(a\\) is 3 x 4, op\\(b\\) is 5 x 4"):
        gemm(a, b, trans_b=True)
    with pytest.raises(ValueError, match="accumulate=True adds into `out`"):
        gemm(a, b, accumulate=True)
    with pytest.raises(ValueError, match="out has shape"):
        gemm(a, b, out=cp.zeros((3, 4), np.float32))
    one = cp.zeros(1, np.float32)  # k = 2^31: one element's memory, broadcast
    wide, tall = (cp.ndarray(shape, np.float32, memptr=one.data, strides=(0, 0))
                  for shape in ((3, INT_MAX + 1), (INT_MAX + 1, 5)))
    with pytest.raises(ValueError, match="32-bit dimensions"):
        gemm(wide, tall)
    # column sums of bfloat16 rows into a bfloat16 buffer: float32 sums added, the total rounded
    x = cp.asarray(rng.standard_normal((6, 5)).astype(BF16))
    acc = cp.asarray(np.ones(5, BF16))
    column_sums(x, out=acc)
    sums = x.get().astype(np.float32).sum(axis=0)
    np.testing.assert_allclose(acc.get().astype(np.float32), (1 + sums).astype(BF16).astype(np.float32), atol=1e-7)


class _Exporter:
    """Another library's array: only the protocols (as Numba's or PyTorch's would give)."""

    def __init__(self, a, *, device):
        self._a, self._device = a, device

    @property
    def __cuda_array_interface__(self):
        if self._device != "cuda":
            raise AttributeError("__cuda_array_interface__")
        return self._a.__cuda_array_interface__

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.device_path_default
@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_backend_with_cupy_present(cp):
    from cutp.runtime.backend import as_array, nccl_status

    ok, why = nccl_status()
    assert ok and why == "NCCL 2.27.3", why  # (the stand-in's get_version, 22703)
    dev = cp.arange(6, dtype=np.float32).reshape(2, 3)
    view = as_array(cp, _Exporter(dev, device="cuda"))  # no copy: the same device memory
    assert view.data.ptr == dev.data.ptr and view.get().tolist() == dev.get().tolist()
    host = np.arange(4, dtype=np.float64)
    moved = as_array(cp, _Exporter(host, device="cpu"), np.float32)  # host DLPack: through NumPy, then copied
    assert type(moved).__name__ == "ndarray" and type(moved).__module__ == "cupy" and moved.get().tolist() == [0, 1, 2, 3]
    assert as_array(np, dev).tolist() == [[0, 1, 2], [3, 4, 5]]  # (for the host: a device-to-host copy)


@pytest.mark.device_path_default
@pytest.mark.skipif(ON_GPU, reason="the stand-in's devices")
def test_cutp_info_with_cupy_present():
    """`python -m cutp info` with the stand-in as CuPy: versions, devices, NCCL, backend usable."""
    proc = subprocess.run([sys.executable, "-m", "cutp", "info"], env=dict(os.environ, **device_env()), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = dict(line.strip().split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert info["backend cuda"] == "usable (CuPy + NCCL)" and info["NCCL"] == "NCCL 2.27.3", info
    assert info["CUDA runtime"] == "12.4" and info["GPU 0"].endswith("80.0 GiB, sm_90"), info


@pytest.mark.device_path_default
@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_cupy_without_a_usable_gpu_and_nvrtc_without_its_headers(cp, monkeypatch, tmp_path):
    """CuPy importing where the CUDA runtime fails or sees no GPU: cupy_status says which, and
    NVRTC's tensor-core header missing: the error names the wheels to install."""
    from cutp.kernels.runtime import KernelLoadError, find_mma_include
    from cutp.runtime.backend import cupy_status

    def broken():
        raise RuntimeError("cudaErrorNoDevice")

    monkeypatch.setattr(cp.cuda.runtime, "getDeviceCount", broken)
    assert cupy_status() == (False, "cupy imports but the CUDA runtime sees no usable GPU (RuntimeError: "
                                    "cudaErrorNoDevice)")
    monkeypatch.setattr(cp.cuda.runtime, "getDeviceCount", lambda: 0)
    assert cupy_status() == (False, "cupy imports but the CUDA runtime reports 0 GPUs")
    monkeypatch.setitem(sys.modules, "nvidia", None)  # (no NVIDIA wheel installed)
    with pytest.raises(KernelLoadError, match="need crt/mma.h for NVRTC.*nvidia-cuda-nvcc-cu12.*Searched: " +
                       str(tmp_path)):
        find_mma_include(str(tmp_path), candidates=[], environ={})
    # CUDA 12's nvcc wheel (nvidia/cuda_nvcc/include) found through the nvidia namespace package
    wheel = tmp_path / "site" / "nvidia"
    (wheel / "cuda_nvcc" / "include" / "crt").mkdir(parents=True)
    (wheel / "cuda_nvcc" / "include" / "crt" / "mma.h").write_text("")
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(__path__=[str(wheel)]))
    assert find_mma_include(str(tmp_path), candidates=[], environ={}) == str(wheel / "cuda_nvcc" / "include")


@pytest.mark.device_path_default
@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_kernel_dispatch_launch_counts_and_module_loading_on_cupy(cp, monkeypatch, tmp_path):
    """With CuPy: dispatch_xp hands out the current device's launchers (none with the kernels off),
    launch_counts sums every device's, the SM count falls back to the target's when the device
    cannot say, and the module loader finds the CUDA headers without NVRTC's version (the first
    candidate) and with it (the candidate of NVRTC's major version)."""
    from cutp import kernels
    from cutp.kernels.runtime import TARGET_SM_COUNT, cupy_module_loader, kernel_source

    monkeypatch.setattr(kernels, "_cupy_launchers", {})  # (this test's launchers, gone after it)
    k0 = kernels.dispatch_xp(cp)
    assert k0 is kernels.cupy_launchers(0) and k0.xp is cp and repr(k0).endswith("cupy device 0>")
    with kernels.use_kernels(False):
        assert kernels.dispatch_xp(cp) is None
    k0.launches["gelu_forward_f32"] += 2
    kernels.cupy_launchers(1).launches.update(gelu_forward_f32=1, softmax_forward_f32=1)
    assert kernels.launch_counts() == {"gelu_forward_f32": 3, "softmax_forward_f32": 1}
    assert k0.sm_count() == 132  # (the stand-in's H100-like device)

    class NoAttributes:
        @property
        def attributes(self):
            raise RuntimeError("cudaErrorInvalidValue")

    monkeypatch.setattr(cp.cuda, "Device", NoAttributes)
    assert kernels.Launchers(lambda s: None, cp).sm_count() == TARGET_SM_COUNT
    built = []
    monkeypatch.setattr(cp, "RawModule", lambda code, options: built.append((code, options)) or "module")
    for version, dirname in ((13, "wheel"), (12, "toolkit")):
        d = tmp_path / dirname / "include"
        d.mkdir(parents=True)
        for header in ("cuda_bf16.h", "cuda_fp16.h"):
            (d / header).write_text("")
        (d / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {version}000\n")
    monkeypatch.setenv("CUTP_CUDA_INCLUDE", str(tmp_path / "wheel" / "include"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    assert cupy_module_loader()("gelu") == "module"  # NVRTC 12 (the stand-in's): the CUDA 12 headers
    assert built[-1] == (kernel_source("gelu"), ("--std=c++17", f"-I{tmp_path / 'toolkit' / 'include'}"))

    def no_version():
        raise RuntimeError("nvrtc: symbol not found")

    monkeypatch.setattr(cp.cuda.nvrtc, "getVersion", no_version)
    cupy_module_loader()("gelu")  # NVRTC's version unknown: the first candidate
    assert built[-1][1] == ("--std=c++17", f"-I{tmp_path / 'wheel' / 'include'}")


@pytest.mark.device_path_default
@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_time_gpu_runs_setup_and_the_flush_untimed_before_every_call(cp):
    from cutp.bench.common import time_gpu

    order = []
    t = time_gpu(lambda: order.append("fn"), warmup=1, repeat=2, setup=lambda: order.append("setup"),
                 flush=lambda: order.append("flush"))
    assert order == ["setup", "fn"] + ["setup", "flush", "fn"] * 2 and len(t.times) == 2 and min(t.times) >= 0


def _worker_nccl():
    import cupy
    from mpi4py import MPI

    from cutp.comm.base import CommError
    from cutp.comm.nccl import NcclCommunicator, broadcast_unique_id, check_array

    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    c = NcclCommunicator(comm, "edges")
    x = cupy.arange(4, dtype=np.float32) + 10 * r
    assert c.broadcast(x, root=1).get().tolist() == [10.0, 11.0, 12.0, 13.0]
    if r == 0:
        c.send(cupy.full(3, 7, np.float32), 1)
    else:
        assert c.recv(cupy.zeros(3, np.float32), 0).get().tolist() == [7.0] * 3
    c.barrier()
    with pytest.raises(CommError, match="takes CuPy arrays, got numpy.ndarray"):
        check_array(np.zeros(2, np.float32), "all_reduce on edges")

    def broken():
        raise RuntimeError("no id today")

    with pytest.raises(CommError, match="failed on the group's first rank: RuntimeError: no id today"):
        broadcast_unique_id(comm, broken)  # (every rank: rank 1 learns it from rank 0)
    c.close()
    c.abort()
    print(f"rank {r}: nccl edges ok", flush=True)


def test_nccl_broadcast_send_recv_barrier_and_failures():
    proc = run_device(2, "tests.device_path.test_device_edges:_worker_nccl", timeout=120)
    assert proc.stdout.count("nccl edges ok") == 2, proc.stdout[-2000:]


@pytest.mark.usefixtures("emulated_kernels")
def test_kernel_benchmarks_check_every_variant_on_the_device_path(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, "-m", "cutp", "bench", "kernels", "--device", "cuda", "--size", "tiny",
                           "--repeat", "1", "--warmup", "0", "--budget", "0", "--copy-mib", "1",
                           "--dtypes", "float32", "bfloat16", "--json", str(out), "--quiet"],
                          env=dict(os.environ, **device_env()), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = [r for name in ("kernels", "attention") for r in report["tables"][name]["rows"]]
    variants = [r for r in rows if r["impl"] == "cuda_kernels"]
    assert len({r["op"] for r in variants}) >= 15, sorted({r["op"] for r in rows})  # every op has its kernel
    bad = [(r["op"], r["dtype"], r["shape"], r["check"]) for r in rows if not r["check"].startswith(("ok", "ref"))]
    assert not bad, bad
    assert report["copy"]["gbs"] > 0


def _benches_on_the_device(out):
    """(In a process with the stand-in as CuPy) the GEMM, MoE and model benchmarks on the GPU path."""
    import cupy

    from cutp import ops
    from cutp.bench import gemm
    from cutp.bench.__main__ import main

    tf32 = ops.tf32_allowed()
    sys.argv = ["python -m cutp.bench.gemm", "--preset", "tiny", "--tokens", "16", "--repeat", "1", "--warmup", "1",
                "--json", os.path.join(out, "gemm.json")]
    try:
        runpy.run_module("cutp.bench.gemm", run_name="__main__")
    except SystemExit as e:
        assert e.code == 0, e.code
    assert ops.tf32_allowed() == tf32  # (restored after the TF32 pass)
    assert main(["moe", "--device", "cuda", "--tokens", "16", "--hidden", "8", "--experts", "4", "--expert-width",
                 "4", "--top-k", "2", "--repeat", "1", "--quiet", "--json", os.path.join(out, "moe.json")]) == 0
    # bench model on the GPU path (its per-op events, the pool's high-water mark, the profiled extra
    # step), on the stand-in's device (no peak known: no MFU) and named as an H100 (MFU computed)
    model = ["model", "--device", "cuda", "--preset", "tiny", "--set", "n_layer=1", "--batch-size", "2", "--seq-len",
             "16", "--timed-steps", "1", "--untimed-steps", "0", "--quiet"]
    assert main(model + ["--json", os.path.join(out, "model.json")]) == 0
    props = cupy.cuda.runtime.getDeviceProperties
    cupy.cuda.runtime.getDeviceProperties = lambda device: dict(props(device), name=b"NVIDIA H100 80GB HBM3")
    assert main(model + ["--json", os.path.join(out, "model_h100.json")]) == 0


@pytest.mark.usefixtures("emulated_kernels")
def test_gemm_moe_and_model_benchmarks_on_the_device_path(tmp_path):
    from cutp.bench.gemm import LABELS, step_gemms
    from cutp.models import GPTConfig

    proc = subprocess.run([sys.executable, "-c", "import sys; from tests.device_path.test_device_edges import "
                           "_benches_on_the_device as f; f(sys.argv[1])", str(tmp_path)],
                          env=dict(os.environ, **device_env()), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("GEMMs of a tiny step, 16 tokens, tp 1, on ") and all(
        f"  {label}: " in proc.stdout for label in LABELS), proc.stdout
    g = json.loads((tmp_path / "gemm.json").read_text())
    names = [x.name for x in step_gemms(GPTConfig.preset("tiny"), 16, 1)]
    assert [x["name"] for x in g["gemms"]] == names
    assert all(list(g["per_gemm"][label]) == names for label in ("bfloat16", "float32", "float32+tf32"))
    for name, mfu in (("model.json", None), ("model_h100.json", "MFU against H100 SXM dense float32 peak 66.9")):
        m = json.loads((tmp_path / name).read_text())
        assert m["meta"]["device"] == "cuda" and (m["result"]["mfu_pct"] is None) == (mfu is None), m["result"]
        said = mfu or "no peak known for 'CuPy stand-in (NumPy on the CPU)' in float32"
        assert any(n.startswith(said) for n in m["notes"]), m["notes"]
        mem = {r["what"]: r["mib"] for r in m["tables"]["memory"]["rows"]}
        kinds = {r["kind"]: r["ms"] for r in m["tables"]["ops"]["rows"]}
        assert mem["CuPy pool high-water"] > 0 and kinds["gemm"] > 0 and kinds["attention"] > 0, (mem, kinds)
    moe = json.loads((tmp_path / "moe.json").read_text())
    assert moe["meta"]["device"] == "cuda"
    peaks = {r["path"]: r["peak"] for r in moe["tables"]["moe"]["rows"]}
    # the pool's peak of each forward + backward (its used bytes at each allocation: never 0 B)
    assert set(peaks) == {"dense SwiGLU", "grouped experts"} and all(float(p.split()[0]) > 0 for p in peaks.values())


@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_erf_and_erfc_of_device_arrays_are_cupyxs(cp):
    from cutp import ops

    x_h = np.linspace(-6.0, 6.0, 97)
    for fn in (ops.erf, ops.erfc):
        got = fn(cp.asarray(x_h))
        assert isinstance(got, cp.ndarray)  # computed on the device (cupyx.scipy.special), not the host
        np.testing.assert_allclose(got.get(), fn(x_h), rtol=1e-13, atol=0)


@pytest.mark.device_path_default
@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_float64_cross_entropy_on_the_device_takes_the_array_path_not_the_hosts_c(cp):
    """float64 device logits: no CUDA kernel takes them and the host's compiled C must not be
    handed device pointers: the array code runs, on the device, with the host's results."""
    from cutp import ops

    rng = np.random.default_rng(0)
    logits, targets = rng.standard_normal((6, 10)), np.array([0, 3, -1, 8, 2, 5])
    want = ops.ce_shard_forward(logits, targets, 9)
    got = ops.ce_shard_forward(cp.asarray(logits), cp.asarray(targets), 9)
    for g, w in zip(got[:3], want[:3]):
        assert isinstance(g, cp.ndarray)
        np.testing.assert_allclose(g.get(), w, rtol=1e-14, atol=0)
    scale = np.full(6, 0.5)
    want_d = ops.ce_shard_backward(logits, *want[:2], targets, 9, scale)
    got_d = ops.ce_shard_backward(cp.asarray(logits), *got[:2], cp.asarray(targets), 9, cp.asarray(scale))
    assert isinstance(got_d, cp.ndarray)
    np.testing.assert_allclose(got_d.get(), want_d, rtol=1e-13, atol=1e-16)


@pytest.mark.skipif(ON_GPU, reason="runs the stand-in in this process")
def test_the_rotary_kernels_refuse_an_out_of_another_shape_or_dtype(cp):
    from cutp import ops

    x = cp.asarray(np.ones((1, 4, 2, 8), np.float32))
    cos, sin = (cp.asarray(t) for t in ops.rope_tables(8, 4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"rotary: out \(1, 4, 2, 6\) float32 must match the input \(1, 4, 2, 8\)"):
        ops.rotary_forward(x, cos, sin, out=cp.empty((1, 4, 2, 6), np.float32))  # (the kernel's own check)
    with pytest.raises(ValueError, match=r"rotary_forward: out \(1, 4, 2, 8\) float64 must match the input"):
        ops.rotary_forward(x, cos, sin, out=cp.empty((1, 4, 2, 8), np.float64))  # (not the kernel's: the array path's)
