/* Tool format tests, per format: the parser reads the template's own rendering of calls (from the
 * goldens) into the calls the conversation holds, the same whether the text comes whole, cut at
 * any byte or fed a few bytes at a time; the grammar accepts that rendering and refuses near
 * misses; and Mistral's call ids, the generic format's prompt text. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/chat/chat.h"
#include "model/grammar/grammar.h"
#include "tests/unit/byte_vocab.h"
#include "tests/unit/chat_golden.h"

/* ---------------------------------------------------------------- helpers */

/* Where a format's calls stand in a rendered conversation: after `before` (which the answer
 * text continues from `skip` bytes in), up to `after`. */
typedef struct answer_site {
    chat_tool_format f;
    const char *golden;
    const char *before;
    size_t skip;
    const char *after;
} answer_site;

static const answer_site SITES[] = {
    {CHAT_TOOLS_HERMES, "qwen2.5", "<|im_start|>assistant\n<tool_call>", 22, "<|im_end|>"},
    {CHAT_TOOLS_LLAMA3, "llama3.1", "<|end_header_id|>\n\n{\"name\"", 19, "<|eot_id|>"},
    {CHAT_TOOLS_MISTRAL, "mistral-nemo", "[TOOL_CALLS]", 0, "</s>"},
    {CHAT_TOOLS_MISTRAL_V3, "mistral-large-2407", "[TOOL_CALLS]", 0, "</s>"},
    {CHAT_TOOLS_MISTRAL_V7, "mistral-small-3.2", "[TOOL_CALLS]", 0, "</s>"},
};

/* The first assistant call turn's text in the golden case `name`, malloc'd. */
static char *golden_answer(const answer_site *site, const char *name) {
    json_t *doc = golden_chat_load(site->golden);
    json_t *c = golden_chat_case(doc, name);
    cr_assert_not_null(c, "%s: no case %s", site->golden, name);
    const char *text = json_string_value(json_object_get(c, "expected"));
    cr_assert_not_null(text, "%s/%s has no rendering", site->golden, name);
    const char *a = strstr(text, site->before);
    cr_assert_not_null(a, "%s/%s: no call turn", site->golden, name);
    a += site->skip;
    const char *z = strstr(a, site->after);
    cr_assert_not_null(z);
    char *out = strndup(a, (size_t)(z - a));
    json_decref(doc);
    return out;
}

/* The calls an answer parses into, as "name(arguments)" lines, and whether they are complete;
 * text is fed in pieces of `step` bytes (each time the whole text so far, as a stream does), or
 * with step 0 cut once at `cut`. */
typedef struct parsed {
    char out[4096]; /* [index:name]arguments..., {content}text */
    bool in_content;
    bool complete;
    int n_calls;
} parsed;

static void feed(chat_tool_parser *p, const char *text, size_t have, bool final, parsed *r,
                 size_t *n) {
    chat_tool_event ev[4];
    int k;
    do {
        k = chat_tools_parse(p, text, have, final, ev, 4);
        for (int i = 0; i < k; i++) {
            const chat_tool_event *e = &ev[i];
            cr_assert(e->s >= text && e->s + e->n <= text + have, "event outside the text");
            char *o = r->out + *n;
            size_t cap = sizeof r->out - *n;
            if (e->kind == CHAT_TOOL_EVENT_CALL)
                *n += (size_t)snprintf(o, cap, "[%d:%.*s]", e->index, (int)e->n, e->s);
            else if (e->kind == CHAT_TOOL_EVENT_CONTENT)
                *n += (size_t)snprintf(o, cap, "%s%.*s", r->in_content ? "" : "{content}",
                                       (int)e->n, e->s);
            else
                *n += (size_t)snprintf(o, cap, "%.*s", (int)e->n, e->s);
            cr_assert_lt(*n, sizeof r->out);
            r->in_content = e->kind == CHAT_TOOL_EVENT_CONTENT;
        }
    } while (k == 4);
}

static parsed parse_pieces(chat_tool_format f, const char *text, size_t step, size_t cut) {
    parsed r;
    memset(&r, 0, sizeof r);
    chat_tool_parser p;
    chat_tool_parser_init(&p, f);
    size_t len = strlen(text), n = 0;
    if (step == 0) {
        feed(&p, text, cut, false, &r, &n);
    } else {
        for (size_t have = step; have < len; have += step) feed(&p, text, have, false, &r, &n);
    }
    feed(&p, text, len, true, &r, &n);
    r.complete = p.mode == 2 && p.complete;
    r.n_calls = p.n_calls;
    return r;
}

