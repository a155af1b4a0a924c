// common.cuh: the one shared include of every kernel in kernels/*.cu.
//
// Compiled three ways: by NVRTC (through cupy.RawModule, in production), by NVCC (compile checks),
// and by g++ against the CPU emulation in tests/cuda_emu (tests in CI, no GPU). Everything below
// the includes is plain CUDA and is the same code in all three. Conventions: kernels/README.md.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// NVRTC has no C++ standard library headers: nothing else may be included on this path.
#include <cuda_bf16.h>
#if defined(CUTP_TENSOR_CORES)  // kernels/attention.cu: nvcuda::wmma (needs crt/mma.h: kernels/runtime.py)
#include <mma.h>
#endif
#else
#include "cuda_emu.h"  // from tests/cuda_emu, on the include path of emulated builds
#endif

// NVRTC does not define the <math.h> macros.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif

// warpSize is not a constant expression in CUDA; this is, for array sizes and loop bounds.
constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

__host__ __device__ __forceinline__ long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }

// ------------------------------------------------------------------------------------------------
// float <-> storage type. Kernels compute in float and load/store T (float or __nv_bfloat16).
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
    return x;
}
// Round to nearest even; every NaN becomes the canonical bf16 NaN 0x7fff.
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// ------------------------------------------------------------------------------------------------
// Reductions. The warp versions need all 32 lanes of the warp to call them; every lane gets the
// result. The block versions need every thread of the block to call them (they contain
// __syncthreads), a block of whole warps (blockDim.x*y*z a multiple of 32), and return the result
// to every thread. The emulator reports a violation of either rule as a BarrierError.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

