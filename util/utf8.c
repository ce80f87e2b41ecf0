/* UTF-8 decoding, validation and encoding (see utf8.h). */
#include "util/utf8.h"

/* Unicode 15.0 Table 3-7 (well-formed byte sequences): the lead byte fixes the sequence length
 * and the range of the second byte; later bytes are always 80..BF. The narrowed second-byte
 * ranges exclude overlong forms (E0, F0), surrogates (ED) and values above U+10FFFF (F4). */
utf8_status utf8_decode(const uint8_t *s, size_t len, uint32_t *cp, size_t *n) {
    uint8_t b0 = s[0];
    if (b0 < 0x80) {
        *cp = b0;
        *n = 1;
        return UTF8_OK;
    }
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF;
    uint32_t v;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        need = 2;
        v = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 3;
        v = b0 & 0x0F;
        if (b0 == 0xE0) lo = 0xA0;
        if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 4;
        v = b0 & 0x07;
        if (b0 == 0xF0) lo = 0x90;
        if (b0 == 0xF4) hi = 0x8F;
    } else {
        *n = 1; /* 80..C1 and F5..FF never start a sequence */
        return UTF8_INVALID;
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= len) {
            *n = i;
            return UTF8_TRUNCATED;
        }
        uint8_t b = s[i];
        if (b < lo || b > hi) {
            *n = i; /* the maximal subpart ends before the offending byte */
            return UTF8_INVALID;
        }
        v = (v << 6) | (b & 0x3F);
        lo = 0x80;
        hi = 0xBF;
    }
    *cp = v;
    *n = need;
    return UTF8_OK;
}

size_t utf8_validate(const uint8_t *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        size_t n;
        if (utf8_decode(s + i, len - i, &cp, &n) != UTF8_OK) return i;
        i += n;
    }
    return len;
}

int utf8_encode(uint32_t cp, uint8_t out[4]) {
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}
