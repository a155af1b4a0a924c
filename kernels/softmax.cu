// Scaled, optionally causal softmax over the rows of attention scores, and its backward.
//
// A row is handled by one warp (short rows: several rows per block, no shared memory, no
// barriers) or by one whole block (long rows), chosen by the host; any row length works in both
// shapes because every pass loops over the row in 128-bit chunks. The forward makes two passes
// over the input: an online max / sum-of-exponentials pass (the running sum is rescaled whenever
// the running max grows, as in flash attention), then a pass that writes exp(v - max) / sum. The
// causal mask is never materialised: query row i of a [Tq, Tk] matrix sits at position
// Tk - Tq + i and only reads keys 0 .. Tk - Tq + i; the masked tail is written as exact zeros.
#include "common.cuh"

namespace softmax_impl {

template <typename T, bool BLOCK>
__device__ void forward(T* y, const T* x, long long n_rows, int Tq, int Tk, float scale, int causal) {
    constexpr int P = Packed128<T>::size;
    const RowGroup<BLOCK> g;
    if (g.row >= n_rows) return;  // the whole group (warp or block) leaves together
    const int q = (int)(g.row % Tq);
    const int L = causal ? min(Tk, Tk - Tq + q + 1) : Tk;  // keys this row may attend
    const T* xr = x + g.row * Tk;
    T* yr = y + g.row * Tk;

    float m = -INFINITY, s = 0.0f;
    for (int c0 = g.tid * P; c0 < L; c0 += g.size * P) {
        float v[P];
        load_chunk(v, xr + c0, L - c0, -INFINITY);
        float cm = -INFINITY;
#pragma unroll
        for (int k = 0; k < P; ++k) {
            // __fmul_rn: the same rounded v * scale in both passes (no FMA contraction).
            v[k] = c0 + k < L ? __fmul_rn(v[k], scale) : -INFINITY;
            cm = fmaxf(cm, v[k]);
        }
        if (cm > m) {  // rescale the running sum to the new max (s is 0 while m is -inf)
            s = m == -INFINITY ? 0.0f : s * expf(m - cm);
            m = cm;
        }
        if (m != -INFINITY) {
#pragma unroll
            for (int k = 0; k < P; ++k) s += expf(v[k] - m);  // padding: exp(-inf) = 0
        }
    }
    const float M = group_reduce_max<BLOCK>(m);
    const float S = group_reduce_sum<BLOCK>(m == -INFINITY ? 0.0f : s * expf(m - M));

    for (int c0 = g.tid * P; c0 < Tk; c0 += g.size * P) {
        float v[P];
        if (c0 < L) {
            load_chunk(v, xr + c0, L - c0);
#pragma unroll
            for (int k = 0; k < P; ++k) v[k] = c0 + k < L ? expf(__fmul_rn(v[k], scale) - M) / S : 0.0f;
        } else {
#pragma unroll
            for (int k = 0; k < P; ++k) v[k] = 0.0f;
        }
        store_chunk(yr + c0, v, Tk - c0);
    }
}

// dx = scale * y * (dy - sum(dy * y)), evaluated as ((dy - s) * y) * scale like cutp.ops.
template <typename T, bool BLOCK>
__device__ void backward(T* dx, const T* dy, const T* y, long long n_rows, int Tk, float scale) {
    constexpr int P = Packed128<T>::size;
    const RowGroup<BLOCK> g;
    if (g.row >= n_rows) return;
    const long long off = g.row * Tk;
    float s = 0.0f;
    for (int c0 = g.tid * P; c0 < Tk; c0 += g.size * P) {
        float a[P], b[P];
        load_chunk(a, dy + off + c0, Tk - c0);
        load_chunk(b, y + off + c0, Tk - c0);
#pragma unroll
        for (int k = 0; k < P; ++k) s += a[k] * b[k];
    }
    s = group_reduce_sum<BLOCK>(s);
    for (int c0 = g.tid * P; c0 < Tk; c0 += g.size * P) {
        float a[P], b[P];
        load_chunk(a, dy + off + c0, Tk - c0);
        load_chunk(b, y + off + c0, Tk - c0);
#pragma unroll
        for (int k = 0; k < P; ++k) a[k] = (a[k] - s) * b[k] * scale;
        store_chunk(dx + off + c0, a, Tk - c0);
    }
}

}  // namespace softmax_impl

// block_per_row: 0 = one warp per row (blockDim.x / 32 rows per block), 1 = one block per row.
extern "C" __global__ void __launch_bounds__(512) softmax_forward_f32(
    float* y, const float* x, long long n_rows, int Tq, int Tk, float scale, int causal, int block_per_row) {
    if (block_per_row) {
        softmax_impl::forward<float, true>(y, x, n_rows, Tq, Tk, scale, causal);
    } else {
        softmax_impl::forward<float, false>(y, x, n_rows, Tq, Tk, scale, causal);
    }
}
extern "C" __global__ void __launch_bounds__(512) softmax_forward_bf16(
    __nv_bfloat16* y, const __nv_bfloat16* x, long long n_rows, int Tq, int Tk, float scale, int causal,
    int block_per_row) {
    if (block_per_row) {
        softmax_impl::forward<__nv_bfloat16, true>(y, x, n_rows, Tq, Tk, scale, causal);
    } else {
        softmax_impl::forward<__nv_bfloat16, false>(y, x, n_rows, Tq, Tk, scale, causal);
    }
}

extern "C" __global__ void __launch_bounds__(512) softmax_backward_f32(
    float* dx, const float* dy, const float* y, long long n_rows, int Tk, float scale, int block_per_row) {
    if (block_per_row) {
        softmax_impl::backward<float, true>(dx, dy, y, n_rows, Tk, scale);
    } else {
        softmax_impl::backward<float, false>(dx, dy, y, n_rows, Tk, scale);
    }
}
extern "C" __global__ void __launch_bounds__(512) softmax_backward_bf16(
    __nv_bfloat16* dx, const __nv_bfloat16* dy, const __nv_bfloat16* y, long long n_rows, int Tk, float scale,
    int block_per_row) {
    if (block_per_row) {
        softmax_impl::backward<__nv_bfloat16, true>(dx, dy, y, n_rows, Tk, scale);
    } else {
        softmax_impl::backward<__nv_bfloat16, false>(dx, dy, y, n_rows, Tk, scale);
    }
}
