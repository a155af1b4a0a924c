// cuda_emu_runtime.cpp: the execution model behind cuda_emu.h.
//
// A launch runs the blocks of the grid one after another on the calling OS thread. Each block
// runs blockDim.x*y*z emulated threads as fibers (user-space stacks switched by hand, or by
// ucontext off x86-64). Scheduling is cooperative: a thread runs until it reaches a barrier or a
// warp operation, or exits; then the scheduler runs the next ready thread in the chosen order:
// in rounds (forward, reverse or seeded random), or a warp at a time, each as far as it gets
// (warp-forward, warp-reverse, warp-random: a warp runs ahead into the next phase). A barrier
// releases its threads when every participant has arrived; when no thread can run and the block
// has not finished, the launch fails with a report of who waits where. Because threads switch
// only at those points, code between two barriers runs as a whole, which makes a missing barrier
// visible as a wrong result under at least one order, and makes atomics trivially atomic.
// Checked builds also report each shared-memory race and out-of-bounds access where it happens
// ("Checks" below).
//
// Launches are serialized by the Python launcher (one process-wide lock), so the state below is
// plain globals. The kernel's shared memory is thread-local storage of this module; the launcher
// poisons all of it before each block. The module must therefore not hold any other TLS.

// The fortified longjmp refuses to jump from the signal handler's alternate stack to the
// launcher's stack, which is exactly what fault reporting does.
#undef _FORTIFY_SOURCE
#include "cuda_emu.h"

#include <dlfcn.h>
#include <fenv.h>
#include <link.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#if !defined(__x86_64__) || defined(CUDA_EMU_USE_UCONTEXT)
#define CUDA_EMU_UCONTEXT 1
#include <ucontext.h>
#endif

namespace {
constexpr size_t kMaxDynamicSmem = 227 * 1024;  // sm_90's opt-in maximum per block
constexpr size_t kSmemGuard = 1024;             // poisoned bytes checked after the requested size
constexpr size_t kStackGuard = 64 * 1024;       // PROT_NONE below each fiber stack
constexpr unsigned kMaxThreads = 1024;
}  // namespace

// Every `extern __shared__` name of the kernel sources is linked (--defsym) to this buffer.
extern "C" {
__attribute__((visibility("hidden"))) alignas(cuda_emu::kSharedVarAlign) thread_local unsigned char
    cuda_emu_dynamic_smem[kMaxDynamicSmem + kSmemGuard];
}

#ifndef CUDA_EMU_UCONTEXT
// switch(save, next): push the callee-saved registers, save the stack pointer to *save, load
// next, pop, return into the other context. A new fiber's stack is laid out so that the first
// switch "returns" into fiber_entry with r12 = argument, r13 = function. The MXCSR and x87
// control words are callee-saved too, but every fiber runs on the same OS thread with the same
// floating-point environment (kernels do not call fesetround), and restoring them would double
// the cost of a switch.
extern "C" void cuda_emu_switch(void** save_sp, void* next_sp) __attribute__((visibility("hidden")));
extern "C" void cuda_emu_fiber_entry() __attribute__((visibility("hidden")));
asm(R"(
    .text
    .p2align 4
    .globl cuda_emu_switch
    .hidden cuda_emu_switch
    .type cuda_emu_switch, @function
cuda_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_emu_switch, .-cuda_emu_switch

    .p2align 4
    .globl cuda_emu_fiber_entry
    .hidden cuda_emu_fiber_entry
    .type cuda_emu_fiber_entry, @function
cuda_emu_fiber_entry:
    .cfi_startproc
    .cfi_undefined rip
    movq %r12, %rdi
    callq *%r13
    ud2
    .cfi_endproc
    .size cuda_emu_fiber_entry, .-cuda_emu_fiber_entry
)");
#endif

namespace cuda_emu::detail {

Builtins g_builtins;

namespace {

enum Error : int {
    kOk = 0,
    kErrBarrier = 1,         // divergent __syncthreads / warp operation, incomplete warp
    kErrFault = 2,           // SIGSEGV, SIGBUS, SIGFPE, SIGILL inside the kernel
    kErrTrap = 3,            // assert(), __trap()
    kErrTimeout = 4,
    kErrSharedOverflow = 5,  // out-of-bounds access (global or shared memory)
    kErrConfig = 6,
    kErrException = 7,       // a C++ exception escaped the kernel
    kErrRace = 8,            // shared-memory race (checked builds)
};

// kForward/kReverse/kRandom run the ready threads in rounds (each thread to its next barrier or
// warp operation); the kWarp* schedules run one warp at a time as far as it gets before the next
// warp runs (to a __syncthreads() or the end), so a warp runs ahead of the others into the next
// phase of the kernel, as it may on a GPU. Warps are taken in order, reverse order or a seeded
// random order (lanes in order, reversed or shuffled likewise).
enum Schedule : int { kForward = 0, kReverse = 1, kRandom = 2, kWarpForward = 3, kWarpReverse = 4, kWarpRandom = 5 };

enum class St : uint8_t { Ready, AtBarrier, AtWarpOp, Done, Trapped };

struct Site {
    const char* file = "";
    const char* func = "";
    unsigned line = 0, column = 0;
};

Site site_of(const std::source_location& loc) {
    return Site{loc.file_name(), loc.function_name(), static_cast<unsigned>(loc.line()),
                static_cast<unsigned>(loc.column())};
}

bool same_site(const Site& a, const Site& b) {
    return a.line == b.line && a.column == b.column && (a.file == b.file || strcmp(a.file, b.file) == 0);
}

struct Fiber {
    void* sp = nullptr;
#ifdef CUDA_EMU_UCONTEXT
    ucontext_t uc;
#endif
    char* mem = nullptr;  // mapping: [guard | stack]
    size_t mem_size = 0;
    uint3 tid{};
    unsigned linear = 0;
    St state = St::Done;
    Site site;
    int op = 0;
    unsigned mask = 0;
    uint64_t value = 0;  // operand of the pending warp operation
    int arg = 0;
    uint64_t result = 0;
};

struct PendingWarpOp {
    unsigned mask;
    int op;
    int width;
    int arrived;
    Site site;
};

struct Warp {
    unsigned exists = 0;  // lanes that exist in this (possibly partial) warp
    int npending = 0;     // operations in progress, on disjoint masks
    PendingWarpOp pending[32];
};

struct State {
    const KernelDesc* kernel = nullptr;
    void** args = nullptr;
    unsigned nthreads = 0;
    int schedule = kForward;
    uint64_t rng = 0;
    size_t shared_mem = 0;
    size_t stack_size = 0;

    std::vector<Fiber*> fibers;  // pool; pointers because a ucontext_t must not move
    std::vector<Warp> warps;
    std::vector<unsigned> ready, next;
    unsigned done = 0;

    unsigned barrier_arrived = 0;
    int barrier_count = 0, barrier_and = 1, barrier_or = 0;

#ifdef CUDA_EMU_UCONTEXT
    ucontext_t sched_uc;
#else
    void* sched_sp = nullptr;
#endif
    Fiber* current = nullptr;

    unsigned char* tls_lo = nullptr;  // this thread's instance of the module's TLS segment
    unsigned char* tls_hi = nullptr;

    int error = kOk;
    std::string message;

