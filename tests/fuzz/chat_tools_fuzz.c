/* libFuzzer target for the tool-call parser (chat_tools_parse): the first byte picks the tool
 * format and a cut position, the rest is a model's answer. The answer is parsed whole and again
 * fed in two pieces (the first not final, as a stream delivers it) and byte by byte; every event
 * must lie inside the text, and the pieces must give the same content, calls and arguments, and
 * the same verdict (complete or not), as the whole. Seeds: tests/fuzz/corpus/chat_tools_fuzz/. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/chat/chat.h"

#define N_FORMATS (CHAT_TOOLS_MISTRAL_V7 + 1) /* the tool formats, the last one included */

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "chat_tools_fuzz: check failed: %s (line %d)\n", #cond, __LINE__);     \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

/* What a parse gave: each kind's bytes in order, separated per call. */
typedef struct outcome {
    char *buf;
    size_t len, cap;
    int n_calls;
    bool complete;
} outcome;

static void put(outcome *o, const char *s, size_t n) {
    if (o->len + n + 1 > o->cap) {
        o->cap = (o->len + n + 1) * 2;
        o->buf = realloc(o->buf, o->cap);
        CHECK(o->buf != NULL);
    }
    memcpy(o->buf + o->len, s, n);
    o->len += n;
}

static void feed(chat_tool_parser *p, const char *text, size_t have, bool final, outcome *o,
                 int *last_kind) {
    chat_tool_event ev[3];
    int k;
    do {
        k = chat_tools_parse(p, text, have, final, ev, 3);
        CHECK(k >= 0 && k <= 3);
        for (int i = 0; i < k; i++) {
            CHECK(ev[i].s >= text && ev[i].s + ev[i].n <= text + have);
            /* calls are numbered in order; arguments continue the latest call */
            if (ev[i].kind == CHAT_TOOL_EVENT_CALL) CHECK(ev[i].index == o->n_calls++);
            if (ev[i].kind == CHAT_TOOL_EVENT_ARGS) CHECK(ev[i].index == o->n_calls - 1);
            /* a marker byte between kinds: pieces of one kind run together */
            if ((int)ev[i].kind != *last_kind || ev[i].kind == CHAT_TOOL_EVENT_CALL)
                put(o, ev[i].kind == CHAT_TOOL_EVENT_CALL ? "\x01" : "\x02", 1);
            *last_kind = (int)ev[i].kind;
            put(o, ev[i].s, ev[i].n);
        }
    } while (k == 3);
    CHECK(p->cur <= have);
}

/* Parses text[0..len): first up to each of cuts[0..n_cuts) (not final), then all of it. */
static outcome parse(chat_tool_format f, const char *text, size_t len, const size_t *cuts,
                     size_t n_cuts) {
    outcome o = {0};
    chat_tool_parser p;
    chat_tool_parser_init(&p, f);
    int last = -1;
    for (size_t i = 0; i < n_cuts; i++) feed(&p, text, cuts[i], false, &o, &last);
    feed(&p, text, len, true, &o, &last);
    CHECK(p.cur == len && o.n_calls == p.n_calls);
    o.complete = p.mode == 2 && p.complete;
    return o;
}

static void same(const outcome *a, const outcome *b) {
    CHECK(a->len == b->len && (a->len == 0 || memcmp(a->buf, b->buf, a->len) == 0));
    CHECK(a->n_calls == b->n_calls && a->complete == b->complete);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 4096) return 0;
    chat_tool_format f = (chat_tool_format)(data[0] % N_FORMATS);
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    outcome whole = parse(f, text, len, NULL, 0);
    size_t cut = len ? (size_t)(data[0] / N_FORMATS) % (len + 1) : 0;
    outcome two = parse(f, text, len, &cut, 1);
    same(&whole, &two);
    size_t *cuts = malloc(sizeof *cuts * (len + 1));
    CHECK(cuts != NULL);
    for (size_t i = 0; i <= len; i++) cuts[i] = i;
    outcome bytes = parse(f, text, len, cuts, len + 1);
    same(&whole, &bytes);
    free(cuts);
    free(whole.buf);
    free(two.buf);
    free(bytes.buf);
    return 0;
}
