// cuda_emu.h: run CUDA C++ kernels on the CPU, compiled by g++ (C++20).
//
// The kernels in kernels/*.cu include kernels/common.cuh, which includes this header when the
// compiler is not NVCC/NVRTC. It provides CUDA's keywords, built-in variables, intrinsics, vector
// and bfloat16 types; the execution model (threads as fibers, blocks, barriers, warps) lives in
// cuda_emu_runtime.cpp and the Python launcher in __init__.py. kernels/README.md says what is
// modelled and what is not. This is a test harness, not a GPU: it exists to run kernel logic,
// indexing, tails, barriers and warp exchanges in CI, on machines without a GPU.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#error "cuda_emu.h is for host compilers only; NVCC/NVRTC builds include <cuda_bf16.h> (see kernels/common.cuh)"
#endif
#if __cplusplus < 202002L
#error "cuda_emu.h needs C++20 (g++ -std=c++20)"
#endif

#include <limits.h>
#include <math.h>  // libstdc++'s math.h also puts the float overloads (exp(float), ...) in the global namespace, as CUDA does
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>  // device-side printf
#include <string.h>

#include <bit>
#include <limits>
#include <source_location>
#include <type_traits>
#include <utility>

#define CUDA_EMU 1

// ---------------------------------------------------------------------------------------------
// Keywords.
// ---------------------------------------------------------------------------------------------
// The launcher finds kernels by preprocessing the sources with CUDA_EMU_SCAN defined and looking
// for these markers, so kernels produced by macros are found too.
#ifdef CUDA_EMU_SCAN
#define __global__ __cuda_emu_global__
#define __launch_bounds__(...) __cuda_emu_launch_bounds__(__VA_ARGS__)
#else
#define __global__
#define __launch_bounds__(...)
#endif
// `inline` is not implied: `__device__ inline f()` is common CUDA and `inline inline` is an error.
// The launcher compiles all sources of a module as one translation unit, as NVRTC does with a
// concatenated source, so header helpers are defined only once anyway.
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__
#define __constant__
#define __managed__
// `thread_local` gives static storage at block scope and, unlike `static`, is also valid after
// `extern`, so both `__shared__ float a[32];` and `extern __shared__ float s[];` compile
// unchanged. All threads of a block run on one OS thread, so they all see the same instance.
// The launcher defines every `extern __shared__` name as an alias of one per-launch buffer
// (as on the GPU, where they all start at the dynamic shared memory base), and fills the
// module's whole thread-local block with a poison pattern before each block runs.
// Every shared variable starts on its own 4 KiB boundary: the gap after a static array is
// shared memory that belongs to no variable, so the checked build (see cuda_emu_runtime.cpp,
// "Checks") reports an access that runs past the end of one array (up to the next boundary)
// as out of bounds, instead of letting it land in the next array.
#define __shared__ thread_local __attribute__((aligned(::cuda_emu::kSharedVarAlign)))

// ---------------------------------------------------------------------------------------------
// Built-in vector types (alignment as in CUDA's vector_types.h). may_alias because kernels
// reinterpret_cast float/bf16 arrays to float4/int4 for 128-bit accesses, which GPUs allow.
// ---------------------------------------------------------------------------------------------
#define CUDA_EMU_VEC2(T, name, align)                                                        \
    struct __attribute__((aligned(align), may_alias)) name { T x, y; };                       \
    inline constexpr name make_##name(T x, T y) { return name{x, y}; }
#define CUDA_EMU_VEC3(T, name)                                                               \
    struct __attribute__((may_alias)) name { T x, y, z; };                                    \
    inline constexpr name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define CUDA_EMU_VEC4(T, name, align)                                                        \
    struct __attribute__((aligned(align), may_alias)) name { T x, y, z, w; };                 \
    inline constexpr name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }
// The 8- and 16-byte vector types a kernel loads and stores as one instruction: a copy from or
// into one checks its address (a GPU faults on a misaligned vector access, "misaligned address";
// g++ may split the copy into 8-byte moves, which x86 executes at any address, and which the
// instrumentation sees as two aligned 8-byte accesses).
#define CUDA_EMU_VEC2_CHECKED(T, name, align)                                                \
    struct __attribute__((aligned(align), may_alias)) name {                                  \
        T x, y;                                                                               \
        name() = default;                                                                     \
        constexpr name(T x_, T y_) : x(x_), y(y_) {}                                          \
        name(const name& o, std::source_location loc = std::source_location::current())       \
            : x((::cuda_emu::detail::check_vector_access(&o, align, false, loc), o.x)), y(o.y) {} \
        name& operator=(const name& o) {                                                      \
            ::cuda_emu::detail::check_vector_access(&o, align, false, std::source_location::current()); \
            ::cuda_emu::detail::check_vector_access(this, align, true, std::source_location::current()); \
            x = o.x;                                                                          \
            y = o.y;                                                                          \
            return *this;                                                                     \
        }                                                                                     \
    };                                                                                        \
    inline constexpr name make_##name(T x, T y) { return name(x, y); }
#define CUDA_EMU_VEC4_CHECKED(T, name, align)                                                \
    struct __attribute__((aligned(align), may_alias)) name {                                  \
        T x, y, z, w;                                                                         \
        name() = default;                                                                     \
        constexpr name(T x_, T y_, T z_, T w_) : x(x_), y(y_), z(z_), w(w_) {}                \
        name(const name& o, std::source_location loc = std::source_location::current())       \
            : x((::cuda_emu::detail::check_vector_access(&o, align, false, loc), o.x)), y(o.y), z(o.z), w(o.w) {} \
        name& operator=(const name& o) {                                                      \
            ::cuda_emu::detail::check_vector_access(&o, align, false, std::source_location::current()); \
            ::cuda_emu::detail::check_vector_access(this, align, true, std::source_location::current()); \
            x = o.x;                                                                          \
            y = o.y;                                                                          \
            z = o.z;                                                                          \
            w = o.w;                                                                          \
            return *this;                                                                     \
        }                                                                                     \
    };                                                                                        \
    inline constexpr name make_##name(T x, T y, T z, T w) { return name(x, y, z, w); }

namespace cuda_emu::detail {
// Reports a misaligned vector access (a KernelFault) from a kernel thread; nothing elsewhere.
__attribute__((visibility("hidden"))) void misaligned_vector_access(const void* p, size_t align, bool write,
                                                                   const std::source_location& loc);
inline void check_vector_access(const void* p, size_t align, bool write, const std::source_location& loc) {
    if (__builtin_expect((reinterpret_cast<uintptr_t>(p) & (align - 1)) != 0, 0))
        misaligned_vector_access(p, align, write, loc);
}
}  // namespace cuda_emu::detail

