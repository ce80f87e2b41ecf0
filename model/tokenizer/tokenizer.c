/* Tokenizer: loading tokenizer.ggml.* from a GGUF file, the special-token partition of the input,
 * the encode driver over BPE / SentencePiece, and decoding (whole and incremental).
 * Overview of the files and the reference behaviour: model/tokenizer/tokenizer_impl.h. */
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer/tokenizer_impl.h"
#include "model/tokenizer/unicode.h"

/* ---------------------------------------------------------------- string -> id table */

/* 64-bit multiply-xorshift over 8-byte words: token texts are short, and this hashes one in a
 * handful of multiplies (the table is probed once per pair during encoding). */
uint64_t tokmap_hash(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0x243F6A8885A308D3ull ^ ((uint64_t)n * 0x9E3779B97F4A7C15ull);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, s, 8);
        h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
        s += 8;
        n -= 8;
    }
    if (n > 0) {
        uint64_t v = 0;
        memcpy(&v, s, n);
        h = (h ^ v) * 0x94D049BB133111EBull;
        h ^= h >> 29;
    }
    h *= 0xBF58476D1CE4E5B9ull;
    return h ^ (h >> 32);
}

static int tokmap_init(tokmap *m, size_t n_entries) {
    size_t cap = 16;
    while (cap < 2 * n_entries) cap *= 2;
    m->ids = malloc(cap * sizeof *m->ids);
    m->hashes = malloc(cap * sizeof *m->hashes);
    if (!m->ids || !m->hashes) return -1;
    for (size_t i = 0; i < cap; i++) m->ids[i] = -1;
    m->cap = cap;
    m->n = 0;
    return 0;
}

static void tokmap_free(tokmap *m) {
    free(m->ids);
    free(m->hashes);
    memset(m, 0, sizeof *m);
}

static inline bool token_text_eq(const tokenizer *t, int32_t id, const void *s, size_t n) {
    return t->text_len[id] == n && memcmp(t->text + t->text_off[id], s, n) == 0;
}

static int32_t tokmap_find(const tokmap *m, const tokenizer *t, const void *s, size_t n) {
    if (m->cap == 0) return -1;
    uint64_t h = tokmap_hash(s, n);
    uint32_t h32 = (uint32_t)(h >> 32);
    size_t mask = m->cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        int32_t id = m->ids[i];
        if (id < 0) return -1;
        if (m->hashes[i] == h32 && token_text_eq(t, id, s, n)) return id;
    }
}

/* Maps token id's text to id; an existing entry for the same text is replaced only when
 * `replace` (the table holds at most one id per text). Capacity was reserved at init. */
static void tokmap_put(tokmap *m, const tokenizer *t, int32_t id, bool replace) {
    const char *s = t->text + t->text_off[id];
    size_t n = t->text_len[id];
    uint64_t h = tokmap_hash(s, n);
    uint32_t h32 = (uint32_t)(h >> 32);
    size_t mask = m->cap - 1;
    size_t i = (size_t)h & mask;
    for (; m->ids[i] >= 0; i = (i + 1) & mask) {
        if (m->hashes[i] == h32 && token_text_eq(t, m->ids[i], s, n)) {
            if (replace) m->ids[i] = id;
            return;
        }
    }
    m->ids[i] = id;
    m->hashes[i] = h32;
    m->n++;
}

int32_t tokenizer_lookup(const tokenizer *t, const void *s, size_t n) {
    return tokmap_find(&t->vocab, t, s, n);
}

int tok_ids_push(tok_ids *a, int32_t id) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 64;
        int32_t *v = realloc(a->v, cap * sizeof *v);
        if (!v) return -1;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = id;
    return 0;
}

/* ---------------------------------------------------------------- loading */

/* An optional integer key: 0 with *present = false when absent, -1 on a wrong type. */
static int get_opt_i64(const gguf_file *g, const char *key, int64_t *v, bool *present,
                       kv_error *err) {
    *present = gguf_has_key(g, key);
    if (!*present) return 0;
    return gguf_get_i64(g, key, v, err) == 0 ? 0 : kv_fail_wrap(err, "tokenizer");
}

static int get_opt_bool(const gguf_file *g, const char *key, bool *v, kv_error *err) {
    if (!gguf_has_key(g, key)) return 0;
    return gguf_get_bool(g, key, v, err) == 0 ? 0 : kv_fail_wrap(err, "tokenizer");
}

/* An optional array of n_vocab elements; a->n == 0 when the key is absent. */
static int get_opt_vocab_array(const gguf_file *g, const char *key, int32_t n_vocab, bool floats,
                               gguf_array *a, kv_error *err) {
    memset(a, 0, sizeof *a);
    if (!gguf_has_key(g, key)) return 0;
    if (gguf_get_array(g, key, a, err) != 0) return kv_fail_wrap(err, "tokenizer");
    gguf_value_type et = a->elem_type;
    bool is_float = et == GGUF_VALUE_TYPE_FLOAT32 || et == GGUF_VALUE_TYPE_FLOAT64;
    bool is_int =
        et <= GGUF_VALUE_TYPE_INT32 || et == GGUF_VALUE_TYPE_UINT64 || et == GGUF_VALUE_TYPE_INT64;
    if (floats ? !is_float : !is_int) {
        return kv_fail(err, "tokenizer: %s has element type %d, expected %s", key, (int)et,
                       floats ? "floats" : "integers");
    }
    if (a->n != (uint64_t)n_vocab) {
        return kv_fail(err, "tokenizer: %s has %llu entries for %d tokens", key,
                       (unsigned long long)a->n, n_vocab);
    }
    return 0;
}

