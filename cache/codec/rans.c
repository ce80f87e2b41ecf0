/* rans: static-model range ANS with two interleaved 32-bit states and byte-wise renormalisation.
 * Stream layout and contracts: rans.h. The coding step (Duda 2013, Giesen 2014):
 *
 *   encode s:  x' = (x / f) << PROB_BITS  +  x % f  +  c        (f = freq[s], c = cum[s])
 *   decode:    slot = x mod 2^PROB_BITS, s = the symbol with c <= slot < c + f,
 *              x = f * (x >> PROB_BITS) + slot - c
 *
 * with x kept in [L, 256 L): before a step the encoder shifts out low bytes while
 * x >= 2^(31 - PROB_BITS) f (so the step lands back in range), and after one the decoder shifts
 * bytes back in while x < L. Decoding runs the encoder backwards, so the encoder walks the symbols
 * from last to first and writes its bytes from the end of the buffer towards the front. */
#include "cache/codec/rans.h"

#include <math.h>
#include <string.h>

_Static_assert(RANS_MAX_SYMBOLS <= RANS_PROB_SCALE, "every symbol needs a probability slot");
_Static_assert(RANS_MAX_SYMBOLS <= 256, "symbols are bytes");
_Static_assert(RANS_PROB_BITS >= 8 && RANS_PROB_BITS <= 16, "coarse table and uint16_t cum");
/* The encoder's bound 2^(31 - PROB_BITS) f <= 2^31 fits 32 bits, and a decoding step leaves
 * x >= f (x >> PROB_BITS) >= 2^(23 - PROB_BITS) >= 2^7, so a refill never takes more than two
 * bytes (which is also what bounds a symbol's cost in rans_encode_bound). */
_Static_assert(RANS_L == (1u << 23), "byte-wise renormalisation of a 32-bit state");

#define SLOT_MASK (RANS_PROB_SCALE - 1u)
#define COARSE_SHIFT (RANS_PROB_BITS - 8)
/* The encoder's bound: before coding s, x must be below X_MAX_UNIT * freq[s]. */
#define X_MAX_UNIT ((RANS_L >> RANS_PROB_BITS) << 8)

/* ---------------------------------------------------------------- models */

/* Fills cum and coarse from freq[0..n_symbols) (already validated or built). */
static void model_fill_tables(rans_model *m) {
    uint32_t c = 0;
    m->cum[0] = 0;
    for (int s = 0; s < m->n_symbols; s++) {
        c += m->freq[s];
        m->cum[s + 1] = (uint16_t)c;
    }
    int s = 0;
    for (uint32_t j = 0; j < 256; j++) {
        uint32_t slot = j << COARSE_SHIFT;
        while (m->cum[s + 1] <= slot) s++;
        m->coarse[j] = (uint8_t)s;
    }
}

/* What giving a symbol one more slot saves, and taking one away costs (its cost is
 * count * -log(f / SCALE); natural logs, since these are only compared). Its last slot cannot
 * be taken: infinite loss. */
static double gain_add(double count, uint32_t f) { return count * log1p(1.0 / f); }
static double loss_remove(double count, uint32_t f) {
    return f > 1 ? count * -log1p(-1.0 / f) : INFINITY;
}

/* Index of the largest (want_max) or smallest value in v[0..n); the first on ties. */
static int arg_extreme(const double *v, int n, int want_max) {
    int best = 0;
    for (int s = 1; s < n; s++)
        if (want_max ? v[s] > v[best] : v[s] < v[best]) best = s;
    return best;
}

