// LayerNorm over the last axis: forward saving mean and rstd, backward giving dx, dweight, dbias.
//
// Forward: one warp per row for rows up to a few thousand columns (no shared memory, no
// barriers), one block per row beyond; three passes over the row (mean, variance of x - mean,
// output), the same two-pass statistics as cutp.ops.layernorm, so float32 results agree to
// rounding. The re-reads hit L1/L2.
//
// Backward: one block per chunk of rows_per_chunk rows. For each row the block reduces
// sum(g) and sum(g * xhat) (g = dy * weight) and writes dx; meanwhile each thread adds
// dy * xhat and dy for *its own* columns into dynamic shared memory (2 * C floats), so the
// parameter gradients need no atomics at all. At the end the block writes its partial sums to
// partial[0, chunk, :] (dweight) and partial[1, chunk, :] (dbias); column_sum_* (reduce.cu) adds
// the chunks in a fixed order: deterministic run to run.
#include "common.cuh"

namespace layernorm_impl {

template <typename T, bool BLOCK>
__device__ void forward(T* y, float* mean_out, float* rstd_out, const T* x, const T* weight, const T* bias,
                        long long n_rows, int C, float eps) {
    constexpr int P = Packed128<T>::size;
    const RowGroup<BLOCK> g;
    if (g.row >= n_rows) return;
    const T* xr = x + g.row * C;
    T* yr = y + g.row * C;
    const float inv_c = 1.0f / (float)C;

    float s = 0.0f;
    for (int c0 = g.tid * P; c0 < C; c0 += g.size * P) {
        float v[P];
        load_chunk(v, xr + c0, C - c0);
#pragma unroll
        for (int k = 0; k < P; ++k) s += v[k];
    }
    const float mean = group_reduce_sum<BLOCK>(s) / (float)C;

    float ss = 0.0f;
    for (int c0 = g.tid * P; c0 < C; c0 += g.size * P) {
        float v[P];
        load_chunk(v, xr + c0, C - c0);
#pragma unroll
        for (int k = 0; k < P; ++k) {
            const float h = c0 + k < C ? v[k] - mean : 0.0f;
            ss += h * h;
        }
    }
    const float rstd = 1.0f / sqrtf(group_reduce_sum<BLOCK>(ss) * inv_c + eps);

    for (int c0 = g.tid * P; c0 < C; c0 += g.size * P) {
        float v[P], w[P], b[P];
        load_chunk(v, xr + c0, C - c0);
        if (weight != nullptr) load_chunk(w, weight + c0, C - c0);
        if (bias != nullptr) load_chunk(b, bias + c0, C - c0);
#pragma unroll
        for (int k = 0; k < P; ++k) {
            float h = (v[k] - mean) * rstd;
            if (weight != nullptr) h *= w[k];
            if (bias != nullptr) h += b[k];
            v[k] = h;
        }
        store_chunk(yr + c0, v, C - c0);
    }
    if (g.tid == 0) {
        mean_out[g.row] = mean;
        rstd_out[g.row] = rstd;
    }
}

template <typename T>
__device__ void backward(T* dx, float* partial, const T* dy, const T* x, const T* weight, const float* mean,
                         const float* rstd, long long n_rows, int C, int rows_per_chunk) {
    constexpr int P = Packed128<T>::size;
    extern __shared__ float acc[];  // [2 * C]: sum(dy * xhat), sum(dy) of this block's rows
    const int stride = blockDim.x * P;
    const bool params = partial != nullptr;
    const float inv_c = 1.0f / (float)C;
    if (params) {
        for (int c = threadIdx.x * P; c < C; c += stride) {
            for (int k = 0; k < P && c + k < C; ++k) acc[c + k] = acc[C + c + k] = 0.0f;
        }
    }
    const long long r0 = (long long)blockIdx.x * rows_per_chunk;
    const long long r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    for (long long r = r0; r < r1; ++r) {  // uniform over the block: the barriers below are safe
        const float mu = mean[r], rs = rstd[r];
        const T* dyr = dy + r * C;
        const T* xr = x + r * C;
        float sg = 0.0f, sgx = 0.0f;
        for (int c0 = threadIdx.x * P; c0 < C; c0 += stride) {
            float d[P], v[P], w[P];
            load_chunk(d, dyr + c0, C - c0);
            load_chunk(v, xr + c0, C - c0);
            if (weight != nullptr) load_chunk(w, weight + c0, C - c0);
#pragma unroll
            for (int k = 0; k < P; ++k) {
                if (c0 + k < C) {
                    const float xhat = (v[k] - mu) * rs;
                    const float gk = weight != nullptr ? d[k] * w[k] : d[k];
                    sg += gk;
                    sgx += gk * xhat;
                    if (params) {  // this thread's own columns: no other thread touches them
                        acc[c0 + k] += d[k] * xhat;
                        acc[C + c0 + k] += d[k];
                    }
                }
            }
        }
        block_reduce_sum2(sg, sgx);
        const float gm = sg * inv_c, gx = sgx * inv_c;
        for (int c0 = threadIdx.x * P; c0 < C; c0 += stride) {
            float d[P], v[P], w[P];
            load_chunk(d, dyr + c0, C - c0);
            load_chunk(v, xr + c0, C - c0);
            if (weight != nullptr) load_chunk(w, weight + c0, C - c0);
#pragma unroll
            for (int k = 0; k < P; ++k) {
                const float xhat = (v[k] - mu) * rs;
                const float gk = weight != nullptr ? d[k] * w[k] : d[k];
                d[k] = (gk - xhat * gx - gm) * rs;
            }
            store_chunk(dx + r * C + c0, d, C - c0);
        }
    }
    if (params) {
        float* pw = partial + (long long)blockIdx.x * C;
        float* pb = partial + ((long long)gridDim.x + blockIdx.x) * C;
        for (int c = threadIdx.x * P; c < C; c += stride) {
            for (int k = 0; k < P && c + k < C; ++k) {
                pw[c + k] = acc[c + k];
                pb[c + k] = acc[C + c + k];
            }
        }
    }
}

}  // namespace layernorm_impl

