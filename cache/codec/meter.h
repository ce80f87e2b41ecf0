/* The fetch policy of the tiers that hold a chunk in several encodings (internal to cache/: the
 * Redis tier, and the disk tier when it keeps encodings): what the tier has measured of its
 * link (a network, a disk) and of this machine's decoders, and the choice of each chunk's
 * encoding made from it (CacheGen section 5.3). A chunk's cost in a stream is the larger of
 * its transfer and its decode, as the next chunk travels while this one decodes.
 *
 * Not thread-safe: the tier that owns a meter guards it with its own lock. */
#ifndef KVSERVE_CACHE_METER_H
#define KVSERVE_CACHE_METER_H

#include "cache/cache.h"
#include "cache/codec/codec.h"

/* Transfers smaller than this measure the round trip more than the link. */
#define CACHE_METER_MIN_SAMPLE 65536

typedef struct cache_meter {
    int n_enc;                    /* encodings offered: cache_enc_count of the tier's table */
    double elems_per_token;       /* KV elements of one token: n_layer * 2 * n_kv_head * head_dim */
    double prior_bw;              /* link bytes per ns taken before one is measured */
    double bw;                    /* measured link, bytes per ns (EWMA; 0: not measured yet) */
    uint64_t bw_at;               /* when bw was last sampled (monotonic ns) */
    double dec_ns[CACHE_ENC_MAX]; /* decode cost per KV element by encoding (EWMA) */
    bool sampled[CACHE_ENC_MAX];  /* dec_ns[e] has a sample of a real decode */
} cache_meter;

/* A fetch's plan so far: the link and decode time of the chunks chosen (estimates). */
typedef struct cache_meter_plan {
    double net, dec;
} cache_meter_plan;

/* A meter for n_enc encodings of chunks of layout l, with prior decode costs until measured. */
void cache_meter_init(cache_meter *m, const cache_layout *l, int n_enc, double prior_bw);
/* Samples the link: bytes arrived ns after they were asked for (ignored below
 * CACHE_METER_MIN_SAMPLE bytes). */
void cache_meter_link(cache_meter *m, size_t bytes, uint64_t ns);
/* Samples a decode of encoding enc: elems KV elements in ns. */
void cache_meter_decode(cache_meter *m, int enc, double elems, uint64_t ns);
/* Takes the costs cache_meter_measure measured (dec_ns[e] > 0) in place of the priors; the
 * encodings it did not measure, or that real decodes have sampled meanwhile, keep theirs. */
void cache_meter_set_decode(cache_meter *m, const double *dec_ns);
/* True when the link was measured within the last 10 s: older, a tier fetches a request's first
 * chunk whatever it costs, so one slow sample cannot keep every later request from the tier. */
bool cache_meter_fresh(const cache_meter *m);

/* The encoding of chunk i of a fetch of n chunks (tokens tokens; size[e]: its bytes in encoding
 * e, 0 where not held), as policy p says, the budget counted from t0, and adds it to plan:
 *   - forced: that encoding where held, else lossless (CACHE_ENC_TEXT forced: text, or lossless
 *     where text is not an option);
 *   - lossless asked for, or no budget: the faster of lossless and text;
 *   - else the finest encoding whose cost fits the chunk's share of what is left of the budget;
 *     none fitting, the one that finishes the plan soonest, or text where that beats it.
 * Text is an option only when text_ok and the link is measured (or i > 0). */
int cache_meter_choose(const cache_meter *m, const cache_fetch_policy *p, const uint64_t *size,
                       int tokens, int i, int n, uint64_t t0, bool text_ok, cache_meter_plan *plan);

/* Measures what decoding a full chunk costs on this machine in each of t's encodings (the
 * payload's checksum, the decode, the conversion to pool blocks; n_threads decoding), on
 * KV-like values drawn around the table's channel centres, into dec_ns[0..cache_enc_count(t)):
 * a tier weighs encodings by this machine's speed from its first fetch on. scratch holds
 * cache_enc_scratch_floats(l) floats. Entries it could not measure are left as they were. */
void cache_meter_measure(const cache_layout *l, const codec_table *t, int n_threads, float *scratch,
                         double *dec_ns);

#endif
