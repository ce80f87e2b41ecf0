/* CPU quantized kernels: the portable scalar reference of every routine in kernels/quant.h, the
 * fp16/bf16 conversions, and the dispatcher that picks the AVX2 or AVX-512 variant
 * (quant_avx2.c, quant_avx512.c) for the CPU at run time.
 *
 * Block formats are GGML's (ggml/src/ggml-common.h, dequantize_row_* in ggml-quants.c); the
 * dequantizers compute in the same float operation order as GGML (and the gguf Python package),
 * so every SIMD level gives bit-identical values. The dot products are the reference the SIMD
 * tiles are tested against: exact integer sums per block, scaled per block as GGML's
 * ggml_vec_dot_*_ref do, accumulated in double. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "kernels/cpu/quant_impl.h"

/* ---------------------------------------------------------------- fp16 / bf16 */

float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, or NaN with its payload */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13); /* rebias 15 -> 127 */
    } else {
        float f = (float)man * 0x1p-24f; /* zero or subnormal: man * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even as F16C's vcvtps2ph does (F. Giesen's float_to_half_fast3_rtne):
 * overflow gives inf, NaN stays NaN with the quiet bit set and the top of its payload. */
uint16_t fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7fffffffu;
    if (x >= 0x47800000u) { /* >= 65536: inf or NaN */
        if (x > 0x7f800000u) return sign | 0x7e00 | (uint16_t)((x >> 13) & 0x3ff);
        return sign | 0x7c00;
    }
    if (x < 0x38800000u) { /* below 2^-14: the result is subnormal or zero */
        /* Adding 0.5f leaves the value's multiple of 2^-24 (the fp16 subnormal step), rounded
         * to nearest even by the float add, in the low mantissa bits. */
        float v;
        memcpy(&v, &x, 4);
        v += 0.5f;
        uint32_t vb;
        memcpy(&vb, &v, 4);
        return sign | (uint16_t)(vb - 0x3f000000u);
    }
    uint32_t mant_odd = (x >> 13) & 1;
    x += ((uint32_t)(15 - 127) << 23) + 0xfff + mant_odd; /* rebias and round half to even */
    return sign | (uint16_t)(x >> 13);
}

float bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void scalar_fp16_to_fp32_row(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = fp16_to_fp32(src[i]);
}

static void scalar_fp32_to_fp16_row(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = fp32_to_fp16(src[i]);
}

static inline uint16_t rd16(const void *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float rdf32(const void *p) {
    float v;
    memcpy(&v, p, 4);
    return v;
}

/* ---------------------------------------------------------------- dequantize (weights) */

static void scalar_dequantize_f32(const void *src, float *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void scalar_dequantize_f16(const void *src, float *dst, int64_t n) {
    const uint8_t *s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = fp16_to_fp32(rd16(s + 2 * i));
}

static void scalar_dequantize_bf16(const void *src, float *dst, int64_t n) {
    const uint8_t *s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_fp32(rd16(s + 2 * i));
}

static void scalar_dequantize_q4_0(const void *src, float *dst, int64_t n) {
    const block_q4_0 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)((b[i].qs[j] & 0xF) - 8);
            dst[j + 16] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
    }
}

static void scalar_dequantize_q4_1(const void *src, float *dst, int64_t n) {
    const block_q4_1 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)(b[i].qs[j] & 0xF) + m;
            dst[j + 16] = d * (float)(b[i].qs[j] >> 4) + m;
        }
    }
}