static int load_vocab(tokenizer *t, const gguf_file *g, kv_error *err) {
    gguf_array toks, types, scores;
    if (!gguf_has_key(g, "tokenizer.ggml.tokens")) {
        return kv_fail(err, "tokenizer: tokenizer.ggml.tokens is missing");
    }
    if (gguf_get_array(g, "tokenizer.ggml.tokens", &toks, err) != 0) {
        return kv_fail_wrap(err, "tokenizer");
    }
    if (toks.elem_type != GGUF_VALUE_TYPE_STRING) {
        return kv_fail(err, "tokenizer: tokenizer.ggml.tokens is not a string array");
    }
    /* Ids are int32 everywhere; a quarter of the range leaves room for the tables' sizes. */
    if (toks.n == 0 || toks.n > (uint64_t)INT32_MAX / 4) {
        return kv_fail(err, "tokenizer: %llu tokens", (unsigned long long)toks.n);
    }
    int32_t n = (int32_t)toks.n;
    t->n_vocab = n;
    if (get_opt_vocab_array(g, "tokenizer.ggml.token_type", n, false, &types, err) != 0 ||
        get_opt_vocab_array(g, "tokenizer.ggml.scores", n, true, &scores, err) != 0) {
        return -1;
    }

    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        gguf_array_str(&toks, (uint64_t)i, &s, &len);
        if (len > UINT32_MAX - 1 || size_add(total, len + 1, &total) != 0) {
            return kv_fail(err, "tokenizer: token %d is too long", i);
        }
    }
    t->text = malloc(total);
    t->text_off = malloc((size_t)n * sizeof *t->text_off);
    t->text_len = malloc((size_t)n * sizeof *t->text_len);
    t->type = malloc((size_t)n);
    t->score = malloc((size_t)n * sizeof *t->score);
    t->eog = calloc((size_t)n, 1);
    t->special_rank = malloc((size_t)n * sizeof *t->special_rank);
    if (!t->text || !t->text_off || !t->text_len || !t->type || !t->score || !t->eog ||
        !t->special_rank || tokmap_init(&t->vocab, (size_t)n) != 0) {
        return kv_fail(err, "tokenizer: out of memory");
    }
    size_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        gguf_array_str(&toks, (uint64_t)i, &s, &len);
        memcpy(t->text + off, s, len);
        t->text[off + len] = '\0';
        t->text_off[i] = off;
        t->text_len[i] = (uint32_t)len;
        off += len + 1;

        int64_t ty = types.n ? gguf_array_i64(&types, (uint64_t)i) : TOKEN_TYPE_NORMAL;
        if (ty < TOKEN_TYPE_UNDEFINED || ty > TOKEN_TYPE_BYTE) {
            return kv_fail(err, "tokenizer: token %d has type %lld", i, (long long)ty);
        }
        t->type[i] = (uint8_t)ty;
        t->score[i] = scores.n ? (float)gguf_array_f64(&scores, (uint64_t)i) : 0.0f;
        t->special_rank[i] = -1;
        /* Later duplicates win, as llama.cpp's token_to_id[text] = i. An empty text cannot be
         * matched by anything (llama.cpp renames it "[EMPTY_<id>]"). */
        if (len > 0) tokmap_put(&t->vocab, t, i, true);
    }
    return 0;
}

typedef struct pre_name {
    const char *name;
    pretok_kind kind;
} pre_name;

/* tokenizer.ggml.pre values and the llama.cpp regex chain they select (llama-vocab.cpp). */
static const pre_name PRE_NAMES[] = {
    {"default", PRETOK_DEFAULT},  {"llama3", PRETOK_LLAMA3},        {"llama-v3", PRETOK_LLAMA3},
    {"llama-bpe", PRETOK_LLAMA3}, {"falcon3", PRETOK_LLAMA3},       {"pixtral", PRETOK_LLAMA3},
    {"gpt-2", PRETOK_GPT2},       {"phi-2", PRETOK_GPT2},           {"jina-es", PRETOK_GPT2},
    {"jina-de", PRETOK_GPT2},     {"jina-v2-es", PRETOK_GPT2},      {"jina-v2-de", PRETOK_GPT2},
    {"gigachat", PRETOK_GPT2},    {"starcoder", PRETOK_STARCODER},  {"smollm", PRETOK_STARCODER},
    {"refact", PRETOK_STARCODER}, {"command-r", PRETOK_STARCODER},  {"codeshell", PRETOK_STARCODER},
    {"exaone", PRETOK_STARCODER}, {"minerva-7b", PRETOK_STARCODER},
};