    // ----- checks (see "Checks" below) -----
    size_t tls_size = 0;           // bytes of the TLS block: all shared memory
    size_t dyn_off = 0;            // offset of the dynamic shared memory in it
    std::vector<uint8_t> kind;     // per TLS byte: kGap, kStaticVar or kDynamic
    struct Var {
        std::string name;
        size_t off, size;
    };
    std::vector<Var> vars;  // static __shared__ variables, by offset
    struct Cell {           // one shared byte: last writer and up to two readers since the last sync
        uint32_t wseq, r1seq, r2seq;  // g.seq at the access; stale if < block_seq
        uint16_t w, r1, r2, pad;      // linear thread id + 1
        uint32_t wpc, r1pc, r2pc;     // code offsets in the module
    };
    std::vector<Cell> cells;
    struct Buffer {  // an array argument: its data and the guard regions around it
        uintptr_t lo, hi, guard_lo, guard_hi;
        size_t itemsize;
        std::string name;
        uint64_t read = 0, written = 0;  // bytes the launch's accesses read / wrote (traffic counting)
    };
    std::vector<Buffer> buffers;
    uintptr_t buf_lo = 0, buf_span = 0;  // hull of the guarded buffers (empty: no buffers)
    uintptr_t last_lo = 0, last_span = 0;  // the array of the last in-bounds access
    Buffer* last_buf = nullptr;            // ... and its buffer (its counters)
    bool detect_races = true;
    uint32_t seq = 1, block_seq = 1;   // sync events: every barrier and completed warp operation
    std::vector<uint32_t> warp_sync;   // per warp: seq of its last operation on all its lanes
    std::vector<uint32_t> lane_sync;   // per warp, 32 x 32: seq of the last operation on both lanes
    bool lane_sync_used = false;
    uintptr_t module_base = 0;
};

using G = State;
State g;

// ----- signals ---------------------------------------------------------------------------------
constexpr int kTimerSignal = SIGVTALRM;
constexpr int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP};
sigjmp_buf g_jmp;
volatile sig_atomic_t g_in_launch = 0;
pthread_t g_launch_thread;
volatile int g_sig = 0;
volatile int g_sig_code = 0;
void* volatile g_sig_addr = nullptr;
struct sigaction g_old_actions[NSIG];
alignas(64) char g_altstack_mem[64 * 1024];

// ----- utilities -------------------------------------------------------------------------------
uint64_t next_random() {  // splitmix64
    uint64_t z = (g.rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

std::string vformat(const char* fmt, va_list ap) {
    va_list ap2;
    va_copy(ap2, ap);
    const int n = vsnprintf(nullptr, 0, fmt, ap2);
    va_end(ap2);
    std::string s(n > 0 ? static_cast<size_t>(n) : 0, '\0');
    if (n > 0) vsnprintf(s.data(), s.size() + 1, fmt, ap);
    return s;
}

__attribute__((format(printf, 1, 2))) std::string format(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = vformat(fmt, ap);
    va_end(ap);
    return s;
}

// Records the first error of a launch; later ones are consequences.
__attribute__((format(printf, 2, 3))) void fail(int code, const char* fmt, ...) {
    if (g.error != kOk) return;
    va_list ap;
    va_start(ap, fmt);
    g.message = vformat(fmt, ap);
    va_end(ap);
    g.error = code;
}

std::string where_block() {
    const uint3 b = g_builtins.block_idx;
    return format("block (%u,%u,%u)", b.x, b.y, b.z);
}

std::string where(const Fiber* f) {
    return format("%s, thread (%u,%u,%u)", where_block().c_str(), f->tid.x, f->tid.y, f->tid.z);
}

std::string site_text(const Site& s) {
    return format("%s:%u:%u in %s", s.file, s.line, s.column, s.func);
}

// "0-15,32,40-47": linear thread ids, compressed, shortened when very fragmented.
std::string ranges(std::vector<unsigned> ids) {
    std::sort(ids.begin(), ids.end());
    std::string out;
    int parts = 0;
    for (size_t i = 0; i < ids.size();) {
        size_t j = i;
        while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
        if (++parts > 16) {
            out += ",...";
            break;
        }
        if (!out.empty()) out += ",";
        out += (j == i) ? format("%u", ids[i]) : format("%u-%u", ids[i], ids[j]);
        i = j + 1;
    }
    return out;
}

const char* warp_op_name(int op) {
    static const char* const names[kWarpOpCount] = {
        "__syncwarp",        "__shfl_sync",       "__shfl_up_sync",    "__shfl_down_sync",  "__shfl_xor_sync",
        "__ballot_sync",     "__any_sync",        "__all_sync",        "__reduce_add_sync", "__reduce_add_sync",
        "__reduce_min_sync", "__reduce_min_sync", "__reduce_max_sync", "__reduce_max_sync", "__reduce_and_sync",
        "__reduce_or_sync",  "__reduce_xor_sync", "wmma::mma_sync"};
    return (op >= 0 && op < kWarpOpCount) ? names[op] : "?";
}

const char* barrier_name(int kind) {
    switch (kind) {
        case kSyncCount: return "__syncthreads_count";
        case kSyncAnd: return "__syncthreads_and";
        case kSyncOr: return "__syncthreads_or";
        default: return "__syncthreads";
    }
}

std::string block_dim_note() {
    const dim3 d = g_builtins.block_dim;
    if (d.y == 1 && d.z == 1) return "";
    return format(" (thread numbers are linear ids x + %u*(y + %u*z))", d.x, d.y);
}

// What every thread of the block is doing, grouped, for barrier errors.
std::string describe_block() {
    struct Group {
        std::string what;
        std::vector<unsigned> ids;
    };
    std::vector<Group> groups;
    for (unsigned i = 0; i < g.nthreads; ++i) {
        const Fiber* f = g.fibers[i];
        std::string what;
        switch (f->state) {
            case St::Ready: what = "ready to run"; break;
            case St::Done: what = "exited"; break;
            case St::Trapped: what = "stopped by an error"; break;
            case St::AtBarrier: what = format("wait at %s() at %s", barrier_name(f->op), site_text(f->site).c_str()); break;
            case St::AtWarpOp:
                what = format("wait at %s(mask 0x%08x) at %s", warp_op_name(f->op), f->mask, site_text(f->site).c_str());
                break;
        }
        auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& gr) { return gr.what == what; });
        if (it == groups.end()) groups.push_back(Group{what, {f->linear}});
        else it->ids.push_back(f->linear);
    }
    std::string out;
    for (const Group& gr : groups)
        out += format("\n  threads %s: %s", ranges(gr.ids).c_str(), gr.what.c_str());
    return out + block_dim_note();
}

// ----- fill patterns ----------------------------------------------------------------------------
// 0xffa5 little-endian in every 16-bit half: a NaN as bf16, fp16 and fp32, -5898331 as an int32.
// Shared by the Python guard regions.
inline unsigned char pattern_byte(uintptr_t addr) { return (addr & 1u) ? 0xffu : 0xa5u; }

void fill_pattern(unsigned char* p, size_t n) {
    size_t i = 0;
    for (; i < n && (reinterpret_cast<uintptr_t>(p + i) & 7u) != 0; ++i) p[i] = pattern_byte(reinterpret_cast<uintptr_t>(p + i));
    const uint64_t word = 0xffa5ffa5ffa5ffa5ull;
    for (; i + 8 <= n; i += 8) memcpy(p + i, &word, 8);
    for (; i < n; ++i) p[i] = pattern_byte(reinterpret_cast<uintptr_t>(p + i));
}

// Offset of the first byte that no longer holds the pattern, or n.
size_t pattern_mismatch(const unsigned char* p, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (p[i] != pattern_byte(reinterpret_cast<uintptr_t>(p + i))) return i;
    return n;
}

// This thread's instance of the module's TLS segment: all `__shared__` variables plus the
// dynamic shared memory buffer.
bool tls_block(unsigned char** lo, unsigned char** hi) {
    struct Ctx {
        uintptr_t probe;
        unsigned char* lo;
        unsigned char* hi;
    } ctx{reinterpret_cast<uintptr_t>(&cuda_emu_dynamic_smem[0]), nullptr, nullptr};
    // Taking the address above made the dynamic TLS of this module exist for this thread.
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* data) -> int {
            auto* c = static_cast<Ctx*>(data);
            if (info->dlpi_tls_data == nullptr) return 0;
            for (int i = 0; i < info->dlpi_phnum; ++i) {
                if (info->dlpi_phdr[i].p_type != PT_TLS) continue;
                auto* base = static_cast<unsigned char*>(info->dlpi_tls_data);
                const uintptr_t b = reinterpret_cast<uintptr_t>(base);
                if (c->probe >= b && c->probe < b + info->dlpi_phdr[i].p_memsz) {
                    c->lo = base;
                    c->hi = base + info->dlpi_phdr[i].p_memsz;
                    return 1;
                }
            }
            return 0;
        },
        &ctx);
    *lo = ctx.lo;
    *hi = ctx.hi;
    return ctx.lo != nullptr;
}

