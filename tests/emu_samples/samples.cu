// Sample kernels for tests/cuda_emu/test_emulator.py: correct CUDA exercising every feature the emulator
// models. They follow the conventions of kernels/README.md and also compile with nvcc.
#include "common.cuh"

// ---- elementwise with a tail ------------------------------------------------------------------
template <typename T>
__device__ void scale_add(T* out, const T* x, const T* y, float a, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = from_float<T>(a * to_float(x[i]) + to_float(y[i]));
}
extern "C" __global__ void scale_add_f32(float* out, const float* x, const float* y, float a, long long n) {
    scale_add(out, x, y, a, n);
}
extern "C" __global__ void scale_add_bf16(__nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* y,
                                          float a, long long n) {
    scale_add(out, x, y, a, n);
}

// Grid-stride loop: any grid size covers any n.
extern "C" __global__ void scale_inplace_f32(float* x, float a, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= a;
}

// Optional pointer: bias may be null.
extern "C" __global__ void add_bias_f32(float* out, const float* x, const float* bias, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + (bias != nullptr ? bias[i] : 0.0f);
}

// ---- block reductions -------------------------------------------------------------------------
// Classic shared-memory tree reduction, one partial sum per block (blockDim.x = 256).
extern "C" __global__ void tree_sum_f32(float* partial, const float* x, int n) {
    __shared__ float buf[256];
    const int tid = threadIdx.x;
    const int i = blockIdx.x * blockDim.x + tid;
    buf[tid] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) buf[tid] += buf[tid + s];
        __syncthreads();
    }
    if (tid == 0) partial[blockIdx.x] = buf[0];
}

// One row per block, through common.cuh's block_reduce_sum / block_reduce_max.
extern "C" __global__ void row_sum_max_f32(float* sums, float* maxs, const float* x, int width) {
    const float* row = x + (long long)blockIdx.x * width;
    float s = 0.0f, m = -INFINITY;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        s += row[i];
        m = fmaxf(m, row[i]);
    }
    s = block_reduce_sum(s);
    m = block_reduce_max(m);  // back-to-back calls reuse the same shared buffer
    if (threadIdx.x == 0) {
        sums[blockIdx.x] = s;
        maxs[blockIdx.x] = m;
    }
}

// Rows spread over a 2D grid (rows beyond `rows` do nothing): mean and 1/std of each row.
extern "C" __global__ void row_stats_f32(float* mean, float* rstd, const float* x, int rows, int width, float eps) {
    const int row = blockIdx.y * gridDim.x + blockIdx.x;
    if (row >= rows) return;  // uniform over the block: no thread of it reaches the barriers below
    const float* r = x + (long long)row * width;
    float s = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) s += r[i];
    const float mu = block_reduce_sum(s) / width;
    float v = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) v += (r[i] - mu) * (r[i] - mu);
    const float var = block_reduce_sum(v) / width;
    if (threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = rsqrtf(var + eps);
    }
}

// ---- dynamic shared memory --------------------------------------------------------------------
// Softmax of each row, the row cached in dynamic shared memory (shared_mem = width * 4 bytes).
extern "C" __global__ void softmax_smem_f32(float* out, const float* x, int width) {
    extern __shared__ float row_cache[];
    const float* r = x + (long long)blockIdx.x * width;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        row_cache[i] = r[i];
        m = fmaxf(m, r[i]);
    }
    m = block_reduce_max(m);  // its barrier also publishes row_cache
    float s = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        row_cache[i] = expf(row_cache[i] - m);
        s += row_cache[i];
    }
    s = block_reduce_sum(s);
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[(long long)blockIdx.x * width + i] = row_cache[i] / s;
}

// Reverses a block-sized chunk through dynamic shared memory of another element type.
extern "C" __global__ void reverse_chunks_i32(int* out, const int* x) {
    extern __shared__ int chunk[];
    const int t = threadIdx.x;
    const long long base = (long long)blockIdx.x * blockDim.x;
    chunk[t] = x[base + t];
    __syncthreads();
    out[base + t] = chunk[blockDim.x - 1 - t];
}

