/* Helpers for the chunk tier's unit tests (cache_disk_test, cache_disk_enc_test, record_test,
 * dirstore_test): a small layout, chunks and namespaces made from seeds, temporary cache
 * directories and the paths of the files in them, and one-line checks. Failures are Criterion
 * assertions. */
#ifndef KVSERVE_DISK_FIXTURE_H
#define KVSERVE_DISK_FIXTURE_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "cache/cache.h"
#include "cache/store/disk.h"

/* 2 layers, 1 KV head, head_dim 8, blocks of 16, chunks of 32: 2048 payload bytes, 8192-byte
 * files. */
cache_layout small_layout(void);

#define PAYLOAD 2048
#define FILE_BYTES 8192
#define HEADER 4096 /* room for 2 block keys, rounded up to CACHE_ALIGN */

cache_key make_ns(const char *salt);
/* The first n_blocks blocks of chunk i of namespace ns: block keys from tokens i*1000.., a
 * payload from a seed of (i, ns). */
cache_chunk *make_part(const cache_layout *l, const cache_key *ns, int i, int n_blocks);
cache_chunk *make_chunk(const cache_layout *l, const cache_key *ns, int i);
/* Chunk i of ns with a KV-like payload (codecs code it as they would KV). */
cache_chunk *kv_chunk(const cache_layout *l, const cache_key *ns, int i);

char *make_tmpdir(void);
/* Deletes dir and everything below it, and frees dir. */
void remove_tree(char *dir);
/* dir/<16 hex of the model>[/name] */
void model_path(const char *dir, const cache_layout *l, const char *name, char *out, size_t n);
void record_path(const char *dir, const cache_layout *l, const cache_key *k, char *out, size_t n);
bool file_exists(const char *path);
/* Files in directory path whose names end with suffix. */
int count_files_in(const char *path, const char *suffix);
/* Files in the model directory whose names end with suffix. */
int count_files(const char *dir, const cache_layout *l, const char *suffix);
void write_file(const char *path, const void *data, size_t n);
/* Flips a bit of the byte at off. */
void flip_byte(const char *path, off_t off);

cache_disk *open_disk(const char *dir, const cache_layout *l, int64_t cap, int wq);
cache_tier_stats stats(cache_disk *d);
void put_ok(cache_disk *d, cache_chunk *c);
/* Reads one key; the chunk (or NULL). */
cache_chunk *read_one(cache_disk *d, const cache_key *k);

#endif
