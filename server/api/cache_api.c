/* The context cache's HTTP surface: GET /v1/cache/stats, POST /v1/cache/clear, POST
 * /v1/cache/pin and /unpin, the cache's Prometheus metrics, and the namespace rule.
 *
 * Namespaces: with API keys configured, every key is its own tenant; cache_salt splits a
 * tenant further (as vLLM's cache_salt does). Clear works within the caller's namespace unless
 * "all" is given. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store/redis_state.h"
#include "server/api/handlers.h"
#include "server/api/job.h"

static json_t *tier_json(const cache_tier_stats *t, bool disk) {
    json_t *v =
        json_pack("{s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I}", "entries", (json_int_t)t->entries,
                  "bytes", (json_int_t)t->bytes, "capacity_bytes", (json_int_t)t->capacity,
                  "pinned", (json_int_t)t->pinned, "hits", (json_int_t)t->hits, "misses",
                  (json_int_t)t->misses, "bytes_in", (json_int_t)t->bytes_in, "bytes_out",
                  (json_int_t)t->bytes_out, "evictions", (json_int_t)t->evictions);
    if (v && disk) {
        json_object_set_new(v, "corrupt", json_integer(t->corrupt));
        json_object_set_new(v, "write_errors", json_integer(t->write_errors));
        json_object_set_new(v, "dropped_writes", json_integer(t->dropped));
    }
    return v;
}

/* Chunks fetched per encoding (the fetch policy's choices): lossless and q8 always, a codec
 * level once it has served one. */
static json_t *levels_json(const cache_tier_stats *t) {
    json_t *levels = json_object();
    for (int e = 0; e < CACHE_ENC_MAX; e++) {
        char name[16];
        cache_enc_name(e, name);
        if (e < CACHE_ENC_CODEC || t->enc_hits[e])
            json_object_set_new(levels, name, json_integer(t->enc_hits[e]));
    }
    return levels;
}

/* Every pinned or leased record (*n of them, malloc'd), or NULL (*n 0) with no store or memory.
 * Listing ends the leases that are due first. */
static cache_pin_info *pins_all(server *s, int *n) {
    int cap = 256;
    *n = 0;
    for (int tries = 0; s->store && tries < 4; tries++) {
        cache_pin_info *pins = malloc(sizeof *pins * (size_t)cap);
        if (!pins) return NULL;
        int total = cache_store_pins(s->store, pins, cap);
        if (total <= cap) {
            *n = total;
            return pins;
        }
        free(pins); /* more than room for: again with room for all (more may come meanwhile) */
        cap = total + 64;
    }
    return NULL;
}

/* The pinned and leased records (up to STATS_PINS of them listed): Anthropic's cache_control
 * leases with their expiry (Unix seconds), /v1/cache/pin's pins (until unpinned). With API keys,
 * only the caller's namespace's: its key's, split by ?cache_salt= (a tenant sees no other's
 * prefixes, token counts or expiries); without keys the server is one tenant and lists all. */
#define STATS_PINS 256
static json_t *pins_json(server *s, const http_call *c) {
    int n_all;
    cache_pin_info *pins = pins_all(s, &n_all);
    int64_t now = s->store ? cache_store_now(s->store) : 0;
    int bt = s->store ? cache_store_layout(s->store)->block_tokens : 0;
    bool mine_only = s->http.n_keys > 0;
    cache_key mine;
    server_cache_namespace(s, c, c->query_salt, &mine);
    if (shared_pins_sync(s, &mine, pins, n_all) > 0) { /* unpinned on another instance */
        free(pins);
        pins = pins_all(s, &n_all);
    }
    json_t *list = json_array();
    int n = 0;
    for (int i = 0; i < n_all; i++) {
        const cache_pin_info *p = &pins[i];
        if (mine_only && memcmp(p->ns.b, mine.b, CACHE_KEY_BYTES) != 0) continue;
        if (n++ >= STATS_PINS) continue; /* counted, not listed */
        char key[2 * CACHE_KEY_BYTES + 1], ns[2 * CACHE_KEY_BYTES + 1];
        cache_key_hex(&p->key, key);
        cache_key_hex(&p->ns, ns);
        json_t *tiers = json_array();
        if (p->ram) json_array_append_new(tiers, json_string("ram"));
        if (p->disk) json_array_append_new(tiers, json_string("disk"));
        json_t *v =
            json_pack("{s:s%,s:s%,s:i,s:b,s:o}", "record", key, (size_t)16, "namespace", ns,
                      (size_t)16, "tokens", p->n_blocks * bt, "pinned", p->manual, "tiers", tiers);
        json_object_set_new(v, "expires_at", p->lease ? json_integer(p->lease) : json_null());
        if (p->lease)
            json_object_set_new(v, "expires_in_s",
                                json_integer(p->lease > now ? p->lease - now : 0));
        json_array_append_new(list, v);
    }
    /* with --redis, the caller's namespace's pins and leases other instances took */
    json_t *shared = shared_pins_json(s, &mine, pins, n_all);
    free(pins);
    size_t i;
    json_t *v;
    json_array_foreach(shared, i, v) {
        if (n++ < STATS_PINS) json_array_append(list, v);
    }
    json_decref(shared);
    return json_pack("{s:I,s:i,s:o}", "limit_bytes", (json_int_t)s->cfg->pin_bytes, "records", n,
                     "list", list);
}

