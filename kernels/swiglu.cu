// SwiGLU on the fused [gate_r ; up_r] layout (Llama's MLP activation): y = silu(gate) * up.
//
// gate_up is [n_rows, 2F]: a row's F gate columns, then its F up columns (cutp/ops/swiglu.py).
// Elementwise over the output [n_rows, F]: a thread handles one 128-bit chunk of y (4 floats /
// 8 bf16), reading the matching chunks of the gate and the up half once; the backward reads
// gate_up and dy once and writes d_gate_up [n_rows, 2F] once. When F is a multiple of the chunk,
// a chunk lies inside one row and every access is a 128-bit one (aligned rows); otherwise an
// element-by-element path (a chunk may straddle two rows).
//
// silu(g) = g / (1 + e), e = exp(-g) with -g clamped to 80, and silu'(g) = sigmoid(g) (1 + g (1 -
// sigmoid(g))), 1 - sigmoid(g) = e sigmoid(g): the reference's formulas in its order.
#include "common.cuh"

namespace swiglu_impl {

__device__ __forceinline__ float exp_neg(float g) { return expf(fminf(-g, 80.0f)); }

__device__ __forceinline__ float swiglu(float g, float u) { return g / (exp_neg(g) + 1.0f) * u; }

// (d_gate, d_up) of y = silu(g) * u for dy.
__device__ __forceinline__ void swiglu_grad(float g, float u, float dy, float& dg, float& du) {
    const float e = exp_neg(g);
    const float sig = 1.0f / (e + 1.0f);
    dg = ((e * sig) * g + 1.0f) * sig * u * dy;
    du = sig * g * dy;
}

template <typename T>
__device__ void forward(T* y, const T* gate_up, long long n_rows, int F) {
    constexpr int P = Packed128<T>::size;
    const long long n = n_rows * F;
    const long long i0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * P;
    if (i0 >= n) return;
    float v[P];
    if (F % P == 0) {  // the chunk lies inside row r: its gate and up chunks are contiguous
        const long long r = i0 / F;
        const long long c0 = i0 - r * F;
        const T* gr = gate_up + r * 2 * F + c0;
        float g[P], u[P];
        load_chunk(g, gr, P);
        load_chunk(u, gr + F, P);
#pragma unroll
        for (int k = 0; k < P; ++k) v[k] = swiglu(g[k], u[k]);
    } else {
#pragma unroll
        for (int k = 0; k < P; ++k) {  // past n: a value store_chunk does not store
            const long long i = i0 + k;
            const long long r = i / F;
            const T* gr = gate_up + r * 2 * F + (i - r * F);
            v[k] = i < n ? swiglu(to_float(gr[0]), to_float(gr[F])) : 0.0f;
        }
    }
    store_chunk(y + i0, v, n - i0);
}

template <typename T>
__device__ void backward(T* d, const T* dy, const T* gate_up, long long n_rows, int F) {
    constexpr int P = Packed128<T>::size;
    const long long n = n_rows * F;
    const long long i0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * P;
    if (i0 >= n) return;
    float dyv[P];
    load_chunk(dyv, dy + i0, n - i0);
    if (F % P == 0) {
        const long long r = i0 / F;
        const long long c0 = i0 - r * F;
        const long long off = r * 2 * F + c0;
        float g[P], u[P], dg[P], du[P];
        load_chunk(g, gate_up + off, P);
        load_chunk(u, gate_up + off + F, P);
#pragma unroll
        for (int k = 0; k < P; ++k) swiglu_grad(g[k], u[k], dyv[k], dg[k], du[k]);
        store_chunk(d + off, dg, P);
        store_chunk(d + off + F, du, P);
    } else {
#pragma unroll
        for (int k = 0; k < P; ++k) {
            const long long i = i0 + k;
            if (i < n) {
                const long long r = i / F;
                const long long off = r * 2 * F + (i - r * F);
                float dg, du;
                swiglu_grad(to_float(gate_up[off]), to_float(gate_up[off + F]), dyv[k], dg, du);
                d[off] = from_float<T>(dg);
                d[off + F] = from_float<T>(du);
            }
        }
    }
}

}  // namespace swiglu_impl

extern "C" __global__ void __launch_bounds__(256) swiglu_forward_f32(float* y, const float* gate_up, long long n_rows,
                                                                    int F) {
    swiglu_impl::forward(y, gate_up, n_rows, F);
}
extern "C" __global__ void __launch_bounds__(256) swiglu_forward_bf16(__nv_bfloat16* y, const __nv_bfloat16* gate_up,
                                                                     long long n_rows, int F) {
    swiglu_impl::forward(y, gate_up, n_rows, F);
}

extern "C" __global__ void __launch_bounds__(256) swiglu_backward_f32(float* d_gate_up, const float* dy,
                                                                     const float* gate_up, long long n_rows, int F) {
    swiglu_impl::backward(d_gate_up, dy, gate_up, n_rows, F);
}
extern "C" __global__ void __launch_bounds__(256) swiglu_backward_bf16(
    __nv_bfloat16* d_gate_up, const __nv_bfloat16* dy, const __nv_bfloat16* gate_up, long long n_rows, int F) {
    swiglu_impl::backward(d_gate_up, dy, gate_up, n_rows, F);
}
