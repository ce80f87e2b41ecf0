/* rans: the entropy coder of the CacheGen KV codec. A static-model range ANS coder (J. Duda,
 * "Asymmetric numeral systems", arXiv:1311.2540; the byte-wise renormalised 32-bit variant
 * described in F. Giesen, "Interleaved entropy coders", arXiv:1402.3392) with two interleaved
 * states and a per-symbol choice of model, so one stream can carry symbols whose statistics
 * differ by layer, channel and K/V (each symbol i is coded with models[ctx[i]]).
 *
 * Models are profiled once per LLM (DESIGN.md, "KV bitstream") and kept beside it, not in the
 * stream: encoder and decoder must be handed the same models and the same ctx[] sequence.
 *
 * ---------------------------------------------------------------- stream layout
 *
 *   offset 0: state 0, 4 bytes little-endian (the state that decodes symbols 0, 2, 4, ...)
 *   offset 4: state 1, 4 bytes little-endian (symbols 1, 3, 5, ...)
 *   offset 8: renormalisation bytes, in the order the decoder consumes them
 *
 * Decoding symbol i takes its slot from state i % 2, then refills that state, most significant
 * byte first (x = x << 8 | next byte), until it is back in [RANS_L, RANS_L << 8); each refill
 * takes 0..2 bytes. Both states start the encoder at RANS_L, so a valid stream is consumed to
 * its last byte with both states back at exactly RANS_L: the decoder checks this, which detects
 * nearly all corruption (a stream carries no other checksum). The stream has no header of its
 * own (no magic, version or length): the enclosing chunk record carries those and n.
 * An empty input (n = 0) is the 8 state bytes alone. */
#ifndef KVSERVE_CACHE_RANS_H
#define KVSERVE_CACHE_RANS_H

#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

/* Frequencies of a model sum to exactly 1 << RANS_PROB_BITS ("probability slots"). */
#define RANS_PROB_BITS 14
#define RANS_PROB_SCALE (1u << RANS_PROB_BITS)
#define RANS_MAX_SYMBOLS 256
/* Lower bound of the normalised state interval [RANS_L, RANS_L << 8); also the initial and
 * final state of every stream. */
#define RANS_L (1u << 23)
/* Bytes the two states take at the front of a stream. */
#define RANS_STATE_BYTES 8

/* A static model over symbols 0..n_symbols-1. Symbol s owns slots [cum[s], cum[s+1]).
 * coarse[j] is the symbol owning slot j << (RANS_PROB_BITS - 8), where the decoder starts its
 * search (a short forward scan over cum). 1284 bytes; no per-slot tables, so the codec can hold
 * one model per (layer, channel, K/V, level). Build with rans_model_build or
 * rans_model_from_freqs; a model that did not come from them must pass rans_model_check before
 * rans_encode/rans_decode use it (those trust their models, not their streams). */
typedef struct rans_model {
    uint16_t n_symbols;                 /* 1..RANS_MAX_SYMBOLS */
    uint16_t freq[RANS_MAX_SYMBOLS];    /* each >= 1, sum RANS_PROB_SCALE */
    uint16_t cum[RANS_MAX_SYMBOLS + 1]; /* cum[0] = 0, cum[s+1] = cum[s] + freq[s] */
    uint8_t coarse[256];                /* symbol owning the first slot of each 64-slot bucket */
} rans_model;

/* Normalises calibration counts[0..n_symbols) into a model: every symbol gets freq >= 1 (a
 * symbol never seen in calibration stays encodable), the rest of the slots go where they save
 * the most bits (the allocation minimises sum counts[s] * -log2(freq[s] / RANS_PROB_SCALE)
 * exactly). Counts may be anything up to UINT64_MAX each; all-zero counts give a uniform model.
 * Fails (-1) for n_symbols outside 1..RANS_MAX_SYMBOLS. */
int rans_model_build(rans_model *m, const uint64_t *counts, int n_symbols, kv_error *err);

/* Builds a model from stored frequencies freq[0..n_symbols) (as a model file would keep them),
 * filling cum and coarse; fails (-1) unless they form a valid model (see rans_model_check). */
int rans_model_from_freqs(rans_model *m, const uint16_t *freq, int n_symbols, kv_error *err);

/* Validates a model from untrusted memory: n_symbols in range, every freq >= 1 and the sum
 * exact, cum and coarse consistent with freq (entries past n_symbols are never read, so they are
 * not checked; rans_model_build leaves them zero). 0 if valid, else -1. */
int rans_model_check(const rans_model *m, kv_error *err);

/* Ideal cost in bits of coding counts[0..m->n_symbols) with m: sum counts[s] * -log2(p(s)). */
double rans_cost_bits(const rans_model *m, const uint64_t *counts);

/* A capacity always enough for rans_encode of n symbols (each symbol costs at most 2 bytes):
 * 2n + RANS_STATE_BYTES, or SIZE_MAX when that overflows. */
size_t rans_encode_bound(size_t n);

/* Encodes syms[0..n), symbol i with models[ctx[i]] (ctx may be NULL: every symbol uses
 * models[0]), into out[0..cap). Returns the stream length, or -1 (err set, out clobbered) when a
 * ctx is >= n_models, a symbol is >= its model's n_symbols, or the stream needs more than cap
 * bytes. */
int64_t rans_encode(const uint8_t *syms, const uint32_t *ctx, size_t n, const rans_model *models,
                    size_t n_models, uint8_t *out, size_t cap, kv_error *err);

/* Decodes exactly n symbols from in[0..len) into syms[0..n), with the same models and ctx (or
 * NULL) the encoder used. Never reads outside in[0..len) nor writes outside syms[0..n).
 * Returns 0, or -1 (err set, syms clobbered) when the input is truncated, a state is out of
 * range, a ctx is >= n_models, bytes are left over, or the final states are not the initial
 * ones (the stream is corrupt, or models/ctx/n differ from the encoder's). */
int rans_decode(const uint8_t *in, size_t len, const uint32_t *ctx, size_t n,
                const rans_model *models, size_t n_models, uint8_t *syms, kv_error *err);

#endif
