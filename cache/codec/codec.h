/* The CacheGen codec (Liu et al., SIGCOMM'24): a chunk's KV to a compact bitstream at a quality
 * level, and back (internal to cache/; see DESIGN.md "KV bitstream").
 *
 * Stages: codec_quant.h turns the chunk into symbols (anchor + delta token groups, or with group
 * 0 every token against its channel's centre; bins per layer and K/V in units of each channel's
 * step unit, which calibration weights by how much an error in the channel costs; keys before
 * RoPE when the table knows it); a few tokens that take much of every query's attention are kept
 * exact (codec.c, protected tokens); rans.h
 * entropy-codes the symbols with static models profiled once per model: one model per (layer,
 * K/V) for anchor symbols and one per (layer, K/V, channel) for delta symbols. The models,
 * units, centres, protection data and levels form a codec_table,
 * built by codec_table_calibrate from the model's own KV and kept in a versioned file beside the
 * model (codec_table_save / codec_table_load). Encoder and decoder must use the same table: the
 * bitstream names the table's identity, and the decoder refuses any other.
 *
 * Layers are coded independently (each with its own escapes and rANS stream), so a chunk
 * decodes layer by layer on several threads, and a loader can hand layer l to the model while
 * layer l + 1 is still decoding.
 *
 * ---------------------------------------------------------------- bitstream (version 2)
 * All integers little-endian.
 *
 *   offset  size          field
 *   0       4             magic "KVCG"
 *   4       2             version (CODEC_STREAM_VERSION)
 *   6       2             level index into the table's levels
 *   8       32            table identity (codec_table.id: SHA-256 of the table file's contents,
 *                         which include the model identity)
 *   40      2             n_layer
 *   42      2             n_chan (n_kv_head * head_dim)
 *   44      4             n_tok
 *   48      4             pos0: position of the first token (K is given rotated at pos0 + t,
 *                         and coded turned back when the table knows the RoPE)
 *   52      4             reserved, 0
 *   56      32            SHA-256 of every other byte: offsets 0..55, then 88 to the end
 *   88      8 * n_layer   per layer: u32 escape count, u32 rANS stream bytes
 *   ...                   per layer, in order: its escapes (u16 f16 bits each), then its stream
 *
 * Layer l's symbols are codec_quantize's for that layer (K rows then V rows, token-major); the
 * symbol at (kv, t, c) uses the anchor model of (l, kv) when t is an anchor token of the level's
 * group, else the delta model of (l, kv, c) (see codec_table.models). Decoders never trust their
 * input: every count and length is checked against the header and the buffer before use, and the
 * checksum before anything is decoded. (The checksum covers the header too: a flipped bit in pos0
 * or the level would otherwise pass unnoticed.) */
#ifndef KVSERVE_CACHE_CODEC_H
#define KVSERVE_CACHE_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "cache/codec/codec_quant.h"
#include "cache/codec/rans.h"
#include "util/util.h"

#define CODEC_STREAM_VERSION 2
#define CODEC_STREAM_HEADER 88
#define CODEC_MAX_LEVELS 8
/* Limits on what a table or bitstream may declare, so a corrupt header cannot ask for huge
 * allocations: channels per layer (codec_quant's own limit) and tokens per chunk (also the
 * largest token group a level may use). */
#define CODEC_MAX_CHANNELS 4096
#define CODEC_MAX_TOKENS 65536
/* Protected tokens (codec.c) are chosen for queries 1..CODEC_QUERY_REACH tokens after them. */
#define CODEC_QUERY_REACH 1024
/* Models per (level, layer) in codec_table.models: anchor K and V, then delta [2][n_chan]. */
#define CODEC_LAYER_MODELS(n_chan) (2 + 2 * (size_t)(n_chan))