static int load_kind(tokenizer *t, const gguf_file *g, kv_error *err) {
    const char *s;
    size_t len;
    if (!gguf_has_key(g, "tokenizer.ggml.model")) {
        return kv_fail(err, "tokenizer: tokenizer.ggml.model is missing");
    }
    if (gguf_get_str(g, "tokenizer.ggml.model", &s, &len, err) != 0) {
        return kv_fail_wrap(err, "tokenizer");
    }
    if (len == 4 && memcmp(s, "gpt2", 4) == 0) {
        t->kind = TOKENIZER_KIND_BPE;
    } else if (len == 5 && memcmp(s, "llama", 5) == 0) {
        t->kind = TOKENIZER_KIND_SPM;
    } else {
        return kv_fail(err, "tokenizer: unsupported tokenizer.ggml.model '%.*s'",
                       (int)(len > 64 ? 64 : len), s);
    }

    t->pre = PRETOK_DEFAULT;
    if (t->kind == TOKENIZER_KIND_BPE && gguf_has_key(g, "tokenizer.ggml.pre")) {
        if (gguf_get_str(g, "tokenizer.ggml.pre", &s, &len, err) != 0) {
            return kv_fail_wrap(err, "tokenizer");
        }
        bool known = false;
        for (size_t i = 0; i < sizeof PRE_NAMES / sizeof PRE_NAMES[0]; i++) {
            if (strlen(PRE_NAMES[i].name) == len && memcmp(PRE_NAMES[i].name, s, len) == 0) {
                t->pre = PRE_NAMES[i].kind;
                known = true;
            }
        }
        if (!known) {
            /* llama.cpp refuses the model; the GPT-2 regex is the common ancestor of the
             * others and a fair approximation. */
            log_warn("tokenizer: unknown pre-tokenizer '%.*s', using the GPT-2 regex",
                     (int)(len > 64 ? 64 : len), s);
            t->pre = PRETOK_GPT2;
        }
    }
    return 0;
}

typedef struct special_key {
    const char *key;
    int32_t *id;
    bool tolerate_bad; /* out of range: warn and ignore instead of failing */
} special_key;

static int load_special_ids(tokenizer *t, const gguf_file *g, kv_error *err) {
    /* llama.cpp's defaults: SentencePiece <unk> <s> </s> are 0 1 2; BPE has none (llama.cpp
     * says 11, GPT-NeoX's <|endoftext|>, which is wrong for everything else). */
    bool spm = t->kind == TOKENIZER_KIND_SPM;
    t->unk = spm ? 0 : -1;
    t->bos = spm ? 1 : -1;
    t->eos = spm ? 2 : -1;
    t->pad = -1;
    t->eot = -1;
    t->eom = -1;
    if (t->eos >= t->n_vocab) t->eos = -1;
    if (t->bos >= t->n_vocab) t->bos = -1;
    t->add_bos = spm || t->pre == PRETOK_LLAMA3;
    t->add_eos = false;
    t->add_space_prefix = spm;
    t->ignore_merges = !spm && t->pre == PRETOK_LLAMA3;

    const special_key keys[] = {
        {"tokenizer.ggml.bos_token_id", &t->bos, false},
        {"tokenizer.ggml.eos_token_id", &t->eos, false},
        {"tokenizer.ggml.unknown_token_id", &t->unk, false},
        {"tokenizer.ggml.eot_token_id", &t->eot, false},
        {"tokenizer.ggml.eom_token_id", &t->eom, false},
        /* Converted models do ship a padding id equal to the vocabulary size; it is never
         * used for encoding, so llama.cpp's warning is enough. */
        {"tokenizer.ggml.padding_token_id", &t->pad, true},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        int64_t v;
        bool present;
        if (get_opt_i64(g, keys[i].key, &v, &present, err) != 0) return -1;
        if (!present) continue;
        if (v < 0 || v >= t->n_vocab) {
            if (!keys[i].tolerate_bad) {
                return kv_fail(err, "tokenizer: %s = %lld is out of range (%d tokens)", keys[i].key,
                               (long long)v, t->n_vocab);
            }
            log_warn("tokenizer: ignoring %s = %lld (%d tokens)", keys[i].key, (long long)v,
                     t->n_vocab);
            continue;
        }
        *keys[i].id = (int32_t)v;
    }
    if (get_opt_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos, err) != 0 ||
        get_opt_bool(g, "tokenizer.ggml.add_eos_token", &t->add_eos, err) != 0 ||
        get_opt_bool(g, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix, err) != 0) {
        return -1;
    }
    return 0;
}

/* llama.cpp finds some special tokens by their text when the file does not name them, makes
 * them control tokens (so they are matched only with parse_special and hidden when decoding),
 * and ends generation on a list of texts (llama-vocab.cpp, "auto-detect special tokens"; lists
 * as in the llama.cpp of llama-cpp-python 0.3.36). Where several texts are present llama.cpp
 * takes whichever its hash map yields first; here the first in list order. */
static const char *const EOT_TEXTS[] = {
    "<|eot_id|>",         "<|im_end|>", "<|end|>", "<end_of_turn>",
    "<|endoftext|>",      "<EOT>",      "_<EOT>",  "<｜end▁of▁sentence｜>", /* DeepSeek */
    "<end_of_utterance>", NULL,
};
static const char *const EOG_TEXTS[] = {
    "<|eot_id|>",      "<|im_end|>",         "<|end|>",    "<|return|>", "<|call|>",
    "<end_of_turn>",   "<|endoftext|>",      "<|eom_id|>", "<EOT>",      "_<EOT>",
    "<|end_of_text|>", "<end_of_utterance>", NULL,
};

