/* Configuration tests: the defaults, each layer (JSON file < KVSERVE_* environment < flags)
 * overriding the one below for every kind of option, and one bad value per layer and kind with
 * the message checked for the key and the source. Files live in a mkdtemp directory per test. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config/config.h"
#include "tests/unit/tmpdir.h"

/* ---------------------------------------------------------------- helpers */

static char *g_dir; /* removed with its files when the test's process exits */

static void dir_setup(void) { g_dir = tmpdir_create("kvserve_config_"); }

TestSuite(config, .init = dir_setup);

/* Writes text to g_dir/name and returns the path (static buffer per name slot). */
static const char *write_file(const char *name, const char *text) {
    static char paths[4][128];
    static int next;
    char *path = paths[next++ % 4];
    snprintf(path, 128, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
    return path;
}

/* Runs config_load on NULL-terminated flag and environment lists (argv[0] is added). */
static config_status load(kv_config *c, const char *const *flags, const char *const *env,
                          kv_error *err) {
    char *argv[64];
    int argc = 0;
    argv[argc++] = "kvserve";
    for (int i = 0; flags && flags[i]; i++) argv[argc++] = (char *)flags[i];
    argv[argc] = NULL;
    char *envp[64];
    int n = 0;
    for (int i = 0; env && env[i]; i++) envp[n++] = (char *)env[i];
    envp[n] = NULL;
    memset(err->msg, 0, sizeof err->msg);
    return config_load(c, argc, argv, envp, stdout, err);
}

/* Expects CONFIG_OK. */
static void load_ok(kv_config *c, const char *const *flags, const char *const *env) {
    kv_error err;
    config_status st = load(c, flags, env, &err);
    cr_assert_eq(st, CONFIG_OK, "config_load failed: %s", err.msg);
}

/* Expects CONFIG_ERROR with a message containing each of the NULL-terminated `parts`; frees c. */
static void load_fails(const char *const *flags, const char *const *env, const char *const *parts) {
    kv_config c;
    kv_error err;
    config_status st = load(&c, flags, env, &err);
    cr_assert_eq(st, CONFIG_ERROR, "expected an error, got %d", st);
    for (int i = 0; parts[i]; i++)
        cr_assert_not_null(strstr(err.msg, parts[i]), "message '%s' lacks '%s'", err.msg, parts[i]);
    config_free(&c); /* the struct may be partly filled: must still be safe */
}

#define L(...) ((const char *const[]){__VA_ARGS__, NULL})
#define NONE ((const char *const *)NULL)

/* "KVSERVE_CONFIG=<path>" in a static buffer. */
static const char *env_config(const char *path) {
    static char buf[192];
    snprintf(buf, sizeof buf, "KVSERVE_CONFIG=%s", path);
    return buf;
}

/* ---------------------------------------------------------------- defaults */

/* --draft-model: a flag over the variable; "" turns it off again. */
Test(config, draft_model_from_env_and_flag) {
    kv_config c;
    load_ok(&c, NONE, L("KVSERVE_DRAFT_MODEL=small.gguf"));
    cr_assert_str_eq(c.draft_model, "small.gguf");
    config_free(&c);
    load_ok(&c, L("--draft-model", "other.gguf"), L("KVSERVE_DRAFT_MODEL=small.gguf"));
    cr_assert_str_eq(c.draft_model, "other.gguf");
    config_free(&c);
    load_ok(&c, L("--draft-model", ""), L("KVSERVE_DRAFT_MODEL=small.gguf"));
    cr_assert_null(c.draft_model);
    config_free(&c);
}

static void check_defaults(const kv_config *c) {
    cr_assert_str_eq(c->model, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    cr_assert_null(c->aliases);
    cr_assert_eq(c->n_aliases, 0);
    cr_assert_eq(c->accept_any_model, false);
    cr_assert_null(c->chat_template);
    cr_assert_null(c->draft_model);
    cr_assert_eq(c->precise, false);
    cr_assert_str_eq(c->host, "127.0.0.1");
    cr_assert_eq(c->port, 8080);
    cr_assert_null(c->api_keys);
    cr_assert_eq(c->n_api_keys, 0);
    cr_assert_eq(c->max_body_bytes, 8 << 20);
    cr_assert_eq(c->max_connections, 4096);
    cr_assert_eq(c->http_threads, 4);
    cr_assert_eq(c->idle_timeout, 30);
    cr_assert_eq(c->shutdown_timeout, 30);
    cr_assert_eq(c->webui, true);
    cr_assert_eq(c->threads, 2);
    cr_assert_eq(c->ctx_size, 0);
    cr_assert_eq(c->kv_pool_tokens, 0);
    cr_assert_eq(c->max_seqs, 16);
    cr_assert_eq(c->max_queue, 64);
    cr_assert_eq(c->prefill_chunk, 256);
    cr_assert_eq(c->max_tokens_limit, 0);
    cr_assert_str_eq(c->log_level, "info");
    cr_assert_str_eq(c->simd, "auto");
}

Test(config, defaults) {
    kv_config c;
    config_defaults(&c);
    check_defaults(&c);
    config_free(&c);
    config_free(&c); /* idempotent */

    load_ok(&c, NONE, NONE);
    check_defaults(&c);
    config_free(&c);
}

Test(config, defaults_ignore_other_environment) {
    kv_config c;
    log_set_level(LOG_LEVEL_ERROR); /* "KVSERVE_" is warned about; keep the test output quiet */
    load_ok(&c, NONE, L("PATH=/usr/bin", "HOME=/root", "KVSERVE", "KVSERVE_=x"));
    check_defaults(&c);
    config_free(&c);
}

/* ---------------------------------------------------------------- layers */

static const char *LAYER_JSON = "{\"port\": 1000, \"model\": \"file.gguf\", \"precise\": true,"
                                " \"api_keys\": [\"f1\", \"f2\"], \"alias\": \"from-file\"}";

Test(config, file_overrides_defaults) {
    const char *p = write_file("conf.json", LAYER_JSON);
    kv_config c;
    load_ok(&c, L("--config", p), NONE);
    cr_assert_eq(c.port, 1000);
    cr_assert_str_eq(c.model, "file.gguf");
    cr_assert_eq(c.precise, true);
    cr_assert_eq(c.n_api_keys, 2);
    cr_assert_str_eq(c.api_keys[0], "f1");
    cr_assert_str_eq(c.api_keys[1], "f2");
    cr_assert_eq(c.n_aliases, 1);
    cr_assert_str_eq(c.aliases[0], "from-file");
    cr_assert_eq(c.threads, 2, "options the file does not name keep their defaults");
    config_free(&c);
}

Test(config, env_overrides_file) {
    const char *p = write_file("conf.json", LAYER_JSON);
    kv_config c;
    load_ok(&c, NONE,
            L(env_config(p), "KVSERVE_PORT=2000", "KVSERVE_MODEL=env.gguf", "KVSERVE_PRECISE=off",
              "KVSERVE_API_KEYS=e1, e2,e3"));
    cr_assert_eq(c.port, 2000);
    cr_assert_str_eq(c.model, "env.gguf");
    cr_assert_eq(c.precise, false);
    cr_assert_eq(c.n_api_keys, 3, "the environment's keys replace the file's");
    cr_assert_str_eq(c.api_keys[0], "e1");
    cr_assert_str_eq(c.api_keys[1], "e2");
    cr_assert_str_eq(c.api_keys[2], "e3");
    cr_assert_eq(c.n_aliases, 1);
    cr_assert_str_eq(c.aliases[0], "from-file");
    config_free(&c);
}

Test(config, flags_override_env) {
    const char *p = write_file("conf.json", LAYER_JSON);
    kv_config c;
    load_ok(
        &c,
        L("--port", "3000", "-m", "flag.gguf", "--precise", "--api-key", "k1", "--api-key", "k2"),
        L(env_config(p), "KVSERVE_PORT=2000", "KVSERVE_MODEL=env.gguf", "KVSERVE_PRECISE=0",
          "KVSERVE_API_KEYS=e1,e2"));
    cr_assert_eq(c.port, 3000);
    cr_assert_str_eq(c.model, "flag.gguf");
    cr_assert_eq(c.precise, true);
    cr_assert_eq(c.n_api_keys, 2);
    cr_assert_str_eq(c.api_keys[0], "k1");
    cr_assert_str_eq(c.api_keys[1], "k2");
    config_free(&c);
}

Test(config, bool_flag_forms) {
    kv_config c;
    load_ok(&c, L("--no-precise"), L("KVSERVE_PRECISE=yes"));
    cr_assert_eq(c.precise, false);
    config_free(&c);
    load_ok(&c, L("--precise=false"), L("KVSERVE_PRECISE=true"));
    cr_assert_eq(c.precise, false);
    config_free(&c);
    load_ok(&c, L("--precise=ON"), NONE);
    cr_assert_eq(c.precise, true);
    config_free(&c);
    load_ok(&c, L("--precise", "--no-precise"), NONE);
    cr_assert_eq(c.precise, false, "the last flag wins");
    config_free(&c);
}

Test(config, bool_env_spellings) {
    static const char *const yes[] = {"1", "true", "yes", "on", "TRUE", "Yes"};
    static const char *const no[] = {"0", "false", "no", "off", "OFF"};
    char buf[64];
    kv_config c;
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
        snprintf(buf, sizeof buf, "KVSERVE_PRECISE=%s", yes[i]);
        load_ok(&c, NONE, L(buf));
        cr_assert_eq(c.precise, true, "%s", buf);
        config_free(&c);
    }
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++) {
        snprintf(buf, sizeof buf, "KVSERVE_PRECISE=%s", no[i]);
        load_ok(&c, NONE, L("KVSERVE_PRECISE=1", buf));
        cr_assert_eq(c.precise, false, "%s", buf);
        config_free(&c);
    }
}

