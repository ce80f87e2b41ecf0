/* cache/store/content_disk.c: content records on disk. Round trip through a reopen (the
 * index rebuilt from the headers), layer-by-layer reads that find a damaged layer where it breaks
 * (the layers before it read fine), torn, stray and foreign files at open, the byte cap (least
 * recently used first) and clearing by namespace. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/store/content.h"
#include "tests/unit/tmpdir.h"

enum { N_LAYER = 4, KV_DIM = 24 };

static uint8_t MODEL[32];

static content_disk *open_dir(const char *dir, int64_t cap) {
    kv_error err = {{0}};
    content_disk *d = content_disk_open(dir, MODEL, N_LAYER, KV_DIM, cap, &err);
    cr_assert_not_null(d, "%s", err.msg);
    return d;
}

/* A record of n tokens whose every f16 value is a function of (seed, index). */
static content_rec *make_rec(int n, int seed, uint8_t ns_byte, int32_t pos0) {
    cache_key key = {{0}}, ns = {{0}};
    key.b[0] = (uint8_t)seed;
    key.b[1] = (uint8_t)n;
    key.b[31] = 0x5a;
    ns.b[0] = ns_byte;
    content_rec *r = content_rec_create(N_LAYER, KV_DIM, n, &key, &ns, pos0);
    cr_assert_not_null(r);
    size_t count = r->bytes / sizeof(uint16_t);
    for (size_t i = 0; i < count; i++) r->data[i] = (uint16_t)(seed * 7919 + i * 31);
    return r;
}

/* Reads every layer of key's record from d; returns the filled record or NULL on a miss. */
static content_rec *read_all(content_disk *d, const content_rec *like) {
    content_rec *r = content_disk_get(d, &like->key, like->n_tok);
    if (!r) return NULL;
    cr_assert_eq(r->pos0, like->pos0);
    for (int l = 0; l < N_LAYER; l++) cr_assert_eq(content_rec_read_layer(r, l), 0, "layer %d", l);
    cr_assert(content_rec_complete(r));
    return r;
}

static char *record_path(const char *dir, const content_rec *r) {
    char hex[2 * CACHE_KEY_BYTES + 1], *p;
    cache_key_hex(&r->key, hex);
    cr_assert_geq(asprintf(&p, "%s/%s.kvb", dir, hex), 0);
    return p;
}

static size_t header_bytes(void) { return 168 + 32 * N_LAYER; }
static size_t layer_bytes(int n) { return 2 * sizeof(uint16_t) * (size_t)n * KV_DIM; }

Test(content_disk, records_survive_a_reopen_and_read_back_layer_by_layer) {
    char *dir = tmpdir_create("kvserve-cd-");
    content_disk *d = open_dir(dir, 1 << 20);
    content_rec *a = make_rec(17, 1, 0, 100), *b = make_rec(40, 2, 0, 3);
    content_disk_put(d, a);
    content_disk_put(d, b);
    content_disk_put(d, a); /* the same record again: one copy */
    content_disk_flush(d);
    cache_tier_stats st;
    content_disk_stats(d, &st);
    cr_assert_eq(st.entries, 2);
    cr_assert_eq(st.bytes,
                 (int64_t)(2 * header_bytes() + N_LAYER * (layer_bytes(17) + layer_bytes(40))));
    content_disk_close(d);

    d = open_dir(dir, 1 << 20);
    content_disk_stats(d, &st);
    cr_assert_eq(st.entries, 2);
    cr_assert_eq(st.corrupt, 0);
    cr_assert_null(content_disk_get(d, &a->key, 18), "another length is another chunk");
    content_rec *ra = read_all(d, a), *rb = read_all(d, b);
    cr_assert_not_null(ra);
    cr_assert_not_null(rb);
    cr_assert_eq(memcmp(ra->data, a->data, a->bytes), 0);
    cr_assert_eq(memcmp(rb->data, b->data, b->bytes), 0);
    /* settled, it can be shared like a record computed in memory */
    content_rec_settle(ra);
    cr_assert_null(ra->src);
    content_rec_unref(ra);
    content_rec_unref(rb);
    content_rec_unref(a);
    content_rec_unref(b);
    content_disk_close(d);
    free(dir);
}

