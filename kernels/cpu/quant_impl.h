/* Internals of the CPU quantized kernels (kernels/cpu/quant*.c): GGML block structs, the
 * activation layouts the dot tiles read, and the per-SIMD-level function tables the dispatcher in
 * quant.c picks from. Not part of the kernels/ contract: only kernels/cpu/ and its tests include
 * this header.
 *
 * ---------------------------------------------------------------- why activations are interleaved
 *
 * A dot product over a quantized block is an exact integer sum followed by a float scale. Summing
 * in SIMD lanes and scaling each block on its own (GGML's way) costs, per block and per
 * (weight row, activation row) pair, a horizontal reduction or a convert + multiply + add on a
 * vector that holds a single block. Here instead one SIMD lane holds one block (or one 16-element
 * sub-block for K-quants): vpdpbusd accumulates a whole block inside a lane over several rows of
 * the interleaved data, and a single convert + multiply + fma then scales 16 blocks at once. The
 * weight rows, which stay in GGUF's layout, are transposed into that lane order once per tile
 * and reused for every activation row of the tile; the activation rows are quantized straight
 * into it (quantize_row_act), once per matmul.
 *
 * The activation rows keep the byte size of GGML's formats (tensor_row_size(act_type, n)), so the
 * callers size buffers the usual way; only their byte order differs. */
#ifndef KVSERVE_QUANT_IMPL_H
#define KVSERVE_QUANT_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/quant.h"

#define QK32 32  /* elements per block of Q4_0 .. Q8_1 */
#define QK_K 256 /* elements per K-quant super-block */

/* ---------------------------------------------------------------- GGML blocks
 * As in ggml/src/ggml-common.h; `uint16_t d` fields are IEEE fp16 bits, little endian. All
 * members have 1- or 2-byte alignment, so the structs have no padding and match the file. */

typedef struct block_q4_0 {
    uint16_t d;
    uint8_t qs[16]; /* element j: qs[j] & 15 (j < 16), qs[j - 16] >> 4 (j >= 16); value d*(q-8) */
} block_q4_0;

typedef struct block_q4_1 {
    uint16_t d, m;
    uint8_t qs[16]; /* as Q4_0; value d*q + m */
} block_q4_1;

typedef struct block_q5_0 {
    uint16_t d;
    uint8_t qh[4];  /* bit j (little-endian u32) = bit 4 of element j */
    uint8_t qs[16]; /* low 4 bits as Q4_0; value d*(q-16) */
} block_q5_0;

typedef struct block_q5_1 {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[16]; /* value d*q + m */
} block_q5_1;

typedef struct block_q8_0 {
    uint16_t d;
    int8_t qs[32]; /* value d*q */
} block_q8_0;

/* K-quants: 8 sub-blocks of 32 with 6-bit scale and min packed in scales[12]
 * (see quant_k4_scale_min); element value d*sc*q - dmin*m. qs[32c + l]: low nibble = element
 * 64c + l, high nibble = element 64c + 32 + l. */
typedef struct block_q4_K {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[QK_K / 2];
} block_q4_K;

