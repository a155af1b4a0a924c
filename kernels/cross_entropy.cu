// The rank-local half of the vocab-parallel cross-entropy (cutp.ops.cross_entropy's ce_shard_*).
//
// One block per row, as llm.c's fused classifier: a row of the logits shard is tens of thousands
// of columns, read with 128-bit loads and reduced over the block. Only the first n_valid columns
// are real classes; the rest is vocabulary padding: never part of the softmax, gradient 0.
// Two passes over the logits per training step, one per kernel:
//   ce_shard_forward  online softmax: the shard's row max and sum exp(logit - that max), fused
//                     with the sum of logits (label smoothing; optional) and the target logit
//                     (0 where the target is in another shard or ignored); the ranks combine
//                     their (max, sum) pairs on [rows] vectors (cutp.ops.ce_shard_forward);
//   ce_shard_backward (softmax - (1 - eps) onehot - eps / n_classes) * row_scale with the global
//                     max and sum, written over the logits in place (out may be logits): no
//                     probability tensor is ever stored.
// Offsets are 64-bit: rows x vocabulary exceeds 2^31 elements at realistic sizes.
#include "common.cuh"

namespace ce_impl {

// One pass over a row's valid columns: an online softmax. Each thread keeps a running max m and
// the sum s of exp(logit - m) of its chunks, rescaling s by exp(m_old - m_new) when a chunk raises
// the max; the block then merges the threads' (m, s): M = max m, S = sum s * exp(m - M), with
// (-inf, 0) (a thread that saw no finite logit) contributing 0 instead of exp(-inf - -inf) = NaN.
// In the same pass: the sum of the logits (label smoothing; sum_logits may be null) and the target
// logit, taken from the chunk that holds it (no second read). Outputs per row: the shard's local
// max (-inf when n_valid is 0), the sum of exps relative to it (0 then), the target logit (0 where
// the target is -1 or outside the shard), the sum of logits.
template <typename T>
__device__ void shard_forward(float* row_max, float* sum_exp, float* target_logit, float* sum_logits,
                              const T* logits, const long long* targets, long long n_rows, int W, int n_valid) {
    constexpr int P = Packed128<T>::size;
    const long long row = blockIdx.x;
    if (row >= n_rows) return;
    const T* lr = logits + row * W;
    const long long t = targets[row];
    float m = -INFINITY, s = 0.0f, sl = 0.0f, tl = 0.0f;
    bool mine = false;  // this thread read the target logit
    for (int c0 = threadIdx.x * P; c0 < n_valid; c0 += blockDim.x * P) {
        float v[P];
        load_chunk<P, true>(v, lr + c0, n_valid - c0, -INFINITY);
        float cm = -INFINITY;
#pragma unroll
        for (int k = 0; k < P; ++k) cm = fmaxf(cm, v[k]);
        if (cm > m) {
            s *= expf(m - cm);  // m = -inf: s is 0 and stays 0
            m = cm;
        }
#pragma unroll
        for (int k = 0; k < P; ++k) {
            if (c0 + k < n_valid) {
                if (m != -INFINITY) s += expf(v[k] - m);  // m = -inf: every logit so far is -inf
                sl += v[k];
                if (c0 + k == t) {
                    tl = v[k];
                    mine = true;
                }
            }
        }
    }
    const float M = block_reduce_max(m);
    float se = m == -INFINITY ? 0.0f : s * expf(m - M);
    block_reduce_sum2(se, sl);
    if (threadIdx.x == 0) {
        row_max[row] = M;
        sum_exp[row] = se;
        if (sum_logits != nullptr) sum_logits[row] = sl;
        if (t < 0 || t >= n_valid) target_logit[row] = 0.0f;
    }
    if (mine) target_logit[row] = tl;
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

// sum_logits may be null (no label smoothing).
extern "C" __global__ void __launch_bounds__(1024) ce_shard_forward_f32(
    float* row_max, float* sum_exp, float* target_logit, float* sum_logits, const float* logits,
    const long long* targets, long long n_rows, int W, int n_valid) {
    ce_impl::shard_forward(row_max, sum_exp, target_logit, sum_logits, logits, targets, n_rows, W, n_valid);
}
extern "C" __global__ void __launch_bounds__(1024) ce_shard_forward_bf16(
    float* row_max, float* sum_exp, float* target_logit, float* sum_logits, const __nv_bfloat16* logits,
    const long long* targets, long long n_rows, int W, int n_valid) {
    ce_impl::shard_forward(row_max, sum_exp, target_logit, sum_logits, logits, targets, n_rows, W, n_valid);
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
