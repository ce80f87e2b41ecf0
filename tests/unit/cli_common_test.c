/* The command-line tools' option parser (cli_parse): every value type stored where its row says,
 * defaults kept, and each kind of bad command line answered with exit status 2. */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <string.h>

#include "server/cli/cli_common.h"

/* ---------------------------------------------------------------- a tool's table */

typedef struct opts {
    engine_model_opts mo;
    const char *name;
    int n;
    int64_t big;
    float x;
    bool flag;
    char seen[8][16]; /* the --item values, in order */
    int n_seen;
} opts;

static int add_item(void *dst, const char *value, kv_error *err) {
    opts *o = dst;
    if (strcmp(value, "bad") == 0) return kv_fail(err, "--item: '%s' is refused", value);
    if (o->n_seen == 8) return kv_fail(err, "at most 8 --item");
    snprintf(o->seen[o->n_seen++], sizeof o->seen[0], "%s", value);
    return 0;
}

static void usage(FILE *out) { fprintf(out, "usage: kvserve test -m MODEL [options]\n"); }

/* Parses the NULL-terminated arguments after "test" into *o (defaults first). */
static int parse(opts *o, const char *arg, ...) {
    char *argv[32] = {"test"};
    int argc = 1;
    va_list ap;
    va_start(ap, arg);
    for (const char *a = arg; a && argc < 32; a = va_arg(ap, const char *))
        argv[argc++] = (char *)a;
    va_end(ap);
    memset(o, 0, sizeof *o);
    o->mo.threads = 2;
    o->n = 7;
    o->x = 0.5f;
    const cli_opt table[] = {
        CLI_MODEL_OPT(&o->mo),
        CLI_THREADS_OPT(&o->mo),
        {"name", 'N', CLI_OPT_STRING, .dst = &o->name},
        {"count", 'n', CLI_OPT_INT, .dst = &o->n, .min = -1, .max = 100},
        {"big", 0, CLI_OPT_INT64, .dst = &o->big, .min = 0, .max = INT64_MAX},
        {"x", 0, CLI_OPT_FLOAT, .dst = &o->x, .fmin = 0, .fmax = 1},
        {"flag", 0, CLI_OPT_FLAG, .dst = &o->flag},
        {"item", 0, CLI_OPT_FN, .dst = o, .fn = add_item},
    };
    const cli_command cmd = {"kvserve test", usage, table, sizeof table / sizeof table[0]};
    int rc = cli_parse(&cmd, argc, argv);
    cr_assert_str_eq(argv[0], "test", "argv[0] is given back");
    return rc;
}

/* ---------------------------------------------------------------- values */

Test(cli_parse, defaults_stay_when_not_given) {
    opts o;
    cr_assert_eq(parse(&o, "-m", "a.gguf", NULL), -1);
    cr_assert_str_eq(o.mo.path, "a.gguf");
    cr_assert_eq(o.mo.threads, 2);
    cr_assert_eq(o.n, 7);
    cr_assert_float_eq(o.x, 0.5f, 0);
    cr_assert_null(o.name);
    cr_assert_not(o.flag);
    cr_assert_eq(o.n_seen, 0);
}

Test(cli_parse, every_type_is_stored) {
    opts o;
    cr_assert_eq(parse(&o, "--model", "b.gguf", "-t", "16", "-N", "name", "--count=-1", "--big",
                       "9223372036854775807", "--x", "0.25", "--flag", "--item", "one", "--item",
                       "two", NULL),
                 -1);
    cr_assert_str_eq(o.mo.path, "b.gguf");
    cr_assert_eq(o.mo.threads, 16);
    cr_assert_str_eq(o.name, "name");
    cr_assert_eq(o.n, -1);
    cr_assert_eq(o.big, INT64_MAX);
    cr_assert_float_eq(o.x, 0.25f, 0);
    cr_assert(o.flag);
    cr_assert_eq(o.n_seen, 2);
    cr_assert_str_eq(o.seen[0], "one");
    cr_assert_str_eq(o.seen[1], "two");
}

Test(cli_parse, short_options_group_and_take_attached_values) {
    opts o;
    cr_assert_eq(parse(&o, "-mc.gguf", "-t3", "-n", "100", NULL), -1);
    cr_assert_str_eq(o.mo.path, "c.gguf");
    cr_assert_eq(o.mo.threads, 3);
    cr_assert_eq(o.n, 100);
}

Test(cli_parse, a_second_parse_starts_afresh) {
    opts o;
    cr_assert_eq(parse(&o, "-m", "a.gguf", "--bogus", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "d.gguf", "-n", "5", NULL), -1);
    cr_assert_str_eq(o.mo.path, "d.gguf");
    cr_assert_eq(o.n, 5);
}

Test(cli_parse, help_exits_zero) {
    opts o;
    cr_assert_eq(parse(&o, "--help", NULL), 0);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "-h", NULL), 0);
}

/* ---------------------------------------------------------------- bad command lines */

Test(cli_parse, bad_values_exit_two) {
    opts o;
    cr_assert_eq(parse(&o, "-m", "a.gguf", "-t", "0", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "-t", "257", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "-n", "abc", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "-n", "5x", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "-n", "", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "--big", "-1", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "--big", "9223372036854775808", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "--x", "1.5", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "--x", "nan", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "--item", "bad", NULL), 2);
}

Test(cli_parse, unknown_options_and_missing_values_exit_two) {
    opts o;
    cr_assert_eq(parse(&o, "-m", "a.gguf", "--bogus", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "-z", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "--count", NULL), 2);
    cr_assert_eq(parse(&o, "-m", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "--flag=yes", NULL), 2);
}

Test(cli_parse, required_options_and_stray_arguments_exit_two) {
    opts o;
    cr_assert_eq(parse(&o, NULL), 2);
    cr_assert_eq(parse(&o, "-t", "4", NULL), 2);
    cr_assert_eq(parse(&o, "-m", "a.gguf", "extra", NULL), 2);
    cr_assert_eq(parse(&o, "extra", "-m", "a.gguf", NULL), 2);
}
