"""The launchers' argument refusals that the op tests never reach (issue 41's coverage), each a
KernelArgumentError (or ValueError, for a caller's wrong mode) naming the argument, raised before
any module is loaded: the launchers here have a loader that fails the test if called. Beside
them: attention's backward with no queries (dk, dv are zero, nothing launched), the rotary kernel
on an empty x, the kernel sources' loading problems, and kernels/resources.py's nvcc lookup.
(Launches themselves: tests/kernels/test_launchers.py and each op's test.)"""
from __future__ import annotations

import importlib
import sys

import ml_dtypes
import numpy as np
import pytest

from cutp.kernels import KernelArgumentError, KernelLoadError, Launchers
from cutp.kernels import resources, runtime
from cutp.kernels.attention import attention_shared_bytes
from cutp.kernels.family import family_of_source
from cutp.kernels.rotary import rotary_supported

F32, F64, BF16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16)


def _never_loaded(source):
    raise AssertionError(f"kernels/{source}.cu was loaded: a refused call must not reach a launch")


@pytest.fixture
def k():
    return Launchers(_never_loaded, np, description="refusals")


def _zeros(*shape, dtype=F32):
    return np.zeros(shape, dtype)


def _huge(*shape):
    """A float32 array of `shape` over one row of memory (zero strides but the last): a shape far
    beyond memory, as the grid checks need."""
    return np.lib.stride_tricks.as_strided(_zeros(shape[-1]), shape=shape, strides=(0,) * (len(shape) - 1) + (4,))


def test_attention_refuses_operands_dropout_and_outputs_by_name(k):
    q, kv = _zeros(2, 1, 1, 4, 64), _zeros(2, 1, 4, 64)
    o, lse = _zeros(2, 1, 1, 4, 64), _zeros(2, 1, 1, 4)
    with pytest.raises(KernelArgumentError, match="^q must be a numpy array, got list$"):
        k.attention_forward(q.tolist(), kv, kv, 0.125)
    with pytest.raises(KernelArgumentError, match=r"^dropout_p=1.5 outside \[0, 1\]$"):
        k.attention_forward(q, kv, kv, 0.125, dropout_p=1.5)
    with pytest.raises(KernelArgumentError, match="^1 dropout offsets for 2 batch rows$"):
        k.attention_forward(q, kv, kv, 0.125, dropout_p=0.1, offsets=[5])
    with pytest.raises(KernelArgumentError, match=r"^attention of 1 heads of Tq=4194304, Tk=4 exceeds the kernels' "
                                                  "grid limits$"):
        k.attention_forward(_huge(1, 1, 1, 1 << 22, 64), _huge(1, 1, 4, 64), _huge(1, 1, 4, 64), 0.125,
                            q_first=0, k_first=0)
    broadcast = np.broadcast_to(_zeros(64), kv.shape)
    with pytest.raises(KernelArgumentError, match=r"^out dk has strides \(0, 0, 0, 4\): the kernels write a contiguous "
                                                  "head dim at non-negative, non-zero strides"):
        k.attention_backward(o, q, kv, kv, o, lse, 0.125, out=(q.copy(), broadcast, kv.copy()))
    gapped = _zeros(2, 1, 1, 4, 128)[..., ::2]  # do: a head dim with gaps (strides are otherwise free)
    with pytest.raises(KernelArgumentError, match=r"^an attention operand of shape \(2, 1, 1, 4, 64\) has strides "
                                                  r"\(2048, 2048, 2048, 512, 8\): the kernels need non-negative "
                                                  r"strides and a contiguous last \(head\) axis \(pass a copy\)$"):
        k.attention_backward(gapped, q, kv, kv, o, lse, 0.125)
    with pytest.raises(ValueError, match="^unknown attention kernel 'backward'$"):
        attention_shared_bytes("backward", F32, 64)


def test_attention_backward_without_queries_zeroes_dk_and_dv_and_launches_nothing(k):
    q, kv = _zeros(1, 2, 1, 0, 64), np.ones((1, 2, 5, 64), F32)
    o, lse = _zeros(1, 2, 1, 0, 64), _zeros(1, 2, 1, 0)
    dq, dk, dv = k.attention_backward(o, q, kv, kv, o, lse, 0.125, q_first=5, k_first=0)
    assert dq.shape == q.shape and not dk.any() and not dv.any() and dk.shape == dv.shape == kv.shape
    filled = (np.ones_like(q), np.full(kv.shape, 3.0, F32), np.full(kv.shape, 4.0, F32))
    k.attention_backward(o, q, kv, kv, o, lse, 0.125, out=filled, q_first=5, k_first=0)
    assert not filled[1].any() and not filled[2].any()  # written: the gradients are zero
    k.attention_backward(o, q, kv, kv, o, lse, 0.125, out=filled, q_first=5, k_first=0, accumulate=True)
    assert not filled[1].any()  # accumulated: nothing added
    summed = (np.ones_like(q), np.full(kv.shape, 3.0, F32), np.full(kv.shape, 4.0, F32))
    k.attention_backward(o, q, kv, kv, o, lse, 0.125, out=summed, q_first=5, k_first=0, accumulate=True)
    assert (summed[1] == 3).all() and (summed[2] == 4).all()
    assert not k.launches