// ---- warp level -------------------------------------------------------------------------------
// One sum per warp of 32 consecutive elements (n may end inside a warp: those lanes add 0).
extern "C" __global__ void warp_sum_f32(float* out, const float* x, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const float v = warp_reduce_sum(i < n ? x[i] : 0.0f);  // every lane takes part in the shuffles
    if (threadIdx.x % WARP_SIZE == 0 && i < n) out[i / WARP_SIZE] = v;
}

// Every warp primitive, for comparison with a reference in Python. One block of full warps;
// out has 12 ints per thread.
extern "C" __global__ void warp_ops_probe(int* out, const int* x, int width) {
    const int t = threadIdx.x;
    const int lane = t % WARP_SIZE;
    const int v = x[t];
    int* o = out + 12 * t;
    o[0] = __shfl_sync(FULL_MASK, v, (lane * 7 + 3) % 32);
    o[1] = __shfl_sync(FULL_MASK, v, 5, width);
    o[2] = __shfl_up_sync(FULL_MASK, v, 3, width);
    o[3] = __shfl_down_sync(FULL_MASK, v, 5, width);
    o[4] = __shfl_xor_sync(FULL_MASK, v, 9, width);
    o[5] = (int)__ballot_sync(FULL_MASK, v % 3 == 0);
    o[6] = __any_sync(FULL_MASK, v == 7);
    o[7] = __all_sync(FULL_MASK, v < 45);
    o[8] = __reduce_add_sync(FULL_MASK, v);
    o[9] = __reduce_max_sync(FULL_MASK, v);
    __syncwarp();
    // Half-warp masks: the two halves exchange independently.
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    o[10] = __shfl_down_sync(half, v, 1, 16);
    o[11] = __syncthreads_count(v % 2 == 1);
}

// ---- atomics ----------------------------------------------------------------------------------
extern "C" __global__ void atomic_sum_f32(float* total, const float* x, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(total, x[i]);
}

extern "C" __global__ void histogram_i32(int* hist, unsigned long long* count, int* max_key, const int* keys,
                                         long long n, int nbins) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int k = keys[i];
    atomicAdd(&hist[((k % nbins) + nbins) % nbins], 1);
    atomicAdd(count, 1ull);
    atomicMax(max_key, k);
}

// The order in which threads of a block pass this point (to test the schedules themselves).
extern "C" __global__ void arrival_order(int* order, int* counter) {
    const int ticket = atomicAdd(counter, 1);
    order[ticket] = blockIdx.x * blockDim.x + threadIdx.x;
}

// ---- bf16 -------------------------------------------------------------------------------------
// Every way to round float -> bf16 (they must agree), and bf16 -> float.
extern "C" __global__ void f32_to_bf16(__nv_bfloat16* a, __nv_bfloat16* b, __nv_bfloat16* c, __nv_bfloat16* d,
                                       const float* x, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    a[i] = __float2bfloat16(x[i]);
    b[i] = __float2bfloat16_rn(x[i]);
    c[i] = from_float<__nv_bfloat16>(x[i]);
    d[i] = (__nv_bfloat16)x[i];
}

extern "C" __global__ void bf16_to_f32(float* a, float* b, const __nv_bfloat16* x, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    a[i] = to_float(x[i]);
    b[i] = __bfloat162float(x[i]);
}

extern "C" __global__ void bf16_mul(__nv_bfloat16* out, const __nv_bfloat16* a, const __nv_bfloat16* b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * b[i];
}

// ---- 2D / 3D grids and blocks -----------------------------------------------------------------
// Each thread records its built-in coordinates: 12 ints per thread, at its global linear id.
extern "C" __global__ void index_probe(int* out) {
    const long long block = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int* o = out + 12 * (block * (blockDim.x * blockDim.y * blockDim.z) + thread);
    o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
    o[3] = blockIdx.x;  o[4] = blockIdx.y;  o[5] = blockIdx.z;
    o[6] = blockDim.x;  o[7] = blockDim.y;  o[8] = blockDim.z;
    o[9] = gridDim.x;   o[10] = gridDim.y;  o[11] = gridDim.z;
}

