"""The CuPy stand-in's own checks (in this process, no MPI): what it reports, and that it
refuses what CuPy refuses.

- a read on one stream of memory another stream writes, without an event wait: RaceError naming
  both places; with the wait (or on one stream): none;
- a host read of memory a non-current stream writes, without a synchronize: HostSyncError;
  each host read is counted as a host synchronization, by place;
- gemmEx from pointers: cuBLAS's column-major product with alpha, beta, transposes and leading
  dimensions of views; a leading dimension below the rows is CUBLAS_STATUS_INVALID_VALUE;
- the pool counts what live arrays hold, and cutp's PoolPeak sees it through using_allocator;
- host arrays in device operations and implicit conversion raise TypeError, as in CuPy.
"""
import ctypes

import numpy as np
import pytest

from cutp.train.memory import PoolPeak
from tests.device_path.standin import build, tracking
from tests.device_path.standin.cublas import CUBLASError

pytestmark = [pytest.mark.device_path, pytest.mark.device_path_default]
cp = build()["cupy"]


def test_an_unordered_read_on_another_stream_is_a_race_naming_both_places():
    x = cp.zeros(64, np.float32)
    side = cp.cuda.Stream(non_blocking=True)
    side.wait_event(cp.cuda.get_current_stream().record())  # (after the zeros)
    with side:
        x += 1  # written on the side stream
    with pytest.raises(tracking.RaceError, match=r"(?s)read after write.*test_standin.py:\d+ .*test_standin.py:\d+"):
        x.sum()  # read on the default stream, no wait
    y = cp.zeros(64, np.float32)
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        y += 1
    cp.cuda.get_current_stream().wait_event(side.record())
    assert float(y.sum()) == 64.0  # ordered by the event: no race


def test_a_host_read_of_unsynchronized_work_on_another_stream_is_reported_and_syncs_are_counted():
    x = cp.zeros(8, np.float32)
    side = cp.cuda.Stream(non_blocking=True)
    with pytest.raises(tracking.RaceError, match="write after write"):
        with side:
            x[...] = 2  # the side stream does not wait for the zeros on the default stream
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        x[...] = 2
    with pytest.raises(tracking.HostSyncError, match="without a synchronize"):
        x.get()
    side.synchronize()
    before = sum(tracking.SYNCS.current.values())
    assert x.get().tolist() == [2.0] * 8 and float(x[0]) == 2.0
    assert sum(tracking.SYNCS.current.values()) - before == 2


def _host_scalar(v):
    return np.array(v, np.float32)


@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemmex_from_pointers_is_cublas_column_major_product(ta, tb):
    rng = np.random.default_rng(0)
    m, n, k = 5, 3, 4
    a_h = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)  # column-major op(A) = m x k
    b_h = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    c_h = rng.standard_normal((m, n)).astype(np.float32)
    # column-major storage with padded leading dimensions: the transposes of row-major views
    A = cp.zeros((a_h.shape[1], a_h.shape[0] + 3), np.float32)
    A[:, :a_h.shape[0]] = cp.asarray(a_h.T)
    B = cp.zeros((b_h.shape[1], b_h.shape[0] + 1), np.float32)
    B[:, :b_h.shape[0]] = cp.asarray(b_h.T)
    C = cp.asarray(np.ascontiguousarray(c_h.T))
    alpha, beta = _host_scalar(0.5), _host_scalar(2.0)
    cublas = cp.cuda.cublas
    cublas.gemmEx(cp.cuda.Device().cublas_handle, ta, tb, m, n, k, alpha.ctypes.data, A.data.ptr, 0,
                  a_h.shape[0] + 3, B.data.ptr, 0, b_h.shape[0] + 1, beta.ctypes.data, C.data.ptr, 0, m, 68, -1)
    want = 0.5 * ((a_h.T if ta else a_h) @ (b_h.T if tb else b_h)) + 2.0 * c_h
    np.testing.assert_allclose(C.get().T, want, rtol=1e-6)
    with pytest.raises(CUBLASError, match=r"INVALID_VALUE.*ldA = 1"):
        cublas.gemmEx(cp.cuda.Device().cublas_handle, ta, tb, m, n, k, alpha.ctypes.data, A.data.ptr, 0, 1,
                      B.data.ptr, 0, b_h.shape[0] + 1, beta.ctypes.data, C.data.ptr, 0, m, 68, -1)
    assert ctypes.sizeof(ctypes.c_float) == 4


def test_the_pool_counts_live_arrays_and_cutps_pool_peak_sees_them():
    pool = cp.get_default_memory_pool()
    hook = PoolPeak(pool)
    with cp.cuda.using_allocator(hook.malloc):
        a = cp.empty(1000, np.float32)  # 4000 bytes -> 4096 (512-byte blocks)
        b = a * 2
        del a, b
    assert hook.bytes_above_start() == 2 * 4096
    assert pool.used_bytes() == hook.base


def test_host_arrays_and_implicit_conversions_are_refused_as_cupy_refuses_them():
    x = cp.ones(4, np.float32)
    with pytest.raises(TypeError, match="Unsupported type"):
        x + np.ones(4, np.float32)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)
    with pytest.raises(TypeError, match="no bfloat16 atomics"):
        cp.add.at(cp.zeros(4, np.dtype("bfloat16") if "bfloat16" in np.sctypeDict else _bf16()), cp.asarray([0]),
                  cp.ones(1, _bf16()))
    with pytest.raises(AttributeError, match="stand-in"):
        x.not_a_cupy_method()


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def test_memory_freed_while_another_stream_still_uses_it_is_reported():
    x = cp.zeros(64, np.float32)
    side = cp.cuda.Stream(non_blocking=True)
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        x *= 2  # queued on the side stream
    del x  # freed on the default stream with no wait: CuPy's pool could hand it out again at once
    with pytest.raises(tracking.RaceError, match=r"freed on the default stream .* while stream \d+ may still write"):
        cp.ones(4, np.float32)
