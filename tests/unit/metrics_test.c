/* The Prometheus text of server/metrics/metrics.c: TTFT is observed once overall and once in the
 * series of the request's reuse class, each series with its own buckets, sum and count, and the
 * family described once. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/metrics/metrics.h"

#define BY_REUSE "kvserve_time_to_first_token_by_reuse_seconds"

/* The value of the sample line that starts with `series ` (NAN when there is none). */
static double value_of(const char *text, const char *series) {
    size_t n = strlen(series);
    for (const char *line = text; *line;) {
        const char *nl = strchr(line, '\n');
        if (strncmp(line, series, n) == 0 && line[n] == ' ') return strtod(line + n + 1, NULL);
        if (!nl) break;
        line = nl + 1;
    }
    return NAN;
}

static int count_of(const char *text, const char *needle) {
    int k = 0;
    for (const char *p = text; (p = strstr(p, needle)) != NULL; p++) k++;
    return k;
}

Test(metrics, ttft_is_split_by_reuse_class) {
    metrics *m = metrics_create();
    cr_assert_not_null(m);
    metrics_ttft(m, 0.5, METRICS_REUSE_NONE);
    metrics_ttft(m, 0.02, METRICS_REUSE_CACHED);
    metrics_ttft(m, 0.03, METRICS_REUSE_CACHED);
    metrics_ttft(m, 0.2, METRICS_REUSE_BLEND);
    size_t len = 0;
    char *t = metrics_render(m, &len);
    cr_assert_not_null(t);
    cr_assert_eq(strlen(t), len);

    cr_assert_eq(value_of(t, "kvserve_time_to_first_token_seconds_count"), 4, "%s", t);
    cr_assert_eq(value_of(t, BY_REUSE "_count{reuse=\"none\"}"), 1, "%s", t);
    cr_assert_eq(value_of(t, BY_REUSE "_count{reuse=\"cached\"}"), 2, "%s", t);
    cr_assert_eq(value_of(t, BY_REUSE "_count{reuse=\"blend\"}"), 1, "%s", t);
    cr_assert_float_eq(value_of(t, BY_REUSE "_sum{reuse=\"cached\"}"), 0.05, 1e-6, "%s", t);
    cr_assert_float_eq(value_of(t, BY_REUSE "_sum{reuse=\"none\"}"), 0.5, 1e-6, "%s", t);
    /* buckets are cumulative per series, the class label before le */
    cr_assert_eq(value_of(t, BY_REUSE "_bucket{reuse=\"cached\",le=\"0.01\"}"), 0, "%s", t);
    cr_assert_eq(value_of(t, BY_REUSE "_bucket{reuse=\"cached\",le=\"0.025\"}"), 1, "%s", t);
    cr_assert_eq(value_of(t, BY_REUSE "_bucket{reuse=\"cached\",le=\"0.05\"}"), 2, "%s", t);
    cr_assert_eq(value_of(t, BY_REUSE "_bucket{reuse=\"cached\",le=\"+Inf\"}"), 2, "%s", t);
    cr_assert_eq(value_of(t, BY_REUSE "_bucket{reuse=\"none\",le=\"0.25\"}"), 0, "%s", t);
    cr_assert_eq(value_of(t, BY_REUSE "_bucket{reuse=\"none\",le=\"0.5\"}"), 1, "%s", t);
    cr_assert_eq(value_of(t, BY_REUSE "_bucket{reuse=\"blend\",le=\"0.25\"}"), 1, "%s", t);
    /* one HELP and TYPE for the family; the unlabelled histogram keeps its form */
    cr_assert_eq(count_of(t, "# TYPE " BY_REUSE " histogram\n"), 1, "%s", t);
    cr_assert_eq(count_of(t, "# HELP " BY_REUSE " "), 1, "%s", t);
    cr_assert_eq(value_of(t, "kvserve_time_to_first_token_seconds_bucket{le=\"0.05\"}"), 2, "%s",
                 t);
    free(t);
    metrics_destroy(m);
}

Test(metrics, every_reuse_series_is_present_before_any_request) {
    metrics *m = metrics_create();
    size_t len = 0;
    char *t = metrics_render(m, &len);
    cr_assert_not_null(t);
    static const char *const classes[] = {"none", "cached", "blend"};
    for (int i = 0; i < 3; i++) {
        char series[128];
        snprintf(series, sizeof series, BY_REUSE "_count{reuse=\"%s\"}", classes[i]);
        cr_assert_eq(value_of(t, series), 0, "%s missing:\n%s", series, t);
    }
    free(t);
    metrics_destroy(m);
}

Test(metrics, an_unknown_reuse_class_counts_as_none) {
    metrics *m = metrics_create();
    metrics_ttft(m, 0.1, (metrics_reuse)7);
    metrics_ttft(m, 0.1, (metrics_reuse)-1);
    size_t len = 0;
    char *t = metrics_render(m, &len);
    cr_assert_eq(value_of(t, BY_REUSE "_count{reuse=\"none\"}"), 2, "%s", t);
    cr_assert_eq(value_of(t, "kvserve_time_to_first_token_seconds_count"), 2, "%s", t);
    free(t);
    metrics_destroy(m);
}

Test(metrics, engine_gauges_read_back_as_last_set) {
    metrics *m = metrics_create();
    cr_assert_not_null(m);
    metrics_engine g;
    metrics_get_engine(m, &g);
    cr_assert(g.waiting == 0 && g.running == 0 && g.kv_blocks_total == 0, "zero before a set");
    metrics_engine set = {.waiting = 3,
                          .running = 2,
                          .kv_blocks_used = 5,
                          .kv_blocks_total = 64,
                          .kv_block_tokens = 16};
    metrics_set_engine(m, &set);
    set.running = 1;
    metrics_set_engine(m, &set);
    metrics_get_engine(m, &g);
    cr_assert_eq(g.waiting, 3);
    cr_assert_eq(g.running, 1);
    cr_assert_eq(g.kv_blocks_used, 5);
    cr_assert_eq(g.kv_blocks_total, 64);
    cr_assert_eq(g.kv_block_tokens, 16);
    metrics_destroy(m);
}
