/* Comparing kvserve's logits with a reference's top-k (ids and logits, from tests/golden/). Shared
 * by the model and architecture tests. */
#ifndef KVSERVE_REF_LOGITS_H
#define KVSERVE_REF_LOGITS_H

#include <jansson.h>

/* A reference's top-1 is "decisive" where it leads its runner-up by this many logits: more than
 * 8-bit activation quantization moves a logit (llama.cpp and kvserve each differ from the exact
 * computation by ~0.2 on average), so there no correct engine may disagree. */
#define DECISIVE_MARGIN 0.5

typedef struct ref_stats {
    int n_pos, top1, decisive, decisive_agree;
    double max_delta, sum_delta;
    int n_delta;
} ref_stats;

/* Adds one position: lg[n_vocab] against the reference's top ids and their logits. */
void ref_compare(ref_stats *st, const float *lg, int n_vocab, json_t *ids, json_t *vals);
double ref_mean_delta(const ref_stats *st);
/* One line on stderr: "<what> vs <ref>: positions, top-1, decisive, |delta| max and mean". */
void ref_report(const char *what, const char *ref, const ref_stats *st);

#endif
