// The rank-local half of the vocab-parallel cross-entropy (cutp.ops.cross_entropy's ce_shard_*).
//
// One block per row, as llm.c's fused classifier: a row of the logits shard is tens of thousands
// of columns, read with 128-bit loads and reduced over the block. Only the first n_valid columns
// are real classes; the rest is vocabulary padding: never part of the softmax, gradient 0.
//   ce_shard_max      row max over the valid columns;
//   ce_shard_stats    sum exp(logit - global max), sum of logits (label smoothing; optional),
//                     and the target logit (0 where the target is in another shard or ignored);
//   ce_shard_backward (softmax - (1 - eps) onehot - eps / n_classes) * row_scale, written over the
//                     logits in place (out may be logits): no probability tensor is ever stored.
// Offsets are 64-bit: rows x vocabulary exceeds 2^31 elements at realistic sizes.
#include "common.cuh"

namespace ce_impl {

template <typename T>
__device__ void shard_max(float* row_max, const T* logits, long long n_rows, int W, int n_valid) {
    constexpr int P = Packed128<T>::size;
    const long long row = blockIdx.x;
    if (row >= n_rows) return;
    const T* lr = logits + row * W;
    float m = -INFINITY;
    for (int c0 = threadIdx.x * P; c0 < n_valid; c0 += blockDim.x * P) {
        float v[P];
        load_chunk<P, true>(v, lr + c0, n_valid - c0, -INFINITY);
#pragma unroll
        for (int k = 0; k < P; ++k) m = fmaxf(m, v[k]);
    }
    m = block_reduce_max(m);
    if (threadIdx.x == 0) row_max[row] = m;
}

template <typename T>
__device__ void shard_stats(float* sum_exp, float* target_logit, float* sum_logits, const T* logits,
                            const float* row_max, const long long* targets, long long n_rows, int W, int n_valid) {
    constexpr int P = Packed128<T>::size;
    const long long row = blockIdx.x;
    if (row >= n_rows) return;
    const T* lr = logits + row * W;
    const float m = row_max[row];
    float se = 0.0f, sl = 0.0f;
    for (int c0 = threadIdx.x * P; c0 < n_valid; c0 += blockDim.x * P) {
        float v[P];
        load_chunk<P, true>(v, lr + c0, n_valid - c0);
#pragma unroll
        for (int k = 0; k < P; ++k) {
            if (c0 + k < n_valid) {
                se += expf(v[k] - m);
                sl += v[k];
            }
        }
    }
    block_reduce_sum2(se, sl);
    if (threadIdx.x == 0) {
        sum_exp[row] = se;
        if (sum_logits != nullptr) sum_logits[row] = sl;
        const long long t = targets[row];
        target_logit[row] = (t >= 0 && t < n_valid) ? to_float(lr[t]) : 0.0f;
    }
}

// out[row, j] for j < n_valid: row_scale * (exp(logit - max) / sum_exp - (1 - eps) [j == target]
// - eps / n_classes), evaluated in the order of cutp.ops (coef = row_scale / sum_exp first);
// padded columns and rows with row_scale == 0 (ignored rows) are exact zeros.
template <typename T>
__device__ void shard_backward(T* out, const T* logits, const float* row_max, const float* sum_exp,
                               const long long* targets, const float* row_scale, long long n_rows, int W,
                               int n_valid, float smooth_frac, float one_minus_eps) {
    constexpr int P = Packed128<T>::size;
    const long long row = blockIdx.x;
    if (row >= n_rows) return;
    const long long off = row * W;
    const float scale = row_scale[row];
    const float m = row_max[row];
    const float coef = scale / sum_exp[row];
    const float smooth = scale * smooth_frac;
    const float hit = scale * one_minus_eps;
    const long long t = targets[row];
    for (int c0 = threadIdx.x * P; c0 < W; c0 += blockDim.x * P) {
        float v[P];
        if (scale != 0.0f && c0 < n_valid) {
            load_chunk<P, true>(v, logits + off + c0, n_valid - c0);
#pragma unroll
            for (int k = 0; k < P; ++k) {
                const int j = c0 + k;
                float d = expf(v[k] - m) * coef - smooth;
                if (j == t) d -= hit;
                v[k] = j < n_valid ? d : 0.0f;
            }
        } else {
#pragma unroll
            for (int k = 0; k < P; ++k) v[k] = 0.0f;
        }
        store_chunk<P, true>(out + off + c0, v, W - c0);
    }
}

}  // namespace ce_impl

extern "C" __global__ void __launch_bounds__(1024) ce_shard_max_f32(
    float* row_max, const float* logits, long long n_rows, int W, int n_valid) {
    ce_impl::shard_max(row_max, logits, n_rows, W, n_valid);
}
extern "C" __global__ void __launch_bounds__(1024) ce_shard_max_bf16(
    float* row_max, const __nv_bfloat16* logits, long long n_rows, int W, int n_valid) {
    ce_impl::shard_max(row_max, logits, n_rows, W, n_valid);
}

// sum_logits may be null (no label smoothing).
extern "C" __global__ void __launch_bounds__(1024) ce_shard_stats_f32(
    float* sum_exp, float* target_logit, float* sum_logits, const float* logits, const float* row_max,
    const long long* targets, long long n_rows, int W, int n_valid) {
    ce_impl::shard_stats(sum_exp, target_logit, sum_logits, logits, row_max, targets, n_rows, W, n_valid);
}
extern "C" __global__ void __launch_bounds__(1024) ce_shard_stats_bf16(
    float* sum_exp, float* target_logit, float* sum_logits, const __nv_bfloat16* logits, const float* row_max,
    const long long* targets, long long n_rows, int W, int n_valid) {
    ce_impl::shard_stats(sum_exp, target_logit, sum_logits, logits, row_max, targets, n_rows, W, n_valid);
}

// out may be the logits themselves (in place): each element is read and then written by one thread.
extern "C" __global__ void __launch_bounds__(1024) ce_shard_backward_f32(
    float* out, const float* logits, const float* row_max, const float* sum_exp, const long long* targets,
    const float* row_scale, long long n_rows, int W, int n_valid, float smooth_frac, float one_minus_eps) {
    ce_impl::shard_backward(out, logits, row_max, sum_exp, targets, row_scale, n_rows, W, n_valid, smooth_frac,
                            one_minus_eps);
}
extern "C" __global__ void __launch_bounds__(1024) ce_shard_backward_bf16(
    __nv_bfloat16* out, const __nv_bfloat16* logits, const float* row_max, const float* sum_exp,
    const long long* targets, const float* row_scale, long long n_rows, int W, int n_valid, float smooth_frac,
    float one_minus_eps) {
    ce_impl::shard_backward(out, logits, row_max, sum_exp, targets, row_scale, n_rows, W, n_valid, smooth_frac,
                            one_minus_eps);
}