/* Everything encoder and decoder share for one model. */
typedef struct codec_table {
    uint8_t id[32];       /* SHA-256 of the table's file contents (set by init, calibrate,
                             parse and load) */
    uint8_t model_id[32]; /* the model whose KV it was calibrated on */
    int n_layer;
    int n_chan;
    int n_levels;
    codec_level levels[CODEC_MAX_LEVELS]; /* from near-lossless (0) to aggressive */
    float *scale;                         /* [n_layer][2][n_chan] channel step units, each > 0 */
    float *center; /* [n_layer][2][n_chan] channel means: what deltas start from (codec_quant.h) */
    /* How to find the tokens kept exact besides the one at position 0 (codec.c, protected
     * tokens); n_head 0: none. */
    int n_head, head_dim, n_rot; /* query heads, dims per head, RoPE-rotated dims per head */
    float margin;                /* logits above the chunk's median that make a token protected */
    float *inv_freq;             /* [n_rot / 2] RoPE frequencies */
    float *qdir; /* [n_layer][n_head][head_dim] mean query, pre-rotation, averaged over the
                    rotations of the queries that will read a key, over sqrt(head_dim) */
    /* [n_levels][n_layer][CODEC_LAYER_MODELS(n_chan)]: per level and layer the anchor models
     * [2] (K, V), then the delta models [2][n_chan], in one array so that a layer's stream
     * decodes with one rans_decode call (ctx: kv for anchors, 2 + kv * n_chan + c for deltas) */
    rans_model *models;
} codec_table;

static inline rans_model *codec_table_layer_models(const codec_table *t, int level, int layer) {
    return t->models +
           ((size_t)level * (size_t)t->n_layer + (size_t)layer) * CODEC_LAYER_MODELS(t->n_chan);
}

/* Allocates scale and models for a shape and copies the levels (models start uniform, scales
 * at 1). -1 with err on a bad shape (n_layer 1..CODEC_MAX_LAYERS, n_chan 1..CODEC_MAX_CHANNELS)
 * or level (group 1..CODEC_MAX_TOKENS, bins finite and > 0), or out of memory. t is
 * overwritten, not freed; on failure it is left zeroed (codec_table_free accepts it). */
int codec_table_init(codec_table *t, const uint8_t model_id[32], int n_layer, int n_chan,
                     const codec_level *levels, int n_levels, kv_error *err);
void codec_table_free(codec_table *t);

/* Calibration from the model's own KV: x holds n_chunks chunks of shape (n_layer, n_tok,
 * n_chan) back to back, f32 [chunk][layer][kv][token][channel], the first chunk at position 0.
 * Sets each channel's centre to its mean and its step unit (scale) from its standard deviation
 * sd: sd itself when weight is NULL; else, with weight[layer][kv][chan] > 0 the channel's
 * importance (how much a unit of error in it costs downstream: for K the energy of the queries
 * that read it, for V the norm of the output projection's columns that read it), the unit is
 * G / sqrt(weight), G the geometric mean over the (layer, kv)'s channels of sd * sqrt(weight).
 * That spends bits where errors cost (each channel's weighted error is equal: reverse
 * water-filling) at about the bits of equal relative steps. A floor keeps every unit > 0. Then
 * quantizes every chunk at every level and builds each model from the symbol counts
 * (rans_model_build: unseen symbols stay codable), and recomputes t->id. */
int codec_table_calibrate(codec_table *t, const float *x, int n_chunks, int n_tok,
                          const float *weight, kv_error *err);

/* Gives the table what it needs to protect heavy hitters (codec.c): the attention shape (n_head
 * query heads of head_dim dims, n_rot of them rotated, reading n_chan / head_dim KV heads), RoPE's
 * inv_freq[n_rot / 2], each layer's and head's mean query before rotation qmean[n_layer][n_head]
 * [head_dim] and the margin in logits (0: no heavy hitters, only the token at position 0). With
 * n_rot > 0 the table then codes K before RoPE (codec.c). Call before codec_table_calibrate,
 * which counts the escapes the protection makes. Recomputes t->id. */
