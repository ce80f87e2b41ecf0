/* cache/: the public contract of the context cache. Chunk keys (DESIGN.md "Chunk keys"), chunk
 * records and the chunk store with its RAM, disk and Redis tiers (DESIGN.md "Store tiers"). The
 * device pool tier (cache/store/pool_cache.h) is the planner's (cache/plan.h), kept on the engine
 * thread that owns the pool; it uses the keys defined here.
 *
 * Reuse is exact to the KV block (16 tokens): every full block of a sequence has a prefix key,
 * chained block by block, so two prompts share block j's key exactly when they share every token
 * up to its end. A chunk is chunk_tokens consecutive tokens starting at a multiple of
 * chunk_tokens; its record holds 1 .. chunk_tokens / block_tokens whole blocks from the chunk's
 * start (a sequence's trailing partial chunk is stored too), every layer's K and V as raw f16,
 * laid out exactly as blocks of the KV pool (kernels/backend.h kv_layout), so a hit is one copy
 * per block and a miss never converts anything. A record knows the keys of all its blocks and is
 * found by any of them: a prompt that diverges inside a chunk still reuses the chunk's blocks
 * before the divergence. K is stored rotated at positions pos0 .. pos0 + n_tokens - 1. */
#ifndef KVSERVE_CACHE_H
#define KVSERVE_CACHE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

typedef struct codec_table codec_table; /* cache/codec/codec.h */

/* ---------------------------------------------------------------- keys */

#define CACHE_KEY_BYTES 32

typedef struct cache_key {
    uint8_t b[CACHE_KEY_BYTES]; /* SHA-256 */
} cache_key;

/* The namespace a request's chunks live in: SHA-256 over a domain tag, the tenant (the digest
 * of the API key used, or nothing on a server without keys) and the request's cache_salt
 * (NULL: none). Tenants never share a namespace, so they never share or probe each other's KV. */
void cache_namespace(const uint8_t *tenant, size_t tenant_len, const char *salt, cache_key *ns);

/* Prefix keys chain: key_i = SHA-256(tag, model identity, namespace, key_{i-1}, tokens of block
 * i as little-endian int32), key_{-1} = 32 zero bytes. Two prompts share key_i only when they
 * share every token up to the end of block i, so reuse by prefix key is exact. */
void cache_prefix_key(const uint8_t model_id[32], const cache_key *ns, const cache_key *prev,
                      const int32_t *tokens, int n_tokens, cache_key *out);
/* The keys of the leading full blocks of tokens[0..n_tokens) (block_tokens each): returns their
 * count (n_tokens / block_tokens, at most max_keys). */
int cache_prefix_keys(const uint8_t model_id[32], const cache_key *ns, const int32_t *tokens,
                      int n_tokens, int block_tokens, cache_key *out, int max_keys);
/* The keys of the records that hold the first n_blocks blocks of a sequence whose block keys are
 * bkeys (chunk_blocks blocks per chunk): one per chunk, the key of its last block there (the
 * last chunk's record may be partial). Returns their count, ceil(n_blocks / chunk_blocks). */
int cache_record_keys(const cache_key *bkeys, int n_blocks, int chunk_blocks, cache_key *out);
/* Content keys do not chain: SHA-256(tag, model identity, namespace, tokens). They find a
 * document's KV whatever precedes it (reuse through blend, not exact). */
void cache_content_key(const uint8_t model_id[32], const cache_key *ns, const int32_t *tokens,
                       int n_tokens, cache_key *out);

/* Schema keys (Prompt Cache, cache/schema/schema.h) chain like prefix keys but over tokens and
 * their RoPE positions: SHA-256(tag, model identity, namespace, previous key, n, tokens,
 * positions). A module's KV depends on its tokens, their positions and the context it was computed
 * after, all of which its chain covers, so a key never matches KV of another position layout. */
void cache_schema_key(const uint8_t model_id[32], const cache_key *ns, const cache_key *prev,
                      const int32_t *tokens, const int32_t *pos, int n_tokens, cache_key *out);

/* Lower-case hex of a key (65 bytes with the NUL). */
void cache_key_hex(const cache_key *k, char out[2 * CACHE_KEY_BYTES + 1]);

/* ---------------------------------------------------------------- chunk records */

/* What a store holds: one model's KV in one pool layout. Records of another model identity or
 * layout are never served. */