int rans_model_build(rans_model *m, const uint64_t *counts, int n_symbols, kv_error *err) {
    if (n_symbols < 1 || n_symbols > RANS_MAX_SYMBOLS)
        return kv_fail(err, "rans: model with %d symbols (must be 1..%d)", n_symbols,
                       RANS_MAX_SYMBOLS);
    if ((uint32_t)n_symbols > RANS_PROB_SCALE)
        return kv_fail(err, "rans: %d symbols do not fit %u probability slots", n_symbols,
                       RANS_PROB_SCALE);
    memset(m, 0, sizeof *m);
    m->n_symbols = (uint16_t)n_symbols;
    const int n = n_symbols;

    /* Totals in double: 256 counts of up to 2^64 cannot overflow it (a uint64_t sum could), and
     * its 53-bit precision is far finer than the 14-bit slots being allocated. */
    double c[RANS_MAX_SYMBOLS], total = 0.0;
    for (int s = 0; s < n; s++) {
        c[s] = (double)counts[s];
        total += c[s];
    }
    uint32_t f[RANS_MAX_SYMBOLS];
    if (total == 0.0) {
        for (int s = 0; s < n; s++)
            f[s] = RANS_PROB_SCALE / (uint32_t)n + ((uint32_t)s < RANS_PROB_SCALE % (uint32_t)n);
    } else {
        /* Start from one reserved slot each plus a proportional share of the rest, rounded
         * down (the sum stays <= SCALE, short by less than n), then give out the remaining
         * slots one at a time where they save the most, then move single slots while that
         * lowers the cost. The cost is a separable convex function of the frequencies, so a
         * point no single move improves is the exact optimum. */
        const double spare = (double)(RANS_PROB_SCALE - (uint32_t)n);
        uint32_t sum = 0;
        for (int s = 0; s < n; s++) {
            double share = floor(c[s] / total * spare);
            f[s] = 1u + (share < spare ? (uint32_t)share : (uint32_t)spare);
            sum += f[s];
        }
        /* Exact shares would undershoot, but the double total may round below the true sum
         * and push the floors one slot over: fix either way. */
        double gain[RANS_MAX_SYMBOLS], loss[RANS_MAX_SYMBOLS];
        for (int s = 0; s < n; s++) {
            gain[s] = gain_add(c[s], f[s]);
            loss[s] = loss_remove(c[s], f[s]);
        }
        while (sum > RANS_PROB_SCALE) {
            int j = arg_extreme(loss, n, 0);
            f[j]--, sum--;
            gain[j] = gain_add(c[j], f[j]);
            loss[j] = loss_remove(c[j], f[j]);
        }
        while (sum < RANS_PROB_SCALE) {
            int i = arg_extreme(gain, n, 1);
            f[i]++, sum++;
            gain[i] = gain_add(c[i], f[i]);
            loss[i] = loss_remove(c[i], f[i]);
        }
        /* Each move lowers the cost by a margin, so this ends; the cap only guards against a
         * floating-point surprise (any allocation reached so far is a valid model). */
        for (int iter = 0; iter < 4 * (int)RANS_PROB_SCALE; iter++) {
            int i = arg_extreme(gain, n, 1), j = arg_extreme(loss, n, 0);
            if (i == j || !(gain[i] > loss[j] * (1.0 + 1e-12))) break;
            f[i]++, f[j]--;
            gain[i] = gain_add(c[i], f[i]);
            loss[i] = loss_remove(c[i], f[i]);
            gain[j] = gain_add(c[j], f[j]);
            loss[j] = loss_remove(c[j], f[j]);
        }
    }
    for (int s = 0; s < n; s++) m->freq[s] = (uint16_t)f[s];
    model_fill_tables(m);
    return 0;
}

int rans_model_from_freqs(rans_model *m, const uint16_t *freq, int n_symbols, kv_error *err) {
    if (n_symbols < 1 || n_symbols > RANS_MAX_SYMBOLS)
        return kv_fail(err, "rans: model with %d symbols (must be 1..%d)", n_symbols,
                       RANS_MAX_SYMBOLS);
    memset(m, 0, sizeof *m);
    m->n_symbols = (uint16_t)n_symbols;
    uint32_t sum = 0;
    for (int s = 0; s < n_symbols; s++) {
        if (freq[s] == 0) return kv_fail(err, "rans: model: symbol %d has frequency 0", s);
        sum += freq[s];
        m->freq[s] = freq[s];
    }
    if (sum != RANS_PROB_SCALE)
        return kv_fail(err, "rans: model: frequencies sum to %u, not %u", sum, RANS_PROB_SCALE);
    model_fill_tables(m);
    return 0;
}

int rans_model_check(const rans_model *m, kv_error *err) {
    int n = m->n_symbols;
    if (n < 1 || n > RANS_MAX_SYMBOLS)
        return kv_fail(err, "rans: model with %d symbols (must be 1..%d)", n, RANS_MAX_SYMBOLS);
    if (m->cum[0] != 0) return kv_fail(err, "rans: model: cum[0] = %u, not 0", m->cum[0]);
    uint32_t sum = 0;
    for (int s = 0; s < n; s++) {
        if (m->freq[s] == 0) return kv_fail(err, "rans: model: symbol %d has frequency 0", s);
        sum += m->freq[s];
        if (m->cum[s + 1] != sum)
            return kv_fail(err, "rans: model: cum[%d] = %u, frequencies give %u", s + 1,
                           m->cum[s + 1], sum);
    }
    if (sum != RANS_PROB_SCALE)
        return kv_fail(err, "rans: model: frequencies sum to %u, not %u", sum, RANS_PROB_SCALE);
    /* cum is now strictly increasing and ends at SCALE, so each slot has exactly one owner. */
    int s = 0;
    for (uint32_t j = 0; j < 256; j++) {
        uint32_t slot = j << COARSE_SHIFT;
        while (m->cum[s + 1] <= slot) s++;
        if (m->coarse[j] != s)
            return kv_fail(err, "rans: model: coarse[%u] = %u, slot %u belongs to symbol %d", j,
                           m->coarse[j], slot, s);
    }
    return 0;
}

