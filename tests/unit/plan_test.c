/* The reuse planner (cache/plan.h) on the real model's layout: a prompt's keys, prefix reuse from
 * the pool tier by reference (to the block, the last token always left to compute), the fetched
 * records copied in behind it, lossy records never named by a prefix key, and the write-back of
 * whole and trailing chunks to the store. The KV itself is not computed here: the planner moves
 * and names blocks, whatever they hold (the engine and e2e tests check the answers). */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "cache/plan.h"
#include "tests/unit/model_fixture.h"
#include "tests/unit/tmpdir.h"

#define CHUNK 64 /* four 16-token blocks a chunk */
#define N_PROMPT 150

static model_fixture g_fx;
static model *g_m;
static backend *g_b;
static kv_pool *g_pool;
static cache_store *g_store;
static int32_t g_prompt[N_PROMPT];
static cache_key g_ns;

static void setup(void) {
    kv_error err = {{0}};
    model_fixture_open(&g_fx, 1, 2048, 0, 0);
    g_m = g_fx.m;
    g_b = g_fx.b;
    g_pool = g_fx.pool;
    cache_layout l = {.n_layer = g_m->hp.n_layer,
                      .n_kv_head = g_m->hp.n_kv_head,
                      .head_dim = g_m->hp.head_dim,
                      .block_tokens = 16,
                      .chunk_tokens = CHUNK};
    memcpy(l.model_id, g_m->identity, sizeof l.model_id);
    cache_store_opts so = {.ram_bytes = 256 << 20};
    g_store = cache_store_open(&l, &so, &err);
    cr_assert_not_null(g_store, "%s", err.msg);
    for (int i = 0; i < N_PROMPT; i++) g_prompt[i] = 1000 + (i * 37) % 5000;
    memset(g_ns.b, 0x5a, sizeof g_ns.b);
}

static void teardown(void) {
    cache_store_close(g_store);
    model_fixture_close(&g_fx);
}

TestSuite(plan, .init = setup, .fini = teardown, .timeout = 120);

static planner *make_planner(bool pool_tier, cache_store *store) {
    kv_error err = {{0}};
    plan_opts o = {.store = store, .chunk_tokens = CHUNK, .pool_tier = pool_tier};
    planner *p = planner_create(g_m, g_b, g_pool, &o, &err);
    cr_assert_not_null(p, "%s", err.msg);
    return p;
}

static void prepare(planner *p, plan_req *pr, bool fetch) {
    plan_req_init(pr);
    cr_assert_eq(plan_prepare(p, pr, &g_ns, g_prompt, N_PROMPT, false, false, 0, fetch), 0);
}

/* A new sequence of g_prompt[0..n) takes its cached prefix: returns the tokens reused. */
static int reuse_new(planner *p, plan_req *pr, plan_seq *ps, kv_seq *kv, int n, bool first,
                     bool score) {
    kv_seq_init(kv);
    cr_assert_eq(plan_seq_init(ps, pr), 0);
    return plan_reuse(p, ps, pr, kv, g_prompt, n, n, first, score, 0);
}

/* Frees what reuse_new made. */
static void drop(plan_seq *ps, kv_seq *kv) {
    kv_seq_release(g_pool, kv);
    plan_seq_free(ps);
}

/* A sequence that "computed" its whole prompt: blocks reserved and written back, and its last
 * partial chunk stored (as the prompt is done, or as the sequence ends). */
static void compute_all(planner *p, plan_seq *ps, plan_req *pr, kv_seq *kv, bool ending) {
    kv_error err = {{0}};
    cr_assert_eq(reuse_new(p, pr, ps, kv, N_PROMPT, true, false), 0, "nothing cached yet");
    cr_assert_eq(kv_seq_reserve(g_pool, kv, N_PROMPT, &err), 0, "%s", err.msg);
    kv->n_tokens = N_PROMPT;
    /* recognisable bytes in each block, for the copies to be compared */
    size_t bb = kv_layout_block_bytes(kv_pool_layout(g_pool));
    for (int i = 0; i < kv->n_blocks; i++) {
        uint8_t *blk = (uint8_t *)kv_pool_memory(g_pool) + (size_t)kv->blocks[i] * bb;
        for (size_t k = 0; k < bb; k += 64) blk[k] = (uint8_t)(i * 31 + k / 64);
    }
    plan_write_back(p, ps, pr, kv, g_prompt, N_PROMPT);
    plan_store_tail(p, ps, pr, kv, ending);
}

