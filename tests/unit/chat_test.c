/* Chat template tests. The goldens (tests/golden/chat, from scripts/ref/make_chat_goldens.py) hold
 * each template's Jinja source and conversations rendered by the jinja2 package, with tools,
 * calls and results for the templates that have a tool format: detection must recognise every
 * source and chat_render must reproduce jinja2's text byte for byte. */
#include <criterion/criterion.h>
#include <glob.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "model/chat/chat.h"
#include "model/grammar/grammar.h"
#include "tests/unit/chat_golden.h"

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

static chat_template template_of_name(const char *name) {
    chat_template t;
    cr_assert_eq(chat_template_from_name(name, &t), 0, "unknown kind name %s", name);
    return t;
}

/* Renders one golden case and compares it with jinja2's text (or its error). */
static void check_case(const char *file, const chat_template *t, const char *bos, json_t *c) {
    const char *name = jstr(c, "name");
    golden_conv conv;
    golden_conv_load(c, &conv);
    bool gen = json_is_true(json_object_get(c, "add_generation_prompt"));
    kv_error err = {{0}};
    char *got = chat_render(t, conv.msgs, conv.n_msgs, conv.tools, conv.n_tools, gen, bos, &err);
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
    golden_conv_free(&conv);
}

Test(chat, goldens_match_jinja2) {
    glob_t g;
    cr_assert_eq(glob(GOLDEN_GLOB, 0, NULL, &g), 0, "no goldens at %s (run from the repo root)",
                 GOLDEN_GLOB);
    cr_assert_geq(g.gl_pathc, 14, "expected >= 14 golden templates, found %zu", g.gl_pathc);
    size_t n_cases = 0, n_tool_cases = 0;
    for (size_t f = 0; f < g.gl_pathc; f++) {
        const char *path = g.gl_pathv[f];
        json_t *doc = golden_load(path);
        const char *src = jstr(doc, "template");
        chat_template t, want = template_of_name(jstr(doc, "kind"));
        chat_template_detect(src, strlen(src), &t);
        cr_assert_eq(t.kind, want.kind, "%s: detected %s, want %s", path,
                     chat_template_name(t.kind), jstr(doc, "kind"));
        cr_assert_eq(t.tools, want.tools, "%s: detected tool format %s, want %s", path,
                     chat_tools_format_name(t.tools), chat_tools_format_name(want.tools));
        chat_template_free(&want);
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
        for (size_t i = 0; i < json_array_size(cases); i++, n_cases++) {
            json_t *c = json_array_get(cases, i);
            check_case(path, &t, jstr(doc, "bos_token"), c);
            n_tool_cases += json_object_get(c, "tools") != NULL;
        }
        chat_template_free(&t);
        json_decref(doc);
    }
    cr_assert_geq(n_tool_cases, 40, "only %zu cases with tools", n_tool_cases);
    cr_log_info("%zu golden cases (%zu with tools) over %zu templates", n_cases, n_tool_cases,
                g.gl_pathc);
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
    static const struct {
        const char *name;
        chat_template_kind kind;
        chat_tool_format tools;
        bool default_system;
    } names[] = {
        {"chatml", CHAT_TEMPLATE_CHATML, CHAT_TOOLS_GENERIC, false},
        {"qwen2.5", CHAT_TEMPLATE_CHATML, CHAT_TOOLS_HERMES, true},
        {"hermes", CHAT_TEMPLATE_CHATML, CHAT_TOOLS_HERMES, false},
        {"llama3", CHAT_TEMPLATE_LLAMA3, CHAT_TOOLS_GENERIC, false},
        {"llama3.1", CHAT_TEMPLATE_LLAMA31, CHAT_TOOLS_LLAMA3, false},
        {"llama3.2", CHAT_TEMPLATE_LLAMA31, CHAT_TOOLS_LLAMA3, false},
        {"llama3.3", CHAT_TEMPLATE_LLAMA31, CHAT_TOOLS_LLAMA3, false},
        {"llama2", CHAT_TEMPLATE_LLAMA2, CHAT_TOOLS_GENERIC, false},
        {"mistral", CHAT_TEMPLATE_MISTRAL_V1, CHAT_TOOLS_GENERIC, false},
        {"mistral-legacy", CHAT_TEMPLATE_MISTRAL_LEGACY, CHAT_TOOLS_GENERIC, false},
        {"mistral-v1", CHAT_TEMPLATE_MISTRAL_V1, CHAT_TOOLS_GENERIC, false},
        {"mistral-v3", CHAT_TEMPLATE_MISTRAL_V3, CHAT_TOOLS_MISTRAL_V3, false},
        {"mistral-nemo", CHAT_TEMPLATE_MISTRAL, CHAT_TOOLS_MISTRAL, false},
        {"mistral-v3-tekken", CHAT_TEMPLATE_MISTRAL, CHAT_TOOLS_MISTRAL, false},
        {"mistral-v7", CHAT_TEMPLATE_MISTRAL_V7, CHAT_TOOLS_GENERIC, false},
        {"mistral-v7-tekken", CHAT_TEMPLATE_MISTRAL_V7_TEKKEN, CHAT_TOOLS_MISTRAL_V7, false},
        {"devstral", CHAT_TEMPLATE_MISTRAL_V7_TEKKEN, CHAT_TOOLS_GENERIC, false},
    };
    chat_template t;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        cr_assert_eq(chat_template_from_name(names[i].name, &t), 0, "%s", names[i].name);
        cr_assert_eq(t.kind, names[i].kind, "%s", names[i].name);
        cr_assert_eq(t.tools, names[i].tools, "%s", names[i].name);
        cr_assert_eq(t.default_system != NULL, names[i].default_system, "%s", names[i].name);
        chat_template_free(&t);
    }
    cr_assert_eq(chat_template_from_name("qwen2.5", &t), 0);
    cr_assert_str_eq(t.default_system,
                     "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
    chat_template_free(&t);
    cr_assert_eq(chat_template_from_name("vicuna", &t), -1);
    cr_assert_eq(t.kind, CHAT_TEMPLATE_UNKNOWN);
    cr_assert_eq(chat_template_from_name("", &t), -1);
    cr_assert_eq(chat_template_from_name(NULL, &t), -1);
    for (int k = CHAT_TEMPLATE_CHATML; k <= CHAT_TEMPLATE_MISTRAL_V7_TEKKEN; k++) {
        cr_assert_eq(chat_template_from_name(chat_template_name((chat_template_kind)k), &t), 0);
        cr_assert_eq((int)t.kind, k);
        chat_template_free(&t);
    }
}