double rans_cost_bits(const rans_model *m, const uint64_t *counts) {
    double bits = 0.0;
    for (int s = 0; s < m->n_symbols; s++) {
        if (counts[s] == 0) continue;
        if (m->freq[s] == 0) return INFINITY;
        bits += (double)counts[s] * (RANS_PROB_BITS - log2((double)m->freq[s]));
    }
    return bits;
}

/* ---------------------------------------------------------------- encoder */

size_t rans_encode_bound(size_t n) {
    size_t b;
    if (size_mul(n, 2, &b) || size_add(b, RANS_STATE_BYTES, &b)) return SIZE_MAX;
    return b;
}

/* Codes symbol i into *x, writing renormalisation bytes below out[*pos]. 0, or -1 on error. */
static inline int encode_one(uint32_t *x, size_t i, const uint8_t *syms, const uint32_t *ctx,
                             const rans_model *models, size_t n_models, uint8_t *out, size_t *pos,
                             kv_error *err) {
    uint32_t c = ctx ? ctx[i] : 0;
    if (c >= n_models)
        return kv_fail(err, "rans: encode: ctx[%zu] = %u out of range (%zu models)", i, c,
                       n_models);
    const rans_model *m = &models[c];
    uint32_t s = syms[i];
    if (s >= m->n_symbols)
        return kv_fail(err, "rans: encode: symbol %zu = %u out of range (model %u has %u)", i, s, c,
                       m->n_symbols);
    uint32_t f = m->freq[s], st = *x;
    uint32_t x_max = X_MAX_UNIT * f;
    while (st >= x_max) {
        if (*pos == 0) return kv_fail(err, "rans: encode: output capacity too small");
        out[--*pos] = (uint8_t)st;
        st >>= 8;
    }
    *x = ((st / f) << RANS_PROB_BITS) + st % f + m->cum[s];
    return 0;
}

int64_t rans_encode(const uint8_t *syms, const uint32_t *ctx, size_t n, const rans_model *models,
                    size_t n_models, uint8_t *out, size_t cap, kv_error *err) {
    if ((uint64_t)cap > (uint64_t)INT64_MAX) cap = (size_t)INT64_MAX;
    uint32_t x0 = RANS_L, x1 = RANS_L;
    size_t pos = cap, i = n;
    /* Backwards: symbol i belongs to state i % 2; an odd count leaves the last one to state 0. */
    if (i & 1) {
        i--;
        if (encode_one(&x0, i, syms, ctx, models, n_models, out, &pos, err)) return -1;
    }
    while (i > 0) {
        i -= 2;
        if (encode_one(&x1, i + 1, syms, ctx, models, n_models, out, &pos, err) ||
            encode_one(&x0, i, syms, ctx, models, n_models, out, &pos, err))
            return -1;
    }
    if (pos < RANS_STATE_BYTES) return kv_fail(err, "rans: encode: output capacity too small");
    pos -= RANS_STATE_BYTES;
    for (int b = 0; b < 4; b++) {
        out[pos + (size_t)b] = (uint8_t)(x0 >> (8 * b));
        out[pos + 4 + (size_t)b] = (uint8_t)(x1 >> (8 * b));
    }
    size_t len = cap - pos;
    memmove(out, out + pos, len);
    return (int64_t)len;
}

/* ---------------------------------------------------------------- decoder */

/* The symbol owning slot: start at the coarse table's guess and scan forward. cum is strictly
 * increasing up to cum[n_symbols] = SCALE > slot, so the scan stops inside the model. Returns
 * the symbol; *start and *freq get its interval (freq[] itself is not read: one load less).
 * Measured against a branch-free binary search over cum (4M symbols, one x86-64 thread):
 * 1.5-2.5x faster when the models are in cache (the scan is almost always 0 or 1 steps), but
 * slower (~0.8x) when every symbol switches among thousands of small models, where the extra
 * cache line of coarse[] costs more than the search saves. */
