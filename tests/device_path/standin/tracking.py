"""Streams, events, device memory and the ordering checks of the CuPy stand-in.

Everything the stand-in runs executes at once, on the host; what a GPU would do later is modelled
by clocks. Every stream counts the work queued on it (``seq``) and knows, per other stream, up to
which of its work it has waited (a vector clock: ``wait_event`` merges the event's knowledge);
the host has such a clock too (``synchronize`` of a stream, an event or the device advances it).
Each device allocation keeps the recent accesses to it (byte range, stream, seq, read/write, the
place in cutp that queued it). An access that overlaps an earlier one of another stream, at
least one of them a write, with no wait between them, is a race (RaceError names both places);
a host read of memory with device work the host has not synchronized with is one too.

Device memory: each allocation is a NumPy byte buffer of its own (never reused); one freed while
another stream's access to it is not waited for is reported at the next device operation (CuPy's
pool would hand it out again at once); the pool counts used bytes, so that cutp's memory reports
read them.
"""
from __future__ import annotations

import bisect
import itertools
import os
import sys
import threading
import time
import weakref

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # NumPy < 2
    _byte_bounds = np.byte_bounds

HERE = os.path.dirname(os.path.abspath(__file__))


from collections import Counter

CALLS: Counter = Counter()  # kernel launches, gemmEx and NCCL calls (by name): what a run exercised
# the array routines run on device arrays, with their operands' dtypes: {(name, (dtype names))}
# (test_fidelity checks the bfloat16 ones against CuPy's type loops)
ROUTINES: set = set()


class RaceError(RuntimeError):
    """Two accesses to device memory without the ordering a GPU needs between them."""


class HostSyncError(RuntimeError):
    """A host read of device memory that a GPU would not have finished writing."""


def place(skip_standin: bool = True) -> str:
    """The first frame outside the stand-in (and numpy): where cutp queued the work."""
    f = sys._getframe(1)
    first = None
    while f is not None:
        fn = f.f_code.co_filename
        if not (fn.startswith(HERE) or os.sep + "numpy" + os.sep in fn or fn.startswith("<")):
            here = f"{_short(fn)}:{f.f_lineno} in {f.f_code.co_name}"
            if first is None:
                first = here
                if not _passing(fn):
                    return first
            elif not _passing(fn):  # a collective or a conversion: also who asked for it
                return f"{first} (from {here})"
        f = f.f_back
    return first or "<unknown>"


_COMM = (os.sep + os.path.join("cutp", "comm") + os.sep, os.sep + os.path.join("cutp", "runtime", "backend.py"))


def _passing(fn: str) -> bool:
    return any(c in fn for c in _COMM)


def _short(fn: str) -> str:
    for key in (os.sep + "cutp" + os.sep, os.sep + "kernels" + os.sep, os.sep + "tests" + os.sep,
                os.sep + "examples" + os.sep, os.sep + "tools" + os.sep):
        i = fn.rfind(key)
        if i >= 0:
            return fn[i + 1:]
    return fn


# ------------------------------------------------------------------------------------------------
# Streams and events
# ------------------------------------------------------------------------------------------------
_stream_ids = itertools.count(1)
_streams: "weakref.WeakValueDictionary[int, Stream]" = weakref.WeakValueDictionary()
_lock = threading.RLock()


class _Host:
    def __init__(self):
        self.known: dict[int, int] = {}


HOST = _Host()