typedef struct fim_group {
    const char *key;      /* the GGUF key that names the token, if the file has it */
    bool eog;             /* pad, repo and file separator also end generation */
    const char *texts[8]; /* else the first of these texts in the vocabulary */
} fim_group;

static const fim_group FIM_GROUPS[] = {
    {"tokenizer.ggml.fim_pre_token_id",
     false,
     {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
      "<|code_prefix|>", NULL}},
    {"tokenizer.ggml.fim_suf_token_id",
     false,
     {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
      "<|code_suffix|>", NULL}},
    {"tokenizer.ggml.fim_mid_token_id",
     false,
     {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
      "<|code_middle|>", NULL}},
    {"tokenizer.ggml.fim_pad_token_id",
     true,
     {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", NULL}},
    {"tokenizer.ggml.fim_rep_token_id",
     true,
     {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", NULL}},
    {"tokenizer.ggml.fim_sep_token_id", true, {"<|file_sep|>", NULL}},
};

static int32_t find_text(const tokenizer *t, const char *s) {
    return tokenizer_lookup(t, s, strlen(s));
}

/* The first of texts[] in the vocabulary, made a control token; -1 if none. */
static int32_t detect_by_text(tokenizer *t, const char *const *texts) {
    for (size_t i = 0; texts[i]; i++) {
        int32_t id = find_text(t, texts[i]);
        if (id >= 0) {
            t->type[id] = TOKEN_TYPE_CONTROL;
            return id;
        }
    }
    return -1;
}

static int detect_special(tokenizer *t, const gguf_file *g, kv_error *err) {
    if (t->eot < 0) t->eot = detect_by_text(t, EOT_TEXTS);
    if (t->eom < 0) {
        static const char *const eom[] = {"<|eom_id|>", NULL};
        t->eom = detect_by_text(t, eom);
    }
    for (size_t k = 0; k < sizeof FIM_GROUPS / sizeof FIM_GROUPS[0]; k++) {
        int64_t v;
        bool present;
        int32_t id;
        if (get_opt_i64(g, FIM_GROUPS[k].key, &v, &present, err) != 0) return -1;
        if (present) {
            if (v < 0 || v >= t->n_vocab) {
                return kv_fail(err, "tokenizer: %s = %lld is out of range (%d tokens)",
                               FIM_GROUPS[k].key, (long long)v, t->n_vocab);
            }
            id = (int32_t)v;
        } else {
            id = detect_by_text(t, FIM_GROUPS[k].texts);
        }
        if (id >= 0 && FIM_GROUPS[k].eog) t->eog[id] = 1;
    }
    for (size_t i = 0; EOG_TEXTS[i]; i++) {
        int32_t id = find_text(t, EOG_TEXTS[i]);
        if (id >= 0) {
            t->type[id] = TOKEN_TYPE_CONTROL;
            t->eog[id] = 1;
        }
    }
    if (t->eos >= 0) t->eog[t->eos] = 1;
    if (t->eot >= 0) t->eog[t->eot] = 1;
    if (t->eom >= 0) t->eog[t->eom] = 1;
    return 0;
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* SentencePiece byte tokens: "<0xXX>" must name the byte they stand for. */
static int load_spm_bytes(tokenizer *t, kv_error *err) {
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (t->type[i] != TOKEN_TYPE_BYTE) continue;
        const char *s = t->text + t->text_off[i];
        if (t->text_len[i] != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>' || hex_digit(s[3]) < 0 ||
            hex_digit(s[4]) < 0) {
            return kv_fail(err, "tokenizer: byte token %d is '%.*s', not <0xXX>", i,
                           (int)(t->text_len[i] > 32 ? 32 : t->text_len[i]), s);
        }
    }
    static const char hex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; b++) {
        char name[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
        uint8_t raw = (uint8_t)b;
        t->byte_token[b] = tokenizer_lookup(t, name, 6);
        if (t->byte_token[b] < 0) t->byte_token[b] = tokenizer_lookup(t, &raw, 1);
    }
    return 0;
}

static bool type_is_special(uint8_t ty) {
    return ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED || ty == TOKEN_TYPE_UNKNOWN;
}

/* Longest text first; equal lengths by id (llama.cpp's std::sort leaves their order open). */
static int cmp_special(const void *a, const void *b, void *ctx) {
    const tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (t->text_len[x] != t->text_len[y]) return t->text_len[x] > t->text_len[y] ? -1 : 1;
    return (x > y) - (x < y);
}

static int build_specials(tokenizer *t, kv_error *err) {
    int32_t n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (type_is_special(t->type[i]) && t->text_len[i] > 0) n++;
    }
    t->special = malloc((size_t)(n ? n : 1) * sizeof *t->special);
    t->special_lens = malloc((size_t)(n ? n : 1) * sizeof *t->special_lens);
    if (!t->special || !t->special_lens || tokmap_init(&t->special_map, (size_t)n) != 0) {
        return kv_fail(err, "tokenizer: out of memory");
    }
    n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (type_is_special(t->type[i]) && t->text_len[i] > 0) t->special[n++] = i;
        t->n_user_defined += t->type[i] == TOKEN_TYPE_USER_DEFINED;
    }
    t->n_special = n;
    qsort_r(t->special, (size_t)n, sizeof *t->special, cmp_special, t);
    for (int32_t k = 0; k < n; k++) {
        int32_t id = t->special[k];
        t->special_rank[id] = k;
        tokmap_put(&t->special_map, t, id, false);
        t->special_first[(uint8_t)t->text[t->text_off[id]]] = 1;
        if (t->n_special_lens == 0 || t->special_lens[t->n_special_lens - 1] != t->text_len[id]) {
            t->special_lens[t->n_special_lens++] = t->text_len[id];
        }
    }
    return 0;
}

/* What each token decodes to (llama.cpp token_to_piece with special = true): normal tokens
 * their bytes, control / unknown / user-defined tokens their text, SentencePiece byte tokens
 * their byte, unused and undefined tokens (and BPE "byte" tokens) nothing. */
static int build_pieces(tokenizer *t, kv_error *err) {
    size_t total = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) total += t->text_len[i]; /* never grows */
    t->piece = malloc(total ? total : 1);
    t->piece_off = malloc(((size_t)t->n_vocab + 1) * sizeof *t->piece_off);
    if (!t->piece || !t->piece_off) return kv_fail(err, "tokenizer: out of memory");
    size_t off = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        const uint8_t *s = (const uint8_t *)t->text + t->text_off[i];
        size_t len = t->text_len[i];
        uint8_t *out = t->piece + off;
        size_t n = 0;
        switch (t->type[i]) {
        case TOKEN_TYPE_CONTROL:
        case TOKEN_TYPE_UNKNOWN:
        case TOKEN_TYPE_USER_DEFINED:
            memcpy(out, s, len);
            n = len;
            break;
        case TOKEN_TYPE_NORMAL:
            if (t->kind == TOKENIZER_KIND_BPE) {
                n = tokenizer_bpe_unmap(t, s, len, out);
                break;
            }
            for (size_t k = 0; k < len;) { /* "▁" (3 bytes) -> ' ' */
                if (k + 3 <= len && s[k] == 0xE2 && s[k + 1] == 0x96 && s[k + 2] == 0x81) {
                    out[n++] = ' ';
                    k += 3;
                } else {
                    out[n++] = s[k++];
                }
            }
            break;
        case TOKEN_TYPE_BYTE:
            if (t->kind == TOKENIZER_KIND_SPM) {
                out[n++] = (uint8_t)(hex_digit((char)s[3]) << 4 | hex_digit((char)s[4]));
            }
            break;
        default:
            break;
        }
        t->piece_off[i] = off;
        off += n;
        if (n > t->max_piece_len) t->max_piece_len = n;
    }
    t->piece_off[t->n_vocab] = off;
    return 0;
}

