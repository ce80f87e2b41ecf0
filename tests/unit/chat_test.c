/* Chat template tests. The goldens (tests/golden/chat, from scripts/ref/make_chat_goldens.py) hold
 * each template's Jinja source and conversations rendered by the jinja2 package: detection must
 * recognise every source and chat_render must reproduce jinja2's text byte for byte. */
#include <criterion/criterion.h>
#include <glob.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "model/chat.h"
#include "model/grammar.h"

#define GOLDEN_GLOB "tests/golden/chat/*.json"

static json_t *golden_load(const char *path) {
    json_error_t jerr;
    json_t *doc = json_load_file(path, 0, &jerr);
    cr_assert_not_null(doc, "%s:%d: %s", path, jerr.line, jerr.text);
    return doc;
}

static const char *jstr(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    cr_assert(json_is_string(v), "missing string '%s'", key);
    return json_string_value(v);
}

static chat_template_kind kind_of_name(const char *name) {
    chat_template t;
    cr_assert_eq(chat_template_from_name(name, &t), 0, "unknown kind name %s", name);
    return t.kind;
}

/* Renders one golden case and compares it with jinja2's text (or its error). */
static void check_case(const char *file, const chat_template *t, const char *bos, json_t *c) {
    const char *name = jstr(c, "name");
    json_t *jm = json_object_get(c, "messages");
    cr_assert(json_is_array(jm));
    int n = (int)json_array_size(jm);
    chat_message *msgs = calloc((size_t)n + 1, sizeof *msgs);
    cr_assert_not_null(msgs);
    for (int i = 0; i < n; i++) {
        json_t *m = json_array_get(jm, (size_t)i);
        msgs[i].role = jstr(m, "role");
        msgs[i].content = jstr(m, "content");
    }
    bool gen = json_is_true(json_object_get(c, "add_generation_prompt"));
    kv_error err = {{0}};
    char *got = chat_render(t, msgs, n, gen, bos, &err);
    json_t *expected = json_object_get(c, "expected");
    if (expected) {
        cr_assert_not_null(got, "%s/%s: render failed: %s", file, name, err.msg);
        const char *want = json_string_value(expected);
        cr_assert_str_eq(got, want, "%s/%s:\n got: [%s]\nwant: [%s]", file, name, got, want);
    } else {
        cr_assert_null(got, "%s/%s: jinja2 raised (%s) but chat_render gave [%s]", file, name,
                       jstr(c, "error"), got);
        cr_assert_neq(err.msg[0], '\0', "%s/%s: no error message", file, name);
    }
    free(got);
    free(msgs);
}

Test(chat, goldens_match_jinja2) {
    glob_t g;
    cr_assert_eq(glob(GOLDEN_GLOB, 0, NULL, &g), 0, "no goldens at %s (run from the repo root)",
                 GOLDEN_GLOB);
    cr_assert_geq(g.gl_pathc, 5, "expected >= 5 golden templates, found %zu", g.gl_pathc);
    size_t n_cases = 0;
    for (size_t f = 0; f < g.gl_pathc; f++) {
        const char *path = g.gl_pathv[f];
        json_t *doc = golden_load(path);
        const char *src = jstr(doc, "template");
        chat_template t;
        chat_template_detect(src, strlen(src), &t);
        cr_assert_eq(t.kind, kind_of_name(jstr(doc, "kind")), "%s: detected %s, want %s", path,
                     chat_template_name(t.kind), jstr(doc, "kind"));
        json_t *ds = json_object_get(doc, "default_system");
        if (json_is_string(ds)) {
            cr_assert_not_null(t.default_system, "%s: default system not found", path);
            cr_assert_str_eq(t.default_system, json_string_value(ds), "%s", path);
        } else {
            cr_assert_null(t.default_system, "%s: unexpected default system [%s]", path,
                           t.default_system);
        }
        json_t *cases = json_object_get(doc, "cases");
        cr_assert_geq(json_array_size(cases), 10, "%s: fewer than 10 cases", path);
        for (size_t i = 0; i < json_array_size(cases); i++, n_cases++)
            check_case(path, &t, jstr(doc, "bos_token"), json_array_get(cases, i));
        chat_template_free(&t);
        json_decref(doc);
    }
    cr_log_info("%zu golden cases over %zu templates", n_cases, g.gl_pathc);
    globfree(&g);
}

/* ---------------------------------------------------------------- detection */

Test(chat, detect_unknown) {
    const char *gemma = "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + "
                        "message['role'] + '\\n' + message['content'] | trim + '<end_of_turn>\\n' "
                        "}}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}"
                        "{% endif %}";
    chat_template t;
    chat_template_detect(gemma, strlen(gemma), &t);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_UNKNOWN);
    cr_assert_null(t.default_system);
    chat_template_detect("", 0, &t);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_UNKNOWN);
    chat_template_detect(NULL, 0, &t);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_UNKNOWN);
    /* the length bounds the search: a marker past len does not count */
    const char *late = "hello <|im_start|>";
    chat_template_detect(late, 6, &t);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_UNKNOWN);
    cr_assert_str_eq(chat_template_name(CHAT_TEMPLATE_UNKNOWN), "unknown");
}