/* The answer parses the same whole, cut at every byte, and fed 1 to 7 bytes at a time. */
static parsed parse_every_way(chat_tool_format f, const char *text) {
    parsed whole = parse_pieces(f, text, 0, 0);
    for (size_t cut = 0; cut <= strlen(text); cut++) {
        parsed part = parse_pieces(f, text, 0, cut);
        cr_assert_str_eq(part.out, whole.out, "%s cut at %zu", chat_tools_format_name(f), cut);
        cr_assert_eq(part.complete, whole.complete);
    }
    for (size_t step = 1; step < 8; step++) {
        parsed part = parse_pieces(f, text, step, 0);
        cr_assert_str_eq(part.out, whole.out, "%s in pieces of %zu", chat_tools_format_name(f),
                         step);
        cr_assert_eq(part.complete, whole.complete);
    }
    return whole;
}

/* Checks parsed calls against the golden's: the same names in order, arguments equal as JSON. */
static void check_calls(const answer_site *site, const char *name, const parsed *got) {
    json_t *doc = golden_chat_load(site->golden);
    json_t *c = golden_chat_case(doc, name);
    size_t i;
    json_t *m, *calls = NULL;
    json_array_foreach(json_object_get(c, "messages"), i, m) {
        if ((calls = json_object_get(m, "tool_calls"))) break;
    }
    cr_assert_not_null(calls);
    cr_assert_eq((size_t)got->n_calls, json_array_size(calls), "%s/%s: %d calls", site->golden,
                 name, got->n_calls);
    const char *p = got->out;
    size_t k;
    json_t *tc;
    json_array_foreach(calls, k, tc) {
        json_t *fn = json_object_get(tc, "function");
        char head[96], next[96] = "";
        snprintf(head, sizeof head, "[%zu:%s]", k, json_string_value(json_object_get(fn, "name")));
        cr_assert(!strncmp(p, head, strlen(head)), "%s/%s: [%s] does not start with %s",
                  site->golden, name, p, head);
        p += strlen(head);
        json_t *after = json_array_get(calls, k + 1);
        if (after)
            snprintf(
                next, sizeof next, "[%zu:%s]", k + 1,
                json_string_value(json_object_get(json_object_get(after, "function"), "name")));
        const char *end = *next ? strstr(p, next) : p + strlen(p);
        cr_assert_not_null(end);
        char *args = strndup(p, (size_t)(end - p));
        json_error_t je;
        json_t *v = json_loads(args, 0, &je);
        cr_assert_not_null(v, "%s/%s: arguments [%s]: %s", site->golden, name, args, je.text);
        cr_assert(json_equal(v, json_object_get(fn, "arguments")), "%s/%s: arguments [%s]",
                  site->golden, name, args);
        json_decref(v);
        free(args);
        p = end;
    }
    cr_assert_str_eq(p, "", "%s/%s: left over", site->golden, name);
    json_decref(doc);
}

/* ---------------------------------------------------------------- parsing */

Test(chat_tools, parses_the_templates_calls_in_any_pieces) {
    const char *cases[] = {"tools_call_turn", "tools_arguments_escaped", "tools_parallel",
                           "tools_three_parallel"};
    for (size_t s = 0; s < sizeof SITES / sizeof SITES[0]; s++) {
        for (size_t i = 0; i < 4; i++) {
            json_t *doc = golden_chat_load(SITES[s].golden);
            bool rendered = json_object_get(golden_chat_case(doc, cases[i]), "expected");
            json_decref(doc);
            if (!rendered) continue; /* Llama 3.1's template refuses parallel calls */
            char *text = golden_answer(&SITES[s], cases[i]);
            parsed got = parse_every_way(SITES[s].f, text);
            cr_assert(got.complete, "%s/%s: [%s] -> [%s] is not complete", SITES[s].golden,
                      cases[i], text, got.out);
            check_calls(&SITES[s], cases[i], &got);
            free(text);
        }
    }
}

Test(chat_tools, generic_calls_in_any_pieces) {
    const char *calls =
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"N\xc3\xa9"
        "a\"}}</tool_call>\n<tool_call>{\"name\": \"ping\", \"arguments\": "
        "{}}</tool_call>";
    parsed got = parse_every_way(CHAT_TOOLS_GENERIC, calls);
    cr_assert(got.complete);
    cr_assert_str_eq(got.out, "[0:get_weather]{\"city\": \"N\xc3\xa9"
                              "a\"}[1:ping]{}");
}

