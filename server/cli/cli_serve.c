/* `kvserve serve`: the HTTP server. It listens first (GET /health answers 503 "loading" while
 * the model loads), then loads the model, starts the engine and serves until SIGINT or SIGTERM.
 * Then it drains: GET /health answers 503 "draining" at once and, after --drain-grace seconds
 * of taking requests as usual (while routers in front take the server out), new requests get
 * 503 while running requests and streams finish, for up to --shutdown-timeout seconds; whatever
 * still runs then ends with an error (a stream's error event); the cache's queued writes are
 * flushed, and it exits 0. A second signal exits at once (status 128 + the signal). */
#include <limits.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "cache/setup.h"
#include "cache/store/redis_state.h"
#include "server/api/handlers.h"
#include "server/api/responses.h"
#include "server/cli/cli.h"
#include "server/cli/cli_common.h"
#include "server/engine/calibrate.h"
#include "util/utf8.h"

extern char **environ;

/* The names clients may use, into s->model_ids: the aliases in order (each once), or the file
 * name without its directory and .gguf. Every response names the first, and JSON strings must
 * be UTF-8. */
static int model_ids_from(const kv_config *c, server *s, kv_error *err) {
    int n = c->n_aliases > 0 ? c->n_aliases : 1;
    if (!(s->model_ids = calloc((size_t)n, sizeof *s->model_ids)))
        return kv_fail(err, "out of memory");
    if (c->n_aliases == 0) {
        const char *base = strrchr(c->model, '/');
        base = base ? base + 1 : c->model;
        size_t len = strlen(base);
        if (len > 5 && strcmp(base + len - 5, ".gguf") == 0) len -= 5;
        if (!(s->model_ids[0] = strndup(base, len))) return kv_fail(err, "out of memory");
        s->n_model_ids = 1;
    }
    for (int i = 0; i < c->n_aliases; i++) {
        bool seen = false;
        for (int k = 0; k < s->n_model_ids; k++)
            seen |= strcmp(s->model_ids[k], c->aliases[i]) == 0;
        if (seen) continue;
        if (!(s->model_ids[s->n_model_ids] = strdup(c->aliases[i])))
            return kv_fail(err, "out of memory");
        s->n_model_ids++;
    }
    for (int i = 0; i < s->n_model_ids; i++) {
        const char *id = s->model_ids[i];
        if (utf8_validate((const uint8_t *)id, strlen(id)) != strlen(id))
            return kv_fail(err, "the model id '%s' is not valid UTF-8: set --alias", id);
    }
    return 0;
}

/* Prompt Cache's schemas; their definitions go beside the disk tier's records. */
static int start_schemas(server *s, const kv_config *c, const model *m, kv_error *err) {
    char *dir = cache_setup_schema_dir(c, m, s->store);
    int rc = schemas_start(s, dir, err);
    free(dir);
    return rc;
}

/* Approximate reuse's budget (--reuse-quality) over the model's calibration
 * (--reuse-calibration; auto: MODEL.kvquality.json beside the model, as `make calibrate-reuse`
 * writes it): what each method may do for requests that ask nothing, logged with the reason.
 * -1 with err on a budget that is not one, or a calibration named explicitly that cannot be
 * used; one found automatically that cannot is logged and passed over (exact reuse only). */