/* What this instance read, wrote and refused of the state shared through Redis (responses,
 * schemas, pins, leases: cache/store/redis_state.h); null without --redis. */
static json_t *shared_json(server *s) {
    if (!s->shared) return json_null();
    redis_state_stats st;
    redis_state_stats_get(s->shared, &st);
    return json_pack("{s:b,s:I,s:I,s:I,s:I,s:I,s:I}", "connected", st.connected, "hits",
                     (json_int_t)st.hits, "misses", (json_int_t)st.misses, "writes",
                     (json_int_t)st.writes, "write_errors", (json_int_t)st.write_errors, "corrupt",
                     (json_int_t)st.corrupt, "deleted", (json_int_t)st.deleted);
}

http_result cache_api_stats(server *s, const http_call *c, http_out *o) {
    http_reply *out = &o->reply;
    engine_cache_stats es;
    engine_cache_stats_get(s->eng, &es);
    cache_stats cs = {0};
    if (s->store) cache_store_stats(s->store, &cs);
    json_t *tiers = json_object();
    json_object_set_new(
        tiers, "pool",
        json_pack("{s:b,s:I,s:I,s:I,s:I,s:I,s:I,s:I}", "enabled", s->cfg->cache, "entries",
                  (json_int_t)es.pool_entries, "blocks", (json_int_t)es.pool_blocks, "hits",
                  (json_int_t)es.pool_hits, "misses", (json_int_t)es.pool_misses, "evictions",
                  (json_int_t)es.pool_evictions, "partial_blocks", (json_int_t)es.pool_partial,
                  "partial_hits", (json_int_t)es.pool_partial_hits));
    json_t *ram = tier_json(&cs.ram, false);
    json_object_set_new(ram, "enabled", json_boolean(s->store && cs.ram.capacity > 0));
    json_object_set_new(tiers, "ram", ram);
    json_t *disk = tier_json(&cs.disk, true);
    json_object_set_new(disk, "enabled", json_boolean(cs.disk_enabled));
    json_object_set_new(disk, "levels", levels_json(&cs.disk));
    json_object_set_new(disk, "evicted_writes", json_integer(es.tails_dropped));
    json_object_set_new(tiers, "disk", disk);
    /* Redis is shared: what it holds (entries, bytes) is not this instance's to report. */
    json_t *redis = tier_json(&cs.redis, true);
    json_object_set_new(redis, "enabled", json_boolean(cs.redis_enabled));
    json_object_set_new(redis, "connected", json_boolean(cs.redis_connected));
    json_t *levels = levels_json(&cs.redis);
    json_object_set_new(levels, "text", json_integer(cs.redis.text));
    json_object_set_new(redis, "levels", levels);
    json_object_set_new(redis, "content_hits", json_integer(cs.redis.content_hits));
    json_object_set_new(redis, "state", shared_json(s));
    json_object_set_new(tiers, "redis", redis);
    /* blend's content records, found by content anywhere in a prompt */
    json_t *bram = tier_json(&es.content, false);
    json_object_set_new(bram, "enabled", json_boolean(es.content.capacity > 0));
    json_object_set_new(tiers, "blend_ram", bram);
    json_t *bdisk = tier_json(&es.content_disk, true);
    json_object_set_new(bdisk, "enabled", json_boolean(s->blend_disk != NULL));
    json_object_set_new(tiers, "blend_disk", bdisk);
    /* the identity records and calibrations are bound to (make calibrate-reuse reads it) */
    char hex[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex((const cache_key *)(const void *)s->m->identity, hex);
    http_reply_json(out, 200,
                    json_pack("{s:s,s:b,s:i,s:I,s:s,s:o,s:o,s:o}", "object", "cache.stats",
                              "enabled", es.enabled, "chunk_tokens", es.chunk_tokens,
                              "reused_tokens", (json_int_t)es.reused_tokens, "model_identity", hex,
                              "tiers", tiers, "pins", pins_json(s, c), "reuse_quality",
                              cache_api_reuse_json(s)));
    return HTTP_REPLIED;
}

json_t *cache_api_reuse_json(const server *s) {
    const server_reuse *r = &s->reuse;
    const quality_choice *c = &r->choice;
    engine_quality_stats q;
    engine_quality_stats_get(s->eng, &q);
    json_t *levels = json_array();
    for (int e = CACHE_ENC_Q8; e < CACHE_ENC_MAX; e++)
        if (!c->gated || (c->levels & (1u << e))) {
            char name[16];
            cache_enc_name(e, name);
            json_array_append_new(levels, json_string(name));
        }
    json_t *blend =
        json_pack("{s:b,s:s}", "on", !c->gated || c->blend, "why", c->why[QUALITY_BLEND]);
    if (c->blend) {
        json_object_set_new(blend, "policy", json_string(blend_policy_name(c->blend_policy)));
        /* the live check's steps move it from the calibrated one */
        json_object_set_new(blend, "ratio", json_real(q.on ? q.ratio : c->blend_ratio));
        json_object_set_new(blend, "calibrated_ratio", json_real(c->blend_ratio));
    }
    json_t *live = json_pack(
        "{s:b,s:f,s:I,s:I,s:I,s:I,s:f,s:f,s:f,s:f,s:I,s:I}", "on", q.on, "sample", q.sample,
        "sampled", (json_int_t)q.sampled, "checked", (json_int_t)q.checked, "dropped",
        (json_int_t)q.dropped, "abandoned", (json_int_t)q.abandoned, "mean_kl", q.mean_kl,
        "mean_top1", q.mean_top1, "rolling_kl", q.rolling_kl, "rolling_top1", q.rolling_top1,
        "steps_up", (json_int_t)q.steps_up, "steps_down", (json_int_t)q.steps_down);
    if (q.last_step[0]) json_object_set_new(live, "last_step", json_string(q.last_step));
    json_object_set_new(blend, "live_check", live);
    json_object_set_new(blend, "repair",
                        json_pack("{s:b,s:I,s:I}", "on", s->cfg->blend_repair, "repaired",
                                  (json_int_t)q.repaired, "dropped", (json_int_t)q.repair_dropped));
    json_t *fixup = json_pack("{s:s}", "why", c->why[QUALITY_FIXUP]);
    if (c->fixup_ratio >= 0) json_object_set_new(fixup, "ratio", json_real(c->fixup_ratio));
    return json_pack("{s:s,s:s,s:s?,s:s?,s:{s:o,s:o,s:{s:o,s:s}}}", "budget", r->budget_name,
                     "bounds", r->bounds, "calibration", r->calibration[0] ? r->calibration : NULL,
                     "calibration_error", r->calib_error[0] ? r->calib_error : NULL, "methods",
                     "blend", blend, "fixup", fixup, "levels", "allowed", levels, "why",
                     c->why[QUALITY_LEVEL]);
}

static int fail_400(api_error *err, const char *param, const char *fmt, const char *detail) {
    return api_fail(err, 400, "invalid_request_error", NULL, param, fmt, detail);
}

/* {"cache_salt": "...", "all": false, "tiers": ["pool", "ram", "disk", "redis"]}, every field
 * optional (no tiers: all of them). An empty body is an empty object. */
http_result cache_api_clear(server *s, const http_call *c, http_out *o) {
    http_reply *out = &o->reply;
    api_error err = {0};
    json_error_t je;
    json_t *root =
        c->len ? json_loadb(c->body, c->len, JSON_REJECT_DUPLICATES, &je) : json_object();
    enum { NT = 4 };
    bool tier[NT] = {true, true, true, true}; /* pool, ram, disk, redis */
    static const char *const TIERS[NT] = {"pool", "ram", "disk", "redis"};
    const char *salt = NULL;
    bool all = false;
    if (!root) {
        fail_400(&err, NULL, "We could not parse the JSON body of your request: %s", je.text);
        goto fail;
    }
    if (!json_is_object(root)) {
        fail_400(&err, NULL, "%s", "the request body must be a JSON object");
        goto fail;
    }
    json_t *v = json_object_get(root, "cache_salt");
    if (v && !json_is_null(v)) {
        if (!json_is_string(v) || json_string_length(v) > API_MAX_CACHE_SALT) {
            fail_400(&err, "cache_salt", "%s",
                     "'cache_salt' must be a string of at most 256 bytes");
            goto fail;
        }
        salt = json_string_value(v);
    }
    if ((v = json_object_get(root, "all")) && !json_is_null(v)) {
        if (!json_is_boolean(v)) {
            fail_400(&err, "all", "%s", "'all' must be a boolean");
            goto fail;
        }
        all = json_is_true(v);
    }
    if ((v = json_object_get(root, "tiers")) && !json_is_null(v)) {
        if (!json_is_array(v)) {
            fail_400(&err, "tiers", "%s",
                     "'tiers' must be an array of \"pool\", \"ram\", \"disk\", \"redis\"");
            goto fail;
        }
        tier[0] = tier[1] = tier[2] = tier[3] = false;
        size_t i;
        json_t *t;
        json_array_foreach(v, i, t) {
            int k = 0;
            while (k < NT && !(json_is_string(t) && strcmp(json_string_value(t), TIERS[k]) == 0))
                k++;
            if (k == NT) {
                fail_400(&err, "tiers", "%s",
                         "'tiers' must be an array of \"pool\", \"ram\", \"disk\", \"redis\"");
                goto fail;
            }
            tier[k] = true;
        }
    }
    if (all && s->http.n_keys > 0) {
        /* With API keys every key is a tenant: one may not drop the others' chunks. */
        api_fail(&err, 403, "permission_error", NULL, "all",
                 "'all' clears every tenant's chunks: refused on a server with API keys");
        goto fail;
    }
    cache_key ns;
    server_cache_namespace(s, c, salt, &ns);
    const cache_key *scope = all ? NULL : &ns;
    int64_t n_pool = tier[0] ? engine_cache_clear(s->eng, scope) : 0, n_ram = 0, n_disk = 0;
    int64_t b_ram = 0, b_disk = 0, n_redis = 0;
    if (s->store)
        cache_store_clear(s->store, scope, tier[1], tier[2], tier[3], &n_ram, &n_disk, &n_redis);
    engine_blend_clear(s->eng, scope, tier[1], tier[2], &b_ram, &b_disk);
    log_info("cache: cleared %s: %lld pool, %lld RAM, %lld disk, %lld Redis chunks; blend: %lld "
             "RAM, %lld disk records",
             all ? "every namespace" : "one namespace", (long long)n_pool, (long long)n_ram,
             (long long)n_disk, (long long)n_redis, (long long)b_ram, (long long)b_disk);
    json_decref(root);
    http_reply_json(out, 200,
                    json_pack("{s:s,s:{s:I,s:I,s:I,s:I,s:I,s:I}}", "object", "cache.clear",
                              "cleared", "pool", (json_int_t)n_pool, "ram", (json_int_t)n_ram,
                              "disk", (json_int_t)n_disk, "redis", (json_int_t)n_redis, "blend_ram",
                              (json_int_t)b_ram, "blend_disk", (json_int_t)b_disk));
    return HTTP_REPLIED;
fail:
    json_decref(root);
    http_reply_error(out, &err);
    return HTTP_REPLIED;
}

/* A pin the caller's share of the pinned bytes cannot take (nothing was pinned): 409, with what
 * it holds and may hold, and how to make room. */
static void pin_share_error(server *s, int tenant, api_error *err) {
    cache_tenant_pins p;
    cache_store_tenant_pins(s->store, tenant, &p);
    bool ram = p.ram_share > 0;
    api_fail(err, 409, "invalid_request_error", "pin_share_exceeded", NULL,
             "nothing pinned: this API key's pins and cache_control leases hold %lld of the %lld "
             "bytes its share of the %s tier allows (--tenant-pin-share); unpin prompts it no "
             "longer needs, or wait for its leases to end",
             (long long)(ram ? p.ram : p.disk), (long long)(ram ? p.ram_share : p.disk_share),
             ram ? "RAM" : "disk");
}

/* A pin's "ttl" at most: 30 days. */
#define PIN_TTL_MAX (30 * 86400)

/* The records of the prompt j computed (one per chunk, the last one partial: its trailing whole
 * blocks) pinned, unpinned or (ttl > 0) leased for ttl seconds, for the caller's tenant; the
 * answer into out. A record still being written is pinned once it is on disk: no need to wait
 * for it. */
static void pin_records(server *s, const http_call *c, const job *j, bool pin, int64_t ttl,
                        http_reply *out) {
    const gen_request *r = j->reqs[0];
    api_error err = {0};
    int cb = cache_chunk_blocks(cache_store_layout(s->store));
    int n_records = (r->plan.n_keys + cb - 1) / cb;
    cache_key *records = malloc(sizeof *records * (size_t)(n_records > 0 ? n_records : 1));
    if (!records) {
        api_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
        http_reply_error(out, &err);
        return;
    }
    cache_record_keys(r->plan.keys, r->plan.n_keys, cb, records);
    int tenant = server_tenant(s, c);
    int64_t until = ttl > 0 ? cache_store_now(s->store) + ttl : 0;
    int held = until ? cache_store_pin_until(s->store, tenant, records, n_records, until)
                     : cache_store_pin(s->store, tenant, records, n_records, pin);
    free(records);
    if (held < 0) {
        pin_share_error(s, tenant, &err);
        http_reply_error(out, &err);
        return;
    }
    /* with --redis, shared: listed and unpinned on every instance, its chunks kept there */
    if (pin)
        shared_pins_record(s, &r->plan.ns, r->plan.keys, r->plan.n_keys, until);
    else {
        int gone = shared_pins_forget(s, &r->plan.ns, r->plan.keys, r->plan.n_keys);
        if (gone > held) held = gone;
    }
    json_t *v = json_pack("{s:s,s:i,s:i,s:i,s:i}", "object", pin ? "cache.pin" : "cache.unpin",
                          "prompt_tokens", r->n_prompt, "chunk_tokens", s->cfg->cache_chunk_tokens,
                          "chunks", n_records, pin ? "pinned_chunks" : "unpinned_chunks", held);
    if (v && until) json_object_set_new(v, "expires_at", json_integer(until));
    http_reply_json(out, 200, v);
}

/* The pin body's optional "ttl" (seconds, 1 .. PIN_TTL_MAX) into *ttl (0: not given). */
static int pin_ttl(const json_t *body, int64_t *ttl, api_error *err) {
    const json_t *v = json_object_get(body, "ttl");
    *ttl = 0;
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > PIN_TTL_MAX)
        return api_fail(err, 400, "invalid_request_error", NULL, "ttl",
                        "'ttl' must be a whole number of seconds from 1 to %d", PIN_TTL_MAX);
    *ttl = json_integer_value(v);
    return 0;
}

