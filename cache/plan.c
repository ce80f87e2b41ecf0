/* The reuse planner: prefix reuse from the pool tier and the fetched records, the blend plan
 * over content-defined chunks, and the write-back of computed KV to every tier. */
#include "cache/plan.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"

/* Content-defined chunking of prompts for blend: a cut after every line break, the hash cutting
 * long lines, so a passage's lines are found wherever it sits, its "Document k:" header and all
 * (a line is a short run, but its KV is only ever reused through the fusor). Only runs of
 * PLAN_MIN_RUN tokens or more of consecutive found chunks are reused. */
#define PLAN_MIN_RUN 32
static const cache_cdc_params PLAN_CDC = {.min_tokens = 1, .avg_tokens = 48, .max_tokens = 256};

#define PREFETCH_CONTENT_BATCH 64 /* content records per MGET */

/* Tail records waiting for the disk queue (plan_store_tail), at most: past it a tail is copied
 * and queued at once, as when the disk keeps up. */
#define PLAN_TAILS_MAX 256

/* A sequence's last record, deferred as it ended: the keys of its blocks, which the pool tier
 * holds, and where the record goes. */
typedef struct plan_tail {
    cache_key *keys; /* [n] */
    cache_key ns;
    int first, n; /* blocks first .. first + n of the sequence */
    bool redis;
} plan_tail;

struct planner {
    const model *m;
    backend *b;
    kv_pool *pool;
    plan_opts o;
    pool_cache *pc;          /* the pool tier, or NULL */
    content_store *cs;       /* NULL: no blend */
    uint8_t *kinds;          /* the chunker's token kinds */
    atomic_llong prefetched; /* bytes of chunks fetched for prompts not yet admitted */
    /* measured compute per token and layer (the loading controller; read by the submitting
     * threads' Redis fetch policy too) */
    _Atomic double ns_token_layer;
    /* tail records waiting for the disk queue, oldest first (engine thread) */
    plan_tail *tails;
    int n_tails, cap_tails;
    atomic_llong tails_dropped; /* tails whose blocks the pool evicted before the disk took them */
};

/* ---------------------------------------------------------------- requests and sequences */

void plan_req_init(plan_req *pr) {
    memset(pr, 0, sizeof *pr);
    pr->kv_level = CACHE_ENC_ANY;
    pr->ttft_budget_ms = -1;
    pr->blend_policy = -1;
}

/* Drops the chunks fetched for pr (after admission used them, or with pr). */
static void drop_loaded(plan_req *pr) {
    free(pr->loaded_src);
    pr->loaded_src = NULL;
    if (!pr->loaded) return;
    for (int i = 0; i < pr->n_loaded; i++) cache_chunk_unref(pr->loaded[i]);
    free(pr->loaded);
    pr->loaded = NULL;
    pr->n_loaded = 0;
    if (pr->loaded_budget) atomic_fetch_sub(pr->loaded_budget, pr->loaded_bytes);
    pr->loaded_bytes = 0;
}

void plan_req_free(plan_req *pr) {
    drop_loaded(pr);
    free(pr->keys);
    free(pr->fetched);
    free(pr->bounds);
    pr->keys = NULL;
    pr->fetched = NULL;
    pr->bounds = NULL;
}

int plan_seq_init(plan_seq *ps, const plan_req *pr) {
    memset(ps, 0, sizeof *ps);
    ps->exact_end = INT_MAX;
    ps->lossy_from = INT_MAX;
    if (pr->n_keys > 0) {
        if (!(ps->keys = malloc(sizeof *ps->keys * (size_t)pr->n_keys))) return -1;
        memcpy(ps->keys, pr->keys, sizeof *ps->keys * (size_t)pr->n_keys);
        ps->n_keys = ps->cap_keys = pr->n_keys;
    }
    return 0;
}

void plan_seq_drop_spans(plan_seq *ps) {
    for (int i = 0; i < ps->n_spans; i++) content_rec_unref(ps->spans[i].rec);
    free(ps->spans);
    ps->spans = NULL;
    ps->n_spans = 0;
    ps->exact_end = INT_MAX;
}

void plan_seq_free(plan_seq *ps) {
    plan_seq_drop_spans(ps);
    free(ps->cuts);
    free(ps->keys);
    ps->cuts = NULL;
    ps->keys = NULL;
}

void plan_seq_share(plan_seq *ps, const plan_seq *from) {
    ps->exact_end = from->exact_end;
    ps->lossy_from = from->lossy_from;
}

/* ---------------------------------------------------------------- the planner */

