/* cache/schema/schema.c on the real model's tokenizer and template: role tags render as the chat
 * template does, positions follow the schema (unions share a start, parameters reserve their
 * length, nested modules sit inside their parent), keys change with positions, context and
 * namespace but not with the schema's name, prompts assemble in slot order with free text after
 * the last position and are refused where they do not fit the schema, KV rows copied to a
 * record and back at another slot are the same bits, and an exact fetch takes only the imported
 * tokens whose KV a full prefill computes. The registry (cache/schema/registry.c) keeps schemas
 * per namespace, builds them through its compute callback (none here: a schema whose records
 * are stored is ready without it, one whose are not fails with the callback's reason), and
 * keeps their definitions in a directory. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cache/schema/schema.h"
#include "tests/unit/model_fixture.h"
#include "tests/unit/tmpdir.h"

static model *g_m;
static schema_chat g_chat;
static cache_key g_ns;

static void setup(void) {
    g_m = model_fixture_load();
    schema_chat_init(&g_chat, g_m);
    cache_namespace(NULL, 0, NULL, &g_ns);
}

static void teardown(void) {
    schema_chat_free(&g_chat);
    model_free(g_m);
}

TestSuite(schema, .init = setup, .fini = teardown);

static schema *compile_ns(const char *src, const cache_key *ns, kv_error *err) {
    pml_doc *d = pml_parse(src, strlen(src), NULL, err);
    if (!d) return NULL;
    schema_opts o = {.m = g_m,
                     .chat = &g_chat,
                     .block_tokens = 16,
                     .chunk_tokens = 64,
                     .max_positions = 2047,
                     .max_modules = 64};
    schema *sc = schema_compile(d, src, strlen(src), ns, &o, err);
    pml_free(d);
    return sc;
}

static schema *compile_ok(const char *src) {
    kv_error err = {{0}};
    schema *sc = compile_ns(src, &g_ns, &err);
    cr_assert_not_null(sc, "%s: %s", src, err.msg);
    return sc;
}

static int n_tokens(const char *text) {
    int32_t *ids = NULL;
    kv_error err = {{0}};
    int n = tokenizer_encode(g_m->tok, text, strlen(text), false, true, &ids, &err);
    free(ids);
    return n;
}

Test(schema, role_tags_render_as_the_chat_template) {
    cr_assert(g_chat.ok, "%s", g_chat.why);
    cr_assert_str_eq(g_chat.pre[PML_ROLE_USER], "<|im_start|>user\n");
    cr_assert_str_eq(g_chat.suf[PML_ROLE_USER], "<|im_end|>\n");
    cr_assert_str_eq(g_chat.pre[PML_ROLE_SYSTEM], "<|im_start|>system\n");
    cr_assert_str_eq(g_chat.gen, "<|im_start|>assistant\n");
    cr_assert(strncmp(g_chat.implicit, "<|im_start|>system\nYou are a helpful", 36) == 0, "%s",
              g_chat.implicit);
    cr_assert_str_eq(g_chat.start, "");
}

static const char *TRAVEL = "<schema name=\"travel\">"
                            "<system>You are a travel agent.</system>"
                            "<user><module name=\"plan\">Plan a trip of <parameter name=\"days\" "
                            "length=\"4\"/> days.</module>"
                            "<union><module name=\"tokyo\">Tokyo has temples.</module>"
                            "<module name=\"miami\">Miami<module name=\"beach\"> has beaches."
                            "</module></module></union>"
                            "</user></schema>";

Test(schema, positions_follow_the_schema) {
    schema *sc = compile_ok(TRAVEL);
    cr_assert_eq(sc->n_nodes, 5);
    const schema_node *root = &sc->nodes[0], *plan = &sc->nodes[1], *tokyo = &sc->nodes[2],
                      *miami = &sc->nodes[3], *beach = &sc->nodes[4];
    cr_assert(sc->roles);
    int sys = n_tokens("<|im_start|>system\nYou are a travel agent.<|im_end|>\n<|im_start|>user\n");
    cr_assert_eq(plan->start, sys);
    cr_assert_eq(plan->n_params, 1);
    int before = n_tokens("Plan a trip of ");
    cr_assert_eq(plan->params[0].pos, plan->start + before);
    cr_assert_eq(plan->n_tok, before + n_tokens(" days."));
    cr_assert_eq(plan->pos[before], plan->params[0].pos + 4,
                 "the parameter's 4 positions stay free");
    cr_assert_eq(plan->end, plan->start + plan->n_tok + 4);
    cr_assert_eq(tokyo->start, plan->end);
    cr_assert_eq(miami->start, plan->end, "union members share their start");
    cr_assert_eq(tokyo->union_id, miami->union_id);
    cr_assert_eq(beach->parent, 3);
    cr_assert_eq(beach->start, miami->start + miami->n_tok);
    int32_t union_end = tokyo->end > miami->end ? tokyo->end : miami->end;
    cr_assert_eq(root->pos[root->n_tok - 1], union_end + n_tokens("<|im_end|>\n") - 1,
                 "the text after the union follows its longest member");
    cr_assert_eq(sc->extent, root->pos[root->n_tok - 1] + 1);
    cr_assert_eq(sc->own_tokens,
                 root->n_tok + plan->n_tok + tokyo->n_tok + miami->n_tok + beach->n_tok);
    schema_unref(sc);
}

Test(schema, declarations_that_clash_are_refused) {
    kv_error err = {{0}};
    cr_assert_null(compile_ns("<schema name=\"s\"><module name=\"a\">x</module>\n"
                              "<module name=\"a\">y</module></schema>",
                              &g_ns, &err));
    cr_assert(strstr(err.msg, "line 2, column 1: module 'a' is declared twice"), "%s", err.msg);
    cr_assert_null(
        compile_ns("<schema name=\"s\"><module name=\"a\"><parameter name=\"p\" "
                   "length=\"2\"/><parameter name=\"p\" length=\"3\"/></module></schema>",
                   &g_ns, &err));
    cr_assert(strstr(err.msg, "two parameters named 'p'"), "%s", err.msg);
    cr_assert_null(compile_ns("<schema name=\"s\"><module name=\"a\"><parameter name=\"p\" "
                              "length=\"4000\"/></module></schema>",
                              &g_ns, &err));
    cr_assert(strstr(err.msg, "more than 2047 positions"), "%s", err.msg);
    cr_assert_null(compile_ns("<schema name=\"s\">\n  \n</schema>", &g_ns, &err));
    cr_assert(strstr(err.msg, "the schema has no text"), "%s", err.msg);
}

Test(schema, keys_follow_positions_context_and_namespace_not_the_name) {
    schema *a =
        compile_ok("<schema name=\"a\">Intro.<module name=\"m\">Same text.</module></schema>");
    schema *b =
        compile_ok("<schema name=\"b\">Intro.<module name=\"m\">Same text.</module></schema>");
    schema *c = compile_ok(
        "<schema name=\"c\">Intro!<module name=\"m\">Same text.</module></schema>"); /* context */
    schema *d = compile_ok("<schema name=\"d\">Intro.<module name=\"x\">Other</module><module "
                           "name=\"m\">Same text.</module></schema>"); /* positions */
    cache_key other;
    cache_namespace((const uint8_t *)"tenant", 6, NULL, &other);
    kv_error err = {{0}};
    schema *e = compile_ns(
        "<schema name=\"a\">Intro.<module name=\"m\">Same text.</module></schema>", &other, &err);
    cr_assert_not_null(e, "%s", err.msg);
    const cache_key *ka = &a->nodes[1].bkeys[0];
    cr_assert_eq(memcmp(ka, &b->nodes[1].bkeys[0], 32), 0, "the schema's name is not in the key");
    cr_assert_neq(memcmp(ka, &c->nodes[1].bkeys[0], 32), 0, "the context is");
    cr_assert_neq(memcmp(ka, &d->nodes[2].bkeys[0], 32), 0, "the positions are");
    cr_assert_neq(memcmp(ka, &e->nodes[1].bkeys[0], 32), 0, "the namespace is");
    schema_unref(a);
    schema_unref(b);
    schema_unref(c);
    schema_unref(d);
    schema_unref(e);
}

