/* Reuse quality (cache/quality.h): the calibration file, the budget, and the choice per method.
 *
 * The file (what `make calibrate-reuse` writes; figures are means over its prompts):
 *   {"format": "kvserve-kvquality", "version": 1, "model_identity": "<64 hex digits>",
 *    "prompts": 50,
 *    "floor": {"kl": 0.004, "top1": 0.98, "same": 0.52},
 *    "points": [{"method": "blend", "policy": "hkvd", "ratio": 0.15,
 *                "kl": 0.099, "top1": 0.7, "same": 0.08, "speedup": 4.2},
 *               {"method": "fixup", "ratio": 0.3, ...}, {"method": "level", "level": "q8", ...}]}
 * Every field is checked before it is trusted; unknown fields are ignored (later versions may add
 * figures). */
#include "cache/quality.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QUALITY_FORMAT "kvserve-kvquality"
#define QUALITY_VERSION 1

static const char *const METHOD_NAMES[QUALITY_METHOD_COUNT] = {"blend", "fixup", "level"};

/* A figure in [lo, hi]: 0 when present and valid, 1 when absent (optional), -1 otherwise. */
static int figure(const json_t *o, const char *key, double lo, double hi, double *out,
                  bool required, const char *where, kv_error *err) {
    const json_t *v = json_object_get(o, key);
    if (!v) {
        if (required) return kv_fail(err, "%s: '%s' is missing", where, key);
        return 1;
    }
    if (!json_is_number(v)) return kv_fail(err, "%s: '%s' must be a number", where, key);
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi)
        return kv_fail(err, "%s: '%s' is %g, outside [%g, %g]", where, key, d, lo, hi);
    *out = d;
    return 0;
}

static int parse_hex_id(const char *hex, uint8_t id[32]) {
    if (!hex || strlen(hex) != 64) return -1;
    for (int i = 0; i < 32; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return -1;
        id[i] = (uint8_t)v;
    }
    return 0;
}

static int parse_point(const json_t *o, int i, quality_point *p, kv_error *err) {
    char where[48];
    snprintf(where, sizeof where, "points[%d]", i);
    if (!json_is_object(o)) return kv_fail(err, "%s must be an object", where);
    const char *method = json_string_value(json_object_get(o, "method"));
    int m = -1;
    for (int k = 0; k < QUALITY_METHOD_COUNT; k++)
        if (method && strcmp(method, METHOD_NAMES[k]) == 0) m = k;
    if (m < 0) return kv_fail(err, "%s: 'method' must be blend, fixup or level", where);
    memset(p, 0, sizeof *p);
    p->method = (quality_method)m;
    p->same = -1;
    double ratio = 0;
    if (m == QUALITY_BLEND) {
        int pol = blend_policy_parse(json_string_value(json_object_get(o, "policy")));
        if (pol < 0) return kv_fail(err, "%s: 'policy' must be hkvd, legolink or hybrid", where);
        p->policy = (blend_policy)pol;
    }
    if (m == QUALITY_BLEND || m == QUALITY_FIXUP) {
        if (figure(o, "ratio", 0, 1, &ratio, true, where, err) < 0) return -1;
        p->ratio = (float)ratio;
    } else {
        const char *level = json_string_value(json_object_get(o, "level"));
        p->enc = level ? cache_enc_parse(level) : CACHE_ENC_ANY;
        if (p->enc < CACHE_ENC_Q8 || p->enc >= CACHE_ENC_MAX)
            return kv_fail(err, "%s: 'level' must be q8 or codec0..codec%d", where,
                           CACHE_ENC_MAX - CACHE_ENC_CODEC - 1);
    }
    if (figure(o, "kl", 0, 1e6, &p->kl, true, where, err) < 0 ||
        figure(o, "top1", 0, 1, &p->top1, true, where, err) < 0 ||
        figure(o, "same", 0, 1, &p->same, false, where, err) < 0 ||
        figure(o, "speedup", 0, 1e6, &p->speedup, false, where, err) < 0)
        return -1;
    return 0;
}