planner *planner_create(const model *m, backend *b, kv_pool *pool, const plan_opts *o,
                        kv_error *err) {
    planner *p = calloc(1, sizeof *p);
    if (!p) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    p->m = m;
    p->b = b;
    p->pool = pool;
    p->o = *o;
    atomic_init(&p->prefetched, 0);
    atomic_init(&p->ns_token_layer, 0.0);
    int bt = kv_pool_layout(pool)->block_tokens;
    if (o->chunk_tokens < bt || o->chunk_tokens % bt != 0) {
        kv_fail(err, "cache chunk size %d is not a multiple of the KV block size %d",
                o->chunk_tokens, bt);
        planner_destroy(p);
        return NULL;
    }
    if ((o->pool_tier && !(p->pc = pool_cache_create(pool))) ||
        (o->blend_bytes > 0 && (!(p->cs = content_store_create(o->blend_bytes)) ||
                                !(p->kinds = cache_token_kinds(m->tok))))) {
        kv_fail(err, "out of memory for the context cache");
        planner_destroy(p);
        return NULL;
    }
    return p;
}

void planner_destroy(planner *p) {
    if (!p) return;
    for (int i = 0; i < p->n_tails; i++) free(p->tails[i].keys);
    free(p->tails);
    pool_cache_destroy(p->pc);
    content_store_destroy(p->cs);
    free(p->kinds);
    free(p);
}

pool_cache *planner_pool(planner *p) { return p->pc; }
content_store *planner_content(planner *p) { return p->cs; }

void planner_set_blend_ratio(planner *p, float ratio) {
    p->o.blend_ratio = ratio < 0 ? 0 : ratio > 1 ? 1 : ratio;
}

void planner_note_step(planner *p, uint64_t dt_ns, int n_tokens) {
    if (n_tokens < 64) return;
    double ns = (double)dt_ns / n_tokens / p->m->hp.n_layer, old = p->ns_token_layer;
    p->ns_token_layer = old > 0 ? 0.8 * old + 0.2 * ns : ns;
}

double planner_ns_token_layer(const planner *p) { return p->ns_token_layer; }

int64_t planner_tails_dropped(const planner *p) { return atomic_load(&p->tails_dropped); }

/* ---------------------------------------------------------------- prefix reuse */

/* Appends to kv the leading blocks of keys[0..n_blocks) the pool tier holds, by reference.
 * Returns how many. */
static int reuse_from_pool(planner *p, const plan_seq *ps, kv_seq *kv, int n_blocks) {
    int32_t *ids = n_blocks > 0 ? malloc(sizeof *ids * (size_t)n_blocks) : NULL;
    if (!ids) return 0;
    int held = pool_cache_lookup(p->pc, ps->keys, n_blocks, ids, true);
    kv_error err = {{0}};
    if (held > 0 && kv_seq_append_blocks(p->pool, kv, ids, held, &err)) {
        log_warn("cache: cannot reuse pooled blocks: %s", err.msg);
        held = 0;
    }
    free(ids);
    return held;
}

/* Continues the prefix (held blocks so far) with the records the submitting thread fetched:
 * their blocks are copied into fresh pool blocks (and kept in the pool tier). Returns the
 * blocks kv holds afterwards. */
static int reuse_loaded(planner *p, plan_seq *ps, const plan_req *pr, kv_seq *kv,
                        const int32_t *hist, int held, int n_blocks) {
    int bt = kv_pool_layout(p->pool)->block_tokens;
    size_t bb = kv_layout_block_bytes(kv_pool_layout(p->pool));
    int upto = pr->loaded_from + pr->loaded_blocks;
    if (upto > n_blocks) upto = n_blocks;
    /* The pool may have lost blocks since the fetch (held < loaded_from): a record still
     * continues the prefix when it starts at or before held, since a record holds its chunk
     * from the chunk's first block (whatever the pool held then); one starting past held
     * does not (below). */
    for (int i = 0; i < pr->n_loaded && held < upto; i++) {
        const cache_chunk *c = pr->loaded[i];
        int c0 = c->pos0 / bt, hi = c0 + c->n_blocks < upto ? c0 + c->n_blocks : upto;
        if (hi <= held) continue; /* the pool held these blocks after all */
        if (c0 > held) break;
        int n = hi - held;
        kv_error err = {{0}};
        if (kv_pool_free_blocks(p->pool) < n && p->pc) pool_cache_make_room(p->pc, n, UINT64_MAX);
        if (kv_seq_import_blocks(p->pool, kv, n, c->data + (size_t)(held - c0) * bb, &err)) break;
        /* KV that came lossy (a codec level from Redis) is this request's alone: no prefix key
         * may name it, and nothing computed after it is exact either */
        bool lossy = pr->loaded_src && pr->loaded_src[i].enc != CACHE_ENC_RAW;
        if (lossy && held * bt < ps->lossy_from) ps->lossy_from = held * bt;
        for (int j = held; j < hi && p->pc && !lossy; j++)
            pool_cache_put(p->pc, &ps->keys[j], &pr->ns, j ? &ps->keys[j - 1] : NULL,
                           hist + (size_t)j * bt, kv->blocks[j]);
        held = hi;
    }
    return held;
}