static pml_doc *prompt(const char *src) {
    kv_error err = {{0}};
    pml_doc *d = pml_parse(src, strlen(src), NULL, &err);
    cr_assert_not_null(d, "%s", err.msg);
    return d;
}

static void assemble_fails(const schema *sc, const char *src, const char *want) {
    pml_doc *d = prompt(src);
    schema_prompt sp;
    kv_error err = {{0}};
    cr_assert_eq(schema_assemble(sc, d, &g_chat, g_m->tok, NULL, 0, true, NULL, SCHEMA_FETCH_NONE,
                                 false, &sp, &err),
                 -1, "accepted: %s", src);
    cr_assert(strstr(err.msg, want), "%s\n  got: %s\n  want: %s", src, err.msg, want);
    pml_free(d);
}

Test(schema, prompts_that_do_not_fit_are_refused) {
    schema *sc = compile_ok(TRAVEL);
    assemble_fails(sc, "<prompt schema=\"other\"/>", "names schema 'other', not 'travel'");
    assemble_fails(sc, "<prompt schema=\"travel\"><rome/></prompt>", "has no module 'rome'");
    assemble_fails(sc, "<prompt schema=\"travel\"><beach/></prompt>",
                   "line 1, column 25: module 'beach' is inside 'miami' in schema 'travel': "
                   "reference it inside <miami>");
    assemble_fails(sc, "<prompt schema=\"travel\"><tokyo/><miami/></prompt>",
                   "modules 'tokyo' and 'miami' are members of one <union>");
    assemble_fails(sc, "<prompt schema=\"travel\"><plan/><plan/></prompt>",
                   "module 'plan' is referenced twice");
    assemble_fails(sc, "<prompt schema=\"travel\"><plan weeks=\"2\"/></prompt>",
                   "module 'plan' has no parameter 'weeks'");
    assemble_fails(sc,
                   "<prompt schema=\"travel\"><plan days=\"one two three four five\"/></prompt>",
                   "parameter 'days' of module 'plan' is 5 tokens; its length is 4");
    schema_unref(sc);
}

