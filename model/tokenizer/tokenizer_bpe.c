/* Byte-level BPE (tokenizer.ggml.model = "gpt2"): GPT-2's byte <-> char mapping, the merge
 * table from tokenizer.ggml.merges, and the merging of one pre-token.
 *
 * GPT-2 (openai/gpt-2 encoder.py, bytes_to_unicode) gives every byte a printable char so that
 * token texts are readable strings: the 188 printable Latin-1 bytes stand for themselves and
 * the other 68 (controls, space, DEL, NBSP, soft hyphen) take U+0100 onwards, in byte order.
 * Merges are "left right" strings over those chars, ranked by their position in the list.
 *
 * Merging follows llama.cpp's llm_tokenizer_bpe_session: repeatedly merge the adjacent pair of
 * lowest rank, ties going to the leftmost pair, using a priority queue with lazy deletion so a
 * long word costs O(n log n). Pairs are compared by token id: the loader checks that both sides
 * and the result of every merge are vocabulary entries, so an id names the text exactly. */
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer/tokenizer_impl.h"
#include "model/tokenizer/unicode.h"

/* ---------------------------------------------------------------- byte mapping */

static bool byte_is_printable(int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* The GPT-2 code point of every byte. */
static void byte_map_build(uint32_t cp[256]) {
    uint32_t next = 256;
    for (int b = 0; b < 256; b++) cp[b] = byte_is_printable(b) ? (uint32_t)b : next++;
}

size_t tokenizer_bpe_unmap(const tokenizer *t, const uint8_t *text, size_t len, uint8_t *out) {
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t c;
        size_t k;
        utf8_status st = utf8_decode(text + i, len - i, &c, &k);
        if (st == UTF8_OK && c < 324 && t->char_byte[c] >= 0) {
            out[n++] = (uint8_t)t->char_byte[c];
        } else {
            /* Not a GPT-2 char (a broken vocabulary): keep the bytes as they are, where
             * llama.cpp writes an "[UNK_BYTE_0x..]" marker. */
            memcpy(out + n, text + i, k);
            n += k;
        }
        i += k;
    }
    return n;
}

/* ---------------------------------------------------------------- merge table */

const merge_slot *mergemap_find(const mergemap *m, int32_t a, int32_t b) {
    uint64_t key = mergemap_key(a, b);
    size_t mask = m->cap - 1;
    size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & mask;
    for (;;) {
        const merge_slot *s = &m->slots[i];
        if (s->key == key) return s;
        if (s->key == UINT64_MAX) return NULL;
        i = (i + 1) & mask;
    }
}

/* Inserts unless present: for a repeated merge the first (lowest) rank wins, as in llama.cpp's
 * bpe_ranks.emplace. */
static void mergemap_insert(mergemap *m, int32_t a, int32_t b, int32_t rank, int32_t result) {
    uint64_t key = mergemap_key(a, b);
    size_t mask = m->cap - 1;
    size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & mask;
    while (m->slots[i].key != UINT64_MAX) {
        if (m->slots[i].key == key) return;
        i = (i + 1) & mask;
    }
    m->slots[i] = (merge_slot){key, rank, result};
}