def test_row_kernels_refuse_arrays_without_a_channel_axis_and_wrong_modes(k):
    scalar = _zeros()  # a 0-d array
    cases = [
        (lambda: k.gelu_forward(_zeros(3, 4), "erf"), ValueError, "^approximate must be 'tanh' or 'none', got 'erf'$"),
        (lambda: k.bias_gelu_forward(scalar, _zeros(1)), KernelArgumentError, r"^x must have a last \(channel\) axis$"),
        (lambda: k.bias_gelu_backward(scalar, scalar), KernelArgumentError, r"^pre must have a last \(channel\) axis$"),
        (lambda: k.layernorm_forward(scalar), KernelArgumentError, r"^x must have a last \(channel\) axis$"),
        (lambda: k.layernorm_backward(scalar, scalar, None, _zeros(1), _zeros(1)), KernelArgumentError,
         r"^x must have a last \(channel\) axis$"),
        (lambda: k.layernorm_backward(_zeros(3, 4), _zeros(3, 4), None, _zeros(3), _zeros(3), bias_dtype=F64),
         KernelArgumentError, "^bias dtype float64: the kernels take float32 or bfloat16$"),
        (lambda: k.rmsnorm_forward(_zeros(3, 0)), KernelArgumentError,
         r"^x must have a non-empty last \(channel\) axis, got shape \(3, 0\)$"),
        (lambda: k.rmsnorm_backward(_zeros(3, 0), _zeros(3, 0), None, _zeros(3)), KernelArgumentError,
         r"^x must have a non-empty last \(channel\) axis, got shape \(3, 0\)$"),
        (lambda: k.rmsnorm_backward(_zeros(3, 4), _zeros(3, 4), None, _zeros(2)), KernelArgumentError,
         "^rstd has 2 elements, expected one per row: 3$"),
        (lambda: k.softmax_forward(scalar), KernelArgumentError, "^softmax needs at least one axis$"),
        (lambda: k.softmax_forward(_zeros(4), causal=True), ValueError,
         r"^causal softmax needs x of shape \[\.\.\., Tq, Tk\]$"),
        (lambda: k.softmax_backward(scalar, scalar), KernelArgumentError, "^softmax needs at least one axis$"),
        (lambda: k.swiglu_forward(_zeros(3, 5)), KernelArgumentError,
         r"^gate_up \(3, 5\) must have an even last axis \(\[gate ; up\] columns of equal width\)$"),
        (lambda: k.ce_shard_forward(scalar, _zeros(1, dtype=np.int64), 1), KernelArgumentError,
         r"^logits must have a last \(vocabulary\) axis$"),
        (lambda: k.ce_shard_backward(_zeros(2, 8), _zeros(2), _zeros(2), _zeros(2, dtype=np.int64), 8, _zeros(2),
                                     label_smoothing=0.1), ValueError, "^label smoothing needs n_classes$"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert not k.launches


def test_rotary_names_what_it_cannot_take(k):
    x, t = _zeros(2, 3, 4, 8), _zeros(3, 8)
    assert rotary_supported(x, t, t, None, 1, None) is None
    assert rotary_supported(x.astype(F64), t, t, None, 1, None) == (
        "the rotary kernel takes float32 or bfloat16 x, got float64")
    gapped = _zeros(2, 3, 4, 16)[..., ::2]
    assert rotary_supported(gapped, t, t, None, 1, None) == rotary_supported(x, t, t, None, 1, gapped) == (
        "the rotary kernel needs a contiguous head dim and non-negative strides (an output: non-zero ones)")
    assert rotary_supported(x, t, t, _zeros(1, 2, 3, dtype=np.int64), 1, None) == (
        "the rotary kernel takes position ids [T] or [B, T], got shape (1, 2, 3)")
    positions = np.arange(3)
    cases = [
        ((x, t, _zeros(3, 6)), {}, r"^cos \(3, 8\) and sin \(3, 6\) differ in shape$"),
        ((x, _zeros(3, 7), _zeros(3, 7)), {}, "^table width 7 must be even and at most the head dim 8$"),
        ((x, _zeros(3, 16), _zeros(3, 16)), {}, "^table width 16 must be even and at most the head dim 8$"),
        ((x, _zeros(1, 3, 8), _zeros(1, 3, 8), positions), {},
         r"^with positions, cos/sin must be \[max_len, rd\] tables, got \(1, 3, 8\)$"),
        ((x, _zeros(4, 8), _zeros(4, 8)), {}, r"^per-token tables \(4, 8\) do not match x \[B, T\] = \[2, 3\]$"),
        ((x, t, t), {"out": _zeros(2, 3, 4, 4)}, r"^out has shape \(2, 3, 4, 4\), expected \(2, 3, 4, 8\)$"),
    ]
    for args, kw, message in cases:
        with pytest.raises(KernelArgumentError, match=message):
            k.rotary(*args, **kw)
    empty = _zeros(2, 0, 4, 8)
    out = np.full((2, 0, 4, 8), np.nan, F32)
    assert k.rotary(empty, _zeros(0, 8), _zeros(0, 8), out=out) is out
    assert k.rotary(empty, t, t, positions[:0]).shape == empty.shape
    assert not k.launches


def test_the_runtime_helpers_refuse_by_name(k):
    with pytest.raises(KernelArgumentError, match="^no kernel for dtype float64$"):
        runtime.dtype_suffix(F64)
    assert runtime.dtype_suffix(F32) == "f32" and runtime.dtype_suffix(BF16) == "bf16"
    with pytest.raises(KernelArgumentError, match="^row_max must be a numpy array, got list$"):
        runtime.row_vector(np, "row_max", [1.0], 1, F32, "f")
    with pytest.raises(KernelArgumentError, match="^Tq = 2147483648 does not fit the kernel's 32-bit int$"):
        runtime.int32_arg("Tq", 2 ** 31)
    assert runtime.int32_arg("Tq", 2 ** 31 - 1) == 2 ** 31 - 1
    assert repr(k) == "<cutp.kernels.Launchers refusals>"
    assert repr(Launchers(_never_loaded, np)) == "<cutp.kernels.Launchers numpy>"
    assert [f.name for f in family_of_source("rmsnorm")] == ["rmsnorm"]
    assert "reduce" in [f.name for f in family_of_source("reduce")] and len(family_of_source("reduce")) > 1


def test_kernel_sources_missing_or_without_the_common_header_are_named(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"^unknown kernel source 'conv'; one of \("):
        runtime.kernel_source("conv")
    monkeypatch.setattr(importlib.resources, "files", lambda package: tmp_path)
    with pytest.raises(KernelLoadError, match=r"^the CUDA kernel sources are missing from the installed package "
                                              r"cutp.kernels \(.*gelu.cu.*\); reinstall cutp \(its wheel ships "):
        runtime.kernel_source("gelu")
    (tmp_path / "gelu.cu").write_text('#include "other.cuh"\n')
    (tmp_path / "common.cuh").write_text("#pragma once\n")
    with pytest.raises(KernelLoadError, match=r'^gelu.cu does not #include "common.cuh" \(kernels/README.md\)$'):
        runtime.kernel_source("gelu")


def test_cuda_headers_found_without_the_nvidia_wheels_and_versions_of_unreadable_headers(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "nvidia", None)  # (no NVIDIA wheel installed)
    found = runtime._include_candidates({"CUDA_HOME": str(tmp_path)})
    assert not any("nvidia wheel" in where for _, where in found)
    assert (str(tmp_path / "include"), "$CUDA_HOME") in found
    assert runtime._cuda_version_of(str(tmp_path / "none")) is None
    (tmp_path / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 12040\n")
    assert runtime._cuda_version_of(str(tmp_path)) == 12


def test_nvcc_is_looked_up_in_the_newest_toolkit_and_its_absence_and_failure_named(monkeypatch, tmp_path):
    monkeypatch.setattr(resources.shutil, "which", lambda name: None)
    monkeypatch.setattr(resources, "Path", lambda p: tmp_path if p == "/usr/local" else importlib.import_module(
        "pathlib").Path(p))
    assert resources.find_nvcc() is None
    for message_of in (resources.nvcc_release, resources.compile_all):
        with pytest.raises(FileNotFoundError, match=r"^nvcc not found on \$PATH or in /usr/local/cuda\*/bin$"):
            message_of()
    for version, found in (("cuda", "cuda"), ("cuda-12.4", "cuda-12.4"), ("cuda-13.0", "cuda-13.0")):
        (tmp_path / version / "bin").mkdir(parents=True)
        (tmp_path / version / "bin" / "nvcc").write_text("")
        assert resources.find_nvcc() == str(tmp_path / found / "bin" / "nvcc")  # a versioned one first, the newest
    monkeypatch.undo()
    monkeypatch.setenv("CUTP_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"^nvcc failed on gelu.cu:\n"):
        resources.compile_source("gelu", "false", version="a failing nvcc")
