/* Content-defined chunks over token ids (cache/blend/blend.h): the token kinds of a vocabulary
 * and the cuts that make a passage chunk the same way wherever it sits. The planner (cache/plan.c)
 * cuts every prompt with them; the content records they key live in cache/store/content.h. */
#include "cache/blend/blend.h"

#include <stdlib.h>
#include <string.h>

uint8_t *cache_token_kinds(const tokenizer *t) {
    int n = tokenizer_n_vocab(t);
    uint8_t *kinds = calloc((size_t)n, 1);
    if (!kinds) return NULL;
    char buf[256];
    for (int32_t id = 0; id < n; id++) {
        /* control tokens decode to nothing unless rendered */
        int len = tokenizer_token_bytes(t, id, false, buf, sizeof buf);
        if (len == 0 && tokenizer_token_bytes(t, id, true, buf, sizeof buf) > 0)
            kinds[id] = CACHE_TOKEN_HARD;
        else if (len > 0 && memchr(buf, '\n', len < (int)sizeof buf ? (size_t)len : sizeof buf))
            kinds[id] = CACHE_TOKEN_SOFT;
    }
    return kinds;
}

/* splitmix64's finaliser: the gear value of a token id. */
static uint64_t gear(uint32_t id) {
    uint64_t z = (uint64_t)id + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int cache_cdc_cut(const int32_t *tokens, int n, const uint8_t *kinds, int n_vocab,
                  const cache_cdc_params *p, const int *bounds, int n_bounds, int *ends,
                  int max_ends) {
    int gap = p->avg_tokens - p->min_tokens;
    int bits = 0;
    while (bits < 32 && (1 << (bits + 1)) <= gap) bits++;
    int n_ends = 0, start = 0, nb = 0;
    uint64_t h = 0;
    for (int i = 0; i < n && n_ends < max_ends; i++) {
        while (nb < n_bounds && bounds[nb] < i) nb++;
        if (nb < n_bounds && bounds[nb] == i) { /* a segment starts here */
            if (i > start) {
                ends[n_ends++] = i;
                if (n_ends == max_ends) return n_ends;
                start = i;
            }
            h = 0;
        }
        int32_t id = tokens[i];
        uint8_t kind = kinds && id >= 0 && id < n_vocab ? kinds[id] : CACHE_TOKEN_PLAIN;
        if (kind == CACHE_TOKEN_HARD) {
            if (i > start) {
                ends[n_ends++] = i;
                if (n_ends == max_ends) return n_ends;
            }
            ends[n_ends++] = i + 1;
            start = i + 1;
            h = 0;
            continue;
        }
        h = (h << 4) + gear((uint32_t)id); /* the top bits see the last 16 tokens */
        int len = i + 1 - start;
        bool cut = len >= p->max_tokens;
        if (len >= p->min_tokens) {
            cut = cut || kind == CACHE_TOKEN_SOFT;
            cut = cut || (bits > 0 && (h >> (64 - bits)) == 0);
        }
        if (cut) {
            ends[n_ends++] = i + 1;
            start = i + 1;
        }
    }
    if (start < n && n_ends < max_ends) ends[n_ends++] = n;
    return n_ends;
}
