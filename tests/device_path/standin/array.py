"""``cupy.ndarray`` of the stand-in: a NumPy view of a device allocation (tracking.Allocation).

Every operation unwraps its device arguments to their NumPy views, runs NumPy, and wraps the
result: a view of device memory stays a view, anything new is copied into a new allocation of
the pool. Reads and writes are recorded on the current stream (tracking.access). As in CuPy:
host arrays are refused where CuPy refuses them (TypeError), implicit conversion to NumPy raises,
``get``/``item``/``float``/``bool``/``tolist`` are host synchronizations (counted, and checked
against device work not synchronized with). Only the functions and methods listed here (each
one CuPy has: tests/device_path/test_fidelity.py) are provided.
"""
from __future__ import annotations

import weakref

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from . import tracking
from .tracking import MemoryPointer, access, allocation_of, host_read

# numpy functions the stand-in's `cupy` forwards (every one exists in CuPy 14).
FUNCTIONS = frozenset("""
abs absolute add all allclose amax amin any arange arccos arcsin arctan arctan2 argmax argmin argsort around
array_equal atleast_1d atleast_2d bincount broadcast_arrays broadcast_to ceil clip compress concatenate
copysign cos cosh count_nonzero cumprod cumsum diag diagonal diff divide dot einsum equal exp exp2 expand_dims expm1
eye flatnonzero flip floor floor_divide fmax fmin full full_like greater greater_equal hstack identity
isclose isfinite isinf isnan kron less less_equal linspace log log10 log1p log2 logaddexp logical_and
logical_not logical_or logical_xor matmul max maximum mean min minimum mod moveaxis multiply nan_to_num
negative nonzero not_equal ones_like outer power prod ravel reciprocal remainder repeat reshape right_shift
left_shift bitwise_and bitwise_or bitwise_xor invert rint round roll rsqrt searchsorted sign sin sinh sort split sqrt square
squeeze stack std subtract sum swapaxes take take_along_axis tanh tile transpose tril triu true_divide trunc
unique var vstack where zeros_like empty_like put cbrt fabs float_power tan arccosh arcsinh arctanh
signbit heaviside histogram array_split meshgrid indices lexsort partition argpartition median percentile
""".split())
# numpy.ndarray methods the stand-in's ndarray forwards (CuPy's ndarray has each)
METHODS = frozenset("""
all any argmax argmin argsort astype clip copy cumsum cumprod diagonal dot fill flatten max mean min nonzero
prod ravel repeat reshape round sort squeeze std sum swapaxes take trace transpose var view
""".split())
DTYPE_NAMES = ("bool_ int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 complex64 "
               "complex128 intp uintp float_ int_ dtype inf nan pi e newaxis finfo iinfo result_type "
               "can_cast promote_types issubdtype floating integer signedinteger unsignedinteger number "
               "generic bool ubyte byte short ushort intc uintc longlong ulonglong single double half").split()


_owners: "weakref.WeakValueDictionary[int, ndarray]" = weakref.WeakValueDictionary()


