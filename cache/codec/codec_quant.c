/* CacheGen's quantization stage and the uniform baselines (see codec_quant.h). */
#include "cache/codec/codec_quant.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "kernels/quant.h"

/* ---------------------------------------------------------------- validation */

int64_t codec_shape_elems(const codec_shape *sh) {
    if (sh->n_layer < 1 || sh->n_layer > CODEC_MAX_LAYERS || sh->n_tok < 1 || sh->n_chan < 1)
        return -1;
    size_t n;
    if (size_mul((size_t)sh->n_layer * 2, (size_t)sh->n_tok, &n) ||
        size_mul(n, (size_t)sh->n_chan, &n) || n > (size_t)INT64_MAX)
        return -1;
    return (int64_t)n;
}

static int check_inputs(const codec_shape *sh, const float *scale, const codec_level *lv,
                        kv_error *err) {
    if (codec_shape_elems(sh) < 0)
        return kv_fail(err, "codec: bad chunk shape (%d layers, %d tokens, %d channels)",
                       sh->n_layer, sh->n_tok, sh->n_chan);
    if (lv->group < 0)
        return kv_fail(err, "codec: token group size %d must not be negative", lv->group);
    for (int l = 0; l < sh->n_layer; l++)
        for (int kv = 0; kv < 2; kv++) {
            float a = lv->anchor_bin[l][kv], d = lv->delta_bin[l][kv];
            if (!(a > 0) || !isfinite(a) || !(d > 0) || !isfinite(d))
                return kv_fail(err,
                               "codec: layer %d %c: bins must be positive (anchor %g, delta %g)", l,
                               kv ? 'V' : 'K', a, d);
        }
    size_t n_scale = (size_t)sh->n_layer * 2 * (size_t)sh->n_chan;
    for (size_t i = 0; i < n_scale; i++)
        if (!(scale[i] > 0) || !isfinite(scale[i]))
            return kv_fail(err, "codec: channel scale %zu is %g; scales must be positive", i,
                           scale[i]);
    return 0;
}

/* ---------------------------------------------------------------- anchor + delta */

/* The same float operations on both sides, so the decoder rebuilds exactly the anchors the
 * encoder took its deltas from. */
static inline float step_of(float bin, float scale) { return bin * scale; }

/* What deltas are taken from until the first anchor: the channels' centres (or 0). */
static void init_prediction(float *pred, const float *center, int l, int kv, int nc) {
    if (!center) {
        memset(pred, 0, sizeof(float) * (size_t)nc);
        return;
    }
    memcpy(pred, center + ((size_t)l * 2 + kv) * nc, sizeof(float) * (size_t)nc);
}

int64_t codec_quantize(const float *x, const codec_shape *sh, const float *scale,
                       const float *center, const codec_level *lv, const uint8_t *exact,
                       uint8_t *sym, uint16_t *esc, size_t esc_cap, kv_error *err) {
    if (check_inputs(sh, scale, lv, err)) return -1;
    const int nc = sh->n_chan;
    size_t n_esc = 0;
    float anchor[4096];
    if (nc > (int)(sizeof anchor / sizeof anchor[0]))
        return kv_fail(err, "codec: %d channels per layer exceed the codec's 4096", nc);
    for (int l = 0; l < sh->n_layer; l++)
        for (int kv = 0; kv < 2; kv++) {
            const float *sc = scale + ((size_t)l * 2 + kv) * nc;
            const float ab = lv->anchor_bin[l][kv], db = lv->delta_bin[l][kv];
            init_prediction(anchor, center, l, kv, nc);
            for (int t = 0; t < sh->n_tok; t++) {
                size_t row = (((size_t)l * 2 + kv) * sh->n_tok + t) * nc;
                const float *xr = x + row;
                uint8_t *sr = sym + row;
                bool is_anchor = codec_is_anchor(t, lv->group);
                bool keep = exact && exact[t];
                for (int c = 0; c < nc; c++) {
                    float v = xr[c];
                    if (keep) {
                        sr[c] = is_anchor ? CODEC_ANCHOR_ESCAPE : CODEC_DELTA_ESCAPE;
                    } else if (is_anchor) {
                        float st = step_of(ab, sc[c]);
                        float q = rintf(v / st);
                        if (isfinite(q) && fabsf(q) <= CODEC_ANCHOR_RADIUS) {
                            sr[c] = (uint8_t)((int)q + CODEC_ANCHOR_RADIUS);
                            anchor[c] = q * st;
                            continue;
                        }
                        sr[c] = CODEC_ANCHOR_ESCAPE;
                    } else {
                        float st = step_of(db, sc[c]);
                        float q = rintf((v - anchor[c]) / st);
                        if (isfinite(q) && fabsf(q) <= CODEC_DELTA_RADIUS) {
                            sr[c] = (uint8_t)((int)q + CODEC_DELTA_RADIUS);
                            continue;
                        }
                        sr[c] = CODEC_DELTA_ESCAPE;
                    }
                    if (n_esc == esc_cap) return kv_fail(err, "codec: escape buffer full");
                    uint16_t h = fp32_to_fp16(v);
                    esc[n_esc++] = h;
                    if (is_anchor) anchor[c] = fp16_to_fp32(h);
                }
            }
        }
    return (int64_t)n_esc;
}

