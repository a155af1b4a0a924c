"""The benchmark suites (cutp.bench): formulas against hand counts and the literature, and every
suite run once in a tiny configuration producing well-formed tables and JSON. No timing
assertions: the numbers of a shared CI machine mean nothing."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np
import pytest

import cutp
from cutp.bench import comm as bcomm
from cutp.bench import common, compare_torch, kernels
from cutp.plan import layout as plan
from cutp.train import reporting
from cutp.bench import model as bmodel
from cutp.bench.__main__ import build_parser, main
from cutp.runtime.threads import get_blas_threads, set_blas_threads
from cutp.models import GPT, GPTConfig
from cutp.models.flops import training_flops_per_token
from tests.mpirun import run_mpi


def _args(*argv):
    return build_parser().parse_args(list(argv))


# ---------------------------------------------------------------------------------------------
# formulas
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_busbw_factors_are_nccl_tests(n):
    assert bcomm.busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert bcomm.busbw_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert bcomm.busbw_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert bcomm.busbw_factor("broadcast", n) == 1.0
    alg, bus = bcomm.bandwidths("all_reduce", 1 << 30, 0.5, n)
    assert alg == pytest.approx((1 << 30) / 0.5 / 1e9)
    assert bus == pytest.approx(alg * 2 * (n - 1) / n)
    with pytest.raises(ValueError):
        bcomm.busbw_factor("all_to_all", n)


def test_message_sizes_and_counts():
    assert bcomm.message_sizes(4096, 256 << 20, 2)[0] == 4096
    assert bcomm.message_sizes(4096, 256 << 20, 2)[-1] == 256 << 20
    assert bcomm.message_sizes(4096, 1 << 20, 4) == [4096, 16384, 65536, 262144, 1 << 20]
    assert bcomm.element_count("all_gather", 4096, 4, 3) % 3 == 0
    assert bcomm.element_count("all_reduce", 4096, 4, 3) == 1024
    assert reporting.parse_size("4K") == 4096 and reporting.parse_size("256MiB") == 256 << 20
    assert reporting.parse_count("70B") == 70e9 and reporting.parse_count("124M") == 124e6


@pytest.mark.parametrize("preset", ["tiny-moe", "llama-tiny"])
def test_model_suite_counts_training_s_flops_for_moe_and_rope_presets(preset, tmp_path):
    # bench model's GFLOP/s and MFU use the FLOPs training's MFU uses (cutp.models.flops): an MoE
    # layer's top_k experts, not all of them; no position table subtracted from a RoPE model
    j = tmp_path / "model.json"
    threads = get_blas_threads() or 1
    assert main(["model", "--preset", preset, "--device", "cpu", "--set", "n_layer=1", "--batch-size", "1",
                 "--seq-len", "16", "--timed-steps", "1", "--untimed-steps", "0", "--json", str(j), "--quiet",
                 "--threads", str(threads)]) == 0
    d = json.loads(j.read_text())
    c = GPTConfig.preset(preset, n_layer=1)
    assert d["result"]["flops_per_token"] == training_flops_per_token(c, 16)
    assert f"FLOPs/token = {training_flops_per_token(c, 16):,.0f}" in d["tables"]["step"]["notes"][0]


def test_plan_70b_against_the_literature():
    a = plan.ARCHITECTURES["70B"]
    assert plan.pick_arch("70B") is a
    pc = plan.param_count(a)
    assert pc["total"] == 68_976_648_192  # Llama-2-70B's published parameter count
    r = plan.plan(a, tp=8, dp=4, micro_batch=1, seq_len=4096, precision="mixed")
    # ~17.5 GB of 16-bit parameters per GPU at TP=8 (70e9 * 2 / 8); exactly params/GPU * 2 bytes
    assert r["param_bytes"] == r["params_per_gpu"] * 2
    assert r["param_bytes"] / 1e9 == pytest.approx(70e9 * 2 / 8 / 1e9, rel=0.02)
    # bf16 parameters keep fp32 gradients (Megatron's main_grad) and fp32 master weights + Adam m, v: 18 B
    assert r["optim_bytes"] == r["params_per_gpu"] * 12 and r["grad_bytes"] == r["params_per_gpu"] * 4
    assert r["bytes_per_param"] == 18 and r["dtype"] == "bfloat16"
    # per layer 4 all-reduces of b*s*h elements (2 forward, 2 backward)
    bsh = 1 * 4096 * 8192
    assert r["tp_allreduce_calls_per_layer"] == 4
    assert r["tp_allreduce_elements_per_layer"] == 4 * bsh
    assert r["tp_allreduce"]["elements"] == (4 * 80 + 2) * bsh
    assert r["tp_allreduce"]["wire_bytes"] == pytest.approx(r["tp_allreduce"]["bytes"] * 2 * 7 / 8)
    # DP: one all-reduce of this rank's (fp32) gradient bytes
    assert r["dp_allreduce"] == {"calls": 1, "elements": r["params_per_gpu"], "bytes": r["params_per_gpu"] * 4,
                                 "wire_bytes": r["params_per_gpu"] * 4 * 2 * 3 / 4}
    # Korthikanti et al.: s*b*h*(34 + 5*a*s/h) per layer without parallelism, (10 + 24/t + 5as/(ht)) with TP
    s, b, h, heads = 2048, 1, 8192, 64
    assert plan.activation_bytes_per_layer(s, b, h, heads, 1) == pytest.approx(s * b * h * (34 + 5 * heads * s / h))
    assert plan.activation_bytes_per_layer(s, b, h, heads, 8) == pytest.approx(
        s * b * h * (10 + 24 / 8 + 5 * heads * s / (h * 8)))
    # Table 2: with sequence parallelism, selective and full recomputation (16-bit; 4-byte activations
    # double all but the 1-byte dropout masks)
    kw = dict(s=s, b=b, h=h, a=heads, t=8)
    sbh, t = s * b * h, 8
    assert plan.activation_bytes_per_layer(**kw, sequence_parallel=True) == pytest.approx(
        sbh * (34 / t + 5 * heads * s / (h * t)))
    assert plan.activation_bytes_per_layer(**kw, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert plan.activation_bytes_per_layer(**kw, recompute="selective", sequence_parallel=True) == pytest.approx(
        sbh * 34 / t)
    assert plan.activation_bytes_per_layer(**kw, recompute="full") == 2 * sbh
    assert plan.activation_bytes_per_layer(**kw, recompute="full", sequence_parallel=True) == 2 * sbh / t
    assert plan.activation_bytes_per_layer(**kw, act_bytes=4, recompute="selective", sequence_parallel=True) == \
        pytest.approx(2 * sbh * 34 / t - 2 * sbh / t)
    assert plan.activation_bytes_per_layer(**kw, act_bytes=4, recompute="full") == 4 * sbh
    assert plan.param_count(plan.ARCHITECTURES["175B"])["total"] / 1e9 == pytest.approx(174.6, abs=0.1)


def test_gpu_peak_table():
    assert common.gpu_peak("NVIDIA H100 80GB HBM3")["label"] == "H100 SXM"
    assert common.gpu_peak("NVIDIA H100 PCIe")["label"] == "H100 PCIe"
    assert common.gpu_peak("NVIDIA H200")["bf16_tflops"] == pytest.approx(989.4)
    assert common.gpu_peak("NVIDIA A100-SXM4-80GB")["bf16_tflops"] == 312.0
    assert common.gpu_peak("NVIDIA A100 80GB PCIe")["label"] == "A100 PCIe"
    assert common.gpu_peak("Some Future GPU") is None
    p = common.gpu_peak("NVIDIA H100 80GB HBM3")
    assert common.peak_tflops(p, "float32") == 66.9 and common.peak_tflops(p, "float32", tf32=True) == 494.7
    assert common.peak_tflops(p, "bfloat16") == 989.4 and common.peak_tflops(p, "float64") is None


def test_bandwidth_row_maths():
    r = kernels.bandwidth_row(2_000_000_000, 0.5, 8.0, baseline_s=1.5)
    assert r == {"gbs": 4.0, "pct_copy": 50.0, "speedup": 3.0}
    assert kernels.bandwidth_row(10, 1.0, None)["pct_copy"] is None
    assert kernels.max_rel_error((np.ones(3),), (np.ones(3) * 1.5,)) == pytest.approx(0.5)
    assert kernels.max_rel_error((np.ones(3),), (np.ones(4),)) == math.inf


def test_kernel_bytes_formulas():
    it = 4
    ops = kernels.OPS
    assert ops["layernorm_fwd"].nbytes(dict(N=10, C=8), it) == 2 * 10 * 8 * it + 2 * 8 * it + 2 * 10 * 4
    assert ops["softmax_bwd"].nbytes(dict(B=2, heads=3, T=5), it) == 3 * 2 * 3 * 25 * it
    assert ops["adamw"].nbytes(dict(n=100), 4) == 100 * 32  # fp32: 32 bytes per parameter
    assert ops["adamw"].nbytes(dict(n=100), 2) == 100 * 24
    assert ops["ce_bwd_fused"].nbytes(dict(N=4, V=50304), 2) == 2 * 4 * 50304 * 2 + 4 * (3 * 4 + 8)


def test_attention_flops_formula_is_the_issues():
    """Forward 4*b*h*T^2*d halved for the causal mask (h: query heads), backward 2.5x (FA-2)."""
    from cutp.bench.kernel_ops import attention_flops, attention_memory

    B, H, T, D = 8, 12, 1024, 64
    assert attention_flops(B, H, T, D) == 4 * B * H * T**2 * D / 2
    assert attention_flops(B, H, T, D, causal=False) == 4 * B * H * T**2 * D
    assert attention_flops(B, H, T, D, "bwd") == 2.5 * 4 * B * H * T**2 * D / 2
    assert attention_flops(B, H, T, D, "fwd_bwd") == 3.5 * 4 * B * H * T**2 * D / 2
    assert attention_flops(8, 12, 1024, 64) == pytest.approx(25.77e9 / 2, rel=1e-3)  # GPT-2 small's layer
    gqa = dict(B=4, Hkv=4, G=2, T=4096, D=128)  # 8 query heads share 4 KV heads: FLOPs of 8 heads
    for kind in ("fwd", "bwd", "fwd_bwd"):
        spec = kernels.OPS[f"attention_{kind}"]
        assert spec.flops(gqa) == attention_flops(4, 8, 4096, 128, kind)
        assert spec.shape_label(gqa) == "B4 H4x2 T4096 D128"
    rows = 4 * 8 * 4096  # query rows: T x T float32 arrays for the unfused path, row statistics for the fused
    assert attention_memory(gqa, "fwd") == {"unfused": 2 * rows * 4096 * 4, "fused": rows * 4}
    assert attention_memory(gqa, "bwd") == {"unfused": 3 * rows * 4096 * 4, "fused": 2 * rows * 4}
    assert kernels.OPS["attention_fwd"].nbytes(gqa, 2) == 2 * 4 * 4 * 4096 * 128 * (2 * 2 + 2)  # q, k, v, o
    r = kernels.flops_row(2e12, 0.5, peak=8.0, baseline_s=1.0)
    assert r == {"tflops": 4.0, "pct_peak": 50.0, "speedup": 2.0}
    assert kernels.unfused_skip_reason(10 << 30, 100 << 30) is None
    assert kernels.unfused_skip_reason(10 << 30, None) is None
    assert "10.0 GiB" in kernels.unfused_skip_reason(10 << 30, 12 << 30)


def test_cached_activation_bytes_counts_each_buffer_once():
    from cutp.tensor_parallel import Module

    class M(Module):
        pass

    m, child = M(), M()
    m.kid = child
    base = np.zeros((10, 10), np.float32)
    m._cache_a = ((base, base[:5]),)
    child._cache_b = ({"x": base.T, "y": np.zeros(7, np.float64)},)
    assert bmodel.cached_activation_bytes(m) == 400 + 56
    assert bmodel.cached_activation_bytes(m, exclude=(base,)) == 56


def test_ops_results_do_not_depend_on_the_thread_count(monkeypatch):
    """The ops split their row blocks over threads; every block is computed as on one thread."""
    from cutp import ops

    def run():
        rng = np.random.default_rng(0)
        out = []
        x = rng.standard_normal((2, 4, 128, 128))
        y, c = ops.softmax_forward(x, 0.3, causal=True)
        out += [y, ops.softmax_backward(x, c)]
        a, w = rng.standard_normal((700, 768)), rng.standard_normal(768)
        y, c = ops.layernorm_forward(a, w, w)
        out += [y, *ops.layernorm_backward(a, c)]
        h = rng.standard_normal((300, 1024))
        y, c = ops.bias_gelu_forward(h, h[0])
        out += [y, *ops.bias_gelu_backward(h, c)]
        L, t = rng.standard_normal((100, 3000)), rng.integers(0, 3000, 100)
        loss, c = ops.cross_entropy_forward(L, t, label_smoothing=0.1)
        out += [loss, ops.cross_entropy_backward(1.0, c)]
        p, g = rng.standard_normal(300_000), rng.standard_normal(300_000)
        m, v = np.zeros_like(p), np.zeros_like(p)
        ops.adamw_update(p, g, m, v, np.ones_like(p), lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                         step=1)
        return out + [p, m, v]

    from cutp.runtime.threads import get_blas_threads, set_blas_threads

    before = get_blas_threads()
    set_blas_threads(1)  # the BLAS calls inside the blocks (GEMV sums) then round alike in both runs
    try:
        monkeypatch.setenv("CUTP_OP_THREADS", "1")
        one = run()
        monkeypatch.setenv("CUTP_OP_THREADS", "3")
        three = run()
    finally:
        set_blas_threads(before or 1)
    for a, b in zip(one, three):
        assert np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# suites, tiny configurations
# ---------------------------------------------------------------------------------------------
def test_kernels_suite_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTP_CPU_KERNELS", "0")  # (its note says so; the default's: below)
    args = _args("kernels", "--device", "cpu", "--size", "tiny", "--repeat", "2", "--warmup", "1", "--copy-mib", "8",
                 "--min-time", "0.02")
    report = kernels.run(args)
    t = report.get("kernels")
    assert {r["op"] for r in t.rows} == set(kernels.OP_GROUPS["memory-bound"])
    for r in t.rows:
        assert r["impl"] == "cutp.ops" and r["check"] == "ref" and r["us"] > 0
        assert r["gbs"] == pytest.approx(r["bytes"] / (r["us"] / 1e6) / 1e9)
        assert r["pct_copy"] == pytest.approx(100 * r["gbs"] / report.extra["copy"]["gbs"])
    assert "speedup" not in [c.key for c in t.columns]  # the CPU has no baseline to compare with
    # what was timed: the compiled C kernels or (here) the NumPy code; it said "NumPy reference" for both
    assert any("compiled kernels off (CUTP_CPU_KERNELS=0): the CPU ops run their NumPy code" in n for n in t.notes)
    monkeypatch.delenv("CUTP_CPU_KERNELS")
    from cutp.ops import compiled
    on = kernels.run(_args("kernels", "--device", "cpu", "--size", "tiny", "--repeat", "1", "--warmup", "0",
                           "--copy-mib", "8", "--min-time", "0", "--ops", "layernorm_fwd", "--dtypes", "float32"))
    assert any(f"compiled kernels {compiled.describe()}, where an op has one" in n for n in on.get("kernels").notes)
    assert any("bfloat16 skipped" in n for n in report.notes)
    text = report.render()
    assert "GB/s" in text and "layernorm_fwd" in text
    path = tmp_path / "k.json"
    report.write_json(str(path))
    d = json.loads(path.read_text())
    assert d["suite"] == "kernels" and d["copy"]["gbs"] > 0
    assert len(d["tables"]["kernels"]["rows"]) == len(t.rows)
    assert {r["op"] for r in d["tables"]["formulas"]["rows"]} == set(kernels.OP_GROUPS["memory-bound"])
    # attention: its own table, TFLOP/s and the speed-up of the blocked NumPy path over the unfused one
    a = report.get("attention")
    assert {(r["op"], r["impl"]) for r in a.rows} == {(op, impl) for op in kernels.ATTENTION_OPS
                                                       for impl in ("unfused", "numpy_blocked")}
    for r in a.rows:
        assert r["tflops"] == pytest.approx(r["flops"] / (r["us"] / 1e6) / 1e12)
        assert r["speedup"] > 0 and r["check"] in ("ref", "ok 0e+00") or r["check"].startswith("ok")
    assert "TFLOP/s" in text and "attention_fwd_bwd" in text and "FlashAttention-2's convention" in text
    assert len(d["tables"]["attention"]["rows"]) == len(a.rows)


def test_attention_bench_runs_the_emulated_kernels(monkeypatch):
    """`--ops attention` at the tiny shapes with the fused kernels under the emulator standing in
    for the GPU's: a row per implementation with its time, TFLOP/s, speed-up and working memory,
    the kernels' outputs checked against the unfused path's."""
    import shutil

    from cutp.bench import kernel_variants
    from cutp.kernels import Launchers

    if shutil.which(os.environ.get("CUTP_EMU_CXX", "g++")) is None:
        pytest.skip("the CUDA emulator needs a C++ compiler (g++ >= 12, or $CUTP_EMU_CXX)")
    from tests.cuda_emu import KERNELS_DIR, EmulatedModule

    # attention.cu alone, unchecked, -O1 (bounds and races are tests/kernels' business): a g++ run of ~4 s
    module = EmulatedModule(path=[KERNELS_DIR / "attention.cu"], checks=False, cxx_flags=("-O1",))
    monkeypatch.setattr(kernel_variants, "_bench_launchers", lambda xp: Launchers(lambda name: module, np))
    kernels.load_plugins()
    made = {}
    kernel_variants.register_bench_variants(lambda op, name, make: made.setdefault(op, make))
    for op in kernels.ATTENTION_OPS:  # the GPU's variant, registered for the CPU for this test only
        monkeypatch.setitem(kernels.VARIANTS[op], "cuda_kernels", (made[op], ("cpu",), ("float32",)))
    args = _args("kernels", "--device", "cpu", "--size", "tiny", "--ops", "attention", "--repeat", "1",
                 "--warmup", "0", "--min-time", "0")
    report = kernels.run(args)
    assert [t.name for t in report.tables] == ["attention"]  # no copy bandwidth, no memory-bound table
    rows = report.get("attention").rows
    shapes = [dict(zip("B Hkv G T D".split(), s)) for s in kernels.SIZES["tiny"]["attention"]]
    assert len(rows) == len(kernels.ATTENTION_OPS) * len(shapes) * 3
    fused = [r for r in rows if r["impl"] == "cuda_kernels"]
    assert len(fused) == len(kernels.ATTENTION_OPS) * len(shapes)
    for r in fused:
        assert r["check"].startswith("ok"), r
        assert r["us"] > 0 and r["tflops"] > 0 and r["speedup"] > 0
        shape = next(s for s in shapes if kernels.OPS[r["op"]].shape_label(s) == r["shape"])
        kind = r["op"][len("attention_"):]
        assert r["flops"] == kernels.attention_flops(shape["B"], shape["Hkv"] * shape["G"], shape["T"], shape["D"],
                                                     kind)
        assert r["work_bytes"] == kernels.attention_memory(shape, kind)["fused"]
    unfused = {(r["op"], r["shape"]): r for r in rows if r["impl"] == "unfused"}
    assert all(unfused[(r["op"], r["shape"])]["work_bytes"] > r["work_bytes"] * 16 for r in fused)  # T x T vs O(T)
    text = report.render()
    assert "cuda_kernels" in text and "vs unfused" in text


def test_attention_bench_skips_an_unfused_path_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(kernels, "free_memory", lambda xp: 1 << 10)
    args = _args("kernels", "--device", "cpu", "--size", "tiny", "--ops", "attention_fwd", "--repeat", "1",
                 "--warmup", "0", "--min-time", "0")
    rows = kernels.run(args).get("attention").rows
    base = [r for r in rows if r["impl"] == "unfused"]
    assert base and all(r["check"].startswith("skipped: its T x T arrays need") and "us" not in r for r in base)
    assert all(r["check"] == "unchecked (no baseline)" and r["speedup"] is None and r["tflops"] > 0
               for r in rows if r["impl"] == "numpy_blocked")


def test_kernel_variants_plug_in_and_are_checked():
    """A variant registered for the CPU is timed next to the reference and checked against it."""
    from cutp import ops

    def good(d, xp):
        return lambda: ops.layernorm_forward(d["x"], d["w"], d["b"])

    def bad(d, xp):
        return lambda: (d["x"] * 0, *ops.layernorm_forward(d["x"], d["w"], d["b"])[1:])

    kernels.register_variant("layernorm_fwd", "test_good", good, devices=("cpu",), dtypes=("float32",))
    kernels.register_variant("layernorm_fwd", "test_bad", bad, devices=("cpu",), dtypes=("float32",))
    try:
        args = _args("kernels", "--device", "cpu", "--size", "tiny", "--ops", "layernorm_fwd", "--repeat", "2",
                     "--warmup", "0", "--copy-mib", "8")
        rows = kernels.run(args).get("kernels").rows
    finally:
        del kernels.VARIANTS["layernorm_fwd"]["test_good"], kernels.VARIANTS["layernorm_fwd"]["test_bad"]
    checks = {(r["impl"], r["shape"]): r["check"] for r in rows}
    assert all(v.startswith("ok") for (impl, _), v in checks.items() if impl == "test_good")
    assert all(v.startswith("FAIL") for (impl, _), v in checks.items() if impl == "test_bad")
    with pytest.raises(KeyError):
        kernels.register_variant("no_such_op", "x", good)


def test_plan_cli_json_and_plot(tmp_path, capsys):
    j, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--params", "70B", "--tp", "8", "--json", str(j), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "Llama-2-70B" in out and "17.25" in out
    d = json.loads(j.read_text())
    assert d["plan"]["params_total"] == 68_976_648_192
    assert set(d["tables"]) == {"model", "memory", "comm"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_suite_tp1_in_process(tmp_path):
    j = tmp_path / "model.json"
    threads = get_blas_threads() or 1  # (--threads: the count the process has already, so later tests keep it)
    assert main(["model", "--preset", "tiny", "--device", "cpu", "--set", "n_layer=1", "--batch-size", "2",
                 "--seq-len", "16", "--timed-steps", "2", "--untimed-steps", "1", "--json", str(j), "--quiet",
                 "--threads", str(threads), "--link-bandwidth", "10", "--link-latency", "2"]) == 0
    d = json.loads(j.read_text())
    # --threads: the process's BLAS threads; --link-bandwidth: a simulated link under every group (one rank: idle)
    assert d["meta"]["blas_threads"] == threads and d["meta"]["link_bandwidth"] == 10.0 and "link" in d["tables"]
    assert "simulated link under every group: 10 GB/s, 2 us (cutp.comm.simulated)" in d["notes"]
    res = d["result"]
    c = GPTConfig.preset("tiny", n_layer=1)
    assert res["flops_per_token"] == training_flops_per_token(c, 16)
    assert res["tokens_per_s"] > 0 and res["activation_bytes"] > 0 and res["mfu_pct"] is None
    assert [r["phase"] for r in d["tables"]["phases"]["rows"]] == ["forward", "backward", "optimizer", "step"]
    mem = {r["what"]: r["mib"] for r in d["tables"]["memory"]["rows"]}
    assert mem["parameters"] == pytest.approx(GPTConfig.preset("tiny", n_layer=1).num_parameters() * 4 / 2**20)
    # where the step goes, per op kind: every kind that runs has time, and the parts add up to the step
    kinds = {r["kind"]: r["ms"] for r in d["tables"]["ops"]["rows"]}
    for kind in ("gemm", "attention", "norms", "activations", "cross-entropy", "optimizer"):
        assert kinds[kind] > 0, kind
    assert kinds["communication"] == 0  # one rank
    parts = sum(ms for k, ms in kinds.items() if k != "step")
    assert parts == pytest.approx(kinds["step"], rel=0.05)  # (medians per kind: near, not exact)


def _mpi_suites(tmpdir):
    """Runs on 2 ranks: the comm suite, and the model suite at TP=2 with and without comm timing."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    main(["comm", "--device", "cpu", "--max-size", "64K", "--iters", "3", "--warmup", "1", "--quiet",
          "--json", os.path.join(tmpdir, "comm.json")])
    base = ["model", "--preset", "tiny", "--device", "cpu", "--tp", "2", "--set", "n_layer=2", "--batch-size", "2",
            "--seq-len", "16", "--timed-steps", "2", "--untimed-steps", "1", "--quiet"]
    main(base + ["--json", os.path.join(tmpdir, "timed.json")])
    main(base + ["--no-comm-timing", "--json", os.path.join(tmpdir, "untimed.json")])
    at = base.index("--tp")
    cp = base[:at] + ["--tp", "1", "--cp", "2"] + base[at + 2:]
    main(cp + ["--json", os.path.join(tmpdir, "cp.json")])
    if rank != 0:
        assert not os.path.exists(os.path.join(tmpdir, f"rank{rank}.json"))


