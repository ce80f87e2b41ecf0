/* The fetch policy of the encoded tiers (cache/codec/meter.h). */
#include <stdlib.h>

#include "cache/codec/chunk_codec.h"
#include "cache/codec/meter.h"

/* Decode costs assumed before they are measured, in ns per KV element: lossless is a checksum
 * and a copy, q8 a dequantization, a codec level rANS. */
#define METER_PRIOR_RAW_NS 1.0
#define METER_PRIOR_Q8_NS 2.0
#define METER_PRIOR_CODEC_NS 6.0
/* The share of a TTFT budget a fetch plans to use: the rest is kept for what follows it (the last
 * decode, copying into the pool, the prefill of the prompt's new tokens). */
#define METER_BUDGET_SHARE 0.8
/* A link measure older than this is refreshed by fetching a request's first chunk. */
#define METER_FRESH_NS 10000000000ull

void cache_meter_init(cache_meter *m, const cache_layout *l, int n_enc, double prior_bw) {
    *m = (cache_meter){.n_enc = n_enc, .prior_bw = prior_bw};
    m->elems_per_token = 2.0 * l->n_layer * l->n_kv_head * l->head_dim;
    for (int e = 0; e < n_enc && e < CACHE_ENC_MAX; e++)
        m->dec_ns[e] = e == CACHE_ENC_RAW  ? METER_PRIOR_RAW_NS
                       : e == CACHE_ENC_Q8 ? METER_PRIOR_Q8_NS
                                           : METER_PRIOR_CODEC_NS;
}

void cache_meter_link(cache_meter *m, size_t bytes, uint64_t ns) {
    if (bytes < CACHE_METER_MIN_SAMPLE) return;
    double bw = (double)bytes / (double)(ns + 1);
    m->bw = m->bw > 0 ? 0.5 * m->bw + 0.5 * bw : bw;
    m->bw_at = clock_now_ns();
}

void cache_meter_decode(cache_meter *m, int enc, double elems, uint64_t ns) {
    if (enc < 0 || enc >= m->n_enc || elems <= 0) return;
    m->dec_ns[enc] = 0.5 * m->dec_ns[enc] + 0.5 * (double)ns / elems;
    m->sampled[enc] = true;
}

void cache_meter_set_decode(cache_meter *m, const double *dec_ns) {
    for (int e = 0; e < m->n_enc; e++)
        if (dec_ns[e] > 0 && !m->sampled[e]) m->dec_ns[e] = dec_ns[e];
}

bool cache_meter_fresh(const cache_meter *m) {
    return m->bw > 0 && clock_now_ns() - m->bw_at < METER_FRESH_NS;
}

/* The time a chunk of `tokens` tokens and size[e] bytes takes in encoding e: on the link, and to
 * decode here. */
static double enc_net(const uint64_t *size, int e, double bw) { return (double)size[e] / bw; }

static double enc_dec(const cache_meter *m, int tokens, int e) {
    return m->dec_ns[e] * m->elems_per_token * tokens;
}

static double enc_cost(const cache_meter *m, const uint64_t *size, int tokens, int e, double bw) {
    double net = enc_net(size, e, bw), dec = enc_dec(m, tokens, e);
    return net > dec ? net : dec;
}