class ndarray(NDArrayOperatorsMixin):
    """cupy.ndarray(shape, dtype=float, memptr=None, strides=None, order='C')."""

    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        shape = (shape,) if np.isscalar(shape) else tuple(shape)
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if memptr is None:
            memptr = tracking.alloc(nbytes)
        off = memptr.ptr - memptr.mem.ptr
        if strides is None:
            strides = _c_strides(shape, dtype.itemsize) if order == "C" else _f_strides(shape, dtype.itemsize)
        self._a = np.ndarray(shape, dtype, buffer=memptr.mem.buf, offset=off, strides=strides)
        self._mem = memptr.mem
        self._base = None
        if id(memptr.mem) not in _owners:
            _owners[id(memptr.mem)] = self  # the array owning the allocation: the base of its views

    # ---- construction from NumPy views --------------------------------------------------------
    @classmethod
    def _view(cls, a: np.ndarray, mem=None):
        self = object.__new__(cls)
        self._a = a
        self._mem = allocation_of(a) if mem is None else mem
        if self._mem is None:
            raise AssertionError("stand-in: a view of host memory taken for device memory")
        owner = _owners.get(id(self._mem))
        if owner is None:  # (its owner was never a stand-in array, or is gone): one over the whole allocation
            owner = ndarray((self._mem.requested,), np.uint8, memptr=MemoryPointer(self._mem))
        self._base = owner  # as in CuPy: a view keeps its base alive
        return self

    # ---- attributes ---------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray._view(self._a.T, self._mem))
    device = property(lambda self: _DEVICE0())
    base = property(lambda self: self._base)

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self._mem, self._a.__array_interface__["data"][0] - self._mem.ptr)

    @property
    def __cuda_array_interface__(self):
        d = dict(self._a.__array_interface__)
        d["version"] = 3
        d["stream"] = tracking.get_current_stream().ptr or 1
        return d

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"stand-in cupy.ndarray(shape={self.shape}, dtype={self.dtype})"

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getattr__(self, name):
        if name in METHODS:
            fn = getattr(self._a, name)

            def method(*args, **kwargs):
                return _call(fn, name, (self,) + args, kwargs, unwrapped_first=True)

            return method
        raise AttributeError(f"stand-in cupy.ndarray has no attribute {name!r} (CuPy's may; add it to METHODS "
                             "after checking it there)")

    # ---- host transfers and conversions (host synchronizations) --------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        host_read([self._a], "get (device-to-host copy)")
        r = np.array(self._a, order=order)
        if out is not None:
            out[...] = r
            return out
        return r

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr).__name__}")
        access([self._a], "w")
        self._a[...] = arr

    def item(self):
        host_read([self._a], "item()")
        return self._a.item()

    def tolist(self):
        host_read([self._a], "tolist()")
        return self._a.tolist()

    def __float__(self):
        host_read([self._a], "float() of a device array")
        return float(self._a)

    def __int__(self):
        host_read([self._a], "int() of a device array")
        return int(self._a)

    def __bool__(self):
        host_read([self._a], "bool() of a device array")
        return bool(self._a)

    def __index__(self):
        host_read([self._a], "index from a device array")
        return self._a.__index__()

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        f"NumPy array explicitly. (stand-in: at {tracking.place()})")

    def __dlpack__(self, stream=None, **kwargs):
        raise TypeError("stand-in cupy.ndarray: DLPack export is not modelled")

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0

    # ---- indexing --------------------------------------------------------------------------------
    def __getitem__(self, index):
        return _call(self._a.__getitem__, "__getitem__", (self, index), {}, unwrapped_first=True)

    def __setitem__(self, index, value):
        _check_host(value, "__setitem__")
        v = value._a if isinstance(value, ndarray) else value
        reads = [value._a] if isinstance(value, ndarray) else []
        reads += [i._a for i in (index if isinstance(index, tuple) else (index,)) if isinstance(i, ndarray)]
        idx = _unwrap(index)
        access(reads, "r")
        target = self._a[idx] if _is_basic(idx) else self._a
        access([target], "w")
        self._a[idx] = v

    # ---- NumPy protocols: np.<ufunc>(device array) and np.<function>(device array) run here ----
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = getattr(ufunc, method)
        if method == "at" and any(getattr(x, "dtype", None) is not None and x.dtype.name == "bfloat16"
                                  for x in inputs):
            raise TypeError(f"stand-in (as CuPy 14): {ufunc.__name__}.at has no bfloat16 atomics")
        return _call(fn, f"{ufunc.__name__}.{method}" if method != "__call__" else ufunc.__name__, inputs, kwargs,
                     in_place_first=method == "at")

    def __array_function__(self, func, types, args, kwargs):
        if func.__name__ not in FUNCTIONS and func.__name__ not in ("copyto", "shares_memory", "may_share_memory",
                                                                     "result_type", "ndim", "shape", "size"):
            return NotImplemented
        return _call(func, func.__name__, args, kwargs, in_place_first=func.__name__ == "copyto")


def _DEVICE0():
    from .cuda import Device

    return Device(0)


def _c_strides(shape, item):
    out, s = [], item
    for d in reversed(shape):
        out.append(s)
        s *= max(1, d)
    return tuple(reversed(out))