/* Text that is not (or stops being) calls: content from where the syntax was left. */
Test(chat_tools, near_misses_are_content) {
    static const struct {
        chat_tool_format f;
        const char *text, *want;
        bool complete;
    } cases[] = {
        {CHAT_TOOLS_HERMES, "Sunny, 20 degrees.", "{content}Sunny, 20 degrees.", false},
        {CHAT_TOOLS_HERMES, "<tool_call>{\"name\": \"f\"", "{content}<tool_call>{\"name\": \"f\"",
         false},
        {CHAT_TOOLS_HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}</tool_call>",
         "[0:f]{}{content}}</tool_call>", false},
        /* a call cut short: arguments so far, never complete */
        {CHAT_TOOLS_HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, ",
         "[0:f]{\"a\": [1, ", false},
        /* a separator with no call after it */
        {CHAT_TOOLS_HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n",
         "[0:f]{}", false},
        {CHAT_TOOLS_LLAMA3, "{\"name\": \"f\", \"parameters\": {\"x\": \"}\"}}",
         "[0:f]{\"x\": \"}\"}", true},
        /* Llama 3.1 writes one call per turn */
        {CHAT_TOOLS_LLAMA3, "{\"name\": \"f\", \"parameters\": {}}\n{", "[0:f]{}{content}\n{",
         false},
        {CHAT_TOOLS_LLAMA3, "{\"name\": \"f\", \"arguments\": {}}",
         "{content}{\"name\": \"f\", \"arguments\": {}}", false},
        {CHAT_TOOLS_LLAMA3, "{\"name\": \"f\", \"parameters\": 42}", "[0:f]{content}42}", false},
        /* Mistral: the closing bracket is owed; the id must be 9 alphanumerics */
        {CHAT_TOOLS_MISTRAL,
         "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}, \"id\": \"abcdefghi\"}", "[0:f]{}",
         false},
        {CHAT_TOOLS_MISTRAL,
         "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}, \"id\": \"abc_efghi\"}]",
         "[0:f]{}{content}abc_efghi\"}]", false},
        {CHAT_TOOLS_MISTRAL,
         "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}, \"id\": \"abcdefghi\"}]", "[0:f]{}",
         true},
        {CHAT_TOOLS_MISTRAL, "[INST]", "{content}[INST]", false},
        /* Mistral v3: a space after [TOOL_CALLS]; Nemo's spelling is not its */
        {CHAT_TOOLS_MISTRAL_V3,
         "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}, \"id\": \"abcdefghi\"}]", "[0:f]{}",
         true},
        {CHAT_TOOLS_MISTRAL_V3,
         "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}, \"id\": \"abcdefghi\"}]",
         "{content}[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}, \"id\": \"abcdefghi\"}]",
         false},
        /* Mistral Small 3.2: each call opens with [TOOL_CALLS], its id before its arguments;
         * nothing is owed after the last one */
        {CHAT_TOOLS_MISTRAL_V7, "[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{}", "[0:f]{}", true},
        {CHAT_TOOLS_MISTRAL_V7,
         "[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{}[TOOL_CALLS]g[CALL_ID]abcdefghj[ARGS]{\"a\": 1}",
         "[0:f]{}[1:g]{\"a\": 1}", true},
        {CHAT_TOOLS_MISTRAL_V7, "[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{}\n", "[0:f]{}{content}\n",
         false},
        {CHAT_TOOLS_MISTRAL_V7, "[TOOL_CALLS]f[CALL_ID]abc_efghi[ARGS]{}",
         "{content}[TOOL_CALLS]f[CALL_ID]abc_efghi[ARGS]{}", false},
        {CHAT_TOOLS_MISTRAL_V7, "[TOOL_CALLS]f[CALL_ID]abcdefgh[ARGS]{}",
         "{content}[TOOL_CALLS]f[CALL_ID]abcdefgh[ARGS]{}", false},
        /* Devstral's spelling, without the id, is not this format */
        {CHAT_TOOLS_MISTRAL_V7, "[TOOL_CALLS]f[ARGS]{}", "{content}[TOOL_CALLS]f[ARGS]{}", false},
        {CHAT_TOOLS_MISTRAL_V7, "[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{\"a\": [", "[0:f]{\"a\": [",
         false},
        {CHAT_TOOLS_GENERIC, "", "", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        parsed got = parse_every_way(cases[i].f, cases[i].text);
        cr_assert_str_eq(got.out, cases[i].want, "case %zu: [%s]", i, got.out);
        cr_assert_eq(got.complete, cases[i].complete, "case %zu", i);
    }
}

