/* Paged attention and the KV pool's kernels of the CUDA backend (layout: kernels/backend.h).
 *
 * kernel_attention: one warp per (sequence, query row, head, key range). A warp walks its keys 32
 * at a time, a lane per key: the score q.k from the transposed K region (lanes read neighbouring
 * keys of one dim: coalesced), an online softmax over the tiles (running max and sum, the partial
 * output rescaled as the max grows, as FlashAttention, Dao et al. 2022, section 3.1), and the
 * weighted V rows accumulated with lanes over the head's dims. GQA: head h reads kv head
 * h / (n_head / n_kv_head). Decode rows over long histories split their keys into ranges
 * (flash-decoding) whose partial states kernel_attn_merge combines. Prefill rows are causal by
 * slot, like the CPU's.
 *
 * KV writes convert f32 rows to f16 with round to nearest even, as the CPU does: the pool holds
 * the same bits whichever backend wrote it. */
#include "kernels/cuda/cuda.h"

namespace KV_CUDA_NS {

#define ATTN_WARPS 4    /* warps per block */
#define ATTN_MAX_HD 256 /* head_dim <= this (model/llama.c allows up to 128) */
#define ATTN_DPL (ATTN_MAX_HD / 32)

__device__ __forceinline__ const uint16_t *region(const uint8_t *pool, const kv_layout &l,
                                                  int layer, int kv, int head, const int32_t *table,
                                                  int slot) {
    return kv_layout_region(pool, &l, layer, kv, head, table, slot);
}

/* The sequence of warp gw: the last descriptor whose first warp is <= gw (offset by field). */
__device__ __forceinline__ int find_seq(const attn_desc *d, int n, int gw, bool merge) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if ((merge ? d[mid].mwarp0 : d[mid].warp0) <= gw)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

__global__ void __launch_bounds__(ATTN_WARPS * 32)
    kernel_attention(const attn_desc *desc, int n_seqs, int n_warps, const uint8_t *pool,
                     kv_layout l, int layer, int n_head, float scale, float *part) {
    __shared__ float sq[ATTN_WARPS][ATTN_MAX_HD];
    __shared__ float sp[ATTN_WARPS][32];
    const int lane = threadIdx.x & 31, wb = threadIdx.x >> 5;
    const int gw = blockIdx.x * ATTN_WARPS + wb;
    if (gw >= n_warps) return; /* whole warps: only warp barriers follow */
    const attn_desc &d = desc[find_seq(desc, n_seqs, gw, false)];
    int w = gw - d.warp0;
    const int split = w % d.n_split;
    w /= d.n_split;
    const int h = w % n_head, r = w / n_head;
    const int g = h / (n_head / l.n_kv_head), hd = l.head_dim, bt = l.block_tokens;
    const int n_keys = d.q_slot[r] + 1;
    const int ns = d.row_split ? attn_split_count(n_keys, d.n_split) : d.n_split;
    if (split >= ns) return; /* a graph's row with fewer keys: whole warps leave */
    const int k0 = (int)((int64_t)n_keys * split / ns);
    const int k1 = (int)((int64_t)n_keys * (split + 1) / ns);

    const float *q = d.q + ((size_t)r * n_head + h) * hd;
    for (int i = lane; i < hd; i += 32) sq[wb][i] = q[i];
    __syncwarp();

    float m = -INFINITY, sum = 0.0f, acc[ATTN_DPL];
    for (int i = 0; i < ATTN_DPL; i++) acc[i] = 0.0f;
    for (int kb = k0; kb < k1; kb += 32) {
        const int key = kb + lane;
        float s = -INFINITY;
        if (key < k1) {
            const uint16_t *kr = region(pool, l, layer, 0, g, d.table, key) + key % bt;
            float dot = 0.0f;
            for (int i = 0; i < hd; i++) dot += sq[wb][i] * h2f(kr[(size_t)i * bt]);
            s = dot * scale;
        }
        const float m_new = fmaxf(m, warp_max(s)); /* finite: key kb is in range */
        const float p = key < k1 ? expf(s - m_new) : 0.0f;
        const float corr = expf(m - m_new); /* 0 on the first tile */
        sum = sum * corr + warp_sum(p);
        KV_UNROLL
        for (int i = 0; i < ATTN_DPL; i++) acc[i] *= corr;
        sp[wb][lane] = p;
        __syncwarp();
        const int nk = k1 - kb < 32 ? k1 - kb : 32;
        for (int j = 0; j < nk; j++) {
            const int kj = kb + j;
            const uint16_t *vr = region(pool, l, layer, 1, g, d.table, kj) + (size_t)(kj % bt) * hd;
            const float pj = sp[wb][j];
            KV_UNROLL
            for (int i = 0; i < ATTN_DPL; i++)
                if (lane + 32 * i < hd) acc[i] += pj * h2f(vr[lane + 32 * i]);
        }
        __syncwarp(); /* sp is rewritten by the next tile */
        m = m_new;
    }
    if (ns == 1) {
        float *o = d.out + ((size_t)r * n_head + h) * hd;
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int i = 0; i < ATTN_DPL; i++)
            if (lane + 32 * i < hd) o[lane + 32 * i] = acc[i] * inv;
    } else {
        float *pp = part + (d.part0 + ((int64_t)r * n_head + h) * d.n_split + split) * (hd + 2);
        if (lane == 0) pp[0] = m, pp[1] = sum;
        for (int i = 0; i < ATTN_DPL; i++)
            if (lane + 32 * i < hd) pp[2 + lane + 32 * i] = acc[i];
    }
}