/* Sources that share a family's special tokens but write calls another way keep the generic
 * tool format (their text is kept short here; the markers are what counts). */
Test(chat, detect_tool_formats) {
    static const struct {
        const char *src;
        chat_template_kind kind;
        chat_tool_format tools;
    } cases[] = {
        /* Qwen3-Coder: <tool_call> around <function=NAME> */
        {"<|im_start|>{{ '<tool_call>\\n<function=' + tool_call.name }}", CHAT_TEMPLATE_CHATML,
         CHAT_TOOLS_GENERIC},
        {"<|im_start|>{{ '<tool_call>\\n{\"name\": \"' }}{{ '\", \"arguments\": ' }}",
         CHAT_TEMPLATE_CHATML, CHAT_TOOLS_HERMES},
        /* functionary v3.1: Llama 3.1's header, calls as <function=NAME> */
        {"<|start_header_id|>Cutting Knowledge Date: {\"parameters\": <function=",
         CHAT_TEMPLATE_LLAMA3, CHAT_TOOLS_GENERIC},
        {"<|start_header_id|>Cutting Knowledge Date: December 2023 '\"parameters\": '",
         CHAT_TEMPLATE_LLAMA31, CHAT_TOOLS_LLAMA3},
        /* Meta-Llama-3: no date header */
        {"<|start_header_id|>{{ message['content'] }}", CHAT_TEMPLATE_LLAMA3, CHAT_TOOLS_GENERIC},
        /* Mistral v3 (7B v0.3, Large 2407): "[INST] " with a space, "[TOOL_CALLS] [" */
        {"{{ \"[INST] \" + m + \"[/INST]\" }}[AVAILABLE_TOOLS] [[TOOL_CALLS] [",
         CHAT_TEMPLATE_MISTRAL_V3, CHAT_TOOLS_MISTRAL_V3},
        /* ... and a v3-like source whose calls are not written as "[TOOL_CALLS] [" */
        {"{{ \"[INST] \" + m }}[AVAILABLE_TOOLS][TOOL_CALLS]", CHAT_TEMPLATE_MISTRAL_V3,
         CHAT_TOOLS_GENERIC},
        /* Devstral, Ministral 3: [SYSTEM_PROMPT], calls as [TOOL_CALLS]NAME[ARGS] */
        {"[SYSTEM_PROMPT][INST][AVAILABLE_TOOLS][TOOL_CALLS][ARGS]",
         CHAT_TEMPLATE_MISTRAL_V7_TEKKEN, CHAT_TOOLS_GENERIC},
        /* Mistral Small 3.2: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS], [TOOL_CONTENT] in results */
        {"[SYSTEM_PROMPT][INST][AVAILABLE_TOOLS][TOOL_CALLS][CALL_ID][ARGS][TOOL_CONTENT]",
         CHAT_TEMPLATE_MISTRAL_V7_TEKKEN, CHAT_TOOLS_MISTRAL_V7},
        /* Mistral Large 2411: v7 with spaces, no tool format */
        {"'[SYSTEM_PROMPT] ' + c + '[/SYSTEM_PROMPT]' '[INST] '", CHAT_TEMPLATE_MISTRAL_V7,
         CHAT_TOOLS_GENERIC},
        {"{{ \"[INST]\" + m }}[AVAILABLE_TOOLS][TOOL_CALLS]", CHAT_TEMPLATE_MISTRAL,
         CHAT_TOOLS_MISTRAL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        chat_template t;
        chat_template_detect(cases[i].src, strlen(cases[i].src), &t);
        cr_assert_eq(t.kind, cases[i].kind, "case %zu: %s", i, chat_template_name(t.kind));
        cr_assert_eq(t.tools, cases[i].tools, "case %zu: %s", i, chat_tools_format_name(t.tools));
        chat_template_free(&t);
    }
}

/* ---------------------------------------------------------------- render errors */

Test(chat, render_errors) {
    chat_template t;
    kv_error err = {{0}};
    const chat_message bad_role[] = {{.role = "user", .content = "hi"},
                                     {.role = "function", .content = "{}"}};
    cr_assert_eq(chat_template_from_name("chatml", &t), 0);
    cr_assert_null(chat_render(&t, bad_role, 2, NULL, 0, true, NULL, &err));
    cr_assert_not_null(strstr(err.msg, "function"), "%s", err.msg);
    const chat_message null_role[] = {{.role = NULL, .content = "hi"}};
    cr_assert_null(chat_render(&t, null_role, 1, NULL, 0, true, NULL, &err));
    cr_assert_null(chat_render(&t, NULL, 3, NULL, 0, true, NULL, &err));
    cr_assert_null(chat_render(&t, bad_role, -1, NULL, 0, true, NULL, &err));

    chat_template unknown = {0};
    const chat_message ok[] = {{.role = "user", .content = "hi"}};
    err.msg[0] = '\0';
    cr_assert_null(chat_render(&unknown, ok, 1, NULL, 0, true, NULL, &err));
    cr_assert_not_null(strstr(err.msg, "unknown chat template"), "%s", err.msg);

    /* Llama 2: a system message after the first turn (its template would drop it silently) */
    cr_assert_eq(chat_template_from_name("llama2", &t), 0);
    const chat_message mid_sys[] = {{.role = "user", .content = "a"},
                                    {.role = "assistant", .content = "b"},
                                    {.role = "system", .content = "c"},
                                    {.role = "user", .content = "d"}};
    cr_assert_null(chat_render(&t, mid_sys, 4, NULL, 0, true, "<s>", &err));
    cr_assert_not_null(strstr(err.msg, "system"), "%s", err.msg);
    const chat_message two_sys[] = {{.role = "system", .content = "a"},
                                    {.role = "system", .content = "b"}};
    cr_assert_null(chat_render(&t, two_sys, 2, NULL, 0, true, "<s>", &err));
}

/* Mistral's templates refuse what their Jinja raises on, with the reason. */
Test(chat, render_errors_mistral) {
    chat_template t;
    kv_error err = {{0}};
    const chat_message sys_user[] = {{.role = "system", .content = "s"},
                                     {.role = "user", .content = "u"}};
    const chat_message two_users[] = {{.role = "user", .content = "a"},
                                      {.role = "user", .content = "b"}};
    /* the original 7B v0.2 template has no system message (its Jinja raises): a leading one
     * opens the first user message, as in the same models' later template, with this one's
     * spacing; a system message anywhere else is refused */
    cr_assert_eq(chat_template_from_name("mistral-legacy", &t), 0);
    char *got = chat_render(&t, sys_user, 2, NULL, 0, true, "<s>", &err);
    cr_assert_not_null(got, "%s", err.msg);
    cr_assert_str_eq(got, "<s>[INST] s\n\nu [/INST]");
    free(got);
    const chat_message late_sys[] = {{.role = "user", .content = "u"},
                                     {.role = "assistant", .content = "a"},
                                     {.role = "system", .content = "s"},
                                     {.role = "user", .content = "v"}};
    cr_assert_null(chat_render(&t, late_sys, 4, NULL, 0, true, "<s>", &err));
    cr_assert_not_null(strstr(err.msg, "alternate"), "%s", err.msg);
    cr_assert_null(chat_render(&t, two_users, 2, NULL, 0, true, "<s>", &err));
    cr_assert_not_null(strstr(err.msg, "alternate"), "%s", err.msg);
    static const char *const alternating[] = {"mistral-v1", "mistral-v3", "mistral-v7-tekken"};
    for (size_t i = 0; i < sizeof alternating / sizeof alternating[0]; i++) {
        cr_assert_eq(chat_template_from_name(alternating[i], &t), 0);
        err.msg[0] = '\0';
        cr_assert_null(chat_render(&t, two_users, 2, NULL, 0, true, "<s>", &err), "%s",
                       alternating[i]);
        cr_assert_not_null(strstr(err.msg, "alternate"), "%s: %s", alternating[i], err.msg);
        char *ok = chat_render(&t, sys_user, 2, NULL, 0, true, "<s>", &err);
        cr_assert_not_null(ok, "%s: %s", alternating[i], err.msg);
        free(ok);
    }
    /* v7 (Large 2411) takes messages in any order; v1 and v3 read the first one */
    cr_assert_eq(chat_template_from_name("mistral-v7", &t), 0);
    char *out = chat_render(&t, two_users, 2, NULL, 0, true, "<s>", &err);
    cr_assert_str_eq(out, "<s>[INST] a[/INST][INST] b[/INST]");
    free(out);
    cr_assert_eq(chat_template_from_name("mistral-v1", &t), 0);
    cr_assert_null(chat_render(&t, NULL, 0, NULL, 0, true, "<s>", &err));
    cr_assert_eq(chat_template_from_name("mistral-v3", &t), 0);
    cr_assert_null(chat_render(&t, NULL, 0, NULL, 0, true, "<s>", &err));
    /* a tool result where the format has none becomes a user turn (the generic format) */
    const chat_message result[] = {{.role = "user", .content = "q"},
                                   {.role = "assistant", .content = "calling"},
                                   {.role = "tool", .content = "42", .name = "f"}};
    cr_assert_eq(chat_template_from_name("devstral", &t), 0);
    out = chat_render(&t, result, 3, NULL, 0, true, "<s>", &err);
    cr_assert_not_null(out, "%s", err.msg);
    cr_assert_not_null(strstr(out, "[INST]<tool_response>"), "%s", out);
    free(out);
    /* Small 3.2's own: the result with its call's id (a missing one mapped to 9 characters) */
    cr_assert_eq(chat_template_from_name("mistral-v7-tekken", &t), 0);
    out = chat_render(&t, result, 3, NULL, 0, true, "<s>", &err);
    cr_assert_not_null(out, "%s", err.msg);
    char id[10];
    chat_tools_mistral_id(NULL, id);
    char want[128];
    snprintf(want, sizeof want,
             "<s>[INST]q[/INST]calling</s>[TOOL_RESULTS]%s[TOOL_CONTENT]42[/TOOL_RESULTS]", id);
    cr_assert_str_eq(out, want);
    free(out);
}

Test(chat, render_null_content_and_bos) {
    chat_template t;
    kv_error err = {{0}};
    const chat_message m[] = {{.role = "user", .content = NULL}};
    cr_assert_eq(chat_template_from_name("llama3", &t), 0);
    char *out = chat_render(&t, m, 1, NULL, 0, false, NULL, &err);
    cr_assert_not_null(out, "%s", err.msg);
    cr_assert_str_eq(out, "<|start_header_id|>user<|end_header_id|>\n\n<|eot_id|>");
    free(out);
    /* an empty conversation without a generation prompt is "" (not an error) */
    out = chat_render(&t, NULL, 0, NULL, 0, false, NULL, &err);
    cr_assert_not_null(out, "%s", err.msg);
    cr_assert_str_eq(out, "");
    free(out);
}

Test(chat, smollm2_default_system_from_name_is_absent) {
    /* Named ChatML has no default system; detection from SmolLM2's source supplies it. */
    chat_template t;
    kv_error err = {{0}};
    cr_assert_eq(chat_template_from_name("chatml", &t), 0);
    const chat_message m[] = {{.role = "user", .content = "hi"}};
    char *out = chat_render(&t, m, 1, NULL, 0, true, NULL, &err);
    cr_assert_str_eq(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    chat_template_free(&t);
}

Test(chat, strip_keeps_malformed_utf8_and_non_space) {
    chat_template t;
    kv_error err = {{0}};
    cr_assert_eq(chat_template_from_name("llama3", &t), 0);
    /* trailing lone continuation byte and a truncated 3-byte lead are not whitespace */
    const chat_message m[] = {{.role = "user", .content = " \x80x\xe3\x80 "},
                              {.role = "assistant", .content = "\xe2\x80\x83y\xe2\x80"}};
    char *out = chat_render(&t, m, 2, NULL, 0, false, "", &err);
    cr_assert_not_null(out, "%s", err.msg);
    cr_assert_str_eq(out, "<|start_header_id|>user<|end_header_id|>\n\n\x80x\xe3\x80<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\ny\xe2\x80<|eot_id|>");
    free(out);
}