/* ---------------------------------------------------------------- grammar */

static gmatch *tools_match(chat_tool_format f, const golden_conv *conv, chat_tool_choice choice,
                           const char *named, bool parallel, grammar **g, grammar_vocab *v) {
    kv_error err = {{0}};
    char *src = chat_tools_gbnf(f, conv->tools, conv->n_tools, choice, named, parallel, &err);
    cr_assert_not_null(src, "%s", err.msg);
    *g = grammar_parse(src, strlen(src), &err);
    cr_assert_not_null(*g, "%s\n%s", err.msg, src);
    free(src);
    gmatch *m = gmatch_create(*g, v, &err);
    cr_assert_not_null(m, "%s", err.msg);
    return m;
}

static bool matches(gmatch *m, const char *text) {
    int32_t s = gmatch_accept_bytes(m, gmatch_start(m), text, strlen(text));
    return s >= 0 && gmatch_can_end(m, s);
}

/* Replaces the first `from` in text with `to` (malloc'd). */
static char *replace(const char *text, const char *from, const char *to) {
    const char *at = strstr(text, from);
    cr_assert_not_null(at, "[%s] has no [%s]", text, from);
    size_t a = (size_t)(at - text), lf = strlen(from), lt = strlen(to), n = strlen(text);
    char *out = malloc(n - lf + lt + 1);
    memcpy(out, text, a);
    memcpy(out + a, to, lt);
    memcpy(out + a + lt, at + lf, n - a - lf + 1);
    return out;
}

Test(chat_tools, grammar_accepts_the_templates_calls) {
    grammar_vocab *v = byte_vocab_create(NULL, 0);
    for (size_t s = 0; s < sizeof SITES / sizeof SITES[0]; s++) {
        const answer_site *site = &SITES[s];
        json_t *doc = golden_chat_load(site->golden);
        golden_conv conv;
        golden_conv_load(golden_chat_case(doc, "tools_parallel"), &conv);
        grammar *g, *g1, *gn, *ga;
        gmatch *m = tools_match(site->f, &conv, CHAT_TOOL_REQUIRED, NULL, true, &g, v);
        gmatch *m1 = tools_match(site->f, &conv, CHAT_TOOL_REQUIRED, NULL, false, &g1, v);
        gmatch *mn = tools_match(site->f, &conv, CHAT_TOOL_NAMED, "ping", true, &gn, v);
        gmatch *ma = tools_match(site->f, &conv, CHAT_TOOL_AUTO, NULL, true, &ga, v);

        char *one = golden_answer(site, "tools_call_turn");
        char *escaped = golden_answer(site, "tools_arguments_escaped");
        cr_assert(matches(m, one), "%s: [%s]", site->golden, one);
        cr_assert(matches(m, escaped), "%s: [%s]", site->golden, escaped);
        cr_assert(matches(m1, one));
        cr_assert(matches(ma, one));
        cr_assert_not(matches(mn, one), "named ping: a get_weather call");
        cr_assert(matches(ma, "It is sunny."));
        cr_assert_not(matches(m, "It is sunny."));
        /* near misses: compact JSON, a wrong key, an argument outside the schema, a cut */
        char *compact = replace(one, "\"city\": ", "\"city\":");
        char *unit = replace(one, "celsius", "kelvin");
        char *key = site->f == CHAT_TOOLS_MISTRAL_V7 ? replace(one, "[ARGS]", "[ARG]")
                                                     : replace(one, "\"name\": ", "\"nam\": ");
        cr_assert_not(matches(m, compact), "%s: [%s]", site->golden, compact);
        cr_assert_not(matches(m, unit), "%s: [%s]", site->golden, unit);
        cr_assert_not(matches(m, key), "%s: [%s]", site->golden, key);
        one[strlen(one) - 1] = '\0';
        cr_assert_not(matches(m, one), "%s: cut [%s]", site->golden, one);
        free(compact);
        free(unit);
        free(key);

        json_t *par = golden_chat_case(doc, "tools_parallel");
        if (json_object_get(par, "expected")) {
            char *two = golden_answer(site, "tools_parallel");
            cr_assert(matches(m, two), "%s: [%s]", site->golden, two);
            cr_assert_not(matches(m1, two), "%s: parallel_tool_calls false", site->golden);
            cr_assert_not(matches(mn, two), "%s: named", site->golden);
            free(two);
        } else {
            /* Llama 3.1: one call, whatever parallel_tool_calls says */
            cr_assert_eq(site->f, CHAT_TOOLS_LLAMA3);
            char *two = malloc(2 * strlen(escaped) + 2);
            sprintf(two, "%s\n%s", escaped, escaped);
            cr_assert_not(matches(m, two));
            free(two);
        }
        if (site->f == CHAT_TOOLS_MISTRAL || site->f == CHAT_TOOLS_MISTRAL_V3 ||
            site->f == CHAT_TOOLS_MISTRAL_V7) {
            char *bad_id = replace(escaped, "Zz9Yy8Xx7", "Zz9Yy8Xx_");
            char *long_id = replace(escaped, "Zz9Yy8Xx7", "Zz9Yy8Xx7a");
            cr_assert_not(matches(m, bad_id));
            cr_assert_not(matches(m, long_id));
            free(bad_id);
            free(long_id);
        }
        free(one);
        free(escaped);
        gmatch_destroy(m);
        gmatch_destroy(m1);
        gmatch_destroy(mn);
        gmatch_destroy(ma);
        grammar_destroy(g);
        grammar_destroy(g1);
        grammar_destroy(gn);
        grammar_destroy(ga);
        golden_conv_free(&conv);
        json_decref(doc);
    }
    grammar_vocab_destroy(v);
}

