/* cache/schema/schema.h: Prompt Cache (Gim et al., MLSys'24; DESIGN.md "Schemas (Prompt Cache)").
 *
 * A schema (PML, cache/schema/pml.h) fixes the positions of every module: text is laid out in
 * order, a parameter reserves `length` positions, and the members of a union share their start (the
 * union takes as many positions as its longest member). Every node (the root, which is the text
 * outside all modules and always included, and each module) has its own tokens: its text, its
 * role tags rendered by the chat template, but not its children's tokens and no placeholder for
 * its parameters (their positions stay free).
 *
 * A node's KV is computed once, at its schema positions, after its context: the tokens of its
 * ancestors that precede it (what every prompt that imports it also holds), but not its
 * siblings, which a prompt may leave out. This is the paper's modular attention (3.3) with the
 * always-present text before a module in view: where a prompt's layout is a prefix's (text only,
 * or one module after all of the text) its KV is a full prefill's; elsewhere modules miss
 * attention to each other and the positions keep the gaps of the modules left out (the fix-up
 * lays the prompt out as a full prefill and recomputes the most deviating tokens, CacheBlend's
 * way). Keys (cache_schema_key) chain over the context and
 * the node's tokens and positions, so a node's records are found again by any schema that lays
 * out the same text at the same positions, and never for another layout.
 *
 * A node's own tokens are stored through the chunk store as if they were a sequence of their
 * own: virtual slot i (token i) in block i / block_tokens, chunks of chunk_tokens, one record per
 * chunk (pos0 is the chunk's first virtual slot; the positions are the layout's, which the keys
 * cover), the last block zero-padded. So RAM, disk, pins, namespaces and checksums are the
 * chunk store's.
 *
 * A prompt imports modules (nested as they are in the schema, at most one member per union,
 * parameter values as attributes, no longer than their length in tokens) and adds free text.
 * Its sequence is, in KV slots: the imported nodes' own tokens in position order (KV copied
 * from the records), then the parameter values at their reserved positions, then the free text
 * at positions after the last one used, computed as any prompt. */
#ifndef KVSERVE_CACHE_SCHEMA_H
#define KVSERVE_CACHE_SCHEMA_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "cache/blend/blend.h"
#include "cache/cache.h"
#include "cache/schema/pml.h"
#include "model/model.h"

/* ---------------------------------------------------------------- role tags */

/* The chat template taken apart into one wrapper per role, so a role tag renders on its own:
 * start, then turns pre[role] + text + suf[role], then gen to open the answer. The parts come
 * from chat_render with marker texts and are checked against whole renderings; a template
 * whose turns depend on each other (Llama 2's system folded into the first user turn) is not
 * ok and role tags are refused with why. */
typedef struct schema_chat {
    bool ok;
    char why[256];
    char *start;  /* before the first turn (the BOS a template spells), or "" */
    char *pre[3]; /* by pml_role */
    char *suf[3];
    char *gen;      /* the assistant turn's opening */
    char *implicit; /* what the template puts first when a conversation has no system turn */
    bool add_bos;   /* the tokenizer's BOS token starts every schema */
    int32_t bos;
} schema_chat;

/* Never fails outright: without a usable template ok is false. */
void schema_chat_init(schema_chat *c, const model *m);
void schema_chat_free(schema_chat *c);

/* ---------------------------------------------------------------- schemas */

typedef struct schema_param {
    char *name;
    int length; /* positions reserved: a value has at most this many tokens */
    int32_t pos;
} schema_param;

typedef struct schema_node {
    char *name; /* NULL: the root */
    int parent; /* -1 for the root */
    int union_id;
    int line, col;
    int32_t start, end; /* positions spanned, its children's included */
    int32_t *tok;       /* [n_tok] its own tokens */
    int32_t *pos;       /* [n_tok] their positions, increasing */
    int n_tok, cap_tok;
    schema_param *params;
    int n_params;
    cache_key ctx_key; /* chain over its context (zero for the root) */
    cache_key *bkeys;  /* [n_blocks] keys of its own tokens' blocks */
    int n_blocks;
} schema_node;

