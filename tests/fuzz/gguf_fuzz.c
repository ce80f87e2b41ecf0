/* libFuzzer target for the GGUF reader: parse arbitrary bytes, then use everything the parse
 * handed out (every key through every getter, every array element, every tensor's first and last
 * data byte), so ASan checks each pointer the reader returns, not just the parse itself.
 * Seeds: tests/fuzz/corpus/gguf_fuzz/ (fixtures from scripts/ref/make_gguf_fixtures.py). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "model/gguf.h"

static uint64_t use_str(const char *s, size_t len) {
    return len ? (uint8_t)s[0] + (uint8_t)s[len - 1] : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kv_error err;
    gguf_file *g = gguf_open_memory(data, size, &err);
    if (!g) return 0;
    volatile uint64_t sink = gguf_version(g) + gguf_file_size(g) + gguf_alignment(g);
    sink += (uintptr_t)gguf_data_base(g);

    for (int64_t i = 0; i < gguf_kv_count(g); i++) {
        const char *key = gguf_kv_key(g, i);
        sink += strlen(key) + (uint64_t)gguf_kv_type(g, i) + gguf_has_key(g, key);
        int64_t v;
        double d;
        bool b;
        const char *s;
        size_t len;
        gguf_array a;
        if (gguf_get_i64(g, key, &v, &err) == 0) sink += (uint64_t)v;
        if (gguf_get_f64(g, key, &d, &err) == 0) sink += (uint64_t)(d == d);
        if (gguf_get_bool(g, key, &b, &err) == 0) sink += b;
        if (gguf_get_str(g, key, &s, &len, &err) == 0) sink += use_str(s, len);
        if (gguf_get_array(g, key, &a, &err) == 0) {
            for (uint64_t j = 0; j < a.n; j++) {
                gguf_array_str(&a, j, &s, &len);
                sink += use_str(s, len);
                sink += (uint64_t)gguf_array_i64(&a, j);
                sink += (uint64_t)(gguf_array_f64(&a, j) == 0.0);
            }
        }
    }
    for (int64_t i = 0; i < gguf_tensor_count(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        if (gguf_find_tensor(g, t->name) != t) __builtin_trap();
        if (t->n_dims < 1 || t->n_dims > 4 || t->size == 0) __builtin_trap();
        const uint8_t *p = t->data;
        sink += p[0] + p[t->size - 1] + (uint64_t)t->ne[0] + strlen(t->name);
    }
    (void)sink;
    gguf_close(g);
    return 0;
}
