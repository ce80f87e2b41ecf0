/* Grammar tests: GBNF parsing (every error path names its problem), matching whole texts byte by
 * byte, masks over a small vocabulary (tokens spanning several elements, UTF-8 split across
 * tokens, end-of-generation only where the grammar may end), forced bytes, and the JSON Schema
 * compiler: each schema's grammar accepts values the schema accepts and refuses the others. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/grammar/grammar.h"
#include "tests/unit/byte_vocab.h"

/* ---------------------------------------------------------------- helpers */

static grammar *parse_ok(const char *src) {
    kv_error err = {{0}};
    grammar *g = grammar_parse(src, strlen(src), &err);
    cr_assert_not_null(g, "grammar_parse failed: %s\n%s", err.msg, src);
    return g;
}

static void parse_fails(const char *src, const char *needle) {
    kv_error err = {{0}};
    grammar *g = grammar_parse(src, strlen(src), &err);
    cr_assert_null(g, "expected a parse error for: %s", src);
    cr_assert(strstr(err.msg, needle), "error '%s' does not mention '%s'", err.msg, needle);
}

/* True when the grammar matches text completely. */
static bool matches(gmatch *m, const char *text) {
    int32_t s = gmatch_accept_bytes(m, gmatch_start(m), text, strlen(text));
    return s >= 0 && gmatch_can_end(m, s);
}

static bool gbnf_matches(const char *src, const char *text) {
    grammar *g = parse_ok(src);
    grammar_vocab *v = byte_vocab_create(NULL, 0);
    kv_error err = {{0}};
    gmatch *m = gmatch_create(g, v, &err);
    cr_assert_not_null(m);
    bool ok = matches(m, text);
    gmatch_destroy(m);
    grammar_vocab_destroy(v);
    grammar_destroy(g);
    return ok;
}

static bool bit(const uint64_t *mask, int32_t t) { return mask[t >> 6] >> (t & 63) & 1; }

/* ---------------------------------------------------------------- parsing */

Test(grammar, parses_the_gbnf_forms) {
    grammar *g = parse_ok("# a comment\n"
                          "root ::= greeting (\" \" name)? [!.]{1,3}\n"
                          "greeting ::= \"hello\" | \"hi\"   # trailing comment\n"
                          "name ::= [A-Z] [a-z]*\n"
                          "  | \"world\"\n");
    cr_assert_gt(grammar_n_rules(g), 3);
    grammar_destroy(g);
    cr_assert(gbnf_matches("root ::= \"a\" | \"b\"", "b"));
    cr_assert(gbnf_matches("root ::= [^a] \"\\n\\x41\\u00e9\"", "z\nA\xc3\xa9"));
    cr_assert(gbnf_matches("root ::= x{2,} \nx ::= \"ab\"", "ababab"));
    cr_assert_not(gbnf_matches("root ::= x{2,} \nx ::= \"ab\"", "ab"));
    cr_assert(gbnf_matches("root ::= (\"a\" | \"b\")+ \".\"?", "abba."));
    cr_assert(gbnf_matches("root ::= . .", "\xe2\x82\xac!"));
    cr_assert_not(gbnf_matches("root ::= \"a\"{0,2}", "aaa"));
    cr_assert(gbnf_matches("root ::= \"a\"{0,2}", ""));
    cr_assert(gbnf_matches("root ::= \"x\" list\nlist ::= \"\" | \",\" list", "x,,,"));
}

Test(grammar, reports_errors) {
    parse_fails("", "empty");
    parse_fails("start ::= \"a\"", "root");
    parse_fails("root ::= missing", "'missing' is used");
    parse_fails("root ::= \"a\"\nroot ::= \"b\"", "defined twice");
    parse_fails("root ::= root \"a\" | \"b\"", "left recursion");
    parse_fails("root ::= x* \"a\"\nx ::= \"b\"?", "left recursion");
    parse_fails("root ::= \"abc", "unterminated");
    parse_fails("root ::= [a-", "unterminated");
    parse_fails("root ::= [z-a]", "out of order");
    parse_fails("root ::= (\"a\"", "expected ')'");
    parse_fails("root ::= \"a\" )", "unexpected ')'");
    parse_fails("root ::= \"a\"{3,1}", "n < m");
    parse_fails("root ::= \"\\q\"", "unknown escape");
    parse_fails("root ::= \"a\" @", "unexpected character");
    parse_fails("root ::= \"\\xZZ\"", "hexadecimal");
    parse_fails("root ::= \"a\"{99999}", "too large");
    char deep[400] = "root ::= ";
    for (int i = 0; i < 100; i++) strcat(deep, "(");
    parse_fails(deep, "nested too deeply");
}