CUDA_EMU_VEC2_CHECKED(float, float2, 8)
CUDA_EMU_VEC3(float, float3)
CUDA_EMU_VEC4_CHECKED(float, float4, 16)
CUDA_EMU_VEC2_CHECKED(double, double2, 16)
CUDA_EMU_VEC2_CHECKED(int, int2, 8)
CUDA_EMU_VEC3(int, int3)
CUDA_EMU_VEC4_CHECKED(int, int4, 16)
CUDA_EMU_VEC2_CHECKED(unsigned int, uint2, 8)
CUDA_EMU_VEC3(unsigned int, uint3)
CUDA_EMU_VEC4_CHECKED(unsigned int, uint4, 16)
CUDA_EMU_VEC2_CHECKED(long long, longlong2, 16)
CUDA_EMU_VEC2_CHECKED(unsigned long long, ulonglong2, 16)
CUDA_EMU_VEC2(short, short2, 4)
CUDA_EMU_VEC2(unsigned short, ushort2, 4)
CUDA_EMU_VEC4(signed char, char4, 4)
CUDA_EMU_VEC4(unsigned char, uchar4, 4)
#undef CUDA_EMU_VEC2
#undef CUDA_EMU_VEC2_CHECKED
#undef CUDA_EMU_VEC4_CHECKED
#undef CUDA_EMU_VEC3
#undef CUDA_EMU_VEC4

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ---------------------------------------------------------------------------------------------
// Runtime interface (implemented in cuda_emu_runtime.cpp, linked into every emulated module).
// ---------------------------------------------------------------------------------------------
namespace cuda_emu {

// Describes one kernel parameter to the Python launcher, which checks arguments against it.
struct ParamDesc {
    char kind;            // of the value, or of the pointee for pointers: f float, B bf16, i/u int,
                          // b bool, c char/unsigned char (raw bytes), v void, o other
    unsigned char is_pointer;
    unsigned char is_const;  // pointee is const
    unsigned char reserved;
    uint32_t size;        // sizeof the parameter itself
    uint32_t elem_size;   // sizeof one component of the value / pointee (float4 -> 4)
    uint32_t elem_count;  // components per value (float4 -> 4)
    const char* type_name;  // g++'s __PRETTY_FUNCTION__ text, parsed by the launcher
};

struct KernelDesc {
    uint32_t abi_version;
    uint32_t nparams;
    const char* name;
    void (*invoke)(void** args);  // args as for cuLaunchKernel: one pointer per parameter value
    const ParamDesc* params;
};

inline constexpr uint32_t kAbiVersion = 1;
inline constexpr size_t kSharedVarAlign = 4096;  // see __shared__

namespace detail {

struct Builtins {  // members are not named threadIdx etc.: those are macros below
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};
// One instance per module: launches are serialized and the scheduler rewrites threadIdx before
// resuming each emulated thread, so a plain global is enough (and fast under -fPIC).
extern Builtins g_builtins __attribute__((visibility("hidden")));

enum WarpOpKind : int {
    kSyncWarp = 0,
    kShflIdx,
    kShflUp,
    kShflDown,
    kShflXor,
    kBallot,
    kAny,
    kAll,
    kReduceAddU,
    kReduceAddS,
    kReduceMinU,
    kReduceMinS,
    kReduceMaxU,
    kReduceMaxS,
    kReduceAnd,
    kReduceOr,
    kReduceXor,
    kMmaSync,  // nvcuda::wmma::mma_sync: the value is a WarpCollective* (below)
    kWarpOpCount
};
// A warp operation whose completion runs `fn` once, with every lane's value (a pointer to its
// WarpCollective, null for lanes outside the mask), before any lane continues.
struct WarpCollective {
    void (*fn)(void* const* lanes);
};
enum BlockBarrierKind : int { kSyncThreads = 0, kSyncCount, kSyncAnd, kSyncOr };

__attribute__((visibility("hidden"))) int block_barrier(int kind, int predicate, const std::source_location& loc);
__attribute__((visibility("hidden"))) uint64_t warp_op(int kind, unsigned mask, uint64_t value, int arg, int width,
                                                      const std::source_location& loc);
__attribute__((visibility("hidden"))) unsigned active_mask();
__attribute__((visibility("hidden"), noreturn)) void trap(const char* what, const std::source_location& loc);
__attribute__((visibility("hidden"))) long long clock_ticks();
// Bounds check of an atomic's target (atomics are not instrumented: they never race). pc: the
// kernel code that called the atomic.
__attribute__((visibility("hidden"))) void atomic_access(const void* p, size_t size, void* pc);

inline int warp_size() { return 32; }

}  // namespace detail
}  // namespace cuda_emu

// Built-in variables: read-only views of the current emulated thread's coordinates.
#define threadIdx (static_cast<const uint3&>(::cuda_emu::detail::g_builtins.thread_idx))
#define blockIdx (static_cast<const uint3&>(::cuda_emu::detail::g_builtins.block_idx))
#define blockDim (static_cast<const dim3&>(::cuda_emu::detail::g_builtins.block_dim))
#define gridDim (static_cast<const dim3&>(::cuda_emu::detail::g_builtins.grid_dim))
// Not a constant expression, as in CUDA: `float buf[warpSize]` must not compile (-Wvla makes the
// local-array case an error too). Use a literal 32 or a constexpr of your own for array sizes.
#define warpSize (::cuda_emu::detail::warp_size())

// ---------------------------------------------------------------------------------------------
// Barriers and warp-level primitives. Each call is a scheduling point: the emulated thread
// waits until every participant has arrived at the same call site, or the launch fails with a
// description of who waits where (a divergent barrier or an incomplete warp is an error,
// never a hang).
// ---------------------------------------------------------------------------------------------
inline void __syncthreads(std::source_location loc = std::source_location::current()) {
    ::cuda_emu::detail::block_barrier(::cuda_emu::detail::kSyncThreads, 0, loc);
}
inline int __syncthreads_count(int predicate, std::source_location loc = std::source_location::current()) {
    return ::cuda_emu::detail::block_barrier(::cuda_emu::detail::kSyncCount, predicate != 0, loc);
}
inline int __syncthreads_and(int predicate, std::source_location loc = std::source_location::current()) {
    return ::cuda_emu::detail::block_barrier(::cuda_emu::detail::kSyncAnd, predicate != 0, loc);
}
inline int __syncthreads_or(int predicate, std::source_location loc = std::source_location::current()) {
    return ::cuda_emu::detail::block_barrier(::cuda_emu::detail::kSyncOr, predicate != 0, loc);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, std::source_location loc = std::source_location::current()) {
    ::cuda_emu::detail::warp_op(::cuda_emu::detail::kSyncWarp, mask, 0, 0, 32, loc);
}
inline unsigned __activemask() { return ::cuda_emu::detail::active_mask(); }

// Memory fences order memory operations between threads that run concurrently; emulated threads
// only switch at barriers and warp operations, so there is nothing to order.
inline void __threadfence_block() {}
inline void __threadfence() {}
inline void __threadfence_system() {}

// (CUDA's clock() is not provided: it would clash with the C library's clock().)
inline long long clock64() { return ::cuda_emu::detail::clock_ticks(); }
inline void __nanosleep(unsigned) {}