typedef struct cache_layout {
    uint8_t model_id[32];
    int n_layer;
    int n_kv_head;
    int head_dim;
    int block_tokens; /* KV pool block size the payload is laid out in (multiple of 16) */
    int chunk_tokens; /* tokens per chunk (multiple of block_tokens, at most 256 blocks) */
} cache_layout;

/* Checks the fields' ranges; -1 with err when one is out of range. */
int cache_layout_check(const cache_layout *l, kv_error *err);
/* Bytes of one full chunk's payload: (chunk_tokens / block_tokens) pool blocks. */
size_t cache_chunk_bytes(const cache_layout *l);
/* Blocks per full chunk. */
int cache_chunk_blocks(const cache_layout *l);
/* Bytes of one pool block: n_layer * 2 * n_kv_head * block_tokens * head_dim f16. */
size_t cache_block_bytes(const cache_layout *l);

#define CACHE_ALIGN 4096 /* payload alignment (O_DIRECT) */
/* Blocks per chunk at most: a record header lists every block's key. */
#define CACHE_MAX_CHUNK_BLOCKS 256

/* An immutable chunk record in memory, shared by reference count between the tiers and the
 * requests that loaded it. data is written once, by its creator, before it is shared. */
typedef struct cache_chunk {
    cache_key key;    /* the key of its last block: the record's own key */
    cache_key ns;     /* the namespace it was stored under (for clear) */
    int32_t pos0;     /* position of its first token (a multiple of chunk_tokens) */
    int n_blocks;     /* 1 .. chunk_tokens / block_tokens */
    size_t bytes;     /* payload bytes: n_blocks pool blocks */
    uint8_t *data;    /* [bytes rounded up to CACHE_ALIGN], CACHE_ALIGN-aligned, host */
    cache_key *bkeys; /* [n_blocks] prefix keys of its blocks; bkeys[n_blocks - 1] == key */
    uint8_t enc;      /* CACHE_ENC_* of the payload: raw pool blocks (0) everywhere but inside an
                         encoded RAM tier (cache_store_opts.ram_enc), whose chunks hold an
                         encoding and are decoded by the store before anyone sees them */
    atomic_int refs;
} cache_chunk;

/* A chunk of n_blocks blocks (1 .. chunk blocks) whose block keys are bkeys (NULL: zero, for the
 * creator to fill in with key before sharing it), with one reference and an uninitialised
 * payload; NULL when out of memory or n_blocks is out of range. */
cache_chunk *cache_chunk_create(const cache_layout *l, const cache_key *bkeys, int n_blocks,
                                const cache_key *ns, int32_t pos0);
/* A chunk with like's keys, namespace, position and blocks whose payload is payload[0..len), an
 * encoding enc of like's (the encoded RAM tier's). NULL when out of memory. */
cache_chunk *cache_chunk_create_encoded(const cache_chunk *like, int enc, const uint8_t *payload,
                                        size_t len);
void cache_chunk_ref(cache_chunk *c);
void cache_chunk_unref(cache_chunk *c);

/* ---------------------------------------------------------------- encodings and fetch policy */

/* How a chunk travels through the Redis tier (cache/codec/chunk_codec.h): lossless (the raw f16
 * blocks), q8 (8-bit per-token quantization) or a level of the CacheGen codec (codec0 the finest).
 * Lossy encodings reach the pool only: RAM and disk hold what a full prefill computes. */
enum { CACHE_ENC_RAW = 0, CACHE_ENC_Q8 = 1, CACHE_ENC_CODEC = 2 };
#define CACHE_ENC_MAX 10    /* CACHE_ENC_CODEC + the codec's CODEC_MAX_LEVELS */
#define CACHE_ENC_TEXT (-2) /* not fetched: computed from its text */
#define CACHE_ENC_ANY (-1)  /* no encoding forced */
/* "lossless", "q8", "codec0", ..., "text" for CACHE_ENC_TEXT: out holds 16 bytes. */
void cache_enc_name(int enc, char out[16]);
/* The encoding a name (cache_enc_name's) means, or CACHE_ENC_ANY when it names none. */
int cache_enc_parse(const char *name);

/* How a lookup fetches from the Redis tier (CacheGen section 5.3). Chunks are fetched in order,
 * each in the encoding chosen from the throughput measured so far: with no budget, lossless; with
 * one, the finest encoding whose remaining chunks fit in what is left of it, else the fastest. A
 * chunk that would arrive later than its text could be computed (text_ns_per_token) is computed
 * instead, and so is every chunk after it. */