/* Continues the prefix (held whole blocks) to the token: the pool tier's block after it whose
 * leading tokens match the most of hist's next ones (a sibling full block, or a sequence's
 * partial last block) is appended by reference; the caller truncates kv to what matched, and
 * the first write copies the block. Returns the tokens matched. */
static int reuse_partial(planner *p, const plan_seq *ps, const plan_req *pr, kv_seq *kv,
                         const int32_t *hist, int n_hist, int held) {
    int bt = kv_pool_layout(p->pool)->block_tokens;
    int n = n_hist - held * bt;
    if (n <= 0 || held > ps->n_keys) return 0;
    int32_t block;
    int got = pool_cache_match(p->pc, &pr->ns, held ? &ps->keys[held - 1] : NULL,
                               hist + (size_t)held * bt, n < bt ? n : bt, &block);
    kv_error err = {{0}};
    if (got > 0 && kv_seq_append_blocks(p->pool, kv, &block, 1, &err)) {
        log_warn("cache: cannot reuse a pooled block: %s", err.msg);
        return 0;
    }
    /* the prefix's head stays more recently used than its tail */
    if (got > 0 && held > 0) pool_cache_lookup(p->pc, ps->keys, held, NULL, false);
    return got;
}

/* The recompute ratio: the request's, else the loading controller's (CacheBlend section 5): as
 * many tokens as can be recomputed per layer while the next layer's reused KV loads (measured:
 * its copy and rotation per token against compute per token), never below the quality floor
 * (--blend-ratio). */
static float blend_ratio_for(const planner *p, const plan_req *pr, double ns_load_token_layer) {
    if (pr->blend_ratio >= 0) return pr->blend_ratio;
    double c = p->ns_token_layer;
    double hide = c > 0 ? ns_load_token_layer / c : 0;
    double ratio = hide > p->o.blend_ratio ? hide : p->o.blend_ratio;
    return ratio > 1 ? 1.0f : (float)ratio;
}

static int cut_prompt(const planner *p, const plan_req *pr, const int32_t *prompt, int n,
                      int *cuts) {
    return cache_cdc_cut(prompt, n, p->kinds, p->m->hp.n_vocab, &PLAN_CDC, pr->bounds, pr->n_bounds,
                         cuts, n);
}

/* Only runs of PLAN_MIN_RUN tokens or more of consecutive found chunks are reused: a stray
 * line found elsewhere saves little and costs the answer its own context. A run is one
 * context's KV: its chunks follow each other in the prompt and were computed one after the
 * other (each record's pos0 where the last one's ended). A chunk found in another context
 * (a blank line, a line two texts share) splits the run there: its KV carries that
 * context's attention, and reused between one passage's lines it raised full reuse's
 * first-token KL from 0.069 to 0.254 on one question (bench-blend's set). */
static void keep_runs(plan_seq *ps) {
    int kept = 0;
    for (int i = 0; i < ps->n_spans;) {
        int j = i + 1, run = ps->spans[i].n;
        while (j < ps->n_spans && ps->spans[j].slot == ps->spans[j - 1].slot + ps->spans[j - 1].n &&
               ps->spans[j].rec->pos0 == ps->spans[j - 1].rec->pos0 + ps->spans[j - 1].n)
            run += ps->spans[j++].n;
        for (int k = i; k < j; k++) {
            if (run >= PLAN_MIN_RUN)
                ps->spans[kept++] = ps->spans[k];
            else
                content_rec_unref(ps->spans[k].rec);
        }
        i = j;
    }
    ps->n_spans = kept;
}

/* Finds, past the exact prefix (n_computed), the content-defined chunks of the prompt that the
 * content store holds (any position, any earlier context): they become spans the blended
 * prefill reuses. The last prompt token is always computed, for its logits. */