[[noreturn]] inline void __trap(std::source_location loc = std::source_location::current()) {
    ::cuda_emu::detail::trap("__trap() called", loc);
}
[[noreturn]] inline void __brkpt(std::source_location loc = std::source_location::current()) {
    ::cuda_emu::detail::trap("__brkpt() called", loc);
}
// A failing device assert aborts the launch and surfaces as DeviceAssertError in Python, instead
// of abort()ing the test process as the libc assert would.
#undef assert
#define assert(cond)                                                                              \
    ((cond) ? (void)0                                                                             \
            : ::cuda_emu::detail::trap("assertion failed: " #cond, std::source_location::current()))

// ---------------------------------------------------------------------------------------------
// Bit casts and integer intrinsics.
// ---------------------------------------------------------------------------------------------
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline unsigned int __float_as_uint(float x) { return std::bit_cast<unsigned int>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint_as_float(unsigned int x) { return std::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }

// ---------------------------------------------------------------------------------------------
// Float math. The standard functions (expf, logf, tanhf, erff, powf, fmaxf, ...) come from
// math.h. __expf, __fdividef and rsqrtf, approximations on a GPU, are modelled with the maximum
// error the CUDA programming guide documents: the exact result moved by a number of ulps drawn
// deterministically (a hash of the operands) from [-bound, bound]. A kernel whose test passes
// against a reference under this model does not depend on these being exact. The other fast
// intrinsics (__logf, __sinf, ...) are still the exact functions.
// ---------------------------------------------------------------------------------------------
namespace cuda_emu::detail {
// x moved by k ulps (positive: away from zero), not past zero or into inf/NaN.
inline float step_ulps(float x, int k) {
    const uint32_t b = std::bit_cast<uint32_t>(x);
    const uint32_t mag = b & 0x7fffffffu;
    if (mag >= 0x7f800000u || mag == 0) return x;  // inf, NaN, zero: as computed
    long long m = static_cast<long long>(mag) + k;
    if (m < 1) m = 1;
    if (m > 0x7f7fffffll) m = 0x7f7fffffll;
    return std::bit_cast<float>((b & 0x80000000u) | static_cast<uint32_t>(m));
}
// A deterministic draw in [-bound, bound] from the operands' bits.
inline int ulp_error(uint64_t key, uint32_t bound) {
    uint64_t z = key + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<int>(z % (2ull * bound + 1)) - static_cast<int>(bound);
}
}  // namespace cuda_emu::detail
// CUDA programming guide, "Intrinsic functions": __expf max error 2 + floor(abs(1.16 * x)) ulp;
// __fdividef 2 ulp for 2^-126 <= |y| <= 2^126, and 0 (NaN for an infinite x) for 2^126 < |y| <
// 2^128; rsqrtf ("Single-precision mathematical functions") 2 ulp.
inline float __expf(float x) {
    const float r = expf(x);
    const float bound = 2.0f + floorf(fabsf(1.16f * x));
    const uint32_t b = bound < 1e6f ? static_cast<uint32_t>(bound) : 1000000u;
    return ::cuda_emu::detail::step_ulps(r, ::cuda_emu::detail::ulp_error(std::bit_cast<uint32_t>(x), b));
}
// __tanhf (CUDA 13: PTX tanh.approx.f32, maximum relative error about 2^-11), only the mutation
// campaign's fast-math class calls it (tools/mutate_kernels.py): the exact result moved by up to
// 4096 ulps (2^-12 to 2^-11 of it), drawn from the operand's bits as __expf's.
inline float __tanhf(float x) {
    return ::cuda_emu::detail::step_ulps(tanhf(x),
                                         ::cuda_emu::detail::ulp_error(std::bit_cast<uint32_t>(x) ^ 0x5851f42d4c957f2dull, 4096));
}
inline float __fdividef(float a, float b) {
    const float ab = fabsf(b);
    if (ab > 0x1p126f && ab < INFINITY) return isinf(a) ? NAN : 0.0f;
    const uint64_t key = (static_cast<uint64_t>(std::bit_cast<uint32_t>(a)) << 32) | std::bit_cast<uint32_t>(b);
    return ::cuda_emu::detail::step_ulps(a / b, ::cuda_emu::detail::ulp_error(key ^ 0xd1b54a32d192ed03ull, 2));
}
inline float rsqrtf(float x) {
    return ::cuda_emu::detail::step_ulps(1.0f / sqrtf(x),
                                         ::cuda_emu::detail::ulp_error(std::bit_cast<uint32_t>(x) ^ 0x8cb92ba72f3d8dd7ull, 2));
}
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
inline double normcdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752); }
inline float fdividef(float a, float b) { return __fdividef(a, b); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }  // NaN -> 0
// Emulated builds contract a*b+c into FMAs as nvcc does (-ffp-contract=fast, see __init__.py).
// The _rn intrinsics are never contracted on a GPU: an empty asm makes a value opaque to g++,
// so no multiply feeds an add across it.
namespace cuda_emu::detail {
inline float no_contract(float x) {
#if defined(__x86_64__)
    asm("" : "+x"(x));
#elif defined(__aarch64__)
    asm("" : "+w"(x));
#else
    volatile float v = x;
    x = v;
#endif
    return x;
}
}  // namespace cuda_emu::detail
inline float __fadd_rn(float a, float b) {
    return ::cuda_emu::detail::no_contract(a) + ::cuda_emu::detail::no_contract(b);
}
inline float __fsub_rn(float a, float b) {
    return ::cuda_emu::detail::no_contract(a) - ::cuda_emu::detail::no_contract(b);
}
inline float __fmul_rn(float a, float b) { return ::cuda_emu::detail::no_contract(a * b); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }

namespace cuda_emu::detail {
// CUDA's float->int conversions saturate and map NaN to 0; a plain C++ cast is UB out of range.
template <class I>
inline I float_to_int_sat(double r) {
    if (r != r) return 0;
    if (r <= static_cast<double>(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
    if (r >= static_cast<double>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
    return static_cast<I>(r);
}
}  // namespace cuda_emu::detail
inline int __float2int_rn(float x) { return ::cuda_emu::detail::float_to_int_sat<int>(nearbyint(static_cast<double>(x))); }
inline int __float2int_rz(float x) { return ::cuda_emu::detail::float_to_int_sat<int>(trunc(static_cast<double>(x))); }
inline int __float2int_rd(float x) { return ::cuda_emu::detail::float_to_int_sat<int>(floor(static_cast<double>(x))); }
inline int __float2int_ru(float x) { return ::cuda_emu::detail::float_to_int_sat<int>(ceil(static_cast<double>(x))); }
inline unsigned int __float2uint_rn(float x) {
    return ::cuda_emu::detail::float_to_int_sat<unsigned int>(nearbyint(static_cast<double>(x)));
}
inline unsigned int __float2uint_rz(float x) {
    return ::cuda_emu::detail::float_to_int_sat<unsigned int>(trunc(static_cast<double>(x)));
}
inline long long __float2ll_rn(float x) {
    return ::cuda_emu::detail::float_to_int_sat<long long>(nearbyint(static_cast<double>(x)));
}
inline long long __float2ll_rz(float x) {
    return ::cuda_emu::detail::float_to_int_sat<long long>(trunc(static_cast<double>(x)));
}
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned int x) { return static_cast<float>(x); }
inline float __ll2float_rn(long long x) { return static_cast<float>(x); }
inline double __int2double_rn(int x) { return static_cast<double>(x); }

// CUDA's min/max overload set (math_functions.h), including the mixed signed/unsigned ones.
// The float versions follow fminf/fmaxf: a NaN operand yields the other operand.
#define CUDA_EMU_MINMAX(R, A, B)                                                             \
    inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); } \
    inline R max(A a, B b) { return static_cast<R>(a) > static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); }
CUDA_EMU_MINMAX(int, int, int)
CUDA_EMU_MINMAX(unsigned int, unsigned int, unsigned int)
CUDA_EMU_MINMAX(unsigned int, int, unsigned int)
CUDA_EMU_MINMAX(unsigned int, unsigned int, int)
CUDA_EMU_MINMAX(long, long, long)
CUDA_EMU_MINMAX(unsigned long, unsigned long, unsigned long)
CUDA_EMU_MINMAX(unsigned long, long, unsigned long)
CUDA_EMU_MINMAX(unsigned long, unsigned long, long)
CUDA_EMU_MINMAX(long long, long long, long long)
CUDA_EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
CUDA_EMU_MINMAX(unsigned long long, long long, unsigned long long)
CUDA_EMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef CUDA_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }

// ---------------------------------------------------------------------------------------------
// bfloat16, following cuda_bf16.h: conversions round to nearest even, every NaN becomes the
// canonical 0x7fff (CUDA's host code and cvt.rn.bf16.f32 both do this; ml_dtypes instead keeps
// the sign and gives 0x7fc0/0xffc0). Arithmetic is done in wider precision and rounded once.
// ---------------------------------------------------------------------------------------------
struct __nv_bfloat16_raw {
    unsigned short x;
};
struct __nv_bfloat16;
inline __nv_bfloat16 __float2bfloat16_rn(float f);
inline __nv_bfloat16 __double2bfloat16(double d);
inline float __bfloat162float(__nv_bfloat16 b);

namespace cuda_emu::detail {
inline constexpr unsigned short bf16_from_float_bits(uint32_t u) {
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    const uint32_t rem = u & 0xffffu;
    uint32_t r = u >> 16;
    if (rem > 0x8000u || (rem == 0x8000u && (r & 1u) != 0u)) ++r;
    return static_cast<unsigned short>(r);
}
// Integers round to bf16 in one step (int -> float -> bf16 would round twice).
inline constexpr unsigned short bf16_from_integer(unsigned long long mag, bool negative) {
    if (mag == 0) return 0;
    int msb = 63 - __builtin_clzll(mag);
    unsigned long long kept = mag;
    if (msb > 7) {
        const int shift = msb - 7;
        kept = mag >> shift;
        const unsigned long long rem = mag & ((1ull << shift) - 1);
        const unsigned long long half = 1ull << (shift - 1);
        if (rem > half || (rem == half && (kept & 1u))) ++kept;
        if (kept == 256) {
            kept = 128;
            ++msb;
        }
    } else {
        kept = mag << (7 - msb);
    }
    return static_cast<unsigned short>((negative ? 0x8000u : 0u) | (static_cast<unsigned>(msb + 127) << 7) |
                                       (static_cast<unsigned>(kept) & 0x7fu));
}
template <class I>
inline constexpr unsigned short bf16_from_int(I v) {
    if constexpr (std::is_signed_v<I>) {
        const bool neg = v < 0;
        const unsigned long long mag =
            neg ? 0ull - static_cast<unsigned long long>(static_cast<long long>(v)) : static_cast<unsigned long long>(v);
        return bf16_from_integer(mag, neg);
    } else {
        return bf16_from_integer(static_cast<unsigned long long>(v), false);
    }
}
}  // namespace cuda_emu::detail

struct __attribute__((aligned(2))) __nv_bfloat16 {
protected:
    unsigned short __x;

public:
    __nv_bfloat16() = default;
    constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
    __nv_bfloat16& operator=(const __nv_bfloat16_raw& r) {
        __x = r.x;
        return *this;
    }
    constexpr operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }

    __nv_bfloat16(float f) : __x(::cuda_emu::detail::bf16_from_float_bits(std::bit_cast<uint32_t>(f))) {}
    __nv_bfloat16(double d);
    __nv_bfloat16(short v) : __x(::cuda_emu::detail::bf16_from_int(v)) {}
    __nv_bfloat16(unsigned short v) : __x(::cuda_emu::detail::bf16_from_int(v)) {}
    __nv_bfloat16(int v) : __x(::cuda_emu::detail::bf16_from_int(v)) {}
    __nv_bfloat16(unsigned int v) : __x(::cuda_emu::detail::bf16_from_int(v)) {}
    __nv_bfloat16(long v) : __x(::cuda_emu::detail::bf16_from_int(v)) {}
    __nv_bfloat16(unsigned long v) : __x(::cuda_emu::detail::bf16_from_int(v)) {}
    __nv_bfloat16(long long v) : __x(::cuda_emu::detail::bf16_from_int(v)) {}
    __nv_bfloat16(unsigned long long v) : __x(::cuda_emu::detail::bf16_from_int(v)) {}

    operator float() const { return std::bit_cast<float>(static_cast<uint32_t>(__x) << 16); }
    explicit operator bool() const { return (__x & 0x7fffu) != 0; }
    // CUDA's integer conversions truncate toward zero, saturate, and map NaN to 0.
    operator signed char() const { return ::cuda_emu::detail::float_to_int_sat<signed char>(static_cast<float>(*this)); }
    operator unsigned char() const { return ::cuda_emu::detail::float_to_int_sat<unsigned char>(static_cast<float>(*this)); }
    operator char() const { return ::cuda_emu::detail::float_to_int_sat<char>(static_cast<float>(*this)); }
    operator short() const { return ::cuda_emu::detail::float_to_int_sat<short>(static_cast<float>(*this)); }
    operator unsigned short() const { return ::cuda_emu::detail::float_to_int_sat<unsigned short>(static_cast<float>(*this)); }
    operator int() const { return ::cuda_emu::detail::float_to_int_sat<int>(static_cast<float>(*this)); }
    operator unsigned int() const { return ::cuda_emu::detail::float_to_int_sat<unsigned int>(static_cast<float>(*this)); }
    operator long() const { return ::cuda_emu::detail::float_to_int_sat<long>(static_cast<float>(*this)); }
    operator unsigned long() const { return ::cuda_emu::detail::float_to_int_sat<unsigned long>(static_cast<float>(*this)); }
    operator long long() const { return ::cuda_emu::detail::float_to_int_sat<long long>(static_cast<float>(*this)); }
    operator unsigned long long() const {
        return ::cuda_emu::detail::float_to_int_sat<unsigned long long>(static_cast<float>(*this));
    }

    __nv_bfloat16& operator=(float f) { return *this = __nv_bfloat16(f); }
    __nv_bfloat16& operator=(double d) { return *this = __nv_bfloat16(d); }
    __nv_bfloat16& operator=(short v) { return *this = __nv_bfloat16(v); }
    __nv_bfloat16& operator=(unsigned short v) { return *this = __nv_bfloat16(v); }
    __nv_bfloat16& operator=(int v) { return *this = __nv_bfloat16(v); }
    __nv_bfloat16& operator=(unsigned int v) { return *this = __nv_bfloat16(v); }
    __nv_bfloat16& operator=(long long v) { return *this = __nv_bfloat16(v); }
    __nv_bfloat16& operator=(unsigned long long v) { return *this = __nv_bfloat16(v); }
};
typedef __nv_bfloat16 nv_bfloat16;

struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
    __nv_bfloat162() = default;
    constexpr __nv_bfloat162(const __nv_bfloat16& a, const __nv_bfloat16& b) : x(a), y(b) {}
};
typedef __nv_bfloat162 nv_bfloat162;

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return static_cast<__nv_bfloat16_raw>(h).x; }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return static_cast<short>(__bfloat16_as_ushort(h)); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) { return __nv_bfloat16_raw{x}; }
inline __nv_bfloat16 __short_as_bfloat16(short x) { return __nv_bfloat16_raw{static_cast<unsigned short>(x)}; }

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    return __nv_bfloat16_raw{::cuda_emu::detail::bf16_from_float_bits(std::bit_cast<uint32_t>(f))};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16_raw{0x7fffu};
    return __nv_bfloat16_raw{static_cast<unsigned short>(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return static_cast<float>(b); }
// double -> bf16 in one rounding: round to float with round-to-odd (keeps enough information for
// the second rounding to be correct), then to bf16 with round-to-nearest-even.
inline __nv_bfloat16 __double2bfloat16(double d) {
    if (d != d) return __nv_bfloat16_raw{0x7fffu};
    float f = static_cast<float>(d);
    if (static_cast<double>(f) != d && fabs(d) <= 3.4028234663852886e38) {
        uint32_t u = std::bit_cast<uint32_t>(f);
        if (fabs(static_cast<double>(f)) > fabs(d)) --u;  // magnitude toward zero: truncation
        u |= 1u;                                         // sticky bit
        f = std::bit_cast<float>(u);
    } else if (static_cast<double>(f) != d) {
        f = std::bit_cast<float>((std::bit_cast<uint32_t>(f) & 0x80000000u) | 0x7f7fffffu);  // beyond FLT_MAX: rounds to inf
    }
    return __float2bfloat16_rn(f);
}
inline __nv_bfloat16::__nv_bfloat16(double d) : __x(__bfloat16_as_ushort(__double2bfloat16(d))) {}

inline __nv_bfloat16 __int2bfloat16_rn(int v) { return __nv_bfloat16(v); }
inline __nv_bfloat16 __uint2bfloat16_rn(unsigned int v) { return __nv_bfloat16(v); }
inline __nv_bfloat16 __ll2bfloat16_rn(long long v) { return __nv_bfloat16(v); }
inline int __bfloat162int_rz(__nv_bfloat16 b) { return static_cast<int>(b); }
inline int __bfloat162int_rn(__nv_bfloat16 b) { return __float2int_rn(static_cast<float>(b)); }

inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(b));
}
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return __floats2bfloat162_rn(a, a); }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return make_float2(static_cast<float>(v.x), static_cast<float>(v.y)); }
inline float __low2float(__nv_bfloat162 v) { return static_cast<float>(v.x); }
inline float __high2float(__nv_bfloat162 v) { return static_cast<float>(v.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return __nv_bfloat162(a, a); }

inline bool __hisnan(__nv_bfloat16 a) { return (__bfloat16_as_ushort(a) & 0x7fffu) > 0x7f80u; }
inline int __hisinf(__nv_bfloat16 a) {
    const unsigned short u = __bfloat16_as_ushort(a);
    return u == 0x7f80u ? 1 : (u == 0xff80u ? -1 : 0);
}
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return __double2bfloat16(static_cast<double>(static_cast<float>(a)) + static_cast<float>(b)); }
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return __double2bfloat16(static_cast<double>(static_cast<float>(a)) - static_cast<float>(b)); }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return __double2bfloat16(static_cast<double>(static_cast<float>(a)) * static_cast<float>(b)); }
inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) { return __double2bfloat16(static_cast<double>(static_cast<float>(a)) / static_cast<float>(b)); }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
    return __double2bfloat16(fma(static_cast<double>(static_cast<float>(a)), static_cast<double>(static_cast<float>(b)),
                                 static_cast<double>(static_cast<float>(c))));
}
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return __ushort_as_bfloat16(static_cast<unsigned short>(__bfloat16_as_ushort(a) ^ 0x8000u)); }
inline __nv_bfloat16 __habs(__nv_bfloat16 a) { return __ushort_as_bfloat16(static_cast<unsigned short>(__bfloat16_as_ushort(a) & 0x7fffu)); }
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(fmaxf(static_cast<float>(a), static_cast<float>(b))); }
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(fminf(static_cast<float>(a), static_cast<float>(b))); }
inline __nv_bfloat16 __hmax_nan(__nv_bfloat16 a, __nv_bfloat16 b) {
    return (__hisnan(a) || __hisnan(b)) ? __ushort_as_bfloat16(0x7fffu) : __hmax(a, b);
}
inline __nv_bfloat16 __hmin_nan(__nv_bfloat16 a, __nv_bfloat16 b) {
    return (__hisnan(a) || __hisnan(b)) ? __ushort_as_bfloat16(0x7fffu) : __hmin(a, b);
}
inline bool __heq(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) == static_cast<float>(b); }
inline bool __hne(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) != static_cast<float>(b); }
inline bool __hlt(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) < static_cast<float>(b); }
inline bool __hle(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) <= static_cast<float>(b); }
inline bool __hgt(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) > static_cast<float>(b); }
inline bool __hge(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) >= static_cast<float>(b); }
inline __nv_bfloat16 hexp(__nv_bfloat16 a) { return __float2bfloat16_rn(expf(static_cast<float>(a))); }
inline __nv_bfloat16 hlog(__nv_bfloat16 a) { return __float2bfloat16_rn(logf(static_cast<float>(a))); }
inline __nv_bfloat16 hsqrt(__nv_bfloat16 a) { return __float2bfloat16_rn(sqrtf(static_cast<float>(a))); }
inline __nv_bfloat16 hrsqrt(__nv_bfloat16 a) { return __float2bfloat16_rn(1.0f / sqrtf(static_cast<float>(a))); }
inline __nv_bfloat16 hrcp(__nv_bfloat16 a) { return __float2bfloat16_rn(1.0f / static_cast<float>(a)); }

inline __nv_bfloat16 operator+(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hadd(a, b); }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hsub(a, b); }
inline __nv_bfloat16 operator*(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hmul(a, b); }
inline __nv_bfloat16 operator/(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hdiv(a, b); }
inline __nv_bfloat16& operator+=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hadd(a, b); }
inline __nv_bfloat16& operator-=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hsub(a, b); }
inline __nv_bfloat16& operator*=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hmul(a, b); }
inline __nv_bfloat16& operator/=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hdiv(a, b); }
inline __nv_bfloat16 operator+(const __nv_bfloat16& a) { return a; }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a) { return __hneg(a); }
inline __nv_bfloat16& operator++(__nv_bfloat16& a) { return a = __hadd(a, __ushort_as_bfloat16(0x3f80u)); }
inline __nv_bfloat16& operator--(__nv_bfloat16& a) { return a = __hsub(a, __ushort_as_bfloat16(0x3f80u)); }
inline bool operator==(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __heq(a, b); }
inline bool operator!=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hne(a, b); }
inline bool operator<(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hlt(a, b); }
inline bool operator<=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hle(a, b); }
inline bool operator>(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hgt(a, b); }
inline bool operator>=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hge(a, b); }

inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hadd(a.x, b.x), __hadd(a.y, b.y)); }
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hsub(a.x, b.x), __hsub(a.y, b.y)); }
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hmul(a.x, b.x), __hmul(a.y, b.y)); }
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
    return __nv_bfloat162(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y));
}
inline __nv_bfloat162 operator+(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hadd2(a, b); }
inline __nv_bfloat162 operator-(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hsub2(a, b); }
inline __nv_bfloat162 operator*(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hmul2(a, b); }

// ---------------------------------------------------------------------------------------------
// Warp shuffles, votes and reductions: real exchanges among the lanes named in `mask`.
// ---------------------------------------------------------------------------------------------
namespace cuda_emu::detail {
template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    uint64_t b = 0;
    memcpy(&b, static_cast<const void*>(&v), sizeof(T));
    return b;
}
template <class T>
inline T from_bits(uint64_t b) {
    T v;
    memcpy(static_cast<void*>(&v), &b, sizeof(T));
    return v;
}
}  // namespace cuda_emu::detail