Test(content_disk, a_damaged_layer_fails_where_it_breaks_and_the_record_goes) {
    char *dir = tmpdir_create("kvserve-cd-");
    content_disk *d = open_dir(dir, 1 << 20);
    content_rec *a = make_rec(33, 3, 0, 0);
    content_disk_put(d, a);
    content_disk_flush(d);
    char *path = record_path(dir, a);
    /* one bit of layer 2's V rows */
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    long off = (long)(header_bytes() + 2 * layer_bytes(33) + layer_bytes(33) / 2 + 5);
    fseek(f, off, SEEK_SET);
    int c = fgetc(f);
    fseek(f, off, SEEK_SET);
    fputc(c ^ 0x10, f);
    fclose(f);

    content_rec *r = content_disk_get(d, &a->key, 33);
    cr_assert_not_null(r);
    cr_assert_eq(content_rec_read_layer(r, 0), 0);
    cr_assert_eq(content_rec_read_layer(r, 1), 0);
    cr_assert_eq(memcmp(content_rec_rows(r, 1, 0), content_rec_rows(a, 1, 0), layer_bytes(33)), 0);
    cr_assert_eq(content_rec_read_layer(r, 2), -1);
    cr_assert(content_rec_failed(r));
    cr_assert_not(content_rec_complete(r));
    cr_assert_eq(content_rec_read_layer(r, 3), -1, "a failed record stays failed");
    cache_tier_stats st;
    content_disk_stats(d, &st);
    cr_assert_eq(st.corrupt, 1);
    cr_assert_eq(st.entries, 0);
    cr_assert_neq(access(path, F_OK), 0, "the damaged file is deleted");
    cr_assert_null(content_disk_get(d, &a->key, 33));
    content_rec_unref(r);

    /* a file that vanished after the index was built fails the same way */
    content_disk_put(d, a);
    content_disk_flush(d);
    r = content_disk_get(d, &a->key, 33);
    cr_assert_not_null(r);
    cr_assert_eq(unlink(path), 0);
    cr_assert_eq(content_rec_read_layer(r, 0), -1);
    content_rec_unref(r);
    content_rec_unref(a);
    content_disk_close(d);
    free(path);
    free(dir);
}

Test(content_disk, torn_stray_and_foreign_files_at_open) {
    char *dir = tmpdir_create("kvserve-cd-");
    content_disk *d = open_dir(dir, 1 << 20);
    content_rec *a = make_rec(20, 4, 0, 0), *b = make_rec(21, 5, 0, 0), *c = make_rec(22, 6, 0, 0);
    content_disk_put(d, a);
    content_disk_put(d, b);
    content_disk_put(d, c);
    content_disk_flush(d);
    content_disk_close(d);
    /* a: torn (truncated); b: its header altered (checksum); a stray temporary; a file that is
     * not a record name at all (left alone) */
    char *pa = record_path(dir, a), *pb = record_path(dir, b), *part, *other;
    cr_assert_eq(truncate(pa, (off_t)(header_bytes() + 10)), 0);
    FILE *f = fopen(pb, "r+b");
    fseek(f, 120, SEEK_SET); /* n_tok */
    fputc(99, f);
    fclose(f);
    cr_assert_geq(asprintf(&part, "%s/x.kvb.part", dir), 0);
    cr_assert_geq(asprintf(&other, "%s/README", dir), 0);
    fclose(fopen(part, "w"));
    fclose(fopen(other, "w"));
    d = open_dir(dir, 1 << 20);
    cache_tier_stats st;
    content_disk_stats(d, &st);
    cr_assert_eq(st.entries, 1);
    cr_assert_eq(st.corrupt, 3);
    cr_assert_neq(access(pa, F_OK), 0);
    cr_assert_neq(access(pb, F_OK), 0);
    cr_assert_neq(access(part, F_OK), 0);
    cr_assert_eq(access(other, F_OK), 0, "not ours: left alone");
    content_rec *rc = read_all(d, c);
    cr_assert_not_null(rc);
    content_rec_unref(rc);
    /* another model's directory content is not served: a tier for another model id rejects
     * the record at open */
    content_disk_close(d);
    MODEL[0] ^= 1;
    d = open_dir(dir, 1 << 20);
    content_disk_stats(d, &st);
    cr_assert_eq(st.entries, 0);
    MODEL[0] ^= 1;
    content_disk_close(d);
    content_rec_unref(a);
    content_rec_unref(b);
    content_rec_unref(c);
    free(pa);
    free(pb);
    free(part);
    free(other);
    free(dir);
}

Test(content_disk, the_cap_evicts_least_recently_used_and_clear_takes_a_namespace) {
    char *dir = tmpdir_create("kvserve-cd-");
    int64_t one = (int64_t)(header_bytes() + N_LAYER * layer_bytes(30));
    content_disk *d = open_dir(dir, 3 * one);
    content_rec *r[4];
    for (int i = 0; i < 4; i++) r[i] = make_rec(30, 10 + i, (uint8_t)(i % 2), 0);
    for (int i = 0; i < 3; i++) content_disk_put(d, r[i]);
    content_disk_flush(d);
    /* r0 used: r1 is now the least recently used */
    content_rec *t = content_disk_get(d, &r[0]->key, 30);
    cr_assert_not_null(t);
    content_rec_unref(t);
    content_disk_put(d, r[3]);
    content_disk_flush(d);
    cache_tier_stats st;
    content_disk_stats(d, &st);
    cr_assert_eq(st.entries, 3);
    cr_assert_eq(st.evictions, 1);
    cr_assert_null(content_disk_get(d, &r[1]->key, 30));
    /* namespace 0 holds r0 and r2 */
    cache_key ns = r[0]->ns;
    cr_assert_eq(content_disk_clear(d, &ns), 2);
    cr_assert_null(content_disk_get(d, &r[0]->key, 30));
    t = content_disk_get(d, &r[3]->key, 30);
    cr_assert_not_null(t);
    content_rec_unref(t);
    cr_assert_eq(content_disk_clear(d, NULL), 1);
    content_disk_stats(d, &st);
    cr_assert_eq(st.entries, 0);
    cr_assert_eq(st.bytes, 0);
    for (int i = 0; i < 4; i++) content_rec_unref(r[i]);
    content_disk_close(d);
    free(dir);
}
