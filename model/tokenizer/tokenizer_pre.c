/* Pre-tokenizers of byte-level BPE: the regexes of tokenizer.ggml.pre, written out by hand over
 * code point flags (model/tokenizer/unicode.h) instead of going through a regex engine.
 *
 * llama.cpp (src/unicode.cpp, unicode_regex_split) applies a chain of regexes: each regex runs
 * separately inside every segment the previous one produced, and both its matches and the text
 * between matches become segments. Regexes with a "custom" implementation there (GPT-2, Llama 3)
 * are mirrored step by step below, including where they differ from a textbook regex engine
 * (lookahead ends at the segment boundary); the others (\p{N}, \p{N}+, the default chain's
 * punctuation runs and digit triples) go through std::regex there and are simple enough to
 * state exactly. */
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer/tokenizer_impl.h"
#include "model/tokenizer/unicode.h"

/* Flags of a position outside the current segment: no category, not whitespace, and unequal to
 * the flags of any real code point (llama.cpp's flags-zero "out of range"). */
#define FL_NONE 0x80

/* One segment [a, b) of a code point array, read like llama.cpp's _get_cpt/_get_flags. */
typedef struct seg_view {
    const uint32_t *cp;
    const uint8_t *fl;
    size_t a, b;
} seg_view;

static inline uint8_t seg_fl(const seg_view *v, size_t i) {
    return (i >= v->a && i < v->b) ? v->fl[i] : FL_NONE;
}
static inline uint32_t seg_cp(const seg_view *v, size_t i) {
    return (i >= v->a && i < v->b) ? v->cp[i] : 0xFFFFFFFFu;
}

static inline bool fl_letter(uint8_t f) { return f != FL_NONE && unicode_flags_letter(f); }
static inline bool fl_number(uint8_t f) { return f != FL_NONE && unicode_flags_number(f); }
static inline bool fl_space(uint8_t f) { return f != FL_NONE && unicode_flags_space(f); }
/* [^\s\p{L}\p{N}] inside the segment */
static inline bool fl_other(uint8_t f) {
    return f != FL_NONE && !unicode_flags_space(f) && !unicode_flags_letter(f) &&
           !unicode_flags_number(f);
}

/* Output segment ends; emitting an end equal to the previous one adds nothing. */
typedef struct seg_out {
    size_t *ends;
    size_t n;
    size_t last;
} seg_out;

static inline void seg_emit(seg_out *o, size_t end) {
    if (end > o->last) {
        o->ends[o->n++] = end;
        o->last = end;
    }
}

/* ---------------------------------------------------------------- GPT-2 */

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ within one
 * segment (llama.cpp unicode_regex_split_custom_gpt2). */
static void split_gpt2(const seg_view *v, seg_out *o) {
    size_t pos = v->a;
    while (pos < v->b) {
        uint32_t c = v->cp[pos];
        uint8_t f = v->fl[pos];
        if (c == '\'' && pos + 1 < v->b) {
            uint32_t c1 = v->cp[pos + 1];
            if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
                pos += 2;
                seg_emit(o, pos);
                continue;
            }
            if (pos + 2 < v->b) {
                uint32_t c2 = v->cp[pos + 2];
                if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
                    (c1 == 'l' && c2 == 'l')) {
                    pos += 3;
                    seg_emit(o, pos);
                    continue;
                }
            }
        }
        uint8_t f2 = c == ' ' ? seg_fl(v, pos + 1) : f;
        if (fl_letter(f2) || fl_number(f2) || fl_other(f2)) {
            bool (*same)(uint8_t) = fl_letter(f2)   ? fl_letter
                                    : fl_number(f2) ? fl_number
                                                    : fl_other;
            pos += c == ' ';
            while (same(seg_fl(v, pos))) pos++;
            seg_emit(o, pos);
            continue;
        }
        size_t nws = 0;
        while (fl_space(seg_fl(v, pos + nws))) nws++;
        if (nws > 1 && pos + nws < v->b) {
            /* \s+(?!\S): leave the last space to prefix the next word */
            pos += nws - 1;
            seg_emit(o, pos);
            continue;
        }
        pos += nws > 0 ? nws : 1;
        seg_emit(o, pos);
    }
}

/* ---------------------------------------------------------------- Llama 3 */

static inline uint32_t ascii_lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
 * \s*[\r\n]+|\s+(?!\S)|\s+ within one segment (llama.cpp unicode_regex_split_custom_llama3).
 * The case-insensitive contractions only need ASCII lowering: no other code point lowercases
 * to s, t, r, e, v, m, l or d. */
