/* The CacheGen codec end to end: a table calibrated on synthetic KV with token-wise locality,
 * chunks encoded at every level decoding within codec_table_error_bound (for several shapes and
 * seeds), sizes shrinking as levels coarsen, chunks decoding independently and on any number of
 * threads, and every corruption of a bitstream or table file refused: each flipped byte, each
 * truncation, another table, another model. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "cache/codec/codec.h"
#include "kernels/quant.h"
#include "tests/unit/tmpdir.h"

/* ---------------------------------------------------------------- synthetic KV */

typedef struct rng {
    uint64_t s;
} rng;
static double uniform01(rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return (double)(r->s >> 11) / 9007199254740992.0;
}
static double gauss(rng *r) {
    double u = uniform01(r) + 1e-12, v = uniform01(r);
    return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}

/* n_chunks chunks [chunk][layer][kv][token][channel]: each channel has its own level and
 * spread (fixed per layer, kv and channel by the table seed, so calibration and test data share
 * statistics), tokens a random walk around it; about one element in 500 an outlier far outside
 * the channel's range (an escape). Values rounded to f16 as the pool stores them. */
static float *make_kv(int n_layer, int n_chan, int n_tok, int n_chunks, uint64_t seed) {
    size_t n = (size_t)n_chunks * n_layer * 2 * n_tok * n_chan;
    float *x = malloc(n * sizeof *x);
    cr_assert_not_null(x);
    rng r = {seed * 0x9E3779B97F4A7C15ull + 1};
    for (int k = 0; k < n_chunks; k++)
        for (int l = 0; l < n_layer; l++)
            for (int kv = 0; kv < 2; kv++)
                for (int c = 0; c < n_chan; c++) {
                    rng shape = {(uint64_t)((l * 2 + kv) * 4099 + c) * 0x2545F4914F6CDD1Dull + 7};
                    double spread = 0.1 + 3 * uniform01(&shape);
                    double mid = 2 * spread * gauss(&shape);
                    double v = mid + spread * gauss(&r);
                    for (int t = 0; t < n_tok; t++) {
                        v += 0.1 * spread * gauss(&r);
                        double y = v;
                        if (uniform01(&r) < 0.002)
                            y = mid + (uniform01(&r) < 0.5 ? -60 : 60) * spread;
                        size_t i = ((((size_t)k * n_layer + l) * 2 + kv) * n_tok + t) * n_chan + c;
                        x[i] = fp16_to_fp32(fp32_to_fp16((float)y));
                    }
                }
    return x;
}

/* Four levels from near-lossless to aggressive, deeper layers coarser (up to 2x). */
static void levels_fill(codec_level *lv, int n_layer, int group) {
    const float bins[4][2] = {{0.05f, 0.1f}, {0.1f, 0.25f}, {0.25f, 0.5f}, {0.5f, 1.0f}};
    memset(lv, 0, 4 * sizeof *lv);
    for (int v = 0; v < 4; v++) {
        lv[v].group = group;
        for (int l = 0; l < n_layer; l++)
            for (int kv = 0; kv < 2; kv++) {
                float g = 1 + (float)l / (float)n_layer;
                lv[v].anchor_bin[l][kv] = bins[v][0] * g;
                lv[v].delta_bin[l][kv] = bins[v][1] * g;
            }
    }
}

static void model_id_fill(uint8_t id[32], uint8_t tag) {
    for (int i = 0; i < 32; i++) id[i] = (uint8_t)(tag + 3 * i);
}

/* A table for the shape, calibrated on 4 chunks of n_tok tokens. */
static void make_table(codec_table *t, int n_layer, int n_chan, int n_tok, int group,
                       uint64_t seed) {
    codec_level lv[4];
    levels_fill(lv, n_layer, group);
    uint8_t mid[32];
    model_id_fill(mid, 1);
    kv_error err = {{0}};
    cr_assert_eq(codec_table_init(t, mid, n_layer, n_chan, lv, 4, &err), 0, "%s", err.msg);
    float *x = make_kv(n_layer, n_chan, n_tok, 4, seed);
    cr_assert_eq(codec_table_calibrate(t, x, 4, n_tok, NULL, &err), 0, "%s", err.msg);
    free(x);
}

/* Encodes x at level (asserting success) into a malloc'd buffer. */
static uint8_t *encode(const codec_table *t, int level, const float *x, int n_tok, int32_t pos0,
                       size_t *len) {
    size_t cap = codec_encode_bound(t, n_tok);
    cr_assert_gt(cap, 0);
    uint8_t *buf = malloc(cap);
    kv_error err = {{0}};
    int64_t n = codec_encode_chunk(t, level, x, n_tok, pos0, buf, cap, &err);
    cr_assert_gt(n, 0, "%s", err.msg);
    *len = (size_t)n;
    return buf;
}

/* Every element of y (n_tok tokens from tok0 of x's n_tok_x) within its bound at level
 * (codec_table_error_bound). */
static void check_bounds(const codec_table *t, int level, const float *x, int n_tok_x, int tok0,
                         const float *y, int n_tok) {
    const int nc = t->n_chan;
    for (int l = 0; l < t->n_layer; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int tok = 0; tok < n_tok; tok++)
                for (int c = 0; c < nc; c++) {
                    float a = x[(((size_t)l * 2 + kv) * n_tok_x + tok0 + tok) * nc + c];
                    float b = y[(((size_t)l * 2 + kv) * n_tok + tok) * nc + c];
                    float bound = codec_table_error_bound(t, level, l, kv, tok, c);
                    /* float rounding of v / step and q * step: a few ulps of the value; keys
                     * coded before RoPE: the rotations' rounding, and escapes rounded to f16
                     * before the rotation back (2^-11 of the pair's magnitude) */
                    float slack = fabsf(a) * 1e-6f;
                    if (kv == 0 && t->n_rot && c % t->head_dim < t->n_rot) {
                        float o = x[(((size_t)l * 2 + kv) * n_tok_x + tok0 + tok) * nc + (c ^ 1)];
                        slack = hypotf(a, o) * 1e-3f;
                    }
                    cr_assert_leq(fabsf(a - b), bound * (1 + 1e-5f) + slack,
                                  "level %d layer %d kv %d token %d chan %d: |%g - %g| > %g", level,
                                  l, kv, tok, c, b, a, bound);
                }
}

