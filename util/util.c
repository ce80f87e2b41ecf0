/* The bottom layer's implementation (util/util.h), used by every folder: errors as values, the
 * logger, the monotonic clock, aligned and zeroed allocation, whole-buffer file I/O, hex,
 * SHA-256 (through OpenSSL's EVP), growable arrays and the byte buffer. */
#include "util/util.h"

#include <errno.h>
#include <openssl/evp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- errors */

int kv_fail(kv_error *err, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int kv_fail_wrap(kv_error *err, const char *fmt, ...) {
    if (!err) return -1;
    char prefix[256];
    char old[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    old[sizeof old - 1] = '\0';
    /* Both parts may be long; the joined message is cut to fit, never overflowed. */
    size_t np = strnlen(prefix, sizeof prefix);
    size_t room = sizeof err->msg - 1;
    size_t n = np < room ? np : room;
    memcpy(err->msg, prefix, n);
    if (n + 2 <= room) {
        memcpy(err->msg + n, ": ", 2);
        n += 2;
        size_t no = strnlen(old, sizeof old);
        size_t k = no < room - n ? no : room - n;
        memcpy(err->msg + n, old, k);
        n += k;
    }
    err->msg[n] = '\0';
    return -1;
}

/* ---------------------------------------------------------------- logging */

/* The one process-wide setting: written at start-up, read by every thread. */
static _Atomic int g_log_level = LOG_LEVEL_INFO;

void log_set_level(log_level level) { atomic_store(&g_log_level, (int)level); }
log_level log_get_level(void) { return (log_level)atomic_load(&g_log_level); }

int log_level_parse(const char *s, log_level *out) {
    static const char *names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++) {
        if (strcmp(s, names[i]) == 0) {
            *out = (log_level)i;
            return 0;
        }
    }
    return -1;
}

void log_msg(log_level level, const char *fmt, ...) {
    if ((int)level > atomic_load(&g_log_level)) return;
    static const char *tags[] = {"E", "W", "I", "D"};
    char line[2048];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld %s ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, tags[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    /* One fputs per line so lines from threads do not interleave. */
    size_t len = strlen(line);
    if (len + 1 < sizeof line) {
        line[len] = '\n';
        line[len + 1] = '\0';
    }
    fputs(line, stderr);
}

/* ---------------------------------------------------------------- time and memory */

uint64_t clock_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void *kv_aligned_alloc(size_t size) {
    size_t rounded;
    if (size_add(size, 63, &rounded)) return NULL;
    rounded &= ~(size_t)63;
    if (rounded == 0) rounded = 64;
    return aligned_alloc(64, rounded);
}

void kv_aligned_free(void *p) { free(p); }

/* The mapping's length sits in the page before the pointer, so kv_zeroed_free needs no size. */
void *kv_zeroed_alloc(size_t size) {
    long page = sysconf(_SC_PAGESIZE);
    size_t total;
    if (page <= 0 || size_add(size, (size_t)page, &total)) return NULL;
    void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return NULL;
    memcpy(base, &total, sizeof total);
    return (uint8_t *)base + page;
}

void kv_zeroed_free(void *p) {
    if (!p) return;
    uint8_t *base = (uint8_t *)p - sysconf(_SC_PAGESIZE);
    size_t total;
    memcpy(&total, base, sizeof total);
    munmap(base, total);
}

int kv_mkdir_p(const char *path, kv_error *err) {
    char *p = strdup(path);
    if (!p) return kv_fail(err, "out of memory");
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s != '\0') continue;
        char c = *s;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            kv_fail(err, "cannot create directory %s: %s", p, strerror(errno));
            free(p);
            return -1;
        }
        *s = c;
        if (!c) break;
    }
    free(p);
    return 0;
}

