/* Prompt Cache's HTTP surface over the schema registry (cache/schema/schema.h): POST /v1/schemas
 * registers a schema, GET /v1/schemas lists them, GET and DELETE /v1/schemas/{name}; and
 * completions and chat turn a "schema_prompt" into a prompt whose first slots come from the
 * records the registry precomputed. The registry's builder thread computes each module's KV
 * through the engine, with a prompt-only request per module whose records are not yet stored
 * (schemas_compute, the one piece of the builder that is the server's).
 *
 * Schemas live in the caller's cache namespace (API key and cache_salt), like the rest of the
 * cache. Their definitions are kept beside the disk tier (schemas/ in the model's cache
 * directory), so after a restart, or in another instance sharing the directory, a schema comes
 * back with its records and is ready without computing anything. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "server/api/handlers.h"
#include "server/api/job.h"

/* ---------------------------------------------------------------- the registry on the engine */

/* The registry's compute callback (schema_compute_fn): a node's job as a prompt-only request
 * through the engine, which stores the node's records. 0, or -1 with msg. */
static int schemas_compute(void *ud, schema_job *jb, const schema_build *b, char *msg, size_t cap) {
    server *s = ud;
    kv_error err = {{0}};
    gen_request *r = gen_request_create(1);
    if (!r) {
        schema_job_free(jb);
        snprintf(msg, cap, "out of memory");
        return -1;
    }
    r->prompt = jb->tokens;
    r->pos = jb->pos;
    r->skv = jb->kv;
    r->n_prompt = jb->n;
    r->max_tokens = 0;
    r->t_arrival = clock_now_ns();
    *jb = (schema_job){0};
    int rc = 0;
    for (;;) {
        engine_submit_status st = engine_submit(s->eng, r, &err);
        if (st == ENGINE_SUBMIT_OK) break;
        if (st != ENGINE_SUBMIT_QUEUE_FULL || schema_build_abandoned(b)) {
            snprintf(msg, cap, "%.300s", err.msg);
            gen_request_unref(r);
            return -1;
        }
        usleep(50 * 1000); /* the queue is full: precomputing waits behind the requests */
    }
    pthread_mutex_lock(&r->mu);
    while (r->n_finished < 1) {
        gen_request_wait(r, 100);
        if (r->n_finished < 1 && schema_build_abandoned(b)) {
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

int schemas_start(server *s, const char *dir, kv_error *err) {
    const schema_registry_opts o = {.m = s->m,
                                    .store = s->store,
                                    .chunk_tokens = s->cfg->cache_chunk_tokens,
                                    .max_positions = s->ctx - 1,
                                    .max_schemas = s->cfg->schema_max,
                                    .dir = dir,
                                    .shared = s->shared,
                                    .compute = schemas_compute,
                                    .compute_ud = s};
    s->schemas = schema_registry_create(&o, err);
    return s->schemas ? 0 : -1;
}

void schemas_stop(server *s) {
    schema_registry_destroy(s->schemas);
    s->schemas = NULL;
}

/* ---------------------------------------------------------------- JSON */

static const char *status_name(schema_status st) {
    return st == SCHEMA_READY ? "ready" : st == SCHEMA_FAILED ? "failed" : "building";
}

static json_t *schema_json(const server *s, const schema_info *in) {
    const schema *sc = in->sc;
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
    double frac = sc->own_tokens > 0 ? (double)in->done_tokens / (double)sc->own_tokens : 1.0;
    size_t per_token = model_kv_bytes_per_token(s->m);
    return json_pack("{s:s,s:s,s:s,s:o,s:I,s:i,s:I,s:I,s:{s:I,s:I,s:f},s:b,s:o}", "object",
                     "schema", "name", sc->name, "status", status_name(in->status), "error",
                     in->status == SCHEMA_FAILED ? json_string(in->error) : json_null(), "created",
                     (json_int_t)in->created, "positions", (int)sc->extent, "tokens",
                     (json_int_t)sc->own_tokens, "kv_bytes",
                     (json_int_t)(sc->own_tokens * (int64_t)per_token), "progress", "done_tokens",
                     (json_int_t)in->done_tokens, "total_tokens", (json_int_t)sc->own_tokens,
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

/* ---------------------------------------------------------------- /v1/schemas */

/* The schema's source in the body of POST /v1/schemas: PML as it is, or {"pml": "...",
 * "cache_salt": "..."} (*root then holds the JSON, which *src points into, and *salt is its
 * salt when it has one). -1 with err. */
static int register_body(const http_call *c, json_t **root, const char **src, size_t *len,
                         const char **salt, api_error *err) {
    *src = c->body;
    *len = c->len;
    size_t i = 0;
    while (i < *len &&
           (c->body[i] == ' ' || c->body[i] == '\n' || c->body[i] == '\r' || c->body[i] == '\t'))
        i++;
    if (i == *len)
        return fail_400(err, NULL, NULL, "the body is empty: send PML or {\"pml\": \"...\"}");
    if (c->body[i] == '<') return 0;
    json_error_t je;
    *root = json_loadb(c->body, c->len, JSON_REJECT_DUPLICATES, &je);
    json_t *p = *root ? json_object_get(*root, "pml") : NULL, *v;
    if (!*root || !json_is_object(*root))
        return api_fail(err, 400, "invalid_request_error", NULL, NULL,
                        "the body must be PML or a JSON object with \"pml\"%s%s", *root ? "" : ": ",
                        *root ? "" : je.text);
    if (!json_is_string(p))
        return fail_400(err, "pml", NULL, "'pml' must be a string holding the <schema>");
    if ((v = json_object_get(*root, "cache_salt")) && !json_is_null(v)) {
        if (!json_is_string(v) || json_string_length(v) > API_MAX_CACHE_SALT)
            return fail_400(err, "cache_salt", NULL,
                            "'cache_salt' must be a string of at most 256 bytes");
        *salt = json_string_value(v);
    }
    *src = json_string_value(p);
    *len = json_string_length(p);
    if (memchr(*src, '\0', *len))
        return fail_400(err, "pml", NULL, "'pml' must not contain NUL characters");
    return 0;
}

/* POST /v1/schemas: 202 with the new schema (precomputed in the background), 200 with the one
 * registered when its source is the same. */
static void api_register(server *s, const http_call *c, http_reply *out) {
    api_error err = {0};
    json_t *root = NULL;
    const char *src, *salt = c->query_salt;
    size_t len;
    if (register_body(c, &root, &src, &len, &salt, &err)) goto fail;
    cache_key ns;
    server_cache_namespace(s, c, salt, &ns);
    kv_error ke = {{0}};
    schema_info in;
    schema_add_result added = schema_registry_add(s->schemas, &ns, src, len, &in, &ke);
    switch (added) {
    case SCHEMA_ADD_NEW:
    case SCHEMA_ADD_SAME:
        json_decref(root);
        http_reply_json(out, added == SCHEMA_ADD_NEW ? 202 : 200, schema_json(s, &in));
        schema_info_free(&in);
        return;
    case SCHEMA_ADD_INVALID:
        fail_400(&err, root ? "pml" : NULL, "invalid_pml", ke.msg);
        break;
    case SCHEMA_ADD_FULL:
        api_fail(&err, 400, "invalid_request_error", "too_many_schemas", NULL, "%s", ke.msg);
        break;
    case SCHEMA_ADD_NOMEM:
        api_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
        break;
    }
fail:
    json_decref(root);
    http_reply_error(out, &err);
}

/* GET /v1/schemas: the caller's namespace's schemas, newest first. */
static void api_list(server *s, const cache_key *ns, http_reply *out) {
    schema_info *v;
    int n;
    if (schema_registry_list(s->schemas, ns, &v, &n)) {
        api_error err;
        api_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
        http_reply_error(out, &err);
        return;
    }
    json_t *data = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(data, schema_json(s, &v[i]));
    schema_info_list_free(v, n);
    http_reply_json(out, 200, json_pack("{s:s,s:o}", "object", "list", "data", data));
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
    api_error err = {0};
    if (!available(s, &err)) {
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    cache_key ns;
    server_cache_namespace(s, c, c->query_salt, &ns);
    if (!name) {
        if (strcmp(method, "POST") == 0)
            api_register(s, c, out);
        else
            api_list(s, &ns, out);
        return HTTP_REPLIED;
    }
    /* a definition stored by another instance (or an earlier run) is loaded here */
    schema_info in;
    if (!schema_registry_get(s->schemas, &ns, name, &in)) {
        not_found(name, out);
        return HTTP_REPLIED;
    }
    if (strcmp(method, "DELETE") == 0) {
        schema_info_free(&in);
        /* found again: a concurrent DELETE may have taken it meanwhile */
        if (!schema_registry_delete(s->schemas, &ns, name)) {
            not_found(name, out);
            return HTTP_REPLIED;
        }
        http_reply_json(
            out, 200,
            json_pack("{s:s,s:s,s:b}", "object", "schema.deleted", "name", name, "deleted", true));
        return HTTP_REPLIED;
    }
    http_reply_json(out, 200, schema_json(s, &in));
    schema_info_free(&in);
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

/* The prompt's tree: a <prompt schema="..."> in PML, or its JSON form. NULL with err. */
static pml_doc *prompt_doc(const api_request *rq, api_error *err) {
    kv_error ke = {{0}};
    pml_doc *doc = rq->schema_prompt_json
                       ? json_prompt(rq->schema_prompt, err)
                       : pml_parse(rq->schema_prompt, strlen(rq->schema_prompt), NULL, &ke);
    if (!doc) {
        if (!rq->schema_prompt_json) fail_400(err, "schema_prompt", "invalid_pml", ke.msg);
        return NULL;
    }
    if (!doc->prompt) {
        pml_free(doc);
        fail_400(err, "schema_prompt", "invalid_pml",
                 "'schema_prompt' must be a <prompt schema=\"...\">, not a <schema>");
        return NULL;
    }
    return doc;
}

/* The free text after the prompt: a chat's messages, a completion's prompt string. *turns is
 * malloc'd (also on failure). -1 with err. */
static int prompt_turns(const api_request *rq, schema_turn **turns, int *n_turns, api_error *err) {
    schema_turn *t = *turns = calloc((size_t)rq->n_messages + 2, sizeof *t);
    *n_turns = 0;
    if (!t) return api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
    for (int i = 0; i < rq->n_messages; i++) {
        const chat_message *m = &rq->messages[i];
        int r = strcmp(m->role, "system") == 0      ? PML_ROLE_SYSTEM
                : strcmp(m->role, "user") == 0      ? PML_ROLE_USER
                : strcmp(m->role, "assistant") == 0 ? PML_ROLE_ASSISTANT
                                                    : -1;
        if (r < 0 || m->n_tool_calls > 0)
            return fail_400(err, "messages", NULL,
                            "after a schema_prompt, messages are system, user or assistant text");
        t[(*n_turns)++] = (schema_turn){.role = r, .text = m->content ? m->content : ""};
    }
    if (rq->kind == API_COMPLETION && rq->n_prompts > 0) {
        if (rq->n_prompts != 1 || !rq->prompts[0].text)
            return fail_400(err, "prompt", NULL,
                            "with a schema_prompt, 'prompt' is one string of free text after it");
        t[(*n_turns)++] = (schema_turn){.role = -1, .text = rq->prompts[0].text};
    }
    return 0;
}

/* The schema the prompt names, in the caller's namespace, into in. Still precomputing: served
 * all the same, its modules that are not stored yet computed with the prompt (as when a record
 * is missing). -1 with err: 404 for an unknown schema, 409 for one that failed (with the cache
 * on). */
static int prompt_schema(server *s, const api_request *rq, const http_call *c, const char *name,
                         schema_info *in, api_error *err) {
    cache_key ns;
    server_cache_namespace(s, c, rq->cache_salt, &ns);
    if (!schema_registry_get(s->schemas, &ns, name, in))
        return api_fail(err, 404, "invalid_request_error", "schema_not_found", "schema_prompt",
                        "no schema '%s' in this namespace (POST it to /v1/schemas first)", name);
    if (in->status == SCHEMA_FAILED && rq->cache)
        return api_fail(err, 409, "invalid_request_error", "schema_failed", "schema_prompt",
                        "schema '%s' could not be precomputed: %s", name, in->error);
    return 0;
}

/* Chat always opens the answer; a completion does when the prompt is a conversation. */
static bool prompt_opens_answer(const api_request *rq, const schema *sc, const pml_doc *doc,
                                int n_turns) {
    bool roles = sc->roles || n_turns > (rq->kind == API_COMPLETION && rq->n_prompts > 0);
    for (int i = 0; i < doc->root.n_kids && !roles; i++)
        roles = doc->root.kids[i]->kind == PML_ROLE;
    return rq->kind == API_CHAT || roles;
}

/* What a prompt that names no fix-up gets: under a quality budget (cache/quality.h), the
 * least calibrated fix-up within it (ratio 0: the modules' KV as precomputed), else the
 * prompt laid out as a full prefill with only the modules' KV that is exact reused (the
 * leading text and modules computed in the order the prompt has them: modules out of their
 * context are approximate reuse, none allowed without a setting measured within the
 * budget); with --reuse-quality none, --schema-fixup. The request's "fixup" wins. The
 * fix-up runs on blend's fusor (--no-blend: plain Prompt Cache, or exact reuse only under a
 * budget that needs the fix-up). Returns what to fetch; *fixup and *exact say which. */
static schema_fetch prompt_reuse(const server *s, const api_request *rq, bool *fixup, bool *exact) {
    const quality_choice *qc = &s->reuse.choice;
    *fixup = rq->fixup >= 0 ? rq->fixup != 0
             : qc->gated    ? qc->fixup_ratio > 0
                            : s->cfg->schema_fixup;
    /* a budget with no setting for it, or one whose fix-up cannot run */
    *exact = rq->fixup < 0 && qc->gated && (qc->fixup_ratio < 0 || (*fixup && !s->cfg->blend));
    *fixup = *fixup && s->cfg->blend && !*exact;
    return !rq->cache ? SCHEMA_FETCH_NONE : *exact ? SCHEMA_FETCH_EXACT : SCHEMA_FETCH_ALL;
}

/* The fix-up's ratio: the request's, else the least the quality budget accepts, else the
 * server's. */
static float fixup_ratio(const server *s, const api_request *rq) {
    return rq->fixup_ratio >= 0               ? rq->fixup_ratio
           : s->reuse.choice.fixup_ratio >= 0 ? s->reuse.choice.fixup_ratio
                                              : (float)s->cfg->schema_fixup_recompute / 100.0f;
}

int schemas_prompt(server *s, const api_request *rq, const http_call *c, schema_prompt *out,
                   api_error *err) {
    memset(out, 0, sizeof *out);
    if (!available(s, err)) return -1;
    /* the request's own text (its PML and turns; the modules' was bounded when registered) */
    size_t len = strlen(rq->schema_prompt);
    for (int i = 0; i < rq->n_messages; i++)
        len += rq->messages[i].content ? strlen(rq->messages[i].content) : 0;
    if (server_check_text(s, len, "schema_prompt", err)) return -1;
    pml_doc *doc = prompt_doc(rq, err);
    if (!doc) return -1;
    schema_turn *turns = NULL;
    int n_turns = 0, rc = -1;
    schema_info in = {0};
    if (prompt_turns(rq, &turns, &n_turns, err) || prompt_schema(s, rq, c, doc->name, &in, err))
        goto done;
    bool fixup, exact;
    schema_fetch fetch = prompt_reuse(s, rq, &fixup, &exact);
    kv_error ke = {{0}};
    /* the full prefill's layout also with "cache": false, so that it changes only the reuse */
    if (schema_assemble(in.sc, doc, schema_registry_chat(s->schemas), s->m->tok, turns, n_turns,
                        prompt_opens_answer(rq, in.sc, doc, n_turns), s->store, fetch,
                        fixup || exact, out, &ke)) {
        fail_400(err, "schema_prompt", NULL, ke.msg);
        goto done;
    }
    if (out->kv)
        out->kv->fixup = fixup ? fixup_ratio(s, rq) : -1;
    else if (out->missing && in.status == SCHEMA_READY)
        /* a record is gone (cleared, evicted, corrupt): computed in full now, rebuilt after */
        schema_registry_rebuild(s->schemas, in.sc);
    rc = 0;
done:
    schema_info_free(&in);
    free(turns);
    pml_free(doc);
    if (rc) schema_prompt_free(out);
    return rc;
}