int quality_table_parse(quality_table *t, const char *json, size_t len, const uint8_t model_id[32],
                        kv_error *err) {
    memset(t, 0, sizeof *t);
    json_error_t jerr;
    json_t *root = json_loadb(json, len, 0, &jerr);
    if (!root) return kv_fail(err, "not JSON (line %d: %s)", jerr.line, jerr.text);
    int rc = -1;
    const json_t *floor = json_object_get(root, "floor"), *pts = json_object_get(root, "points");
    const char *format = json_string_value(json_object_get(root, "format"));
    const json_t *version = json_object_get(root, "version");
    if (!json_is_object(root) || !format || strcmp(format, QUALITY_FORMAT) != 0) {
        kv_fail(err, "not a reuse-quality calibration ('format' is not \"%s\")", QUALITY_FORMAT);
        goto done;
    }
    if (!json_is_integer(version) || json_integer_value(version) != QUALITY_VERSION) {
        kv_fail(err, "calibration version is not %d", QUALITY_VERSION);
        goto done;
    }
    if (parse_hex_id(json_string_value(json_object_get(root, "model_identity")), t->model_id)) {
        kv_fail(err, "'model_identity' must be 64 hex digits");
        goto done;
    }
    if (memcmp(t->model_id, model_id, 32) != 0) {
        kv_fail(err, "it was measured on another model (its model_identity is not this model's)");
        goto done;
    }
    const json_t *np = json_object_get(root, "prompts");
    if (!json_is_integer(np) || json_integer_value(np) < 1 || json_integer_value(np) > 1000000) {
        kv_fail(err, "'prompts' must be a positive integer");
        goto done;
    }
    t->prompts = (int)json_integer_value(np);
    if (!json_is_object(floor)) {
        kv_fail(err, "'floor' must be an object");
        goto done;
    }
    t->floor_same = -1;
    if (figure(floor, "kl", 0, 1e6, &t->floor_kl, true, "floor", err) < 0 ||
        figure(floor, "top1", 0, 1, &t->floor_top1, true, "floor", err) < 0 ||
        figure(floor, "same", 0, 1, &t->floor_same, false, "floor", err) < 0)
        goto done;
    if (!json_is_array(pts) || json_array_size(pts) > QUALITY_MAX_POINTS) {
        kv_fail(err, "'points' must be an array of at most %d", QUALITY_MAX_POINTS);
        goto done;
    }
    for (size_t i = 0; i < json_array_size(pts); i++)
        if (parse_point(json_array_get(pts, i), (int)i, &t->pts[t->n_pts++], err)) goto done;
    rc = 0;
done:
    json_decref(root);
    return rc;
}

int quality_table_load(quality_table *t, const char *path, const uint8_t model_id[32],
                       kv_error *err) {
    /* a calibration is a few KB: anything past 1 MB is not one */
    size_t n;
    char *buf = kv_read_file(path, 1 << 20, &n, err);
    if (!buf) return -1;
    int rc = quality_table_parse(t, buf, n, model_id, err);
    if (rc) kv_fail_wrap(err, "%s", path);
    free(buf);
    return rc;
}

/* ---------------------------------------------------------------- the budget */

/* A budget's bound on KL as a multiple of the floor's, and its slack on top-1 (points). */
static const struct {
    const char *name;
    double kl_times;
    double top1_slack;
} BUDGETS[] = {
    [QUALITY_BUDGET_NONE] = {"none", 0, 0},
    [QUALITY_BUDGET_FLOOR] = {"floor", 2, 0.02},
    [QUALITY_BUDGET_BALANCED] = {"balanced", 5, 0.05},
    [QUALITY_BUDGET_FAST] = {"fast", 15, 0.10},
};

int quality_budget_parse(const char *s, quality_budget *out, kv_error *err) {
    memset(out, 0, sizeof *out);
    for (int k = QUALITY_BUDGET_NONE; k <= QUALITY_BUDGET_FAST; k++)
        if (s && strcmp(s, BUDGETS[k].name) == 0) {
            out->kind = (quality_budget_kind)k;
            return 0;
        }
    char *end = NULL;
    double kl = s ? strtod(s, &end) : 0;
    if (!s || end == s || *end || !isfinite(kl) || kl <= 0)
        return kv_fail(err,
                       "--reuse-quality must be none, floor, balanced, fast or a KL > 0 "
                       "(got '%s')",
                       s ? s : "");
    out->kind = QUALITY_BUDGET_KL;
    out->max_kl = kl;
    return 0;
}

