// GeLU forward and backward, plain and fused with the bias of the preceding linear layer.
//
// All elementwise: a thread handles one 128-bit chunk (4 floats / 8 bf16), with a scalar
// fallback for tails and unaligned views. The bias gradient of the fused backward is a column sum
// over rows; to stay deterministic (no float atomics) each block writes the partial sums of its
// row chunk to a scratch buffer [n_chunks, C] that column_sum_* (reduce.cu) adds up in a fixed order.
#include "common.cuh"

namespace gelu_impl {

constexpr float K = 0.7978845608028654f;           // sqrt(2 / pi)
// Products taken in double and rounded once, as NumPy/CuPy round the Python-float constants.
constexpr float CK = (float)(0.044715 * 0.7978845608028654);         // C * K
constexpr float CK3_2 = (float)(1.5 * 0.044715 * 0.7978845608028654);  // 1.5 * C * K
constexpr float INV_SQRT2 = 0.7071067811865476f;
constexpr float INV_SQRT_2PI = 0.3989422804014327f;

// Same evaluation order as cutp.ops.gelu (tanh form: 0.5 * ((1 + tanh(u)) * x)).
__device__ __forceinline__ float gelu(float x, bool exact) {
    if (exact) return 0.5f * erfcf(-x * INV_SQRT2) * x;
    const float u = (x * x * CK + K) * x;
    return (tanhf(u) + 1.0f) * x * 0.5f;
}

// dy * gelu'(x).  tanh: gelu' = (1 + t) * (0.5 + d * (1 - t)), d = x * (0.5 K + 1.5 C K x^2).
__device__ __forceinline__ float gelu_grad(float x, float dy, bool exact) {
    if (exact) {
        const float phi = expf(x * x * -0.5f) * INV_SQRT_2PI * x;
        return (phi + 0.5f * erfcf(-x * INV_SQRT2)) * dy;
    }
    const float t = tanhf((x * x * CK + K) * x);
    const float d = (x * x * CK3_2 + 0.5f * K) * x;
    return (d * (1.0f - t) + 0.5f) * (2.0f - (1.0f - t)) * dy;
}

template <typename T>
__device__ void forward(T* out, const T* x, long long n, int exact) {
    constexpr int P = Packed128<T>::size;
    const long long i0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * P;
    if (i0 >= n) return;
    float v[P];
    load_chunk(v, x + i0, n - i0);
#pragma unroll
    for (int k = 0; k < P; ++k) v[k] = gelu(v[k], exact != 0);
    store_chunk(out + i0, v, n - i0);
}

template <typename T>
__device__ void backward(T* dx, const T* dy, const T* x, long long n, int exact) {
    constexpr int P = Packed128<T>::size;
    const long long i0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * P;
    if (i0 >= n) return;
    float a[P], g[P];
    load_chunk(a, x + i0, n - i0);
    load_chunk(g, dy + i0, n - i0);
#pragma unroll
    for (int k = 0; k < P; ++k) g[k] = gelu_grad(a[k], g[k], exact != 0);
    store_chunk(dx + i0, g, n - i0);
}

// y = gelu(x + b) over [n_rows, C]; saves the pre-activation x + b in T (for bf16 the GeLU is
// evaluated on the rounded sum, so forward and backward see the same value).
template <typename T>
__device__ void bias_forward(T* y, T* pre, const T* x, const T* bias, long long n_rows, int C, int exact) {
    constexpr int P = Packed128<T>::size;
    const long long n = n_rows * C;
    const long long i0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * P;
    if (i0 >= n) return;
    const int c0 = (int)(i0 % C);
    float v[P], b[P];
    load_chunk(v, x + i0, n - i0);
    if (C % P == 0) {  // a chunk lies inside one row: the bias is one chunk too
        load_chunk(b, bias + c0, C - c0);
    } else {
#pragma unroll
        for (int k = 0; k < P; ++k) b[k] = i0 + k < n ? to_float(bias[(c0 + k) % C]) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < P; ++k) v[k] = to_float(from_float<T>(v[k] + b[k]));
    store_chunk(pre + i0, v, n - i0);
#pragma unroll
    for (int k = 0; k < P; ++k) v[k] = gelu(v[k], exact != 0);
    store_chunk(y + i0, v, n - i0);
}

// dx = dy * gelu'(pre) over [n_rows, C], and (if partial != null) the column sums of dx over this
// block's rows into partial[blockIdx.y, :]. Grid: x over column chunks (P columns per thread,
// coalesced along the row), y over row chunks of rows_per_chunk rows. Each thread keeps its P
// column sums in registers while walking down its rows, so no shared memory and no barriers.
template <typename T>
__device__ void bias_backward(T* dx, float* partial, const T* dy, const T* pre, long long n_rows, int C,
                              int rows_per_chunk, int exact) {
    constexpr int P = Packed128<T>::size;
    const int c0 = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) * P);
    if (c0 >= C) return;
    const int count = C - c0 < P ? C - c0 : P;
    const long long r0 = (long long)blockIdx.y * rows_per_chunk;
    const long long r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    float acc[P];
