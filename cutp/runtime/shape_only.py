"""Shape-only arrays: an array module whose arrays have a shape, a dtype and strides but no data,
and whose every buffer is booked on a heap while it lives. The planner (cutp.plan) builds cutp's
own model, optimizer and training step on them and reads the heap: the bytes the real step would
hold at each moment, derived from the code that runs rather than written down a second time.

    xp = ShapeOnly("cpu")                 # NumPy's allocation behaviour ("cuda": CuPy's)
    a = xp.zeros((4096, 768), np.float32)  # booked: 12.6 MB
    b = a[:, :384]                         # a view: nothing booked
    del a, b                               # the buffer goes with its last array
    xp.heap.peak

What is booked is what NumPy (or CuPy) allocates for the same calls: a buffer per new array
(`empty`, `zeros`, `astype`, `copy`, the result of an operator or a function without `out=`),
nothing for views (basic indexing, `reshape` where NumPy would not copy, transposes,
`broadcast_to`, `view`), nothing for in-place operators and `out=` results. Buffers are released
when their last array goes, as CPython releases NumPy's: each array holds its owner buffer, and
the buffer's finaliser books the free. Two behaviours of the module imitated are copied:

- "cpu": NumPy's temporary elision: `a + b` where `a` (or `b`, for + and *) is a temporary (no
  other reference) that owns its data, of at least 256 KiB, of the result's shape and dtype,
  reuses that buffer (numpy/_core/src/multiarray/temp_elide.c). The ops' threads: `parallel_map`
  of the blocked CPU ops runs the blocks one after the other and books `threads` of them at once
  (an upper bound; with 1 thread exact).
- "cuda": CuPy's memory pool rounds each buffer up to 512 bytes; no elision.

Data: arrays up to 1 MiB (token ids, masks, counts, small buffers; `empty` ones start as zeros)
keep values, computed by NumPy as the code writes them, so what depends on them (a boolean mask's
`compress`, `int(a.min())`) is exact. Anything else that needs data gets a hint that keeps the
step on its usual path: truth values True (and `any()` False: no overflow, no NaN), numbers 0
(no non-finite entry counted, a zero norm); a data-dependent shape without values (`nonzero`,
`bincount` of unknown ids, `unique`) raises `ShapeOnlyError` naming the call, so a code path
the planner cannot follow fails loudly instead of planning something else.

(It runs over 500 lines: NumPy's surface that cutp's step touches, in one place.)
"""
from __future__ import annotations

import math
import numbers
import sys
import types
import weakref

import numpy as np
from numpy.lib.stride_tricks import as_strided

ELIDE_BYTES = 256 * 1024  # NumPy reuses a temporary operand from this size (NPY_MIN_ELIDE_BYTES)
POOL_ROUND = 512  # CuPy's memory pool rounds every allocation up to this
KEEP_VALUES_BYTES = 1 << 20  # host data up to this size keeps its values


class ShapeOnlyError(RuntimeError):
    """The planner's step needed data that shape-only arrays do not have."""


class Heap:
    """Live bytes, their high-water mark and what was being done when it was reached."""

    def __init__(self, round_to: int = 1):
        self.round_to = round_to
        self.cur = 0
        self.peak = 0
        self.where = ""  # the `label` at the peak (the planner sets it per phase)
        self.label = ""

    def size(self, nbytes: int) -> int:
        n, r = int(nbytes), self.round_to
        return n if r <= 1 or n == 0 else -(-n // r) * r

    def book(self, n: int) -> None:
        self.cur += n
        if self.cur > self.peak:
            self.peak, self.where = self.cur, self.label

    def release(self, n: int) -> None:
        self.cur -= n

    def reset_peak(self) -> None:
        self.peak, self.where = self.cur, self.label


class _Buffer:
    """One allocation; booked until the last array viewing it goes."""

    __slots__ = ("nbytes", "__weakref__")

    def __init__(self, heap: Heap, nbytes: int):
        self.nbytes = heap.size(nbytes)
        heap.book(self.nbytes)
        weakref.finalize(self, heap.release, self.nbytes)


def _ghost(shape, strides, dtype) -> np.ndarray:
    """A NumPy array with this layout over one element of memory: NumPy computes the metadata of
    views (indexing, reshape, transposes) on it; its data is never read."""
    return as_strided(np.zeros(1, dtype), shape=tuple(shape), strides=tuple(strides), writeable=False)


def _c_strides(shape, itemsize):
    strides, acc = [], itemsize
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


def _norm_shape(shape):
    if isinstance(shape, (numbers.Integral, np.integer)):
        return (int(shape),)
    return tuple(int(d) for d in shape)


def _is_basic_index(key) -> bool:
    items = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (slice, numbers.Integral, np.integer)) for k in items)