def test_comm_and_model_suites_on_two_ranks(tmp_path):
    run_mpi(2, "tests.bench.test_suites:_mpi_suites", str(tmp_path), timeout=120)
    d = json.loads((tmp_path / "comm.json").read_text())
    rows = d["tables"]["comm"]["rows"]
    assert {r["op"] for r in rows} == set(bcomm.OPS)
    assert len(rows) == 4 * len(bcomm.message_sizes(4096, 64 << 10, 4))
    for r in rows:
        assert r["check"] == "ok"
        assert r["algbw"] == pytest.approx(r["size"] / (r["us"] / 1e6) / 1e9, rel=1e-6)
        assert r["busbw"] == pytest.approx(r["algbw"] * bcomm.busbw_factor(r["op"], 2), rel=1e-9)
    timed = json.loads((tmp_path / "timed.json").read_text())
    untimed = json.loads((tmp_path / "untimed.json").read_text())
    # the timing wrapper changes nothing the model computes
    assert timed["result"]["losses"] == untimed["result"]["losses"]
    comm_rows = {r["key"]: r for r in timed["tables"]["comm"]["rows"]}
    # 2 layers: 4 all-reduces each, embedding + LM head, 2 for the cross-entropy, 1 for the grad norm
    assert comm_rows["tp.all_reduce"]["calls"] == 4 * 2 + 2 + 2 + 1
    assert timed["result"]["comm_ms"]["forward"] > 0
    assert timed["meta"]["tp"] == 2
    # --cp 2: the same model and tokens with each sequence over the two ranks (the ring's sends)
    cp = json.loads((tmp_path / "cp.json").read_text())
    assert cp["meta"]["cp"] == 2 and cp["meta"]["tp"] == 1
    np.testing.assert_allclose(cp["result"]["losses"], timed["result"]["losses"], rtol=1e-5)
    cp_rows = {r["key"]: r for r in cp["tables"]["comm"]["rows"]}
    assert cp_rows["cp.send"]["calls"] == cp_rows["cp.recv"]["calls"] > 0 and "tp.all_reduce" not in cp_rows