tokenizer *tokenizer_create(const gguf_file *g, kv_error *err) {
    tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        kv_fail(err, "tokenizer: out of memory");
        return NULL;
    }
    for (int b = 0; b < 256; b++) t->byte_token[b] = -1;
    if (!g) {
        kv_fail(err, "tokenizer: no GGUF file");
        goto fail;
    }
    if (load_kind(t, g, err) != 0 || load_vocab(t, g, err) != 0 ||
        load_special_ids(t, g, err) != 0) {
        goto fail;
    }
    if (t->kind == TOKENIZER_KIND_BPE ? tokenizer_bpe_load(t, g, err) != 0
                                      : load_spm_bytes(t, err) != 0) {
        goto fail;
    }
    if (detect_special(t, g, err) != 0 || build_specials(t, err) != 0 || build_pieces(t, err) != 0)
        goto fail;
    return t;
fail:
    tokenizer_destroy(t);
    return NULL;
}

void tokenizer_destroy(tokenizer *t) {
    if (!t) return;
    free(t->text);
    free(t->text_off);
    free(t->text_len);
    free(t->type);
    free(t->shown);
    free(t->score);
    free(t->piece);
    free(t->piece_off);
    tokmap_free(&t->vocab);
    free(t->merges.slots);
    free(t->special);
    free(t->special_rank);
    tokmap_free(&t->special_map);
    free(t->special_lens);
    free(t->eog);
    free(t);
}

/* ---------------------------------------------------------------- queries */

int32_t tokenizer_n_vocab(const tokenizer *t) { return t->n_vocab; }
int32_t tokenizer_bos(const tokenizer *t) { return t->bos; }
int32_t tokenizer_eos(const tokenizer *t) { return t->eos; }
bool tokenizer_add_bos(const tokenizer *t) { return t->add_bos && t->bos >= 0; }
bool tokenizer_add_eos(const tokenizer *t) { return t->add_eos && t->eos >= 0; }
size_t tokenizer_max_token_len(const tokenizer *t) { return t->max_piece_len; }

bool tokenizer_is_eog(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && t->eog[id];
}

const char *tokenizer_token_text(const tokenizer *t, int32_t id) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    return t->text + t->text_off[id];
}

