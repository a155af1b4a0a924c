// Fused AdamW over the flat parameter buffer (cutp.optim.FlatParameters): one launch updates
// every parameter of the model. Per element, exactly the arithmetic of cutp.ops.adamw_update, in
// the same order, in float (m and v are float32; params, grads and the decay mask are T):
//   g = grad * grad_scale
//   m = m * beta1 + (1 - beta1) * g;   v = v * beta2 + (g * g) * (1 - beta2)
//   p = p * (1 - lr_wd * decay_mask)                      (only when weight decay is on; no mask:
//                                                          every element decays)
//   p = p - (m / (sqrt(v) * inv_sqrt_bc2 + eps)) * step_size
// Bias corrections are folded into step_size = lr / (1 - beta1^t) and inv_sqrt_bc2 =
// 1 / sqrt(1 - beta2^t) on the host. Memory bound: one 128-bit chunk per thread per array.
#include "common.cuh"

namespace adamw_impl {

template <typename T>
__device__ void update(T* p, float* m, float* v, const T* grad, const T* decay_mask, long long n, float beta1,
                       float one_minus_beta1, float beta2, float one_minus_beta2, float lr_wd, int decay,
                       float eps, float step_size, float inv_sqrt_bc2, float grad_scale) {
    constexpr int P = Packed128<T>::size;
    const long long i0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * P;
    if (i0 >= n) return;
    const long long count = n - i0;
    float pv[P], gv[P], mv[P], vv[P], dm[P];
    load_chunk<P, true>(gv, grad + i0, count);
    load_chunk(pv, p + i0, count);
    load_chunk(mv, m + i0, count);
    load_chunk(vv, v + i0, count);
    if (decay && decay_mask) load_chunk<P, true>(dm, decay_mask + i0, count);
#pragma unroll
    for (int k = 0; k < P; ++k) {
        const float g = __fmul_rn(gv[k], grad_scale);
        mv[k] = __fadd_rn(__fmul_rn(mv[k], beta1), __fmul_rn(one_minus_beta1, g));
        vv[k] = __fadd_rn(__fmul_rn(vv[k], beta2), __fmul_rn(__fmul_rn(g, g), one_minus_beta2));
        float pk = pv[k];
        if (decay) pk = __fmul_rn(pk, __fsub_rn(1.0f, decay_mask ? __fmul_rn(lr_wd, dm[k]) : lr_wd));
        const float denom = __fadd_rn(__fmul_rn(sqrtf(vv[k]), inv_sqrt_bc2), eps);
        pv[k] = __fsub_rn(pk, __fmul_rn(mv[k] / denom, step_size));
    }
    store_chunk(p + i0, pv, count);
    store_chunk(m + i0, mv, count);
    store_chunk(v + i0, vv, count);
}

}  // namespace adamw_impl

// decay: 0 skips the decay term (weight_decay == 0). A null decay_mask decays every element
// (cutp.optim updates the decayed parameters as one range and the others with decay 0).
// The _rn intrinsics keep NVRTC from contracting into FMAs: float32 results equal the CuPy
// reference composition (separate elementwise kernels) bit for bit, up to sqrt/division, which
// are IEEE-rounded in both.
extern "C" __global__ void __launch_bounds__(256) adamw_update_f32(
    float* p, float* m, float* v, const float* grad, const float* decay_mask, long long n, float beta1,
    float one_minus_beta1, float beta2, float one_minus_beta2, float lr_wd, int decay, float eps, float step_size,
    float inv_sqrt_bc2, float grad_scale) {
    adamw_impl::update(p, m, v, grad, decay_mask, n, beta1, one_minus_beta1, beta2, one_minus_beta2, lr_wd, decay,
                       eps, step_size, inv_sqrt_bc2, grad_scale);
}
extern "C" __global__ void __launch_bounds__(256) adamw_update_bf16(
    __nv_bfloat16* p, float* m, float* v, const __nv_bfloat16* grad, const __nv_bfloat16* decay_mask, long long n,
    float beta1, float one_minus_beta1, float beta2, float one_minus_beta2, float lr_wd, int decay, float eps,
    float step_size, float inv_sqrt_bc2, float grad_scale) {
    adamw_impl::update(p, m, v, grad, decay_mask, n, beta1, one_minus_beta1, beta2, one_minus_beta2, lr_wd, decay,
                       eps, step_size, inv_sqrt_bc2, grad_scale);
}