template <float (*WarpReduce)(float)>
__device__ __forceinline__ float block_reduce(float v, float identity) {
    __shared__ float partial[WARP_SIZE];  // one value per warp; a block has at most 32 warps
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int nwarps = (blockDim.x * blockDim.y * blockDim.z) / WARP_SIZE;
    const int lane = tid % WARP_SIZE;
    const int warp = tid / WARP_SIZE;
    v = WarpReduce(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = WarpReduce(lane < nwarps ? partial[lane] : identity);
    // partial[] is reused by the next call: no warp may write it before every warp has read it.
    __syncthreads();
    return v;
}

__device__ __forceinline__ float block_reduce_sum(float v) { return block_reduce<warp_reduce_sum>(v, 0.0f); }
__device__ __forceinline__ float block_reduce_max(float v) { return block_reduce<warp_reduce_max>(v, -INFINITY); }

// ------------------------------------------------------------------------------------------------
// 128-bit loads and stores (one instruction for 4 floats or 8 bf16). The address must be 16-byte
// aligned: arrays from the allocator are, so offsets must be multiples of 4 floats / 8 bf16.
// The `cs` variants hint "streaming, not reused" (evict first) for data read or written once.
// ------------------------------------------------------------------------------------------------
template <typename T>
struct alignas(16) Packed128 {
    static constexpr int size = 16 / sizeof(T);
    T payload[size];

    Packed128() = default;
    __device__ explicit Packed128(int4 bits) { *reinterpret_cast<int4*>(payload) = bits; }
    __device__ static Packed128 constant(T value) {
        Packed128 r;
#pragma unroll
        for (int i = 0; i < size; ++i) r.payload[i] = value;
        return r;
    }
    __device__ T& operator[](int i) { return payload[i]; }
    __device__ const T& operator[](int i) const { return payload[i]; }
    __device__ int4 get_bits() const { return *reinterpret_cast<const int4*>(payload); }
};

template <typename T>
__device__ __forceinline__ Packed128<T> load128(const T* address) {
    return Packed128<T>(*reinterpret_cast<const int4*>(address));
}
template <typename T>
__device__ __forceinline__ Packed128<T> load128cs(const T* address) {
    return Packed128<T>(__ldcs(reinterpret_cast<const int4*>(address)));
}
template <typename T>
__device__ __forceinline__ void store128(T* target, Packed128<T> value) {
    *reinterpret_cast<int4*>(target) = value.get_bits();
}
template <typename T>
__device__ __forceinline__ void store128cs(T* target, Packed128<T> value) {
    __stcs(reinterpret_cast<int4*>(target), value.get_bits());
}

// ------------------------------------------------------------------------------------------------
// Chunked accesses with a scalar fallback: the vector paths of cutp's kernels.
//
// A thread handles a chunk of N consecutive elements (N a multiple of Packed128<T>::size, usually
// exactly one 128-bit pack: 4 floats or 8 bf16). load_chunk reads the first `count` elements of
// the chunk into floats and fills the rest with `fill`: with 128-bit loads when the whole chunk is
// present and its address is 16-byte aligned, element by element otherwise (row tails, rows whose
// width is not a multiple of the pack, views at odd offsets). The test is per chunk, so a kernel
// needs no host-side alignment logic and is correct for any pointer.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ bool is_aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

template <int N, bool STREAMING = false, typename T>
__device__ __forceinline__ void load_chunk(float (&v)[N], const T* p, long long count, float fill = 0.0f) {
    constexpr int P = Packed128<T>::size;
    static_assert(N % P == 0, "a chunk is a whole number of 128-bit packs");
    if (count >= N && is_aligned16(p)) {
#pragma unroll
        for (int k = 0; k < N; k += P) {
            const Packed128<T> q = STREAMING ? load128cs(p + k) : load128(p + k);
#pragma unroll
            for (int j = 0; j < P; ++j) v[k + j] = to_float(q[j]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = k < count ? to_float(p[k]) : fill;
    }
}

// Stores the first `count` elements of v (rounded to T) at p; 128-bit stores for whole aligned chunks.
template <int N, bool STREAMING = false, typename T>
__device__ __forceinline__ void store_chunk(T* p, const float (&v)[N], long long count) {
    constexpr int P = Packed128<T>::size;
    static_assert(N % P == 0, "a chunk is a whole number of 128-bit packs");
    if (count >= N && is_aligned16(p)) {
#pragma unroll
        for (int k = 0; k < N; k += P) {
            Packed128<T> q;
#pragma unroll
            for (int j = 0; j < P; ++j) q[j] = from_float<T>(v[k + j]);
            if (STREAMING) {
                store128cs(p + k, q);
            } else {
                store128(p + k, q);
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) {
            if (k < count) p[k] = from_float<T>(v[k]);
        }
    }
}

// Two sums over the block in one round trip through shared memory (half the barriers of two
// block_reduce_sum calls). Same rules as block_reduce_sum; back-to-back calls are safe.
__device__ __forceinline__ void block_reduce_sum2(float& a, float& b) {
    __shared__ float partial2[2][WARP_SIZE];
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int nwarps = (blockDim.x * blockDim.y * blockDim.z) / WARP_SIZE;
    const int lane = tid % WARP_SIZE;
    const int warp = tid / WARP_SIZE;
    a = warp_reduce_sum(a);
    b = warp_reduce_sum(b);
    if (lane == 0) {
        partial2[0][warp] = a;
        partial2[1][warp] = b;
    }
    __syncthreads();
    a = warp_reduce_sum(lane < nwarps ? partial2[0][lane] : 0.0f);
    b = warp_reduce_sum(lane < nwarps ? partial2[1][lane] : 0.0f);
    __syncthreads();
}

// Row kernels run in one of two shapes, chosen by the host per launch: a warp per row (short
// rows: no shared memory, no barriers, several rows per block) or the whole block per row (long
// rows). A "group" is that warp or that block; these reduce over it. The choice is uniform over a
// block, so the barriers inside the block versions are reached by every thread.
template <bool BLOCK>
__device__ __forceinline__ float group_reduce_sum(float v) {
    if constexpr (BLOCK) {
        return block_reduce_sum(v);
    } else {
        return warp_reduce_sum(v);
    }
}
template <bool BLOCK>
__device__ __forceinline__ float group_reduce_max(float v) {
    if constexpr (BLOCK) {
        return block_reduce_max(v);
    } else {
        return warp_reduce_max(v);
    }
}
template <bool BLOCK>
__device__ __forceinline__ void group_reduce_sum2(float& a, float& b) {
    if constexpr (BLOCK) {
        block_reduce_sum2(a, b);
    } else {
        a = warp_reduce_sum(a);
        b = warp_reduce_sum(b);
    }
}

// The norms' backward (layernorm.cu, rmsnorm.cu) runs 2-D blocks (threads per row, R): R "row
// groups", the threads with one threadIdx.y (whole warps, as blockDim.x is a multiple of 32),
// each on its own row. These reduce over a row group, every thread of it getting the sums; the
// warps' sums added in a fixed order. A barrier for every thread of the block, then a trailing
// one (back-to-back calls are safe).
__device__ __forceinline__ float row_group_reduce_sum(float a) {
    __shared__ float part[WARP_SIZE];  // one per warp; a block has at most 32 warps
    const int lane = threadIdx.x % WARP_SIZE;
    const int nw = blockDim.x / WARP_SIZE;  // warps per row group
    const int w0 = threadIdx.y * (blockDim.x / WARP_SIZE);  // the group's first warp in the block
    a = warp_reduce_sum(a);
    if (lane == 0) part[w0 + threadIdx.x / WARP_SIZE] = a;
    __syncthreads();
    a = 0.0f;
    for (int i = 0; i < nw; ++i) a += part[w0 + i];
    __syncthreads();
    return a;
}
__device__ __forceinline__ void row_group_reduce_sum2(float& a, float& b) {
    __shared__ float part[2][WARP_SIZE];  // one pair per warp
    const int lane = threadIdx.x % WARP_SIZE;
    const int nw = blockDim.x / WARP_SIZE;
    const int w0 = threadIdx.y * (blockDim.x / WARP_SIZE);
    a = warp_reduce_sum(a);
    b = warp_reduce_sum(b);
    if (lane == 0) {
        part[0][w0 + threadIdx.x / WARP_SIZE] = a;
        part[1][w0 + threadIdx.x / WARP_SIZE] = b;
    }
    __syncthreads();
    a = 0.0f;
    b = 0.0f;
    for (int i = 0; i < nw; ++i) {
        a += part[0][w0 + i];
        b += part[1][w0 + i];
    }
    __syncthreads();
}

// out[c] = the sum over the block's row groups y, in order, of acc[y * stride + c] (c < C): the
// block's partial of a parameter gradient from its groups' accumulators in shared memory (call
// after a barrier; every thread of the block takes a share of the columns).
__device__ __forceinline__ void sum_row_groups(float* out, const float* acc, long long stride, int C) {
    const int nthreads = blockDim.x * blockDim.y;
    for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < C; c += nthreads) {
        float sum = 0.0f;
        for (int y = 0; y < (int)blockDim.y; ++y) sum += acc[(long long)y * stride + c];
        out[c] = sum;
    }
}

// The row of this thread's group, its index in the group and the group size (1-D blocks).
template <bool BLOCK>
struct RowGroup {
    long long row;
    int tid;
    int size;
    __device__ RowGroup()
        : row(BLOCK ? (long long)blockIdx.x
                    : (long long)blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE),
          tid(BLOCK ? (int)threadIdx.x : (int)(threadIdx.x % WARP_SIZE)),
          size(BLOCK ? (int)blockDim.x : WARP_SIZE) {}
};

// ------------------------------------------------------------------------------------------------
// Dropout's keep decision (kernels/dropout.cu, and the fused attention's probability dropout): the
// (offset + i)-th output of SplitMix64 seeded with `seed`, top 24 bits compared with the integer
// threshold ceil(p * 2^24): no floating point, so every platform agrees exactly with
// cutp.ops.dropout_mask.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ bool dropout_keep(unsigned long long seed, unsigned long long offset, unsigned long long i,
                                             unsigned int threshold) {
    unsigned long long z = seed + (offset + i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (unsigned int)(z >> 40) >= threshold;
}