static void plan_blend(planner *p, plan_seq *ps, const plan_req *pr, const int32_t *prompt, int n,
                       int n_computed, bool score, double load_ns) {
    plan_seq_drop_spans(ps);
    ps->blended = ps->recomputed = 0;
    if (!p->cs || pr->blend == PLAN_BLEND_OFF || score) return;
    if (!ps->cuts) {
        if (!(ps->cuts = malloc(sizeof *ps->cuts * (size_t)n))) return;
        ps->n_cuts = cut_prompt(p, pr, prompt, n, ps->cuts);
    }
    if (pr->blend != PLAN_BLEND_ON) return; /* its chunks are stored (the cuts), none reused */
    cache_tier_stats cst, dst;
    content_store_stats(p->cs, &cst);
    content_disk_stats(p->o.blend_disk, &dst);
    if (cst.entries == 0 && dst.entries == 0) return;
    int cap = 0;
    for (int i = 0, a = 0; i < ps->n_cuts; a = ps->cuts[i++]) {
        int b = ps->cuts[i];
        if (a < n_computed || b > n - 1 || b - a < PLAN_CDC.min_tokens) continue;
        cache_key key;
        cache_content_key(p->m->identity, &pr->ns, prompt + a, b - a, &key);
        content_rec *rec = content_store_get(p->cs, &key);
        /* on disk: its layers are read by the fusor's loader as the pass reaches them */
        if (!rec) rec = content_disk_get(p->o.blend_disk, &key, b - a);
        if (!rec) continue;
        if (rec->n_tok != b - a) {
            content_rec_unref(rec);
            continue;
        }
        if (ps->n_spans == cap) {
            cap = cap ? cap * 2 : 8;
            blend_span *sp = realloc(ps->spans, sizeof *sp * (size_t)cap);
            if (!sp) {
                content_rec_unref(rec);
                break;
            }
            ps->spans = sp;
        }
        ps->spans[ps->n_spans++] = (blend_span){.slot = a, .n = b - a, .off = 0, .rec = rec};
    }
    keep_runs(ps);
    if (ps->n_spans == 0) return;
    ps->blend_ratio = blend_ratio_for(p, pr, load_ns);
    ps->blend_policy = pr->blend_policy >= 0 ? (blend_policy)pr->blend_policy : p->o.blend_policy;
    int k = blend_force_run_starts(ps->spans, ps->n_spans, ps->blend_policy, ps->blend_ratio);
    /* at ratio 1 every token is computed: the KV is a full prefill's, bit for bit */
    ps->exact_end = ps->blend_ratio >= 1 ? INT_MAX : ps->spans[0].slot;
    log_debug("blend: %d spans from token %d, ratio %.2f, %s (%d run-start tokens forced)",
              ps->n_spans, ps->exact_end, ps->blend_ratio, blend_policy_name(ps->blend_policy), k);
}

int plan_reuse(planner *p, plan_seq *ps, plan_req *pr, kv_seq *kv, const int32_t *hist, int n_hist,
               int n_prompt, bool first, bool score, double load_ns) {
    int bt = kv_pool_layout(p->pool)->block_tokens;
    int held = 0;
    first = first && pr->loaded; /* the fetched records are used once */
    if (!score) {
        int n_blocks = ps->n_keys < n_hist / bt ? ps->n_keys : n_hist / bt;
        if (p->pc) held = reuse_from_pool(p, ps, kv, n_blocks);
        if (first) held = reuse_loaded(p, ps, pr, kv, hist, held, n_blocks);
    }
    if (first) drop_loaded(pr);
    int reused = held * bt;
    if (!score && p->pc && pr->cache) reused += reuse_partial(p, ps, pr, kv, hist, n_hist, held);
    if (reused >= n_hist) reused = n_hist - 1;
    kv_seq_truncate(p->pool, kv, reused);
    /* plan_write_back revisits the reused blocks: a chunk that came from the pool but has left
     * RAM and disk is stored again. */
    ps->n_stored = ps->tail_stored = 0;
    if (reused > 0) log_debug("cache: %d of %d tokens reused", reused, n_hist);
    plan_blend(p, ps, pr, hist, n_prompt, reused, score, load_ns);
    return reused;
}

int64_t plan_shared_blocks(planner *p, const plan_req *pr, bool score) {
    if (!p->pc || !pr->cache || score) return 0;
    return pool_cache_lookup(p->pc, pr->keys, pr->n_keys, NULL, false);
}

/* ---------------------------------------------------------------- write-back */

/* Copies blocks [first, first + n) of kv (one chunk's, from its start) into a record for the
 * store (RAM now, disk and Redis in the background), unless a record holds them already.
 * below_ram: onto disk (and Redis) only, where there is a disk tier (see plan_store_tail). */
static void store_record(planner *p, const plan_seq *ps, const plan_req *pr, kv_seq *kv, int first,
                         int n, bool below_ram) {
    const cache_layout *cl = cache_store_layout(p->o.store);
    if (cache_store_holds(p->o.store, &ps->keys[first + n - 1])) return;
    cache_chunk *c = cache_chunk_create(cl, ps->keys + first, n, &pr->ns, first * cl->block_tokens);
    if (!c) return; /* not stored: only a later miss */
    kv_seq_export_blocks(p->pool, kv, first, n, c->data);
    /* computed from text though Redis holds it (the fetch chose to): not written there again */
    bool redis = first + n > pr->redis_held_blocks;
    if (!below_ram || !cache_store_put_below(p->o.store, c, redis)) {
        if (redis)
            cache_store_put(p->o.store, c);
        else
            cache_store_put_local(p->o.store, c);
    }
    cache_chunk_unref(c);
}

/* Of the first n rows of ps's KV, how many a full prefill computes, the only ones a prefix key
 * (or a kept partial block) may name: not blended KV, nor KV that came lossy from Redis, nor
 * anything computed after either. */