int tokenizer_bpe_load(tokenizer *t, const gguf_file *g, kv_error *err) {
    uint32_t cp_of[256];
    byte_map_build(cp_of);
    for (int c = 0; c < 324; c++) t->char_byte[c] = -1;
    for (int b = 0; b < 256; b++) {
        t->char_byte[cp_of[b]] = (int16_t)b;
        uint8_t u[4];
        int n = utf8_encode(cp_of[b], u);
        memcpy(t->byte_char[b], u, (size_t)n);
        t->byte_char_len[b] = (uint8_t)n;
        t->byte_token[b] = tokenizer_lookup(t, u, (size_t)n);
    }

    gguf_array a;
    if (!gguf_has_key(g, "tokenizer.ggml.merges")) {
        return kv_fail(err, "tokenizer: tokenizer.ggml.merges is missing (required by gpt2)");
    }
    if (gguf_get_array(g, "tokenizer.ggml.merges", &a, err) != 0) return -1;
    if (a.elem_type != GGUF_VALUE_TYPE_STRING) {
        return kv_fail(err, "tokenizer: tokenizer.ggml.merges is not a string array");
    }
    if (a.n > (uint64_t)INT32_MAX / 4) {
        return kv_fail(err, "tokenizer: %llu merges is too many", (unsigned long long)a.n);
    }
    size_t cap = 16;
    while (cap < 2 * (size_t)a.n) cap *= 2;
    t->merges.slots = malloc(cap * sizeof *t->merges.slots);
    if (!t->merges.slots) return kv_fail(err, "tokenizer: out of memory");
    t->merges.cap = cap;
    for (size_t i = 0; i < cap; i++) t->merges.slots[i].key = UINT64_MAX;

    uint8_t *cat = NULL;
    size_t cat_cap = 0;
    for (uint64_t i = 0; i < a.n; i++) {
        const char *s;
        size_t len;
        gguf_array_str(&a, i, &s, &len);
        /* "left right": the separator is the first space after the first byte (token texts
         * never hold a raw space, GPT-2 maps it to U+0120) */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp || sp + 1 == s + len) {
            free(cat);
            return kv_fail(err, "tokenizer: merge %llu ('%.*s') is not \"left right\"",
                           (unsigned long long)i, (int)(len > 64 ? 64 : len), s);
        }
        size_t nl = (size_t)(sp - s), nr = len - nl - 1;
        if (nl + nr > cat_cap) {
            size_t c2 = (nl + nr) * 2;
            uint8_t *p = realloc(cat, c2);
            if (!p) {
                free(cat);
                return kv_fail(err, "tokenizer: out of memory");
            }
            cat = p;
            cat_cap = c2;
        }
        memcpy(cat, s, nl);
        memcpy(cat + nl, sp + 1, nr);
        int32_t l = tokenizer_lookup(t, s, nl);
        int32_t r = tokenizer_lookup(t, sp + 1, nr);
        int32_t m = tokenizer_lookup(t, cat, nl + nr);
        if (l < 0 || r < 0 || m < 0) {
            free(cat);
            return kv_fail(err,
                           "tokenizer: merge %llu ('%.*s') uses a text that is not in the "
                           "vocabulary",
                           (unsigned long long)i, (int)(len > 64 ? 64 : len), s);
        }
        mergemap_insert(&t->merges, l, r, (int32_t)i, m);
    }
    free(cat);
    return 0;
}

/* ---------------------------------------------------------------- merging one word */

typedef struct bpe_sym {
    int32_t id;         /* token id, -1 for a byte whose char is not in the vocabulary */
    int32_t prev, next; /* neighbours in the word, -1 at the ends */
    uint8_t byte;       /* the raw byte, for id == -1 */
    bool alive;         /* false once merged into its left neighbour */
} bpe_sym;

typedef struct bpe_pair {
    int32_t rank;
    int32_t left, right; /* symbol indices */
    int32_t lid, rid;    /* their ids when the pair was queued: a later mismatch means stale */
    int32_t result;
} bpe_pair;

/* Lower rank first, then the leftmost pair (llama.cpp's llm_bigram_bpe::comparator). */
static inline bool pair_before(const bpe_pair *x, const bpe_pair *y) {
    return x->rank < y->rank || (x->rank == y->rank && x->left < y->left);
}

typedef struct pair_heap {
    bpe_pair *v;
    size_t n;
} pair_heap;

TOKENIZER_PAIR_HEAP(bpe_heap, bpe_pair, pair_before)

static void try_pair(const tokenizer *t, const bpe_sym *sym, pair_heap *h, int32_t l, int32_t r) {
    if (l < 0 || r < 0 || sym[l].id < 0 || sym[r].id < 0) return;
    const merge_slot *m = mergemap_find(&t->merges, sym[l].id, sym[r].id);
    if (!m) return;
    bpe_heap_push(h->v, &h->n, (bpe_pair){m->rank, l, r, sym[l].id, sym[r].id, m->result});
}

