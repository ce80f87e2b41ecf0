/* Comparing logits with a reference's top-k (tests/unit/ref_logits.h), for the model and
 * architecture tests: top-1 agreement, agreement where the reference is decisive, and the
 * logit deltas, reported on one line. */
#include "tests/unit/ref_logits.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>

#include "model/sampler.h"

void ref_compare(ref_stats *st, const float *lg, int n_vocab, json_t *ids, json_t *vals) {
    int ref_top = (int)json_integer_value(json_array_get(ids, 0));
    double margin =
        json_real_value(json_array_get(vals, 0)) - json_real_value(json_array_get(vals, 1));
    bool agree = sampler_argmax(lg, n_vocab) == ref_top;
    st->n_pos++;
    st->top1 += agree;
    if (margin >= DECISIVE_MARGIN) {
        st->decisive++;
        st->decisive_agree += agree;
    }
    for (size_t k = 0; k < json_array_size(ids); k++) {
        int id = (int)json_integer_value(json_array_get(ids, k));
        cr_assert(id >= 0 && id < n_vocab, "reference token id %d out of range", id);
        double d = fabs(lg[id] - json_real_value(json_array_get(vals, k)));
        st->max_delta = d > st->max_delta ? d : st->max_delta;
        st->sum_delta += d;
        st->n_delta++;
    }
}

double ref_mean_delta(const ref_stats *st) { return st->n_delta ? st->sum_delta / st->n_delta : 0; }

void ref_report(const char *what, const char *ref, const ref_stats *st) {
    fprintf(stderr,
            "%s vs %s: %d positions, top-1 agreement %.2f%% (%d/%d); where the reference's "
            "margin >= %.1f: %d/%d; |delta logit| over its top-k: max %.3f, mean %.4f\n",
            what, ref, st->n_pos, st->n_pos ? 100.0 * st->top1 / st->n_pos : 0.0, st->top1,
            st->n_pos, DECISIVE_MARGIN, st->decisive_agree, st->decisive, st->max_delta,
            ref_mean_delta(st));
}
