/* The chunk payload encodings of the Redis tier (cache/codec/chunk_codec.h): lossless is the
 * payload bit for bit; q8 is within half a step of each row (plus f16 rounding); every codec level
 * within the table's error bound; names round-trip; decoders refuse another table, position, shape
 * or length. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec/chunk_codec.h"
#include "kernels/quant.h"
#include "tests/unit/chunk_fixture.h"

/* 2 layers, 2 KV heads of 8, blocks of 16, chunks of 64. */
static cache_layout layout(void) {
    cache_layout l = {
        .n_layer = 2, .n_kv_head = 2, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 64};
    for (int i = 0; i < 32; i++) l.model_id[i] = (uint8_t)(7 + i);
    return l;
}

static cache_chunk *kv_chunk(const cache_layout *l, int n_blocks, int32_t pos0, uint64_t seed) {
    cache_key ns = {{0}};
    cache_chunk *c = cache_chunk_create(l, NULL, n_blocks, &ns, pos0);
    cr_assert_not_null(c);
    chunk_fill_kv(c, l, seed);
    return c;
}

/* Encodes c as enc and decodes it into a fresh chunk of c's shape. */
static cache_chunk *round_trip(const cache_layout *l, const codec_table *t, int enc,
                               const cache_chunk *c, size_t *len_out) {
    size_t cap = cache_enc_bound(l, t, enc, c->n_blocks);
    cr_assert_gt(cap, 0);
    uint8_t *buf = malloc(cap);
    float *scratch = malloc(sizeof(float) * cache_enc_scratch_floats(l));
    kv_error err = {{0}};
    int64_t len = cache_enc_encode(l, t, enc, c, scratch, buf, cap, &err);
    cr_assert_gt(len, 0, "%s", err.msg);
    cache_key ns = {{0}};
    cache_chunk *d = cache_chunk_create(l, NULL, c->n_blocks, &ns, c->pos0);
    cr_assert_eq(cache_enc_decode(l, t, enc, buf, (size_t)len, d, scratch, 2, &err), 0, "%s",
                 err.msg);
    *len_out = (size_t)len;
    free(buf);
    free(scratch);
    return d;
}

Test(chunk_codec, names_round_trip) {
    for (int e = CACHE_ENC_TEXT; e < CACHE_ENC_MAX; e++) {
        if (e == CACHE_ENC_ANY) continue;
        char n[16];
        cache_enc_name(e, n);
        cr_assert_eq(cache_enc_parse(n), e, "%s", n);
    }
    cr_assert_eq(cache_enc_parse("lossless"), CACHE_ENC_RAW);
    cr_assert_eq(cache_enc_parse("codec1"), CACHE_ENC_CODEC + 1);
    cr_assert_eq(cache_enc_parse("codec"), CACHE_ENC_ANY);
    cr_assert_eq(cache_enc_parse("codec8"), CACHE_ENC_ANY);
    cr_assert_eq(cache_enc_parse(""), CACHE_ENC_ANY);
    cr_assert_eq(cache_enc_count(NULL), 2);
}