#pragma unroll
    for (int k = 0; k < P; ++k) acc[k] = 0.0f;
    for (long long r = r0; r < r1; ++r) {
        const long long off = r * C + c0;
        float a[P], g[P];
        load_chunk(a, pre + off, count);
        load_chunk(g, dy + off, count);
#pragma unroll
        for (int k = 0; k < P; ++k) {
            g[k] = gelu_grad(a[k], g[k], exact != 0);
            acc[k] += g[k];
        }
        store_chunk(dx + off, g, count);
    }
    if (partial != nullptr) {
        float* out = partial + (long long)blockIdx.y * C + c0;
#pragma unroll
        for (int k = 0; k < P; ++k) {
            if (k < count) out[k] = acc[k];
        }
    }
}

}  // namespace gelu_impl

extern "C" __global__ void __launch_bounds__(256) gelu_forward_f32(float* out, const float* x, long long n, int exact) {
    gelu_impl::forward(out, x, n, exact);
}
extern "C" __global__ void __launch_bounds__(256) gelu_forward_bf16(
    __nv_bfloat16* out, const __nv_bfloat16* x, long long n, int exact) {
    gelu_impl::forward(out, x, n, exact);
}

extern "C" __global__ void __launch_bounds__(256) gelu_backward_f32(
    float* dx, const float* dy, const float* x, long long n, int exact) {
    gelu_impl::backward(dx, dy, x, n, exact);
}
extern "C" __global__ void __launch_bounds__(256) gelu_backward_bf16(
    __nv_bfloat16* dx, const __nv_bfloat16* dy, const __nv_bfloat16* x, long long n, int exact) {
    gelu_impl::backward(dx, dy, x, n, exact);
}

extern "C" __global__ void __launch_bounds__(256) bias_gelu_forward_f32(
    float* y, float* pre, const float* x, const float* bias, long long n_rows, int C, int exact) {
    gelu_impl::bias_forward(y, pre, x, bias, n_rows, C, exact);
}
extern "C" __global__ void __launch_bounds__(256) bias_gelu_forward_bf16(
    __nv_bfloat16* y, __nv_bfloat16* pre, const __nv_bfloat16* x, const __nv_bfloat16* bias, long long n_rows, int C,
    int exact) {
    gelu_impl::bias_forward(y, pre, x, bias, n_rows, C, exact);
}

extern "C" __global__ void __launch_bounds__(256) bias_gelu_backward_f32(
    float* dx, float* partial, const float* dy, const float* pre, long long n_rows, int C, int rows_per_chunk,
    int exact) {
    gelu_impl::bias_backward(dx, partial, dy, pre, n_rows, C, rows_per_chunk, exact);
}
extern "C" __global__ void __launch_bounds__(256) bias_gelu_backward_bf16(
    __nv_bfloat16* dx, float* partial, const __nv_bfloat16* dy, const __nv_bfloat16* pre, long long n_rows, int C,
    int rows_per_chunk, int exact) {
    gelu_impl::bias_backward(dx, partial, dy, pre, n_rows, C, rows_per_chunk, exact);
}
