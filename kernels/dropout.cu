// Dropout with the counter-based SplitMix64 hash of cutp.ops.dropout: the keep-mask of element i
// under (seed, offset) is a pure function of i, so the GPU mask is bit-identical to the NumPy one
// and no RNG state lives on the device. Elementwise, one 128-bit chunk of the data per thread.
//   dropout_mask_bool     the keep-mask alone (cutp.ops.dropout_mask);
//   dropout_forward_*     y = (x * keep) * scale and the mask, in one pass;
//   dropout_apply_*       y = (x * mask) * scale from a saved mask (the backward).
#include "common.cuh"

namespace dropout_impl {

// keep(): common.cuh's dropout_keep, also used by the fused attention's probability dropout.
__device__ __forceinline__ bool keep(unsigned long long seed, unsigned long long offset, unsigned long long i,
                                     unsigned int threshold) {
    return dropout_keep(seed, offset, i, threshold);
}

template <typename T>
__device__ void forward(T* y, bool* mask, const T* x, long long n, unsigned long long seed,
                        unsigned long long offset, unsigned int threshold, float scale) {
    constexpr int P = Packed128<T>::size;
    const long long i0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * P;
    if (i0 >= n) return;
    float v[P];
    load_chunk(v, x + i0, n - i0);
#pragma unroll
    for (int k = 0; k < P; ++k) {
        const bool kept = keep(seed, offset, (unsigned long long)(i0 + k), threshold);
        if (mask != nullptr && i0 + k < n) mask[i0 + k] = kept;
        v[k] = __fmul_rn(__fmul_rn(v[k], kept ? 1.0f : 0.0f), scale);
    }
    store_chunk(y + i0, v, n - i0);
}

template <typename T>
__device__ void apply(T* y, const T* x, const bool* mask, long long n, float scale) {
    constexpr int P = Packed128<T>::size;
    const long long i0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * P;
    if (i0 >= n) return;
    float v[P];
    load_chunk(v, x + i0, n - i0);
#pragma unroll
    for (int k = 0; k < P; ++k) {
        const float kept = i0 + k < n && mask[i0 + k] ? 1.0f : 0.0f;
        v[k] = __fmul_rn(__fmul_rn(v[k], kept), scale);
    }
    store_chunk(y + i0, v, n - i0);
}

}  // namespace dropout_impl

// One mask element per thread (bool output: 4 per thread would not make a 128-bit store anyway).
extern "C" __global__ void __launch_bounds__(256) dropout_mask_bool(
    bool* mask, long long n, unsigned long long seed, unsigned long long offset, unsigned int threshold) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) mask[i] = dropout_impl::keep(seed, offset, (unsigned long long)i, threshold);
}

// mask may be null (the mask is then not stored).
extern "C" __global__ void __launch_bounds__(256) dropout_forward_f32(
    float* y, bool* mask, const float* x, long long n, unsigned long long seed, unsigned long long offset,
    unsigned int threshold, float scale) {
    dropout_impl::forward(y, mask, x, n, seed, offset, threshold, scale);
}
extern "C" __global__ void __launch_bounds__(256) dropout_forward_bf16(
    __nv_bfloat16* y, bool* mask, const __nv_bfloat16* x, long long n, unsigned long long seed,
    unsigned long long offset, unsigned int threshold, float scale) {
    dropout_impl::forward(y, mask, x, n, seed, offset, threshold, scale);
}

extern "C" __global__ void __launch_bounds__(256) dropout_apply_f32(
    float* y, const float* x, const bool* mask, long long n, float scale) {
    dropout_impl::apply(y, x, mask, n, scale);
}
extern "C" __global__ void __launch_bounds__(256) dropout_apply_bf16(
    __nv_bfloat16* y, const __nv_bfloat16* x, const bool* mask, long long n, float scale) {
    dropout_impl::apply(y, x, mask, n, scale);
}
