/* Quantized tensor formats (GGML block layouts as GGUF stores them) and the CPU routines over
 * them: per-type traits, dequantization, activation quantization and dot-product tiles.
 * Part of the kernels/ contract (included by kernels/backend.h).
 *
 * Layout: a weight matrix W of GGUF shape [ne0 = n_in, ne1 = n_out] is n_out rows, each row
 * n_in elements stored as n_in / block_size consecutive blocks of type_size bytes. */
#ifndef KVSERVE_QUANT_H
#define KVSERVE_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Values are GGML's type ids, as written in GGUF tensor infos. */
typedef enum tensor_type {
    TENSOR_TYPE_F32 = 0,
    TENSOR_TYPE_F16 = 1,
    TENSOR_TYPE_Q4_0 = 2,
    TENSOR_TYPE_Q4_1 = 3,
    TENSOR_TYPE_Q5_0 = 6,
    TENSOR_TYPE_Q5_1 = 7,
    TENSOR_TYPE_Q8_0 = 8,
    TENSOR_TYPE_Q8_1 = 9, /* activations only */
    TENSOR_TYPE_Q4_K = 12,
    TENSOR_TYPE_Q5_K = 13,
    TENSOR_TYPE_Q6_K = 14,
    TENSOR_TYPE_Q8_K = 15, /* activations only */
    TENSOR_TYPE_BF16 = 30,
    /* kvserve's own layouts, never read from a file (tensor_type_traits.internal): a 32-element
     * type's rows with each group of 16 blocks repacked into the CPU dot tiles' lane order at
     * load (quant_repack_lanes). The ids lie far from GGML's. */
    TENSOR_TYPE_Q4_0_L16 = 64,
    TENSOR_TYPE_Q4_1_L16 = 65,
    TENSOR_TYPE_Q8_0_L16 = 66,
    TENSOR_TYPE_COUNT = 67,
} tensor_type;

typedef struct tensor_type_traits {
    const char *name;      /* "Q4_1" */
    int block_size;        /* elements per block */
    size_t type_size;      /* bytes per block */
    bool weight_supported; /* usable as a weight type by matmul */
    tensor_type act_type;  /* the format activations are converted to for dot products */
    bool internal;         /* a kvserve layout (the *_L16 types): a GGUF file never has it */
} tensor_type_traits;

/* NULL for ids GGUF may hold that kvserve does not support (unknown or e.g. Q2_K). */
const tensor_type_traits *tensor_type_get(int type_id);

/* Bytes of a row of n elements, or 0 when n is not a multiple of the block size. */
size_t tensor_row_size(tensor_type t, int64_t n);

/* ---------------------------------------------------------------- SIMD level */

/* The instruction set the dispatching routines use. Chosen once from CPUID at first use; tests
 * may force a lower level to check every variant against the scalar reference. */
typedef enum simd_level {
    SIMD_LEVEL_SCALAR = 0,
    SIMD_LEVEL_AVX2 = 1,   /* AVX2 + FMA + F16C */
    SIMD_LEVEL_AVX512 = 2, /* AVX-512 F/BW/VL/DQ + VNNI */
} simd_level;

simd_level simd_level_detect(void); /* what the CPU supports */
simd_level simd_level_get(void);    /* what is in use */
/* Forces a level (clamped to what the CPU supports); returns the level now in use. Not thread
 * safe: call before starting compute. */
simd_level simd_level_set(simd_level level);
const char *simd_level_name(simd_level level);
/* "scalar", "avx2", "avx512", or "auto" (what the CPU supports); -1 for any other name. */
int simd_level_from_name(const char *name, simd_level *out);

/* ---------------------------------------------------------------- conversions */

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f); /* round to nearest even */
float bf16_to_fp32(uint16_t h);
void fp16_to_fp32_row(const uint16_t *src, float *dst, int64_t n);
void fp32_to_fp16_row(const float *src, uint16_t *dst, int64_t n);

/* ---------------------------------------------------------------- rows */