// The exact overload set of CUDA (so that e.g. a short argument promotes to int as with nvcc).
#define CUDA_EMU_SHUFFLES(T)                                                                                 \
    inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32,                                  \
                         std::source_location loc = std::source_location::current()) {                       \
        using namespace ::cuda_emu::detail;                                                                  \
        return from_bits<T>(warp_op(kShflIdx, mask, to_bits(var), srcLane, width, loc));                     \
    }                                                                                                        \
    inline T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = 32,                        \
                            std::source_location loc = std::source_location::current()) {                    \
        using namespace ::cuda_emu::detail;                                                                  \
        return from_bits<T>(warp_op(kShflUp, mask, to_bits(var), static_cast<int>(delta), width, loc));      \
    }                                                                                                        \
    inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = 32,                      \
                              std::source_location loc = std::source_location::current()) {                  \
        using namespace ::cuda_emu::detail;                                                                  \
        return from_bits<T>(warp_op(kShflDown, mask, to_bits(var), static_cast<int>(delta), width, loc));    \
    }                                                                                                        \
    inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32,                             \
                             std::source_location loc = std::source_location::current()) {                   \
        using namespace ::cuda_emu::detail;                                                                  \
        return from_bits<T>(warp_op(kShflXor, mask, to_bits(var), laneMask, width, loc));                    \
    }
CUDA_EMU_SHUFFLES(int)
CUDA_EMU_SHUFFLES(unsigned int)
CUDA_EMU_SHUFFLES(long)
CUDA_EMU_SHUFFLES(unsigned long)
CUDA_EMU_SHUFFLES(long long)
CUDA_EMU_SHUFFLES(unsigned long long)
CUDA_EMU_SHUFFLES(float)
CUDA_EMU_SHUFFLES(double)
CUDA_EMU_SHUFFLES(__nv_bfloat16)
CUDA_EMU_SHUFFLES(__nv_bfloat162)
#undef CUDA_EMU_SHUFFLES

inline unsigned __ballot_sync(unsigned mask, int pred, std::source_location loc = std::source_location::current()) {
    return static_cast<unsigned>(::cuda_emu::detail::warp_op(::cuda_emu::detail::kBallot, mask, pred != 0, 0, 32, loc));
}
inline int __any_sync(unsigned mask, int pred, std::source_location loc = std::source_location::current()) {
    return static_cast<int>(::cuda_emu::detail::warp_op(::cuda_emu::detail::kAny, mask, pred != 0, 0, 32, loc));
}
inline int __all_sync(unsigned mask, int pred, std::source_location loc = std::source_location::current()) {
    return static_cast<int>(::cuda_emu::detail::warp_op(::cuda_emu::detail::kAll, mask, pred != 0, 0, 32, loc));
}
#define CUDA_EMU_WARP_REDUCE(name, T, kind)                                                                      \
    inline T name(unsigned mask, T value, std::source_location loc = std::source_location::current()) {          \
        using namespace ::cuda_emu::detail;                                                                      \
        return static_cast<T>(warp_op(kind, mask, static_cast<uint32_t>(value), 0, 32, loc));                   \
    }
CUDA_EMU_WARP_REDUCE(__reduce_add_sync, unsigned, kReduceAddU)
CUDA_EMU_WARP_REDUCE(__reduce_add_sync, int, kReduceAddS)
CUDA_EMU_WARP_REDUCE(__reduce_min_sync, unsigned, kReduceMinU)
CUDA_EMU_WARP_REDUCE(__reduce_min_sync, int, kReduceMinS)
CUDA_EMU_WARP_REDUCE(__reduce_max_sync, unsigned, kReduceMaxU)
CUDA_EMU_WARP_REDUCE(__reduce_max_sync, int, kReduceMaxS)
CUDA_EMU_WARP_REDUCE(__reduce_and_sync, unsigned, kReduceAnd)
CUDA_EMU_WARP_REDUCE(__reduce_or_sync, unsigned, kReduceOr)
CUDA_EMU_WARP_REDUCE(__reduce_xor_sync, unsigned, kReduceXor)
#undef CUDA_EMU_WARP_REDUCE

// ---------------------------------------------------------------------------------------------
// Atomics. Emulated threads never interleave inside an atomic (they switch only at barriers and
// warp operations), so a plain read-modify-write is atomic here. Integer adds wrap as on a GPU.
// ---------------------------------------------------------------------------------------------
namespace cuda_emu::detail {
// Not instrumented by the checked build (so not inlined into instrumented code): atomics on the
// same address from several threads are no race. Their bounds are checked all the same.
template <class T, class F>
__attribute__((no_sanitize_thread, noinline)) T atomic_rmw(T* p, F f) {
    atomic_access(p, sizeof(T), __builtin_return_address(0));
    const T old = *p;
    *p = f(old);
    return old;
}
template <class T>
inline T wrap_add(T a, T b) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
}
}  // namespace cuda_emu::detail

#define CUDA_EMU_ATOMIC_INT(T)                                                                                    \
    inline T atomicAdd(T* p, T v) { return ::cuda_emu::detail::atomic_rmw(p, [v](T o) { return ::cuda_emu::detail::wrap_add(o, v); }); } \
    inline T atomicSub(T* p, T v) { return ::cuda_emu::detail::atomic_rmw(p, [v](T o) { return ::cuda_emu::detail::wrap_add(o, static_cast<T>(0 - static_cast<std::make_unsigned_t<T>>(v))); }); } \
    inline T atomicExch(T* p, T v) { return ::cuda_emu::detail::atomic_rmw(p, [v](T) { return v; }); }             \
    inline T atomicMin(T* p, T v) { return ::cuda_emu::detail::atomic_rmw(p, [v](T o) { return v < o ? v : o; }); } \
    inline T atomicMax(T* p, T v) { return ::cuda_emu::detail::atomic_rmw(p, [v](T o) { return v > o ? v : o; }); } \
    inline T atomicAnd(T* p, T v) { return ::cuda_emu::detail::atomic_rmw(p, [v](T o) { return static_cast<T>(o & v); }); } \
    inline T atomicOr(T* p, T v) { return ::cuda_emu::detail::atomic_rmw(p, [v](T o) { return static_cast<T>(o | v); }); } \
    inline T atomicXor(T* p, T v) { return ::cuda_emu::detail::atomic_rmw(p, [v](T o) { return static_cast<T>(o ^ v); }); } \
    inline T atomicCAS(T* p, T compare, T v) {                                                                    \
        return ::cuda_emu::detail::atomic_rmw(p, [compare, v](T o) { return o == compare ? v : o; });             \
    }