// ----- fibers -----------------------------------------------------------------------------------
void fiber_main(Fiber* f);

#ifdef CUDA_EMU_UCONTEXT
Fiber* g_starting = nullptr;
void fiber_main_uc() { fiber_main(g_starting); }
#endif

void switch_to_fiber(Fiber* f) {
    g.current = f;
    g_builtins.thread_idx = f->tid;
#ifdef CUDA_EMU_UCONTEXT
    g_starting = f;
    swapcontext(&g.sched_uc, &f->uc);
#else
    cuda_emu_switch(&g.sched_sp, f->sp);
#endif
    g.current = nullptr;
}

void switch_to_scheduler(Fiber* f) {
#ifdef CUDA_EMU_UCONTEXT
    swapcontext(&f->uc, &g.sched_uc);
#else
    cuda_emu_switch(&f->sp, g.sched_sp);
#endif
}

[[noreturn]] void stop_current_thread() {
    Fiber* f = g.current;
    f->state = St::Trapped;
    switch_to_scheduler(f);  // the scheduler sees g.error and never resumes this fiber
    __builtin_unreachable();
}

void fiber_main(Fiber* f) {
    try {
        g.kernel->invoke(g.args);
    } catch (...) {
        fail(kErrException, "a C++ exception escaped the kernel in %s", where(f).c_str());
        stop_current_thread();
    }
    f->state = St::Done;
    ++g.done;
    switch_to_scheduler(f);
    __builtin_unreachable();
}

bool ensure_fibers(unsigned n, size_t stack_size) {
    if (stack_size != g.stack_size) {
        for (Fiber* f : g.fibers) {
            munmap(f->mem, f->mem_size);
            delete f;
        }
        g.fibers.clear();
        g.stack_size = stack_size;
    }
    while (g.fibers.size() < n) {
        auto* f = new Fiber();
        f->mem_size = kStackGuard + stack_size;
        void* mem = mmap(nullptr, f->mem_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK,
                         -1, 0);
        if (mem == MAP_FAILED) {
            delete f;
            fail(kErrConfig, "cannot map a %zu KiB stack for emulated thread %zu", stack_size / 1024, g.fibers.size());
            return false;
        }
        f->mem = static_cast<char*>(mem);
        mprotect(f->mem, kStackGuard, PROT_NONE);  // a stack overflow faults instead of corrupting a neighbour
        g.fibers.push_back(f);
    }
    return true;
}

void init_fiber(Fiber* f, unsigned linear) {
    const dim3 d = g_builtins.block_dim;
    f->linear = linear;
    f->tid = uint3{linear % d.x, (linear / d.x) % d.y, linear / (d.x * d.y)};
    f->state = St::Ready;
    f->site = Site{};
    f->op = 0;
    f->mask = 0;
    f->result = 0;
    // Stagger the stack tops: page-aligned tops would put the hot frames of all threads in the
    // same cache sets.
    char* top = f->mem + f->mem_size - ((linear * 17u) % 64u) * 64u;
#ifdef CUDA_EMU_UCONTEXT
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->mem + kStackGuard;
    f->uc.uc_stack.ss_size = f->mem_size - kStackGuard;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, fiber_main_uc, 0);
    (void)top;
#else
    // Frame popped by cuda_emu_switch: r15, r14, r13, r12, rbx, rbp, return address, plus
    // padding so that rsp is 16-byte aligned at fiber_entry's call.
    auto* sp = reinterpret_cast<uint64_t*>(top - 72);
    sp[0] = 0;                                       // r15
    sp[1] = 0;                                       // r14
    sp[2] = reinterpret_cast<uint64_t>(&fiber_main);  // r13: function
    sp[3] = reinterpret_cast<uint64_t>(f);           // r12: argument
    sp[4] = 0;                                       // rbx
    sp[5] = 0;                                       // rbp
    sp[6] = reinterpret_cast<uint64_t>(&cuda_emu_fiber_entry);
    sp[7] = sp[8] = 0;
    f->sp = sp;
#endif
}

// ----- scheduling -------------------------------------------------------------------------------
void make_ready(Fiber* f) {
    f->state = St::Ready;
    g.next.push_back(f->linear);
}

void order_round(std::vector<unsigned>& ids) {
    switch (g.schedule) {
        case kForward:
        case kWarpForward:
            if (!std::is_sorted(ids.begin(), ids.end())) std::sort(ids.begin(), ids.end());
            break;
        case kReverse:
        case kWarpReverse:
            if (std::is_sorted(ids.begin(), ids.end())) std::reverse(ids.begin(), ids.end());
            else std::sort(ids.begin(), ids.end(), std::greater<unsigned>());
            break;
        default:
            for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[next_random() % i]);
            break;
    }
}

void fail_deadlock() {
    fail(kErrBarrier,
         "deadlock in %s: not every thread reached the barrier the others wait at. Every thread of a "
         "block must reach the same __syncthreads(), and every lane named in a warp operation's mask "
         "the same warp operation (a thread that returned early, or a barrier in a branch that not all "
         "threads take, is undefined behaviour on a GPU):%s",
         where_block().c_str(), describe_block().c_str());
}

// The kWarp* schedules: the first warp (in the schedule's order) runs, lanes in the schedule's
// order, each to its next barrier or warp operation, again and again, until none of its lanes can
// run (all wait at a __syncthreads() or exited); then the next warp. When every warp is stuck, the
// barrier has released them (or the block is done, or deadlocked) and it starts over.
void run_block_warp_major() {
    const unsigned n = g.nthreads, nwarps = static_cast<unsigned>(g.warps.size());
    std::vector<unsigned> warp_order(nwarps), lanes;
    for (unsigned w = 0; w < nwarps; ++w) warp_order[w] = g.schedule == kWarpReverse ? nwarps - 1 - w : w;
    for (;;) {
        if (g.schedule == kWarpRandom) order_round(warp_order);
        bool progressed = false;
        for (unsigned w : warp_order) {
            lanes.clear();
            for (unsigned id = w * 32; id < std::min(n, w * 32 + 32); ++id) lanes.push_back(id);
            for (bool ran = true; ran;) {
                ran = false;
                order_round(lanes);
                for (unsigned id : lanes) {
                    Fiber* f = g.fibers[id];
                    if (f->state != St::Ready) continue;
                    switch_to_fiber(f);
                    if (g.error != kOk) return;
                    ran = progressed = true;
                }
            }
        }
        g.next.clear();
        if (!progressed) {
            if (g.done != n) fail_deadlock();
            return;
        }
    }
}

void run_block() {
    const unsigned n = g.nthreads;
    for (unsigned i = 0; i < n; ++i) init_fiber(g.fibers[i], i);
    for (Warp& w : g.warps) w.npending = 0;
    g.done = 0;
    g.barrier_arrived = 0;
    if (g.schedule >= kWarpForward) {
        run_block_warp_major();
        return;
    }
    g.ready.resize(n);
    for (unsigned i = 0; i < n; ++i) g.ready[i] = i;
    for (;;) {
        order_round(g.ready);
        g.next.clear();
        for (unsigned id : g.ready) {
            Fiber* f = g.fibers[id];
            if (f->state != St::Ready) continue;
            switch_to_fiber(f);
            if (g.error != kOk) return;
        }
        if (g.next.empty()) {
            if (g.done != n) fail_deadlock();
            return;
        }
        std::swap(g.ready, g.next);
    }
}

Fiber* current_or_die(const char* what) {
    Fiber* f = g.current;
    if (f == nullptr) {
        fprintf(stderr, "cuda_emu: %s called outside an emulated kernel\n", what);
        abort();
    }
    return f;
}

}  // namespace