/* dst[0..n) = dequantized src row; n a multiple of the block size. Any weight type; src 2-byte
 * aligned (as GGUF tensor data is). Bit-identical to GGML's dequantize_row_* at every level. */
void dequantize_row(tensor_type t, const void *src, float *dst, int64_t n);

/* Converts an f32 activation row to act_type (Q8_0, Q8_1, Q8_K, or F32/F16 as the weight type's
 * traits say); dst holds tensor_row_size(act_type, n) bytes. Q8_0 rows are GGML's block_q8_0.
 * Q8_1 and Q8_K rows have GGML's sizes and precision (8-bit values, one scale per 32 / 256) but
 * an interleaved byte order that the CPU dot tiles read directly (kernels/cpu/quant_impl.h):
 * treat them as opaque, produced by this function and read by dot_tile / dequantize_row_act.
 * The result is the same at every SIMD level. */
void quantize_row_act(tensor_type act_type, const float *src, void *dst, int64_t n);

/* dst[0..n) = the values a quantize_row_act row stands for (tests, checking other backends). */
void dequantize_row_act(tensor_type act_type, const void *src, float *dst, int64_t n);

/* ---------------------------------------------------------------- lane-order repacking
 *
 * Decode reads every weight once per token, and a one-row tile pays alone for bringing a Q4_0,
 * Q4_1 or Q8_0 row into the act32 lane order (kernels/cpu/quant_impl.h) with shuffles. Repacked
 * once at load, a group of 16 blocks is already in that order, and the tiles only load it. The
 * row keeps its size and every block's values; each full group of 16 blocks becomes
 *   d[16] (fp16, lane order), m[16] (Q4_1 only), then the codes as rows of 16 lane dwords:
 *   Q4_0 / Q4_1: 4 rows, lane p of row t = qs dword t of block sigma(p) (low nibbles: elements
 *   4t..4t+3, high: 16+4t..); Q8_0: 8 rows, lane p of row r = qs dword r of block sigma(p).
 * A row's remainder groups (8, 4, 2 blocks) are repacked in their own lane order
 * (kernels/cpu/quant_impl.h, l16_pack_tail); a last single block stays as GGUF has it. A repacked
 * row's dot products are bit for bit its GGUF row's, at every SIMD level, tile shape and row
 * count. */

/* The lane-order twin of t where the SIMD level in use has tiles for it (AVX2, AVX-512), else
 * t itself. */
tensor_type quant_lanes_type(tensor_type t);
/* The GGUF type a *_L16 type repacks; t itself for any other type. */
tensor_type quant_lanes_base(tensor_type t);
/* Repacks n_rows rows of n_in elements of base type t (row i at src + i * row_bytes) into dst
 * (same size and stride, not overlapping src) as quant_lanes_type(t) lays them out; -1 when t
 * has no lane twin. */
int quant_repack_lanes(tensor_type t, const void *src, void *dst, int64_t n_in, int64_t n_rows,
                       size_t row_bytes);

/* ---------------------------------------------------------------- dot tiles */

#define DOT_TILE_MAX_W 4
#define DOT_TILE_MAX_X 4

/* The inner kernel of matmul. For i < nw weight rows and j < nx activation rows:
 *   out[j * out_stride + i] = dot(W row i, X row j)
 * W rows are at w + i * w_stride in weight type wt; X rows at x + j * x_stride in
 * tensor_type_get(wt)->act_type (already converted by quantize_row_act). n = elements per row.
 * 1 <= nw <= DOT_TILE_MAX_W, 1 <= nx <= DOT_TILE_MAX_X. Rows may have any alignment and stride.
 * Matmul use: for each tile of 4 weight rows, every tile of 4 activation rows (the weight tile is
 * transposed into the kernel's lane order once per call, so the larger nx the better). */
void dot_tile(tensor_type wt, int64_t n, const void *w, size_t w_stride, int nw, const void *x,
              size_t x_stride, int nx, float *out, size_t out_stride);

#ifdef __cplusplus
}
#endif

#endif
