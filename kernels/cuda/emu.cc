/* The CUDA emulator's machinery (see emu.h): fibers and their scheduler, the runtime API over host
 * memory, and cuBLAS's GemmEx as a reference GEMM. Compiled only into the emulation build. */
#include "kernels/cuda/emu.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace emu {

__thread thread_state *cur_thread;
__thread block_state *cur_block;

/* ---------------------------------------------------------------- context switch */

#if defined(__x86_64__)
/* emu_switch(save, to): pushes the callee-saved registers (System V: rbx, rbp, r12-r15) on the
 * current stack, stores the stack pointer in *save, loads `to` and pops the same from there. A
 * fresh fiber's stack is laid out as if it had switched away at emu_fiber_entry's first
 * instruction (new_stack below). The SSE and x87 control words, callee-saved too, are left
 * alone: nothing in kvserve changes them (and reloading them costs more than the rest). */
extern "C" void emu_switch(void **save, void *to);
asm(".text\n"
    ".globl emu_switch\n"
    ".type emu_switch, @function\n"
    "emu_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size emu_switch, .-emu_switch\n");
#endif

/* ---------------------------------------------------------------- the scheduler */

/* A block's threads are fibers run in a fixed round-robin order. A fiber that waits at a barrier
 * or finishes switches straight to the next runnable fiber (the launching thread only starts the
 * block and gets it back at the end). A barrier is released, its waiters made runnable, by the
 * fiber whose arrival (or exit) completes it: counters keep that O(1). */
enum fiber_state { FIBER_RUNNABLE, FIBER_AT_BLOCK, FIBER_AT_WARP, FIBER_DONE };

struct fiber {
    thread_state ts;
    fiber_state state;
    unsigned char *stack; /* lowest usable byte (a guard page lies below) */
#if defined(__x86_64__)
    void *sp;
#else
    ucontext_t uc;
#endif
    void *asan_fake;
};

struct warp_slots {
    uint64_t v[2][32];               /* exchange rows: a shuffle's phase picks one (see exchange) */
    unsigned n[2][32];               /* the phase each lane deposited at: who took part */
    uint32_t g[2][32][GATHER_WORDS]; /* warp_gather's rows, by phase as v */
    int alive;                       /* lanes that have not exited */
    int waiting;                     /* lanes at the warp barrier */
};

/* The emulator of one host thread: fibers and stacks reused from launch to launch. */
struct scheduler {
    std::vector<fiber> fibers;
    std::vector<warp_slots> warps;
    unsigned char *stacks = nullptr;
    size_t n_stacks = 0;
    std::vector<unsigned char> dyn_smem;
    block_state block{};
    void (*fn)(void *) = nullptr;
    void *arg = nullptr;
    fiber *running = nullptr;
    size_t n = 0;        /* threads of the block */
    size_t live = 0;     /* not finished */
    size_t at_block = 0; /* waiting at __syncthreads */
    bool deadlock = false;
#if defined(__x86_64__)
    void *main_sp = nullptr;
#else
    ucontext_t main_uc;
#endif
    void *main_fake = nullptr;
    const void *main_bottom = nullptr;
    size_t main_size = 0;
    bool from_main = false; /* the switch in progress leaves the launching thread's stack */

    ~scheduler() {
        if (stacks) munmap(stacks, n_stacks * stride());
    }
    static size_t stride() { return page() + stack_bytes(); }
    static size_t page() { return (size_t)sysconf(_SC_PAGESIZE); }
    /* Kernels keep small arrays in registers (locals); sanitizers' frames are larger. */
    static size_t stack_bytes() { return EMU_ASAN ? 512 * 1024 : 128 * 1024; }
    bool reserve(size_t n);
};

/* One per host thread, freed at its exit. */
static scheduler &sched() {
    static thread_local scheduler s;
    return s;
}

bool scheduler::reserve(size_t count) {
    if (count <= n_stacks) return true;
    if (stacks) munmap(stacks, n_stacks * stride());
    stacks = nullptr;
    n_stacks = 0;
    size_t bytes = count * stride();
    void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    stacks = static_cast<unsigned char *>(p);
    n_stacks = count;
    for (size_t i = 0; i < count; i++) mprotect(stacks + i * stride(), page(), PROT_NONE);
    fibers.resize(count);
    for (size_t i = 0; i < count; i++) fibers[i].stack = stacks + i * stride() + page();
    return true;
}

static void asan_start(void **fake, const void *bottom, size_t size) {
#if EMU_ASAN
    __sanitizer_start_switch_fiber(fake, bottom, size);
#else
    (void)fake, (void)bottom, (void)size;
#endif
}

static void asan_finish(void *fake, const void **bottom, size_t *size) {
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, bottom, size);
#else
    (void)fake, (void)bottom, (void)size;
