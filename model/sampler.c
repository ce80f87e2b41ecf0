/* Token sampling over logits, and stop-string matching for generated text.
 *
 * Order of operations (llama.cpp's common sampler chain, with temperature applied before the
 * probability-mass cuts as HF transformers and vLLM do, so top-p and min-p see the distribution
 * that is actually sampled):
 *
 *   1. logit bias        logits[t] += bias (-INFINITY bans t)
 *   2. penalties         over the last repeat_last_n history tokens, per distinct token t seen
 *                        count times: repetition (llama.cpp: logit > 0 ? logit / r : logit * r),
 *                        then frequency/presence (OpenAI: logit -= count * f + (count > 0) * p)
 *   3. greedy            temperature == 0: argmax (lowest id on ties), steps 4-8 skipped
 *   4. top-k             keep the k highest logits (partial heap selection, not a full sort)
 *   5. temperature       logits / T
 *   6. top-p             keep the smallest prefix (by probability) whose mass reaches top_p
 *   7. min-p             keep tokens with p >= min_p * p_max
 *   8. sample            one draw from the renormalised survivors with the sampler's own PRNG
 *
 * logits[] is modified in place by steps 1-2 only: on return it holds the biased and penalised
 * logits. The logprob reported is log-softmax of the logits as they came in.
 *
 * Ties are broken by token id everywhere, and the PRNG is xoshiro256** seeded through
 * splitmix64, so a seed gives the same tokens on every machine (up to libm's expf). */
#include "model/sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- PRNG */

/* splitmix64 (Steele, Lea, Flood 2014) spreads a possibly small seed over xoshiro's 256-bit state,
 * as its authors recommend; a zero seed still gives a non-zero state. */