Test(chunk_codec, every_encoding_within_its_bound) {
    cache_layout l = layout();
    codec_table t;
    chunk_codec_table(&t, &l, 1, 5);
    cr_assert_eq(cache_enc_count(&t), 6);
    cache_chunk *c = kv_chunk(&l, 4, 128, 9);
    size_t prev = SIZE_MAX;
    for (int enc = 0; enc < cache_enc_count(&t); enc++) {
        size_t len;
        cache_chunk *d = round_trip(&l, &t, enc, c, &len);
        if (enc == CACHE_ENC_RAW) {
            cr_assert_eq(len, c->bytes);
            cr_assert_eq(memcmp(d->data, c->data, c->bytes), 0);
        }
        if (enc > CACHE_ENC_CODEC) cr_assert_lt(len, prev, "coarser levels are smaller");
        if (enc >= CACHE_ENC_CODEC) prev = len;
        int nc = l.n_kv_head * l.head_dim;
        float xs[64 * 16], ys[64 * 16]; /* one layer's K or V rows, read by the backend */
        for (int ly = 0; ly < l.n_layer; ly++)
            for (int kv = 0; kv < 2; kv++) {
                chunk_kv_rows(c, &l, ly, kv, xs);
                chunk_kv_rows(d, &l, ly, kv, ys);
                for (int tk = 0; tk < 64; tk++) {
                    float lo = INFINITY, hi = -INFINITY;
                    for (int ch = 0; ch < nc; ch++) {
                        lo = fminf(lo, xs[tk * nc + ch]);
                        hi = fmaxf(hi, xs[tk * nc + ch]);
                    }
                    for (int ch = 0; ch < nc; ch++) {
                        float x = xs[tk * nc + ch], y = ys[tk * nc + ch];
                        /* f16 rounding of the decoded value, and of q8's min and step */
                        float bound = enc == CACHE_ENC_RAW ? 0
                                      : enc == CACHE_ENC_Q8
                                          ? (hi - lo) / 255 * 0.52f + 1e-3f * fabsf(lo) + 1e-3f
                                          : codec_table_error_bound(&t, enc - CACHE_ENC_CODEC, ly,
                                                                    kv, tk, ch) +
                                                1e-3f * fabsf(x) + 1e-4f;
                        cr_assert_leq(fabsf(x - y), bound,
                                      "encoding %d (%d,%d,%d,%d): %g vs %g, bound %g", enc, ly, kv,
                                      tk, ch, x, y, bound);
                    }
                }
            }
        cache_chunk_unref(d);
    }
    cache_chunk_unref(c);
    codec_table_free(&t);
}

Test(chunk_codec, partial_chunks_and_no_table) {
    cache_layout l = layout();
    cache_chunk *c = kv_chunk(&l, 1, 64, 3);
    size_t len;
    cache_chunk *d = round_trip(&l, NULL, CACHE_ENC_Q8, c, &len);
    cr_assert_eq(len, (size_t)2 * 2 * 16 * (4 + 16));
    cache_chunk_unref(d);
    cr_assert_eq(cache_enc_bound(&l, NULL, CACHE_ENC_CODEC, 1), 0, "no table, no codec levels");
    cr_assert_eq(cache_enc_bound(&l, NULL, CACHE_ENC_Q8, 5), 0, "more blocks than a chunk");
    cache_chunk_unref(c);
}

