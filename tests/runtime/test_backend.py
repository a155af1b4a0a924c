"""The one place that decides the array module, and array exchange with host codes."""
import numpy as np
import pytest

from cutp.runtime import backend


class _DLPackOnly:
    """A foreign array type that only speaks DLPack (as a host code's own arrays might)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_numpy_is_chosen_for_host_arrays_without_importing_cupy():
    import subprocess
    import sys

    assert backend.get_array_module(np.ones(2), 3.0) is np
    assert backend.is_cupy_array(np.ones(2)) is False
    code = ("import sys, numpy as np, cutp; from cutp import ops; "
            "ops.softmax_forward(np.ones((2, 3))); assert 'cupy' not in sys.modules, 'cupy imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_as_array_takes_dlpack_zero_copy():
    a = np.arange(6.0).reshape(2, 3)
    b = backend.as_array(np, _DLPackOnly(a))
    assert isinstance(b, np.ndarray) and np.shares_memory(a, b)
    np.testing.assert_array_equal(b, a)
    assert backend.as_array(np, [1, 2], dtype=np.int32).dtype == np.int32


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(backend, "cuda_device_count", lambda: 0)
    assert backend.resolve_device("cpu") == "cpu"
    assert backend.resolve_device("auto") == "cpu"
    monkeypatch.setenv("CUTP_DEVICE", "cpu")
    assert backend.resolve_device("auto") == "cpu"
    with pytest.raises(backend.BackendError, match="no GPU is usable"):
        backend.resolve_device("cuda")
    monkeypatch.setattr(backend, "cuda_device_count", lambda: 2)
    monkeypatch.delenv("CUTP_DEVICE")
    assert backend.resolve_device("auto") == "cuda"


def test_to_numpy_passes_host_arrays_through():
    a = np.ones(3)
    assert backend.to_numpy(a) is a


class _DeviceDLPack:
    """A DLPack exporter NumPy cannot import (a device array's), that converts through __array__."""

    def __dlpack__(self, *args, **kwargs):
        raise BufferError("the data lives on a device")

    def __array__(self, dtype=None, copy=None):
        return np.arange(3.0, dtype=dtype)


def test_as_array_falls_back_for_what_dlpack_cannot_hand_over():
    from cutp.runtime.shape_only import ShapeOnly

    np.testing.assert_array_equal(backend.as_array(np, _DeviceDLPack()), np.arange(3.0))
    assert backend._dlpack_on_host(_DeviceDLPack()) is False  # no __dlpack_device__: from_dlpack decides
    assert backend._dlpack_on_host(np.ones(2)) is True
    xp = ShapeOnly("cuda")
    a = backend.as_array(xp, [1.0, 2.0], np.float32)
    assert (a.shape, a.dtype, a.values.tolist()) == ((2,), np.float32, [1.0, 2.0])


def test_nccl_status_names_what_is_missing(monkeypatch):
    import sys
    import types

    monkeypatch.setattr(backend, "cupy_status", lambda: (True, "CuPy 14"))
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy without its NCCL module
    ok, why = backend.nccl_status()
    assert not ok and why.startswith("cupy.cuda.nccl does not import (")
    assert backend.nccl_version_string().startswith("unknown (")

    def version():
        raise RuntimeError("ncclGetVersion failed")

    nccl = types.SimpleNamespace(available=False, get_version=version)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(nccl=nccl)))
    monkeypatch.setitem(sys.modules, "cupy.cuda", sys.modules["cupy"].cuda)
    assert backend.nccl_status() == (False, "libnccl.so.2 cannot be loaded; install nvidia-nccl-cu12 (or -cu13)")
    assert backend.nccl_version_string() == "unknown (ncclGetVersion failed)"
    nccl.available, nccl.get_version = True, lambda: 22703
    assert backend.nccl_status() == (True, "NCCL 2.27.3")
