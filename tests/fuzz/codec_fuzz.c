/* libFuzzer target for the KV bitstream decoder and the codec table parser (cache/codec/codec.c).
 * A fixed table (2 layers, 8 channels as 2 heads of 4 dims with RoPE, 2 levels, groups of 4)
 * is calibrated once on deterministic synthetic KV, and a valid 12-token bitstream encoded
 * with it. Each input is
 *   1. given to codec_stream_info_get and codec_decode_chunk as it is (a copy of exactly size
 *      bytes, so ASan sees any read past len);
 *   2. when its last byte has any of bits 0..3 set, given again after repairs those bits choose:
 *      bit 3 starts from the valid bitstream with the input XORed into it (so the decoder's
 *      deeper checks see streams that are nearly right), bit 0 writes a valid magic, version
 *      and table id, bit 1 the table's shape, a small token count and a zero reserved field,
 *      bit 2 makes the layer lengths add up (the last layer's stream takes what is left); then
 *      the checksum is recomputed, so the checks behind it are reached without guessing
 *      SHA-256;
 *   3. when its first byte is odd, given to codec_table_parse as it is, and (last byte bit 4)
 *      XORed into a valid file of a one-layer, one-channel table with the trailing SHA-256
 *      recomputed.
 * Whenever a bitstream is accepted its header fields must be in range and decoding on one and
 * on three threads must give the same bytes; a table that parses must serialize back to the
 * input byte for byte (a table has one valid encoding). Every refusal names its
 * reason. Any violation aborts. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "cache/codec/codec.h"
#include "kernels/quant.h"

/* Decoded outputs are bounded: a header asking for more tokens is refused before decoding
 * (codec_decode_chunk itself allows up to CODEC_MAX_TOKENS). */
#define FUZZ_MAX_TOKENS 1024
#define FUZZ_LAYERS 2
#define FUZZ_CHAN 8

/* kernels/cpu/quant.c, which holds the production fp16 conversions, also holds the SIMD
 * dispatcher that clang 14 cannot build without the AVX flags (and clang's __fp16 needs a
 * compiler-rt that is not linked). F16C's conversions are what the production code matches bit
 * for bit (round to nearest even); every x86-64 CPU a fuzzer runs on has them. */
__attribute__((target("f16c"))) float fp16_to_fp32(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) uint16_t fp32_to_fp16(float f) {
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

typedef struct fuzz_state {
    codec_table table; /* the decoder's table */
    uint8_t *stream;   /* a valid bitstream under it */
    size_t stream_len;
    uint8_t *tiny; /* a valid file of a one-layer, one-channel, one-level table */
    size_t tiny_len;
    uint8_t model_id[32];
} fuzz_state;

static void fill_levels(codec_level *lv, int n) {
    memset(lv, 0, (size_t)n * sizeof *lv);
    for (int v = 0; v < n; v++) {
        lv[v].group = 4;
        for (int l = 0; l < FUZZ_LAYERS; l++)
            for (int kv = 0; kv < 2; kv++) {
                lv[v].anchor_bin[l][kv] = 0.05f * (float)(1 + 4 * v);
                lv[v].delta_bin[l][kv] = 0.2f * (float)(1 + 4 * v);
            }
    }
}

/* Deterministic KV with token-wise locality and a few outliers: [chunk][layer][kv][tok][chan]. */
static void fill_kv(float *x, int n_chunks, int n_layer, int n_tok, int n_chan) {
    uint32_t r = 12345;
    for (int k = 0; k < n_chunks; k++)
        for (int lk = 0; lk < n_layer * 2; lk++)
            for (int c = 0; c < n_chan; c++) {
                float v = (float)((c * 7 + lk * 3) % 11) - 5.0f;
                for (int t = 0; t < n_tok; t++) {
                    r = r * 1664525u + 1013904223u;
                    v += (float)((int)(r >> 24) - 128) / 512.0f;
                    float y = (r & 0xff) == 7 ? v * 300.0f : v;
                    x[(((size_t)k * n_layer * 2 + lk) * n_tok + t) * n_chan + c] = y;
                }
            }
}

static fuzz_state *fuzz_setup(void) {
    static fuzz_state st; /* built once, read-only afterwards */
    static int ready;
    if (ready) return &st;
    kv_error err = {{0}};
    for (int i = 0; i < 32; i++) st.model_id[i] = (uint8_t)(0xC0 ^ i);
    codec_level lv[2];
    fill_levels(lv, 2);
    float *x = malloc(sizeof(float) * 3 * FUZZ_LAYERS * 2 * 16 * FUZZ_CHAN);
    /* RoPE over 2 KV heads of 4 dims read by 4 query heads: keys are coded before it, so
     * every decode turns them forward */
    const float inv_freq[2] = {0.7f, 0.01f};
    float q[FUZZ_LAYERS * 4 * 4];
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) q[i] = (float)((int)(i % 5) - 2);
    if (!x || codec_table_init(&st.table, st.model_id, FUZZ_LAYERS, FUZZ_CHAN, lv, 2, &err) ||
        codec_table_set_attention(&st.table, 4, 4, 4, inv_freq, q, 4.0f, &err) ||
        (fill_kv(x, 3, FUZZ_LAYERS, 16, FUZZ_CHAN), 0) ||
        codec_table_calibrate(&st.table, x, 3, 16, NULL, &err))
        abort();
    size_t cap = codec_encode_bound(&st.table, 12);
    st.stream = malloc(cap);
    int64_t n = st.stream ? codec_encode_chunk(&st.table, 1, x, 12, 40, st.stream, cap, &err) : -1;
    if (n < 0) abort();
    st.stream_len = (size_t)n;

    codec_table tiny; /* with protection data (2 query heads of 1 dim), so its parser is reached */
    const float no_freq[1] = {0}, qmean[2] = {0.5f, -1.0f};
    if (codec_table_init(&tiny, st.model_id, 1, 1, lv, 1, &err) ||
        codec_table_set_attention(&tiny, 2, 1, 0, no_freq, qmean, 4.0f, &err) ||
        codec_table_calibrate(&tiny, x, 1, 16, NULL, &err) ||
        codec_table_serialize(&tiny, &st.tiny, &st.tiny_len, &err))
        abort();
    codec_table_free(&tiny);
    free(x);
    ready = 1;
    return &st;
}