// out[b, t, c] = x[b, t, c] + bias[c]: grid (ceil(C/32), ceil(T/8), B), block (32, 8).
extern "C" __global__ void add_bias_btc_f32(float* out, const float* x, const float* bias, int B, int T, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    if (b >= B || t >= T || c >= C) return;
    const long long i = ((long long)b * T + t) * C + c;
    out[i] = x[i] + __ldg(&bias[c]);
}

// ---- 128-bit accesses -------------------------------------------------------------------------
// Copies and scales 8 bf16 per thread with Packed128 (n a multiple of 8).
extern "C" __global__ void scale128_bf16(__nv_bfloat16* out, const __nv_bfloat16* x, float a, long long n) {
    const long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * Packed128<__nv_bfloat16>::size;
    if (i >= n) return;
    const Packed128<__nv_bfloat16> in = load128cs(x + i);
    Packed128<__nv_bfloat16> res;
    for (int k = 0; k < Packed128<__nv_bfloat16>::size; ++k) res[k] = from_float<__nv_bfloat16>(a * to_float(in[k]));
    store128(out + i, res);
}

// float4 loads through reinterpret_cast (n a multiple of 4).
extern "C" __global__ void scale4_f32(float* out, const float* x, float a, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (4 * i >= n) return;
    float4 v = reinterpret_cast<const float4*>(x)[i];
    v = make_float4(a * v.x, a * v.y, a * v.z, a * v.w);
    reinterpret_cast<float4*>(out)[i] = v;
}

// The device address of an argument modulo 256 (CUDA allocations are 256-byte aligned).
extern "C" __global__ void address_mod_256(long long* out, const float* p) {
    out[0] = (long long)((unsigned long long)p % 256ull);
}

// ---- the rest of the intrinsic surface (also checks, via nvcc/NVRTC, that the emulated names
// and signatures are CUDA's) -------------------------------------------------------------------
// 24 results per element.
extern "C" __global__ void math_probe_f32(float* out, const float* x, const float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float a = x[i], b = y[i];  // a in (-4, 4), b in (0.5, 4)
    float* o = out + 24 * (long long)i;
    o[0] = expf(a);          o[1] = __expf(a);         o[2] = logf(b);            o[3] = __logf(b);
    o[4] = sqrtf(b);         o[5] = rsqrtf(b);         o[6] = tanhf(a);           o[7] = erff(a);
    o[8] = fmaxf(a, b);      o[9] = fminf(a, b);       o[10] = fabsf(a);          o[11] = __fdividef(a, b);
    o[12] = powf(b, a);      o[13] = max(a, b);        o[14] = (float)min(i, 5);  o[15] = __saturatef(a);
    o[16] = normcdff(a);     o[17] = exp2f(a);         o[18] = log1pf(b);         o[19] = (float)__float2int_rn(a);
    o[20] = fmaf(a, b, 1.0f); o[21] = __int_as_float(__float_as_int(a));           o[22] = copysignf(b, a);
    o[23] = isinf(INFINITY) && isnan(NAN) ? 1.0f : 0.0f;
}

// 8 results per element.
extern "C" __global__ void bits_probe(unsigned* out, const unsigned* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned v = x[i];
    unsigned* o = out + 8 * i;
    o[0] = __popc(v);        o[1] = __clz((int)v);    o[2] = __ffs((int)v);   o[3] = __brev(v);
    o[4] = __umulhi(v, 0x9e3779b9u);                  o[5] = __popcll(0xf0f0ull * v);
    o[6] = max(v, 1000u);    o[7] = min(v, 1000u);
}