class Stream:
    """cupy.cuda.Stream: ``ptr`` 0 is the legacy default stream."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None, *, _id=None):
        self.sid = 0 if null else next(_stream_ids)
        self.ptr = 0 if null else 0x7F0000 + 16 * self.sid
        self.non_blocking = bool(non_blocking)
        self.seq = 0
        self.known: dict[int, int] = dict(HOST.known)  # work the host finished is finished for it too
        self._prev: list = []
        _streams[self.sid] = self

    def __repr__(self):
        return f"<cupy.cuda.Stream {'null' if self.sid == 0 else self.sid}>"

    def _tick(self) -> int:
        self.seq += 1
        self.known[self.sid] = self.seq
        return self.seq

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event):
        if event.vector is None:
            return  # an event never recorded completes at once (CUDA)
        for k, v in event.vector.items():
            if self.known.get(k, 0) < v:
                self.known[k] = v

    def synchronize(self):
        _check_open_groups(f"synchronize of {self!r}")
        _merge(HOST.known, self.known)
        SYNCS.note("stream.synchronize", place())

    @property
    def done(self):
        return True

    def use(self):
        _tls().stack[-1:] = [self]
        return self

    def __enter__(self):
        _tls().stack.append(self)
        return self

    def __exit__(self, *exc):
        _tls().stack.pop()
        return False

    def __eq__(self, other):
        return isinstance(other, Stream) and other.sid == self.sid

    def __hash__(self):
        return hash(self.sid)


def _merge(into: dict, src: dict):
    for k, v in src.items():
        if into.get(k, 0) < v:
            into[k] = v


NULL_STREAM = Stream(null=True)
Stream.null = NULL_STREAM
_local = threading.local()


def _tls():
    if not hasattr(_local, "stack"):
        _local.stack = [NULL_STREAM]
    return _local


def get_current_stream(device_id=None):
    return _tls().stack[-1]


class Event:
    """cupy.cuda.Event: what the recording stream knew (its vector clock) at the record."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.vector: dict[int, int] | None = None
        self.ptr = id(self)
        self.time: float | None = None  # (the host's clock: the work before it ran at once, on the host)

    def record(self, stream=None):
        stream = get_current_stream() if stream is None else stream
        self.vector = dict(stream.known)
        self.vector[stream.sid] = stream.seq
        self.time = time.perf_counter()

    def synchronize(self):
        if self.vector is not None:
            _merge(HOST.known, self.vector)
        SYNCS.note("event.synchronize", place())

    @property
    def done(self):
        return True


def get_elapsed_time(start, end) -> float:
    """Milliseconds between the two records (the host time the work between them took: the
    stand-in runs it at once); CuPy raises for an event not recorded."""
    if start.time is None or end.time is None:
        raise RuntimeError("stand-in (as CUDA: cudaErrorInvalidResourceHandle): get_elapsed_time of an event "
                           "not recorded")
    return (end.time - start.time) * 1e3


# ------------------------------------------------------------------------------------------------
# Host synchronizations
# ------------------------------------------------------------------------------------------------
class SyncLog:
    """Every host synchronization (device-to-host copy, .item(), stream/device synchronize), by
    (reason, place) in cutp; ``mark_step`` closes a step (examples and tests call it)."""

    def __init__(self):
        self.current: dict[tuple[str, str], int] = {}
        self.steps: list[dict] = []
        self.paused = False

    def note(self, reason: str, where: str):
        if self.paused:  # (a test's own reads between steps)
            return
        k = (reason, where)
        self.current[k] = self.current.get(k, 0) + 1

    def mark_step(self):
        self.steps.append(self.current)
        self.current = {}


SYNCS = SyncLog()


# ------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------
_ALIGN = 512  # CuPy's pool rounds every allocation up to 512 bytes