// ----- checks: shared-memory races, out-of-bounds accesses ---------------------------------------
// Checked builds (the launcher's default) compile the kernels with g++'s thread-sanitizer
// instrumentation (-fsanitize=thread when compiling, not when linking: no sanitizer runtime):
// every load and store of kernel code calls __tsan_readN / __tsan_writeN(address) below. Each
// access is checked against
//   * shared memory (this module's TLS block): the byte must belong to a static __shared__
//     variable or to the first shared_mem bytes of the dynamic buffer (kind[]), and, per byte,
//     the last writer and the readers since the last sync (cells[]) must not conflict;
//   * the launch's array arguments (buffers[]): an access that touches a guard region around an
//     array is out of bounds.
// Anything else (the thread's stack, the emulator's globals) is not checked.
//
// Happens-before, per byte: an access by thread U is ordered before a later access by thread T
// when a __syncthreads() of the block completed in between, or U and T are lanes of one warp and
// a warp operation (__syncwarp, shuffle, vote, reduce) whose mask holds both completed in
// between. g.seq numbers the sync events; an access records the current g.seq, so "a sync
// completed in between" is "its number is greater than the one recorded". A write conflicts
// with the unordered last writer and readers, a read with the unordered last writer: RAW, WAR,
// WAW. Two reader slots per byte: with more readers the first two are kept, which suffices to
// name one reader other than any later writer (a reader ordered by a warp sync may hide a third
// one: a missed report, never a false one).
namespace {
enum : uint8_t { kGap = 0, kStaticVar = 1, kDynamic = 2 };

uint32_t pc_offset(void* pc) { return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(pc) - g.module_base); }

std::string thread_text(unsigned linear) {
    const dim3 d = g_builtins.block_dim;
    return format("thread (%u,%u,%u)", linear % d.x, (linear / d.x) % d.y, linear / (d.x * d.y));
}

// "{pc:1234}" is replaced by the launcher with the source line(s) of that code offset.
std::string pc_text(uint32_t pc) { return format("{pc:%x}", pc); }

std::string describe_shared(size_t off) {
    if (off >= g.dyn_off && off < g.dyn_off + kMaxDynamicSmem + kSmemGuard)
        return format("the dynamic shared memory (extern __shared__; shared_mem=%zu bytes were given at launch), "
                      "byte %zu",
                      g.shared_mem, off - g.dyn_off);
    const G::Var* before = nullptr;
    for (const G::Var& v : g.vars) {
        if (off >= v.off && off < v.off + v.size)
            return format("byte %zu of __shared__ %s (%zu bytes)", off - v.off, v.name.c_str(), v.size);
        if (v.off + v.size <= off && (before == nullptr || v.off > before->off)) before = &v;
    }
    if (before != nullptr)
        return format("byte %zu past the end of __shared__ %s (%zu bytes)", off - (before->off + before->size),
                      before->name.c_str(), before->size);
    return format("shared byte %zu, before every shared variable", off);
}

[[noreturn]] void report_shared_oob(size_t off, size_t n, bool write, void* pc) {
    fail(kErrSharedOverflow, "out-of-bounds shared-memory %s of %zu bytes at %s by %s, %s: %s (address 0x%zx)",
         write ? "write" : "read", n, pc_text(pc_offset(pc)).c_str(), thread_text(g.current->linear).c_str(),
         where_block().c_str(), describe_shared(off).c_str(), reinterpret_cast<uintptr_t>(g.tls_lo) + off);
    stop_current_thread();
}

[[noreturn]] void report_race(const char* what, size_t off, bool write, uint32_t pc, unsigned other, bool other_write,
                              uint32_t other_pc) {
    const unsigned me = g.current->linear;
    const char* note = me / 32 == other / 32 ? " or __syncwarp()" : "";
    fail(kErrRace,
         "shared-memory race (%s) in %s on %s, address 0x%zx: %s (warp %u lane %u) %s it at %s; %s (warp %u lane %u) "
         "%s it at %s, with no __syncthreads()%s between them",
         what, where_block().c_str(), describe_shared(off).c_str(), reinterpret_cast<uintptr_t>(g.tls_lo) + off,
         thread_text(me).c_str(), me / 32, me % 32, write ? "writes" : "reads", pc_text(pc).c_str(),
         thread_text(other).c_str(), other / 32, other % 32, other_write ? "wrote" : "read", pc_text(other_pc).c_str(),
         note);
    stop_current_thread();
}

// Whether an access by thread `u` (linear id) when g.seq was `s` is ordered before the current
// access of thread `t` (both in the current __syncthreads() interval).
inline bool ordered(unsigned u, uint32_t s, unsigned t) {
    if (u / 32 != t / 32) return false;
    const unsigned w = u / 32;
    if (g.warp_sync[w] > s) return true;
    return g.lane_sync_used && g.lane_sync[w * 1024 + (u % 32) * 32 + t % 32] > s;
}

void shared_access(size_t off, size_t n, bool write, void* pc) {
    if (off + n > g.tls_size) report_shared_oob(off, n, write, pc);
    for (size_t i = 0; i < n; ++i) {
        const uint8_t k = g.kind[off + i];
        if (k == kGap || (k == kDynamic && off + i - g.dyn_off >= g.shared_mem)) report_shared_oob(off + i, n, write, pc);
    }
    if (!g.detect_races) return;
    const unsigned t = g.current->linear;
    const uint16_t me = static_cast<uint16_t>(t + 1);
    const uint32_t s = g.seq, bs = g.block_seq, p = pc_offset(pc);
    for (size_t i = 0; i < n; ++i) {
        G::Cell& c = g.cells[off + i];
        if (c.wseq >= bs && c.w != me && !ordered(c.w - 1u, c.wseq, t))
            report_race(write ? "write after write" : "read after write", off + i, write, p, c.w - 1u, true, c.wpc);
        if (write) {
            if (c.r1seq >= bs && c.r1 != me && !ordered(c.r1 - 1u, c.r1seq, t))
                report_race("write after read", off + i, true, p, c.r1 - 1u, false, c.r1pc);
            if (c.r2seq >= bs && c.r2 != me && !ordered(c.r2 - 1u, c.r2seq, t))
                report_race("write after read", off + i, true, p, c.r2 - 1u, false, c.r2pc);
            c.w = me;
            c.wseq = s;
            c.wpc = p;
            c.r1seq = c.r2seq = 0;
        } else if (c.r1seq < bs || c.r1 == me) {
            c.r1 = me;
            c.r1seq = s;
            c.r1pc = p;
        } else if (c.r2seq < bs || c.r2 == me) {
            c.r2 = me;
            c.r2seq = s;
            c.r2pc = p;
        }
    }
}

[[noreturn]] void report_global_oob(const G::Buffer& b, uintptr_t a, size_t n, bool write, void* pc) {
    std::string detail;
    const size_t nelem = (b.hi - b.lo) / b.itemsize;
    if (a >= b.hi) {
        detail = format("%zu byte(s) after the end (element index %zu of a %zu-element array)", a - b.hi,
                        (a - b.lo) / b.itemsize, nelem);
    } else if (a < b.lo) {
        const size_t dist = b.lo - a;
        detail = format("%zu byte(s) before the start (element index -%zu)", dist, (dist + b.itemsize - 1) / b.itemsize);
    } else {
        detail = format("its last %zu byte(s) run past the end (element index %zu of a %zu-element array)",
                        a + n - b.hi, (a - b.lo) / b.itemsize, nelem);
    }
    fail(kErrSharedOverflow, "out-of-bounds %s of %zu bytes %s %s: %s, at %s by %s, %s (address 0x%zx)",
         write ? "write" : "read", n, write ? "to" : "from", b.name.c_str(), detail.c_str(),
         pc_text(pc_offset(pc)).c_str(), thread_text(g.current->linear).c_str(), where_block().c_str(), a);
    stop_current_thread();
}