#endif
}

/* Makes the waiters of warp w's barrier (or the block's) runnable once all live members wait. */
static void release_warp(scheduler &s, size_t w) {
    warp_slots &ws = s.warps[w];
    if (ws.waiting == 0 || ws.waiting != ws.alive) return;
    size_t lo = w * 32, hi = lo + 32 < s.n ? lo + 32 : s.n;
    for (size_t t = lo; t < hi; t++)
        if (s.fibers[t].state == FIBER_AT_WARP) s.fibers[t].state = FIBER_RUNNABLE;
    ws.waiting = 0;
}

static void release_block(scheduler &s) {
    if (s.at_block == 0 || s.at_block != s.live) return;
    for (size_t t = 0; t < s.n; t++)
        if (s.fibers[t].state == FIBER_AT_BLOCK) s.fibers[t].state = FIBER_RUNNABLE;
    s.at_block = 0;
}

/* The running fiber stops (waits or finishes) and the next runnable one after it in round-robin
 * order runs; returns when this fiber is resumed. The launching thread resumes when none is left
 * to run: the block is done, or deadlocked (s.deadlock). */
static void yield_to_scheduler(fiber_state why) {
    scheduler &s = sched();
    fiber *f = s.running;
    const size_t me = (size_t)(f - s.fibers.data()), w = (size_t)f->ts.warp;
    f->state = why;
    if (why == FIBER_AT_WARP) {
        s.warps[w].waiting++;
        release_warp(s, w);
    } else if (why == FIBER_AT_BLOCK) {
        s.at_block++;
        release_block(s);
    } else {
        s.live--;
        s.warps[w].alive--;
        release_warp(s, w);
        release_block(s);
    }
    fiber *next = nullptr;
    for (size_t k = 1; k <= s.n; k++) {
        fiber *c = &s.fibers[(me + k) % s.n];
        if (c->state == FIBER_RUNNABLE) {
            next = c;
            break;
        }
    }
    if (next == f) return; /* it released its own barrier and nobody else can run */
    void **save = why == FIBER_DONE ? nullptr : &f->asan_fake;
    if (!next) {
        s.deadlock = s.live > 0;
        s.running = nullptr;
        asan_start(save, s.main_bottom, s.main_size);
#if defined(__x86_64__)
        emu_switch(&f->sp, s.main_sp);
#else
        swapcontext(&f->uc, &s.main_uc);
#endif
    } else {
        s.running = next;
        cur_thread = &next->ts;
        asan_start(save, next->stack, scheduler::stack_bytes());
#if defined(__x86_64__)
        emu_switch(&f->sp, next->sp);
#else
        swapcontext(&f->uc, &next->uc);
#endif
    }
    asan_finish(f->asan_fake, nullptr, nullptr);
}

static void fiber_body() {
    scheduler &s = sched();
    /* the first fiber of a block learns the launching thread's stack, for switching back */
    if (s.from_main)
        asan_finish(nullptr, &s.main_bottom, &s.main_size);
    else
        asan_finish(nullptr, nullptr, nullptr);
    s.from_main = false;
    s.fn(s.arg);
    yield_to_scheduler(FIBER_DONE); /* never resumed */
    std::abort();
}

#if defined(__x86_64__)
extern "C" void emu_fiber_entry() { fiber_body(); }

/* A stack that emu_switch "returns" into emu_fiber_entry on, aligned as after a call. Stacks lie
 * a multiple of the page size apart; fiber i's top is moved down i % 64 cache lines so that the
 * fibers' top frames do not all fall in the same cache set (which made every switch a miss). */
static void *new_stack(unsigned char *stack, size_t size, size_t fiber_index) {
    uintptr_t top = ((uintptr_t)(stack + size) - (fiber_index % 64) * 64) & ~(uintptr_t)15;
    uint64_t *sp = reinterpret_cast<uint64_t *>(top);
    *--sp = 0;                                    /* emu_fiber_entry's return address */
    *--sp = (uint64_t)(uintptr_t)emu_fiber_entry; /* emu_switch's ret */
    for (int i = 0; i < 6; i++) *--sp = 0;        /* rbp rbx r12 r13 r14 r15 */
    return sp;
}
#endif