Test(plan, keys_are_the_prompts_full_blocks) {
    planner *p = make_planner(true, NULL);
    plan_req pr;
    prepare(p, &pr, false);
    cr_assert(pr.cache);
    cr_assert_eq(pr.n_keys, N_PROMPT / 16);
    cache_key want[N_PROMPT / 16];
    cr_assert_eq(cache_prefix_keys(g_m->identity, &g_ns, g_prompt, N_PROMPT, 16, want, 16),
                 N_PROMPT / 16);
    cr_expect(memcmp(want, pr.keys, sizeof want) == 0);
    plan_req_free(&pr);
    /* a prompt with its own positions (Prompt Cache) names no prefix */
    plan_req_init(&pr);
    cr_assert_eq(plan_prepare(p, &pr, &g_ns, g_prompt, N_PROMPT, true, false, 0, true), 0);
    cr_expect_not(pr.cache);
    cr_expect_eq(pr.n_keys, 0);
    plan_req_free(&pr);
    planner_destroy(p);
}

Test(plan, the_pool_tier_lends_whole_blocks_and_leaves_the_last_token) {
    planner *p = make_planner(true, NULL);
    plan_req pr;
    prepare(p, &pr, false);
    plan_seq a;
    kv_seq ka;
    compute_all(p, &a, &pr, &ka, false);
    cr_expect_eq(a.n_stored, N_PROMPT / 16, "every full block registered");
    kv_seq_release(g_pool, &ka);
    cr_expect_eq(plan_shared_blocks(p, &pr, false), N_PROMPT / 16);
    cr_expect_eq(plan_shared_blocks(p, &pr, true), 0, "scoring shares nothing");

    plan_seq b, c, d;
    kv_seq kb, kc, kd;
    int reused = reuse_new(p, &pr, &b, &kb, N_PROMPT, true, false);
    cr_expect_eq(reused, N_PROMPT / 16 * 16);
    cr_expect_eq(kb.n_tokens, reused);
    /* the same prompt cut at a block boundary: its last token is computed again */
    cr_expect_eq(reuse_new(p, &pr, &c, &kc, 128, false, false), 127);
    /* scoring reuses nothing */
    cr_expect_eq(reuse_new(p, &pr, &d, &kd, N_PROMPT, false, true), 0);
    drop(&b, &kb);
    drop(&c, &kc);
    drop(&d, &kd);
    plan_seq_free(&a);
    plan_req_free(&pr);
    planner_destroy(p);
}

Test(plan, chunks_go_to_the_store_and_come_back_without_the_pool) {
    planner *p = make_planner(false, g_store);
    plan_req pr;
    prepare(p, &pr, false);
    plan_seq a;
    kv_seq ka;
    compute_all(p, &a, &pr, &ka, false);
    /* two whole chunks (128 tokens) and the trailing partial one (block 8) */
    cr_expect(cache_store_holds(g_store, &pr.keys[3]));
    cr_expect(cache_store_holds(g_store, &pr.keys[7]));
    cr_expect(cache_store_holds(g_store, &pr.keys[8]), "the trailing partial chunk is kept");
    /* the blocks' bytes, to compare with what comes back */
    size_t bb = kv_layout_block_bytes(kv_pool_layout(g_pool));
    uint8_t *want = malloc(bb * (size_t)ka.n_blocks);
    memset(want, 0, bb * (size_t)ka.n_blocks);
    kv_seq_export_blocks(g_pool, &ka, 0, N_PROMPT / 16, want);
    kv_seq_release(g_pool, &ka);

    plan_req fetched;
    prepare(p, &fetched, true);
    cr_assert_eq(fetched.n_loaded, 3, "three records continue the prefix");
    cr_expect_eq(fetched.loaded_blocks, N_PROMPT / 16);
    cr_expect_eq(fetched.n_fetched, 3);
    for (int i = 0; i < fetched.n_fetched; i++)
        cr_expect_eq(fetched.fetched[i].tier, CACHE_TIER_RAM);
    plan_seq b;
    kv_seq kb;
    cr_expect_eq(reuse_new(p, &fetched, &b, &kb, N_PROMPT, true, false), N_PROMPT / 16 * 16);
    cr_expect_null(fetched.loaded, "the first choice uses the records up");
    uint8_t *got = malloc(bb * (size_t)kb.n_blocks);
    kv_seq_export_blocks(g_pool, &kb, 0, N_PROMPT / 16, got);
    cr_expect(memcmp(got, want, bb * (N_PROMPT / 16)) == 0, "the records' blocks, copied in");
    cr_expect_eq(b.lossy_from, INT_MAX);
    free(got);
    free(want);
    drop(&b, &kb);
    plan_seq_free(&a);
    plan_req_free(&fetched);
    plan_req_free(&pr);
    planner_destroy(p);
}

