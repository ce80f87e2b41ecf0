/* The CUDA emulator: CUDA's execution model on the CPU, so the CUDA backend's kernels
 * (kernels/cuda/ .cu files) run and are checked where no GPU is (DESIGN.md, "CUDA without a GPU").
 * The .cu files compile as C++ (g++, -DKVSERVE_CUDA_EMU) against this header instead of the CUDA
 * toolkit's; kernels/cuda/cuda_rt.h chooses.
 *
 * What is emulated, and how (emu.cc):
 * - A launch runs its blocks one after another on the calling thread. Each CUDA thread of a
 *   block is a fiber (its own stack, switched by a few instructions of assembly): a thread runs
 *   until it finishes or waits at a barrier, then the next runnable one runs. The order is fixed
 *   (thread 0 first, round robin), so a run is deterministic.
 * - __syncthreads: a block-wide barrier over the threads that have not exited. __syncwarp, and
 *   every warp shuffle and vote, a barrier over the non-exited lanes of the warp (32 consecutive
 *   threads in x-major order): a shuffle deposits the lane's value, waits for the warp, then reads
 *   the source lane's. A barrier no thread can pass (threads of one warp at different barriers,
 *   __syncthreads in code some live threads skip) stops the process with the kernel's name.
 * - Atomics are plain read-modify-writes: fibers never preempt each other.
 * - __shared__ variables are function statics, one copy per host thread (blocks run one at a
 *   time); dynamic shared memory (KV_DYNAMIC_SMEM) is a per-launch buffer. Shared memory is not
 *   cleared between blocks, as on a GPU.
 * - Device memory, pinned memory, streams and events are host memory and no-ops: every copy and
 *   launch has finished when its call returns, whatever stream it names. Launch configurations
 *   are checked as the device checks them (block size, grid size, dynamic shared memory).
 * - cuBLAS's GemmEx is a reference GEMM in f32 (emu.cc).
 * - Stream capture and graphs (the "graphs" sections here and in emu.cc): on a capturing stream,
 *   launches, async copies and sets and GemmEx are recorded, not run (a copy's arguments are
 *   pointers: a replay reads its source as it is then); calls CUDA forbids during a capture fail
 *   with its error and invalidate the capture; a graph launch runs the recorded nodes in order.
 * What it cannot see: races between threads (a fiber runs until it waits, so a missing barrier
 *   usually still gives the right answer), between streams, and device-only faults (a host
 *   pointer passed to a kernel works here). Those are `make test-gpu`'s (compute-sanitizer). */
#ifndef KVSERVE_CUDA_EMU_H
#define KVSERVE_CUDA_EMU_H

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "kernels/quant.h"

/* ---------------------------------------------------------------- qualifiers and types */

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
/* One copy per host thread: the blocks of a launch run one at a time on it. */
#define __shared__ static thread_local

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
    return uint4{x, y, z, w};
}

/* ---------------------------------------------------------------- runtime API */

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorNoDevice = 100,
    cudaErrorIllegalState = 401,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureImplicit = 906,
    cudaErrorCapturedEvent = 907,
    cudaErrorStreamCaptureWrongThread = 908,
} cudaError_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

typedef struct emu_stream *cudaStream_t;
typedef struct emu_event *cudaEvent_t;

#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02
#define cudaHostAllocDefault 0x00

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    int multiProcessorCount;
    int major, minor;
    int memoryBusWidth; /* bits */
};

const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemset(void *p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

/* ---------------------------------------------------------------- graphs: runtime API */

/* CUDA Runtime API, "Stream Management" and "Graph Management". What is checked during a capture
 * (CUDA Programming Guide, "Prohibited and Unhandled Operations" of stream capture):
 * - conflicting with any capture: synchronising the capturing stream
 *   (cudaErrorStreamCaptureUnsupported) or an event last recorded into a capture
 *   (cudaErrorCapturedEvent); cudaDeviceSynchronize while
 *   any capture is active (the same); the legacy stream (stream 0, synchronous copies and sets)
 *   while a stream created without cudaStreamNonBlocking captures
 *   (cudaErrorStreamCaptureImplicit);
 * - "potentially unsafe" calls (cudaMalloc, cudaFree, cudaMallocHost/cudaHostAlloc/cudaFreeHost,
 *   synchronous cudaMemcpy/cudaMemset): refused (cudaErrorStreamCaptureUnsupported) from the
 *   capturing thread unless its capture is relaxed, and from any thread while another thread's
 *   capture is in global mode;
 * - a cudaStreamWaitEvent that would fork a capture into another stream, or join a capture with
 *   an event recorded outside it, is refused (cudaErrorStreamCaptureUnsupported: not emulated).
 * A refused call invalidates the capture it conflicts with: later work on the stream returns
 * cudaErrorStreamCaptureInvalidated and cudaStreamEndCapture returns that and no graph. */
enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
};
enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2,
};
typedef struct emu_graph *cudaGraph_t;
typedef struct emu_graph_exec *cudaGraphExec_t;
typedef struct emu_graph_node *cudaGraphNode_t;

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status);
/* nodes NULL: *n is set to the node count; else up to *n nodes are stored. */
cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t *nodes, size_t *n);
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *exec, cudaGraph_t g,
                                          unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t g);