/* The generic format: what chat_render writes for a call turn is what its grammar accepts. */
Test(chat_tools, generic_grammar_accepts_rendered_calls) {
    json_t *doc = golden_chat_load("qwen2.5"); /* its conversations; rendered as plain ChatML */
    golden_conv conv;
    golden_conv_load(golden_chat_case(doc, "tools_parallel"), &conv);
    chat_template t;
    cr_assert_eq(chat_template_from_name("chatml", &t), 0);
    kv_error err = {{0}};
    char *text =
        chat_render(&t, conv.msgs, conv.n_msgs, conv.tools, conv.n_tools, true, NULL, &err);
    cr_assert_not_null(text, "%s", err.msg);
    cr_assert(strstr(text, "<|im_start|>system\nYou are a terse assistant.\n\nYou can call these "
                           "functions. Each is given as JSON with the JSON Schema of its "
                           "arguments:\n{\"name\":\"get_weather\",\"description\":"),
              "%s", text);
    /* the result is named after the call its id answers */
    cr_assert(strstr(text, "<|im_start|>user\n<tool_response>{\"name\": \"get_weather\", "
                           "\"content\": \"18 degrees and sunny\"}</tool_response><|im_end|>\n"),
              "%s", text);
    const char *a = strstr(text, "<|im_start|>assistant\n<tool_call>");
    cr_assert_not_null(a, "%s", text);
    a += strlen("<|im_start|>assistant\n");
    char *answer = strndup(a, (size_t)(strstr(a, "<|im_end|>") - a));
    cr_assert_str_eq(answer,
                     "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                     "\"Paris\", \"unit\": \"celsius\"}}</tool_call>\n<tool_call>{\"name\": "
                     "\"ping\", \"arguments\": {}}</tool_call>");
    grammar_vocab *v = byte_vocab_create(NULL, 0);
    grammar *g;
    gmatch *m = tools_match(CHAT_TOOLS_GENERIC, &conv, CHAT_TOOL_REQUIRED, NULL, true, &g, v);
    cr_assert(matches(m, answer));
    parsed got = parse_every_way(CHAT_TOOLS_GENERIC, answer);
    cr_assert(got.complete);
    cr_assert_eq(got.n_calls, 2);
    gmatch_destroy(m);
    grammar_destroy(g);
    grammar_vocab_destroy(v);
    cr_assert_null(chat_tools_gbnf(CHAT_TOOLS_GENERIC, conv.tools, conv.n_tools, CHAT_TOOL_NAMED,
                                   "nope", false, &err));
    cr_assert(strstr(err.msg, "'nope'"));
    free(answer);
    free(text);
    chat_template_free(&t);
    golden_conv_free(&conv);
    json_decref(doc);
}

/* ---------------------------------------------------------------- rendering details */

