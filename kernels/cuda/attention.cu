/* Paged attention and the KV pool's kernels of the CUDA backend (layout: kernels/backend.h).
 *
 * kernel_attention: one warp per (sequence, query row, head, key range). A warp walks its keys 32
 * at a time, a lane per key: the score q.k from the transposed K region (lanes read neighbouring
 * keys of one dim: coalesced), an online softmax over the tiles (running max and sum, the partial
 * output rescaled as the max grows, as FlashAttention, Dao et al. 2022, section 3.1), and the
 * weighted V rows accumulated with lanes over the head's dims. GQA: head h reads kv head
 * h / (n_head / n_kv_head), and the warps of one block are heads of one KV group that share
 * each K/V tile through shared memory (read once per group, not once per head). Decode rows over
 * long histories split their keys into ranges (flash-decoding) whose partial states
 * kernel_attn_merge combines. Prefill rows are causal by slot, like the CPU's.
 *
 * kernel_attention_tc: sequences of ATTN_TC_MIN_ROWS rows or more (prefill), on tensor cores in
 * f16 with f32 accumulation, a block per (sequence, KV head, 64 rows of the head's group); its
 * section below says how and how far from f32 it may be.
 *
 * KV writes convert f32 rows to f16 with round to nearest even, as the CPU does: the pool holds
 * the same bits whichever backend wrote it. */
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/mma.cuh"

