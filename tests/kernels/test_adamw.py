"""kernels/adamw.cu through its launcher (kernels/adamw.py) against cutp/ops/adamw.py, on each backend.

adamw_update over flat float32 and bfloat16 parameters, with and without weight decay: the
kernel does the reference's float32 operations in its order (no contraction into FMAs), so the
emulated results equal the reference bit for bit; on a GPU they are compared within 1e-6
relative (the GPU's sqrtf and division are not checked bit-exact).
"""
from __future__ import annotations

import numpy as np
import pytest

from cutp import ops
from cutp.kernels import KernelArgumentError

from .helpers import ADAMW_KW, BF16, F32, bits, close, rng


def _adamw_state(n, dtype, seed):
    r = rng(seed)
    p = r.standard_normal(n).astype(np.float32).astype(dtype)
    g = r.standard_normal(n).astype(np.float32).astype(dtype)
    m = (r.standard_normal(n) * 0.1).astype(np.float32)
    v = (r.random(n) * 0.01).astype(np.float32)
    mask = (r.random(n) < 0.5).astype(np.float32).astype(dtype)
    return p, g, m, v, mask


def assert_same_float_ops(backend, got, want, *, rtol, atol):
    """Bit for bit under the emulator; within (rtol, atol) on a GPU."""
    if backend.emulated:
        np.testing.assert_array_equal(bits(got), bits(want))
    else:
        close(got, want, np.asarray(want).dtype, rtol=rtol, atol=atol)


# 124_439_808 // 64 + 3: a GPT-2-sized flat buffer's worth of blocks, ending mid-chunk
@pytest.mark.parametrize("n", [0, 1, 5, 1000, 1027, 124_439_808 // 64 + 3])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_adamw_float32_matches_the_reference(backend, k, n, weight_decay):
    kw = dict(ADAMW_KW, weight_decay=weight_decay)
    p, g, m, v, mask = _adamw_state(n, F32, n)
    gp, gg, gm, gv = (backend.to_device(a) for a in (p, g, m, v))
    k.adamw_update(gp, gg, gm, gv, backend.to_device(mask), **kw)
    ops.adamw_update(p, g, m, v, mask, **kw)
    assert_same_float_ops(backend, gp, p, rtol=1e-6, atol=1e-7)
    assert_same_float_ops(backend, gm, m, rtol=1e-6, atol=0)
    assert_same_float_ops(backend, gv, v, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(backend.host(gg), g)  # the gradient is read, never written


# 2048 = 256 threads * 8 bf16: one block's worth; 2053 spills 5 elements into a second block's
# first thread (a partial chunk), 4099 ends mid-chunk in a third block
@pytest.mark.parametrize("n", [1, 31, 333, 2048, 2053, 4099])
def test_adamw_bf16_params(backend, k, n):
    backend.require_bf16()
    p, g, m, v, mask = _adamw_state(n, BF16, 5 + n)
    p_ref = p.astype(np.float32)
    m2, v2 = m.copy(), v.copy()
    gp, gg, gm, gv = (backend.to_device(a) for a in (p, g, m, v))
    k.adamw_update(gp, gg, gm, gv, backend.to_device(mask), **ADAMW_KW)
    ops.adamw_update(p_ref, g.astype(np.float32), m2, v2, mask.astype(np.float32), **ADAMW_KW)
    # the kernel computes in float32 from the exact bf16 values, as the float32 reference does on
    # them, and rounds p to bf16 once: m and v are bit-identical, p the reference rounded to bf16
    assert_same_float_ops(backend, gm, m2, rtol=1e-6, atol=0)
    assert_same_float_ops(backend, gv, v2, rtol=1e-6, atol=0)
    if backend.emulated:
        np.testing.assert_array_equal(bits(gp), bits(p_ref.astype(BF16)))
    else:  # a float32 difference on the GPU may round p to the neighbouring bf16 value
        close(gp, p_ref.astype(BF16), BF16)
    np.testing.assert_array_equal(bits(gg), bits(g))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("n", [50, 1027])
def test_adamw_without_a_mask_decays_every_element(backend, k, n, weight_decay):
    """decay_mask None (cutp.optim's per-range updates): the result of an all-ones mask, bit for
    bit, in the kernel and in the reference; with weight decay 0, that of an all-zeros mask."""
    dev = backend.to_device
    kw = dict(ADAMW_KW, weight_decay=weight_decay)
    p, g, m, v, _ = _adamw_state(n, F32, 6)
    p2, m2, v2 = p.copy(), m.copy(), v.copy()
    p3, m3, v3 = p.copy(), m.copy(), v.copy()
    gp = dev(p)
    k.adamw_update(gp, dev(g), dev(m), dev(v), None, **kw)
    ops.adamw_update(p2, g, m2, v2, None, **kw)
    ops.adamw_update(p3, g, m3, v3, np.ones(n, np.float32), **kw)
    np.testing.assert_array_equal(bits(p2), bits(p3))
    assert_same_float_ops(backend, gp, p2, rtol=1e-6, atol=1e-7)
    with pytest.raises(KernelArgumentError, match="decay_mask"):
        k.adamw_update(gp, dev(g), dev(m), dev(v), dev(np.ones(n - 1, np.float32)), **kw)