void global_access(uintptr_t a, size_t n, bool write, void* pc) {
    for (G::Buffer& b : g.buffers) {
        if (a + n <= b.guard_lo || a >= b.guard_hi) continue;
        if (a >= b.lo && a + n <= b.hi) {
            g.last_lo = b.lo;  // consecutive accesses mostly hit one array: on_access tries it first
            g.last_span = b.hi - b.lo;
            g.last_buf = &b;
            (write ? b.written : b.read) += n;
            return;
        }
        report_global_oob(b, a, n, write, pc);
    }
}

inline __attribute__((always_inline)) void on_access(uintptr_t a, size_t n, bool write, void* pc) {
    if (g.current == nullptr) return;
    const uintptr_t rel = a - g.last_lo;  // wraps (huge) for a < last_lo
    if (rel < g.last_span && rel + n <= g.last_span) {
        (write ? g.last_buf->written : g.last_buf->read) += n;
        return;
    }
    const uintptr_t off = a - reinterpret_cast<uintptr_t>(g.tls_lo);
    if (off < g.tls_size) shared_access(off, n, write, pc);
    else if (a - g.buf_lo < g.buf_span) global_access(a, n, write, pc);
}

// A naturally aligned access (the compiler's __tsan_readN / __tsan_writeN, not the _unaligned_
// ones) of N = 2, 4, 8 or 16 bytes whose address is not a multiple of N: a GPU's vector or scalar
// load/store faults there ("misaligned address"), while x86 executes it (or splits a 16-byte int4
// copy into two 8-byte moves that never fault), so the emulator reports it.
[[noreturn]] void report_misaligned(uintptr_t a, size_t n, bool write, void* pc) {
    fail(kErrFault, "misaligned address: a %zu-byte %s at 0x%zx, which is only %zu-byte aligned (a GPU faults: "
         "%zu-byte accesses need %zu-byte alignment), at %s by %s, %s",
         n, write ? "store" : "load", a, static_cast<size_t>(a & (~a + 1)), n, n, pc_text(pc_offset(pc)).c_str(),
         thread_text(g.current->linear).c_str(), where_block().c_str());
    stop_current_thread();
}

inline __attribute__((always_inline)) void on_aligned_access(uintptr_t a, size_t n, bool write, void* pc) {
    if (g.current != nullptr && (a & (n - 1)) != 0) report_misaligned(a, n, write, pc);
    on_access(a, n, write, pc);
}

// A warp operation on `mask` completed: it orders the earlier accesses of its lanes before their
// later ones.
void on_warp_sync(unsigned warp_index, unsigned mask) {
    const uint32_t s = ++g.seq;
    if (mask == g.warps[warp_index].exists) {
        g.warp_sync[warp_index] = s;
        return;
    }
    if (!g.lane_sync_used) {
        g.lane_sync.assign(g.warp_sync.size() * 1024, 0);
        g.lane_sync_used = true;
    }
    uint32_t* m = &g.lane_sync[warp_index * 1024];
    for (unsigned i = 0; i < 32; ++i)
        if ((mask >> i) & 1u)
            for (unsigned j = 0; j < 32; ++j)
                if ((mask >> j) & 1u) m[i * 32 + j] = s;
}

void on_block_sync() { g.block_seq = ++g.seq; }

// Per launch: shadow state sized to the module's shared memory, a fresh numbering when it would wrap.
void prepare_checks(unsigned nwarps) {
    if (g.kind.size() != g.tls_size) {  // no layout from the launcher: every byte counts as valid
        g.kind.assign(g.tls_size, kStaticVar);
        std::fill(g.kind.begin() + g.dyn_off, g.kind.begin() + g.dyn_off + sizeof(cuda_emu_dynamic_smem), kDynamic);
    }
    if (g.cells.size() != g.tls_size) g.cells.assign(g.tls_size, G::Cell{});
    if (g.seq > 0xf0000000u) {
        std::fill(g.cells.begin(), g.cells.end(), G::Cell{});
        g.seq = 1;
    }
    g.warp_sync.assign(nwarps, 0);
    g.lane_sync_used = false;
    if (g.module_base == 0) {
        Dl_info info{};
        if (dladdr(reinterpret_cast<void*>(&pc_offset), &info) != 0) g.module_base = reinterpret_cast<uintptr_t>(info.dli_fbase);
    }
}
}  // namespace

void atomic_access(const void* p, size_t size, void* pc) {
    if (g.current == nullptr) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t off = a - reinterpret_cast<uintptr_t>(g.tls_lo);
    if (off < g.tls_size) {
        if (off + size > g.tls_size) report_shared_oob(off, size, true, pc);
        for (size_t i = 0; i < size; ++i) {
            const uint8_t k = g.kind[off + i];
            if (k == kGap || (k == kDynamic && off + i - g.dyn_off >= g.shared_mem)) report_shared_oob(off + i, size, true, pc);
        }
    } else if (a - g.buf_lo < g.buf_span) {
        global_access(a, size, true, pc);  // counted as written; an atomic also reads its target:
        for (G::Buffer& b : g.buffers)
            if (a >= b.lo && a + size <= b.hi) {
                b.read += size;
                break;
            }
    }
}

// ----- barriers and warp operations (called from kernel code) ----------------------------------
int block_barrier(int kind, int predicate, const std::source_location& loc) {
    Fiber* f = current_or_die("__syncthreads");
    f->state = St::AtBarrier;
    f->site = site_of(loc);
    f->op = kind;
    if (g.barrier_arrived == 0) {
        g.barrier_count = 0;
        g.barrier_and = 1;
        g.barrier_or = 0;
    }
    ++g.barrier_arrived;
    g.barrier_count += predicate;
    g.barrier_and &= predicate;
    g.barrier_or |= predicate;
    if (g.barrier_arrived == g.nthreads) {
        const Fiber* first = g.fibers[0];
        for (unsigned i = 1; i < g.nthreads; ++i) {
            const Fiber* o = g.fibers[i];
            if (!same_site(o->site, first->site) || o->op != first->op) {
                fail(kErrBarrier,
                     "divergent barrier in %s: the threads of the block wait at different barriers; all must reach "
                     "the same __syncthreads():%s",
                     where_block().c_str(), describe_block().c_str());
                stop_current_thread();
            }
        }
        uint64_t result = 0;
        if (kind == kSyncCount) result = static_cast<uint64_t>(g.barrier_count);
        else if (kind == kSyncAnd) result = static_cast<uint64_t>(g.barrier_and);
        else if (kind == kSyncOr) result = static_cast<uint64_t>(g.barrier_or);
        for (unsigned i = 0; i < g.nthreads; ++i) {
            g.fibers[i]->result = result;
            make_ready(g.fibers[i]);
        }
        g.barrier_arrived = 0;
        on_block_sync();
    }
    switch_to_scheduler(f);
    return static_cast<int>(f->result);
}