/* Token ids mean the same text in both: the texts (bytes), their types and the special ids. The
 * merges and pre-tokenizer only matter to encoding, which the draft model never does. */
int tokenizer_same_vocab(const tokenizer *a, const tokenizer *b, kv_error *err) {
    if (a->n_vocab != b->n_vocab)
        return kv_fail(err, "%d tokens against %d", a->n_vocab, b->n_vocab);
    for (int32_t i = 0; i < a->n_vocab; i++) {
        if (a->text_len[i] != b->text_len[i] || a->type[i] != b->type[i] ||
            memcmp(a->text + a->text_off[i], b->text + b->text_off[i], a->text_len[i]) != 0)
            return kv_fail(err, "token %d differs (its text or its type)", i);
        if (a->eog[i] != b->eog[i]) return kv_fail(err, "token %d ends generation in one only", i);
    }
    const int32_t sa[] = {a->bos, a->eos, a->unk, a->pad, a->eot, a->eom},
                  sb[] = {b->bos, b->eos, b->unk, b->pad, b->eot, b->eom};
    static const char *const names[] = {"BOS", "EOS", "UNK", "PAD", "EOT", "EOM"};
    for (int i = 0; i < 6; i++)
        if (sa[i] != sb[i])
            return kv_fail(err, "%s is token %d against %d", names[i], sa[i], sb[i]);
    return 0;
}

int32_t tokenizer_find(const tokenizer *t, const char *text) {
    return text ? tokenizer_lookup(t, text, strlen(text)) : -1;
}

/* ---------------------------------------------------------------- special-token partition */

/* A run of the input: raw text (id < 0) or one special token. */
typedef struct frag {
    size_t off, len;
    int32_t id;
} frag;

typedef struct occurrence {
    size_t pos;
    int32_t rank; /* of the token in the special order */
} occurrence;

static int cmp_occurrence(const void *a, const void *b) {
    const occurrence *x = a, *y = b;
    if (x->rank != y->rank) return x->rank < y->rank ? -1 : 1;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

/* llama.cpp (tokenizer_st_partition) takes the special tokens longest first and, for each, cuts
 * every non-overlapping occurrence, left to right, out of the raw fragments left by the
 * previous ones. The same result from one pass: find every occurrence of every special text
 * (only at bytes that start one), then accept them in (token order, position) order unless they
 * overlap text an earlier one took. Without parse_special only user-defined tokens count. */
static int partition(const tokenizer *t, const uint8_t *s, size_t len, bool parse_special,
                     frag **out, size_t *n_out, kv_error *err) {
    occurrence *occ = NULL;
    uint8_t *taken = NULL;
    frag *fr = NULL;
    size_t n_occ = 0, cap_occ = 0, n_fr = 0;
    int rc = -1;

    bool any = parse_special ? t->n_special > 0 : t->n_user_defined > 0;
    for (size_t p = 0; p < len && any; p++) {
        if (!t->special_first[s[p]]) continue;
        for (int32_t k = 0; k < t->n_special_lens; k++) {
            size_t l = t->special_lens[k];
            if (l > len - p) continue;
            int32_t id = tokmap_find(&t->special_map, t, s + p, l);
            if (id < 0 || (!parse_special && t->type[id] != TOKEN_TYPE_USER_DEFINED)) continue;
            if (n_occ == cap_occ) {
                size_t c = cap_occ ? 2 * cap_occ : 16;
                occurrence *q = realloc(occ, c * sizeof *q);
                if (!q) goto oom;
                occ = q;
                cap_occ = c;
            }
            occ[n_occ++] = (occurrence){p, t->special_rank[id]};
        }
    }

    /* At most one fragment per accepted token plus one raw fragment before each and at the end. */
    fr = malloc((2 * n_occ + 1) * sizeof *fr);
    if (!fr) goto oom;
    if (n_occ > 0) {
        taken = calloc(len, 1);
        if (!taken) goto oom;
        qsort(occ, n_occ, sizeof *occ, cmp_occurrence);
        size_t n_acc = 0;
        for (size_t k = 0; k < n_occ; k++) {
            size_t p = occ[k].pos, l = t->text_len[t->special[occ[k].rank]];
            if (memchr(taken + p, 1, l)) continue;
            memset(taken + p, 1, l);
            occ[n_acc++] = occ[k];
        }
        n_occ = n_acc;
        for (size_t k = 0; k < n_occ; k++) occ[k].rank = t->special[occ[k].rank]; /* -> id */
        /* back to text order */
        for (size_t k = 1; k < n_occ; k++) {
            occurrence x = occ[k];
            size_t j = k;
            for (; j > 0 && occ[j - 1].pos > x.pos; j--) occ[j] = occ[j - 1];
            occ[j] = x;
        }
    }
    size_t at = 0;
    for (size_t k = 0; k < n_occ; k++) {
        if (occ[k].pos > at) fr[n_fr++] = (frag){at, occ[k].pos - at, -1};
        fr[n_fr++] = (frag){occ[k].pos, t->text_len[occ[k].rank], occ[k].rank};
        at = occ[k].pos + t->text_len[occ[k].rank];
    }
    if (at < len) fr[n_fr++] = (frag){at, len - at, -1};
    *out = fr;
    *n_out = n_fr;
    fr = NULL;
    rc = 0;
    goto done;
oom:
    kv_fail(err, "tokenizer: out of memory");
done:
    free(occ);
    free(taken);
    free(fr);
    return rc;
}

/* ---------------------------------------------------------------- encoding */

int tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_bos,
                     bool parse_special, int32_t **out, kv_error *err) {
    const uint8_t *s = (const uint8_t *)text;
    tok_ids ids = {NULL, 0, 0};
    frag *fr = NULL;
    size_t n_fr = 0;
    pretok_scratch ps;
    bpe_scratch bs;
    memset(&ps, 0, sizeof ps);
    memset(&bs, 0, sizeof bs);
    int rc = -1;

    *out = NULL;
    if (!text && len > 0) return kv_fail(err, "tokenizer: NULL text");
    /* A token holds at least one byte, so the count fits an int with room for BOS. */
    if (len > (size_t)INT32_MAX / 4)
        return kv_fail(err, "tokenizer: text of %zu bytes is too long", len);
    size_t bad = utf8_validate(s, len);
    if (bad != len) return kv_fail(err, "tokenizer: invalid UTF-8 at byte %zu", bad);

    if (tok_ids_push(&ids, 0) != 0) goto oom; /* always hand back an array */
    ids.n = 0;
    if (add_bos && t->bos >= 0 && tok_ids_push(&ids, t->bos) != 0) goto oom;
    if (partition(t, s, len, parse_special, &fr, &n_fr, err) != 0) goto done;

    /* SentencePiece: llama.cpp prefixes a space to the first fragment and to every fragment
     * that follows a special token. */
    bool prev_special = true;
    for (size_t f = 0; f < n_fr; f++) {
        if (fr[f].id >= 0) {
            if (tok_ids_push(&ids, fr[f].id) != 0) goto oom;
            prev_special = true;
            continue;
        }
        const uint8_t *fs = s + fr[f].off;
        if (t->kind == TOKENIZER_KIND_SPM) {
            if (tokenizer_spm_encode(t, fs, fr[f].len, t->add_space_prefix && prev_special, &ids,
                                     err) != 0) {
                goto done;
            }
        } else {
            const size_t *ends;
            size_t n_words;
            if (pretok_split(t->pre, fs, fr[f].len, &ps, &ends, &n_words, err) != 0) goto done;
            size_t start = 0;
            for (size_t w = 0; w < n_words; w++) {
                if (tokenizer_bpe_encode_word(t, fs + start, ends[w] - start, &bs, &ids, err) !=
                    0) {
                    goto done;
                }
                start = ends[w];
            }
        }
        prev_special = false;
    }
    *out = ids.v;
    ids.v = NULL;
    rc = (int)ids.n;
    goto done;
oom:
    kv_fail(err, "tokenizer: out of memory");
done:
    free(ids.v);
    free(fr);
    pretok_scratch_free(&ps);
    bpe_scratch_free(&bs);
    return rc;
}

