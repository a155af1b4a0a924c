"""Fidelity of the CuPy stand-in to CuPy: every attribute of ``cupy`` (and of ``cupy.cuda``,
its streams, events, devices, pool, ``cupy.ndarray`` and ``cupyx.scipy.special``) that the
stand-in provides exists in the real package, and where both signatures can be read, the
stand-in's parameters are CuPy's (names, in order), and its integer constants CuPy's values, as
are the enum values cutp writes itself (cutp.ops.gemm's cuBLAS and CUDA types, cutp.comm.nccl's). ``cupy.cuda.cublas`` and
``cupy.cuda.nccl`` are checked when their libraries load (libcublas, libnccl), else reported.

Runs where the real CuPy imports (``pip install cupy-cuda12x``: it imports without a GPU;
``$CUTP_REAL_CUPY`` may name a directory holding it, searched first, or the Python of a separate
environment that has it, with ``nvidia-cublas-cu12`` and ``nvidia-nccl-cu12`` for the cuBLAS and
NCCL modules), in a child process without the stand-in; skipped with the reason elsewhere.
"""
import importlib
import inspect
import json
import os
import subprocess
import sys
import types

import pytest

from tests.device_path.harness import ON_GPU
from tests.device_path.standin import build

pytestmark = [pytest.mark.device_path]

_CHECK = r'''
import importlib, inspect, json, sys
wanted = json.loads(sys.stdin.read())
import cupy
import cupyx.scipy.special
report = {"version": cupy.__version__, "missing": [], "signatures": [], "unloaded": {}}
for mod in ("cupy.cuda.cublas", "cupy.cuda.nccl"):
    try:
        try:  # (loaded lazily by CuPy from cupy_backends, the library found through the nvidia-* wheels)
            lib = importlib.import_module(mod)
        except ImportError:
            lib = getattr(cupy.cuda, mod.rsplit(".", 1)[1])
        sys.modules[mod] = lib
        if mod.endswith("nccl") and not lib.available:
            raise ImportError("nccl.available is False (libnccl.so.2 not found)")
    except Exception as e:
        report["unloaded"][mod] = f"{type(e).__name__}: {e}"
for name, params in wanted:
    if any(name.startswith(m + ".") for m in report["unloaded"]):
        continue
    parts = name.split(".")
    obj = sys.modules[parts[0]]
    try:
        for i, p in enumerate(parts[1:]):
            prefix = ".".join(parts[:i + 2])
            obj = sys.modules[prefix] if prefix in sys.modules and not hasattr(obj, p) else getattr(obj, p)
    except AttributeError:
        report["missing"].append(name)
        continue
    if params is None:
        continue
    if type(params) is int:  # a constant (an enum value, a status code): CuPy's value
        if obj != params:
            report["signatures"].append((name, params, obj))
        continue
    try:
        real = [q.name for q in inspect.signature(obj).parameters.values()
                if q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD) and q.name != "self"]
    except (TypeError, ValueError):
        continue  # a Cython function without a readable signature: existence only
    if real[:len(params)] != params and not set(params) <= set(real):
        report["signatures"].append((name, params, real))
print(json.dumps(report))
'''


def _params(obj):
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [q.name for q in sig.parameters.values()
            if q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD) and q.name != "self"]


def _provided():
    """(dotted name, the stand-in's parameter names, its value (an int constant) or None) of
    everything the stand-in provides."""
    mods = build()
    out = []
    skip = {"__standin__", "__version__", "__file__", "__name__", "__doc__", "__loader__", "__package__", "__spec__"}
    for mname, m in mods.items():
        for k, v in vars(m).items():
            if k in skip or isinstance(v, types.ModuleType):
                continue
            out.append((f"{mname}.{k}", v if type(v) is int else _params(v) if callable(v) and not isinstance(v, type)
                        else None))
    cuda = mods["cupy.cuda"]
    for cls_name in ("Stream", "Event", "Device", "MemoryPool"):
        cls = getattr(cuda, cls_name)
        for k, v in vars(cls).items():
            if not k.startswith("_") and k != "null":
                out.append((f"cupy.cuda.{cls_name}.{k}", _params(v) if inspect.isfunction(v) else None))
    nd = mods["cupy"].ndarray
    from tests.device_path.standin.array import METHODS

    for k in sorted(set(k for k in vars(nd) if not k.startswith("_")) | METHODS):
        v = vars(nd).get(k)
        out.append((f"cupy.ndarray.{k}", _params(v) if inspect.isfunction(v) else None))
    return out