/* The bounds of budget b on table t: KL at most *kl, top-1 at least *top1. */
static void bounds(const quality_budget *b, const quality_table *t, double *kl, double *top1) {
    if (b->kind == QUALITY_BUDGET_KL) {
        *kl = b->max_kl;
        *top1 = 0;
        return;
    }
    *kl = BUDGETS[b->kind].kl_times * t->floor_kl;
    *top1 = t->floor_top1 - BUDGETS[b->kind].top1_slack;
}

void quality_budget_describe(const quality_budget *b, const quality_table *t, char *out,
                             size_t cap) {
    if (b->kind == QUALITY_BUDGET_NONE || !t) {
        snprintf(out, cap, "%s", b->kind == QUALITY_BUDGET_NONE ? "no gate" : "no calibration");
        return;
    }
    double kl, top1;
    bounds(b, t, &kl, &top1);
    if (b->kind == QUALITY_BUDGET_KL)
        snprintf(out, cap, "KL <= %.4f", kl);
    else
        snprintf(out, cap, "KL <= %.4f and top-1 >= %.0f%%", kl, 100 * top1);
}

bool quality_meets(const quality_budget *b, const quality_table *t, const quality_point *p) {
    if (b->kind == QUALITY_BUDGET_NONE) return true;
    if (!t) return false;
    double kl, top1;
    bounds(b, t, &kl, &top1);
    /* the tolerance of the figures' printed precision: a method measured at the bound is in */
    return p->kl <= kl * (1 + 1e-9) + 1e-12 && p->top1 >= top1 - 1e-9;
}

/* ---------------------------------------------------------------- the choice */

/* True when a is a cheaper setting than b (a higher measured speed-up; where either lacks one,
 * less recompute). */
static bool cheaper(const quality_point *a, const quality_point *b) {
    if (a->speedup > 0 && b->speedup > 0 && a->speedup != b->speedup)
        return a->speedup > b->speedup;
    return a->ratio < b->ratio;
}

static void describe_point(const quality_point *p, char *out, size_t cap) {
    char name[40], enc[16];
    if (p->method == QUALITY_BLEND)
        snprintf(name, sizeof name, "%s %.0f%%", blend_policy_name(p->policy), 100.0 * p->ratio);
    else if (p->method == QUALITY_FIXUP)
        snprintf(name, sizeof name, "fix-up %.0f%%", 100.0 * p->ratio);
    else {
        cache_enc_name(p->enc, enc);
        snprintf(name, sizeof name, "%s", enc);
    }
    int n = snprintf(out, cap, "%s: KL %.4f, top-1 %.0f%%", name, p->kl, 100 * p->top1);
    if (p->speedup > 0 && n > 0 && (size_t)n < cap)
        snprintf(out + n, cap - (size_t)n, " (TTFT speed-up %.1fx)", p->speedup);
}