/* ---------------------------------------------------------------- masks */

Test(grammar, masks_tokens_spanning_elements) {
    const char *extra[] = {"{\"", "\":", "ab", "abc", "cd", "\xc3", "\xa9x"};
    grammar_vocab *v = byte_vocab_create(extra, 7);
    grammar *g = parse_ok("root ::= \"{\\\"\" [a-c]+ \"\\\":\" [0-9] \"}\"");
    kv_error err = {{0}};
    gmatch *m = gmatch_create(g, v, &err);
    int32_t s = gmatch_start(m);
    const uint64_t *mask = gmatch_mask(m, s, &err);
    cr_assert_not_null(mask, "%s", err.msg);
    cr_assert(bit(mask, '{'));
    cr_assert(bit(mask, 256)); /* {" spans two literal bytes */
    cr_assert_not(bit(mask, '"'));
    cr_assert_not(bit(mask, 256 + 7), "end-of-generation before the grammar may end");
    s = gmatch_accept_token(m, s, 256);
    cr_assert_geq(s, 0);
    mask = gmatch_mask(m, s, &err);
    cr_assert(bit(mask, 258) && bit(mask, 259)); /* ab, abc */
    cr_assert_not(bit(mask, 260));               /* cd: d is outside [a-c] */
    cr_assert_not(bit(mask, 257));               /* ": needs a letter first */
    s = gmatch_accept_token(m, s, 259);
    mask = gmatch_mask(m, s, &err);
    cr_assert(bit(mask, 257) && bit(mask, 'a'));
    s = gmatch_accept_bytes(m, s, "\":7}", 4);
    cr_assert(gmatch_is_final(m, s));
    mask = gmatch_mask(m, s, &err);
    cr_assert(bit(mask, 256 + 7));
    int n = 0;
    for (int t = 0; t < 256 + 8; t++) n += bit(mask, t);
    cr_assert_eq(n, 1, "only end-of-generation after the end");
    gmatch_destroy(m);
    grammar_destroy(g);
    grammar_vocab_destroy(v);
}

Test(grammar, utf8_split_across_tokens) {
    const char *extra[] = {"\xc3", "\xa9x", "\xa9"};
    grammar_vocab *v = byte_vocab_create(extra, 3);
    grammar *g = parse_ok("root ::= [\xc3\xa0-\xc3\xbf]+ \"x\"");
    kv_error err = {{0}};
    gmatch *m = gmatch_create(g, v, &err);
    int32_t s = gmatch_start(m);
    const uint64_t *mask = gmatch_mask(m, s, &err);
    cr_assert(bit(mask, 256) && bit(mask, 0xc3));
    cr_assert_not(bit(mask, 257) || bit(mask, 'x'));
    s = gmatch_accept_token(m, s, 256);
    mask = gmatch_mask(m, s, &err);
    cr_assert(bit(mask, 257) && bit(mask, 258)); /* the continuation byte, with or without x */
    cr_assert_not(bit(mask, 'x'));
    s = gmatch_accept_token(m, s, 257);
    cr_assert(gmatch_is_final(m, s));
    cr_assert_eq(gmatch_accept_token(m, gmatch_start(m), 258), GMATCH_DEAD);
    gmatch_destroy(m);
    grammar_destroy(g);
    grammar_vocab_destroy(v);
}

Test(grammar, apply_and_forced_bytes) {
    grammar_vocab *v = byte_vocab_create(NULL, 0);
    grammar *g = parse_ok("root ::= \"{\\\"name\\\": \\\"\" [a-z]+ \"\\\"}\"");
    kv_error err = {{0}};
    gmatch *m = gmatch_create(g, v, &err);
    float logits[257];
    for (int i = 0; i < 257; i++) logits[i] = 1.0f;
    cr_assert_eq(gmatch_apply(m, gmatch_start(m), logits, &err), 1);
    cr_assert_eq(logits['{'], 1.0f);
    cr_assert(isinf(logits['a']) && logits['a'] < 0);
    char buf[64];
    int32_t next;
    size_t n = gmatch_forced(m, gmatch_start(m), buf, sizeof buf, &next);
    cr_assert_eq(n, 10);
    cr_assert(!memcmp(buf, "{\"name\": \"", 10));
    cr_assert_eq(gmatch_forced(m, next, buf, sizeof buf, &next), 0);
    gmatch_destroy(m);
    grammar_destroy(g);
    /* forced bytes stop at a whole character */
    g = parse_ok("root ::= \"\xe2\x82\xac\" [\xe2\x82\xa0-\xe2\x82\xaf]");
    m = gmatch_create(g, v, &err);
    n = gmatch_forced(m, gmatch_start(m), buf, sizeof buf, &next);
    cr_assert_eq(n, 3, "got %zu", n);
    gmatch_destroy(m);
    grammar_destroy(g);
    grammar_vocab_destroy(v);
}

