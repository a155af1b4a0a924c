"""The checked emulator traps a naturally aligned access at an address that is not (a GPU's
"misaligned address" fault): a 16-byte int4 load or store at an address that is only 8-byte
aligned, an 8-byte one at 4, while the same kernel at aligned addresses, and element-by-element
fallbacks at any address, run."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_emu import EmulatedModule, KernelFault

CODE = r'''#include "common.cuh"
extern "C" __global__ void copy_int4(float* out, const float* x, int offset) {
    // one 128-bit load and store at x + offset / out + offset: 16-byte aligned only for offset % 4 == 0
    *reinterpret_cast<int4*>(out + offset) = *reinterpret_cast<const int4*>(x + offset);
}
extern "C" __global__ void copy_int2(float* out, const float* x, int offset) {
    *reinterpret_cast<int2*>(out + offset) = *reinterpret_cast<const int2*>(x + offset);
}
extern "C" __global__ void copy_load128(float* out, const float* x, int offset) {
    store128(out + offset, load128(x + offset));  // common.cuh's Packed128: what the kernels use
}
extern "C" __global__ void copy_floats(float* out, const float* x, int offset) {
    for (int k = 0; k < 4; ++k) out[offset + k] = x[offset + k];
}
'''


@pytest.fixture(scope="module")
def module():
    return EmulatedModule(code=CODE)


@pytest.mark.parametrize("kernel,offset", [("copy_int4", 2), ("copy_int4", 1), ("copy_load128", 2),
                                           ("copy_int2", 1)])
def test_a_vector_access_below_its_alignment_faults(module, kernel, offset):
    x = np.arange(16, dtype=np.float32)
    out = np.zeros(16, np.float32)
    with pytest.raises(KernelFault, match="misaligned address"):
        module.get_function(kernel)((1,), (1,), (out, x, np.int32(offset)))


@pytest.mark.parametrize("kernel,offset", [("copy_int4", 4), ("copy_load128", 8), ("copy_int2", 2), ("copy_floats", 1),
                                           ("copy_floats", 2)])
def test_aligned_vector_and_scalar_accesses_run(module, kernel, offset):
    x = np.arange(16, dtype=np.float32)
    out = np.zeros(16, np.float32)
    module.get_function(kernel)((1,), (1,), (out, x, np.int32(offset)))
    width = 2 if kernel == "copy_int2" else 4
    np.testing.assert_array_equal(out[offset:offset + width], x[offset:offset + width])
    assert not out[:offset].any() and not out[offset + width:].any()