def _real_cupy():
    """(the Python that imports the real CuPy, its environment), or the test skipped with the reason."""
    env = dict(os.environ)
    env.pop("CUTP_CUPY_STANDIN", None)
    real, python = os.environ.get("CUTP_REAL_CUPY"), sys.executable
    if real and os.path.isfile(real):  # a Python that has CuPy (its own environment: its nvidia-* libraries)
        python = real
    elif real:
        env["PYTHONPATH"] = real + os.pathsep + env.get("PYTHONPATH", "")
    probe = subprocess.run([python, "-c", "import cupy"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ""
        pytest.skip("the real CuPy does not import here (pip install cupy-cuda12x, or $CUTP_REAL_CUPY=<a directory "
                    f"holding it, or the Python of an environment that has it>): {why}")
    return python, env


def _cutp_constants():
    """(CuPy's name, cutp's value) of the enum values cutp writes itself (cuBLAS's operations,
    compute types and algorithm, the CUDA data types, NCCL's data types and reductions)."""
    gemm, nccl = importlib.import_module("cutp.ops.gemm"), importlib.import_module("cutp.comm.nccl")  # (the modules,
    # not the functions cutp.ops exports under the same names)
    out = [(f"cupy.cuda.cublas.{k}", getattr(gemm, k)) for k in ("CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_COMPUTE_32F",
                                                                  "CUBLAS_COMPUTE_32F_FAST_TF32", "CUBLAS_GEMM_DEFAULT")]
    out += [(f"cupy.cuda.runtime.CUDA_R_{n}", gemm.CUDA_DATA_TYPES[t])
            for t, n in (("float32", "32F"), ("float16", "16F"), ("bfloat16", "16BF"))]
    out += [(f"cupy.cuda.nccl.NCCL_{t.upper()}", v) for t, v in nccl._NCCL_DTYPES.items()]
    out += [(f"cupy.cuda.nccl.NCCL_{op.upper()}", v) for op, v in nccl._NCCL_OPS.items()]
    return out


@pytest.mark.device_path_default
def test_every_attribute_the_stand_in_provides_is_cupys():
    python, env = _real_cupy()
    proc = subprocess.run([python, "-c", _CHECK], env=env, input=json.dumps(_provided() + _cutp_constants()),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"CuPy {report['version']}; not checked (library not loadable): {report['unloaded']}")
    assert not report["missing"], f"the stand-in provides what CuPy {report['version']} has not: {report['missing']}"
    assert not report["signatures"], f"signatures that differ from CuPy's: {report['signatures']}"


_LOOPS = r'''
import json, sys
import numpy, ml_dtypes, cupy
bf = numpy.dtype(ml_dtypes.bfloat16)
def dt(c):
    return bf if c == bf.char else numpy.dtype(c)
out = {"version": cupy.__version__, "refused": [], "unchecked": []}
for name, dtypes in json.loads(sys.stdin.read()):
    u = getattr(cupy, name.split(".")[0], None)
    if not isinstance(u, cupy.ufunc):
        out["unchecked"].append(name)
        continue
    ins = [bf if d == "bfloat16" else numpy.dtype(d) for d in dtypes]
    if "." in name:  # reduce / accumulate / at: the array's dtype for every input
        ins = ins[:1]
    ins = (ins + [ins[0]] * u.nin)[:u.nin]  # (a Python scalar operand takes the array's dtype)
    loops = [[dt(c) for c in t.split("->")[0]] for t in u.types if isinstance(t, str)]
    if not any(all(numpy.can_cast(i, o) for i, o in zip(ins, loop)) for loop in loops):
        out["refused"].append([name, dtypes])
print(json.dumps(out))
'''


@pytest.mark.skipif(ON_GPU, reason="reads what the stand-in ran: on a GPU, CuPy itself refuses what it lacks")
@pytest.mark.usefixtures("emulated_kernels")
def test_cupy_has_the_bfloat16_loops_cutp_runs(tmp_path):
    """The elementwise routines (CuPy's ufuncs) that bfloat16 training runs on device arrays with
    a bfloat16 operand, on the stand-in: CuPy has a type loop for each (what CuPy refuses, the
    stand-in must refuse). The other routines (reductions, sorts, copies) have no type table
    readable without a GPU: listed, not checked."""
    python, env = _real_cupy()
    from tests.device_path.harness import OVERLAP, run_device

    report = tmp_path / "standin"
    run_device(4, "tests.device_path.harness:worker_train",
               [["llama", "bfloat16", {"tp": 2, "dp": 2}, OVERLAP], ["mixtral", "bfloat16", {"tp": 2, "dp": 2, "ep": 2}, {}],
                ["gpt2", "bfloat16", {"pp": 2, "dp": 2}, {"micro_batch_size": 1}]],
               env={"CUTP_STANDIN_REPORT": str(report)}, timeout=300)
    ran = {(n, tuple(d)) for rank in range(4)
           for n, d in json.loads((tmp_path / f"standin.{rank}").read_text())["routines"]}
    bf16 = sorted([n, list(d)] for n, d in ran if "bfloat16" in d)
    assert bf16, "a bfloat16 run ran no array routine on a bfloat16 operand"
    proc = subprocess.run([python, "-c", _LOOPS], env=env, input=json.dumps(bf16), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"CuPy {out['version']}: routines run with a bfloat16 operand: {bf16}; not checkable here: "
          f"{sorted(set(out['unchecked']))}")
    assert not out["refused"], f"CuPy {out['version']} has no loop for these, which the stand-in ran: {out['refused']}"
