/* Chunk payload encodings (cache/codec/chunk_codec.h): the pool's f16 blocks to the codec's
 * [layer][kv][token][channel] f32 order and back, around codec_quant.h's uniform baseline and
 * codec.h's bitstream. */
#include <stdio.h>
#include <string.h>

#include "cache/codec/chunk_codec.h"
#include "kernels/quant.h"

_Static_assert(CACHE_ENC_MAX == CACHE_ENC_CODEC + CODEC_MAX_LEVELS, "one id per codec level");

int cache_enc_count(const codec_table *t) { return CACHE_ENC_CODEC + (t ? t->n_levels : 0); }

int cache_enc_check_table(const cache_layout *l, const codec_table *t, kv_error *err) {
    if (!t) return 0;
    if (memcmp(t->model_id, l->model_id, 32) != 0)
        return kv_fail(err, "the codec table was calibrated for another model");
    if (t->n_layer != l->n_layer || t->n_chan != l->n_kv_head * l->head_dim)
        return kv_fail(err,
                       "the codec table codes %d layers of %d channels, the model has %d of %d",
                       t->n_layer, t->n_chan, l->n_layer, l->n_kv_head * l->head_dim);
    if (!codec_encode_bound(t, l->chunk_tokens))
        return kv_fail(err, "the codec table cannot code chunks of %d tokens", l->chunk_tokens);
    return 0;
}

size_t cache_enc_scratch_floats(const cache_layout *l) {
    return (size_t)l->n_layer * 2 * (size_t)l->chunk_tokens * (size_t)l->n_kv_head *
           (size_t)l->head_dim;
}

static codec_shape shape_of(const cache_layout *l, int n_blocks) {
    return (codec_shape){.n_layer = l->n_layer,
                         .n_tok = n_blocks * l->block_tokens,
                         .n_chan = l->n_kv_head * l->head_dim};
}

size_t cache_enc_bound(const cache_layout *l, const codec_table *t, int enc, int n_blocks) {
    if (n_blocks < 1 || n_blocks > cache_chunk_blocks(l)) return 0;
    codec_shape sh = shape_of(l, n_blocks);
    if (enc == CACHE_ENC_RAW) return cache_block_bytes(l) * (size_t)n_blocks;
    if (enc == CACHE_ENC_Q8) return codec_uniform_bytes(&sh, 8);
    if (!t || enc < CACHE_ENC_CODEC || enc >= cache_enc_count(t)) return 0;
    return codec_encode_bound(t, sh.n_tok);
}

/* The pool blocks (kernels/backend.h's layout: per block [layer][kv][head] regions, a K region
 * [head_dim][block_tokens] (transposed), a V region [block_tokens][head_dim], f16) as x [layer]
 * [kv][token][head * head_dim + dim] f32, and back. Rows go through the vectorized row
 * converters: a V region's token rows directly, a K region's dim rows through a gather. */
#define CHUNK_CODEC_MAX_BT 4096 /* block tokens at most (cache_layout_check: a chunk's) */

static void blocks_to_f32(const cache_layout *l, const cache_chunk *c, float *x) {
    int bt = l->block_tokens, hd = l->head_dim, nh = l->n_kv_head, nc = nh * hd;
    int n_tok = c->n_blocks * bt;
    size_t bb = cache_block_bytes(l);
    float row[CHUNK_CODEC_MAX_BT];
    for (int b = 0; b < c->n_blocks; b++) {
        const uint16_t *blk = (const uint16_t *)(const void *)(c->data + (size_t)b * bb);
        for (int ly = 0; ly < l->n_layer; ly++)
            for (int kv = 0; kv < 2; kv++)
                for (int h = 0; h < nh; h++) {
                    const uint16_t *reg = blk + (((size_t)ly * 2 + kv) * nh + h) * bt * hd;
                    float *dst =
                        x + (((size_t)ly * 2 + kv) * n_tok + (size_t)b * bt) * nc + (size_t)h * hd;
                    if (kv == 1) {
                        for (int t = 0; t < bt; t++)
                            fp16_to_fp32_row(reg + (size_t)t * hd, dst + (size_t)t * nc, hd);
                        continue;
                    }
                    for (int d = 0; d < hd; d++) {
                        fp16_to_fp32_row(reg + (size_t)d * bt, row, bt);
                        for (int t = 0; t < bt; t++) dst[(size_t)t * nc + d] = row[t];
                    }
                }
    }
}

