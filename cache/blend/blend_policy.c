/* Blend's selection policies (cache/blend/blend.h): their names, and the chunk-start tokens that
 * LegoLink and the hybrid force. Plain functions over spans, apart from the fusor, so the
 * request parser links them alone. */
#include <math.h>
#include <string.h>

#include "cache/blend/blend.h"

static const char *const POLICY_NAMES[BLEND_POLICY_COUNT] = {"hkvd", "legolink", "hybrid"};

const char *blend_policy_name(blend_policy p) {
    return p >= 0 && p < BLEND_POLICY_COUNT ? POLICY_NAMES[p] : "?";
}

int blend_policy_parse(const char *name) {
    for (int p = 0; p < BLEND_POLICY_COUNT; p++)
        if (name && strcmp(name, POLICY_NAMES[p]) == 0) return p;
    return -1;
}

/* True when span i goes on where span i - 1 ends, in the prompt and in the context its KV was
 * computed in: the two are one run of KV from one earlier prompt. */
static bool continues_run(const blend_span *spans, int i) {
    if (i == 0) return false;
    const blend_span *a = &spans[i - 1], *b = &spans[i];
    return b->slot == a->slot + a->n && b->rec->pos0 + b->off == a->rec->pos0 + a->off + a->n;
}

/* Tokens forced when each run gives its first k (runs shorter than k give all they have). */
static int64_t forced_at(const blend_span *spans, int n_spans, int k) {
    int64_t total = 0, left = 0;
    for (int i = 0; i < n_spans; i++) {
        if (!continues_run(spans, i)) left = k;
        int64_t take = left < spans[i].n ? left : spans[i].n;
        total += take;
        left -= take;
    }
    return total;
}

int blend_force_run_starts(blend_span *spans, int n_spans, blend_policy policy, float ratio) {
    int64_t n_reused = 0;
    int longest = 0;
    for (int i = 0, run = 0; i < n_spans; i++) {
        spans[i].forced = 0;
        n_reused += spans[i].n;
        run = continues_run(spans, i) ? run + spans[i].n : spans[i].n;
        if (run > longest) longest = run;
    }
    if (policy == BLEND_POLICY_HKVD || ratio <= 0 || n_spans == 0) return 0;
    /* The budget is the deep layers' (blend_rows_at_layer): the least k that spends it, the
     * runs shorter than k lending the rest to the longer ones; ratio 1 forces every token. */
    /* (a float ratio of m / n is off by up to 6e-8 relative: m, not m + 1) */
    int64_t budget =
        ratio >= 1 ? n_reused : (int64_t)ceil((double)ratio * n_reused * (1 - 1e-6) - 1e-9);
    int lo = 0, hi = longest;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (forced_at(spans, n_spans, mid) >= budget)
            hi = mid;
        else
            lo = mid + 1;
    }
    int k = lo;
    if (policy == BLEND_POLICY_HYBRID && ratio < 1 && k > BLEND_HYBRID_K) k = BLEND_HYBRID_K;
    for (int i = 0, left = 0; i < n_spans; i++) {
        if (!continues_run(spans, i)) left = k;
        spans[i].forced = left < spans[i].n ? left : spans[i].n;
        left -= spans[i].forced;
    }
    return k;
}

int blend_rows_at_layer(float ratio, int reused, int layer) {
    /* Layer 0's K and V are a token's embedding through one norm and one projection: the same in
     * any context (re-rotation aside), so its deviation says nothing. Layer 1 is the first whose
     * KV depends on the context: every reused token is computed through it and ranked there. */
    if (layer <= 1) return ratio > 0 ? reused : 0;
    /* Gradual filtering (CacheBlend section 4.3): twice the ratio at layer 2, then down to it
     * within a few layers, as 1 + 1 / (l - 1)^2: deviation ranks agree closely from one layer
     * to the next (the paper's figure 8), so long tails of extra rows bought nothing measurable
     * (bench-blend, 16 questions at 15%: first-token KL 0.101 with 1 + 1 / (l - 1), 0.104 with
     * this, for 5% less time). */
    double d = (double)(layer - 1);
    double r = (double)ratio * (1.0 + 1.0 / (d * d));
    if (r >= 1) return reused;
    int n = (int)ceil(r * reused - 1e-9);
    return n < 0 ? 0 : n;
}