typedef struct schema {
    char *name;
    cache_key ns;
    char *source;
    size_t source_len;
    schema_node *nodes; /* [0] is the root; a parent comes before its children */
    int n_nodes;
    int n_unions;
    int32_t extent;     /* positions used */
    int64_t own_tokens; /* every node's own tokens: what precomputing computes */
    bool roles;
    int block_tokens, chunk_tokens;
    atomic_int refs;
} schema;

typedef struct schema_opts {
    const model *m;
    const schema_chat *chat;
    int block_tokens;
    int chunk_tokens;
    int max_positions; /* the extent allowed (the context) */
    int max_modules;
} schema_opts;

/* Lays out a parsed schema (doc->prompt false) and computes its keys in namespace ns; src is
 * kept as its definition. NULL with err (line and column where they apply): a module declared
 * twice, a parameter declared twice in a module, role tags the template cannot render, more
 * positions or modules than allowed. */
schema *schema_compile(const pml_doc *doc, const char *src, size_t len, const cache_key *ns,
                       const schema_opts *o, kv_error *err);
void schema_ref(schema *sc);
void schema_unref(schema *sc);
/* The node of a module, or -1. */
int schema_find(const schema *sc, const char *module);
/* The records that hold node's KV: one key per chunk. Returns their count (at most max). */
int schema_node_records(const schema *sc, int node, cache_key *out, int max);
/* True when the store holds every block of every node (no I/O). */
bool schema_stored(const schema *sc, cache_store *st);

/* ---------------------------------------------------------------- KV handed to the engine */

/* n rows of rec from its slot src on go to sequence slots dst..; they were computed at positions
 * src_pos.. (consecutive) */
typedef struct schema_rows {
    const cache_chunk *rec;
    int src, dst, n;
    int32_t src_pos;
} schema_rows;

typedef struct schema_kv {
    schema_rows *rows; /* in slot order; without the fix-up they cover slots [0, n_slots) */
    int n_rows, cap_rows;
    cache_chunk **recs; /* the records rows point into, one reference each */
    int n_recs, cap_recs;
    int n_slots;
    /* fix-up: < 0 imports the rows as they are; else the prompt is laid out as a full prefill
     * (schema_assemble's compact) and the rows are blended (cache/blend/blend.h) at this recompute
     * ratio: K moved to the new positions, the most deviating tokens recomputed */
    float fixup;
    /* a precompute: slots [export_from, export_from + export_n) are stored as records under
     * export_bkeys (one per block) in namespace export_ns, once computed (the schema registry
     * pins them, under its lock, unless the schema was deleted meanwhile) */
    cache_key *export_bkeys;
    int export_blocks, export_from, export_n;
    cache_key export_ns;
} schema_kv;

void schema_kv_free(schema_kv *k);
/* Reserves slots [0, n_slots) of the empty seq and copies the rows into them. -1 with err when
 * the pool is full (nothing is kept then). */
int schema_kv_import(const schema_kv *k, kv_pool *pool, kv_seq *seq, kv_error *err);
/* Stores the export slots of seq as records (RAM now, disk in the background), unpinned.
 * -1 with err when out of memory. */
int schema_kv_export(const schema_kv *k, cache_store *st, kv_pool *pool, const kv_seq *seq,
                     kv_error *err);
/* Fix-up: the rows as blend spans over content records (their KV converted to the fusor's rows,
 * computed at src_pos..), which the fusor moves to the positions the batch gives their slots.
 * *spans is malloc'd, each span holds a record reference. -1 with err. */
int schema_kv_blend_spans(const schema_kv *k, const kv_layout *l, blend_span **spans, int *n_spans,
                          kv_error *err);

/* What precomputing node needs: its context's tokens (imported from its ancestors' records)
 * then its own, with their positions, and the export of its own. -1 with err when an
 * ancestor's records are not in the store (they are computed first). */