CUDA_EMU_ATOMIC_INT(int)
CUDA_EMU_ATOMIC_INT(unsigned int)
CUDA_EMU_ATOMIC_INT(unsigned long long)
#undef CUDA_EMU_ATOMIC_INT
inline long long atomicMin(long long* p, long long v) { return ::cuda_emu::detail::atomic_rmw(p, [v](long long o) { return v < o ? v : o; }); }
inline long long atomicMax(long long* p, long long v) { return ::cuda_emu::detail::atomic_rmw(p, [v](long long o) { return v > o ? v : o; }); }
inline unsigned short atomicCAS(unsigned short* p, unsigned short compare, unsigned short v) {
    return ::cuda_emu::detail::atomic_rmw(p, [compare, v](unsigned short o) { return o == compare ? v : o; });
}
inline unsigned atomicInc(unsigned* p, unsigned limit) {
    return ::cuda_emu::detail::atomic_rmw(p, [limit](unsigned o) { return o >= limit ? 0u : o + 1u; });
}
inline unsigned atomicDec(unsigned* p, unsigned limit) {
    return ::cuda_emu::detail::atomic_rmw(p, [limit](unsigned o) { return (o == 0u || o > limit) ? limit : o - 1u; });
}
inline float atomicAdd(float* p, float v) { return ::cuda_emu::detail::atomic_rmw(p, [v](float o) { return o + v; }); }
inline double atomicAdd(double* p, double v) { return ::cuda_emu::detail::atomic_rmw(p, [v](double o) { return o + v; }); }
inline float atomicExch(float* p, float v) { return ::cuda_emu::detail::atomic_rmw(p, [v](float) { return v; }); }
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
    return ::cuda_emu::detail::atomic_rmw(p, [v](__nv_bfloat16 o) { return __hadd(o, v); });
}
inline __nv_bfloat162 atomicAdd(__nv_bfloat162* p, __nv_bfloat162 v) {
    return ::cuda_emu::detail::atomic_rmw(p, [v](__nv_bfloat162 o) { return __hadd2(o, v); });
}

// ---------------------------------------------------------------------------------------------
// Cache-hinted loads and stores (__ldg, __ldcs, __stcs, ...): plain accesses here.
// ---------------------------------------------------------------------------------------------
#define CUDA_EMU_LOAD(name) \
    template <class T>      \
    inline T name(const T* p) { return *p; }
#define CUDA_EMU_STORE(name) \
    template <class T>       \
    inline void name(T* p, T v) { *p = v; }
CUDA_EMU_LOAD(__ldg)
CUDA_EMU_LOAD(__ldca)
CUDA_EMU_LOAD(__ldcg)
CUDA_EMU_LOAD(__ldcs)
CUDA_EMU_LOAD(__ldlu)
CUDA_EMU_LOAD(__ldcv)
CUDA_EMU_STORE(__stwb)
CUDA_EMU_STORE(__stcg)
CUDA_EMU_STORE(__stcs)
CUDA_EMU_STORE(__stwt)
#undef CUDA_EMU_LOAD
#undef CUDA_EMU_STORE

// ---------------------------------------------------------------------------------------------
// Tensor cores: nvcuda::wmma (CUDA's <mma.h>), the m16n16k16 shape with __nv_bfloat16 A and B and
// a float accumulator (what kernels/attention.cu uses), executed for real: mma_sync gathers the
// 32 lanes' fragments and computes D = A B + C in float (products of bf16 are exact in float;
// each output adds its 16 products to C in k order with fmaf). CUDA leaves the fragment layout
// unspecified, so a correct kernel only uses layout-independent element operations (fill,
// the same scaling of every element); the emulator's layout, documented so tests can construct
// fragments: element i of lane l holds the tile's element number l + 32 * i in row-major order
// (row (l + 32 i) / cols, column (l + 32 i) % cols), for A (16 x 16, M x K), B (K x N) and the
// accumulator (M x N) alike. mma_sync is warp-collective (all 32 lanes, a BarrierError
// otherwise) and orders like __syncwarp(). load_matrix_sync / store_matrix_sync are each lane's
// own accesses here, not scheduling points: CUDA promises no memory ordering between lanes for
// them, so a kernel orders a warp's shared-memory writes before another lane's fragment load
// with __syncwarp() or __syncthreads(), and the race detector checks that it does. Their
// accesses are checked like any other (bounds, races), and CUDA's rules on the arguments: a
// 256-bit (32-byte) aligned pointer, ldm a multiple of 16 bytes, else a DeviceAssertError.
// ---------------------------------------------------------------------------------------------
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K>
struct fragment_dims;
template <int M, int N, int K>
struct fragment_dims<matrix_a, M, N, K> {
    static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct fragment_dims<matrix_b, M, N, K> {
    static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct fragment_dims<accumulator, M, N, K> {
    static constexpr int rows = M, cols = N;
};

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the CUDA emulator implements the wmma shape m16n16k16 only");
    static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float> : std::is_same_v<T, __nv_bfloat16>,
                  "the CUDA emulator implements __nv_bfloat16 A/B fragments with float accumulators only");
    // <mma.h> defines A/B fragments with a row_major or col_major layout only, accumulators without
    static_assert(std::is_same_v<Use, accumulator>
                      ? std::is_void_v<Layout>
                      : std::is_same_v<Layout, row_major> || std::is_same_v<Layout, col_major>,
                  "wmma: matrix_a / matrix_b fragments need a row_major or col_major layout, accumulators none");

public:
    using element_type = T;
    static constexpr int rows = fragment_dims<Use, M, N, K>::rows;
    static constexpr int cols = fragment_dims<Use, M, N, K>::cols;
    static constexpr int num_elements = rows * cols / 32;
    T x[num_elements];
};

namespace emu {
inline unsigned lane_id() {
    const auto& t = ::cuda_emu::detail::g_builtins;
    return (t.thread_idx.x + t.block_dim.x * (t.thread_idx.y + t.block_dim.y * t.thread_idx.z)) % 32u;
}
template <class T>
inline void check_access(const T* p, unsigned ldm, const char* what, const std::source_location& loc) {
    if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
        ::cuda_emu::detail::trap(what, loc);
    if ((static_cast<size_t>(ldm) * sizeof(T)) % 16 != 0)
        ::cuda_emu::detail::trap(what, loc);
}
// One lane's operands of mma_sync; the warp's D = A B + C is computed once, when the last lane
// arrives (the runtime calls mma_warp with all 32 lanes' MmaLane), from every lane's fragments.
struct MmaLane {
    ::cuda_emu::detail::WarpCollective head;
    const __nv_bfloat16* a;
    const __nv_bfloat16* b;
    const float* c;
    float* d;
};
// Not instrumented: the lanes' fragments are their registers, not memory a kernel shares.
__attribute__((no_sanitize_thread)) inline void mma_warp(void* const* lanes) {
    const MmaLane* const* l = reinterpret_cast<const MmaLane* const*>(lanes);
    float out[32][8];
    for (int lane = 0; lane < 32; ++lane) {
        for (int i = 0; i < 8; ++i) {
            const int idx = lane + 32 * i;
            const int r = idx / 16, col = idx % 16;
            float acc = l[lane]->c[i];
            for (int k = 0; k < 16; ++k) {
                const int ia = r * 16 + k, ib = k * 16 + col;  // row-major element numbers in A and B
                acc = fmaf(static_cast<float>(l[ia % 32]->a[ia / 32]), static_cast<float>(l[ib % 32]->b[ib / 32]), acc);
            }
            out[lane][i] = acc;
        }
    }
    for (int lane = 0; lane < 32; ++lane)  // after every read: d may be c
        for (int i = 0; i < 8; ++i) l[lane]->d[i] = out[lane][i];
}
}  // namespace emu