namespace {
void complete_warp_op(unsigned warp_index, const PendingWarpOp& p) {
    on_warp_sync(warp_index, p.mask);
    Fiber* const* lanes = &g.fibers[warp_index * 32];
    uint64_t combined = 0;
    if (p.op == kMmaSync) {
        void* args[32] = {};
        const WarpCollective* any = nullptr;
        for (unsigned lane = 0; lane < 32; ++lane) {
            if (!((p.mask >> lane) & 1u)) continue;
            args[lane] = reinterpret_cast<void*>(static_cast<uintptr_t>(lanes[lane]->value));
            any = static_cast<const WarpCollective*>(args[lane]);
        }
        if (any != nullptr) any->fn(args);
    } else if (p.op == kBallot || p.op == kAny || p.op == kAll) {
        for (unsigned lane = 0; lane < 32; ++lane)
            if ((p.mask >> lane) & 1u && lanes[lane]->value != 0) combined |= 1ull << lane;
        if (p.op == kAny) combined = combined != 0;
        if (p.op == kAll) combined = combined == p.mask;
    } else if (p.op >= kReduceAddU) {
        bool first = true;
        uint32_t acc = 0;
        for (unsigned lane = 0; lane < 32; ++lane) {
            if (!((p.mask >> lane) & 1u)) continue;
            const uint32_t v = static_cast<uint32_t>(lanes[lane]->value);
            if (first) {
                acc = v;
                first = false;
                continue;
            }
            switch (p.op) {
                case kReduceAddU:
                case kReduceAddS: acc += v; break;
                case kReduceMinU: acc = std::min(acc, v); break;
                case kReduceMaxU: acc = std::max(acc, v); break;
                case kReduceMinS: acc = static_cast<uint32_t>(std::min(static_cast<int32_t>(acc), static_cast<int32_t>(v))); break;
                case kReduceMaxS: acc = static_cast<uint32_t>(std::max(static_cast<int32_t>(acc), static_cast<int32_t>(v))); break;
                case kReduceAnd: acc &= v; break;
                case kReduceOr: acc |= v; break;
                case kReduceXor: acc ^= v; break;
                default: break;
            }
        }
        combined = acc;
    }
    const bool shuffle = p.op >= kShflIdx && p.op <= kShflXor;
    // Results first, then release: a lane's value must not be read after its result is written.
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (!((p.mask >> lane) & 1u)) continue;
        Fiber* f = lanes[lane];
        if (!shuffle) {
            f->result = combined;
            continue;
        }
        const int width = p.width;
        const int me = static_cast<int>(lane);
        const int seg = me & ~(width - 1);
        const int arg = f->arg;
        int src = me;
        switch (p.op) {
            case kShflIdx: src = seg + (arg & (width - 1)); break;
            case kShflUp: src = (me - arg >= seg) ? me - arg : me; break;
            case kShflDown: src = (me + arg < seg + width) ? me + arg : me; break;
            case kShflXor: src = ((me ^ arg) < seg + width) ? (me ^ arg) : me; break;  // later groups: own value
            default: break;
        }
        if (src < 0 || src > 31 || !((p.mask >> src) & 1u)) {
            fail(kErrBarrier,
                 "%s at %s in %s: lane %u reads lane %d, which is not in the mask 0x%08x (its value is "
                 "undefined on a GPU)",
                 warp_op_name(p.op), site_text(p.site).c_str(), where_block().c_str(), lane, src, p.mask);
            stop_current_thread();
        }
        f->result = lanes[src]->value;
    }
    for (unsigned lane = 0; lane < 32; ++lane)
        if ((p.mask >> lane) & 1u) make_ready(lanes[lane]);
}
}  // namespace

uint64_t warp_op(int op, unsigned mask, uint64_t value, int arg, int width, const std::source_location& loc) {
    Fiber* f = current_or_die(warp_op_name(op));
    const unsigned warp_index = f->linear / 32, lane = f->linear % 32;
    Warp& w = g.warps[warp_index];
    f->site = site_of(loc);
    f->op = op;
    f->mask = mask;
    if (!((mask >> lane) & 1u)) {
        fail(kErrBarrier, "%s at %s: the calling lane %u is not in its mask 0x%08x (%s)", warp_op_name(op),
             site_text(f->site).c_str(), lane, mask, where(f).c_str());
        stop_current_thread();
    }
    if (mask & ~w.exists) {
        fail(kErrBarrier,
             "%s at %s: incomplete warp. The mask 0x%08x names lanes that do not exist: warp %u of the block has "
             "lanes 0x%08x only (blockDim (%u,%u,%u) = %u threads is not a multiple of 32). Launch full warps or "
             "pass the mask of the existing lanes (%s)",
             warp_op_name(op), site_text(f->site).c_str(), mask, warp_index, w.exists, g_builtins.block_dim.x,
             g_builtins.block_dim.y, g_builtins.block_dim.z, g.nthreads, where(f).c_str());
        stop_current_thread();
    }
    if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
        fail(kErrBarrier, "%s at %s: width %d is not a power of two in [1, 32] (%s)", warp_op_name(op),
             site_text(f->site).c_str(), width, where(f).c_str());
        stop_current_thread();
    }
    PendingWarpOp* p = nullptr;
    for (int k = 0; k < w.npending; ++k) {
        PendingWarpOp& q = w.pending[k];
        if (!(q.mask & mask)) continue;
        if (q.mask != mask || q.op != op || q.width != width || !same_site(q.site, f->site)) {
            fail(kErrBarrier,
                 "divergent warp operation in warp %u of %s: lane %u is at %s(mask 0x%08x, width %d) at %s while "
                 "lanes of that warp wait at %s(mask 0x%08x, width %d) at %s. The lanes named in a mask must all "
                 "reach the same warp operation with the same mask.",
                 warp_index, where_block().c_str(), lane, warp_op_name(op), mask, width, site_text(f->site).c_str(),
                 warp_op_name(q.op), q.mask, q.width, site_text(q.site).c_str());
            stop_current_thread();
        }
        p = &q;
        break;
    }
    if (p == nullptr) {
        p = &w.pending[w.npending++];  // at most 32: the masks are disjoint and non-empty
        *p = PendingWarpOp{mask, op, width, 0, f->site};
    }
    f->value = value;
    f->arg = arg;
    f->state = St::AtWarpOp;
    if (++p->arrived == __builtin_popcount(mask)) {
        const PendingWarpOp done = *p;
        *p = w.pending[--w.npending];
        complete_warp_op(warp_index, done);
    }
    switch_to_scheduler(f);
    return f->result;
}

unsigned active_mask() {
    Fiber* f = current_or_die("__activemask");
    const unsigned warp_index = f->linear / 32;
    unsigned m = 0;
    for (unsigned lane = 0; lane < 32; ++lane) {
        const unsigned id = warp_index * 32 + lane;
        if (id < g.nthreads && g.fibers[id]->state != St::Done && g.fibers[id]->state != St::Trapped) m |= 1u << lane;
    }
    return m;
}

void misaligned_vector_access(const void* p, size_t align, bool write, const std::source_location& loc) {
    if (g.current == nullptr) return;  // the launcher's own copies (kernel arguments)
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    fail(kErrFault, "misaligned address: a %zu-byte vector %s at 0x%zx, which is only %zu-byte aligned (a GPU "
         "faults), at %s (%s)", align, write ? "store" : "load", a, static_cast<size_t>(a & (~a + 1)),
         site_text(site_of(loc)).c_str(), where(g.current).c_str());
    stop_current_thread();
}

void trap(const char* what, const std::source_location& loc) {
    Fiber* f = current_or_die("__trap");
    fail(kErrTrap, "%s at %s (%s)", what, site_text(site_of(loc)).c_str(), where(f).c_str());
    stop_current_thread();
}

long long clock_ticks() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<long long>(ts.tv_sec) * 1000000000ll + ts.tv_nsec;
}

// ----- launch -----------------------------------------------------------------------------------
namespace {

void on_signal(int sig, siginfo_t* info, void*) {
    if (!g_in_launch || !pthread_equal(pthread_self(), g_launch_thread)) {
        if (sig == kTimerSignal) return;
        // Not ours: put the previous handler back; the faulting instruction runs again and reaches it.
        sigaction(sig, &g_old_actions[sig], nullptr);
        return;
    }
    g_sig = sig;
    g_sig_code = info->si_code;
    g_sig_addr = info->si_addr;
    siglongjmp(g_jmp, 1);
}

std::string describe_signal() {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(g_sig_addr);
    const Fiber* f = g.current;
    std::string who = f ? where(f) : format("the emulator itself, between threads of %s", where_block().c_str());
    if (g_sig == kTimerSignal) return who;
    std::string what;
    switch (g_sig) {
        case SIGSEGV: what = "SIGSEGV (invalid memory access)"; break;
        case SIGBUS: what = "SIGBUS (misaligned or invalid memory access)"; break;
        case SIGFPE: what = (g_sig_code == FPE_INTDIV) ? "SIGFPE (integer division by zero)" : "SIGFPE (arithmetic fault)"; break;
        case SIGILL:  // si_addr is the trapping instruction: its source line ({pc:} adds the -1 back)
            what = format("SIGILL (illegal instruction at %s: in a checked build, an index out of the bounds of an "
                          "array of known size, a thread's local array or a static __shared__ one; else "
                          "__builtin_unreachable() or __builtin_trap() reached?)",
                          pc_text(static_cast<uint32_t>(addr - g.module_base + 1)).c_str());
            break;
        default: what = format("signal %d", g_sig); break;
    }
    std::string hint;
    for (const Fiber* s : g.fibers) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(s->mem);
        if (addr >= lo && addr < lo + kStackGuard) {
            hint = format("; the address is in the guard page of an emulated thread's stack: stack overflow (stacks are "
                          "%zu KiB, set CUTP_EMU_STACK_KB for more)",
                          g.stack_size / 1024);
            break;
        }
    }
    if (hint.empty() && (g_sig == SIGSEGV || g_sig == SIGBUS))
        hint = "; the kernel read or wrote far outside its arrays (accesses just past an array hit the launcher's "
               "guard regions instead, which are reported as OutOfBoundsError), or dereferenced a null/host pointer";
    return format("%s at address 0x%zx in %s%s", what.c_str(), static_cast<size_t>(addr), who.c_str(), hint.c_str());
}

}  // namespace
}  // namespace cuda_emu::detail

