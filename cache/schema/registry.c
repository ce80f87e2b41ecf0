/* The schema registry (cache/schema/schema.h, "the registry"): the schemas registered per
 * namespace, their definitions kept in a directory (loaded at start and whenever a prompt names
 * one not registered here), and the builder thread that precomputes each module's KV and pins
 * its records. The model runs above cache/, so the builder hands each module's job to the
 * compute callback its creator gives (the server's engine). Used through schema.h by the
 * server's /v1/schemas and schema prompts. */
#include "cache/schema/schema.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/store/redis_state.h"

typedef struct entry {
    schema *sc; /* one reference */
    schema_status status;
    char error[400];
    int64_t done_tokens;
    long created;
    bool building; /* the builder works on it */
    bool deleted;  /* out of the registry; freed once the builder lets go */
    struct entry *next;
} entry;

struct schema_registry {
    schema_registry_opts o; /* o.dir is not kept: dir is */
    schema_chat chat;
    char *dir; /* definitions, or NULL */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    entry *list;
    int n;
    bool stop;
    pthread_t thread;
    bool started;
};

/* The node the builder hands the compute callback: asked whether it is still wanted. */
struct schema_build {
    schema_registry *g;
    const entry *e;
};

static void entry_free(entry *e) {
    if (!e) return;
    schema_unref(e->sc);
    free(e);
}

/* The live entry of (ns, name), under mu. */
static entry *find_locked(schema_registry *g, const cache_key *ns, const char *name) {
    for (entry *e = g->list; e; e = e->next)
        if (!e->deleted && strcmp(e->sc->name, name) == 0 &&
            memcmp(e->sc->ns.b, ns->b, CACHE_KEY_BYTES) == 0)
            return e;
    return NULL;
}

/* e as it is now, with a schema reference. Under mu. */
static void info_locked(const entry *e, schema_info *out) {
    schema_ref(e->sc);
    out->sc = e->sc;
    out->status = e->status;
    snprintf(out->error, sizeof out->error, "%s", e->error);
    out->done_tokens = e->done_tokens;
    out->created = e->created;
}

void schema_info_free(schema_info *in) {
    schema_unref(in->sc);
    in->sc = NULL;
}

/* ---------------------------------------------------------------- pins */

/* Every record key of sc. *n gets the count; malloc'd. */
static cache_key *record_keys(const schema *sc, int *n) {
    int cb = sc->chunk_tokens / sc->block_tokens, total = 0;
    for (int i = 0; i < sc->n_nodes; i++) total += (sc->nodes[i].n_blocks + cb - 1) / cb;
    cache_key *k = malloc(sizeof *k * (size_t)(total + 1));
    *n = 0;
    if (!k) return NULL;
    for (int i = 0; i < sc->n_nodes; i++) *n += schema_node_records(sc, i, k + *n, total - *n);
    return k;
}

/* Unpins e's records that no other live schema holds (a pin is a flag, not a count). Under mu. */
static void unpin_locked(schema_registry *g, const entry *e) {
    cache_store *st = g->o.store;
    int n = 0;
    cache_key *keys = record_keys(e->sc, &n);
    if (!keys) return;
    int kept = 0;
    for (int i = 0; i < n; i++) {
        bool shared = false;
        for (entry *o = g->list; o && !shared; o = o->next) {
            if (o == e || o->deleted) continue;
            int m = 0;
            cache_key *ok = record_keys(o->sc, &m);
            for (int j = 0; ok && j < m && !shared; j++)
                shared = memcmp(ok[j].b, keys[i].b, CACHE_KEY_BYTES) == 0;
            free(ok);
        }
        if (!shared) keys[kept++] = keys[i];
    }
    if (kept > 0) cache_store_pin(st, CACHE_TENANT_NONE, keys, kept, false);
    free(keys);
}

/* Takes e out of the registry and unpins its records; it is freed here unless the builder holds
 * it (the builder frees it then). Under mu. */
