/* The CacheGen codec's table for a model, calibrated from the model's own KV (calibrate.c): by
 * `kvserve calibrate` (server/cli/cli_calibrate.c), and by `kvserve serve` when its Redis tier
 * needs a table and finds none. */
#ifndef KVSERVE_CALIBRATE_H
#define KVSERVE_CALIBRATE_H

#include "cache/codec/codec.h"
#include "server/engine/single.h"

#define CALIB_DEFAULT_TOKENS 2048
#define CALIB_DEFAULT_CHUNK 256

typedef struct calib_opts {
    const char *text_path; /* calibration text, or NULL: text the model writes itself */
    int n_tokens;          /* calibration tokens (at most the model's context) */
    int chunk;             /* tokens per chunk */
    int group;             /* tokens per anchor group; 0: none */
    uint64_t seed;         /* of the self-written text */
    const char *bins;      /* bins per level, comma-separated, in step units */
    bool sd_units;         /* step units: plain standard deviations instead of importance */
    float margin;          /* heavy hitters: logits above a chunk's median (0: position 0 only) */
} calib_opts;

#define CALIB_DEFAULTS                                                                             \
    {                                                                                              \
        .n_tokens = CALIB_DEFAULT_TOKENS, .chunk = CALIB_DEFAULT_CHUNK, .seed = 1,                 \
        .bins = "0.4,0.7,1,1.3", .margin = 4.0f                                                    \
    }

/* Loads the model mo names and calibrates *t (overwritten; zeroed on failure) from its KV; the
 * chunks it calibrated on go to *n_chunks (when not NULL). */
int calibrate_codec_table(const engine_model_opts *mo, const calib_opts *co, codec_table *t,
                          int *n_chunks, kv_error *err);

#endif