/* As Q4_K, plus bit 4 of element 32s + l in bit s of qh[l]. */
typedef struct block_q5_K {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_K;

/* 16 sub-blocks of 16, int8 scales; value d*scales[e/16]*(q-32). For half h (128 elements) and
 * l < 32, with ql' = ql + 64h, qh' = qh + 32h, the elements 128h + l + 32k (k = 0..3) take
 * their low 4 bits from ql'[l + 32(k&1)] (low nibble for k < 2, high nibble otherwise) and their
 * 2 high bits from qh'[l] >> 2k. */
typedef struct block_q6_K {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_K;

_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 size");
_Static_assert(sizeof(block_q4_1) == 20, "block_q4_1 size");
_Static_assert(sizeof(block_q5_0) == 22, "block_q5_0 size");
_Static_assert(sizeof(block_q5_1) == 24, "block_q5_1 size");
_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 size");
_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K size");
_Static_assert(sizeof(block_q5_K) == 176, "block_q5_K size");
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K size");

/* Unpacks sub-block j's 6-bit scale and min from block_q4_K/q5_K scales[12]
 * (GGML's get_scale_min_k4). */
static inline void quant_k4_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* ---------------------------------------------------------------- Q8_1 activations ("act32")
 *
 * The activation format of every 32-element weight type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). Each
 * block of 32 is quantized as GGML's block_q8_1 is (d = amax/127 rounded to fp16, q = round(x/d)
 * in -127..127) and keeps its 36 bytes, but the blocks of a row are stored in groups: 16 blocks
 * per group while at least 16 remain, then one group each of 8, 4, 2 and 1 as the remainder's
 * binary digits say. A group of g blocks that starts at block b0 lies at byte 36*b0 and holds
 *   qs[32g]  int8, in R = max(g/2, 1) rows of min(32g, 64) bytes, one 4-byte lane per 4 elements
 *   d[g]     fp16 scales
 *   sum[g]   int16 sums of each block's 32 qs (GGML's Q8_1 keeps d*sum as fp16 instead)
 * In a group of 16, lane p of row r holds elements 4r..4r+3 of block act32_sigma(p), and d[p],
 * sum[p] belong to that block too (lane order). In a smaller group, lane p of row r holds
 * elements 4t..4t+3 of block p % g with t = r + R*(p / g), and d[k], sum[k] belong to block k;
 * every lane then covers a single block, which is all the dot tiles need. */

#define ACT32_BLOCK_BYTES 36

/* The lane order of a 16-block group: the order in which a 4x4 transpose inside 128-bit lanes
 * leaves 16 weight blocks loaded four to a register (see quant_avx512.c). An involution. */
static inline int act32_sigma(int p) { return 4 * (p % 4) + p / 4; }

/* Blocks in the group that starts with `remaining` blocks left in the row. */
static inline int act32_group_blocks(int64_t remaining) {
    if (remaining >= 16) return 16;
    if (remaining >= 8) return 8;
    if (remaining >= 4) return 4;
    if (remaining >= 2) return 2;
    return 1;
}

/* Rows of the group's qs, and the bytes of one row. */
static inline int act32_rows(int g) { return g >= 2 ? g / 2 : 1; }
static inline int act32_row_bytes(int g) { return g >= 2 ? 64 : 32; }

/* Byte offset inside the group's qs of element e (0..31) of the group's block k. */
static inline int act32_qs_offset(int g, int k, int e) {
    int t = e / 4;
    if (g == 16) return t * 64 + act32_sigma(k) * 4 + e % 4;
    int R = act32_rows(g);
    int r = t % R, p = k + g * (t / R);
    return r * act32_row_bytes(g) + p * 4 + e % 4;
}

/* Index into the group's d[] and sum[] of block k. */
static inline int act32_slot(int g, int k) { return g == 16 ? act32_sigma(k) : k; }

/* Stores block k of an act32 group: 32 int8 values in element order, fp16 scale bits, sum. */
static inline void act32_put_block(uint8_t *grp, int g, int k, const int8_t q[32], uint16_t dh,
                                   int sum) {
    if (g == 16) /* the common case, without act32_qs_offset's divisions */
        for (int t = 0; t < 8; t++) memcpy(grp + 64 * t + 4 * act32_sigma(k), q + 4 * t, 4);
    else
        for (int t = 0; t < 8; t++) memcpy(grp + act32_qs_offset(g, k, 4 * t), q + 4 * t, 4);
    const int slot = act32_slot(g, k);
    const int16_t s16 = (int16_t)sum;
    memcpy(grp + 32 * g + 2 * slot, &dh, 2);
    memcpy(grp + 34 * g + 2 * slot, &s16, 2);
}

/* ---------------------------------------------------------------- Q8_K activations ("actK")
 *
 * The activation format of the K-quants. Each super-block of 256 keeps GGML's block_q8_K size
 * (292 bytes) and quantization (float d = amax/127, q in -127..127) but stores
 *   qs[256]   int8 in 4 rows of 64 bytes: lane p of row r holds elements 4t..4t+3 of sub-block
 *             p % 8 (32 elements each) with t = r + 4*(p / 8), so lane p covers the 16 elements
 *             32*(p%8) + 16*(p/8) ..+15, which is Q6_K's sub-block 2*(p%8) + p/8
 *   d         float
 *   bsum[16]  int16 sum of lane p's 16 elements (lane order; GGML keeps them in element order) */