static int reuse_setup(const kv_config *c, const model *m, server_reuse *r, kv_error *err) {
    memset(r, 0, sizeof *r);
    if (quality_budget_parse(c->reuse_quality, &r->budget, err)) return -1;
    snprintf(r->budget_name, sizeof r->budget_name, "%s", c->reuse_quality);
    quality_table *t = calloc(1, sizeof *t);
    if (!t) return kv_fail(err, "out of memory");
    bool auto_path = strcmp(c->reuse_calibration, "auto") == 0;
    if (auto_path)
        snprintf(r->calibration, sizeof r->calibration, "%s.kvquality.json", c->model);
    else
        snprintf(r->calibration, sizeof r->calibration, "%s", c->reuse_calibration);
    bool found = !auto_path || access(r->calibration, F_OK) == 0;
    kv_error lerr = {{0}};
    if (found && r->budget.kind != QUALITY_BUDGET_NONE &&
        quality_table_load(t, r->calibration, m->identity, &lerr)) {
        if (!auto_path) {
            free(t);
            return kv_fail(err, "--reuse-calibration: %s", lerr.msg);
        }
        snprintf(r->calib_error, sizeof r->calib_error, "%s", lerr.msg);
        log_warn("reuse quality: calibration not used: %s", lerr.msg);
        found = false;
    }
    if (!found || r->budget.kind == QUALITY_BUDGET_NONE) r->calibration[0] = 0;
    const quality_table *use = r->calibration[0] ? t : NULL;
    quality_choose(&r->budget, use, &r->choice);
    quality_monitor_init(&r->monitor, &r->budget, use, &r->choice);
    quality_budget_describe(&r->budget, use, r->bounds, sizeof r->bounds);
    if (!r->choice.gated)
        log_info("reuse quality: none (no gate): blend, the fix-up and levels as configured");
    else if (!use)
        log_info("reuse quality: %s: no calibration of this model (%s): exact reuse only, "
                 "unless a request asks; calibrate it with `make calibrate-reuse "
                 "MODEL=%s`",
                 r->budget_name, r->calib_error[0] ? r->calib_error : "none found", c->model);
    else
        log_info("reuse quality: %s (%s, calibration %s over %d prompts): blend %s; fix-up %s; "
                 "levels %s",
                 r->budget_name, r->bounds, r->calibration, t->prompts,
                 r->choice.why[QUALITY_BLEND], r->choice.why[QUALITY_FIXUP],
                 r->choice.why[QUALITY_LEVEL]);
    free(t);
    return 0;
}

/* The codec table calibrated from text the model writes (cache_setup_codec's fallback). */
static int calibrate_at_start(const kv_config *c, codec_table *t, kv_error *err) {
    engine_model_opts mo = {.path = c->model, .threads = c->threads};
    calib_opts co = CALIB_DEFAULTS;
    return calibrate_codec_table(&mo, &co, t, NULL, err);
}

/* The draft model (--draft-model), mapped as the model is, into *out (NULL: none, or --spec off,
 * where it would never draft). Its vocabulary is checked against the model's by the engine. */
static int draft_load(const kv_config *c, model **out, kv_error *err) {
    *out = NULL;
    if (!c->draft_model) return 0;
    if (strcmp(c->spec, "off") == 0) {
        log_info("draft model %s not loaded: --spec off", c->draft_model);
        return 0;
    }
    model_load_opts lo = {0};
    if (!(*out = model_load(c->draft_model, &lo, err)))
        return kv_fail_wrap(err, "--draft-model %s", c->draft_model);
    log_info("draft model '%s' (%d layers, %.1f MiB mapped) from %s", (*out)->name,
             (*out)->hp.n_layer, model_weight_bytes(*out) / 1048576.0, c->draft_model);
    return 0;
}

/* Descriptors kept free of connections: the listener, the model, the disk tier's files,
 * io_uring, the ITC of each HTTP thread, logs; and per HTTP thread, room for the clients being
 * refused (accepted, then closed) when the limit is reached. */
#define FD_RESERVE 128
#define FD_REFUSING_PER_THREAD 64

/* Every connection is a descriptor: raises the soft limit to the hard one and caps
 * max_connections below it. */
static void fd_limit_raise(kv_config *c) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    rlim_t before = rl.rlim_cur;
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) rl.rlim_cur = before;
    }
    long long lim = rl.rlim_cur == RLIM_INFINITY ? LLONG_MAX : (long long)rl.rlim_cur;
    if (rl.rlim_cur != before)
        log_info("file descriptors: limit raised from %lld to the hard limit, %lld",
                 (long long)before, lim);
    else
        log_info("file descriptors: limit %lld (the hard limit)", lim);
    long long reserve = FD_RESERVE + (long long)FD_REFUSING_PER_THREAD * c->http_threads;
    if ((long long)c->max_connections + reserve > lim) {
        int cap = lim > 2 * reserve ? (int)(lim - reserve) : (int)(lim / 2);
        log_warn("--max-connections %d does not fit the file descriptor limit of %lld: %d",
                 c->max_connections, lim, cap);
        c->max_connections = cap;
    }
}

static const char *signal_name(int sig) { return sig == SIGINT ? "SIGINT" : "SIGTERM"; }

/* Waits up to timeout_s for the requests in flight to finish (true when they did). Another
 * SIGINT or SIGTERM meanwhile exits the process at once. */
