/* cache/schema/pml.c: PML schemas and prompts parse into the tree PML describes (modules, nesting,
 * unions, parameters, role tags, text with its indentation dropped), and every malformed or
 * disallowed document is refused with the line and column of its problem. */
#include <criterion/criterion.h>
#include <string.h>

#include "cache/schema/pml.h"

static pml_doc *parse_ok(const char *src) {
    kv_error err = {{0}};
    pml_doc *d = pml_parse(src, strlen(src), NULL, &err);
    cr_assert_not_null(d, "%s: %s", src, err.msg);
    return d;
}

static void parse_fails(const char *src, const char *want) {
    kv_error err = {{0}};
    pml_doc *d = pml_parse(src, strlen(src), NULL, &err);
    cr_assert_null(d, "accepted: %s", src);
    cr_assert(strstr(err.msg, want), "%s\n  got: %s\n  want: %s", src, err.msg, want);
}

Test(pml, a_schema_parses_into_its_tree) {
    pml_doc *d = parse_ok("<schema name=\"travel\">\n"
                          "  <system>You are a travel agent.</system>\n"
                          "  <user>\n"
                          "    <module name=\"plan\">Plan a trip of <parameter name=\"days\" "
                          "length=\"4\"/> days.</module>\n"
                          "    <union>\n"
                          "      <module name=\"tokyo\">Tokyo</module>\n"
                          "      <module name=\"miami\">Miami<module name=\"beach\">Sand</module>"
                          "</module>\n"
                          "    </union>\n"
                          "  </user>\n"
                          "</schema>\n");
    cr_assert_not(d->prompt);
    cr_assert_str_eq(d->name, "travel");
    cr_assert_eq(d->root.n_kids, 2);
    const pml_node *sys = d->root.kids[0], *user = d->root.kids[1];
    cr_assert_eq(sys->kind, PML_ROLE);
    cr_assert_eq(sys->role, PML_ROLE_SYSTEM);
    cr_assert_str_eq(sys->kids[0]->text, "You are a travel agent.");
    cr_assert_eq(user->role, PML_ROLE_USER);
    cr_assert_eq(user->n_kids, 2); /* the indentation is gone */
    const pml_node *plan = user->kids[0];
    cr_assert_eq(plan->kind, PML_MODULE);
    cr_assert_str_eq(plan->name, "plan");
    cr_assert_eq(plan->n_kids, 3);
    cr_assert_str_eq(plan->kids[0]->text, "Plan a trip of "); /* spaces kept */
    cr_assert_eq(plan->kids[1]->kind, PML_PARAM);
    cr_assert_str_eq(plan->kids[1]->name, "days");
    cr_assert_eq(plan->kids[1]->length, 4);
    cr_assert_str_eq(plan->kids[2]->text, " days.");
    const pml_node *u = user->kids[1];
    cr_assert_eq(u->kind, PML_UNION);
    cr_assert_eq(u->n_kids, 2);
    cr_assert_str_eq(u->kids[1]->kids[1]->name, "beach");
    cr_assert_eq(u->line, 5);
    cr_assert_eq(u->col, 5);
    pml_free(d);
}

Test(pml, a_prompt_parses_with_references_values_and_text) {
    pml_doc *d = parse_ok("<prompt schema=\"travel\"><plan days=\"3 &amp; a half\"/>"
                          "<miami><beach/></miami> Free text <user>Where to surf?</user></prompt>");
    cr_assert(d->prompt);
    cr_assert_str_eq(d->name, "travel");
    cr_assert_eq(d->root.n_kids, 4);
    const pml_node *plan = d->root.kids[0];
    cr_assert_eq(plan->kind, PML_MODULE);
    cr_assert_eq(plan->n_args, 1);
    cr_assert_str_eq(plan->args[0], "days");
    cr_assert_str_eq(plan->args[1], "3 & a half");
    cr_assert_str_eq(d->root.kids[1]->kids[0]->name, "beach");
    cr_assert_str_eq(d->root.kids[2]->text, " Free text ");
    cr_assert_eq(d->root.kids[3]->kind, PML_ROLE);
    cr_assert_str_eq(d->root.kids[3]->kids[0]->text, "Where to surf?");
    pml_free(d);
}

Test(pml, cdata_and_comments_are_text_and_nothing) {
    pml_doc *d = parse_ok("<schema name=\"s\"><module name=\"m\">a<!-- no -->b<![CDATA[<x>]]>"
                          "</module></schema>");
    cr_assert_str_eq(d->root.kids[0]->kids[0]->text, "ab<x>");
    pml_free(d);
}