Test(chat_tools, mistral_ids) {
    char id[10];
    chat_tools_mistral_id("a1B2c3D4e", id);
    cr_assert_str_eq(id, "a1B2c3D4e", "a valid id is kept");
    const char *others[] = {
        "call_0123456789abcdef", "a1B2c3D4", "a1B2c3D4e5", "a1B2c3D4_", "", NULL};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        chat_tools_mistral_id(others[i], id);
        cr_assert_eq(strlen(id), 9);
        for (int k = 0; k < 9; k++)
            cr_assert((id[k] >= '0' && id[k] <= '9') || (id[k] >= 'a' && id[k] <= 'z') ||
                      (id[k] >= 'A' && id[k] <= 'Z'));
        char again[10];
        chat_tools_mistral_id(others[i], again);
        cr_assert_str_eq(id, again, "the mapping is deterministic");
    }
    char x[10], y[10];
    chat_tools_mistral_id("call_1", x);
    chat_tools_mistral_id("call_2", y);
    cr_assert_str_neq(x, y);

    /* a call and the result that answers it carry the same mapped id */
    chat_template t;
    cr_assert_eq(chat_template_from_name("mistral-nemo", &t), 0);
    const chat_tool_call call = {.id = "call_1", .name = "f", .arguments = "{\"a\":[1,2.50]}"};
    const chat_message msgs[] = {
        {.role = "user", .content = "q"},
        {.role = "assistant", .tool_calls = &call, .n_tool_calls = 1},
        {.role = "tool", .content = "r", .tool_call_id = "call_1"},
    };
    kv_error err = {{0}};
    char *text = chat_render(&t, msgs, 3, NULL, 0, true, "<s>", &err);
    cr_assert_not_null(text, "%s", err.msg);
    char want[256];
    snprintf(want, sizeof want,
             "<s>[INST]q[/INST][TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5]}, "
             "\"id\": \"%s\"}]</s>[TOOL_RESULTS]{\"content\": r, \"call_id\": \"%s\"}"
             "[/TOOL_RESULTS]",
             x, x);
    cr_assert_str_eq(text, want);
    free(text);
}

Test(chat_tools, render_errors) {
    chat_template t;
    kv_error err = {{0}};
    const chat_tool_call bad = {.name = "f", .arguments = "{nope"};
    const chat_tool_call two[] = {{.name = "f"}, {.name = "g"}};
    const chat_message bad_args[] = {{.role = "user", .content = "q"},
                                     {.role = "assistant", .tool_calls = &bad, .n_tool_calls = 1}};
    const chat_message parallel[] = {{.role = "user", .content = "q"},
                                     {.role = "assistant", .tool_calls = two, .n_tool_calls = 2}};
    const char *names[] = {"chatml",         "qwen2.5",    "llama3.1",   "mistral-nemo",
                           "llama2",         "mistral-v3", "mistral-v1", "mistral-v7-tekken",
                           "mistral-legacy", "mistral-v7"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        cr_assert_eq(chat_template_from_name(names[i], &t), 0);
        err.msg[0] = '\0';
        cr_assert_null(chat_render(&t, bad_args, 2, NULL, 0, true, "", &err), "%s", names[i]);
        cr_assert(strstr(err.msg, "not JSON"), "%s: %s", names[i], err.msg);
        char *ok = chat_render(&t, parallel, 2, NULL, 0, true, "", &err);
        cr_assert_eq(ok == NULL, !strcmp(names[i], "llama3.1"), "%s", names[i]);
        free(ok);
        chat_template_free(&t);
    }
    /* Llama 3.1 lists tools in the first user message: a conversation needs one */
    cr_assert_eq(chat_template_from_name("llama3.1", &t), 0);
    const chat_tool tool = {.name = "f"};
    const chat_message sys[] = {{.role = "system", .content = "s"}};
    cr_assert_null(chat_render(&t, sys, 1, &tool, 1, true, "", &err));
    cr_assert(strstr(err.msg, "first user message"), "%s", err.msg);
}

/* ---------------------------------------------------------------- repeated calls */

typedef struct guarded {
    int repeat;     /* the scan's verdict at the end (1: a call repeated an earlier one) */
    size_t cut;     /* where the answer was cut */
    size_t release; /* the most ever released */
    size_t fed;     /* bytes fed when it ended */
} guarded;

/* Feeds text to a guard `step` bytes at a time, as the engine does token by token; checks that
 * what is released never shrinks; stops at a repeat. */