static bool wait_in_flight(server *s, const sigset_t *sigs, double timeout_s) {
    uint64_t deadline = clock_now_ns() + (uint64_t)(timeout_s * 1e9);
    while (atomic_load(&s->http.in_flight) > 0) {
        if (clock_now_ns() >= deadline) return false;
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000000L};
        int sig = sigtimedwait(sigs, NULL, &ts);
        if (sig == SIGINT || sig == SIGTERM) {
            log_warn("%s again: exiting now, without draining", signal_name(sig));
            _exit(128 + sig);
        }
    }
    return true;
}

/* --drain-grace: waits seconds, taking requests as usual, while GET /health answers 503 and
 * the routers in front take the server out. Another SIGINT or SIGTERM exits at once. */
static void drain_grace(server *s, const sigset_t *sigs, int sig, int seconds) {
    atomic_store(&s->leaving, true);
    if (seconds <= 0) return;
    log_info("%s: /health answers 503; requests are still taken for %d s (--drain-grace) while "
             "routers take the server out",
             signal_name(sig), seconds);
    struct timespec ts = {.tv_sec = seconds, .tv_nsec = 0};
    int again = sigtimedwait(sigs, NULL, &ts);
    if (again == SIGINT || again == SIGTERM) {
        log_warn("%s again: exiting now, without draining", signal_name(again));
        _exit(128 + again);
    }
}

/* The first signal: after the grace, new requests get 503 while those running finish, up to the
 * timeout. */
static void drain(server *s, const sigset_t *sigs, int sig) {
    drain_grace(s, sigs, sig, s->cfg->drain_grace);
    atomic_store(&s->http.draining, true);
    int timeout = s->cfg->shutdown_timeout;
    log_info("%s: draining: %d requests in flight get up to %d s to finish (a second signal "
             "exits at once)",
             signal_name(sig), atomic_load(&s->http.in_flight), timeout);
    if (wait_in_flight(s, sigs, timeout))
        log_info("drained: no request in flight");
    else
        log_warn("shutdown timeout (%d s): ending the %d requests still running", timeout,
                 atomic_load(&s->http.in_flight));
}

/* Embedding pooling: the flag, else the GGUF's <arch>.pooling_type (llama.cpp's numbering:
 * 1 mean, 2 cls, 3 last), else mean. */
static gen_pooling embed_pooling(const char *flag, const model *m) {
    if (flag && !strcmp(flag, "mean")) return GEN_POOL_MEAN;
    if (flag && !strcmp(flag, "last")) return GEN_POOL_LAST;
    if (flag && !strcmp(flag, "cls")) return GEN_POOL_CLS;
    const char *arch = NULL;
    size_t len = 0;
    int64_t v = 0;
    char key[96];
    if (gguf_get_str(m->gguf, "general.architecture", &arch, &len, NULL) == 0) {
        snprintf(key, sizeof key, "%.*s.pooling_type", (int)(len < 64 ? len : 64), arch);
        if (gguf_get_i64(m->gguf, key, &v, NULL) == 0)
            return v == 2 ? GEN_POOL_CLS : v == 3 ? GEN_POOL_LAST : GEN_POOL_MEAN;
    }
    return GEN_POOL_MEAN;
}

/* ---------------------------------------------------------------- the server's life */

/* What serve sets up, in order, and tears down in reverse. */
typedef struct serve_state {
    kv_config cfg;
    kv_error err;
    sigset_t sigs; /* SIGINT and SIGTERM, taken by sigwait */
    server s;
    model *m, *draft;
    codec_table *codec; /* the Redis tier's, outlives the store */
    engine_opts eo;
} serve_state;

/* The configuration (defaults < file < env < flags) and the log level. -1 to go on, else the
 * exit status: 0 after --help, 2 after a bad configuration. */
static int serve_config(kv_config *cfg, int argc, char **argv, kv_error *err) {
    config_defaults(cfg);
    argv[0] = "kvserve serve"; /* the command name the usage text shows */
    config_status cs = config_load(cfg, argc, argv, environ, stdout, err);
    if (cs == CONFIG_HELP) {
        config_free(cfg);
        return 0;
    }
    if (cs != CONFIG_OK) {
        fprintf(stderr, "kvserve serve: %s\n", err->msg);
        config_free(cfg);
        return 2;
    }
    log_level lv = LOG_LEVEL_INFO;
    log_level_parse(cfg->log_level, &lv);
    log_set_level(lv);
    return -1;
}

