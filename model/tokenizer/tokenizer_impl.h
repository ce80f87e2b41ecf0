/* Internals shared by the tokenizer's files (not a public header):
 *   tokenizer.c      loading and validating tokenizer.ggml.*, special-token partition, encode
 *                    driver, decoding and incremental detokenization, the string hash table
 *   tokenizer_pre.c  the regex pre-tokenizers of byte-level BPE, written out by hand
 *   tokenizer_bpe.c  GPT-2 byte <-> char mapping, merge table, BPE merging of one word
 *   tokenizer_spm.c  SentencePiece merging by score with byte fallback
 * Reference behaviour throughout: llama.cpp's src/llama-vocab.cpp and src/unicode.cpp, which
 * wrote the GGUF fields this reads and define what a "correct" token sequence is for them. */
#ifndef KVSERVE_TOKENIZER_IMPL_H
#define KVSERVE_TOKENIZER_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/tokenizer/tokenizer.h"

/* tokenizer.ggml.token_type values (llama.cpp's llama_token_type). */
enum {
    TOKEN_TYPE_UNDEFINED = 0,
    TOKEN_TYPE_NORMAL = 1,
    TOKEN_TYPE_UNKNOWN = 2,
    TOKEN_TYPE_CONTROL = 3,
    TOKEN_TYPE_USER_DEFINED = 4,
    TOKEN_TYPE_UNUSED = 5,
    TOKEN_TYPE_BYTE = 6,
};

typedef enum tokenizer_kind {
    TOKENIZER_KIND_BPE = 0, /* tokenizer.ggml.model = "gpt2" */
    TOKENIZER_KIND_SPM = 1, /* tokenizer.ggml.model = "llama" */
} tokenizer_kind;

/* The pre-tokenizer regex chains of llama.cpp (llm_tokenizer_bpe), by tokenizer.ggml.pre. */
typedef enum pretok_kind {
    PRETOK_DEFAULT = 0,   /* "default" or missing: llama.cpp's four-regex default chain */
    PRETOK_GPT2 = 1,      /* "gpt-2" and unknown names: the GPT-2 regex */
    PRETOK_STARCODER = 2, /* "starcoder", "smollm", "refact", ...: digits apart, then GPT-2 */
    PRETOK_LLAMA3 = 3,    /* "llama-bpe", "llama3", ...: the Llama 3 regex */
} pretok_kind;

/* ---------------------------------------------------------------- string -> id table */

/* Open addressing with linear probing over token texts kept elsewhere (the tokenizer's text
 * arena): a slot holds an id and the key's hash, the text is compared through the id. */
typedef struct tokmap {
    int32_t *ids;     /* [cap] token id, -1 for an empty slot */
    uint32_t *hashes; /* [cap] high bits of the key's hash, to skip most memcmp calls */
    size_t cap;       /* power of two, at least twice the entries */
    size_t n;
} tokmap;

uint64_t tokmap_hash(const void *p, size_t n);

/* ---------------------------------------------------------------- merges (BPE) */

/* (left id, right id) -> (rank, merged id). Keys pack the two ids; an empty slot has key
 * UINT64_MAX, which no pair of non-negative int32 ids can produce. */
typedef struct merge_slot {
    uint64_t key;
    int32_t rank;
    int32_t result;
} merge_slot;

typedef struct mergemap {
    merge_slot *slots; /* [cap] */
    size_t cap;        /* power of two */
} mergemap;

static inline uint64_t mergemap_key(int32_t a, int32_t b) {
    return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
}

/* The slot of the pair, NULL when (a, b) is not a merge. */
const merge_slot *mergemap_find(const mergemap *m, int32_t a, int32_t b);

/* ---------------------------------------------------------------- the tokenizer */

struct tokenizer {
    tokenizer_kind kind;
    pretok_kind pre;
    int32_t n_vocab;

    char *text;         /* arena of every token's text, each NUL-terminated */
    size_t *text_off;   /* [n_vocab] offset of token i's text in `text` */
    uint32_t *text_len; /* [n_vocab] its length in bytes (texts may hold NUL bytes) */
    uint8_t *type;      /* [n_vocab] TOKEN_TYPE_*, after llama.cpp's adjustments */
    uint8_t *shown;     /* [n_vocab] control tokens that decode to their text, or NULL: none */
    float *score;       /* [n_vocab] SentencePiece scores, 0 when the file has none */

    uint8_t *piece;    /* arena of each token's decoded bytes (control tokens: their text) */
    size_t *piece_off; /* [n_vocab + 1] token i decodes to piece[piece_off[i] .. [i+1]) */
    size_t max_piece_len;

    tokmap vocab;    /* every token text -> id (for a duplicated text the last id, as llama.cpp) */
    mergemap merges; /* BPE only */

    /* BPE: id of the single-char token of the byte's GPT-2 char. SPM: id of <0xXX>, else of the
     * one-byte text. -1 when the vocabulary has neither. */
    int32_t byte_token[256];
    /* BPE: the GPT-2 char of each byte as UTF-8 (1 or 2 bytes). */
    uint8_t byte_char[256][2];
    uint8_t byte_char_len[256];
    int16_t char_byte[324]; /* BPE: inverse mapping, GPT-2 code point -> byte, -1 for others */