static int exact_rows(const plan_seq *ps, int n) {
    if (ps->exact_end < n) n = ps->exact_end;
    return ps->lossy_from < n ? ps->lossy_from : n;
}

void plan_write_back(planner *p, plan_seq *ps, const plan_req *pr, kv_seq *kv, const int32_t *hist,
                     int n_computed) {
    int bt = kv_pool_layout(p->pool)->block_tokens;
    int cb = p->o.chunk_tokens / bt;
    int exact = exact_rows(ps, n_computed);
    while ((ps->n_stored + 1) * bt <= exact) {
        int i = ps->n_stored;
        if (i >= ps->n_keys) {
            if (ps->n_keys == ps->cap_keys) {
                int cap = ps->cap_keys ? ps->cap_keys * 2 : 8;
                cache_key *k = realloc(ps->keys, sizeof *k * (size_t)cap);
                if (!k) return; /* not stored: only a later miss */
                ps->keys = k;
                ps->cap_keys = cap;
            }
            cache_prefix_key(p->m->identity, &pr->ns, i ? &ps->keys[i - 1] : NULL,
                             hist + (size_t)i * bt, bt, &ps->keys[i]);
            ps->n_keys++;
        }
        if (p->pc)
            pool_cache_put(p->pc, &ps->keys[i], &pr->ns, i ? &ps->keys[i - 1] : NULL,
                           hist + (size_t)i * bt, kv->blocks[i]);
        ps->n_stored++;
        if (p->o.store && ps->n_stored % cb == 0)
            store_record(p, ps, pr, kv, ps->n_stored - cb, cb, false);
    }
}

void plan_keep_partial(planner *p, const plan_seq *ps, const plan_req *pr, const kv_seq *kv,
                       const int32_t *hist, int n_computed) {
    if (!p->pc || !pr->cache) return;
    int bt = kv_pool_layout(p->pool)->block_tokens;
    int exact = exact_rows(ps, n_computed < kv->n_tokens ? n_computed : kv->n_tokens);
    int h = exact / bt, n = exact - h * bt;
    /* the block after the registered ones (their keys name its parent) */
    if (n == 0 || h > ps->n_stored || h >= kv->n_blocks) return;
    pool_cache_put_partial(p->pc, &pr->ns, h ? &ps->keys[h - 1] : NULL, hist + (size_t)h * bt, n,
                           kv->blocks[h]);
}

/* A tail is copied for the disk only while nothing waits for it (plan_opts' tail_backlog): else
 * it waits in the pool tier, so that one copy at most is held for the disk at a time. A budget
 * of one chunk's record instead held two or three tail copies at once as 16 streams ended
 * together: peak RSS 182.8 MiB against 180.1 (scripts/bench/serve.py's 16 streams, medians
 * of 3 runs each, alternating). */
static int64_t tail_budget(const planner *p) {
    if (p->o.tail_backlog == 0) return 1; /* a backlog of a byte or more waits */
    return p->o.tail_backlog > 0 ? p->o.tail_backlog : 0;
}

/* Remembers blocks [first, first + n) of ps as a tail record to store once the disk's backlog
 * allows (plan_drain_tails). False when it cannot (out of memory, or PLAN_TAILS_MAX wait). */
static bool defer_tail(planner *p, const plan_seq *ps, const plan_req *pr, int first, int n) {
    if (p->n_tails == PLAN_TAILS_MAX) return false;
    if (p->n_tails == p->cap_tails) {
        int cap = p->cap_tails ? p->cap_tails * 2 : 16;
        plan_tail *t = realloc(p->tails, sizeof *t * (size_t)cap);
        if (!t) return false;
        p->tails = t;
        p->cap_tails = cap;
    }
    cache_key *keys = malloc(sizeof *keys * (size_t)n);
    if (!keys) return false;
    memcpy(keys, ps->keys + first, sizeof *keys * (size_t)n);
    p->tails[p->n_tails++] = (plan_tail){.keys = keys,
                                         .ns = pr->ns,
                                         .first = first,
                                         .n = n,
                                         .redis = first + n > pr->redis_held_blocks};
    return true;
}

/* Stores a deferred tail from the pool tier's blocks: those of its leading blocks still held
 * (the pool may have evicted the rest since). */
static void store_deferred(planner *p, const plan_tail *t) {
    const cache_layout *cl = cache_store_layout(p->o.store);
    int32_t *blocks = malloc(sizeof *blocks * (size_t)t->n);
    int held = blocks ? pool_cache_lookup(p->pc, t->keys, t->n, blocks, false) : 0;
    cache_chunk *c =
        held > 0 && !cache_store_holds(p->o.store, &t->keys[held - 1])
            ? cache_chunk_create(cl, t->keys, held, &t->ns, t->first * cl->block_tokens)
            : NULL;
    if (c) {
        kv_pool_export_blocks(p->pool, blocks, held, c->data);
        if (!cache_store_put_below(p->o.store, c, t->redis)) cache_store_put_local(p->o.store, c);
        cache_chunk_unref(c);
    } else if (held == 0) {
        log_debug("cache: a tail record's blocks left the pool before its write (%lld so far)",
                  (long long)atomic_fetch_add(&p->tails_dropped, 1) + 1);
    }
    free(blocks);
}