static uint64_t splitmix64_next(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256** 1.0 (Blackman, Vigna 2018). */
static uint64_t xoshiro_next(uint64_t s[4]) {
    uint64_t result = rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

/* Uniform double in [0, 1) from the top 53 bits. */
static double xoshiro_uniform(uint64_t s[4]) {
    return (double)(xoshiro_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

/* ---------------------------------------------------------------- state */

typedef struct candidate {
    int32_t id;
    float logit; /* after step 5 temperature-scaled and shifted so the best is 0 */
    float w;     /* expf(logit) from step 5 on: the unnormalised probability */
} candidate;

/* The incoming logit of a token that bias or a penalty changed, kept so logprob can be computed
 * under the unmodified distribution without copying all n_vocab logits. */
typedef struct logit_undo {
    int32_t token;
    float orig;
} logit_undo;

struct sampler {
    sampler_params p; /* p.bias points at bias below */
    logit_bias *bias; /* [n_bias] own copy */
    int32_t n_vocab;
    uint64_t rng[4];
    candidate *cand;  /* [n_vocab] scratch for steps 4-8; NULL when greedy */
    int32_t *count;   /* [n_vocab] penalty counts, all zero between calls; NULL when no penalty */
    logit_undo *undo; /* [cap_undo] modifications of the current call, in order */
    size_t cap_undo;
    size_t n_undo;
};

void sampler_params_default(sampler_params *p) {
    /* OpenAI's defaults (everything neutral at temperature 1) with llama.cpp's penalty window. */
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_k = 0;
    p->top_p = 1.0f;
    p->min_p = 0.0f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = 64;
    p->frequency_penalty = 0.0f;
    p->presence_penalty = 0.0f;
    p->seed = 0;
    p->bias = NULL;
    p->n_bias = 0;
}

static bool penalties_active(const sampler_params *p) {
    return p->repeat_last_n != 0 && (p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f ||
                                     p->presence_penalty != 0.0f);
}

static int params_validate(const sampler_params *p, int32_t n_vocab, kv_error *err) {
    if (n_vocab <= 0) return kv_fail(err, "sampler: n_vocab must be > 0 (got %d)", (int)n_vocab);
    /* Comparisons written so that NaN fails them. */
    if (!(p->temperature >= 0.0f) || !isfinite(p->temperature))
        return kv_fail(err, "temperature must be finite and >= 0 (got %g)", (double)p->temperature);
    if (p->top_k < 0) return kv_fail(err, "top_k must be >= 0 (got %d)", p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return kv_fail(err, "top_p must be in (0, 1] (got %g)", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return kv_fail(err, "min_p must be in [0, 1] (got %g)", (double)p->min_p);
    if (!(p->repeat_penalty > 0.0f) || !isfinite(p->repeat_penalty))
        return kv_fail(err, "repeat_penalty must be finite and > 0 (got %g)",
                       (double)p->repeat_penalty);
    if (p->repeat_last_n < -1)
        return kv_fail(err, "repeat_last_n must be >= -1 (got %d)", p->repeat_last_n);
    if (!isfinite(p->frequency_penalty))
        return kv_fail(err, "frequency_penalty must be finite (got %g)",
                       (double)p->frequency_penalty);
    if (!isfinite(p->presence_penalty))
        return kv_fail(err, "presence_penalty must be finite (got %g)",
                       (double)p->presence_penalty);
    if (p->n_bias < 0) return kv_fail(err, "logit_bias: count must be >= 0 (got %d)", p->n_bias);
    if (p->n_bias > 0 && !p->bias)
        return kv_fail(err, "logit_bias: NULL with %d entries", p->n_bias);
    for (int i = 0; i < p->n_bias; i++) {
        const logit_bias *b = &p->bias[i];
        if (b->token < 0 || b->token >= n_vocab)
            return kv_fail(err, "logit_bias: token id %d out of range [0, %d)", (int)b->token,
                           (int)n_vocab);
        /* -INFINITY is the documented ban; +INFINITY or NaN would poison the softmax. */
        if (isnan(b->bias) || b->bias == INFINITY)
            return kv_fail(err, "logit_bias: bias for token %d must be finite or -inf (got %g)",
                           (int)b->token, (double)b->bias);
    }
    return 0;
}

sampler *sampler_create(const sampler_params *p, int32_t n_vocab, kv_error *err) {
    if (!p) {
        kv_fail(err, "sampler: NULL params");
        return NULL;
    }
    if (params_validate(p, n_vocab, err) != 0) return NULL;
    sampler *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->p = *p;
    s->n_vocab = n_vocab;
    if (p->n_bias > 0) {
        s->bias = malloc((size_t)p->n_bias * sizeof *s->bias);
        if (!s->bias) goto oom;
        memcpy(s->bias, p->bias, (size_t)p->n_bias * sizeof *s->bias);
    }
    s->p.bias = s->bias;
    if (p->temperature > 0.0f) {
        s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
        if (!s->cand) goto oom;
    }
    /* Each call modifies at most n_bias entries plus one per distinct penalised token. */
    size_t n_pen = 0;
    if (penalties_active(p)) {
        s->count = calloc((size_t)n_vocab, sizeof *s->count);
        if (!s->count) goto oom;
        n_pen = (size_t)n_vocab;
        if (p->repeat_last_n > 0 && p->repeat_last_n < n_vocab) n_pen = (size_t)p->repeat_last_n;
    }
    s->cap_undo = (size_t)p->n_bias + n_pen;
    if (s->cap_undo > 0) {
        s->undo = malloc(s->cap_undo * sizeof *s->undo);
        if (!s->undo) goto oom;
    }
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64_next(&x);
    return s;
oom:
    sampler_destroy(s);
    kv_fail(err, "sampler: out of memory (n_vocab %d)", (int)n_vocab);
    return NULL;
}

void sampler_destroy(sampler *s) {
    if (!s) return;
    free(s->bias);
    free(s->cand);
    free(s->count);
    free(s->undo);
    free(s);
}

/* ---------------------------------------------------------------- steps 1-2: bias, penalties */

/* A broken forward pass must not poison the softmax: NaN counts as impossible, +inf as the
 * largest finite logit (so inf - inf never happens). */
static inline float logit_clean(float x) {
    if (isnan(x)) return -INFINITY;
    return x == INFINITY ? FLT_MAX : x;
}

static void undo_push(sampler *s, int32_t token, float orig) {
    /* Capacity is sized in sampler_create for the worst case; the check guards the invariant. */
    if (s->n_undo < s->cap_undo) s->undo[s->n_undo++] = (logit_undo){token, orig};
}

/* The first recorded value is the one before any modification of this call. */
static float logit_original(const sampler *s, const float *logits, int32_t token) {
    for (size_t i = 0; i < s->n_undo; i++)
        if (s->undo[i].token == token) return s->undo[i].orig;
    return logits[token];
}

static void bias_apply(sampler *s, float *logits) {
    for (int i = 0; i < s->p.n_bias; i++) {
        const logit_bias *b = &s->bias[i];
        undo_push(s, b->token, logits[b->token]);
        logits[b->token] += b->bias;
    }
}

static void penalties_apply(sampler *s, float *logits, const int32_t *history, int n_history) {
    if (!s->count || !history || n_history <= 0) return;
    int n = n_history;
    if (s->p.repeat_last_n > 0 && s->p.repeat_last_n < n) n = s->p.repeat_last_n;
    const int32_t *win = history + (n_history - n);
    const float rp = s->p.repeat_penalty, fp = s->p.frequency_penalty, pp = s->p.presence_penalty;
    for (int i = 0; i < n; i++)
        if (win[i] >= 0 && win[i] < s->n_vocab) s->count[win[i]]++;
    /* Each distinct token is penalised once, at its first occurrence in the window; its count is
     * then negated so later occurrences skip it, and the last loop zeroes what was touched. */
    for (int i = 0; i < n; i++) {
        int32_t t = win[i];
        if (t < 0 || t >= s->n_vocab || s->count[t] <= 0) continue;
        int32_t c = s->count[t];
        float l = logits[t];
        undo_push(s, t, l);
        l = l <= 0.0f ? l * rp : l / rp;
        l -= (float)c * fp + pp;
        logits[t] = l;
        s->count[t] = -c;
    }
    for (int i = 0; i < n; i++)
        if (win[i] >= 0 && win[i] < s->n_vocab) s->count[win[i]] = 0;
}

/* ---------------------------------------------------------------- steps 3-8 */

/* Total order: higher logit first, lower id on ties, so selection is reproducible. */
static inline bool cand_better(candidate a, candidate b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

/* Min-heap on "better": the root is the worst candidate kept so far. */
static void heap_sift_down(candidate *h, size_t n, size_t i) {
    for (;;) {
        size_t l = 2 * i + 1, worst = i;
        if (l < n && cand_better(h[worst], h[l])) worst = l;
        if (l + 1 < n && cand_better(h[worst], h[l + 1])) worst = l + 1;
        if (worst == i) return;
        candidate t = h[i];
        h[i] = h[worst];
        h[worst] = t;
        i = worst;
    }
}

/* Offers x to the heap h of the k best so far (full): x replaces the root, the worst kept, when
 * it is better; the candidate given up goes to *out. */
static void heap_offer(candidate *h, size_t k, candidate x, candidate *out) {
    if (!cand_better(x, h[0])) {
        *out = x;
        return;
    }
    *out = h[0];
    h[0] = x;
    heap_sift_down(h, k, 0);
}

/* Heap sort of a min-heap on "better": best first. */
static void heap_sort(candidate *h, size_t k) {
    for (size_t end = k; end-- > 1;) {
        candidate t = h[0];
        h[0] = h[end];
        h[end] = t;
        heap_sift_down(h, end, 0);
    }
}

/* Moves the k best of c[0..n) to c[0..k), sorted best first, in O(n log k); c stays a
 * permutation of its input, so a later call with a larger k sees every candidate again. */
static void select_top(candidate *c, size_t n, size_t k) {
    if (k == 0) return;
    for (size_t i = k / 2; i-- > 0;) heap_sift_down(c, k, i);
    for (size_t i = k; i < n; i++) heap_offer(c, k, c[i], &c[i]);
    heap_sort(c, k);
}

int sampler_top_ids(const float *logits, int32_t n, int k, int32_t *ids) {
    candidate h[SAMPLER_MAX_TOP_IDS];
    if (k > n) k = n;
    if (k > SAMPLER_MAX_TOP_IDS) k = SAMPLER_MAX_TOP_IDS;
    if (k <= 0) return 0;
    for (int i = 0; i < k; i++) h[i] = (candidate){.id = i, .logit = logit_clean(logits[i])};
    for (size_t i = (size_t)k / 2; i-- > 0;) heap_sift_down(h, (size_t)k, i);
    candidate out;
    for (int32_t i = k; i < n; i++)
        heap_offer(h, (size_t)k, (candidate){.id = i, .logit = logit_clean(logits[i])}, &out);
    heap_sort(h, (size_t)k);
    for (int i = 0; i < k; i++) ids[i] = h[i].id;
    return k;
}

int32_t sampler_argmax(const float *logits, int32_t n) {
    int32_t best = 0;
    float bv = logit_clean(logits[0]);
    for (int32_t i = 1; i < n; i++) {
        float v = logit_clean(logits[i]);
        if (v > bv) {
            bv = v;
            best = i;
        }
    }
    return best;
}

/* Bucket of a scaled logit in [lo, hi] for top-p's histogram: 0 holds the highest logits. */
static inline size_t bucket_of(float l, float hi, float scale, size_t n_buckets) {
    if (l == -INFINITY) return n_buckets - 1;
    float b = (hi - l) * scale;
    return b < (float)n_buckets ? (size_t)b : n_buckets - 1;
}

enum { TOP_P_BUCKETS = 256, TOP_P_SORT_MAX = 128, TOP_P_DEPTH = 4 };

/* Step 6: the smallest best-first prefix of c[0..n) whose mass reaches top_p * total; returns its
 * length, the prefix moved to c[0..). Sorting a 128k vocabulary for every token costs
 * milliseconds, so without a prior top-k the cut is found the way llama.cpp's bucket sort does:
 * a histogram of mass over logit buckets finds the bucket where the cumulative mass crosses the
 * target; tokens above it are in, tokens below it are out, and only that bucket is refined
 * (recursively, on its own range) until it is small enough to sort. Ties of logit share a
 * bucket, so the result is exactly the sorted prefix with ties broken by id. */
static size_t top_p_cut(candidate *c, size_t n, bool sorted, double total, float top_p) {
    const double target = (double)top_p * total;
    size_t start = 0;  /* c[0..start): in the nucleus, unsorted */
    double base = 0.0; /* their mass */
    for (int depth = 0; !sorted; depth++) {
        size_t m = n - start;
        float hi = -INFINITY, lo = INFINITY;
        for (size_t i = start; i < n; i++) {
            float l = c[i].logit;
            if (l == -INFINITY) continue;
            hi = l > hi ? l : hi;
            lo = l < lo ? l : lo;
        }
        const float scale = (float)TOP_P_BUCKETS / (hi - lo);
        if (m <= TOP_P_SORT_MAX || depth == TOP_P_DEPTH || !(hi > lo) || !isfinite(scale)) {
            select_top(c + start, m, m);
            sorted = true;
            break;
        }
        double mass[TOP_P_BUCKETS] = {0};
        for (size_t i = start; i < n; i++)
            mass[bucket_of(c[i].logit, hi, scale, TOP_P_BUCKETS)] += (double)c[i].w;
        size_t cut = 0;
        double cum = base;
        for (; cut < TOP_P_BUCKETS - 1; cut++) {
            if (cum + mass[cut] >= target) break;
            cum += mass[cut];
        }
        /* Keep buckets <= cut (dropping the rest), then move buckets < cut to the front. */
        size_t keep = start;
        for (size_t i = start; i < n; i++)
            if (bucket_of(c[i].logit, hi, scale, TOP_P_BUCKETS) <= cut) c[keep++] = c[i];
        size_t in = start;
        for (size_t i = start; i < keep; i++) {
            if (bucket_of(c[i].logit, hi, scale, TOP_P_BUCKETS) < cut) {
                candidate t = c[in];
                c[in++] = c[i];
                c[i] = t;
            }
        }
        start = in;
        base = cum;
        n = keep;
    }
    double cum = base;
    for (size_t i = start; i < n; i++) {
        cum += (double)c[i].w;
        if (cum >= target) return i + 1;
    }
    return n; /* rounding kept the sum just below target */
}

/* Steps 4-8. With a draft token (>= 0) step 8 is speculative sampling's rule for a draft that
 * proposed `draft` with certainty (Leviathan et al. 2023, Chen et al. 2023, with q a point
 * mass): accepted with probability p(draft) under the truncated distribution, else a draw from
 * that distribution with draft taken out and the rest renormalised, max(0, p - q) normalised.
 * Either way the token returned is distributed as p. */
static int32_t sample_truncated(sampler *s, const float *logits, int32_t draft, bool *accepted) {
    const sampler_params *p = &s->p;
    candidate *c = s->cand;
    size_t n = (size_t)s->n_vocab;
    for (size_t i = 0; i < n; i++) c[i] = (candidate){(int32_t)i, logit_clean(logits[i]), 0.0f};
    bool sorted = false;

    /* 4. top-k */
    if (p->top_k > 0 && (size_t)p->top_k < n) {
        select_top(c, n, (size_t)p->top_k);
        n = (size_t)p->top_k;
        sorted = true;
    }

    float max = -INFINITY;
    for (size_t i = 0; i < n; i++) max = c[i].logit > max ? c[i].logit : max;
    if (max == -INFINITY) return c[0].id; /* everything banned: nothing better to offer */

    /* 5. temperature; shifting by the max keeps expf() in range and makes the max's weight 1.
     * Weights are computed once here and reused by every later step. */
    const float inv_t = 1.0f / p->temperature;
    double total = 0.0;
    for (size_t i = 0; i < n; i++) {
        /* d == 0 kept exact: a tiny temperature makes inv_t infinite, and 0 * inf is NaN */
        float d = c[i].logit - max;
        c[i].logit = d == 0.0f ? 0.0f : d * inv_t;
        c[i].w = expf(c[i].logit);
        total += (double)c[i].w;
    }

    /* 6-7. top-p then min-p. Both keep a best-first prefix and min-p's threshold is relative to
     * the max, which top-p always keeps, so the result is the shorter of the two prefixes with
     * top-p's mass measured before min-p (total, above). That lets min-p run first as a cheap
     * linear cut and top-p order only what min-p left. */
    if (p->min_p > 0.0f) {
        const float thresh = logf(p->min_p);
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if (c[i].logit >= thresh) c[m++] = c[i];
        n = m; /* >= 1: the max has logit 0 >= log(min_p) */
    }
    if (p->top_p < 1.0f) n = top_p_cut(c, n, sorted, total, p->top_p);

    /* 8. sample */
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += (double)c[i].w;
    if (draft >= 0) {
        double pd = 0.0;
        for (size_t i = 0; i < n; i++)
            if (c[i].id == draft) {
                pd = (double)c[i].w;
                c[i].w = 0.0f; /* out of the residual distribution if rejected */
            }
        if (pd > 0.0 && xoshiro_uniform(s->rng) * sum < pd) {
            *accepted = true;
            return draft;
        }
        sum -= pd;
        if (!(sum > 0.0)) return draft; /* p is all on the draft: not reached (accepted above) */
    }
    double r = xoshiro_uniform(s->rng) * sum, acc = 0.0;
    size_t last = 0;
    for (size_t i = 0; i < n; i++) {
        if (c[i].w <= 0.0f) continue;
        acc += (double)c[i].w;
        last = i;
        if (r < acc) return c[i].id;
    }
    return c[last].id; /* r landed past the sum through rounding */
}

int32_t sampler_sample(sampler *s, float *logits, const int32_t *history, int n_history,
                       float *logprob) {
    return sampler_sample_draft(s, logits, history, n_history, -1, logprob, NULL);
}

int32_t sampler_sample_draft(sampler *s, float *logits, const int32_t *history, int n_history,
                             int32_t draft, float *logprob, bool *accepted) {
    const int32_t n = s->n_vocab;
    bool acc = false;
    if (draft >= n) draft = -1;
    /* log-softmax normaliser of the incoming logits, before anything changes them, kept as max
     * and log-sum apart: log p = (l - max) - log(sum) loses nothing when max is huge */
    float lmax = -INFINITY;
    double log_sum = 0.0;
    if (logprob) {
        for (int32_t i = 0; i < n; i++) lmax = fmaxf(lmax, logit_clean(logits[i]));
        double sum = 0.0;
        if (lmax != -INFINITY)
            for (int32_t i = 0; i < n; i++) sum += (double)expf(logit_clean(logits[i]) - lmax);
        log_sum = log(sum);
    }

    s->n_undo = 0;
    bias_apply(s, logits);
    penalties_apply(s, logits, history, n_history);

    int32_t tok = s->p.temperature > 0.0f ? sample_truncated(s, logits, draft, &acc)
                                          : sampler_argmax(logits, n);
    /* greedy: the draft is kept when it is the argmax; no draw either way */
    if (s->p.temperature <= 0.0f) acc = draft >= 0 && tok == draft;
    if (accepted) *accepted = acc;

    if (logprob) {
        float orig = logit_clean(logit_original(s, logits, tok));
        *logprob = orig == -INFINITY ? -INFINITY : (float)((double)(orig - lmax) - log_sum);
    }
    return tok;
}

/* ---------------------------------------------------------------- stop strings */

int stop_set_init(stop_set *s, const char *const *strs, int n, kv_error *err) {
    memset(s, 0, sizeof *s);
    if (n < 0) return kv_fail(err, "stop: count must be >= 0 (got %d)", n);
    if (n == 0) return 0;
    if (!strs) return kv_fail(err, "stop: NULL list with %d entries", n);
    s->strs = calloc((size_t)n, sizeof *s->strs);
    s->lens = calloc((size_t)n, sizeof *s->lens);
    if (!s->strs || !s->lens) goto oom;
    for (int i = 0; i < n; i++) {
        if (!strs[i] || strs[i][0] == '\0') {
            stop_set_free(s);
            return kv_fail(err, "stop: string %d is empty", i);
        }
        size_t len = strlen(strs[i]);
        s->strs[i] = malloc(len + 1);
        if (!s->strs[i]) goto oom;
        memcpy(s->strs[i], strs[i], len + 1);
        s->lens[i] = len;
        s->n = i + 1;
    }
    return 0;
oom:
    s->n = n; /* calloc'd slots not yet filled are NULL and free(NULL) is fine */
    stop_set_free(s);
    return kv_fail(err, "stop: out of memory");
}

void stop_set_free(stop_set *s) {
    if (!s) return;
    if (s->strs)
        for (int i = 0; i < s->n; i++) free(s->strs[i]);
    free(s->strs);
    free(s->lens);
    memset(s, 0, sizeof *s);
}

int stop_set_match_at(const stop_set *s, const char *text, size_t len) {
    for (int i = 0; s && i < s->n; i++)
        if (s->lens[i] <= len && memcmp(text, s->strs[i], s->lens[i]) == 0) return i;
    return -1;
}

size_t stop_set_scan(const stop_set *s, const char *text, size_t len, bool *matched) {
    if (matched) *matched = false;
    if (!s || s->n == 0 || len == 0) return len;
    /* Earliest start over all stop strings: the emitted text must end before any of them. */
    size_t first = len;
    bool found = false;
    for (int i = 0; i < s->n; i++) {
        const char *hit = memmem(text, len, s->strs[i], s->lens[i]);
        if (hit && (size_t)(hit - text) < first) {
            first = (size_t)(hit - text);
            found = true;
        }
    }
    if (found) {
        if (matched) *matched = true;
        return first;
    }
    /* No full match: hold back the longest tail that is a proper prefix of some stop string. */
    size_t hold = 0;
    for (int i = 0; i < s->n; i++) {
        size_t k = s->lens[i] - 1 < len ? s->lens[i] - 1 : len;
        for (; k > hold; k--) {
            if (memcmp(text + len - k, s->strs[i], k) == 0) {
                hold = k;
                break;
            }
        }
    }
    return len - hold;
}