Test(config, api_key_env_single_and_list_combine) {
    const char *p = write_file("conf.json", "{\"api_keys\": [\"f1\"]}");
    kv_config c;
    load_ok(&c, L("--config", p), L("KVSERVE_API_KEYS=a,b", "KVSERVE_API_KEY=c"));
    cr_assert_eq(c.n_api_keys, 3);
    cr_assert_str_eq(c.api_keys[0], "a");
    cr_assert_str_eq(c.api_keys[1], "b");
    cr_assert_str_eq(c.api_keys[2], "c");
    config_free(&c);

    load_ok(&c, L("--config", p), L("KVSERVE_API_KEY=only"));
    cr_assert_eq(c.n_api_keys, 1);
    cr_assert_str_eq(c.api_keys[0], "only");
    config_free(&c);
}

Test(config, api_keys_empty_array_in_file) {
    const char *p = write_file("conf.json", "{\"api_keys\": []}");
    kv_config c;
    load_ok(&c, L("--config", p), NONE);
    cr_assert_eq(c.n_api_keys, 0);
    config_free(&c);
}

Test(config, later_strings_replace_earlier) {
    /* Each replacement frees the previous copy: ASan/LSan builds catch a leak or double free. */
    const char *p = write_file("conf.json", "{\"host\": \"0.0.0.0\", \"chat_template\": \"chatml\","
                                            " \"log_level\": \"debug\"}");
    kv_config c;
    load_ok(&c, L("--host", "::1", "--host=10.0.0.1", "--chat-template", "llama3"),
            L(env_config(p), "KVSERVE_HOST=192.168.1.1", "KVSERVE_CHAT_TEMPLATE=zephyr",
              "KVSERVE_LOG_LEVEL=WARN"));
    cr_assert_str_eq(c.host, "10.0.0.1");
    cr_assert_str_eq(c.chat_template, "llama3");
    cr_assert_str_eq(c.log_level, "warn", "enum values are stored in canonical case");
    config_free(&c);
}