/* One warp per (split sequence, row, head): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
 */
__global__ void __launch_bounds__(ATTN_WARPS * 32)
    kernel_attn_merge(const attn_desc *desc, int n_seqs, int n_mwarps, int n_head, int hd,
                      const float *part) {
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (gw >= n_mwarps) return;
    const attn_desc &d = desc[find_seq(desc, n_seqs, gw, true)];
    const int w = gw - d.mwarp0, h = w % n_head, r = w / n_head;
    const int ns = d.row_split ? attn_split_count(d.q_slot[r] + 1, d.n_split) : d.n_split;
    if (ns == 1) return; /* kernel_attention wrote the row */
    const float *p = part + (d.part0 + ((int64_t)r * n_head + h) * d.n_split) * (hd + 2);
    float mx = -INFINITY;
    for (int s = 0; s < ns; s++) mx = fmaxf(mx, p[(size_t)s * (hd + 2)]);
    float total = 0.0f, acc[ATTN_DPL];
    for (int i = 0; i < ATTN_DPL; i++) acc[i] = 0.0f;
    for (int s = 0; s < ns; s++) {
        const float *ps = p + (size_t)s * (hd + 2);
        if (ps[0] == -INFINITY) continue; /* no keys */
        const float wgt = expf(ps[0] - mx);
        total += wgt * ps[1];
        for (int i = 0; i < ATTN_DPL; i++)
            if (lane + 32 * i < hd) acc[i] += wgt * ps[2 + lane + 32 * i];
    }
    float *o = d.out + ((size_t)r * n_head + h) * hd;
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int i = 0; i < ATTN_DPL; i++)
        if (lane + 32 * i < hd) o[lane + 32 * i] = acc[i] * inv;
}