def _f_strides(shape, item):
    out, s = [], item
    for d in shape:
        out.append(s)
        s *= max(1, d)
    return tuple(out)


def _is_basic(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(isinstance(i, (int, np.integer, slice, type(Ellipsis), type(None))) for i in items)


def _check_host(x, what):
    if isinstance(x, np.ndarray) and x.ndim > 0:
        raise TypeError(f"Unsupported type <class 'numpy.ndarray'> (stand-in, as CuPy: a host array handed to "
                        f"{what} on device arrays at {tracking.place()}; move it with cupy.asarray first)")


def _unwrap(x):
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, tuple):
        return tuple(_unwrap(v) for v in x)
    if isinstance(x, list):
        return [_unwrap(v) for v in x]
    return x


def _device_arrays(x, out: list):
    if isinstance(x, ndarray):
        out.append(x._a)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _device_arrays(v, out)
    return out


def _host_arrays(x):
    if isinstance(x, np.ndarray) and x.ndim > 0:
        return True
    if isinstance(x, (tuple, list)):
        return any(_host_arrays(v) for v in x)
    return False


def wrap(r):
    """A NumPy result as the stand-in's: views of device memory stay views, the rest is copied
    into new device memory; NumPy scalars become 0-d arrays (CuPy's reductions return those)."""
    if isinstance(r, np.ndarray):
        mem = allocation_of(r)
        if mem is not None:
            return ndarray._view(r, mem)
        return to_device(r)
    if isinstance(r, np.generic):
        return to_device(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(wrap(v) for v in r)
    if isinstance(r, list):
        return [wrap(v) for v in r]
    return r


def to_device(a: np.ndarray) -> ndarray:
    out = ndarray(a.shape, a.dtype)
    np.copyto(out._a, a, casting="unsafe")
    return out


_VIEWS = frozenset(("reshape", "view", "transpose", "swapaxes", "ravel", "squeeze", "diagonal", "moveaxis",
                    "expand_dims", "broadcast_to", "atleast_1d", "atleast_2d"))


def _call(fn, name, args, kwargs, *, unwrapped_first=False, in_place_first=False):
    """Runs NumPy's `fn` on the unwrapped arguments; records the reads, the writes (out=, an
    in-place first argument, a new result) on the current stream."""
    if _host_arrays(args[1:] if unwrapped_first else args) or _host_arrays(tuple(kwargs.values())):
        raise TypeError(f"Unsupported type <class 'numpy.ndarray'> (stand-in, as CuPy: a host array handed to {name} "
                        f"on device arrays at {tracking.place()}; move it with cupy.asarray first)")
    if name == "__getitem__" and _is_basic(args[1]):  # CuPy: a view, 0-d for a single element
        idx = args[1] if isinstance(args[1], tuple) else (args[1],)
        return wrap(args[0]._a[idx + (Ellipsis,)] if Ellipsis not in idx else args[0]._a[idx])
    if name in _VIEWS:
        r = fn(*(_unwrap(args[1:]) if unwrapped_first else _unwrap(args)), **{k: _unwrap(v) for k, v in kwargs.items()})
        if isinstance(r, np.ndarray) and allocation_of(r) is not None:
            return wrap(r)  # a view: no device work
        access(_device_arrays(args, []), "r")
        res = wrap(r)
        access(_device_arrays(res, []), "w")
        return res
    reads = _device_arrays(args, [])
    reads = _device_arrays(tuple(v for k, v in kwargs.items() if k != "out"), reads)
    tracking.ROUTINES.add((name, tuple(a.dtype.name for a in reads)))
    outs = _device_arrays(kwargs.get("out"), [])
    if in_place_first and reads:
        outs.append(reads[0])
    access(reads, "r")
    uargs = _unwrap(args[1:]) if unwrapped_first else _unwrap(args)
    ukw = {k: _unwrap(v) for k, v in kwargs.items()}
    r = fn(*uargs, **ukw)
    if outs:
        access(outs, "w")
    res = wrap(r)
    new = _device_arrays(res, [])
    if new and not outs:
        access(new, "w")
    return res