/* A planner with the pool tier (and store, when not NULL) whose first sequence computed g_prompt
 * and is ending (its KV still held). */
static planner *computed_planner(cache_store *store, plan_req *pr, plan_seq *a, kv_seq *ka) {
    planner *p = make_planner(true, store);
    prepare(p, pr, false);
    compute_all(p, a, pr, ka, true);
    return p;
}

/* Evicts the n least recently used idle blocks of the pool tier. */
static void evict_blocks(planner *p, int n) {
    cr_assert_eq(pool_cache_make_room(planner_pool(p), kv_pool_free_blocks(g_pool) + n, UINT64_MAX),
                 kv_pool_free_blocks(g_pool));
}

/* The pool held blocks 0-5 when the records were fetched (from block 6: chunk 1's, which starts
 * at block 4, and chunk 2's), and lost block 5 before the sequence took its prefix: chunk 1's
 * record holds block 5 too, so the prefix goes on through it instead of stopping at block 5
 * (seen under load, 8 long sequences in a small pool: whole prompts computed again). */
Test(plan, fetched_records_fill_blocks_the_pool_lost_after_the_fetch) {
    plan_req pr;
    plan_seq a;
    kv_seq ka;
    planner *p = computed_planner(g_store, &pr, &a, &ka);
    drop(&a, &ka);
    /* the head most recently used, so that eviction takes the tail first */
    cr_assert_eq(pool_cache_lookup(planner_pool(p), pr.keys, pr.n_keys, NULL, false), 9);
    evict_blocks(p, 3);
    cr_assert_eq(pool_cache_lookup(planner_pool(p), pr.keys, pr.n_keys, NULL, false), 6);
    plan_req fetched;
    prepare(p, &fetched, true);
    cr_assert_eq(fetched.loaded_from, 6);
    cr_assert_eq(fetched.n_loaded, 2, "chunk 1's record and the trailing partial one");
    evict_blocks(p, 1);
    cr_assert_eq(pool_cache_lookup(planner_pool(p), pr.keys, pr.n_keys, NULL, false), 5);
    plan_seq b;
    kv_seq kb;
    cr_expect_eq(reuse_new(p, &fetched, &b, &kb, N_PROMPT, true, false), N_PROMPT / 16 * 16);
    drop(&b, &kb);
    plan_req_free(&fetched);
    plan_req_free(&pr);
    planner_destroy(p);
}

/* As a sequence ends, the pool tier keeps its blocks: its last partial chunk goes to disk and
 * not into RAM, which would hold the same KV a second time; without a disk tier (or a pool tier
 * to keep the blocks) RAM takes it as before. */
Test(plan, an_ending_sequences_last_chunk_skips_ram_while_the_pool_holds_it) {
    for (int pool_tier = 1; pool_tier >= 0; pool_tier--)
        for (int with_disk = 1; with_disk >= 0; with_disk--) {
            kv_error err = {{0}};
            char *dir = with_disk ? tmpdir_create("plan_tail_") : NULL;
            cache_store_opts so = {.ram_bytes = 256 << 20, .dir = dir, .disk_bytes = 256 << 20};
            cache_store *st = cache_store_open(cache_store_layout(g_store), &so, &err);
            cr_assert_not_null(st, "%s", err.msg);
            planner *p = make_planner(pool_tier, st);
            plan_req pr;
            prepare(p, &pr, false);
            plan_seq a;
            kv_seq ka;
            compute_all(p, &a, &pr, &ka, true);
            plan_drain_tails(p, true); /* it may wait for the two chunks' writes */
            cache_store_flush(st);
            cache_stats cs;
            cache_store_stats(st, &cs);
            cr_expect(cache_store_holds(st, &pr.keys[8]), "the last partial chunk is kept");
            /* two whole chunks, and the partial one where nothing else keeps it */
            cr_expect_eq(cs.ram.entries, pool_tier && with_disk ? 2 : 3,
                         "pool tier %d, disk %d: %lld records in RAM", pool_tier, with_disk,
                         (long long)cs.ram.entries);
            if (with_disk) cr_expect_eq(cs.disk.entries, 3);
            drop(&a, &ka);
            plan_req_free(&pr);
            planner_destroy(p);
            cache_store_close(st);
            free(dir);
        }
}

