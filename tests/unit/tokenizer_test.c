/* Tokenizer tests: token ids identical to llama.cpp (llama-cpp-python) on the goldens of
 * scripts/ref/make_tokenizer_goldens.py, round trips, incremental detokenization, special ids,
 * and the loader's handling of corrupt metadata. Run from the repository root. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/grammar/grammar.h"
#include "model/tokenizer/tokenizer.h"
#include "model/tokenizer/unicode.h"

#define GOLDEN "tests/golden/tokenizer/"
#define SMOLLM "models/SmolLM2-135M-Instruct.Q4_1.gguf"

typedef struct loaded {
    gguf_file *g;
    tokenizer *t;
} loaded;

static loaded load(const char *path) {
    kv_error err = {{0}};
    loaded l = {gguf_open(path, &err), NULL};
    cr_assert(l.g != NULL, "gguf_open(%s): %s", path, err.msg);
    l.t = tokenizer_create(l.g, &err);
    cr_assert(l.t != NULL, "tokenizer_create(%s): %s", path, err.msg);
    return l;
}

static void unload(loaded *l) {
    tokenizer_destroy(l->t);
    gguf_close(l->g);
}

/* ---------------------------------------------------------------- goldens */

typedef struct golden {
    char *text;
    size_t len;
    char *decoded; /* llama.cpp's pieces of the ids joined (special rendered) */
    size_t decoded_len;
    bool special;
    int32_t *ids;
    size_t n_ids;
} golden;

static golden *read_goldens(const char *path, size_t *n_out) {
    FILE *f = fopen(path, "r");
    cr_assert(f != NULL, "cannot open %s", path);
    golden *v = NULL;
    size_t n = 0, cap = 0;
    char *line = NULL;
    size_t line_cap = 0;
    while (getline(&line, &line_cap, f) > 0) {
        json_error_t jerr;
        json_t *o = json_loads(line, JSON_ALLOW_NUL, &jerr);
        cr_assert(o != NULL, "%s:%zu: %s", path, n + 1, jerr.text);
        json_t *text = json_object_get(o, "text"), *ids = json_object_get(o, "ids");
        cr_assert(json_is_string(text) && json_is_array(ids));
        if (n == cap) {
            cap = cap ? 2 * cap : 256;
            v = realloc(v, cap * sizeof *v);
            cr_assert(v != NULL);
        }
        golden *gd = &v[n++];
        gd->len = json_string_length(text);
        gd->text = malloc(gd->len + 1);
        memcpy(gd->text, json_string_value(text), gd->len + 1);
        json_t *dec = json_object_get(o, "decoded");
        cr_assert(json_is_string(dec));
        gd->decoded_len = json_string_length(dec);
        gd->decoded = malloc(gd->decoded_len + 1);
        memcpy(gd->decoded, json_string_value(dec), gd->decoded_len + 1);
        gd->special = json_is_true(json_object_get(o, "special"));
        gd->n_ids = json_array_size(ids);
        gd->ids = malloc((gd->n_ids ? gd->n_ids : 1) * sizeof *gd->ids);
        for (size_t i = 0; i < gd->n_ids; i++) {
            gd->ids[i] = (int32_t)json_integer_value(json_array_get(ids, i));
        }
        json_decref(o);
    }
    free(line);
    fclose(f);
    *n_out = n;
    return v;
}

static void free_goldens(golden *v, size_t n) {
    for (size_t i = 0; i < n; i++) {
        free(v[i].text);
        free(v[i].decoded);
        free(v[i].ids);
    }
    free(v);
}

static void print_ids(const char *label, const int32_t *ids, size_t n) {
    fprintf(stderr, "  %s (%zu):", label, n);
    for (size_t i = 0; i < n && i < 40; i++) fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, n > 40 ? " ...\n" : "\n");
}

