/* Reuse quality (cache/quality.h): a calibration is bound to its model and checked field by
 * field, budgets parse, and a budget picks per method the cheapest setting within it from a
 * constructed table (and turns off a method with none). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "cache/codec/meter.h"
#include "cache/quality.h"

static const uint8_t ID[32] = {0xab, 0xcd, 1, 2, 3};
static const char *ID_HEX = "abcd010203000000000000000000000000000000000000000000000000000000";

/* A calibration: floor KL 0.004, top-1 0.98; blend points, a fix-up point and two levels. */
static char *calibration(const char *id_hex) {
    static char buf[4096];
    snprintf(buf, sizeof buf,
             "{\"format\": \"kvserve-kvquality\", \"version\": 1, \"model_identity\": \"%s\","
             " \"prompts\": 20, \"floor\": {\"kl\": 0.004, \"top1\": 0.98, \"same\": 0.5},"
             " \"points\": ["
             "  {\"method\": \"blend\", \"policy\": \"hkvd\", \"ratio\": 0.15, \"kl\": 0.1,"
             "   \"top1\": 0.7, \"speedup\": 4.2},"
             "  {\"method\": \"blend\", \"policy\": \"hkvd\", \"ratio\": 0.5, \"kl\": 0.03,"
             "   \"top1\": 0.9, \"speedup\": 1.8},"
             "  {\"method\": \"blend\", \"policy\": \"legolink\", \"ratio\": 0.3, \"kl\": 0.007,"
             "   \"top1\": 0.97, \"speedup\": 3.0},"
             "  {\"method\": \"blend\", \"policy\": \"legolink\", \"ratio\": 0.5, \"kl\": 0.005,"
             "   \"top1\": 0.98, \"speedup\": 2.0},"
             "  {\"method\": \"blend\", \"policy\": \"hybrid\", \"ratio\": 0.15, \"kl\": 0.012,"
             "   \"top1\": 0.95, \"speedup\": 4.0, \"same\": 0.3},"
             "  {\"method\": \"fixup\", \"ratio\": 0.3, \"kl\": 0.006, \"top1\": 0.98},"
             "  {\"method\": \"level\", \"level\": \"q8\", \"kl\": 0.003, \"top1\": 0.99},"
             "  {\"method\": \"level\", \"level\": \"codec1\", \"kl\": 0.02, \"top1\": 0.93}]}",
             id_hex);
    return buf;
}

static void parse_ok(quality_table *t) {
    kv_error err = {{0}};
    const char *j = calibration(ID_HEX);
    cr_assert_eq(quality_table_parse(t, j, strlen(j), ID, &err), 0, "%s", err.msg);
}

Test(quality, a_calibration_is_read_with_every_figure) {
    quality_table t;
    parse_ok(&t);
    cr_expect_eq(t.prompts, 20);
    cr_expect_float_eq(t.floor_kl, 0.004, 1e-12);
    cr_expect_float_eq(t.floor_top1, 0.98, 1e-12);
    cr_expect_eq(t.n_pts, 8);
    cr_expect_eq(t.pts[2].method, QUALITY_BLEND);
    cr_expect_eq(t.pts[2].policy, BLEND_POLICY_LEGOLINK);
    cr_expect_float_eq(t.pts[2].ratio, 0.3f, 1e-6);
    cr_expect_float_eq(t.pts[4].same, 0.3, 1e-12);
    cr_expect_float_eq(t.pts[0].same, -1, 1e-12); /* not measured */
    cr_expect_eq(t.pts[6].enc, CACHE_ENC_Q8);
    cr_expect_eq(t.pts[7].enc, CACHE_ENC_CODEC + 1);
}

Test(quality, another_models_calibration_is_refused) {
    quality_table t;
    kv_error err = {{0}};
    const char *j = calibration("abcd010203000000000000000000000000000000000000000000000000000001");
    cr_expect_eq(quality_table_parse(&t, j, strlen(j), ID, &err), -1);
    cr_expect(strstr(err.msg, "another model") != NULL, "%s", err.msg);
}