int codec_table_set_attention(codec_table *t, int n_head, int head_dim, int n_rot,
                              const float *inv_freq, const float *qmean, float margin,
                              kv_error *err);

/* The file beside the model (MODEL.kvcodec): magic "KVCT", version, model identity, shape,
 * levels, scales and model frequencies, SHA-256 of the contents. load checks all of it, and the
 * model identity against model_id, before trusting anything. */
int codec_table_save(const codec_table *t, const char *path, kv_error *err);
int codec_table_load(codec_table *t, const char *path, const uint8_t model_id[32], kv_error *err);
/* The same from and to memory (serialize: malloc'd buffer in *out, *len bytes). parse
 * overwrites t (zeroed on failure). The file (all integers and floats little-endian):
 *   magic "KVCT", u16 version 3, u16 0, model_id[32], u32 n_layer, u32 n_chan, u32 n_levels,
 *   u32 n_head, u32 head_dim, u32 n_rot (all 0: no protection data);
 *   per level: u32 group, f32 anchor_bin[n_layer][2], f32 delta_bin[n_layer][2];
 *   f32 scale[n_layer][2][n_chan]; f32 center[n_layer][2][n_chan];
 *   if n_head: f32 margin, f32 inv_freq[n_rot / 2], f32 qdir[n_layer][n_head][head_dim];
 *   per level: anchor models [n_layer][2], then delta models [n_layer][2][n_chan], each as
 *     u16 n_symbols (CODEC_ANCHOR_SYMBOLS or CODEC_DELTA_SYMBOLS) and u16 freq[n_symbols];
 *   SHA-256 of every preceding byte (the table's id). Nothing may follow. */
int codec_table_serialize(const codec_table *t, uint8_t **out, size_t *len, kv_error *err);
int codec_table_parse(codec_table *t, const uint8_t *buf, size_t len, const uint8_t model_id[32],
                      kv_error *err);

/* How far a decoded element of level may be from the original: codec_error_bound's half bin,
 * except for keys in a table that codes them before RoPE (codec.c), where rotation mixes each
 * rotated pair's errors: the hypot of the pair's two bounds. */
float codec_table_error_bound(const codec_table *t, int level, int layer, int kv, int token,
                              int chan);

/* Bytes enough for any encoding of an n_tok-token chunk under t (0 if n_tok is out of
 * 1..CODEC_MAX_TOKENS). */
size_t codec_encode_bound(const codec_table *t, int n_tok);

/* Encodes x (f32 [layer][kv][token][channel], t's shape; n_tok 1..CODEC_MAX_TOKENS, pos0 >= 0
 * with pos0 + n_tok - 1 <= INT32_MAX) at level into out[0..cap). Returns the bitstream length,
 * or -1 with err. */
int64_t codec_encode_chunk(const codec_table *t, int level, const float *x, int n_tok, int32_t pos0,
                           uint8_t *out, size_t cap, kv_error *err);

/* What a bitstream's header says. codec_stream_info_get checks the header against t, the layer
 * lengths against len and the checksum (so n_tok can be trusted to size x) before it answers. */
typedef struct codec_stream_info {
    int level;
    int n_tok;
    int32_t pos0;
} codec_stream_info;
int codec_stream_info_get(const codec_table *t, const uint8_t *in, size_t len,
                          codec_stream_info *info, kv_error *err);

/* Decodes a bitstream into x (f32 [layer][kv][token][channel], n_tok from the header; the caller
 * sizes x with codec_stream_info_get) using up to n_threads threads (one layer per task; the
 * calling thread is one of them, and n_threads <= 1 decodes on it alone).
 * Every element ends within codec_error_bound of the encoded value. -1 with err on any
 * inconsistency: wrong magic, version, table, shape, lengths, checksum or a corrupt stream
 * (x may then be partly written). */
int codec_decode_chunk(const codec_table *t, const uint8_t *in, size_t len, float *x, int n_threads,
                       kv_error *err);

#endif