Test(config, empty_env_resets_optional_strings) {
    const char *p = write_file("conf.json", "{\"alias\": \"x\", \"chat_template\": \"chatml\"}");
    kv_config c;
    load_ok(&c, NONE, L(env_config(p), "KVSERVE_ALIAS=", "KVSERVE_CHAT_TEMPLATE="));
    cr_assert_eq(c.n_aliases, 0);
    cr_assert_null(c.chat_template);
    config_free(&c);
}

Test(config, json_null_resets_optional_strings) {
    const char *p = write_file("conf.json", "{\"alias\": null}");
    kv_config c;
    load_ok(&c, L("--alias", "a", "--config", p), NONE);
    cr_assert_str_eq(c.aliases[0], "a", "the flag still wins over the file");
    config_free(&c);
    load_ok(&c, L("--config", p), L("KVSERVE_ALIAS=b"));
    cr_assert_str_eq(c.aliases[0], "b");
    config_free(&c);
    load_ok(&c, L("--config", p), NONE);
    cr_assert_eq(c.n_aliases, 0);
    config_free(&c);
}

/* --alias is a list like --api-key: a repeated flag keeps its order, a variable is
 * comma-separated, the file takes an array (or one string), each layer replaces the aliases of
 * the layers below, and an empty value resets them to none (the file name). */
Test(config, repeated_alias) {
    const char *p = write_file("conf.json", "{\"alias\": [\"f1\", \"f2\"], \"api_keys\": [\"k\"]}");
    kv_config c;
    load_ok(&c, L("--config", p), NONE);
    cr_assert_eq(c.n_aliases, 2);
    cr_assert_str_eq(c.aliases[0], "f1");
    cr_assert_str_eq(c.aliases[1], "f2");
    config_free(&c);
    load_ok(&c, NONE, L(env_config(p), "KVSERVE_ALIAS=e1, e2"));
    cr_assert_eq(c.n_aliases, 2);
    cr_assert_str_eq(c.aliases[0], "e1");
    cr_assert_str_eq(c.aliases[1], "e2");
    config_free(&c);
    /* each list is replaced by its own first flag, whatever flags come between */
    load_ok(&c, L("--alias", "a", "--api-key", "k2", "--alias=b", "--alias", "gpt-4o,mini"),
            L(env_config(p), "KVSERVE_ALIAS=e1"));
    cr_assert_eq(c.n_aliases, 3);
    cr_assert_str_eq(c.aliases[0], "a", "the first is the one responses report");
    cr_assert_str_eq(c.aliases[1], "b");
    cr_assert_str_eq(c.aliases[2], "gpt-4o,mini", "a flag is one name, commas and all");
    cr_assert_eq(c.n_api_keys, 1);
    cr_assert_str_eq(c.api_keys[0], "k2");
    config_free(&c);
    load_ok(&c, L("--alias", "a", "--alias", ""), L(env_config(p)));
    cr_assert_eq(c.n_aliases, 0);
    cr_assert_null(c.aliases);
    config_free(&c);
    load_fails(NONE, L("KVSERVE_ALIAS=a,,b"), L("KVSERVE_ALIAS: item 2: empty alias"));
}

Test(config, accept_any_model) {
    const char *p = write_file("conf.json", "{\"accept_any_model\": true}");
    kv_config c;
    load_ok(&c, L("--config", p), NONE);
    cr_assert(c.accept_any_model);
    config_free(&c);
    load_ok(&c, L("--no-accept-any-model"), L(env_config(p)));
    cr_assert_not(c.accept_any_model);
    config_free(&c);
    load_ok(&c, L("--accept-any-model"), NONE);
    cr_assert(c.accept_any_model);
    config_free(&c);
    load_ok(&c, NONE, L("KVSERVE_ACCEPT_ANY_MODEL=yes"));
    cr_assert(c.accept_any_model);
    config_free(&c);
}