/* Sequences that end together would each hold a copy of their last record until the disk wrote
 * it: over the disk's backlog (plan_opts' tail_backlog; negative here: always) the tail waits as
 * its blocks' keys, and plan_drain_tails copies it from the pool tier's blocks, the bytes the
 * sequence had, onto disk and not into RAM. A tail whose blocks the pool let go meanwhile is
 * not stored. */
Test(plan, ending_tails_wait_for_the_disk_and_come_from_the_pool_tier) {
    for (int evicted = 0; evicted < 2; evicted++) {
        kv_error err = {{0}};
        char *dir = tmpdir_create("plan_defer_");
        cache_store_opts so = {.ram_bytes = 256 << 20, .dir = dir, .disk_bytes = 256 << 20};
        cache_store *st = cache_store_open(cache_store_layout(g_store), &so, &err);
        cr_assert_not_null(st, "%s", err.msg);
        plan_opts o = {.store = st, .chunk_tokens = CHUNK, .pool_tier = true, .tail_backlog = -1};
        planner *p = planner_create(g_m, g_b, g_pool, &o, &err);
        cr_assert_not_null(p, "%s", err.msg);
        int64_t free0 = kv_pool_free_blocks(g_pool);
        plan_req pr;
        prepare(p, &pr, false);
        plan_seq a;
        kv_seq ka;
        compute_all(p, &a, &pr, &ka, true);
        const int nb = N_PROMPT / 16; /* 9 whole blocks: two chunks and block 8 */
        size_t bb = kv_layout_block_bytes(kv_pool_layout(g_pool));
        uint8_t *want = malloc(bb * nb), *got = malloc(bb * nb);
        kv_seq_export_blocks(g_pool, &ka, 0, nb, want);
        kv_seq_release(g_pool, &ka); /* the sequence ends: the pool tier keeps its blocks */
        cache_store_flush(st);
        cr_expect(plan_tails_pending(p));
        cr_expect(!cache_store_holds(st, &pr.keys[8]), "the tail waits, no copy made");
        plan_drain_tails(p, false);
        cr_expect(plan_tails_pending(p), "the backlog allows nothing here");
        if (evicted) {
            pool_cache_clear(planner_pool(p), NULL);
            pool_cache_reclaim(planner_pool(p));
        }
        plan_drain_tails(p, true);
        cr_expect(!plan_tails_pending(p));
        cr_expect_eq(planner_tails_dropped(p), evicted, "counted as dropped when evicted");
        cache_store_flush(st);
        cache_stats cs;
        cache_store_stats(st, &cs);
        cr_expect_eq(cs.ram.entries, 2, "the tail is not in RAM");
        cr_expect_eq(cs.disk.entries, evicted ? 2 : 3, "evicted %d: %lld records on disk", evicted,
                     (long long)cs.disk.entries);
        cr_expect_eq(cache_store_holds(st, &pr.keys[8]), !evicted);
        if (!evicted) {
            /* read back without the pool tier: the tail comes from disk, the sequence's bytes */
            planner *q = make_planner(false, st);
            plan_req fetched;
            plan_req_init(&fetched);
            cr_assert_eq(
                plan_prepare(q, &fetched, &g_ns, g_prompt, N_PROMPT, false, false, 0, true), 0);
            cr_assert_eq(fetched.n_loaded, 3);
            cr_expect_eq(fetched.fetched[2].tier, CACHE_TIER_DISK);
            plan_seq b;
            kv_seq kb;
            cr_expect_eq(reuse_new(q, &fetched, &b, &kb, N_PROMPT, true, false), nb * 16);
            kv_seq_export_blocks(g_pool, &kb, 0, nb, got);
            cr_expect(memcmp(got, want, bb * nb) == 0, "the blocks, as the sequence had them");
            drop(&b, &kb);
            plan_req_free(&fetched);
            planner_destroy(q);
        }
        free(want);
        free(got);
        plan_seq_free(&a);
        plan_req_free(&pr);
        planner_destroy(p);
        cr_expect_eq(kv_pool_free_blocks(g_pool), free0, "every block back in the pool");
        cache_store_close(st);
        free(dir);
    }
}