using namespace cuda_emu::detail;

// glibc's assert() calls this. Defining it here (hidden, so it binds inside this module only)
// turns the assert of a kernel that included <assert.h> itself into a DeviceAssertError too,
// instead of an abort() of the test process.
extern "C" __attribute__((visibility("hidden"), noreturn)) void __assert_fail(const char* assertion, const char* file,
                                                                           unsigned int line,
                                                                           const char* function) noexcept {
    if (g.current == nullptr) {
        fprintf(stderr, "%s:%u: %s: assertion `%s' failed\n", file, line, function, assertion);
        abort();
    }
    fail(kErrTrap, "assertion failed: %s at %s:%u in %s (%s)", assertion, file, line, function, where(g.current).c_str());
    stop_current_thread();
}

extern "C" __attribute__((visibility("default"))) uint32_t cuda_emu_runtime_abi() { return cuda_emu::kAbiVersion; }

// The instrumentation's entry points (checked builds; see "Checks"). The return address is the
// kernel code that made the access.
#define CUDA_EMU_ACCESS(n)                                                                                         \
    extern "C" __attribute__((visibility("hidden"))) void __tsan_read##n(uintptr_t a) {                            \
        on_aligned_access(a, n, false, __builtin_return_address(0));                                               \
    }                                                                                                              \
    extern "C" __attribute__((visibility("hidden"))) void __tsan_write##n(uintptr_t a) {                           \
        on_aligned_access(a, n, true, __builtin_return_address(0));                                                \
    }                                                                                                              \
    extern "C" __attribute__((visibility("hidden"))) void __tsan_unaligned_read##n(uintptr_t a) {                  \
        on_access(a, n, false, __builtin_return_address(0));                                                       \
    }                                                                                                              \
    extern "C" __attribute__((visibility("hidden"))) void __tsan_unaligned_write##n(uintptr_t a) {                 \
        on_access(a, n, true, __builtin_return_address(0));                                                        \
    }
CUDA_EMU_ACCESS(1)
CUDA_EMU_ACCESS(2)
CUDA_EMU_ACCESS(4)
CUDA_EMU_ACCESS(8)
CUDA_EMU_ACCESS(16)
#undef CUDA_EMU_ACCESS
extern "C" __attribute__((visibility("hidden"))) void __tsan_read_range(uintptr_t a, size_t n) {
    on_access(a, n, false, __builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"))) void __tsan_write_range(uintptr_t a, size_t n) {
    on_access(a, n, true, __builtin_return_address(0));
}
// C++ atomics in instrumented code (the guard of a function-local static) become these.
#define CUDA_EMU_TSAN_ATOMIC(bits)                                                                                 \
    extern "C" __attribute__((visibility("hidden"))) uint##bits##_t __tsan_atomic##bits##_load(                     \
        const volatile uint##bits##_t* a, int) {                                                                   \
        return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                               \
    }                                                                                                              \
    extern "C" __attribute__((visibility("hidden"))) void __tsan_atomic##bits##_store(volatile uint##bits##_t* a,  \
                                                                                      uint##bits##_t v, int) {     \
        __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                                  \
    }
