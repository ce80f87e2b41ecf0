/* Tenants (DESIGN.md "Tenants"): which one a request comes from, and their gauges in /metrics.
 * A tenant is an API key, named by its index in --api-key order (the keys' order in the
 * configuration: "0" is the first key), never by the key or a hash of it, since /metrics is
 * public and a short hash would let anyone test guesses of a weak key offline. A server without
 * keys is one tenant, "0". */
#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "server/api/handlers.h"
#include "server/api/responses.h"

int server_tenant(const server *s, const http_call *c) {
    const http_transport *t = &s->http;
    if (t->n_keys == 0 || !c->api_key) return 0;
    uint8_t d[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)c->api_key, strlen(c->api_key), d);
    for (int i = 0; i < t->n_keys; i++)
        if (CRYPTO_memcmp(d, t->key_digests[i], sizeof d) == 0) return i;
    return 0;
}

static void gauge(FILE *f, const char *name, const char *help) {
    fprintf(f, "# HELP %s %s\n# TYPE %s gauge\n", name, help, name);
}

/* The queue's and batch's gauges per tenant. */
static void engine_gauges(server *s, FILE *f, int n) {
    engine_tenant_stats es;
    gauge(f, "kvserve_tenant_requests_waiting", "Requests queued per tenant (API key index).");
    for (int t = 0; t < n; t++) {
        engine_tenant_stats_get(s->eng, t, &es);
        fprintf(f, "kvserve_tenant_requests_waiting{tenant=\"%d\"} %d\n", t, es.waiting);
    }
    gauge(f, "kvserve_tenant_sequences_running", "Sequences in the batch per tenant.");
    for (int t = 0; t < n; t++) {
        engine_tenant_stats_get(s->eng, t, &es);
        fprintf(f, "kvserve_tenant_sequences_running{tenant=\"%d\"} %d\n", t, es.running);
    }
    gauge(f, "kvserve_tenant_queue_share", "Requests a tenant may queue (--tenant-queue-share).");
    fprintf(f, "kvserve_tenant_queue_share %d\n", es.queue_share);
}

/* Pinned and leased bytes per tenant and tier, and what each tier lets a tenant hold. */
static void pin_gauges(server *s, FILE *f, int n) {
    if (!s->store) return;
    cache_tenant_pins p = {0};
    gauge(f, "kvserve_tenant_pinned_bytes",
          "Bytes a tenant holds pinned or cache_control-leased, by tier.");
    for (int t = 0; t < n; t++) {
        cache_store_tenant_pins(s->store, t, &p);
        fprintf(f,
                "kvserve_tenant_pinned_bytes{tenant=\"%d\",tier=\"ram\"} %lld\n"
                "kvserve_tenant_pinned_bytes{tenant=\"%d\",tier=\"disk\"} %lld\n",
                t, (long long)p.ram, t, (long long)p.disk);
    }
    gauge(f, "kvserve_tenant_pin_share_bytes",
          "Pinned and leased bytes one tenant may hold, by tier (--tenant-pin-share).");
    fprintf(f,
            "kvserve_tenant_pin_share_bytes{tier=\"ram\"} %lld\n"
            "kvserve_tenant_pin_share_bytes{tier=\"disk\"} %lld\n",
            (long long)p.ram_share, (long long)p.disk_share);
}

/* Stored responses per tenant. */
static void response_gauges(server *s, FILE *f, int n) {
    if (!s->responses) return;
    resp_store_stats r;
    gauge(f, "kvserve_tenant_responses_stored", "Responses API: stored responses per tenant.");
    for (int t = 0; t < n; t++) {
        resp_store_tenant_stats(s->responses, t, &r);
        fprintf(f, "kvserve_tenant_responses_stored{tenant=\"%d\"} %lld\n", t, (long long)r.count);
    }
    gauge(f, "kvserve_tenant_responses_stored_bytes",
          "Responses API: bytes of stored responses per tenant.");
    for (int t = 0; t < n; t++) {
        resp_store_tenant_stats(s->responses, t, &r);
        fprintf(f, "kvserve_tenant_responses_stored_bytes{tenant=\"%d\"} %lld\n", t,
                (long long)r.bytes);
    }
}

void tenant_metrics(server *s, FILE *f) {
    int n = s->http.n_keys > 1 ? s->http.n_keys : 1;
    engine_gauges(s, f, n);
    pin_gauges(s, f, n);
    response_gauges(s, f, n);
}