static int pick(const cache_meter *m, const cache_fetch_policy *p, const uint64_t *size, int tokens,
                int i, int n, uint64_t t0, bool text_ok, const cache_meter_plan *plan, double bw) {
    if (p->force_enc == CACHE_ENC_TEXT) return text_ok ? CACHE_ENC_TEXT : CACHE_ENC_RAW;
    if (p->force_enc == CACHE_ENC_RAW || (p->force_enc > 0 && !p->lossless))
        return p->force_enc < m->n_enc && size[p->force_enc] ? p->force_enc : CACHE_ENC_RAW;
    double text = text_ok && p->text_ns_per_token > 0 && (cache_meter_fresh(m) || i > 0)
                      ? p->text_ns_per_token * tokens
                      : 1e30;
    double raw = enc_cost(m, size, tokens, CACHE_ENC_RAW, bw);
    int exact = text < raw ? CACHE_ENC_TEXT : CACHE_ENC_RAW;
    double exact_cost = text < raw ? text : raw;
    if (p->lossless || p->budget_ns <= 0) return exact;
    /* what is left of the budget, shared by this chunk and the ones after it */
    double left =
        ((double)t0 + METER_BUDGET_SHARE * (double)p->budget_ns - (double)clock_now_ns()) / (n - i);
    if (exact_cost <= left) return exact;
    for (int e = CACHE_ENC_Q8; e < m->n_enc; e++) /* finest first */
        if (size[e] && !(p->barred & (1u << e)) && enc_cost(m, size, tokens, e, bw) <= left)
            return e;
    /* With a budget no encoding meets, the fastest: the one that finishes the plan soonest, the
     * link and the decoder working at once (so a fast link mixes encodings light on the link
     * with ones light on the decoder, rather than queueing all on one of them). */
    int fastest = CACHE_ENC_RAW;
    double best = 1e300;
    for (int e = CACHE_ENC_RAW; e < m->n_enc; e++) {
        if (!size[e] || (p->barred & (1u << e))) continue;
        double net = plan->net + enc_net(size, e, bw), dec = plan->dec + enc_dec(m, tokens, e);
        double done = net > dec ? net : dec;
        if (done < best) {
            best = done;
            fastest = e;
        }
    }
    /* text only where it beats the chunk's own fetch: it runs after the stream, on the CPU */
    return text < enc_cost(m, size, tokens, fastest, bw) ? CACHE_ENC_TEXT : fastest;
}

int cache_meter_choose(const cache_meter *m, const cache_fetch_policy *p, const uint64_t *size,
                       int tokens, int i, int n, uint64_t t0, bool text_ok,
                       cache_meter_plan *plan) {
    double bw = m->bw > 0 ? m->bw : m->prior_bw;
    int e = pick(m, p, size, tokens, i, n, t0, text_ok, plan, bw);
    if (e != CACHE_ENC_TEXT) {
        plan->net += enc_net(size, e, bw);
        plan->dec += enc_dec(m, tokens, e);
    }
    return e;
}

void cache_meter_measure(const cache_layout *l, const codec_table *t, int n_threads, float *scratch,
                         double *dec_ns) {
    int nb = cache_chunk_blocks(l), nt = l->chunk_tokens, nc = l->n_kv_head * l->head_dim;
    int n_enc = cache_enc_count(t);
    size_t cap = 0;
    for (int e = 0; e < n_enc; e++) {
        size_t b = cache_enc_bound(l, t, e, nb);
        if (b > cap) cap = b;
    }
    cache_key zero = {{0}};
    cache_chunk *c = cache_chunk_create(l, NULL, nb, &zero, 0), *d = NULL;
    uint8_t *buf = malloc(cap);
    if (!c || !buf || !(d = cache_chunk_create(l, NULL, nb, &zero, 0))) goto done;
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int ly = 0; ly < l->n_layer; ly++)
        for (int kv = 0; kv < 2; kv++)
            for (int tk = 0; tk < nt; tk++)
                for (int ch = 0; ch < nc; ch++) {
                    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                    float u = (float)(s >> 40) / (float)(1 << 24) - 0.5f; /* -0.5 .. 0.5 */
                    size_t at = ((size_t)ly * 2 + kv) * (size_t)nc + (size_t)ch;
                    float centre = t ? t->center[at] : 0, unit = t ? t->scale[at] : 1;
                    scratch[(((size_t)ly * 2 + kv) * nt + tk) * nc + ch] = centre + 4 * u * unit;
                }
    cache_enc_from_f32(l, scratch, c);
    double elems = (double)c->bytes / 2;
    for (int e = 0; e < n_enc; e++) {
        kv_error err = {{0}};
        int64_t len = cache_enc_encode(l, t, e, c, scratch, buf, cap, &err);
        if (len <= 0) continue;
        /* a read verifies the payload's SHA-256 (cache/store/record.h) before decoding it */
        uint8_t sha[32];
        uint64_t t0 = clock_now_ns();
        kv_sha256(buf, (size_t)len, sha);
        int rc = cache_enc_decode(l, t, e, buf, (size_t)len, d, scratch, n_threads, &err);
        double ns = (double)(clock_now_ns() - t0) / elems;
        if (rc) continue;
        dec_ns[e] = ns;
        log_debug("cache: decoding %d costs %.2f ns per KV element", e, ns);
    }
done:
    if (c) cache_chunk_unref(c);
    if (d) cache_chunk_unref(d);
    free(buf);
}