/* Runs a block's n threads to the end. */
static void run_block(size_t n, unsigned warps) {
    scheduler &s = sched();
    uint3 tid = {0, 0, 0}; /* x-major, counted (a division per thread showed in profiles) */
    for (size_t t = 0; t < n; t++) {
        fiber &f = s.fibers[t];
        f.ts.tid = tid;
        if (++tid.x == s.block.dim.x) {
            tid.x = 0;
            if (++tid.y == s.block.dim.y) tid.y = 0, tid.z++;
        }
        f.ts.lane = (int)(t % 32);
        f.ts.warp = (int)(t / 32);
        f.ts.phase = 0;
        f.state = FIBER_RUNNABLE;
        f.asan_fake = nullptr;
#if EMU_ASAN
        /* A finished fiber's frames all returned (and were unpoisoned) but the bottom three,
         * fiber_body's, which it left by switching away: they lie in the stack's top pages. */
        const size_t top = 32 * 1024;
        __asan_unpoison_memory_region(f.stack + scheduler::stack_bytes() - top, top);
#endif
#if defined(__x86_64__)
        f.sp = new_stack(f.stack, scheduler::stack_bytes(), t);
#else
        getcontext(&f.uc);
        f.uc.uc_stack.ss_sp = f.stack;
        f.uc.uc_stack.ss_size = scheduler::stack_bytes();
        f.uc.uc_link = nullptr;
        makecontext(&f.uc, fiber_body, 0);
#endif
    }
    for (unsigned w = 0; w < warps; w++) {
        warp_slots &ws = s.warps[w];
        std::memset(ws.n, 0, sizeof ws.n);
        ws.alive = (int)(n - (size_t)w * 32 < 32 ? n - (size_t)w * 32 : 32);
        ws.waiting = 0;
    }
    s.n = s.live = n;
    s.at_block = 0;
    s.deadlock = false;
    fiber &first = s.fibers[0];
    s.running = &first;
    cur_thread = &first.ts;
    s.from_main = true;
    asan_start(&s.main_fake, first.stack, scheduler::stack_bytes());
#if defined(__x86_64__)
    emu_switch(&s.main_sp, first.sp);
#else
    swapcontext(&s.main_uc, &first.uc);
#endif
    asan_finish(s.main_fake, nullptr, nullptr);
    if (s.deadlock) {
        const uint3 &b = s.block.bid;
        std::fprintf(stderr,
                     "cuda emulator: kernel %s deadlocks in block (%u,%u,%u): %zu of %zu live "
                     "threads at __syncthreads, the others at warp barriers that part of their "
                     "warp does not reach\n",
                     s.block.kernel, b.x, b.y, b.z, s.at_block, s.live);
        std::abort();
    }
    cur_thread = nullptr;
    s.running = nullptr;
}

void sync_block() { yield_to_scheduler(FIBER_AT_BLOCK); }
void sync_warp() { yield_to_scheduler(FIBER_AT_WARP); }

/* Lanes write row `phase % 2` and read it after the warp barrier. A lane can write that row again
 * only two shuffles later, after the next barrier, which every lane passes only once it has read
 * this one: two rows suffice. A lane took part in this shuffle when it deposited at the same
 * phase (lanes that exited before it did not). */
static warp_slots &deposit(uint64_t v, int *row, unsigned *phase) {
    thread_state *ts = cur_thread;
    warp_slots &w = sched().warps[(size_t)ts->warp];
    *phase = ++ts->phase;
    *row = (int)(*phase & 1);
    w.v[*row][ts->lane] = v;
    w.n[*row][ts->lane] = *phase;
    sync_warp();
    return w;
}

uint64_t exchange(uint64_t v, int src) {
    int row;
    unsigned phase;
    warp_slots &w = deposit(v, &row, &phase);
    if (src < 0 || src > 31 || w.n[row][src] != phase) return v; /* undefined on a GPU */
    return w.v[row][src];
}

const uint32_t *warp_gather(const uint32_t *words, int n) {
    thread_state *ts = cur_thread;
    warp_slots &w = sched().warps[(size_t)ts->warp];
    const unsigned phase = ++ts->phase;
    const int row = (int)(phase & 1);
    std::memcpy(w.g[row][ts->lane], words, sizeof(uint32_t) * (size_t)n);
    w.n[row][ts->lane] = phase;
    sync_warp();
    for (int l = 0; l < 32; l++)
        if (w.n[row][l] != phase) {
            std::fprintf(stderr,
                         "cuda emulator: kernel %s: a warp-wide matrix instruction in warp %d "
                         "without lane %d (every lane of the warp must execute it)\n",
                         cur_block->kernel, ts->warp, l);
            std::abort();
        }
    return &w.g[row][0][0];
}

/* The lanes that reach this point together: a warp barrier first lets lanes that leave the warp
 * (return early) do so, as a GPU's diverged lanes are not active here. */
unsigned active_mask() {
    sync_warp();
    scheduler &s = sched();
    size_t base = (size_t)cur_thread->warp * 32;
    unsigned n = s.block.dim.x * s.block.dim.y * s.block.dim.z, mask = 0;
    for (unsigned l = 0; l < 32 && base + l < n; l++)
        if (s.fibers[base + l].state != FIBER_DONE) mask |= 1u << l;
    return mask;
}