static guarded guard_pieces(chat_tool_format f, const char *text, size_t step) {
    chat_tool_guard g;
    chat_tool_guard_init(&g, f);
    guarded r = {0};
    size_t len = strlen(text);
    for (size_t have = 0; have < len;) {
        have = have + step < len ? have + step : len;
        size_t release, cut;
        r.repeat = chat_tool_guard_scan(&g, text, have, &release, &cut);
        cr_assert_geq(r.repeat, 0);
        cr_assert_geq(release, r.release, "released text is never taken back");
        cr_assert_leq(release, have);
        r.release = release;
        r.fed = have;
        if (r.repeat) {
            r.cut = cut;
            break;
        }
    }
    chat_tool_guard_free(&g);
    return r;
}

/* The answer cut where the guard said, with the format's closing: complete calls, the first
 * n_calls of text's. */
static void check_cut(chat_tool_format f, const char *text, size_t cut, int n_calls) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%.*s%s", (int)cut, text, chat_tools_closing(f));
    chat_tool_parser p;
    chat_tool_parser_init(&p, f);
    chat_tool_event ev[16];
    while (chat_tools_parse(&p, buf, strlen(buf), true, ev, 16) == 16) {
    }
    cr_assert(p.complete, "cut answer '%s' is complete calls", buf);
    cr_assert_eq(p.n_calls, n_calls, "'%s'", buf);
}

#define CALL_A "<tool_call>{\"name\": \"get\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>"
#define CALL_B "<tool_call>{\"name\": \"get\", \"arguments\": {\"city\": \"Rome\"}}</tool_call>"
#define CALL_C "<tool_call>{\"name\": \"put\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>"

Test(chat_tools, a_repeated_call_ends_the_answer_after_the_calls_before_it) {
    const char *text = CALL_A "\n" CALL_B "\n" CALL_A "\n" CALL_C;
    size_t two = strlen(CALL_A "\n" CALL_B);
    for (size_t step = 1; step <= 7; step++) {
        guarded r = guard_pieces(CHAT_TOOLS_GENERIC, text, step);
        cr_assert_eq(r.repeat, 1, "step %zu", step);
        cr_assert_eq(r.cut, two, "cut after the two calls before the repeat (step %zu)", step);
        cr_assert_leq(r.release, two, "the repeat was never released (step %zu)", step);
        cr_assert_lt(r.fed, strlen(text) - strlen(CALL_C), "it ends as soon as the repeat does");
        check_cut(CHAT_TOOLS_GENERIC, text, r.cut, 2);
    }
}

Test(chat_tools, calls_that_differ_are_released_as_soon_as_they_differ) {
    /* the same arguments under another name, another city under the same name */
    const char *text = CALL_A "\n" CALL_C "\n" CALL_B;
    guarded r = guard_pieces(CHAT_TOOLS_GENERIC, text, 1);
    cr_assert_eq(r.repeat, 0);
    cr_assert_eq(r.release, strlen(text));
    /* a second call is held back while it could still be the first one again */
    chat_tool_guard g;
    chat_tool_guard_init(&g, CHAT_TOOLS_GENERIC);
    const char *held = CALL_A "\n<tool_call>{\"name\": \"get\", \"arguments\": {\"city\": \"Pa";
    size_t release, cut;
    cr_assert_eq(chat_tool_guard_scan(&g, held, strlen(held), &release, &cut), 0);
    cr_assert_eq(release, strlen(CALL_A), "held from the end of the first call");
    const char *differs = CALL_A "\n<tool_call>{\"name\": \"get\", \"arguments\": {\"city\": \"Pas";
    cr_assert_eq(chat_tool_guard_scan(&g, differs, strlen(differs), &release, &cut), 0);
    cr_assert_eq(release, strlen(differs), "released once it differs");
    chat_tool_guard_free(&g);
    /* content is never held */
    r = guard_pieces(CHAT_TOOLS_GENERIC, "It is sunny. It is sunny.", 2);
    cr_assert_eq(r.repeat, 0);
    cr_assert_eq(r.release, strlen("It is sunny. It is sunny."));
}