/* The body is what the client would send to /v1/chat/completions ("messages") or
 * /v1/completions ("prompt"), so a pinned prompt has exactly the keys its requests will have,
 * and an optional "ttl" (seconds) that makes the pin a lease, ending by itself then (as
 * Anthropic's cache_control leases do; unpin leaves it, and unpin ignores a ttl, so the same body
 * serves both). Pin computes whatever of the prompt is not cached yet (a prompt-only run through
 * the engine) and pins its chunks; unpin only computes the keys. Pins may fill at most half of
 * each tier: pinned_chunks < chunks says some did not fit. A key's pins (with its leases) may
 * fill at most its share of that (--tenant-pin-share): a pin that would take it past its share
 * is refused whole with a 409 (pin_share_exceeded), and pins nothing. */
static http_result pin_or_unpin(server *s, const http_call *c, http_out *o, bool pin) {
    http_reply *out = &o->reply;
    api_error err = {0};
    api_request rq;
    if (!s->store || !s->cfg->cache) {
        api_fail(&err, 400, "invalid_request_error", "cache_disabled", NULL,
                 "the context cache is off on this server (--no-cache), or has no RAM or disk "
                 "tier");
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    json_error_t je;
    json_t *probe = json_loadb(c->body, c->len, 0, &je);
    api_kind kind = probe && json_object_get(probe, "messages") ? API_CHAT : API_COMPLETION;
    int64_t ttl = 0;
    int bad_ttl = pin && probe ? pin_ttl(probe, &ttl, &err) : 0;
    json_decref(probe);
    if (bad_ttl || api_parse_request(kind, c->body, c->len, &rq, &err)) {
        if (!bad_ttl) api_request_free(&rq);
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    if (kind == API_COMPLETION && rq.n_prompts != 1) {
        api_request_free(&rq);
        fail_400(&err, "prompt", "%s", "pin takes one prompt");
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    /* A prompt-only run: no token is generated, the prompt's chunks are stored. */
    rq.max_tokens = 0;
    rq.n = 1;
    rq.stream = false;
    rq.echo = false;
    rq.logprobs = false;
    rq.cache = true;
    job *j = job_start(s, &rq, c, pin, &err);
    api_request_free(&rq);
    if (!j) {
        http_reply_error(out, &err);
        if (err.status == 429) out->retry_after = 1;
        return HTTP_REPLIED;
    }
    if (pin && (job_wait(j, &err) || job_error(j, &err)))
        http_reply_error(out, &err);
    else
        pin_records(s, c, j, pin, ttl, out);
    job_free(j);
    return HTTP_REPLIED;
}

/* ---------------------------------------------------------------- metrics */

static void metric(FILE *f, const char *name, const char *type, const char *help) {
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* name{level="..."} of every level levels_json lists. */
static void level_lines(FILE *f, const char *name, const cache_tier_stats *t) {
    for (int e = 0; e < CACHE_ENC_MAX; e++) {
        char level[16];
        cache_enc_name(e, level);
        if (e < CACHE_ENC_CODEC || t->enc_hits[e])
            fprintf(f, "%s{level=\"%s\"} %lld\n", name, level, (long long)t->enc_hits[e]);
    }
}

/* The tiers of the cache's series, Redis last: its evictions, entries and bytes are not known
 * here (other instances share it), so those series stop before it (N_HELD). */
enum { N_TIERS = 5, N_HELD = N_TIERS - 1 };
static const char *const tier_names[N_TIERS] = {"ram", "disk", "blend_ram", "blend_disk", "redis"};

/* Lookups and traffic: reused tokens, hits, misses, evictions, bytes in and out, corrupt
 * records. */
static void traffic_metrics(FILE *f, const engine_cache_stats *es, const cache_stats *cs,
                            const cache_tier_stats *const t[N_TIERS]) {
    metric(f, "kvserve_cache_reused_tokens_total", "counter",
           "Prompt tokens whose KV came from the context cache.");
    fprintf(f, "kvserve_cache_reused_tokens_total %lld\n", (long long)es->reused_tokens);
    metric(f, "kvserve_cache_hits_total", "counter", "Chunk lookups found, by tier.");
    fprintf(f, "kvserve_cache_hits_total{tier=\"pool\"} %lld\n", (long long)es->pool_hits);
    for (int i = 0; i < N_TIERS; i++)
        fprintf(f, "kvserve_cache_hits_total{tier=\"%s\"} %lld\n", tier_names[i],
                (long long)t[i]->hits);
    metric(f, "kvserve_cache_partial_hits_total", "counter",
           "Prompts that reused part of a pool block (matched to the token).");
    fprintf(f, "kvserve_cache_partial_hits_total %lld\n", (long long)es->pool_partial_hits);
    metric(f, "kvserve_cache_misses_total", "counter", "Chunk lookups not found, by tier.");
    fprintf(f, "kvserve_cache_misses_total{tier=\"pool\"} %lld\n", (long long)es->pool_misses);
    for (int i = 0; i < N_TIERS; i++)
        fprintf(f, "kvserve_cache_misses_total{tier=\"%s\"} %lld\n", tier_names[i],
                (long long)t[i]->misses);
    metric(f, "kvserve_cache_evictions_total", "counter", "Chunks evicted for room, by tier.");
    fprintf(f, "kvserve_cache_evictions_total{tier=\"pool\"} %lld\n",
            (long long)es->pool_evictions);
    for (int i = 0; i < N_HELD; i++)
        fprintf(f, "kvserve_cache_evictions_total{tier=\"%s\"} %lld\n", tier_names[i],
                (long long)t[i]->evictions);
    metric(f, "kvserve_cache_bytes_in_total", "counter", "Bytes stored into a tier.");
    for (int i = 0; i < N_TIERS; i++)
        fprintf(f, "kvserve_cache_bytes_in_total{tier=\"%s\"} %lld\n", tier_names[i],
                (long long)t[i]->bytes_in);
    metric(f, "kvserve_cache_bytes_out_total", "counter", "Bytes loaded from a tier.");
    for (int i = 0; i < N_TIERS; i++)
        fprintf(f, "kvserve_cache_bytes_out_total{tier=\"%s\"} %lld\n", tier_names[i],
                (long long)t[i]->bytes_out);
    metric(f, "kvserve_cache_corrupt_total", "counter",
           "Records dropped as torn or corrupt (failed header or checksum).");
    fprintf(f, "kvserve_cache_corrupt_total{tier=\"disk\"} %lld\n", (long long)cs->disk.corrupt);
    fprintf(f, "kvserve_cache_corrupt_total{tier=\"blend_disk\"} %lld\n",
            (long long)es->content_disk.corrupt);
    fprintf(f, "kvserve_cache_corrupt_total{tier=\"redis\"} %lld\n", (long long)cs->redis.corrupt);
}

/* The live check of approximate reuse (cache/quality.h) and the blend ratio it leads to. */
static void quality_metrics(FILE *f, const server *s) {
    engine_quality_stats q;
    engine_quality_stats_get(s->eng, &q);
    metric(f, "kvserve_reuse_quality_checks_total", "counter",
           "Blended requests computed again as a full prefill and compared.");
    fprintf(f, "kvserve_reuse_quality_checks_total{method=\"blend\"} %lld\n", (long long)q.checked);
    metric(f, "kvserve_reuse_quality_kl", "gauge",
           "First-token KL of blended requests against a full prefill: over the last window, "
           "and over every check.");
    fprintf(f, "kvserve_reuse_quality_kl{method=\"blend\",window=\"rolling\"} %.6f\n",
            q.rolling_kl);
    fprintf(f, "kvserve_reuse_quality_kl{method=\"blend\",window=\"all\"} %.6f\n", q.mean_kl);
    metric(f, "kvserve_reuse_quality_top1", "gauge",
           "Share of checked blended requests whose first token a full prefill agrees with.");
    fprintf(f, "kvserve_reuse_quality_top1{method=\"blend\",window=\"rolling\"} %.4f\n",
            q.rolling_top1);
    fprintf(f, "kvserve_reuse_quality_top1{method=\"blend\",window=\"all\"} %.4f\n", q.mean_top1);
    metric(f, "kvserve_reuse_quality_steps_total", "counter",
           "The live check's steps of the blend setting: up (safer), down (back).");
    fprintf(f, "kvserve_reuse_quality_steps_total{method=\"blend\",direction=\"up\"} %lld\n",
            (long long)q.steps_up);
    fprintf(f, "kvserve_reuse_quality_steps_total{method=\"blend\",direction=\"down\"} %lld\n",
            (long long)q.steps_down);
    metric(f, "kvserve_blend_ratio", "gauge",
           "The blend ratio requests that name none get (-1: blend off for them).");
    const quality_choice *c = &s->reuse.choice;
    double ratio = q.on                         ? q.ratio
                   : c->blend                   ? c->blend_ratio
                   : !c->gated && s->cfg->blend ? s->cfg->blend_recompute / 100.0
                                                : -1.0;
    fprintf(f, "kvserve_blend_ratio %.4f\n", ratio);
}

static void write_error_metrics(FILE *f, const engine_cache_stats *es, const cache_stats *cs) {
    metric(
        f, "kvserve_cache_write_errors_total", "counter",
        "Failed or dropped write-backs (a full disk, a full queue, a last record whose blocks the "
        "pool evicted before the disk took it).");
    fprintf(f, "kvserve_cache_write_errors_total{tier=\"disk\",reason=\"io\"} %lld\n",
            (long long)cs->disk.write_errors);
    fprintf(f, "kvserve_cache_write_errors_total{tier=\"disk\",reason=\"queue_full\"} %lld\n",
            (long long)cs->disk.dropped);
    fprintf(f, "kvserve_cache_write_errors_total{tier=\"disk\",reason=\"evicted\"} %lld\n",
            (long long)es->tails_dropped);
    fprintf(f, "kvserve_cache_write_errors_total{tier=\"blend_disk\",reason=\"io\"} %lld\n",
            (long long)es->content_disk.write_errors);
    fprintf(f, "kvserve_cache_write_errors_total{tier=\"blend_disk\",reason=\"queue_full\"} %lld\n",
            (long long)es->content_disk.dropped);
    fprintf(f, "kvserve_cache_write_errors_total{tier=\"redis\",reason=\"io\"} %lld\n",
            (long long)cs->redis.write_errors);
    fprintf(f, "kvserve_cache_write_errors_total{tier=\"redis\",reason=\"queue_full\"} %lld\n",
            (long long)cs->redis.dropped);
}

/* The chunks Redis and disk served by level, and whether Redis answers. */
static void level_metrics(FILE *f, const cache_stats *cs) {
    metric(f, "kvserve_cache_redis_chunks_total", "counter",
           "Chunks fetched from Redis, by the level they came in (text: left to be computed).");
    level_lines(f, "kvserve_cache_redis_chunks_total", &cs->redis);
    fprintf(f, "kvserve_cache_redis_chunks_total{level=\"text\"} %lld\n",
            (long long)cs->redis.text);
    metric(f, "kvserve_cache_disk_chunks_total", "counter",
           "Chunks read from disk, by the level they came in (--cache-disk-encoded).");
    level_lines(f, "kvserve_cache_disk_chunks_total", &cs->disk);
    metric(f, "kvserve_cache_redis_connected", "gauge",
           "1 when the last exchange with the Redis tier succeeded (0: down or no Redis tier).");
    fprintf(f, "kvserve_cache_redis_connected %d\n", cs->redis_connected ? 1 : 0);
}

/* What each tier holds now: chunks and payload bytes. */
static void held_metrics(FILE *f, const engine_cache_stats *es,
                         const cache_tier_stats *const t[N_TIERS]) {
    metric(f, "kvserve_cache_entries", "gauge", "Chunks held, by tier.");
    fprintf(f, "kvserve_cache_entries{tier=\"pool\"} %lld\n", (long long)es->pool_entries);
    for (int i = 0; i < N_HELD; i++)
        fprintf(f, "kvserve_cache_entries{tier=\"%s\"} %lld\n", tier_names[i],
                (long long)t[i]->entries);
    metric(f, "kvserve_cache_bytes", "gauge", "Payload bytes held, by tier.");
    for (int i = 0; i < N_HELD; i++)
        fprintf(f, "kvserve_cache_bytes{tier=\"%s\"} %lld\n", tier_names[i],
                (long long)t[i]->bytes);
}

char *cache_api_metrics(server *s, char *text, size_t *len) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f) {
        free(text);
        return NULL;
    }
    fwrite(text, 1, *len, f);
    free(text);
    engine_cache_stats es;
    engine_cache_stats_get(s->eng, &es);
    cache_stats cs = {0};
    if (s->store) cache_store_stats(s->store, &cs);
    const cache_tier_stats *const t[N_TIERS] = {&cs.ram, &cs.disk, &es.content, &es.content_disk,
                                                &cs.redis};
    traffic_metrics(f, &es, &cs, t);
    quality_metrics(f, s);
    write_error_metrics(f, &es, &cs);
    level_metrics(f, &cs);
    held_metrics(f, &es, t);
    responses_metrics(s, f);
    tenant_metrics(s, f);
    if (fclose(f) != 0) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

http_result cache_api_pin(server *s, const http_call *c, http_out *o) {
    return pin_or_unpin(s, c, o, true);
}

http_result cache_api_unpin(server *s, const http_call *c, http_out *o) {
    return pin_or_unpin(s, c, o, false);
}