static void split_llama3(const seg_view *v, seg_out *o) {
    size_t pos = v->a;
    while (pos < v->b) {
        uint32_t c = v->cp[pos];
        uint8_t f = v->fl[pos];
        if (c == '\'' && pos + 1 < v->b) {
            uint32_t c1 = ascii_lower(v->cp[pos + 1]);
            if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
                pos += 2;
                seg_emit(o, pos);
                continue;
            }
            if (pos + 2 < v->b) {
                uint32_t c2 = ascii_lower(v->cp[pos + 2]);
                if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
                    (c1 == 'l' && c2 == 'l')) {
                    pos += 3;
                    seg_emit(o, pos);
                    continue;
                }
            }
        }
        /* [^\r\n\p{L}\p{N}]?\p{L}+ */
        if (!(c == '\r' || c == '\n' || fl_number(f)) &&
            (fl_letter(f) || fl_letter(seg_fl(v, pos + 1)))) {
            pos++;
            while (fl_letter(seg_fl(v, pos))) pos++;
            seg_emit(o, pos);
            continue;
        }
        /* \p{N}{1,3} */
        if (fl_number(f)) {
            size_t ini = pos;
            while (fl_number(seg_fl(v, pos))) {
                if (++pos - ini >= 3) {
                    seg_emit(o, pos);
                    ini = pos;
                }
            }
            seg_emit(o, pos);
            continue;
        }
        /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
        uint8_t f2 = c == ' ' ? seg_fl(v, pos + 1) : f;
        if (fl_other(f2)) {
            pos += c == ' ';
            while (fl_other(seg_fl(v, pos))) pos++;
            for (uint32_t c2 = seg_cp(v, pos); c2 == '\r' || c2 == '\n'; c2 = seg_cp(v, pos)) pos++;
            seg_emit(o, pos);
            continue;
        }
        size_t nws = 0, last_rn = 0;
        while (fl_space(seg_fl(v, pos + nws))) {
            uint32_t c2 = v->cp[pos + nws];
            if (c2 == '\r' || c2 == '\n') last_rn = pos + nws + 1;
            nws++;
        }
        if (last_rn > 0) { /* \s*[\r\n]+ */
            pos = last_rn;
        } else if (nws > 1 && pos + nws < v->b) { /* \s+(?!\S) */
            pos += nws - 1;
        } else {
            pos += nws > 0 ? nws : 1;
        }
        seg_emit(o, pos);
    }
}

/* ---------------------------------------------------------------- class runs (std::regex) */

/* The default chain's first class [\p{P}\$\+<=>\^~\|]: punctuation and eight ASCII symbols.
 * (The backquote, also an ASCII symbol, is not in it.) */
static bool cls_default_punct(uint32_t c, uint8_t f) {
    return unicode_flags_punct(f) || (c < 128 && c != 0 && strchr("$+<=>^~|", (int)c) != NULL);
}
static bool cls_number(uint32_t c, uint8_t f) {
    (void)c;
    return unicode_flags_number(f);
}

/* Regex "X+" (runs = true) or "X" (one code point per match) for a class X: matches and the
 * text between them become segments. */
static void split_class(const seg_view *v, seg_out *o, bool (*cls)(uint32_t, uint8_t), bool runs) {
    size_t pos = v->a;
    while (pos < v->b) {
        if (!cls(v->cp[pos], v->fl[pos])) {
            pos++;
            continue;
        }
        seg_emit(o, pos);
        pos++;
        while (runs && pos < v->b && cls(v->cp[pos], v->fl[pos])) pos++;
        seg_emit(o, pos);
    }
    seg_emit(o, v->b);
}

static inline bool ascii_digit(uint32_t c) { return c >= '0' && c <= '9'; }

/* "[0-9][0-9][0-9]": leftmost non-overlapping triples of ASCII digits. */
static void split_digit_triples(const seg_view *v, seg_out *o) {
    size_t pos = v->a;
    while (pos < v->b) {
        if (pos + 3 <= v->b && ascii_digit(v->cp[pos]) && ascii_digit(v->cp[pos + 1]) &&
            ascii_digit(v->cp[pos + 2])) {
            seg_emit(o, pos);
            pos += 3;
            seg_emit(o, pos);
        } else {
            pos++;
        }
    }
    seg_emit(o, v->b);
}

/* ---------------------------------------------------------------- driver */