Test(schema, a_prompt_assembles_in_slot_order) {
    schema *sc = compile_ok(TRAVEL);
    pml_doc *d = prompt("<prompt schema=\"travel\"><plan days=\"3\"/><miami><beach/></miami>"
                        "<user>Where?</user></prompt>");
    schema_prompt sp;
    kv_error err = {{0}};
    cr_assert_eq(schema_assemble(sc, d, &g_chat, g_m->tok, NULL, 0, true, NULL, SCHEMA_FETCH_NONE,
                                 false, &sp, &err),
                 0, "%s", err.msg);
    const schema_node *root = &sc->nodes[0], *plan = &sc->nodes[1], *miami = &sc->nodes[3],
                      *beach = &sc->nodes[4];
    int cached = root->n_tok + plan->n_tok + miami->n_tok + beach->n_tok;
    cr_assert_eq(sp.n_cached, cached);
    cr_assert_eq(sp.n_modules, 3);
    for (int i = 1; i < sp.n_cached; i++)
        cr_assert_lt(sp.pos[i - 1], sp.pos[i], "cached slots in position order");
    /* then the parameter's value at its reserved position */
    int n3 = n_tokens("3");
    cr_assert_eq(sp.pos[cached], plan->params[0].pos);
    /* then the free text after the last position used, and the answer's opening */
    int free_n = n_tokens("<|im_start|>user\nWhere?<|im_end|>\n<|im_start|>assistant\n");
    cr_assert_eq(sp.n, cached + n3 + free_n);
    cr_assert_eq(sp.pos[cached + n3], sc->extent);
    cr_assert_eq(sp.last_pos, sc->extent + free_n - 1);
    /* a full prefill's order: the same tokens by position (an insertion sort of the slots'),
     * then the free text */
    int m = sp.n - free_n;
    int32_t *p = malloc(sizeof *p * (size_t)m), *t = malloc(sizeof *t * (size_t)m);
    for (int i = 0; i < m; i++) {
        int j = i;
        while (j > 0 && p[j - 1] > sp.pos[i]) {
            p[j] = p[j - 1];
            t[j] = t[j - 1];
            j--;
        }
        p[j] = sp.pos[i];
        t[j] = sp.tokens[i];
    }
    cr_assert_eq(memcmp(t, sp.flat, sizeof *t * (size_t)m), 0);
    cr_assert_eq(memcmp(sp.tokens + m, sp.flat + m, sizeof *t * (size_t)free_n), 0);
    free(p);
    free(t);
    schema_prompt_free(&sp);
    pml_free(d);
    schema_unref(sc);
}