class _Flags:
    def __init__(self, ghost):
        self.c_contiguous = bool(ghost.flags.c_contiguous)
        self.f_contiguous = bool(ghost.flags.f_contiguous)
        self.contiguous = self.c_contiguous


class ShapeArray:
    """An array without data (see the module docstring)."""

    __slots__ = ("xp", "_ghost", "_buffer", "base", "offset", "values", "__weakref__")
    __array_priority__ = 1000

    def __init__(self, xp, ghost, buffer, base=None, offset=0, values=None):
        self.xp, self._ghost, self._buffer, self.base, self.offset, self.values = xp, ghost, buffer, base, offset, values

    # ---- metadata --------------------------------------------------------------------------
    shape = property(lambda self: self._ghost.shape)
    dtype = property(lambda self: self._ghost.dtype)
    strides = property(lambda self: self._ghost.strides)
    ndim = property(lambda self: self._ghost.ndim)
    size = property(lambda self: self._ghost.size)
    itemsize = property(lambda self: self._ghost.itemsize)
    nbytes = property(lambda self: self._ghost.nbytes)
    flags = property(lambda self: _Flags(self._ghost))
    T = property(lambda self: self.transpose())
    device = property(lambda self: self.xp.device)

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"ShapeArray({self.shape}, {self.dtype}, {self.xp.device})"

    @property
    def data(self):
        """A device array's `.data.ptr` (cutp.comm.base.address, NCCL's arguments): not an address,
        but distinct per buffer and offset, so overlap checks between these arrays hold."""
        return _Pointer(id(self._buffer) + self.offset)

    # ---- views ------------------------------------------------------------------------------
    def _view(self, ghost, values=None):
        base = self if self.base is None else self.base
        off = self.offset + (ghost.__array_interface__["data"][0] - self._ghost.__array_interface__["data"][0])
        return ShapeArray(self.xp, ghost, self._buffer, base, off, values)

    def _values_of(self, fn):
        return None if self.values is None else fn(self.values)

    def reshape(self, *shape, order="C"):
        shape = shape[0] if len(shape) == 1 and not isinstance(shape[0], numbers.Integral) else shape
        try:
            v = np.reshape(self._ghost, shape, copy=False)  # NumPy refuses where it would have to copy
        except ValueError:
            return self.copy().reshape(shape)
        return self._view(v, self._values_of(lambda a: a.reshape(shape)))

    def view(self, dtype=None):
        if dtype is None:
            return self._view(self._ghost.view())
        return self._view(self._ghost.view(dtype), self._values_of(lambda a: a.view(dtype)))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and not isinstance(axes[0], numbers.Integral) else (axes or None)
        return self._view(self._ghost.transpose(axes), self._values_of(lambda a: a.transpose(axes)))

    def swapaxes(self, a, b):
        return self._view(self._ghost.swapaxes(a, b), self._values_of(lambda v: v.swapaxes(a, b)))

    def ravel(self):
        return self.reshape(-1)

    def squeeze(self, axis=None):
        return self._view(self._ghost.squeeze(axis), self._values_of(lambda a: a.squeeze(axis)))

    def __getitem__(self, key):
        if isinstance(key, ShapeArray) or (isinstance(key, tuple) and any(isinstance(k, ShapeArray) for k in key)):
            return self.xp._take_by(self, key)
        if _is_basic_index(key):  # (values through a view too: an Ellipsis keeps a 0-d result an array)
            items = key if isinstance(key, tuple) else (key,)
            vkey = items if Ellipsis in items else items + (Ellipsis,)
            return self._view(self._ghost[key], self._values_of(lambda a: a[vkey]))
        # advanced indexing with host indices: a new array of the result's shape
        ghost = np.empty(self.shape, np.bool_)[key] if self.values is None else None
        values = None if self.values is None else self.values[key]
        shape = ghost.shape if values is None else values.shape
        return self.xp._new(shape, self.dtype, values)

    def __setitem__(self, key, value):
        # in place: nothing allocated (NumPy casts through small buffers); known values follow
        if self.values is None:
            return
        v = value.values if isinstance(value, ShapeArray) else value
        if v is None or isinstance(key, ShapeArray) or (isinstance(key, tuple) and any(
                isinstance(k, ShapeArray) and k.values is None for k in key)):
            self._forget_values()
            return
        if isinstance(key, ShapeArray) or isinstance(key, tuple):
            key = tuple(k.values if isinstance(k, ShapeArray) else k for k in (key if isinstance(key, tuple) else (key,)))
        self.values[key] = v

    def _forget_values(self):
        """An unknown value was written: this array's values (and its owner's) are unknown now."""
        self.values = None
        if self.base is not None:
            self.base.values = None

    def __iter__(self):
        for i in range(self.shape[0]):
            yield self[i]

    # ---- copies -----------------------------------------------------------------------------
    def astype(self, dtype, copy=True, **_):
        dtype = np.dtype(dtype)
        if not copy and dtype == self.dtype:
            return self
        return self.xp._new(self.shape, dtype, self._values_of(lambda a: a.astype(dtype)))

    def copy(self, order="C"):
        return self.xp._new(self.shape, self.dtype, self._values_of(np.copy))

    def flatten(self):
        return self.copy().reshape(-1)

    def fill(self, value):
        pass

    def get(self):
        return self.xp.to_numpy(self)

    # ---- reductions and the like -------------------------------------------------------------
    def sum(self, axis=None, dtype=None, keepdims=False, out=None):
        return self.xp._reduce(self, "sum", axis, dtype, keepdims, out)

    def mean(self, axis=None, dtype=None, keepdims=False, out=None):
        return self.xp._reduce(self, "mean", axis, dtype, keepdims, out)

    def max(self, axis=None, keepdims=False, out=None):
        return self.xp._reduce(self, "max", axis, None, keepdims, out)

    def min(self, axis=None, keepdims=False, out=None):
        return self.xp._reduce(self, "min", axis, None, keepdims, out)

    def prod(self, axis=None, dtype=None, keepdims=False, out=None):
        return self.xp._reduce(self, "prod", axis, dtype, keepdims, out)

    def any(self, axis=None, keepdims=False, out=None):
        return self.xp._reduce(self, "any", axis, np.bool_, keepdims, out)

    def all(self, axis=None, keepdims=False, out=None):
        return self.xp._reduce(self, "all", axis, np.bool_, keepdims, out)

    def argmax(self, axis=None, keepdims=False, out=None):
        return self.xp._reduce(self, "argmax", axis, np.int64, keepdims, out)

    def cumsum(self, axis=None, dtype=None):
        return self.xp.cumsum(self, axis=axis, dtype=dtype)

    def take(self, indices, axis=None):
        return self.xp.take(self, indices, axis=axis)

    def repeat(self, repeats, axis=None):
        return self.xp.repeat(self, repeats, axis=axis)

    def nonzero(self):
        return self.xp.nonzero(self)

    def dot(self, other):
        return self.xp.matmul(self, other)

    def tolist(self):
        return self.xp.to_numpy(self).tolist()

    def item(self):
        return self.xp._scalar(self, float if self.dtype.kind == "f" else int)

    # ---- Python numbers and truth values: the values when known, else the hints ------------
    def __bool__(self):
        return bool(self.xp._scalar(self, bool))

    def __float__(self):
        return float(self.xp._scalar(self, float))

    def __int__(self):
        return int(self.xp._scalar(self, int))

    __index__ = __int__

    # ---- NumPy's own functions on these arrays are routed to the module ----------------------
    def __array__(self, dtype=None, copy=None):
        if self.values is not None:
            return self.values if dtype is None else self.values.astype(dtype)
        raise ShapeOnlyError(f"a shape-only array {self.shape} {self.dtype} was converted to NumPy data: the "
                             "planner cannot follow a code path that reads array values")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__":
            return NotImplemented
        return self.xp._ufunc(ufunc, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        fn = getattr(self.xp, func.__name__, None)
        if fn is None:
            raise ShapeOnlyError(f"numpy.{func.__name__} has no shape-only version (cutp.runtime.shape_only)")
        return fn(*args, **kwargs)


def _operator(ufunc, reflected=False, commutative=False):
    if reflected:
        def op(self, other):
            return self.xp._ufunc(ufunc, (other, self), {})
    else:
        def op(self, other):
            # NumPy's elision looks at reference counts; so does this, from the same depth of calls
            return self.xp._binary(ufunc, self, other, sys.getrefcount(self), sys.getrefcount(other), commutative)
    return op


def _inplace(ufunc):
    def op(self, other):
        self.xp._ufunc(ufunc, (self, other), {"out": self})
        return self
    return op


for _name, _uf, _comm in (("add", np.add, True), ("sub", np.subtract, False), ("mul", np.multiply, True),
                          ("truediv", np.true_divide, False), ("floordiv", np.floor_divide, False),
                          ("mod", np.remainder, False), ("pow", np.power, False), ("and", np.bitwise_and, True),
                          ("or", np.bitwise_or, True), ("xor", np.bitwise_xor, True), ("lshift", np.left_shift, False),
                          ("rshift", np.right_shift, False)):
    setattr(ShapeArray, f"__{_name}__", _operator(_uf, commutative=_comm))
    setattr(ShapeArray, f"__r{_name}__", _operator(_uf, reflected=True))
    setattr(ShapeArray, f"__i{_name}__", _inplace(_uf))
for _name, _uf in (("lt", np.less), ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal),
                   ("eq", np.equal), ("ne", np.not_equal)):
    setattr(ShapeArray, f"__{_name}__", _operator(_uf))