/* ---------------------------------------------------------------- decoding */

static bool piece_hidden(const tokenizer *t, int32_t id) {
    return (t->type[id] == TOKEN_TYPE_CONTROL && !(t->shown && t->shown[id])) ||
           t->type[id] == TOKEN_TYPE_UNKNOWN;
}

int32_t tokenizer_render_as_text(tokenizer *t, const char *text) {
    int32_t id = tokenizer_find(t, text);
    if (id < 0 || t->type[id] != TOKEN_TYPE_CONTROL) return -1;
    if (!t->shown && !(t->shown = calloc((size_t)t->n_vocab, 1))) return -1;
    t->shown[id] = 1;
    return id;
}

static void piece_of(const tokenizer *t, int32_t id, bool render_special, const uint8_t **p,
                     size_t *n) {
    *p = t->piece + t->piece_off[id];
    *n = (!render_special && piece_hidden(t, id)) ? 0 : t->piece_off[id + 1] - t->piece_off[id];
}

int tokenizer_token_bytes(const tokenizer *t, int32_t id, bool render_special, char *buf,
                          size_t cap) {
    if (id < 0 || id >= t->n_vocab) return -1;
    const uint8_t *p;
    size_t n;
    piece_of(t, id, render_special, &p, &n);
    if (cap > 0) memcpy(buf, p, n < cap ? n : cap);
    return (int)n;
}

bool tokenizer_token_starts(const tokenizer *t, const int32_t *ids, int n, bool added_bos,
                            const char *text, size_t len, size_t *starts) {
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab) return false;
        starts[i] = off;
        if (i == 0 && added_bos) continue; /* not in the text */
        const uint8_t *p;
        size_t np;
        piece_of(t, ids[i], true, &p, &np);
        if (np > len - off || memcmp(text + off, p, np) != 0) return false;
        off += np;
    }
    return off == len;
}

/* Output of the UTF-8 repair: a caller's fixed buffer, or a growing one. */
typedef struct utf8_out {
    uint8_t *p;
    size_t n, cap;
    bool grow, overflow;
} utf8_out;

