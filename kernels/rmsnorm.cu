// RMSNorm over the last axis (Llama, Qwen2, Mistral): forward saving rstd, backward giving dx and
// dweight; and the fused residual add + RMSNorm forward of a pre-norm block (llm.c's
// fused_residual_forward): s = x + branch, written once, and its norm, in one launch.
//
// HF's rounding order (cutp/ops/rmsnorm.py): xhat = x * rstd in float32, rounded to the storage
// type, then multiplied by the weight and rounded once (for float32 the rounding is the identity).
//
// Forward: one warp per row for rows up to a few thousand columns (no shared memory, no
// barriers), one block per row beyond; two passes over the row (sum of squares, output), the
// re-read hitting L1/L2.
//
// Backward (LayerNorm's layout, kernels/layernorm.cu): a grid of a few blocks per SM (the
// launcher's: 2 x the SM count), each block over an even share of the rows, R rows at a time
// (block (threads per row, R)). For each row its group reduces sum(g * xhat) (g = dy * weight) and
// writes dx = rstd * (g - xhat * mean(g * xhat)); meanwhile each thread adds dy * xhat (xhat as
// the forward rounded it) for its own columns into its group's accumulator in dynamic shared
// memory (R * C floats): no atomics. At the end the block adds its groups' sums in order into
// partial[block, :], and column_sum_* (reduce.cu) adds the blocks' partials in a fixed order:
// deterministic run to run.
#include "common.cuh"

namespace rmsnorm_impl {

// The row's s = x + branch rounded to T (written to `sum`), or x itself when branch is null.
template <bool RESIDUAL, typename T, int P>
__device__ __forceinline__ void load_input(float (&v)[P], const T* xr, const T* br, T* sr, int c0, int C) {
    load_chunk(v, xr + c0, C - c0);
    if constexpr (RESIDUAL) {
        float b[P];
        load_chunk(b, br + c0, C - c0);
#pragma unroll
        for (int k = 0; k < P; ++k) v[k] = to_float(from_float<T>(v[k] + b[k]));
        store_chunk(sr + c0, v, C - c0);
    }
}

template <typename T, bool BLOCK, bool RESIDUAL>
__device__ void forward(T* y, float* rstd_out, T* sum, const T* x, const T* branch, const T* weight,
                        long long n_rows, int C, float eps) {
    constexpr int P = Packed128<T>::size;
    const RowGroup<BLOCK> g;
    if (g.row >= n_rows) return;
    const T* xr = x + g.row * C;
    const T* br = RESIDUAL ? branch + g.row * C : nullptr;
    T* sr = RESIDUAL ? sum + g.row * C : nullptr;
    T* yr = y + g.row * C;

    float ss = 0.0f;
    for (int c0 = g.tid * P; c0 < C; c0 += g.size * P) {
        float v[P];
        load_input<RESIDUAL>(v, xr, br, sr, c0, C);
#pragma unroll
        for (int k = 0; k < P; ++k) ss += v[k] * v[k];  // load_chunk fills the tail with 0
    }
    const float rstd = 1.0f / sqrtf(group_reduce_sum<BLOCK>(ss) / (float)C + eps);

    // the second pass reads what this thread's own first pass stored in `sum`: the same chunks
    const T* in = RESIDUAL ? sr : xr;
    for (int c0 = g.tid * P; c0 < C; c0 += g.size * P) {
        float v[P], w[P];
        load_chunk(v, in + c0, C - c0);
        if (weight != nullptr) load_chunk(w, weight + c0, C - c0);
#pragma unroll
        for (int k = 0; k < P; ++k) {
            float h = to_float(from_float<T>(v[k] * rstd));  // HF's .to(input dtype) before the weight
            if (weight != nullptr) h *= w[k];
            v[k] = h;
        }
        store_chunk(yr + c0, v, C - c0);
    }
    if (g.tid == 0) rstd_out[g.row] = rstd;
}

// Block (threads per row, R): R row groups, each on its own row at a time. Block b takes the rows
// [b * n_rows / gridDim.x, (b + 1) * n_rows / gridDim.x), R at a time; each thread adds dy * xhat
// of its own columns into its group's accumulator acc[y][C] (no atomics); at the end the block
// adds the R groups' accumulators in order into partial[b, :].
template <typename T>
__device__ void backward(T* dx, float* partial, const T* dy, const T* x, const T* weight, const float* rstd,
                         long long n_rows, int C) {
    constexpr int P = Packed128<T>::size;
    extern __shared__ float acc[];  // [R][C]: sum(dy * xhat) of each group's rows
    const int stride = blockDim.x * P;
    const bool params = partial != nullptr;
    const float inv_c = 1.0f / (float)C;
    float* const my_acc = acc + (long long)threadIdx.y * C;
    if (params) {
        for (int c = threadIdx.x * P; c < C; c += stride) {
            for (int k = 0; k < P && c + k < C; ++k) my_acc[c + k] = 0.0f;
        }
    }
    const long long r0 = blockIdx.x * n_rows / gridDim.x;  // 64-bit products: n_rows is long long
    const long long r1 = (blockIdx.x + 1) * n_rows / gridDim.x;
    for (long long base = r0; base < r1; base += blockDim.y) {  // uniform over the block: the barriers are safe
        const long long r = base + threadIdx.y;
        const bool active = r < r1;  // the last round may leave row groups idle
        const float rs = active ? rstd[r] : 0.0f;
        const T* dyr = dy + r * C;
        const T* xr = x + r * C;
        float sgx = 0.0f;
        for (int c0 = threadIdx.x * P; active && c0 < C; c0 += stride) {
            float d[P], v[P], w[P];
            load_chunk(d, dyr + c0, C - c0);
            load_chunk(v, xr + c0, C - c0);
            if (weight != nullptr) load_chunk(w, weight + c0, C - c0);
#pragma unroll
            for (int k = 0; k < P; ++k) {
                if (c0 + k < C) {
                    const float xhat = v[k] * rs;
                    const float gk = weight != nullptr ? d[k] * w[k] : d[k];
                    sgx += gk * xhat;
                    // the xhat the forward multiplied the weight by (rounded to T); this thread's own columns
                    if (params) my_acc[c0 + k] += d[k] * to_float(from_float<T>(xhat));
                }
            }
        }
        const float gx = row_group_reduce_sum(sgx) * inv_c;
        for (int c0 = threadIdx.x * P; active && c0 < C; c0 += stride) {
            float d[P], v[P], w[P];
            load_chunk(d, dyr + c0, C - c0);
            load_chunk(v, xr + c0, C - c0);
            if (weight != nullptr) load_chunk(w, weight + c0, C - c0);
#pragma unroll
            for (int k = 0; k < P; ++k) {
                const float xhat = v[k] * rs;
                const float gk = weight != nullptr ? d[k] * w[k] : d[k];
                d[k] = (gk - xhat * gx) * rs;
            }
            store_chunk(dx + r * C + c0, d, C - c0);
        }
    }
    if (params) {
        __syncthreads();  // the groups' accumulators, read across threads below
        sum_row_groups(partial + (long long)blockIdx.x * C, acc, C, C);
    }
}

}  // namespace rmsnorm_impl

