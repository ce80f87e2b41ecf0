/* A grammar vocabulary for tests that match text byte by byte. */
#ifndef KVSERVE_BYTE_VOCAB_H
#define KVSERVE_BYTE_VOCAB_H

#include "model/grammar/grammar.h"

/* The 256 single bytes plus extra tokens; the last token is end-of-generation. The test fails
 * when it cannot be made. */
grammar_vocab *byte_vocab_create(const char *const *extra, int n_extra);

#endif