static char *default_system_of(const char *src) {
    chat_template t;
    chat_template_detect(src, strlen(src), &t);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_CHATML);
    return t.default_system;
}

Test(chat, default_system_extraction) {
    /* Jinja escapes in a double-quoted literal, including \u and \" */
    char *s = default_system_of("{{ \"<|im_start|>system\\nSay \\\"hi\\\" \\u00e9t\\u00e9\\t"
                                "ok<|im_end|>\\n\" }}{{ '<|im_start|>' }}");
    cr_assert_str_eq(s, "Say \"hi\" \xc3\xa9t\xc3\xa9\tok");
    free(s);
    /* a literal that only opens the system turn is not a default message */
    s = default_system_of("{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>' }}");
    cr_assert_null(s);
    /* raw template text, with CRLF normalised as Jinja does */
    s = default_system_of("{% if x %}<|im_start|>system\r\nPlain text.<|im_end|>\n{% endif %}");
    cr_assert_str_eq(s, "Plain text.");
    free(s);
    /* a string inside a comment is not part of the template */
    s = default_system_of("{# '<|im_start|>system\\nhidden<|im_end|>' #}{{ '<|im_start|>' }}");
    cr_assert_null(s);
    /* a '}}' inside a literal does not end the tag */
    s = default_system_of("{{ '}}' + '<|im_start|>system\\nA}}B<|im_end|>' }}");
    cr_assert_str_eq(s, "A}}B");
    free(s);
    /* unterminated literal and tag: no crash, nothing found */
    s = default_system_of("{{ '<|im_start|>system\\nnever closed");
    cr_assert_null(s);
}

Test(chat, from_name) {
    chat_template t;
    cr_assert_eq(chat_template_from_name("chatml", &t), 0);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_CHATML);
    cr_assert_null(t.default_system);
    cr_assert_eq(chat_template_from_name("llama3", &t), 0);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_LLAMA3);
    cr_assert_eq(chat_template_from_name("llama2", &t), 0);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_LLAMA2);
    cr_assert_eq(chat_template_from_name("mistral", &t), 0);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_LLAMA2);
    cr_assert_eq(chat_template_from_name("vicuna", &t), -1);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_UNKNOWN);
    cr_assert_eq(chat_template_from_name("", &t), -1);
    cr_assert_eq(chat_template_from_name(NULL, &t), -1);
    for (int k = CHAT_TEMPLATE_CHATML; k <= CHAT_TEMPLATE_LLAMA2; k++) {
        cr_assert_eq(chat_template_from_name(chat_template_name((chat_template_kind)k), &t), 0);
        cr_assert_eq((int)t.kind, k);
    }
}

/* ---------------------------------------------------------------- render errors */

Test(chat, render_errors) {
    chat_template t;
    kv_error err = {{0}};
    const chat_message bad_role[] = {{"user", "hi"}, {"tool", "{}"}};
    cr_assert_eq(chat_template_from_name("chatml", &t), 0);
    cr_assert_null(chat_render(&t, bad_role, 2, true, NULL, &err));
    cr_assert_not_null(strstr(err.msg, "tool"), "%s", err.msg);
    const chat_message null_role[] = {{NULL, "hi"}};
    cr_assert_null(chat_render(&t, null_role, 1, true, NULL, &err));
    cr_assert_null(chat_render(&t, NULL, 3, true, NULL, &err));
    cr_assert_null(chat_render(&t, bad_role, -1, true, NULL, &err));

    chat_template unknown = {CHAT_TEMPLATE_UNKNOWN, NULL};
    const chat_message ok[] = {{"user", "hi"}};
    err.msg[0] = '\0';
    cr_assert_null(chat_render(&unknown, ok, 1, true, NULL, &err));
    cr_assert_not_null(strstr(err.msg, "unknown chat template"), "%s", err.msg);

    /* Llama 2: a system message after the first turn (its template would drop it silently) */
    cr_assert_eq(chat_template_from_name("llama2", &t), 0);
    const chat_message mid_sys[] = {
        {"user", "a"}, {"assistant", "b"}, {"system", "c"}, {"user", "d"}};
    cr_assert_null(chat_render(&t, mid_sys, 4, true, "<s>", &err));
    cr_assert_not_null(strstr(err.msg, "system"), "%s", err.msg);
    const chat_message two_sys[] = {{"system", "a"}, {"system", "b"}};
    cr_assert_null(chat_render(&t, two_sys, 2, true, "<s>", &err));
}

Test(chat, render_null_content_and_bos) {
    chat_template t;
    kv_error err = {{0}};
    const chat_message m[] = {{"user", NULL}};
    cr_assert_eq(chat_template_from_name("llama3", &t), 0);
    char *out = chat_render(&t, m, 1, false, NULL, &err);
    cr_assert_not_null(out, "%s", err.msg);
    cr_assert_str_eq(out, "<|start_header_id|>user<|end_header_id|>\n\n<|eot_id|>");
    free(out);
    /* an empty conversation without a generation prompt is "" (not an error) */
    out = chat_render(&t, NULL, 0, false, NULL, &err);
    cr_assert_not_null(out, "%s", err.msg);
    cr_assert_str_eq(out, "");
    free(out);
}

