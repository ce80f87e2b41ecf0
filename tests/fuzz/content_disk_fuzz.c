/* libFuzzer target for blend's content record header parser (cache/store/content_disk.h) under a
 * fixed layout (2 layers, kv_dim 8: a header of 232 bytes, layers of 32 bytes per token). Each
 * input is checked as it is (a copy of exactly size bytes, so ASan sees any read past len), and
 * again after repairs chosen by its last byte: bit 0 writes a valid magic, version and header size,
 * bit 1 the model identity and the key, bit 2 the dimensions, a token count of 1..4 and its
 * layer size, bit 3 the checksums of the layers that follow (when they do); then the header
 * checksum is recomputed, so the checks behind it are reached without guessing SHA-256. The
 * file size is the input's. Whenever a header is accepted, its fields must be in range, and
 * when the layers that follow match their checksums, re-encoding the record must give back the
 * input header byte for byte (a header has one valid encoding), and the whole-record parser must
 * accept it exactly then, with the input's layers. Any violation aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store/content_disk.h"

enum { N_LAYER = 2, KV_DIM = 8, HB = 168 + 32 * N_LAYER };

static const uint8_t *model_id(void) {
    static uint8_t id[32];
    for (int i = 0; i < 32; i++) id[i] = (uint8_t)(0xA5 ^ i);
    return id;
}

static cache_key fuzz_key(void) {
    cache_key k;
    for (int i = 0; i < 32; i++) k.b[i] = (uint8_t)(3 * i + 1);
    return k;
}

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void sha(const uint8_t *p, size_t n, uint8_t *out) {
    if (kv_sha256(p, n, out) != 0) abort();
}

static void check(const uint8_t *buf, size_t len) {
    cache_key key = fuzz_key();
    content_record_info info;
    kv_error err = {{0}};
    if (content_record_check_header(model_id(), N_LAYER, KV_DIM, buf, len, (int64_t)len, &key,
                                    &info, &err) != 0) {
        if (!err.msg[0]) abort(); /* every refusal names its reason */
        return;
    }
    size_t lb = content_record_layer_bytes(KV_DIM, info.n_tok);
    if (info.n_tok < 1 || info.n_tok > CONTENT_RECORD_MAX_TOKENS || info.pos0 < 0 ||
        len != HB + N_LAYER * lb || memcmp(info.key.b, key.b, 32) != 0)
        abort();
    content_rec *r =
        content_rec_create(N_LAYER, KV_DIM, info.n_tok, &info.key, &info.ns, info.pos0);
    if (!r) abort();
    memcpy(r->data, buf + HB, r->bytes);
    uint8_t again[HB];
    if (content_record_encode_header(model_id(), r, again) != 0) abort();
    /* the layers' checksums are the input's only when its layers match them */
    uint8_t s[32];
    bool layers_ok = true;
    for (int l = 0; l < N_LAYER; l++) {
        sha(buf + HB + (size_t)l * lb, lb, s);
        layers_ok = layers_ok && memcmp(s, buf + 168 + 32 * l, 32) == 0;
    }
    if (layers_ok && memcmp(again, buf, HB) != 0) abort();
    /* the whole-record parser (the Redis tier's) accepts exactly the inputs whose layers match */
    content_rec *whole = content_record_parse(model_id(), N_LAYER, KV_DIM, buf, len, &key, &err);
    if ((whole != NULL) != layers_ok) abort();
    if (whole && memcmp(whole->data, r->data, r->bytes) != 0) abort();
    if (whole) content_rec_unref(whole);
    content_rec_unref(r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    check(buf, size);
    if (size < HB + 1) {
        free(buf);
        return 0;
    }
    uint8_t fix = data[size - 1];
    if (fix & 1) {
        memcpy(buf, "KVSBLEND", 8);
        put_u32(buf + 8, CONTENT_RECORD_VERSION);
        put_u32(buf + 12, HB);
    }
    if (fix & 2) {
        memcpy(buf + 16, model_id(), 32);
        memcpy(buf + 48, fuzz_key().b, 32);
    }
    int n_tok = 1 + (buf[120] & 3);
    size_t lb = content_record_layer_bytes(KV_DIM, n_tok);
    if (fix & 4) {
        put_u32(buf + 112, N_LAYER);
        put_u32(buf + 116, KV_DIM);
        put_u32(buf + 120, (uint32_t)n_tok);
        buf[127] &= 0x7f; /* pos0 within range */
        put_u32(buf + 128, (uint32_t)lb);
        put_u32(buf + 132, 0);
    }
    if ((fix & 8) && size >= HB + N_LAYER * lb)
        for (int l = 0; l < N_LAYER; l++) sha(buf + HB + (size_t)l * lb, lb, buf + 168 + 32 * l);
    if (kv_sha256_2(buf, 136, buf + 168, HB - 168, buf + 136) != 0) abort();
    check(buf, size);
    free(buf);
    return 0;
}