unsigned ballot(bool pred) {
    int row;
    unsigned phase, mask = 0;
    warp_slots &w = deposit(pred, &row, &phase);
    for (int l = 0; l < 32; l++)
        if (w.n[row][l] == phase && w.v[row][l]) mask |= 1u << l;
    return mask;
}

/* ---------------------------------------------------------------- launches */

static thread_local cudaError_t g_last_error = cudaSuccess;

/* The device's limits (sm_86/sm_90 without opting in to more shared memory). */
#define EMU_MAX_THREADS 1024
#define EMU_MAX_DYN_SMEM (48 * 1024)

/* False, with the error set, when the device would refuse the configuration. */
static bool launch_config_ok(const char *kernel, dim3 grid, dim3 block, size_t smem) {
    uint64_t n = (uint64_t)block.x * block.y * block.z;
    if (n == 0 || n > EMU_MAX_THREADS || block.z > 64 || grid.x == 0 || grid.y == 0 ||
        grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 ||
        smem > EMU_MAX_DYN_SMEM) {
        std::fprintf(stderr,
                     "cuda emulator: kernel %s: invalid launch grid (%u,%u,%u) block (%u,%u,%u) "
                     "shared %zu\n",
                     kernel, grid.x, grid.y, grid.z, block.x, block.y, block.z, smem);
        g_last_error = cudaErrorInvalidValue; /* what the device's runtime reports */
        return false;
    }
    return true;
}

bool launch(const char *kernel, dim3 grid, dim3 block, size_t smem, void (*fn)(void *), void *arg) {
    uint64_t n = (uint64_t)block.x * block.y * block.z;
    if (!launch_config_ok(kernel, grid, block, smem)) return false;
    scheduler &s = sched();
    if (!s.reserve((size_t)n)) {
        g_last_error = cudaErrorMemoryAllocation;
        return false;
    }
    unsigned warps = (unsigned)((n + 31) / 32);
    if (s.warps.size() < warps) s.warps.resize(warps);
    if (s.dyn_smem.size() < smem) s.dyn_smem.resize(smem);
    /* a launch inside a kernel (dynamic parallelism) is not supported */
    if (s.running) std::abort();
    block_state *outer = cur_block;
    s.block.grid = {grid.x, grid.y, grid.z};
    s.block.dim = {block.x, block.y, block.z};
    s.block.dyn_smem = s.dyn_smem.data();
    s.block.kernel = kernel;
    s.fn = fn;
    s.arg = arg;
    cur_block = &s.block;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                s.block.bid = {x, y, z};
                run_block((size_t)n, warps);
            }
    cur_block = outer;
    return true;
}

/* ---------------------------------------------------------------- memory */

static long g_live_allocs; /* the emulated device's allocation count (atomic) */

long live_allocations() { return __atomic_load_n(&g_live_allocs, __ATOMIC_RELAXED); }

} // namespace emu

/* For C tests (tests/unit/cuda_test.c). */
extern "C" long cuda_emu_live_allocations(void) { return emu::live_allocations(); }

/* ---------------------------------------------------------------- runtime API */

static cudaError_t emu_fail(cudaError_t e) {
    emu::g_last_error = e;
    return e;
}

/* Stream capture's checks (the graphs section below): cudaSuccess, or the error of a call that
 * conflicts with an active capture (which that invalidates). */
static cudaError_t capture_unsafe_call();
static cudaError_t capture_legacy_use();
static cudaError_t capture_device_sync();

static cudaError_t emu_fail_if(cudaError_t e) { return e == cudaSuccess ? e : emu_fail(e); }

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess:
        return "cudaSuccess";
    case cudaErrorInvalidValue:
        return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
        return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
        return "cudaErrorInvalidConfiguration";
    case cudaErrorNoDevice:
        return "cudaErrorNoDevice";
    case cudaErrorIllegalState:
        return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported:
        return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
        return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureImplicit:
        return "cudaErrorStreamCaptureImplicit";
    case cudaErrorCapturedEvent:
        return "cudaErrorCapturedEvent";
    case cudaErrorStreamCaptureWrongThread:
        return "cudaErrorStreamCaptureWrongThread";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInvalidConfiguration:
        return "invalid configuration argument";
    case cudaErrorNoDevice:
        return "no CUDA-capable device is detected";
    case cudaErrorIllegalState:
        return "the resource is not in a valid state to perform the requested operation";
    case cudaErrorStreamCaptureUnsupported:
        return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
        return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit:
        return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent:
        return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureWrongThread:
        return "attempt to terminate a thread-local capture sequence from another thread";
    }
    return "unknown error";
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = emu::g_last_error;
    emu::g_last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) { return emu::g_last_error; }

cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int dev) {
    return dev == 0 ? cudaSuccess : emu_fail(cudaErrorInvalidValue);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev) {
    if (dev != 0) return emu_fail(cudaErrorInvalidValue);
    std::memset(p, 0, sizeof *p);
    std::snprintf(p->name, sizeof p->name, "CUDA emulator (CPU)");
    p->totalGlobalMem = (size_t)1 << 34;
    p->sharedMemPerBlock = EMU_MAX_DYN_SMEM;
    p->multiProcessorCount = 4;
    p->major = 8;
    p->minor = 6;
    p->memoryBusWidth = 384;
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = (size_t)1 << 34;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) { return emu_fail_if(capture_device_sync()); }

/* Device memory is host memory from malloc: AddressSanitizer builds check kernels' bounds, to
 * the byte (the padding to 256 is poisoned: compute-sanitizer's memcheck counts a read past the
 * requested size as out of bounds too). */
cudaError_t cudaMalloc(void **p, size_t bytes) {
    if (cudaError_t e = capture_unsafe_call()) return emu_fail(e);
    const size_t rounded = (bytes + 255) / 256 * 256 + (bytes == 0) * 256;
    *p = std::aligned_alloc(256, rounded);
    if (!*p) return emu_fail(cudaErrorMemoryAllocation);
#if EMU_ASAN
    __asan_poison_memory_region(static_cast<char *>(*p) + bytes, rounded - bytes);
#endif
    __atomic_add_fetch(&emu::g_live_allocs, 1, __ATOMIC_RELAXED);
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    if (cudaError_t e = capture_unsafe_call()) return emu_fail(e);
    if (!p) return cudaSuccess;
    __atomic_sub_fetch(&emu::g_live_allocs, 1, __ATOMIC_RELAXED);
    std::free(p);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes) { return cudaMalloc(p, bytes); }
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags) {
    (void)flags;
    return cudaMalloc(p, bytes);
}
cudaError_t cudaFreeHost(void *p) { return cudaFree(p); }

/* Whether work on s goes to its capture; *e is then what the call returns (recorded: success). */
static bool capture_record(cudaStream_t s, const char *what, std::function<void()> body,
                           cudaError_t *e);

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    (void)kind;
    if (cudaError_t e = capture_unsafe_call()) return emu_fail(e);
    if (cudaError_t e = capture_legacy_use()) return emu_fail(e);
    if (bytes) std::memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s) {
    (void)kind;
    cudaError_t e;
    if (capture_record(
            s, "memcpy",
            [=]() {
                if (bytes) std::memmove(dst, src, bytes);
            },
            &e))
        return e;
    if (bytes) std::memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int value, size_t bytes) {
    if (cudaError_t e = capture_unsafe_call()) return emu_fail(e);
    if (cudaError_t e = capture_legacy_use()) return emu_fail(e);
    if (bytes) std::memset(p, value, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
    cudaError_t e;
    if (capture_record(
            s, "memset",
            [=]() {
                if (bytes) std::memset(p, value, bytes);
            },
            &e))
        return e;
    if (bytes) std::memset(p, value, bytes);
    return cudaSuccess;
}

struct emu_capture;

struct emu_stream {
    unsigned flags;
    emu_capture *cap; /* the capture in progress on it, or null */
};
struct emu_event {
    uint64_t cap_id; /* the capture its last record went into (emu_capture.id), or 0 */
};

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    *s = new (std::nothrow) emu_stream{flags, nullptr};
    return *s ? cudaSuccess : emu_fail(cudaErrorMemoryAllocation);
}
static void capture_abandon(cudaStream_t s);
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    capture_abandon(s);
    delete s;
    return cudaSuccess;
}
static cudaError_t capture_stream_sync(cudaStream_t s);
static cudaError_t capture_event_record(cudaEvent_t e, cudaStream_t s);
static cudaError_t capture_event_sync(cudaEvent_t e);
static cudaError_t capture_stream_wait(cudaStream_t s, cudaEvent_t e);
cudaError_t cudaStreamSynchronize(cudaStream_t s) { return emu_fail_if(capture_stream_sync(s)); }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    (void)flags;
    return emu_fail_if(capture_stream_wait(s, e));
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    (void)flags;
    *e = new (std::nothrow) emu_event{0};
    return *e ? cudaSuccess : emu_fail(cudaErrorMemoryAllocation);
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    return emu_fail_if(capture_event_record(e, s));
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return emu_fail_if(capture_event_sync(e)); }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    (void)start, (void)end;
    *ms = 0.0f; /* the emulator keeps no device time */
    return cudaSuccess;
}

/* ---------------------------------------------------------------- cuBLAS */

struct emu_cublas {
    cudaStream_t stream;
};

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = new (std::nothrow) emu_cublas{nullptr};
    return *h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

static void gemm_run(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float al,
                     const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                     int ldb, float be, void *C, int ldc);