Test(config, webui_turned_off_by_flag_env_or_file) {
    const char *p = write_file("conf.json", "{\"webui\": false}");
    const struct {
        const char *const *flags, *const *env;
        bool on;
    } cases[] = {
        {L("--no-webui"), NONE, false},
        {NONE, L("KVSERVE_WEBUI=off"), false},
        {L("--config", p), NONE, false},
        {L("--webui"), L("KVSERVE_WEBUI=0"), true}, /* the flag beats the environment */
        {NONE, NONE, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kv_config c;
        load_ok(&c, cases[i].flags, cases[i].env);
        cr_assert_eq(c.webui, cases[i].on, "case %zu", i);
        config_free(&c);
    }
    load_fails(NONE, L("KVSERVE_WEBUI=maybe"), L("KVSERVE_WEBUI"));
}

/* ---------------------------------------------------------------- the config file's path */

Test(config, config_flag_beats_env) {
    const char *a = write_file("conf.json", "{\"threads\": 3}");
    const char *b = write_file("other.json", "{\"threads\": 5}");
    kv_config c;
    load_ok(&c, NONE, L(env_config(a)));
    cr_assert_eq(c.threads, 3);
    config_free(&c);
    load_ok(&c, L("--config", b), L(env_config(a)));
    cr_assert_eq(c.threads, 5);
    config_free(&c);
    char eq[192];
    snprintf(eq, sizeof eq, "--config=%s", a);
    load_ok(&c, L(eq), NONE);
    cr_assert_eq(c.threads, 3);
    config_free(&c);
}

Test(config, config_path_errors) {
    char missing[128];
    snprintf(missing, sizeof missing, "%s/nope.json", g_dir);
    load_fails(L("--config", missing), NONE, L("nope.json", "cannot open"));
    load_fails(NONE, L(env_config(missing)), L("nope.json", "cannot open"));
    load_fails(L("--config"), NONE, L("--config", "missing value"));
    load_fails(L("--config="), NONE, L("--config", "empty path"));
    load_fails(NONE, L("KVSERVE_CONFIG="), L("KVSERVE_CONFIG", "empty path"));
    load_fails(L("--config", g_dir), NONE, L("is a directory"));
}

/* ---------------------------------------------------------------- bad JSON files */

Test(config, malformed_json) {
    const char *p = write_file("conf.json", "{\"port\": 9000,,}");
    load_fails(L("--config", p), NONE, L("conf.json:1:", "invalid JSON"));
}

Test(config, duplicate_json_keys) {
    const char *p = write_file("conf.json", "{\"port\": 9000,\n \"port\": 9001}");
    load_fails(L("--config", p), NONE, L("conf.json:2:", "duplicate"));
}

Test(config, json_top_level_not_object) {
    const char *p = write_file("conf.json", "[1, 2]");
    load_fails(L("--config", p), NONE, L("conf.json: expected a JSON object", "got an array"));
}

Test(config, unknown_json_key) {
    const char *p = write_file("conf.json", "{\"threads\": 4, \"prot\": 9000}");
    load_fails(L("--config", p), NONE, L("conf.json: unknown key 'prot'", "did you mean 'port'"));
    p = write_file("conf.json", "{\"max-seqs\": 4}");
    load_fails(L("--config", p), NONE, L("unknown key 'max-seqs'", "'max_seqs'"));
    p = write_file("conf.json", "{\"zzzzzz\": 4}");
    kv_config c;
    kv_error err;
    cr_assert_eq(load(&c, L("--config", p), NONE, &err), CONFIG_ERROR);
    cr_assert_null(strstr(err.msg, "did you mean"), "no hint for a far name: %s", err.msg);
    config_free(&c);
}

Test(config, json_wrong_types) {
    static const struct {
        const char *json, *want;
    } cases[] = {
        {"{\"max_seqs\": \"8\"}",
         "conf.json: key 'max_seqs': expected an integer in [1, 256], got a string"},
        {"{\"port\": 80.5}", "key 'port': expected an integer in [1, 65535], got a number"},
        {"{\"port\": null}", "key 'port': expected an integer in [1, 65535], got null"},
        {"{\"precise\": \"true\"}", "key 'precise': expected a boolean, got a string"},
        {"{\"precise\": 1}", "key 'precise': expected a boolean, got an integer"},
        {"{\"model\": 5}", "key 'model': expected a string, got an integer"},
        {"{\"model\": null}", "key 'model': expected a string, got null"},
        {"{\"model\": \"\"}", "key 'model': empty value"},
        {"{\"alias\": 3}", "key 'alias': expected a string, an array of strings or null, got an "
                           "integer"},
        {"{\"alias\": [\"a\", \"\"]}", "key 'alias': index 1: empty alias"},
        {"{\"api_keys\": \"k\"}", "key 'api_keys': expected an array of strings, got a string"},
        {"{\"api_keys\": [\"a\", 3]}", "key 'api_keys': expected an array of strings, got an "
                                       "integer at index 1"},
        {"{\"api_keys\": [\"a\", \"\"]}", "key 'api_keys': index 1: empty API key"},
        {"{\"api_keys\": [\"a b\"]}", "key 'api_keys': index 0: API key contains a space"},
        {"{\"log_level\": \"verbose\"}",
         "key 'log_level': 'verbose' is not one of error, warn, info, debug"},
        {"{\"log_level\": 2}", "key 'log_level': expected one of error, warn, info, debug, got"},
        {"{\"host\": \"a\\u0000b\"}", "invalid JSON"}, /* no NUL can reach a string */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *p = write_file("conf.json", cases[i].json);
        load_fails(L("--config", p), NONE, L(cases[i].want));
    }
}

Test(config, json_out_of_range) {
    const char *p = write_file("conf.json", "{\"port\": 70000}");
    load_fails(L("--config", p), NONE,
               L("conf.json: key 'port': 70000 is not an integer in [1, 65535]"));
    p = write_file("conf.json", "{\"ctx_size\": 8}");
    load_fails(L("--config", p), NONE,
               L("key 'ctx_size': 8 is not 0 or an integer in [16, 16777216]"));
    p = write_file("conf.json", "{\"max_body_bytes\": \"2G\"}");
    load_fails(L("--config", p), NONE, L("key 'max_body_bytes': '2G' is not a size"));
}

Test(config, error_after_file_strings_frees_cleanly) {
    /* The file sets strings, then the environment fails: config_free releases what was set. */
    const char *p =
        write_file("conf.json", "{\"model\": \"m.gguf\", \"alias\": \"a\", "
                                "\"api_keys\": [\"k1\", \"k2\"], \"log_level\": \"debug\"}");
    load_fails(NONE, L(env_config(p), "KVSERVE_HOST=h", "KVSERVE_THREADS=abc"),
               L("KVSERVE_THREADS: 'abc' is not an integer in [1, 256]"));
    load_fails(L("--model", "x", "--api-key", "k3", "--port", "0"), L(env_config(p)),
               L("--port: '0' is not an integer in [1, 65535]"));
    /* A JSON error part-way through the object: earlier keys are already applied. */
    p = write_file("conf.json", "{\"model\": \"m.gguf\", \"api_keys\": [\"k1\"], \"port\": \"x\"}");
    load_fails(L("--config", p), NONE, L("key 'port'"));
}

/* ---------------------------------------------------------------- bad values: env, flags */

Test(config, env_bad_values) {
    load_fails(NONE, L("KVSERVE_THREADS=abc"),
               L("KVSERVE_THREADS: 'abc' is not an integer in [1, 256]"));
    load_fails(NONE, L("KVSERVE_PORT="), L("KVSERVE_PORT: '' is not an integer in [1, 65535]"));
    load_fails(NONE, L("KVSERVE_PORT=80x"), L("KVSERVE_PORT: '80x' is not an integer"));
    load_fails(NONE, L("KVSERVE_PORT= 80"), L("KVSERVE_PORT: ' 80' is not an integer"));
    load_fails(NONE, L("KVSERVE_PORT=+80"), L("KVSERVE_PORT: '+80' is not"));
    load_fails(NONE, L("KVSERVE_PORT=0x50"), L("KVSERVE_PORT: '0x50' is not"));
    load_fails(NONE, L("KVSERVE_PORT=99999999999999999999999"), L("KVSERVE_PORT: '9999"));
    load_fails(NONE, L("KVSERVE_PORT=80K"), L("KVSERVE_PORT: '80K' is not"));
    load_fails(NONE, L("KVSERVE_MAX_QUEUE=-1"),
               L("KVSERVE_MAX_QUEUE: '-1' is not an integer in [1, 100000]"));
    load_fails(NONE, L("KVSERVE_PRECISE=maybe"), L("KVSERVE_PRECISE: 'maybe' is not a boolean"));
    load_fails(NONE, L("KVSERVE_PRECISE="), L("KVSERVE_PRECISE: '' is not a boolean"));
    load_fails(NONE, L("KVSERVE_MODEL="), L("KVSERVE_MODEL: empty value"));
    load_fails(NONE, L("KVSERVE_LOG_LEVEL=verbose"),
               L("KVSERVE_LOG_LEVEL: 'verbose' is not one of"));
    load_fails(NONE, L("KVSERVE_API_KEYS="), L("KVSERVE_API_KEYS: empty list"));
    load_fails(NONE, L("KVSERVE_API_KEYS=a,,b"), L("KVSERVE_API_KEYS: item 2: empty API key"));
    load_fails(NONE, L("KVSERVE_API_KEYS=a,"), L("KVSERVE_API_KEYS: item 2: empty API key"));
    load_fails(NONE, L("KVSERVE_API_KEY="), L("KVSERVE_API_KEY: empty API key"));
    load_fails(NONE, L("KVSERVE_KV_POOL_TOKENS=15"),
               L("KVSERVE_KV_POOL_TOKENS: '15' is not 0 or an integer in [16, 1073741824]"));
}

Test(config, flag_bad_values) {
    load_fails(L("--port", "70000"), NONE, L("--port: '70000' is not an integer in [1, 65535]"));
    load_fails(L("--port=70000"), NONE, L("--port: '70000' is not an integer in [1, 65535]"));
    load_fails(L("-t", "0"), NONE, L("-t: '0' is not an integer in [1, 256]"));
    load_fails(L("-c", "8"), NONE, L("-c: '8' is not 0 or an integer in [16, 16777216]"));
    load_fails(L("--precise=maybe"), NONE, L("--precise: 'maybe' is not a boolean"));
    load_fails(L("--no-precise=1"), NONE, L("--no-precise: takes no value"));
    load_fails(L("--model="), NONE, L("--model: empty value"));
    load_fails(L("--log-level", "loud"), NONE, L("--log-level: 'loud' is not one of error, warn"));
    load_fails(L("--simd", "avx3"), NONE, L("--simd: 'avx3' is not one of auto, avx512, avx2"));
    load_fails(L("--api-key", "a\tb"), NONE, L("--api-key: API key contains"));
    load_fails(L("--prefill-chunk", "8193"), NONE,
               L("--prefill-chunk: '8193' is not an integer in [16, 8192]"));
}

Test(config, flag_syntax_errors) {
    load_fails(L("--prot", "9000"), NONE, L("unknown option '--prot'", "did you mean '--port'"));
    load_fails(L("--max_seqs", "4"), NONE, L("unknown option '--max_seqs'", "'--max-seqs'"));
    load_fails(L("--api-keys", "k"), NONE, L("unknown option '--api-keys'", "'--api-key'"));
    load_fails(L("--no-port"), NONE, L("unknown option '--no-port'"));
    load_fails(L("-x"), NONE, L("unknown option '-x'"));
    load_fails(L("-t4"), NONE, L("unknown option '-t4'"));
    load_fails(L("--"), NONE, L("unknown option '--'"));
    load_fails(L("--port"), NONE, L("--port: missing value"));
    load_fails(L("-m"), NONE, L("-m: missing value"));
    load_fails(L("--model", "--port", "9000"), NONE, L("--model: missing value"));
    load_fails(L("serve.gguf"), NONE, L("unexpected argument 'serve.gguf'"));
    load_fails(L("--precise", "false"), NONE, L("unexpected argument 'false'"));
    load_fails(L("-"), NONE, L("unexpected argument '-'"));
}

Test(config, flag_value_may_start_with_dash_in_eq_form) {
    kv_config c;
    load_ok(&c, L("--alias=-weird-", "--api-key=-k"), NONE);
    cr_assert_str_eq(c.aliases[0], "-weird-");
    cr_assert_str_eq(c.api_keys[0], "-k");
    config_free(&c);
}

/* ---------------------------------------------------------------- forms, sizes, ranges */

Test(config, flag_forms) {
    kv_config c;
    load_ok(&c,
            L("--port=9000", "-t", "4", "-c", "2048", "-m", "x.gguf", "--max-seqs=8",
              "--kv-pool-tokens", "65536", "--max-tokens-limit=0", "--max-queue", "1"),
            NONE);
    cr_assert_eq(c.port, 9000);
    cr_assert_eq(c.threads, 4);
    cr_assert_eq(c.ctx_size, 2048);
    cr_assert_str_eq(c.model, "x.gguf");
    cr_assert_eq(c.max_seqs, 8);
    cr_assert_eq(c.kv_pool_tokens, 65536);
    cr_assert_eq(c.max_tokens_limit, 0);
    cr_assert_eq(c.max_queue, 1);
    config_free(&c);
}

Test(config, range_edges) {
    kv_config c;
    load_ok(&c, L("--port", "1", "-c", "16", "--kv-pool-tokens", "1073741824", "-t", "256"), NONE);
    cr_assert_eq(c.port, 1);
    cr_assert_eq(c.ctx_size, 16);
    cr_assert_eq(c.kv_pool_tokens, INT64_C(1) << 30);
    cr_assert_eq(c.threads, 256);
    config_free(&c);
    load_ok(&c, L("--port", "65535", "-c", "16777216", "-c", "0"), NONE);
    cr_assert_eq(c.port, 65535);
    cr_assert_eq(c.ctx_size, 0, "0 (model default) is allowed outside [16, 2^24]");
    config_free(&c);
}

Test(config, size_suffixes) {
    kv_config c;
    load_ok(&c, L("--max-body-bytes", "64K"), NONE);
    cr_assert_eq(c.max_body_bytes, 65536);
    config_free(&c);
    load_ok(&c, NONE, L("KVSERVE_MAX_BODY_BYTES=2M"));
    cr_assert_eq(c.max_body_bytes, 2 << 20);
    config_free(&c);
    load_ok(&c, L("--max-body-bytes=1g"), NONE);
    cr_assert_eq(c.max_body_bytes, INT64_C(1) << 30);
    config_free(&c);
    load_ok(&c, L("--max-body-bytes=16MiB"), NONE);
    cr_assert_eq(c.max_body_bytes, 16 << 20);
    config_free(&c);
    load_ok(&c, L("--max-body-bytes=4096"), NONE);
    cr_assert_eq(c.max_body_bytes, 4096);
    config_free(&c);
    const char *p = write_file("conf.json", "{\"max_body_bytes\": \"512K\"}");
    load_ok(&c, L("--config", p), NONE);
    cr_assert_eq(c.max_body_bytes, 512 << 10);
    config_free(&c);
    p = write_file("conf.json", "{\"max_body_bytes\": 2048}");
    load_ok(&c, L("--config", p), NONE);
    cr_assert_eq(c.max_body_bytes, 2048);
    config_free(&c);

    load_fails(L("--max-body-bytes", "2G"), NONE,
               L("--max-body-bytes: '2G' is not a size in [1024, 1073741824]"));
    load_fails(L("--max-body-bytes", "1023"), NONE, L("--max-body-bytes: '1023' is not a size"));
    load_fails(L("--max-body-bytes", "8X"), NONE, L("--max-body-bytes: '8X' is not a size"));
    load_fails(L("--max-body-bytes", "8MB"), NONE, L("--max-body-bytes: '8MB' is not a size"));
    load_fails(L("--max-body-bytes", "K"), NONE, L("--max-body-bytes: 'K' is not a size"));
    load_fails(L("--max-body-bytes", "9999999999999G"), NONE, L("--max-body-bytes: '9999"));
    load_fails(L("--port", "8K"), NONE, L("--port: '8K' is not an integer"));
}

/* ---------------------------------------------------------------- unknown variables */

/* Runs fn with stderr sent to a file in g_dir and returns what it wrote (caller frees). */
static char *capture_stderr(void (*fn)(void)) {
    char path[128];
    snprintf(path, sizeof path, "%s/stderr.txt", g_dir);
    fflush(stderr);
    int saved = dup(2);
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    cr_assert(saved >= 0 && fd >= 0);
    dup2(fd, 2);
    close(fd);
    fn();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f);
    char *text = calloc(1, 8192);
    cr_assert_not_null(text);
    size_t n = fread(text, 1, 8191, f);
    text[n] = '\0';
    fclose(f);
    return text;
}

