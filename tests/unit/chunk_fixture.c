/* Chunk records for the store tiers' unit tests (chunk_fixture.h). */
#include "tests/unit/chunk_fixture.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec/chunk_codec.h"
#include "kernels/backend.h"
#include "kernels/quant.h"

void chunk_fill(cache_chunk *c, uint64_t seed) {
    uint64_t s = seed;
    for (size_t b = 0; b < c->bytes; b++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        c->data[b] = (uint8_t)(s >> 32);
    }
}

cache_chunk *chunk_coded_copy(const cache_layout *l, const codec_table *t, int enc,
                              const cache_chunk *c) {
    size_t cap = cache_enc_bound(l, t, enc, c->n_blocks);
    uint8_t *buf = malloc(cap);
    float *scratch = malloc(sizeof(float) * cache_enc_scratch_floats(l));
    cache_chunk *d = cache_chunk_create(l, c->bkeys, c->n_blocks, &c->ns, c->pos0);
    kv_error err = {{0}};
    int64_t len = cache_enc_encode(l, t, enc, c, scratch, buf, cap, &err);
    cr_assert(len > 0 && cache_enc_decode(l, t, enc, buf, (size_t)len, d, scratch, 1, &err) == 0,
              "%s", err.msg);
    free(buf);
    free(scratch);
    return d;
}

void chunk_assert_same(const cache_chunk *got, const cache_chunk *want) {
    cr_assert_not_null(got);
    cr_assert_eq(memcmp(got->key.b, want->key.b, CACHE_KEY_BYTES), 0);
    cr_assert_eq(got->n_blocks, want->n_blocks);
    cr_assert_eq(memcmp(got->bkeys, want->bkeys, sizeof(cache_key) * (size_t)want->n_blocks), 0);
    cr_assert_eq(memcmp(got->ns.b, want->ns.b, CACHE_KEY_BYTES), 0);
    cr_assert_eq(got->pos0, want->pos0);
    cr_assert_eq(got->bytes, want->bytes);
    cr_assert_eq(memcmp(got->data, want->data, want->bytes), 0, "payload differs");
}

/* xorshift64 as a uniform in (0, 1). */
static double unit(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return ((double)(*s >> 11) + 0.5) / 9007199254740992.0;
}

float chunk_kv_value(int layer, int kv, int pos, int chan, uint64_t seed) {
    uint64_t s =
        seed * 0x9E3779B97F4A7C15ull +
        (uint64_t)(((layer * 2 + kv) * 65536 + pos) * 4096 + chan) * 0xD1B54A32D192ED03ull + 1;
    for (int i = 0; i < 3; i++) unit(&s);
    double gauss = sqrt(-2 * log(unit(&s))) * cos(6.283185307179586 * unit(&s));
    double centre = 0.5 * sin(chan * 0.7 + layer), spread = 0.2 + 0.1 * ((chan + kv) % 5);
    return (float)(centre + spread * gauss);
}

/* The CPU backend, for its KV pool writer and reader (kernels/backend.h owns the block layout). */
static backend *fixture_backend(void) {
    static backend *b;
    kv_error err = {{0}};
    if (!b) b = backend_cpu_create(1, &err);
    cr_assert_not_null(b, "%s", err.msg);
    return b;
}

/* c's payload as a pool of its blocks: the layout, block table and slots of its tokens. */
static kv_layout chunk_pool(const cache_layout *l, const cache_chunk *c, int32_t *table,
                            int32_t *slots) {
    for (int b = 0; b < c->n_blocks; b++) table[b] = b;
    for (int t = 0; t < c->n_blocks * l->block_tokens; t++) slots[t] = t;
    return (kv_layout){.n_layer = l->n_layer,
                       .n_kv_head = l->n_kv_head,
                       .head_dim = l->head_dim,
                       .block_tokens = l->block_tokens,
                       .n_blocks = c->n_blocks};
}

void chunk_fill_kv(cache_chunk *c, const cache_layout *l, uint64_t seed) {
    int n = c->n_blocks * l->block_tokens, nc = l->n_kv_head * l->head_dim;
    int32_t *table = malloc(sizeof *table * (size_t)c->n_blocks),
            *slots = malloc(sizeof *slots * n);
    float *k = malloc(sizeof *k * (size_t)n * nc), *v = malloc(sizeof *v * (size_t)n * nc);
    cr_assert(table && slots && k && v);
    kv_layout kl = chunk_pool(l, c, table, slots);
    for (int ly = 0; ly < l->n_layer; ly++) {
        for (int t = 0; t < n; t++)
            for (int ch = 0; ch < nc; ch++) {
                k[(size_t)t * nc + ch] = chunk_kv_value(ly, 0, c->pos0 + t, ch, seed);
                v[(size_t)t * nc + ch] = chunk_kv_value(ly, 1, c->pos0 + t, ch, seed);
            }
        cr_assert_eq(backend_kv_store(fixture_backend(), c->data, &kl, ly, table, slots, n, k, v),
                     0);
    }
    free(table);
    free(slots);
    free(k);
    free(v);
}

void chunk_kv_rows(const cache_chunk *c, const cache_layout *l, int layer, int kv, float *out) {
    int n = c->n_blocks * l->block_tokens;
    int32_t *table = malloc(sizeof *table * (size_t)c->n_blocks),
            *slots = malloc(sizeof *slots * n);
    cr_assert(table && slots);
    kv_layout kl = chunk_pool(l, c, table, slots);
    cr_assert_eq(backend_kv_load(fixture_backend(), c->data, &kl, layer, kv, table, slots, n, out),
                 0);
    free(table);
    free(slots);
}

void chunk_codec_table(codec_table *t, const cache_layout *l, float coarse, uint64_t seed) {
    int nl = l->n_layer, nc = l->n_kv_head * l->head_dim, nt = l->chunk_tokens;
    codec_level lv[4];
    memset(lv, 0, sizeof lv);
    const float bins[4] = {0.25f, 0.5f, 1.0f, 2.0f};
    for (int v = 0; v < 4; v++)
        for (int ly = 0; ly < nl; ly++)
            for (int kv = 0; kv < 2; kv++)
                lv[v].anchor_bin[ly][kv] = lv[v].delta_bin[ly][kv] = bins[v] * coarse;
    kv_error err = {{0}};
    cr_assert_eq(codec_table_init(t, l->model_id, nl, nc, lv, 4, &err), 0, "%s", err.msg);
    size_t per = (size_t)nl * 2 * (size_t)nt * (size_t)nc;
    float *x = malloc(sizeof(float) * per * 4);
    cr_assert_not_null(x);
    for (int k = 0; k < 4; k++)
        for (int ly = 0; ly < nl; ly++)
            for (int kv = 0; kv < 2; kv++)
                for (int tk = 0; tk < nt; tk++)
                    for (int c = 0; c < nc; c++)
                        x[(size_t)k * per + (((size_t)ly * 2 + kv) * nt + tk) * nc + c] =
                            chunk_kv_value(ly, kv, k * nt + tk, c, seed);
    cr_assert_eq(codec_table_calibrate(t, x, 4, nt, NULL, &err), 0, "%s", err.msg);
    free(x);
}