static void remove_locked(schema_registry *g, entry *e) {
    e->deleted = true;
    unpin_locked(g, e);
    for (entry **p = &g->list; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    g->n--;
    if (!e->building) entry_free(e);
}

/* ---------------------------------------------------------------- the builder */

static void set_status(schema_registry *g, entry *e, schema_status st, const char *msg) {
    pthread_mutex_lock(&g->mu);
    e->status = st;
    if (msg) snprintf(e->error, sizeof e->error, "%.380s", msg);
    pthread_mutex_unlock(&g->mu);
    if (st == SCHEMA_READY)
        log_info("schemas: '%s' is ready (%lld tokens in %d nodes)", e->sc->name,
                 (long long)e->sc->own_tokens, e->sc->n_nodes);
    else if (st == SCHEMA_FAILED)
        log_warn("schemas: '%s' failed: %s", e->sc->name, msg ? msg : "");
}

static bool abandoned(schema_registry *g, const entry *e) {
    pthread_mutex_lock(&g->mu);
    bool gone = g->stop || e->deleted;
    pthread_mutex_unlock(&g->mu);
    return gone;
}

bool schema_build_abandoned(const schema_build *b) { return abandoned(b->g, b->e); }

/* Precomputes node i of e's schema through the compute callback. 0, or -1 with msg. */
static int build_node(schema_registry *g, entry *e, int i, char *msg, size_t cap) {
    schema_job jb;
    kv_error err = {{0}};
    if (schema_node_job(e->sc, i, g->o.store, &jb, &err)) {
        snprintf(msg, cap, "%.300s", err.msg);
        return -1;
    }
    const schema_build b = {g, e};
    return g->o.compute(g->o.compute_ud, &jb, &b, msg, cap);
}

/* Pins node i's records, stored by the engine just now (fresh: they are in RAM, and -1 with msg
 * says they did not fit there) or before (a restart, another schema with the same text: they
 * may be on disk only, which keeps them pinned too). Under mu and only while e is live: a DELETE
 * unpins under mu, so a node that was in the engine when it came leaves nothing pinned. */
static int pin_node(schema_registry *g, entry *e, int i, bool fresh, char *msg, size_t cap) {
    const schema *sc = e->sc;
    int cb = sc->chunk_tokens / sc->block_tokens, max = (sc->nodes[i].n_blocks + cb - 1) / cb;
    cache_key *keys = malloc(sizeof *keys * (size_t)max);
    if (!keys) {
        snprintf(msg, cap, "out of memory");
        return -1;
    }
    int n = schema_node_records(sc, i, keys, max);
    pthread_mutex_lock(&g->mu);
    int pinned =
        g->stop || e->deleted ? n : cache_store_pin(g->o.store, CACHE_TENANT_NONE, keys, n, true);
    pthread_mutex_unlock(&g->mu);
    free(keys);
    if (fresh && pinned < n) {
        snprintf(msg, cap,
                 "%d of %d records could not be kept (pinned records may fill half of the "
                 "cache's RAM tier: raise --cache-ram-bytes)",
                 n - pinned, n);
        return -1;
    }
    return 0;
}

static void build(schema_registry *g, entry *e) {
    schema *sc = e->sc;
    cache_store *st = g->o.store;
    char msg[512];
    uint64_t t0 = clock_now_ns();
    int64_t computed = 0;
    for (int i = 0; i < sc->n_nodes; i++) {
        if (abandoned(g, e)) return;
        const schema_node *nd = &sc->nodes[i];
        if (nd->n_tok == 0) continue;
        bool held = true;
        for (int b = 0; b < nd->n_blocks && held; b++) held = cache_store_holds(st, &nd->bkeys[b]);
        if (!held) {
            if (build_node(g, e, i, msg, sizeof msg)) goto failed;
            computed += nd->n_tok;
        }
        if (pin_node(g, e, i, !held, msg, sizeof msg)) goto failed;
        pthread_mutex_lock(&g->mu);
        e->done_tokens += nd->n_tok;
        pthread_mutex_unlock(&g->mu);
    }
    log_info("schemas: '%s': %lld tokens precomputed in %.2f s", sc->name, (long long)computed,
             (double)(clock_now_ns() - t0) / 1e9);
    set_status(g, e, SCHEMA_READY, NULL);
    return;
failed:
    if (!abandoned(g, e)) set_status(g, e, SCHEMA_FAILED, msg);
}

static void *builder_main(void *arg) {
    schema_registry *g = arg;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        entry *e = NULL;
        while (!g->stop) {
            for (e = g->list; e; e = e->next)
                if (!e->deleted && e->status == SCHEMA_BUILDING) break;
            if (e) break;
            pthread_cond_wait(&g->cv, &g->mu);
        }
        if (g->stop) break;
        e->building = true;
        pthread_mutex_unlock(&g->mu);
        build(g, e);
        pthread_mutex_lock(&g->mu);
        e->building = false;
        if (e->deleted) {
            /* deleted while it was built: out of the list already */
            entry_free(e);
        }
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* ---------------------------------------------------------------- registration */

/* Compiles src as a schema of namespace ns. NULL with err. */
static schema *compile(schema_registry *g, const cache_key *ns, const char *src, size_t len,
                       kv_error *err) {
    pml_doc *doc = pml_parse(src, len, NULL, err);
    if (!doc) return NULL;
    const schema_opts o = {.m = g->o.m,
                           .chat = &g->chat,
                           .block_tokens = 16,
                           .chunk_tokens = g->o.chunk_tokens,
                           .max_positions = g->o.max_positions,
                           .max_modules = 4096};
    schema *sc = schema_compile(doc, src, len, ns, &o, err);
    pml_free(doc);
    return sc;
}

/* Adds sc (taking its reference) as a new entry, replacing a live one of its name. Under mu. */
static entry *add_locked(schema_registry *g, schema *sc) {
    entry *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->sc = sc;
    e->created = (long)time(NULL);
    entry *old = find_locked(g, &sc->ns, sc->name);
    e->next = g->list;
    g->list = e;
    g->n++;
    if (old) remove_locked(g, old);
    pthread_cond_broadcast(&g->cv);
    return e;
}

static void load_one(void *ud, const cache_key *ns, const char *name, const char *src, size_t len) {
    schema_registry *g = ud;
    kv_error err = {{0}};
    schema *sc = compile(g, ns, src, len, &err);
    if (!sc) {
        log_warn("schemas: the stored schema '%s' no longer compiles: %s", name, err.msg);
        return;
    }
    pthread_mutex_lock(&g->mu);
    if (!add_locked(g, sc)) schema_unref(sc);
    pthread_mutex_unlock(&g->mu);
}

schema_registry *schema_registry_create(const schema_registry_opts *o, kv_error *err) {
    schema_registry *g = calloc(1, sizeof *g);
    if (!g) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    g->o = *o;
    g->o.dir = NULL;
    schema_chat_init(&g->chat, o->m);
    if (!g->chat.ok) log_info("schemas: no role tags: %s", g->chat.why);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    if (o->dir && !(g->dir = strdup(o->dir))) {
        free(g);
        kv_fail(err, "out of memory");
        return NULL;
    }
    if (g->dir) schema_def_load_all(g->dir, load_one, g);
    if (g->n > 0) log_info("schemas: %d stored schemas loaded from %s", g->n, g->dir);
    int rc = pthread_create(&g->thread, NULL, builder_main, g);
    if (rc) {
        free(g->dir);
        free(g);
        kv_fail(err, "cannot start the schema builder: %s", strerror(rc));
        return NULL;
    }
    g->started = true;
    return g;
}

void schema_registry_destroy(schema_registry *g) {
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    g->stop = true;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    if (g->started) pthread_join(g->thread, NULL);
    for (entry *e = g->list, *n; e; e = n) {
        n = e->next;
        entry_free(e);
    }
    schema_chat_free(&g->chat);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g->dir);
    free(g);
}

const schema_chat *schema_registry_chat(const schema_registry *g) { return &g->chat; }

schema_add_result schema_registry_add(schema_registry *g, const cache_key *ns, const char *src,
                                      size_t len, schema_info *out, kv_error *err) {
    memset(out, 0, sizeof *out);
    schema *sc = compile(g, ns, src, len, err);
    if (!sc) return SCHEMA_ADD_INVALID;
    pthread_mutex_lock(&g->mu);
    entry *old = find_locked(g, ns, sc->name);
    if (old && old->sc->source_len == sc->source_len &&
        memcmp(old->sc->source, sc->source, sc->source_len) == 0) {
        /* the same schema again: nothing to do here (Redis may have lost or deleted it) */
        info_locked(old, out);
        pthread_mutex_unlock(&g->mu);
        if (g->o.shared)
            redis_state_put(g->o.shared, REDIS_STATE_SCHEMA, ns, sc->name, src, len, 0);
        schema_unref(sc);
        return SCHEMA_ADD_SAME;
    }
    if (!old && g->n >= g->o.max_schemas) {
        int n = g->n;
        pthread_mutex_unlock(&g->mu);
        schema_unref(sc);
        kv_fail(err,
                "%d schemas are registered, the most this server keeps (--schema-max); delete "
                "one first",
                n);
        return SCHEMA_ADD_FULL;
    }
    kv_error ke = {{0}};
    if (g->dir && schema_def_save(g->dir, ns, sc->name, sc->source, sc->source_len, &ke))
        log_warn("schemas: '%s' will not survive a restart: %s", sc->name, ke.msg);
    entry *e = add_locked(g, sc);
    if (!e) {
        pthread_mutex_unlock(&g->mu);
        schema_unref(sc);
        kv_fail(err, "out of memory");
        return SCHEMA_ADD_NOMEM;
    }
    info_locked(e, out);
    pthread_mutex_unlock(&g->mu);
    if (g->o.shared &&
        redis_state_put(g->o.shared, REDIS_STATE_SCHEMA, ns, out->sc->name, src, len, 0) != 0)
        log_warn("schemas: '%s' is not shared with other instances (Redis unreachable, or "
                 "over its bounds)",
                 out->sc->name);
    log_info("schemas: '%s' registered: %d modules, %d positions, %lld tokens to precompute",
             sc->name, sc->n_nodes - 1, (int)sc->extent, (long long)sc->own_tokens);
    return SCHEMA_ADD_NEW;
}

/* ---------------------------------------------------------------- lookups */

/* This instance's schemas of ns. */
static int list_local(schema_registry *g, const cache_key *ns, schema_info **out, int *n) {
    *out = NULL;
    *n = 0;
    pthread_mutex_lock(&g->mu);
    schema_info *v = calloc((size_t)g->n + 1, sizeof *v);
    if (!v) {
        pthread_mutex_unlock(&g->mu);
        return -1;
    }
    for (entry *e = g->list; e; e = e->next)
        if (!e->deleted && memcmp(e->sc->ns.b, ns->b, CACHE_KEY_BYTES) == 0)
            info_locked(e, &v[(*n)++]);
    pthread_mutex_unlock(&g->mu);
    *out = v;
    return 0;
}

/* ---------------------------------------------------------------- shared through Redis */

/* Whether the entry (ns, name) here is still wanted: false (and it is removed here) when Redis
 * holds its tombstone, deleted on another instance. */
static bool shared_keep(schema_registry *g, const cache_key *ns, const char *name) {
    if (!g->o.shared || redis_state_deleted(g->o.shared, REDIS_STATE_SCHEMA, ns, name) != 1)
        return true;
    pthread_mutex_lock(&g->mu);
    entry *e = find_locked(g, ns, name);
    if (e) remove_locked(g, e);
    if (e && g->dir) schema_def_delete(g->dir, ns, name);
    pthread_mutex_unlock(&g->mu);
    if (e) log_info("schemas: '%s' was deleted on another instance", name);
    return false;
}

/* Registers here namespace ns's schemas that Redis holds and this instance does not (or holds
 * in an older version: one registered here after Redis's was stored, while Redis was away, is
 * kept), and drops those deleted elsewhere. */
static void shared_sync(schema_registry *g, const cache_key *ns) {
    redis_state_item *items = NULL;
    int n = 0;
    if (!g->o.shared || redis_state_list(g->o.shared, REDIS_STATE_SCHEMA, ns, &items, &n)) return;
    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&g->mu);
        const entry *e = find_locked(g, ns, items[i].name);
        bool keep = e && ((e->sc->source_len == items[i].len &&
                           memcmp(e->sc->source, items[i].value, items[i].len) == 0) ||
                          e->created > items[i].stored);
        pthread_mutex_unlock(&g->mu);
        if (!keep) load_one(g, ns, items[i].name, items[i].value, items[i].len);
    }
    redis_state_items_free(items, n);
    /* the ones here that Redis no longer lists: deleted elsewhere, or expired or lost there */
    schema_info *v = NULL;
    int m = 0;
    if (list_local(g, ns, &v, &m)) return;
    for (int i = 0; i < m; i++) shared_keep(g, ns, v[i].sc->name);
    schema_info_list_free(v, m);
}