/* Decodes (asserting success and the header's fields) into a malloc'd array. */
static float *decode(const codec_table *t, const uint8_t *buf, size_t len, int level, int n_tok,
                     int32_t pos0, int n_threads) {
    codec_stream_info info;
    kv_error err = {{0}};
    cr_assert_eq(codec_stream_info_get(t, buf, len, &info, &err), 0, "%s", err.msg);
    cr_assert_eq(info.level, level);
    cr_assert_eq(info.n_tok, n_tok);
    cr_assert_eq(info.pos0, pos0);
    float *y = malloc((size_t)t->n_layer * 2 * n_tok * t->n_chan * sizeof *y);
    cr_assert_eq(codec_decode_chunk(t, buf, len, y, n_threads, &err), 0, "%s", err.msg);
    return y;
}

/* Both entry points refuse buf[0..len). */
static void assert_refused(const codec_table *t, const uint8_t *buf, size_t len, float *y,
                           const char *what, size_t at) {
    codec_stream_info info;
    kv_error err = {{0}};
    cr_assert_eq(codec_stream_info_get(t, buf, len, &info, &err), -1, "%s %zu accepted", what, at);
    cr_assert(err.msg[0]);
    err.msg[0] = 0;
    cr_assert_eq(codec_decode_chunk(t, buf, len, y, 2, &err), -1, "%s %zu decoded", what, at);
    cr_assert(err.msg[0]);
}

/* ---------------------------------------------------------------- round trips */

Test(codec, round_trip_within_bounds_at_every_level) {
    codec_table t;
    make_table(&t, 3, 16, 40, 10, 1);
    float *x = make_kv(3, 16, 40, 1, 99); /* not the calibration data */
    for (int v = 0; v < 4; v++) {
        size_t len;
        uint8_t *buf = encode(&t, v, x, 40, 1000, &len);
        float *y = decode(&t, buf, len, v, 40, 1000, 1);
        check_bounds(&t, v, x, 40, 0, y, 40);
        free(y);
        free(buf);
    }
    free(x);
    codec_table_free(&t);
}