namespace KV_CUDA_NS {

#define ATTN_WARPS 4    /* warps per block of the merge kernel */
#define ATTN_FOLD_MAX 8 /* warps (heads of one KV group) per block of kernel_attention */
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

/* Dynamic shared memory of a kernel_attention block of hb warps: the staged K tile [hd][32] and
 * V tile [32][hd] (f16), then each warp's query [hb][hd] and weights [hb][32] (f32). */
static inline size_t attn_smem(int hd, int hb) {
    return (size_t)2 * 32 * hd * 2 + (size_t)hb * (hd + 32) * 4;
}

/* A block of hb warps: heads h0..h0 + hb - 1 of one KV group (hb divides the group), for one
 * (sequence, row, key range); warp gw of the call is head gw % n_head of (row, range) gw /
 * n_head, so a block's warps are consecutive heads. The block stages each 32-key tile of its
 * KV head once (K columns and V rows, coalesced) and every warp reads it from shared memory:
 * the pool is read once per group rather than once per head. Each warp's arithmetic is the
 * unfolded kernel's, in the same order. */
__global__ void __launch_bounds__(ATTN_FOLD_MAX * 32)
    kernel_attention(const attn_desc *desc, int n_seqs, const uint8_t *pool, kv_layout l, int layer,
                     int n_head, float scale, float *part) {
    const int hd = l.head_dim, bt = l.block_tokens, hb = blockDim.x >> 5;
    KV_DYNAMIC_SMEM(uint16_t, smem);
    uint16_t *sk = smem, *sv = smem + 32 * hd; /* [hd][32], [32][hd] */
    float *sq = reinterpret_cast<float *>(smem + 2 * 32 * hd), *sp = sq + hb * hd;
    const int lane = threadIdx.x & 31, wb = threadIdx.x >> 5;
    const int gw = blockIdx.x * hb + wb;
    const attn_desc &d = desc[find_seq(desc, n_seqs, gw, false)];
    int w = gw - d.warp0;
    const int h = w % n_head;
    w /= n_head;
    const int split = w % d.n_split, r = w / d.n_split;
    const int g = h / (n_head / l.n_kv_head);
    const int n_keys = d.q_slot[r] + 1;
    const int ns = d.row_split ? attn_split_count(n_keys, d.n_split) : d.n_split;
    /* a graph's row with fewer keys: the block leaves whole (its warps share row and range) */
    if (split >= ns) return;
    const int k0 = (int)((int64_t)n_keys * split / ns);
    const int k1 = (int)((int64_t)n_keys * (split + 1) / ns);
    float *mq = sq + wb * hd, *mp = sp + wb * 32;

    const float *q = d.q + ((size_t)r * n_head + h) * hd;
    for (int i = lane; i < hd; i += 32) mq[i] = q[i];

    float m = -INFINITY, sum = 0.0f, acc[ATTN_DPL];
    for (int i = 0; i < ATTN_DPL; i++) acc[i] = 0.0f;
    for (int kb = k0; kb < k1; kb += 32) {
        const int nk = k1 - kb < 32 ? k1 - kb : 32;
        __syncthreads(); /* the previous tile is read (and the queries written) */
        for (int e = threadIdx.x; e < 32 * hd; e += blockDim.x) {
            const int kj = kb + e % 32, i = e / 32; /* K: neighbouring threads, neighbouring keys */
            if (kj < k1)
                sk[e] = region(pool, l, layer, 0, g, d.table, kj)[(size_t)i * bt + kj % bt];
            const int vj = kb + e / hd, vi = e % hd; /* V: a key's row */
            if (vj < k1)
                sv[e] = region(pool, l, layer, 1, g, d.table, vj)[(size_t)(vj % bt) * hd + vi];
        }
        __syncthreads();
        float s = -INFINITY;
        if (lane < nk) {
            float dot = 0.0f;
            for (int i = 0; i < hd; i++) dot += mq[i] * h2f(sk[i * 32 + lane]);
            s = dot * scale;
        }
        const float m_new = fmaxf(m, warp_max(s)); /* finite: key kb is in range */
        const float p = lane < nk ? expf(s - m_new) : 0.0f;
        const float corr = expf(m - m_new); /* 0 on the first tile */
        sum = sum * corr + warp_sum(p);
        KV_UNROLL
        for (int i = 0; i < ATTN_DPL; i++) acc[i] *= corr;
        mp[lane] = p;
        __syncwarp();
        for (int j = 0; j < nk; j++) {
            const uint16_t *vr = sv + (size_t)j * hd;
            const float pj = mp[j];
            KV_UNROLL
            for (int i = 0; i < ATTN_DPL; i++)
                if (lane + 32 * i < hd) acc[i] += pj * h2f(vr[lane + 32 * i]);
        }
        __syncwarp(); /* mp is rewritten by the next tile */
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

/* ---------------------------------------------------------------- tensor-core prefill */

/* kernel_attention_tc: a block per (sequence, KV head, tile of FA_ROWS stacked rows), in the
 * manner of FlashAttention-2 (Dao 2023, algorithm 1: the query tile held by its warps, key tiles
 * streamed through shared memory, an online softmax per row, the output normalized once at the
 * end). Stacked row i of a KV head's group is query row i / G of head kvh * G + i % G (G =
 * n_head / n_kv_head), so the G heads that share the KV head share each staged K/V tile: the
 * pool is read once per group and tile, not once per head.
 *
 * Warp w holds stacked rows 16w..16w+15 of the tile: Q as mma A fragments (the scale and
 * log2(e) folded in, so the softmax runs on exp2f), S = Q K^T by mma_f16_16x8x16 with f32
 * accumulation, the causal mask by slot (key > q_slot[row]: rows need not be contiguous
 * slots), the running max and sum per row in f32, and P reused from the S accumulators as A
 * fragments of O += P V (FlashAttention-2, section 3.3's register reuse). K tiles are staged
 * as the pool holds them ([dim][key]) and read with ldmatrix.trans as column-major B
 * fragments; V tiles as [key][dim], read with ldmatrix.trans too. Rows of padded shared memory
 * (8 halves) put ldmatrix's eight row addresses in distinct bank groups.
 *
 * Precision. K and V are f16 in the pool, so they are exact as mma operands; Q and P are not.
 * Each is split in two f16 parts, hi = f16(x) and lo = f16(x - hi), and multiplied twice (lo
 * first, then hi, into the same f32 accumulators): twice the mma of plain f16, for products
 * within 2^-22 x (+ 2^-25 where lo is subnormal) of f32's. Plain f16 Q and P (2^-11 each, as
 * FlashAttention and llama.cpp's kernels use them) measured 1.5e-4 off the CPU on cuda_test's
 * outputs of about 0.1, and flipped 2 of cuda_forward_test's 55 top-1 tokens (SmolLM2's layers
 * at MATMUL_PRECISION_Q8, CPU margins 0.05-0.06): prefill's attention feeds every later layer's
 * KV. Split, the outputs are within 3e-7 there and every top-1 holds. The bound cuda_test
 * checks (tc_bounds) follows from these: a score off by ds moves each softmax weight by a
 * factor within e^(+-2 ds), the output by (e^(2 ds) - 1) max|v|. */

#define FA_WARPS 4
#define FA_ROWS (FA_WARPS * 16) /* stacked rows per block */
#define FA_PAD 8                /* halves of padding per shared row */

template <int HD> struct fa_tile {
    static constexpr int KEYS = 32;     /* keys per staged tile */
    static constexpr int KS = HD / 16;  /* k-steps of Q K^T */
    static constexpr int ND = HD / 8;   /* n-tiles of O */
    static constexpr int NK = KEYS / 8; /* n-tiles of S */
};

/* The block's sequence: the last descriptor whose first block is <= b. */
__device__ __forceinline__ int find_tc_seq(const attn_desc *d, int n, int b) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (d[mid].tblock0 <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* x0, x1 (even, odd element) as two f16 pairs: hi = f16(x), lo = f16(x - hi) (x - hi is exact
 * in f32). */
__device__ __forceinline__ void split_h2(float x0, float x1, uint32_t &hi, uint32_t &lo) {
    const uint16_t h0 = f2h(x0), h1 = f2h(x1);
    hi = (uint32_t)h0 | (uint32_t)h1 << 16;
    lo = (uint32_t)f2h(x0 - h2f(h0)) | (uint32_t)f2h(x1 - h2f(h1)) << 16;
}

/* Keys [kb, kb + KEYS) of KV head kvh into sk ([HD][KEYS + pad], as the pool's K regions) and
 * sv ([KEYS][HD + pad]), 8 halves (16 bytes) per load: block_tokens is a multiple of 16, so an
 * 8-key group never straddles two pool blocks. Groups at or past kend are zeros (the table ends
 * there), and V rows past kend too: a masked key's weight is 0, and 0 times a stale V must not
 * be a NaN. */
template <int HD>
__device__ __forceinline__ void fa_stage(uint16_t (*sk)[fa_tile<HD>::KEYS + FA_PAD],
                                         uint16_t (*sv)[HD + FA_PAD], const uint8_t *pool,
                                         const kv_layout &l, int layer, int kvh,
                                         const int32_t *table, int kb, int kend) {
    constexpr int KEYS = fa_tile<HD>::KEYS;
    const int bt = l.block_tokens;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int i = threadIdx.x; i < HD * (KEYS / 8); i += FA_WARPS * 32) {
        const int dim = i / (KEYS / 8), c = 8 * (i % (KEYS / 8)), slot = kb + c;
        uint4 v = zero;
        if (slot < kend)
            v = *reinterpret_cast<const uint4 *>(region(pool, l, layer, 0, kvh, table, slot) +
                                                 (size_t)dim * bt + slot % bt);
        *reinterpret_cast<uint4 *>(&sk[dim][c]) = v;
    }
    for (int i = threadIdx.x; i < KEYS * (HD / 8); i += FA_WARPS * 32) {
        const int key = i / (HD / 8), c = 8 * (i % (HD / 8)), slot = kb + key;
        uint4 v = zero;
        if (slot < kend)
            v = *reinterpret_cast<const uint4 *>(region(pool, l, layer, 1, kvh, table, slot) +
                                                 (size_t)(slot % bt) * HD + c);
        *reinterpret_cast<uint4 *>(&sv[key][c]) = v;
    }
}

/* One warp's 16 stacked rows: this lane's share of the rows g and g + 8 (C fragments: e = 0, 1
 * row g; e = 2, 3 row g + 8), their Q fragments, running maxima and sums (log2 units), and O. */
template <int HD> struct fa_rows {
    typedef fa_tile<HD> T;
    uint32_t qhi[T::KS][4], qlo[T::KS][4]; /* A fragments, hi and lo parts */
    float o[T::ND][4];
    float m[2], sum[2]; /* sum: this lane's part; the group's 4 lanes add up at the end */
    int slot[2];        /* the rows' q_slot; -1: a padding row, every key masked */

    /* Q once, scaled: a[0] row g dims 2t, 2t+1; a[1] row g + 8; a[2], a[3] dims + 8. */
    __device__ __forceinline__ void load_q(const float *const q[2], float qscale, int t) {
        KV_UNROLL
        for (int ks = 0; ks < T::KS; ks++) {
            KV_UNROLL
            for (int j = 0; j < 4; j++) {
                const float *src = q[j % 2];
                const int dim = 16 * ks + 8 * (j / 2) + 2 * t;
                split_h2(src ? src[dim] * qscale : 0.0f, src ? src[dim + 1] * qscale : 0.0f,
                         qhi[ks][j], qlo[ks][j]);
            }
        }
        KV_UNROLL
        for (int i = 0; i < T::ND; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
        m[0] = m[1] = -INFINITY;
        sum[0] = sum[1] = 0.0f;
    }

    /* S = Q K^T over the staged keys; ldmatrix.trans's matrices: dims 16ks + 0-7 / 8-15 of keys
     * 8nt.., then of keys 8(nt + 1).. */
    __device__ __forceinline__ void scores(const uint16_t (*sk)[T::KEYS + FA_PAD], int lane,
                                           float s[T::NK][4]) const {
        const int mi = lane / 8, mr = lane % 8; /* the row address this lane gives */
        KV_UNROLL
        for (int i = 0; i < T::NK; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        KV_UNROLL
        for (int ks = 0; ks < T::KS; ks++) {
            KV_UNROLL
            for (int nt = 0; nt < T::NK; nt += 2) {
                uint32_t kf[4];
                ldmatrix_x4_trans(kf, &sk[16 * ks + 8 * (mi % 2) + mr][8 * nt + 8 * (mi / 2)]);
                mma_f16_16x8x16(s[nt], qlo[ks], kf);
                mma_f16_16x8x16(s[nt + 1], qlo[ks], kf + 2);
                mma_f16_16x8x16(s[nt], qhi[ks], kf);
                mma_f16_16x8x16(s[nt + 1], qhi[ks], kf + 2);
            }
        }
    }

    /* The causal mask by slot, then the online softmax: S becomes P (against the new maxima),
     * the sums and O rescaled as the maxima grow. */
    __device__ __forceinline__ void softmax(float s[T::NK][4], int kb, int t) {
        float mx[2] = {-INFINITY, -INFINITY};
        KV_UNROLL
        for (int nt = 0; nt < T::NK; nt++) {
            KV_UNROLL
            for (int e = 0; e < 4; e++) {
                const int key = kb + 8 * nt + 2 * t + e % 2;
                if (key > slot[e / 2]) s[nt][e] = -INFINITY;
                mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
            }
        }
        float corr[2], mu[2];
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            const float m_new = fmaxf(m[i], mx[i]);
            mu[i] = m_new == -INFINITY ? 0.0f : m_new; /* no key yet: every p is 0 */
            corr[i] = exp2f(m[i] - mu[i]);
            m[i] = m_new;
            sum[i] *= corr[i];
        }
        KV_UNROLL
        for (int nt = 0; nt < T::NK; nt++) {
            KV_UNROLL
            for (int e = 0; e < 4; e++) {
                s[nt][e] = exp2f(s[nt][e] - mu[e / 2]);
                sum[e / 2] += s[nt][e];
            }
        }
        KV_UNROLL
        for (int i = 0; i < T::ND; i++) {
            KV_UNROLL
            for (int e = 0; e < 4; e++) o[i][e] *= corr[e / 2];
        }
    }

    /* O += P V. P's A fragment of keys 16kk.. is S's n-tiles 2kk and 2kk + 1 (a[0], a[1]: rows g
     * and g + 8 of n-tile 2kk; a[2], a[3]: of 2kk + 1); ldmatrix.trans's matrices: keys 16kk +
     * 0-7 / 8-15 of dims 8nd.., then of dims 8(nd + 1).. */
    __device__ __forceinline__ void accumulate(const uint16_t (*sv)[HD + FA_PAD], int lane,
                                               const float s[T::NK][4]) {
        const int mi = lane / 8, mr = lane % 8;
        KV_UNROLL
        for (int kk = 0; kk < T::KEYS / 16; kk++) {
            uint32_t phi[4], plo[4];
            KV_UNROLL
            for (int j = 0; j < 4; j++) {
                const int nt = 2 * kk + j / 2, e = 2 * (j % 2);
                split_h2(s[nt][e], s[nt][e + 1], phi[j], plo[j]);
            }
            KV_UNROLL
            for (int nd = 0; nd < T::ND; nd += 2) {
                uint32_t vf[4];
                ldmatrix_x4_trans(vf, &sv[16 * kk + 8 * (mi % 2) + mr][8 * nd + 8 * (mi / 2)]);
                mma_f16_16x8x16(o[nd], plo, vf);
                mma_f16_16x8x16(o[nd + 1], plo, vf + 2);
                mma_f16_16x8x16(o[nd], phi, vf);
                mma_f16_16x8x16(o[nd + 1], phi, vf + 2);
            }
        }
    }

    /* O / sum into the rows' outputs (padding rows: none). */
    __device__ __forceinline__ void store(float *const out[2], int t) {
        float inv[2];
        for (int i = 0; i < 2; i++) {
            sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 1);
            sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 2);
            inv[i] = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
        }
        KV_UNROLL
        for (int nd = 0; nd < T::ND; nd++)
            for (int i = 0; i < 2; i++)
                if (out[i]) {
                    float2 v;
                    v.x = o[nd][2 * i] * inv[i], v.y = o[nd][2 * i + 1] * inv[i];
                    *reinterpret_cast<float2 *>(out[i] + 8 * nd + 2 * t) = v;
                }
    }
};

template <int HD>
__global__ void __launch_bounds__(FA_WARPS * 32)
    kernel_attention_tc(const attn_desc *desc, int n_seqs, const uint8_t *pool, kv_layout l,
                        int layer, int n_head, float qscale) {
    typedef fa_tile<HD> T;
    __align__(16) __shared__ uint16_t sk[HD][T::KEYS + FA_PAD];
    __align__(16) __shared__ uint16_t sv[T::KEYS][HD + FA_PAD];
    __shared__ int s_kend[FA_WARPS];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane / 4, t = lane % 4;
    const attn_desc &d = desc[find_tc_seq(desc, n_seqs, blockIdx.x)];
    const int grp = n_head / l.n_kv_head, b = blockIdx.x - d.tblock0;
    const int kvh = b % l.n_kv_head, row0 = (b / l.n_kv_head) * FA_ROWS + 16 * w;

    /* This lane's two rows (g and g + 8 of the warp's 16): stacked row si is query row si / grp
     * of head kvh * grp + si % grp. */
    fa_rows<HD> rows;
    const float *q[2];
    float *out[2];
    for (int i = 0; i < 2; i++) {
        const int si = row0 + g + 8 * i, r = si / grp, h = kvh * grp + si % grp;
        const bool valid = si < d.n_q * grp;
        q[i] = valid ? d.q + ((size_t)r * n_head + h) * HD : nullptr;
        out[i] = valid ? d.out + ((size_t)r * n_head + h) * HD : nullptr;
        rows.slot[i] = valid ? d.q_slot[r] : -1;
    }
    rows.load_q(q, qscale, t);

    /* The keys the block needs: up to its largest slot (the warps' maxima through shared). */
    int wend = rows.slot[0] > rows.slot[1] ? rows.slot[0] : rows.slot[1];
    for (int x = 1; x < 32; x <<= 1) {
        const int other = __shfl_xor_sync(0xffffffffu, wend, x);
        wend = other > wend ? other : wend;
    }
    wend += 1;
    if (lane == 0) s_kend[w] = wend;
    __syncthreads();
    int kend = 0;
    for (int i = 0; i < FA_WARPS; i++) kend = s_kend[i] > kend ? s_kend[i] : kend;

    for (int kb = 0; kb < kend; kb += T::KEYS) {
        __syncthreads(); /* the previous tile is read */
        fa_stage<HD>(sk, sv, pool, l, layer, kvh, d.table, kb, kend);
        __syncthreads();
        if (kb >= wend) continue; /* warp-uniform: none of this warp's rows reach these keys */
        float s[T::NK][4];
        rows.scores(sk, lane, s);
        rows.softmax(s, kb, t);
        rows.accumulate(sv, lane, s);
    }
    rows.store(out, t);
}

bool cuda_attention_tc_fits(const kv_layout *l, int n_head) {
    return l->head_dim % 16 == 0 && l->head_dim <= ATTN_TC_MAX_HD && l->block_tokens % 16 == 0 &&
           n_head % l->n_kv_head == 0;
}

int cuda_attention_tc_blocks(const kv_layout *l, int n_head, int n_q) {
    const int64_t rows = (int64_t)n_q * (n_head / l->n_kv_head);
    return (int)((rows + FA_ROWS - 1) / FA_ROWS) * l->n_kv_head;
}

/* Every head_dim the kernel takes, each its own instantiation (register arrays sized by it): the
 * multiples of 16 that model/llama.c accepts (up to 128, as the CPU reference). */
static int launch_attention_tc(cudaStream_t s, const void *pool, const kv_layout *l, int layer,
                               int n_head, float scale, const attn_desc *desc, int n_seqs,
                               int n_blocks) {
    const uint8_t *p = static_cast<const uint8_t *>(pool);
    const float qscale = scale * 1.44269504088896341f; /* log2(e): the softmax on exp2f */
    switch (l->head_dim) {
#define FA_CASE(hd)                                                                                \
    case hd:                                                                                       \
        KV_LAUNCH(kernel_attention_tc<hd>, dim3(n_blocks), dim3(FA_WARPS * 32), 0, s, desc,        \
                  n_seqs, p, *l, layer, n_head, qscale);                                           \
        break;
        FA_CASE(16)
        FA_CASE(32)
        FA_CASE(48)
        FA_CASE(64)
        FA_CASE(80)
        FA_CASE(96)
        FA_CASE(112)
        FA_CASE(128)
#undef FA_CASE
    default:
        log_error("cuda attention: no tensor-core kernel for head_dim %d", l->head_dim);
        return -1;
    }
    CUDA_CHECK_LAUNCH("attention_tc");
    return 0;
}

int cuda_attention(cudaStream_t s, const void *pool, const kv_layout *l, int layer, int n_head,
                   float scale, const attn_desc *desc, int n_seqs, int n_warps, int n_mwarps,
                   int n_tblocks, float *part) {
    if (l->head_dim > ATTN_MAX_HD) {
        log_error("cuda attention: head_dim %d > %d", l->head_dim, ATTN_MAX_HD);
        return -1;
    }
    if (n_tblocks > 0 &&
        launch_attention_tc(s, pool, l, layer, n_head, scale, desc, n_seqs, n_tblocks))
        return -1;
    if (n_warps == 0) return 0;
    /* heads per block: the most that divide the group (and so every sequence's warps) and fit
     * the shared memory a launch gets without opting in */
    const int grp = n_head / l->n_kv_head;
    int hb = 1;
    for (int k = 2; k <= ATTN_FOLD_MAX && k <= grp; k++)
        if (grp % k == 0 && attn_smem(l->head_dim, k) <= 48 * 1024) hb = k;
    KV_LAUNCH(kernel_attention, dim3(n_warps / hb), dim3(hb * 32), attn_smem(l->head_dim, hb), s,
              desc, n_seqs, static_cast<const uint8_t *>(pool), *l, layer, n_head, scale, part);
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