int cuda_attention(cudaStream_t s, const void *pool, const kv_layout *l, int layer, int n_head,
                   float scale, const attn_desc *desc, int n_seqs, int n_warps, int n_mwarps,
                   float *part) {
    if (l->head_dim > ATTN_MAX_HD) {
        log_error("cuda attention: head_dim %d > %d", l->head_dim, ATTN_MAX_HD);
        return -1;
    }
    if (n_warps == 0) return 0;
    KV_LAUNCH(kernel_attention, dim3((n_warps + ATTN_WARPS - 1) / ATTN_WARPS),
              dim3(ATTN_WARPS * 32), 0, s, desc, n_seqs, n_warps,
              static_cast<const uint8_t *>(pool), *l, layer, n_head, scale, part);
    CUDA_CHECK_LAUNCH("attention");
    if (n_mwarps > 0) {
        KV_LAUNCH(kernel_attn_merge, dim3((n_mwarps + ATTN_WARPS - 1) / ATTN_WARPS),
                  dim3(ATTN_WARPS * 32), 0, s, desc, n_seqs, n_mwarps, n_head, l->head_dim,
                  static_cast<const float *>(part));
        CUDA_CHECK_LAUNCH("attn_merge");
    }
    return 0;
}

/* ---------------------------------------------------------------- KV copies */

/* One thread per (token, kv head, dim): K into the transposed region's column, V into its row. */
__global__ void kernel_kv_write(uint8_t *pool, kv_layout l, int layer, const int32_t *table,
                                const int32_t *slots, int n_tok, const float *k, const float *v) {
    const int hd = l.head_dim, bt = l.block_tokens;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n_tok * l.n_kv_head * hd) return;
    const int dd = (int)(i % hd);
    const int64_t th = i / hd;
    const int h = (int)(th % l.n_kv_head), t = (int)(th / l.n_kv_head);
    const int slot = slots[t], off = slot % bt;
    uint16_t *kr = kv_layout_region(pool, &l, layer, 0, h, table, slot);
    uint16_t *vr = kv_layout_region(pool, &l, layer, 1, h, table, slot);
    kr[(size_t)dd * bt + off] = f2h(k[i]);
    vr[(size_t)off * hd + dd] = f2h(v[i]);
}

int cuda_kv_write(cudaStream_t s, void *pool, const kv_layout *l, int layer, const int32_t *table,
                  const int32_t *slots, int n_tok, const float *k, const float *v) {
    const int64_t n = (int64_t)n_tok * l->n_kv_head * l->head_dim;
    if (n == 0) return 0;
    KV_LAUNCH(kernel_kv_write, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s,
              static_cast<uint8_t *>(pool), *l, layer, table, slots, n_tok, k, v);
    CUDA_CHECK_LAUNCH("kv_write");
    return 0;
}

__global__ void kernel_kv_gather(const uint8_t *pool, kv_layout l, int layer, int kv,
                                 const int32_t *table, const int32_t *slots, int n_tok,
                                 float *out) {
    const int hd = l.head_dim, bt = l.block_tokens;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n_tok * l.n_kv_head * hd) return;
    const int dd = (int)(i % hd);
    const int64_t th = i / hd;
    const int h = (int)(th % l.n_kv_head), t = (int)(th / l.n_kv_head);
    const int slot = slots[t], off = slot % bt;
    const uint16_t *r = kv_layout_region(pool, &l, layer, kv, h, table, slot);
    out[i] = h2f(kv == 0 ? r[(size_t)dd * bt + off] : r[(size_t)off * hd + dd]);
}

int cuda_kv_gather(cudaStream_t s, const void *pool, const kv_layout *l, int layer, int kv,
                   const int32_t *table, const int32_t *slots, int n_tok, float *out) {
    const int64_t n = (int64_t)n_tok * l->n_kv_head * l->head_dim;
    if (n == 0) return 0;
    KV_LAUNCH(kernel_kv_gather, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s,
              static_cast<const uint8_t *>(pool), *l, layer, kv, table, slots, n_tok, out);
    CUDA_CHECK_LAUNCH("kv_gather");
    return 0;
}

/* One thread per (token, kv head, pair) of the rotated dims: K turned in f32 by cs row t and
 * rounded back, as the CPU's cpu_kv_rope (rope_rotate's operations, unfused). */