/* Every golden string encodes to the reference ids; returns how many did. */
static void check_ids(const char *gguf_path, const char *jsonl) {
    loaded l = load(gguf_path);
    size_t n;
    golden *gv = read_goldens(jsonl, &n);
    size_t ok = 0;
    for (size_t i = 0; i < n; i++) {
        kv_error err = {{0}};
        int32_t *ids = NULL;
        int got = tokenizer_encode(l.t, gv[i].text, gv[i].len, false, gv[i].special, &ids, &err);
        cr_assert(got >= 0, "%s line %zu: %s", jsonl, i + 1, err.msg);
        if ((size_t)got == gv[i].n_ids && memcmp(ids, gv[i].ids, gv[i].n_ids * 4) == 0) {
            ok++;
        } else if (i - ok < 5) {
            fprintf(stderr, "%s line %zu (special=%d) differs: %.80s\n", jsonl, i + 1,
                    gv[i].special, gv[i].text);
            print_ids("want", gv[i].ids, gv[i].n_ids);
            print_ids("got ", ids, (size_t)got);
        }
        free(ids);
    }
    fprintf(stderr, "%s: %zu/%zu match\n", jsonl, ok, n);
    cr_expect_eq(ok, n, "%s: %zu/%zu match", jsonl, ok, n);
    free_goldens(gv, n);
    unload(&l);
}

Test(tokenizer_golden, smollm2) { check_ids(SMOLLM, GOLDEN "smollm2.jsonl"); }
Test(tokenizer_golden, spm_tiny) { check_ids(GOLDEN "spm_tiny.gguf", GOLDEN "spm_tiny.jsonl"); }
Test(tokenizer_golden, bpe_llama3) {
    check_ids(GOLDEN "bpe_llama_bpe.gguf", GOLDEN "bpe_llama_bpe.jsonl");
}
Test(tokenizer_golden, bpe_default) {
    check_ids(GOLDEN "bpe_default.gguf", GOLDEN "bpe_default.jsonl");
}
Test(tokenizer_golden, bpe_gpt2) { check_ids(GOLDEN "bpe_gpt_2.gguf", GOLDEN "bpe_gpt_2.jsonl"); }

/* ---------------------------------------------------------------- meta: ids, EOG, pieces */

/* FNV-1a 64 over each token's piece length (u32 little-endian) and bytes, as the script. */
static uint64_t pieces_hash(const tokenizer *t, bool render_special) {
    uint64_t h = 0xCBF29CE484222325ull;
    size_t cap = tokenizer_max_token_len(t) + 1;
    char *buf = malloc(cap);
    for (int32_t id = 0; id < tokenizer_n_vocab(t); id++) {
        int n = tokenizer_token_bytes(t, id, render_special, buf, cap);
        cr_assert(n >= 0 && (size_t)n < cap);
        uint8_t len[4] = {(uint8_t)n, (uint8_t)(n >> 8), (uint8_t)(n >> 16), (uint8_t)(n >> 24)};
        for (int k = 0; k < 4; k++) h = (h ^ len[k]) * 0x100000001B3ull;
        for (int k = 0; k < n; k++) h = (h ^ (uint8_t)buf[k]) * 0x100000001B3ull;
    }
    free(buf);
    return h;
}

