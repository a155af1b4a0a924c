"""The benchmark suites' edges, in one process (issue 41's coverage): the command line's refusals
of a message size or factor and an unknown kernel op (one line, exit 2); the comm suite on one
rank with its default sizes and repeats; the kernels suite's defaults on the CPU and on a GPU,
its plug-ins (absent, broken, without or with a failing hook), a variant that raises, a time
budget that stops it, glibc's freed-memory setting; the timing helpers' setup; the machine facts
when /proc/cpuinfo or the load average cannot be read; the correctness check's edge cases;
compare-torch's thread default; the CUDA kernel variants refused off CuPy."""
from __future__ import annotations

import argparse
import json
import math
import runpy
import sys
import warnings

import numpy as np
import pytest

from cutp.bench import __main__ as bench_main
from cutp.bench import comm as bcomm
from cutp.bench import common, compare_torch, kernel_variants, kernels
from cutp.runtime.errors import BackendError
from cutp.runtime.threads import available_cores, get_blas_threads, set_blas_threads


@pytest.fixture
def blas_threads():
    """(the suites set the BLAS thread count for their process: restored after the test)"""
    before = get_blas_threads()
    yield
    set_blas_threads(before or 1)


@pytest.mark.parametrize("argv, message", [
    (["comm", "--factor", "1"], "argument --factor: '1': each message size is the previous one times an integer >= 2"),
    (["comm", "--max-size", "12Q"], "argument --max-size: '12Q' is not a size: give bytes or a number with K, M or G"),
    (["comm", "--min-size=-4K"], "argument --min-size: '-4K' is not a size: give bytes or a number with K, M or G"),
])
def test_a_message_size_or_factor_that_cannot_be_used_is_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        f"python -m cutp bench comm: error: {message}")
    with pytest.raises(ValueError, match="^the size factor must be >= 2$"):  # (the function's own check, for API callers)
        bcomm.message_sizes(4096, 1 << 20, 1)


