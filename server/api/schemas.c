/* Prompt Cache's HTTP surface (cache/schema/schema.h): POST /v1/schemas registers a schema, GET
 * /v1/schemas lists them, GET and DELETE /v1/schemas/{name}; a builder thread precomputes each
 * module's KV through the engine in the background (a prompt-only request per module whose
 * records are not yet stored), and completions and chat turn a "schema_prompt" into a prompt
 * whose first slots come from those records.
 *
 * Schemas live in the caller's cache namespace (API key and cache_salt), like the rest of the
 * cache. Their definitions are kept beside the disk tier (schemas/ in the model's cache
 * directory), so after a restart, or in another instance sharing the directory, a schema comes
 * back with its records and is ready without computing anything. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "server/api/handlers.h"
#include "server/api/openai_job.h"

typedef enum entry_status {
    ENTRY_BUILDING = 0,
    ENTRY_READY,
    ENTRY_FAILED,
} entry_status;

typedef struct entry {
    schema *sc; /* one reference */
    entry_status status;
    char error[400];
    int64_t done_tokens;
    long created;
    bool building; /* the builder works on it */
    bool deleted;  /* out of the registry; freed once the builder lets go */
    struct entry *next;
} entry;

struct schema_registry {
    server *s;
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

static const char *status_name(entry_status st) {
    return st == ENTRY_READY ? "ready" : st == ENTRY_FAILED ? "failed" : "building";
}

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
    cache_store *st = g->s->store;
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
    if (kept > 0) cache_store_pin(st, keys, kept, false);
    free(keys);
}

/* ---------------------------------------------------------------- the builder */

static void set_status(schema_registry *g, entry *e, entry_status st, const char *msg) {
    pthread_mutex_lock(&g->mu);
    e->status = st;
    if (msg) snprintf(e->error, sizeof e->error, "%.380s", msg);
    pthread_mutex_unlock(&g->mu);
    if (st == ENTRY_READY)
        log_info("schemas: '%s' is ready (%lld tokens in %d nodes)", e->sc->name,
                 (long long)e->sc->own_tokens, e->sc->n_nodes);
    else if (st == ENTRY_FAILED)
        log_warn("schemas: '%s' failed: %s", e->sc->name, msg ? msg : "");
}

static bool abandoned(schema_registry *g, const entry *e) {
    pthread_mutex_lock(&g->mu);
    bool gone = g->stop || e->deleted;
    pthread_mutex_unlock(&g->mu);
    return gone;
}

/* Precomputes node i of e's schema through the engine. 0, or -1 with msg. */
static int build_node(schema_registry *g, entry *e, int i, char *msg, size_t cap) {
    server *s = g->s;
    schema_job jb;
    kv_error err = {{0}};
    if (schema_node_job(e->sc, i, s->store, &jb, &err)) {
        snprintf(msg, cap, "%.300s", err.msg);
        return -1;
    }
    gen_request *r = gen_request_create(1);
    if (!r) {
        schema_job_free(&jb);
        snprintf(msg, cap, "out of memory");
        return -1;
    }
    r->prompt = jb.tokens;
    r->pos = jb.pos;
    r->skv = jb.kv;
    r->n_prompt = jb.n;
    r->max_tokens = 0;
    r->t_arrival = clock_now_ns();
    jb = (schema_job){0};
    int rc = 0;
    for (;;) {
        engine_submit_status st = engine_submit(s->eng, r, &err);
        if (st == ENGINE_SUBMIT_OK) break;
        if (st != ENGINE_SUBMIT_QUEUE_FULL || abandoned(g, e)) {
            snprintf(msg, cap, "%.300s", err.msg);
            gen_request_unref(r);
            return -1;
        }
        usleep(50 * 1000); /* the queue is full: precomputing waits behind the requests */
    }
    pthread_mutex_lock(&r->mu);
    while (r->n_finished < 1) {
        gen_request_wait(r, 100);
        if (r->n_finished < 1 && abandoned(g, e)) {
            atomic_store(&r->cancelled, true);
            rc = -1;
            snprintf(msg, cap, "stopped");
            break;
        }
    }
    if (rc == 0 && (r->error_status || r->export_failed)) {
        rc = -1;
        snprintf(msg, cap, "%s", r->error[0] ? r->error : "the engine failed");
    }
    pthread_mutex_unlock(&r->mu);
    gen_request_unref(r);
    return rc;
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
    int pinned = g->stop || e->deleted ? n : cache_store_pin(g->s->store, keys, n, true);
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
    cache_store *st = g->s->store;
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
    set_status(g, e, ENTRY_READY, NULL);
    return;
failed:
    if (!abandoned(g, e)) set_status(g, e, ENTRY_FAILED, msg);
}

