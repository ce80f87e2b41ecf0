/* What the parser fuzz targets check with. CHECK traps on a broken invariant, so libFuzzer counts
 * a crash and saves the input; use_str reads a string the parser handed out end to end, so ASan
 * checks every byte of it. */
#ifndef KVSERVE_FUZZ_CHECK_H
#define KVSERVE_FUZZ_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s: check failed: %s (line %d)\n", __FILE__, #cond, __LINE__);        \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

static inline uint64_t use_str(const char *s) {
    CHECK(s != NULL);
    size_t len = strlen(s);
    return len ? (uint8_t)s[0] + (uint8_t)s[len - 1] + len : 0;
}

#endif
