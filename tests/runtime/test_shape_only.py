"""Shape-only arrays (cutp.runtime.shape_only): what they book is what NumPy (or CuPy's pool)
would allocate for the same calls, and what they cannot know they refuse by name."""
import numpy as np
import pytest

from cutp.runtime.backend import get_array_module, on_host
from cutp.runtime.shape_only import ELIDE_BYTES, ShapeOnly, ShapeOnlyError

F32 = np.float32


def test_views_book_nothing_copies_book_their_bytes_and_the_last_view_frees():
    xp = ShapeOnly("cpu")
    a = xp.zeros((512, 256), F32)
    assert xp.heap.cur == a.nbytes == 512 * 256 * 4
    views = [a[:, :10], a.T, a.reshape(256, 512), a[3], a[None], xp.broadcast_to(a[:1], (4, 256)), a.view(np.int32)]
    assert xp.heap.cur == a.nbytes and [v.base is a for v in views] == [True] * len(views)
    c = a.T.reshape(-1)  # NumPy copies here (a transposed array does not flatten in place)
    assert c.base is not a and xp.heap.cur == 2 * a.nbytes
    d = a.astype(np.float64)
    assert xp.heap.cur == 2 * a.nbytes + d.nbytes
    del a, c, d
    assert xp.heap.cur == views[0].base.nbytes  # the views keep their buffer alive
    del views
    assert xp.heap.cur == 0 and xp.heap.peak == 512 * 256 * 4 * 4


def test_operators_allocate_results_and_elide_temporaries_as_numpy_does():
    xp = ShapeOnly("cpu")
    n = ELIDE_BYTES // 4  # float32 elements: the size from which NumPy reuses a temporary
    a = xp.empty(n, F32)
    b = (a * 2) + 1  # the temporary a * 2 is reused for + 1
    assert xp.heap.cur == 2 * a.nbytes and xp.heap.peak == 2 * a.nbytes
    e = a + a * 2  # + is commutative: the right temporary is reused
    assert xp.heap.cur == 3 * a.nbytes
    f = a + b  # named operands: a new array
    assert xp.heap.cur == 4 * a.nbytes
    small = xp.empty(n // 2, F32)
    g = (small * 2) + 1  # below the size: no elision
    assert xp.heap.peak == 4 * a.nbytes + 3 * small.nbytes
    a += 1  # in place
    xp.add(a, b, out=f)
    assert xp.heap.cur == 4 * a.nbytes + 2 * small.nbytes
    del b, e, f, g


def test_the_gpu_pool_rounds_to_512_bytes_and_never_elides():
    xp = ShapeOnly("cuda")
    a = xp.empty(100, F32)  # 400 bytes
    assert xp.heap.cur == 512 and not on_host(xp)
    b = xp.empty(ELIDE_BYTES // 4, F32)
    c = (b * 2) + 1
    assert xp.heap.peak == 512 + 3 * b.nbytes
    del a, b, c


def test_functions_shapes_and_dtypes_follow_numpy():
    xp = ShapeOnly("cpu")
    x = xp.empty((4, 8, 16), np.float32)
    w = xp.empty((16, 32), np.float32)
    assert (x @ w).shape == (4, 8, 32) and xp.matmul(x[0], w).dtype == np.float32
    assert xp.einsum("bij,jk->bik", x, w).shape == (4, 8, 32)
    assert x.sum(axis=-1, keepdims=True).shape == (4, 8, 1) and x.max(axis=(0, 2)).shape == (8,)
    assert (x.astype(np.float16) * 2.0).dtype == np.float16  # Python scalars are weak (NEP 50)
    assert xp.concatenate([x, x], axis=1).shape == (4, 16, 16) and xp.stack([w, w]).shape == (2, 16, 32)
    assert xp.moveaxis(x, 1, 0).shape == (8, 4, 16) and xp.where(x > 0, x, 0.0).shape == x.shape
    ids = xp.asarray(np.array([[1, 3], [0, 2]]))  # host data keeps its values
    assert w[ids].shape == (2, 2, 32) and int(ids.max()) == 3 and not bool((ids < 0).any())
    assert get_array_module(x) is xp and on_host(xp)


def test_what_depends_on_unknown_data_is_refused_by_name():
    xp = ShapeOnly("cpu")
    x = xp.empty((1 << 19,), np.float32)  # 2 MiB: past what keeps values (small host arrays do)
    for call, name in ((lambda: xp.nonzero(x > 0), "nonzero"), (lambda: xp.bincount(x.astype(np.int64)), "bincount"),
                       (lambda: x[x > 0], "boolean indexing"), (lambda: np.asarray(x), "converted to NumPy data")):
        with pytest.raises(ShapeOnlyError, match=name):
            call()
    mask = xp.asarray(np.array([True, False] * 32))  # known values: exact
    small = xp.empty(64, np.float32)
    assert xp.compress(mask, small).shape == (32,) and xp.nonzero(mask)[0].shape == (32,)
    flags = xp.empty(8, bool)  # what the code writes into a small array is known
    flags[0] = True
    xp.not_equal(xp.arange(7), xp.arange(1, 8) % 3, out=flags[1:])
    assert xp.flatnonzero(flags).shape == (int(np.count_nonzero([True] + list(np.arange(7) != np.arange(1, 8) % 3))),)


def test_blocks_that_threads_would_run_at_once_are_booked_at_once():
    xp = ShapeOnly("cpu", threads=2)
    out = xp.empty(4, F32)

    def block(i):
        t = xp.empty(1000, F32)  # a 4000-byte temporary per block
        return i

    assert xp.parallel_map(block, [0, 1, 2, 3]) == [0, 1, 2, 3]
    assert xp.heap.peak == out.nbytes + 2 * 4000  # two at once, never more
    one = ShapeOnly("cpu", threads=1)
    kept = one.parallel_map(lambda i: one.empty(1000, F32), [0, 1, 2])  # results are kept: booked
    assert one.heap.peak == one.heap.cur == 3 * 4000
    del kept
    one.heap.reset_peak()
    one.parallel_map(lambda i: one.empty(1000, F32) is None, [0, 1, 2])  # one block's transient at a time
    assert one.heap.peak == 4000 and one.heap.cur == 0