ShapeArray.__matmul__ = lambda self, other: self.xp.matmul(self, other)
ShapeArray.__rmatmul__ = lambda self, other: self.xp.matmul(other, self)
ShapeArray.__neg__ = lambda self: self.xp._ufunc(np.negative, (self,), {})
ShapeArray.__abs__ = lambda self: self.xp._ufunc(np.absolute, (self,), {})
ShapeArray.__invert__ = lambda self: self.xp._ufunc(np.invert, (self,), {})
ShapeArray.__pos__ = lambda self: self
ShapeArray.__hash__ = object.__hash__


class _Ufunc:
    """numpy's ufunc `fn` on shape-only arrays (`xp.add(a, b, out=c)`, `xp.add.at(...)`)."""

    def __init__(self, xp, fn):
        self.xp, self.fn = xp, fn

    def __call__(self, *inputs, **kwargs):
        return self.xp._ufunc(self.fn, inputs, kwargs)

    def at(self, a, indices, b=None):
        return None  # in place


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr




def _dtype_of(x):
    if isinstance(x, (ShapeArray, np.ndarray, np.generic)):
        return x.dtype
    return None


def _result_dtype(ufunc, inputs, dtype=None):
    if dtype is not None:
        return np.dtype(dtype)
    probes = []
    for x in inputs:
        dt = _dtype_of(x)
        if dt is not None:
            probes.append(np.zeros((1,) * max(getattr(x, "ndim", 0), 0) if getattr(x, "ndim", 0) else (), dt)
                          if not isinstance(x, np.generic) else x)
        elif x is None:
            continue
        else:
            probes.append(x)  # a Python scalar: weak (NEP 50), as NumPy treats it
    try:
        with np.errstate(all="ignore"):
            out = ufunc(*probes)
    except TypeError as e:
        raise ShapeOnlyError(f"{ufunc.__name__} of {[getattr(p, 'dtype', type(p)) for p in probes]}: {e}") from None
    out = out[0] if isinstance(out, tuple) else out
    return np.asarray(out).dtype