static void put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void check_stream(const fuzz_state *st, const uint8_t *buf, size_t len) {
    const codec_table *t = &st->table;
    codec_stream_info info;
    kv_error err = {{0}};
    if (codec_stream_info_get(t, buf, len, &info, &err) != 0) {
        if (!err.msg[0]) abort();
        return;
    }
    if (info.level < 0 || info.level >= t->n_levels || info.n_tok < 1 ||
        info.n_tok > CODEC_MAX_TOKENS || info.pos0 < 0)
        abort();
    if (info.n_tok > FUZZ_MAX_TOKENS) return;
    size_t n = (size_t)t->n_layer * 2 * (size_t)info.n_tok * (size_t)t->n_chan;
    float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    if (!a || !b) abort();
    err.msg[0] = 0;
    int ra = codec_decode_chunk(t, buf, len, a, 1, &err);
    if (ra != 0 && !err.msg[0]) abort();
    int rb = codec_decode_chunk(t, buf, len, b, 3, &err);
    if (ra != rb || (ra == 0 && memcmp(a, b, n * sizeof *a) != 0)) abort();
    free(a);
    free(b);
}

static void reseal_stream(uint8_t *buf, size_t len) {
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    unsigned int n = 0;
    if (!md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1 ||
        EVP_DigestUpdate(md, buf, 56) != 1 || EVP_DigestUpdate(md, buf + 88, len - 88) != 1 ||
        EVP_DigestFinal_ex(md, buf + 56, &n) != 1)
        abort();
    EVP_MD_CTX_free(md);
}

/* Step 2: the repaired and resealed bitstream. */
static void check_repaired(const fuzz_state *st, const uint8_t *data, size_t size) {
    uint8_t flags = data[size - 1];
    size_t body = size - 1, len = body;
    if (flags & 8) len = st->stream_len;
    size_t table_end = CODEC_STREAM_HEADER + 8 * (size_t)FUZZ_LAYERS;
    if (len < table_end) return;
    uint8_t *buf = malloc(len);
    if (!buf) abort();
    if (flags & 8) {
        memcpy(buf, st->stream, len);
        for (size_t i = 0; i < body && i < len; i++) buf[i] ^= data[i];
    } else {
        memcpy(buf, data, len);
    }
    if (flags & 1) {
        memcpy(buf, "KVCG", 4);
        put_u16(buf + 4, CODEC_STREAM_VERSION);
        memcpy(buf + 8, st->table.id, 32);
    }
    if (flags & 2) {
        put_u16(buf + 40, FUZZ_LAYERS);
        put_u16(buf + 42, FUZZ_CHAN);
        put_u32(buf + 44, 1 + get_u32(buf + 44) % 64);
        put_u32(buf + 52, 0);
    }
    if (flags & 4) {
        /* Layer 0's entry as it is (clamped to fit), the last layer's stream takes the rest. */
        size_t room = len - table_end;
        uint8_t *e0 = buf + CODEC_STREAM_HEADER, *e1 = e0 + 8;
        size_t esc0 = get_u32(e0) % (room / 2 + 1);
        size_t s0 = get_u32(e0 + 4) % (room - 2 * esc0 + 1);
        size_t left = room - 2 * esc0 - s0;
        size_t esc1 = get_u32(e1) % (left / 2 + 1);
        put_u32(e0, (uint32_t)esc0);
        put_u32(e0 + 4, (uint32_t)s0);
        put_u32(e1, (uint32_t)esc1);
        put_u32(e1 + 4, (uint32_t)(left - 2 * esc1));
    }
    reseal_stream(buf, len);
    check_stream(st, buf, len);
    free(buf);
}

static void check_table(const fuzz_state *st, const uint8_t *buf, size_t len) {
    codec_table t;
    kv_error err = {{0}};
    if (codec_table_parse(&t, buf, len, st->model_id, &err) != 0) {
        if (!err.msg[0] || t.models || t.scale) abort();
        return;
    }
    uint8_t *again = NULL;
    size_t n = 0;
    if (codec_table_serialize(&t, &again, &n, &err) != 0 || n != len ||
        memcmp(again, buf, len) != 0 || memcmp(t.id, buf + len - 32, 32) != 0)
        abort();
    free(again);
    codec_table_free(&t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const fuzz_state *st = fuzz_setup();
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    check_stream(st, buf, size);
    if (size >= 1 && (data[size - 1] & 15)) check_repaired(st, data, size);
    if (size >= 1 && (data[0] & 1)) {
        check_table(st, buf, size);
        if (data[size - 1] & 16) {
            uint8_t *tb = malloc(st->tiny_len);
            if (!tb) abort();
            memcpy(tb, st->tiny, st->tiny_len);
            for (size_t i = 0; i + 1 < size && i < st->tiny_len - 32; i++) tb[i] ^= data[i + 1];
            unsigned int n = 0;
            if (EVP_Digest(tb, st->tiny_len - 32, tb + st->tiny_len - 32, &n, EVP_sha256(), NULL) !=
                1)
                abort();
            check_table(st, tb, st->tiny_len);
            free(tb);
        }
    }
    free(buf);
    return 0;
}