static float emu_element(const void *p, cudaDataType t, size_t i) {
    uint16_t h;
    switch (t) {
    case CUDA_R_16F:
        std::memcpy(&h, (const uint8_t *)p + 2 * i, 2);
        return fp16_to_fp32(h);
    case CUDA_R_16BF:
        std::memcpy(&h, (const uint8_t *)p + 2 * i, 2);
        return bf16_to_fp32(h);
    default:
        return ((const float *)p)[i];
    }
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType at,
                            int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                            void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
    (void)algo;
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (ct != CUDA_R_32F || compute != CUBLAS_COMPUTE_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m < 0 || n < 0 || k < 0 || lda < (ta == CUBLAS_OP_N ? m : k) ||
        ldb < (tb == CUBLAS_OP_N ? k : n) || ldc < m)
        return CUBLAS_STATUS_INVALID_VALUE;
    const float al = *(const float *)alpha, be = *(const float *)beta;
    /* on a capturing stream, recorded with the scalars read now (host pointer mode) */
    cudaError_t e;
    if (capture_record(
            h->stream, "cublasGemmEx",
            [=]() { gemm_run(ta, tb, m, n, k, al, A, at, lda, B, bt, ldb, be, C, ldc); }, &e))
        return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
    gemm_run(ta, tb, m, n, k, al, A, at, lda, B, bt, ldb, be, C, ldc);
    return CUBLAS_STATUS_SUCCESS;
}

static void gemm_run(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float al,
                     const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                     int ldb, float be, void *C, int ldc) {
    /* op(A) rows and op(B) columns converted to f32 once, then dot products */
    std::vector<float> a((size_t)k), b((size_t)k * n);
    for (int j = 0; j < n; j++)
        for (int l = 0; l < k; l++)
            b[(size_t)j * k + l] = emu_element(B, bt,
                                               tb == CUBLAS_OP_N ? (size_t)l + (size_t)j * ldb
                                                                 : (size_t)j + (size_t)l * ldb);
    float *c = (float *)C;
    for (int i = 0; i < m; i++) {
        for (int l = 0; l < k; l++)
            a[l] = emu_element(A, at,
                               ta == CUBLAS_OP_N ? (size_t)i + (size_t)l * lda
                                                 : (size_t)l + (size_t)i * lda);
        for (int j = 0; j < n; j++) {
            const float *bj = b.data() + (size_t)j * k;
            /* eight running sums, as a tensor core's products are not summed in k order
             * either (and the emulated prefill's logits stay quick) */
            float s8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int l = 0;
            for (; l + 8 <= k; l += 8)
                for (int u = 0; u < 8; u++) s8[u] += a[l + u] * bj[l + u];
            float acc = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
            for (; l < k; l++) acc += a[l] * bj[l];
            float *cij = c + (size_t)i + (size_t)j * ldc;
            *cij = al * acc + (be != 0.0f ? be * *cij : 0.0f);
        }
    }
}

/* ---------------------------------------------------------------- graphs */

/* A capture: the nodes recorded so far, who began it, how strict it is, and whether a refused
 * call has invalidated it. One mutex guards every capture's state: a "potentially unsafe" call
 * from any thread checks every global-mode capture (emu.h). */
struct emu_graph_node {
    const char *what; /* the kernel's name, "memcpy", "memset", "cublasGemmEx", "graph" */
    dim3 grid, block;
    size_t smem;
    bool kernel;
    std::function<void()> body;
};

struct emu_capture {
    uint64_t id; /* from 1: events name the capture they were recorded into by it */
    cudaStream_t origin;
    cudaStreamCaptureMode mode;
    pthread_t thread;
    bool invalidated;
    std::vector<emu_graph_node> nodes;
};

struct emu_graph {
    std::vector<emu_graph_node> nodes;
};
struct emu_graph_exec {
    std::vector<emu_graph_node> nodes;
};

namespace {
std::mutex g_capture_mu;
std::vector<emu_capture *> g_captures; /* active, in begin order */
long g_live_graphs;                    /* graphs and executable graphs (under g_capture_mu) */
uint64_t g_capture_ids;                /* captures begun */
} // namespace

long emu::live_graphs() {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    return g_live_graphs;
}

/* A stream created without cudaStreamNonBlocking synchronises with the legacy stream. */
static bool blocking_capture_active() {
    for (emu_capture *c : g_captures)
        if (!(c->origin->flags & cudaStreamNonBlocking)) return true;
    return false;
}

static cudaError_t capture_unsafe_call() {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    const pthread_t me = pthread_self();
    for (emu_capture *c : g_captures) {
        const bool mine = pthread_equal(c->thread, me) != 0;
        if ((mine && c->mode != cudaStreamCaptureModeRelaxed) ||
            (!mine && c->mode == cudaStreamCaptureModeGlobal)) {
            c->invalidated = true;
            return cudaErrorStreamCaptureUnsupported;
        }
    }
    return cudaSuccess;
}

