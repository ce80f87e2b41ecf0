/* The quantization stage of the CacheGen codec (Liu et al., SIGCOMM'24, section 5.1): a chunk's
 * KV becomes small integer symbols for the entropy coder, and back.
 *
 * Tokens are taken in groups: the group's first token (the anchor) is quantized on its own, the
 * others as their difference from the anchor's reconstruction, which is small because nearby
 * tokens' KV is similar (the paper's "token-wise locality"). Group 0 has no anchors: every token
 * is a delta to its channel's centre (calibration mean), which on SmolLM2 codes in fewer bits
 * (its tokens' KV is not close enough to its neighbours' to beat the channel's own
 * distribution). Bins are in units of each channel's scale (its step unit from calibration) and
 * may differ by layer and K/V (the paper's "layer-wise sensitivity"). A level is one set of
 * bins.
 *
 * Every element's reconstruction error is at most half its bin times its channel's scale, or 0
 * for an escaped element (an out-of-range symbol: its exact f16 value travels on the side). */
#ifndef KVSERVE_CODEC_QUANT_H
#define KVSERVE_CODEC_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

#define CODEC_MAX_LAYERS 256

/* Delta symbols: q in [-CODEC_DELTA_RADIUS, CODEC_DELTA_RADIUS] as q + radius, and an escape. */
#define CODEC_DELTA_RADIUS 31
#define CODEC_DELTA_SYMBOLS (2 * CODEC_DELTA_RADIUS + 2)
#define CODEC_DELTA_ESCAPE (2 * CODEC_DELTA_RADIUS + 1)
/* Anchor symbols: q in [-127, 127] as q + 127, and an escape. */
#define CODEC_ANCHOR_RADIUS 127
#define CODEC_ANCHOR_SYMBOLS (2 * CODEC_ANCHOR_RADIUS + 2)
#define CODEC_ANCHOR_ESCAPE (2 * CODEC_ANCHOR_RADIUS + 1)

/* A chunk: x[layer][kv][token][channel] f32 (kv 0 = K, 1 = V; channel = head * head_dim + d). */
typedef struct codec_shape {
    int n_layer;
    int n_tok;
    int n_chan;
} codec_shape;

typedef struct codec_level {
    int group; /* tokens per group: an anchor and group-1 deltas; 0: no anchors, every token is
                  a delta to its channel's calibration centre */
    float anchor_bin[CODEC_MAX_LAYERS][2]; /* per layer, K and V, in channel-scale units */
    float delta_bin[CODEC_MAX_LAYERS][2];
} codec_level;

/* Elements of a chunk (n_layer * 2 * n_tok * n_chan), or -1 on overflow or a bad shape. */
int64_t codec_shape_elems(const codec_shape *sh);

/* Whether token t is its group's anchor (never, for group 0). */
static inline int codec_is_anchor(int t, int group) { return group > 0 && t % group == 0; }

/* Quantizes x into one symbol per element, in x's order. Escaped elements append their f16
 * bits to esc (which holds up to esc_cap, at most one per element). scale: [n_layer][2][n_chan],
 * every entry > 0; center: the same shape, the prediction of deltas before any anchor (all of
 * them with group 0), or NULL for zeros. Tokens t with exact[t] != 0 are escaped whole (kept
 * exact: tokens that take a large share of every query's attention, whose error costs more than
 * their bits; the codec's choice, see codec.c), exact NULL for none. Returns the escape count,
 * or -1 with err (bad shape, level or scale). */
int64_t codec_quantize(const float *x, const codec_shape *sh, const float *scale,
                       const float *center, const codec_level *lv, const uint8_t *exact,
                       uint8_t *sym, uint16_t *esc, size_t esc_cap, kv_error *err);

/* The inverse: x from symbols and escapes. Never trusts its input: a symbol outside its
 * alphabet, more escape symbols than n_esc escapes (or fewer used than given), a bad shape or
 * level is an error. */
int codec_dequantize(const uint8_t *sym, const uint16_t *esc, size_t n_esc, const codec_shape *sh,
                     const float *scale, const float *center, const codec_level *lv, float *x,
                     kv_error *err);

/* The bound codec_dequantize(codec_quantize(x)) keeps for element (layer, kv, token, channel). */
float codec_error_bound(const codec_shape *sh, const float *scale, const codec_level *lv, int layer,
                        int kv, int token, int chan);

/* ---------------------------------------------------------------- baselines */

/* Per-token uniform quantization, the paper's baseline: every (layer, kv, token) row of n_chan
 * values is stored as bits-bit codes between its min and max (f16 min and step per row).
 * bits: 16 (plain fp16, no codes), 8 or 4. Bytes per chunk: */
size_t codec_uniform_bytes(const codec_shape *sh, int bits);
/* Encodes into out (codec_uniform_bytes bytes) and decodes back; -1 with err on bad input. */
int codec_uniform_encode(const float *x, const codec_shape *sh, int bits, uint8_t *out,
                         kv_error *err);
int codec_uniform_decode(const uint8_t *in, size_t len, const codec_shape *sh, int bits, float *x,
                         kv_error *err);

#endif