/* ---------------------------------------------------------------- cuBLAS (GemmEx only) */

typedef struct emu_cublas *cublasHandle_t;
typedef enum cublasStatus {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
} cublasStatus_t;
typedef enum cublasOperation { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType;
typedef enum cublasComputeType { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum cublasGemmAlgo { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
/* Column-major C = alpha op(A) op(B) + beta C, as cuBLAS: A, B of type f16, bf16 or f32, C f32,
 * products summed in f32 (eight interleaved running sums). */
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType at,
                            int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                            void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo);

/* ---------------------------------------------------------------- the execution model */

namespace emu {

/* One CUDA thread (a fiber). */
struct thread_state {
    uint3 tid;
    int lane;       /* tid's linear index % 32 */
    int warp;       /* tid's linear index / 32 */
    unsigned phase; /* shuffles done: which of the warp's two exchange rows this one uses */
};

/* The block being run and its launch. */
struct block_state {
    uint3 bid;
    uint3 grid; /* gridDim */
    uint3 dim;  /* blockDim */
    unsigned char *dyn_smem;
    const char *kernel;
};

/* __thread, not thread_local: an extern thread_local is read through a wrapper that calls its
 * initialisation function where one is linked, and GCC 12 at -O2 under UBSan miscompiled that
 * (the pointer not loaded on the branch without one, its null check testing stale flags): every
 * kernel read a null blockIdx in the sanitized unit tests. A __thread pointer is a plain load. */
extern __thread thread_state *cur_thread;
extern __thread block_state *cur_block;

void sync_block();
void sync_warp();
/* Deposits v for the warp, waits for every live lane, returns lane src's value. */
uint64_t exchange(uint64_t v, int src);
/* The warp's live lanes whose pred is true (waits for the warp). */
unsigned ballot(bool pred);
/* The warp's lanes that have not exited, after a warp barrier (see emu.cc). */
unsigned active_mask();

/* Warp-wide matrix instructions (mma.cuh): deposits the lane's n <= GATHER_WORDS 32-bit words,
 * waits for the warp and returns the 32 lanes' deposits, lane l's at [l * GATHER_WORDS]. As on a
 * device, every lane of the warp must take part: a warp with exited or missing lanes stops the
 * process with the kernel's name. */
#define GATHER_WORDS 8
const uint32_t *warp_gather(const uint32_t *words, int n);

/* Runs fn(arg) as every thread of every block; false when the configuration is invalid (the
 * launch then sets cudaErrorInvalidValue, as CUDA 13's runtime does on an H200). */
bool launch(const char *kernel, dim3 grid, dim3 block, size_t smem, void (*fn)(void *), void *arg);

/* Live cudaMalloc allocations (tests check a backend frees what it allocated). */
long live_allocations();

/* ---------------------------------------------------------------- graphs: launches */

/* Whether a launch on s goes to a capture (s captures, or is the legacy stream while a blocking
 * stream captures) rather than running now. */
bool launch_captured(cudaStream_t s);
/* Records a launch of body on s's capture (or refuses it: the launch's error is then set, as a
 * device sets it). The configuration is checked now, as the device checks it at the launch. */
void record_launch(cudaStream_t s, const char *kernel, dim3 grid, dim3 block, size_t smem,
                   std::function<void()> body);
/* Graphs and executable graphs alive (tests check a backend destroys what it instantiated). */
long live_graphs();

template <class T> inline T exchange_as(T v, int src) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a wide type");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof v);
    bits = exchange(bits, src);
    T r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
}

template <class... P, class... A>
void launch_kernel(const char *name, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   void (*kernel)(P...), A &&...args) {
    /* every stream is the host thread: in order, done on return; or recorded into a capture,
     * the arguments copied as a launch copies them */
    if (launch_captured(stream)) {
        record_launch(stream, name, grid, block, smem, [kernel, args...]() { kernel(args...); });
        return;
    }
    auto call = [&]() { kernel(args...); };
    launch(
        name, grid, block, smem, [](void *c) { (*static_cast<decltype(call) *>(c))(); }, &call);
}

} // namespace emu

#define threadIdx (emu::cur_thread->tid)
#define blockIdx (emu::cur_block->bid)
#define blockDim (emu::cur_block->dim)
#define gridDim (emu::cur_block->grid)
#define warpSize 32

inline void __syncthreads() { emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)mask;
    emu::sync_warp();
}