/* KV that came lossy (a codec level from Redis) is the request's alone: no prefix key names it,
 * nor anything computed after it. */
Test(plan, lossy_records_are_never_keyed) {
    planner *p = make_planner(true, g_store);
    plan_req pr;
    prepare(p, &pr, false);
    plan_seq a;
    kv_seq ka;
    compute_all(p, &a, &pr, &ka, false);
    plan_seq_free(&a);
    kv_seq_release(g_pool, &ka);
    plan_req fetched;
    prepare(p, &fetched, true);
    /* the pool tier holds every block: nothing fetched; make it fetch by clearing the pool */
    cr_assert_eq(fetched.n_loaded, 0);
    plan_req_free(&fetched);
    pool_cache_clear(planner_pool(p), NULL);
    pool_cache_reclaim(planner_pool(p));
    prepare(p, &fetched, true);
    cr_assert_eq(fetched.n_loaded, 3);
    fetched.loaded_src[1].enc = CACHE_ENC_Q8; /* as a lossy fetch marks it */
    plan_seq b;
    kv_seq kb;
    cr_expect_eq(reuse_new(p, &fetched, &b, &kb, N_PROMPT, true, false), N_PROMPT / 16 * 16);
    cr_expect_eq(b.lossy_from, CHUNK, "the second record's first token");
    /* only the first record's blocks went back into the pool tier */
    cr_expect_eq(plan_shared_blocks(p, &fetched, false), CHUNK / 16);
    b.n_stored = 0;
    plan_write_back(p, &b, &fetched, &kb, g_prompt, N_PROMPT);
    cr_expect_eq(b.n_stored, CHUNK / 16, "write-back stops where the lossy KV starts");
    drop(&b, &kb);
    plan_req_free(&fetched);
    plan_req_free(&pr);
    planner_destroy(p);
}

/* ---------------------------------------------------------------- blend's content records */

static const char *PASS_X =
    "The licenses for most software and other practical works are designed\n"
    "to take away your freedom to share and change the works. By contrast,\n"
    "the GNU General Public License is intended to guarantee your freedom to\n"
    "share and change all versions of a program--to make sure it remains free\n";
static const char *PASS_Y =
    "When we speak of free software, we are referring to freedom, not\n"
    "price. Our General Public Licenses are designed to make sure that you\n";
static const char *PASS_Z =
    "To protect your rights, we need to prevent others from denying you\n"
    "these rights or asking you to surrender the rights. Therefore, you have\n";

/* Plans, "computes" and stores the content of the prompt of the given texts, joined; returns
 * the tokens it blended. */
static int blend_prompt(planner *p, const char *const *texts, int n_texts) {
    char buf[2048] = "";
    for (int i = 0; i < n_texts; i++) strcat(buf, texts[i]);
    kv_error err = {{0}};
    int32_t *ids = NULL;
    int n = tokenizer_encode(g_m->tok, buf, strlen(buf), false, false, &ids, &err);
    cr_assert_gt(n, 0, "%s", err.msg);
    plan_req pr;
    plan_req_init(&pr);
    pr.blend = PLAN_BLEND_ON;
    pr.blend_ratio = 0.5f;
    cr_assert_eq(plan_prepare(p, &pr, &g_ns, ids, n, false, false, 0, false), 0);
    plan_seq ps;
    kv_seq kv;
    kv_seq_init(&kv);
    cr_assert_eq(plan_seq_init(&ps, &pr), 0);
    plan_reuse(p, &ps, &pr, &kv, ids, n, n, true, false, 0);
    int blended = 0;
    for (int i = 0; i < ps.n_spans; i++) blended += ps.spans[i].n;
    cr_assert_eq(kv_seq_reserve(g_pool, &kv, n, &err), 0, "%s", err.msg);
    kv.n_tokens = n;
    plan_store_content(p, &ps, &pr, &kv, ids, n, true);
    drop(&ps, &kv);
    plan_req_free(&pr);
    free(ids);
    return blended;
}

static int64_t content_entries(planner *p) {
    cache_tier_stats st;
    content_store_stats(planner_content(p), &st);
    return st.entries;
}

