"""The CUDA kernel sources as the GPU path loads them, without a GPU: what NVRTC is given
(common.cuh inlined, #line mapping, options, the CUDA header search), compiling it with NVCC
(and NVRTC when installed), and packaging (a regular, non-editable install ships every
kernels/*.cu / *.cuh as cutp/kernels/... and every cutp package).

Executing the kernels is the job of tests/kernels/; the sources as files are
compiled by tests/cuda_emu/test_emulator.py::test_sources_compile_with_nvcc.
"""
from __future__ import annotations

import configparser
import ctypes
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest

from cutp.runtime import backend
from cutp import kernels as ck
from cutp.kernels import resources as kernel_resources
from cutp.kernels import runtime as kernel_runtime
from tests.cuda_emu.test_emulator import (_KERNEL_DEF, _cuda_sources, _find_nvrtc, _nvcc, _strip_comments,
                                 kernel_entry_points, load_nvrtc, nvrtc_compile)

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"


def test_every_source_file_is_loaded_and_compile_checked():
    files = {p.stem for p in KERNELS.glob("*.cu")}
    assert set(ck.SOURCES) == files, "cutp.kernels.SOURCES must list every kernels/*.cu"
    assert {p.resolve() for p in KERNELS.glob("*.cu")} <= {p.resolve() for p in _cuda_sources()}


def test_launchers_name_only_existing_kernels():
    """Every kernel name the host code launches exists in the source it loads it from."""
    text = "\n".join(p.read_text() for p in sorted(KERNELS.glob("*.py")))
    defined = {s: set(kernel_entry_points(KERNELS / f"{s}.cu")) for s in ck.SOURCES}
    calls = re.findall(r'_launch\(\s*"(\w+)",\s*f?"(\w+)(?:\{[^}]*\})?"', text)
    assert len(calls) >= 15, calls
    for source, prefix in calls:
        names = defined[source]
        assert any(n == prefix or n.startswith(prefix) for n in names), (source, prefix)
    # the dtype-suffixed kernels come in pairs
    for s, names in defined.items():
        for n in names:
            if n.endswith("_f32"):
                assert n[:-4] + "_bf16" in names, n


def test_every_family_is_declared_once_and_whole():
    """Each source is some family's own (kernels/<op>.py FAMILY, its first source; reduce.cu the
    column sum's, in runtime.py); each family's entry points are exactly its targets, its sources
    exist, its test files and --quick node ids' files exist, and every launchers class is in
    Launchers."""
    from cutp.kernels.family import families

    fams = families()
    assert sorted(f.sources[0] for f in fams) == sorted(ck.SOURCES)
    assert len({f.name for f in fams}) == len(fams)
    for f in fams:
        assert set(f.sources) <= set(ck.SOURCES), f.name
        entry = {kernel_resources.family(k) for k in kernel_entry_points(KERNELS / f"{f.sources[0]}.cu")}
        assert set(f.targets) == entry, (f.name, sorted(entry ^ set(f.targets)))
        assert set(f.traffic) | set(f.compute_bound) == set(f.targets), f.name
        for t in (*f.tests, *(q.split("::")[0] for q in f.quick_tests)):
            assert (ROOT / "tests" / "kernels" / t).exists(), (f.name, t)
        assert issubclass(ck.Launchers, f.launchers), f.name


@pytest.mark.parametrize("name", ck.SOURCES)
def test_kernel_source_inlines_common_and_keeps_line_numbers(name):
    src = ck.kernel_source(name)
    original = (KERNELS / f"{name}.cu").read_text()
    assert '#include "common.cuh"' not in src
    assert "#pragma once" not in src
    assert "block_reduce_sum2" in src  # the header's text is there
    # following the #line directives, every line of <name>.cu is at its own number, and the
    # header's text comes where the include was (what precedes it, e.g. a #define, first)
    orig = original.splitlines()
    seen, where = {}, None
    for line in src.splitlines():
        m = re.match(r'#line (\d+) "([^"]+)"$', line)
        if m:
            where = [m.group(2), int(m.group(1))]
            continue
        if where[0] == f"{name}.cu":
            seen[where[1]] = line
        where[1] += 1
    assert sorted(seen) == list(range(1, len(orig) + 1))
    for number, b in enumerate(orig, 1):
        a = seen[number]
        assert a == b or (b.strip() == '#include "common.cuh"' and "inlined" in a)
    include_at = next(i for i, b in enumerate(orig) if b.strip() == '#include "common.cuh"')
    assert src.index("block_reduce_sum2") > src.index(orig[include_at - 1]) if include_at else True
    assert set(kernel_entry_points_text(src)) == set(kernel_entry_points(KERNELS / f"{name}.cu"))