static cudaError_t capture_legacy_use() {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    if (!blocking_capture_active()) return cudaSuccess;
    for (emu_capture *c : g_captures)
        if (!(c->origin->flags & cudaStreamNonBlocking)) c->invalidated = true;
    return cudaErrorStreamCaptureImplicit;
}

static cudaError_t capture_device_sync() {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    if (g_captures.empty()) return cudaSuccess;
    for (emu_capture *c : g_captures) c->invalidated = true;
    return cudaErrorStreamCaptureUnsupported;
}

static cudaError_t capture_stream_sync(cudaStream_t s) {
    if (!s) return capture_legacy_use();
    std::lock_guard<std::mutex> lk(g_capture_mu);
    if (!s->cap) return cudaSuccess;
    s->cap->invalidated = true;
    return cudaErrorStreamCaptureUnsupported;
}

/* The active capture event e was last recorded into, or null (none, or it has ended: the
 * event then stands for work that never runs, and waits pass). Under g_capture_mu. */
static emu_capture *event_capture(cudaEvent_t e) {
    if (!e->cap_id) return nullptr;
    for (emu_capture *c : g_captures)
        if (c->id == e->cap_id) return c;
    return nullptr;
}

static cudaError_t capture_event_record(cudaEvent_t e, cudaStream_t s) {
    if (!s) {
        if (cudaError_t err = capture_legacy_use()) return err;
        e->cap_id = 0;
        return cudaSuccess;
    }
    std::lock_guard<std::mutex> lk(g_capture_mu);
    /* on a capturing stream: a point of the graph, not of the device's time */
    e->cap_id = s->cap ? s->cap->id : 0;
    if (s->cap && s->cap->invalidated) return cudaErrorStreamCaptureInvalidated;
    return cudaSuccess;
}

static cudaError_t capture_event_sync(cudaEvent_t e) {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    emu_capture *c = event_capture(e);
    if (!c) return cudaSuccess;
    c->invalidated = true;
    return cudaErrorCapturedEvent;
}

static cudaError_t capture_stream_wait(cudaStream_t s, cudaEvent_t e) {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    emu_capture *sc = s ? s->cap : nullptr, *ec = event_capture(e);
    if (sc == ec) return cudaSuccess; /* neither captures, or both the same capture */
    if (sc) sc->invalidated = true;
    if (ec) ec->invalidated = true;
    return cudaErrorStreamCaptureUnsupported;
}

/* Ends s's capture without a graph (the stream is going away). */
static void capture_abandon(cudaStream_t s) {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    if (!s || !s->cap) return;
    for (size_t i = 0; i < g_captures.size(); i++)
        if (g_captures[i] == s->cap) g_captures.erase(g_captures.begin() + (long)i);
    delete s->cap;
    s->cap = nullptr;
}

/* The capture work on s goes to: s's own, or any blocking stream's when s is the legacy stream
 * (an error). Under g_capture_mu. */
static bool capture_of(cudaStream_t s, emu_capture **c, cudaError_t *e) {
    *c = nullptr;
    *e = cudaSuccess;
    if (!s) {
        if (!blocking_capture_active()) return false;
        for (emu_capture *b : g_captures)
            if (!(b->origin->flags & cudaStreamNonBlocking)) b->invalidated = true;
        *e = cudaErrorStreamCaptureImplicit;
        return true;
    }
    if (!s->cap) return false;
    *c = s->cap;
    if ((*c)->invalidated) *e = cudaErrorStreamCaptureInvalidated;
    return true;
}

static bool capture_record(cudaStream_t s, const char *what, std::function<void()> body,
                           cudaError_t *e) {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    emu_capture *c;
    if (!capture_of(s, &c, e)) return false;
    if (*e == cudaSuccess) c->nodes.push_back(emu_graph_node{what, {}, {}, 0, false, body});
    if (*e != cudaSuccess) emu::g_last_error = *e;
    return true;
}

bool emu::launch_captured(cudaStream_t s) {
    if (s && !__atomic_load_n(&s->cap, __ATOMIC_RELAXED)) return false; /* the common case */
    std::lock_guard<std::mutex> lk(g_capture_mu);
    emu_capture *c;
    cudaError_t e;
    return capture_of(s, &c, &e);
}