__global__ void kernel_kv_rope(uint8_t *pool, kv_layout l, int layer, const int32_t *table,
                               const int32_t *slots, int n_tok, const float *cs, int n_rot) {
    const int half = n_rot / 2, bt = l.block_tokens;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n_tok * l.n_kv_head * half) return;
    const int p = (int)(i % half);
    const int64_t th = i / half;
    const int h = (int)(th % l.n_kv_head), t = (int)(th / l.n_kv_head);
    const int slot = slots[t], off = slot % bt;
    uint16_t *kr = kv_layout_region(pool, &l, layer, 0, h, table, slot);
    const float c = cs[(size_t)t * n_rot + 2 * p], sn = cs[(size_t)t * n_rot + 2 * p + 1];
    uint16_t *e0 = kr + (size_t)(2 * p) * bt + off, *e1 = kr + (size_t)(2 * p + 1) * bt + off;
    const float x0 = h2f(*e0), x1 = h2f(*e1);
    *e0 = f2h(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn)));
    *e1 = f2h(__fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c)));
}

int cuda_kv_rope(cudaStream_t s, void *pool, const kv_layout *l, int layer, const int32_t *table,
                 const int32_t *slots, int n_tok, const float *cs, int n_rot) {
    const int64_t n = (int64_t)n_tok * l->n_kv_head * (n_rot / 2);
    if (n == 0) return 0;
    KV_LAUNCH(kernel_kv_rope, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s,
              static_cast<uint8_t *>(pool), *l, layer, table, slots, n_tok, cs, n_rot);
    CUDA_CHECK_LAUNCH("kv_rope");
    return 0;
}

/* One thread per (token, layer, K/V, head, dim): a 2-byte element between a pool slot and a
 * stage slot, each in its block's region (K transposed, V by rows). */
__global__ void kernel_kv_rows(uint8_t *pool, kv_layout l, const int32_t *table, int slot, int n,
                               uint8_t *stage, int stage_slot, bool to_pool) {
    const int hd = l.head_dim, bt = l.block_tokens;
    const int64_t per_tok = (int64_t)l.n_layer * 2 * l.n_kv_head * hd;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * per_tok) return;
    const int t = (int)(i / per_tok);
    int64_t r = i % per_tok;
    const int dd = (int)(r % hd);
    r /= hd;
    const int h = (int)(r % l.n_kv_head);
    r /= l.n_kv_head;
    const int kv = (int)(r % 2), layer = (int)(r / 2);
    const int s = slot + t, g = stage_slot + t;
    const size_t bb = kv_layout_block_bytes(&l), reg = kv_layout_offset(&l, layer, kv, h);
    uint16_t *p = reinterpret_cast<uint16_t *>(pool + (size_t)table[s / bt] * bb + reg);
    uint16_t *q = reinterpret_cast<uint16_t *>(stage + (size_t)(g / bt) * bb + reg);
    const size_t ep = kv == 0 ? (size_t)dd * bt + s % bt : (size_t)(s % bt) * hd + dd;
    const size_t eq = kv == 0 ? (size_t)dd * bt + g % bt : (size_t)(g % bt) * hd + dd;
    if (to_pool)
        p[ep] = q[eq];
    else
        q[eq] = p[ep];
}

int cuda_kv_rows(cudaStream_t s, void *pool, const kv_layout *l, const int32_t *table, int slot,
                 int n, void *stage, int stage_slot, bool to_pool) {
    const int64_t total = (int64_t)n * l->n_layer * 2 * l->n_kv_head * l->head_dim;
    if (total == 0) return 0;
    KV_LAUNCH(kernel_kv_rows, dim3((unsigned)((total + 255) / 256)), dim3(256), 0, s,
              static_cast<uint8_t *>(pool), *l, table, slot, n, static_cast<uint8_t *>(stage),
              stage_slot, to_pool);
    CUDA_CHECK_LAUNCH("kv_rows");
    return 0;
}

} // namespace KV_CUDA_NS
