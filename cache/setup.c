/* The context cache's tiers from the configuration (setup.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/setup.h"
#include "cache/store/content.h"

/* The disk tier's directory: the configured one, "auto" ($XDG_CACHE_HOME/kvserve, else
 * ~/.cache/kvserve) or none ("off", or "auto" without a home). malloc'd, or NULL. */
char *cache_setup_dir(const kv_config *c) {
    if (strcmp(c->cache_dir, "off") == 0) return NULL;
    if (strcmp(c->cache_dir, "auto") != 0) return strdup(c->cache_dir);
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char *dir = NULL;
    if (xdg && xdg[0] == '/') {
        if (asprintf(&dir, "%s/kvserve", xdg) < 0) dir = NULL;
    } else if (home && home[0] == '/') {
        if (asprintf(&dir, "%s/.cache/kvserve", home) < 0) dir = NULL;
    }
    return dir;
}

/* Prompt Cache's definitions: beside the disk tier's records (the model's directory under the
 * cache directory), when there is a disk tier. */
char *cache_setup_schema_dir(const kv_config *c, const model *m, cache_store *store) {
    cache_stats st;
    cache_store_stats(store, &st);
    char *base = st.disk_enabled ? cache_setup_dir(c) : NULL, *dir = NULL;
    if (base) {
        char hex[2 * CACHE_KEY_BYTES + 1];
        cache_key_hex((const cache_key *)(const void *)m->identity, hex);
        if (asprintf(&dir, "%s/%.16s/schemas", base, hex) < 0) dir = NULL;
    }
    free(base);
    return dir;
}

/* --cache-ram-encoding's encoding into *enc (the configuration accepts only the names of
 * encodings); -1 with err on one this build does not know. */
static int ram_encoding(const kv_config *c, int *enc, kv_error *err) {
    *enc = cache_enc_parse(c->cache_ram_encoding);
    if (*enc >= 0) return 0;
    return kv_fail(err, "--cache-ram-encoding: no encoding '%s'", c->cache_ram_encoding);
}

/* The codec table the tiers encode their levels with (Redis, an encoded disk or RAM tier;
 * --redis-codec): off: none (lossless and q8 only); a path: that file; auto: MODEL.kvcodec (what
 * `kvserve calibrate` writes), else <cache dir>/<model>/codec.kvcodec, else one calibrated now from
 * text the model writes (about a minute, once: it is saved there). NULL in *out with no table. */
int cache_setup_codec(const kv_config *c, const model *m, cache_calibrate_fn calibrate,
                      codec_table **out, kv_error *err) {
    *out = NULL;
    int ram_enc;
    if (ram_encoding(c, &ram_enc, err)) return -1;
    bool levels = c->redis || c->cache_disk_encoded || ram_enc >= CACHE_ENC_CODEC;
    if (!levels || strcmp(c->redis_codec, "off") == 0) return 0;
    codec_table *t = calloc(1, sizeof *t);
    char *beside = NULL, *dir = NULL, *saved = NULL, *base = cache_setup_dir(c);
    int rc = -1;
    if (!t || asprintf(&beside, "%s.kvcodec", c->model) < 0) {
        beside = NULL;
        kv_fail(err, "out of memory");
        goto done;
    }
    if (strcmp(c->redis_codec, "auto") != 0) {
        if (codec_table_load(t, c->redis_codec, m->identity, err)) {
            kv_fail_wrap(err, "--redis-codec");
            goto done;
        }
        log_info("cache: codec table %s", c->redis_codec);
        rc = 0;
        goto done;
    }
    if (base) {
        char hex[2 * CACHE_KEY_BYTES + 1];
        cache_key_hex((const cache_key *)(const void *)m->identity, hex);
        if (asprintf(&dir, "%s/%.16s", base, hex) < 0) dir = NULL;
        if (!dir || asprintf(&saved, "%s/codec.kvcodec", dir) < 0) {
            saved = NULL;
            kv_fail(err, "out of memory");
            goto done;
        }
    }
    const char *paths[2] = {beside, saved};
    for (int i = 0; i < 2; i++) {
        kv_error lerr = {{0}};
        if (!paths[i] || access(paths[i], F_OK) != 0) continue;
        if (codec_table_load(t, paths[i], m->identity, &lerr) == 0) {
            log_info("cache: codec table %s", paths[i]);
            rc = 0;
            goto done;
        }
        log_warn("cache: codec table %s not used: %s", paths[i], lerr.msg);
    }
    log_info("cache: no codec table for the Redis tier's levels: calibrating one from text the "
             "model writes (once; --redis-codec off skips it)");
    kv_error cerr = {{0}};
    int n_chan = m->hp.n_kv_head * m->hp.head_dim;
    if (m->hp.n_layer > CODEC_MAX_LAYERS || n_chan > CODEC_MAX_CHANNELS)
        kv_fail(&cerr,
                "the codec codes at most %d layers of %d KV channels; the model has %d of %d",
                CODEC_MAX_LAYERS, CODEC_MAX_CHANNELS, m->hp.n_layer, n_chan);
    else
        calibrate(c, t, &cerr);
    if (cerr.msg[0]) { /* the tier works without codec levels: lossless and q8 */
        log_warn("cache: no codec table (%s): the Redis tier stores lossless and q8 only",
                 cerr.msg);
        codec_table_free(t);
        free(t);
        t = NULL;
        rc = 0;
        goto done;
    }
    kv_error serr = {{0}};
    if (saved && kv_mkdir_p(dir, &serr) == 0 && codec_table_save(t, saved, &serr) == 0)
        log_info("cache: codec table saved to %s", saved);
    else
        log_warn("cache: codec table kept in memory only: %s",
                 saved ? serr.msg : "no cache directory");
    rc = 0;
done:
    if (rc == 0) {
        *out = t; /* NULL: none */
    } else if (t) {
        codec_table_free(t);
        free(t);
    }
    free(beside);
    free(dir);
    free(saved);
    free(base);
    return rc;
}