Test(chat, smollm2_default_system_from_name_is_absent) {
    /* Named ChatML has no default system; detection from SmolLM2's source supplies it. */
    chat_template t;
    kv_error err = {{0}};
    cr_assert_eq(chat_template_from_name("chatml", &t), 0);
    const chat_message m[] = {{"user", "hi"}};
    char *out = chat_render(&t, m, 1, true, NULL, &err);
    cr_assert_str_eq(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    chat_template_free(&t);
}

Test(chat, strip_keeps_malformed_utf8_and_non_space) {
    chat_template t;
    kv_error err = {{0}};
    cr_assert_eq(chat_template_from_name("llama3", &t), 0);
    /* trailing lone continuation byte and a truncated 3-byte lead are not whitespace */
    const chat_message m[] = {{"user", " \x80x\xe3\x80 "}, {"assistant", "\xe2\x80\x83y\xe2\x80"}};
    char *out = chat_render(&t, m, 2, false, "", &err);
    cr_assert_not_null(out, "%s", err.msg);
    cr_assert_str_eq(out, "<|start_header_id|>user<|end_header_id|>\n\n\x80x\xe3\x80<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\ny\xe2\x80<|eot_id|>");
    free(out);
}

/* ---------------------------------------------------------------- tools */

static const chat_tool TOOLS[] = {
    {"get_weather", "Weather in a city",
     "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]"
     "}"},
    {"ping", NULL, NULL},
};

/* Calls and content recovered from text fed in pieces of `step` bytes. */
static void parse_in_steps(const char *text, size_t step, char *out, size_t cap, bool *complete) {
    chat_tool_parser p = {0};
    size_t len = strlen(text), n = 0;
    out[0] = '\0';
    for (size_t have = step < len ? step : len;; have = have + step < len ? have + step : len) {
        chat_tool_event ev[8];
        int k;
        while ((k = chat_tools_parse(&p, text, have, have == len, ev, 8)) > 0)
            for (int i = 0; i < k; i++)
                n += ev[i].kind == CHAT_TOOL_EVENT_CALL
                         ? (size_t)snprintf(out + n, cap - n, "[call %d: %.*s]", ev[i].index,
                                            (int)ev[i].n, ev[i].s)
                         : (size_t)snprintf(out + n, cap - n, "%.*s", (int)ev[i].n, ev[i].s);
        if (have == len) break;
    }
    *complete = p.mode == 2 && p.complete;
}

Test(chat_tools, parse_is_the_same_in_any_pieces) {
    const char *calls =
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"N\xc3\xa9"
        "a\"}}</tool_call>\n<tool_call>{\"name\": \"ping\", \"arguments\": "
        "{}}</tool_call>";
    char whole[512], part[512];
    bool c1, c2;
    parse_in_steps(calls, 1000, whole, sizeof whole, &c1);
    cr_assert(c1);
    cr_assert_str_eq(whole, "[call 0: get_weather]{\"city\": \"N\xc3\xa9"
                            "a\"}[call 1: ping]{}");
    for (size_t step = 1; step < 20; step++) {
        parse_in_steps(calls, step, part, sizeof part, &c2);
        cr_assert(c2);
        cr_assert_str_eq(part, whole, "in pieces of %zu bytes", step);
    }
    parse_in_steps("Sunny, 20 degrees.", 3, part, sizeof part, &c2);
    cr_assert_not(c2);
    cr_assert_str_eq(part, "Sunny, 20 degrees.");
    parse_in_steps("<tool_call>{\"name\": \"ping\", \"argu", 5, part, sizeof part, &c2);
    cr_assert_not(c2, "a call cut short is not complete");
}

Test(chat_tools, grammar_accepts_rendered_calls) {
    kv_error err = {{0}};
    char *g = chat_tools_gbnf(TOOLS, 2, CHAT_TOOL_REQUIRED, NULL, true, &err);
    cr_assert_not_null(g, "%s", err.msg);
    grammar *gr = grammar_parse(g, strlen(g), &err);
    cr_assert_not_null(gr, "%s\n%s", err.msg, g);
    char *call = chat_tools_render_call("get_weather", "{\"city\": \"Oslo\"}");
    cr_assert_str_eq(call, "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                           "\"Oslo\"}}</tool_call>");
    grammar_destroy(gr);
    free(call);
    free(g);
    cr_assert_null(chat_tools_gbnf(TOOLS, 2, CHAT_TOOL_NAMED, "nope", false, &err));
    cr_assert(strstr(err.msg, "'nope'"));
    char *sys = chat_tools_system(TOOLS, 2, &err);
    cr_assert(strstr(sys, "{\"name\":\"get_weather\",\"description\":\"Weather in a city\","));
    free(sys);
}
