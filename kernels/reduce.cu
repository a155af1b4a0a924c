// Deterministic second pass of the column reductions (bias / LayerNorm parameter gradients).
//
// The first-pass kernels write partial column sums, one row of `partial` [n_chunks, C] per block
// of rows; this adds them up in a fixed order, so the result is identical run to run (no float
// atomics anywhere). Block (32, 8): threadIdx.x is a column of a 32-wide tile (coalesced reads of
// each partial row), threadIdx.y strides over the chunks; the 8 per-column sums are then added in
// shared memory, always in the same order.
#include "common.cuh"

namespace reduce_impl {

constexpr int TILE = 32;
constexpr int SPLIT = 8;

template <typename T>
__device__ void column_sum(T* out, const float* partial, int n_chunks, int C) {
    __shared__ float sums[SPLIT][TILE + 1];
    const int c = blockIdx.x * TILE + threadIdx.x;
    float s = 0.0f;
    if (c < C) {
        for (int k = threadIdx.y; k < n_chunks; k += SPLIT) s += partial[(long long)k * C + c];
    }
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float total = sums[0][threadIdx.x];
#pragma unroll
        for (int j = 1; j < SPLIT; ++j) total += sums[j][threadIdx.x];
        out[c] = from_float<T>(total);
    }
}

}  // namespace reduce_impl

// out[c] = sum_k partial[k, c], launched with block (32, 8) and grid ceil(C / 32).
extern "C" __global__ void __launch_bounds__(256) column_sum_f32(
    float* out, const float* partial, int n_chunks, int C) {
    reduce_impl::column_sum(out, partial, n_chunks, C);
}
extern "C" __global__ void __launch_bounds__(256) column_sum_bf16(
    __nv_bfloat16* out, const float* partial, int n_chunks, int C) {
    reduce_impl::column_sum(out, partial, n_chunks, C);
}