int codec_dequantize(const uint8_t *sym, const uint16_t *esc, size_t n_esc, const codec_shape *sh,
                     const float *scale, const float *center, const codec_level *lv, float *x,
                     kv_error *err) {
    if (check_inputs(sh, scale, lv, err)) return -1;
    const int nc = sh->n_chan;
    float anchor[4096];
    if (nc > (int)(sizeof anchor / sizeof anchor[0]))
        return kv_fail(err, "codec: %d channels per layer exceed the codec's 4096", nc);
    size_t used = 0;
    for (int l = 0; l < sh->n_layer; l++)
        for (int kv = 0; kv < 2; kv++) {
            const float *sc = scale + ((size_t)l * 2 + kv) * nc;
            const float ab = lv->anchor_bin[l][kv], db = lv->delta_bin[l][kv];
            init_prediction(anchor, center, l, kv, nc);
            for (int t = 0; t < sh->n_tok; t++) {
                size_t row = (((size_t)l * 2 + kv) * sh->n_tok + t) * nc;
                const uint8_t *sr = sym + row;
                float *xr = x + row;
                bool is_anchor = codec_is_anchor(t, lv->group);
                for (int c = 0; c < nc; c++) {
                    int s = sr[c];
                    int esc_sym = is_anchor ? CODEC_ANCHOR_ESCAPE : CODEC_DELTA_ESCAPE;
                    if (s > esc_sym)
                        return kv_fail(err, "codec: symbol %d out of range at layer %d token %d", s,
                                       l, t);
                    if (s == esc_sym) {
                        if (used == n_esc)
                            return kv_fail(err, "codec: more escapes than the %zu stored", n_esc);
                        xr[c] = fp16_to_fp32(esc[used++]);
                        if (is_anchor) anchor[c] = xr[c];
                    } else if (is_anchor) {
                        anchor[c] = (float)(s - CODEC_ANCHOR_RADIUS) * step_of(ab, sc[c]);
                        xr[c] = anchor[c];
                    } else {
                        xr[c] = anchor[c] + (float)(s - CODEC_DELTA_RADIUS) * step_of(db, sc[c]);
                    }
                }
            }
        }
    if (used != n_esc) return kv_fail(err, "codec: %zu escapes stored but %zu used", n_esc, used);
    return 0;
}

float codec_error_bound(const codec_shape *sh, const float *scale, const codec_level *lv, int layer,
                        int kv, int token, int chan) {
    float s = scale[((size_t)layer * 2 + kv) * sh->n_chan + chan];
    float bin =
        codec_is_anchor(token, lv->group) ? lv->anchor_bin[layer][kv] : lv->delta_bin[layer][kv];
    return 0.5f * bin * s;
}