Test(quality, malformed_calibrations_are_refused_with_the_reason) {
    struct {
        const char *from, *to, *says;
    } cases[] = {
        {"kvserve-kvquality", "kvserve-kvcodec", "format"},
        {"\"version\": 1", "\"version\": 2", "version"},
        {"\"prompts\": 20", "\"prompts\": 0", "prompts"},
        {"\"kl\": 0.004", "\"kl\": -1", "'kl'"},
        {"\"top1\": 0.98,", "\"top1\": 1.5,", "'top1'"},
        {"\"policy\": \"hkvd\", \"ratio\": 0.15", "\"policy\": \"best\", \"ratio\": 0.15",
         "policy"},
        {"\"ratio\": 0.5, \"kl\": 0.03", "\"ratio\": \"half\", \"kl\": 0.03", "'ratio'"},
        {"\"level\": \"q8\"", "\"level\": \"lossless\"", "level"},
        {"\"method\": \"fixup\"", "\"method\": \"magic\"", "method"},
        {"\"kl\": 0.003,", "", "'kl' is missing"},
        {"]}", "]", "JSON"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char j[4096];
        const char *src = calibration(ID_HEX), *at = strstr(src, cases[i].from);
        cr_assert_not_null(at, "case %zu", i);
        size_t pre = (size_t)(at - src);
        snprintf(j, sizeof j, "%.*s%s%s", (int)pre, src, cases[i].to, at + strlen(cases[i].from));
        quality_table t;
        kv_error err = {{0}};
        cr_expect_eq(quality_table_parse(&t, j, strlen(j), ID, &err), -1, "case %zu", i);
        cr_expect(strstr(err.msg, cases[i].says) != NULL, "case %zu: %s", i, err.msg);
    }
}

Test(quality, budgets_parse_and_refuse_what_is_not_one) {
    quality_budget b;
    kv_error err = {{0}};
    cr_expect_eq(quality_budget_parse("floor", &b, &err), 0);
    cr_expect_eq(b.kind, QUALITY_BUDGET_FLOOR);
    cr_expect_eq(quality_budget_parse("none", &b, &err), 0);
    cr_expect_eq(b.kind, QUALITY_BUDGET_NONE);
    cr_expect_eq(quality_budget_parse("0.02", &b, &err), 0);
    cr_expect_eq(b.kind, QUALITY_BUDGET_KL);
    cr_expect_float_eq(b.max_kl, 0.02, 1e-12);
    const char *bad[] = {"", "-1", "0", "nan", "0.02x", "Floor", "inf"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_expect_eq(quality_budget_parse(bad[i], &b, &err), -1, "'%s'", bad[i]);
        cr_expect(strstr(err.msg, "--reuse-quality") != NULL);
    }
}

Test(quality, each_budget_picks_the_fastest_setting_within_it) {
    quality_table t;
    parse_ok(&t);
    quality_budget b;
    quality_choice c;
    kv_error err = {{0}};
    /* floor: KL <= 0.008, top-1 >= 96%: legolink 30% (3.0x) beats legolink 50% (2.0x) */
    quality_budget_parse("floor", &b, &err);
    quality_choose(&b, &t, &c);
    cr_expect(c.gated);
    cr_expect(c.blend);
    cr_expect_eq(c.blend_policy, BLEND_POLICY_LEGOLINK);
    cr_expect_float_eq(c.blend_ratio, 0.3f, 1e-6);
    cr_expect(strstr(c.why[QUALITY_BLEND], "legolink 30%") != NULL, "%s", c.why[QUALITY_BLEND]);
    cr_expect_float_eq(c.fixup_ratio, 0.3f, 1e-6);
    cr_expect_eq(c.levels, 1u << CACHE_ENC_Q8);
    /* balanced: KL <= 0.02, top-1 >= 93%: the hybrid at 15% (4.0x); codec1 joins q8 */
    quality_budget_parse("balanced", &b, &err);
    quality_choose(&b, &t, &c);
    cr_expect_eq(c.blend_policy, BLEND_POLICY_HYBRID);
    cr_expect_float_eq(c.blend_ratio, 0.15f, 1e-6);
    cr_expect_eq(c.levels, (1u << CACHE_ENC_Q8) | (1u << (CACHE_ENC_CODEC + 1)));
    /* a KL budget alone: 0.11 takes hkvd 15% (4.2x), top-1 not checked */
    quality_budget_parse("0.11", &b, &err);
    quality_choose(&b, &t, &c);
    cr_expect_eq(c.blend_policy, BLEND_POLICY_HKVD);
    cr_expect_float_eq(c.blend_ratio, 0.15f, 1e-6);
}

Test(quality, a_method_with_no_setting_within_budget_is_off_and_says_why) {
    quality_table t;
    parse_ok(&t);
    quality_budget b;
    quality_choice c;
    kv_error err = {{0}};
    quality_budget_parse("0.001", &b, &err);
    quality_choose(&b, &t, &c);
    cr_expect(c.gated);
    cr_expect_not(c.blend);
    cr_expect_float_eq(c.fixup_ratio, -1, 1e-6);
    cr_expect_eq(c.levels, 0u);
    cr_expect(strstr(c.why[QUALITY_BLEND], "off: no setting within KL <= 0.0010") != NULL, "%s",
              c.why[QUALITY_BLEND]);
    /* the closest is named, so a user sees how far off it is */
    cr_expect(strstr(c.why[QUALITY_BLEND], "legolink 50%: KL 0.0050") != NULL, "%s",
              c.why[QUALITY_BLEND]);
    cr_expect(strstr(c.why[QUALITY_LEVEL], "lossless only") != NULL, "%s", c.why[QUALITY_LEVEL]);
}

/* The calibration with each "from" replaced by its "to", parsed. */
static void parse_edited(quality_table *t, const char *const *edits, int n_edits) {
    char j[4096];
    snprintf(j, sizeof j, "%s", calibration(ID_HEX));
    for (int i = 0; i < n_edits; i++) {
        char *at = strstr(j, edits[2 * i]);
        cr_assert_not_null(at, "%s", edits[2 * i]);
        char rest[4096];
        snprintf(rest, sizeof rest, "%s", at + strlen(edits[2 * i]));
        snprintf(at, sizeof j - (size_t)(at - j), "%s%s", edits[2 * i + 1], rest);
    }
    kv_error err = {{0}};
    cr_assert_eq(quality_table_parse(t, j, strlen(j), ID, &err), 0, "%s", err.msg);
}

/* What budget (a --reuse-quality value) picks from t. */
static void choose_under(const char *budget, const quality_table *t, quality_choice *c) {
    quality_budget b;
    kv_error err = {{0}};
    cr_assert_eq(quality_budget_parse(budget, &b, &err), 0, "%s", err.msg);
    quality_choose(&b, t, c);
    cr_assert(c->gated);
}

/* A setting within the budget that saves under QUALITY_MIN_SPEEDUP of the TTFT is not worth its
 * approximation: the method is off and says so; an unmeasured speed-up does not count against
 * a setting. */
Test(quality, a_setting_that_saves_too_little_is_not_chosen) {
    /* floor's candidates (legolink 30% and 50%) made 1.1x and 1.2x */
    const char *slow[] = {"\"speedup\": 3.0", "\"speedup\": 1.1", "\"speedup\": 2.0",
                          "\"speedup\": 1.2"};
    quality_table t;
    quality_choice c;
    parse_edited(&t, slow, 2);
    choose_under("floor", &t, &c);
    cr_expect_not(c.blend);
    cr_expect(strstr(c.why[QUALITY_BLEND], "off: legolink 50%: KL 0.0050") != NULL, "%s",
              c.why[QUALITY_BLEND]);
    cr_expect(strstr(c.why[QUALITY_BLEND], "saves too little (a speed-up under 1.25x)") != NULL,
              "%s", c.why[QUALITY_BLEND]);
    /* the fix-up's speed-up was not measured: still chosen */
    cr_expect_float_eq(c.fixup_ratio, 0.3f, 1e-6);
    /* at exactly the least speed-up, it is */
    const char *enough[] = {"\"speedup\": 3.0", "\"speedup\": 1.25", "\"speedup\": 2.0",
                            "\"speedup\": 1.2"};
    parse_edited(&t, enough, 2);
    choose_under("floor", &t, &c);
    cr_expect(c.blend);
    cr_expect_float_eq(c.blend_ratio, 0.3f, 1e-6, "legolink 30%% (1.25x), not 50%% (1.2x)");
}

Test(quality, no_calibration_means_exact_reuse_only_and_none_means_no_gate) {
    quality_budget b;
    quality_choice c;
    kv_error err = {{0}};
    quality_budget_parse("fast", &b, &err);
    quality_choose(&b, NULL, &c);
    cr_expect(c.gated);
    cr_expect_not(c.blend);
    cr_expect_eq(c.levels, 0u);
    cr_expect(strstr(c.why[QUALITY_BLEND], "no calibration") != NULL, "%s", c.why[QUALITY_BLEND]);
    quality_budget_parse("none", &b, &err);
    quality_choose(&b, NULL, &c);
    cr_expect_not(c.gated);
}

Test(quality, a_calibration_file_is_loaded_and_a_missing_one_named) {
    char path[] = "/tmp/kvserve-quality-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    fputs(calibration(ID_HEX), f);
    fclose(f);
    quality_table t;
    kv_error err = {{0}};
    cr_expect_eq(quality_table_load(&t, path, ID, &err), 0, "%s", err.msg);
    cr_expect_eq(t.n_pts, 8);
    remove(path);
    cr_expect_eq(quality_table_load(&t, path, ID, &err), -1);
    cr_expect(strstr(err.msg, path) != NULL, "%s", err.msg);
}

/* The fetch policy (cache/codec/meter.h) never takes a level the budget barred: on a slow link
 * where lossless misses the budget, the finest level that fits is taken, or, barred, the next. */
Test(quality, a_barred_level_is_never_chosen_by_budget) {
    cache_layout l = {
        .n_layer = 30, .n_kv_head = 3, .head_dim = 64, .block_tokens = 16, .chunk_tokens = 256};
    cache_meter m;
    cache_meter_init(&m, &l, CACHE_ENC_CODEC + 2, 0.01); /* 10 MB/s */
    /* lossless, q8, codec0, codec1: a chunk's bytes in each */
    uint64_t size[CACHE_ENC_MAX] = {5800000, 2900000, 1300000, 1000000};
    cache_fetch_policy p = {.force_enc = CACHE_ENC_ANY, .budget_ns = INT64_C(10000000000)};
    cache_meter_plan plan = {0};
    uint64_t t0 = clock_now_ns();
    /* 10 s for 8 chunks: lossless (580 ms each) fits, more than finest-first needs */
    int e = cache_meter_choose(&m, &p, size, 256, 0, 8, t0, false, &plan);
    cr_expect_eq(e, CACHE_ENC_RAW);
    /* 2 s for 8 chunks (250 ms each): q8 (290 ms) misses, codec0 (130 ms) fits */
    p.budget_ns = INT64_C(2000000000);
    plan = (cache_meter_plan){0};
    e = cache_meter_choose(&m, &p, size, 256, 0, 8, t0, false, &plan);
    cr_expect_eq(e, CACHE_ENC_CODEC);
    /* codec0 barred: codec1 */
    p.barred = 1u << CACHE_ENC_CODEC;
    plan = (cache_meter_plan){0};
    e = cache_meter_choose(&m, &p, size, 256, 0, 8, t0, false, &plan);
    cr_expect_eq(e, CACHE_ENC_CODEC + 1);
    /* every lossy level barred: lossless, however late */
    p.barred = ~1u;
    plan = (cache_meter_plan){0};
    e = cache_meter_choose(&m, &p, size, 256, 0, 8, t0, false, &plan);
    cr_expect_eq(e, CACHE_ENC_RAW);
    /* a forced level is the request's own: taken even when barred */
    p.force_enc = CACHE_ENC_Q8;
    e = cache_meter_choose(&m, &p, size, 256, 0, 8, t0, false, &plan);
    cr_expect_eq(e, CACHE_ENC_Q8);
}

/* The live check: a calibration that claims too much is found out within a window of samples
 * and the ratio steps up the policy's measured ratios; once the figures are well within budget
 * it steps back, waiting longer each time the setting below it failed. */
Test(quality, the_monitor_steps_up_when_samples_leave_the_budget_and_back_when_they_return) {
    quality_table t;
    parse_ok(&t);
    quality_budget b;
    quality_choice c;
    kv_error err = {{0}};
    quality_budget_parse("floor", &b, &err); /* KL <= 0.008, top-1 >= 96% */
    quality_choose(&b, &t, &c);              /* legolink 30% */
    quality_monitor mon;
    quality_monitor_init(&mon, &b, &t, &c);
    cr_assert(mon.on);
    cr_expect_eq(mon.n_ladder, 3); /* 30%, 50%, then a full prefill */
    cr_expect_float_eq(quality_monitor_ratio(&mon), 0.3f, 1e-6);
    char why[256];
    int step = 0, at = 0;
    /* samples 4x over the budget's KL: the first full window steps up */
    for (int i = 0; i < 50 && !step; i++, at = i)
        step = quality_monitor_add(&mon, 0.03, true, why, sizeof why);
    cr_expect_eq(step, 1);
    cr_expect_eq(at, QUALITY_WINDOW);
    cr_expect_float_eq(quality_monitor_ratio(&mon), 0.5f, 1e-6);
    cr_expect(strstr(why, "legolink 30% -> 50%") && strstr(why, "KL 0.0300"), "%s", why);
    /* top-1 too low steps up too, to a full prefill, and no further */
    for (int i = 0; i < QUALITY_WINDOW; i++)
        step = quality_monitor_add(&mon, 0.001, i % 4 != 0, why, sizeof why);
    cr_expect_eq(step, 1);
    cr_expect_float_eq(quality_monitor_ratio(&mon), 1.0f, 1e-6);
    for (int i = 0; i < QUALITY_WINDOW; i++)
        step = quality_monitor_add(&mon, 0.5, false, why, sizeof why);
    cr_expect_eq(step, 0);
    cr_expect_float_eq(quality_monitor_ratio(&mon), 1.0f, 1e-6);
    /* well within budget again: 50% failed once, so two good windows before stepping back to it */
    for (int i = 0; i < QUALITY_WINDOW; i++)
        step = quality_monitor_add(&mon, 0.001, true, why, sizeof why);
    cr_expect_eq(step, 0);
    for (int i = 0; i < QUALITY_WINDOW; i++)
        step = quality_monitor_add(&mon, 0.001, true, why, sizeof why);
    cr_expect_eq(step, -1);
    cr_expect_float_eq(quality_monitor_ratio(&mon), 0.5f, 1e-6);
    cr_expect(strstr(why, "100% -> 50%") != NULL, "%s", why);
    /* within budget but not well within (above half its KL): it stays */
    for (int i = 0; i < 4 * QUALITY_WINDOW; i++)
        step = quality_monitor_add(&mon, 0.006, true, why, sizeof why);
    cr_expect_float_eq(quality_monitor_ratio(&mon), 0.5f, 1e-6);
    cr_expect_eq(mon.steps_up, 2);
    cr_expect_eq(mon.steps_down, 1);
    /* no blend setting: nothing to watch */
    quality_budget_parse("0.001", &b, &err);
    quality_choose(&b, &t, &c);
    quality_monitor_init(&mon, &b, &t, &c);
    cr_expect_not(mon.on);
    cr_expect_eq(quality_monitor_add(&mon, 1.0, false, why, sizeof why), 0);
}

/* The live check's KL is the offline bench's (scripts/bench/blend.py kl(): the reference value
 * below is what it prints for these lists), so the two compare. */
Test(quality, top_k_kl_matches_the_benchs_estimator) {
    /* p: a 0.5, b 0.3, c 0.1; q: a 0.4, c 0.35, d 0.2 (ids a=1, b=2, c=3, d=4) */
    const int32_t p_ids[] = {1, 2, 3}, q_ids[] = {1, 3, 4};
    const float p_lps[] = {logf(0.5f), logf(0.3f), logf(0.1f)};
    const float q_lps[] = {logf(0.4f), logf(0.35f), logf(0.2f)};
    cr_expect_float_eq(quality_kl_topk(p_ids, p_lps, 3, q_ids, q_lps, 3), 0.454508601520, 1e-6);
    cr_expect_float_eq(quality_kl_topk(p_ids, p_lps, 3, p_ids, p_lps, 3), 0.0, 1e-12);
}