static void check_meta(const char *gguf_path, const char *meta_path) {
    loaded l = load(gguf_path);
    json_error_t jerr;
    json_t *m = json_load_file(meta_path, 0, &jerr);
    cr_assert(m != NULL, "%s: %s", meta_path, jerr.text);
    const tokenizer *t = l.t;
    cr_expect_eq(tokenizer_n_vocab(t), json_integer_value(json_object_get(m, "n_vocab")));
    cr_expect_eq(tokenizer_bos(t), json_integer_value(json_object_get(m, "bos")));
    cr_expect_eq(tokenizer_eos(t), json_integer_value(json_object_get(m, "eos")));
    cr_expect_eq(tokenizer_add_bos(t), json_is_true(json_object_get(m, "add_bos")));

    json_t *eog = json_object_get(m, "eog");
    size_t n_eog = 0;
    for (int32_t id = 0; id < tokenizer_n_vocab(t); id++) {
        if (!tokenizer_is_eog(t, id)) continue;
        bool listed = false;
        for (size_t k = 0; k < json_array_size(eog); k++) {
            listed |= json_integer_value(json_array_get(eog, k)) == id;
        }
        cr_expect(listed, "%s: token %d (%s) is EOG here, not in llama.cpp", meta_path, id,
                  tokenizer_token_text(t, id));
        n_eog++;
    }
    cr_expect_eq(n_eog, json_array_size(eog), "%s: %zu EOG tokens, llama.cpp has %zu", meta_path,
                 n_eog, json_array_size(eog));

    char want[32];
    snprintf(want, sizeof want, "%016llx", (unsigned long long)pieces_hash(t, true));
    cr_expect_str_eq(want, json_string_value(json_object_get(m, "pieces_fnv1a64_special")),
                     "%s: token pieces (special) differ from llama_token_to_piece", meta_path);
    snprintf(want, sizeof want, "%016llx", (unsigned long long)pieces_hash(t, false));
    cr_expect_str_eq(want, json_string_value(json_object_get(m, "pieces_fnv1a64_plain")),
                     "%s: token pieces (plain) differ from llama_token_to_piece", meta_path);
    json_decref(m);
    unload(&l);
}

Test(tokenizer_meta, smollm2) { check_meta(SMOLLM, GOLDEN "smollm2_meta.json"); }
Test(tokenizer_meta, spm_tiny) { check_meta(GOLDEN "spm_tiny.gguf", GOLDEN "spm_tiny_meta.json"); }
Test(tokenizer_meta, bpe_llama3) {
    check_meta(GOLDEN "bpe_llama_bpe.gguf", GOLDEN "bpe_llama_bpe_meta.json");
}

/* ---------------------------------------------------------------- round trips, detok */

static bool utf8_ok(const char *s, size_t n) { return utf8_validate((const uint8_t *)s, n) == n; }

/* Decoding the reference ids gives llama.cpp's text, which is s itself (decode(encode(s)) == s)
 * except where the vocabulary lacks a byte (SmolLM2 has no token for 0x1D); and pushing the ids
 * one by one gives the same text as decoding them at once, in pieces that are each valid UTF-8. */
static void check_round_trip(const char *gguf_path, const char *jsonl) {
    loaded l = load(gguf_path);
    size_t n;
    golden *gv = read_goldens(jsonl, &n);
    size_t cap = 16 + 3 * tokenizer_max_token_len(l.t);
    char *chunk = malloc(cap);
    size_t n_trip = 0;
    for (size_t i = 0; i < n; i++) {
        kv_error err = {{0}};
        size_t len;
        char *s = tokenizer_decode(l.t, gv[i].ids, gv[i].n_ids, true, &len, &err);
        cr_assert(s != NULL, "%s", err.msg);
        cr_expect(len == gv[i].decoded_len && memcmp(s, gv[i].decoded, len) == 0,
                  "%s line %zu: decode gives '%.60s', llama.cpp '%.60s'", jsonl, i + 1, s,
                  gv[i].decoded);
        if (!gv[i].special && len == gv[i].len && memcmp(s, gv[i].text, len) == 0) n_trip++;
        free(s);
        char *full = tokenizer_decode(l.t, gv[i].ids, gv[i].n_ids, false, &len, &err);
        cr_assert(full != NULL, "%s", err.msg);
        cr_expect(utf8_ok(full, len));
        detok_state st;
        detok_init(&st);
        char *inc = malloc(len + 8);
        size_t at = 0;
        for (size_t k = 0; k <= gv[i].n_ids; k++) {
            int w = k < gv[i].n_ids ? detok_push(l.t, &st, gv[i].ids[k], chunk, cap)
                                    : detok_flush(&st, chunk, cap);
            cr_assert(w >= 0, "%s line %zu: detok_push failed", jsonl, i + 1);
            cr_assert(utf8_ok(chunk, (size_t)w), "%s line %zu: invalid UTF-8 out of token %zu",
                      jsonl, i + 1, k);
            cr_assert(at + (size_t)w <= len, "%s line %zu: detok longer than decode", jsonl, i + 1);
            memcpy(inc + at, chunk, (size_t)w);
            at += (size_t)w;
        }
        cr_expect(at == len && memcmp(inc, full, len) == 0,
                  "%s line %zu: incremental detok differs from decode", jsonl, i + 1);
        free(inc);
        free(full);
    }
    size_t n_plain = 0;
    for (size_t i = 0; i < n; i++) n_plain += !gv[i].special;
    fprintf(stderr, "%s: decode(encode(s)) == s for %zu/%zu strings\n", jsonl, n_trip, n_plain);
    cr_expect_geq(n_trip + 1, n_plain, "more than one string fails the round trip");
    free(chunk);
    free_goldens(gv, n);
    unload(&l);
}