void plan_drain_tails(planner *p, bool all) {
    int done = 0;
    for (; done < p->n_tails; done++) {
        if (!all && cache_store_disk_backlog(p->o.store) >= tail_budget(p)) break;
        store_deferred(p, &p->tails[done]);
        free(p->tails[done].keys);
    }
    if (done == 0) return;
    p->n_tails -= done;
    memmove(p->tails, p->tails + done, sizeof *p->tails * (size_t)p->n_tails);
}

bool plan_tails_pending(const planner *p) { return p->n_tails > 0; }

/* True when an ending sequence's tail waits: the disk is behind, or other tails wait already
 * (they go first). */
static bool tail_waits(planner *p) {
    return p->n_tails > 0 || cache_store_disk_backlog(p->o.store) >= tail_budget(p);
}

/* Its pool blocks are touched last first, so the pool tier evicts the prefix from its tail.
 * As a sequence ends, its blocks stay in the pool tier: its last record goes to disk (and Redis)
 * where there is a disk tier, and RAM holds it only once it is read back. A copy in
 * RAM would hold the KV twice while the pool keeps it (16 streams of 134 tokens: 44 MiB of a
 * 223 MiB peak RSS), and the next turn of a chat finds it in the pool.
 * The copy for the disk is held in memory until it is written, and sequences often end
 * together (16 streams at once: 45 MiB of copies). So while anything waits for the disk
 * (tail_budget), an ending sequence's tail waits as keys, and plan_drain_tails copies it from
 * the pool tier's blocks once the disk has written what it had. */
void plan_store_tail(planner *p, plan_seq *ps, const plan_req *pr, kv_seq *kv, bool ending) {
    int bt = kv_pool_layout(p->pool)->block_tokens, cb = p->o.chunk_tokens / bt;
    int n = ps->n_stored;
    if (p->pc && n > 0) pool_cache_lookup(p->pc, ps->keys, n, NULL, false);
    if (!p->o.store || n % cb == 0 || n <= ps->tail_stored || kv->n_tokens < n * bt) return;
    int first = n - n % cb;
    bool below = ending && p->pc;
    bool deferred = below && !cache_store_holds(p->o.store, &ps->keys[n - 1]) && tail_waits(p) &&
                    defer_tail(p, ps, pr, first, n % cb);
    if (!deferred) store_record(p, ps, pr, kv, first, n % cb, below);
    ps->tail_stored = n;
}

/* Only KV a full prefill computes is stored: the chunks before the first blended (or lossy)
 * token. A chunk after it attended to approximate KV, and its record would pass that error on
 * to every prompt that reuses it. */
void plan_store_content(planner *p, plan_seq *ps, const plan_req *pr, kv_seq *kv,
                        const int32_t *prompt, int n_computed, bool first) {
    if (!p->cs || !ps->cuts || !first || pr->blend == PLAN_BLEND_OFF) return;
    const kv_layout *kl = kv_pool_layout(p->pool);
    int kvd = kl->n_kv_head * kl->head_dim;
    float *rows = NULL;
    int32_t *slots = NULL;
    int sp = 0;
    for (int i = 0, a = 0; i < ps->n_cuts && ps->cuts[i] <= n_computed; a = ps->cuts[i++]) {
        int b = ps->cuts[i], n = b - a;
        /* Lossy KV, blended KV, or KV computed after either (attending to it), is not what any
         * prefill computes: stored, the next prompt to reuse it would compound its error with
         * its own (bench-blend: a question after two others sharing its passages, blended at
         * 50%, had first-token KL 0.077 against 0.010 alone). */
        if (b > ps->lossy_from || b > ps->exact_end) break;
        while (sp < ps->n_spans && ps->spans[sp].slot + ps->spans[sp].n <= a) sp++;
        if (n < PLAN_CDC.min_tokens || (sp < ps->n_spans && ps->spans[sp].slot < b)) continue;
        cache_key key;
        cache_content_key(p->m->identity, &pr->ns, prompt + a, n, &key);
        if (content_store_has(p->cs, &key)) continue;
        if (!rows) {
            rows = malloc(sizeof *rows * (size_t)PLAN_CDC.max_tokens * (size_t)kvd);
            slots = malloc(sizeof *slots * (size_t)PLAN_CDC.max_tokens);
            if (!rows || !slots) break;
        }
        content_rec *rec = content_rec_create(kl->n_layer, kvd, n, &key, &pr->ns, a);
        if (!rec) break;
        for (int j = 0; j < n; j++) slots[j] = a + j;
        for (int l = 0; l < kl->n_layer; l++)
            for (int kv_i = 0; kv_i < 2; kv_i++) {
                backend_kv_load(p->b, kv_pool_memory(p->pool), kl, l, kv_i, kv->blocks, slots, n,
                                rows);
                fp32_to_fp16_row(rows, (uint16_t *)content_rec_rows(rec, l, kv_i),
                                 (int64_t)n * kvd);
            }
        content_store_put(p->cs, rec);
        content_disk_put(p->o.blend_disk, rec);
        cache_store_put_content(p->o.store, rec);
        content_rec_unref(rec);
    }
    free(rows);
    free(slots);
}