int schema_registry_list(schema_registry *g, const cache_key *ns, schema_info **out, int *n) {
    shared_sync(g, ns);
    return list_local(g, ns, out, n);
}

void schema_info_list_free(schema_info *v, int n) {
    for (int i = 0; i < n; i++) schema_info_free(&v[i]);
    free(v);
}

/* The live entry of (ns, name) into out, under mu. False when there is none. */
static bool get_locked(schema_registry *g, const cache_key *ns, const char *name,
                       schema_info *out) {
    pthread_mutex_lock(&g->mu);
    entry *e = find_locked(g, ns, name);
    if (e) info_locked(e, out);
    pthread_mutex_unlock(&g->mu);
    return e != NULL;
}

bool schema_registry_get(schema_registry *g, const cache_key *ns, const char *name,
                         schema_info *out) {
    memset(out, 0, sizeof *out);
    if (get_locked(g, ns, name, out)) {
        if (shared_keep(g, ns, name)) return true;
        schema_info_free(out);
        return false;
    }
    if (!pml_name_ok(name)) return false;
    size_t len = 0;
    char *src = g->dir ? schema_def_load(g->dir, ns, name, &len) : NULL;
    if (!src && g->o.shared &&
        redis_state_get(g->o.shared, REDIS_STATE_SCHEMA, ns, name, &src, &len) != 1)
        src = NULL;
    if (src) load_one(g, ns, name, src, len);
    free(src);
    return get_locked(g, ns, name, out);
}

bool schema_registry_delete(schema_registry *g, const cache_key *ns, const char *name) {
    pthread_mutex_lock(&g->mu);
    entry *e = find_locked(g, ns, name);
    bool found = e != NULL;
    if (found) {
        remove_locked(g, e);
        if (g->dir) schema_def_delete(g->dir, ns, name);
    }
    pthread_mutex_unlock(&g->mu);
    if (g->o.shared && redis_state_delete(g->o.shared, REDIS_STATE_SCHEMA, ns, name) == 1)
        found = true;
    if (found) log_info("schemas: '%s' deleted", name);
    return found;
}

void schema_registry_rebuild(schema_registry *g, const schema *sc) {
    log_warn("schemas: '%s': module KV missing; computing the prompt in full and "
             "precomputing the schema again",
             sc->name);
    pthread_mutex_lock(&g->mu);
    entry *e = find_locked(g, &sc->ns, sc->name);
    if (e && e->sc == sc && e->status == SCHEMA_READY) {
        e->status = SCHEMA_BUILDING;
        e->done_tokens = 0;
        pthread_cond_broadcast(&g->cv);
    }
    pthread_mutex_unlock(&g->mu);
}