/* A run is one context's KV. A prompt's question and X's first line, stored first from another
 * prompt (before other text), are found again ahead of X's other lines, which were stored from
 * X's own: the two records were not computed one after the other, so the run splits there,
 * and the short piece of the other context (under PLAN_MIN_RUN) is computed: fewer tokens are
 * blended than where the other prompt was never seen and X's first line is X's own. */
static int blend_after_other_context(bool other_first) {
    kv_error err = {{0}};
    plan_opts o = {.chunk_tokens = CHUNK, .blend_bytes = 64 << 20, .blend_ratio = 0.15f};
    planner *p = planner_create(g_m, g_b, g_pool, &o, &err);
    cr_assert_not_null(p, "%s", err.msg);
    const char *line1 = "The licenses for most software and other practical works are designed\n";
    cr_assert(strncmp(PASS_X, line1, strlen(line1)) == 0);
    if (other_first) blend_prompt(p, (const char *[]){"Question first?\n", line1, "Hello.\n"}, 3);
    blend_prompt(p, (const char *[]){PASS_X, PASS_Z, PASS_Y}, 3);
    int got = blend_prompt(
        p, (const char *[]){"Question first?\n", PASS_X, PASS_Z, PASS_Y, "Question?\n"}, 5);
    planner_destroy(p);
    return got;
}

Test(plan, a_run_is_one_contexts_kv) {
    int alone = blend_after_other_context(false), other = blend_after_other_context(true);
    cr_expect_gt(other, 64, "X's other lines, Z's and Y's are blended (%d)", other);
    /* without the other prompt, X's first line is X's own (stored with the rest of X) */
    cr_expect_lt(other, alone, "the other context's question and line are computed (%d, %d)", other,
                 alone);
}

Test(plan, content_records_stop_where_blended_kv_starts) {
    kv_error err = {{0}};
    plan_opts o = {.chunk_tokens = CHUNK, .blend_bytes = 64 << 20, .blend_ratio = 0.15f};
    planner *p = planner_create(g_m, g_b, g_pool, &o, &err);
    cr_assert_not_null(p, "%s", err.msg);
    /* X alone: every chunk of it kept */
    cr_expect_eq(blend_prompt(p, (const char *[]){PASS_X}, 1), 0);
    int64_t x = content_entries(p);
    cr_assert_gt(x, 1);
    /* Y, X, Z: Y computed before any blended token is kept; X is blended; Z attended to the
     * blended X and is not kept */
    cr_expect_gt(blend_prompt(p, (const char *[]){PASS_Y, PASS_X, PASS_Z}, 3), 32);
    int64_t yxz = content_entries(p);
    cr_expect_gt(yxz, x, "Y's chunks are kept");
    /* so a prompt of Z then X blends X alone, and one of Y then X blends both */
    int only_x = blend_prompt(p, (const char *[]){PASS_Z, PASS_X, "Question?\n"}, 3);
    int y_and_x = blend_prompt(p, (const char *[]){PASS_Y, PASS_X, "Question?\n"}, 3);
    int32_t *ids = NULL;
    int n_x = tokenizer_encode(g_m->tok, PASS_X, strlen(PASS_X), false, false, &ids, &err);
    free(ids);
    cr_expect_leq(only_x, n_x, "Z was kept");
    cr_expect_gt(only_x, n_x / 2);
    cr_expect_gt(y_and_x, n_x, "Y was not kept");
    planner_destroy(p);
}

/* ---------------------------------------------------------------- reuse to the token */

/* The pool tier's entries directly: a partial block is kept once (again, or covered by a longer
 * one: no-op), found by its parent, namespace and leading tokens only, and gives way to a full
 * block that covers it once no sequence shares it. */