static inline uint32_t model_lookup(const rans_model *m, uint32_t slot, uint32_t *start,
                                    uint32_t *freq) {
    uint32_t s = m->coarse[slot >> COARSE_SHIFT];
    uint32_t next = m->cum[s + 1];
    while (next <= slot) next = m->cum[++s + 1];
    *start = m->cum[s];
    *freq = next - *start;
    return s;
}

/* One decoding step of x (without the refill); returns the symbol. */
static inline uint8_t decode_step(uint32_t *x, const rans_model *m) {
    uint32_t slot = *x & SLOT_MASK, start, f;
    uint32_t s = model_lookup(m, slot, &start, &f);
    *x = f * (*x >> RANS_PROB_BITS) + slot - start;
    return (uint8_t)s;
}

/* Refill with at least 2 readable bytes at in[*p]: a step leaves x >= f * (x >> PROB_BITS) >=
 * 2^(23 - PROB_BITS) = 2^9, so two bytes always bring it back to >= L. Branches rather than a
 * branch-free 0/1/2-byte shift: the refill is well predicted at both ends of the entropy range
 * (almost never at < 1 bit/symbol, always one byte at 8 bits), where it measured 1.4-1.5x
 * faster, and ~6% slower around 3 bits/symbol. */
static inline void refill_fast(uint32_t *x, const uint8_t *in, size_t *p) {
    if (*x < RANS_L) {
        *x = *x << 8 | in[(*p)++];
        if (*x < RANS_L) *x = *x << 8 | in[(*p)++];
    }
}

/* Refill near the end of the stream: byte by byte, checking the length. */
static inline int refill_checked(uint32_t *x, const uint8_t *in, size_t len, size_t *p) {
    while (*x < RANS_L) {
        if (*p >= len) return -1;
        *x = *x << 8 | in[(*p)++];
    }
    return 0;
}

int rans_decode(const uint8_t *in, size_t len, const uint32_t *ctx, size_t n,
                const rans_model *models, size_t n_models, uint8_t *syms, kv_error *err) {
    if (len < RANS_STATE_BYTES)
        return kv_fail(err, "rans: decode: stream truncated (%zu bytes, states need %d)", len,
                       RANS_STATE_BYTES);
    uint32_t x0 = le_get_u32(in), x1 = le_get_u32(in + 4);
    /* Out-of-range states would break the step's arithmetic (and the two-byte refill bound). */
    if (x0 < RANS_L || x0 >= RANS_L << 8 || x1 < RANS_L || x1 >= RANS_L << 8)
        return kv_fail(err, "rans: decode: initial state out of range (corrupt stream)");
    size_t p = RANS_STATE_BYTES, i = 0;

    /* Main loop: one symbol per state, while 4 bytes (2 refills of at most 2) remain. */
    while (n - i >= 2 && len - p >= 4) {
        uint32_t c0 = ctx ? ctx[i] : 0, c1 = ctx ? ctx[i + 1] : 0;
        if ((c0 >= n_models) | (c1 >= n_models)) break; /* reported below */
        syms[i] = decode_step(&x0, &models[c0]);
        syms[i + 1] = decode_step(&x1, &models[c1]);
        refill_fast(&x0, in, &p);
        refill_fast(&x1, in, &p);
        i += 2;
    }
    /* The rest, symbol by symbol with checked reads. */
    for (; i < n; i++) {
        uint32_t c = ctx ? ctx[i] : 0;
        if (c >= n_models)
            return kv_fail(err, "rans: decode: ctx[%zu] = %u out of range (%zu models)", i, c,
                           n_models);
        uint32_t *x = (i & 1) ? &x1 : &x0;
        syms[i] = decode_step(x, &models[c]);
        if (refill_checked(x, in, len, &p))
            return kv_fail(err, "rans: decode: stream truncated (%zu bytes) at symbol %zu of %zu",
                           len, i, n);
    }
    if (p != len)
        return kv_fail(err, "rans: decode: %zu trailing bytes after %zu symbols (corrupt stream)",
                       len - p, n);
    if (x0 != RANS_L || x1 != RANS_L)
        return kv_fail(err,
                       "rans: decode: final states %#x, %#x are not the initial %#x (corrupt "
                       "stream, or models/ctx differ from the encoder's)",
                       x0, x1, RANS_L);
    return 0;
}