/* The RAM and disk tiers. An automatic directory that cannot be used costs only the disk tier
 * (a warning); a directory the operator named must work. */
cache_store *cache_setup_store(const kv_config *c, const model *m, const codec_table *codec,
                               kv_error *err) {
    cache_layout l = {.n_layer = m->hp.n_layer,
                      .n_kv_head = m->hp.n_kv_head,
                      .head_dim = m->hp.head_dim,
                      .block_tokens = 16,
                      .chunk_tokens = c->cache_chunk_tokens};
    memcpy(l.model_id, m->identity, sizeof l.model_id);
    if (c->cache_chunk_tokens % 16 != 0) {
        kv_fail(err, "--cache-chunk-tokens must be a multiple of 16, got %d",
                c->cache_chunk_tokens);
        return NULL;
    }
    if (c->redis && cache_store_check_redis_url(c->redis, err) != 0) {
        kv_fail_wrap(err, "--redis");
        return NULL;
    }
    int ram_enc;
    if (ram_encoding(c, &ram_enc, err)) return NULL;
    char *dir = cache_setup_dir(c);
    cache_store_opts o = {.ram_bytes = c->cache_ram_bytes,
                          .dir = dir,
                          .disk_bytes = c->cache_disk_bytes,
                          .write_queue = 64,
                          .redis_url = c->redis,
                          .redis_ttl_s = c->redis_ttl,
                          .redis_timeout_ms = c->redis_timeout_ms,
                          .codec = codec,
                          .disk_encoded = c->cache_disk_encoded && dir,
                          .ram_enc = ram_enc,
                          .pin_bytes = c->pin_bytes,
                          .n_tenants = c->n_api_keys,
                          .tenant_pin_share = c->tenant_pin_share};
    cache_store *st = cache_store_open(&l, &o, err);
    if (!st && dir && strcmp(c->cache_dir, "auto") == 0) {
        log_warn("cache: no disk tier: %s", err->msg);
        o.dir = NULL;
        st = cache_store_open(&l, &o, err);
    }
    if (st)
        log_info("cache: chunks of %d tokens (%.1f MiB each); RAM tier %.0f MiB; disk tier %s; "
                 "Redis tier %s",
                 l.chunk_tokens, (double)cache_chunk_bytes(&l) / 1048576.0,
                 (double)c->cache_ram_bytes / 1048576.0, o.dir ? o.dir : "off",
                 c->redis ? "on" : "off");
    free(dir);
    return st;
}

/* Blend's content records on disk, beside the chunk records of the same model
 * (<cache dir>/<model>/blend). Like the disk tier, an automatic directory that cannot be used
 * costs only the disk copy; a directory the operator named must work. */
int cache_setup_blend_disk(const kv_config *c, const model *m, content_disk **out, kv_error *err) {
    *out = NULL;
    char *dir = cache_setup_dir(c);
    if (!dir || c->cache_disk_bytes == 0) {
        free(dir);
        return 0;
    }
    cache_key id;
    char hex[2 * CACHE_KEY_BYTES + 1], *path = NULL;
    memcpy(id.b, m->identity, CACHE_KEY_BYTES);
    cache_key_hex(&id, hex);
    int64_t cap = c->blend_disk_bytes ? c->blend_disk_bytes : c->cache_disk_bytes / 4;
    if (asprintf(&path, "%s/%.16s/blend", dir, hex) < 0) path = NULL;
    free(dir);
    if (!path) return kv_fail(err, "out of memory");
    *out = content_disk_open(path, m->identity, m->hp.n_layer, m->hp.n_kv_head * m->hp.head_dim,
                             cap, err);
    free(path);
    if (*out || strcmp(c->cache_dir, "auto") != 0) return *out ? 0 : -1;
    log_warn("blend: no disk copy: %s", err->msg);
    return 0;
}