Test(chunk_codec, decoders_refuse_what_does_not_fit) {
    cache_layout l = layout();
    codec_table t, other;
    chunk_codec_table(&t, &l, 1, 5);
    chunk_codec_table(&other, &l, 1.5f, 5);
    cache_chunk *c = kv_chunk(&l, 4, 128, 9);
    float *scratch = malloc(sizeof(float) * cache_enc_scratch_floats(&l));
    size_t cap = cache_enc_bound(&l, &t, CACHE_ENC_CODEC + 1, 4);
    uint8_t *buf = malloc(cap);
    kv_error err = {{0}};
    int64_t len = cache_enc_encode(&l, &t, CACHE_ENC_CODEC + 1, c, scratch, buf, cap, &err);
    cr_assert_gt(len, 0);
    cache_key ns = {{0}};
    cache_chunk *d = cache_chunk_create(&l, NULL, 4, &ns, 128);
    /* another table, another level, another position, another shape, a cut stream */
    cr_assert_eq(
        cache_enc_decode(&l, &other, CACHE_ENC_CODEC + 1, buf, (size_t)len, d, scratch, 1, &err),
        -1);
    cr_assert_eq(
        cache_enc_decode(&l, &t, CACHE_ENC_CODEC + 2, buf, (size_t)len, d, scratch, 1, &err), -1);
    d->pos0 = 192;
    cr_assert_eq(
        cache_enc_decode(&l, &t, CACHE_ENC_CODEC + 1, buf, (size_t)len, d, scratch, 1, &err), -1);
    cache_chunk *d2 = cache_chunk_create(&l, NULL, 2, &ns, 128);
    cr_assert_eq(
        cache_enc_decode(&l, &t, CACHE_ENC_CODEC + 1, buf, (size_t)len, d2, scratch, 1, &err), -1);
    d->pos0 = 128;
    cr_assert_eq(
        cache_enc_decode(&l, &t, CACHE_ENC_CODEC + 1, buf, (size_t)len - 1, d, scratch, 1, &err),
        -1);
    cr_assert_eq(cache_enc_decode(&l, &t, CACHE_ENC_Q8, buf, 100, d, scratch, 1, &err), -1);
    cr_assert_eq(cache_enc_decode(&l, &t, CACHE_ENC_RAW, buf, 100, d, scratch, 1, &err), -1);
    /* and the right one still decodes */
    cr_assert_eq(
        cache_enc_decode(&l, &t, CACHE_ENC_CODEC + 1, buf, (size_t)len, d, scratch, 1, &err), 0,
        "%s", err.msg);
    {
        cache_layout l2 = l;
        l2.n_layer = 3;
        cr_assert_eq(cache_enc_check_table(&l2, &t, &err), -1);
        l2 = l;
        l2.model_id[0] ^= 1;
        cr_assert_eq(cache_enc_check_table(&l2, &t, &err), -1);
        cr_assert_eq(cache_enc_check_table(&l, &t, &err), 0);
    }
    cache_chunk_unref(d);
    cache_chunk_unref(d2);
    cache_chunk_unref(c);
    free(buf);
    free(scratch);
    codec_table_free(&t);
    codec_table_free(&other);
}

/* What the codecs see of a chunk is what the backend reads from its blocks (kernels/backend.h
 * owns the layout: K regions are transposed): encoding the chunk gives the bytes of encoding the
 * backend's rows directly. A layout slip would still round-trip, but code other values. */
Test(chunk_codec, codecs_see_the_backends_rows) {
    cache_layout l = layout();
    codec_table t;
    chunk_codec_table(&t, &l, 1, 5);
    cache_chunk *c = kv_chunk(&l, 4, 128, 9);
    int nc = l.n_kv_head * l.head_dim, nt = 64;
    float *x = malloc(sizeof(float) * cache_enc_scratch_floats(&l));
    float *scratch = malloc(sizeof(float) * cache_enc_scratch_floats(&l));
    for (int ly = 0; ly < l.n_layer; ly++)
        for (int kv = 0; kv < 2; kv++)
            chunk_kv_rows(c, &l, ly, kv, x + ((size_t)ly * 2 + kv) * (size_t)nt * nc);
    const int encs[2] = {CACHE_ENC_Q8, CACHE_ENC_CODEC};
    for (int i = 0; i < 2; i++) {
        size_t cap = cache_enc_bound(&l, &t, encs[i], 4);
        uint8_t *got = malloc(cap), *want = malloc(cap);
        kv_error err = {{0}};
        int64_t n = cache_enc_encode(&l, &t, encs[i], c, scratch, got, cap, &err);
        codec_shape sh = {.n_layer = l.n_layer, .n_tok = nt, .n_chan = nc};
        int64_t m = encs[i] == CACHE_ENC_Q8
                        ? (codec_uniform_encode(x, &sh, 8, want, &err)
                               ? -1
                               : (int64_t)codec_uniform_bytes(&sh, 8))
                        : codec_encode_chunk(&t, 0, x, nt, 128, want, cap, &err);
        cr_assert(n > 0 && n == m, "encoding %d: %lld vs %lld bytes", encs[i], (long long)n,
                  (long long)m);
        cr_assert_eq(memcmp(got, want, (size_t)n), 0, "encoding %d", encs[i]);
        free(got);
        free(want);
    }
    free(x);
    free(scratch);
    cache_chunk_unref(c);
    codec_table_free(&t);
}