/* ---------------------------------------------------------------- uniform baselines */

static size_t uniform_row_bytes(int n_chan, int bits) {
    if (bits == 16) return (size_t)n_chan * 2;
    return 4 + (bits == 8 ? (size_t)n_chan : ((size_t)n_chan + 1) / 2);
}

size_t codec_uniform_bytes(const codec_shape *sh, int bits) {
    if (codec_shape_elems(sh) < 0 || (bits != 16 && bits != 8 && bits != 4)) return 0;
    return (size_t)sh->n_layer * 2 * (size_t)sh->n_tok * uniform_row_bytes(sh->n_chan, bits);
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static uint16_t get16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

int codec_uniform_encode(const float *x, const codec_shape *sh, int bits, uint8_t *out,
                         kv_error *err) {
    size_t rb = 0;
    if (!codec_uniform_bytes(sh, bits))
        return kv_fail(err, "codec: uniform baseline needs a valid shape and 16, 8 or 4 bits");
    rb = uniform_row_bytes(sh->n_chan, bits);
    const int nc = sh->n_chan, levels = (1 << bits) - 1;
    size_t n_rows = (size_t)sh->n_layer * 2 * (size_t)sh->n_tok;
    for (size_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * nc;
        uint8_t *o = out + r * rb;
        if (bits == 16) {
            for (int c = 0; c < nc; c++) put16(o + 2 * c, fp32_to_fp16(xr[c]));
            continue;
        }
        float lo = xr[0], hi = xr[0];
        for (int c = 1; c < nc; c++) {
            lo = fminf(lo, xr[c]);
            hi = fmaxf(hi, xr[c]);
        }
        /* min and step as stored (f16), so the codes are chosen against what decodes */
        uint16_t lo_h = fp32_to_fp16(lo), st_h = fp32_to_fp16((hi - lo) / (float)levels);
        float lo16 = fp16_to_fp32(lo_h), st16 = fp16_to_fp32(st_h);
        put16(o, lo_h);
        put16(o + 2, st_h);
        uint8_t *codes = o + 4;
        if (bits == 4) memset(codes, 0, ((size_t)nc + 1) / 2);
        for (int c = 0; c < nc; c++) {
            float q = st16 > 0 ? rintf((xr[c] - lo16) / st16) : 0;
            int v = q < 0 ? 0 : q > levels ? levels : (int)q;
            if (bits == 8)
                codes[c] = (uint8_t)v;
            else
                codes[c / 2] |= (uint8_t)(v << (4 * (c & 1)));
        }
    }
    return 0;
}

int codec_uniform_decode(const uint8_t *in, size_t len, const codec_shape *sh, int bits, float *x,
                         kv_error *err) {
    size_t need = codec_uniform_bytes(sh, bits);
    if (!need)
        return kv_fail(err, "codec: uniform baseline needs a valid shape and 16, 8 or 4 bits");
    if (len != need)
        return kv_fail(err, "codec: uniform %d-bit chunk has %zu bytes, expected %zu", bits, len,
                       need);
    size_t rb = uniform_row_bytes(sh->n_chan, bits);
    const int nc = sh->n_chan;
    size_t n_rows = (size_t)sh->n_layer * 2 * (size_t)sh->n_tok;
    for (size_t r = 0; r < n_rows; r++) {
        const uint8_t *o = in + r * rb;
        float *xr = x + r * nc;
        if (bits == 16) {
            for (int c = 0; c < nc; c++) xr[c] = fp16_to_fp32(get16(o + 2 * c));
            continue;
        }
        float lo = fp16_to_fp32(get16(o)), st = fp16_to_fp32(get16(o + 2));
        const uint8_t *codes = o + 4;
        for (int c = 0; c < nc; c++) {
            int v = bits == 8 ? codes[c] : (codes[c / 2] >> (4 * (c & 1))) & 15;
            xr[c] = lo + (float)v * st;
        }
    }
    return 0;
}