template <class Use, class T, class Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const T& v) {
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

template <class Use, class Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p, unsigned ldm,
                             std::source_location loc = std::source_location::current()) {
    emu::check_access(p, ldm, "wmma::load_matrix_sync: the pointer must be 32-byte aligned and ldm a multiple of 8 "
                              "bf16 elements", loc);
    const int lane = static_cast<int>(emu::lane_id());
    for (int i = 0; i < f.num_elements; ++i) {
        const int idx = lane + 32 * i, r = idx / f.cols, c = idx % f.cols;
        f.x[i] = std::is_same_v<Layout, row_major> ? p[static_cast<size_t>(r) * ldm + c] : p[static_cast<size_t>(c) * ldm + r];
    }
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t layout,
                             std::source_location loc = std::source_location::current()) {
    emu::check_access(p, ldm, "wmma::load_matrix_sync: the pointer must be 32-byte aligned and ldm a multiple of 4 "
                              "floats", loc);
    const int lane = static_cast<int>(emu::lane_id());
    for (int i = 0; i < f.num_elements; ++i) {
        const int idx = lane + 32 * i, r = idx / 16, c = idx % 16;
        f.x[i] = layout == mem_row_major ? p[static_cast<size_t>(r) * ldm + c] : p[static_cast<size_t>(c) * ldm + r];
    }
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t layout,
                              std::source_location loc = std::source_location::current()) {
    emu::check_access(p, ldm, "wmma::store_matrix_sync: the pointer must be 32-byte aligned and ldm a multiple of 4 "
                              "floats", loc);
    const int lane = static_cast<int>(emu::lane_id());
    for (int i = 0; i < f.num_elements; ++i) {
        const int idx = lane + 32 * i, r = idx / 16, c = idx % 16;
        (layout == mem_row_major ? p[static_cast<size_t>(r) * ldm + c] : p[static_cast<size_t>(c) * ldm + r]) = f.x[i];
    }
}

template <class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c,
                     std::source_location loc = std::source_location::current()) {
    // crt/mma.h's bf16 mma_sync is (d, a, b, c): no satf argument (the integer shapes' satf is
    // not emulated), so a kernel that passes one fails here as it would under NVRTC.
    emu::MmaLane me{{&emu::mma_warp}, a.x, b.x, c.x, d.x};
    ::cuda_emu::detail::warp_op(::cuda_emu::detail::kMmaSync, 0xffffffffu, reinterpret_cast<uintptr_t>(&me), 0, 32, loc);
}
}  // namespace wmma
}  // namespace nvcuda

// ---------------------------------------------------------------------------------------------
// Kernel registration, used by the launcher's generated code after the kernel sources: exports
// `cuda_emu_kernel__NAME()`, returning the parameter description and a cuLaunchKernel-style
// invoker (`void** args`, one pointer per parameter value).
// ---------------------------------------------------------------------------------------------
namespace cuda_emu::detail {

template <class T>
constexpr const char* type_name() {
    return __PRETTY_FUNCTION__;
}

template <class T>
struct vec_traits {
    using elem = T;
    static constexpr uint32_t count = 1;
};
#define CUDA_EMU_VEC_TRAITS(V, E, N) \
    template <>                      \
    struct vec_traits<V> {           \
        using elem = E;              \
        static constexpr uint32_t count = N; \
    };
CUDA_EMU_VEC_TRAITS(float2, float, 2)
CUDA_EMU_VEC_TRAITS(float3, float, 3)
CUDA_EMU_VEC_TRAITS(float4, float, 4)
CUDA_EMU_VEC_TRAITS(double2, double, 2)
CUDA_EMU_VEC_TRAITS(int2, int, 2)
CUDA_EMU_VEC_TRAITS(int3, int, 3)
CUDA_EMU_VEC_TRAITS(int4, int, 4)
CUDA_EMU_VEC_TRAITS(uint2, unsigned int, 2)
CUDA_EMU_VEC_TRAITS(uint3, unsigned int, 3)
CUDA_EMU_VEC_TRAITS(uint4, unsigned int, 4)
CUDA_EMU_VEC_TRAITS(longlong2, long long, 2)
CUDA_EMU_VEC_TRAITS(ulonglong2, unsigned long long, 2)
CUDA_EMU_VEC_TRAITS(short2, short, 2)
CUDA_EMU_VEC_TRAITS(ushort2, unsigned short, 2)
CUDA_EMU_VEC_TRAITS(char4, signed char, 4)
CUDA_EMU_VEC_TRAITS(uchar4, unsigned char, 4)
CUDA_EMU_VEC_TRAITS(__nv_bfloat162, __nv_bfloat16, 2)
#undef CUDA_EMU_VEC_TRAITS

template <class T>
constexpr char kind_of() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_void_v<U>) return 'v';
    else if constexpr (std::is_same_v<U, bool>) return 'b';
    else if constexpr (std::is_same_v<U, char> || std::is_same_v<U, unsigned char>) return 'c';
    else if constexpr (std::is_same_v<U, __nv_bfloat16>) return 'B';
    else if constexpr (std::is_floating_point_v<U>) return 'f';
    else if constexpr (std::is_integral_v<U>) return std::is_signed_v<U> ? 'i' : 'u';
    else return 'o';
}

template <class P>
constexpr ParamDesc describe_param() {
    static_assert(!std::is_reference_v<P>, "CUDA kernels cannot take reference parameters");
    static_assert(std::is_trivially_copyable_v<P>, "kernel parameters must be trivially copyable");
    static_assert(sizeof(P) <= 16, "the emulator passes parameters of at most 16 bytes by value");
    if constexpr (std::is_pointer_v<P>) {
        using T = std::remove_pointer_t<P>;
        using V = std::remove_cv_t<T>;
        using E = typename vec_traits<V>::elem;
        uint32_t esize = 1;
        if constexpr (!std::is_void_v<V>) esize = static_cast<uint32_t>(sizeof(E));
        return ParamDesc{kind_of<E>(), 1, std::is_const_v<T>, 0, static_cast<uint32_t>(sizeof(P)), esize,
                         vec_traits<V>::count, type_name<P>()};
    } else {
        using E = typename vec_traits<P>::elem;
        return ParamDesc{kind_of<E>(), 0, 0, 0, static_cast<uint32_t>(sizeof(P)), static_cast<uint32_t>(sizeof(E)),
                         vec_traits<P>::count, type_name<P>()};
    }
}

template <class F>
struct kernel_traits;
template <class R, class... A>
struct kernel_traits<R (*)(A...)> {
    static_assert(std::is_void_v<R>, "a __global__ function must return void");
    static constexpr uint32_t arity = sizeof...(A);
    // Not instrumented by checked builds: reading the launcher's argument block is no kernel
    // access (and would cost a check per parameter per thread).
    template <auto F, size_t... I>
    __attribute__((no_sanitize_thread)) static void call(void** args, std::index_sequence<I...>) {
        F(*static_cast<std::remove_cv_t<A>*>(args[I])...);
    }
    template <auto F>
    static void invoke(void** args) {
        call<F>(args, std::index_sequence_for<A...>{});
    }
    static constexpr ParamDesc params[sizeof...(A) + 1] = {describe_param<A>()..., ParamDesc{}};
};

template <auto F>
const KernelDesc* describe_kernel(const char* name) {
    using Tr = kernel_traits<decltype(F)>;
    static const KernelDesc desc{kAbiVersion, Tr::arity, name, &Tr::template invoke<F>, Tr::params};
    return &desc;
}

}  // namespace cuda_emu::detail

#define CUDA_EMU_REGISTER_KERNEL(name)                                                       \
    extern "C" __attribute__((visibility("default"))) const ::cuda_emu::KernelDesc*          \
        cuda_emu_kernel__##name() {                                                           \
        return ::cuda_emu::detail::describe_kernel<&name>(#name);                             \
    }
