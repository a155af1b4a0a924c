// Deliberately broken kernels: each has a bug that a GPU may or may not show, and that the
// emulator must report. tests/cuda_emu/test_emulator.py asserts that it does. (Valid CUDA: they compile.)
#include "common.cuh"
#if defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#include <assert.h>  // NVCC only: NVRTC has no <assert.h> (see kernels/README.md)
#endif

// Tail bound off by one: thread n writes out[n]. Caught by the guard region after `out`.
extern "C" __global__ void tail_off_by_one_f32(float* out, const float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = 2.0f * x[i < n ? i : 0];
}

// Writes one element before the start. Caught by the guard region before `out`.
extern "C" __global__ void write_before_start_f32(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i - 1] = 1.0f;
}

// Tree reduction without the barrier between steps: a thread reads buf[tid + s] before its owner
// has added into it. Wrong under the forward schedule (right under reverse, by luck).
extern "C" __global__ void tree_sum_missing_sync_f32(float* partial, const float* x, int n) {
    __shared__ float buf[256];
    const int tid = threadIdx.x;
    const int i = blockIdx.x * blockDim.x + tid;
    buf[tid] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) buf[tid] += buf[tid + s];
        // missing __syncthreads();
    }
    if (tid == 0) partial[blockIdx.x] = buf[0];
}

// No barrier between writing shared memory and reading another thread's slot: the reader may
// see the poison pattern (NaN) of a slot not written yet.
extern "C" __global__ void neighbour_missing_sync_f32(float* out, const float* x) {
    __shared__ float buf[256];
    const int t = threadIdx.x;
    buf[t] = x[blockIdx.x * blockDim.x + t];
    // missing __syncthreads();
    out[blockIdx.x * blockDim.x + t] = buf[(t + 1) % blockDim.x];
}

// Reads a shared slot that no thread ever writes (the last thread reads buf[blockDim.x]).
extern "C" __global__ void uninitialized_shared_f32(float* out, const float* x) {
    __shared__ float buf[257];
    const int t = threadIdx.x;
    buf[t] = x[t];
    __syncthreads();
    out[t] = buf[t + 1];
}

// Legacy warp-synchronous reduction: relies on the 32 lanes running in lockstep (no __syncwarp),
// which no GPU since Volta guarantees.
extern "C" __global__ void warp_lockstep_sum_f32(float* out, const float* x) {
    __shared__ float buf[64];
    const int t = threadIdx.x;  // one warp
    buf[t] = x[t];
    buf[t + 32] = 0.0f;
    volatile float* v = buf;
    for (int s = 16; s > 0; s >>= 1) v[t] += v[t + s];  // missing __syncwarp() around each step
    if (t == 0) out[0] = v[0];
}

// __syncthreads() inside a branch that only half of the block takes.
extern "C" __global__ void divergent_syncthreads_f32(float* out) {
    if (threadIdx.x < blockDim.x / 2) __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// The tail threads return before a barrier the others wait at.
extern "C" __global__ void early_exit_before_barrier_f32(float* out, const float* x, int n) {
    __shared__ float buf[256];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    buf[threadIdx.x] = x[i];
    __syncthreads();
    out[i] = buf[0];
}

// Two different __syncthreads() call sites, one per half of the block.
extern "C" __global__ void different_barriers_f32(float* out) {
    if (threadIdx.x % 2 == 0) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}

// The two halves of the warp shuffle at different call sites.
extern "C" __global__ void divergent_shuffle_f32(float* out, const float* x) {
    float v = x[threadIdx.x];
    if (threadIdx.x % 32 < 16) {
        v += __shfl_xor_sync(FULL_MASK, v, 1);
    } else {
        v -= __shfl_xor_sync(FULL_MASK, v, 1);
    }
    out[threadIdx.x] = v;
}

// Full-mask warp reduction: fine with full warps, an incomplete warp if blockDim is not a
// multiple of 32.
extern "C" __global__ void warp_sum_any_block_f32(float* out, const float* x) {
    out[threadIdx.x] = warp_reduce_sum(x[threadIdx.x]);
}

// Writes past the dynamic shared memory size it was launched with (uses blockDim.x + 1 floats).
extern "C" __global__ void dynamic_smem_overflow_f32(float* out) {
    extern __shared__ float smem[];
    smem[threadIdx.x + 1] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = smem[threadIdx.x + 1];
}

// Reads far outside its array: a crash on the CPU, reported as KernelFault.
extern "C" __global__ void wild_read_f32(float* out, const float* x) {
    out[threadIdx.x] = x[threadIdx.x + (1ll << 42)];
}

// Waits for a flag that nobody sets.
extern "C" __global__ void spin_wait(volatile int* flag) {
    while (flag[0] == 0) {
    }
}

extern "C" __global__ void device_assert(const int* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) assert(x[i] >= 0);
}

extern "C" __global__ void device_trap(const int* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && x[i] < 0) __trap();
}