void quality_choose(const quality_budget *b, const quality_table *t, quality_choice *out) {
    memset(out, 0, sizeof *out);
    out->fixup_ratio = -1;
    out->gated = b->kind != QUALITY_BUDGET_NONE;
    if (!out->gated) {
        for (int m = 0; m < QUALITY_METHOD_COUNT; m++)
            snprintf(out->why[m], sizeof out->why[m], "as configured (--reuse-quality none)");
        return;
    }
    if (!t) {
        for (int m = 0; m < QUALITY_METHOD_COUNT; m++)
            snprintf(out->why[m], sizeof out->why[m],
                     "off: no calibration of this model (make calibrate-reuse)");
        return;
    }
    char budget[96];
    quality_budget_describe(b, t, budget, sizeof budget);
    const quality_point *best[QUALITY_METHOD_COUNT] = {0};
    const quality_point *slow[QUALITY_METHOD_COUNT] = {0}; /* within, but saving too little */
    const quality_point *closest[QUALITY_METHOD_COUNT] = {0};
    for (int i = 0; i < t->n_pts; i++) {
        const quality_point *p = &t->pts[i];
        if (p->method == QUALITY_LEVEL) {
            if (quality_meets(b, t, p)) out->levels |= 1u << p->enc;
        } else if (quality_meets(b, t, p)) {
            const quality_point **to = p->speedup > 0 && p->speedup < QUALITY_MIN_SPEEDUP
                                           ? &slow[p->method]
                                           : &best[p->method];
            if (!*to || cheaper(p, *to)) *to = p;
        }
        if (!closest[p->method] || p->kl < closest[p->method]->kl) closest[p->method] = p;
    }
    for (int m = 0; m < QUALITY_METHOD_COUNT; m++) {
        char fig[120] = "";
        if (m == QUALITY_LEVEL) {
            int n = 0;
            for (int e = CACHE_ENC_Q8; e < CACHE_ENC_MAX; e++)
                if (out->levels & (1u << e)) {
                    char enc[16];
                    cache_enc_name(e, enc);
                    n += snprintf(fig + n, sizeof fig - (size_t)n, "%s%s", n ? ", " : "", enc);
                    if ((size_t)n >= sizeof fig) break;
                }
            if (out->levels)
                snprintf(out->why[m], sizeof out->why[m], "%s within %s", fig, budget);
            else if (closest[m]) {
                describe_point(closest[m], fig, sizeof fig);
                snprintf(out->why[m], sizeof out->why[m], "lossless only: closest %s, budget %s",
                         fig, budget);
            } else
                snprintf(out->why[m], sizeof out->why[m], "lossless only: not calibrated");
            continue;
        }
        if (best[m]) {
            describe_point(best[m], fig, sizeof fig);
            snprintf(out->why[m], sizeof out->why[m], "%s, within %s", fig, budget);
        } else if (slow[m]) {
            describe_point(slow[m], fig, sizeof fig);
            snprintf(out->why[m], sizeof out->why[m],
                     "off: %s is within %s but saves too little (a speed-up under %.2fx)", fig,
                     budget, QUALITY_MIN_SPEEDUP);
        } else if (closest[m]) {
            describe_point(closest[m], fig, sizeof fig);
            snprintf(out->why[m], sizeof out->why[m], "off: no setting within %s (closest %s)",
                     budget, fig);
        } else {
            snprintf(out->why[m], sizeof out->why[m], "off: not calibrated");
        }
    }
    if (best[QUALITY_BLEND]) {
        out->blend = true;
        out->blend_policy = best[QUALITY_BLEND]->policy;
        out->blend_ratio = best[QUALITY_BLEND]->ratio;
    }
    if (best[QUALITY_FIXUP]) out->fixup_ratio = best[QUALITY_FIXUP]->ratio;
}

/* ---------------------------------------------------------------- the live check */

void quality_monitor_init(quality_monitor *mon, const quality_budget *b, const quality_table *t,
                          const quality_choice *c) {
    memset(mon, 0, sizeof *mon);
    if (!c->gated || !c->blend || !t) return;
    mon->on = true;
    bounds(b, t, &mon->max_kl, &mon->min_top1);
    mon->policy = c->blend_policy;
    /* the calibrated ratio, then every higher one measured for the policy, then 1 */
    mon->ladder[mon->n_ladder++] = c->blend_ratio;
    for (;;) {
        float last = mon->ladder[mon->n_ladder - 1], next = 1;
        for (int i = 0; i < t->n_pts; i++) {
            const quality_point *p = &t->pts[i];
            if (p->method == QUALITY_BLEND && p->policy == c->blend_policy && p->ratio > last &&
                p->ratio < next)
                next = p->ratio;
        }
        if (last >= 1 || mon->n_ladder == QUALITY_LADDER) break;
        mon->ladder[mon->n_ladder++] = next;
    }
}

float quality_monitor_ratio(const quality_monitor *mon) {
    return mon->on ? mon->ladder[mon->at] : -1;
}