#define ACTK_BLOCK_BYTES 292
#define ACTK_D_OFFSET 256
#define ACTK_BSUM_OFFSET 260

static inline int actk_qs_offset(int e) {
    int s = e / 32, t = (e % 32) / 4;
    int r = t % 4, p = s + 8 * (t / 4);
    return r * 64 + p * 4 + e % 4;
}

/* The lane of element e (for bsum). */
static inline int actk_lane(int e) { return e / 32 + 8 * ((e % 32) / 16); }

/* Stores a super-block: 256 int8 values in element order and the scale. */
static inline void actk_put(uint8_t *blk, const int8_t q[QK_K], float d) {
    for (int p = 0; p < 16; p++) {
        const int e0 = 32 * (p % 8) + 16 * (p / 8);
        int sum = 0;
        for (int e = 0; e < 16; e++) sum += q[e0 + e];
        for (int r = 0; r < 4; r++) memcpy(blk + 64 * r + 4 * p, q + e0 + 4 * r, 4);
        const int16_t s16 = (int16_t)sum;
        memcpy(blk + ACTK_BSUM_OFFSET + 2 * p, &s16, 2);
    }
    memcpy(blk + ACTK_D_OFFSET, &d, 4);
}

/* ---------------------------------------------------------------- lane-order groups (*_L16)
 *
 * A repacked group of 16 blocks (kernels/quant.h): d[16] fp16 at 0, m[16] at 32 (Q4_1), then
 * its code rows of 64 bytes (lane p: 4 bytes of block act32_sigma(p)). Its size is 16 blocks'. */
#define L16_GROUP_BLOCKS 16
#define L16_ROW_BYTES 64

typedef struct l16_geometry {
    int block_bytes; /* the GGUF block */
    int qs_offset;   /* of the codes inside a GGUF block */
    bool has_min;    /* Q4_1: m[16] after d[16] */
    int code_rows;   /* 4 (nibbles: rows t and t + 4 of the act32 group) or 8 (Q8_0) */
} l16_geometry;

/* The geometry of a GGUF type that has a lane-order twin; 0 when it has none. */
static inline int l16_geometry_of(tensor_type base, l16_geometry *g) {
    switch (base) {
    case TENSOR_TYPE_Q4_0:
        *g = (l16_geometry){18, 2, false, 4};
        return 1;
    case TENSOR_TYPE_Q4_1:
        *g = (l16_geometry){20, 4, true, 4};
        return 1;
    case TENSOR_TYPE_Q8_0:
        *g = (l16_geometry){34, 2, false, 8};
        return 1;
    default:
        return 0;
    }
}

static inline int l16_codes_offset(const l16_geometry *g) { return g->has_min ? 64 : 32; }

/* One group of 16 GGUF blocks at src into lane order at dst. */
static inline void l16_pack_group(const l16_geometry *g, const uint8_t *src, uint8_t *dst) {
    const int codes = l16_codes_offset(g);
    for (int p = 0; p < L16_GROUP_BLOCKS; p++) {
        const uint8_t *blk = src + (size_t)g->block_bytes * (size_t)act32_sigma(p);
        memcpy(dst + 2 * p, blk, 2);
        if (g->has_min) memcpy(dst + 32 + 2 * p, blk + 2, 2);
        for (int t = 0; t < g->code_rows; t++)
            memcpy(dst + codes + L16_ROW_BYTES * t + 4 * p, blk + g->qs_offset + 4 * t, 4);
    }
}

/* The inverse: a lane-order group at src back into 16 GGUF blocks at dst. */
static inline void l16_unpack_group(const l16_geometry *g, const uint8_t *src, uint8_t *dst) {
    const int codes = l16_codes_offset(g);
    for (int p = 0; p < L16_GROUP_BLOCKS; p++) {
        uint8_t *blk = dst + (size_t)g->block_bytes * (size_t)act32_sigma(p);
        memcpy(blk, src + 2 * p, 2);
        if (g->has_min) memcpy(blk + 2, src + 32 + 2 * p, 2);
        for (int t = 0; t < g->code_rows; t++)
            memcpy(blk + g->qs_offset + 4 * t, src + codes + L16_ROW_BYTES * t + 4 * p, 4);
    }
}

