"""GPU-path contracts that can be pinned without a GPU.

Each test stands in for CuPy or NCCL with a small fake that behaves like the real one where it
matters (CuPy 14's refusals, NCCL's argument lists), and checks what cutp hands to it: the NCCL
wrapper's counts, dtype and op enums and stream; the array module an op picks; host conversion
of device arrays; the device the watchdog's thread queries events on.
"""
from __future__ import annotations

import sys
import threading
import types

import ml_dtypes
import numpy as np
import pytest

from cutp.runtime import backend
from tests.runtime.test_backend import _DLPackOnly

BF16 = np.dtype(ml_dtypes.bfloat16)


class FakeDeviceArray:
    """Looks like a CuPy array to cutp (`type(x).__module__` starts with 'cupy'), wraps a NumPy
    array, and refuses implicit host conversion as CuPy does."""

    def __init__(self, a):
        self._a = np.ascontiguousarray(a)
        self.data = types.SimpleNamespace(ptr=self._a.ctypes.data)

    shape = property(lambda self: self._a.shape)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    dtype = property(lambda self: self._a.dtype)
    flags = property(lambda self: self._a.flags)

    def get(self):
        return self._a.copy()

    def copy(self):
        return FakeDeviceArray(self._a.copy())

    def __getitem__(self, index):  # a view, as CuPy slicing gives (the pointer moves with it)
        return FakeDeviceArray(self._a[index])

    def __array__(self, *args, **kwargs):  # cupy.ndarray.__array__ raises exactly this
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")


FakeDeviceArray.__module__ = "cupy._core.core"


def test_fake_device_array_is_taken_for_cupy():
    a = FakeDeviceArray(np.ones(3))
    assert backend.is_cupy_array(a)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(a)
    np.testing.assert_array_equal(backend.to_numpy(a), np.ones(3))