static void f32_to_blocks(const cache_layout *l, const float *x, cache_chunk *c) {
    int bt = l->block_tokens, hd = l->head_dim, nh = l->n_kv_head, nc = nh * hd;
    int n_tok = c->n_blocks * bt;
    size_t bb = cache_block_bytes(l);
    float row[CHUNK_CODEC_MAX_BT];
    for (int b = 0; b < c->n_blocks; b++) {
        uint16_t *blk = (uint16_t *)(void *)(c->data + (size_t)b * bb);
        for (int ly = 0; ly < l->n_layer; ly++)
            for (int kv = 0; kv < 2; kv++)
                for (int h = 0; h < nh; h++) {
                    uint16_t *reg = blk + (((size_t)ly * 2 + kv) * nh + h) * bt * hd;
                    const float *src =
                        x + (((size_t)ly * 2 + kv) * n_tok + (size_t)b * bt) * nc + (size_t)h * hd;
                    if (kv == 1) {
                        for (int t = 0; t < bt; t++)
                            fp32_to_fp16_row(src + (size_t)t * nc, reg + (size_t)t * hd, hd);
                        continue;
                    }
                    for (int d = 0; d < hd; d++) {
                        for (int t = 0; t < bt; t++) row[t] = src[(size_t)t * nc + d];
                        fp32_to_fp16_row(row, reg + (size_t)d * bt, bt);
                    }
                }
    }
}

void cache_enc_from_f32(const cache_layout *l, const float *x, cache_chunk *c) {
    f32_to_blocks(l, x, c);
}

int64_t cache_enc_encode(const cache_layout *l, const codec_table *t, int enc, const cache_chunk *c,
                         float *scratch, uint8_t *out, size_t cap, kv_error *err) {
    size_t bound = cache_enc_bound(l, t, enc, c->n_blocks);
    if (!bound) return kv_fail(err, "encoding %d is not available", enc);
    if (enc == CACHE_ENC_RAW) {
        if (cap < c->bytes) return kv_fail(err, "encode buffer too small");
        memcpy(out, c->data, c->bytes);
        return (int64_t)c->bytes;
    }
    codec_shape sh = shape_of(l, c->n_blocks);
    blocks_to_f32(l, c, scratch);
    if (enc == CACHE_ENC_Q8) {
        if (cap < bound) return kv_fail(err, "encode buffer too small");
        return codec_uniform_encode(scratch, &sh, 8, out, err) ? -1 : (int64_t)bound;
    }
    return codec_encode_chunk(t, enc - CACHE_ENC_CODEC, scratch, sh.n_tok, c->pos0, out, cap, err);
}

int cache_enc_decode(const cache_layout *l, const codec_table *t, int enc, const uint8_t *in,
                     size_t len, cache_chunk *c, float *scratch, int n_threads, kv_error *err) {
    if (!cache_enc_bound(l, t, enc, c->n_blocks))
        return kv_fail(err, "encoding %d is not available here", enc);
    if (enc == CACHE_ENC_RAW) {
        if (len != c->bytes)
            return kv_fail(err, "lossless payload of %zu bytes, expected %zu", len, c->bytes);
        memcpy(c->data, in, len);
        return 0;
    }
    codec_shape sh = shape_of(l, c->n_blocks);
    if (enc == CACHE_ENC_Q8) {
        if (codec_uniform_decode(in, len, &sh, 8, scratch, err)) return -1;
    } else {
        codec_stream_info info;
        if (codec_stream_info_get(t, in, len, &info, err)) return -1;
        if (info.level != enc - CACHE_ENC_CODEC || info.n_tok != sh.n_tok || info.pos0 != c->pos0)
            return kv_fail(err,
                           "bitstream of level %d, %d tokens at %d; the record says level %d, "
                           "%d tokens at %d",
                           info.level, info.n_tok, (int)info.pos0, enc - CACHE_ENC_CODEC, sh.n_tok,
                           (int)c->pos0);
        if (codec_decode_chunk(t, in, len, scratch, n_threads, err)) return -1;
    }
    f32_to_blocks(l, scratch, c);
    return 0;
}
