/* util: the bottom layer every other folder may use: errors as values, the logger, clocks,
 * aligned allocation, whole-buffer file I/O, SHA-256 and hex. No mutable state except the logger's
 * level (set once at start-up). */
#ifndef KVSERVE_UTIL_H
#define KVSERVE_UTIL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */

/* Functions that can fail on input data return a status (0 ok, -1 error) or NULL and fill a
 * kv_error the caller owns. The message names the problem (file, key, tensor, value). */
typedef struct kv_error {
    char msg[512];
} kv_error;

/* Formats the message into err (if non-NULL) and returns -1, so `return kv_fail(err, ...)`. */
int kv_fail(kv_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prefixes an existing message: "context: old message". Returns -1. */
int kv_fail_wrap(kv_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---------------------------------------------------------------- logging */

typedef enum log_level {
    LOG_LEVEL_ERROR = 0,
    LOG_LEVEL_WARN = 1,
    LOG_LEVEL_INFO = 2,
    LOG_LEVEL_DEBUG = 3,
} log_level;

void log_set_level(log_level level);
log_level log_get_level(void);
/* Parses "error|warn|info|debug"; returns -1 on anything else. */
int log_level_parse(const char *s, log_level *out);
void log_msg(log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_error(...) log_msg(LOG_LEVEL_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_LEVEL_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_LEVEL_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_LEVEL_DEBUG, __VA_ARGS__)

/* ---------------------------------------------------------------- time and memory */

/* Monotonic clock in nanoseconds (CLOCK_MONOTONIC). */
uint64_t clock_now_ns(void);

/* 64-byte aligned allocation (cache line / AVX-512 width); free with kv_aligned_free.
 * Returns NULL on overflow or out of memory. */
void *kv_aligned_alloc(size_t size);
void kv_aligned_free(void *p);

/* Page-aligned, zero-filled memory for large buffers (the KV pool): pages are committed when
 * first touched, so an unused pool costs neither start-up time nor resident memory. Free with
 * kv_zeroed_free. NULL on overflow or when the mapping fails. */
void *kv_zeroed_alloc(size_t size);
void kv_zeroed_free(void *p);

/* Little-endian integers in byte buffers (the cache's record and bitstream formats). */
static inline void le_put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void le_put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void le_put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t le_get_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t le_get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t le_get_u64(const uint8_t *p) {
    return (uint64_t)le_get_u32(p) | (uint64_t)le_get_u32(p + 4) << 32;
}

/* ---------------------------------------------------------------- SHA-256 (OpenSSL's libcrypto) */

/* SHA-256 of a[0..na) followed by b[0..nb) (b may be NULL when nb is 0): the checksum of a
 * record header without its own checksum field, or of one buffer. 0, or -1 when libcrypto
 * cannot allocate its context. */
int kv_sha256_2(const void *a, size_t na, const void *b, size_t nb, uint8_t out[32]);
static inline int kv_sha256(const void *data, size_t len, uint8_t out[32]) {
    return kv_sha256_2(data, len, NULL, 0, out);
}

/* ---------------------------------------------------------------- randomness */

/* Fills buf with n bytes from the kernel's CSPRNG (getrandom), retrying a call a signal
 * interrupted (EINTR) and short reads. 0, or -1 with errno when the kernel cannot give them:
 * ids and secrets are never made from a clock instead, so the caller fails what needed them. */
int kv_random(void *buf, size_t n);

/* Lower-case hex of b[0..n) to out[2n + 1] (terminated). */
void kv_hex_encode(const void *b, size_t n, char *out);
/* The n bytes that the 2n lower-case hex digits at s spell, to out; false at any other character
 * (out is then partly written). The names of cache files are parsed with it. */
bool kv_hex_decode(const char *s, size_t n, uint8_t *out);

/* Makes a directory and its missing parents (mode 0755); -1 with err naming the one that
 * could not be made. */
int kv_mkdir_p(const char *path, kv_error *err);

/* ---------------------------------------------------------------- growable buffer and arrays */

/* A growable string (as Redis's sds and SQLite's sqlite3_str serve those codebases). Appends do
 * not report failure: the first that runs out of memory sets oom and later ones do nothing, so a
 * builder checks oom once at the end. p is NUL-terminated once anything was appended; the owner
 * frees it. Zero-initialise to start. */
typedef struct kv_buf {
    char *p;
    size_t len, cap;
    bool oom;
} kv_buf;

void kv_buf_append(kv_buf *b, const void *s, size_t n);
void kv_buf_puts(kv_buf *b, const char *s);
void kv_buf_printf(kv_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Room in *arr (*cap elements of elem bytes) for need elements: unchanged when there is, else
 * moved to *cap (min_cap when 0) doubled until it holds need. 0, or -1 on overflow or out of memory
 * (*arr and *cap then unchanged). arr is the address of the caller's pointer: (void **)&items. */
int kv_array_reserve(void **arr, size_t *cap, size_t need, size_t elem, size_t min_cap);

/* ---------------------------------------------------------------- tenants' shares */

/* A tenant (DESIGN.md "Tenants": an API key, or the whole server without keys) may hold a share
 * of a budget shared by n_tenants: share_pct percent of total (0: an equal part, total /
 * n_tenants), rounded down, and at least min (so a share of a small count is never zero when
 * min is 1). One tenant (n_tenants <= 1) holds all of it whatever share_pct says. */
int64_t kv_tenant_share(int64_t total, int share_pct, int n_tenants, int64_t min);

/* ---------------------------------------------------------------- file I/O */

/* Writes p[0..n) to fd at its file offset, retrying short writes and EINTR: 0, or -1 with errno
 * (EIO when the device took nothing). */
int kv_write_full(int fd, const void *p, size_t n);
/* Reads buf[0..len) from fd at offset off, retrying short reads and EINTR, stopping early only at
 * the end of the file: the bytes read (< len: the file ended), or -1 with errno. */
int64_t kv_pread_full(int fd, void *buf, size_t len, int64_t off);

/* The whole file at path, NUL-terminated (malloc'd; *len, when not NULL: its bytes), or NULL
 * with err when it cannot be opened or read, or holds more than max bytes. */
char *kv_read_file(const char *path, size_t max, size_t *len, kv_error *err);

/* Overflow-checked size arithmetic: return 0 and store the result, or -1 on overflow. */
static inline int size_mul(size_t a, size_t b, size_t *out) {
    return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}
static inline int size_add(size_t a, size_t b, size_t *out) {
    return __builtin_add_overflow(a, b, out) ? -1 : 0;
}

#ifdef __cplusplus
}
#endif

#endif
