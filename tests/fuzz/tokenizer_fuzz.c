/* libFuzzer target for the tokenizer. The first input byte picks the mode, the rest is data:
 *
 *   bit 7 clear: text. Bit 0 picks the tokenizer (the real SmolLM2 byte-level BPE, or the tiny
 *     SentencePiece fixture), bit 1 parse_special, bit 2 add_bos. Invalid UTF-8 must be refused;
 *     valid text must encode, every id must be in range, decode(encode(text)) must give the text
 *     back (without parse_special and BOS, see round_trip_possible), and pushing the ids one by
 *     one must give exactly the whole decode, in valid UTF-8 pieces.
 *   bit 7 set: a GGUF file. tokenizer_create must refuse it cleanly or give a tokenizer that
 *     encodes and decodes a fixed string within its own vocabulary.
 *
 * Both models load once, on the first input, from the repository root (run it from there, as
 * `make fuzz` does). Seeds: tests/fuzz/corpus/tokenizer_fuzz/ (text samples and small GGUFs from
 * scripts/ref/make_tokenizer_goldens.py). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer/tokenizer.h"
#include "model/tokenizer/tokenizer_impl.h"
#include "model/tokenizer/unicode.h"

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "tokenizer_fuzz: check failed: %s (line %d)\n", #cond, __LINE__);      \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

typedef struct model {
    gguf_file *g;
    tokenizer *t;
} model;

static model load(const char *path) {
    kv_error err;
    model m = {gguf_open(path, &err), NULL};
    if (m.g) m.t = tokenizer_create(m.g, &err);
    if (!m.t) {
        fprintf(stderr, "tokenizer_fuzz: cannot load %s: %s\n", path, err.msg);
        abort();
    }
    return m;
}

/* Whether decode(encode(s)) can give s back: byte-level BPE needs a token for every byte
 * (SmolLM2 has none for 0x1D, which llama.cpp drops too); SentencePiece decodes its space mark
 * U+2581 to a space, so a literal U+2581 in the text comes back as ' '. */
static bool round_trip_possible(const tokenizer *t, const uint8_t *s, size_t n) {
    if (t->kind == TOKENIZER_KIND_SPM) return memmem(s, n, "\xE2\x96\x81", 3) == NULL;
    for (size_t i = 0; i < n; i++) {
        if (t->byte_token[s[i]] < 0) return false;
    }
    return true;
}

static void check_text(const tokenizer *t, const uint8_t *s, size_t n, bool special, bool bos) {
    kv_error err;
    int32_t *ids = NULL;
    int k = tokenizer_encode(t, (const char *)s, n, bos, special, &ids, &err);
    if (utf8_validate(s, n) != n) {
        CHECK(k == -1 && ids == NULL);
        return;
    }
    CHECK(k >= 0 && ids != NULL);
    for (int i = 0; i < k; i++) CHECK(ids[i] >= 0 && ids[i] < tokenizer_n_vocab(t));

    size_t len;
    char *back = tokenizer_decode(t, ids, (size_t)k, true, &len, &err);
    CHECK(back != NULL && back[len] == '\0');
    if (!special && !bos && round_trip_possible(t, s, n)) {
        CHECK(len == n && memcmp(back, s, n) == 0);
    }
    free(back);

    char *full = tokenizer_decode(t, ids, (size_t)k, false, &len, &err);
    CHECK(full != NULL && utf8_validate((const uint8_t *)full, len) == len);
    size_t cap = 16 + 3 * tokenizer_max_token_len(t), at = 0;
    char *chunk = malloc(cap);
    detok_state st;
    detok_init(&st);
    for (int i = 0; i <= k; i++) {
        int w = i < k ? detok_push(t, &st, ids[i], chunk, cap) : detok_flush(&st, chunk, cap);
        CHECK(w >= 0 && at + (size_t)w <= len);
        CHECK(utf8_validate((const uint8_t *)chunk, (size_t)w) == (size_t)w);
        CHECK(memcmp(full + at, chunk, (size_t)w) == 0);
        at += (size_t)w;
    }
    CHECK(at == len);
    free(chunk);
    free(full);
    free(ids);
}

static void check_gguf(const uint8_t *data, size_t size) {
    kv_error err;
    gguf_file *g = gguf_open_memory(data, size, &err);
    if (!g) return;
    tokenizer *t = tokenizer_create(g, &err);
    if (t) {
        static const char text[] = "Hello <s> world <|im_end|> 12345 \xC3\xA9\xF0\x9F\x98\x80";
        for (int mode = 0; mode < 4; mode++) {
            int32_t *ids = NULL;
            int k = tokenizer_encode(t, text, sizeof text - 1, mode & 1, mode & 2, &ids, &err);
            if (k >= 0) {
                for (int i = 0; i < k; i++) CHECK(ids[i] >= 0 && ids[i] < tokenizer_n_vocab(t));
                size_t len;
                free(tokenizer_decode(t, ids, (size_t)k, mode & 1, &len, &err));
            }
            free(ids);
        }
        for (int32_t id = 0; id < tokenizer_n_vocab(t) && id < 64; id++) {
            char buf[8];
            CHECK(tokenizer_token_bytes(t, id, true, buf, sizeof buf) >= 0);
            CHECK(tokenizer_token_text(t, id) != NULL);
            (void)tokenizer_is_eog(t, id);
        }
        tokenizer_destroy(t);
    }
    gguf_close(g);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* Loaded once and never freed: the fuzzer's process lifetime. */
    static model bpe, spm;
    if (!bpe.t) {
        bpe = load("models/SmolLM2-135M-Instruct.Q4_1.gguf");
        spm = load("tests/golden/tokenizer/spm_tiny.gguf");
    }
    if (size == 0) return 0;
    uint8_t mode = data[0];
    if (mode & 0x80) {
        check_gguf(data + 1, size - 1);
    } else {
        const tokenizer *t = (mode & 1) ? spm.t : bpe.t;
        check_text(t, data + 1, size - 1, mode & 2, mode & 4);
    }
    return 0;
}
