/* cache/quality.h: how close each approximate reuse method comes to a full prefill on this
 * model, and what the server's quality budget lets it use (DESIGN.md "Reuse quality").
 *
 * Every method that is not exact (blend at a policy and ratio, the schema fix-up, q8 and the
 * codec levels) is judged against the noise floor: two exact full prefills that differ only in
 * rounding (default vs --precise), in first-token KL, top-1 agreement and identical answers. A
 * calibration (MODEL.kvquality.json, written by `make calibrate-reuse`, bound to the model's
 * identity as the codec table is) holds those figures for the floor and for every setting it
 * measured; the budget (--reuse-quality) picks from it, per method, the cheapest setting whose
 * figures stay within budget, and turns off a method none of whose settings do. A model with no
 * calibration gets exact reuse only.
 *
 * Plain data and pure functions, apart from the loader's file read: the planner and the server
 * apply the choice. */
#ifndef KVSERVE_CACHE_QUALITY_H
#define KVSERVE_CACHE_QUALITY_H

#include <stdbool.h>
#include <stdint.h>

#include "cache/cache.h"
#include "util/util.h"

typedef enum quality_method {
    QUALITY_BLEND = 0, /* blend (CacheBlend / LegoLink / hybrid) at a policy and ratio */
    QUALITY_FIXUP = 1, /* Prompt Cache's fix-up at a ratio */
    QUALITY_LEVEL = 2, /* a lossy encoding of reused KV: q8 or a codec level */
    QUALITY_METHOD_COUNT
} quality_method;

/* One measured setting of a method, against a full prefill of the same prompts. */
typedef struct quality_point {
    quality_method method;
    blend_policy policy; /* QUALITY_BLEND */
    float ratio;         /* QUALITY_BLEND, QUALITY_FIXUP: the recompute ratio */
    int enc;             /* QUALITY_LEVEL: CACHE_ENC_Q8 or a codec level */
    double kl;           /* mean first-token KL(full prefill || method) */
    double top1;         /* share of first tokens equal to the full prefill's, 0..1 */
    double same;         /* share of whole greedy answers equal, 0..1 (-1: not measured) */
    double speedup;      /* TTFT of a full prefill over the method's (0: not measured) */
} quality_point;

#define QUALITY_MAX_POINTS 256

typedef struct quality_table {
    uint8_t model_id[32];
    int prompts;     /* how many prompts the figures are means over */
    double floor_kl; /* the noise floor: default vs --precise full prefills */
    double floor_top1;
    double floor_same;
    quality_point pts[QUALITY_MAX_POINTS];
    int n_pts;
} quality_table;

/* Reads a calibration (JSON, "kvserve-kvquality" version 1). -1 with err when it cannot be
 * read, is malformed, or was measured on another model (model_id). */
int quality_table_load(quality_table *t, const char *path, const uint8_t model_id[32],
                       kv_error *err);
/* Parses the calibration's JSON text (what quality_table_load reads). */
int quality_table_parse(quality_table *t, const char *json, size_t len, const uint8_t model_id[32],
                        kv_error *err);

typedef enum quality_budget_kind {
    QUALITY_BUDGET_NONE = 0, /* no gate: every method as configured (needs no calibration) */
    QUALITY_BUDGET_FLOOR,    /* KL within 2x the floor's, top-1 within 2 points of it */
    QUALITY_BUDGET_BALANCED, /* KL within 5x, top-1 within 5 points */
    QUALITY_BUDGET_FAST,     /* KL within 15x, top-1 within 10 points */
    QUALITY_BUDGET_KL,       /* KL at most max_kl, top-1 not checked */
} quality_budget_kind;

typedef struct quality_budget {
    quality_budget_kind kind;
    double max_kl; /* QUALITY_BUDGET_KL */
} quality_budget;

/* "none", "floor", "balanced", "fast", or a KL (a number > 0). -1 with err otherwise. */
int quality_budget_parse(const char *s, quality_budget *out, kv_error *err);
/* What the budget allows on table t, in words: "KL <= 0.0080 and top-1 >= 94%". */
void quality_budget_describe(const quality_budget *b, const quality_table *t, char *out,
                             size_t cap);
/* True when p's figures are within budget b on table t. */
bool quality_meets(const quality_budget *b, const quality_table *t, const quality_point *p);