def _values(x):
    return x.values if isinstance(x, ShapeArray) else x


def _shape_of(x):
    return tuple(x.shape) if hasattr(x, "shape") else ()


class ShapeOnly:
    """The array module of shape-only arrays (the stand-in of `numpy` or `cupy`), with its heap.

    device: "cpu" (NumPy's behaviour) or "cuda" (CuPy's); threads: the CPU ops' threads that may
    run blocks at once (`parallel_map`)."""

    ndarray = ShapeArray
    shape_only = True
    newaxis = None
    inf, nan, pi, e = np.inf, np.nan, np.pi, np.e

    def __init__(self, device: str = "cpu", threads: int = 1):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r}: cpu or cuda")
        self.device = device
        self.host = device == "cpu"  # the CPU code paths (blocked loops, BLAS tricks) run on it
        self.threads = max(1, int(threads))
        self.heap = Heap(POOL_ROUND if device == "cuda" else 1)
        self.__name__ = f"cutp.runtime.shape_only[{device}]"
        self.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=self.as_strided))

    def as_strided(self, a, shape=None, strides=None, **_):
        """A view of a's memory with this layout (numpy.lib.stride_tricks.as_strided)."""
        return a._view(as_strided(a._ghost, shape=shape, strides=strides, writeable=False))

    def __repr__(self):
        return f"<ShapeOnly {self.device}>"

    def __getattr__(self, name):  # dtypes as numpy has them (xp.float32, ...); its ufuncs on these arrays
        v = getattr(np, name, None)
        if isinstance(v, type) and issubclass(v, np.generic):
            return v
        if isinstance(v, np.ufunc):
            return _Ufunc(self, v)
        if name in ("dtype", "finfo", "iinfo", "result_type", "can_cast", "promote_types"):
            return v
        raise AttributeError(f"cutp.runtime.shape_only has no {name!r}: the planner's step called numpy.{name} "
                             "(add it to ShapeOnly)")

    # ---- making arrays -----------------------------------------------------------------------
    def _new(self, shape, dtype, values=None) -> ShapeArray:
        shape, dtype = _norm_shape(shape), np.dtype(dtype)
        ghost = _ghost(shape, _c_strides(shape, dtype.itemsize), dtype)
        return ShapeArray(self, ghost, _Buffer(self.heap, ghost.nbytes), values=values)

    def _small(self, shape, dtype, make):
        """Host-sized arrays get values (what the code writes into them is then known)."""
        shape = _norm_shape(shape)
        return make(shape, dtype) if math.prod(shape) * np.dtype(dtype).itemsize <= KEEP_VALUES_BYTES else None

    def empty(self, shape, dtype=np.float64, order="C"):
        # (zeros, not NumPy's garbage: the step must take its usual path, finite values, no skip)
        return self._new(shape, dtype, self._small(shape, dtype, np.zeros))

    def zeros(self, shape, dtype=np.float64, order="C"):
        shape = _norm_shape(shape)
        small = math.prod(shape) * np.dtype(dtype).itemsize <= KEEP_VALUES_BYTES
        return self._new(shape, dtype, np.zeros(shape, dtype) if small else None)

    def ones(self, shape, dtype=np.float64, order="C"):
        return self._new(shape, dtype, self._small(shape, dtype, np.ones))

    def full(self, shape, fill_value, dtype=None):
        return self._new(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)

    def empty_like(self, a, dtype=None, shape=None):
        return self._new(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)

    zeros_like = ones_like = empty_like

    def full_like(self, a, fill_value, dtype=None):
        return self.empty_like(a, dtype)

    def asarray(self, a, dtype=None, order=None):
        if isinstance(a, ShapeArray):
            return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
        a = np.asarray(a, dtype=dtype)
        return self._new(a.shape, a.dtype, a.copy() if a.nbytes <= KEEP_VALUES_BYTES else None)

    def array(self, a, dtype=None, copy=True, order=None):
        # np.array copies unless told not to; a copy is an allocation the plan must count
        if not copy or not isinstance(a, ShapeArray):
            return self.asarray(a, dtype)
        return a.astype(a.dtype if dtype is None else dtype, copy=True)

    def ascontiguousarray(self, a, dtype=None):
        a = self.asarray(a, dtype)
        return a if a.flags.c_contiguous else a.copy()

    def arange(self, *args, dtype=None):
        v = np.arange(*args, dtype=dtype)
        return self._new(v.shape, v.dtype, v if v.nbytes <= KEEP_VALUES_BYTES else None)

    def to_numpy(self, a) -> np.ndarray:
        if a.values is None:
            raise ShapeOnlyError(f"the values of a shape-only array {a.shape} {a.dtype} were asked for: the planner "
                                 "cannot follow a code path that reads array values")
        return np.asarray(a.values)

    # ---- elementwise -------------------------------------------------------------------------
    def _ufunc(self, ufunc, inputs, kwargs):
        if ufunc is np.matmul:  # (a gufunc: numpy's `a @ b` with one shape-only operand lands here)
            return self.matmul(*inputs, out=kwargs.get("out"))
        out = kwargs.get("out")
        if isinstance(out, tuple):
            out = out[0]
        shape = np.broadcast_shapes(*(_shape_of(x) for x in inputs if x is not None))
        dtype = _result_dtype(ufunc, inputs, kwargs.get("dtype"))
        values = None
        known = all((not isinstance(x, ShapeArray)) or x.values is not None for x in inputs)
        if out is not None:
            if isinstance(out, ShapeArray) and out.values is not None:
                where = kwargs.get("where", True)
                if known and (not isinstance(where, ShapeArray) or where.values is not None):
                    with np.errstate(all="ignore"):
                        ufunc(*(x.values if isinstance(x, ShapeArray) else x for x in inputs), out=out.values,
                              where=where.values if isinstance(where, ShapeArray) else where)
                else:
                    out._forget_values()
            return out
        if known:
            with np.errstate(all="ignore"):
                values = ufunc(*(x.values if isinstance(x, ShapeArray) else x for x in inputs))
        if ufunc.nout > 1:
            return tuple(self._new(shape, dtype) for _ in range(ufunc.nout))
        return self._new(shape, dtype, values)

    def _binary(self, ufunc, a, b, refs_a, refs_b, commutative):
        if self.host:  # NumPy's temporary elision
            for tmp, other, refs in ((a, b, refs_a), (b, a, refs_b) if commutative else (None, None, 0)):
                if (isinstance(tmp, ShapeArray) and refs <= _TEMP_REFS and tmp.base is None
                        and tmp.nbytes >= ELIDE_BYTES and _shape_of(other) in ((), tmp.shape)
                        and np.can_cast(_dtype_of(other) or np.min_scalar_type(other), tmp.dtype, "safe")
                        and _result_dtype(ufunc, (a, b)) == tmp.dtype):
                    return tmp  # the result is written into the temporary
        return self._ufunc(ufunc, (a, b), {})

    def where(self, cond, a=None, b=None):
        if a is None:
            return self.nonzero(cond)
        shape = np.broadcast_shapes(_shape_of(cond), _shape_of(a), _shape_of(b))
        known = [x.values if isinstance(x, ShapeArray) else x for x in (cond, a, b)]
        values = np.where(*known) if all(v is not None for v in known) else None
        dtype = values.dtype if values is not None else _result_dtype(np.add, (a, b))
        return self._new(shape, dtype, values)

    def clip(self, a, lo, hi, out=None):
        return out if out is not None else self._new(a.shape, a.dtype)

    def copyto(self, dst, src, **_):
        return None

    def einsum(self, subscripts, *operands, out=None, **_):
        ins, _, res = subscripts.replace(" ", "").partition("->")
        dims = {}
        for spec, x in zip(ins.split(","), operands):
            for letter, d in zip(spec, x.shape):
                dims[letter] = d
        dtype = np.result_type(*(x.dtype for x in operands))
        return out if out is not None else self._new(tuple(dims[c] for c in res), dtype)

    def matmul(self, a, b, out=None):
        a_s, b_s = _shape_of(a), _shape_of(b)
        shape = self._matmul_shape(a_s, b_s)
        dtype = np.result_type(_dtype_of(a), _dtype_of(b))
        return out if out is not None else self._new(shape, dtype)

    @staticmethod
    def _matmul_shape(a, b):
        if len(a) == 1 and len(b) == 1:
            return ()
        if len(a) == 1:
            return tuple(b[:-2]) + (b[-1],)
        if len(b) == 1:
            return tuple(a[:-1])
        batch = np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
        return batch + (a[-2], b[-1])

    dot = matmul

    # ---- reductions --------------------------------------------------------------------------
    def _reduce(self, a, kind, axis, dtype, keepdims, out):
        if a.values is not None and out is None:
            fn = getattr(np, {"max": "amax", "min": "amin"}.get(kind, kind))
            kw = dict(axis=axis, keepdims=keepdims) if kind != "argmax" else dict(axis=axis)
            if dtype is not None and kind in ("sum", "mean", "prod"):
                kw["dtype"] = dtype
            v = np.asarray(fn(a.values, **kw))
            return self._new(v.shape, v.dtype, v)
        shape = np.empty(a.shape, np.bool_).sum(axis=axis, keepdims=keepdims).shape if a.size < 1 << 16 else \
            self._reduced_shape(a.shape, axis, keepdims)
        if dtype is None:
            dtype = a.dtype
            if kind in ("sum", "prod") and a.dtype.kind in "biu":
                dtype = np.int64 if a.dtype.kind in "bi" else np.uint64
            elif kind == "mean" and a.dtype.kind in "biu":
                dtype = np.float64
        result = self._new(shape, dtype)
        if kind == "any":
            result.values = np.zeros(shape, bool)  # the hint: no NaN, no overflow, nothing to skip
        elif kind == "all":
            result.values = np.ones(shape, bool)
        return out if out is not None else result

    @staticmethod
    def _reduced_shape(shape, axis, keepdims):
        n = len(shape)
        axes = range(n) if axis is None else [(ax % n) for ax in (axis if isinstance(axis, tuple) else (axis,))]
        return tuple(1 if i in axes else d for i, d in enumerate(shape) if keepdims or i not in axes)

    def sum(self, a, axis=None, dtype=None, keepdims=False, out=None):
        return self.asarray(a).sum(axis=axis, dtype=dtype, keepdims=keepdims, out=out)

    def max(self, a, axis=None, keepdims=False, out=None):
        return self.asarray(a).max(axis=axis, keepdims=keepdims, out=out)

    amax = max

    def min(self, a, axis=None, keepdims=False, out=None):
        return self.asarray(a).min(axis=axis, keepdims=keepdims, out=out)

    def mean(self, a, axis=None, dtype=None, keepdims=False):
        return self.asarray(a).mean(axis=axis, dtype=dtype, keepdims=keepdims)

    def any(self, a, axis=None, keepdims=False):
        return self.asarray(a).any(axis=axis, keepdims=keepdims)

    def all(self, a, axis=None, keepdims=False):
        return self.asarray(a).all(axis=axis, keepdims=keepdims)

    def argmax(self, a, axis=None, keepdims=False):
        return self.asarray(a).argmax(axis=axis, keepdims=keepdims)

    def cumsum(self, a, axis=None, dtype=None):
        a = self.asarray(a)
        if a.values is not None:
            v = np.cumsum(a.values, axis=axis, dtype=dtype)
            return self._new(v.shape, v.dtype, v)
        return self._new(a.shape if axis is not None else (a.size,), dtype or a.dtype)

    def count_nonzero(self, a, axis=None):
        return (self.asarray(a) != 0).astype(np.int64).sum(axis=axis)  # (known values: counted, not summed)

    # ---- shapes --------------------------------------------------------------------------------
    def reshape(self, a, shape):
        return a.reshape(shape)

    def transpose(self, a, axes=None):
        return a.transpose(axes)

    def swapaxes(self, a, i, j):
        return a.swapaxes(i, j)

    def moveaxis(self, a, source, destination):
        return a._view(np.moveaxis(a._ghost, source, destination))

    def expand_dims(self, a, axis):
        return a._view(np.expand_dims(a._ghost, axis))

    def broadcast_to(self, a, shape):
        a = self.asarray(a)
        return a._view(np.broadcast_to(a._ghost, shape))

    def squeeze(self, a, axis=None):
        return a.squeeze(axis)

    def concatenate(self, arrays, axis=0, out=None):
        arrays = [self.asarray(a) for a in arrays]
        if all(a.values is not None for a in arrays):
            v = np.concatenate([a.values for a in arrays], axis=axis)
            return self._new(v.shape, v.dtype, v)
        shape = np.concatenate([np.empty(a.shape, np.bool_) for a in arrays], axis=axis).shape
        return out if out is not None else self._new(shape, np.result_type(*(a.dtype for a in arrays)))

    def stack(self, arrays, axis=0):
        arrays = [self.asarray(a) for a in arrays]
        return self.concatenate([self.expand_dims(a, axis) for a in arrays], axis=axis)

    def take(self, a, indices, axis=None):
        idx = self.asarray(indices)
        if axis is None:
            shape = idx.shape
        else:
            ax = axis % a.ndim
            shape = a.shape[:ax] + idx.shape + a.shape[ax + 1:]
        return self._new(shape, a.dtype)

    def take_along_axis(self, a, indices, axis):
        return self._new(np.broadcast_shapes(a.shape[:axis % a.ndim] + (1,) + a.shape[axis % a.ndim + 1:],
                                             _shape_of(indices)), a.dtype)

    def _take_by(self, a, key):
        """a[key] with index arrays among the key (gathers: the embedding's rows)."""
        items = key if isinstance(key, tuple) else (key,)
        ghost_key = tuple(np.zeros(k.shape, np.intp) if isinstance(k, ShapeArray) and k.dtype.kind in "iu"
                          else (np.zeros(k.shape, np.bool_) if isinstance(k, ShapeArray) else k) for k in items)
        if any(isinstance(k, ShapeArray) and k.dtype == np.bool_ and k.values is None for k in items):
            raise ShapeOnlyError(f"boolean indexing of a shape-only array {a.shape} by a mask without values")
        if any(isinstance(k, ShapeArray) and k.dtype == np.bool_ for k in items):
            ghost_key = tuple(k.values if isinstance(k, ShapeArray) and k.dtype == np.bool_ else g
                              for k, g in zip(items, ghost_key))
        shape = np.empty(a.shape, np.bool_)[ghost_key].shape
        values = None
        if a.values is not None and all(not isinstance(k, ShapeArray) or k.values is not None for k in items):
            values = a.values[tuple(k.values if isinstance(k, ShapeArray) else k for k in items)]
        return self._new(shape, a.dtype, values)

    def compress(self, condition, a, axis=None):
        cond = condition.values if isinstance(condition, ShapeArray) else np.asarray(condition)
        if cond is None:
            raise ShapeOnlyError("compress with a shape-only condition without values")
        n = int(np.count_nonzero(cond))
        if axis is None:
            return self._new((n,), a.dtype)
        shape = list(a.shape)
        shape[axis % a.ndim] = n
        return self._new(shape, a.dtype)

    def repeat(self, a, repeats, axis=None):
        a = self.asarray(a)
        if not isinstance(repeats, numbers.Integral):
            counts = repeats.values if isinstance(repeats, ShapeArray) else np.asarray(repeats)
            if counts is None:
                self._data_dependent("repeat by counts", a)
            if a.values is not None:
                return self.asarray(np.repeat(a.values, counts, axis=axis))
            shape = list(a.shape if axis is not None else (a.size,))
            shape[0 if axis is None else axis % a.ndim] = int(np.sum(counts))
            return self._new(shape, a.dtype)
        if axis is None:
            return self._new((a.size * repeats,), a.dtype)
        shape = list(a.shape)
        shape[axis % a.ndim] *= repeats
        return self._new(shape, a.dtype)

    def diff(self, a, n=1, axis=-1, prepend=None, append=None):
        a = self.asarray(a)
        parts = [x for x in (prepend, a, append) if x is not None]
        if all(not isinstance(x, ShapeArray) or x.values is not None for x in parts):
            v = np.diff(a.values, n=n, axis=axis, **({"prepend": _values(prepend)} if prepend is not None else {}),
                        **({"append": _values(append)} if append is not None else {}))
            return self.asarray(v)
        shape = list(a.shape)
        shape[axis] += (0 if prepend is None else 1) + (0 if append is None else 1) - n
        return self._new(shape, a.dtype)

    def argsort(self, a, axis=-1, kind=None):
        a = self.asarray(a)
        values = None if a.values is None else np.argsort(a.values, axis=axis, kind=kind)
        return self._new(a.shape, np.int64, values)

    def searchsorted(self, a, v, side="left"):
        return self._new(_shape_of(v), np.int64)

    def _data_dependent(self, name, a):
        raise ShapeOnlyError(f"{name} of a shape-only array {getattr(a, 'shape', '')} (its result's size depends on "
                             "the data); the planner cannot follow this code path")

    def nonzero(self, a):
        a = self.asarray(a)
        if a.values is None:
            self._data_dependent("nonzero", a)
        return tuple(self.asarray(i) for i in np.nonzero(a.values))

    def flatnonzero(self, a):
        return self.nonzero(self.asarray(a).reshape(-1))[0]

    def bincount(self, x, weights=None, minlength=0):
        x = self.asarray(x)
        if x.values is None:
            self._data_dependent("bincount", x)
        return self.asarray(np.bincount(x.values, minlength=minlength))

    def unique(self, a, **kw):
        a = self.asarray(a)
        if a.values is None:
            self._data_dependent("unique", a)
        return self.asarray(np.unique(a.values, **kw))

    # ---- Python numbers ------------------------------------------------------------------------
    def _scalar(self, a, kind):
        if a.values is not None:
            return kind(np.asarray(a.values).reshape(-1)[0]) if a.values.size == 1 else kind(a.values.all())
        if a.size != 1 and kind is not bool:
            raise TypeError(f"only a one-element array converts to a Python {kind.__name__} (shape {a.shape})")
        return {bool: True, float: 0.0, int: 0}[kind]

    def isfinite(self, a, out=None):
        return self._ufunc(np.isfinite, (a,), {"out": out})

    def allclose(self, a, b, **_):
        return True

    # ---- the blocked CPU loops (cutp.runtime.threads.parallel_map) -----------------------------
    def parallel_map(self, fn, items):
        """Each item after the other; the blocks that would run at once on `threads` threads are
        booked at once: the heap's peak counts the sum of their transients (an upper bound)."""
        heap, results = self.heap, []
        for g in range(0, len(items), self.threads):
            group = items[g:g + self.threads]
            start, transients = heap.cur, []
            for item in group:
                before, saved = heap.cur, (heap.peak, heap.where)
                heap.peak = heap.cur
                results.append(fn(item))
                transients.append(heap.peak - before)
                heap.peak, heap.where = max(saved[0], heap.peak), saved[1] if saved[0] >= heap.peak else heap.where
            if len(group) > 1:
                worst = start + sum(sorted(transients)[-self.threads:])
                if worst > heap.peak:
                    heap.peak, heap.where = worst, heap.label
        return results


def _calibrate_refcounts() -> int:
    """The reference count an operand has inside ShapeArray's operators when it is a temporary
    (NumPy elides when nothing but the expression refers to it): measured, since it depends on
    the interpreter."""
    xp, seen = ShapeOnly("cpu"), []
    xp._binary = lambda ufunc, a, b, refs_a, refs_b, commutative: seen.append(min(refs_a, refs_b))
    xp.empty(1) + xp.empty(1)
    return seen[0]


_TEMP_REFS = _calibrate_refcounts()