Test(codec, round_trip_property_over_shapes_and_seeds) {
    /* n_tok not a multiple of the group, a single token, groups of 1 and beyond the chunk, no
     * anchors (group 0) */
    const struct {
        int n_layer, n_chan, n_tok, group;
    } shapes[] = {{3, 16, 37, 10}, {2, 5, 1, 10}, {1, 3, 23, 1},
                  {4, 7, 11, 64},  {2, 9, 19, 4}, {3, 6, 29, 0}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (uint64_t seed = 1; seed <= 3; seed++) {
            codec_table t;
            make_table(&t, shapes[s].n_layer, shapes[s].n_chan, 30, shapes[s].group, seed * 7);
            int n_tok = shapes[s].n_tok;
            float *x = make_kv(t.n_layer, t.n_chan, n_tok, 1, seed * 1000 + s);
            for (int v = 0; v < 4; v++) {
                size_t len;
                uint8_t *buf = encode(&t, v, x, n_tok, (int32_t)seed, &len);
                float *y = decode(&t, buf, len, v, n_tok, (int32_t)seed, (int)seed);
                check_bounds(&t, v, x, n_tok, 0, y, n_tok);
                free(y);
                free(buf);
            }
            free(x);
            codec_table_free(&t);
        }
}

Test(codec, sizes_shrink_as_levels_coarsen) {
    codec_table t;
    make_table(&t, 3, 16, 40, 10, 2);
    float *x = make_kv(3, 16, 40, 1, 5);
    size_t prev = SIZE_MAX;
    codec_shape sh = {.n_layer = 3, .n_tok = 40, .n_chan = 16};
    for (int v = 0; v < 4; v++) {
        size_t len;
        uint8_t *buf = encode(&t, v, x, 40, 0, &len);
        cr_assert_lt(len, prev, "level %d: %zu bytes, level %d had %zu", v, len, v - 1, prev);
        prev = len;
        free(buf);
    }
    /* the aggressive level beats the 4-bit per-token baseline by a margin */
    cr_assert_lt(prev * 2, codec_uniform_bytes(&sh, 4), "%zu bytes", prev);
    free(x);
    codec_table_free(&t);
}

Test(codec, chunks_at_different_levels_decode_independently) {
    codec_table t;
    make_table(&t, 3, 16, 40, 10, 3);
    const int n_tok = 40, n_chunks = 3, total = n_tok * n_chunks;
    float *whole = make_kv(3, 16, total, 1, 8); /* one long sequence */
    const int level[3] = {0, 3, 1};
    uint8_t *buf[3];
    size_t len[3];
    size_t row = 16;
    float *part = malloc((size_t)3 * 2 * n_tok * row * sizeof *part);
    for (int k = 0; k < n_chunks; k++) {
        for (int lk = 0; lk < 3 * 2; lk++) /* tokens [40k, 40k + 40) of every (layer, kv) */
            memcpy(part + (size_t)lk * n_tok * row, whole + ((size_t)lk * total + k * n_tok) * row,
                   (size_t)n_tok * row * sizeof *part);
        buf[k] = encode(&t, level[k], part, n_tok, k * n_tok, &len[k]);
    }
    /* decoded out of order, each on its own, then concatenated */
    float *joined = malloc((size_t)3 * 2 * total * row * sizeof *joined);
    const int order[3] = {2, 0, 1};
    for (int i = 0; i < 3; i++) {
        int k = order[i];
        float *y = decode(&t, buf[k], len[k], level[k], n_tok, k * n_tok, 2);
        check_bounds(&t, level[k], whole, total, k * n_tok, y, n_tok);
        for (int lk = 0; lk < 3 * 2; lk++)
            memcpy(joined + ((size_t)lk * total + k * n_tok) * row, y + (size_t)lk * n_tok * row,
                   (size_t)n_tok * row * sizeof *y);
        free(y);
    }
    for (int k = 0; k < n_chunks; k++) {
        float *y = malloc((size_t)3 * 2 * n_tok * row * sizeof *y);
        for (int lk = 0; lk < 3 * 2; lk++)
            memcpy(y + (size_t)lk * n_tok * row, joined + ((size_t)lk * total + k * n_tok) * row,
                   (size_t)n_tok * row * sizeof *y);
        check_bounds(&t, level[k], whole, total, k * n_tok, y, n_tok);
        free(y);
        free(buf[k]);
    }
    free(joined);
    free(part);
    free(whole);
    codec_table_free(&t);
}

Test(codec, thread_count_does_not_change_the_result) {
    codec_table t;
    make_table(&t, 3, 16, 40, 10, 4);
    float *x = make_kv(3, 16, 40, 1, 6);
    size_t len;
    uint8_t *buf = encode(&t, 1, x, 40, 0, &len);
    float *ref = decode(&t, buf, len, 1, 40, 0, 1);
    const int threads[] = {0, 2, 3, 4, 64};
    for (size_t i = 0; i < sizeof threads / sizeof threads[0]; i++) {
        float *y = decode(&t, buf, len, 1, 40, 0, threads[i]);
        cr_assert_eq(memcmp(y, ref, (size_t)3 * 2 * 40 * 16 * sizeof *y), 0, "%d threads",
                     threads[i]);
        free(y);
    }
    free(ref);
    free(buf);
    free(x);
    codec_table_free(&t);
}

/* ---------------------------------------------------------------- corrupt bitstreams */

Test(codec, every_flipped_byte_and_truncation_is_refused) {
    codec_table t;
    make_table(&t, 2, 4, 12, 4, 5);
    float *x = make_kv(2, 4, 6, 1, 9);
    size_t len;
    uint8_t *buf = encode(&t, 2, x, 6, 77, &len);
    float *y = malloc((size_t)2 * 2 * 6 * 4 * sizeof *y);
    uint8_t *bad = malloc(len + 1);
    for (size_t i = 0; i < len; i++)
        for (int flip = 1; flip < 256; flip <<= 3) {
            memcpy(bad, buf, len);
            bad[i] ^= (uint8_t)flip;
            assert_refused(&t, bad, len, y, "byte flipped at", i);
        }
    for (size_t n = 0; n < len; n++) assert_refused(&t, buf, n, y, "truncated to", n);
    memcpy(bad, buf, len);
    bad[len] = 0;
    assert_refused(&t, bad, len + 1, y, "one byte appended to", len);
    assert_refused(&t, NULL, 0, y, "NULL", 0);
    /* the untouched stream still decodes */
    float *ok = decode(&t, buf, len, 2, 6, 77, 1);
    check_bounds(&t, 2, x, 6, 0, ok, 6);
    free(ok);
    free(bad);
    free(y);
    free(buf);
    free(x);
    codec_table_free(&t);
}

/* Rewrites a bitstream's checksum after an edit (codec.h: bytes 0..55 and 88 to the end). */
static void reseal_stream(uint8_t *buf, size_t len) {
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    unsigned int n = 0;
    cr_assert_not_null(md);
    cr_assert_eq(EVP_DigestInit_ex(md, EVP_sha256(), NULL), 1);
    EVP_DigestUpdate(md, buf, 56);
    EVP_DigestUpdate(md, buf + 88, len - 88);
    cr_assert_eq(EVP_DigestFinal_ex(md, buf + 56, &n), 1);
    EVP_MD_CTX_free(md);
}

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Behind the checksum: edits resealed with a valid checksum still fail their own checks. */
Test(codec, resealed_corruption_is_refused) {
    codec_table t;
    make_table(&t, 2, 4, 12, 4, 5);
    float *x = make_kv(2, 4, 6, 1, 9);
    size_t len;
    uint8_t *buf = encode(&t, 1, x, 6, 0, &len);
    const uint32_t elems = 2 * 6 * 4;
    uint32_t esc0 = (uint32_t)buf[88] | (uint32_t)buf[89] << 8;
    uint32_t rans0 = (uint32_t)buf[92] | (uint32_t)buf[93] << 8;
    float *y = malloc((size_t)2 * 2 * 6 * 4 * sizeof *y);
    uint8_t *bad = malloc(len + 1);
    const struct {
        size_t at;
        uint32_t val; /* written as u32 at at (u16 for at < 44) */
        int wide;
        const char *msg;
    } edits[] = {
        {6, 4, 0, "level"},         /* no level 4 */
        {40, 3, 0, "shape"},        /* n_layer */
        {42, 5, 0, "shape"},        /* n_chan */
        {44, 0, 1, "out of range"}, /* n_tok 0 */
        {44, CODEC_MAX_TOKENS + 1, 1, "out of range"},
        {48, 0x80000000u, 1, "out of range"},   /* pos0 negative */
        {48, INT32_MAX - 4, 1, "out of range"}, /* pos0 + n_tok - 1 past INT32_MAX */
        {52, 1, 1, "out of range"},             /* reserved */
        {88, elems + 1, 1, "out of range"},     /* layer 0: more escapes than elements */
        {92, 7, 1, "out of range"},             /* layer 0: stream shorter than its states */
        {92, 1u << 30, 1, "runs past"},         /* layer 0: stream past the end */
        {92, rans0 - 1, 1, "after the last"},   /* lengths no longer add up */
        {44, 7, 1, "rans"},                     /* one token more: the stream does not end */
    };
    for (size_t e = 0; e < sizeof edits / sizeof edits[0]; e++) {
        memcpy(bad, buf, len);
        if (edits[e].wide)
            put32(bad + edits[e].at, edits[e].val);
        else {
            bad[edits[e].at] = (uint8_t)edits[e].val;
            bad[edits[e].at + 1] = (uint8_t)(edits[e].val >> 8);
        }
        reseal_stream(bad, len);
        kv_error err = {{0}};
        int info_rc = codec_stream_info_get(&t, bad, len, &(codec_stream_info){0}, &err);
        cr_assert_eq(codec_decode_chunk(&t, bad, len, y, 1, &err), -1, "edit %zu decoded", e);
        cr_assert(strstr(err.msg, edits[e].msg), "edit %zu: %s", e, err.msg);
        /* info checks the header only: the stream itself is decode's to refuse */
        cr_assert_eq(info_rc, strcmp(edits[e].msg, "rans") ? -1 : 0, "edit %zu", e);
    }
    /* an escape taken from the stream's bytes: counts add up, the symbols do not */
    memcpy(bad, buf, len);
    put32(bad + 88, esc0 + 1);
    put32(bad + 92, rans0 - 2);
    reseal_stream(bad, len);
    kv_error moved = {{0}};
    cr_assert_eq(codec_decode_chunk(&t, bad, len, y, 1, &moved), -1);
    cr_assert(moved.msg[0]);
    /* every byte of layer 1's stream flipped in turn */
    size_t stream1 = len - ((uint32_t)buf[100] | (uint32_t)buf[101] << 8);
    for (size_t i = stream1; i < len; i++) {
        memcpy(bad, buf, len);
        bad[i] ^= 0x5a;
        reseal_stream(bad, len);
        kv_error err = {{0}};
        cr_assert_eq(codec_decode_chunk(&t, bad, len, y, 2, &err), -1, "flip at %zu decoded", i);
    }
    /* a byte appended and the checksum redone */
    memcpy(bad, buf, len);
    bad[len] = 0;
    reseal_stream(bad, len + 1);
    kv_error err = {{0}};
    cr_assert_eq(codec_decode_chunk(&t, bad, len + 1, y, 1, &err), -1);
    cr_assert(strstr(err.msg, "after the last"), "%s", err.msg);
    free(bad);
    free(y);
    free(buf);
    free(x);
    codec_table_free(&t);
}

Test(codec, bitstream_from_another_table_is_refused) {
    codec_table a, b;
    make_table(&a, 3, 16, 40, 10, 1);
    make_table(&b, 3, 16, 40, 10, 2); /* same shape and levels, other calibration data */
    cr_assert_neq(memcmp(a.id, b.id, 32), 0);
    float *x = make_kv(3, 16, 40, 1, 3);
    size_t len;
    uint8_t *buf = encode(&a, 0, x, 40, 0, &len);
    float *y = malloc((size_t)3 * 2 * 40 * 16 * sizeof *y);
    kv_error err = {{0}};
    cr_assert_eq(codec_decode_chunk(&b, buf, len, y, 1, &err), -1);
    cr_assert(strstr(err.msg, "another codec table"), "%s", err.msg);
    codec_stream_info info;
    cr_assert_eq(codec_stream_info_get(&b, buf, len, &info, &err), -1);
    free(y);
    free(buf);
    free(x);
    codec_table_free(&a);
    codec_table_free(&b);
}

Test(codec, bad_arguments_are_refused) {
    codec_table t;
    make_table(&t, 2, 4, 12, 4, 5);
    float *x = make_kv(2, 4, 6, 1, 9);
    size_t cap = codec_encode_bound(&t, 6);
    uint8_t *buf = malloc(cap);
    kv_error err = {{0}};
    cr_assert_eq(codec_encode_chunk(&t, 4, x, 6, 0, buf, cap, &err), -1); /* no level 4 */
    cr_assert_eq(codec_encode_chunk(&t, -1, x, 6, 0, buf, cap, &err), -1);
    cr_assert_eq(codec_encode_chunk(&t, 0, x, 0, 0, buf, cap, &err), -1);
    cr_assert_eq(codec_encode_chunk(&t, 0, x, CODEC_MAX_TOKENS + 1, 0, buf, cap, &err), -1);
    cr_assert_eq(codec_encode_chunk(&t, 0, x, 6, -1, buf, cap, &err), -1);
    cr_assert_eq(codec_encode_chunk(&t, 0, x, 6, INT32_MAX - 4, buf, cap, &err), -1);
    cr_assert_eq(codec_encode_chunk(&t, 0, x, 6, INT32_MAX - 5, buf, cap, &err) > 0, 1, "%s",
                 err.msg);
    cr_assert_eq(codec_encode_chunk(&t, 0, x, 6, 0, buf, 50, &err), -1); /* capacity */
    cr_assert_eq(codec_encode_chunk(&t, 0, x, 6, 0, buf, 120, &err), -1);
    cr_assert_eq(codec_encode_bound(&t, 0), 0);
    cr_assert_eq(codec_encode_bound(&t, CODEC_MAX_TOKENS + 1), 0);
    codec_table empty;
    memset(&empty, 0, sizeof empty);
    cr_assert_eq(codec_encode_chunk(&empty, 0, x, 6, 0, buf, cap, &err), -1);
    free(buf);
    free(x);
    codec_table_free(&t);
}

/* ---------------------------------------------------------------- table file */

Test(codec, table_init_refuses_bad_shapes_and_levels) {
    codec_level lv[4];
    levels_fill(lv, 2, 10);
    uint8_t mid[32];
    model_id_fill(mid, 1);
    codec_table t;
    kv_error err = {{0}};
    cr_assert_eq(codec_table_init(&t, mid, 0, 4, lv, 4, &err), -1);
    cr_assert_eq(codec_table_init(&t, mid, CODEC_MAX_LAYERS + 1, 4, lv, 4, &err), -1);
    cr_assert_eq(codec_table_init(&t, mid, 2, CODEC_MAX_CHANNELS + 1, lv, 4, &err), -1);
    cr_assert_eq(codec_table_init(&t, mid, 2, 4, lv, 0, &err), -1);
    cr_assert_eq(codec_table_init(&t, mid, 2, 4, lv, CODEC_MAX_LEVELS + 1, &err), -1);
    lv[1].group = -1;
    cr_assert_eq(codec_table_init(&t, mid, 2, 4, lv, 4, &err), -1);
    lv[1].group = CODEC_MAX_TOKENS + 1;
    cr_assert_eq(codec_table_init(&t, mid, 2, 4, lv, 4, &err), -1);
    lv[1].group = 10;
    lv[2].delta_bin[1][1] = NAN;
    cr_assert_eq(codec_table_init(&t, mid, 2, 4, lv, 4, &err), -1);
    cr_assert(strstr(err.msg, "bins"), "%s", err.msg);
    cr_assert_eq(codec_table_init(&t, mid, 1, 4, lv, 4, &err), 0, "%s",
                 err.msg); /* layer 1 unused */
    float nan_kv[2 * 3 * 4];
    for (int i = 0; i < 2 * 3 * 4; i++) nan_kv[i] = (float)i;
    nan_kv[5] = INFINITY;
    cr_assert_eq(codec_table_calibrate(&t, nan_kv, 1, 3, NULL, &err), -1);
    cr_assert_eq(codec_table_calibrate(&t, nan_kv, 0, 3, NULL, &err), -1);
    codec_table_free(&t);
    codec_table_free(&t); /* safe twice */
}

Test(codec, table_serialize_parse_round_trip) {
    codec_table t, u;
    make_table(&t, 3, 16, 40, 10, 1);
    uint8_t *file;
    size_t n;
    kv_error err = {{0}};
    cr_assert_eq(codec_table_serialize(&t, &file, &n, &err), 0, "%s", err.msg);
    cr_assert_eq(codec_table_parse(&u, file, n, t.model_id, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(u.id, t.id, 32), 0);
    cr_assert_eq(memcmp(u.id, file + n - 32, 32), 0, "the id is the file's SHA-256");
    cr_assert_eq(u.n_levels, 4);
    cr_assert_eq(memcmp(u.levels, t.levels, sizeof t.levels), 0);
    cr_assert_eq(memcmp(u.scale, t.scale, (size_t)3 * 2 * 16 * sizeof(float)), 0);
    uint8_t *again;
    size_t n2;
    cr_assert_eq(codec_table_serialize(&u, &again, &n2, &err), 0);
    cr_assert_eq(n2, n);
    cr_assert_eq(memcmp(again, file, n), 0);
    float *x = make_kv(3, 16, 40, 1, 12);
    for (int v = 0; v < 4; v++) {
        size_t la, lb;
        uint8_t *a = encode(&t, v, x, 40, 5, &la), *b = encode(&u, v, x, 40, 5, &lb);
        cr_assert_eq(la, lb);
        cr_assert_eq(memcmp(a, b, la), 0, "level %d encodings differ", v);
        float *y = decode(&u, a, la, v, 40, 5, 2); /* and the parsed table decodes t's stream */
        check_bounds(&u, v, x, 40, 0, y, 40);
        free(y);
        free(a);
        free(b);
    }
    free(x);
    free(again);
    free(file);
    codec_table_free(&u);
    codec_table_free(&t);
}

/* Rewrites the trailing SHA-256 after an edit, so the checks behind it are reached. */
static void reseal(uint8_t *file, size_t n) {
    unsigned int len = 0;
    cr_assert_eq(EVP_Digest(file, n - 32, file + n - 32, &len, EVP_sha256(), NULL), 1);
}

Test(codec, table_parse_refuses_corruption) {
    /* a small table (1 layer, 2 channels, 1 level: ~1.4 KB) so every byte can be tried */
    codec_level four[4];
    levels_fill(four, 1, 3);
    codec_level lv = four[0];
    uint8_t mid[32], other[32];
    model_id_fill(mid, 1);
    model_id_fill(other, 2);
    codec_table t, u;
    kv_error err = {{0}};
    cr_assert_eq(codec_table_init(&t, mid, 1, 2, &lv, 1, &err), 0, "%s", err.msg);
    float *x = make_kv(1, 2, 10, 2, 3);
    cr_assert_eq(codec_table_calibrate(&t, x, 2, 10, NULL, &err), 0, "%s", err.msg);
    uint8_t *file;
    size_t n;
    cr_assert_eq(codec_table_serialize(&t, &file, &n, &err), 0);
    cr_assert_eq(codec_table_parse(&u, file, n, mid, &err), 0, "%s", err.msg);
    codec_table_free(&u);
    uint8_t *bad = malloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        memcpy(bad, file, n);
        bad[i] ^= 0x10;
        cr_assert_eq(codec_table_parse(&u, bad, n, mid, &err), -1, "flip at %zu accepted", i);
        cr_assert_null(u.models);
    }
    for (size_t k = 0; k < n; k++)
        cr_assert_eq(codec_table_parse(&u, file, k, mid, &err), -1, "truncation to %zu", k);
    memcpy(bad, file, n);
    bad[n] = 0;
    cr_assert_eq(codec_table_parse(&u, bad, n + 1, mid, &err), -1);
    cr_assert(strstr(err.msg, "trailing"), "%s", err.msg);
    cr_assert_eq(codec_table_parse(&u, file, n, other, &err), -1);
    cr_assert(strstr(err.msg, "another model"), "%s", err.msg);

    /* resealed edits: each field's own check */
    const struct {
        size_t at;
        uint8_t val;
        const char *msg;
    } edits[] = {
        {4, 2, "version"},       /* version 2: before keys were coded before RoPE */
        {6, 1, "version"},       /* reserved */
        {40, 2, "bytes"},        /* n_layer 2: size no longer matches */
        {52, 1, "attention"},    /* n_head 1 with head_dim 0 */
        {67, 0x80, "group"},     /* group 3 -> 2^31 + 3 */
        {71, 0xff, "bins"},      /* anchor bin K negative (f32 bytes 68..71) */
        {84 + 3, 0x80, "scale"}, /* first scale negative (scales at 84, centres at 100) */
        {116, 3, "symbols"},     /* anchor model K: n_symbols 256 -> 259 */
        {118, 0, "frequenc"},    /* its first freq: 0, or the sum off */
    };
    for (size_t e = 0; e < sizeof edits / sizeof edits[0]; e++) {
        memcpy(bad, file, n);
        bad[edits[e].at] = edits[e].val;
        reseal(bad, n);
        cr_assert_eq(codec_table_parse(&u, bad, n, mid, &err), -1, "edit %zu accepted", e);
        cr_assert(strstr(err.msg, edits[e].msg), "edit %zu: %s", e, err.msg);
    }
    memcpy(bad, file, n);
    memcpy(bad + 100, (const uint8_t[]){0x00, 0x00, 0xc0, 0x7f}, 4); /* first centre NaN */
    reseal(bad, n);
    cr_assert_eq(codec_table_parse(&u, bad, n, mid, &err), -1);
    cr_assert(strstr(err.msg, "centre"), "%s", err.msg);
    free(bad);
    free(file);
    free(x);
    codec_table_free(&t);
}

Test(codec, token_at_position_zero_decodes_exact) {
    /* The attention sink (position 0) is kept exact; a chunk that starts elsewhere is not. */
    codec_table t;
    make_table(&t, 2, 8, 20, 0, 6);
    float *x = make_kv(2, 8, 20, 1, 77);
    for (int32_t pos0 = 0; pos0 <= 20; pos0 += 20) {
        size_t len;
        uint8_t *buf = encode(&t, 3, x, 20, pos0, &len);
        float *y = decode(&t, buf, len, 3, 20, pos0, 1);
        int exact = 0;
        for (int lk = 0; lk < 2 * 2; lk++)
            for (int c = 0; c < 8; c++)
                exact += y[(size_t)lk * 20 * 8 + c] == x[(size_t)lk * 20 * 8 + c];
        if (pos0 == 0)
            cr_assert_eq(exact, 2 * 2 * 8, "only %d of token 0's values exact", exact);
        else
            cr_assert_lt(exact, 2 * 2 * 8 / 2, "%d of token 0's values exact at pos0 20", exact);
        check_bounds(&t, 3, x, 20, 0, y, 20);
        free(y);
        free(buf);
    }
    free(x);
    codec_table_free(&t);
}

/* A 2-layer table over 2 KV heads of 4 dims read by 4 query heads, whose mean query looks at
 * channel 0 of each head only; RoPE frequencies 0 (no rotation), so a key's score is its
 * channel 0 over sqrt(4). */
static void make_attention_table(codec_table *t, float margin) {
    make_table(t, 2, 8, 30, 0, 9);
    const float inv_freq[2] = {0, 0};
    float qmean[2 * 4 * 4] = {0};
    for (int lh = 0; lh < 2 * 4; lh++) qmean[lh * 4] = 1.0f;
    kv_error err = {{0}};
    cr_assert_eq(codec_table_set_attention(t, 4, 4, 4, inv_freq, qmean, margin, &err), 0, "%s",
                 err.msg);
    float *x = make_kv(2, 8, 30, 4, 9);
    cr_assert_eq(codec_table_calibrate(t, x, 4, 30, NULL, &err), 0, "%s", err.msg);
    free(x);
}

Test(codec, heavy_hitters_the_mean_query_favours_decode_exact) {
    codec_table t;
    make_attention_table(&t, 4.0f);
    const int nl = 2, nc = 8, n_tok = 30;
    float *x = make_kv(nl, nc, n_tok, 1, 31);
    for (int l = 0; l < nl; l++) /* token 7's keys: channel 0 of head 1 far above the rest */
        x[(((size_t)l * 2 + 0) * n_tok + 7) * nc + 4] = 64.0f;
    size_t len;
    uint8_t *buf = encode(&t, 3, x, n_tok, 100, &len);
    float *y = decode(&t, buf, len, 3, n_tok, 100, 2);
    check_bounds(&t, 3, x, n_tok, 0, y, n_tok);
    size_t others_exact = 0, others = 0;
    for (int l = 0; l < nl; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int tok = 0; tok < n_tok; tok++)
                for (int c = 0; c < nc; c++) {
                    size_t i = (((size_t)l * 2 + kv) * n_tok + tok) * nc + c;
                    if (tok == 7) {
                        cr_assert_eq(y[i], x[i], "layer %d kv %d chan %d of the hitter", l, kv, c);
                    } else {
                        others++;
                        others_exact += y[i] == x[i];
                    }
                }
    cr_assert_lt(others_exact * 4, others, "%zu of %zu other values exact", others_exact, others);
    /* the protection costs bits: the same chunk without the outlier key is smaller */
    x[(((size_t)0 * 2 + 0) * n_tok + 7) * nc + 4] = 0.0f;
    x[(((size_t)1 * 2 + 0) * n_tok + 7) * nc + 4] = 0.0f;
    size_t len2;
    uint8_t *buf2 = encode(&t, 3, x, n_tok, 100, &len2);
    cr_assert_lt(len2 + 2 * 2 * 2 * 8, len, "%zu bytes without the hitter, %zu with", len2, len);

    /* the attention data survives the file, and a non-finite direction is refused */
    uint8_t *file;
    size_t n;
    kv_error err = {{0}};
    codec_table u;
    cr_assert_eq(codec_table_serialize(&t, &file, &n, &err), 0, "%s", err.msg);
    cr_assert_eq(codec_table_parse(&u, file, n, t.model_id, &err), 0, "%s", err.msg);
    cr_assert_eq(u.n_head, 4);
    cr_assert_eq(u.margin, 4.0f);
    cr_assert_eq(memcmp(u.qdir, t.qdir, sizeof(float) * 2 * 4 * 4), 0);
    cr_assert_eq(memcmp(u.id, t.id, 32), 0);
    float *z = decode(&u, buf, len, 3, n_tok, 100, 1);
    cr_assert_eq(memcmp(z, y, sizeof(float) * (size_t)nl * 2 * n_tok * nc), 0);
    codec_table_free(&u);
    /* the models of 4 levels precede the checksum; qdir's last float precedes the models */
    size_t at = n - 32 -
                4 * ((size_t)2 * 2 * (2 + 2 * CODEC_ANCHOR_SYMBOLS) +
                     (size_t)2 * 2 * 8 * (2 + 2 * CODEC_DELTA_SYMBOLS)) -
                4;
    memcpy(file + at, (const uint8_t[]){0x00, 0x00, 0x80, 0x7f}, 4); /* +inf */
    reseal(file, n);
    cr_assert_eq(codec_table_parse(&u, file, n, t.model_id, &err), -1);
    cr_assert(strstr(err.msg, "query direction"), "%s", err.msg);
    free(file);

    /* bad attention arguments */
    const float f0[2] = {0, 0};
    float q[2 * 4 * 4] = {0};
    cr_assert_eq(codec_table_set_attention(&t, 3, 4, 4, f0, q, 4.0f, &err), -1); /* 3 % 2 */
    cr_assert_eq(codec_table_set_attention(&t, 4, 4, 5, f0, q, 4.0f, &err), -1); /* odd rot */
    cr_assert_eq(codec_table_set_attention(&t, 4, 4, 4, f0, q, -1.0f, &err), -1);
    q[3] = NAN;
    cr_assert_eq(codec_table_set_attention(&t, 4, 4, 4, f0, q, 4.0f, &err), -1);
    free(z);
    free(buf);
    free(buf2);
    free(y);
    free(x);
    codec_table_free(&t);
}

/* Keys turned by RoPE at positions pos0 + t: x's K rows (n_chunks chunks of n_tok, chunk k at
 * pos0 + k * n_tok) rotated in place, pairs (2i, 2i+1) of each 4-dim head by inv_freq[i]. */
static void rotate_keys(float *x, int n_layer, int n_chan, int n_tok, int n_chunks, int32_t pos0,
                        const float inv_freq[2]) {
    for (int k = 0; k < n_chunks; k++)
        for (int l = 0; l < n_layer; l++)
            for (int tok = 0; tok < n_tok; tok++) {
                float *r = x + (((size_t)k * n_layer + l) * 2 * n_tok + tok) * n_chan;
                for (int c = 0; c < n_chan; c += 2) {
                    double ang = ((double)pos0 + k * n_tok + tok) * inv_freq[(c % 4) / 2];
                    double x0 = r[c], x1 = r[c + 1];
                    r[c] = fp16_to_fp32(fp32_to_fp16((float)(x0 * cos(ang) - x1 * sin(ang))));
                    r[c + 1] = fp16_to_fp32(fp32_to_fp16((float)(x0 * sin(ang) + x1 * cos(ang))));
                }
            }
}

Test(codec, keys_are_coded_before_rope) {
    /* Keys with strong channel means, rotated as RoPE does: a table that knows the RoPE codes
     * them before rotation, where each channel keeps its own spread around a fixed centre (sd
     * units: about half the units of a table that sees the means spin into spread; V alike),
     * and decodes them rotated back within the pairs' bounds at every level. margin 0: the
     * RoPE without heavy hitters. */
    const int nl = 2, nc = 8, n_tok = 64;
    const float inv_freq[2] = {1.0f, 0.05f};
    float qmean[2 * 4 * 4] = {0};
    codec_level lv[4];
    levels_fill(lv, nl, 0);
    uint8_t mid[32];
    model_id_fill(mid, 1);
    kv_error err = {{0}};
    codec_table rope, plain;
    cr_assert_eq(codec_table_init(&rope, mid, nl, nc, lv, 4, &err), 0, "%s", err.msg);
    cr_assert_eq(codec_table_set_attention(&rope, 4, 4, 4, inv_freq, qmean, 0.0f, &err), 0, "%s",
                 err.msg);
    cr_assert_eq(codec_table_init(&plain, mid, nl, nc, lv, 4, &err), 0, "%s", err.msg);
    float *cal = make_kv(nl, nc, n_tok, 4, 5);
    rotate_keys(cal, nl, nc, n_tok, 4, 0, inv_freq);
    cr_assert_eq(codec_table_calibrate(&rope, cal, 4, n_tok, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(codec_table_calibrate(&plain, cal, 4, n_tok, NULL, &err), 0, "%s", err.msg);
    free(cal);

    double log_k = 0;
    for (int l = 0; l < nl; l++)
        for (int c = 0; c < nc; c++) {
            size_t k = (size_t)l * 2 * nc + c, v = k + nc;
            log_k += log(rope.scale[k] / plain.scale[k]);
            cr_assert_eq(rope.scale[v], plain.scale[v], "layer %d V channel %d", l, c);
        }
    cr_assert_lt(exp(log_k / (nl * nc)), 0.7, "key units before RoPE / after: %g",
                 exp(log_k / (nl * nc)));
    float *x = make_kv(nl, nc, n_tok, 1, 77);
    rotate_keys(x, nl, nc, n_tok, 1, 300, inv_freq);
    for (int v = 0; v < 4; v++) {
        size_t len_r, len_p;
        uint8_t *br = encode(&rope, v, x, n_tok, 300, &len_r);
        uint8_t *bp = encode(&plain, v, x, n_tok, 300, &len_p);
        float *yr = decode(&rope, br, len_r, v, n_tok, 300, 2);
        float *yp = decode(&plain, bp, len_p, v, n_tok, 300, 1);
        check_bounds(&rope, v, x, n_tok, 0, yr, n_tok);
        check_bounds(&plain, v, x, n_tok, 0, yp, n_tok);
        free(br);
        free(bp);
        free(yr);
        free(yp);
    }
    /* margin 0 and the RoPE survive the file */
    uint8_t *file;
    size_t n;
    codec_table u;
    cr_assert_eq(codec_table_serialize(&rope, &file, &n, &err), 0, "%s", err.msg);
    cr_assert_eq(codec_table_parse(&u, file, n, mid, &err), 0, "%s", err.msg);
    cr_assert_eq(u.margin, 0.0f);
    cr_assert_eq(u.n_rot, 4);
    cr_assert_eq(u.inv_freq[0], 1.0f);
    size_t len;
    uint8_t *b = encode(&u, 2, x, n_tok, 300, &len);
    float *y = decode(&rope, b, len, 2, n_tok, 300, 2);
    check_bounds(&u, 2, x, n_tok, 0, y, n_tok);
    free(y);
    free(b);
    /* a key pair near f16's limit turns past it before RoPE: refused, not escaped as inf */
    x[(size_t)1 * nc + 0] = x[(size_t)1 * nc + 1] = 60000.0f; /* layer 0, token 1 (pos 301) */
    size_t cap = codec_encode_bound(&rope, n_tok);
    b = malloc(cap);
    cr_assert_eq(codec_encode_chunk(&rope, 0, x, n_tok, 300, b, cap, &err), -1);
    cr_assert(strstr(err.msg, "f16 range"), "%s", err.msg);
    cr_assert_gt(codec_encode_chunk(&plain, 0, x, n_tok, 300, b, cap, &err), 0, "%s", err.msg);
    free(b);
    free(file);
    codec_table_free(&u);
    free(x);
    codec_table_free(&rope);
    codec_table_free(&plain);
}

Test(codec, calibration_weights_set_units_and_centres) {
    /* units: G / sqrt(weight), G the geometric mean of sd * sqrt(weight) over the channels of a
     * (layer, kv); centres: channel means */
    codec_level lv[4];
    levels_fill(lv, 2, 0);
    uint8_t mid[32];
    model_id_fill(mid, 1);
    codec_table t, u;
    kv_error err = {{0}};
    const int nl = 2, nc = 4, n_tok = 64;
    cr_assert_eq(codec_table_init(&t, mid, nl, nc, lv, 4, &err), 0, "%s", err.msg);
    cr_assert_eq(codec_table_init(&u, mid, nl, nc, lv, 4, &err), 0, "%s", err.msg);
    float *x = make_kv(nl, nc, n_tok, 2, 21);
    float w[2 * 2 * 4];
    for (int i = 0; i < 2 * 2 * 4; i++) w[i] = (float)(1 + i % 4 * 3);
    cr_assert_eq(codec_table_calibrate(&t, x, 2, n_tok, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(codec_table_calibrate(&u, x, 2, n_tok, w, &err), 0, "%s", err.msg);
    for (int lk = 0; lk < nl * 2; lk++) {
        double log_g = 0;
        for (int c = 0; c < nc; c++) log_g += log(t.scale[lk * nc + c] * sqrt(w[lk * nc + c]));
        double g = exp(log_g / nc);
        for (int c = 0; c < nc; c++) {
            int i = lk * nc + c;
            cr_assert_float_eq(u.scale[i], g / sqrt(w[i]), 1e-4 * g, "unit %d: %g", i, u.scale[i]);
            double mean = 0; /* t's sd units: plain sd; centres the same either way */
            int l = lk / 2, kv = lk % 2;
            for (int k = 0; k < 2; k++)
                for (int tok = 0; tok < n_tok; tok++)
                    mean += x[((((size_t)k * nl + l) * 2 + kv) * n_tok + tok) * nc + c];
            mean /= 2 * n_tok;
            cr_assert_float_eq(u.center[i], mean, 1e-4 * (1 + fabs(mean)), "centre %d", i);
            cr_assert_eq(u.center[i], t.center[i]);
        }
    }
    /* the weighted table still round-trips within its (now uneven) bounds */
    float *y0 = make_kv(nl, nc, n_tok, 1, 22);
    size_t len;
    uint8_t *buf = encode(&u, 2, y0, n_tok, 64, &len);
    float *y = decode(&u, buf, len, 2, n_tok, 64, 2);
    check_bounds(&u, 2, y0, n_tok, 0, y, n_tok);
    w[5] = 0;
    cr_assert_eq(codec_table_calibrate(&u, x, 2, n_tok, w, &err), -1);
    cr_assert(strstr(err.msg, "weight"), "%s", err.msg);
    free(y);
    free(buf);
    free(y0);
    free(x);
    codec_table_free(&t);
    codec_table_free(&u);
}

Test(codec, table_save_and_load) {
    codec_table t, u;
    make_table(&t, 2, 8, 20, 5, 4);
    char *dir = tmpdir_create("codec_test.");
    char path[256];
    snprintf(path, sizeof path, "%s/model.kvcodec", dir);
    kv_error err = {{0}};
    cr_assert_eq(codec_table_save(&t, path, &err), 0, "%s", err.msg);
    cr_assert_eq(codec_table_save(&t, path, &err), 0, "%s", err.msg); /* replaces */
    cr_assert_eq(codec_table_load(&u, path, t.model_id, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(u.id, t.id, 32), 0);
    codec_table_free(&u);
    uint8_t other[32];
    model_id_fill(other, 9);
    cr_assert_eq(codec_table_load(&u, path, other, &err), -1);
    cr_assert(strstr(err.msg, path), "%s", err.msg);
    char missing[300];
    snprintf(missing, sizeof missing, "%s/none.kvcodec", dir);
    cr_assert_eq(codec_table_load(&u, missing, t.model_id, &err), -1);
    snprintf(missing, sizeof missing, "%s/no/such/dir.kvcodec", dir);
    cr_assert_eq(codec_table_save(&t, missing, &err), -1);
    /* nothing but the table is left beside it */
    char cmd[600];
    snprintf(cmd, sizeof cmd, "test $(ls -A %s | wc -l) -eq 1", dir);
    cr_assert_eq(system(cmd), 0, "temporary files left in %s", dir);
    free(dir);
    codec_table_free(&t);
}