extern "C" __global__ void divide_by_zero(int* out, int d) {
    out[threadIdx.x] = 100 / d;
}

// Needs far more stack than an emulated thread has.
extern "C" __global__ void huge_local_array(float* out, int n) {
    float big[1 << 16];  // 256 KiB: all of an emulated thread's default stack (a GPU allows 512 KiB)
    for (int i = 0; i < n; ++i) big[i] = (float)i;
    out[0] = big[n - 1];
}

// Writes one past a thread's local array (`k <= 4`): on a GPU another register or local slot.
extern "C" __global__ void local_array_overrun_f32(float* out, const float* x, int n) {
    float v[4];
    for (int k = 0; k <= n; ++k) v[k] = x[k % 4];
    out[threadIdx.x] = v[0] + v[1] + v[2] + v[3];
}

// Writes through a pointer it received as const.
extern "C" __global__ void writes_const_input(const float* x) {
    const_cast<float*>(x)[threadIdx.x] = 0.0f;
}

// ---- planted races and out-of-bounds accesses: what a checked build reports ----------------------
// (tests/cuda_emu/test_emulator.py, "Races and out-of-bounds accesses"). Each races under every schedule;
// the kind named is the one the forward schedule runs into first.

// Read after write: thread t reads its left neighbour's slot with no barrier after the writes.
extern "C" __global__ void race_raw_f32(float* out, const float* x) {
    __shared__ float buf[256];
    const int t = threadIdx.x;
    buf[t] = x[t];
    // missing __syncthreads();
    out[t] = buf[(t + blockDim.x - 1) % blockDim.x];
}

// Write after read: each thread reads slot t + 1, then the block overwrites every slot without a
// barrier between the reads and the writes (a rotation in place).
extern "C" __global__ void race_war_f32(float* out, const float* x) {
    __shared__ float buf[256];
    const int t = threadIdx.x;
    buf[t] = x[t];
    __syncthreads();
    const float right = buf[(t + 1) % blockDim.x];
    // missing __syncthreads();
    buf[t] = right;
    __syncthreads();
    out[t] = buf[t];
}

// Write after write: every thread with a positive input stores it into the same slot.
extern "C" __global__ void race_waw_f32(float* out, const float* x) {
    __shared__ float last;
    const int t = threadIdx.x;
    if (t == 0) last = 0.0f;
    __syncthreads();
    if (x[t] > 0.0f) last = x[t];
    __syncthreads();
    out[t] = last;
}

// The block reduction of common.cuh without its trailing barrier, called twice (the issue's
// survivor): a warp that runs ahead writes partial[] for the second sum while slower warps
// still read it for the first. The round schedules never let a warp run ahead, so the results
// are right under them and wrong under warp-forward / warp-reverse; a checked build reports the
// race under every schedule.
__device__ float block_sum_without_trailing_sync(float v) {
    __shared__ float partial[WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_reduce_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = warp_reduce_sum(lane < (int)(blockDim.x / WARP_SIZE) ? partial[lane] : 0.0f);
    // missing __syncthreads();
    return v;
}
extern "C" __global__ void sum_and_sumsq_missing_sync_f32(float* out, const float* x) {
    const float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    const float s = block_sum_without_trailing_sync(v);
    const float s2 = block_sum_without_trailing_sync(v * v);
    if (threadIdx.x == 0) {
        out[2 * blockIdx.x] = s;
        out[2 * blockIdx.x + 1] = s2;
    }
}

// Reads one element past the end of a static shared array (thread 31 reads buf[32]).
extern "C" __global__ void static_smem_overrun_f32(float* out, const float* x) {
    __shared__ float buf[32];
    buf[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = buf[threadIdx.x] + buf[(threadIdx.x + 1) % 33];
}

// Reads past the dynamic shared memory it was launched with (blockDim.x floats).
extern "C" __global__ void dynamic_smem_read_overrun_f32(float* out) {
    extern __shared__ float smem[];
    smem[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = smem[threadIdx.x + 1];
}

// Reads x[n] (one past the end) in the last thread: a read leaves no trace in memory, so only the
// checked build sees it.
extern "C" __global__ void tail_read_off_by_one_f32(float* out, const float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + x[i + 1];
}

// Reads one element before the start of its input: thread 0 reads x[0], then x[-1] (right
// after an in-bounds access of the same array, which the checks try first).
extern "C" __global__ void read_before_start_f32(float* out, const float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + x[i - 1];
}

// An atomic one element past the end of a shared counter array.
extern "C" __global__ void atomic_smem_overrun(int* out) {
    __shared__ int counts[4];
    if (threadIdx.x < 4) counts[threadIdx.x] = 0;
    __syncthreads();
    atomicAdd(&counts[threadIdx.x % 5], 1);
    __syncthreads();
    if (threadIdx.x < 4) out[threadIdx.x] = counts[threadIdx.x];
}