Test(plan, a_partial_block_is_kept_once_and_gives_way_to_a_covering_one) {
    pool_cache *pc = pool_cache_create(g_pool);
    cr_assert_not_null(pc);
    int64_t free0 = kv_pool_free_blocks(g_pool);
    kv_error err = {{0}};
    kv_seq s;
    kv_seq_init(&s);
    cr_assert_eq(kv_seq_reserve(g_pool, &s, 48, &err), 0, "%s", err.msg);
    int32_t b0 = s.blocks[0], b1 = s.blocks[1], b2 = s.blocks[2];
    pool_cache_put_partial(pc, &g_ns, NULL, g_prompt, 6, b0);
    pool_cache_put_partial(pc, &g_ns, NULL, g_prompt, 6, b1); /* the same tokens */
    pool_cache_put_partial(pc, &g_ns, NULL, g_prompt, 4, b1); /* fewer of them */
    pool_cache_stats st;
    pool_cache_stats_get(pc, &st);
    cr_expect_eq(st.partial, 1);
    cr_expect_eq(kv_pool_block_refs(g_pool, b0), 2);
    cr_expect_eq(kv_pool_block_refs(g_pool, b1), 1);

    int32_t got = -1;
    cr_expect_eq(pool_cache_match(pc, &g_ns, NULL, g_prompt, 16, &got), 6);
    cr_expect_eq(got, b0);
    cr_expect_eq(pool_cache_match(pc, &g_ns, NULL, g_prompt, 3, &got), 3, "a shorter prompt");
    int32_t other[16];
    memcpy(other, g_prompt, sizeof other);
    other[0] = 7;
    cr_expect_eq(pool_cache_match(pc, &g_ns, NULL, other, 16, &got), 0, "another first token");
    cache_key ns2 = g_ns, parent;
    ns2.b[31] ^= 1;
    cr_expect_eq(pool_cache_match(pc, &ns2, NULL, g_prompt, 16, &got), 0, "another namespace");
    cache_prefix_key(g_m->identity, &g_ns, NULL, g_prompt, 16, &parent);
    cr_expect_eq(pool_cache_match(pc, &g_ns, &parent, g_prompt, 16, &got), 0, "another parent");

    /* a full block starting with the same tokens replaces the partial one, unshared now */
    kv_seq_truncate(g_pool, &s, 16); /* b1, b2 back in the pool */
    kv_seq t;
    kv_seq_init(&t);
    cr_assert_eq(kv_seq_reserve(g_pool, &t, 16, &err), 0, "%s", err.msg);
    kv_seq_release(g_pool, &s); /* b0: held by the pool tier alone */
    pool_cache_put(pc, &parent, &g_ns, NULL, g_prompt, t.blocks[0]);
    pool_cache_stats_get(pc, &st);
    cr_expect_eq(st.partial, 0);
    cr_expect_eq(st.entries, 1);
    cr_expect_eq(kv_pool_block_refs(g_pool, b0), 0, "the partial block is free");
    cr_expect_eq(pool_cache_match(pc, &g_ns, NULL, g_prompt, 16, &got), 16);
    cr_expect_eq(got, t.blocks[0]);
    (void)b2;
    kv_seq_release(g_pool, &t);
    pool_cache_destroy(pc);
    cr_expect_eq(kv_pool_free_blocks(g_pool), free0, "every block back in the pool");
}

/* A prompt n tokens long made of g_prompt's first `shared` tokens and then others. */
static void diverging(int32_t *out, int n, int shared) {
    for (int i = 0; i < n; i++) out[i] = i < shared ? g_prompt[i] : 7 + i;
}

static int reuse_tokens(planner *p, plan_req *pr, plan_seq *ps, kv_seq *kv, const int32_t *prompt,
                        int n) {
    plan_req_init(pr);
    cr_assert_eq(plan_prepare(p, pr, &g_ns, prompt, n, false, false, 0, false), 0);
    kv_seq_init(kv);
    cr_assert_eq(plan_seq_init(ps, pr), 0);
    return plan_reuse(p, ps, pr, kv, prompt, n, n, true, false, 0);
}

/* A sequence's partly filled last block, kept as it ends, lends its leading rows to a prompt that
 * shares them: by reference, copied on the first write, so the cached block is never written in
 * place; a full block lends its leading rows the same way (prompts under a block too). */
