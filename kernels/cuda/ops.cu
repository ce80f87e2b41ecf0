/* Row and elementwise kernels of the CUDA backend: RMSNorm, RoPE (angles, rotation at positions
 * or by precomputed angles), SwiGLU, add, row gathers, and softmax / top-k for sampling. Float
 * operations follow the CPU backend's order where it makes results bit-identical (RoPE, the
 * rounding of RMSNorm's scale); reductions sum in another order (tolerances in cuda_test.c). */
#include "kernels/cuda/cuda.h"

namespace KV_CUDA_NS {

#define ROW_THREADS 256

/* Sum over a block of ROW_THREADS threads (every thread gets it); red: [32] shared floats. */
__device__ __forceinline__ float block_sum(float v, float *red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads(); /* red may still be read by a previous call */
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : -INFINITY;
    return warp_max(v);
}

/* ---------------------------------------------------------------- RMSNorm */

/* A block per row: y = x * scale * g with scale = 1 / sqrt(mean(x^2) + eps) rounded to f32 as the
 * CPU rounds it (from double). */
__global__ void __launch_bounds__(ROW_THREADS)
    kernel_rmsnorm(const float *x, const float *g, float *y, int dim, float eps) {
    __shared__ float red[32];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float scale = (float)(1.0 / sqrt((double)ss / dim + eps));
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        yr[i] = __fmul_rn(__fmul_rn(xr[i], scale), g[i]);
}

int cuda_rmsnorm(cudaStream_t s, const float *x, const float *g, float *y, int n_tok, int dim,
                 float eps) {
    if (n_tok == 0) return 0;
    KV_LAUNCH(kernel_rmsnorm, dim3(n_tok), dim3(ROW_THREADS), 0, s, x, g, y, dim, eps);
    CUDA_CHECK_LAUNCH("rmsnorm");
    return 0;
}

/* ---------------------------------------------------------------- RoPE */

/* cs[t][2i], cs[t][2i + 1] = cos, sin of pos[t] * inv_freq[i], in double and rounded once
 * (kernels/rope.c's rope_angles). */
__global__ void kernel_rope_angles(const float *inv_freq, int half, const int32_t *pos, int n_tok,
                                   float *cs) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n_tok * half) return;
    const int64_t t = i / half;
    const int p = (int)(i % half);
    const double theta = (double)pos[t] * (double)inv_freq[p];
    cs[t * 2 * half + 2 * p] = (float)cos(theta);
    cs[t * 2 * half + 2 * p + 1] = (float)sin(theta);
}

int cuda_rope_angles(cudaStream_t s, const float *inv_freq, int n_rot, const int32_t *pos,
                     int n_tok, float *cs) {
    const int64_t n = (int64_t)n_tok * (n_rot / 2);
    if (n == 0) return 0;
    KV_LAUNCH(kernel_rope_angles, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s, inv_freq,
              n_rot / 2, pos, n_tok, cs);
    CUDA_CHECK_LAUNCH("rope_angles");
    return 0;
}

/* One thread per (row, head, pair): (x0, x1) -> (x0 c - x1 s, x0 s + x1 c) as rope_rotate, with
 * the angle from cs row idx[t] (or t), or computed from pos[t] when cs is NULL. */
__global__ void kernel_rope(float *x, const int32_t *pos, const float *inv_freq, const float *cs,
                            const int32_t *idx, int n_tok, int n_head, int head_dim, int n_rot) {
    const int half = n_rot / 2;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n_tok * n_head * half) return;
    const int p = (int)(i % half);
    const int64_t th = i / half;
    const int64_t t = th / n_head;
    float c, sn;
    if (cs) {
        const float *a = cs + (size_t)(idx ? idx[t] : t) * n_rot;
        c = a[2 * p];
        sn = a[2 * p + 1];
    } else {
        const double theta = (double)pos[t] * (double)inv_freq[p];
        c = (float)cos(theta);
        sn = (float)sin(theta);
    }
    float *v = x + th * head_dim;
    const float x0 = v[2 * p], x1 = v[2 * p + 1];
    v[2 * p] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
    v[2 * p + 1] = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
}

int cuda_rope(cudaStream_t s, float *x, const int32_t *pos, const float *inv_freq, const float *cs,
              const int32_t *idx, int n_tok, int n_head, int head_dim, int n_rot) {
    const int64_t n = (int64_t)n_tok * n_head * (n_rot / 2);
    if (n == 0) return 0;
    KV_LAUNCH(kernel_rope, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s, x, pos, inv_freq, cs,
              idx, n_tok, n_head, head_dim, n_rot);
    CUDA_CHECK_LAUNCH("rope");
    return 0;
}

/* ---------------------------------------------------------------- elementwise */

