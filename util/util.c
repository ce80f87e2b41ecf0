#include "util/util.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