static void load_with_unknown_env(void) {
    kv_config c;
    load_ok(&c, NONE,
            L("KVSERVE_PROT=1", "KVSERVE_BIN=build/kvserve", "KVSERVE_PROT=2", "KVSERVE_PORT=81"));
    cr_assert_eq(c.port, 81);
    config_free(&c);
}

Test(config, unknown_env_warns_once_per_name) {
    char *text = capture_stderr(load_with_unknown_env);
    const char *first = strstr(text, "KVSERVE_PROT");
    cr_assert_not_null(first, "no warning for KVSERVE_PROT: %s", text);
    int n_prot = 0;
    for (const char *s = text; (s = strstr(s, "variable KVSERVE_PROT")) != NULL; s++) n_prot++;
    cr_assert_eq(n_prot, 1, "expected one warning for KVSERVE_PROT: %s", text);
    cr_assert_not_null(strstr(text, "did you mean 'KVSERVE_PORT'"), "%s", text);
    cr_assert_not_null(strstr(text, "KVSERVE_BIN"), "%s", text);
    free(text);
}

/* ---------------------------------------------------------------- help */

/* Every option's flag and variable, written out here so a renamed option fails the test. */
static const char *const ALL_FLAGS[] = {
    "--simd",
    "--allowed-origins",
    "--allowed-hosts",
    "--get-load-format",
    "--drain-grace",
    "--device",
    "--cache",
    "--no-cache",
    "--cache-chunk-tokens",
    "--cache-ram-bytes",
    "--cache-dir",
    "--cache-disk-bytes",
    "--cache-disk-encoded",
    "--cache-ram-encoding",
    "--blend",
    "--no-blend",
    "--blend-recompute",
    "--blend-ram-bytes",
    "--blend-chunk",
    "--model",
    "-m",
    "--alias",
    "--accept-any-model",
    "--no-accept-any-model",
    "--chat-template",
    "--precise",
    "--no-precise",
    "--host",
    "--port",
    "--api-key",
    "--max-body-bytes",
    "--max-connections",
    "--webui",
    "--no-webui",
    "--threads",
    "-t",
    "--ctx-size",
    "-c",
    "--kv-pool-tokens",
    "--max-seqs",
    "--max-queue",
    "--prefill-chunk",
    "--max-tokens-limit",
    "--draft-model",
    "--responses-store",
    "--responses-store-bytes",
    "--log-level",
    "--config",
    "--help",
    "-h",
};
static const char *const ALL_ENV[] = {
    "KVSERVE_SIMD",
    "KVSERVE_ALLOWED_ORIGINS",
    "KVSERVE_ALLOWED_HOSTS",
    "KVSERVE_GET_LOAD_FORMAT",
    "KVSERVE_DRAIN_GRACE",
    "KVSERVE_DRAFT_MODEL",
    "KVSERVE_RESPONSES_STORE",
    "KVSERVE_RESPONSES_STORE_BYTES",
    "KVSERVE_DEVICE",
    "KVSERVE_CACHE",
    "KVSERVE_CACHE_CHUNK_TOKENS",
    "KVSERVE_CACHE_RAM_BYTES",
    "KVSERVE_BLEND",
    "KVSERVE_BLEND_RECOMPUTE",
    "KVSERVE_BLEND_RAM_BYTES",
    "KVSERVE_BLEND_CHUNK",
    "KVSERVE_CACHE_DIR",
    "KVSERVE_CACHE_DISK_BYTES",
    "KVSERVE_MODEL",
    "KVSERVE_ALIAS",
    "KVSERVE_ACCEPT_ANY_MODEL",
    "KVSERVE_CHAT_TEMPLATE",
    "KVSERVE_PRECISE",
    "KVSERVE_HOST",
    "KVSERVE_PORT",
    "KVSERVE_API_KEYS",
    "KVSERVE_API_KEY",
    "KVSERVE_MAX_BODY_BYTES",
    "KVSERVE_MAX_CONNECTIONS",
    "KVSERVE_WEBUI",
    "KVSERVE_THREADS",
    "KVSERVE_CTX_SIZE",
    "KVSERVE_KV_POOL_TOKENS",
    "KVSERVE_MAX_SEQS",
    "KVSERVE_MAX_QUEUE",
    "KVSERVE_PREFILL_CHUNK",
    "KVSERVE_REDIS_CODEC",
    "KVSERVE_TTFT_BUDGET_MS",
    "KVSERVE_MAX_TOKENS_LIMIT",
    "KVSERVE_LOG_LEVEL",
    "KVSERVE_CONFIG",
};