typedef enum split_step {
    STEP_GPT2,
    STEP_LLAMA3,
    STEP_EACH_NUMBER,   /* \p{N} */
    STEP_NUMBER_RUNS,   /* \p{N}+ */
    STEP_DEFAULT_PUNCT, /* [\p{P}\$\+<=>\^~\|]+ */
    STEP_DIGIT_TRIPLES, /* [0-9][0-9][0-9] */
} split_step;

void pretok_scratch_free(pretok_scratch *s) {
    free(s->cp);
    free(s->fl);
    free(s->boff);
    free(s->seg[0]);
    free(s->seg[1]);
    memset(s, 0, sizeof *s);
}

static int scratch_reserve(pretok_scratch *s, size_t n, kv_error *err) {
    if (n <= s->cap) return 0;
    size_t cap = s->cap ? s->cap : 256;
    while (cap < n) cap *= 2;
    uint32_t *cp = realloc(s->cp, cap * sizeof *cp);
    if (cp) s->cp = cp;
    uint8_t *fl = realloc(s->fl, cap);
    if (fl) s->fl = fl;
    size_t *boff = realloc(s->boff, (cap + 1) * sizeof *boff);
    if (boff) s->boff = boff;
    size_t *s0 = realloc(s->seg[0], cap * sizeof *s0);
    if (s0) s->seg[0] = s0;
    size_t *s1 = realloc(s->seg[1], cap * sizeof *s1);
    if (s1) s->seg[1] = s1;
    if (!cp || !fl || !boff || !s0 || !s1) return kv_fail(err, "tokenizer: out of memory");
    s->cap = cap;
    return 0;
}

int pretok_split(pretok_kind pre, const uint8_t *s, size_t len, pretok_scratch *sc,
                 const size_t **ends, size_t *n_words, kv_error *err) {
    static const split_step steps_default[] = {STEP_DEFAULT_PUNCT, STEP_GPT2, STEP_NUMBER_RUNS,
                                               STEP_DIGIT_TRIPLES};
    static const split_step steps_gpt2[] = {STEP_GPT2};
    static const split_step steps_starcoder[] = {STEP_EACH_NUMBER, STEP_GPT2};
    static const split_step steps_llama3[] = {STEP_LLAMA3};
    const split_step *steps;
    size_t n_steps;
    switch (pre) {
    case PRETOK_GPT2:
        steps = steps_gpt2, n_steps = 1;
        break;
    case PRETOK_STARCODER:
        steps = steps_starcoder, n_steps = 2;
        break;
    case PRETOK_LLAMA3:
        steps = steps_llama3, n_steps = 1;
        break;
    default:
        steps = steps_default, n_steps = 4;
        break;
    }

    *n_words = 0;
    if (len == 0) return 0;
    if (scratch_reserve(sc, len, err) != 0) return -1;

    /* Decode once; the caller has validated the UTF-8. */
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t c;
        size_t k;
        if (utf8_decode(s + i, len - i, &c, &k) != UTF8_OK) {
            return kv_fail(err, "tokenizer: invalid UTF-8 at byte %zu", i);
        }
        sc->cp[n] = c;
        sc->fl[n] = unicode_flags(c);
        sc->boff[n] = i;
        n++;
        i += k;
    }
    sc->boff[n] = len;

    size_t *in = sc->seg[0], *outv = sc->seg[1];
    size_t n_in = 1;
    in[0] = n;
    for (size_t st = 0; st < n_steps; st++) {
        seg_out o = {outv, 0, 0};
        size_t start = 0;
        for (size_t k = 0; k < n_in; k++) {
            seg_view v = {sc->cp, sc->fl, start, in[k]};
            start = in[k];
            switch (steps[st]) {
            case STEP_GPT2:
                split_gpt2(&v, &o);
                break;
            case STEP_LLAMA3:
                split_llama3(&v, &o);
                break;
            case STEP_EACH_NUMBER:
                split_class(&v, &o, cls_number, false);
                break;
            case STEP_NUMBER_RUNS:
                split_class(&v, &o, cls_number, true);
                break;
            case STEP_DEFAULT_PUNCT:
                split_class(&v, &o, cls_default_punct, true);
                break;
            case STEP_DIGIT_TRIPLES:
                split_digit_triples(&v, &o);
                break;
            }
        }
        size_t *tmp = in;
        in = outv;
        outv = tmp;
        n_in = o.n;
    }
    /* Code point indices -> byte offsets, in place. */
    for (size_t k = 0; k < n_in; k++) in[k] = sc->boff[in[k]];
    *ends = in;
    *n_words = n_in;
    return 0;
}