typedef struct cache_fetch_policy {
    int force_enc;            /* CACHE_ENC_ANY, an encoding (lossless where a record lacks it),
                                 or CACHE_ENC_TEXT: nothing from Redis */
    bool lossless;            /* lossless or text only, whatever the budget */
    int64_t budget_ns;        /* time to have the reused KV ready (0: none) */
    uint64_t start_ns;        /* when the budget started (monotonic; 0: at the lookup) */
    double text_ns_per_token; /* measured cost of computing a token from text (0: unknown) */
    /* lossy encodings a budget may not choose (bit e: CACHE_ENC_* e; cache/quality.h's budget
     * rules them out on this model); a forced encoding is still taken */
    uint32_t barred;
} cache_fetch_policy;

/* Where each chunk a lookup returned came from. */
enum { CACHE_TIER_RAM = 0, CACHE_TIER_DISK = 1, CACHE_TIER_REDIS = 2 };
typedef struct cache_fetch_src {
    uint8_t tier; /* CACHE_TIER_* */
    uint8_t enc;  /* CACHE_ENC_* it travelled in (RAM: lossless) */
} cache_fetch_src;

/* ---------------------------------------------------------------- statistics */

typedef struct cache_tier_stats {
    int64_t entries;
    int64_t bytes;    /* payload bytes held */
    int64_t capacity; /* byte cap */
    int64_t pinned;   /* entries kept from eviction */
    int64_t hits, misses;
    int64_t bytes_in;  /* written into the tier */
    int64_t bytes_out; /* read from the tier */
    int64_t evictions;
    int64_t corrupt;      /* records dropped as torn or corrupt (disk, Redis) */
    int64_t write_errors; /* failed writes, e.g. a full disk, Redis down or out of memory */
    int64_t dropped;      /* write-backs skipped because the queue was full (disk, Redis) */
    int64_t enc_hits[CACHE_ENC_MAX]; /* Redis: chunks fetched per encoding */
    int64_t text;                    /* Redis: chunks held but computed from text instead */
    int64_t content_hits;            /* Redis: blend's content records found */
} cache_tier_stats;

typedef struct cache_stats {
    cache_tier_stats ram;
    cache_tier_stats disk;
    cache_tier_stats redis; /* entries, bytes, capacity unknown (0): Redis is shared */
    bool disk_enabled;
    bool redis_enabled;
    bool redis_connected; /* the last exchange with Redis succeeded */
} cache_stats;

/* ---------------------------------------------------------------- the store */

typedef struct cache_store_opts {
    int64_t ram_bytes;     /* RAM tier cap (0: no RAM tier) */
    const char *dir;       /* disk tier directory, or NULL for none */
    int64_t disk_bytes;    /* disk tier cap */
    int write_queue;       /* pending disk (and Redis) writes at most (beyond: dropped, counted) */
    const char *redis_url; /* Redis tier (cache/store/redis.h), or NULL for none */
    int64_t redis_ttl_s;   /* expiry of the keys it writes (0: none) */
    int redis_timeout_ms;  /* each network wait (0: 200) */
    const codec_table *codec; /* the CacheGen codec's table for Redis's encodings (NULL: lossless
                                 and q8 only); borrowed, outlives the store */
    bool disk_encoded;        /* the disk tier keeps every encoding too (cache/store/disk.h) */
    int ram_enc;              /* the RAM tier holds chunks in this encoding (CACHE_ENC_RAW: as
                                 computed; else lossy, decoded when found) */
    int64_t pin_bytes;        /* pinned and leased bytes per tier at most, beside half of each
                                 tier (0: half of each tier) */
    /* Tenants (DESIGN.md "Tenants"): pins and leases are made for one of n_tenants (0 or 1: one
     * tenant), each holding at most tenant_pin_share percent of a tier's pin cap (0: an equal
     * part, 100 / n_tenants), counted where they are made (cache/store/pins.h). */
    int n_tenants;
    int tenant_pin_share;
    /* The clock leases expire by, in Unix seconds (NULL: the wall clock); tests inject one. */
    int64_t (*clock)(void *arg);
    void *clock_arg;
} cache_store_opts;

typedef struct cache_store cache_store;

/* Opens the store; the disk tier rebuilds its index from the directory (records of other
 * models are left alone; torn or corrupt ones are deleted and counted). A Redis tier that is
 * down at open is not an error (it is used once it answers); a bad URL is. */
