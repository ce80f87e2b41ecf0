/* The CUDA emulator (kernels/cuda/emu.h) against CUDA's documented semantics: barriers order
 * shared-memory writes before reads, shuffles and votes exchange among a warp's lanes (partial
 * warps too), atomics, static and dynamic shared memory per block, 3-D indices, the integer
 * and rounding intrinsics of the int8 matmuls, the tensor-core instructions' fragment layouts
 * (mma.cuh), launch configuration errors, a deadlocked barrier, the reference GemmEx, and
 * stream capture and graph launches. The same file builds
 * with nvcc (make test-gpu), where it checks the device instead; the emulator-only cases are
 * skipped there. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_rt.h"
#include "kernels/cuda/mma.cuh"

using namespace KV_CUDA_NS;

/* A device buffer of n T, freed at scope end. */
template <class T> struct dbuf {
    T *p = nullptr;
    size_t n;
    explicit dbuf(size_t count) : n(count) {
        cr_assert_eq(cudaMalloc((void **)&p, sizeof(T) * n), cudaSuccess);
        cr_assert_eq(cudaMemset(p, 0, sizeof(T) * n), cudaSuccess);
    }
    ~dbuf() { cudaFree(p); }
    void get(T *host) const {
        cr_assert_eq(cudaMemcpy(host, p, sizeof(T) * n, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    void put(const T *host) {
        cr_assert_eq(cudaMemcpy(p, host, sizeof(T) * n, cudaMemcpyHostToDevice), cudaSuccess);
    }
};

static void check_launch() {
    cr_assert_eq(cudaGetLastError(), cudaSuccess);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
}

/* ---------------------------------------------------------------- barriers */

/* Each thread reads the slot its right neighbour wrote before the barrier: a serial run without
 * the barrier would read slots not yet written. Two rounds reuse the array across a second
 * barrier. */
__global__ void kernel_rotate(int *out) {
    __shared__ int s[256];
    int t = threadIdx.x;
    s[t] = t + 1000 * (int)blockIdx.x;
    __syncthreads();
    int v = s[(t + 1) % blockDim.x];
    __syncthreads();
    s[t] = v * 2;
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = s[(t + blockDim.x - 1) % blockDim.x];
}

Test(cuda_emu, syncthreads_orders_shared_memory) {
    const int nb = 3, nt = 256;
    dbuf<int> d(nb * nt);
    KV_LAUNCH(kernel_rotate, dim3(nb), dim3(nt), 0, 0, d.p);
    check_launch();
    int h[nb * nt];
    d.get(h);
    for (int b = 0; b < nb; b++)
        for (int t = 0; t < nt; t++) {
            /* thread t reads what thread t-1 stored: 2 * s[t] from the first round */
            int want = 2 * (t + 1000 * b);
            cr_assert_eq(h[b * nt + t], want, "block %d thread %d: %d != %d", b, t, h[b * nt + t],
                         want);
        }
}

/* ---------------------------------------------------------------- shuffles and votes */

__global__ void kernel_shuffles(int *out, int n) {
    int t = threadIdx.x, lane = t % 32;
    int *o = out + t * 8;
    o[0] = __shfl_xor_sync(0xffffffffu, t, 5);
    o[1] = __shfl_down_sync(0xffffffffu, t, 3);
    o[2] = __shfl_up_sync(0xffffffffu, t, 2);
    o[3] = __shfl_sync(0xffffffffu, t, 7);
    o[4] = __shfl_sync(0xffffffffu, t, 3, 16);
    o[5] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
    o[6] = __any_sync(0xffffffffu, t == n - 1) + 2 * __all_sync(0xffffffffu, t < n);
    o[7] = (int)warp_sum((float)lane);
}

Test(cuda_emu, warp_shuffles_and_votes) {
    const int n = 64;
    dbuf<int> d(n * 8);
    KV_LAUNCH(kernel_shuffles, dim3(1), dim3(n), 0, 0, d.p, n);
    check_launch();
    int h[n * 8];
    d.get(h);
    for (int t = 0; t < n; t++) {
        int lane = t % 32, w = t - lane;
        const int *o = h + t * 8;
        cr_expect_eq(o[0], w + (lane ^ 5), "xor at %d", t);
        cr_expect_eq(o[1], lane + 3 < 32 ? t + 3 : t, "down at %d", t);
        cr_expect_eq(o[2], lane >= 2 ? t - 2 : t, "up at %d", t);
        cr_expect_eq(o[3], w + 7, "idx at %d", t);
        cr_expect_eq(o[4], w + (lane & 16) + 3, "idx width 16 at %d", t);
        cr_expect_eq((unsigned)o[5], 0x49249249u, "ballot at %d", t);
        cr_expect_eq(o[6], (t / 32 == (n - 1) / 32) + 2, "any/all at %d", t);
        cr_expect_eq(o[7], 496, "warp_sum at %d", t);
    }
}

/* 48 threads: the second warp has 16 lanes, of which 8 exit at once; they do not hold up a
 * shuffle among the others. */
__global__ void kernel_partial(int *out) {
    int t = threadIdx.x;
    if (t >= 40) return;
    unsigned live = __activemask();
    out[t] = __shfl_sync(live, t, 0) + 100 * __popc(live);
}

Test(cuda_emu, partial_warps) {
    dbuf<int> d(48);
    KV_LAUNCH(kernel_partial, dim3(1), dim3(48), 0, 0, d.p);
    check_launch();
    int h[48];
    d.get(h);
    for (int t = 0; t < 40; t++) {
        int lanes = t < 32 ? 32 : 8;
        cr_expect_eq(h[t], t / 32 * 32 + 100 * lanes, "thread %d: %d", t, h[t]);
    }
}

/* ---------------------------------------------------------------- atomics, shared memory, 3-D */

__global__ void kernel_atomics(int *count, float *sum, int *mx) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(count, 1);
    atomicAdd(sum, 0.5f);
    atomicMax(mx, t);
}

Test(cuda_emu, atomics) {
    dbuf<int> c(1), m(1);
    dbuf<float> s(1);
    KV_LAUNCH(kernel_atomics, dim3(7), dim3(96), 0, 0, c.p, s.p, m.p);
    check_launch();
    int hc, hm;
    float hs;
    c.get(&hc);
    m.get(&hm);
    s.get(&hs);
    cr_expect_eq(hc, 7 * 96);
    cr_expect_float_eq(hs, 7 * 96 * 0.5f, 1e-3);
    cr_expect_eq(hm, 7 * 96 - 1);
}

/* Block sums through dynamic shared memory sized at launch; a static array per block beside it. */
__global__ void kernel_block_sum(const float *x, float *out) {
    KV_DYNAMIC_SMEM(float, part);
    __shared__ int tag;
    int t = threadIdx.x;
    if (t == 0) tag = (int)blockIdx.x;
    part[t] = x[blockIdx.x * blockDim.x + t];
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) part[t] += part[t + s];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = part[0] + 1000.0f * (float)tag;
}

Test(cuda_emu, dynamic_shared_memory) {
    const int nb = 5, nt = 128;
    float hx[nb * nt], ho[nb];
    for (int i = 0; i < nb * nt; i++) hx[i] = (float)(i % 7);
    dbuf<float> x(nb * nt), o(nb);
    x.put(hx);
    KV_LAUNCH(kernel_block_sum, dim3(nb), dim3(nt), sizeof(float) * nt, 0, x.p, o.p);
    check_launch();
    o.get(ho);
    for (int b = 0; b < nb; b++) {
        float want = 1000.0f * (float)b;
        for (int t = 0; t < nt; t++) want += hx[b * nt + t];
        cr_expect_float_eq(ho[b], want, 1e-3, "block %d", b);
    }
}

__global__ void kernel_index(int *out) {
    int lin = ((int)threadIdx.z * (int)blockDim.y + (int)threadIdx.y) * (int)blockDim.x +
              (int)threadIdx.x;
    int blk =
        ((int)blockIdx.z * (int)gridDim.y + (int)blockIdx.y) * (int)gridDim.x + (int)blockIdx.x;
    int n = (int)(blockDim.x * blockDim.y * blockDim.z);
    /* lanes follow the linear index: lane 0 of each warp broadcasts its linear index */
    out[blk * n + lin] = __shfl_sync(0xffffffffu, lin, 0) * 1000 + lin;
}

Test(cuda_emu, three_dimensional_indices) {
    dim3 grid(2, 3, 2), block(8, 4, 3);
    const int nb = 12, nt = 96;
    dbuf<int> d(nb * nt);
    KV_LAUNCH(kernel_index, grid, block, 0, 0, d.p);
    check_launch();
    int h[nb * nt];
    d.get(h);
    for (int b = 0; b < nb; b++)
        for (int t = 0; t < nt; t++)
            cr_expect_eq(h[b * nt + t], (t / 32 * 32) * 1000 + t, "block %d thread %d", b, t);
}

/* ---------------------------------------------------------------- integer and rounding intrinsics
 */

/* What the int8 matmuls (kernels/cuda/mmvq.cu) use, each case against the CUDA Math API's
 * documented result: __dp4a (signed and unsigned bytes, the 32-bit sum wrapping), __vsubss4
 * (per-byte signed saturation), __funnelshift_r (shift taken mod 32), __float2int_rn (half to
 * even, NaN 0, saturation), __fdiv_rn (IEEE). */
__global__ void kernel_intrinsics(unsigned *o, float nan) {
    o[0] = (unsigned)__dp4a((int)0x80FF7F01, (int)0x807F02FF, 10);
    o[1] = __dp4a(0x80FF7F01u, 0x807F02FFu, 10u);
    o[2] = (unsigned)__dp4a(0x7F7F7F7F, 0x7F7F7F7F, 0x7FFFFFFF);
    o[3] = __dp4a(0x01010101u, 0x01010101u, 0xFFFFFFFFu);
    o[4] = __vsubss4(0x7F800A05u, 0x81010F03u);
    o[5] = __funnelshift_r(0x89ABCDEFu, 0x01234567u, 16);
    o[6] = __funnelshift_r(0x89ABCDEFu, 0x01234567u, 0);
    o[7] = __funnelshift_r(0x89ABCDEFu, 0x01234567u, 36);
    const float r[8] = {2.5f, 3.5f, -2.5f, -0.5f, 126.5f, 1e10f, -1e10f, nan};
    for (int i = 0; i < 8; i++) o[8 + i] = (unsigned)__float2int_rn(r[i]);
    o[16] = (unsigned)__float_as_int(__fdiv_rn(1.0f, 3.0f));
}

Test(cuda_emu, integer_and_rounding_intrinsics) {
    dbuf<unsigned> d(17);
    KV_LAUNCH(kernel_intrinsics, dim3(1), dim3(1), 0, 0, d.p, (float)NAN);
    check_launch();
    unsigned h[17];
    d.get(h);
    /* bytes 1, 127, -1, -128 times -1, 2, 127, -128: -1 + 254 - 127 + 16384, plus 10 */
    cr_expect_eq((int)h[0], 16520);
    /* unsigned: 1, 127, 255, 128 times 255, 2, 127, 128 */
    cr_expect_eq(h[1], 255u + 254u + 32385u + 16384u + 10u);
    cr_expect_eq(h[2], 0x7FFFFFFFu + 4u * 16129u, "the signed sum wraps");
    cr_expect_eq(h[3], 3u, "the unsigned sum wraps");
    /* 5 - 3, 10 - 15, -128 - 1 (saturates to -128), 127 + 127 (to 127) */
    cr_expect_eq(h[4], 0x7F80FB02u, "got %08x", h[4]);
    cr_expect_eq(h[5], 0x456789ABu);
    cr_expect_eq(h[6], 0x89ABCDEFu);
    cr_expect_eq(h[7], 0x789ABCDEu, "a shift of 36 is one of 4");
    const int want[8] = {2, 4, -2, 0, 126, 2147483647, -2147483647 - 1, 0};
    for (int i = 0; i < 8; i++) cr_expect_eq((int)h[8 + i], want[i], "__float2int_rn case %d", i);
    cr_expect_eq(h[16], 0x3EAAAAABu, "1/3 rounded to nearest");
}

/* ---------------------------------------------------------------- tensor-core instructions */

/* One warp: A (16 x 32 s8, row-major), B stored as its transpose bt (8 x 32), C (16 x 8) = A B
 * plus the bias c0, through registers filled as the PTX ISA's fragment tables say (written out
 * here apart from mma.cuh's emulation, which reads them back the same way). */
__global__ void kernel_mma_s8(const int8_t *a, const int8_t *bt, const int *c0, int *c) {
    const int l = threadIdx.x, g = l / 4, t = l % 4;
    uint32_t ra[4], rb[2];
    int rc[4];
    for (int i = 0; i < 4; i++) {
        const int row = g + 8 * (i % 2), col = 4 * t + 16 * (i / 2);
        memcpy(&ra[i], a + row * 32 + col, 4);
    }
    for (int i = 0; i < 2; i++) memcpy(&rb[i], bt + g * 32 + 4 * t + 16 * i, 4);
    for (int i = 0; i < 4; i++) rc[i] = c0[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
    mma_s8_16x8x32(rc, ra, rb);
    for (int i = 0; i < 4; i++) c[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = rc[i];
}

Test(cuda_emu, mma_s8_fragments) {
    int8_t a[16 * 32], bt[8 * 32];
    int c0[16 * 8], want[16 * 8], got[16 * 8];
    uint32_t x = 12345;
    for (int i = 0; i < 16 * 32; i++) a[i] = (int8_t)((x = x * 1103515245u + 12345u) >> 24);
    for (int i = 0; i < 8 * 32; i++) bt[i] = (int8_t)((x = x * 1103515245u + 12345u) >> 24);
    a[0] = -128, bt[0] = -128; /* the extremes */
    for (int i = 0; i < 16 * 8; i++) c0[i] = i * 1000 - 50000;
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++) {
            int s = c0[m * 8 + n];
            for (int k = 0; k < 32; k++) s += a[m * 32 + k] * bt[n * 32 + k];
            want[m * 8 + n] = s;
        }
    dbuf<int8_t> da(16 * 32), db(8 * 32);
    dbuf<int> dc0(16 * 8), dc(16 * 8);
    da.put(a), db.put(bt), dc0.put(c0);
    KV_LAUNCH(kernel_mma_s8, dim3(1), dim3(32), 0, 0, da.p, db.p, dc0.p, dc.p);
    check_launch();
    dc.get(got);
    for (int i = 0; i < 16 * 8; i++)
        cr_assert_eq(got[i], want[i], "C[%d][%d]: %d, want %d", i / 8, i % 8, got[i], want[i]);
}

/* The same for f16: A 16 x 16, bt 8 x 16, C f32. */
__global__ void kernel_mma_f16(const uint16_t *a, const uint16_t *bt, float *c) {
    const int l = threadIdx.x, g = l / 4, t = l % 4;
    uint32_t ra[4], rb[2];
    float rc[4];
    for (int i = 0; i < 4; i++) {
        const int row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
        ra[i] = a[row * 16 + col] | (uint32_t)a[row * 16 + col + 1] << 16;
    }
    for (int i = 0; i < 2; i++)
        rb[i] = bt[g * 16 + 2 * t + 8 * i] | (uint32_t)bt[g * 16 + 2 * t + 8 * i + 1] << 16;
    for (int i = 0; i < 4; i++) rc[i] = 0.5f;
    mma_f16_16x8x16(rc, ra, rb);
    for (int i = 0; i < 4; i++) c[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = rc[i];
}

Test(cuda_emu, mma_f16_fragments) {
    uint16_t a[16 * 16], bt[8 * 16];
    float got[16 * 8];
    /* small integers and halves: every product and sum is exact in f32, whatever the order */
    for (int i = 0; i < 16 * 16; i++) a[i] = fp32_to_fp16((float)((i * 7) % 13 - 6) * 0.5f);
    for (int i = 0; i < 8 * 16; i++) bt[i] = fp32_to_fp16((float)((i * 5) % 11 - 5));
    dbuf<uint16_t> da(16 * 16), db(8 * 16);
    dbuf<float> dc(16 * 8);
    da.put(a), db.put(bt);
    KV_LAUNCH(kernel_mma_f16, dim3(1), dim3(32), 0, 0, da.p, db.p, dc.p);
    check_launch();
    dc.get(got);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++) {
            float s = 0.5f;
            for (int k = 0; k < 16; k++)
                s += fp16_to_fp32(a[m * 16 + k]) * fp16_to_fp32(bt[n * 16 + k]);
            cr_assert_eq(got[m * 8 + n], s, "C[%d][%d]: %g, want %g", m, n, got[m * 8 + n], s);
        }
}

/* ldmatrix: four 8 x 8 matrices of a 16 x 16 tile (element [r][c] = 256 r + c) in shared memory,
 * lanes 8i..8i+7 pointing at matrix i's rows (matrix i: rows 8 (i % 2), columns 8 (i / 2)). */
__global__ void kernel_ldmatrix(uint32_t *out, int trans) {
    __shared__ uint4 words[32]; /* 16-byte rows */
    uint16_t(*tile)[16] = reinterpret_cast<uint16_t(*)[16]>(words);
    const int l = threadIdx.x;
    for (int i = l; i < 256; i += 32) tile[i / 16][i % 16] = (uint16_t)(256 * (i / 16) + i % 16);
    __syncwarp();
    const int m = l / 8, r = l % 8;
    const uint16_t *row = &tile[8 * (m % 2) + r][8 * (m / 2)];
    uint32_t v[4];
    if (trans)
        ldmatrix_x4_trans(v, row);
    else
        ldmatrix_x4(v, row);
    for (int i = 0; i < 4; i++) out[l * 4 + i] = v[i];
}

Test(cuda_emu, ldmatrix_fragments) {
    dbuf<uint32_t> d(32 * 4);
    uint32_t got[32 * 4];
    for (int trans = 0; trans < 2; trans++) {
        KV_LAUNCH(kernel_ldmatrix, dim3(1), dim3(32), 0, 0, d.p, trans);
        check_launch();
        d.get(got);
        for (int l = 0; l < 32; l++)
            for (int i = 0; i < 4; i++) {
                const int g = l / 4, t = l % 4, r0 = 8 * (i % 2), c0 = 8 * (i / 2);
                uint32_t lo, hi; /* matrix i's [g][2t], [g][2t+1], or transposed */
                if (trans)
                    lo = 256 * (r0 + 2 * t) + c0 + g, hi = 256 * (r0 + 2 * t + 1) + c0 + g;
                else
                    lo = 256 * (r0 + g) + c0 + 2 * t, hi = lo + 1;
                cr_assert_eq(got[l * 4 + i], lo | hi << 16, "trans %d lane %d reg %d: %08x", trans,
                             l, i, got[l * 4 + i]);
            }
    }
}

/* ---------------------------------------------------------------- errors */

__global__ void kernel_nop(int *p) {
    if (p) *p = 1;
}

Test(cuda_emu, invalid_launch_configuration) {
    /* the context first: on a device, a launch that is the process's first CUDA call reports the
     * runtime's start-up as well */
    cr_assert_eq(cudaFree(nullptr), cudaSuccess);
    KV_LAUNCH(kernel_nop, dim3(1), dim3(2048), 0, 0, (int *)nullptr);
    cudaError_t e = cudaGetLastError();
    /* CUDA 13's runtime on an H200 reports too many threads as an invalid value (seen in the
     * first device check), not as cudaErrorInvalidConfiguration */
    cr_expect_eq(e, cudaErrorInvalidValue, "got %s", cudaGetErrorName(e));
    cr_expect_eq(cudaGetLastError(), cudaSuccess, "the error is cleared once read");
    /* more dynamic shared memory than a block gets without opting in */
    KV_LAUNCH(kernel_nop, dim3(1), dim3(32), 200 * 1024, 0, (int *)nullptr);
    cr_expect_neq(cudaGetLastError(), cudaSuccess);
}

#ifdef KVSERVE_CUDA_EMU
/* Half of the second warp waits at __syncthreads, the other half at a shuffle that the first half
 * never joins: on a GPU a hang, here a message and an abort. */
__global__ void kernel_deadlock(int *p) {
    if (threadIdx.x < 48)
        __syncthreads();
    else
        p[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, 0);
}

Test(cuda_emu, deadlock_is_reported, .signal = SIGABRT) {
    dbuf<int> d(64);
    KV_LAUNCH(kernel_deadlock, dim3(1), dim3(64), 0, 0, d.p);
}

/* A matrix instruction in a warp whose last lanes exited: undefined on a GPU, an abort here. */
__global__ void kernel_mma_partial(int *p) {
    if (threadIdx.x >= 24) return;
    uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    int c[4] = {0, 0, 0, 0};
    mma_s8_16x8x32(c, a, b);
    p[threadIdx.x] = c[0];
}

Test(cuda_emu, mma_without_the_whole_warp_is_reported, .signal = SIGABRT) {
    dbuf<int> d(32);
    KV_LAUNCH(kernel_mma_partial, dim3(1), dim3(32), 0, 0, d.p);
}

Test(cuda_emu, allocations_are_counted) {
    long before = emu::live_allocations();
    void *p = nullptr;
    cr_assert_eq(cudaMalloc(&p, 100), cudaSuccess);
    cr_expect_eq(emu::live_allocations(), before + 1);
    cudaFree(p);
    cr_expect_eq(emu::live_allocations(), before);
}

/* ---------------------------------------------------------------- cuBLAS */

Test(cuda_emu, gemm_ex_reference) {
    /* C (m x n) = A^T B with A stored k x m (transposed), B k x n, column-major, f16 inputs */
    const int m = 5, n = 3, k = 40;
    uint16_t a[k * m], b[k * n];
    float c[m * n], alpha = 1.0f, beta = 0.0f;
    for (int i = 0; i < k * m; i++) a[i] = fp32_to_fp16((float)(i % 11) * 0.25f - 1.0f);
    for (int i = 0; i < k * n; i++) b[i] = fp32_to_fp16((float)(i % 5) * 0.5f);
    cublasHandle_t h;
    cr_assert_eq(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, a, CUDA_R_16F, k, b,
                              CUDA_R_16F, k, &beta, c, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_SUCCESS);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double want = 0;
            for (int l = 0; l < k; l++)
                want += (double)fp16_to_fp32(a[i * k + l]) * fp16_to_fp32(b[j * k + l]);
            cr_expect_float_eq(c[i + j * m], want, 1e-4, "C[%d][%d]", i, j);
        }
    cublasDestroy(h);
}
#endif

/* ---------------------------------------------------------------- graphs */

/* Stream capture and graph launches, as the CUDA Runtime API documents them (Stream Management,
 * Graph Management; Programming Guide, "Prohibited and Unhandled Operations"). These hold on a
 * device too (make test-gpu). */

__global__ void kernel_axpb(const int *x, int *y, int a, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) y[i] = a * x[i] + y[i];
}