/* Never wrong, one step slower: the failed spans' tokens are computed in full next time. */
bool plan_settle(planner *p, plan_seq *ps, bool failed) {
    int kept = 0;
    for (int i = 0; i < ps->n_spans; i++) {
        content_rec *rec = ps->spans[i].rec;
        if (content_rec_failed(rec)) {
            content_rec_unref(rec);
            continue;
        }
        if (rec->src && content_rec_complete(rec)) {
            content_rec_settle(rec);
            content_store_put(p->cs, rec);
        }
        ps->spans[kept++] = ps->spans[i];
    }
    if (!failed) return false;
    log_warn("blend: %d chunks unreadable on disk; computing them instead", ps->n_spans - kept);
    ps->n_spans = kept;
    /* a dropped span ends a run: what is left of it is kept as the plan would have kept it
     * without the record (PLAN_MIN_RUN), and the run after it starts one */
    keep_runs(ps);
    if (ps->n_spans == 0) plan_seq_drop_spans(ps);
    blend_force_run_starts(ps->spans, ps->n_spans, ps->blend_policy, ps->blend_ratio);
    ps->exact_end = ps->n_spans == 0 || ps->blend_ratio >= 1 ? INT_MAX : ps->spans[0].slot;
    return true;
}

/* ---------------------------------------------------------------- fetching (submitting thread) */

/* Keeps, for usage, what the fetch brought (pr->loaded, pr->loaded_src) and how many chunks
 * after them it left to text. */
static void note_fetched(plan_req *pr, const cache_layout *cl, int n_text) {
    if (pr->n_loaded + n_text == 0) return;
    if (!(pr->fetched = calloc((size_t)(pr->n_loaded + n_text), sizeof *pr->fetched))) return;
    /* tokens of the prompt's full blocks each covers (a record may hold more: the prompt
     * diverged inside it) */
    int tokens = pr->loaded_from * cl->block_tokens, end = pr->n_keys * cl->block_tokens;
    for (int i = 0; i < pr->n_loaded; i++) {
        const cache_chunk *c = pr->loaded[i];
        int hi = c->pos0 + c->n_blocks * cl->block_tokens;
        if (hi > end) hi = end;
        pr->fetched[i] = (plan_fetched){.tokens = hi > tokens ? hi - tokens : 0,
                                        .tier = pr->loaded_src[i].tier,
                                        .enc = pr->loaded_src[i].enc};
        if (hi > tokens) tokens = hi;
    }
    pr->n_fetched = pr->n_loaded;
    for (int i = 0; i < n_text && tokens < end; i++) {
        int n = end - tokens < cl->chunk_tokens ? end - tokens : cl->chunk_tokens;
        pr->fetched[pr->n_fetched++] =
            (plan_fetched){.tokens = n, .tier = CACHE_TIER_REDIS, .enc = CACHE_ENC_TEXT};
        tokens += n;
    }
    if (n_text > 0) pr->redis_held_blocks = tokens / cl->block_tokens;
}

/* Fetches from the store the records that continue pr's prefix past the blocks the pool holds,
 * as far as the prefetch budget allows (reserved a chunk at a time, then trimmed to what was
 * found). */
