/* The CacheGen codec (see codec.h): the codec table (calibration and its file) and the chunk
 * bitstream, whose layers are quantized by codec_quant.c and entropy-coded by rans.c.
 *
 * A layer is the unit of everything here: codec_quantize and codec_dequantize see one layer at
 * a time (a one-layer shape and a one-layer level holding that layer's bins), and rans_encode
 * and rans_decode code its symbols with the layer's slice of codec_table.models, picked per
 * symbol by a ctx[] array that depends only on (n_tok, n_chan, group) and so is built once per
 * call and shared by every layer and thread. */
#include "cache/codec/codec.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "kernels/rope.h"

#define TABLE_VERSION 3
#define TABLE_HEADER                                                                               \
    64 /* magic, version, reserved, model_id, n_layer, n_chan, n_levels,                           \
          n_head, head_dim, n_rot */
#define SHA_BYTES 32
/* Bitstream header fields (codec.h). */
#define STREAM_CHECKSUM_AT 56
#define STREAM_LAYER_ENTRY 8

_Static_assert(CODEC_ANCHOR_SYMBOLS <= RANS_MAX_SYMBOLS, "anchor alphabet fits a rANS model");
_Static_assert(CODEC_DELTA_SYMBOLS <= RANS_MAX_SYMBOLS, "delta alphabet fits a rANS model");
_Static_assert(CODEC_MAX_LAYERS <= UINT16_MAX && CODEC_MAX_CHANNELS <= UINT16_MAX,
               "n_layer and n_chan are u16 in the bitstream");
/* A layer's symbols (2 * n_tok * n_chan <= 2^29) and its escape and stream byte counts fit the
 * u32 fields of the layer table. */
_Static_assert(2ull * CODEC_MAX_TOKENS * CODEC_MAX_CHANNELS * 2 + RANS_STATE_BYTES <= UINT32_MAX,
               "layer lengths fit u32");

