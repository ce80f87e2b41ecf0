/* Prompt Cache's KV through the chunk store (cache/schema/schema.h): module records written from
 * the pool after a precompute, copied into a prompt's slots, or handed to the fusor for the fix-up;
 * and schema definitions kept on disk beside the records. */
#include "cache/schema/schema.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/quant.h"

int schema_kv_import(const schema_kv *k, kv_pool *pool, kv_seq *seq, kv_error *err) {
    if (kv_seq_reserve(pool, seq, k->n_slots, err)) return -1;
    for (int i = 0; i < k->n_rows; i++) {
        const schema_rows *r = &k->rows[i];
        int bt = kv_pool_layout(pool)->block_tokens;
        if (r->src < 0 || r->n < 0 || r->src + r->n > r->rec->n_blocks * bt || r->dst < 0 ||
            r->dst + r->n > k->n_slots) {
            kv_seq_truncate(pool, seq, 0);
            return kv_fail(err, "schema rows %d..%d do not fit their record", r->src,
                           r->src + r->n);
        }
        if (kv_seq_import_rows(pool, seq, r->dst, r->n, r->rec->data, r->src, err)) {
            kv_seq_truncate(pool, seq, 0);
            return -1;
        }
    }
    seq->n_tokens = k->n_slots;
    return 0;
}

int schema_kv_export(const schema_kv *k, cache_store *st, kv_pool *pool, const kv_seq *seq,
                     kv_error *err) {
    const cache_layout *cl = cache_store_layout(st);
    int ct = cl->chunk_tokens, cb = cache_chunk_blocks(cl), bt = cl->block_tokens;
    size_t bb = cache_block_bytes(cl);
    int n_recs = (k->export_blocks + cb - 1) / cb;
    for (int c = 0; c < n_recs; c++) {
        int b0 = c * cb, nb = k->export_blocks - b0 < cb ? k->export_blocks - b0 : cb;
        int t0 = c * ct, nt = k->export_n - t0 < nb * bt ? k->export_n - t0 : nb * bt;
        cache_chunk *rec = cache_chunk_create(cl, k->export_bkeys + b0, nb, &k->export_ns, t0);
        if (!rec) return kv_fail(err, "out of memory for a schema record");
        memset(rec->data, 0, (size_t)nb * bb); /* the last block's unused slots: zeros */
        if (kv_seq_export_rows(pool, seq, k->export_from + t0, nt, rec->data, 0, err)) {
            cache_chunk_unref(rec);
            return -1;
        }
        cache_store_put(st, rec);
        cache_chunk_unref(rec);
    }
    return 0;
}

/* One token row of a record (K or V of a layer) into dst[kvd] f16: K is transposed there. */
static void rec_row(const kv_layout *l, const uint8_t *data, int slot, int layer, int kv,
                    uint16_t *dst) {
    int bt = l->block_tokens, hd = l->head_dim;
    const uint8_t *blk = data + (size_t)(slot / bt) * kv_layout_block_bytes(l);
    int off = slot % bt;
    for (int h = 0; h < l->n_kv_head; h++) {
        const uint16_t *reg =
            (const uint16_t *)(const void *)(blk + kv_layout_offset(l, layer, kv, h));
        for (int d = 0; d < hd; d++)
            dst[h * hd + d] = kv == 0 ? reg[(size_t)d * bt + off] : reg[(size_t)off * hd + d];
    }
}

int schema_kv_blend_spans(const schema_kv *k, const kv_layout *l, blend_span **spans, int *n_spans,
                          kv_error *err) {
    int kvd = l->n_kv_head * l->head_dim;
    blend_span *sp = calloc((size_t)(k->n_rows + 1), sizeof *sp);
    if (!sp) return kv_fail(err, "out of memory");
    for (int i = 0; i < k->n_rows; i++) {
        const schema_rows *r = &k->rows[i];
        cache_key ckey = {{0}};
        content_rec *c = content_rec_create(l->n_layer, kvd, r->n, &ckey, &r->rec->ns, r->src_pos);
        if (!c) {
            for (int j = 0; j < i; j++) content_rec_unref(sp[j].rec);
            free(sp);
            return kv_fail(err, "out of memory");
        }
        for (int il = 0; il < l->n_layer; il++)
            for (int kv = 0; kv < 2; kv++) {
                uint16_t *rows = (uint16_t *)content_rec_rows(c, il, kv);
                for (int t = 0; t < r->n; t++)
                    rec_row(l, r->rec->data, r->src + t, il, kv, rows + (size_t)t * kvd);
            }
        sp[i] = (blend_span){.slot = r->dst, .n = r->n, .off = 0, .rec = c};
    }
    *spans = sp;
    *n_spans = k->n_rows;
    return 0;
}

