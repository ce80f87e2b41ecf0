/* The compiled grammar's layout, shared by the parser (grammar.c) and the matcher
 * (grammar_match.c). Not part of model/'s contract. */
#ifndef KVSERVE_GRAMMAR_IMPL_H
#define KVSERVE_GRAMMAR_IMPL_H

#include <stdint.h>

#include "model/grammar/grammar.h"

typedef enum gelem_type {
    G_END = 0, /* end of an alternative: the rule is matched */
    G_BYTE,    /* one byte: val */
    G_SET,     /* one byte of the set sets[val] */
    G_REF,     /* the rule rules[val] */
} gelem_type;

typedef struct gelem {
    int32_t type;
    int32_t val;
} gelem;

typedef struct grule {
    char *name; /* NULL for rules generated from groups, repetitions and classes */
    int32_t first_alt, n_alts;
} grule;

struct grammar {
    gelem *elems;        /* [n_elems]: each rule's alternatives, each ended by G_END, then one
                            more G_END, so the element after a G_REF always exists */
    int32_t *alts;       /* alternative starts (indices into elems), rule by rule */
    grule *rules;        /* [n_rules] */
    uint64_t (*sets)[4]; /* [n_sets] 256-bit byte sets */
    int32_t n_elems, n_rules, n_sets;
    int32_t root;
};

static inline bool gelem_matches(const grammar *g, const gelem *e, uint8_t c) {
    if (e->type == G_BYTE) return e->val == c;
    return e->type == G_SET && (g->sets[e->val][c >> 6] >> (c & 63) & 1);
}

#endif