Test(plan, the_pool_tier_lends_rows_to_the_token_and_never_writes_a_cached_block) {
    plan_req pr;
    plan_seq a;
    kv_seq ka;
    planner *p = computed_planner(NULL, &pr, &a, &ka);
    plan_keep_partial(p, &a, &pr, &ka, g_prompt, N_PROMPT);
    const int last = N_PROMPT / 16; /* 9 whole blocks, then 6 rows */
    int32_t cached = ka.blocks[last];
    kv_seq_release(g_pool, &ka);
    cr_expect_eq(kv_pool_block_refs(g_pool, cached), 1, "the pool tier's reference");
    size_t bb = kv_layout_block_bytes(kv_pool_layout(g_pool));
    uint8_t *mem = kv_pool_memory(g_pool), *before = malloc(bb);
    cr_assert_not_null(before);
    memcpy(before, mem + (size_t)cached * bb, bb);

    int32_t other[N_PROMPT];
    diverging(other, N_PROMPT, N_PROMPT - 3);
    plan_req po;
    plan_seq b;
    kv_seq kb;
    cr_expect_eq(reuse_tokens(p, &po, &b, &kb, other, N_PROMPT), N_PROMPT - 3);
    cr_expect_eq(kb.n_tokens, N_PROMPT - 3);
    cr_assert_eq(kb.blocks[last], cached, "shared by reference");
    cr_expect_eq(kv_pool_block_refs(g_pool, cached), 2);
    kv_error err = {{0}};
    cr_assert_eq(kv_seq_reserve(g_pool, &kb, N_PROMPT, &err), 0, "%s", err.msg);
    int32_t copy = kb.blocks[last];
    cr_assert_neq(copy, cached, "copied before the write");
    cr_expect_eq(kv_pool_block_refs(g_pool, cached), 1);
    cr_expect_eq(kv_pool_block_refs(g_pool, copy), 1);
    cr_expect(memcmp(mem + (size_t)copy * bb, before, bb) == 0,
              "the copy starts as the cached one");
    memset(mem + (size_t)copy * bb, 0xee, bb); /* the sequence's write */
    cr_expect(memcmp(mem + (size_t)cached * bb, before, bb) == 0, "the cached block is unchanged");
    drop(&b, &kb);
    plan_req_free(&po);

    /* under a block: the first full block's leading rows; the whole prompt, but its last token */
    for (int n = 1; n <= 12; n += 11) {
        int32_t shortp[12];
        diverging(shortp, n, n - 1);
        cr_expect_eq(reuse_tokens(p, &po, &b, &kb, shortp, n), n == 1 ? 0 : n - 1);
        drop(&b, &kb);
        plan_req_free(&po);
        diverging(shortp, n, n);
        cr_expect_eq(reuse_tokens(p, &po, &b, &kb, shortp, n), n - 1);
        drop(&b, &kb);
        plan_req_free(&po);
    }
    /* scoring reuses nothing, to the token neither */
    plan_req_init(&po);
    cr_assert_eq(plan_prepare(p, &po, &g_ns, other, N_PROMPT, false, true, 0, false), 0);
    kv_seq_init(&kb);
    cr_assert_eq(plan_seq_init(&b, &po), 0);
    cr_expect_eq(plan_reuse(p, &b, &po, &kb, other, N_PROMPT, N_PROMPT, true, true, 0), 0);
    drop(&b, &kb);
    plan_req_free(&po);
    free(before);
    plan_seq_free(&a);
    plan_req_free(&pr);
    planner_destroy(p);
}

/* Only rows a full prefill computes are kept: none past the first blended or lossy token. */
Test(plan, partial_blocks_stop_where_inexact_kv_starts) {
    plan_req pr;
    plan_seq a;
    kv_seq ka;
    planner *p = computed_planner(NULL, &pr, &a, &ka);
    a.exact_end = N_PROMPT / 16 * 16 + 2; /* blended from there on */
    plan_keep_partial(p, &a, &pr, &ka, g_prompt, N_PROMPT);
    pool_cache_stats st;
    pool_cache_stats_get(planner_pool(p), &st);
    cr_expect_eq(st.partial, 1);
    int32_t got;
    const int32_t *tail = g_prompt + N_PROMPT / 16 * 16;
    cr_expect_eq(
        pool_cache_match(planner_pool(p), &g_ns, &a.keys[N_PROMPT / 16 - 1], tail, 6, &got), 2);
    /* lossy KV from a token on: the rows before it are kept */
    pool_cache_clear(planner_pool(p), NULL);
    pool_cache_reclaim(planner_pool(p));
    a.exact_end = INT_MAX;
    a.lossy_from = 16 * 3 + 2;
    plan_keep_partial(p, &a, &pr, &ka, g_prompt, N_PROMPT);
    cr_expect_eq(pool_cache_match(planner_pool(p), &g_ns, &a.keys[2], g_prompt + 48, 16, &got), 2,
                 "the rows before the lossy token");
    kv_seq_release(g_pool, &ka);
    plan_seq_free(&a);
    plan_req_free(&pr);
    planner_destroy(p);
}