def kernel_entry_points_text(text: str) -> list[str]:
    return _KERNEL_DEF.findall(_strip_comments(text))


def test_inlined_source_runs_under_the_emulator():
    """The text handed to NVRTC, compiled and run (here by the emulator): same kernels, same results."""
    from tests.cuda_emu import EmulatedModule

    mod = EmulatedModule(code=ck.kernel_source("softmax"), schedule="reverse")
    assert set(mod.kernel_names) == set(kernel_entry_points(KERNELS / "softmax.cu"))
    k = ck.Launchers(lambda name: mod, np)
    x = np.random.default_rng(0).standard_normal((2, 3, 7)).astype(np.float32)
    from cutp import ops

    np.testing.assert_allclose(k.softmax_forward(x, 0.5, True), ops.softmax_forward(x, 0.5, True)[0], rtol=1e-6,
                               atol=1e-7)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_inlined_sources_compile_with_nvcc():
    """What NVRTC gets (common.cuh inlined), compiled for sm_80 and sm_90 with warnings as errors:
    the compile of kernels/resources.py, cached for tests/kernel_build/test_resources.py in the same session."""
    res = kernel_resources.compile_all(_nvcc())
    assert {k for k, _ in res} == {k for name in ck.SOURCES for k in kernel_entry_points(KERNELS / f"{name}.cu")}
    assert "-Werror" in kernel_resources.NVCC_OPTIONS