def _mpi_zero3_model(path):
    main(["model", "--preset", "tiny", "--device", "cpu", "--dp", "2", "--zero", "3", "--set", "n_layer=1",
          "--batch-size", "2", "--seq-len", "16", "--timed-steps", "1", "--untimed-steps", "1", "--threads", "1",
          "--quiet", "--json", path])


def test_model_suite_times_zero_3s_non_blocking_collectives(tmp_path):
    """ZeRO-3's gathers and reduce-scatters are non-blocking (start_*, waited for in the unit hooks):
    their time is in the per-collective table and in the phases that wait for them, not 0 ms
    (the bench timed the blocking calls only)."""
    path = tmp_path / "z3.json"
    run_mpi(2, "tests.bench.test_suites:_mpi_zero3_model", str(path), timeout=120)
    d = json.loads(path.read_text())
    rows = {r["key"]: r for r in d["tables"]["comm"]["rows"]}
    for key in ("dp.all_gather", "dp.reduce_scatter"):
        assert rows[key]["calls"] > 0 and rows[key]["ms"] > 0, (key, rows)
    # the gathers are waited for before each unit's forward and backward, the reduce-scatters in the backward
    assert d["result"]["comm_ms"]["forward"] > 0 and d["result"]["comm_ms"]["backward"] > 0, d["result"]["comm_ms"]


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_compare_torch_skipped_or_same_loss(preset):
    from cutp.bench import compare_torch

    why = compare_torch.torch_missing_reason()
    if why:
        pytest.skip(f"compare-torch needs torch, an optional extra not installed here: {why}")
    r = compare_torch.compare(preset, batch=2, seq_len=16, threads=1, overrides=["n_layer=1"], check_only=True)
    chk = r["check"]
    assert chk["ok"], chk
    assert chk["loss_rel_diff"] < 1e-5 and max(chk["grads"].values()) < 1e-3
    if preset == "llama-tiny":
        assert set(chk["grads"]) == set(compare_torch.CHECKED_LLAMA_GRADS)
        if compare_torch.transformers_missing_reason():
            assert "transformers" not in chk  # (the suite's note says why it was not checked)
        else:  # the timed module is transformers' math: its loss and gradients as LlamaForCausalLM's
            hf = chk["transformers"]
            assert hf["loss_rel_diff"] < 1e-6 and max(hf["grads"].values()) < 1e-5


