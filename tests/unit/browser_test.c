/* Requests from web browsers (server/http/browser.c) and the transport's work budget: the
 * server's own origins and Host names for loopback, any-address and other listeners, the allowed
 * ones added (and "*"), Host headers with and without ports, JSON content types, the headers a
 * preflight allows; and http_work_take's admission (server/http/http.c). */
#include <criterion/criterion.h>
#include <string.h>

#include "server/http/http.h"

/* b for a listener on host:port with the given allowed lists (NULL-terminated, or NULL). */
static void browser_for(http_browser *b, const char *host, int port, const char **origins,
                        const char **hosts) {
    kv_config c;
    config_defaults(&c);
    c.host = (char *)host;
    c.port = port;
    for (; origins && origins[c.n_allowed_origins];) c.n_allowed_origins++;
    for (; hosts && hosts[c.n_allowed_hosts];) c.n_allowed_hosts++;
    c.allowed_origins = (char **)origins;
    c.allowed_hosts = (char **)hosts;
    kv_error err;
    cr_assert_eq(http_browser_init(b, &c, &err), 0, "%s", err.msg);
}

/* Asserts that check(b, x) is `want` for every x of the NULL-terminated list. */
static void expect_all(bool (*check)(const http_browser *, const char *), const http_browser *b,
                       const char *const *list, bool want) {
    for (int i = 0; list[i]; i++)
        cr_assert_eq(check(b, list[i]), want, "'%s' should be %s", list[i],
                     want ? "answered" : "refused");
}

#define LIST(...) ((const char *const[]){__VA_ARGS__, NULL})

Test(browser, a_loopback_listener_answers_its_own_names_and_pages) {
    http_browser b;
    browser_for(&b, "127.0.0.1", 8080, NULL, NULL);
    cr_assert(b.check_host);
    expect_all(http_browser_origin_ok, &b,
               LIST("http://127.0.0.1:8080", "http://localhost:8080", "http://[::1]:8080",
                    "HTTP://LOCALHOST:8080"),
               true);
    expect_all(http_browser_origin_ok, &b,
               LIST("http://evil.example", "http://localhost:8081", "https://localhost:8080",
                    "null", "http://127.0.0.1:8080.evil.example", ""),
               false);
    cr_assert(http_browser_origin_ok(&b, NULL), "curl and the SDKs send no Origin");
    expect_all(
        http_browser_host_ok, &b,
        LIST("localhost", "localhost:8080", "127.0.0.1:9", "[::1]", "[::1]:8080", "LocalHost"),
        true);
    expect_all(http_browser_host_ok, &b,
               LIST("evil.example", "evil.example:8080", "localhost.evil.example", "localhost:80x",
                    "localhost:", "[::1]x", "127.0.0.2", ""),
               false);
    cr_assert(http_browser_host_ok(&b, NULL));
    http_browser_free(&b);
}

Test(browser, allowed_lists_add_to_the_servers_own) {
    http_browser b;
    const char *origins[] = {"http://app.example:3000/", NULL}, *hosts[] = {"box.lan", NULL};
    browser_for(&b, "127.0.0.2", 80, origins, hosts);
    cr_assert(http_browser_origin_ok(&b, "http://app.example:3000"));
    cr_assert(http_browser_origin_ok(&b, "http://127.0.0.2"), "port 80 is left out");
    cr_assert(http_browser_origin_ok(&b, "http://localhost"));
    cr_assert_not(http_browser_origin_ok(&b, "http://app.example:3001"));
    cr_assert(http_browser_host_ok(&b, "box.lan:80"));
    cr_assert(http_browser_host_ok(&b, "127.0.0.2"), "the bound address");
    cr_assert_not(http_browser_host_ok(&b, "other.lan"));
    http_browser_free(&b);
    const char *any[] = {"*", NULL};
    browser_for(&b, "127.0.0.1", 8080, any, any);
    cr_assert(http_browser_origin_ok(&b, "http://anything.example"));
    cr_assert(http_browser_host_ok(&b, "anything.example"));
    http_browser_free(&b);
}

Test(browser, other_listeners_check_origins_not_hosts) {
    http_browser b;
    browser_for(&b, "0.0.0.0", 8080, NULL, NULL);
    cr_assert_not(b.check_host);
    cr_assert(http_browser_host_ok(&b, "gpu-box.lan:8080"));
    cr_assert(http_browser_origin_ok(&b, "http://localhost:8080"));
    cr_assert(http_browser_origin_ok(&b, "http://0.0.0.0:8080"));
    cr_assert_not(http_browser_origin_ok(&b, "http://gpu-box.lan:8080"));
    http_browser_free(&b);
    browser_for(&b, "10.1.2.3", 8080, NULL, NULL);
    cr_assert(http_browser_origin_ok(&b, "http://10.1.2.3:8080"));
    cr_assert_not(http_browser_origin_ok(&b, "http://localhost:8080"));
    http_browser_free(&b);
    kv_config c;
    config_defaults(&c);
    c.host = "localhost";
    kv_error err;
    cr_assert_eq(http_browser_init(&b, &c, &err), -1);
    cr_assert_not_null(strstr(err.msg, "IPv4"), "%s", err.msg);
}

Test(browser, json_content_types) {
    const char *const types[] = {"application/json",
                                 "Application/JSON",
                                 "application/json; charset=utf-8",
                                 "application/json;charset=UTF-8",
                                 " application/json",
                                 "text/plain",
                                 "application/x-www-form-urlencoded",
                                 "multipart/form-data",
                                 "application/jsonp",
                                 "application/json-seq",
                                 ""};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        cr_assert_eq(http_content_type_is(types[i], "application/json"), i < 5, "%s", types[i]);
    cr_assert_not(http_content_type_is(NULL, "application/json"));
    cr_assert(http_content_type_is("application/xml; charset=utf-8", "application/xml"));
}

Test(browser, preflights_allow_the_headers_asked_for_when_they_are_names) {
    cr_assert_str_eq(http_preflight_headers("authorization, x-stainless-os"),
                     "authorization, x-stainless-os");
    const char *def = http_preflight_headers(NULL);
    cr_assert_not_null(strstr(def, "Authorization"));
    cr_assert_not_null(strstr(def, "Content-Type"));
    cr_assert_str_eq(http_preflight_headers("a\r\nSet-Cookie: x"), def);
    cr_assert_str_eq(http_preflight_headers(""), def);
}

Test(transport, the_work_budget_refuses_past_it_but_never_a_request_alone) {
    http_transport t;
    memset(&t, 0, sizeof t);
    t.work_budget = 100;
    cr_assert(http_work_take(&t, 500), "alone, whatever its size");
    cr_assert_not(http_work_take(&t, 1));
    http_work_release(&t, 500);
    cr_assert(http_work_take(&t, 60));
    cr_assert(http_work_take(&t, 40));
    cr_assert_not(http_work_take(&t, 1), "the budget is spent");
    cr_assert_eq(atomic_load(&t.work_bytes), 100, "a refusal takes nothing");
    http_work_release(&t, 60);
    cr_assert(http_work_take(&t, 50));
    t.work_budget = 0;
    cr_assert(http_work_take(&t, 1 << 30), "0: no bound");
}