/* The settings a budget picks. */
typedef struct quality_choice {
    bool gated; /* false: no budget (QUALITY_BUDGET_NONE): everything as configured */
    /* blend: on for requests that ask nothing, at this policy and ratio */
    bool blend;
    blend_policy blend_policy;
    float blend_ratio;
    /* the schema fix-up: the least ratio within budget (-1: none is) */
    float fixup_ratio;
    /* the lossy encodings the fetch policy may choose: bit e for CACHE_ENC_* e */
    uint32_t levels;
    /* per method, why: "hkvd 30%: KL 0.0071, top-1 98% (speed-up 2.6x)" or the reason it is
     * off */
    char why[QUALITY_METHOD_COUNT][320];
} quality_choice;

/* The least measured TTFT speed-up for which a budget turns approximate reuse (blend, the
 * fix-up) on. Below it the gain is within a calibration's timing noise, and it is not worth
 * what approximate reuse costs besides its answers: a blended prompt's KV is never stored
 * (only what a full prefill computes is), so a later repeat of the same prompt, or the same
 * prompt after a restart, blends again instead of reusing its whole KV exactly. */
#define QUALITY_MIN_SPEEDUP 1.25

/* Picks, per method, the setting of t within b with the highest speed-up (the least ratio where
 * speed-ups were not measured), among blend and fix-up settings with a speed-up of at least
 * QUALITY_MIN_SPEEDUP where it was measured; t NULL: no calibration, exact reuse only (unless b
 * is NONE). */
void quality_choose(const quality_budget *b, const quality_table *t, quality_choice *out);

/* ---------------------------------------------------------------- the live check
 *
 * A sampled share of blended requests is computed again as a full prefill when the engine has
 * nothing else to do, and the two first-token distributions compared. The monitor keeps the
 * rolling figures of the setting in force; when they leave the budget it steps to the next
 * safer setting of the same policy (a higher ratio the calibration measured, then a full
 * prefill: ratio 1), and when a safer setting has stayed well within budget for a window it
 * steps back towards the calibrated one. Not thread-safe: its owner locks. */

#define QUALITY_WINDOW 20 /* samples the rolling figures are over */
#define QUALITY_LADDER 16

typedef struct quality_monitor {
    bool on;       /* a blend setting is in force and a budget judges it */
    double max_kl; /* the budget's bounds on this model */
    double min_top1;
    float ladder[QUALITY_LADDER]; /* ratios, cheapest first: the calibrated one .. 1 */
    int n_ladder;
    int at; /* the ratio in force: ladder[at] */
    blend_policy policy;
    double kl[QUALITY_WINDOW]; /* the samples since the last step, a ring */
    bool top1[QUALITY_WINDOW];
    int n, head;
    /* hysteresis: windows well within budget in a row at this setting, and how often each
     * setting left the budget (a step back to it waits 2^fails windows, at most 16) */
    int good;
    int fails[QUALITY_LADDER];
    int64_t samples, steps_up, steps_down; /* totals */
    double last_kl, last_top1;             /* the rolling figures when last full */
} quality_monitor;

/* A monitor of the setting c chose under b over t (off when c has no blend setting). */
void quality_monitor_init(quality_monitor *mon, const quality_budget *b, const quality_table *t,
                          const quality_choice *c);
/* Adds a sample (the KL of the sampled request's first token against the full prefill's, and
 * whether their top tokens agree). Returns +1 when the monitor stepped to a safer setting, -1
 * when it stepped back, 0 otherwise; why says so, with the numbers. */
int quality_monitor_add(quality_monitor *mon, double kl, bool top1, char *why, size_t cap);
/* The ratio in force. */
float quality_monitor_ratio(const quality_monitor *mon);

/* KL(p || q) of two next-token distributions known by their top-k lists (token ids and
 * logprobs, most likely first), over the union of both lists: a token one list lacks gets the
 * smaller of that list's least logprob and the mass it leaves out (the estimator
 * scripts/bench/blend.py uses, so the live figures compare with the offline ones). */
double quality_kl_topk(const int32_t *p_ids, const float *p_lps, int n_p, const int32_t *q_ids,
                       const float *q_lps, int n_q);

#endif