// weight may be null (no scale). block_per_row: 0 = a warp per row. Plain: sum and branch are null.
#define RMSNORM_FWD_PARAMS(T)                                                                                  \
    T *y, float *rstd, T *sum, const T *x, const T *branch, const T *weight, long long n_rows, int C, float eps, \
        int block_per_row
#define RMSNORM_FWD(T, RESIDUAL)                                                                               \
    if (block_per_row) {                                                                                       \
        rmsnorm_impl::forward<T, true, RESIDUAL>(y, rstd, sum, x, branch, weight, n_rows, C, eps);             \
    } else {                                                                                                   \
        rmsnorm_impl::forward<T, false, RESIDUAL>(y, rstd, sum, x, branch, weight, n_rows, C, eps);            \
    }
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_forward_f32(RMSNORM_FWD_PARAMS(float)) {
    RMSNORM_FWD(float, false)
}
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_forward_bf16(RMSNORM_FWD_PARAMS(__nv_bfloat16)) {
    RMSNORM_FWD(__nv_bfloat16, false)
}

// The residual add fused before the norm: sum = x + branch (rounded to T), normalised. At most 512
// threads: with 1024 (64 registers each) the bf16 path spills.
extern "C" __global__ void __launch_bounds__(512) residual_rmsnorm_forward_f32(RMSNORM_FWD_PARAMS(float)) {
    RMSNORM_FWD(float, true)
}
extern "C" __global__ void __launch_bounds__(512) residual_rmsnorm_forward_bf16(RMSNORM_FWD_PARAMS(__nv_bfloat16)) {
    RMSNORM_FWD(__nv_bfloat16, true)
}

// Grid: a few blocks per SM, each over an even share of the rows; block (threads per row, R rows
// at a time); partial is [gridDim.x, C] floats (or null without a weight) and shared_mem
// R * C * 4 bytes (0 when partial is null).
extern "C" __global__ void __launch_bounds__(512) rmsnorm_backward_f32(
    float* dx, float* partial, const float* dy, const float* x, const float* weight, const float* rstd,
    long long n_rows, int C) {
    rmsnorm_impl::backward(dx, partial, dy, x, weight, rstd, n_rows, C);
}
extern "C" __global__ void __launch_bounds__(512) rmsnorm_backward_bf16(
    __nv_bfloat16* dx, float* partial, const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* weight,
    const float* rstd, long long n_rows, int C) {
    rmsnorm_impl::backward(dx, partial, dy, x, weight, rstd, n_rows, C);
}