// Every atomic on one set of counters (one block): see test_all_atomics.
extern "C" __global__ void atomics_probe(int* i32, unsigned* u32, unsigned long long* u64, float* f32) {
    const int t = threadIdx.x;
    atomicAdd(&i32[0], t);
    atomicSub(&i32[1], t);
    atomicMin(&i32[2], -t);
    atomicMax(&i32[3], t);
    atomicAnd(&i32[4], ~(1 << (t % 31)));
    atomicOr(&i32[5], 1 << (t % 31));
    atomicXor(&i32[6], t);
    atomicExch(&i32[7], 42);
    atomicCAS(&i32[8], 0, t + 1);  // only the first thread to get there succeeds
    atomicInc(&u32[0], 9u);        // wraps to 0 after 9
    atomicDec(&u32[1], 1000u);
    atomicAdd(&u32[2], 2u);
    atomicAdd(&u64[0], 1ull << 33);
    atomicMax(&u64[1], (unsigned long long)t << 40);
    atomicCAS(&u64[2], 0ull, 7ull);
    atomicAdd(&f32[0], 0.5f);
    atomicExch(&f32[1], -1.0f);
}

// Shuffles of every argument type: lane i gets the value of lane i ^ 1.
extern "C" __global__ void shuffle_types_probe(float* f, double* d, long long* ll, unsigned long long* ull,
                                               __nv_bfloat16* h, __nv_bfloat162* h2) {
    const int t = threadIdx.x;
    f[t] = __shfl_xor_sync(FULL_MASK, f[t], 1);
    d[t] = __shfl_xor_sync(FULL_MASK, d[t], 1);
    ll[t] = __shfl_xor_sync(FULL_MASK, ll[t], 1);
    ull[t] = __shfl_xor_sync(FULL_MASK, ull[t], 1);
    h[t] = __shfl_xor_sync(FULL_MASK, h[t], 1);
    h2[t] = __shfl_xor_sync(FULL_MASK, h2[t], 1);
}

// ---- race-free shared-memory patterns the checked build must accept --------------------------
// Warp-synchronous exchange through shared memory, ordered by __syncwarp() (every lane writes its
// slot, the warp syncs, every lane reads its neighbour's, the warp syncs before the next write).
extern "C" __global__ void warp_exchange_syncwarp_f32(float* out, const float* x) {
    __shared__ float buf[1024];
    const int t = threadIdx.x;
    const int lane = t % WARP_SIZE, base = t - lane;
    float v = x[t];
    for (int step = 1; step < WARP_SIZE; step <<= 1) {
        buf[t] = v;
        __syncwarp();
        v += buf[base + ((lane + step) % WARP_SIZE)];
        __syncwarp();
    }
    out[t] = v;
}

// Half-warp masks: each half exchanges among its own 16 lanes only.
extern "C" __global__ void half_warp_exchange_f32(float* out, const float* x) {
    __shared__ float buf[1024];
    const int t = threadIdx.x;
    const int lane = t % WARP_SIZE;
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    buf[t] = x[t];
    __syncwarp(half);
    out[t] = buf[t - lane % 16 + (lane + 1) % 16];
}

// Shared counters updated with atomics by every thread: no race.
extern "C" __global__ void shared_atomic_histogram(int* hist, const int* keys, int n) {
    __shared__ int local[16];
    if (threadIdx.x < 16) local[threadIdx.x] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&local[keys[i] & 15], 1);
    __syncthreads();
    if (threadIdx.x < 16) atomicAdd(&hist[threadIdx.x], local[threadIdx.x]);
}

// The order in which threads pass two points separated by a __syncwarp(): 2 tickets per thread
// (to test that the warp-* schedules let a warp run ahead).
extern "C" __global__ void phase_order(int* order, int* counter) {
    const int t = threadIdx.x;
    order[2 * t] = atomicAdd(counter, 1);
    __syncwarp();
    order[2 * t + 1] = atomicAdd(counter, 1);
}

// __fdividef alone, for its documented behaviour at huge divisors.
extern "C" __global__ void fdividef_probe(float* out, const float* x, const float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __fdividef(x[i], y[i]);
}