static void prefetch(planner *p, plan_req *pr, uint64_t t_arrival) {
    const cache_layout *cl = cache_store_layout(p->o.store);
    int cb = cache_chunk_blocks(cl);
    int first = 0;
    if (p->pc)
        while (first < pr->n_keys && pool_cache_has(p->pc, &pr->keys[first])) first++;
    if (first >= pr->n_keys) return;
    int want = (pr->n_keys - 1) / cb - first / cb + 1; /* chunks from first's to the last's */
    int64_t chunk_bytes = (int64_t)cache_chunk_bytes(cl);
    int64_t limit = p->o.prefetch_bytes > 0 ? p->o.prefetch_bytes : INT64_C(1) << 30;
    int k = 0;
    for (; k < want; k++)
        if (atomic_fetch_add(&p->prefetched, chunk_bytes) + chunk_bytes > limit) {
            atomic_fetch_sub(&p->prefetched, chunk_bytes);
            break;
        }
    if (k == 0) return;
    pr->loaded_budget = &p->prefetched;
    pr->loaded_bytes = k * chunk_bytes;
    int n_text = 0;
    pr->loaded = calloc((size_t)k, sizeof *pr->loaded);
    pr->loaded_src = calloc((size_t)k, sizeof *pr->loaded_src);
    if (pr->loaded && pr->loaded_src) {
        int64_t budget = pr->ttft_budget_ms >= 0 ? pr->ttft_budget_ms : p->o.ttft_budget_ms;
        cache_fetch_policy pol = {.force_enc = pr->kv_level,
                                  .lossless = pr->kv_lossless,
                                  .budget_ns = budget * 1000000,
                                  .start_ns = t_arrival,
                                  .text_ns_per_token = p->ns_token_layer * p->m->hp.n_layer,
                                  .barred = p->o.levels_barred};
        pr->loaded_from = first;
        pr->loaded_blocks =
            cache_store_fetch(p->o.store, pr->keys, first, pr->n_keys, &pol, pr->loaded,
                              pr->loaded_src, k, &pr->n_loaded, &n_text);
    }
    int64_t found = 0;
    for (int i = 0; i < pr->n_loaded; i++) found += (int64_t)pr->loaded[i]->bytes;
    atomic_fetch_sub(&p->prefetched, pr->loaded_bytes - found);
    pr->loaded_bytes = found;
    note_fetched(pr, cl, n_text);
}

/* Brings from the Redis tier the content records of the prompt's content-defined chunks past
 * its fetched prefix that RAM and disk lack, into the content store, where the blend planned at
 * admission finds them. */
static void prefetch_content(planner *p, plan_req *pr, const int32_t *prompt, int n) {
    if (!p->cs || pr->blend != PLAN_BLEND_ON || !cache_store_has_redis(p->o.store)) return;
    int bt = kv_pool_layout(p->pool)->block_tokens;
    int from = pr->n_loaded ? (pr->loaded_from + pr->loaded_blocks) * bt : 0, n_want = 0;
    int *cuts = malloc(sizeof *cuts * (size_t)n), *n_tok = malloc(sizeof *n_tok * (size_t)n);
    cache_key *keys = malloc(sizeof *keys * (size_t)n);
    content_rec **got = malloc(sizeof *got * (size_t)n);
    if (!cuts || !n_tok || !keys || !got) goto done;
    int n_cuts = cut_prompt(p, pr, prompt, n, cuts);
    for (int i = 0, a = 0; i < n_cuts; a = cuts[i++]) {
        int b = cuts[i];
        if (a < from || b > n - 1 || b - a < PLAN_CDC.min_tokens) continue;
        cache_key *k = &keys[n_want];
        cache_content_key(p->m->identity, &pr->ns, prompt + a, b - a, k);
        if (content_store_has(p->cs, k)) continue;
        content_rec *on_disk = content_disk_get(p->o.blend_disk, k, b - a);
        if (on_disk) {
            content_rec_unref(on_disk);
            continue;
        }
        n_tok[n_want++] = b - a;
    }
    /* in batches, and no more than the content store holds */
    int64_t room = p->o.blend_bytes, kvd = p->m->hp.n_kv_head * p->m->hp.head_dim;
    for (int i = 0; i < n_want && room > 0; i += PREFETCH_CONTENT_BATCH) {
        int k = n_want - i < PREFETCH_CONTENT_BATCH ? n_want - i : PREFETCH_CONTENT_BATCH;
        if (cache_store_fetch_content(p->o.store, &pr->ns, keys + i, n_tok + i, k, got) == 0)
            continue;
        for (int j = 0; j < k; j++)
            if (got[j]) {
                room -= (int64_t)2 * 2 * p->m->hp.n_layer * kvd * got[j]->n_tok;
                content_store_put(p->cs, got[j]);
                content_rec_unref(got[j]);
            }
    }
done:
    free(cuts);
    free(n_tok);
    free(keys);
    free(got);
}

int plan_prepare(planner *p, plan_req *pr, const cache_key *ns, const int32_t *prompt, int n_prompt,
                 bool positioned, bool score, uint64_t t_arrival, bool fetch) {
    /* a Prompt Cache prompt's KV is not a plain prefix's: no prefix key may name it */
    pr->cache = !positioned;
    if (!pr->cache) return 0;
    pr->ns = *ns;
    int bt = kv_pool_layout(p->pool)->block_tokens;
    int n = n_prompt / bt;
    if (n == 0) return 0;
    if (!(pr->keys = malloc(sizeof *pr->keys * (size_t)n))) return -1;
    pr->n_keys = cache_prefix_keys(p->m->identity, ns, prompt, n_prompt, bt, pr->keys, n);
    /* Scoring reuses nothing (it needs every row's logits): only the keys, for storing. */
    if (fetch && p->o.store && !score) {
        prefetch(p, pr, t_arrival);
        prefetch_content(p, pr, prompt, n_prompt);
    }
    return 0;
}