    /* Tokens matched in the text before tokenizing (control, user-defined, unknown), ordered by
     * text length, longest first, as llama.cpp's cache_special_tokens; `special_rank[id]` is
     * the position in that order, -1 for other tokens. */
    int32_t *special; /* [n_special] */
    int32_t n_special;
    int32_t n_user_defined;     /* of them, the ones matched even without parse_special */
    int32_t *special_rank;      /* [n_vocab] */
    tokmap special_map;         /* special token text -> the first id in that order */
    uint8_t special_first[256]; /* 1 when some special token text starts with the byte */
    uint32_t *special_lens;     /* distinct special text lengths, longest first */
    int32_t n_special_lens;

    uint8_t *eog; /* [n_vocab] 1 for end-of-generation tokens */

    int32_t bos, eos, unk, pad, eot, eom; /* -1 when absent */
    bool add_bos, add_eos, add_space_prefix;
    bool ignore_merges; /* Llama 3: a pre-token that is a whole vocabulary entry is not merged */
};

/* Id of the token with text s[0..n), -1 when absent. */
int32_t tokenizer_lookup(const tokenizer *t, const void *s, size_t n);

/* ---------------------------------------------------------------- growable id list */

typedef struct tok_ids {
    int32_t *v;
    size_t n, cap;
} tok_ids;

int tok_ids_push(tok_ids *a, int32_t id);

/* ---------------------------------------------------------------- per-file entry points */

/* Pre-tokenizer scratch, reused over the fragments of one encode call. */
typedef struct pretok_scratch {
    uint32_t *cp;   /* [n] code points of the fragment */
    uint8_t *fl;    /* [n] their unicode_flags */
    size_t *boff;   /* [n + 1] byte offset of each code point */
    size_t *seg[2]; /* ping-pong lists of segment ends (code point indices) */
    size_t cap;
} pretok_scratch;

void pretok_scratch_free(pretok_scratch *s);

/* Splits valid UTF-8 s[0..len) into pre-tokens; on success *ends holds *n_words end offsets
 * (bytes, increasing, the last is len) that live in the scratch. */
int pretok_split(pretok_kind pre, const uint8_t *s, size_t len, pretok_scratch *sc,
                 const size_t **ends, size_t *n_words, kv_error *err);

/* BPE merging state, reused over the words of one encode call. */
typedef struct bpe_scratch {
    void *sym;
    size_t sym_cap;
    void *heap;
    size_t heap_cap;
    uint8_t *mapped;
    size_t mapped_cap;
} bpe_scratch;

void bpe_scratch_free(bpe_scratch *s);

/* Fills byte_char/byte_token and the merge table from tokenizer.ggml.merges. */
int tokenizer_bpe_load(tokenizer *t, const gguf_file *g, kv_error *err);
/* Appends the tokens of one pre-token (raw bytes w[0..n), n >= 1). */
int tokenizer_bpe_encode_word(const tokenizer *t, const uint8_t *w, size_t n, bpe_scratch *sc,
                              tok_ids *out, kv_error *err);
/* Writes the bytes a byte-level BPE token text stands for (GPT-2 chars -> bytes; at most len
 * bytes) and returns their count. */
size_t tokenizer_bpe_unmap(const tokenizer *t, const uint8_t *text, size_t len, uint8_t *out);

/* Appends the SentencePiece tokens of one text fragment; space_prefix adds the leading space
 * llama.cpp adds to the first fragment and to fragments after a special token. */
int tokenizer_spm_encode(const tokenizer *t, const uint8_t *s, size_t len, bool space_prefix,
                         tok_ids *out, kv_error *err);

/* A binary heap over PAIR in caller-owned storage v[0..*n), ordered by BEFORE(a, b) ("a is merged
 * first"): the priority queue of the BPE and SentencePiece merge loops. Defines PREFIX_push (v has
 * room for one more) and PREFIX_pop (*n > 0). */
#define TOKENIZER_PAIR_HEAP(PREFIX, PAIR, BEFORE)                                                  \
    static void PREFIX##_push(PAIR *v, size_t *n, PAIR p) {                                        \
        size_t i = (*n)++;                                                                         \
        while (i > 0) {                                                                            \
            size_t up = (i - 1) / 2;                                                               \
            if (!BEFORE(&p, &v[up])) break;                                                        \
            v[i] = v[up];                                                                          \
            i = up;                                                                                \
        }                                                                                          \
        v[i] = p;                                                                                  \
    }                                                                                              \
    static PAIR PREFIX##_pop(PAIR *v, size_t *n) {                                                 \
        PAIR top = v[0], last = v[--(*n)];                                                         \
        size_t i = 0;                                                                              \
        for (;;) {                                                                                 \
            size_t c = 2 * i + 1;                                                                  \
            if (c >= *n) break;                                                                    \
            if (c + 1 < *n && BEFORE(&v[c + 1], &v[c])) c++;                                       \
            if (!BEFORE(&v[c], &last)) break;                                                      \
            v[i] = v[c];                                                                           \
            i = c;                                                                                 \
        }                                                                                          \
        if (*n > 0) v[i] = last;                                                                   \
        return top;                                                                                \
    }

#endif