static void *builder_main(void *arg) {
    schema_registry *g = arg;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        entry *e = NULL;
        while (!g->stop) {
            for (e = g->list; e; e = e->next)
                if (!e->deleted && e->status == ENTRY_BUILDING) break;
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

static void schema_opts_for(const server *s, const schema_registry *g, schema_opts *o) {
    *o = (schema_opts){.m = s->m,
                       .chat = &g->chat,
                       .block_tokens = 16,
                       .chunk_tokens = s->cfg->cache_chunk_tokens,
                       .max_positions = s->ctx - 1,
                       .max_modules = 4096};
}

/* Compiles src as a schema of namespace ns. NULL with err. */
static schema *compile(schema_registry *g, const cache_key *ns, const char *src, size_t len,
                       kv_error *err) {
    pml_doc *doc = pml_parse(src, len, NULL, err);
    if (!doc) return NULL;
    schema_opts o;
    schema_opts_for(g->s, g, &o);
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
    if (old) {
        old->deleted = true;
        unpin_locked(g, old);
        for (entry **p = &g->list; *p; p = &(*p)->next)
            if (*p == old) {
                *p = old->next;
                break;
            }
        g->n--;
        if (!old->building) entry_free(old);
    }
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

int schemas_start(server *s, const char *dir, kv_error *err) {
    schema_registry *g = calloc(1, sizeof *g);
    if (!g) return kv_fail(err, "out of memory");
    g->s = s;
    schema_chat_init(&g->chat, s->m);
    if (!g->chat.ok) log_info("schemas: no role tags: %s", g->chat.why);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    if (dir && !(g->dir = strdup(dir))) {
        free(g);
        return kv_fail(err, "out of memory");
    }
    if (g->dir) schema_def_load_all(g->dir, load_one, g);
    if (g->n > 0) log_info("schemas: %d stored schemas loaded from %s", g->n, g->dir);
    int rc = pthread_create(&g->thread, NULL, builder_main, g);
    if (rc) {
        free(g->dir);
        free(g);
        return kv_fail(err, "cannot start the schema builder: %s", strerror(rc));
    }
    g->started = true;
    s->schemas = g;
    return 0;
}

void schemas_stop(server *s) {
    schema_registry *g = s->schemas;
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
    s->schemas = NULL;
}

/* ---------------------------------------------------------------- JSON */

static json_t *entry_json(const schema_registry *g, const entry *e) {
    const schema *sc = e->sc;
    json_t *mods = json_array();
    for (int i = 1; i < sc->n_nodes; i++) {
        const schema_node *nd = &sc->nodes[i];
        json_t *params = json_array();
        for (int k = 0; k < nd->n_params; k++)
            json_array_append_new(params, json_pack("{s:s,s:i,s:i}", "name", nd->params[k].name,
                                                    "length", nd->params[k].length, "position",
                                                    (int)nd->params[k].pos));
        json_t *m = json_pack(
            "{s:s,s:o,s:o,s:i,s:i,s:i,s:o}", "name", nd->name, "parent",
            nd->parent > 0 ? json_string(sc->nodes[nd->parent].name) : json_null(), "union",
            nd->union_id >= 0 ? json_integer(nd->union_id) : json_null(), "start", (int)nd->start,
            "end", (int)nd->end, "tokens", nd->n_tok, "parameters", params);
        json_array_append_new(mods, m);
    }
    double frac = sc->own_tokens > 0 ? (double)e->done_tokens / (double)sc->own_tokens : 1.0;
    size_t per_token = model_kv_bytes_per_token(g->s->m);
    return json_pack("{s:s,s:s,s:s,s:o,s:I,s:i,s:I,s:I,s:{s:I,s:I,s:f},s:b,s:o}", "object",
                     "schema", "name", sc->name, "status", status_name(e->status), "error",
                     e->status == ENTRY_FAILED ? json_string(e->error) : json_null(), "created",
                     (json_int_t)e->created, "positions", (int)sc->extent, "tokens",
                     (json_int_t)sc->own_tokens, "kv_bytes",
                     (json_int_t)(sc->own_tokens * (int64_t)per_token), "progress", "done_tokens",
                     (json_int_t)e->done_tokens, "total_tokens", (json_int_t)sc->own_tokens,
                     "fraction", frac, "roles", sc->roles, "modules", mods);
}

static int fail_400(api_error *err, const char *param, const char *code, const char *msg) {
    return api_fail(err, 400, "invalid_request_error", code, param, "%s", msg);
}

static bool available(server *s, api_error *err) {
    if (s->schemas && s->store && s->cfg->cache) return true;
    api_fail(err, 400, "invalid_request_error", "cache_disabled", NULL,
             "schemas need the context cache with a RAM or disk tier (this server runs "
             "--no-cache or without tiers)");
    return false;
}

/* POST /v1/schemas: the body is PML, or {"pml": "...", "cache_salt": "..."}. */
static void api_register(server *s, const http_call *c, http_reply *out) {
    schema_registry *g = s->schemas;
    api_error err = {0};
    json_t *root = NULL;
    const char *src = c->body, *salt = c->query_salt;
    size_t len = c->len, i = 0;
    while (i < len && (src[i] == ' ' || src[i] == '\n' || src[i] == '\r' || src[i] == '\t')) i++;
    if (i == len) {
        fail_400(&err, NULL, NULL, "the body is empty: send PML or {\"pml\": \"...\"}");
        goto fail;
    }
    if (src[i] != '<') {
        json_error_t je;
        root = json_loadb(c->body, c->len, JSON_REJECT_DUPLICATES, &je);
        json_t *p = root ? json_object_get(root, "pml") : NULL, *v;
        if (!root || !json_is_object(root)) {
            api_fail(&err, 400, "invalid_request_error", NULL, NULL,
                     "the body must be PML or a JSON object with \"pml\"%s%s", root ? "" : ": ",
                     root ? "" : je.text);
            goto fail;
        }
        if (!json_is_string(p)) {
            fail_400(&err, "pml", NULL, "'pml' must be a string holding the <schema>");
            goto fail;
        }
        if ((v = json_object_get(root, "cache_salt")) && !json_is_null(v)) {
            if (!json_is_string(v) || json_string_length(v) > API_MAX_CACHE_SALT) {
                fail_400(&err, "cache_salt", NULL,
                         "'cache_salt' must be a string of at most 256 bytes");
                goto fail;
            }
            salt = json_string_value(v);
        }
        src = json_string_value(p);
        len = json_string_length(p);
        if (memchr(src, '\0', len)) {
            fail_400(&err, "pml", NULL, "'pml' must not contain NUL characters");
            goto fail;
        }
    }
    cache_key ns;
    server_cache_namespace(s, c, salt, &ns);
    kv_error ke = {{0}};
    schema *sc = compile(g, &ns, src, len, &ke);
    if (!sc) {
        fail_400(&err, root ? "pml" : NULL, "invalid_pml", ke.msg);
        goto fail;
    }
    pthread_mutex_lock(&g->mu);
    entry *old = find_locked(g, &ns, sc->name);
    if (old && old->sc->source_len == sc->source_len &&
        memcmp(old->sc->source, sc->source, sc->source_len) == 0) {
        /* the same schema again: nothing to do */
        json_t *v = entry_json(g, old);
        pthread_mutex_unlock(&g->mu);
        schema_unref(sc);
        json_decref(root);
        http_reply_json(out, 200, v);
        return;
    }
    if (!old && g->n >= s->cfg->schema_max) {
        pthread_mutex_unlock(&g->mu);
        schema_unref(sc);
        api_fail(&err, 400, "invalid_request_error", "too_many_schemas", NULL,
                 "%d schemas are registered, the most this server keeps (--schema-max); delete "
                 "one first",
                 g->n);
        goto fail;
    }
    if (g->dir && schema_def_save(g->dir, &ns, sc->name, sc->source, sc->source_len, &ke))
        log_warn("schemas: '%s' will not survive a restart: %s", sc->name, ke.msg);
    entry *e = add_locked(g, sc);
    if (!e) {
        pthread_mutex_unlock(&g->mu);
        schema_unref(sc);
        api_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    json_t *v = entry_json(g, e);
    pthread_mutex_unlock(&g->mu);
    log_info("schemas: '%s' registered: %d modules, %d positions, %lld tokens to precompute",
             sc->name, sc->n_nodes - 1, (int)sc->extent, (long long)sc->own_tokens);
    json_decref(root);
    http_reply_json(out, 202, v);
    return;
fail:
    json_decref(root);
    http_reply_error(out, &err);
}

/* The live entry of name in the caller's namespace, loading a definition another instance (or
 * an earlier run) stored when it is not registered here. Returns it with a schema reference in
 * *sc and its status, or NULL; the entry itself may be freed as soon as this returns (compare,
 * never dereference). */
static entry *lookup(server *s, const cache_key *ns, const char *name, schema **sc,
                     entry_status *st, char *error, size_t cap) {
    schema_registry *g = s->schemas;
    pthread_mutex_lock(&g->mu);
    entry *e = find_locked(g, ns, name);
    pthread_mutex_unlock(&g->mu);
    if (!e && g->dir && pml_name_ok(name)) {
        size_t len = 0;
        char *src = schema_def_load(g->dir, ns, name, &len);
        if (src) load_one(g, ns, name, src, len);
        free(src);
        pthread_mutex_lock(&g->mu);
        e = find_locked(g, ns, name);
        pthread_mutex_unlock(&g->mu);
    }
    if (!e) return NULL;
    pthread_mutex_lock(&g->mu);
    schema_ref(e->sc);
    *sc = e->sc;
    *st = e->status;
    if (error) snprintf(error, cap, "%s", e->error);
    pthread_mutex_unlock(&g->mu);
    return e;
}

static void not_found(const char *name, http_reply *out) {
    api_error err;
    api_fail(&err, 404, "invalid_request_error", "schema_not_found", NULL,
             "no schema '%s' in this namespace", name);
    http_reply_error(out, &err);
}

http_result schemas_api(server *s, const http_call *c, http_out *o) {
    http_reply *out = &o->reply;
    const char *method = c->method, *name = c->tail[0] ? c->tail : NULL;
    schema_registry *g = s->schemas;
    api_error err = {0};
    if (!available(s, &err)) {
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    cache_key ns;
    server_cache_namespace(s, c, c->query_salt, &ns);
    if (!name) {
        if (strcmp(method, "POST") == 0) {
            api_register(s, c, out);
            return HTTP_REPLIED;
        }
        json_t *data = json_array();
        pthread_mutex_lock(&g->mu);
        for (entry *e = g->list; e; e = e->next)
            if (!e->deleted && memcmp(e->sc->ns.b, ns.b, CACHE_KEY_BYTES) == 0)
                json_array_append_new(data, entry_json(g, e));
        pthread_mutex_unlock(&g->mu);
        http_reply_json(out, 200, json_pack("{s:s,s:o}", "object", "list", "data", data));
        return HTTP_REPLIED;
    }
    schema *sc = NULL;
    entry_status st;
    if (lookup(s, &ns, name, &sc, &st, NULL, 0)) schema_unref(sc);
    /* found again under the lock: a concurrent DELETE may have freed what lookup saw */
    pthread_mutex_lock(&g->mu);
    entry *e = find_locked(g, &ns, name);
    if (!e) {
        pthread_mutex_unlock(&g->mu);
        not_found(name, out);
        return HTTP_REPLIED;
    }
    if (strcmp(method, "DELETE") == 0) {
        e->deleted = true;
        unpin_locked(g, e);
        for (entry **p = &g->list; *p; p = &(*p)->next)
            if (*p == e) {
                *p = e->next;
                break;
            }
        g->n--;
        if (g->dir) schema_def_delete(g->dir, &ns, name);
        if (!e->building) entry_free(e);
        pthread_mutex_unlock(&g->mu);
        log_info("schemas: '%s' deleted", name);
        http_reply_json(
            out, 200,
            json_pack("{s:s,s:s,s:b}", "object", "schema.deleted", "name", name, "deleted", true));
        return HTTP_REPLIED;
    }
    json_t *v = entry_json(g, e);
    pthread_mutex_unlock(&g->mu);
    http_reply_json(out, 200, v);
    return HTTP_REPLIED;
}

/* ---------------------------------------------------------------- prompts */

static int json_text_kids(pml_node *root, const json_t *text, api_error *err);

/* The JSON form of a prompt as the tree PML gives: {"schema", "modules": [{"name", "params":
 * {name: value}, "modules": [...]}], "text": a string or [strings and {"role", "content"}]}. */
static int json_modules(pml_node *parent, const json_t *mods, const char *path, api_error *err) {
    if (!json_is_array(mods)) return fail_400(err, path, NULL, "'modules' must be an array");
    size_t i;
    json_t *m;
    json_array_foreach(mods, i, m) {
        char p[64];
        snprintf(p, sizeof p, "%.40s[%zu]", path, i);
        const json_t *name = json_object_get(m, "name");
        if (!json_is_object(m) || !json_is_string(name))
            return fail_400(err, p, NULL,
                            "a module reference is {\"name\": ..., \"params\": {...}}");
        if (parent->n_kids == parent->cap_kids) {
            int cap = parent->cap_kids ? 2 * parent->cap_kids : 4;
            pml_node **k = realloc(parent->kids, sizeof *k * (size_t)cap);
            if (!k) return api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
            parent->kids = k;
            parent->cap_kids = cap;
        }
        pml_node *n = calloc(1, sizeof *n);
        if (!n) return api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
        parent->kids[parent->n_kids++] = n;
        n->kind = PML_MODULE;
        if (!(n->name = strdup(json_string_value(name))))
            return api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
        const json_t *params = json_object_get(m, "params"), *v;
        if (params && !json_is_object(params))
            return fail_400(err, p, NULL, "'params' must be an object of strings");
        size_t np = params ? json_object_size(params) : 0;
        if (np && !(n->args = calloc(2 * np, sizeof *n->args)))
            return api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
        const char *key;
        if (params) json_object_foreach((json_t *)params, key, v) {
                if (!json_is_string(v))
                    return fail_400(err, p, NULL, "a parameter's value must be a string");
                if (!(n->args[2 * n->n_args] = strdup(key)) ||
                    !(n->args[2 * n->n_args + 1] = strdup(json_string_value(v))))
                    return api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
                n->n_args++;
            }
        const json_t *sub = json_object_get(m, "modules");
        if (sub && json_modules(n, sub, p, err)) return -1;
    }
    return 0;
}

static int json_text_kids(pml_node *root, const json_t *text, api_error *err) {
    json_t *one = NULL;
    if (json_is_string(text)) text = one = json_pack("[O]", text);
    if (!json_is_array(text))
        return fail_400(err, "schema_prompt.text", NULL,
                        "'text' must be a string or an array of strings "
                        "and {\"role\", \"content\"} turns");
    size_t i;
    json_t *t;
    int rc = 0;
    json_array_foreach(text, i, t) {
        const char *role = json_string_value(json_object_get(t, "role"));
        const char *content = json_is_string(t) ? json_string_value(t)
                                                : json_string_value(json_object_get(t, "content"));
        int r = !role                            ? -1
                : strcmp(role, "system") == 0    ? PML_ROLE_SYSTEM
                : strcmp(role, "user") == 0      ? PML_ROLE_USER
                : strcmp(role, "assistant") == 0 ? PML_ROLE_ASSISTANT
                                                 : -2;
        if (!content || r == -2 || (r == -1 && !json_is_string(t))) {
            rc = fail_400(err, "schema_prompt.text", NULL,
                          "'text' holds strings and {\"role\": system|user|assistant, "
                          "\"content\": string} turns");
            break;
        }
        pml_node *n = calloc(1, sizeof *n), *txt = NULL;
        pml_node **k = realloc(root->kids, sizeof *k * (size_t)(root->n_kids + 1));
        if (k) root->kids = k;
        if (!n || !k || !(n->text = strdup(content))) {
            free(n);
            rc = api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
            break;
        }
        root->kids[root->n_kids++] = n;
        root->cap_kids = root->n_kids;
        n->len = strlen(content);
        n->kind = PML_TEXT;
        if (r >= 0) {
            /* a role: the text moves under it */
            txt = calloc(1, sizeof *txt);
            pml_node **kk = txt ? malloc(sizeof *kk) : NULL;
            if (!txt || !kk) {
                free(txt);
                rc = api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
                break;
            }
            *txt = *n;
            memset(n, 0, sizeof *n);
            n->kind = PML_ROLE;
            n->role = (pml_role)r;
            n->kids = kk;
            n->kids[0] = txt;
            n->n_kids = n->cap_kids = 1;
        }
    }
    json_decref(one);
    return rc;
}

static pml_doc *json_prompt(const char *text, api_error *err) {
    json_error_t je;
    json_t *v = json_loads(text, 0, &je);
    pml_doc *d = calloc(1, sizeof *d);
    if (!v || !d) {
        json_decref(v);
        free(d);
        api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    d->prompt = true;
    const json_t *name = json_object_get(v, "schema"), *mods = json_object_get(v, "modules"),
                 *txt = json_object_get(v, "text");
    int rc = 0;
    if (!json_is_string(name))
        rc =
            fail_400(err, "schema_prompt.schema", NULL, "'schema' (the schema's name) is required");
    else if (!(d->name = strdup(json_string_value(name))))
        rc = api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
    if (rc == 0 && mods) rc = json_modules(&d->root, mods, "schema_prompt.modules", err);
    if (rc == 0 && txt) rc = json_text_kids(&d->root, txt, err);
    json_decref(v);
    if (rc) {
        pml_free(d);
        return NULL;
    }
    return d;
}

int schemas_prompt(server *s, const api_request *rq, const http_call *c, schema_prompt *out,
                   api_error *err) {
    memset(out, 0, sizeof *out);
    if (!available(s, err)) return -1;
    schema_registry *g = s->schemas;
    kv_error ke = {{0}};
    pml_doc *doc = rq->schema_prompt_json
                       ? json_prompt(rq->schema_prompt, err)
                       : pml_parse(rq->schema_prompt, strlen(rq->schema_prompt), NULL, &ke);
    if (!doc) {
        if (!rq->schema_prompt_json) fail_400(err, "schema_prompt", "invalid_pml", ke.msg);
        return -1;
    }
    if (!doc->prompt) {
        pml_free(doc);
        return fail_400(err, "schema_prompt", "invalid_pml",
                        "'schema_prompt' must be a <prompt schema=\"...\">, not a <schema>");
    }
    /* the free text after it: a chat's messages, a completion's prompt string */
    schema_turn *turns = calloc((size_t)rq->n_messages + 2, sizeof *turns);
    int n_turns = 0, rc = -1;
    schema *sc = NULL;
    if (!turns) {
        api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
        goto done;
    }
    for (int i = 0; i < rq->n_messages; i++) {
        const chat_message *m = &rq->messages[i];
        int r = strcmp(m->role, "system") == 0      ? PML_ROLE_SYSTEM
                : strcmp(m->role, "user") == 0      ? PML_ROLE_USER
                : strcmp(m->role, "assistant") == 0 ? PML_ROLE_ASSISTANT
                                                    : -1;
        if (r < 0 || m->n_tool_calls > 0) {
            fail_400(err, "messages", NULL,
                     "after a schema_prompt, messages are system, user or assistant text");
            goto done;
        }
        turns[n_turns++] = (schema_turn){.role = r, .text = m->content ? m->content : ""};
    }
    if (rq->kind == API_COMPLETION && rq->n_prompts > 0) {
        if (rq->n_prompts != 1 || !rq->prompts[0].text) {
            fail_400(err, "prompt", NULL,
                     "with a schema_prompt, 'prompt' is one string of free text after it");
            goto done;
        }
        turns[n_turns++] = (schema_turn){.role = -1, .text = rq->prompts[0].text};
    }
    cache_key ns;
    server_cache_namespace(s, c, rq->cache_salt, &ns);
    entry_status st;
    char why[400] = "";
    if (!lookup(s, &ns, doc->name, &sc, &st, why, sizeof why)) {
        api_fail(err, 404, "invalid_request_error", "schema_not_found", "schema_prompt",
                 "no schema '%s' in this namespace (POST it to /v1/schemas first)", doc->name);
        goto done;
    }
    /* still precomputing: served all the same, its modules that are not stored yet computed
     * with the prompt (as when a record is missing) */
    if (st == ENTRY_FAILED && rq->cache) {
        api_fail(err, 409, "invalid_request_error", "schema_failed", "schema_prompt",
                 "schema '%s' could not be precomputed: %s", doc->name, why);
        goto done;
    }
    /* chat always opens the answer; a completion does when the prompt is a conversation */
    bool roles = sc->roles || n_turns > (rq->kind == API_COMPLETION && rq->n_prompts > 0);
    for (int i = 0; i < doc->root.n_kids && !roles; i++)
        roles = doc->root.kids[i]->kind == PML_ROLE;
    bool gen = rq->kind == API_CHAT || roles;
    /* What a prompt that names no fix-up gets: under a quality budget (cache/quality.h), the
     * least calibrated fix-up within it (ratio 0: the modules' KV as precomputed), else the
     * prompt laid out as a full prefill with only the modules' KV that is exact reused (the
     * leading text and modules computed in the order the prompt has them: modules out of their
     * context are approximate reuse, none allowed without a setting measured within the
     * budget); with --reuse-quality none, --schema-fixup. The request's "fixup" wins. The
     * fix-up runs on blend's fusor (--no-blend: plain Prompt Cache, or exact reuse only under a
     * budget that needs the fix-up). */
    const quality_choice *qc = &s->reuse.choice;
    bool fixup = rq->fixup >= 0 ? rq->fixup != 0
                 : qc->gated    ? qc->fixup_ratio > 0
                                : s->cfg->schema_fixup;
    /* a budget with no setting for it, or one whose fix-up cannot run */
    bool exact = rq->fixup < 0 && qc->gated && (qc->fixup_ratio < 0 || (fixup && !s->cfg->blend));
    fixup = fixup && s->cfg->blend && !exact;
    schema_fetch fetch = !rq->cache ? SCHEMA_FETCH_NONE
                         : exact    ? SCHEMA_FETCH_EXACT
                                    : SCHEMA_FETCH_ALL;
    /* the full prefill's layout also with "cache": false, so that it changes only the reuse */
    if (schema_assemble(sc, doc, &g->chat, s->m->tok, turns, n_turns, gen, s->store, fetch,
                        fixup || exact, out, &ke)) {
        fail_400(err, "schema_prompt", NULL, ke.msg);
        goto done;
    }
    if (out->kv) {
        /* the request's ratio, else the least the quality budget accepts, else the server's */
        float ratio = rq->fixup_ratio >= 0 ? rq->fixup_ratio
                      : s->reuse.choice.fixup_ratio >= 0
                          ? s->reuse.choice.fixup_ratio
                          : (float)s->cfg->schema_fixup_recompute / 100.0f;
        out->kv->fixup = fixup ? ratio : -1;
    } else if (out->missing && st == ENTRY_READY) {
        /* a record is gone (cleared, evicted, corrupt): computed in full now, rebuilt after */
        log_warn("schemas: '%s': module KV missing; computing the prompt in full and "
                 "precomputing the schema again",
                 sc->name);
        pthread_mutex_lock(&g->mu);
        entry *e = find_locked(g, &ns, sc->name);
        if (e && e->sc == sc && e->status == ENTRY_READY) {
            e->status = ENTRY_BUILDING;
            e->done_tokens = 0;
            pthread_cond_broadcast(&g->cv);
        }
        pthread_mutex_unlock(&g->mu);
    }
    rc = 0;
done:
    schema_unref(sc);
    free(turns);
    pml_free(doc);
    if (rc) schema_prompt_free(out);
    return rc;
}
