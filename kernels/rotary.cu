// Rotary position embedding (RoPE) in HF's rotate_half layout, applied to q and k heads in place
// (or into out), forward (R x) and backward (R^T dy), from global position ids and the
// precomputed float32 cos/sin tables (cutp.ops.rope_tables: llama3 / linear scaling is in them).
//
// x is [B, T, H, D] with any strides in elements for B, T and H and a contiguous head dim: the Q
// and K heads of a fused QKV buffer ([B, T, nq + nkv, D], row stride (nq + 2 nkv) D) go in as they
// are, GQA or not (the kernel sees heads, not which are queries). Over the first rd elements of
// the head dim, element i pairs with i + rd/2, both turned by the angle of the token's position:
//   y1 = c1 x1 - s1 x2,  y2 = s2 x1 + c2 x2      (R^T: y1 = c1 x1 + s2 x2,  y2 = c2 x2 - s1 x1)
// with c1/c2, s1/s2 the table row's two halves (equal for HF's tables). Elements past rd pass
// unchanged (copied when out is not x). The table row of token (b, t) is pos[b * pos_bs + t]
// (pos_bs 0: positions [T] shared by the batch) or, without position ids, b * tab_bs + t
// (per-token tables [T, rd] or [B, T, rd]).
//
// A thread handles one 128-bit chunk (4 floats / 8 bf16) of a head's first half and the matching
// chunk of its second half: it reads both before writing either, and no other thread touches
// them, so out may be x. Tail chunks (past rd) follow the rotated ones in each head.
#include "common.cuh"

namespace rotary_impl {

template <typename T>
__device__ void rotate(T* out, const T* x, const float* cos, const float* sin, const long long* pos, long long n,
                       int T_, int H, int D, int rd, long long xsb, long long xst, long long xsh, long long osb,
                       long long ost, long long osh, long long pos_bs, long long tab_bs, int transpose,
                       int copy_tail) {
    constexpr int P = Packed128<T>::size;
    const int hh = rd / 2;
    const int n_rot = (hh + P - 1) / P;
    const int n_tail = copy_tail ? (D - rd + P - 1) / P : 0;
    const int nc = n_rot + n_tail;
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;  // n = B * T * H * nc threads
    const long long c = i % nc;
    const long long head = i / nc;
    const long long h = head % H;
    const long long bt = head / H;
    const long long t = bt % T_;
    const long long b = bt / T_;
    const T* xh = x + b * xsb + t * xst + h * xsh;
    T* oh = out + b * osb + t * ost + h * osh;
    if (c >= n_rot) {  // past rd: copied
        const long long e0 = rd + (c - n_rot) * P;
        float v[P];
        load_chunk(v, xh + e0, D - e0);
        store_chunk(oh + e0, v, D - e0);
        return;
    }
    const long long row = pos != nullptr ? pos[b * pos_bs + t] : b * tab_bs + t;
    const float* cr = cos + row * rd;
    const float* sr = sin + row * rd;
    const long long e0 = c * P;
    const long long count = hh - e0 < P ? hh - e0 : P;
    float x1[P];
    float x2[P];
    float c1[P];
    float c2[P];
    float s1[P];
    float s2[P];
    load_chunk(x1, xh + e0, count);
    load_chunk(x2, xh + hh + e0, count);
    load_chunk(c1, cr + e0, count);
    load_chunk(c2, cr + hh + e0, count);
    load_chunk(s1, sr + e0, count);
    load_chunk(s2, sr + hh + e0, count);
    float y1[P];
    float y2[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
        if (transpose) {
            y1[k] = x1[k] * c1[k] + x2[k] * s2[k];
            y2[k] = x2[k] * c2[k] - x1[k] * s1[k];
        } else {
            y1[k] = x1[k] * c1[k] - x2[k] * s1[k];
            y2[k] = x2[k] * c2[k] + x1[k] * s2[k];
        }
    }
    store_chunk(oh + e0, y1, count);
    store_chunk(oh + hh + e0, y2, count);
}

}  // namespace rotary_impl

// One thread per 128-bit chunk of a head's rotated half (and per chunk of its tail when
// copy_tail): n = B * T * H * chunks per head threads; pos may be null (per-token tables). b
// comes from the thread index, so B itself is not a parameter.
extern "C" __global__ void __launch_bounds__(256) rotary_f32(
    float* out, const float* x, const float* cos, const float* sin, const long long* pos, long long n, int T, int H,
    int D, int rd, long long xsb, long long xst, long long xsh, long long osb, long long ost, long long osh,
    long long pos_bs, long long tab_bs, int transpose, int copy_tail) {
    rotary_impl::rotate(out, x, cos, sin, pos, n, T, H, D, rd, xsb, xst, xsh, osb, ost, osh, pos_bs, tab_bs, transpose,
                        copy_tail);
}
extern "C" __global__ void __launch_bounds__(256) rotary_bf16(
    __nv_bfloat16* out, const __nv_bfloat16* x, const float* cos, const float* sin, const long long* pos, long long n,
    int T, int H, int D, int rd, long long xsb, long long xst, long long xsh, long long osb, long long ost,
    long long osh, long long pos_bs, long long tab_bs, int transpose, int copy_tail) {
    rotary_impl::rotate(out, x, cos, sin, pos, n, T, H, D, rd, xsb, xst, xsh, osb, ost, osh, pos_bs, tab_bs, transpose,
                        copy_tail);
}