@pytest.mark.skipif(_find_nvrtc() is None, reason="NVRTC (nvidia-cuda-nvrtc) not installed")
def test_inlined_sources_compile_with_nvrtc_and_our_options():
    """The production path minus the GPU: kernel_source() + source_options(find_cuda_include())."""
    lib_path, _ = _find_nvrtc()
    lib = load_nvrtc(lib_path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    include = ck.find_cuda_include(major.value)
    failures = []
    for name in ck.SOURCES:
        opts = ck.source_options(name, include)
        for arch in ("compute_80", "compute_90"):
            log = nvrtc_compile(lib, ck.kernel_source(name).encode(), f"{name}.cu", [f"-arch={arch}", *opts])
            if log is not None:
                failures.append(f"{name} ({arch}):\n{log}")
    assert not failures, "\n\n".join(failures)


# ------------------------------------------------------------------------------------------------
# CUDA header search and the CuPy loader (with a stand-in for cupy)
# ------------------------------------------------------------------------------------------------
def _fake_include(d: Path, cudart: int | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "cuda_bf16.h").write_text("")
    (d / "cuda_fp16.h").write_text("")
    if cudart:
        (d / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {cudart}\n")
    return d


def test_find_cuda_include_prefers_nvrtcs_version(tmp_path):
    a = _fake_include(tmp_path / "a" / "include", 12080)
    b = _fake_include(tmp_path / "b" / "include", 13000)
    (tmp_path / "empty").mkdir()
    cands = [(str(tmp_path / "empty"), "x"), (str(a), "a"), (str(b), "b")]
    assert ck.find_cuda_include(None, cands) == str(a)
    assert ck.find_cuda_include(13, cands) == str(b)
    assert ck.find_cuda_include(12, cands) == str(a)
    assert ck.find_cuda_include(11, cands) == str(a)  # no match: the first usable one


def test_find_cuda_include_names_the_wheel_when_absent(tmp_path):
    with pytest.raises(ck.KernelLoadError, match=r"Install the wheel nvidia-cuda-runtime \(.*CUTP_KERNELS=0"):
        ck.find_cuda_include(13, [(str(tmp_path), "nowhere")])
    with pytest.raises(ck.KernelLoadError, match="nvidia-cuda-runtime-cu12"):
        ck.find_cuda_include(12, [(str(tmp_path), "nowhere")])


def test_include_search_order(tmp_path, monkeypatch):
    wheel_root = tmp_path / "site"
    cu13 = _fake_include(wheel_root / "nvidia" / "cu13" / "include", 13000)
    cu12 = _fake_include(wheel_root / "nvidia" / "cuda_runtime" / "include", 12080)
    monkeypatch.syspath_prepend(str(wheel_root))
    for m in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, m)
    env = {"CUTP_CUDA_INCLUDE": "/explicit", "CUDA_PATH": "/toolkit"}
    dirs = [d for d, _ in kernel_runtime._include_candidates(env)]
    assert dirs[0] == "/explicit"
    assert dirs.index(str(cu13)) < dirs.index(str(cu12)) < dirs.index("/toolkit/include")
    assert dirs.index("/toolkit/include") < dirs.index("/usr/local/cuda/include")
    assert ck.find_cuda_include(13, environ={}) == str(cu13)
    assert ck.find_cuda_include(12, environ={}) == str(cu12)
    assert ck.find_cuda_include(12, [(d, "") for d in (str(cu13), str(cu12))]) == str(cu12)


def test_cupy_loader_builds_one_rawmodule_per_source(tmp_path, monkeypatch):
    made = []

    class RawModule:
        def __init__(self, *, code, options):
            made.append((code, options))

        def get_function(self, name):
            return lambda *a, **kw: None

    inc = _fake_include(tmp_path / "inc", 13000)
    fake = types.ModuleType("cupy")
    fake.RawModule = RawModule
    fake.cuda = types.SimpleNamespace(nvrtc=types.SimpleNamespace(getVersion=lambda: (13, 0)),
                                      runtime=types.SimpleNamespace(getDevice=lambda: 0))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setenv("CUTP_CUDA_INCLUDE", str(inc))
    monkeypatch.setattr(ck, "_cupy_launchers", {})
    k = ck.cupy_launchers()
    assert ck.cupy_launchers() is k and k.xp is fake
    k.function("gelu", "gelu_forward_f32")
    k.function("gelu", "gelu_backward_bf16")
    k.function("softmax", "softmax_forward_f32")
    assert len(made) == 2  # one module per source, built lazily
    code, options = made[0]
    assert code == ck.kernel_source("gelu")
    assert isinstance(options, tuple) and "--std=c++17" in options and f"-I{inc}" in options


# ------------------------------------------------------------------------------------------------
# Packaging: a regular install finds the kernel sources
# ------------------------------------------------------------------------------------------------
def _pip_env(tmp: Path, base: dict | None = None) -> dict:
    """The environment for a pip subprocess that writes nothing under the user's home: a private
    cache in `tmp` and no self version check (which would write its state file into the cache)."""
    return dict(os.environ if base is None else base, PIP_CACHE_DIR=str(tmp / "pip-cache"),
                PIP_DISABLE_PIP_VERSION_CHECK="1")


def test_pip_subprocesses_use_a_private_cache(tmp_path):
    # from an environment without any PIP_* settings (this machine may set some of them itself);
    # without PIP_NO_CACHE_DIR in particular, with which `pip cache dir` refuses to answer
    env = _pip_env(tmp_path, {k: v for k, v in os.environ.items() if not k.startswith("PIP_")})
    p = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert Path(p.stdout.strip()) == tmp_path / "pip-cache", p.stdout
    p = subprocess.run([sys.executable, "-m", "pip", "config", "debug"], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PIP_DISABLE_PIP_VERSION_CHECK='1'" in p.stdout, p.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the project (so no build/ or egg-info lands in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for f in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "cutp", src / "cutp", ignore=ignore)
    shutil.copytree(ROOT / "kernels", src / "kernels", ignore=ignore)
    out = tmp / "dist"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w",
                        str(out)], cwd=src, capture_output=True, text=True, env=_pip_env(tmp))
    if p.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{p.stdout}\n{p.stderr}")
    (whl,) = out.glob("cutp-*.whl")
    return whl


def test_wheel_ships_every_kernel_source_and_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in sorted(KERNELS.iterdir()):
        if f.suffix in (".cu", ".cuh"):
            assert f"cutp/kernels/{f.name}" in names, f"{f.name} is missing from the wheel"
    for init in sorted((ROOT / "cutp").rglob("__init__.py")):
        rel = init.relative_to(ROOT).as_posix()
        assert rel in names, f"package {init.parent.relative_to(ROOT)} is missing from the wheel: add it to setup.cfg"
    for f in sorted(KERNELS.glob("*.py")):  # the launchers beside their sources
        assert f"cutp/kernels/{f.name}" in names, f"{f.name} is missing from the wheel"
    for f in sorted((KERNELS / "cpu").iterdir()):  # the compiled CPU kernels' C sources (cutp.ops.compiled)
        assert f"cutp/kernels/cpu/{f.name}" in names, f"cpu/{f.name} is missing from the wheel"
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {".".join(p.relative_to(ROOT).parent.parts) for p in (ROOT / "cutp").rglob("__init__.py")} | {"cutp.kernels"}
    assert found <= listed, f"setup.cfg [options] packages lacks {sorted(found - listed)}"