static void out_put(utf8_out *o, const void *s, size_t n) {
    if (o->overflow || n == 0) return;
    if (o->n + n > o->cap) {
        size_t cap = o->cap ? o->cap : 64;
        while (cap < o->n + n) cap *= 2;
        uint8_t *q = o->grow ? realloc(o->p, cap) : NULL;
        if (!q) {
            o->overflow = true;
            return;
        }
        o->p = q;
        o->cap = cap;
    }
    memcpy(o->p + o->n, s, n);
    o->n += n;
}

/* Writes the bytes a[0..na) ++ b[0..nb) with every maximal invalid subpart replaced by U+FFFD.
 * A valid but incomplete sequence at the end is written as U+FFFD when `final`; otherwise it is
 * left out and its length returned, for the caller to keep until more bytes come. */
static size_t utf8_repair(const uint8_t *a, size_t na, const uint8_t *b, size_t nb, bool final,
                          utf8_out *o) {
    size_t total = na + nb;
    size_t i = 0;
    while (i < total) {
        if (i >= na) { /* fast path: copy the ASCII run of b */
            size_t j = i - na, k = j;
            while (k < nb && b[k] < 0x80) k++;
            if (k > j) {
                out_put(o, b + j, k - j);
                i += k - j;
                continue;
            }
        }
        uint8_t win[4];
        size_t wl = total - i < 4 ? total - i : 4;
        for (size_t k = 0; k < wl; k++) win[k] = i + k < na ? a[i + k] : b[i + k - na];
        uint32_t cp;
        size_t n;
        utf8_status st = utf8_decode(win, wl, &cp, &n);
        if (st == UTF8_TRUNCATED && !final) return total - i;
        if (st == UTF8_OK)
            out_put(o, win, n);
        else
            out_put(o, UTF8_REPLACEMENT, 3);
        i += n;
    }
    return 0;
}

char *tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool render_special,
                       size_t *out_len, kv_error *err) {
    utf8_out raw = {NULL, 0, 0, true, false}, o = {NULL, 0, 0, true, false};
    bool at_start = true;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab) {
            free(raw.p);
            kv_fail(err, "tokenizer: token id %d out of range (%d tokens)", ids[i], t->n_vocab);
            return NULL;
        }
        const uint8_t *p;
        size_t len;
        piece_of(t, ids[i], render_special, &p, &len);
        if (len > 0 && at_start) {
            /* SentencePiece: the space llama.cpp put before the text is not part of it. */
            if (t->kind == TOKENIZER_KIND_SPM && t->add_space_prefix && p[0] == ' ') p++, len--;
            at_start = false;
        }
        out_put(&raw, p, len);
    }
    utf8_repair(raw.p, raw.n, NULL, 0, true, &o);
    free(raw.p);
    out_put(&o, "", 1);
    if (o.overflow) {
        free(o.p);
        kv_fail(err, "tokenizer: out of memory");
        return NULL;
    }
    *out_len = o.n - 1;
    return (char *)o.p;
}

char *tokenizer_piece_utf8(const tokenizer *t, int32_t id, bool render_special, size_t *out_len) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    const uint8_t *p;
    size_t len;
    piece_of(t, id, render_special, &p, &len);
    utf8_out o = {NULL, 0, 0, true, false};
    utf8_repair(p, len, NULL, 0, true, &o);
    out_put(&o, "", 1);
    if (o.overflow) {
        free(o.p);
        return NULL;
    }
    *out_len = o.n - 1;
    return (char *)o.p;
}

void detok_init(detok_state *s) {
    memset(s, 0, sizeof *s);
    s->at_start = true;
}

int detok_push(const tokenizer *t, detok_state *s, int32_t id, char *buf, size_t cap) {
    if (id < 0 || id >= t->n_vocab || s->n_pending < 0 || s->n_pending > 3) return -1;
    const uint8_t *p;
    size_t len;
    piece_of(t, id, false, &p, &len);
    bool at_start = s->at_start;
    if (len > 0 && at_start) {
        if (t->kind == TOKENIZER_KIND_SPM && t->add_space_prefix && p[0] == ' ') p++, len--;
        at_start = false;
    }
    utf8_out o = {(uint8_t *)buf, 0, cap, false, false};
    size_t keep = utf8_repair(s->pending, (size_t)s->n_pending, p, len, false, &o);
    if (o.overflow || o.n > INT32_MAX) return -1;
    /* The kept tail (at most 3 bytes) is the end of pending ++ piece. */
    uint8_t tail[3];
    size_t total = (size_t)s->n_pending + len;
    for (size_t k = 0; k < keep; k++) {
        size_t i = total - keep + k;
        tail[k] = i < (size_t)s->n_pending ? s->pending[i] : p[i - (size_t)s->n_pending];
    }
    memcpy(s->pending, tail, keep);
    s->n_pending = (int)keep;
    s->at_start = at_start;
    return (int)o.n;
}

int detok_flush(detok_state *s, char *buf, size_t cap) {
    if (s->n_pending <= 0) {
        s->n_pending = 0;
        return 0;
    }
    if (cap < 3) return -1;
    memcpy(buf, UTF8_REPLACEMENT, 3);
    s->n_pending = 0;
    return 3;
}