Test(tokenizer_decode, smollm2_round_trip) { check_round_trip(SMOLLM, GOLDEN "smollm2.jsonl"); }
Test(tokenizer_decode, spm_round_trip) {
    check_round_trip(GOLDEN "spm_tiny.gguf", GOLDEN "spm_tiny.jsonl");
}
Test(tokenizer_decode, bpe_llama3_round_trip) {
    check_round_trip(GOLDEN "bpe_llama_bpe.gguf", GOLDEN "bpe_llama_bpe.jsonl");
}

static int encode(const tokenizer *t, const char *s, bool bos, bool special, int32_t **ids) {
    kv_error err = {{0}};
    int n = tokenizer_encode(t, s, strlen(s), bos, special, ids, &err);
    cr_assert(n >= 0, "encode '%s': %s", s, err.msg);
    return n;
}

/* An emoji is four bytes spread over several byte-level tokens: nothing comes out until the
 * last one, then the whole char. */
Test(tokenizer_decode, detok_holds_split_chars) {
    loaded l = load(SMOLLM);
    int32_t *ids;
    int n = encode(l.t, "\xF0\x9F\x98\x80", false, false, &ids);
    cr_assert_gt(n, 1, "the emoji should take several tokens");
    detok_state st;
    detok_init(&st);
    char buf[64];
    for (int i = 0; i < n - 1; i++) cr_expect_eq(detok_push(l.t, &st, ids[i], buf, sizeof buf), 0);
    cr_expect_eq(detok_push(l.t, &st, ids[n - 1], buf, sizeof buf), 4);
    cr_expect(memcmp(buf, "\xF0\x9F\x98\x80", 4) == 0);
    cr_expect_eq(detok_flush(&st, buf, sizeof buf), 0);
    free(ids);

    /* a lone continuation byte (GPT-2 char U+0122 stands for 0x80) can never be valid */
    int32_t cont = tokenizer_find(l.t, "\xC4\xA2");
    cr_assert_geq(cont, 0);
    cr_expect_eq(detok_push(l.t, &st, cont, buf, sizeof buf), 3);
    cr_expect(memcmp(buf, UTF8_REPLACEMENT, 3) == 0);
    /* a lead byte (U+00F0 stands for 0xF0) held, then broken by 'a' */
    int32_t lead = tokenizer_find(l.t, "\xC3\xB0");
    int32_t a = tokenizer_find(l.t, "a");
    cr_assert(lead >= 0 && a >= 0);
    cr_expect_eq(detok_push(l.t, &st, lead, buf, sizeof buf), 0);
    cr_expect_eq(detok_push(l.t, &st, a, buf, sizeof buf), 4);
    cr_expect(memcmp(buf, UTF8_REPLACEMENT "a", 4) == 0);
    /* a held lead byte at the end becomes U+FFFD on flush */
    cr_expect_eq(detok_push(l.t, &st, lead, buf, sizeof buf), 0);
    cr_expect_eq(detok_flush(&st, buf, 2), -1, "too small a buffer is refused");
    cr_expect_eq(detok_flush(&st, buf, sizeof buf), 3);
    /* control tokens print nothing; out-of-range ids are refused */
    cr_expect_eq(detok_push(l.t, &st, 2, buf, sizeof buf), 0);
    cr_expect_eq(detok_push(l.t, &st, -1, buf, sizeof buf), -1);
    cr_expect_eq(detok_push(l.t, &st, tokenizer_n_vocab(l.t), buf, sizeof buf), -1);
    /* a buffer too small leaves the state as it was */
    int32_t hello = tokenizer_find(l.t, "Hello");
    cr_assert_geq(hello, 0);
    cr_expect_eq(detok_push(l.t, &st, hello, buf, 3), -1);
    cr_expect_eq(detok_push(l.t, &st, hello, buf, sizeof buf), 5);
    unload(&l);
}