/* A non-blocking stream, its capture ended (if still on) and the stream destroyed at scope end. */
struct capture_stream {
    cudaStream_t s = nullptr;
    capture_stream() {
        cr_assert_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    }
    ~capture_stream() {
        cudaStreamCaptureStatus st;
        if (cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
            cudaGraph_t g = nullptr;
            cudaStreamEndCapture(s, &g);
            if (g) cudaGraphDestroy(g);
        }
        cudaGetLastError();
        cudaStreamDestroy(s);
    }
};

Test(cuda_emu, capture_records_and_a_replay_reads_its_sources_then) {
    const int n = 100;
    capture_stream cs;
    dbuf<int> x(n), y(n);
    int *pinned = nullptr;
    cr_assert_eq(cudaHostAlloc((void **)&pinned, sizeof(int) * n, cudaHostAllocDefault),
                 cudaSuccess);
    for (int i = 0; i < n; i++) pinned[i] = i;

    cr_assert_eq(cudaStreamBeginCapture(cs.s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    cudaStreamCaptureStatus st;
    cr_assert_eq(cudaStreamIsCapturing(cs.s, &st), cudaSuccess);
    cr_expect_eq(st, cudaStreamCaptureStatusActive);
    cr_assert_eq(cudaMemsetAsync(y.p, 0, sizeof(int) * n, cs.s), cudaSuccess);
    cr_assert_eq(cudaMemcpyAsync(x.p, pinned, sizeof(int) * n, cudaMemcpyHostToDevice, cs.s),
                 cudaSuccess);
    KV_LAUNCH(kernel_axpb, dim3((n + 63) / 64), dim3(64), 0, cs.s, (const int *)x.p, y.p, 3, n);
    cr_assert_eq(cudaGetLastError(), cudaSuccess);
    cudaGraph_t g = nullptr;
    cr_assert_eq(cudaStreamEndCapture(cs.s, &g), cudaSuccess);
    cr_assert(g);
    cr_assert_eq(cudaStreamIsCapturing(cs.s, &st), cudaSuccess);
    cr_expect_eq(st, cudaStreamCaptureStatusNone);
    size_t nodes = 0;
    cr_assert_eq(cudaGraphGetNodes(g, nullptr, &nodes), cudaSuccess);
    cr_expect_eq(nodes, 3u, "a memset, a copy and a kernel: %zu nodes", nodes);

    /* nothing ran during the capture */
    int h[n];
    cr_assert_eq(cudaStreamSynchronize(cs.s), cudaSuccess);
    x.get(h);
    cr_expect_eq(h[5], 0, "the copy was recorded, not run");

    cudaGraphExec_t ex = nullptr;
    cr_assert_eq(cudaGraphInstantiateWithFlags(&ex, g, 0), cudaSuccess);
    cr_assert_eq(cudaGraphDestroy(g), cudaSuccess, "the executable graph stands alone");
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < n; i++) pinned[i] = round == 0 ? i : 1000 + i;
        cr_assert_eq(cudaGraphLaunch(ex, cs.s), cudaSuccess);
        cr_assert_eq(cudaStreamSynchronize(cs.s), cudaSuccess);
        y.get(h);
        for (int i = 0; i < n; i++)
            cr_assert_eq(h[i], 3 * pinned[i],
                         "round %d, y[%d] = %d: the memset runs first, "
                         "the copy reads the pinned buffer as it is now",
                         round, i, h[i]);
    }
    cr_expect_eq(cudaGraphExecDestroy(ex), cudaSuccess);
    cudaFreeHost(pinned);
}