class Allocation:
    """One device allocation: a NumPy byte buffer and the accesses queued on it."""

    __slots__ = ("buf", "ptr", "size", "requested", "accesses", "pool", "__weakref__")

    def __init__(self, size: int, pool):
        self.requested = int(size)  # what the caller asked for: the bounds of gemmEx's and NCCL's checks
        self.size = max(_ALIGN, -(-int(size) // _ALIGN) * _ALIGN)
        owner = np.empty(self.size + 256, np.uint8)
        off = (-owner.ctypes.data) % 256  # cudaMalloc's alignment
        self.buf = owner[off:off + self.size]  # (every view of it has base `owner`)
        self.ptr = int(self.buf.ctypes.data)
        self.accesses: list[tuple] = []
        self.pool = pool
        _register(self)

    def release(self):
        self.pool._freed(self)


_by_ptr: dict[int, "weakref.ref[Allocation]"] = {}
_sorted_ptrs: list[int] = []
_by_buf: dict[int, "weakref.ref[Allocation]"] = {}


def _register(a: Allocation):
    with _lock:
        _by_ptr[a.ptr] = weakref.ref(a)
        bisect.insort(_sorted_ptrs, a.ptr)
        _by_buf[id(a.buf.base)] = weakref.ref(a)
    holder = _Accesses(a)
    holder.records = a.accesses
    weakref.finalize(a, _unregister, a.ptr, id(a.buf.base), a.pool, a.size, holder)


class _Accesses:
    """What a finalizer may hold of an allocation: its access records (not the allocation)."""

    def __init__(self, a):
        self.alloc_ref = weakref.ref(a)
        self.records: list = []


_freed_in_use: list[str] = []  # reported at the next access or synchronization (a finalizer cannot raise)


def _unregister(ptr, buf_id, pool, size, holder=None):
    if holder is not None and CHECK:
        stream = get_current_stream()
        for rlo, rhi, rsid, rseq, rkind, rwhere in holder.records:
            if rsid != stream.sid and stream.known.get(rsid, 0) < rseq and HOST.known.get(rsid, 0) < rseq:
                _freed_in_use.append(
                    f"device memory freed on {_sname(stream)} (at {place()}) while {_sname(rsid)} may still "
                    f"{'write' if rkind == 'w' else 'read'} it (queued at {rwhere}): CuPy's pool hands it out again "
                    "at once on the freeing stream (no record_stream); keep the array until an event wait")
                break
    _unregister_bytes(ptr, buf_id, pool, size)


def _unregister_bytes(ptr, buf_id, pool, size):
    with _lock:
        _by_ptr.pop(ptr, None)
        i = bisect.bisect_left(_sorted_ptrs, ptr)
        if i < len(_sorted_ptrs) and _sorted_ptrs[i] == ptr:
            del _sorted_ptrs[i]
        _by_buf.pop(buf_id, None)
    pool._used -= size


def find(ptr: int) -> Allocation | None:
    """The live allocation holding device address ptr."""
    with _lock:
        i = bisect.bisect_right(_sorted_ptrs, ptr) - 1
        if i < 0:
            return None
        a = _by_ptr[_sorted_ptrs[i]]()
    if a is None or not (a.ptr <= ptr < a.ptr + a.size):
        return None
    return a


def allocation_of(a: np.ndarray) -> Allocation | None:
    base = a if a.base is None else a.base
    ref = _by_buf.get(id(base))
    return None if ref is None else ref()


class MemoryPointer:
    """cupy.cuda.MemoryPointer: ``mem`` (the allocation), ``ptr`` (an address inside it)."""

    def __init__(self, mem: Allocation, offset: int = 0):
        self.mem = mem
        self.ptr = mem.ptr + int(offset)
        self.device_id = 0

    def __add__(self, offset):
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))

    def __int__(self):
        return self.ptr


class MemoryPool:
    """cupy.cuda.MemoryPool's counters: used_bytes is what live arrays hold (512-byte rounding)."""

    def __init__(self, allocator=None):
        self._used = 0
        self._limit = 0

    def malloc(self, size: int) -> MemoryPointer:
        a = Allocation(size, self)
        self._used += a.size
        return MemoryPointer(a)

    def _freed(self, a):
        pass

    def used_bytes(self) -> int:
        return int(self._used)

    def total_bytes(self) -> int:
        return int(self._used)

    def free_bytes(self) -> int:
        return 0

    def free_all_blocks(self, stream=None) -> None:
        pass

    def n_free_blocks(self) -> int:
        return 0

    def set_limit(self, size=None, fraction=None):
        self._limit = int(size or 0)

    def get_limit(self) -> int:
        return self._limit


class PinnedMemoryPool:
    def free_all_blocks(self):
        pass

    def n_free_blocks(self):
        return 0


DEFAULT_POOL = MemoryPool()
PINNED_POOL = PinnedMemoryPool()


def _allocator_tls():
    if not hasattr(_local, "allocator"):
        _local.allocator = None
    return _local


def get_allocator():
    return _allocator_tls().allocator or DEFAULT_POOL.malloc


def set_allocator(allocator=None):
    _allocator_tls().allocator = allocator


class using_allocator:
    def __init__(self, allocator=None):
        self.allocator = allocator

    def __enter__(self):
        t = _allocator_tls()
        self.prev = t.allocator
        t.allocator = self.allocator
        return self

    def __exit__(self, *exc):
        _allocator_tls().allocator = self.prev
        return False


def alloc(size: int) -> MemoryPointer:
    return get_allocator()(int(size))


# ------------------------------------------------------------------------------------------------
# The ordering checks
# ------------------------------------------------------------------------------------------------
CHECK = os.environ.get("CUTP_STANDIN_RACES", "1") != "0"
_open_groups: list = []  # NCCL groups begun and not ended (nccl.py appends)