static char *help_text(const char *const *flags, const char *const *env, config_status *st) {
    char *buf = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&buf, &len);
    cr_assert_not_null(out);
    char *argv[16];
    int argc = 0;
    argv[argc++] = "kvserve-serve";
    for (int i = 0; flags[i]; i++) argv[argc++] = (char *)flags[i];
    argv[argc] = NULL;
    char *envp[8];
    int n = 0;
    for (int i = 0; env && env[i]; i++) envp[n++] = (char *)env[i];
    envp[n] = NULL;
    kv_config c;
    kv_error err = {{0}};
    *st = config_load(&c, argc, argv, envp, out, &err);
    config_free(&c);
    fclose(out);
    return buf;
}

Test(config, help_lists_every_option) {
    config_status st;
    char *text = help_text(L("--help"), NONE, &st);
    cr_assert_eq(st, CONFIG_HELP);
    cr_assert_not_null(strstr(text, "Usage: kvserve-serve"), "%s", text);
    for (size_t i = 0; i < sizeof ALL_FLAGS / sizeof ALL_FLAGS[0]; i++) {
        char word[64];
        snprintf(word, sizeof word, "%s ", ALL_FLAGS[i]);
        char word2[64];
        snprintf(word2, sizeof word2, "%s,", ALL_FLAGS[i]);
        char word3[64]; /* a flag too wide for the column has its help on the next line */
        snprintf(word3, sizeof word3, "%s\n", ALL_FLAGS[i]);
        cr_assert(strstr(text, word) || strstr(text, word2) || strstr(text, word3),
                  "help lacks %s:\n%s", ALL_FLAGS[i], text);
    }
    for (size_t i = 0; i < sizeof ALL_ENV / sizeof ALL_ENV[0]; i++) {
        char word[64];
        snprintf(word, sizeof word, "%s ", ALL_ENV[i]);
        char word2[64];
        snprintf(word2, sizeof word2, "%s;", ALL_ENV[i]);
        cr_assert(strstr(text, word) || strstr(text, word2), "help lacks %s:\n%s", ALL_ENV[i],
                  text);
    }
    cr_assert_not_null(strstr(text, "models/SmolLM2-135M-Instruct.Q4_1.gguf"), "default shown");
    cr_assert_not_null(strstr(text, "precedence"), "the layer order is explained");
    /* Lines stay readable in an 100-column terminal. */
    for (const char *line = text; *line;) {
        const char *nl = strchr(line, '\n');
        size_t n = nl ? (size_t)(nl - line) : strlen(line);
        cr_assert(n <= 100, "help line of %zu columns: %.*s", n, (int)n, line);
        line += n + (nl != NULL);
    }
    free(text);
}

