"""The shape-only arrays' NumPy API (cutp.runtime.shape_only) call by call against NumPy: each
method and function the planner's arrays offer gives NumPy's result shape and dtype, and where
the values are known (small host arrays keep theirs) NumPy's values; with values unknown (large
arrays) the shape and dtype still, and what depends on the data is refused by name."""
import numpy as np
import pytest

from cutp.runtime.shape_only import KEEP_VALUES_BYTES, ShapeArray, ShapeOnly, ShapeOnlyError


def _inputs(xp, cols):
    """a [6, cols] float32, b [2, 3, cols], s sorted 1-D, i int64 indices, m a bool mask over
    the 6 rows, c counts for 4 columns."""
    a = np.arange(6 * cols, dtype=np.float32).reshape(6, cols) % 7 - 3
    return dict(a=xp.asarray(a), s=xp.asarray(np.sort(a[0])), i=xp.asarray(np.array([2, 0, 1])),
                m=xp.asarray(np.arange(6) % 2 == 0), c=xp.asarray(np.array([1, 0, 2, 1])),
                b=xp.asarray(a.reshape(2, 3, cols)))


CASES = {  # name: (the call, whether it needs the values of `a` / of the mask)
    "min axis 0": lambda xp, a, **_: a.min(axis=0),
    "prod": lambda xp, a, **_: a.prod(),
    "all": lambda xp, a, **_: (a > -9).all(),
    "argmax axis 1": lambda xp, a, **_: a.argmax(axis=1),
    "cumsum method": lambda xp, a, **_: a.cumsum(axis=1),
    "cumsum flat": lambda xp, a, **_: xp.cumsum(a),
    "repeat scalar": lambda xp, a, **_: a.repeat(2, axis=0),
    "repeat flat": lambda xp, a, **_: xp.repeat(a, 3),
    "repeat counts": lambda xp, a, c, **_: xp.repeat(a[:, :4], c, axis=1),
    "dot": lambda xp, a, **_: a.dot(a.T),
    "ravel": lambda xp, a, **_: a.ravel(),
    "squeeze": lambda xp, a, **_: a[None].squeeze(),
    "squeeze fn": lambda xp, a, **_: xp.squeeze(a[:, :1], axis=1),
    "flatten": lambda xp, a, **_: a.flatten(),
    "view": lambda xp, a, **_: a.view(),
    "take method": lambda xp, a, i, **_: a.take(i, axis=1),
    "take flat": lambda xp, a, i, **_: xp.take(a, i),
    "gather rows": lambda xp, a, i, **_: a[i],
    "gather 2-d": lambda xp, a, i, **_: a[i, 1:3],
    "take_along_axis": lambda xp, a, **_: xp.take_along_axis(a, xp.argsort(a, axis=1), axis=1),
    "where 3": lambda xp, a, **_: xp.where(a > 0, a, 0.0),
    "clip": lambda xp, a, **_: xp.clip(a, -1.0, 1.0),
    "sum fn": lambda xp, a, **_: xp.sum(a, axis=1, keepdims=True),
    "max fn": lambda xp, a, **_: xp.max(a, axis=0),
    "min fn": lambda xp, a, **_: xp.min(a),
    "any fn": lambda xp, a, **_: xp.any(a > 100),
    "all fn": lambda xp, a, **_: xp.all(a > -100, axis=1),
    "argmax fn": lambda xp, a, **_: xp.argmax(a, axis=0),
    "count_nonzero": lambda xp, a, **_: xp.count_nonzero(a, axis=1),
    "reshape fn": lambda xp, a, **_: xp.reshape(a, (2, -1)),
    "transpose fn": lambda xp, b, **_: xp.transpose(b, (2, 0, 1)),
    "swapaxes": lambda xp, b, **_: xp.swapaxes(b, 0, 2),
    "swapaxes method": lambda xp, b, **_: b.swapaxes(1, 2),
    "compress axis": lambda xp, a, m, **_: xp.compress(m, a, axis=0),
    "compress flat": lambda xp, a, **_: xp.compress(np.array([True, False, True]), a),
    "diff": lambda xp, a, **_: xp.diff(a, axis=1),
    "diff prepend": lambda xp, s, **_: xp.diff(s, prepend=xp.asarray(np.zeros(1, np.float32))),
    "searchsorted": lambda xp, s, **_: xp.searchsorted(s, xp.asarray(np.array([0.0, 2.5], np.float32))),
    "full_like": lambda xp, a, **_: xp.full_like(a, 2.0, dtype=np.float64),
    "isfinite": lambda xp, a, **_: xp.isfinite(a),
    "np.add": lambda xp, a, **_: np.add(a, a),  # (a NumPy ufunc on a shape-only array: routed)
    "np.sum": lambda xp, a, **_: np.sum(a, axis=0),  # (a NumPy function: routed)
    "gather host rows": lambda xp, a, **_: a[np.array([2, 0, 2])],
    "mask rows": lambda xp, a, m, **_: a[m],
    "np.matmul host first": lambda xp, a, **_: np.matmul(np.ones((2, 6), np.float32), a),
    "divmod": lambda xp, a, **_: xp.divmod(a, 2.0),
    "where 1": lambda xp, m, **_: xp.where(m),
    "sum dtype": lambda xp, a, **_: xp.sum(a, axis=0, dtype=np.float64),
    "mean of ints": lambda xp, a, **_: xp.mean(a.astype(np.int32), axis=1),
    "array of a list": lambda xp, **_: xp.array([1.5, 2.5]),
    "positional out None": lambda xp, a, **_: xp.multiply(a, 2.0, None),
    "ufunc dtype": lambda xp, a, **_: xp.add(a, a, dtype=np.float64),  # (the result in the dtype asked)
}
# Calls whose result the shape-only arrays do not compute even from known values (the planner
# needs only their shapes); every other call keeps what it was given known.
SHAPES_ONLY = {"np.matmul host first", "divmod", "repeat scalar", "repeat flat", "dot", "view", "take method", "take flat", "take_along_axis", "clip",
               "compress axis", "compress flat", "searchsorted", "full_like"}