// weight / bias may be null (no scale / no shift). block_per_row: 0 = a warp per row.
extern "C" __global__ void __launch_bounds__(1024) layernorm_forward_f32(
    float* y, float* mean, float* rstd, const float* x, const float* weight, const float* bias, long long n_rows, int C,
    float eps, int block_per_row) {
    if (block_per_row) {
        layernorm_impl::forward<float, true>(y, mean, rstd, x, weight, bias, n_rows, C, eps);
    } else {
        layernorm_impl::forward<float, false>(y, mean, rstd, x, weight, bias, n_rows, C, eps);
    }
}
extern "C" __global__ void __launch_bounds__(1024) layernorm_forward_bf16(
    __nv_bfloat16* y, float* mean, float* rstd, const __nv_bfloat16* x, const __nv_bfloat16* weight,
    const __nv_bfloat16* bias, long long n_rows, int C, float eps, int block_per_row) {
    if (block_per_row) {
        layernorm_impl::forward<__nv_bfloat16, true>(y, mean, rstd, x, weight, bias, n_rows, C, eps);
    } else {
        layernorm_impl::forward<__nv_bfloat16, false>(y, mean, rstd, x, weight, bias, n_rows, C, eps);
    }
}

// Grid: one block per chunk of rows_per_chunk rows; partial is [2, gridDim.x, C] floats (or null
// when no parameter gradient is wanted) and shared_mem 2 * C * 4 bytes (0 when partial is null).
extern "C" __global__ void __launch_bounds__(512) layernorm_backward_f32(
    float* dx, float* partial, const float* dy, const float* x, const float* weight, const float* mean,
    const float* rstd, long long n_rows, int C, int rows_per_chunk) {
    layernorm_impl::backward(dx, partial, dy, x, weight, mean, rstd, n_rows, C, rows_per_chunk);
}
extern "C" __global__ void __launch_bounds__(512) layernorm_backward_bf16(
    __nv_bfloat16* dx, float* partial, const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* weight,
    const float* mean, const float* rstd, long long n_rows, int C, int rows_per_chunk) {
    layernorm_impl::backward(dx, partial, dy, x, weight, mean, rstd, n_rows, C, rows_per_chunk);
}