void emu::record_launch(cudaStream_t s, const char *kernel, dim3 grid, dim3 block, size_t smem,
                        std::function<void()> body) {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    emu_capture *c;
    cudaError_t e;
    if (!capture_of(s, &c, &e)) return; /* the caller checked: not reached */
    if (e == cudaSuccess && !launch_config_ok(kernel, grid, block, smem)) {
        c->invalidated = true; /* a failed launch invalidates the capture */
        return;
    }
    if (e != cudaSuccess) {
        g_last_error = e;
        return;
    }
    c->nodes.push_back(emu_graph_node{kernel, grid, block, smem, true, std::move(body)});
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    if (!s) return emu_fail(cudaErrorStreamCaptureUnsupported); /* not on the legacy stream */
    std::lock_guard<std::mutex> lk(g_capture_mu);
    if (s->cap) return emu_fail(cudaErrorIllegalState); /* already capturing */
    emu_capture *c =
        new (std::nothrow) emu_capture{++g_capture_ids, s, mode, pthread_self(), false, {}};
    if (!c) return emu_fail(cudaErrorMemoryAllocation);
    g_captures.push_back(c);
    __atomic_store_n(&s->cap, c, __ATOMIC_RELAXED);
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
    *graph = nullptr;
    if (!s) return emu_fail(cudaErrorIllegalState);
    std::lock_guard<std::mutex> lk(g_capture_mu);
    emu_capture *c = s->cap;
    if (!c) return emu_fail(cudaErrorIllegalState);
    if (c->mode != cudaStreamCaptureModeRelaxed && !pthread_equal(c->thread, pthread_self()))
        return emu_fail(cudaErrorStreamCaptureWrongThread);
    for (size_t i = 0; i < g_captures.size(); i++)
        if (g_captures[i] == c) g_captures.erase(g_captures.begin() + (long)i);
    __atomic_store_n(&s->cap, (emu_capture *)nullptr, __ATOMIC_RELAXED);
    const bool ok = !c->invalidated;
    if (ok) {
        *graph = new (std::nothrow) emu_graph{std::move(c->nodes)};
        if (*graph) g_live_graphs++;
    }
    delete c;
    if (!ok) return emu_fail(cudaErrorStreamCaptureInvalidated);
    return *graph ? cudaSuccess : emu_fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status) {
    std::lock_guard<std::mutex> lk(g_capture_mu);
    if (!s) {
        /* asking about the legacy stream while a blocking stream captures is itself an error */
        *status = cudaStreamCaptureStatusNone;
        return blocking_capture_active() ? emu_fail(cudaErrorStreamCaptureImplicit) : cudaSuccess;
    }
    *status = !s->cap               ? cudaStreamCaptureStatusNone
              : s->cap->invalidated ? cudaStreamCaptureStatusInvalidated
                                    : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t *nodes, size_t *n) {
    if (!g || !n) return emu_fail(cudaErrorInvalidValue);
    if (!nodes) {
        *n = g->nodes.size();
        return cudaSuccess;
    }
    size_t k = *n < g->nodes.size() ? *n : g->nodes.size();
    for (size_t i = 0; i < k; i++) nodes[i] = &g->nodes[i];
    *n = k;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *exec, cudaGraph_t g,
                                          unsigned long long flags) {
    (void)flags;
    *exec = nullptr;
    if (!g) return emu_fail(cudaErrorInvalidValue);
    *exec = new (std::nothrow) emu_graph_exec{g->nodes}; /* independent of g from here on */
    if (!*exec) return emu_fail(cudaErrorMemoryAllocation);
    std::lock_guard<std::mutex> lk(g_capture_mu);
    g_live_graphs++;
    return cudaSuccess;
}

/* Runs the nodes in recorded order (a capture from one stream is a chain). */
static void graph_run(const std::vector<emu_graph_node> &nodes) {
    for (const emu_graph_node &n : nodes) {
        if (!n.kernel) {
            n.body();
            continue;
        }
        const std::function<void()> *body = &n.body;
        emu::launch(
            n.what, n.grid, n.block, n.smem,
            [](void *b) { (*static_cast<const std::function<void()> *>(b))(); },
            const_cast<std::function<void()> *>(body));
    }
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    if (!exec) return emu_fail(cudaErrorInvalidValue);
    cudaError_t e;
    /* a launch into a capture records the graph as one node, its nodes as they are now */
    std::vector<emu_graph_node> nodes = exec->nodes;
    if (capture_record(
            s, "graph", [nodes]() { graph_run(nodes); }, &e))
        return e;
    graph_run(exec->nodes);
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    if (!exec) return cudaSuccess;
    delete exec;
    std::lock_guard<std::mutex> lk(g_capture_mu);
    g_live_graphs--;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g) {
    if (!g) return cudaSuccess;
    delete g;
    std::lock_guard<std::mutex> lk(g_capture_mu);
    g_live_graphs--;
    return cudaSuccess;
}

/* For C tests (tests/unit/cuda_test.c). */
extern "C" long cuda_emu_live_graphs(void) { return emu::live_graphs(); }
