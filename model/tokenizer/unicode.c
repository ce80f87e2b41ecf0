/* The code point flag lookup (see unicode.h). */
#include "model/tokenizer/unicode.h"

uint8_t unicode_flags(uint32_t cp) {
    if (cp < 128) return unicode_ascii_flags[cp];
    if (cp > 0x10FFFF) return UNICODE_CAT_UNASSIGNED;
    /* Last run whose start is <= cp; run 0 starts at U+0000, so one always exists. */
    size_t lo = 0, hi = unicode_runs_count;
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (unicode_runs_start[mid] <= cp)
            lo = mid;
        else
            hi = mid;
    }
    return unicode_runs_flags[lo];
}