@pytest.mark.parametrize("argv, message", [
    # numbers no suite can take, before any work (review F5, F8): each was a traceback or a silent default
    (["model", "--timed-steps", "0"], "--timed-steps 0 is below 1: give --timed-steps 1 or more"),
    (["model", "--untimed-steps", "-1"], "--untimed-steps -1 is below 0"),
    (["model", "--batch-size", "0"], "--batch-size 0 is below 1"),
    (["model", "--seq-len", "0"], "--seq-len 0 is below 1"),
    (["model", "--threads", "0"], "--threads 0 is below 1"),
    (["model", "--seq-len", "100000", "--set", "n_layer=1"],
     "--seq-len 100000 is past tiny's block size 128 (the positions it has); give --seq-len 128 or less"),
    (["model", "--link-bandwidth", "0", "--set", "n_layer=1"], "--link-bandwidth 0: a link moves more than 0 GB/s"),
    (["model", "--link-bandwidth", "-2", "--set", "n_layer=1"], "--link-bandwidth -2: a link moves more than 0 GB/s"),
    (["comm", "--iters", "0"], "--iters 0 is below 1"),
    (["comm", "--iters", "-3"], "--iters -3 is below 1"),
    (["comm", "--min-size", "0"], "--min-size 0 is below 1"),
    (["comm", "--warmup", "-5"], "--warmup -5 is below 0"),
    (["comm", "--max-size", "1K", "--min-size", "64K"],
     "--max-size 1,024 B is below --min-size 65,536 B: no message size between them; give --max-size >= --min-size"),
    (["compare-torch", "--repeat", "0"], "--repeat 0 is below 1: give --repeat 1 or more"),
    (["kernels", "--repeat", "-2"], "--repeat -2 is below 1"),
])
def test_a_number_a_suite_cannot_take_is_refused_in_one_line(argv, message, capsys):
    assert bench_main.main([*argv, "--device", "cpu"] if argv[0] != "compare-torch" else argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m cutp bench {argv[0]}: error: {message}") and err.count("\n") == 1, err


def test_the_comm_suite_on_one_rank_with_its_default_repeats(blas_threads):
    args = bench_main.build_parser().parse_args(["comm", "--device", "cpu", "--min-size", "16M", "--warmup", "0",
                                                 "--factor", "4", "--ops", "all_reduce", "broadcast", "--quiet"])
    assert (args.min_size, args.max_size, args.factor) == (16 << 20, None, 4)
    report = bcomm.run(args)
    rows = report.get("comm").rows
    assert [(r["op"], r["size"], r["iters"], r["check"]) for r in rows] == [
        ("all_reduce", 16 << 20, 16, "ok"), ("broadcast", 16 << 20, 16, "ok")]  # 256 MiB of traffic per size
    assert any("one rank: collectives are copies or no-ops" in n for n in report.notes)
    assert "CPU run capped at 16 MiB; --max-size 256M extends it" in report.get("comm").notes
    assert [bcomm.iterations(n) for n in (1, 4 << 20, 1 << 30)] == [200, 64, 5]


def test_the_kernels_suite_defaults_on_the_cpu_and_on_a_gpu(monkeypatch):
    seen = []
    monkeypatch.setattr(kernels, "run", lambda args: seen.append(vars(args).copy()) or "report")
    parse = bench_main.build_parser().parse_args
    cpu, gpu = (10, 2, 0.0, True), (30, 3, 60.0, True)  # (repeat, warmup, budget s, glibc keeps freed memory)
    here = gpu if bench_main.backend.resolve_device("auto") == "cuda" else cpu
    assert bench_main.run(parse(["kernels", "--device", "auto"])) == "report"
    monkeypatch.setattr(bench_main.backend, "resolve_device", lambda name: "cuda")  # (as on a machine with a GPU)
    bench_main.run(parse(["kernels", "--device", "auto"]))
    bench_main.run(parse(["kernels", "--device", "auto", "--repeat", "4", "--warmup", "0", "--budget", "5"]))
    assert [(s["repeat"], s["warmup"], s["budget"], s["keep_freed_memory"]) for s in seen] == [
        here, gpu, (4, 0, 5.0, True)]


def test_an_unknown_kernel_op_is_refused_in_one_line(capsys):
    assert bench_main.main(["kernels", "--device", "cpu", "--ops", "layernorm_fwd", "gelu_fwdd", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m cutp bench kernels: error: ops: unknown op(s) ['gelu_fwdd']; "
                                               "choose from ")


def _plugin(tmp_path, name, text):
    (tmp_path / f"{name}.py").write_text(text)
    return name


def test_plugins_absent_broken_without_or_with_a_failing_hook_are_noted_and_skipped(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    names = [
        "cutp_test_plugin_absent",
        _plugin(tmp_path, "cutp_test_plugin_nested", "import cutp_test_dependency_absent\n"),
        _plugin(tmp_path, "cutp_test_plugin_broken", "raise RuntimeError('half installed')\n"),
        _plugin(tmp_path, "cutp_test_plugin_no_hook", "X = 1\n"),
        _plugin(tmp_path, "cutp_test_plugin_bad_hook", "def register_bench_variants(register):\n"
                                                       "    register('no_such_op', 'v', lambda d, xp: None)\n"),
    ]
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(kernels, "PLUGIN_MODULES", ())
    monkeypatch.setattr(kernels, "_plugin_notes", [])
    monkeypatch.setattr(kernels, "_plugins_loaded", False)
    monkeypatch.setenv("CUTP_BENCH_PLUGINS", ",".join(names))
    notes = kernels.load_plugins()
    assert notes == [
        "plug-in cutp_test_plugin_nested failed to import: No module named 'cutp_test_dependency_absent'",
        "plug-in cutp_test_plugin_broken failed to import: RuntimeError: half installed",
        "plug-in cutp_test_plugin_bad_hook: register_bench_variants failed: KeyError: \"unknown op 'no_such_op'; "
        f"choose one of {sorted(kernels.OPS)}\"",
    ]
    assert kernels.load_plugins() is notes  # (once per process)


def test_a_raising_variant_a_time_budget_and_kept_freed_memory(monkeypatch):
    def raising(d, xp):
        def call():
            raise FloatingPointError("diverged")
        return call

    kernels.register_variant("layernorm_fwd", "test_raising", raising, devices=("cpu",), dtypes=("float32",))
    monkeypatch.setattr(kernels, "keep_freed_memory", lambda: "freed memory kept (test)")
    args = bench_main.build_parser().parse_args(["kernels", "--device", "cpu", "--size", "tiny", "--ops",
                                                 "layernorm_fwd", "--repeat", "1", "--warmup", "0", "--min-time", "0",
                                                 "--copy-mib", "1"])
    args.keep_freed_memory, args.budget = True, 0.0
    try:
        report = kernels.run(args)
        args.budget = 1e-9  # spent before the first case: every case is skipped, and said so
        stopped = kernels.run(args)
    finally:
        del kernels.VARIANTS["layernorm_fwd"]["test_raising"]
    rows = report.get("kernels").rows
    errors = [r["check"] for r in rows if r["impl"] == "test_raising"]
    assert errors and all(c == "ERROR FloatingPointError: diverged" for c in errors)
    assert all(r["check"] == "ref" for r in rows if r["impl"] != "test_raising")
    assert "freed memory kept (test)" in report.notes
    n_cases = len({r["shape"] for r in rows})
    assert not stopped.get("kernels").rows and (f"time budget of 1e-09 s reached: {n_cases} case(s) not run "
                                                "(--budget 0 runs all)") in stopped.notes


class _Libc:
    def __init__(self, result):
        self.result, self.calls = result, []

    def mallopt(self, what, value):
        self.calls.append((what, value))
        return self.result


def test_keep_freed_memory_sets_glibc_s_thresholds_or_says_nothing(monkeypatch):
    libc = _Libc(1)
    monkeypatch.setattr(common.ctypes, "CDLL", lambda name: libc)
    assert common.keep_freed_memory() == "glibc mallopt: freed memory kept for reuse (M_MMAP_THRESHOLD 1 GiB, no trim)"
    assert libc.calls == [(-3, 1 << 30), (-1, (1 << 31) - 1)]  # M_MMAP_THRESHOLD, then M_TRIM_THRESHOLD
    monkeypatch.setattr(common.ctypes, "CDLL", lambda name: _Libc(0))  # refused: nothing is said
    assert common.keep_freed_memory() is None

    def no_libc(name):
        raise OSError("no glibc here")

    monkeypatch.setattr(common.ctypes, "CDLL", no_libc)
    assert common.keep_freed_memory() is None


def test_time_cpu_runs_setup_untimed_before_every_call():
    order = []
    t = common.time_cpu(lambda: order.append("fn"), warmup=1, repeat=2, setup=lambda: order.append("setup"))
    assert order == ["setup", "fn"] * 3 and len(t.times) == 2


def test_machine_facts_without_cpuinfo_or_load_average(monkeypatch):
    def unreadable(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(common, "open", unreadable, raising=False)
    monkeypatch.setattr(common.os, "getloadavg", unreadable)
    info = common.machine_info()
    assert info["cpu"] == (common.platform.processor() or common.platform.machine()) and "loadavg" not in info


def test_the_correctness_check_of_outputs_that_differ_in_number_are_empty_or_not_a_number():
    a = np.ones(3, np.float32)
    assert kernels.max_rel_error((a,), (a, a)) == math.inf
    assert kernels.max_rel_error((np.zeros(0, np.float32), a), (np.zeros(0, np.float32), a * 1.5)) == 0.5
    assert kernels.max_rel_error((a,), (np.full(3, np.nan, np.float32),)) == math.inf
    assert kernels._as_tuple(None) == () and kernels._as_tuple(a)[0] is a
    assert kernels.free_memory(argparse.Namespace()) is None  # (an array module without a memory pool)

    class NoBf16:
        @staticmethod
        def zeros(n, dtype):
            raise TypeError("dtype bfloat16 is not supported")

    assert kernels.bf16_supported(NoBf16) == (False, "bfloat16 skipped: this CuPy has no bfloat16 arrays (TypeError: "
                                                     "dtype bfloat16 is not supported); CuPy >= 14")


def test_python_m_cutp_bench_runs_a_suite(capsys):
    sys_argv = sys.argv
    sys.argv = ["python -m cutp.bench", "plan", "--params", "7B", "--tp", "2", "--quiet"]
    try:
        with pytest.raises(SystemExit) as e, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (runpy: the module is imported already)
            runpy.run_module("cutp.bench", run_name="__main__")
    finally:
        sys.argv = sys_argv
    assert e.value.code == 0


def test_compare_torch_runs_on_every_core_unless_told_and_the_kernel_variants_need_cupy(monkeypatch):
    seen = []
    monkeypatch.setattr(compare_torch, "run", lambda args: seen.append(args.threads) or "report")
    parse = bench_main.build_parser().parse_args
    assert bench_main.run(parse(["compare-torch"])) == "report" and bench_main.run(parse(["compare-torch", "--threads",
                                                                                       "1"])) == "report"
    assert seen == [available_cores(), 1]
    with pytest.raises(BackendError, match="^the CUDA kernels run on CuPy arrays, not numpy$"):
        kernel_variants._bench_launchers(np)


@pytest.mark.parametrize("command", [("bench", "plan"), ("plan",)])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_work(command, tmp_path, capsys, monkeypatch):
    """(review F5, F12) A directory or an unwritable path was a traceback after the work, leaving
    PATH.tmp; a file that is not a report was replaced without a word."""
    from cutp.plan import cli as plan_cli
    main = bench_main.main if command[0] == "bench" else plan_cli.main
    argv = [*command[1:], "--params", "7B", "--quiet", "--json"]
    ran = []
    real_run = plan_cli.run
    monkeypatch.setattr(plan_cli, "run", lambda args: ran.append(1) or real_run(args))
    (tmp_path / "adir").mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("keep\n")
    blocked = tmp_path / "file"
    blocked.write_text("")
    for path, message in ((tmp_path / "adir", f"--json {tmp_path / 'adir'} is a directory; give a file in it"),
                          (blocked / "x.json", f"--json {blocked / 'x.json'}: cannot write in {blocked}"),
                          (notes, f"--json {notes} exists and is not a cutp bench or plan JSON report, so it was "
                                  "not replaced; give a new path")):
        assert main([*argv, str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not ran and notes.read_text() == "keep\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "adir", "file", "notes.txt"]  # (no PATH.tmp, no check file left)
    report = tmp_path / "adir" / "plan.json"
    assert main([*argv, str(report)]) == 0 and main([*argv, str(report)]) == 0  # a previous report is replaced
    assert len(ran) == 2 and json.loads(report.read_text())["suite"] == "plan"
    empty = tmp_path / "adir" / "empty.json"  # (an empty file holds nothing to lose: a caller's temporary file)
    empty.write_text("")
    assert main([*argv, str(empty)]) == 0 and json.loads(empty.read_text())["suite"] == "plan"


@pytest.mark.parametrize("preset, lacks", [
    ("qwen3-tiny", "the Llama module (RMSNorm, RoPE, SwiGLU, GQA, untied, no biases) has no q/k norms (qk_norm)"),
    ("gemma-tiny", "has no q/k norms (qk_norm), sliding-window layers (sliding_window), softcaps"),
    ("tiny-moe", "the GPT-2 module (LayerNorm, learned positions, tanh GeLU, MHA, tied embeddings) has no experts"),
    ("deepseek-tiny", "has no experts (n_experts), latent attention (kv_lora_rank)"),
])
def test_compare_torch_refuses_a_preset_its_torch_modules_do_not_compute(preset, lacks, capsys, monkeypatch):
    """(review F6) qwen3-tiny was compared with a Llama module without its q/k norms and reported
    as a disagreement; gemma, MoE and DeepSeek presets ended in tracebacks. Refused before any
    work (and without torch: the check needs none)."""
    monkeypatch.setattr(compare_torch, "torch_missing_reason", lambda: pytest.fail("looked for torch first"))
    assert bench_main.main(["compare-torch", "--presets", "tiny", preset, "--check-only"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m cutp bench compare-torch: error: compare-torch cannot compare {preset}: ")
    assert lacks in err and err.count("\n") == 1, err
    assert compare_torch.lacks(compare_torch.GPTConfig.preset(preset).with_overrides(["n_experts=0"])
                               if preset == "tiny-moe" else compare_torch.GPTConfig.preset("llama-tiny")) is None


def test_compare_torch_exits_1_when_cutp_and_torch_disagree(capsys, monkeypatch, blas_threads):
    """(review F6) A failed check printed DISAGREE and exited 0: make compare-torch passed."""
    if compare_torch.torch_missing_reason():
        pytest.skip(f"compare-torch needs torch: {compare_torch.torch_missing_reason()}")
    argv = ["compare-torch", "--presets", "tiny", "--set", "n_layer=1", "--batch-size", "1", "--seq-len", "8",
            "--threads", "1", "--check-only", "--quiet"]
    assert bench_main.main(argv) == 0
    real = compare_torch.check_same_work
    monkeypatch.setattr(compare_torch, "check_same_work", lambda *a, **k: dict(real(*a, **k), ok=False))
    assert bench_main.main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m cutp bench compare-torch: error: cutp and torch disagree on tiny (see the notes)")


def _mpi_refused_comm():
    import sys as _sys
    _sys.exit(bench_main.main(["comm", "--device", "cpu", "--max-size", "1K", "--min-size", "64K"]))


def test_a_refusal_under_two_ranks_is_one_line(capsys):
    """Every rank refuses alike; rank 0 says it (two ranks' lines came out glued on one line)."""
    from tests.mpirun import run_mpi

    out = run_mpi(2, "tests.bench.test_bench_edges:_mpi_refused_comm", expect_failure=True, timeout=120)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "python -m cutp bench comm: error:" in line]
    assert lines == ["python -m cutp bench comm: error: --max-size 1,024 B is below --min-size 65,536 B: no message "
                     "size between them; give --max-size >= --min-size"], out.stdout + out.stderr