/* SentencePiece: the space encoding put in front is dropped from the first piece. */
Test(tokenizer_decode, spm_leading_space) {
    loaded l = load(GOLDEN "spm_tiny.gguf");
    int32_t *ids;
    int n = encode(l.t, "hello world", true, false, &ids);
    cr_assert_gt(n, 1);
    cr_expect_eq(ids[0], tokenizer_bos(l.t));
    kv_error err;
    size_t len;
    char *s = tokenizer_decode(l.t, ids, (size_t)n, false, &len, &err);
    cr_expect_str_eq(s, "hello world");
    free(s);
    detok_state st;
    detok_init(&st);
    char buf[256], out[64] = {0};
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        int w = detok_push(l.t, &st, ids[i], buf, sizeof buf);
        cr_assert(w >= 0);
        memcpy(out + at, buf, (size_t)w);
        at += (size_t)w;
    }
    cr_expect_str_eq(out, "hello world");
    free(ids);
    unload(&l);
}

/* Where each token starts in the text it encodes: byte-level BPE spells the text exactly (a
 * BOS the encoding added spans nothing); SentencePiece's added space does not, so no map. */
Test(tokenizer_decode, token_starts) {
    loaded l = load(SMOLLM);
    const char *text = "<|im_start|>user\nHello, wörld.When<|im_end|>";
    size_t len = strlen(text);
    int32_t *ids;
    int n = encode(l.t, text, true, true, &ids);
    cr_assert_gt(n, 6);
    size_t starts[64];
    cr_assert(tokenizer_token_starts(l.t, ids, n, true, text, len, starts));
    cr_expect_eq(starts[0], 0, "the added BOS");
    cr_expect_eq(starts[1], 0, "<|im_start|>");
    cr_expect_eq(starts[2], 12);
    char piece[64];
    for (int i = 2; i < n; i++) {
        int w = tokenizer_token_bytes(l.t, ids[i], true, piece, sizeof piece);
        size_t end = i + 1 < n ? starts[i + 1] : len;
        cr_expect_eq(end - starts[i], (size_t)w, "token %d spans its bytes", i);
        cr_expect(memcmp(text + starts[i], piece, (size_t)w) == 0);
    }
    cr_expect_not(tokenizer_token_starts(l.t, ids, n, true, text, len - 1, starts),
                  "text too short");
    cr_expect_not(tokenizer_token_starts(l.t, ids, n, false, text, len, starts),
                  "SmolLM2's BOS is <|im_start|>: counted as text, the rest is off by one token");
    cr_expect_not(tokenizer_token_starts(l.t, ids + 2, n - 2, false, text, len, starts),
                  "the tokens must cover the text from its first byte");
    free(ids);
    unload(&l);
    l = load(GOLDEN "spm_tiny.gguf");
    n = encode(l.t, "hello world", true, false, &ids);
    cr_expect_not(tokenizer_token_starts(l.t, ids, n, true, "hello world", 11, starts));
    free(ids);
    unload(&l);
}

/* ---------------------------------------------------------------- special ids */

