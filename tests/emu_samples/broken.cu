// Deliberately broken kernels: each has a bug that a GPU may or may not show, and that the
// emulator must report. tests/test_cuda_emu.py asserts that it does. (Valid CUDA: they compile.)
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

// Writes through a pointer it received as const.
extern "C" __global__ void writes_const_input(const float* x) {
    const_cast<float*>(x)[threadIdx.x] = 0.0f;
}