NEEDS_VALUES = {  # what depends on the data: refused by name without its values
    "nonzero": lambda xp, a, **_: a.nonzero(),
    "bincount": lambda xp, i, **_: xp.bincount(i),
    "unique": lambda xp, a, **_: xp.unique(a),
}


def _check(got, want, known):
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            _check(g, w, known)
        return
    want = np.asarray(want)
    assert isinstance(got, ShapeArray) and got.shape == want.shape and got.dtype == want.dtype, (got, want.dtype)
    assert got.values is not None or not known, "values known on the way in, dropped by the call"
    if got.values is not None:  # (what it knows must be NumPy's; values unknown: shapes only)
        np.testing.assert_array_equal(got.values, want)


@pytest.mark.parametrize("known", [True, False], ids=["values known", "shapes only"])
def test_each_call_gives_numpys_shape_dtype_and_known_values(known):
    cols = 4 if known else KEEP_VALUES_BYTES // 16  # (6 x cols x 4 bytes: above the size that keeps values)
    xp = ShapeOnly("cpu")
    ours, ref = _inputs(xp, cols), _inputs(np, cols)
    if not known:  # (the indices, mask and counts stay small: their values are known)
        assert ours["a"].values is None and ours["i"].values is not None
    for name, call in CASES.items():
        _check(call(xp, **ours), call(np, **ref), known and name not in SHAPES_ONLY)
    for name, call in NEEDS_VALUES.items():
        if known or name == "bincount":
            _check(call(xp, **ours), call(np, **ref), True)
        else:
            with pytest.raises(ShapeOnlyError, match=f"{name} of a shape-only array"):
                call(xp, **ours)


def test_the_arrays_python_side():
    xp = ShapeOnly("cuda")
    a = xp.asarray(np.arange(6, dtype=np.float32).reshape(3, 2))
    assert len(a) == 3 and repr(a) == "ShapeArray((3, 2), float32, cuda)" and repr(xp) == "<ShapeOnly cuda>"
    assert [r.values.tolist() for r in a] == [[0, 1], [2, 3], [4, 5]] and a.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert a.get().tolist() == a.tolist() and np.asarray(a).dtype == np.float32 and a[2, 1].item() == 5.0
    assert np.asarray(a, dtype=np.float64).dtype == np.float64
    a.fill(7.0)  # (in place: nothing booked, the values stay what they were known to be)
    dst = xp.zeros((3, 2), np.float32)
    xp.copyto(dst, a)
    assert xp.allclose(dst, a) is True and xp.full((2,), 3).dtype == np.asarray(3).dtype
    big = xp.empty((KEEP_VALUES_BYTES,), np.float32)
    with pytest.raises(ShapeOnlyError, match="were asked for"):
        big.get()
    with pytest.raises(TypeError, match="only a one-element array converts to a Python float"):
        float(big)
    assert int(big[:1]) == 0 and bool(big) is True  # (the hints of unknown values: the usual path)
    with pytest.raises(ShapeOnlyError, match="numpy.histogram has no shape-only version"):
        np.histogram(big)
    with pytest.raises(AttributeError, match="the planner's step called numpy.histogram"):
        xp.histogram
    assert a.__array_ufunc__(np.add, "reduce", a) is NotImplemented  # (only calls are routed)
    with pytest.raises(ShapeOnlyError, match="repeat by counts of a shape-only array"):
        xp.repeat(big, xp.empty((KEEP_VALUES_BYTES,), np.int64))
    assert xp.diff(big, append=big[:1]).shape == big.shape  # (unknown values: the shape alone)


def test_what_numpy_refuses_is_refused_by_name():
    xp = ShapeOnly("cpu")
    with pytest.raises(ValueError, match="device 'tpu': cpu or cuda"):
        ShapeOnly("tpu")
    a = xp.zeros((3, 2), np.float32)
    with pytest.raises(ShapeOnlyError, match=r"bitwise_and of \[dtype\('float32'\), dtype\('float32'\)\]"):
        xp.bitwise_and(a, a)
    big = xp.empty((KEEP_VALUES_BYTES,), np.float32)
    with pytest.raises(ShapeOnlyError, match="compress with a shape-only condition without values"):
        xp.compress(big > 0, big)
    assert xp.finfo(np.float32).eps == np.finfo(np.float32).eps and xp.iinfo is np.iinfo
