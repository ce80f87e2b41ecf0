/* Token sampling over logits, and stop-string matching for generated text. */
#ifndef KVSERVE_SAMPLER_H
#define KVSERVE_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

typedef struct logit_bias {
    int32_t token;
    float bias; /* added to the logit; -INFINITY bans the token */
} logit_bias;

typedef struct sampler_params {
    float temperature;       /* <= 0: greedy */
    int top_k;               /* <= 0: off */
    float top_p;             /* >= 1: off */
    float min_p;             /* <= 0: off */
    float repeat_penalty;    /* 1: off (llama.cpp semantics: divide positive, multiply negative) */
    int repeat_last_n;       /* window for the three penalties; -1: whole history */
    float frequency_penalty; /* 0: off (OpenAI semantics) */
    float presence_penalty;  /* 0: off */
    uint64_t seed;
    const logit_bias *bias;
    int n_bias;
} sampler_params;

void sampler_params_default(sampler_params *p);

typedef struct sampler sampler;

/* Validates params (ranges, bias token ids < n_vocab) and copies them. */
sampler *sampler_create(const sampler_params *p, int32_t n_vocab, kv_error *err);
void sampler_destroy(sampler *s);

/* Picks the next token from logits[n_vocab] (modified in place). history holds the tokens the
 * penalties look at (prompt + generated so far). Same seed + same inputs = same token. If
 * logprob is non-NULL it receives log p(token) under the model's unmodified distribution. */
int32_t sampler_sample(sampler *s, float *logits, const int32_t *history, int n_history,
                       float *logprob);

/* sampler_sample, verifying a draft token (draft < 0: none, as sampler_sample): greedy keeps it
 * when it is the argmax; sampling keeps it with probability p(draft) under the distribution
 * sampler_sample draws from (after bias, penalties, top-k, temperature, top-p, min-p), else
 * draws from that distribution without it, so the token returned is distributed exactly as
 * sampler_sample's (speculative sampling's accept/resample rule for a draft that proposes one
 * token with certainty). *accepted (may be NULL) says whether the token is the draft. */
int32_t sampler_sample_draft(sampler *s, float *logits, const int32_t *history, int n_history,
                             int32_t draft, float *logprob, bool *accepted);

/* The greedy choice: the id of the highest logit, the lowest such id on ties (NaN counts as
 * -inf). */
int32_t sampler_argmax(const float *logits, int32_t n);

#define SAMPLER_MAX_TOP_IDS 64
/* The ids of the k (at most SAMPLER_MAX_TOP_IDS, and n) highest logits, best first, lower ids
 * first on ties (the order sampling and greedy use), in O(n log k). Returns their count. */
int sampler_top_ids(const float *logits, int32_t n, int k, int32_t *ids);

/* ---------------------------------------------------------------- stop strings */

typedef struct stop_set {
    char **strs;
    size_t *lens;
    int n;
} stop_set;

/* Copies the strings (empty ones are an error). */
int stop_set_init(stop_set *s, const char *const *strs, int n, kv_error *err);
void stop_set_free(stop_set *s);

/* For generated text[0..len): if a stop string occurs, returns its first start offset (the text
 * to emit ends there) and sets *matched. Otherwise returns how many bytes are safe to emit: all
 * but a trailing part that could still grow into a stop string. */
size_t stop_set_scan(const stop_set *s, const char *text, size_t len, bool *matched);
/* The index of a stop string text[0..len) begins with (where stop_set_scan found a match), or
 * -1 when none does. */
int stop_set_match_at(const stop_set *s, const char *text, size_t len);

#endif