def test_compare_torch_suite_reports_a_skip_without_torch(monkeypatch):
    from cutp.bench import compare_torch

    monkeypatch.setattr(compare_torch, "torch_missing_reason", lambda: "torch is not importable (test)")
    report = compare_torch.run(argparse.Namespace(presets=["tiny"]))
    assert report.extra["skipped"] and "skipped" in report.render()


@pytest.fixture
def threads_kept():
    """The BLAS's (and torch's, where installed) thread counts as they were, after the test."""
    blas = get_blas_threads() or 1
    torch = None if compare_torch.torch_missing_reason() else sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    set_blas_threads(blas)
    if torch is not None:
        torch.set_num_threads(before)


def test_compare_torch_times_both_at_tiny_sizes_and_refuses_what_it_cannot_build(tmp_path, monkeypatch, threads_kept):
    """The command end to end (torch only: CI has none, `make bench` runs it): each preset
    checked, then timed interleaved (both attentions of the torch module), a row with both
    times and their ratio, the transformers check's note for the Llama one, the JSON written;
    configurations the plain torch modules do not implement refused by name; a torch or
    transformers that does not import named as the reason."""
    if compare_torch.torch_missing_reason():
        pytest.skip(f"compare-torch needs torch, an optional extra not installed here: "
                    f"{compare_torch.torch_missing_reason()}")
    for attention in ("sdpa", "manual"):
        out = tmp_path / f"{attention}.json"
        assert main(["compare-torch", "--presets", "tiny", "llama-tiny", "--set", "n_layer=1", "--batch-size", "2",
                     "--seq-len", "16", "--threads", "1", "--repeat", "2", "--warmup", "1", "--gap", "0",
                     "--profile-repeats", "2", "--torch-attention", attention, "--quiet", "--json", str(out)]) == 0
        results = json.loads(out.read_text())["results"]
        assert [r["preset"] for r in results] == ["tiny", "llama-tiny"] and all(r["check"]["ok"] for r in results)
        for r in results:
            assert r["cutp"]["repeats"] == r["torch_timing"]["repeats"] == 2 and r["attention"] == attention
            assert r["ratio"] == pytest.approx(r["cutp_ms"] / r["torch_ms"]) and r["cutp_ms"] > 0
            # the profiled split: both sides' GEMMs timed (each a part of its own step), the floor
            # cutp's GEMMs over torch's timed step
            cut, tor = r["profiled_ms"]["cutp"], r["profiled_ms"]["torch"]
            assert 0 < cut["gemm"] < cut["step"] and cut["attention"] > 0 and cut["norms"] > 0
            assert 0 < tor["gemm"] < tor["step"]
            assert r["gemm_floor"] == pytest.approx(cut["gemm"] / r["torch_ms"])
        split = json.loads(out.read_text())["tables"]["split"]["rows"]
        assert [row["preset"] for row in split] == ["tiny", "llama-tiny"]
        assert all(row["cutp_rest"] == pytest.approx(r["cutp_ms"] - r["profiled_ms"]["cutp"]["gemm"])
                   for row, r in zip(split, results))
    # a GPT-2 without biases: the checked bias gradient is absent, the rest still checked
    r = compare_torch.compare("tiny", batch=2, seq_len=16, threads=1, overrides=["n_layer=1", "bias=False"],
                              check_only=True)
    assert r["check"]["ok"] and "layers.0.mlp.fc1.bias" not in r["check"]["grads"] and r["check"]["grads"]
    # a disagreement is reported and not timed; a Llama without transformers says it was not checked
    with monkeypatch.context() as m:
        m.setattr(compare_torch, "check_same_work", lambda *a, **k: dict(r["check"], ok=False))
        m.setattr(compare_torch, "transformers_missing_reason", lambda: "transformers is not importable (test)")
        report = compare_torch.run(argparse.Namespace(
            presets=["tiny", "llama-tiny"], batch_size=2, seq_len=16, threads=1, repeat=1, warmup=0,
            torch_attention="sdpa", set=["n_layer=1"], check_only=False, gap=0.0, profile_repeats=1))
    assert any(n.startswith("tiny: cutp and torch DISAGREE") and n.endswith("not timed") for n in report.notes)
    assert "llama-tiny: not checked against transformers (transformers is not importable (test))" in report.notes
    assert "cutp_ms" not in report.extra["results"][0] and "cutp_ms" in report.extra["results"][1]
    # a torch without the dispatch mode (a private module): the split without torch's GEMMs
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torch.utils._python_dispatch", None)
        report = compare_torch.run(argparse.Namespace(
            presets=["tiny"], batch_size=2, seq_len=16, threads=1, repeat=1, warmup=0, torch_attention="sdpa",
            set=["n_layer=1"], check_only=False, gap=0.0, profile_repeats=1))
    r, = report.extra["results"]
    assert "gemm" not in r["profiled_ms"]["torch"] and r["profiled_ms"]["torch"]["step"] > 0
    assert r["gemm_floor"] > 0 and {t.name: t for t in report.tables}["split"].rows[0]["torch_gemm"] is None
    tiny, llama = GPTConfig.preset("tiny"), GPTConfig.preset("llama-tiny")
    with cutp.init(tp=1, device="cpu", abort_on_error=False) as ctx:
        state = dict(GPT(ctx, tiny).gather_state_dict(), **{"tok_embed.weight": np.zeros((3, 3), np.float32)})
        hf_state = compare_torch.hf_state_dict(llama, GPT(ctx, llama).gather_state_dict())
    with pytest.raises(ValueError, match=r"wte.weight: cutp shape \(3, 3\) does not fit torch shape"):
        compare_torch.build_torch_gpt(tiny, state)
    tmodel = compare_torch.build_torch_llama(llama, hf_state)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: cutp shape \(3,\) does not fit torch shape"):
        compare_torch._load(tmodel, {name: np.zeros(3, np.float32) for name, _ in tmodel.named_parameters()})
    with pytest.raises(ValueError, match="supports GPT-2 configurations"):
        compare_torch.build_torch_gpt(llama, {})
    with pytest.raises(ValueError, match="supports dense, untied Llama configurations"):
        compare_torch.build_torch_llama(dataclasses.replace(llama, tie_embeddings=True), {})
    monkeypatch.setitem(sys.modules, "torch", None)  # (import torch raises ModuleNotFoundError)
    assert compare_torch.torch_missing_reason().startswith("torch is not importable (ModuleNotFoundError")
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert compare_torch.transformers_missing_reason().startswith("transformers is not importable (ModuleNotFoundError")


def test_plan_refuses_a_mesh_the_model_cannot_take_with_one_line():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "cutp", "bench", "plan", "--preset", "gpt2", "--tp", "8"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == ("python -m cutp bench plan: error: tp=8 does not divide n_head=12: attention is "
                                  "split by whole heads; use tp in [1, 2, 3, 4, 6, 12]"), out.stderr
    gqa = dataclasses.replace(plan.ARCHITECTURES["70B"], n_embd=6144, n_head=48, n_kv_head=12)
    with pytest.raises(cutp.ConfigError, match="tp=16 and n_kv_head=12: KV heads are either split"):
        plan.plan(gqa, tp=16, dp=1, micro_batch=1, seq_len=16)
