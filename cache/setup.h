/* The context cache's tiers as the configuration asks for them: the disk directory, the codec
 * table the tiers' levels use, the chunk store (RAM, disk, Redis), blend's content records on
 * disk and Prompt Cache's definitions. `kvserve serve` calls these once at start. */
#ifndef KVSERVE_CACHE_SETUP_H
#define KVSERVE_CACHE_SETUP_H

#include "cache/cache.h"
#include "cache/codec/codec.h"
#include "config/config.h"
#include "model/model.h"

typedef struct content_disk content_disk;

/* The disk tier's directory: the configured one, "auto" ($XDG_CACHE_HOME/kvserve, else
 * ~/.cache/kvserve) or none ("off", or "auto" without a home). malloc'd, or NULL. */
char *cache_setup_dir(const kv_config *c);

/* Calibrates t from the model c names (a minute or so): 0, or -1 with err. */
typedef int (*cache_calibrate_fn)(const kv_config *c, codec_table *t, kv_error *err);

/* The codec table the tiers encode their levels with (Redis, an encoded disk or RAM tier;
 * --redis-codec): off: none (lossless and q8 only); a path: that file; auto: MODEL.kvcodec (what
 * `kvserve calibrate` writes), else <cache dir>/<model>/codec.kvcodec, else one calibrate makes
 * now (once: it is saved there). NULL in *out with no table; -1 with err on a table named that
 * cannot be used. */
int cache_setup_codec(const kv_config *c, const model *m, cache_calibrate_fn calibrate,
                      codec_table **out, kv_error *err);

/* The RAM, disk and Redis tiers. An automatic directory that cannot be used costs only the disk
 * tier (a warning); a directory the operator named must work. NULL with err. */
cache_store *cache_setup_store(const kv_config *c, const model *m, const codec_table *codec,
                               kv_error *err);

/* Blend's content records on disk, beside the chunk records of the same model
 * (<cache dir>/<model>/blend), or *out NULL without a disk tier. */
int cache_setup_blend_disk(const kv_config *c, const model *m, content_disk **out, kv_error *err);

/* Where Prompt Cache keeps schema definitions (malloc'd), or NULL without a disk tier. */
char *cache_setup_schema_dir(const kv_config *c, const model *m, cache_store *store);

#endif