typedef struct schema_job {
    int32_t *tokens, *pos;
    int n;
    schema_kv *kv;
} schema_job;
int schema_node_job(const schema *sc, int node, cache_store *st, schema_job *out, kv_error *err);
void schema_job_free(schema_job *j);

/* ---------------------------------------------------------------- prompts */

/* A turn of free text after the prompt (a chat request's messages): role -1 is raw text. */
typedef struct schema_turn {
    int role;
    const char *text;
} schema_turn;

typedef struct schema_prompt {
    int32_t *tokens; /* [n] in slot order: imported rows, parameter values, free text */
    int32_t *pos;    /* [n] */
    int n;
    int32_t *flat; /* [n] the same tokens in position order: a full prefill's prompt */
    int n_cached;  /* leading slots whose KV the records hold */
    int n_modules; /* modules imported */
    int32_t last_pos;
    schema_kv *kv; /* NULL when nothing is imported, or a record was missing (missing) */
    bool missing;
} schema_prompt;

/* What schema_assemble takes from the store. */
typedef enum schema_fetch {
    SCHEMA_FETCH_NONE, /* nothing: every token is computed */
    /* the imported tokens that lead a full prefill's layout with the KV it computes: at
     * positions 0, 1, ... without a gap, each after only its own node's and its ancestors'
     * tokens (what its KV was computed after). Exact reuse, as a chunk store prefix is: the
     * prompt is laid out as a full prefill (as compact does) and the rest is computed */
    SCHEMA_FETCH_EXACT,
    SCHEMA_FETCH_ALL, /* every imported token: Prompt Cache (or, compact, the fix-up's rows) */
} schema_fetch;

/* Assembles doc (a <prompt>) over sc, with turns after it and (gen) the answer's opening, and
 * fetches what fetch says from the store (RAM, or disk: this blocks on I/O). compact lays
 * the prompt out as a full prefill instead (the flat order at positions 0..n-1, n_cached 0) with
 * rows for every imported token wherever it lands: the fix-up's layout. -1 with err
 * for a prompt that does not fit the schema (line and column where they apply): an unknown
 * module, one referenced outside its parent or twice, two members of one union, an unknown
 * parameter, a value longer than its length, role tags the template cannot render. */
int schema_assemble(const schema *sc, const pml_doc *doc, const schema_chat *chat,
                    const tokenizer *tok, const schema_turn *turns, int n_turns, bool gen,
                    cache_store *st, schema_fetch fetch, bool compact, schema_prompt *out,
                    kv_error *err);
void schema_prompt_free(schema_prompt *p);

/* ---------------------------------------------------------------- definitions on disk */

/* A schema's source kept in dir (one file per namespace and name, written to a temporary file
 * and renamed, with a checksum), so registered schemas come back after a restart. */
int schema_def_save(const char *dir, const cache_key *ns, const char *name, const char *src,
                    size_t len, kv_error *err);
void schema_def_delete(const char *dir, const cache_key *ns, const char *name);
/* Calls fn for every valid definition in dir (invalid files are skipped with a warning). */
typedef void (*schema_def_fn)(void *ud, const cache_key *ns, const char *name, const char *src,
                              size_t len);
void schema_def_load_all(const char *dir, schema_def_fn fn, void *ud);
/* The definition of (ns, name): its source, malloc'd, or NULL. */
char *schema_def_load(const char *dir, const cache_key *ns, const char *name, size_t *len);

/* ---------------------------------------------------------------- the registry */

/* The schemas registered per namespace (cache/schema/registry.c), with a builder thread that
 * precomputes each one's modules (the newest registered first) and pins
 * their records, so a prompt imports them from RAM or disk. Definitions are kept in a
 * directory when one is given (schema_def_save), loaded at start and whenever a namespace names
 * one not registered here (another instance sharing the directory stored it). With Redis
 * (opts.shared) a definition is also written there, so any instance sharing it finds the schema
 * by name or in a list, compiles and builds it (the modules' records then come from the shared
 * chunk tier when another instance wrote them); a delete removes it everywhere (a tombstone
 * makes the others drop theirs when next asked). Thread-safe: the server's handlers call it
 * from their connections' threads. */