static inline uint32_t q5_high_bits(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

static void scalar_dequantize_q5_0(const void *src, float *dst, int64_t n) {
    const block_q5_0 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const float d = fp16_to_fp32(b[i].d);
        const uint32_t qh = q5_high_bits(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int lo = (b[i].qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
            int hi = (b[i].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            dst[j] = d * (float)(lo - 16);
            dst[j + 16] = d * (float)(hi - 16);
        }
    }
}

static void scalar_dequantize_q5_1(const void *src, float *dst, int64_t n) {
    const block_q5_1 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
        const uint32_t qh = q5_high_bits(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int lo = (b[i].qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
            int hi = (b[i].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            dst[j] = d * (float)lo + m;
            dst[j + 16] = d * (float)hi + m;
        }
    }
}

static void scalar_dequantize_q8_0(const void *src, float *dst, int64_t n) {
    const block_q8_0 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK32; j++) dst[j] = d * (float)b[i].qs[j];
    }
}

static void scalar_dequantize_q4_K(const void *src, float *dst, int64_t n) {
    const block_q4_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        const uint8_t *q = b[i].qs;
        for (int s = 0; s < 8; s += 2, q += 32) {
            int sc, m;
            quant_k4_scale_min(b[i].scales, s, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            quant_k4_scale_min(b[i].scales, s + 1, &sc, &m);
            const float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) *dst++ = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *dst++ = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

static void scalar_dequantize_q5_K(const void *src, float *dst, int64_t n) {
    const block_q5_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        const uint8_t *q = b[i].qs, *qh = b[i].qh;
        for (int s = 0; s < 8; s += 2, q += 32) {
            int sc, m;
            quant_k4_scale_min(b[i].scales, s, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            quant_k4_scale_min(b[i].scales, s + 1, &sc, &m);
            const float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++)
                *dst++ = d1 * (float)((q[l] & 0xF) | ((qh[l] >> s) & 1) << 4) - m1;
            for (int l = 0; l < 32; l++)
                *dst++ = d2 * (float)((q[l] >> 4) | ((qh[l] >> (s + 1)) & 1) << 4) - m2;
        }
    }
}

/* The 6-bit value of element e (0..255) of a Q6_K block (its ql and qh), before the -32. */
static inline int q6_K_value(const uint8_t *ql, const uint8_t *qh, int e) {
    const int h = e / 128, k = (e % 128) / 32, l = e % 32;
    const uint8_t lo4 = ql[64 * h + l + 32 * (k & 1)];
    const int lo = k < 2 ? (lo4 & 0xF) : (lo4 >> 4);
    return lo | ((qh[32 * h + l] >> (2 * k)) & 3) << 4;
}

static void scalar_dequantize_q6_K(const void *src, float *dst, int64_t n) {
    const block_q6_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K) {
        const float d = fp16_to_fp32(b[i].d);
        for (int e = 0; e < QK_K; e++)
            dst[e] = d * (float)b[i].scales[e / 16] * (float)(q6_K_value(b[i].ql, b[i].qh, e) - 32);
    }
}

/* ---------------------------------------------------------------- quantize (activations) */

/* x * id rounded to nearest even and clamped to +-127. NaN gives -127 (no UB) as at every SIMD
 * level: these comparisons are maxss/minss, which return the second operand on NaN, like the
 * vector max/min the SIMD variants use. */
static inline int8_t q8_round(float v) {
    v = v > -127.0f ? v : -127.0f;
    v = v < 127.0f ? v : 127.0f;
    return (int8_t)(int)((v + 0x1.8p23f) - 0x1.8p23f); /* |v| < 2^22: the add rounds */
}

/* The fp16 scale GGML's Q8_0/Q8_1 use for a block whose largest magnitude is amax: amax/127
 * rounded to fp16, clamped to the largest finite fp16. */
static inline uint16_t q8_scale_fp16(float amax) {
    uint16_t dh = fp32_to_fp16(amax / 127.0f);
    return (dh & 0x7fff) >= 0x7c00 ? 0x7bff : dh;
}

/* Largest magnitude; NaN counts as 0. */
static inline float q8_amax(const float *x, int n) {
    float amax = 0.0f;
    for (int e = 0; e < n; e++) {
        float a = fabsf(x[e]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* One 32-element block with an fp16 scale; returns the scale's bits and the sum of q. */
static uint16_t q8_block32(const float *x, int8_t q[32], int *sum) {
    const uint16_t dh = q8_scale_fp16(q8_amax(x, 32));
    const float d = fp16_to_fp32(dh);
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    int s = 0;
    for (int e = 0; e < 32; e++) {
        q[e] = q8_round(x[e] * id);
        s += q[e];
    }
    *sum = s;
    return dh;
}

static void scalar_quantize_f32(const float *src, void *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void scalar_quantize_f16(const float *src, void *dst, int64_t n) {
    uint8_t *d = dst;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h = fp32_to_fp16(src[i]);
        memcpy(d + 2 * i, &h, 2);
    }
}

/* GGML's block_q8_0 layout, as stored in files. */
static void scalar_quantize_q8_0(const float *src, void *dst, int64_t n) {
    block_q8_0 *y = dst;
    for (int64_t i = 0; i < n / QK32; i++) {
        int sum;
        y[i].d = q8_block32(src + QK32 * i, y[i].qs, &sum);
    }
}

/* The act32 layout (quant_impl.h). */
static void scalar_quantize_q8_1(const float *src, void *dst, int64_t n) {
    const int64_t nb = n / QK32;
    uint8_t *y = dst;
    for (int64_t b0 = 0, g; b0 < nb; b0 += g) {
        g = act32_group_blocks(nb - b0);
        for (int k = 0; k < (int)g; k++) {
            int8_t q[32];
            int sum;
            const uint16_t dh = q8_block32(src + QK32 * (b0 + k), q, &sum);
            act32_put_block(y + ACT32_BLOCK_BYTES * b0, (int)g, k, q, dh, sum);
        }
    }
}

/* The actK layout (quant_impl.h). */
static void scalar_quantize_q8_K(const float *src, void *dst, int64_t n) {
    uint8_t *y = dst;
    for (int64_t i = 0; i < n / QK_K; i++, src += QK_K, y += ACTK_BLOCK_BYTES) {
        const float d = q8_amax(src, QK_K) / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t q[QK_K];
        for (int e = 0; e < QK_K; e++) q[e] = q8_round(src[e] * id);
        actk_put(y, q, d);
    }
}

/* ---------------------------------------------------------------- dot products */

/* Reads block k of an act32 group: its 32 int8 values in element order, scale and sum. */
static void act32_read_block(const uint8_t *grp, int g, int k, int8_t xq[32], float *dx,
                             int *xsum) {
    for (int e = 0; e < 32; e++) xq[e] = (int8_t)grp[act32_qs_offset(g, k, e)];
    const int slot = act32_slot(g, k);
    *dx = fp16_to_fp32(rd16(grp + 32 * g + 2 * slot));
    *xsum = (int16_t)rd16(grp + 34 * g + 2 * slot);
}

/* Unsigned quant values of a 32-element weight block in element order, with the block's
 * value = scale * (q - offset) + bias. */
typedef struct w32_block {
    int q[32];
    float scale, bias;
    int offset;
} w32_block;

static void w32_read(tensor_type t, const uint8_t *blk, w32_block *o) {
    o->bias = 0.0f;
    o->offset = 0;
    switch (t) {
    case TENSOR_TYPE_Q4_0:
    case TENSOR_TYPE_Q4_1: {
        const int has_min = t == TENSOR_TYPE_Q4_1;
        const uint8_t *qs = blk + (has_min ? 4 : 2);
        for (int j = 0; j < 16; j++) {
            o->q[j] = qs[j] & 0xF;
            o->q[j + 16] = qs[j] >> 4;
        }
        o->scale = fp16_to_fp32(rd16(blk));
        if (has_min)
            o->bias = fp16_to_fp32(rd16(blk + 2));
        else
            o->offset = 8;
        break;
    }
    case TENSOR_TYPE_Q5_0:
    case TENSOR_TYPE_Q5_1: {
        const int has_min = t == TENSOR_TYPE_Q5_1;
        const uint8_t *qh = blk + (has_min ? 4 : 2), *qs = qh + 4;
        const uint32_t h = q5_high_bits(qh);
        for (int j = 0; j < 16; j++) {
            o->q[j] = (qs[j] & 0xF) | (int)((h >> j) & 1) << 4;
            o->q[j + 16] = (qs[j] >> 4) | (int)((h >> (j + 16)) & 1) << 4;
        }
        o->scale = fp16_to_fp32(rd16(blk));
        if (has_min)
            o->bias = fp16_to_fp32(rd16(blk + 2));
        else
            o->offset = 16;
        break;
    }
    default: /* Q8_0 */
        for (int j = 0; j < 32; j++) o->q[j] = (int8_t)blk[2 + j];
        o->scale = fp16_to_fp32(rd16(blk));
        break;
    }
}

/* sum over blocks of (dw*dx) * sum_e (q_e - offset) x_e + bias * (dx * sum_e x_e), as GGML's
 * ggml_vec_dot_q4_1_q8_1 etc. do it. */
static float scalar_dot_row_w32(tensor_type t, int64_t n, const uint8_t *w, const uint8_t *x) {
    const int64_t nb = n / QK32;
    const size_t wbytes = tensor_type_get((int)t)->type_size;
    /* a lane-order row (*_L16): each full group read back as its GGUF blocks */
    l16_geometry lg = {0};
    const int lanes = quant_lanes_base(t) != t && l16_geometry_of(quant_lanes_base(t), &lg);
    t = quant_lanes_base(t);
    double sum = 0.0;
    for (int64_t b0 = 0, g; b0 < nb; b0 += g) {
        g = act32_group_blocks(nb - b0);
        const uint8_t *grp = x + ACT32_BLOCK_BYTES * b0;
        uint8_t gguf[L16_GROUP_BLOCKS * 34];
        const uint8_t *wg = w + wbytes * (size_t)b0;
        if (lanes && g >= 2) {
            if (g == L16_GROUP_BLOCKS)
                l16_unpack_group(&lg, wg, gguf);
            else
                l16_unpack_tail(&lg, (int)g, wg, gguf);
            wg = gguf;
        }
        for (int k = 0; k < (int)g; k++) {
            int8_t xq[32];
            float dx;
            int xsum;
            act32_read_block(grp, (int)g, k, xq, &dx, &xsum);
            w32_block wb;
            w32_read(t, wg + wbytes * (size_t)k, &wb);
            int isum = 0;
            for (int e = 0; e < 32; e++) isum += (wb.q[e] - wb.offset) * xq[e];
            sum += (double)((wb.scale * dx) * (float)isum);
            if (wb.bias != 0.0f) sum += (double)(wb.bias * (dx * (float)xsum));
        }
    }
    return (float)sum;
}

/* Reads super-block x of actK: 256 int8 values in element order, d and the 8 sums of the
 * 32-element sub-blocks. */
static float actk_read(const uint8_t *x, int8_t xq[QK_K], int xsum32[8], int bsum16[16]) {
    for (int e = 0; e < QK_K; e++) xq[e] = (int8_t)x[actk_qs_offset(e)];
    for (int s = 0; s < 8; s++) {
        int lo = (int16_t)rd16(x + ACTK_BSUM_OFFSET + 2 * actk_lane(32 * s));
        int hi = (int16_t)rd16(x + ACTK_BSUM_OFFSET + 2 * actk_lane(32 * s + 16));
        bsum16[2 * s] = lo;
        bsum16[2 * s + 1] = hi;
        xsum32[s] = lo + hi;
    }
    return rdf32(x + ACTK_D_OFFSET);
}

/* Q4_K / Q5_K: d*dx * sum_s sc_s * sum(q x) - dmin*dx * sum_s m_s * sum(x), exact integers per
 * super-block as GGML's ggml_vec_dot_q4_K_q8_K. */
static float scalar_dot_row_k45(tensor_type t, int64_t n, const uint8_t *w, const uint8_t *x) {
    const int five = t == TENSOR_TYPE_Q5_K;
    const size_t wbytes = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    double sum = 0.0;
    for (int64_t i = 0; i < n / QK_K; i++, w += wbytes, x += ACTK_BLOCK_BYTES) {
        int8_t xq[QK_K];
        int xsum[8], bsum16[16];
        const float dx = actk_read(x, xq, xsum, bsum16);
        const uint8_t *scales = w + 4;
        const uint8_t *qh = five ? w + 16 : NULL, *qs = w + (five ? 48 : 16);
        int64_t sumi = 0, summ = 0;
        for (int s = 0; s < 8; s++) {
            int sc, m, isum = 0;
            quant_k4_scale_min(scales, s, &sc, &m);
            for (int l = 0; l < 32; l++) {
                int q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF;
                if (five) q |= ((qh[l] >> s) & 1) << 4;
                isum += q * xq[32 * s + l];
            }
            sumi += (int64_t)sc * isum;
            summ += (int64_t)m * xsum[s];
        }
        const float d = fp16_to_fp32(rd16(w)) * dx, dmin = fp16_to_fp32(rd16(w + 2)) * dx;
        sum += (double)(d * (float)sumi) - (double)(dmin * (float)summ);
    }
    return (float)sum;
}

/* Q6_K: d*dx * sum over 16-element sub-blocks of sc * sum((q-32) x). Byte offsets, not the
 * struct: tiles take rows at any alignment. */
static float scalar_dot_row_q6_K(int64_t n, const uint8_t *w, const uint8_t *x) {
    double sum = 0.0;
    for (int64_t i = 0; i < n / QK_K; i++, w += sizeof(block_q6_K), x += ACTK_BLOCK_BYTES) {
        const uint8_t *ql = w + offsetof(block_q6_K, ql), *qh = w + offsetof(block_q6_K, qh);
        const int8_t *scales = (const int8_t *)(w + offsetof(block_q6_K, scales));
        int8_t xq[QK_K];
        int xsum[8], bsum16[16];
        const float dx = actk_read(x, xq, xsum, bsum16);
        int64_t sumi = 0;
        for (int s = 0; s < 16; s++) {
            int isum = 0;
            for (int l = 0; l < 16; l++)
                isum += (q6_K_value(ql, qh, 16 * s + l) - 32) * xq[16 * s + l];
            sumi += (int64_t)scales[s] * isum;
        }
        sum += (double)((fp16_to_fp32(rd16(w + offsetof(block_q6_K, d))) * dx) * (float)sumi);
    }
    return (float)sum;
}

/* x: f32 activations, possibly unaligned (any row stride). */
static float scalar_dot_row_float(tensor_type t, int64_t n, const uint8_t *w, const uint8_t *x) {
    double sum = 0.0;
    for (int64_t e = 0; e < n; e++) {
        float v = t == TENSOR_TYPE_F32   ? rdf32(w + 4 * e)
                  : t == TENSOR_TYPE_F16 ? fp16_to_fp32(rd16(w + 2 * e))
                                         : bf16_to_fp32(rd16(w + 2 * e));
        sum += (double)v * (double)rdf32(x + 4 * e);
    }
    return (float)sum;
}

static float scalar_dot_row(tensor_type t, int64_t n, const uint8_t *w, const uint8_t *x) {
    switch (t) {
    case TENSOR_TYPE_F32:
    case TENSOR_TYPE_F16:
    case TENSOR_TYPE_BF16:
        return scalar_dot_row_float(t, n, w, x);
    case TENSOR_TYPE_Q4_K:
    case TENSOR_TYPE_Q5_K:
        return scalar_dot_row_k45(t, n, w, x);
    case TENSOR_TYPE_Q6_K:
        return scalar_dot_row_q6_K(n, w, x);
    default:
        return scalar_dot_row_w32(t, n, w, x);
    }
}

static void scalar_dot_tile(tensor_type t, int64_t n, const void *w, size_t w_stride, int nw,
                            const void *x, size_t x_stride, int nx, float *out, size_t out_stride) {
    for (int j = 0; j < nx; j++)
        for (int i = 0; i < nw; i++)
            out[(size_t)j * out_stride + (size_t)i] =
                scalar_dot_row(t, n, (const uint8_t *)w + (size_t)i * w_stride,
                               (const uint8_t *)x + (size_t)j * x_stride);
}

#define SCALAR_DOT_TILE(T, NAME)                                                                   \
    static void scalar_dot_tile_##NAME(int64_t n, const void *w, size_t ws, int nw, const void *x, \
                                       size_t xs, int nx, float *out, size_t os) {                 \
        scalar_dot_tile(T, n, w, ws, nw, x, xs, nx, out, os);                                      \
    }
SCALAR_DOT_TILE(TENSOR_TYPE_F32, f32)
SCALAR_DOT_TILE(TENSOR_TYPE_F16, f16)
SCALAR_DOT_TILE(TENSOR_TYPE_BF16, bf16)
SCALAR_DOT_TILE(TENSOR_TYPE_Q4_0, q4_0)
SCALAR_DOT_TILE(TENSOR_TYPE_Q4_1, q4_1)
SCALAR_DOT_TILE(TENSOR_TYPE_Q5_0, q5_0)
SCALAR_DOT_TILE(TENSOR_TYPE_Q5_1, q5_1)
SCALAR_DOT_TILE(TENSOR_TYPE_Q8_0, q8_0)
SCALAR_DOT_TILE(TENSOR_TYPE_Q4_K, q4_K)
SCALAR_DOT_TILE(TENSOR_TYPE_Q5_K, q5_K)
SCALAR_DOT_TILE(TENSOR_TYPE_Q6_K, q6_K)
SCALAR_DOT_TILE(TENSOR_TYPE_Q4_0_L16, q4_0_l16)
SCALAR_DOT_TILE(TENSOR_TYPE_Q4_1_L16, q4_1_l16)
SCALAR_DOT_TILE(TENSOR_TYPE_Q8_0_L16, q8_0_l16)

/* A lane-order row: each full group back into GGUF blocks, then the GGUF type's dequantize at
 * the level in use (the embedding lookup, matmul's f32 precision). */
static void dequantize_l16(tensor_type t, const uint8_t *src, float *dst, int64_t n) {
    const tensor_type base = quant_lanes_base(t);
    l16_geometry g = {0};
    if (!l16_geometry_of(base, &g)) return;
    const int64_t nb = n / QK32;
    for (int64_t b0 = 0, k; b0 < nb; b0 += k, src += (size_t)g.block_bytes * (size_t)k) {
        k = act32_group_blocks(nb - b0);
        uint8_t gguf[L16_GROUP_BLOCKS * 34];
        if (k == L16_GROUP_BLOCKS)
            l16_unpack_group(&g, src, gguf);
        else if (k >= 2)
            l16_unpack_tail(&g, (int)k, src, gguf);
        else
            memcpy(gguf, src, (size_t)g.block_bytes);
        dequantize_row(base, gguf, dst + QK32 * b0, QK32 * k);
    }
}

#define SCALAR_DEQUANTIZE_L16(T, NAME)                                                             \
    static void scalar_dequantize_##NAME(const void *src, float *dst, int64_t n) {                 \
        dequantize_l16(T, src, dst, n);                                                            \
    }
SCALAR_DEQUANTIZE_L16(TENSOR_TYPE_Q4_0_L16, q4_0_l16)
SCALAR_DEQUANTIZE_L16(TENSOR_TYPE_Q4_1_L16, q4_1_l16)
SCALAR_DEQUANTIZE_L16(TENSOR_TYPE_Q8_0_L16, q8_0_l16)

const quant_kernels quant_kernels_scalar = {
    .dequantize =
        {
            [TENSOR_TYPE_F32] = scalar_dequantize_f32,
            [TENSOR_TYPE_F16] = scalar_dequantize_f16,
            [TENSOR_TYPE_BF16] = scalar_dequantize_bf16,
            [TENSOR_TYPE_Q4_0] = scalar_dequantize_q4_0,
            [TENSOR_TYPE_Q4_1] = scalar_dequantize_q4_1,
            [TENSOR_TYPE_Q5_0] = scalar_dequantize_q5_0,
            [TENSOR_TYPE_Q5_1] = scalar_dequantize_q5_1,
            [TENSOR_TYPE_Q8_0] = scalar_dequantize_q8_0,
            [TENSOR_TYPE_Q4_K] = scalar_dequantize_q4_K,
            [TENSOR_TYPE_Q5_K] = scalar_dequantize_q5_K,
            [TENSOR_TYPE_Q6_K] = scalar_dequantize_q6_K,
            [TENSOR_TYPE_Q4_0_L16] = scalar_dequantize_q4_0_l16,
            [TENSOR_TYPE_Q4_1_L16] = scalar_dequantize_q4_1_l16,
            [TENSOR_TYPE_Q8_0_L16] = scalar_dequantize_q8_0_l16,
        },
    .quantize_act =
        {
            [TENSOR_TYPE_F32] = scalar_quantize_f32,
            [TENSOR_TYPE_F16] = scalar_quantize_f16,
            [TENSOR_TYPE_Q8_0] = scalar_quantize_q8_0,
            [TENSOR_TYPE_Q8_1] = scalar_quantize_q8_1,
            [TENSOR_TYPE_Q8_K] = scalar_quantize_q8_K,
        },
    .dot_tile =
        {
            [TENSOR_TYPE_F32] = scalar_dot_tile_f32,
            [TENSOR_TYPE_F16] = scalar_dot_tile_f16,
            [TENSOR_TYPE_BF16] = scalar_dot_tile_bf16,
            [TENSOR_TYPE_Q4_0] = scalar_dot_tile_q4_0,
            [TENSOR_TYPE_Q4_1] = scalar_dot_tile_q4_1,
            [TENSOR_TYPE_Q5_0] = scalar_dot_tile_q5_0,
            [TENSOR_TYPE_Q5_1] = scalar_dot_tile_q5_1,
            [TENSOR_TYPE_Q8_0] = scalar_dot_tile_q8_0,
            [TENSOR_TYPE_Q4_K] = scalar_dot_tile_q4_K,
            [TENSOR_TYPE_Q5_K] = scalar_dot_tile_q5_K,
            [TENSOR_TYPE_Q6_K] = scalar_dot_tile_q6_K,
            [TENSOR_TYPE_Q4_0_L16] = scalar_dot_tile_q4_0_l16,
            [TENSOR_TYPE_Q4_1_L16] = scalar_dot_tile_q4_1_l16,
            [TENSOR_TYPE_Q8_0_L16] = scalar_dot_tile_q8_0_l16,
        },
    .fp16_to_fp32_row = scalar_fp16_to_fp32_row,
    .fp32_to_fp16_row = scalar_fp32_to_fp16_row,
};

/* ---------------------------------------------------------------- dequantize (activations) */

void dequantize_row_act(tensor_type act_type, const void *src, float *dst, int64_t n) {
    const uint8_t *x = src;
    switch (act_type) {
    case TENSOR_TYPE_Q8_1: {
        const int64_t nb = n / QK32;
        for (int64_t b0 = 0, g; b0 < nb; b0 += g) {
            g = act32_group_blocks(nb - b0);
            for (int k = 0; k < (int)g; k++) {
                int8_t xq[32];
                float dx;
                int xsum;
                act32_read_block(x + ACT32_BLOCK_BYTES * b0, (int)g, k, xq, &dx, &xsum);
                for (int e = 0; e < 32; e++) dst[QK32 * (b0 + k) + e] = dx * (float)xq[e];
            }
        }
        break;
    }
    case TENSOR_TYPE_Q8_K:
        for (int64_t i = 0; i < n / QK_K; i++, x += ACTK_BLOCK_BYTES, dst += QK_K) {
            const float d = rdf32(x + ACTK_D_OFFSET);
            for (int e = 0; e < QK_K; e++) dst[e] = d * (float)(int8_t)x[actk_qs_offset(e)];
        }
        break;
    default: /* F32, F16, Q8_0 are stored as the weight types are */
        dequantize_row(act_type, src, dst, n);
        break;
    }
}

/* ---------------------------------------------------------------- SIMD level and dispatch */

/* The one mutable global of the kernels: the SIMD level the dispatching routines use, -1 until
 * the first call detects it. Written by simd_level_set (tests, benchmarks) before compute
 * starts; atomic so that the lazy first detection may race harmlessly between threads. */
static _Atomic int g_simd_level = -1;

simd_level simd_level_detect(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2")))
        return SIMD_LEVEL_SCALAR;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
        return SIMD_LEVEL_AVX512;
    return SIMD_LEVEL_AVX2;
}

simd_level simd_level_get(void) {
    int l = atomic_load_explicit(&g_simd_level, memory_order_relaxed);
    if (l < 0) {
        l = (int)simd_level_detect();
        atomic_store_explicit(&g_simd_level, l, memory_order_relaxed);
    }
    return (simd_level)l;
}

simd_level simd_level_set(simd_level level) {
    simd_level max = simd_level_detect();
    if ((int)level < 0) level = SIMD_LEVEL_SCALAR;
    if (level > max) level = max;
    atomic_store_explicit(&g_simd_level, (int)level, memory_order_relaxed);
    return level;
}

const char *simd_level_name(simd_level level) {
    switch (level) {
    case SIMD_LEVEL_SCALAR:
        return "scalar";
    case SIMD_LEVEL_AVX2:
        return "avx2";
    case SIMD_LEVEL_AVX512:
        return "avx512";
    }
    return "unknown";
}

int simd_level_from_name(const char *name, simd_level *out) {
    if (!name) return -1;
    if (!strcmp(name, "auto")) {
        *out = simd_level_detect();
        return 0;
    }
    for (int l = SIMD_LEVEL_SCALAR; l <= SIMD_LEVEL_AVX512; l++)
        if (!strcmp(name, simd_level_name((simd_level)l))) {
            *out = (simd_level)l;
            return 0;
        }
    return -1;
}

static const quant_kernels *const LEVEL_KERNELS[] = {
    [SIMD_LEVEL_SCALAR] = &quant_kernels_scalar,
    [SIMD_LEVEL_AVX2] = &quant_kernels_avx2,
    [SIMD_LEVEL_AVX512] = &quant_kernels_avx512,
};

/* The highest-level table at or below the level in use with a non-NULL entry (the scalar table
 * is complete for every type the traits mark supported). */
#define QUANT_RESOLVE(field)                                                                       \
    for (int l = (int)simd_level_get(); l >= 0; l--)                                               \
        if (LEVEL_KERNELS[l]->field) return LEVEL_KERNELS[l]->field;                               \
    return NULL

static quant_dequantize_fn resolve_dequantize(tensor_type t) { QUANT_RESOLVE(dequantize[t]); }
static quant_quantize_fn resolve_quantize(tensor_type t) { QUANT_RESOLVE(quantize_act[t]); }
static quant_dot_tile_fn resolve_dot_tile(tensor_type t) { QUANT_RESOLVE(dot_tile[t]); }

static int valid_type(tensor_type t) { return (int)t >= 0 && (int)t < TENSOR_TYPE_COUNT; }

void dequantize_row(tensor_type t, const void *src, float *dst, int64_t n) {
    quant_dequantize_fn f = valid_type(t) ? resolve_dequantize(t) : NULL;
    if (f) f(src, dst, n);
}

void quantize_row_act(tensor_type act_type, const float *src, void *dst, int64_t n) {
    quant_quantize_fn f = valid_type(act_type) ? resolve_quantize(act_type) : NULL;
    if (f) f(src, dst, n);
}

void dot_tile(tensor_type wt, int64_t n, const void *w, size_t w_stride, int nw, const void *x,
              size_t x_stride, int nx, float *out, size_t out_stride) {
    quant_dot_tile_fn f = valid_type(wt) ? resolve_dot_tile(wt) : NULL;
    if (f) f(n, w, w_stride, nw, x, x_stride, nx, out, out_stride);
}

/* ---------------------------------------------------------------- lane-order repacking */

tensor_type quant_lanes_base(tensor_type t) {
    switch (t) {
    case TENSOR_TYPE_Q4_0_L16:
        return TENSOR_TYPE_Q4_0;
    case TENSOR_TYPE_Q4_1_L16:
        return TENSOR_TYPE_Q4_1;
    case TENSOR_TYPE_Q8_0_L16:
        return TENSOR_TYPE_Q8_0;
    default:
        return t;
    }
}

static tensor_type lanes_twin(tensor_type t) {
    switch (t) {
    case TENSOR_TYPE_Q4_0:
        return TENSOR_TYPE_Q4_0_L16;
    case TENSOR_TYPE_Q4_1:
        return TENSOR_TYPE_Q4_1_L16;
    case TENSOR_TYPE_Q8_0:
        return TENSOR_TYPE_Q8_0_L16;
    default:
        return t;
    }
}

tensor_type quant_lanes_type(tensor_type t) {
    const tensor_type twin = lanes_twin(t);
    /* only where a SIMD level has the twin's tiles: the scalar ones unpack each group again */
    if (twin == t || simd_level_get() == SIMD_LEVEL_SCALAR) return t;
    return twin;
}

int quant_repack_lanes(tensor_type t, const void *src, void *dst, int64_t n_in, int64_t n_rows,
                       size_t row_bytes) {
    l16_geometry g = {0};
    if (lanes_twin(t) == t || !l16_geometry_of(t, &g) || n_in % QK32) return -1;
    const int64_t nb = n_in / QK32;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *s = (const uint8_t *)src + (size_t)r * row_bytes;
        uint8_t *d = (uint8_t *)dst + (size_t)r * row_bytes;
        for (int64_t b0 = 0, k; b0 < nb; b0 += k) {
            k = act32_group_blocks(nb - b0);
            const size_t at = (size_t)g.block_bytes * (size_t)b0;
            if (k == L16_GROUP_BLOCKS)
                l16_pack_group(&g, s + at, d + at);
            else if (k >= 2)
                l16_pack_tail(&g, (int)k, s + at, d + at);
            else
                memcpy(d + at, s + at, (size_t)g.block_bytes);
        }
    }
    return 0;
}

void fp16_to_fp32_row(const uint16_t *src, float *dst, int64_t n) {
    for (int l = (int)simd_level_get(); l >= 0; l--)
        if (LEVEL_KERNELS[l]->fp16_to_fp32_row) {
            LEVEL_KERNELS[l]->fp16_to_fp32_row(src, dst, n);
            return;
        }
}

void fp32_to_fp16_row(const float *src, uint16_t *dst, int64_t n) {
    for (int l = (int)simd_level_get(); l >= 0; l--)
        if (LEVEL_KERNELS[l]->fp32_to_fp16_row) {
            LEVEL_KERNELS[l]->fp32_to_fp16_row(src, dst, n);
            return;
        }
}
