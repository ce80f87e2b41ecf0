/* See byte_vocab.h. */
#include "tests/unit/byte_vocab.h"

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

grammar_vocab *byte_vocab_create(const char *const *extra, int n_extra) {
    int n = 256 + n_extra + 1;
    char **toks = calloc((size_t)n, sizeof *toks);
    size_t *lens = calloc((size_t)n, sizeof *lens);
    bool *eog = calloc((size_t)n, sizeof *eog);
    char bytes[256];
    for (int i = 0; i < 256; i++) {
        bytes[i] = (char)i;
        toks[i] = &bytes[i];
        lens[i] = 1;
    }
    for (int i = 0; i < n_extra; i++) {
        toks[256 + i] = (char *)extra[i];
        lens[256 + i] = strlen(extra[i]);
    }
    eog[n - 1] = true;
    kv_error err = {{0}};
    grammar_vocab *v =
        grammar_vocab_create_raw((const char *const *)toks, lens, eog, (int32_t)n, &err);
    cr_assert_not_null(v, "%s", err.msg);
    free(toks);
    free(lens);
    free(eog);
    return v;
}