CUDA_EMU_TSAN_ATOMIC(8)
CUDA_EMU_TSAN_ATOMIC(16)
CUDA_EMU_TSAN_ATOMIC(32)
CUDA_EMU_TSAN_ATOMIC(64)
#undef CUDA_EMU_TSAN_ATOMIC
extern "C" __attribute__((visibility("hidden"))) void __tsan_init() {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_func_entry(void*) {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_func_exit() {}

// The static __shared__ variables of the module (from its symbol table, read by the launcher):
// offsets in the TLS block, sizes, names. Called once after loading.
extern "C" __attribute__((visibility("default"))) void cuda_emu_set_shared_vars(uint64_t n, const uint64_t* offsets,
                                                                               const uint64_t* sizes,
                                                                               const char* const* names) {
    unsigned char *lo, *hi;
    if (!tls_block(&lo, &hi)) return;
    const size_t size = static_cast<size_t>(hi - lo);
    const size_t dyn = static_cast<size_t>(&cuda_emu_dynamic_smem[0] - lo);
    g.vars.clear();
    g.kind.assign(size, kGap);
    std::fill(g.kind.begin() + dyn, g.kind.begin() + dyn + sizeof(cuda_emu_dynamic_smem), kDynamic);
    for (uint64_t i = 0; i < n; ++i) {
        if (offsets[i] == dyn || offsets[i] + sizes[i] > size) continue;
        g.vars.push_back(G::Var{names[i], offsets[i], sizes[i]});
        std::fill(g.kind.begin() + offsets[i], g.kind.begin() + offsets[i] + sizes[i], kStaticVar);
    }
}

// The array arguments of the next launch: per buffer lo, hi, guard_lo, guard_hi, itemsize (5
// values) and a name for reports. detect_races: 0 to check bounds only.
extern "C" __attribute__((visibility("default"))) void cuda_emu_set_buffers(uint64_t n, const uint64_t* ranges,
                                                                           const char* const* names, int detect_races) {
    g.buffers.clear();
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (uint64_t i = 0; i < n; ++i) {
        const uint64_t* r = ranges + 5 * i;
        g.buffers.push_back(G::Buffer{r[0], r[1], r[2], r[3], r[4] ? r[4] : 1, names[i]});
        lo = std::min<uintptr_t>(lo, r[2]);
        hi = std::max<uintptr_t>(hi, r[3]);
    }
    g.buf_lo = n ? lo : 0;
    g.buf_span = n ? hi - lo : 0;
    g.last_lo = g.last_span = 0;
    g.last_buf = nullptr;
    g.detect_races = detect_races != 0;
}

// Traffic counting (checked builds): per buffer of the last cuda_emu_set_buffers, the bytes the
// kernel code read and wrote since then (every instrumented access, its size: a 128-bit load
// counts 16, a scalar bf16 load 2; atomics count as a read and a write). n: the capacity of out,
// in buffers; 2 values per buffer. Returns the number of buffers.
extern "C" __attribute__((visibility("default"))) uint64_t cuda_emu_buffer_traffic(uint64_t n, uint64_t* out) {
    for (uint64_t i = 0; i < n && i < g.buffers.size(); ++i) {
        out[2 * i] = g.buffers[i].read;
        out[2 * i + 1] = g.buffers[i].written;
    }
    return g.buffers.size();
}
extern "C" __attribute__((visibility("default"))) uint64_t cuda_emu_max_dynamic_smem() { return kMaxDynamicSmem; }

// Bytes of static `__shared__` storage in the module (all kernels together).
extern "C" __attribute__((visibility("default"))) uint64_t cuda_emu_static_smem_bytes() {
    unsigned char *lo, *hi;
    if (!tls_block(&lo, &hi)) return 0;
    return static_cast<uint64_t>(hi - lo) - sizeof(cuda_emu_dynamic_smem);
}

// Runs one launch. grid/block: 3 values each, validated by the caller. args: one pointer per
// kernel parameter to its value (cuLaunchKernel's kernelParams). Returns 0 or an Error code with
// a message in err.
extern "C" __attribute__((visibility("default"))) int cuda_emu_launch(const cuda_emu::KernelDesc* kernel,
                                                                     const uint32_t* grid, const uint32_t* block,
                                                                     uint64_t shared_mem, void** args, int schedule,
                                                                     uint64_t seed, double timeout_s,
                                                                     uint64_t stack_size, char* err, uint64_t errlen) {
    g.error = kOk;
    g.message.clear();
    g.current = nullptr;
    g.kernel = kernel;
    g.args = args;
    g.schedule = schedule;
    g.rng = seed;
    g.shared_mem = shared_mem;
    g_builtins.block_dim = dim3(block[0], block[1], block[2]);
    g_builtins.grid_dim = dim3(grid[0], grid[1], grid[2]);
    g_builtins.block_idx = uint3{0, 0, 0};
    const unsigned long long nthreads = 1ull * block[0] * block[1] * block[2];
    const unsigned long long nblocks = 1ull * grid[0] * grid[1] * grid[2];
    unsigned char* const dyn = &cuda_emu_dynamic_smem[0];
    const size_t dyn_total = sizeof(cuda_emu_dynamic_smem);

    if (nthreads == 0 || nthreads > kMaxThreads || nblocks == 0) fail(kErrConfig, "invalid launch configuration");
    else if (shared_mem > kMaxDynamicSmem) fail(kErrConfig, "shared_mem %llu exceeds %zu bytes", (unsigned long long)shared_mem, kMaxDynamicSmem);
    else if ((schedule == kRandom || schedule == kWarpRandom) && nblocks > (1ull << 27)) fail(kErrConfig, "grid of %llu blocks too large for the random schedule", nblocks);
    else if (!tls_block(&g.tls_lo, &g.tls_hi) || dyn < g.tls_lo || dyn + dyn_total > g.tls_hi)
        fail(kErrConfig, "cannot locate the module's thread-local shared memory");
    else if (reinterpret_cast<uintptr_t>(dyn) % 16 != 0) fail(kErrConfig, "dynamic shared memory is misaligned");
    else if (ensure_fibers(static_cast<unsigned>(nthreads), ((stack_size + 4095) / 4096) * 4096)) {
        g.nthreads = static_cast<unsigned>(nthreads);
        g.warps.assign((g.nthreads + 31) / 32, Warp{});
        g.tls_size = static_cast<size_t>(g.tls_hi - g.tls_lo);
        g.dyn_off = static_cast<size_t>(dyn - g.tls_lo);
        prepare_checks(static_cast<unsigned>(g.warps.size()));
        for (unsigned w = 0; w < g.warps.size(); ++w) {
            const unsigned lanes = std::min(32u, g.nthreads - w * 32);
            g.warps[w].exists = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
        }
    }
    if (g.error != kOk) {
        snprintf(err, errlen, "%s", g.message.c_str());
        return g.error;
    }

    std::vector<uint32_t> order;
    if (schedule == kRandom || schedule == kWarpRandom) {
        order.resize(nblocks);
        for (uint32_t i = 0; i < nblocks; ++i) order[i] = i;
        for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
    }

    // Signals: faults and the watchdog timer become errors of this launch instead of killing or
    // hanging the test process.
    stack_t alt{}, old_alt{};
    alt.ss_sp = g_altstack_mem;
    alt.ss_size = sizeof(g_altstack_mem);
    sigaltstack(&alt, &old_alt);
    struct sigaction sa {};
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (int s : kFaultSignals) sigaction(s, &sa, &g_old_actions[s]);
    sigaction(kTimerSignal, &sa, &g_old_actions[kTimerSignal]);
    timer_t timer{};
    volatile bool have_timer = false;  // read after siglongjmp
    if (timeout_s > 0) {
        sigevent sev{};
        sev.sigev_notify = SIGEV_THREAD_ID;
        sev.sigev_signo = kTimerSignal;
        sev._sigev_un._tid = static_cast<pid_t>(syscall(SYS_gettid));
        if (timer_create(CLOCK_MONOTONIC, &sev, &timer) == 0) {
            have_timer = true;
            itimerspec its{};
            its.it_value.tv_sec = static_cast<time_t>(timeout_s);
            its.it_value.tv_nsec = static_cast<long>((timeout_s - static_cast<double>(its.it_value.tv_sec)) * 1e9);
            if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0) its.it_value.tv_nsec = 1;
            timer_settime(timer, 0, &its, nullptr);
        }
    }
    // IEEE defaults for the launch (round to nearest, no flush-to-zero), as CUDA without fast-math:
    // a library loaded into the process may have set FTZ/DAZ for this thread.
    fenv_t saved_fenv;
    fegetenv(&saved_fenv);
    fesetenv(FE_DFL_ENV);
#if defined(__x86_64__)
    const uint32_t ieee_mxcsr = 0x1f80;  // all exceptions masked, FTZ and DAZ off
    asm volatile("ldmxcsr %0" : : "m"(ieee_mxcsr));
#endif
    g_launch_thread = pthread_self();
    g_sig = 0;
    g_in_launch = 1;

    if (sigsetjmp(g_jmp, 1) == 0) {
        const dim3 gd = g_builtins.grid_dim;
        for (unsigned long long b = 0; b < nblocks && g.error == kOk; ++b) {
            const unsigned long long lin = (schedule == kRandom || schedule == kWarpRandom) ? order[b]
                                           : (schedule == kReverse || schedule == kWarpReverse) ? nblocks - 1 - b
                                                                                                 : b;
            g_builtins.block_idx = uint3{static_cast<unsigned>(lin % gd.x), static_cast<unsigned>((lin / gd.x) % gd.y),
                                         static_cast<unsigned>(lin / (1ull * gd.x * gd.y))};
            // Poison all shared memory: static __shared__ variables and the dynamic buffer up to
            // the requested size plus a guard, whose integrity is checked after the block.
            fill_pattern(g.tls_lo, static_cast<size_t>(dyn - g.tls_lo));
            fill_pattern(dyn, shared_mem + kSmemGuard);
            fill_pattern(dyn + dyn_total, static_cast<size_t>(g.tls_hi - (dyn + dyn_total)));
            on_block_sync();
            run_block();
            if (g.error != kOk) break;
            const size_t bad = pattern_mismatch(dyn + shared_mem, kSmemGuard);
            if (bad != kSmemGuard)
                fail(kErrSharedOverflow,
                     "%s wrote past the end of its dynamic shared memory: shared_mem=%llu bytes were given at launch "
                     "and byte %llu (0x%llx) was written",
                     where_block().c_str(), (unsigned long long)shared_mem, (unsigned long long)(shared_mem + bad),
                     (unsigned long long)(shared_mem + bad));
        }
    } else if (g_sig == kTimerSignal) {
        g.error = kErrTimeout;
        g.message = format("the kernel did not finish within %g s (was in %s). An infinite loop, or a spin-wait for a "
                           "value another thread writes: emulated threads switch only at barriers and warp operations, "
                           "so such a wait never ends here",
                           timeout_s, describe_signal().c_str());
    } else {
        g.error = kErrFault;
        g.message = describe_signal();
    }

    g_in_launch = 0;
    fesetenv(&saved_fenv);
    if (have_timer) timer_delete(timer);
    for (int s : kFaultSignals) sigaction(s, &g_old_actions[s], nullptr);
    sigaction(kTimerSignal, &g_old_actions[kTimerSignal], nullptr);
    sigaltstack(&old_alt, nullptr);
    g.current = nullptr;
    fflush(stdout);
    snprintf(err, errlen, "%s", g.message.c_str());
    return g.error;
}