cache_store *cache_store_open(const cache_layout *l, const cache_store_opts *o, kv_error *err);
/* Checks the syntax of a Redis tier URL (cache_store_opts.redis_url; cache/store/redis.h says what
 * is accepted); -1 with err naming what is wrong. */
int cache_store_check_redis_url(const char *url, kv_error *err);
/* Finishes queued writes and frees everything. */
void cache_store_close(cache_store *s);
const cache_layout *cache_store_layout(const cache_store *s);

/* Continues a sequence's cached prefix from block `first` on: bkeys[0..n_blocks) are its block
 * keys. Finds, chunk by chunk, the record that holds the most of the sequence's blocks (RAM
 * first, then disk; disk hits are read in parallel and promoted to RAM) until a chunk has no
 * record or one that ends before the chunk does; the chunks from the first that RAM and disk
 * lack are then streamed from Redis as policy says (NULL: lossless; lossless hits promoted to RAM
 * and written to disk, lossy ones only returned). out[0..*n_out) get one reference each, in
 * order (the first holds block `first`; at most max_out), and src[i] (src may be NULL) says
 * where out[i] came from; *n_text counts the chunks after them that Redis holds but policy left to
 * be computed from text. Returns the number of blocks from `first` on the records cover for this
 * sequence (a record may hold more: the sequence diverged inside it). Blocks on disk reads and
 * Redis round trips (each bounded by the Redis timeout); thread-safe. */
int cache_store_fetch(cache_store *s, const cache_key *bkeys, int first, int n_blocks,
                      const cache_fetch_policy *policy, cache_chunk **out, cache_fetch_src *src,
                      int max_out, int *n_out, int *n_text);
/* True when the RAM or disk tier holds a record holding the block whose key is bkey (no I/O:
 * Redis is not asked, so a chunk only Redis holds is "not held" and may be stored again). */
bool cache_store_holds(cache_store *s, const cache_key *bkey);
/* Stores c (the store takes its own reference): into RAM now, onto disk and into Redis in the
 * background (each tier's own thread).
 * Records of the same chunk that hold a prefix of c's blocks are dropped: c supersedes them.
 * Never blocks on I/O; a write that cannot be queued is dropped and counted. */
void cache_store_put(cache_store *s, cache_chunk *c);
/* The same into RAM and onto disk only: for a chunk Redis is known to hold already. */
void cache_store_put_local(cache_store *s, cache_chunk *c);
/* The same onto disk and (redis true) into Redis, not into RAM: for a record whose blocks the
 * pool tier holds as it is stored, which RAM would hold a second time. False, with nothing
 * stored, when there is no disk tier (Redis alone is a network away: RAM keeps the record). */
bool cache_store_put_below(cache_store *s, cache_chunk *c, bool redis);
/* The bytes of the records queued for the disk tier or being written (their chunks are held in
 * memory until then); -1 without a disk tier. */
int64_t cache_store_disk_backlog(cache_store *s);
/* Pins and leases are made for a tenant (an index below cache_store_opts' n_tenants), or for
 * none: CACHE_TENANT_NONE counts against the tiers' pin caps only (the schema registry's pins). */
#define CACHE_TENANT_NONE (-1)

/* Pins or unpins records by their own keys, for tenant (RAM and disk keep pinned chunks; pins
 * may fill at most half of each tier, and a tenant its share of that). Returns how many keys the
 * RAM tier (without one: the disk tier) held and pinned; -1 when that tier pinned none of them
 * because the new pins would take the tenant past its share (a tier pins all of a call's records
 * that its share needs, or none). Unpinning never fails. */
int cache_store_pin(cache_store *s, int tenant, const cache_key *keys, int n_keys, bool pin);
/* The same as pinning, with an expiry: leases records by their own keys until `until` (Unix
 * seconds, the store's clock; a later lease a record has is kept), with a pin's all-or-none
 * share (-1) and a lease's end (below: it ends by itself, and unpinning leaves it). */
int cache_store_pin_until(cache_store *s, int tenant, const cache_key *keys, int n_keys,
                          int64_t until);
/* Tenant t's pinned and leased bytes in RAM and on disk, and the most each tier lets it hold. */
typedef struct cache_tenant_pins {
    int64_t ram, ram_share, disk, disk_share;
} cache_tenant_pins;
void cache_store_tenant_pins(cache_store *s, int tenant, cache_tenant_pins *out);
/* ---- leases: pins with an expiry (Anthropic's prompt caching: cache_control markers).
 * A lease keeps a record like a pin until its time (Unix seconds, the store's clock) and then
 * ends by itself; a record may have a pin and a lease, and is kept while it has either. A lease
 * passes, like a pin, to a longer record of the chunk that replaces its record (the same
 * prompt's record once generated tokens extend it), and the disk tier keeps its leases across a
 * restart (cache/store/leases.h). Leases and pins share the cap on pinned bytes (pin_bytes). */