/* A remainder group of nb = 8, 4 or 2 blocks in lane order (kernels/quant.h): d[nb] (fp16, block
 * order: lane p uses block p % nb), m[nb] (Q4_1), then act32_rows(nb) code rows, lane p of row r
 * holding element dword t = r + R*(p/nb) of block p % nb (quant_impl.h's act32 order). A 4-bit
 * row keeps its 8 lanes of half 0 (32 bytes, each qs dword t < 4, whose high nibbles are the
 * dword t + 4 of half 1's lanes); a Q8_0 row all 16 (64 bytes). Its size is nb blocks'. A group
 * of 1 block is already in lane order. */
static inline int l16_tail_row_bytes(const l16_geometry *g) { return g->code_rows == 8 ? 64 : 32; }

/* Where in the group's GGUF blocks the 4 bytes of code row r, lane k come from. */
static inline size_t l16_tail_offset(const l16_geometry *g, int nb, int r, int k) {
    const int t = r + act32_rows(nb) * (k / nb);
    return (size_t)g->block_bytes * (size_t)(k % nb) + (size_t)g->qs_offset + 4 * (size_t)t;
}

static inline void l16_pack_tail(const l16_geometry *g, int nb, const uint8_t *src, uint8_t *dst) {
    const int scales = g->has_min ? 4 * nb : 2 * nb, lanes = l16_tail_row_bytes(g) / 4;
    for (int k = 0; k < nb; k++) {
        memcpy(dst + 2 * k, src + (size_t)g->block_bytes * (size_t)k, 2);
        if (g->has_min)
            memcpy(dst + 2 * nb + 2 * k, src + (size_t)g->block_bytes * (size_t)k + 2, 2);
    }
    for (int r = 0; r < act32_rows(nb); r++)
        for (int k = 0; k < lanes; k++)
            memcpy(dst + scales + l16_tail_row_bytes(g) * r + 4 * k,
                   src + l16_tail_offset(g, nb, r, k), 4);
}

static inline void l16_unpack_tail(const l16_geometry *g, int nb, const uint8_t *src,
                                   uint8_t *dst) {
    const int scales = g->has_min ? 4 * nb : 2 * nb, lanes = l16_tail_row_bytes(g) / 4;
    for (int k = 0; k < nb; k++) {
        memcpy(dst + (size_t)g->block_bytes * (size_t)k, src + 2 * k, 2);
        if (g->has_min)
            memcpy(dst + (size_t)g->block_bytes * (size_t)k + 2, src + 2 * nb + 2 * k, 2);
    }
    for (int r = 0; r < act32_rows(nb); r++)
        for (int k = 0; k < lanes; k++)
            memcpy(dst + l16_tail_offset(g, nb, r, k),
                   src + scales + l16_tail_row_bytes(g) * r + 4 * k, 4);
}

/* ---------------------------------------------------------------- per-level function tables */

typedef void (*quant_dequantize_fn)(const void *src, float *dst, int64_t n);
typedef void (*quant_quantize_fn)(const float *src, void *dst, int64_t n);
typedef void (*quant_dot_tile_fn)(int64_t n, const void *w, size_t w_stride, int nw, const void *x,
                                  size_t x_stride, int nx, float *out, size_t out_stride);

/* What one SIMD level implements. A NULL entry falls back to the level below (scalar has all). */
typedef struct quant_kernels {
    quant_dequantize_fn dequantize[TENSOR_TYPE_COUNT];
    quant_quantize_fn quantize_act[TENSOR_TYPE_COUNT];
    quant_dot_tile_fn dot_tile[TENSOR_TYPE_COUNT];
    void (*fp16_to_fp32_row)(const uint16_t *src, float *dst, int64_t n);
    void (*fp32_to_fp16_row)(const float *src, uint16_t *dst, int64_t n);
} quant_kernels;

extern const quant_kernels quant_kernels_scalar; /* quant.c */
extern const quant_kernels quant_kernels_avx2;   /* quant_avx2.c */
extern const quant_kernels quant_kernels_avx512; /* quant_avx512.c */

#endif