/* Signals are taken by sigwait in this thread only: every thread started from here on inherits
 * the blocked mask. */
static void serve_signals_block(sigset_t *sigs) {
    sigemptyset(sigs);
    sigaddset(sigs, SIGINT);
    sigaddset(sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
}

/* The API keys' SHA-256 digests, which requests' keys are compared against. */
static int api_key_digests(const kv_config *c, http_transport *h, kv_error *err) {
    if (c->n_api_keys == 0) return 0;
    if (!(h->key_digests = calloc((size_t)c->n_api_keys, sizeof *h->key_digests)))
        return kv_fail(err, "out of memory");
    for (int i = 0; i < c->n_api_keys; i++)
        SHA256((const unsigned char *)c->api_keys[i], strlen(c->api_keys[i]), h->key_digests[i]);
    h->n_keys = c->n_api_keys;
    return 0;
}

/* Metrics, the model ids and the API keys, then the listener: GET /health answers 503
 * "loading" until the engine is ready. */
static int serve_listen(serve_state *st) {
    kv_config *cfg = &st->cfg;
    server *s = &st->s;
    if (!(s->mx = metrics_create())) return kv_fail(&st->err, "out of memory");
    if (model_ids_from(cfg, s, &st->err)) return -1;
    if (api_key_digests(cfg, &s->http, &st->err)) return -1;
    fd_limit_raise(cfg);
    s->http.app = s;
    s->http.cfg = cfg;
    s->http.mx = s->mx;
    s->http.n_routes = api_routes(cfg, s->http.routes, HTTP_MAX_ROUTES);
    if (http_start(&s->http, &st->err)) return -1;
    log_info("listening on http://%s:%d (loading %s); %d HTTP threads, up to %d connections, "
             "idle timeout %d s",
             cfg->host, cfg->port, cfg->model, cfg->http_threads, cfg->max_connections,
             cfg->idle_timeout);
    return 0;
}

/* The kernels, the model and its draft; the context and the max_tokens limit they allow. */
static int serve_models_load(serve_state *st) {
    const kv_config *cfg = &st->cfg;
    server *s = &st->s;
    if (engine_simd_apply(cfg->simd, &st->err) != 0) return -1;
    model_load_opts lo = {.chat_template = cfg->chat_template};
    if (!(st->m = model_load(cfg->model, &lo, &st->err))) return -1;
    if (draft_load(cfg, &st->draft, &st->err)) return -1;
    const model *m = st->m;
    s->ctx = cfg->ctx_size ? cfg->ctx_size : m->hp.n_ctx_train;
    if (s->ctx > m->hp.n_ctx_train)
        log_warn("ctx_size %d is beyond the model's training context of %d tokens", s->ctx,
                 m->hp.n_ctx_train);
    s->max_tokens_limit = cfg->max_tokens_limit ? cfg->max_tokens_limit : s->ctx;
    return 0;
}

/* The engine's options from the configuration, then from the reuse budget (reuse_setup), which
 * sets the blend for requests that ask nothing and bars the levels it does not allow. */
static int serve_engine_opts(serve_state *st) {
    const kv_config *cfg = &st->cfg;
    server *s = &st->s;
    engine_opts *eo = &st->eo;
    *eo = (engine_opts){
        .device = cfg->device,
        .threads = cfg->threads,
        .precise = cfg->precise,
        .no_cuda_graphs = !cfg->cuda_graphs,
        .ctx = s->ctx,
        .kv_pool_tokens = cfg->kv_pool_tokens ? cfg->kv_pool_tokens : 4 * (int64_t)s->ctx,
        .max_seqs = cfg->max_seqs,
        .max_queue = cfg->max_queue,
        .n_tenants = cfg->n_api_keys,
        .tenant_queue_share = cfg->tenant_queue_share,
        .prefill_chunk = cfg->prefill_chunk,
        .spec = strcmp(cfg->spec, "off") != 0,
        .draft = st->draft,
        .chunk_tokens = cfg->cache ? cfg->cache_chunk_tokens : 0,
        .pool_cache = true,
        .prefetch_bytes = cfg->cache_ram_bytes > 0 ? cfg->cache_ram_bytes : 0,
        .blend_bytes = !cfg->cache || !cfg->blend ? 0
                       : cfg->blend_ram_bytes     ? cfg->blend_ram_bytes
                                                  : cfg->cache_ram_bytes / 4,
        .blend_ratio = (float)cfg->blend_recompute / 100.0f,
        .blend_policy = (blend_policy)blend_policy_parse(cfg->blend_policy),
        .blend_chunk = cfg->blend_chunk,
        .ttft_budget_ms = cfg->ttft_budget_ms,
        .quality_sample = cfg->quality_sample / 100.0,
        .blend_repair = cfg->blend_repair,
    };
    if (eo->kv_pool_tokens < s->ctx)
        return kv_fail(&st->err,
                       "kv_pool_tokens (%lld) must hold at least one context (ctx_size %d)",
                       (long long)eo->kv_pool_tokens, s->ctx);
    if (reuse_setup(cfg, st->m, &s->reuse, &st->err)) return -1;
    eo->monitor = s->reuse.monitor;
    if (s->reuse.choice.blend) {
        /* the budget's setting for requests that ask nothing: the loading controller's floor */
        eo->blend_ratio = s->reuse.choice.blend_ratio;
        eo->blend_policy = s->reuse.choice.blend_policy;
    }
    if (s->reuse.choice.gated)
        for (int e = CACHE_ENC_Q8; e < CACHE_ENC_MAX; e++)
            if (!(s->reuse.choice.levels & (1u << e))) eo->levels_barred |= 1u << e;
    return 0;
}

/* The cache's tiers (--cache): the codec table, the store, and the blend's disk tier. */
static int serve_cache_tiers(serve_state *st) {
    const kv_config *cfg = &st->cfg;
    server *s = &st->s;
    if (cfg->cache && cache_setup_codec(cfg, st->m, calibrate_at_start, &st->codec, &st->err))
        return -1;
    if (cfg->cache && !(s->store = cache_setup_store(cfg, st->m, st->codec, &st->err))) return -1;
    st->eo.store = s->store;
    if (st->eo.blend_bytes > 0 && cache_setup_blend_disk(cfg, st->m, &s->blend_disk, &st->err))
        return -1;
    st->eo.blend_disk = s->blend_disk;
    return 0;
}

/* The engine, the grammar vocabulary and embedding pooling over the model. */
static int serve_engine_start(serve_state *st) {
    server *s = &st->s;
    if (!(s->eng = engine_create(st->m, &st->eo, s->mx, &st->err))) return -1;
    if (!(s->gvocab = grammar_vocab_create(st->m->tok, &st->err))) return -1;
    s->pooling = embed_pooling(st->cfg.pooling, st->m);
    s->m = st->m;
    return 0;
}

/* With --redis: what clients leave on this instance (stored responses, schemas, pins, leases)
 * shared with the others through Redis, bounded as README's "Redis tier" says: each kind's
 * items live --redis-ttl seconds (30 days with --redis-ttl 0; pins and leases: their own
 * expiry), a namespace keeps as many as one instance does (--responses-store, --schema-max;
 * 4096 pins and as many leases), a value at most what one instance takes (--responses-store-bytes
 * and --max-body-bytes, at most 512 MiB; 1 KiB for a pin or a lease). */
static int serve_shared_start(serve_state *st) {
    const kv_config *cfg = &st->cfg;
    if (!cfg->redis) return 0;
    int64_t ttl = cfg->redis_ttl > 0 ? cfg->redis_ttl : INT64_C(30) * 86400;
    int64_t cap = INT64_C(512) << 20;
    redis_state_bounds b[REDIS_STATE_KINDS] = {
        [REDIS_STATE_RESPONSE] = {ttl, cfg->responses_store > 0 ? cfg->responses_store : 1,
                                  (size_t)(cfg->responses_store_bytes < cap
                                               ? cfg->responses_store_bytes
                                               : cap)},
        [REDIS_STATE_SCHEMA] = {ttl, cfg->schema_max,
                                (size_t)(cfg->max_body_bytes < cap ? cfg->max_body_bytes : cap)},
        [REDIS_STATE_PIN] = {ttl, 4096, 1024},
        [REDIS_STATE_LEASE] = {ttl, 4096, 1024}};
    st->s.shared = redis_state_open(cfg->redis, cfg->redis_timeout_ms, b, &st->err);
    return st->s.shared ? 0 : -1;
}

/* The registries requests refer to: Prompt Cache's schemas (with a store) and the Responses
 * API's stored responses (--responses-store). */
static int serve_registries_start(serve_state *st) {
    const kv_config *cfg = &st->cfg;
    server *s = &st->s;
    if (serve_shared_start(st)) return -1;
    if (s->store && start_schemas(s, cfg, st->m, &st->err)) return -1;
    if (cfg->responses_store > 0 &&
        !(s->responses = resp_store_create(cfg->responses_store, cfg->responses_store_bytes,
                                           cfg->n_api_keys, cfg->tenant_store_share)))
        return kv_fail(&st->err, "out of memory");
    return 0;
}

/* Opens the doors (GET /health answers 200) and says what serves. */
static void serve_ready(serve_state *st) {
    const kv_config *cfg = &st->cfg;
    server *s = &st->s;
    const model *m = st->m;
    /* Routes that tokenize on an HTTP thread: at once, as many bodies of the most text a prompt
     * can have as leave one thread free for the others' streams (over it, a 429). */
    int work_threads = cfg->http_threads > 1 ? cfg->http_threads - 1 : 1;
    s->http.work_budget = (int64_t)work_threads * (int64_t)server_text_limit(s);
    atomic_store(&s->http.ready, true);
    int64_t pool = engine_kv_pool_tokens(s->eng);
    log_info("ready: model '%s' (%s, %d layers, %.1f MiB mapped), backend %s with %d threads "
             "(SIMD %s, %s matmuls), context %d, KV pool %lld tokens (%.1f MiB), up to %d "
             "sequences; API keys %s; serving http://%s:%d/v1",
             s->model_ids[0], m->name, m->hp.n_layer, model_weight_bytes(m) / 1048576.0,
             engine_backend_name(s->eng), engine_threads(s->eng), simd_level_name(simd_level_get()),
             cfg->precise ? "f32" : "8-bit activation", s->ctx, (long long)pool,
             (double)pool * (double)model_kv_bytes_per_token(m) / 1048576.0, cfg->max_seqs,
             s->http.n_keys ? "required" : "off", cfg->host, cfg->port);
}

/* Stops and frees whatever serve set up, the last first; rc is what serve returns (nonzero: the
 * error is logged first). */
static void serve_teardown(serve_state *st, int rc) {
    server *s = &st->s;
    if (rc) log_error("%s", st->err.msg);
    atomic_store(&s->http.draining, true);
    atomic_store(&s->http.stopping, true);
    if (s->eng) {
        /* Ends what still runs: each request's connection is woken and writes its error (a
         * stream: an error event and [DONE]) before the connections are closed. */
        engine_stop(s->eng);
        wait_in_flight(s, &st->sigs, 2.0);
    }
    http_stop(&s->http);
    schemas_stop(s);
    resp_store_destroy(s->responses);
    redis_state_close(s->shared);
    engine_destroy(s->eng);
    grammar_vocab_destroy(s->gvocab);
    if (s->store) {
        cache_store_close(s->store);
        log_info("cache: queued writes flushed");
    }
    content_disk_close(s->blend_disk);
    if (st->codec) {
        codec_table_free(st->codec);
        free(st->codec);
    }
    model_free(st->draft);
    model_free(st->m);
    metrics_destroy(s->mx);
    free(s->http.key_digests);
    for (int i = 0; i < s->n_model_ids; i++) free(s->model_ids[i]);
    free(s->model_ids);
    config_free(&st->cfg);
    if (rc == 0) log_info("stopped");
}

int cli_serve(int argc, char **argv) {
    serve_state st;
    memset(&st, 0, sizeof st);
    int rc = serve_config(&st.cfg, argc, argv, &st.err);
    if (rc >= 0) return rc;
    serve_signals_block(&st.sigs);

    rc = 1;
    st.s.cfg = &st.cfg;
    st.s.started = (long)time(NULL);
    if (serve_listen(&st)) goto done;
    if (serve_models_load(&st)) goto done;
    if (serve_engine_opts(&st)) goto done;
    if (serve_cache_tiers(&st)) goto done;
    if (serve_engine_start(&st)) goto done;
    if (serve_registries_start(&st)) goto done;
    serve_ready(&st);

    int sig = 0;
    sigwait(&st.sigs, &sig);
    drain(&st.s, &st.sigs, sig);
    rc = 0;
done:
    serve_teardown(&st, rc);
    return rc;
}
