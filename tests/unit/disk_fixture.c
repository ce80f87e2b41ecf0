/* The chunk tier's test helpers (tests/unit/disk_fixture.h). */
#include "tests/unit/disk_fixture.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/unit/chunk_fixture.h"
#include "tests/unit/tmpdir.h"

/* 2 layers, 1 KV head, head_dim 8, blocks of 16, chunks of 32: 2048 payload bytes, 8192-byte
 * files. */
cache_layout small_layout(void) {
    cache_layout l = {
        .n_layer = 2, .n_kv_head = 1, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 32};
    for (int i = 0; i < 32; i++) l.model_id[i] = (uint8_t)(0xA0 + i);
    return l;
}

cache_key make_ns(const char *salt) {
    cache_key ns;
    cache_namespace((const uint8_t *)"tenant", 6, salt, &ns);
    return ns;
}

/* The first n_blocks blocks of chunk i of namespace ns: block keys from tokens i*1000.., a
 * payload from a seed of (i, ns). */
cache_chunk *make_part(const cache_layout *l, const cache_key *ns, int i, int n_blocks) {
    int32_t tokens[128];
    cache_key bkeys[8];
    cr_assert_leq(l->chunk_tokens, 128);
    for (int t = 0; t < l->chunk_tokens; t++) tokens[t] = i * 1000 + t;
    int nb = cache_prefix_keys(l->model_id, ns, tokens, l->chunk_tokens, l->block_tokens, bkeys, 8);
    cr_assert_leq(n_blocks, nb);
    cache_chunk *c = cache_chunk_create(l, bkeys, n_blocks, ns, i * l->chunk_tokens);
    cr_assert_not_null(c);
    chunk_fill(c, 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1) ^ ns->b[0]);
    return c;
}

cache_chunk *make_chunk(const cache_layout *l, const cache_key *ns, int i) {
    return make_part(l, ns, i, cache_chunk_blocks(l));
}

char *make_tmpdir(void) { return tmpdir_create("kvserve-disk-test-"); }

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

void remove_tree(char *dir) {
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(dir);
}

/* dir/<16 hex of the model>[/name] */
void model_path(const char *dir, const cache_layout *l, const char *name, char *out, size_t n) {
    cache_key m;
    memcpy(m.b, l->model_id, 32);
    char hex[65];
    cache_key_hex(&m, hex);
    snprintf(out, n, "%s/%.16s%s%s", dir, hex, name ? "/" : "", name ? name : "");
}

void record_path(const char *dir, const cache_layout *l, const cache_key *k, char *out, size_t n) {
    char hex[65], name[80];
    cache_key_hex(k, hex);
    snprintf(name, sizeof name, "%s.kvc", hex);
    model_path(dir, l, name, out, n);
}

bool file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* Files in the model directory whose names end with suffix. */
int count_files_in(const char *path, const char *suffix) {
    DIR *dp = opendir(path);
    cr_assert_not_null(dp, "cannot list %s", path);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dp))) {
        size_t a = strlen(de->d_name), b = strlen(suffix);
        n += a >= b && strcmp(de->d_name + a - b, suffix) == 0;
    }
    closedir(dp);
    return n;
}

int count_files(const char *dir, const cache_layout *l, const char *suffix) {
    char path[512];
    model_path(dir, l, NULL, path, sizeof path);
    return count_files_in(path, suffix);
}

cache_disk *open_disk(const char *dir, const cache_layout *l, int64_t cap, int wq) {
    kv_error err = {{0}};
    cache_disk *d = cache_disk_open(dir, l, cap, wq, &err);
    cr_assert_not_null(d, "cache_disk_open: %s", err.msg);
    return d;
}

cache_tier_stats stats(cache_disk *d) {
    cache_tier_stats st;
    cache_disk_stats(d, &st);
    return st;
}

void put_ok(cache_disk *d, cache_chunk *c) { cr_assert(cache_disk_put(d, c), "put refused"); }

/* Reads one key; the chunk (or NULL). */
cache_chunk *read_one(cache_disk *d, const cache_key *k) {
    cache_chunk *out = NULL;
    cache_disk_read(d, k, 1, &out);
    return out;
}

void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    fclose(f);
}

void flip_byte(const char *path, off_t off) {
    int fd = open(path, O_RDWR);
    cr_assert_geq(fd, 0, "cannot open %s", path);
    uint8_t b;
    cr_assert_eq(pread(fd, &b, 1, off), 1);
    b ^= 0x10;
    cr_assert_eq(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

/* Chunk i of ns with a KV-like payload (codecs code it as they would KV). */
cache_chunk *kv_chunk(const cache_layout *l, const cache_key *ns, int i) {
    cache_chunk *c = make_chunk(l, ns, i);
    chunk_fill_kv(c, l, (uint64_t)(7 + i));
    return c;
}
