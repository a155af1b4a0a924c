"""The emulator's nvcuda::wmma (tests/cuda_emu/cuda_emu.h, "Tensor cores") against CUDA's
<mma.h>: D = A B + C for every layout pair kernels may use, the accumulator stored row- and
column-major, and the API's shape (the bf16 mma_sync of crt/mma.h has no satf argument, so a
kernel passing one must not compile here either: NVRTC would reject it on the GPU)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.cuda_emu import CompileError, EmulatedModule

BF16 = np.dtype(ml_dtypes.bfloat16)

WMMA_KERNEL = r"""
#define CUTP_TENSOR_CORES
#include "common.cuh"
template <class LA, class LB>
__device__ void mma_tile(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, int d_col_major) {
    using namespace nvcuda;
    __shared__ __align__(32) __nv_bfloat16 As[256], Bs[256];
    __shared__ __align__(32) float Cs[256];
    for (int i = threadIdx.x; i < 256; i += 32) { As[i] = a[i]; Bs[i] = b[i]; Cs[i] = c[i]; }
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LA> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, LB> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
    wmma::load_matrix_sync(fa, As, 16);
    wmma::load_matrix_sync(fb, Bs, 16);
    wmma::load_matrix_sync(fc, Cs, 16, wmma::mem_row_major);
    wmma::mma_sync(fc, fa, fb, fc);
    __syncwarp();
    wmma::store_matrix_sync(Cs, fc, 16, d_col_major ? wmma::mem_col_major : wmma::mem_row_major);
    __syncwarp();
    for (int i = threadIdx.x; i < 256; i += 32) d[i] = Cs[i];
}
extern "C" __global__ void mma_rr(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, int cm) {
    mma_tile<nvcuda::wmma::row_major, nvcuda::wmma::row_major>(d, a, b, c, cm);
}
extern "C" __global__ void mma_rc(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, int cm) {
    mma_tile<nvcuda::wmma::row_major, nvcuda::wmma::col_major>(d, a, b, c, cm);
}
extern "C" __global__ void mma_cr(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, int cm) {
    mma_tile<nvcuda::wmma::col_major, nvcuda::wmma::row_major>(d, a, b, c, cm);
}
"""


@pytest.fixture(scope="module")
def wmma_module():
    return EmulatedModule(code=WMMA_KERNEL)


@pytest.mark.parametrize("name", ["mma_rr", "mma_rc", "mma_cr"])
@pytest.mark.parametrize("d_col_major", [0, 1])
def test_mma_sync_is_a_b_plus_c(wmma_module, name, d_col_major):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 16)).astype(np.float32).astype(BF16)
    b = rng.standard_normal((16, 16)).astype(np.float32).astype(BF16)
    c = rng.standard_normal((16, 16)).astype(np.float32)
    # memory as the layouts read it: col_major A holds A^T row-major, col_major B holds B^T
    a_mem = np.ascontiguousarray(a.T if name[-2] == "c" else a)
    b_mem = np.ascontiguousarray(b.T if name[-1] == "c" else b)
    d = np.zeros((16, 16), np.float32)
    wmma_module.get_function(name)((1,), (32,), (d, a_mem, b_mem, c, np.int32(d_col_major)))
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d.T if d_col_major else d, want, rtol=1e-5, atol=1e-5)


def test_bf16_mma_sync_takes_no_satf():
    """crt/mma.h declares the bf16 m16n16k16 mma_sync as (d, a, b, c): no satf. The emulator
    took a satf argument (and clamped to [0, 1], which is not CUDA's saturate-to-finite either),
    so a kernel passing it ran in CI and failed to compile on the GPU."""
    code = WMMA_KERNEL.replace("wmma::mma_sync(fc, fa, fb, fc);", "wmma::mma_sync(fc, fa, fb, fc, true);")
    with pytest.raises(CompileError):
        EmulatedModule(code=code).get_function("mma_rr")


@pytest.mark.parametrize("decl", [
    "wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16> fa;",  # A without a layout
    "wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LA> fa; "
    "wmma::fragment<wmma::accumulator, 16, 16, 16, float, wmma::row_major> bad; "
    "wmma::fill_fragment(bad, 0.0f);",  # accumulator with one
])
def test_fragments_declared_as_mma_h_defines_them(decl):
    """<mma.h> has no matrix_a / matrix_b fragment without a layout and no accumulator with one
    (incomplete types: NVCC and NVRTC reject them); the emulator must not compile them either."""
    code = WMMA_KERNEL.replace("wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LA> fa;", decl)
    assert code != WMMA_KERNEL
    with pytest.raises(CompileError):
        EmulatedModule(code=code).get_function("mma_rr")