/* The store's clock (Unix seconds). */
int64_t cache_store_now(cache_store *s);
/* Leases the records holding a sequence's first n_blocks blocks (bkeys: its block keys), chunk
 * by chunk, in RAM and on disk (a record being written included), until `until` (a later lease a
 * record has is kept). Returns the blocks from the start whose chunks are leased in at least
 * one tier: less than n_blocks when a record is missing (evicted, never stored) or the pin cap
 * or tenant's share of it is reached, from the first such chunk on (a lease renewed holds no
 * more bytes, so a tenant's share never refuses it). Expired leases end first. */
int cache_store_lease(cache_store *s, int tenant, const cache_key *bkeys, int n_blocks,
                      int64_t until);
/* Keeps the chunks of a sequence's blocks bkeys[0..n_blocks) of namespace ns in the Redis tier
 * for at least ttl_s seconds (cache_redis_keep): a pin or lease shared with other instances
 * names chunks they can read. 0, or -1 when Redis could not be reached; 0 without Redis. */
int cache_store_keep_shared(cache_store *s, const cache_key *ns, const cache_key *bkeys,
                            int n_blocks, int64_t ttl_s);
/* Ends the leases due by the store's clock (also done by every put, lease, stats and pin
 * listing, so an expired lease never keeps a record from eviction). Returns how many ended. */
int cache_store_expire(cache_store *s);

/* A pinned or leased record, as cache_store_pins lists it. */
typedef struct cache_pin_info {
    cache_key key; /* the record's own key */
    cache_key ns;  /* its namespace */
    int n_blocks;
    bool manual;    /* pinned until unpinned */
    int64_t lease;  /* leased until (Unix seconds), 0: no lease */
    bool ram, disk; /* the tiers holding it so */
} cache_pin_info;

/* Lists up to max pinned or leased records (a record in both tiers once, with both flags) into
 * out, after ending the expired leases; returns how many records there are (a record past max
 * in one tier and listed in the other may be counted twice). */
int cache_store_pins(cache_store *s, cache_pin_info *out, int max);

/* Drops every chunk of namespace ns (NULL: all of this model), pinned or not, from the RAM tier
 * (when ram), the disk tier (when disk) and Redis (when redis); the counts dropped go to *n_ram,
 * *n_disk and *n_redis (-1: Redis could not be reached). */
void cache_store_clear(cache_store *s, const cache_key *ns, bool ram, bool disk, bool redis,
                       int64_t *n_ram, int64_t *n_disk, int64_t *n_redis);
void cache_store_stats(cache_store *s, cache_stats *out);
/* Waits until every queued disk and Redis write has finished (tests, shutdown). */
void cache_store_flush(cache_store *s);

/* ---------------------------------------------------------------- blend's selection policy */

/* Which reused tokens are recomputed (DESIGN.md "Segments, content keys and blend"), at the
 * same budget: ratio x the reused tokens at the deep layers.
 * - HKVD (CacheBlend section 4.3): every reused token through layers 0 and 1, then the most
 *   deviating ones, ranked layer by layer (gradual filtering).
 * - LEGOLINK (EPIC, ICML'25): the first tokens of every run of KV computed in one other context
 *   (they carry that context's attention-sink pattern), the budget spread over the runs; the
 *   other reused tokens are reused as they are from layer 0 on.
 * - HYBRID: up to BLEND_HYBRID_K chunk-start tokens of every run, HKVD for the rest of the
 *   budget. */
typedef enum blend_policy {
    BLEND_POLICY_HKVD = 0,
    BLEND_POLICY_LEGOLINK = 1,
    BLEND_POLICY_HYBRID = 2,
    BLEND_POLICY_COUNT
} blend_policy;

/* The chunk-start tokens HYBRID forces per run, at most. */
#define BLEND_HYBRID_K 8

/* "hkvd", "legolink", "hybrid". */
const char *blend_policy_name(blend_policy p);
/* The policy named name (as blend_policy_name spells it); -1 when none is. */
int blend_policy_parse(const char *name);

#endif
