/* libFuzzer target for the reuse-quality calibration parser (cache/quality.c): every input is
 * parsed as it is (a copy of exactly size bytes). A refusal must say why; an accepted table must
 * hold only figures in range (checked here), and the budget's choice over it must name settings
 * the table holds. Any violation aborts. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache/quality.h"

static const uint8_t ID[32] = {0};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    quality_table *t = malloc(sizeof *t);
    kv_error err = {{0}};
    if (t && quality_table_parse(t, buf, size, ID, &err) != 0) {
        if (!err.msg[0]) abort();
    } else if (t) {
        if (t->prompts < 1 || !(t->floor_kl >= 0) || !(t->floor_top1 >= 0 && t->floor_top1 <= 1))
            abort();
        if (t->n_pts < 0 || t->n_pts > QUALITY_MAX_POINTS) abort();
        for (int i = 0; i < t->n_pts; i++) {
            const quality_point *p = &t->pts[i];
            if (p->method < 0 || p->method >= QUALITY_METHOD_COUNT || !(p->kl >= 0) ||
                !(p->top1 >= 0 && p->top1 <= 1) || !(p->ratio >= 0 && p->ratio <= 1))
                abort();
            if (p->method == QUALITY_LEVEL && (p->enc < CACHE_ENC_Q8 || p->enc >= CACHE_ENC_MAX))
                abort();
        }
        const char *budgets[] = {"floor", "balanced", "fast", "0.05"};
        for (int k = 0; k < 4; k++) {
            quality_budget b;
            quality_choice c;
            if (quality_budget_parse(budgets[k], &b, &err)) abort();
            quality_choose(&b, t, &c);
            if (c.blend && (c.blend_policy < 0 || c.blend_policy >= BLEND_POLICY_COUNT ||
                            !(c.blend_ratio >= 0 && c.blend_ratio <= 1)))
                abort();
            if (c.levels & ~(((1u << CACHE_ENC_MAX) - 1) & ~((1u << CACHE_ENC_Q8) - 1))) abort();
        }
    }
    free(t);
    free(buf);
    return 0;
}