Test(schema, kv_rows_survive_a_record_at_another_slot) {
    kv_error err = {{0}};
    backend *b = backend_cpu_create(1, &err);
    kv_pool *pool = kv_pool_create(b, g_m, 1024, 16, &err);
    cr_assert_not_null(pool, "%s", err.msg);
    const kv_layout *l = kv_pool_layout(pool);
    int kvd = l->n_kv_head * l->head_dim, n = 45;
    kv_seq src, dst;
    kv_seq_init(&src);
    kv_seq_init(&dst);
    cr_assert_eq(kv_seq_reserve(pool, &src, 100, &err), 0);
    src.n_tokens = 100;
    float *k = malloc(sizeof *k * (size_t)100 * kvd), *v = malloc(sizeof *v * (size_t)100 * kvd);
    int32_t slots[100];
    for (int i = 0; i < 100; i++) slots[i] = i;
    for (int il = 0; il < l->n_layer; il++) {
        for (int i = 0; i < 100 * kvd; i++) {
            k[i] = (float)((i * 31 + il * 7) % 1000) / 64.0f - 7.0f;
            v[i] = (float)((i * 17 + il * 3) % 999) / 32.0f - 15.0f;
        }
        backend_kv_store(b, kv_pool_memory(pool), l, il, src.blocks, slots, 100, k, v);
    }
    /* slots 7..51 to host slots 3.. (unaligned), and back at slots 20.. of another sequence;
     * then aligned: slots 16..63 to host 0.. and back at 32.. (whole blocks) */
    size_t bb = kv_layout_block_bytes(l);
    uint8_t *host = kv_aligned_alloc(bb * 8);
    memset(host, 0, bb * 8);
    cr_assert_eq(kv_seq_export_rows(pool, &src, 7, n, host, 3, &err), 0, "%s", err.msg);
    cr_assert_eq(kv_seq_reserve(pool, &dst, 100, &err), 0);
    cr_assert_eq(kv_seq_import_rows(pool, &dst, 20, n, host, 3, &err), 0, "%s", err.msg);
    cr_assert_eq(kv_seq_export_rows(pool, &src, 16, 48, host, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(kv_seq_import_rows(pool, &dst, 32 + 48, 16, host, 32, &err), 0, "%s", err.msg);
    float *a = malloc(sizeof *a * (size_t)n * kvd), *c = malloc(sizeof *c * (size_t)n * kvd);
    int32_t s_src[64], s_dst[64];
    for (int i = 0; i < n; i++) s_src[i] = 7 + i, s_dst[i] = 20 + i;
    for (int il = 0; il < l->n_layer; il++)
        for (int kv = 0; kv < 2; kv++) {
            backend_kv_load(b, kv_pool_memory(pool), l, il, kv, src.blocks, s_src, n, a);
            backend_kv_load(b, kv_pool_memory(pool), l, il, kv, dst.blocks, s_dst, n, c);
            cr_assert_eq(memcmp(a, c, sizeof *a * (size_t)n * kvd), 0, "layer %d kv %d", il, kv);
        }
    for (int i = 0; i < 16; i++) s_src[i] = 48 + i, s_dst[i] = 80 + i;
    backend_kv_load(b, kv_pool_memory(pool), l, 3, 0, src.blocks, s_src, 16, a);
    backend_kv_load(b, kv_pool_memory(pool), l, 3, 0, dst.blocks, s_dst, 16, c);
    cr_assert_eq(memcmp(a, c, sizeof *a * 16 * (size_t)kvd), 0, "whole blocks");
    cr_assert_eq(kv_seq_import_rows(pool, &dst, 90, 30, host, 0, &err), -1, "out of bounds");
    free(a);
    free(c);
    free(k);
    free(v);
    kv_aligned_free(host);
    kv_seq_release(pool, &src);
    kv_seq_release(pool, &dst);
    kv_pool_destroy(pool);
    backend_destroy(b);
}

/* ---------------------------------------------------------------- exact reuse */

/* A RAM store holding every node's records of sc (the payload is not read here), but none of
 * node skip's (-1: none skipped). */
static cache_store *store_of(const schema *sc, int skip) {
    static const cache_layout L = {
        .n_layer = 1, .n_kv_head = 1, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 64};
    cache_store_opts o = {.ram_bytes = 64 << 20};
    kv_error err = {{0}};
    cache_store *st = cache_store_open(&L, &o, &err);
    cr_assert_not_null(st, "%s", err.msg);
    int cb = L.chunk_tokens / L.block_tokens;
    for (int i = 0; i < sc->n_nodes; i++) {
        const schema_node *nd = &sc->nodes[i];
        for (int b = 0; b < nd->n_blocks && i != skip; b += cb) {
            int nb = nd->n_blocks - b < cb ? nd->n_blocks - b : cb;
            cache_chunk *c = cache_chunk_create(&L, nd->bkeys + b, nb, &sc->ns, b * L.block_tokens);
            cr_assert_not_null(c);
            cache_store_put(st, c);
            cache_chunk_unref(c);
        }
    }
    return st;
}

/* Assembles src with fetch over st; checks the full prefill's layout where fetch is exact and
 * that the rows cover the leading n_cached slots in order; returns n_cached. */
static int assembled(const schema *sc, cache_store *st, schema_fetch fetch, const char *src,
                     schema_prompt *sp) {
    pml_doc *d = prompt(src);
    kv_error err = {{0}};
    cr_assert_eq(
        schema_assemble(sc, d, &g_chat, g_m->tok, NULL, 0, false, st, fetch, false, sp, &err), 0,
        "%s: %s", src, err.msg);
    pml_free(d);
    cr_assert_not(sp->missing, "%s", src);
    if (fetch == SCHEMA_FETCH_EXACT)
        for (int i = 0; i < sp->n; i++) {
            cr_assert_eq(sp->pos[i], i, "%s: laid out as a full prefill", src);
            cr_assert_eq(sp->tokens[i], sp->flat[i], "%s", src);
        }
    int slots = 0;
    for (int r = 0; sp->kv && r < sp->kv->n_rows; r++) {
        cr_assert_eq(sp->kv->rows[r].dst, slots, "%s: rows in slot order", src);
        slots += sp->kv->rows[r].n;
    }
    cr_assert_eq(slots, sp->n_cached, "%s", src);
    cr_assert_eq(sp->kv ? sp->kv->n_slots : 0, sp->n_cached, "%s", src);
    return sp->n_cached;
}

static int exact_tokens(const schema *sc, cache_store *st, const char *src) {
    schema_prompt sp;
    int n = assembled(sc, st, SCHEMA_FETCH_EXACT, src, &sp);
    schema_prompt_free(&sp);
    return n;
}

/* Under a quality budget that allows no approximate reuse, a schema prompt reuses only the
 * modules' KV that is exact: the imported tokens at positions 0, 1, ... each computed after
 * only its node's and its ancestors' tokens. A parameter's gap, a module left out, a sibling
 * module or the schema's text after a module ends it. */
Test(schema, exact_fetch_takes_the_prefix_a_full_prefill_computes) {
    schema *sc = compile_ok(TRAVEL);
    cache_store *st = store_of(sc, -1);
    const schema_node *root = &sc->nodes[0], *plan = &sc->nodes[1], *miami = &sc->nodes[3],
                      *beach = &sc->nodes[4];
    int sys = plan->start, before = n_tokens("Plan a trip of ");
    const char *p = "<prompt schema=\"travel\"><plan days=\"3\"/><miami><beach/></miami>"
                    "<user>Where?</user></prompt>";
    cr_assert_eq(exact_tokens(sc, st, p), sys + before, "up to the parameter's positions");
    cr_assert_eq(exact_tokens(sc, st, "<prompt schema=\"travel\"><miami><beach/></miami></prompt>"),
                 sys, "plan is left out: its positions are a gap");
    /* every imported token, as Prompt Cache has them */
    schema_prompt sp;
    cr_assert_eq(assembled(sc, st, SCHEMA_FETCH_ALL, p, &sp),
                 root->n_tok + plan->n_tok + miami->n_tok + beach->n_tok);
    schema_prompt_free(&sp);
    schema_unref(sc);

    /* nested modules after all of the text: exact to the end, the last token computed */
    sc = compile_ok("<schema name=\"nest\">Intro.<module name=\"a\">Alpha<module name=\"b\"> "
                    "beta</module></module></schema>");
    cache_store_close(st);
    st = store_of(sc, -1);
    int r = sc->nodes[0].n_tok, a = sc->nodes[1].n_tok, b = sc->nodes[2].n_tok;
    cr_assert_eq(exact_tokens(sc, st, "<prompt schema=\"nest\"><a><b/></a> Why?</prompt>"),
                 r + a + b);
    cr_assert_eq(exact_tokens(sc, st, "<prompt schema=\"nest\"><a><b/></a></prompt>"),
                 r + a + b - 1, "the last token is computed, for its logits");
    cr_assert_eq(exact_tokens(sc, st, "<prompt schema=\"nest\"><a/> Why?</prompt>"), r + a);
    schema_unref(sc);

    /* siblings, and text after a module: neither saw the module before it */
    sc = compile_ok("<schema name=\"sib\">Intro.<module name=\"a\">Alpha.</module><module "
                    "name=\"b\">Beta.</module> Outro.</schema>");
    cache_store_close(st);
    st = store_of(sc, -1);
    r = sc->nodes[0].n_tok - n_tokens(" Outro.");
    a = sc->nodes[1].n_tok;
    cr_assert_eq(exact_tokens(sc, st, "<prompt schema=\"sib\"><a/><b/> Why?</prompt>"), r + a);
    cr_assert_eq(exact_tokens(sc, st, "<prompt schema=\"sib\"><b/> Why?</prompt>"), r);
    cache_store_close(st);
    /* a module past the prefix needs no record: b's are gone, a's prefix is still taken */
    st = store_of(sc, 2);
    cr_assert_eq(exact_tokens(sc, st, "<prompt schema=\"sib\"><a/><b/> Why?</prompt>"), r + a);
    cache_store_close(st);
    schema_unref(sc);
}

/* ---------------------------------------------------------------- the registry */

/* The compute callback of these tests: there is no engine, so it counts its calls and refuses. */
static int refuse(void *ud, schema_job *job, const schema_build *b, char *msg, size_t cap) {
    (void)b;
    atomic_fetch_add((atomic_int *)ud, 1);
    schema_job_free(job);
    snprintf(msg, cap, "no engine here");
    return -1;
}

static schema_registry *registry(cache_store *st, const char *dir, int max, atomic_int *calls) {
    schema_registry_opts o = {.m = g_m,
                              .store = st,
                              .chunk_tokens = 64,
                              .max_positions = 2047,
                              .max_schemas = max,
                              .dir = dir,
                              .compute = refuse,
                              .compute_ud = calls};
    kv_error err = {{0}};
    schema_registry *g = schema_registry_create(&o, &err);
    cr_assert_not_null(g, "%s", err.msg);
    return g;
}

static schema_add_result add(schema_registry *g, const char *src, kv_error *err) {
    schema_info in;
    schema_add_result r = schema_registry_add(g, &g_ns, src, strlen(src), &in, err);
    schema_info_free(&in);
    return r;
}

/* name once the builder is done with it (up to 10 s). */
static schema_info settled(schema_registry *g, const char *name) {
    schema_info in = {0};
    for (int i = 0; i < 1000; i++) {
        cr_assert(schema_registry_get(g, &g_ns, name, &in), "'%s' is registered", name);
        if (in.status != SCHEMA_BUILDING) break;
        schema_info_free(&in);
        usleep(10 * 1000);
    }
    cr_assert_neq(in.status, SCHEMA_BUILDING, "'%s' is still building", name);
    return in;
}

static int listed(schema_registry *g, const cache_key *ns) {
    schema_info *v;
    int n;
    cr_assert_eq(schema_registry_list(g, ns, &v, &n), 0);
    schema_info_list_free(v, n);
    return n;
}

Test(schema, stored_records_make_a_schema_ready_without_computing) {
    schema *sc = compile_ok(TRAVEL);
    cache_store *st = store_of(sc, -1);
    atomic_int calls = 0;
    schema_registry *g = registry(st, NULL, 8, &calls);
    kv_error err = {{0}};
    cr_assert_eq(add(g, TRAVEL, &err), SCHEMA_ADD_NEW, "%s", err.msg);
    schema_info in = settled(g, "travel");
    cr_assert_eq(in.status, SCHEMA_READY, "%s", in.error);
    cr_assert_eq(in.done_tokens, sc->own_tokens);
    cr_assert_eq(atomic_load(&calls), 0, "every node's records were stored");
    schema_info_free(&in);
    cr_assert_eq(add(g, TRAVEL, &err), SCHEMA_ADD_SAME);

    /* in its namespace only, until deleted */
    cache_key other;
    cache_namespace(NULL, 0, "other", &other);
    cr_assert_eq(listed(g, &g_ns), 1);
    cr_assert_eq(listed(g, &other), 0);
    cr_assert_not(schema_registry_get(g, &other, "travel", &in));
    cr_assert(schema_registry_delete(g, &g_ns, "travel"));
    cr_assert_not(schema_registry_delete(g, &g_ns, "travel"));
    cr_assert_not(schema_registry_get(g, &g_ns, "travel", &in));
    cr_assert_eq(listed(g, &g_ns), 0);
    schema_registry_destroy(g);
    cache_store_close(st);
    schema_unref(sc);
}

Test(schema, a_schema_that_cannot_be_computed_fails_with_the_reason) {
    schema *sc = compile_ok(TRAVEL);
    cache_store *st = store_of(sc, 0); /* the schema's text is not stored */
    atomic_int calls = 0;
    schema_registry *g = registry(st, NULL, 1, &calls);
    kv_error err = {{0}};
    cr_assert_eq(add(g, TRAVEL, &err), SCHEMA_ADD_NEW, "%s", err.msg);
    schema_info in = settled(g, "travel");
    cr_assert_eq(in.status, SCHEMA_FAILED);
    cr_assert_str_eq(in.error, "no engine here");
    cr_assert_eq(atomic_load(&calls), 1);
    schema_info_free(&in);

    /* refused: a source that does not compile, one schema past --schema-max */
    cr_assert_eq(
        add(g, "<schema name=\"bad\"><module name=\"a\"/><module name=\"a\"/></schema>", &err),
        SCHEMA_ADD_INVALID);
    cr_assert_eq(add(g, "<schema name=\"more\">More.</schema>", &err), SCHEMA_ADD_FULL);
    cr_assert(strstr(err.msg, "1 schemas are registered"), "%s", err.msg);
    schema_registry_destroy(g);
    cache_store_close(st);
    schema_unref(sc);
}

Test(schema, definitions_come_back_from_the_directory_until_deleted) {
    schema *sc = compile_ok(TRAVEL);
    cache_store *st = store_of(sc, -1);
    char *dir = tmpdir_create("schemas");
    atomic_int calls = 0;
    schema_registry *g = registry(st, dir, 8, &calls);
    schema_registry *peer = registry(st, dir, 8, &calls); /* another instance on the directory */
    kv_error err = {{0}};
    cr_assert_eq(add(g, TRAVEL, &err), SCHEMA_ADD_NEW, "%s", err.msg);
    /* the peer finds it once it is named */
    cr_assert_eq(listed(peer, &g_ns), 0);
    schema_info in;
    cr_assert(schema_registry_get(peer, &g_ns, "travel", &in));
    schema_info_free(&in);
    schema_registry_destroy(peer);
    /* a restart loads it */
    schema_registry_destroy(g);
    g = registry(st, dir, 8, &calls);
    cr_assert_eq(listed(g, &g_ns), 1);
    cr_assert(schema_registry_delete(g, &g_ns, "travel"));
    schema_registry_destroy(g);
    g = registry(st, dir, 8, &calls);
    cr_assert_eq(listed(g, &g_ns), 0);
    schema_registry_destroy(g);
    cache_store_close(st);
    free(dir);
    schema_unref(sc);
}