int quality_monitor_add(quality_monitor *mon, double kl, bool top1, char *why, size_t cap) {
    if (why && cap) why[0] = 0;
    if (!mon->on || !isfinite(kl)) return 0;
    mon->samples++;
    mon->kl[mon->head] = kl;
    mon->top1[mon->head] = top1;
    mon->head = (mon->head + 1) % QUALITY_WINDOW;
    if (mon->n < QUALITY_WINDOW) mon->n++;
    if (mon->n < QUALITY_WINDOW) return 0; /* a window of samples at this setting first */
    double sum = 0;
    int agree = 0;
    for (int i = 0; i < QUALITY_WINDOW; i++) {
        sum += mon->kl[i];
        agree += mon->top1[i];
    }
    double m_kl = sum / QUALITY_WINDOW, m_top1 = (double)agree / QUALITY_WINDOW;
    mon->last_kl = m_kl;
    mon->last_top1 = m_top1;
    int step = 0;
    /* out of budget: one step safer; within half the budget's KL at a safer setting than the
     * calibrated one for long enough (longer each time the setting below left the budget): one
     * step back */
    bool out = m_kl > mon->max_kl || m_top1 < mon->min_top1;
    bool well = m_kl <= 0.5 * mon->max_kl && m_top1 >= mon->min_top1;
    mon->good = well ? mon->good + 1 : 0;
    if (out) mon->fails[mon->at]++;
    if (out && mon->at + 1 < mon->n_ladder) {
        step = +1;
    } else if (mon->at > 0 && well) {
        int f = mon->fails[mon->at - 1];
        if (mon->good >= 1 << (f < 4 ? f : 4)) step = -1;
    }
    if (!step) {
        mon->n = mon->head = 0; /* the next window: new samples only */
        return 0;
    }
    mon->good = 0;
    float from = mon->ladder[mon->at];
    mon->at += step;
    mon->n = mon->head = 0; /* the next window is the new setting's */
    if (step > 0)
        mon->steps_up++;
    else
        mon->steps_down++;
    if (why)
        snprintf(why, cap,
                 "%s %.0f%% -> %.0f%%: rolling first-token KL %.4f, top-1 %.0f%% over %d "
                 "samples (budget: KL <= %.4f, top-1 >= %.0f%%)",
                 blend_policy_name(mon->policy), 100.0 * from, 100.0 * mon->ladder[mon->at], m_kl,
                 100 * m_top1, QUALITY_WINDOW, mon->max_kl, 100 * mon->min_top1);
    return step;
}

/* The logprob a token missing from a top-k list is given: the least of the list, or the mass
 * the list leaves out, whichever is smaller. */
static double topk_floor(const float *lps, int n) {
    double least = 0, mass = 0;
    for (int i = 0; i < n; i++) {
        mass += exp((double)lps[i]);
        if (i == 0 || lps[i] < least) least = lps[i];
    }
    double rest = log(1 - mass > 1e-12 ? 1 - mass : 1e-12);
    return n == 0 ? rest : least < rest ? least : rest;
}

static int topk_find(const int32_t *ids, int n, int32_t t) {
    for (int i = 0; i < n; i++)
        if (ids[i] == t) return i;
    return -1;
}

double quality_kl_topk(const int32_t *p_ids, const float *p_lps, int n_p, const int32_t *q_ids,
                       const float *q_lps, int n_q) {
    double fp = topk_floor(p_lps, n_p), fq = topk_floor(q_lps, n_q);
    /* the union of both lists: p's tokens, then q's that p lacks; [0] p's mass, [1] q's */
    double zp = 0, zq = 0, kl = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int side = 0; side < 2; side++) {
            const int32_t *ids = side ? q_ids : p_ids;
            int n = side ? n_q : n_p;
            for (int i = 0; i < n; i++) {
                if (side && topk_find(p_ids, n_p, ids[i]) >= 0) continue; /* counted with p */
                int ip = topk_find(p_ids, n_p, ids[i]), iq = topk_find(q_ids, n_q, ids[i]);
                double lp = ip >= 0 ? p_lps[ip] : fp, lq = iq >= 0 ? q_lps[iq] : fq;
                if (pass == 0) {
                    zp += exp(lp);
                    zq += exp(lq);
                } else {
                    double p = exp(lp) / zp, q = exp(lq) / zq;
                    kl += p * log(p / q);
                }
            }
        }
    return kl;
}