Test(config, help_wins_over_other_errors) {
    config_status st;
    char *text = help_text(L("--port", "bad", "-h"), L("KVSERVE_CONFIG=/nonexistent/x.json"), &st);
    cr_assert_eq(st, CONFIG_HELP);
    cr_assert_not_null(strstr(text, "--max-body-bytes"));
    free(text);
}

Test(config, cache_options) {
    kv_config c;
    config_defaults(&c);
    cr_assert(c.cache);
    cr_assert_eq(c.cache_chunk_tokens, 256);
    cr_assert_str_eq(c.cache_dir, "auto");
    cr_assert_eq(c.cache_ram_bytes, INT64_C(2) << 30);
    cr_assert_eq(c.cache_disk_bytes, INT64_C(4) << 30);
    kv_error err = {{0}};
    char *argv[] = {"kvserve",
                    "--no-cache",
                    "--cache-ram-bytes",
                    "0",
                    "--cache-dir",
                    "/tmp/x",
                    "--cache-disk-bytes",
                    "64M",
                    "--cache-chunk-tokens",
                    "512",
                    NULL};
    cr_assert_eq(config_load(&c, 10, argv, NULL, NULL, &err), CONFIG_OK, "%s", err.msg);
    cr_assert_not(c.cache);
    cr_assert_eq(c.cache_ram_bytes, 0);
    cr_assert_str_eq(c.cache_dir, "/tmp/x");
    cr_assert_eq(c.cache_disk_bytes, INT64_C(64) << 20);
    cr_assert_eq(c.cache_chunk_tokens, 512);
    config_free(&c);
    config_defaults(&c);
    char *bad[] = {"kvserve", "--cache-disk-bytes", "1K", NULL};
    cr_assert_eq(config_load(&c, 3, bad, NULL, NULL, &err), CONFIG_ERROR);
    cr_assert(strstr(err.msg, "--cache-disk-bytes"), "%s", err.msg);
    config_free(&c);
}

