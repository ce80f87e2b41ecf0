/* libFuzzer target for the rANS coder (cache/codec/rans.c). The first bytes choose up to 4 models
 * (each built from a count shape, then optionally hit with one byte of corruption and kept only
 * if rans_model_check still accepts it), a symbol count and a context sequence; the rest is
 *   1. decoded as a stream: any outcome but a crash is fine, and an accepted stream must be
 *      exactly what the encoder makes of the decoded symbols (decoding inverts encoding both
 *      ways, so a stream the decoder accepts is the canonical one);
 *   2. taken as symbols, encoded (into a fuzzer-chosen capacity, then the bound) and decoded
 *      back: any mismatch aborts.
 * Input layout (missing bytes read as 0):
 *   [0] flags: bits 0-1 n_models - 1; bit 2 contexts may be out of range; bit 3 ctx = NULL
 *   per model, 5 bytes: n_symbols - 1, shape, parameter (also the corrupting xor - 1),
 *     offset of the byte to corrupt (2 bytes LE; past the struct: none)
 *   then: n (2 bytes LE, mod 4097), ctx seed, capacity shortfall; the rest.
 * Seeds: tests/fuzz/corpus/rans_fuzz/. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec/rans.h"

#define MAX_MODELS 4
#define MAX_N 4096

typedef struct reader {
    const uint8_t *p;
    size_t left;
} reader;

static uint8_t next_byte(reader *r) {
    if (!r->left) return 0;
    r->left--;
    return *r->p++;
}

/* Counts of one of four shapes: all zero (uniform), geometric, hashed noise, one spike. */
static void make_counts(uint64_t *counts, int n, uint8_t shape, uint8_t param) {
    uint64_t h = 0x9E3779B97F4A7C15ull * (param + 1u);
    for (int s = 0; s < n; s++) {
        switch (shape & 3) {
        case 0:
            counts[s] = 0;
            break;
        case 1:
            counts[s] = (uint64_t)(1e15 * exp(-(param / 16.0) * s));
            break;
        case 2:
            h ^= h << 13, h ^= h >> 7, h ^= h << 17;
            counts[s] = h >> (shape >> 2);
            break;
        default:
            counts[s] = s == param % n ? UINT64_MAX : (uint64_t)(shape >> 2) * (s & 1);
        }
    }
}

static void encode_must_match(const uint8_t *syms, const uint32_t *ctx, size_t n,
                              const rans_model *models, size_t n_models, const uint8_t *stream,
                              size_t len) {
    size_t cap = rans_encode_bound(n);
    uint8_t *out = malloc(cap);
    kv_error err;
    int64_t got = rans_encode(syms, ctx, n, models, n_models, out, cap, &err);
    if (got < 0 || (size_t)got != len || memcmp(out, stream, len) != 0) abort();
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size};
    kv_error err;
    uint8_t flags = next_byte(&r);
    size_t n_models = 1 + (flags & 3u);
    rans_model models[MAX_MODELS];
    for (size_t k = 0; k < n_models; k++) {
        int n_sym = 1 + next_byte(&r);
        uint8_t shape = next_byte(&r), param = next_byte(&r);
        size_t off = next_byte(&r);
        off |= (size_t)next_byte(&r) << 8;
        uint64_t counts[RANS_MAX_SYMBOLS];
        make_counts(counts, n_sym, shape, param);
        if (rans_model_build(&models[k], counts, n_sym, &err) != 0) abort();
        if (rans_model_check(&models[k], &err) != 0) abort();
        /* One corrupted byte: kept only if the check passes, so the decoder is exercised with
         * every model the check lets through. */
        rans_model bad = models[k];
        if (off < sizeof bad) {
            ((uint8_t *)&bad)[off] ^= (uint8_t)(1 + param);
            if (rans_model_check(&bad, &err) == 0) models[k] = bad;
        }
    }
    size_t n = next_byte(&r);
    n = (n | (size_t)next_byte(&r) << 8) % (MAX_N + 1);
    uint64_t seed = next_byte(&r) + 1u;
    size_t shortfall = next_byte(&r);

    uint32_t *ctx = malloc((n ? n : 1) * sizeof *ctx);
    uint32_t *ctx_ok = malloc((n ? n : 1) * sizeof *ctx_ok);
    uint8_t *syms = malloc(n ? n : 1);
    int any_bad_ctx = 0;
    for (size_t i = 0; i < n; i++) {
        seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
        ctx[i] = (uint32_t)(seed % (n_models + ((flags & 4) ? 1 : 0)));
        any_bad_ctx |= ctx[i] >= n_models;
        ctx_ok[i] = ctx[i] % (uint32_t)n_models;
    }
    const uint32_t *use_ctx = (flags & 8) ? NULL : ctx;
    if (!use_ctx) any_bad_ctx = 0;

    /* 1. The rest as a stream (data's own allocation ends at data + size, so ASan sees any
     * read past len). */
    if (rans_decode(r.p, r.left, use_ctx, n, models, n_models, syms, &err) == 0) {
        if (any_bad_ctx) abort();
        for (size_t i = 0; i < n; i++)
            if (syms[i] >= models[use_ctx ? use_ctx[i] : 0].n_symbols) abort();
        encode_must_match(syms, use_ctx, n, models, n_models, r.p, r.left);
    }

    /* 2. The rest as symbols: encode, decode, compare. */
    const uint32_t *rt_ctx = (flags & 8) ? NULL : ctx_ok;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = r.left ? r.p[i % r.left] : (uint8_t)i;
        syms[i] = (uint8_t)(b % models[rt_ctx ? rt_ctx[i] : 0].n_symbols);
    }
    size_t cap = rans_encode_bound(n);
    uint8_t *out = malloc(cap);
    uint8_t *back = malloc(n ? n : 1);
    /* A short capacity either fails or (the bound being loose) produces the same stream. */
    size_t short_cap = cap > shortfall ? cap - shortfall : 0;
    int64_t len_short = rans_encode(syms, rt_ctx, n, models, n_models, out, short_cap, &err);
    int64_t len = rans_encode(syms, rt_ctx, n, models, n_models, out, cap, &err);
    if (len < RANS_STATE_BYTES || (size_t)len > cap) abort();
    if (len_short >= 0 && len_short != len) abort();
    if (len_short < 0 && (size_t)len <= short_cap) abort();
    if (rans_decode(out, (size_t)len, rt_ctx, n, models, n_models, back, &err) != 0) abort();
    if (n && memcmp(syms, back, n) != 0) abort();

    free(out);
    free(back);
    free(ctx);
    free(ctx_ok);
    free(syms);
    return 0;
}
