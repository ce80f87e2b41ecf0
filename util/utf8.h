/* UTF-8 as Unicode 15.0 defines it (Table 3-7, well-formed byte sequences): decoding with the
 * maximal-subpart rule for invalid input, validation and encoding. */
#ifndef KVSERVE_UTIL_UTF8_H
#define KVSERVE_UTIL_UTF8_H

#include <stddef.h>
#include <stdint.h>

typedef enum utf8_status {
    UTF8_OK = 0,        /* a valid sequence of *n bytes */
    UTF8_INVALID = 1,   /* a maximal subpart of *n bytes that can never become valid */
    UTF8_TRUNCATED = 2, /* all *n bytes left are a valid prefix that needs more bytes */
} utf8_status;

/* Decodes the sequence at s[0..len) (len >= 1): stores the code point (UTF8_OK only) and the
 * number of bytes the status covers (1..4). Overlong forms, surrogates and values above
 * U+10FFFF are invalid. */
utf8_status utf8_decode(const uint8_t *s, size_t len, uint32_t *cp, size_t *n);

/* Offset of the first byte that is not part of a complete valid sequence, len if all valid. */
size_t utf8_validate(const uint8_t *s, size_t len);

/* Encodes cp (<= U+10FFFF) into out; returns the length 1..4. */
int utf8_encode(uint32_t cp, uint8_t out[4]);

/* U+FFFD REPLACEMENT CHARACTER in UTF-8. */
#define UTF8_REPLACEMENT "\xEF\xBF\xBD"

#endif