template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    (void)mask;
    int lane = emu::cur_thread->lane;
    return emu::exchange_as(v, (lane & ~(width - 1)) | (src & (width - 1)));
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    (void)mask;
    int lane = emu::cur_thread->lane, src = lane ^ lane_mask;
    return emu::exchange_as(v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    (void)mask;
    int lane = emu::cur_thread->lane;
    int src = (lane & (width - 1)) + (int)delta < width ? lane + (int)delta : lane;
    return emu::exchange_as(v, src);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    (void)mask;
    int lane = emu::cur_thread->lane;
    return emu::exchange_as(v, (lane & (width - 1)) >= (int)delta ? lane - (int)delta : lane);
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return emu::ballot(pred != 0) & mask; }
inline int __any_sync(unsigned mask, int pred) { return (emu::ballot(pred != 0) & mask) != 0; }
inline int __all_sync(unsigned mask, int pred) {
    return (emu::ballot(pred != 0) & mask) == (emu::ballot(true) & mask);
}
inline unsigned __activemask() { return emu::active_mask(); }

/* ---------------------------------------------------------------- atomics */

template <class T> inline T atomicAdd(T *p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}
template <class T> inline T atomicMax(T *p, T v) {
    T old = *p;
    *p = old > v ? old : v;
    return old;
}
template <class T> inline T atomicMin(T *p, T v) {
    T old = *p;
    *p = old < v ? old : v;
    return old;
}
template <class T> inline T atomicExch(T *p, T v) {
    T old = *p;
    *p = v;
    return old;
}
template <class T> inline T atomicCAS(T *p, T compare, T v) {
    T old = *p;
    if (old == compare) *p = v;
    return old;
}

/* ---------------------------------------------------------------- device math */

using std::isinf;
using std::isnan;

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
/* Integer SIMD intrinsics (CUDA Math API, "Integer Intrinsics" and "SIMD Intrinsics"). Sums wrap
 * modulo 2^32 as the device's 32-bit adds do: computed in unsigned arithmetic, where C++ defines
 * the wraparound. */
/* The four byte products of a and b (signed bytes for int, unsigned for unsigned), plus c. */
inline int __dp4a(int a, int b, int c) {
    uint32_t s = (uint32_t)c;
    for (int i = 0; i < 4; i++)
        s += (uint32_t)((int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i)));
    return (int)s;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 4; i++) c += ((a >> (8 * i)) & 0xFF) * ((b >> (8 * i)) & 0xFF);
    return c;
}
/* Per byte, signed a - b saturated to -128..127. */
inline unsigned __vsubss4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; i++) {
        int d = (int)(int8_t)(a >> (8 * i)) - (int)(int8_t)(b >> (8 * i));
        d = d < -128 ? -128 : d > 127 ? 127 : d;
        r |= (unsigned)(d & 0xFF) << (8 * i);
    }
    return r;
}
/* The low 32 bits of the 64-bit hi:lo shifted right by shift & 31. */
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((uint64_t)hi << 32) | lo) >> (shift & 31));
}
/* Round to nearest even (cvt.rni.s32.f32): NaN gives 0, out-of-range values saturate. */
inline int __float2int_rn(float x) {
    if (std::isnan(x)) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x < -2147483648.0f) return (-2147483647 - 1);
    return (int)std::nearbyint(x);
}
/* IEEE division, round to nearest even (what `/` is on the host). */
inline float __fdiv_rn(float a, float b) { return a / b; }
template <class T> inline T __ldg(const T *p) { return *p; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }

#endif