typedef struct schema_registry schema_registry;
typedef struct redis_state redis_state;

typedef enum schema_status {
    SCHEMA_BUILDING = 0, /* its modules are being precomputed (a prompt is served meanwhile) */
    SCHEMA_READY,
    SCHEMA_FAILED,
} schema_status;

/* A registered schema as it was when asked. sc holds one reference: schema_info_free. */
typedef struct schema_info {
    schema *sc;
    schema_status status;
    char error[400];     /* why it failed */
    int64_t done_tokens; /* of sc->own_tokens, precomputed and pinned */
    long created;        /* Unix seconds */
} schema_info;
void schema_info_free(schema_info *in);
void schema_info_list_free(schema_info *v, int n);

/* What the builder hands whoever computes a node, which asks it while it waits whether the node
 * is still wanted (false once the registry stops or the schema is deleted: give up then). */
typedef struct schema_build schema_build;
bool schema_build_abandoned(const schema_build *b);

/* Computes job (a node's schema_node_job: a prompt-only pass whose KV is exported as the node's
 * records) through the model, taking its arrays (freed by whoever takes them, also on failure).
 * 0 once the records are stored, or -1 with msg (an error, or given up as b says). Called on the
 * builder thread. */
typedef int (*schema_compute_fn)(void *ud, schema_job *job, const schema_build *b, char *msg,
                                 size_t cap);

typedef struct schema_registry_opts {
    const model *m;
    cache_store *store; /* where the records go */
    int chunk_tokens;   /* the store's */
    int max_positions;  /* a schema's extent allowed (the context) */
    int max_schemas;    /* registered at most, all namespaces */
    const char *dir;    /* definitions (copied), or NULL: none kept */
    /* definitions shared with other instances through Redis (cache/store/redis_state.h, kind
     * "schema"), or NULL; borrowed */
    redis_state *shared;
    schema_compute_fn compute;
    void *compute_ud;
} schema_registry_opts;

/* Loads the definitions in o->dir and starts the builder. NULL with err. */
schema_registry *schema_registry_create(const schema_registry_opts *o, kv_error *err);
/* Stops the builder (a node being computed is given up) and frees every schema. */
void schema_registry_destroy(schema_registry *g);
/* The role tags the schemas are compiled with (schema_assemble's chat). */
const schema_chat *schema_registry_chat(const schema_registry *g);

typedef enum schema_add_result {
    SCHEMA_ADD_NEW,     /* registered (replacing one of its name): built in the background */
    SCHEMA_ADD_SAME,    /* the same source is registered already: nothing changes */
    SCHEMA_ADD_INVALID, /* the source does not compile: err says why */
    SCHEMA_ADD_FULL,    /* max_schemas are registered: err says so */
    SCHEMA_ADD_NOMEM,
} schema_add_result;
/* Compiles src as a schema of namespace ns and registers it, keeping its definition; out gets
 * its entry (NEW, SAME). */
schema_add_result schema_registry_add(schema_registry *g, const cache_key *ns, const char *src,
                                      size_t len, schema_info *out, kv_error *err);
/* The schemas of namespace ns, newest first (with Redis: those registered on other instances
 * too, compiled here first): *out malloc'd (schema_info_list_free). -1 when out of memory. */
int schema_registry_list(schema_registry *g, const cache_key *ns, schema_info **out, int *n);
/* The schema name of namespace ns, loading its definition from the directory, or else from
 * Redis, when it is not registered here. False when there is none. */
bool schema_registry_get(schema_registry *g, const cache_key *ns, const char *name,
                         schema_info *out);
/* Unregisters name of namespace ns, unpins its records (those no other schema holds) and
 * deletes its definition (from Redis too). False when there is none here or there. */
bool schema_registry_delete(schema_registry *g, const cache_key *ns, const char *name);
/* A record of sc was found missing (cleared, evicted, corrupt) while it was ready: it is
 * precomputed again, if sc is still the one registered under its name. */
void schema_registry_rebuild(schema_registry *g, const schema *sc);

#endif