/* ---------------------------------------------------------------- little-endian fields */

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float get_f32(const uint8_t *p) {
    uint32_t u = le_get_u32(p);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---------------------------------------------------------------- shared helpers */

/* The one-layer view of level lv at layer l that codec_quantize / codec_dequantize take with a
 * one-layer shape: only group and bins [0][kv] are read (check_inputs and the coders look at
 * layers < n_layer = 1), so the rest of the 4 KiB struct is left alone. */
static void layer_level(const codec_level *lv, int l, codec_level *one) {
    one->group = lv->group;
    for (int kv = 0; kv < 2; kv++) {
        one->anchor_bin[0][kv] = lv->anchor_bin[l][kv];
        one->delta_bin[0][kv] = lv->delta_bin[l][kv];
    }
}

/* Model index of every symbol of a layer, in codec_quantize's order (kv, token, channel):
 * kv for anchor tokens, 2 + kv * n_chan + c for the others. ctx: [2][n_tok][n_chan]. */
static uint32_t *build_ctx(int n_tok, int n_chan, int group) {
    uint32_t *ctx = malloc((size_t)2 * (size_t)n_tok * (size_t)n_chan * sizeof *ctx);
    if (!ctx) return NULL;
    uint32_t *p = ctx;
    for (int kv = 0; kv < 2; kv++)
        for (int t = 0; t < n_tok; t++) {
            if (codec_is_anchor(t, group)) {
                for (int c = 0; c < n_chan; c++) *p++ = (uint32_t)kv;
            } else {
                uint32_t base = 2 + (uint32_t)kv * (uint32_t)n_chan;
                for (int c = 0; c < n_chan; c++) *p++ = base + (uint32_t)c;
            }
        }
    return ctx;
}

static int check_levels(const codec_level *levels, int n_levels, int n_layer, kv_error *err) {
    for (int i = 0; i < n_levels; i++) {
        const codec_level *lv = &levels[i];
        if (lv->group < 0 || lv->group > CODEC_MAX_TOKENS)
            return kv_fail(err, "codec: level %d: token group %d outside 0..%d", i, lv->group,
                           CODEC_MAX_TOKENS);
        for (int l = 0; l < n_layer; l++)
            for (int kv = 0; kv < 2; kv++) {
                float a = lv->anchor_bin[l][kv], d = lv->delta_bin[l][kv];
                if (!(a > 0) || !isfinite(a) || !(d > 0) || !isfinite(d))
                    return kv_fail(err,
                                   "codec: level %d layer %d %c: bins must be finite and positive "
                                   "(anchor %g, delta %g)",
                                   i, l, kv ? 'V' : 'K', a, d);
            }
    }
    return 0;
}

/* The attention shape a table may declare: none (all 0), or heads of head_dim channels with
 * n_kv_head = n_chan / head_dim KV heads each read by n_head / n_kv_head query heads, and the
 * first n_rot (even) channels of a head rotated. */
static int check_attention_shape(int n_chan, uint32_t n_head, uint32_t head_dim, uint32_t n_rot,
                                 kv_error *err) {
    if (!n_head && !head_dim && !n_rot) return 0;
    if (n_head < 1 || head_dim < 1 || head_dim > (uint32_t)n_chan || n_chan % head_dim ||
        n_head % ((uint32_t)n_chan / head_dim) || n_head > 64 * ((uint32_t)n_chan / head_dim) ||
        n_rot % 2 || n_rot > head_dim)
        return kv_fail(err,
                       "codec: attention shape of %u heads x %u dims (%u rotated) does not fit "
                       "%d KV channels",
                       n_head, head_dim, n_rot, n_chan);
    return 0;
}

static int attention_alloc(codec_table *t, int n_head, int head_dim, int n_rot, kv_error *err) {
    free(t->inv_freq);
    free(t->qdir);
    t->inv_freq = malloc(sizeof(float) * (size_t)(n_rot / 2 + 1));
    t->qdir = malloc(sizeof(float) * (size_t)t->n_layer * (size_t)n_head * (size_t)head_dim);
    if (!t->inv_freq || !t->qdir) {
        free(t->inv_freq);
        free(t->qdir);
        t->inv_freq = t->qdir = NULL;
        t->n_head = t->head_dim = t->n_rot = 0;
        return kv_fail(err, "codec: out of memory");
    }
    t->n_head = n_head;
    t->head_dim = head_dim;
    t->n_rot = n_rot;
    return 0;
}

static int table_ready(const codec_table *t, kv_error *err) {
    if (!t || !t->scale || !t->center || !t->models || t->n_layer < 1 ||
        t->n_layer > CODEC_MAX_LAYERS || t->n_chan < 1 || t->n_chan > CODEC_MAX_CHANNELS ||
        t->n_levels < 1 || t->n_levels > CODEC_MAX_LEVELS)
        return kv_fail(err, "codec: table is not initialised");
    return 0;
}

/* ---------------------------------------------------------------- table file

 * Layout: codec.h (codec_table_parse). The serializer streams the file through a small staging
 * buffer into the SHA-256 and, when given one, into the output buffer, so computing a table's
 * id does not need the whole file in memory. */

typedef struct table_writer {
    uint8_t *out; /* the whole file, or NULL to hash only */
    size_t pos;   /* bytes emitted so far */
    EVP_MD_CTX *md;
    size_t fill;
    uint8_t stage[16384];
} table_writer;

static void writer_flush(table_writer *w) {
    if (!w->fill) return;
    EVP_DigestUpdate(w->md, w->stage, w->fill);
    if (w->out) memcpy(w->out + w->pos, w->stage, w->fill);
    w->pos += w->fill;
    w->fill = 0;
}

/* Room for n (<= 1024) more bytes in the stage; returns where to write them. */
static uint8_t *writer_take(table_writer *w, size_t n) {
    if (sizeof w->stage - w->fill < n) writer_flush(w);
    uint8_t *p = w->stage + w->fill;
    w->fill += n;
    return p;
}

static size_t model_bytes(int n_symbols) { return 2 + 2 * (size_t)n_symbols; }

/* Size of a table file for a shape within the limits (which keep it far below SIZE_MAX). */
static size_t table_file_size(int n_layer, int n_chan, int n_levels, int n_head, int head_dim,
                              int n_rot) {
    size_t nl = (size_t)n_layer, nc = (size_t)n_chan, nv = (size_t)n_levels;
    size_t attention =
        n_head ? 4 + 4 * (size_t)(n_rot / 2) + 4 * nl * (size_t)n_head * (size_t)head_dim : 0;
    size_t level_bytes = 4 + 16 * nl;
    size_t models_per_level =
        nl * 2 * (model_bytes(CODEC_ANCHOR_SYMBOLS) + nc * model_bytes(CODEC_DELTA_SYMBOLS));
    return TABLE_HEADER + nv * level_bytes + 2 * 4 * nl * 2 * nc + attention +
           nv * models_per_level + SHA_BYTES;
}

static int write_model(table_writer *w, const rans_model *m, int n_symbols, kv_error *err) {
    if (m->n_symbols != n_symbols)
        return kv_fail(err, "codec: table model has %u symbols, expected %d", m->n_symbols,
                       n_symbols);
    uint8_t *p = writer_take(w, model_bytes(n_symbols));
    le_put_u16(p, (uint16_t)n_symbols);
    for (int s = 0; s < n_symbols; s++) le_put_u16(p + 2 + 2 * s, m->freq[s]);
    return 0;
}

/* Emits t's file into out (table_file_size bytes, trailing SHA-256 included), or only hashes it
 * when out is NULL; id gets the SHA-256 either way. */
static int table_emit(const codec_table *t, uint8_t *out, uint8_t id[SHA_BYTES], kv_error *err) {
    if (table_ready(t, err)) return -1;
    table_writer *w = malloc(sizeof *w);
    if (!w) return kv_fail(err, "codec: out of memory serializing the table");
    w->out = out;
    w->pos = w->fill = 0;
    w->md = EVP_MD_CTX_new();
    int rc = -1;
    if (!w->md || EVP_DigestInit_ex(w->md, EVP_sha256(), NULL) != 1) {
        kv_fail(err, "codec: SHA-256 is unavailable");
        goto done;
    }
    const int nl = t->n_layer, nc = t->n_chan;
    uint8_t *p = writer_take(w, TABLE_HEADER);
    memcpy(p, "KVCT", 4);
    le_put_u16(p + 4, TABLE_VERSION);
    le_put_u16(p + 6, 0);
    memcpy(p + 8, t->model_id, 32);
    le_put_u32(p + 40, (uint32_t)nl);
    le_put_u32(p + 44, (uint32_t)nc);
    le_put_u32(p + 48, (uint32_t)t->n_levels);
    le_put_u32(p + 52, (uint32_t)t->n_head);
    le_put_u32(p + 56, (uint32_t)t->head_dim);
    le_put_u32(p + 60, (uint32_t)t->n_rot);
    for (int v = 0; v < t->n_levels; v++) {
        const codec_level *lv = &t->levels[v];
        le_put_u32(writer_take(w, 4), (uint32_t)lv->group);
        for (int l = 0; l < nl; l++)
            for (int kv = 0; kv < 2; kv++)
                le_put_u32(writer_take(w, 4), f32_bits(lv->anchor_bin[l][kv]));
        for (int l = 0; l < nl; l++)
            for (int kv = 0; kv < 2; kv++)
                le_put_u32(writer_take(w, 4), f32_bits(lv->delta_bin[l][kv]));
    }
    size_t n_scale = (size_t)nl * 2 * (size_t)nc;
    for (size_t i = 0; i < n_scale; i++) le_put_u32(writer_take(w, 4), f32_bits(t->scale[i]));
    for (size_t i = 0; i < n_scale; i++) le_put_u32(writer_take(w, 4), f32_bits(t->center[i]));
    if (t->n_head) {
        le_put_u32(writer_take(w, 4), f32_bits(t->margin));
        for (int i = 0; i < t->n_rot / 2; i++)
            le_put_u32(writer_take(w, 4), f32_bits(t->inv_freq[i]));
        size_t n_dir = (size_t)nl * (size_t)t->n_head * (size_t)t->head_dim;
        for (size_t i = 0; i < n_dir; i++) le_put_u32(writer_take(w, 4), f32_bits(t->qdir[i]));
    }
    for (int v = 0; v < t->n_levels; v++) {
        for (int l = 0; l < nl; l++)
            for (int kv = 0; kv < 2; kv++)
                if (write_model(w, &codec_table_layer_models(t, v, l)[kv], CODEC_ANCHOR_SYMBOLS,
                                err))
                    goto done;
        for (int l = 0; l < nl; l++) {
            const rans_model *m = codec_table_layer_models(t, v, l) + 2;
            for (size_t i = 0; i < 2 * (size_t)nc; i++)
                if (write_model(w, &m[i], CODEC_DELTA_SYMBOLS, err)) goto done;
        }
    }
    writer_flush(w);
    unsigned int n = 0;
    if (EVP_DigestFinal_ex(w->md, id, &n) != 1 || n != SHA_BYTES) {
        kv_fail(err, "codec: SHA-256 failed");
        goto done;
    }
    if (out) memcpy(out + w->pos, id, SHA_BYTES);
    rc = 0;
done:
    EVP_MD_CTX_free(w->md);
    free(w);
    return rc;
}

/* Allocates a table's arrays for a shape already checked; levels copied with the bins of
 * layers >= n_layer zeroed, so equal tables are equal structs. Models and scales unset. */
static int table_alloc(codec_table *t, const uint8_t model_id[32], int n_layer, int n_chan,
                       const codec_level *levels, int n_levels, kv_error *err) {
    memset(t, 0, sizeof *t);
    size_t n_scale = (size_t)n_layer * 2 * (size_t)n_chan;
    size_t n_models = (size_t)n_levels * (size_t)n_layer * CODEC_LAYER_MODELS(n_chan);
    t->scale = malloc(n_scale * sizeof *t->scale);
    t->center = malloc(n_scale * sizeof *t->center);
    t->models = malloc(n_models * sizeof *t->models);
    if (!t->scale || !t->center || !t->models) {
        codec_table_free(t);
        return kv_fail(err, "codec: out of memory for a table of %zu models", n_models);
    }
    memcpy(t->model_id, model_id, 32);
    t->n_layer = n_layer;
    t->n_chan = n_chan;
    t->n_levels = n_levels;
    for (int v = 0; v < n_levels; v++) {
        t->levels[v].group = levels[v].group;
        for (int l = 0; l < n_layer; l++)
            for (int kv = 0; kv < 2; kv++) {
                t->levels[v].anchor_bin[l][kv] = levels[v].anchor_bin[l][kv];
                t->levels[v].delta_bin[l][kv] = levels[v].delta_bin[l][kv];
            }
    }
    return 0;
}

int codec_table_init(codec_table *t, const uint8_t model_id[32], int n_layer, int n_chan,
                     const codec_level *levels, int n_levels, kv_error *err) {
    memset(t, 0, sizeof *t);
    if (!model_id || !levels) return kv_fail(err, "codec: table needs a model identity and levels");
    if (n_layer < 1 || n_layer > CODEC_MAX_LAYERS || n_chan < 1 || n_chan > CODEC_MAX_CHANNELS)
        return kv_fail(err, "codec: table shape %d layers x %d channels outside 1..%d x 1..%d",
                       n_layer, n_chan, CODEC_MAX_LAYERS, CODEC_MAX_CHANNELS);
    if (n_levels < 1 || n_levels > CODEC_MAX_LEVELS)
        return kv_fail(err, "codec: %d levels outside 1..%d", n_levels, CODEC_MAX_LEVELS);
    if (check_levels(levels, n_levels, n_layer, err)) return -1;
    if (table_alloc(t, model_id, n_layer, n_chan, levels, n_levels, err)) return -1;
    size_t n_scale = (size_t)n_layer * 2 * (size_t)n_chan;
    for (size_t i = 0; i < n_scale; i++) {
        t->scale[i] = 1.0f;
        t->center[i] = 0.0f;
    }
    static const uint64_t zeros[RANS_MAX_SYMBOLS];
    rans_model ua, ud;
    if (rans_model_build(&ua, zeros, CODEC_ANCHOR_SYMBOLS, err) ||
        rans_model_build(&ud, zeros, CODEC_DELTA_SYMBOLS, err))
        goto fail;
    for (int v = 0; v < n_levels; v++)
        for (int l = 0; l < n_layer; l++) {
            rans_model *m = codec_table_layer_models(t, v, l);
            m[0] = m[1] = ua;
            for (size_t i = 2; i < CODEC_LAYER_MODELS(n_chan); i++) m[i] = ud;
        }
    if (table_emit(t, NULL, t->id, err)) goto fail;
    return 0;
fail:
    codec_table_free(t);
    return -1;
}

void codec_table_free(codec_table *t) {
    if (!t) return;
    free(t->scale);
    free(t->center);
    free(t->inv_freq);
    free(t->qdir);
    free(t->models);
    memset(t, 0, sizeof *t);
}

int codec_table_serialize(const codec_table *t, uint8_t **out, size_t *len, kv_error *err) {
    *out = NULL;
    *len = 0;
    if (table_ready(t, err)) return -1;
    size_t n =
        table_file_size(t->n_layer, t->n_chan, t->n_levels, t->n_head, t->head_dim, t->n_rot);
    uint8_t *buf = malloc(n);
    if (!buf) return kv_fail(err, "codec: out of memory for a %zu-byte table", n);
    uint8_t id[SHA_BYTES];
    if (table_emit(t, buf, id, err)) {
        free(buf);
        return -1;
    }
    *out = buf;
    *len = n;
    return 0;
}

/* Reads one model of n_symbols at *p (the caller has checked the whole file's length). */
static int read_model(const uint8_t **p, rans_model *m, int n_symbols, kv_error *err) {
    const uint8_t *q = *p;
    int n = le_get_u16(q);
    if (n != n_symbols)
        return kv_fail(err, "codec: table model has %d symbols, expected %d", n, n_symbols);
    uint16_t freq[RANS_MAX_SYMBOLS];
    for (int s = 0; s < n; s++) freq[s] = le_get_u16(q + 2 + 2 * s);
    if (rans_model_from_freqs(m, freq, n, err)) return kv_fail_wrap(err, "codec: table");
    *p = q + model_bytes(n);
    return 0;
}

/* The shape a table file declares (codec.h, codec_table_parse): layers, channels, levels and
 * the attention shape (heads, head_dim, rotated dims; all 0 when none). */
typedef struct table_shape {
    uint32_t nl, nc, nv, nh, hd, nr;
} table_shape;

/* Checks buf[0, len) before any of its body is read: magic and version, a shape within the
 * limits, the length that shape needs, the trailing SHA-256 and the model it was calibrated
 * for. The shape into *s. */
static int table_check_file(const uint8_t *buf, size_t len, const uint8_t model_id[32],
                            table_shape *s, kv_error *err) {
    if (len < TABLE_HEADER + SHA_BYTES)
        return kv_fail(err, "codec: table truncated (%zu bytes)", len);
    if (memcmp(buf, "KVCT", 4) != 0) return kv_fail(err, "codec: not a codec table (bad magic)");
    if (le_get_u16(buf + 4) != TABLE_VERSION || le_get_u16(buf + 6) != 0)
        return kv_fail(err, "codec: table version %u.%u not supported (want %d.0)",
                       le_get_u16(buf + 4), le_get_u16(buf + 6), TABLE_VERSION);
    uint32_t nl = le_get_u32(buf + 40), nc = le_get_u32(buf + 44), nv = le_get_u32(buf + 48);
    uint32_t nh = le_get_u32(buf + 52), hd = le_get_u32(buf + 56), nr = le_get_u32(buf + 60);
    if (nl < 1 || nl > CODEC_MAX_LAYERS || nc < 1 || nc > CODEC_MAX_CHANNELS || nv < 1 ||
        nv > CODEC_MAX_LEVELS)
        return kv_fail(err, "codec: table shape %u layers x %u channels x %u levels out of range",
                       nl, nc, nv);
    if (check_attention_shape((int)nc, nh, hd, nr, err)) return -1;
    /* Within the limits the size cannot overflow (about 1.2 GB at most). */
    size_t want = table_file_size((int)nl, (int)nc, (int)nv, (int)nh, (int)hd, (int)nr);
    if (len != want)
        return kv_fail(err, "codec: table has %zu bytes, its shape needs %zu (%s)", len, want,
                       len < want ? "truncated" : "trailing bytes");
    uint8_t sum[SHA_BYTES];
    if (kv_sha256(buf, len - SHA_BYTES, sum) != 0) return kv_fail(err, "codec: SHA-256 failed");
    if (memcmp(sum, buf + len - SHA_BYTES, SHA_BYTES) != 0)
        return kv_fail(err, "codec: table checksum mismatch (corrupt file)");
    if (memcmp(buf + 8, model_id, 32) != 0)
        return kv_fail(err, "codec: table was calibrated for another model");
    *s = (table_shape){.nl = nl, .nc = nc, .nv = nv, .nh = nh, .hd = hd, .nr = nr};
    return 0;
}

/* Reads the levels at *p (each: group, then the anchor and delta bins of every layer), checks
 * them and allocates t for shape s (table_alloc). On failure t holds nothing. */
static int read_levels(const uint8_t **p, codec_table *t, const table_shape *s,
                       const uint8_t model_id[32], kv_error *err) {
    const uint8_t *q = *p;
    codec_level *levels = calloc(s->nv, sizeof *levels);
    if (!levels) return kv_fail(err, "codec: out of memory");
    for (uint32_t v = 0; v < s->nv; v++) {
        uint32_t group = le_get_u32(q);
        levels[v].group = group > CODEC_MAX_TOKENS ? -1 : (int)group;
        q += 4;
        for (uint32_t l = 0; l < s->nl; l++)
            for (int kv = 0; kv < 2; kv++, q += 4) levels[v].anchor_bin[l][kv] = get_f32(q);
        for (uint32_t l = 0; l < s->nl; l++)
            for (int kv = 0; kv < 2; kv++, q += 4) levels[v].delta_bin[l][kv] = get_f32(q);
    }
    int rc = check_levels(levels, (int)s->nv, (int)s->nl, err);
    if (!rc) rc = table_alloc(t, model_id, (int)s->nl, (int)s->nc, levels, (int)s->nv, err);
    free(levels);
    if (rc) return kv_fail_wrap(err, "codec: table");
    *p = q;
    return 0;
}

/* Reads every channel's scale (finite and positive) and then its centre (finite) at *p. */
static int read_scales(const uint8_t **p, codec_table *t, kv_error *err) {
    const uint8_t *q = *p;
    size_t n_scale = (size_t)t->n_layer * 2 * (size_t)t->n_chan;
    for (size_t i = 0; i < n_scale; i++, q += 4) {
        float s = get_f32(q);
        if (!(s > 0) || !isfinite(s))
            return kv_fail(err, "codec: table scale %zu is %g; scales must be finite and positive",
                           i, s);
        t->scale[i] = s;
    }
    for (size_t i = 0; i < n_scale; i++, q += 4) {
        float c = get_f32(q);
        if (!isfinite(c))
            return kv_fail(err, "codec: table centre %zu is %g; centres must be finite", i, c);
        t->center[i] = c;
    }
    *p = q;
    return 0;
}

/* Reads the attention section at *p (shape s declares one): the margin, the RoPE frequencies
 * and every layer's query directions, each checked. */
static int read_attention(const uint8_t **p, codec_table *t, const table_shape *s, kv_error *err) {
    const uint8_t *q = *p;
    if (attention_alloc(t, (int)s->nh, (int)s->hd, (int)s->nr, err)) return -1;
    t->margin = get_f32(q);
    q += 4;
    if (!(t->margin >= 0) || !isfinite(t->margin))
        return kv_fail(err, "codec: table margin %g must be finite and not negative", t->margin);
    for (uint32_t i = 0; i < s->nr / 2; i++, q += 4) {
        t->inv_freq[i] = get_f32(q);
        if (!(t->inv_freq[i] >= 0) || !isfinite(t->inv_freq[i]))
            return kv_fail(err, "codec: table RoPE frequency %u is %g", i, t->inv_freq[i]);
    }
    size_t n_dir = (size_t)s->nl * s->nh * s->hd;
    for (size_t i = 0; i < n_dir; i++, q += 4) {
        t->qdir[i] = get_f32(q);
        if (!isfinite(t->qdir[i]))
            return kv_fail(err, "codec: table query direction %zu is not finite", i);
    }
    *p = q;
    return 0;
}

/* Reads every level's rANS models at *p: each layer's two anchor models, then each layer's
 * delta models (two per channel), as table_emit writes them. */
static int read_models(const uint8_t **p, codec_table *t, kv_error *err) {
    for (int v = 0; v < t->n_levels; v++) {
        for (int l = 0; l < t->n_layer; l++)
            for (int kv = 0; kv < 2; kv++)
                if (read_model(p, &codec_table_layer_models(t, v, l)[kv], CODEC_ANCHOR_SYMBOLS,
                               err))
                    return -1;
        for (int l = 0; l < t->n_layer; l++) {
            rans_model *m = codec_table_layer_models(t, v, l) + 2;
            for (size_t i = 0; i < 2 * (size_t)t->n_chan; i++)
                if (read_model(p, &m[i], CODEC_DELTA_SYMBOLS, err)) return -1;
        }
    }
    return 0;
}

int codec_table_parse(codec_table *t, const uint8_t *buf, size_t len, const uint8_t model_id[32],
                      kv_error *err) {
    memset(t, 0, sizeof *t);
    if (!buf || !model_id) return kv_fail(err, "codec: table parse needs a buffer and model id");
    table_shape s = {0};
    if (table_check_file(buf, len, model_id, &s, err)) return -1;
    const uint8_t *p = buf + TABLE_HEADER;
    if (read_levels(&p, t, &s, model_id, err)) return -1;
    if (read_scales(&p, t, err) || (s.nh && read_attention(&p, t, &s, err)) ||
        read_models(&p, t, err))
        goto fail;
    if (p != buf + len - SHA_BYTES) { /* the size check makes this unreachable */
        kv_fail(err, "codec: table layout mismatch");
        goto fail;
    }
    memcpy(t->id, buf + len - SHA_BYTES, SHA_BYTES);
    return 0;
fail:
    codec_table_free(t);
    return -1;
}

/* Written to a temporary file beside path, synced and renamed over it: a reader sees the old
 * table or the new one, never part of one. */
int codec_table_save(const codec_table *t, const char *path, kv_error *err) {
    uint8_t *buf = NULL;
    size_t len = 0;
    if (codec_table_serialize(t, &buf, &len, err)) return -1;
    size_t plen = strlen(path);
    char *tmp = malloc(plen + sizeof ".tmp.XXXXXX");
    if (!tmp) {
        free(buf);
        return kv_fail(err, "codec: out of memory");
    }
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp.XXXXXX", sizeof ".tmp.XXXXXX");
    int rc = -1, fd = mkstemp(tmp);
    if (fd < 0) {
        kv_fail(err, "codec: cannot create a temporary file beside %s: %s", path, strerror(errno));
        goto done;
    }
    if (fchmod(fd, 0644) != 0 || kv_write_full(fd, buf, len) != 0 || fsync(fd) != 0) {
        kv_fail(err, "codec: cannot write %s: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        goto done;
    }
    if (close(fd) != 0 || rename(tmp, path) != 0) {
        kv_fail(err, "codec: cannot write %s: %s", path, strerror(errno));
        unlink(tmp);
        goto done;
    }
    rc = 0;
done:
    free(tmp);
    free(buf);
    return rc;
}

int codec_table_load(codec_table *t, const char *path, const uint8_t model_id[32], kv_error *err) {
    memset(t, 0, sizeof *t);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kv_fail(err, "codec: cannot open %s: %s", path, strerror(errno));
    struct stat st;
    uint8_t *buf = NULL;
    int rc = -1;
    /* the largest shape: every limit at once, 64 query heads per KV head */
    size_t max = table_file_size(CODEC_MAX_LAYERS, CODEC_MAX_CHANNELS, CODEC_MAX_LEVELS,
                                 64 * CODEC_MAX_CHANNELS, 1, 0) +
                 4 * CODEC_MAX_CHANNELS / 2;
    if (fstat(fd, &st) != 0) {
        kv_fail(err, "codec: cannot stat %s: %s", path, strerror(errno));
        goto done;
    }
    if (st.st_size < 0 || (uint64_t)st.st_size > max) {
        kv_fail(err, "codec: %s: %lld bytes is not a codec table", path, (long long)st.st_size);
        goto done;
    }
    size_t len = (size_t)st.st_size, got = 0;
    buf = malloc(len ? len : 1);
    if (!buf) {
        kv_fail(err, "codec: out of memory reading %s", path);
        goto done;
    }
    while (got < len) {
        ssize_t r = read(fd, buf + got, len - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            kv_fail(err, "codec: cannot read %s: %s", path, r ? strerror(errno) : "short file");
            goto done;
        }
        got += (size_t)r;
    }
    rc = codec_table_parse(t, buf, len, model_id, err);
    if (rc) kv_fail_wrap(err, "%s", path);
done:
    free(buf);
    close(fd);
    return rc;
}

/* ---------------------------------------------------------------- keys before RoPE

 * A table that knows the model's RoPE (n_head > 0, n_rot > 0) codes K before rotation: the
 * encoder turns each key back by its position's angles, the decoder turns it forward again. A
 * rotated channel mixes its pair's two values at an angle that changes with position, so its
 * spread takes in its partner's and, for fast-turning pairs, its own mean as well; before RoPE
 * each channel keeps its own narrower distribution around a fixed centre. (In the numpy study,
 * scripts/ref/codec_study.py, the held-out KL divergence fell by a third at equal bytes.)
 * Rotation mixes a pair's errors: a decoded key element is within the hypot of its pair's
 * bounds (codec_table_error_bound), and an escape is exact before rotation, so exact to f16
 * rounding after. */

/* cos and sin of (pos0 + j) * inv_freq[i], [n_tok][n_rot / 2][2] (kernels/rope.c, as the
 * model's rope op computes them); NULL when out of memory. */
static float *rope_angles_of(const codec_table *t, int n_tok, int32_t pos0) {
    const int half = t->n_rot / 2;
    const rope_table rt = {.n_rot = t->n_rot, .inv_freq = t->inv_freq};
    float *cs = malloc(sizeof(float) * 2 * (size_t)n_tok * (size_t)(half + 1));
    if (!cs) return NULL;
    for (int j = 0; j < n_tok; j++) rope_angles(&rt, (int64_t)pos0 + j, cs + (size_t)j * half * 2);
    return cs;
}

/* Turns the rotated dims of every head of k ([n_tok][n_chan] keys) by the angles of cs: forward
 * (as RoPE does) or back (inverse). */
static void rope_keys(const codec_table *t, const float *cs, float *k, int n_tok, bool inverse) {
    const int half = t->n_rot / 2, hd = t->head_dim;
    for (int j = 0; j < n_tok; j++)
        rope_rotate(k + (size_t)j * t->n_chan, t->n_chan / hd, hd, t->n_rot,
                    cs + (size_t)j * half * 2, inverse);
}

static bool keys_rotated(const codec_table *t) { return t->n_head > 0 && t->n_rot > 0; }

float codec_table_error_bound(const codec_table *t, int level, int layer, int kv, int token,
                              int chan) {
    const codec_shape sh = {.n_layer = t->n_layer, .n_tok = token + 1, .n_chan = t->n_chan};
    const codec_level *lv = &t->levels[level];
    float b = codec_error_bound(&sh, t->scale, lv, layer, kv, token, chan);
    int d = chan % (t->head_dim ? t->head_dim : 1);
    if (kv != 0 || !keys_rotated(t) || d >= t->n_rot) return b;
    float o = codec_error_bound(&sh, t->scale, lv, layer, kv, token, chan ^ 1);
    return sqrtf(b * b + o * o);
}

/* ---------------------------------------------------------------- protected tokens

 * A few tokens take a large share of every later query's attention: the one at position 0 (the
 * attention sink: on SmolLM2 65-85% of the attention of layers 12 and deeper) and, in some
 * layers, "heavy hitters" (on SmolLM2 layers 2-10 give each of a handful of tokens 7-10%). Their
 * error weighs on every query, so they are kept exact (escaped). The sink is known by position;
 * heavy hitters by the attention logit that the model's mean query (codec_table.qdir, averaged
 * over the relative rotations of queries 1..CODEC_QUERY_REACH tokens later) gives each token's
 * key: a token is protected in a layer when its best logit over the heads exceeds the chunk's
 * median by more than the table's margin (a token e^margin times as attended as a typical one).
 * Choosing needs only the keys and the table, so encoder and calibration choose alike, and the
 * decoder needs no list: the escapes say it all. */

typedef struct protect_ctx {
    const codec_table *t;
    int n_tok;
    int32_t pos0;
    float *cs;     /* [n_tok][n_rot / 2][2]: cos and sin of (pos0 + t) * inv_freq */
    float *dir;    /* [n_head][head_dim]: a layer's qdir turned to one token's position */
    float *score;  /* [n_tok] */
    float *sorted; /* [n_tok] */
} protect_ctx;

static void protect_free(protect_ctx *pc) {
    free(pc->cs);
    free(pc->dir);
    free(pc->score);
    free(pc->sorted);
    memset(pc, 0, sizeof *pc);
}

/* pc->cs is also what rope_keys turns keys by (NULL when the table knows no RoPE). */
static int protect_init(protect_ctx *pc, const codec_table *t, int n_tok, int32_t pos0,
                        kv_error *err) {
    memset(pc, 0, sizeof *pc);
    pc->t = t;
    pc->n_tok = n_tok;
    pc->pos0 = pos0;
    if (!t->n_head) return 0;
    pc->cs = rope_angles_of(t, n_tok, pos0);
    if (t->margin > 0) {
        pc->dir = malloc(sizeof(float) * (size_t)t->n_head * (size_t)t->head_dim);
        pc->score = malloc(sizeof(float) * (size_t)n_tok);
        pc->sorted = malloc(sizeof(float) * (size_t)n_tok);
    }
    if (!pc->cs || (t->margin > 0 && (!pc->dir || !pc->score || !pc->sorted))) {
        protect_free(pc);
        return kv_fail(err, "codec: out of memory");
    }
    return 0;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* mask[0..n_tok) for layer l, whose K rows are k [n_tok][n_chan] (rotated at pos0 + t). */
static void protect_layer(protect_ctx *pc, int l, const float *k, uint8_t *mask) {
    const codec_table *t = pc->t;
    const int n_tok = pc->n_tok;
    memset(mask, 0, (size_t)n_tok);
    if (pc->pos0 == 0) mask[0] = 1;
    if (!t->n_head || !(t->margin > 0)) return;
    const int hd = t->head_dim, group = t->n_head / (t->n_chan / hd), half = t->n_rot / 2;
    const size_t n_dir = (size_t)t->n_head * (size_t)hd;
    const float *dir = t->qdir + (size_t)l * n_dir;
    int n_finite = 0;
    for (int j = 0; j < n_tok; j++) {
        /* the directions rotated to the key's position: (R(phi) a) . k_rotated */
        memcpy(pc->dir, dir, n_dir * sizeof *dir);
        rope_rotate(pc->dir, t->n_head, hd, t->n_rot, pc->cs + (size_t)j * half * 2, false);
        float best = -INFINITY;
        for (int h = 0; h < t->n_head; h++) {
            const float *a = pc->dir + (size_t)h * hd;
            const float *kr = k + (size_t)j * t->n_chan + (size_t)(h / group) * hd;
            float sum = 0;
            for (int i = 0; i < half; i++)
                sum += a[2 * i] * kr[2 * i] + a[2 * i + 1] * kr[2 * i + 1];
            for (int d = 2 * half; d < hd; d++) sum += a[d] * kr[d];
            if (sum > best) best = sum;
        }
        pc->score[j] = best;
        if (isfinite(best)) pc->sorted[n_finite++] = best;
    }
    if (!n_finite) return;
    qsort(pc->sorted, (size_t)n_finite, sizeof(float), cmp_float);
    const float limit = pc->sorted[n_finite / 2] + t->margin;
    for (int j = 0; j < n_tok; j++)
        if (pc->score[j] > limit) mask[j] = 1;
}

int codec_table_set_attention(codec_table *t, int n_head, int head_dim, int n_rot,
                              const float *inv_freq, const float *qmean, float margin,
                              kv_error *err) {
    if (table_ready(t, err)) return -1;
    if (n_head < 1 || head_dim < 1 || n_rot < 0 ||
        check_attention_shape(t->n_chan, (uint32_t)n_head, (uint32_t)head_dim, (uint32_t)n_rot,
                              err))
        return kv_fail(err, "codec: attention shape %d x %d (%d rotated) does not fit %d channels",
                       n_head, head_dim, n_rot, t->n_chan);
    if (!(margin >= 0) || !isfinite(margin))
        return kv_fail(err, "codec: margin %g must be finite and not negative", margin);
    const int half = n_rot / 2;
    for (int i = 0; i < half; i++)
        if (!(inv_freq[i] >= 0) || !isfinite(inv_freq[i]))
            return kv_fail(err, "codec: RoPE frequency %d is %g", i, inv_freq[i]);
    size_t n_dir = (size_t)t->n_layer * (size_t)n_head * (size_t)head_dim;
    for (size_t i = 0; i < n_dir; i++)
        if (!isfinite(qmean[i])) return kv_fail(err, "codec: mean query %zu is not finite", i);
    if (attention_alloc(t, n_head, head_dim, n_rot, err)) return -1;
    t->margin = margin;
    memcpy(t->inv_freq, inv_freq, sizeof(float) * (size_t)half);
    const double inv_sqrt = 1.0 / sqrt((double)head_dim);
    for (size_t h = 0; h < (size_t)t->n_layer * (size_t)n_head; h++) {
        const float *q = qmean + h * (size_t)head_dim;
        float *a = t->qdir + h * (size_t)head_dim;
        for (int i = 0; i < half; i++) { /* E[R(delta * theta_i)] over delta = 1..reach */
            double c = 0, sn = 0;
            for (int d = 1; d <= CODEC_QUERY_REACH; d++) {
                c += cos((double)d * inv_freq[i]);
                sn += sin((double)d * inv_freq[i]);
            }
            c /= CODEC_QUERY_REACH;
            sn /= CODEC_QUERY_REACH;
            a[2 * i] = (float)((c * q[2 * i] - sn * q[2 * i + 1]) * inv_sqrt);
            a[2 * i + 1] = (float)((sn * q[2 * i] + c * q[2 * i + 1]) * inv_sqrt);
        }
        for (int d = 2 * half; d < head_dim; d++) a[d] = (float)(q[d] * inv_sqrt);
    }
    return table_emit(t, NULL, t->id, err);
}

/* ---------------------------------------------------------------- calibration */

/* Each channel's mean (its centre) and step unit (codec.h, codec_table_calibrate) over every
 * chunk and token. Sums are taken around the channel's first value (in double) to avoid
 * cancellation; the standard deviation is floored at 1e-6 (1 + mean |x|) so a constant channel
 * still gets a usable step. */
static int calibrate_scales(codec_table *t, const float *x, int n_chunks, int n_tok,
                            const float *weight, kv_error *err) {
    const int nl = t->n_layer, nc = t->n_chan;
    const size_t layer_elems = (size_t)2 * (size_t)n_tok * (size_t)nc;
    const size_t chunk_elems = (size_t)nl * layer_elems;
    double *acc = malloc((size_t)nc * 4 * sizeof *acc);
    if (!acc) return kv_fail(err, "codec: out of memory");
    double *sum = acc, *sq = acc + nc, *abs_sum = acc + 2 * (size_t)nc, *sd = acc + 3 * (size_t)nc;
    const double n = (double)n_chunks * (double)n_tok;
    for (int l = 0; l < nl; l++)
        for (int kv = 0; kv < 2; kv++) {
            const size_t off = (size_t)l * layer_elems + (size_t)kv * (size_t)n_tok * nc;
            const size_t at = ((size_t)l * 2 + kv) * nc;
            const float *ref = x + off; /* chunk 0, token 0 */
            memset(acc, 0, (size_t)nc * 3 * sizeof *acc);
            for (int k = 0; k < n_chunks; k++)
                for (int tok = 0; tok < n_tok; tok++) {
                    const float *row = x + (size_t)k * chunk_elems + off + (size_t)tok * nc;
                    for (int c = 0; c < nc; c++) {
                        double d = (double)row[c] - (double)ref[c];
                        sum[c] += d;
                        sq[c] += d * d;
                        abs_sum[c] += fabs((double)row[c]);
                    }
                }
            double log_g = 0;
            for (int c = 0; c < nc; c++) {
                double mean = sum[c] / n, var = sq[c] / n - mean * mean;
                double floor = 1e-6 * (1 + abs_sum[c] / n);
                sd[c] = sqrt(var > 0 ? var : 0);
                if (sd[c] < floor) sd[c] = floor;
                t->center[at + c] = (float)((double)ref[c] + mean);
                if (weight) {
                    double w = weight[at + c];
                    if (!(w > 0) || !isfinite(w)) {
                        free(acc);
                        return kv_fail(err,
                                       "codec: calibration: layer %d %c channel %d has weight %g",
                                       l, kv ? 'V' : 'K', c, w);
                    }
                    log_g += log(sd[c] * sqrt(w));
                }
            }
            double g = exp(log_g / nc);
            for (int c = 0; c < nc; c++) {
                double u = weight ? g / sqrt((double)weight[at + c]) : sd[c];
                float s = (float)u;
                if (!(s > 0) || !isfinite(s) || !isfinite(t->center[at + c])) {
                    free(acc);
                    return kv_fail(err,
                                   "codec: calibration: layer %d %c channel %d has non-finite "
                                   "values",
                                   l, kv ? 'V' : 'K', c);
                }
                t->scale[at + c] = s;
            }
        }
    free(acc);
    return 0;
}

int codec_table_calibrate(codec_table *t, const float *x, int n_chunks, int n_tok,
                          const float *weight, kv_error *err) {
    if (table_ready(t, err)) return -1;
    if (!x || n_chunks < 1 || n_tok < 1 || n_tok > CODEC_MAX_TOKENS)
        return kv_fail(err, "codec: calibration needs chunks (%d) of 1..%d tokens (%d)", n_chunks,
                       CODEC_MAX_TOKENS, n_tok);
    const int nl = t->n_layer, nc = t->n_chan;
    const size_t layer_elems = (size_t)2 * (size_t)n_tok * (size_t)nc;
    size_t total;
    if (size_mul(layer_elems * (size_t)nl, (size_t)n_chunks, &total) ||
        (int64_t)n_chunks * n_tok > INT32_MAX) /* chunk k sits at position k * n_tok */
        return kv_fail(err, "codec: calibration set too large");

    const size_t n_delta_counts = (size_t)2 * (size_t)nc * CODEC_DELTA_SYMBOLS;
    uint64_t *counts = malloc((2 * CODEC_ANCHOR_SYMBOLS + n_delta_counts) * sizeof *counts);
    uint8_t *sym = malloc(layer_elems);
    uint16_t *esc = malloc(layer_elems * sizeof *esc);
    /* the tokens the encoder would keep exact, per chunk and layer (the same at every level) */
    uint8_t *masks = malloc((size_t)n_chunks * (size_t)nl * (size_t)n_tok);
    /* the set as the coder sees it: keys before RoPE when the table knows it */
    float *pre = keys_rotated(t) ? malloc(total * sizeof *pre) : NULL;
    int rc = -1;
    if (!counts || !sym || !esc || !masks || (keys_rotated(t) && !pre)) {
        kv_fail(err, "codec: out of memory calibrating");
        goto done;
    }
    if (pre) memcpy(pre, x, total * sizeof *pre);
    for (int k = 0; k < n_chunks; k++) {
        protect_ctx pc;
        if (protect_init(&pc, t, n_tok, (int32_t)(k * n_tok), err)) goto done;
        for (int l = 0; l < nl; l++) {
            size_t at = ((size_t)k * (size_t)nl + (size_t)l) * layer_elems;
            protect_layer(&pc, l, x + at, masks + ((size_t)k * nl + l) * n_tok);
            if (pre) rope_keys(t, pc.cs, pre + at, n_tok, true);
        }
        protect_free(&pc);
    }
    if (pre) x = pre;
    if (calibrate_scales(t, x, n_chunks, n_tok, weight, err)) goto done;
    uint64_t *anchor_counts = counts, *delta_counts = counts + 2 * CODEC_ANCHOR_SYMBOLS;
    const codec_shape sh = {.n_layer = 1, .n_tok = n_tok, .n_chan = nc};
    for (int v = 0; v < t->n_levels; v++)
        for (int l = 0; l < nl; l++) {
            codec_level one;
            layer_level(&t->levels[v], l, &one);
            memset(counts, 0, (2 * CODEC_ANCHOR_SYMBOLS + n_delta_counts) * sizeof *counts);
            for (int k = 0; k < n_chunks; k++) {
                const float *xl = x + ((size_t)k * (size_t)nl + (size_t)l) * layer_elems;
                if (codec_quantize(
                        xl, &sh, t->scale + (size_t)l * 2 * nc, t->center + (size_t)l * 2 * nc,
                        &one, masks + ((size_t)k * nl + l) * n_tok, sym, esc, layer_elems, err) < 0)
                    goto done;
                const uint8_t *s = sym;
                for (int kv = 0; kv < 2; kv++)
                    for (int tok = 0; tok < n_tok; tok++, s += nc) {
                        if (codec_is_anchor(tok, one.group)) {
                            uint64_t *a = anchor_counts + kv * CODEC_ANCHOR_SYMBOLS;
                            for (int c = 0; c < nc; c++) a[s[c]]++;
                        } else {
                            uint64_t *d = delta_counts + (size_t)kv * nc * CODEC_DELTA_SYMBOLS;
                            for (int c = 0; c < nc; c++)
                                d[(size_t)c * CODEC_DELTA_SYMBOLS + s[c]]++;
                        }
                    }
            }
            rans_model *m = codec_table_layer_models(t, v, l);
            for (int kv = 0; kv < 2; kv++)
                if (rans_model_build(&m[kv], anchor_counts + kv * CODEC_ANCHOR_SYMBOLS,
                                     CODEC_ANCHOR_SYMBOLS, err))
                    goto done;
            for (size_t i = 0; i < 2 * (size_t)nc; i++)
                if (rans_model_build(&m[2 + i], delta_counts + i * CODEC_DELTA_SYMBOLS,
                                     CODEC_DELTA_SYMBOLS, err))
                    goto done;
        }
    rc = table_emit(t, NULL, t->id, err);
done:
    free(pre);
    free(masks);
    free(counts);
    free(sym);
    free(esc);
    return rc;
}

/* ---------------------------------------------------------------- encoder */

static size_t layer_table_end(int n_layer) {
    return CODEC_STREAM_HEADER + STREAM_LAYER_ENTRY * (size_t)n_layer;
}

size_t codec_encode_bound(const codec_table *t, int n_tok) {
    if (table_ready(t, NULL) || n_tok < 1 || n_tok > CODEC_MAX_TOKENS) return 0;
    /* Within the limits: 2^29 symbols a layer, 2^37 bytes at most in all. */
    size_t e = (size_t)2 * (size_t)n_tok * (size_t)t->n_chan;
    size_t per_layer = 2 * e + rans_encode_bound(e);
    return layer_table_end(t->n_layer) + (size_t)t->n_layer * per_layer;
}

/* SHA-256 of a bitstream's bytes except its checksum field (codec.h). */
static int stream_digest(const uint8_t *buf, size_t len, uint8_t out[SHA_BYTES], kv_error *err) {
    return kv_sha256_2(buf, STREAM_CHECKSUM_AT, buf + CODEC_STREAM_HEADER,
                       len - CODEC_STREAM_HEADER, out) == 0
               ? 0
               : kv_fail(err, "codec: SHA-256 failed");
}

int64_t codec_encode_chunk(const codec_table *t, int level, const float *x, int n_tok, int32_t pos0,
                           uint8_t *out, size_t cap, kv_error *err) {
    if (table_ready(t, err)) return -1;
    if (level < 0 || level >= t->n_levels)
        return kv_fail(err, "codec: level %d outside the table's 0..%d", level, t->n_levels - 1);
    if (!x || !out || n_tok < 1 || n_tok > CODEC_MAX_TOKENS)
        return kv_fail(err, "codec: encode needs 1..%d tokens (%d)", CODEC_MAX_TOKENS, n_tok);
    if (pos0 < 0 || (int64_t)pos0 + n_tok - 1 > INT32_MAX)
        return kv_fail(err, "codec: chunk position %d + %d tokens out of range", pos0, n_tok);
    const int nl = t->n_layer, nc = t->n_chan;
    const codec_level *lv = &t->levels[level];
    const size_t e = (size_t)2 * (size_t)n_tok * (size_t)nc;
    size_t pos = layer_table_end(nl);
    if (cap < pos) return kv_fail(err, "codec: output capacity %zu below the header's", cap);
    if (cap > (size_t)INT64_MAX) cap = (size_t)INT64_MAX;

    uint8_t *sym = malloc(e), *mask = malloc((size_t)n_tok);
    uint16_t *esc = malloc(e * sizeof *esc);
    uint32_t *ctx = build_ctx(n_tok, nc, lv->group);
    float *pre = keys_rotated(t) ? malloc(e * sizeof *pre) : NULL; /* a layer, K before RoPE */
    protect_ctx pc = {0};
    int64_t rc = -1;
    if (!sym || !mask || !esc || !ctx || (keys_rotated(t) && !pre)) {
        kv_fail(err, "codec: out of memory encoding");
        goto done;
    }
    if (protect_init(&pc, t, n_tok, pos0, err)) goto done;
    const codec_shape sh = {.n_layer = 1, .n_tok = n_tok, .n_chan = nc};
    for (int l = 0; l < nl; l++) {
        codec_level one;
        layer_level(lv, l, &one);
        const float *xl = x + (size_t)l * e;
        protect_layer(&pc, l, xl, mask);
        if (pre) {
            memcpy(pre, xl, e * sizeof *pre);
            rope_keys(t, pc.cs, pre, n_tok, true);
            /* turning a pair can lift one value past f16's range, which an escape cannot hold */
            for (size_t i = 0; i < (size_t)n_tok * (size_t)nc; i++)
                if (fabsf(pre[i]) > 65504.0f) {
                    kv_fail(err, "codec: encode layer %d: a key is beyond f16 range before RoPE",
                            l);
                    goto done;
                }
            xl = pre;
        }
        int64_t n_esc =
            codec_quantize(xl, &sh, t->scale + (size_t)l * 2 * nc, t->center + (size_t)l * 2 * nc,
                           &one, mask, sym, esc, e, err);
        if (n_esc < 0) {
            kv_fail_wrap(err, "codec: encode layer %d", l);
            goto done;
        }
        if ((cap - pos) / 2 < (size_t)n_esc) {
            kv_fail(err, "codec: output capacity %zu too small (use codec_encode_bound)", cap);
            goto done;
        }
        for (int64_t i = 0; i < n_esc; i++) le_put_u16(out + pos + 2 * (size_t)i, esc[i]);
        pos += 2 * (size_t)n_esc;
        int64_t n_bytes = rans_encode(sym, ctx, e, codec_table_layer_models(t, level, l),
                                      CODEC_LAYER_MODELS(nc), out + pos, cap - pos, err);
        if (n_bytes < 0) {
            kv_fail_wrap(err, "codec: encode layer %d", l);
            goto done;
        }
        uint8_t *entry = out + CODEC_STREAM_HEADER + STREAM_LAYER_ENTRY * (size_t)l;
        le_put_u32(entry, (uint32_t)n_esc);
        le_put_u32(entry + 4, (uint32_t)n_bytes);
        pos += (size_t)n_bytes;
    }
    memcpy(out, "KVCG", 4);
    le_put_u16(out + 4, CODEC_STREAM_VERSION);
    le_put_u16(out + 6, (uint16_t)level);
    memcpy(out + 8, t->id, 32);
    le_put_u16(out + 40, (uint16_t)nl);
    le_put_u16(out + 42, (uint16_t)nc);
    le_put_u32(out + 44, (uint32_t)n_tok);
    le_put_u32(out + 48, (uint32_t)pos0);
    le_put_u32(out + 52, 0);
    if (stream_digest(out, pos, out + STREAM_CHECKSUM_AT, err)) goto done;
    rc = (int64_t)pos;
done:
    protect_free(&pc);
    free(pre);
    free(sym);
    free(mask);
    free(esc);
    free(ctx);
    return rc;
}

/* ---------------------------------------------------------------- decoder */

/* A bitstream whose header, layer table and checksum have been checked against the table and
 * the buffer: where each layer's escapes and stream lie. */
typedef struct stream_view {
    int level, n_tok;
    int32_t pos0;
    size_t layer_elems; /* symbols per layer: 2 * n_tok * n_chan */
    size_t max_esc;     /* the most escapes any layer has */
    size_t esc_at[CODEC_MAX_LAYERS], rans_at[CODEC_MAX_LAYERS];
    uint32_t n_esc[CODEC_MAX_LAYERS], rans_len[CODEC_MAX_LAYERS];
} stream_view;

static int stream_open(const codec_table *t, const uint8_t *in, size_t len, stream_view *v,
                       kv_error *err) {
    if (table_ready(t, err)) return -1;
    if (!in || len < CODEC_STREAM_HEADER)
        return kv_fail(err, "codec: bitstream truncated (%zu bytes)", len);
    if (memcmp(in, "KVCG", 4) != 0) return kv_fail(err, "codec: not a KV bitstream (bad magic)");
    if (le_get_u16(in + 4) != CODEC_STREAM_VERSION)
        return kv_fail(err, "codec: bitstream version %u not supported (want %d)",
                       le_get_u16(in + 4), CODEC_STREAM_VERSION);
    /* The checksum first: past it every field is what the encoder wrote, so the checks below
     * name real mismatches (another table, another shape) rather than corruption. */
    uint8_t sum[SHA_BYTES];
    if (stream_digest(in, len, sum, err)) return -1;
    if (memcmp(sum, in + STREAM_CHECKSUM_AT, SHA_BYTES) != 0)
        return kv_fail(err, "codec: bitstream checksum mismatch (corrupt or truncated)");
    if (memcmp(in + 8, t->id, 32) != 0)
        return kv_fail(err, "codec: bitstream was encoded with another codec table");
    int level = le_get_u16(in + 6), nl = le_get_u16(in + 40), nc = le_get_u16(in + 42);
    uint32_t n_tok = le_get_u32(in + 44), pos0 = le_get_u32(in + 48);
    if (level >= t->n_levels)
        return kv_fail(err, "codec: bitstream level %d outside the table's %d", level, t->n_levels);
    if (nl != t->n_layer || nc != t->n_chan)
        return kv_fail(err, "codec: bitstream shape %d layers x %d channels, table has %d x %d", nl,
                       nc, t->n_layer, t->n_chan);
    if (n_tok < 1 || n_tok > CODEC_MAX_TOKENS || pos0 > (uint32_t)INT32_MAX ||
        (uint64_t)pos0 + n_tok - 1 > (uint64_t)INT32_MAX || le_get_u32(in + 52) != 0)
        return kv_fail(err, "codec: bitstream header out of range (%u tokens at %u)", n_tok, pos0);
    size_t pos = layer_table_end(nl);
    if (len < pos) return kv_fail(err, "codec: bitstream truncated in its layer table");
    v->level = level;
    v->n_tok = (int)n_tok;
    v->pos0 = (int32_t)pos0;
    v->layer_elems = (size_t)2 * n_tok * (size_t)nc;
    v->max_esc = 0;
    for (int l = 0; l < nl; l++) {
        const uint8_t *entry = in + CODEC_STREAM_HEADER + STREAM_LAYER_ENTRY * (size_t)l;
        uint32_t n_esc = le_get_u32(entry), n_bytes = le_get_u32(entry + 4);
        if (n_esc > v->layer_elems || n_bytes < RANS_STATE_BYTES)
            return kv_fail(err, "codec: layer %d: %u escapes and %u stream bytes out of range", l,
                           n_esc, n_bytes);
        size_t need = 2 * (size_t)n_esc + n_bytes;
        if (need > len - pos)
            return kv_fail(err, "codec: layer %d runs past the bitstream's %zu bytes", l, len);
        v->n_esc[l] = n_esc;
        v->rans_len[l] = n_bytes;
        v->esc_at[l] = pos;
        v->rans_at[l] = pos + 2 * (size_t)n_esc;
        if (n_esc > v->max_esc) v->max_esc = n_esc;
        pos += need;
    }
    if (pos != len)
        return kv_fail(err, "codec: %zu bytes after the last layer of the bitstream", len - pos);
    return 0;
}

int codec_stream_info_get(const codec_table *t, const uint8_t *in, size_t len,
                          codec_stream_info *info, kv_error *err) {
    stream_view *v = malloc(sizeof *v);
    if (!v) return kv_fail(err, "codec: out of memory");
    int rc = stream_open(t, in, len, v, err);
    if (!rc) *info = (codec_stream_info){.level = v->level, .n_tok = v->n_tok, .pos0 = v->pos0};
    free(v);
    return rc;
}

/* What every decoding thread shares: layers are taken from next until none are left or one
 * fails. */
typedef struct decode_job {
    const codec_table *t;
    const stream_view *v;
    const uint8_t *in;
    const uint32_t *ctx; /* [2][n_tok][n_chan], shared read-only */
    const float *cs;     /* RoPE angles of the chunk's positions (NULL: keys coded as they are) */
    float *x;
    atomic_int next;
    atomic_int failed;
} decode_job;

/* One thread's scratch, allocated once per call, and its first error. */
typedef struct decode_worker {
    decode_job *job;
    uint8_t *sym;  /* [layer_elems] */
    uint16_t *esc; /* [max_esc] */
    int fail_layer;
    kv_error err;
    pthread_t thread;
} decode_worker;

static int decode_layer(decode_job *j, int l, uint8_t *sym, uint16_t *esc, kv_error *err) {
    const codec_table *t = j->t;
    const stream_view *v = j->v;
    const int nc = t->n_chan;
    if (rans_decode(j->in + v->rans_at[l], v->rans_len[l], j->ctx, v->layer_elems,
                    codec_table_layer_models(t, v->level, l), CODEC_LAYER_MODELS(nc), sym, err))
        return -1;
    const uint8_t *e = j->in + v->esc_at[l];
    for (uint32_t i = 0; i < v->n_esc[l]; i++) esc[i] = le_get_u16(e + 2 * (size_t)i);
    codec_level one;
    layer_level(&t->levels[v->level], l, &one);
    const codec_shape sh = {.n_layer = 1, .n_tok = v->n_tok, .n_chan = nc};
    float *xl = j->x + (size_t)l * v->layer_elems;
    if (codec_dequantize(sym, esc, v->n_esc[l], &sh, t->scale + (size_t)l * 2 * nc,
                         t->center + (size_t)l * 2 * nc, &one, xl, err))
        return -1;
    if (j->cs) rope_keys(t, j->cs, xl, v->n_tok, false);
    return 0;
}

static void *decode_worker_run(void *arg) {
    decode_worker *w = arg;
    decode_job *j = w->job;
    while (!atomic_load_explicit(&j->failed, memory_order_relaxed)) {
        int l = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (l >= j->t->n_layer) break;
        if (decode_layer(j, l, w->sym, w->esc, &w->err)) {
            w->fail_layer = l;
            atomic_store_explicit(&j->failed, 1, memory_order_relaxed);
            break;
        }
    }
    return NULL;
}

int codec_decode_chunk(const codec_table *t, const uint8_t *in, size_t len, float *x, int n_threads,
                       kv_error *err) {
    stream_view *v = malloc(sizeof *v);
    if (!v) return kv_fail(err, "codec: out of memory");
    decode_worker *w = NULL;
    uint32_t *ctx = NULL;
    float *cs = NULL;
    int n_w = 0, want = 0, rc = -1;
    if (stream_open(t, in, len, v, err)) goto done;
    if (!x) {
        kv_fail(err, "codec: decode needs an output buffer");
        goto done;
    }
    ctx = build_ctx(v->n_tok, t->n_chan, t->levels[v->level].group);
    want = n_threads < 1 ? 1 : n_threads > t->n_layer ? t->n_layer : n_threads;
    w = calloc((size_t)want, sizeof *w);
    if (keys_rotated(t)) cs = rope_angles_of(t, v->n_tok, v->pos0);
    if (!ctx || !w || (keys_rotated(t) && !cs)) {
        kv_fail(err, "codec: out of memory decoding");
        goto done;
    }
    decode_job job = {.t = t, .v = v, .in = in, .ctx = ctx, .cs = cs, .x = x};
    atomic_init(&job.next, 0);
    atomic_init(&job.failed, 0);
    /* Worker 0 is this thread. Helpers that cannot get scratch or a thread are simply not
     * started: the others take their layers. */
    for (n_w = 0; n_w < want; n_w++) {
        w[n_w].job = &job;
        w[n_w].fail_layer = -1;
        w[n_w].sym = malloc(v->layer_elems);
        w[n_w].esc = malloc((v->max_esc ? v->max_esc : 1) * sizeof *w[n_w].esc);
        if (!w[n_w].sym || !w[n_w].esc) break;
        if (n_w > 0 && pthread_create(&w[n_w].thread, NULL, decode_worker_run, &w[n_w]) != 0) break;
    }
    if (n_w == 0) {
        kv_fail(err, "codec: out of memory decoding");
        goto done;
    }
    decode_worker_run(&w[0]);
    for (int i = 1; i < n_w; i++) pthread_join(w[i].thread, NULL);
    /* Report the first failing layer (the one a single thread would have stopped at). */
    int first = -1;
    for (int i = 0; i < n_w; i++)
        if (w[i].fail_layer >= 0 && (first < 0 || w[i].fail_layer < w[first].fail_layer)) first = i;
    if (first >= 0) {
        if (err) *err = w[first].err;
        kv_fail_wrap(err, "codec: decode layer %d", w[first].fail_layer);
        goto done;
    }
    rc = 0;
done:
    if (w) /* the worker that failed to start may hold scratch too */
        for (int i = 0; i < want && i <= n_w; i++) {
            free(w[i].sym);
            free(w[i].esc);
        }
    free(w);
    free(ctx);
    free(cs);
    free(v);
    return rc;
}
