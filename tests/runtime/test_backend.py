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