Test(chat_tools, repeats_in_every_format_with_several_calls) {
    const struct {
        chat_tool_format f;
        const char *text;
        size_t cut; /* bytes of the calls before the repeat */
    } cases[] = {
        {CHAT_TOOLS_HERMES,
         "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n"
         "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>",
         strlen("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>")},
        /* Mistral's ids differ; the name and arguments decide, before the id is generated */
        {CHAT_TOOLS_MISTRAL,
         "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"id\": \"abcdefghi\"}, "
         "{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"id\": \"zzzzzzzzz\"}]",
         strlen(
             "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"id\": \"abcdefghi\"}")},
        {CHAT_TOOLS_MISTRAL_V3,
         "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}, \"id\": \"abcdefghi\"}, "
         "{\"name\": \"g\", \"arguments\": {}, \"id\": \"bcdefghij\"}, "
         "{\"name\": \"f\", \"arguments\": {}, \"id\": \"cdefghijk\"}]",
         strlen("[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}, \"id\": \"abcdefghi\"}, "
                "{\"name\": \"g\", \"arguments\": {}, \"id\": \"bcdefghij\"}")},
        {CHAT_TOOLS_MISTRAL_V7,
         "[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{\"a\": [1, 2]}"
         "[TOOL_CALLS]f[CALL_ID]bcdefghij[ARGS]{\"a\": [1, 2]}",
         strlen("[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{\"a\": [1, 2]}")},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (size_t step = 1; step <= 5; step += 4) {
            guarded r = guard_pieces(cases[i].f, cases[i].text, step);
            cr_assert_eq(r.repeat, 1, "%s step %zu", chat_tools_format_name(cases[i].f), step);
            cr_assert_eq(r.cut, cases[i].cut, "%s", chat_tools_format_name(cases[i].f));
            cr_assert_leq(r.release, r.cut);
            int n = cases[i].f == CHAT_TOOLS_MISTRAL_V3 ? 2 : 1;
            check_cut(cases[i].f, cases[i].text, r.cut, n);
        }
    }
}

/* ---------------------------------------------------------------- tool turns */

Test(chat_tools, tool_turns_answer_the_calls_right_before_them) {
    const chat_tool_call two[] = {{.id = "a", .name = "f"}, {.id = "b", .name = "f"}};
    const chat_message user = {.role = "user", .content = "q"};
    const chat_message calls = {.role = "assistant", .tool_calls = two, .n_tool_calls = 2};
    const chat_message ra = {.role = "tool", .content = "1", .tool_call_id = "a"};
    const chat_message rb = {.role = "tool", .content = "2", .tool_call_id = "b"};
    const chat_message rx = {.role = "tool", .content = "?", .tool_call_id = "x"};
    const chat_message no_id = {.role = "tool", .content = "?"};
    const struct {
        chat_message m[6];
        int n;
        chat_turn_check want;
    } cases[] = {
        {{user, calls, rb, ra, user}, 5, {CHAT_TURNS_OK, -1, -1, -1}},
        {{user, ra}, 2, {CHAT_TURNS_RESULT_WITHOUT_CALLS, 1, -1, -1}},
        {{ra, user}, 2, {CHAT_TURNS_RESULT_WITHOUT_CALLS, 0, -1, -1}},
        {{user, calls, ra, rb, user, rb}, 6, {CHAT_TURNS_RESULT_WITHOUT_CALLS, 5, -1, -1}},
        {{user, calls, ra, rx}, 4, {CHAT_TURNS_UNKNOWN_ID, 3, -1, -1}},
        {{user, calls, no_id}, 3, {CHAT_TURNS_UNKNOWN_ID, 2, -1, -1}},
        {{user, calls, rb, ra, rb}, 5, {CHAT_TURNS_ANSWERED_TWICE, 4, 1, 2}},
        {{user, calls, rb, user}, 4, {CHAT_TURNS_UNANSWERED, 1, 0, -1}},
        {{user, calls, ra}, 3, {CHAT_TURNS_UNANSWERED, 1, 1, -1}},
        {{user, calls}, 2, {CHAT_TURNS_UNANSWERED, 1, 0, -1}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        chat_turn_check got;
        cr_assert_eq(chat_check_tool_turns(cases[i].m, cases[i].n, &got), cases[i].want.problem,
                     "case %zu", i);
        cr_assert_eq(got.problem, cases[i].want.problem, "case %zu", i);
        cr_assert_eq(got.msg, cases[i].want.msg, "case %zu: msg %d", i, got.msg);
        cr_assert_eq(got.call, cases[i].want.call, "case %zu: call %d", i, got.call);
        cr_assert_eq(got.other, cases[i].want.other, "case %zu", i);
    }
}