Test(tokenizer_special, smollm2_ids) {
    loaded l = load(SMOLLM);
    const tokenizer *t = l.t;
    cr_expect_eq(tokenizer_n_vocab(t), 49152);
    cr_expect_eq(tokenizer_bos(t), 1);
    cr_expect_eq(tokenizer_eos(t), 2);
    cr_expect_not(tokenizer_add_bos(t));
    cr_expect_not(tokenizer_add_eos(t));
    cr_expect_eq(tokenizer_find(t, "<|im_end|>"), 2);
    cr_expect_eq(tokenizer_find(t, "<|im_start|>"), 1);
    cr_expect_eq(tokenizer_find(t, "no such token \x01"), -1);
    cr_expect(tokenizer_is_eog(t, 2), "<|im_end|> ends generation");
    cr_expect(tokenizer_is_eog(t, 0), "<|endoftext|> ends generation");
    cr_expect_not(tokenizer_is_eog(t, 1));
    cr_expect_not(tokenizer_is_eog(t, -1));
    cr_expect_not(tokenizer_is_eog(t, 49152));
    cr_expect_str_eq(tokenizer_token_text(t, 2), "<|im_end|>");
    cr_expect_null(tokenizer_token_text(t, -1));
    cr_expect_null(tokenizer_token_text(t, 49152));

    char buf[32];
    cr_expect_eq(tokenizer_token_bytes(t, 2, false, buf, sizeof buf), 0);
    cr_expect_eq(tokenizer_token_bytes(t, 2, true, buf, sizeof buf), 10);
    cr_expect(memcmp(buf, "<|im_end|>", 10) == 0);
    cr_expect_eq(tokenizer_token_bytes(t, 2, true, buf, 4), 10, "full length, like snprintf");
    cr_expect_eq(tokenizer_token_bytes(t, -3, true, buf, sizeof buf), -1);

    int32_t *ids;
    int n = encode(t, "<|im_start|>user", true, true, &ids);
    cr_expect_eq(n, 3);
    cr_expect_eq(ids[0], 1, "BOS first");
    cr_expect_eq(ids[1], 1, "<|im_start|> as one token");
    free(ids);
    n = encode(t, "<|im_start|>user", false, false, &ids);
    cr_expect_gt(n, 3, "without parse_special the text is plain");
    free(ids);
    n = encode(t, "", true, false, &ids);
    cr_expect_eq(n, 1);
    free(ids);
    n = encode(t, "", false, false, &ids);
    cr_expect_eq(n, 0);
    cr_expect_not_null(ids);
    free(ids);
    unload(&l);
}

/* ---------------------------------------------------------------- errors */

Test(tokenizer_errors, invalid_utf8_rejected) {
    loaded l = load(SMOLLM);
    static const char *bad[] = {
        "\xFF",
        "abc\xC3",
        "\xC3(",
        "\xED\xA0\x80 surrogate",
        "\xC0\xAF",
        "\xE0\x80\xAF",
        "\xF4\x90\x80\x80",
        "\xF8\x88\x80\x80\x80",
        "ok \x80 cont",
        "emoji \xF0\x9F\x98",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_error err = {{0}};
        int32_t *ids = (int32_t *)&err; /* must be reset to NULL */
        int n = tokenizer_encode(l.t, bad[i], strlen(bad[i]), false, true, &ids, &err);
        cr_expect_eq(n, -1, "case %zu accepted", i);
        cr_expect_null(ids);
        cr_expect(strstr(err.msg, "UTF-8") != NULL, "case %zu: %s", i, err.msg);
    }
    unload(&l);
}

static void expect_rejected(const char *path, const char *why) {
    kv_error err = {{0}};
    gguf_file *g = gguf_open(path, &err);
    if (!g) return; /* refused by the reader already: also fine */
    tokenizer *t = tokenizer_create(g, &err);
    cr_expect_null(t, "%s (%s) was accepted", path, why);
    cr_expect_neq(err.msg[0], '\0', "%s: no error message", path);
    tokenizer_destroy(t);
    gguf_close(g);
}