Test(cuda_emu, a_host_wait_in_a_capture_is_refused_and_invalidates_it) {
    capture_stream cs;
    dbuf<int> y(32);
    cudaEvent_t ev;
    cr_assert_eq(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);

    /* synchronising the capturing stream */
    cr_assert_eq(cudaStreamBeginCapture(cs.s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    KV_LAUNCH(kernel_nop, dim3(1), dim3(32), 0, cs.s, y.p);
    cudaError_t e = cudaStreamSynchronize(cs.s);
    cr_expect_eq(e, cudaErrorStreamCaptureUnsupported, "got %s", cudaGetErrorName(e));
    cudaStreamCaptureStatus st;
    cr_assert_eq(cudaStreamIsCapturing(cs.s, &st), cudaSuccess);
    cr_expect_eq(st, cudaStreamCaptureStatusInvalidated);
    e = cudaMemsetAsync(y.p, 0, 4, cs.s);
    cr_expect_eq(e, cudaErrorStreamCaptureInvalidated, "got %s", cudaGetErrorName(e));
    cudaGraph_t g = nullptr;
    e = cudaStreamEndCapture(cs.s, &g);
    cr_expect_eq(e, cudaErrorStreamCaptureInvalidated, "got %s", cudaGetErrorName(e));
    cr_expect_null(g);
    cudaGetLastError();

    /* waiting on an event recorded into the capture */
    cr_assert_eq(cudaStreamBeginCapture(cs.s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    cr_assert_eq(cudaEventRecord(ev, cs.s), cudaSuccess);
    e = cudaEventSynchronize(ev);
    cr_expect_eq(e, cudaErrorCapturedEvent, "got %s", cudaGetErrorName(e));
    e = cudaStreamEndCapture(cs.s, &g);
    cr_expect_eq(e, cudaErrorStreamCaptureInvalidated, "got %s", cudaGetErrorName(e));
    cudaGetLastError();

    /* a synchronous copy (potentially unsafe) from the capturing thread */
    int h = 0;
    cr_assert_eq(cudaStreamBeginCapture(cs.s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    e = cudaMemcpy(&h, y.p, sizeof h, cudaMemcpyDeviceToHost);
    cr_expect_eq(e, cudaErrorStreamCaptureUnsupported, "got %s", cudaGetErrorName(e));
    e = cudaStreamEndCapture(cs.s, &g);
    cr_expect_eq(e, cudaErrorStreamCaptureInvalidated, "got %s", cudaGetErrorName(e));
    cudaGetLastError();

    /* relaxed mode allows it; the stream captures as before */
    cr_assert_eq(cudaStreamBeginCapture(cs.s, cudaStreamCaptureModeRelaxed), cudaSuccess);
    void *p = nullptr;
    cr_expect_eq(cudaMalloc(&p, 64), cudaSuccess);
    cr_expect_eq(cudaFree(p), cudaSuccess);
    KV_LAUNCH(kernel_nop, dim3(1), dim3(32), 0, cs.s, y.p);
    cr_expect_eq(cudaStreamEndCapture(cs.s, &g), cudaSuccess);
    cr_assert(g);
    cudaGraphDestroy(g);
    cudaEventDestroy(ev);
}

Test(cuda_emu, a_bad_launch_in_a_capture_invalidates_it) {
    capture_stream cs;
    cr_assert_eq(cudaStreamBeginCapture(cs.s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    KV_LAUNCH(kernel_nop, dim3(1), dim3(2048), 0, cs.s, (int *)nullptr);
    cr_expect_neq(cudaGetLastError(), cudaSuccess);
    cudaGraph_t g = nullptr;
    cudaError_t e = cudaStreamEndCapture(cs.s, &g);
    cr_expect_eq(e, cudaErrorStreamCaptureInvalidated, "got %s", cudaGetErrorName(e));
    cr_expect_null(g);
    cudaGetLastError();
}

#ifdef KVSERVE_CUDA_EMU
Test(cuda_emu, graphs_are_counted_and_gemm_ex_is_recorded) {
    long before = emu::live_graphs();
    capture_stream cs;
    cublasHandle_t h;
    cr_assert_eq(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(cublasSetStream(h, cs.s), CUBLAS_STATUS_SUCCESS);
    /* C (1 x 1) = A^T B over k = 8, f32 */
    float a[8], b[8], c = -1.0f, alpha = 1.0f, beta = 0.0f;
    for (int i = 0; i < 8; i++) a[i] = (float)i, b[i] = 1.0f;
    cr_assert_eq(cudaStreamBeginCapture(cs.s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    cr_assert_eq(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, 1, 1, 8, &alpha, a, CUDA_R_32F, 8, b,
                              CUDA_R_32F, 8, &beta, &c, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_SUCCESS);
    alpha = 2.0f; /* the scalars were read at the call */
    cudaGraph_t g = nullptr;
    cr_assert_eq(cudaStreamEndCapture(cs.s, &g), cudaSuccess);
    cr_expect_eq(c, -1.0f, "recorded, not run");
    cudaGraphExec_t ex = nullptr;
    cr_assert_eq(cudaGraphInstantiateWithFlags(&ex, g, 0), cudaSuccess);
    cr_expect_eq(emu::live_graphs(), before + 2);
    b[7] = 3.0f; /* the replay reads its inputs as they are then */
    cr_assert_eq(cudaGraphLaunch(ex, cs.s), cudaSuccess);
    cr_expect_eq(c, 28.0f + 14.0f, "got %g", c);
    cudaGraphExecDestroy(ex);
    cudaGraphDestroy(g);
    cr_expect_eq(emu::live_graphs(), before);
    cublasDestroy(h);
}
#endif