def test_installed_wheel_reads_the_kernel_sources(wheel, tmp_path):
    """Installed (not editable) into a fresh directory, cutp.kernels finds its sources
    through importlib.resources."""
    target = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, env=_pip_env(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    code = (
        "import cutp, cutp.kernels as ck\n"
        "print(cutp.__file__)\n"
        "print(sum(len(ck.kernel_source(s)) for s in ck.SOURCES))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    where, size = p.stdout.split()
    assert Path(where).resolve().is_relative_to(target.resolve()), f"imported cutp from {where}, not the install"
    assert int(size) > 10000


# ------------------------------------------------------------------------------------------------
# tools/gpu_check.py (make gpu-check) runs for real only on a lent GPU machine; here its host
# logic, so a mistake in it does not first show up there
# ------------------------------------------------------------------------------------------------
def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["gpu_check"]
    return mod


def test_gpu_check_helpers(tmp_path):
    g = _gpu_check_module()
    assert g.pytest_summary("x\n72 passed, 1 skipped in 10.54s\n") == "72 passed, 1 skipped in 10.54s"
    assert g.pytest_summary("==== 1 failed, 2 passed in 3.0s ====\n") == "1 failed, 2 passed in 3.0s"
    m = tmp_path / "m.jsonl"
    m.write_text("".join(f'{{"step": {i}, "loss": {5 - i * 0.1}, "ms": 10, "tokens_per_s": 100}}\n' for i in range(1, 6)))
    r = g.metrics(m)
    assert r["steps"] == 5 and r["first_loss"] == 4.9 and abs(r["last_loss"] - 4.5) < 1e-12 and r["median_ms"] == 10
    g.compare_trains({"last_loss": 2.0, "median_ms": 10}, {"last_loss": 2.5, "median_ms": 20})
    assert g.PARTS[-1].status == "FAILED"
    g.nccl_parts({"nccl": {"available": True, "version": 22805}, "_mpiexec": "/x"})
    assert g.PARTS[-1].status == "skipped" and "< 2.30" in g.PARTS[-1].detail
    g.nccl_parts({"nccl": {"available": True, "version": 23000}, "_mpiexec": None, "mpiexec": "NOT FOUND"})
    assert "no mpiexec" in g.PARTS[-1].detail
    shutil.rmtree(g.CACHE, ignore_errors=True)


def test_gpu_check_runs_the_kernel_tests_on_the_cuda_backend_only():
    """`make gpu-check` runs tests/kernels with CUTP_KERNEL_BACKENDS=cuda, and that selects the
    cuda backend's cases (and the tests that need no backend) and none of the emulated ones."""
    g = _gpu_check_module()
    calls = []

    def run(name, cmd, limit, env=None, **kw):
        calls.append((cmd, env))
        return g.Part(name, "ok"), "3 passed in 1.0s"

    g.run = run
    g.gpu_tests()
    shutil.rmtree(g.CACHE, ignore_errors=True)
    ((cmd, env),) = calls
    assert cmd[-1] == "tests/kernels" and env == {"CUTP_KERNEL_BACKENDS": "cuda"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        "tests/kernels"], cwd=ROOT, env=dict(os.environ, **env), capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    ids = [line for line in p.stdout.splitlines() if "::" in line]
    assert any("[cuda" in i for i in ids), ids[:5]
    assert not any("emulated" in i for i in ids), [i for i in ids if "emulated" in i][:5]


@pytest.mark.skipif(backend.cuda_device_count() > 0, reason="a GPU is here: run `make gpu-check` itself")
def test_gpu_check_without_a_gpu_reports_and_writes_its_summary(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT), GPU_CHECK_BUDGET_S="120")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr  # no GPU: the environment part fails
    text = (tmp_path / "gpu_check_summary.txt").read_text()
    assert "no usable GPU" in text and "gpu kernel tests" in text and "RESULT: FAILED: environment" in text
    assert "mpiexec:" in text and (tmp_path / "gpu_check_logs" / "environment.log").exists()