Test(tokenizer_errors, corrupt_fixtures) {
    expect_rejected(GOLDEN "bad_merge_missing.gguf", "merge result not a token");
    expect_rejected(GOLDEN "bad_merge_nospace.gguf", "merge without separator");
    expect_rejected(GOLDEN "bad_merges_absent.gguf", "gpt2 without merges");
    expect_rejected(GOLDEN "bad_bos_range.gguf", "bos id out of range");
    expect_rejected(GOLDEN "bad_eos_range.gguf", "eos id out of range");
    expect_rejected(GOLDEN "bad_eot_range.gguf", "eot id out of range");
    expect_rejected(GOLDEN "bad_types_len.gguf", "token_type length");
    expect_rejected(GOLDEN "bad_type_value.gguf", "token type 9");
    expect_rejected(GOLDEN "bad_model.gguf", "unknown tokenizer model");
    expect_rejected(GOLDEN "bad_spm_scores_len.gguf", "scores length");
    expect_rejected(GOLDEN "bad_spm_byte.gguf", "byte token text");
    expect_rejected(GOLDEN "bad_empty_vocab.gguf", "no tokens");
}

static uint8_t *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    cr_assert(f != NULL);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)n);
    cr_assert(fread(buf, 1, (size_t)n, f) == (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static uint8_t *find_bytes(uint8_t *hay, size_t n, const void *needle, size_t m) {
    return memmem(hay, n, needle, m);
}

/* The real model's buffer, doctored in place: a BOS id past the vocabulary and a merge whose
 * separator is gone must both be refused. */
Test(tokenizer_errors, doctored_model_buffer) {
    size_t len;
    uint8_t *buf = read_file(SMOLLM, &len);
    kv_error err = {{0}};

    /* key string, then type u32 (4), then the value */
    static const char key[] = "tokenizer.ggml.bos_token_id";
    uint8_t *k = find_bytes(buf, len, key, sizeof key - 1);
    cr_assert_not_null(k);
    uint8_t *val = k + sizeof key - 1 + 4;
    uint8_t saved[4];
    memcpy(saved, val, 4);
    memset(val, 0xFF, 4);
    gguf_file *g = gguf_open_memory(buf, len, &err);
    cr_assert_not_null(g, "%s", err.msg);
    cr_expect_null(tokenizer_create(g, &err), "bos id 0xFFFFFFFF accepted");
    gguf_close(g);
    memcpy(val, saved, 4);

    /* the first merge, "Ġ t" (U+0120 is C4 A0), loses its space */
    uint8_t *m = find_bytes(buf, len, "\xC4\xA0 t", 4);
    cr_assert_not_null(m);
    m[2] = 'x';
    g = gguf_open_memory(buf, len, &err);
    cr_assert_not_null(g, "%s", err.msg);
    tokenizer *t = tokenizer_create(g, &err);
    cr_expect_null(t, "a merge without separator accepted");
    cr_expect(strstr(err.msg, "merge") != NULL, "%s", err.msg);
    tokenizer_destroy(t);
    gguf_close(g);
    free(buf);
}

Test(tokenizer_errors, decode_out_of_range) {
    loaded l = load(SMOLLM);
    kv_error err = {{0}};
    size_t len;
    int32_t ids[] = {1, 49152};
    cr_expect_null(tokenizer_decode(l.t, ids, 2, true, &len, &err));
    cr_expect(strstr(err.msg, "out of range") != NULL);
    unload(&l);
}

/* ---------------------------------------------------------------- speed (reported only) */

/* A long English text: the golden prose, code and contractions (the first 160 lines of the
 * SmolLM2 goldens), repeated to about 64 KB. Prints tokens per second; asserts nothing. */
Test(tokenizer_speed, encode_english, .timeout = 60) {
    uint64_t t_load = clock_now_ns();
    loaded l = load(SMOLLM);
    t_load = clock_now_ns() - t_load;
    size_t n;
    golden *gv = read_goldens(GOLDEN "smollm2.jsonl", &n);
    size_t cap = 70000, at = 0;
    char *text = malloc(cap);
    for (size_t i = 0; at < 65536; i = (i + 1) % 160) {
        if (gv[i].special || at + gv[i].len + 1 >= cap) continue;
        memcpy(text + at, gv[i].text, gv[i].len);
        at += gv[i].len;
        text[at++] = ' ';
    }
    kv_error err;
    int32_t *ids;
    int n_tok = 0;
    uint64_t best = UINT64_MAX;
    for (int rep = 0; rep < 5; rep++) {
        uint64_t t0 = clock_now_ns();
        n_tok = tokenizer_encode(l.t, text, at, false, true, &ids, &err);
        uint64_t dt = clock_now_ns() - t0;
        cr_assert_gt(n_tok, 0, "%s", err.msg);
        free(ids);
        if (dt < best) best = dt;
    }
    fprintf(stderr,
            "tokenizer speed: %zu bytes -> %d tokens in %.2f ms: %.2f M tokens/s (%.2f ms per 4K "
            "tokens); loading the SmolLM2 tokenizer took %.1f ms\n",
            at, n_tok, best / 1e6, n_tok / (best / 1e9) / 1e6, best / 1e6 * 4096.0 / n_tok,
            t_load / 1e6);
    free(text);
    free_goldens(gv, n);
    unload(&l);
}

/* A tool format's call marker that the vocabulary holds as a control token decodes to its text
 * once made so (SmolLM2's <|im_start|> stands in for Mistral's [TOOL_CALLS]); encoding does not
 * change, and a grammar over the vocabulary can then ask for the token. */
Test(tokenizer, a_control_marker_rendered_as_text) {
    loaded l = load(SMOLLM);
    int32_t id = tokenizer_find(l.t, "<|im_start|>");
    cr_assert_geq(id, 0);
    char buf[64];
    cr_assert_eq(tokenizer_token_bytes(l.t, id, false, buf, sizeof buf), 0, "hidden at first");
    int32_t *before = NULL, *after = NULL;
    kv_error err = {{0}};
    const char *text = "<|im_start|>user";
    int n0 = tokenizer_encode(l.t, text, strlen(text), false, false, &before, &err);
    cr_assert_gt(n0, 2, "%s", err.msg);
    cr_assert_eq(tokenizer_render_as_text(l.t, "<|im_start|>"), id);
    cr_assert_eq(tokenizer_render_as_text(l.t, "user"), -1, "a normal token is left as it is");
    cr_assert_eq(tokenizer_render_as_text(l.t, "<|no such token|>"), -1);
    cr_assert_eq(tokenizer_token_bytes(l.t, id, false, buf, sizeof buf), 12);
    cr_assert_eq(memcmp(buf, "<|im_start|>", 12), 0);
    int n1 = tokenizer_encode(l.t, text, strlen(text), false, false, &after, &err);
    cr_assert_eq(n1, n0);
    cr_assert_eq(memcmp(before, after, sizeof(int32_t) * (size_t)n0), 0, "encoding unchanged");
    int32_t ids[2] = {id, tokenizer_find(l.t, "user")};
    size_t len = 0;
    char *dec = tokenizer_decode(l.t, ids, 2, false, &len, &err);
    cr_assert_str_eq(dec, "<|im_start|>user");
    free(dec);

    const char *gbnf = "root ::= \"<|im_start|>\" [a-z]+";
    grammar *g = grammar_parse(gbnf, strlen(gbnf), &err);
    cr_assert_not_null(g, "%s", err.msg);
    grammar_vocab *v = grammar_vocab_create(l.t, &err);
    cr_assert_not_null(v, "%s", err.msg);
    gmatch *m = gmatch_create(g, v, &err);
    cr_assert_not_null(m, "%s", err.msg);
    const uint64_t *mask = gmatch_mask(m, gmatch_start(m), &err);
    cr_assert_not_null(mask, "%s", err.msg);
    cr_assert(mask[id / 64] >> (id % 64) & 1, "the grammar may take the control token");
    int32_t st = gmatch_accept_token(m, gmatch_start(m), id);
    cr_assert_geq(st, 0);
    cr_assert_geq(gmatch_accept_token(m, st, ids[1]), 0);
    gmatch_destroy(m);
    grammar_vocab_destroy(v);
    grammar_destroy(g);
    free(before);
    free(after);
    unload(&l);
}