Test(config, responses_store_options) {
    kv_config c;
    config_defaults(&c);
    cr_assert_eq(c.responses_store, 1024);
    cr_assert_eq(c.responses_store_bytes, INT64_C(64) << 20);
    config_free(&c);
    /* 0 stores nothing; the environment sets the bytes, a flag beats it */
    load_ok(&c, L("--responses-store", "0", "--responses-store-bytes", "2M"),
            L("KVSERVE_RESPONSES_STORE_BYTES=1G"));
    cr_assert_eq(c.responses_store, 0);
    cr_assert_eq(c.responses_store_bytes, INT64_C(2) << 20);
    config_free(&c);
    load_ok(&c, NONE, L("KVSERVE_RESPONSES_STORE=7", "KVSERVE_RESPONSES_STORE_BYTES=1G"));
    cr_assert_eq(c.responses_store, 7);
    cr_assert_eq(c.responses_store_bytes, INT64_C(1) << 30);
    config_free(&c);
    load_fails(L("--responses-store", "-1"), NONE, L("--responses-store"));
    load_fails(L("--responses-store-bytes", "1K"), NONE, L("--responses-store-bytes"));
}

Test(config, get_load_format_names_the_router_in_front) {
    kv_config c;
    config_defaults(&c);
    cr_assert_str_eq(c.get_load_format, "sglang");
    config_free(&c);
    load_ok(&c, L("--get-load-format", "vllm"), NONE);
    cr_assert_str_eq(c.get_load_format, "vllm");
    config_free(&c);
    load_ok(&c, NONE, L("KVSERVE_GET_LOAD_FORMAT=vllm"));
    cr_assert_str_eq(c.get_load_format, "vllm");
    config_free(&c);
    load_fails(L("--get-load-format", "nginx"), NONE, L("--get-load-format", "sglang, vllm"));
}

Test(config, drain_grace_in_seconds) {
    kv_config c;
    config_defaults(&c);
    cr_assert_eq(c.drain_grace, 0);
    config_free(&c);
    load_ok(&c, L("--drain-grace", "3"), L("KVSERVE_DRAIN_GRACE=9"));
    cr_assert_eq(c.drain_grace, 3);
    config_free(&c);
    load_fails(L("--drain-grace", "-1"), NONE, L("--drain-grace"));
    load_fails(NONE, L("KVSERVE_DRAIN_GRACE=3601"), L("KVSERVE_DRAIN_GRACE"));
}

Test(config, pin_bytes_from_flag_and_environment) {
    kv_config c;
    config_defaults(&c);
    cr_assert_eq(c.pin_bytes, INT64_C(1) << 30);
    kv_error err = {{0}};
    char *env[] = {"KVSERVE_PIN_BYTES=256M", NULL};
    char *argv[] = {"kvserve", NULL};
    cr_assert_eq(config_load(&c, 1, argv, env, NULL, &err), CONFIG_OK, "%s", err.msg);
    cr_assert_eq(c.pin_bytes, INT64_C(256) << 20);
    config_free(&c);
    config_defaults(&c);
    char *flag[] = {"kvserve", "--pin-bytes", "2G", NULL};
    cr_assert_eq(config_load(&c, 3, flag, env, NULL, &err), CONFIG_OK, "%s", err.msg);
    cr_assert_eq(c.pin_bytes, INT64_C(2) << 30, "a flag beats the environment");
    config_free(&c);
    config_defaults(&c);
    char *bad[] = {"kvserve", "--pin-bytes", "0", NULL};
    cr_assert_eq(config_load(&c, 3, bad, NULL, NULL, &err), CONFIG_ERROR);
    cr_assert(strstr(err.msg, "--pin-bytes"), "%s", err.msg);
    config_free(&c);
}

/* --allowed-origins and --allowed-hosts: comma-separated in a flag as in the variable, a
 * trailing "/" taken, anything that is not an origin (or a host name) refused by name. */
Test(config, allowed_origins_and_hosts) {
    kv_config c;
    load_ok(&c, NONE, NONE);
    cr_assert_eq(c.n_allowed_origins, 0);
    cr_assert_eq(c.n_allowed_hosts, 0);
    config_free(&c);
    load_ok(&c,
            L("--allowed-origins", "http://a.example:3000, https://b.example/",
              "--allowed-hosts=box.lan,10.0.0.5"),
            L("KVSERVE_ALLOWED_ORIGINS=*"));
    cr_assert_eq(c.n_allowed_origins, 2, "the flag's list replaces the environment's");
    cr_assert_str_eq(c.allowed_origins[0], "http://a.example:3000");
    cr_assert_str_eq(c.allowed_origins[1], "https://b.example/");
    cr_assert_eq(c.n_allowed_hosts, 2);
    cr_assert_str_eq(c.allowed_hosts[1], "10.0.0.5");
    config_free(&c);
    load_ok(&c, NONE, L("KVSERVE_ALLOWED_ORIGINS=*,null", "KVSERVE_ALLOWED_HOSTS=*"));
    cr_assert_eq(c.n_allowed_origins, 2);
    cr_assert_str_eq(c.allowed_origins[0], "*");
    cr_assert_str_eq(c.allowed_hosts[0], "*");
    config_free(&c);
    load_fails(L("--allowed-origins", "app.example"), NONE,
               L("--allowed-origins", "scheme://host[:port]"));
    load_fails(L("--allowed-origins", "http://app.example/page"), NONE, L("has a path"));
    load_fails(L("--allowed-hosts", "http://box"), NONE, L("--allowed-hosts", "not a host name"));
    load_fails(L("--allowed-hosts", "box:8080"), NONE, L("not a host name"));
}