# ---- NCCL wrapper: what reaches cupy.cuda.nccl.NcclCommunicator --------------------------------
class _RecordingNcclComm:
    """Records each call with CuPy 14's positional signatures (sendbuf, recvbuf, count, datatype,
    [op,] [root/peer,] stream)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args: self.calls.append((name, args))


def _nccl_comm(rank=1, size=4):
    from cutp.comm.base import Communicator
    from cutp.comm.nccl import NcclCommunicator

    c = NcclCommunicator.__new__(NcclCommunicator)  # no MPI bootstrap, no CUDA
    Communicator.__init__(c, rank, size, "tp")
    c.nccl_comm = _RecordingNcclComm()
    c._stream = lambda: 0xBEEF
    c._empty = lambda shape, dtype: FakeDeviceArray(np.empty(shape, dtype))
    return c


@pytest.mark.parametrize("dtype,enum", [(np.float32, 7), (np.float64, 8), (BF16, 9), (np.float16, 6), (np.int32, 2),
                                        (np.int64, 4)])
def test_nccl_wrapper_passes_counts_dtypes_ops_and_stream(dtype, enum):
    c = _nccl_comm()
    x = FakeDeviceArray(np.zeros((8, 3), dtype))
    out = c.all_reduce(x, "avg")
    name, args = c.nccl_comm.calls[-1]
    assert name == "allReduce" and args == (x.data.ptr, out.data.ptr, 24, enum, 4, 0xBEEF)
    c.all_reduce(x, "max", out=x)  # in place: the same pointer twice
    assert c.nccl_comm.calls[-1] == ("allReduce", (x.data.ptr, x.data.ptr, 24, enum, 2, 0xBEEF))

    rs = c.reduce_scatter(x, "sum")  # recvcount: this rank's chunk, 2 rows of 3
    assert rs.shape == (2, 3)
    assert c.nccl_comm.calls[-1] == ("reduceScatter", (x.data.ptr, rs.data.ptr, 6, enum, 0, 0xBEEF))

    g = c.all_gather(x)  # sendcount: this rank's contribution
    assert g.shape == (32, 3)
    assert c.nccl_comm.calls[-1] == ("allGather", (x.data.ptr, g.data.ptr, 24, enum, 0xBEEF))

    assert c.broadcast(x, root=2) is x
    assert c.nccl_comm.calls[-1] == ("broadcast", (x.data.ptr, x.data.ptr, 24, enum, 2, 0xBEEF))
    c.send(x, 3)
    assert c.nccl_comm.calls[-1] == ("send", (x.data.ptr, 24, enum, 3, 0xBEEF))
    assert c.recv(x, 0) is x
    assert c.nccl_comm.calls[-1] == ("recv", (x.data.ptr, 24, enum, 0, 0xBEEF))


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_nccl_wrapper_in_place_layouts_and_overlaps(rank):
    """NCCL's in-place layouts reach NCCL as they are; any other overlap of x and out is copied
    first (NCCL leaves it undefined)."""
    c = _nccl_comm(rank=rank, size=4)

    def sent():
        return c.nccl_comm.calls[-1][1][:2]

    def inside(ptr, a):
        return a.data.ptr <= ptr < a.data.ptr + a.nbytes

    out = FakeDeviceArray(np.zeros((8, 3), np.float32))
    slot = out[2 * rank:2 * rank + 2]
    c.all_gather(slot, out=out)  # x is this rank's slot of out
    assert sent() == (slot.data.ptr, out.data.ptr)
    shifted = out[(2 * rank + 1) % 7:(2 * rank + 1) % 7 + 2]  # overlapping, but not at this rank's slot
    c.all_gather(shifted, out=out)
    assert not inside(sent()[0], out) and sent()[1] == out.data.ptr

    x = FakeDeviceArray(np.zeros((8, 3), np.float32))
    mine = x[2 * rank:2 * rank + 2]
    c.reduce_scatter(x, out=mine)  # out is this rank's slot of x
    assert sent() == (x.data.ptr, mine.data.ptr)
    theirs = x[2 * ((rank + 1) % 4):2 * ((rank + 1) % 4) + 2]
    c.reduce_scatter(x, out=theirs)
    assert not inside(sent()[0], x) and sent()[1] == theirs.data.ptr

    c.all_reduce(x, out=x)  # the same buffer: in place
    assert sent() == (x.data.ptr, x.data.ptr)
    c.all_reduce(x[0:4], out=x[2:6])  # a partial overlap
    assert not inside(sent()[0], x) and sent()[1] == x[2:6].data.ptr


def test_nccl_wrapper_refuses_before_calling_nccl():
    from cutp.comm import CommError

    c = _nccl_comm()
    with pytest.raises(CommError, match="takes CuPy arrays"):
        c.all_reduce(np.zeros(4, np.float32))
    with pytest.raises(CommError, match="dtype int8"):
        c.all_reduce(FakeDeviceArray(np.zeros(4, np.int8)))
    with pytest.raises(CommError, match="axis 0 divisible by 4"):
        c.reduce_scatter(FakeDeviceArray(np.zeros(6, np.float32)))
    with pytest.raises(CommError, match="out has shape"):
        c.all_reduce(FakeDeviceArray(np.zeros(4, np.float32)), out=FakeDeviceArray(np.zeros(5, np.float32)))
    assert c.nccl_comm.calls == []


# ---- embedding backward on CuPy: no bfloat16 atomics --------------------------------------------
class _StrictAdd:
    """cupy.add.at: CuPy 14 (cupy/_core/_routines_indexing.pyx, _scatter_op_single) raises
    TypeError unless the values are int32, int64, float16, float32, float64, uint32 or uint64."""

    OK = {np.dtype(t) for t in (np.int32, np.int64, np.float16, np.float32, np.float64, np.uint32, np.uint64)}

    def __init__(self):
        self.dtypes = []

    def at(self, a, idx, b):
        b = np.asarray(b).astype(a.dtype, copy=False)  # CuPy casts the values to a's dtype first
        self.dtypes.append(b.dtype)
        if b.dtype not in self.OK:
            raise TypeError("cupy.add.at only supports int32, int64, float16, float32, float64, uint32, uint64")
        np.add.at(a, idx, b)


def _cupy_like_module():
    xp = types.ModuleType("fake_cupy")
    for name in ("flatnonzero", "unique", "zeros", "float32"):
        setattr(xp, name, getattr(np, name))
    xp.add = _StrictAdd()
    return xp


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("masked", [False, True])
def test_embedding_backward_device_path_takes_no_bf16_atomics(monkeypatch, dtype, masked):
    from cutp import ops
    from cutp.ops import embedding

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 5, (4, 6))  # repeated ids
    dy = rng.integers(-4, 5, (4, 6, 3)).astype(np.float32).astype(dtype)  # small integers: exact sums
    mask = rng.random((4, 6)) < 0.6 if masked else None
    base = rng.integers(-4, 5, (7, 3)).astype(np.float32).astype(dtype)
    ctx = ops.EmbeddingCtx(ids, mask)
    want = ops.embedding_backward(dy, ctx, base.copy())  # the NumPy path

    xp = _cupy_like_module()
    monkeypatch.setattr(embedding, "get_array_module", lambda *a: xp)
    got = ops.embedding_backward(dy, ctx, base.copy())
    assert xp.add.dtypes and all(d in _StrictAdd.OK for d in xp.add.dtypes)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


# ---- host conversion of device arrays -------------------------------------------------------------
_HostDLPack = _DLPackOnly  # a torch CPU tensor, say: a foreign host array that only speaks DLPack


def test_as_array_on_cuda_takes_host_dlpack_through_numpy():
    def from_dlpack(a):  # cupy.from_dlpack (cupy/_core/dlpack.pyx) refuses kDLCPU exporters
        if a.__dlpack_device__()[0] == 1:
            raise TypeError("CPU arrays cannot be directly imported to CuPy.")
        raise AssertionError("only host exporters in this test")

    xp = types.SimpleNamespace(asarray=lambda a, dtype=None: ("device", np.asarray(a, dtype=dtype)),
                               from_dlpack=from_dlpack)
    kind, got = backend.as_array(xp, _HostDLPack(np.arange(6.0)), dtype=np.float32)
    assert kind == "device" and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.arange(6.0))


def test_generate_takes_a_device_prompt():
    from cutp.generate import _as_batch

    idx, single = _as_batch(FakeDeviceArray(np.array([[1, 2, 3]], np.int32)))
    assert not single and idx.dtype == np.int64
    np.testing.assert_array_equal(idx, [[1, 2, 3]])


def test_load_full_state_dict_takes_device_arrays():
    from mpi4py import MPI

    import cutp
    from cutp.models import GPT, GPTConfig

    ctx = cutp.init(comm=MPI.COMM_SELF, tp=1, device="cpu", abort_on_error=False, collective_timeout=0)
    try:
        cfg = GPTConfig.preset("tiny", n_layer=1, n_embd=32, n_head=2, block_size=16)
        src = GPT(ctx, cfg, seed=5)
        full = src.gather_state_dict(rank=None)
        dst = GPT(ctx, cfg, init=False)
        dst.load_full_state_dict({k: FakeDeviceArray(v) for k, v in full.items()})
        for name, p in dst.named_parameters().items():
            np.testing.assert_array_equal(p.data, src.named_parameters()[name].data, err_msg=name)
    finally:
        ctx.close()


# ---- the watchdog's thread queries NCCL completion events on their own device ---------------------
def _fake_cupy(current_device):
    calls = {"set": [], "recorded_on": []}
    state = threading.local()

    def get_device():
        return getattr(state, "device", 0)  # CUDA: a new thread's current device is 0

    def set_device(d):
        calls["set"].append((threading.current_thread().name, d))
        state.device = d

    class Event:
        def __init__(self, **kwargs):
            self.queried_on = []

        def record(self, stream=None):
            calls["recorded_on"].append(stream)

        @property
        def done(self):
            self.queried_on.append(get_device())
            return True

    stream = object()
    runtime = types.SimpleNamespace(getDevice=get_device, setDevice=set_device)
    cuda = types.ModuleType("cupy.cuda")
    cuda.Event, cuda.runtime, cuda.get_current_stream = Event, runtime, (lambda: stream)
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    state.device = current_device  # the main thread's device, as cutp.init's Device(id).use() sets it
    return cupy, cuda, calls, stream


def test_watchdog_queries_nccl_events_on_their_device(monkeypatch):
    from cutp.comm.base import Communicator
    from cutp.comm.watched import WatchdogCommunicator
    from cutp.runtime.watchdog import Watchdog

    cupy, cuda, calls, stream = _fake_cupy(current_device=3)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)

    class Inner(Communicator):
        kind = "nccl"

        def all_reduce(self, x, op="sum", out=None):
            return x

    wd = Watchdog(1000.0, rank=0)
    wd.begin = lambda desc, done=None: seen.append(done)  # capture the completion test only
    seen = []
    c = WatchdogCommunicator(Inner(0, 2, "tp"), wd)
    c.all_reduce(np.zeros(2))
    assert calls["recorded_on"] == [stream], "the event must be recorded on the collective's stream"
    (done,) = seen
    result = []
    t = threading.Thread(target=lambda: result.append(done()), name="cutp-watchdog-test")
    t.start()
    t.join()
    assert result == [True]
    assert calls["set"] == [("cutp-watchdog-test", 3)], calls["set"]
    assert done.args[0].queried_on == [3], "queried with the thread's current device still 0"


# ---- non-blocking NCCL collectives: a communication stream ordered by events --------------------
class _FakeEvent:
    def __init__(self, stream, log):
        self.stream, self.done = stream, False
        log.append(("record", stream.name))


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log, self.ptr = name, log, {"compute": 0xC0, "comm": 0xC1}[name]

    def record(self):
        return _FakeEvent(self, self.log)

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.stream.name))


def test_nccl_start_runs_on_the_comm_stream_after_the_compute_stream_and_keeps_its_buffers():
    """Compute records, comm waits, NCCL runs on the comm stream, comm records done; wait() makes
    the compute stream wait for done (no host synchronisation) and only then lets the buffers go."""
    import gc
    import weakref

    c = _nccl_comm(rank=1, size=4)
    log = []
    streams = (_FakeStream("compute", log), _FakeStream("comm", log))
    c._streams = lambda: streams
    x = FakeDeviceArray(np.zeros((8, 3), np.float32))
    req = c.start_all_reduce(x, "avg")
    name, args = c.nccl_comm.calls[-1]
    assert name == "allReduce" and args[-1] == 0xC1 and args[2:5] == (24, 7, 4)
    assert log[:2] == [("record", "compute"), ("wait", "comm", "compute")] and log[-1] == ("record", "comm")
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is not None and not req.test()  # held by the request until its wait
    req.done.done = True
    assert req.test()
    out = req.wait()
    assert log[-1] == ("wait", "compute", "comm") and out.shape == (8, 3)
    gc.collect()
    assert alive() is None
    mine = c.start_reduce(FakeDeviceArray(np.zeros(6, np.float32)), root=1).wait()
    assert c.nccl_comm.calls[-1][0] == "reduce" and c.nccl_comm.calls[-1][1][-2:] == (1, 0xC1) and mine is not None