__global__ void kernel_swiglu(const float *g, const float *u, float *o, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

int cuda_swiglu(cudaStream_t s, const float *g, const float *u, float *o, int64_t n) {
    if (n == 0) return 0;
    KV_LAUNCH(kernel_swiglu, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s, g, u, o, n);
    CUDA_CHECK_LAUNCH("swiglu");
    return 0;
}

__global__ void kernel_add(float *y, const float *x, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

int cuda_add(cudaStream_t s, float *y, const float *x, int64_t n) {
    if (n == 0) return 0;
    KV_LAUNCH(kernel_add, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s, y, x, n);
    CUDA_CHECK_LAUNCH("add");
    return 0;
}

__global__ void kernel_gather_rows(float *dst, const float *src, const int32_t *idx, int n,
                                   int width) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * width) return;
    const int64_t t = i / width;
    dst[i] = src[(int64_t)idx[t] * width + i % width];
}

int cuda_gather_rows(cudaStream_t s, float *dst, const float *src, const int32_t *idx, int n,
                     int width) {
    const int64_t total = (int64_t)n * width;
    if (total == 0) return 0;
    KV_LAUNCH(kernel_gather_rows, dim3((unsigned)((total + 255) / 256)), dim3(256), 0, s, dst, src,
              idx, n, width);
    CUDA_CHECK_LAUNCH("gather_rows");
    return 0;
}

/* ---------------------------------------------------------------- sampling */

__global__ void __launch_bounds__(ROW_THREADS) kernel_softmax(float *x, int n) {
    __shared__ float red[32];
    float *r = x + (size_t)blockIdx.x * n;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, r[i]);
    m = block_max(m, red);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float e = expf(r[i] - m);
        r[i] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    const float inv = (float)(1.0 / (double)sum);
    for (int i = threadIdx.x; i < n; i += blockDim.x) r[i] *= inv;
}

int cuda_softmax(cudaStream_t s, float *x, int n_rows, int n) {
    if (n_rows == 0) return 0;
    KV_LAUNCH(kernel_softmax, dim3(n_rows), dim3(ROW_THREADS), 0, s, x, n);
    CUDA_CHECK_LAUNCH("softmax");
    return 0;
}

/* (a, ia) ranks above (b, ib): the larger value, NaN below everything, ties to the lower index
 * (the CPU backend's order). */
__device__ __forceinline__ bool topk_above(float a, int ia, float b, int ib) {
    if (isnan(b)) return !isnan(a) || ia < ib;
    if (isnan(a)) return false;
    return a > b || (a == b && ia < ib);
}

/* A block per row, k rounds: each takes the best element ranked below the previous round's pick
 * (a strict order, so no element is taken twice): per-thread bests over a strided scan, then a
 * warp and a block reduction of (value, index) pairs. k <= BACKEND_TOPK_MAX rounds of n / 256
 * reads each: cheap beside the logits' matmul. */
__global__ void __launch_bounds__(ROW_THREADS)
    kernel_topk(const float *x, int n, int k, float *val, int32_t *idx) {
    __shared__ float rv[32];
    __shared__ int ri[32];
    const float *r = x + (size_t)blockIdx.x * n;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float prev_v = 0.0f;
    int prev_i = -1; /* none yet */
    for (int round = 0; round < k; round++) {
        float bv = 0.0f;
        int bi = -1;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = r[i];
            if (prev_i >= 0 && !topk_above(prev_v, prev_i, v, i)) continue;
            if (bi < 0 || topk_above(v, i, bv, bi)) bv = v, bi = i;
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || topk_above(ov, oi, bv, bi))) bv = ov, bi = oi;
        }
        __syncthreads(); /* the previous round's readers are done with rv, ri */
        if (lane == 0) rv[w] = bv, ri[w] = bi;
        __syncthreads();
        bv = 0.0f;
        bi = -1;
        for (int j = 0; j < nw; j++)
            if (ri[j] >= 0 && (bi < 0 || topk_above(rv[j], ri[j], bv, bi))) bv = rv[j], bi = ri[j];
        if (threadIdx.x == 0) {
            val[(size_t)blockIdx.x * k + round] = bv;
            idx[(size_t)blockIdx.x * k + round] = bi;
        }
        prev_v = bv;
        prev_i = bi;
    }
}

int cuda_topk(cudaStream_t s, const float *x, int n_rows, int n, int k, float *val, int32_t *idx) {
    if (n_rows == 0) return 0;
    KV_LAUNCH(kernel_topk, dim3(n_rows), dim3(ROW_THREADS), 0, s, x, n, k, val, idx);
    CUDA_CHECK_LAUNCH("topk");
    return 0;
}

} // namespace KV_CUDA_NS