Test(pml, bad_documents_name_their_line_and_column) {
    parse_fails("<schema name=\"s\">\n  <module name=\"a\">x</modul>\n</schema>",
                "line 2, column 23: mismatched tag");
    parse_fails("<schema>\n</schema>", "line 1, column 1: <schema> needs a 'name' attribute");
    parse_fails("<schema name=\"s\">\n <module>x</module></schema>",
                "line 2, column 2: <module> needs a 'name'");
    parse_fails("<schema name=\"s\"><module name=\"1a\"/></schema>",
                "line 1, column 18: name '1a' of <module> is not a name");
    parse_fails("<schema name=\"s\"><module name=\"user\"/></schema>", "'user' is reserved");
    parse_fails("<schema name=\"s\"><module name=\"a\" x=\"1\"/></schema>",
                "<module> has no attribute 'x'");
    parse_fails("<schema name=\"s\">\n\n   <parameter name=\"p\" length=\"3\"/></schema>",
                "line 3, column 4: <parameter> outside a module");
    parse_fails("<schema name=\"s\"><module name=\"a\"><parameter name=\"p\"/></module></schema>",
                "needs a 'length' of 1 to 4096");
    parse_fails(
        "<schema name=\"s\"><module name=\"a\"><parameter name=\"p\" length=\"0x3\"/></module>"
        "</schema>",
        "not '0x3'");
    parse_fails("<schema name=\"s\"><union>\n  loose text</union></schema>",
                "line 1, column 25: text inside <union>");
    parse_fails("<schema name=\"s\"><union><user/></union></schema>",
                "<user> inside <union>: a union holds modules only");
    parse_fails("<schema name=\"s\"><union></union></schema>", "an empty <union>");
    parse_fails("<schema name=\"s\"><user><system>x</system></user></schema>",
                "<system> inside another role tag");
    parse_fails("<schema name=\"s\"><foo/></schema>", "unknown element <foo> in a schema");
    parse_fails("<schema name=\"s\"><schema name=\"t\"/></schema>", "<schema> inside a schema");
    parse_fails("<doc/>", "must be a <schema> or a <prompt>, not <doc>");
    parse_fails("", "line 1, column 1: no element found");
    parse_fails("<schema name=\"s\">x</schema><more/>", "junk after document element");
    parse_fails("<schema name=\"s\">\xff</schema>", "not well-formed");
}

Test(pml, bad_prompts_name_their_line_and_column) {
    parse_fails("<prompt schema=\"s\"><module name=\"a\"/></prompt>",
                "line 1, column 20: <module> belongs in a schema");
    parse_fails("<prompt schema=\"s\"><a>text</a></prompt>",
                "text inside <a>: a module reference holds nested module references only");
    parse_fails("<prompt schema=\"s\"><user><a/></user></prompt>",
                "<a> inside <user>: a prompt's role tag holds text only");
    parse_fails("<prompt schema=\"s\"><a><user>x</user></a></prompt>",
                "<user> inside the module reference <a>");
    parse_fails("<prompt schema=\"s\"><user x=\"1\">q</user></prompt>", "has no attribute 'x'");
    parse_fails("<prompt><a/></prompt>", "<prompt> needs a 'schema' attribute");
}

Test(pml, entities_and_doctypes_are_refused) {
    parse_fails("<!DOCTYPE s [<!ENTITY x \"xx\">]><schema name=\"s\">&x;</schema>",
                "DOCTYPE declarations are not allowed");
    parse_fails("<schema name=\"s\">&undefined;</schema>", "undefined entity");
}

Test(pml, limits_hold) {
    pml_limits lim;
    pml_limits_default(&lim);
    lim.max_depth = 4;
    lim.max_nodes = 6;
    lim.max_bytes = 200;
    kv_error err = {{0}};
    const char *deep = "<schema name=\"s\"><module name=\"a\"><module name=\"b\"><module "
                       "name=\"c\"><module name=\"d\"/></module></module></module></schema>";
    cr_assert_null(pml_parse(deep, strlen(deep), &lim, &err));
    cr_assert(strstr(err.msg, "elements nest deeper than 4"), "%s", err.msg);
    const char *many = "<schema name=\"s\"><module name=\"a\"/><module name=\"b\"/><module "
                       "name=\"c\"/><module name=\"d\"/><module name=\"e\"/><module "
                       "name=\"f\"/></schema>";
    cr_assert_null(pml_parse(many, strlen(many), &lim, &err));
    cr_assert(strstr(err.msg, "more than 6 elements"), "%s", err.msg);
    char big[400];
    memset(big, 'a', sizeof big);
    cr_assert_null(pml_parse(big, sizeof big, &lim, &err));
    cr_assert(strstr(err.msg, "at most 200 are accepted"), "%s", err.msg);
}

Test(pml, names) {
    cr_assert(pml_name_ok("doc-1.en_US"));
    cr_assert(pml_name_ok("_x"));
    cr_assert_not(pml_name_ok(""));
    cr_assert_not(pml_name_ok("1x"));
    cr_assert_not(pml_name_ok("a b"));
    cr_assert_not(pml_name_ok("a:b"));
    char longname[80];
    memset(longname, 'a', 64);
    longname[64] = '\0';
    cr_assert_not(pml_name_ok(longname));
    cr_assert(pml_reserved("union"));
    cr_assert_not(pml_reserved("unions"));
}