Test(grammar, ambiguous_grammar_stays_bounded) {
    /* Many ways to split the same text: the state is a set, deduplicated. */
    cr_assert(
        gbnf_matches("root ::= (\"a\" | \"aa\" | \"aaa\")*", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"));
    cr_assert(gbnf_matches("root ::= x x x x x x x x\nx ::= \"a\"?", "aaaa"));
}

/* ---------------------------------------------------------------- JSON Schema */

typedef struct schema_case {
    const char *schema;
    const char *good[6];
    const char *bad[6];
} schema_case;

static void check_schema(const schema_case *c) {
    kv_error err = {{0}};
    char *gbnf = json_schema_to_gbnf(c->schema, strlen(c->schema), &err);
    cr_assert_not_null(gbnf, "schema %s: %s", c->schema, err.msg);
    grammar *g = parse_ok(gbnf);
    grammar_vocab *v = byte_vocab_create(NULL, 0);
    gmatch *m = gmatch_create(g, v, &err);
    for (int i = 0; i < 6 && c->good[i]; i++)
        cr_assert(matches(m, c->good[i]), "schema %s should accept %s\n%s", c->schema, c->good[i],
                  gbnf);
    for (int i = 0; i < 6 && c->bad[i]; i++)
        cr_assert_not(matches(m, c->bad[i]), "schema %s should refuse %s\n%s", c->schema, c->bad[i],
                      gbnf);
    gmatch_destroy(m);
    grammar_vocab_destroy(v);
    grammar_destroy(g);
    free(gbnf);
}

Test(json_schema, objects_and_arrays) {
    schema_case cases[] = {
        {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":"
         "\"integer\"}},\"required\":[\"name\"],\"additionalProperties\":false}",
         {"{\"name\": \"Bo\"}", "{\"name\": \"Bo\", \"age\": 3}", "{\"name\": \"\\u00e9\\n\"}"},
         {"{}", "{\"age\": 3}", "{\"name\": 1}", "{\"age\": 3, \"name\": \"x\"}"}},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"boolean\"}}}",
         {"{}", "{\"a\": true}"},
         {"{\"a\": 1}"}},
        {"{\"type\":\"object\"}", {"{}", "{\"x\": [1, {\"y\": null}]}"}, {"[]"}},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"null\"}},\"required\":[\"a\"],"
         "\"additionalProperties\":{\"type\":\"integer\"}}",
         {"{\"a\": null, \"b\": 2}", "{\"a\": null}"},
         {"{\"a\": null, \"b\": \"x\"}"}},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":3}",
         {"[1]", "[1, -2, 3]"},
         {"[]", "[1, 2, 3, 4]", "[1.5]"}},
        {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"number\"}]}",
         {"[\"a\", 1.5]"},
         {"[\"a\"]", "[1, 1]"}},
        {"{\"type\":\"array\"}", {"[]", "[1, \"a\", []]"}, {"{}"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) check_schema(&cases[i]);
}

Test(json_schema, strings_numbers_enums) {
    schema_case cases[] = {
        {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}",
         {"\"ab\"", "\"abc\""},
         {"\"a\"", "\"abcd\""}},
        {"{\"enum\":[\"red\",\"green\",3,null]}",
         {"\"red\"", "3", "null"},
         {"\"blue\"", "\"Red\""}},
        {"{\"const\":{\"k\":[1,2]}}", {"{\"k\":[1,2]}"}, {"{\"k\":[1]}"}},
        {"{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d{3}$\"}",
         {"\"AB-123\""},
         {"\"AB-12\"", "\"ab-123\""}},
        {"{\"type\":\"string\",\"pattern\":\"^(cat|dog)s?$\"}",
         {"\"cats\"", "\"dog\""},
         {"\"cow\""}},
        {"{\"type\":\"string\",\"format\":\"date\"}", {"\"2024-02-29\""}, {"\"2024-13-01\""}},
        {"{\"type\":\"string\",\"format\":\"date-time\"}",
         {"\"2024-02-29T10:20:30Z\"", "\"2024-02-29T10:20:30.5+01:00\""},
         {"\"2024-02-29 10:20:30\""}},
        {"{\"type\":\"string\",\"format\":\"uuid\"}",
         {"\"123e4567-e89b-12d3-a456-426614174000\""},
         {"\"123e4567\""}},
        {"{\"type\":\"string\",\"format\":\"email\"}", {"\"a.b@example.com\""}, {"\"a@b\""}},
        {"{\"type\":\"integer\",\"minimum\":-15,\"maximum\":120}",
         {"-15", "0", "7", "99", "120"},
         {"-16", "121", "007", "1.5", "1000"}},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":0}", {"1", "123456"}, {"0", "-1"}},
        {"{\"type\":\"number\",\"minimum\":0,\"maximum\":1}", {"0", "0.25", "1"}, {"1.5", "-0.1"}},
        {"{\"type\":\"number\",\"minimum\":-2.5,\"exclusiveMaximum\":3}",
         {"-2", "2.75", "0"},
         {"3", "-3", "3.5"}},
        {"{\"type\":[\"string\",\"null\"]}", {"\"x\"", "null"}, {"1"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) check_schema(&cases[i]);
}

Test(json_schema, refs_and_combinators) {
    schema_case cases[] = {
        {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
         "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":["
         "\"v\",\"kids\"]}},\"$ref\":\"#/$defs/node\"}",
         {"{\"v\": 1, \"kids\": []}", "{\"v\": 1, \"kids\": [{\"v\": 2, \"kids\": []}]}"},
         {"{\"v\": 1}"}},
        {"{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"string\",\"maxLength\":1}]}",
         {"5", "\"a\""},
         {"\"ab\""}},
        {"{\"allOf\":[{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
         "\"required\":[\"a\"]},{\"properties\":{\"b\":{\"type\":\"string\"}},\"required\":["
         "\"b\"]}],\"additionalProperties\":false}",
         {"{\"a\": 1, \"b\": \"x\"}"},
         {"{\"a\": 1}"}},
        {"{\"definitions\":{\"x\":{\"type\":\"boolean\"}},\"type\":\"object\",\"properties\":{"
         "\"f\":{\"$ref\":\"#/definitions/x\",\"description\":\"d\"}},\"required\":[\"f\"]}",
         {"{\"f\": false}"},
         {"{\"f\": 0}"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) check_schema(&cases[i]);
}

Test(json_schema, unsupported_keywords_are_named) {
    const char *bad[][2] = {
        {"{\"type\":\"object\",\"minProperties\":1}", "'minProperties'"},
        {"{\"not\":{\"type\":\"string\"}}", "'not'"},
        {"{\"type\":\"string\",\"format\":\"ipv4\"}", "'ipv4'"},
        {"{\"type\":\"array\",\"items\":{\"uniqueItems\":true}}", "#/items"},
        {"{\"$ref\":\"#/$defs/none\"}", "does not resolve"},
        {"{\"type\":\"object\",\"required\":[\"x\"]}", "'x'"},
        {"{\"type\":\"string\",\"pattern\":\"(?=a)\"}", "lookaround"},
        {"{\"type\":\"integer\",\"minimum\":5,\"maximum\":1}", "leave no value"},
        {"{\"type\":\"strin\"}", "'strin'"},
        {"[1", "not valid JSON"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kv_error err = {{0}};
        char *g = json_schema_to_gbnf(bad[i][0], strlen(bad[i][0]), &err);
        cr_assert_null(g, "%s should fail", bad[i][0]);
        cr_assert(strstr(err.msg, bad[i][1]), "'%s' does not mention %s", err.msg, bad[i][1]);
    }
}

Test(json_schema, json_object_grammar) {
    grammar *g = parse_ok(json_object_gbnf());
    grammar_vocab *v = byte_vocab_create(NULL, 0);
    kv_error err = {{0}};
    gmatch *m = gmatch_create(g, v, &err);
    cr_assert(matches(m, "{\"a\": [1, 2.5e3, \"x\", true, null, {}]}"));
    cr_assert_not(matches(m, "[1]"));
    gmatch_destroy(m);
    grammar_vocab_destroy(v);
    grammar_destroy(g);
}
