/* The grammar's vocabulary from the model's tokenizer: every token's bytes as the detokenizer
 * emits them (control tokens give none, so a grammar never asks for them as text), and which
 * tokens end generation. Apart from grammar_match.c so the parser's fuzz target links without
 * the tokenizer. */
#include "model/grammar/grammar.h"

#include <stdlib.h>
#include <string.h>

grammar_vocab *grammar_vocab_create(const tokenizer *t, kv_error *err) {
    int32_t n = tokenizer_n_vocab(t);
    size_t max = tokenizer_max_token_len(t);
    char **toks = calloc((size_t)n + 1, sizeof *toks);
    size_t *lens = calloc((size_t)n + 1, sizeof *lens);
    bool *eog = calloc((size_t)n + 1, sizeof *eog);
    char *buf = malloc(max + 1);
    grammar_vocab *v = NULL;
    if (!toks || !lens || !eog || !buf) {
        kv_fail(err, "out of memory");
        goto done;
    }
    for (int32_t i = 0; i < n; i++) {
        eog[i] = tokenizer_is_eog(t, i);
        /* Control tokens decode to nothing: the grammar never asks for them as text. */
        int len = tokenizer_token_bytes(t, i, false, buf, max + 1);
        if (len <= 0) continue;
        if ((size_t)len > max) len = (int)max;
        if (!(toks[i] = malloc((size_t)len))) {
            kv_fail(err, "out of memory");
            goto done;
        }
        memcpy(toks[i], buf, (size_t)len);
        lens[i] = (size_t)len;
    }
    v = grammar_vocab_create_raw((const char *const *)toks, lens, eog, n, err);
done:
    if (toks)
        for (int32_t i = 0; i < n; i++) free(toks[i]);
    free(toks);
    free(lens);
    free(eog);
    free(buf);
    return v;
}
