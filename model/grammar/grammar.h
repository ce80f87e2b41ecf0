/* Grammar-constrained decoding: a GBNF grammar (llama.cpp's format) compiled to a pushdown
 * automaton over bytes, matched against the vocabulary through a token trie, giving the sampler
 * a mask of the tokens allowed at each step; and JSON Schema compiled to GBNF.
 *
 * Three objects with three lifetimes:
 *   grammar        the parsed rules; immutable, built on any thread (the HTTP handler's).
 *   grammar_vocab  the vocabulary's token trie; built once per model, read-only.
 *   gmatch         a grammar bound to a vocabulary, with the memo that makes masks fast (the
 *                  automaton's states determinized lazily, masks cached per state). One thread
 *                  at a time (the engine's); any number of sequences share it, each holding only
 *                  a state id, so rolling a sequence back is restoring an int. */
#ifndef KVSERVE_GRAMMAR_H
#define KVSERVE_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/tokenizer/tokenizer.h"
#include "util/util.h"

#define GRAMMAR_MAX_TEXT (1 << 20) /* bytes of GBNF source */

typedef struct grammar grammar;

/* Parses GBNF (rules `name ::= alternatives`, "literals", [classes], [^negated], ., groups,
 * * + ? {m} {m,} {m,n}, # comments) whose start rule is "root". NULL with err naming the
 * problem and its line: syntax, an undefined rule, left recursion, limits. */
grammar *grammar_parse(const char *src, size_t len, kv_error *err);
void grammar_destroy(grammar *g);
/* Rules (named and generated) and elements, for tests and logs. */
int grammar_n_rules(const grammar *g);

/* ---------------------------------------------------------------- vocabulary */

typedef struct grammar_vocab grammar_vocab;

/* The trie of every token's bytes (control tokens, which decode to nothing, are left out; the
 * end-of-generation ones are allowed where the grammar may end). */
grammar_vocab *grammar_vocab_create(const tokenizer *t, kv_error *err);
/* The same from explicit token bytes (tests): tokens[i] of lens[i] bytes (0: never allowed);
 * eog[i] marks end-of-generation tokens (NULL: none). */
grammar_vocab *grammar_vocab_create_raw(const char *const *tokens, const size_t *lens,
                                        const bool *eog, int32_t n_vocab, kv_error *err);
void grammar_vocab_destroy(grammar_vocab *v);
int32_t grammar_vocab_n_tokens(const grammar_vocab *v);
int64_t grammar_vocab_n_nodes(const grammar_vocab *v);

/* ---------------------------------------------------------------- matching */

typedef struct gmatch gmatch;

/* States are ids >= 0. GMATCH_DEAD: the input left the language. GMATCH_ERROR: a limit was hit
 * (the memo grew past its budget, a state held too many stacks). */
#define GMATCH_DEAD (-1)
#define GMATCH_ERROR (-2)

/* Binds g (which must outlive the match) to v. NULL when out of memory. */
gmatch *gmatch_create(const grammar *g, const grammar_vocab *v, kv_error *err);
void gmatch_destroy(gmatch *m);
/* The state before any input (GMATCH_ERROR possible). */
int32_t gmatch_start(gmatch *m);
/* The state after the token (an end-of-generation token is accepted where the grammar may end
 * and leads to a final state), or GMATCH_DEAD / GMATCH_ERROR. */
int32_t gmatch_accept_token(gmatch *m, int32_t state, int32_t token);
int32_t gmatch_accept_bytes(gmatch *m, int32_t state, const char *bytes, size_t n);
/* The grammar may end here (end-of-generation allowed). */
bool gmatch_can_end(const gmatch *m, int32_t state);
/* Nothing may follow: the output is complete. */
bool gmatch_is_final(const gmatch *m, int32_t state);
/* The allowed tokens as a bitset of n_vocab bits (words of 64), owned by m and valid until the
 * next call; NULL with err when a limit is hit. */
const uint64_t *gmatch_mask(gmatch *m, int32_t state, kv_error *err);
/* Sets the logits of the tokens the mask forbids to -INFINITY; returns how many stay allowed, or
 * -1 with err. */
int gmatch_apply(gmatch *m, int32_t state, float *logits, kv_error *err);
/* The bytes the grammar forces from state on (where exactly one byte can follow and the grammar
 * cannot end), up to cap, cut back to a whole UTF-8 character; *next receives the state after
 * them. Returns the count. Jump-forward feeds them to the model as one prefill step. */
size_t gmatch_forced(gmatch *m, int32_t state, char *buf, size_t cap, int32_t *next);
/* Memo sizes, for benchmarks and logs. */
void gmatch_stats(const gmatch *m, int64_t *n_states, int64_t *n_masks, int64_t *bytes);

/* ---------------------------------------------------------------- JSON Schema */

/* Compiles a JSON Schema (given as JSON text) to GBNF whose root matches exactly the JSON values
 * the schema accepts, laid out as Python's json.dumps writes them (", " and ": ", no other
 * whitespace), within what is expressible. The supported keywords are listed in json_schema.c;
 * any other is an error that names it (and its path), never silently dropped. Returns malloc'd
 * GBNF, or NULL with err. */
char *json_schema_to_gbnf(const char *schema, size_t len, kv_error *err);
/* The same schema's rules only, to combine several schemas in one grammar: its start rule is
 * named prefix and its other rules prefix-rN; they refer to the shared rules of
 * json_schema_primitives() (value, string, number, ...), which the caller adds once. */
char *json_schema_to_gbnf_rules(const char *schema, size_t len, const char *prefix, kv_error *err);
const char *json_schema_primitives(void);
/* GBNF for any JSON object (response_format json_object). Static. */
const char *json_object_gbnf(void);

#endif