def _report_freed_in_use():
    if _freed_in_use:
        msg, _freed_in_use[:] = _freed_in_use[0], []
        raise RaceError(msg)


def _check_open_groups(what: str):
    if _open_groups:
        raise RaceError(f"{what} while an NCCL group begun at {_open_groups[-1]} was never ended (groupEnd missing): "
                        "its collectives never launch, and a GPU would wait here forever")


def _bounds(a: np.ndarray) -> tuple[int, int]:
    if a.size == 0:
        lo = a.__array_interface__["data"][0]
        return lo, lo
    lo, hi = _byte_bounds(a)
    return lo, hi


def access(arrays, kind: str, stream=None, where: str | None = None):
    """Records reads ('r') or writes ('w') of host views of device memory on `stream` (default:
    the current stream); raises RaceError on an unordered overlap with another stream's access."""
    if not CHECK:
        return
    _report_freed_in_use()
    stream = get_current_stream() if stream is None else stream
    seq = stream._tick()
    where = where or place()
    for a in arrays:
        if a is None:
            continue
        alloc = allocation_of(a)
        if alloc is None:
            continue
        lo, hi = _bounds(a)
        access_range(alloc, lo, hi, kind, stream, seq, where)


def access_range(alloc: Allocation, lo: int, hi: int, kind: str, stream, seq: int, where: str):
    if lo >= hi:
        return
    keep = []
    for rec in alloc.accesses:
        rlo, rhi, rsid, rseq, rkind, rwhere = rec
        overlap = rlo < hi and lo < rhi
        if overlap and rsid != stream.sid and (rkind == "w" or kind == "w"):
            if stream.known.get(rsid, 0) < rseq:
                what = {"ww": "write after write", "wr": "read after write", "rw": "write after read"}[rkind + kind]
                raise RaceError(
                    f"race on device memory ({what}, bytes {max(lo, rlo) - alloc.ptr}..{min(hi, rhi) - alloc.ptr} of a "
                    f"{alloc.size}-byte allocation): {_sname(stream)} at {where} does not wait for "
                    f"{_sname(rsid)}'s {'write' if rkind == 'w' else 'read'} at {rwhere} (no event wait between them)")
        # a write on this stream covering an older access of this stream supersedes it
        if not (rsid == stream.sid and kind == "w" and lo <= rlo and rhi <= hi):
            keep.append(rec)
    keep.append((lo, hi, stream.sid, seq, kind, where))
    if len(keep) > 24:
        keep = [r for r in keep if not _known_everywhere(r[2], r[3])]
    alloc.accesses[:] = keep  # (in place: the finalizer's holder shares the list)


def _known_everywhere(sid: int, seq: int) -> bool:
    if HOST.known.get(sid, 0) >= seq:
        return True
    return all(s.known.get(sid, 0) >= seq for s in list(_streams.values()))


def _sname(s) -> str:
    sid = s if isinstance(s, int) else s.sid
    return "the default stream" if sid == 0 else f"stream {sid}"


def host_read(arrays, reason: str):
    """A device-to-host read (get, item, a conversion): counted, and checked against device work
    the host has not waited for. CuPy's copies run on the current stream and synchronize it."""
    where = place()
    SYNCS.note(reason, where)
    stream = get_current_stream()
    _check_open_groups(f"{reason} at {where}")
    _report_freed_in_use()
    _merge(HOST.known, stream.known)
    HOST.known[stream.sid] = max(HOST.known.get(stream.sid, 0), stream.seq)
    if not CHECK:
        return
    for a in arrays:
        alloc = allocation_of(a)
        if alloc is None:
            continue
        lo, hi = _bounds(a)
        for rlo, rhi, rsid, rseq, rkind, rwhere in alloc.accesses:
            if rkind == "w" and rlo < hi and lo < rhi and HOST.known.get(rsid, 0) < rseq:
                raise HostSyncError(f"host read ({reason}) at {where} of device memory that {_sname(rsid)} still "
                                    f"writes (queued at {rwhere}) without a synchronize")


def device_synchronize():
    _check_open_groups("device synchronize")
    for s in list(_streams.values()):
        HOST.known[s.sid] = max(HOST.known.get(s.sid, 0), s.seq)
    SYNCS.note("device synchronize", place())
