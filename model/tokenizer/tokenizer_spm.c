/* SentencePiece (tokenizer.ggml.model = "llama") as llama.cpp runs it (llm_tokenizer_spm):
 * spaces become U+2581 "▁", the text is cut into UTF-8 chars, and the adjacent pair whose
 * concatenation is the vocabulary entry of highest score is merged, ties to the leftmost pair,
 * until no pair is a vocabulary entry. A char left that is no vocabulary entry falls back to
 * its bytes, <0xXX> tokens (SentencePiece's byte_fallback).
 *
 * Like llama.cpp, and unlike sentencepiece itself, any vocabulary entry may be formed by a
 * merge, control and byte tokens included, and no text normalization is applied. */
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer/tokenizer_impl.h"
#include "model/tokenizer/unicode.h"

typedef struct spm_sym {
    size_t start;       /* byte offset in the escaped text */
    size_t len;         /* bytes; 0 once merged into its left neighbour */
    int32_t id;         /* vocabulary id of the text, -1 if none */
    int32_t prev, next; /* neighbours, -1 at the ends */
} spm_sym;

typedef struct spm_pair {
    float score;
    int32_t left, right;
    int32_t id;  /* the merged token */
    size_t size; /* bytes of the merged text: a mismatch later means the pair is stale */
} spm_pair;

/* Higher score first, then the leftmost pair (llama.cpp's llm_bigram_spm::comparator). */
static inline bool pair_before(const spm_pair *x, const spm_pair *y) {
    return x->score > y->score || (x->score == y->score && x->left < y->left);
}

typedef struct spm_heap {
    spm_pair *v;
    size_t n, cap;
} spm_heap;

TOKENIZER_PAIR_HEAP(spm_heap_sift, spm_pair, pair_before)

/* Grows the storage, then pushes. */
static int heap_push(spm_heap *h, spm_pair p) {
    if (h->n == h->cap) {
        size_t c = h->cap ? 2 * h->cap : 64;
        spm_pair *v = realloc(h->v, c * sizeof *v);
        if (!v) return -1;
        h->v = v;
        h->cap = c;
    }
    spm_heap_sift_push(h->v, &h->n, p);
    return 0;
}

static int try_pair(const tokenizer *t, const uint8_t *text, const spm_sym *sym, spm_heap *h,
                    int32_t l, int32_t r) {
    if (l < 0 || r < 0) return 0;
    size_t size = sym[l].len + sym[r].len;
    int32_t id = tokenizer_lookup(t, text + sym[l].start, size);
    if (id < 0) return 0;
    return heap_push(h, (spm_pair){t->score[id], l, r, id, size});
}

/* A char that is no vocabulary entry: its bytes as byte tokens. llama.cpp aborts when a byte
 * has no token; here the unknown token stands in, and without one it is an error. */
static int emit_bytes(const tokenizer *t, const uint8_t *s, size_t n, tok_ids *out, kv_error *err) {
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_token[s[i]];
        if (id < 0) id = t->unk;
        if (id < 0) {
            return kv_fail(err, "tokenizer: byte 0x%02X has no token and there is no <unk>", s[i]);
        }
        if (tok_ids_push(out, id) != 0) return kv_fail(err, "tokenizer: out of memory");
    }
    return 0;
}

int tokenizer_spm_encode(const tokenizer *t, const uint8_t *s, size_t len, bool space_prefix,
                         tok_ids *out, kv_error *err) {
    static const uint8_t ws[3] = {0xE2, 0x96, 0x81}; /* U+2581 */
    uint8_t *text = NULL;
    spm_sym *sym = NULL;
    spm_heap h = {NULL, 0, 0};
    int rc = -1;

    /* Escaped text: every ' ' (and the optional prefix) becomes "▁", 3 bytes. */
    size_t n_sp = space_prefix ? 1 : 0;
    for (size_t i = 0; i < len; i++) n_sp += s[i] == ' ';
    size_t tlen = len + 2 * n_sp + (space_prefix ? 1 : 0);
    if (len > SIZE_MAX / 4 || tlen > (size_t)INT32_MAX) {
        return kv_fail(err, "tokenizer: text too long");
    }
    text = malloc(tlen ? tlen : 1);
    if (!text) goto oom;
    size_t m = 0;
    if (space_prefix) {
        memcpy(text, ws, 3);
        m = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (s[i] == ' ') {
            memcpy(text + m, ws, 3);
            m += 3;
        } else {
            text[m++] = s[i];
        }
    }

    /* One symbol per UTF-8 char (the caller has validated the UTF-8). */
    sym = malloc((tlen ? tlen : 1) * sizeof *sym);
    if (!sym) goto oom;
    int32_t n = 0;
    for (size_t i = 0; i < tlen;) {
        uint32_t c;
        size_t k;
        if (utf8_decode(text + i, tlen - i, &c, &k) != UTF8_OK) k = 1;
        sym[n] = (spm_sym){i, k, tokenizer_lookup(t, text + i, k), n - 1, -1};
        if (n > 0) sym[n - 1].next = n;
        n++;
        i += k;
    }
    for (int32_t i = 1; i < n; i++) {
        if (try_pair(t, text, sym, &h, i - 1, i) != 0) goto oom;
    }

    while (h.n > 0) {
        spm_pair p = spm_heap_sift_pop(h.v, &h.n);
        spm_sym *l = &sym[p.left], *r = &sym[p.right];
        if (l->len == 0 || r->len == 0 || l->len + r->len != p.size) continue; /* stale */
        l->len += r->len;
        l->id = p.id;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0) sym[r->next].prev = p.left;
        if (try_pair(t, text, sym, &h, l->prev, p.left) != 0) goto oom;
        if (try_pair(t, text, sym, &h, p.left, l->next) != 0) goto oom;
    }

    for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = sym[i].next) {
        if (sym[i].id >= 0) {
            if (tok_ids_push(out, sym[i].id) != 0) goto oom;
        } else if (emit_bytes(t, text + sym[i].start, sym[i].len, out, err) != 0) {
            goto done;
        }
    }
    rc = 0;
    goto done;
oom:
    kv_fail(err, "tokenizer: out of memory");
done:
    free(text);
    free(sym);
    free(h.v);
    return rc;
}