void bpe_scratch_free(bpe_scratch *s) {
    free(s->sym);
    free(s->heap);
    free(s->mapped);
    memset(s, 0, sizeof *s);
}

static int grow(void **p, size_t *cap, size_t need, size_t elem, kv_error *err) {
    return kv_array_reserve(p, cap, need, elem, 64) ? kv_fail(err, "tokenizer: out of memory") : 0;
}

/* A symbol the vocabulary cannot name: llama.cpp then looks up each byte of its text alone
 * (here: of the byte's GPT-2 char) and emits the ones it finds. */
static int emit_unknown_byte(const tokenizer *t, uint8_t byte, tok_ids *out) {
    for (int k = 0; k < t->byte_char_len[byte]; k++) {
        int32_t id = tokenizer_lookup(t, &t->byte_char[byte][k], 1);
        if (id >= 0 && tok_ids_push(out, id) != 0) return -1;
    }
    return 0;
}

int tokenizer_bpe_encode_word(const tokenizer *t, const uint8_t *w, size_t n, bpe_scratch *sc,
                              tok_ids *out, kv_error *err) {
    if (t->ignore_merges) {
        /* Llama 3: a pre-token that is itself a vocabulary entry is taken whole. */
        if (grow((void **)&sc->mapped, &sc->mapped_cap, 2 * n, 1, err) != 0) return -1;
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            memcpy(sc->mapped + m, t->byte_char[w[i]], t->byte_char_len[w[i]]);
            m += t->byte_char_len[w[i]];
        }
        int32_t id = tokenizer_lookup(t, sc->mapped, m);
        if (id >= 0) {
            if (tok_ids_push(out, id) != 0) return kv_fail(err, "tokenizer: out of memory");
            return 0;
        }
    }
    if (n == 1) {
        int32_t id = t->byte_token[w[0]];
        int rc = id >= 0 ? tok_ids_push(out, id) : emit_unknown_byte(t, w[0], out);
        return rc == 0 ? 0 : kv_fail(err, "tokenizer: out of memory");
    }
    if (n > (size_t)INT32_MAX / 4) return kv_fail(err, "tokenizer: pre-token too long");
    if (grow(&sc->sym, &sc->sym_cap, n, sizeof(bpe_sym), err) != 0) return -1;
    /* Each merge queues at most two pairs: n - 1 + 2 (n - 1) entries at most. */
    if (grow(&sc->heap, &sc->heap_cap, 3 * n, sizeof(bpe_pair), err) != 0) return -1;
    bpe_sym *sym = sc->sym;
    pair_heap h = {sc->heap, 0};
    for (size_t i = 0; i < n; i++) {
        sym[i] = (bpe_sym){t->byte_token[w[i]], (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1,
                           w[i], true};
    }
    for (size_t i = 1; i < n; i++) try_pair(t, sym, &h, (int32_t)i - 1, (int32_t)i);

    while (h.n > 0) {
        bpe_pair p = bpe_heap_pop(h.v, &h.n);
        bpe_sym *l = &sym[p.left], *r = &sym[p.right];
        if (!l->alive || !r->alive || l->next != p.right || l->id != p.lid || r->id != p.rid) {
            continue; /* one side changed since the pair was queued */
        }
        l->id = p.result;
        l->next = r->next;
        r->alive = false;
        if (r->next >= 0) sym[r->next].prev = p.left;
        try_pair(t, sym, &h, l->prev, p.left);
        try_pair(t, sym, &h, p.left, l->next);
    }

    for (int32_t i = 0; i >= 0; i = sym[i].next) {
        int rc =
            sym[i].id >= 0 ? tok_ids_push(out, sym[i].id) : emit_unknown_byte(t, sym[i].byte, out);
        if (rc != 0) return kv_fail(err, "tokenizer: out of memory");
    }
    return 0;
}