/* ---------------------------------------------------------------- definitions */

/* File: "kvserve-pml 1\n", the namespace (hex), the source's SHA-256 (hex), the name, one a
 * line, then the source. Named by the SHA-256 of namespace and name. */
static const char DEF_MAGIC[] = "kvserve-pml 1\n";

static void def_file(const cache_key *ns, const char *name, char out[80]) {
    uint8_t h[32] = {0};
    kv_sha256_2(ns->b, CACHE_KEY_BYTES, name, strlen(name), h);
    char hex[65];
    cache_key_hex((const cache_key *)(const void *)h, hex);
    snprintf(out, 80, "%.40s.pml", hex);
}

static void sha_hex(const char *src, size_t len, char hex[65]) {
    cache_key k = {{0}};
    kv_sha256(src, len, k.b);
    cache_key_hex(&k, hex);
}

int schema_def_save(const char *dir, const cache_key *ns, const char *name, const char *src,
                    size_t len, kv_error *err) {
    if (kv_mkdir_p(dir, err)) return -1;
    char file[80], path[4200], tmp[4220], nshex[65], sha[65];
    def_file(ns, name, file);
    snprintf(path, sizeof path, "%s/%s", dir, file);
    snprintf(tmp, sizeof tmp, "%s.part", path);
    cache_key_hex(ns, nshex);
    sha_hex(src, len, sha);
    FILE *f = fopen(tmp, "wb");
    if (!f) return kv_fail(err, "cannot write %s: %s", tmp, strerror(errno));
    bool ok = fprintf(f, "%s%s\n%s\n%s\n", DEF_MAGIC, nshex, sha, name) > 0 &&
              fwrite(src, 1, len, f) == len;
    ok = fflush(f) == 0 && fsync(fileno(f)) == 0 && ok;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return kv_fail(err, "cannot write %s: %s", path, strerror(errno));
    }
    return 0;
}

void schema_def_delete(const char *dir, const cache_key *ns, const char *name) {
    char file[80], path[4200];
    def_file(ns, name, file);
    snprintf(path, sizeof path, "%s/%s", dir, file);
    if (unlink(path) != 0 && errno != ENOENT)
        log_warn("schemas: cannot delete %s: %s", path, strerror(errno));
}

/* Reads and checks one definition file: 0 with its parts (*buf malloc'd holds them), or -1. */
static int def_read(const char *path, char **buf, cache_key *ns, char **name, char **src,
                    size_t *len) {
    kv_error err;
    size_t n;
    char *b = *buf = kv_read_file(path, 64 << 20, &n, &err);
    if (!b) return -1;
    size_t m = strlen(DEF_MAGIC);
    if (n < m + 65 + 65 + 2 || memcmp(b, DEF_MAGIC, m) != 0) return -1;
    char *p = b + m, *nl;
    if (p[64] != '\n') return -1;
    for (int i = 0; i < 32; i++) {
        unsigned v;
        if (sscanf(p + 2 * i, "%2x", &v) != 1) return -1;
        ns->b[i] = (uint8_t)v;
    }
    char *sha = p + 65;
    if (sha[64] != '\n') return -1;
    sha[64] = '\0';
    *name = sha + 65;
    if (!(nl = memchr(*name, '\n', n - (size_t)(*name - b)))) return -1;
    *nl = '\0';
    *src = nl + 1;
    *len = n - (size_t)(*src - b);
    char got[65];
    sha_hex(*src, *len, got);
    return strcmp(got, sha) == 0 && pml_name_ok(*name) ? 0 : -1;
}

void schema_def_load_all(const char *dir, schema_def_fn fn, void *ud) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t nl = strlen(de->d_name);
        if (nl < 5 || strcmp(de->d_name + nl - 4, ".pml") != 0) continue;
        char path[4200], *buf, *name, *src;
        size_t len;
        cache_key ns;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (def_read(path, &buf, &ns, &name, &src, &len) == 0)
            fn(ud, &ns, name, src, len);
        else
            log_warn("schemas: skipping %s: not a valid schema definition", path);
        free(buf);
    }
    closedir(d);
}

char *schema_def_load(const char *dir, const cache_key *ns, const char *name, size_t *len) {
    char file[80], path[4200], *buf, *nm, *src;
    cache_key got;
    def_file(ns, name, file);
    snprintf(path, sizeof path, "%s/%s", dir, file);
    if (def_read(path, &buf, &got, &nm, &src, len) != 0 ||
        memcmp(got.b, ns->b, CACHE_KEY_BYTES) != 0 || strcmp(nm, name) != 0) {
        free(buf);
        return NULL;
    }
    char *out = malloc(*len + 1);
    if (out) {
        memcpy(out, src, *len);
        out[*len] = '\0';
    }
    free(buf);
    return out;
}