int kv_write_full(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -1;
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

int64_t kv_pread_full(int fd, void *buf, size_t len, int64_t off) {
    uint8_t *b = buf;
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, b + got, len - got, (off_t)(off + (int64_t)got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        got += (size_t)r;
    }
    return (int64_t)got;
}

char *kv_read_file(const char *path, size_t max, size_t *len, kv_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        kv_fail(err, "%s: %s", path, strerror(errno));
        return NULL;
    }
    /* read in growing steps rather than by fstat's size: a pipe or /proc file has none */
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf && !ferror(f) && !feof(f) && n <= max) {
        if (cap - n < 2) {
            char *b2 = realloc(buf, cap * 2);
            if (!b2) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b2;
            cap *= 2;
        }
        n += fread(buf + n, 1, cap - n - 1, f);
    }
    bool failed = ferror(f) != 0;
    fclose(f);
    if (!buf || failed || n > max) {
        free(buf);
        if (!buf)
            kv_fail(err, "%s: out of memory", path);
        else if (failed)
            kv_fail(err, "%s: read error", path);
        else
            kv_fail(err, "%s: larger than %zu bytes", path, max);
        return NULL;
    }
    buf[n] = '\0';
    if (len) *len = n;
    return buf;
}

int kv_random(void *buf, size_t n) {
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t got = getrandom(p, n, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            if (got == 0) errno = EIO;
            return -1;
        }
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

void kv_hex_encode(const void *b, size_t n, char *out) {
    static const char digits[] = "0123456789abcdef";
    const uint8_t *p = b;
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[p[i] >> 4];
        out[2 * i + 1] = digits[p[i] & 15];
    }
    out[2 * n] = '\0';
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

bool kv_hex_decode(const char *s, size_t n, uint8_t *out) {
    for (size_t i = 0; i < n; i++) {
        int hi = hex_digit(s[2 * i]);
        int lo = hi < 0 ? -1 : hex_digit(s[2 * i + 1]);
        if (lo < 0) return false;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

int kv_sha256_2(const void *a, size_t na, const void *b, size_t nb, uint8_t out[32]) {
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    unsigned int n = 0;
    int ok = md && EVP_DigestInit_ex(md, EVP_sha256(), NULL) == 1 &&
             EVP_DigestUpdate(md, a, na) == 1 && (nb == 0 || EVP_DigestUpdate(md, b, nb) == 1) &&
             EVP_DigestFinal_ex(md, out, &n) == 1 && n == 32;
    EVP_MD_CTX_free(md);
    return ok ? 0 : -1;
}

int kv_array_reserve(void **arr, size_t *cap, size_t need, size_t elem, size_t min_cap) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : min_cap ? min_cap : 1;
    while (c < need) c = c > SIZE_MAX / 2 ? need : 2 * c;
    size_t bytes;
    if (size_mul(c, elem, &bytes)) return -1;
    void *v = realloc(*arr, bytes);
    if (!v) return -1;
    *arr = v;
    *cap = c;
    return 0;
}

void kv_buf_append(kv_buf *b, const void *s, size_t n) {
    size_t need;
    if (b->oom) return;
    if (size_add(b->len, n, &need) || size_add(need, 1, &need) ||
        kv_array_reserve((void **)&b->p, &b->cap, need, 1, 256)) {
        b->oom = true;
        return;
    }
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void kv_buf_puts(kv_buf *b, const char *s) { kv_buf_append(b, s, strlen(s)); }

void kv_buf_printf(kv_buf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) { /* an encoding error: the text would be wrong, as on running out of memory */
        b->oom = true;
        return;
    }
    if ((size_t)n < sizeof tmp) {
        kv_buf_append(b, tmp, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    kv_buf_append(b, big, (size_t)n);
    free(big);
}

/* ---------------------------------------------------------------- tenants' shares */

int64_t kv_tenant_share(int64_t total, int share_pct, int n_tenants, int64_t min) {
    int64_t part = total;
    if (n_tenants > 1)
        part = share_pct > 0 ? total / 100 * share_pct + total % 100 * share_pct / 100
                             : total / n_tenants;
    return part > min ? part : min < total ? min : total;
}
