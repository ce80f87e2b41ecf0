/* GGUF reader tests: the fixtures written by scripts/ref/make_gguf_fixtures.py (every value and
 * tensor checked), the real model, and corrupt files built from a fixture in memory (every
 * truncation point, every header byte mutated, and one test per check the reader makes). */
#include <criterion/criterion.h>

#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/gguf.h"
#include "tests/unit/model_fixture.h"
#include "tests/unit/tmpdir.h"

#define FIXTURE_DIR "tests/golden/gguf/"
#define ALL_TYPES FIXTURE_DIR "all_types.gguf"

/* ---------------------------------------------------------------- helpers */

typedef struct blob {
    uint8_t *p;
    size_t len;
} blob;

static blob blob_load(const char *path) {
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s (run scripts/ref/make_gguf_fixtures.py)", path);
    cr_assert(fseek(f, 0, SEEK_END) == 0);
    long n = ftell(f);
    cr_assert(n > 0);
    rewind(f);
    blob b = {malloc((size_t)n), (size_t)n};
    cr_assert(b.p);
    cr_assert(fread(b.p, 1, b.len, f) == b.len);
    fclose(f);
    return b;
}

/* Offset of the u64 length field of the file string s (length prefix + bytes, so "w.f16" does
 * not match inside "test.arr_f16"). */
static size_t find_str(const blob *b, const char *s) {
    size_t n = strlen(s);
    uint8_t needle[128];
    cr_assert(n + 8 <= sizeof needle);
    uint64_t len = n;
    memcpy(needle, &len, 8);
    memcpy(needle + 8, s, n);
    const uint8_t *hit = memmem(b->p, b->len, needle, n + 8);
    cr_assert(hit, "string '%s' not in fixture", s);
    return (size_t)(hit - b->p);
}

/* Offset just past the file string s: where a key's type or a tensor's n_dims is. */
static size_t after_str(const blob *b, const char *s) { return find_str(b, s) + 8 + strlen(s); }

static void put_u32(blob *b, size_t off, uint32_t v) { memcpy(b->p + off, &v, 4); }
static void put_u64(blob *b, size_t off, uint64_t v) { memcpy(b->p + off, &v, 8); }
static uint32_t get_u32(const blob *b, size_t off) {
    uint32_t v;
    memcpy(&v, b->p + off, 4);
    return v;
}

static uint8_t pattern_byte(size_t k, int seed) {
    return (uint8_t)((k * 31 + (size_t)seed * 7 + 3) & 0xff);
}

static float half_to_float(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(m | 0x400), e - 25);
    return h & 0x8000 ? -v : v;
}

/* Touches every value and tensor byte range, as a consumer would: ASan checks the pointers. */
static void walk(const gguf_file *g) {
    volatile uint64_t sink = 0;
    for (int64_t i = 0; i < gguf_kv_count(g); i++) {
        const char *key = gguf_kv_key(g, i);
        cr_assert(key && gguf_has_key(g, key));
        gguf_array a;
        if (gguf_get_array(g, key, &a, NULL) == 0) {
            for (uint64_t j = 0; j < a.n; j++) {
                const char *s;
                size_t len;
                gguf_array_str(&a, j, &s, &len);
                if (len) sink += (uint8_t)s[len - 1];
                sink += (uint64_t)gguf_array_i64(&a, j);
            }
        }
        const char *s;
        size_t len;
        if (gguf_get_str(g, key, &s, &len, NULL) == 0 && len) sink += (uint8_t)s[len - 1];
    }
    for (int64_t i = 0; i < gguf_tensor_count(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        cr_assert(gguf_find_tensor(g, t->name) == t);
        const uint8_t *d = t->data;
        sink += d[0] + d[t->size - 1];
    }
    (void)sink;
}

/* Parses a copy of exactly b->len bytes, so ASan sees any read past the end; on success walks
 * the result. Returns whether it parsed. */
static bool parses(const blob *b, kv_error *err) {
    uint8_t *copy = malloc(b->len ? b->len : 1);
    cr_assert(copy);
    memcpy(copy, b->p, b->len);
    gguf_file *g = gguf_open_memory(copy, b->len, err);
    bool ok = g != NULL;
    if (g) walk(g);
    gguf_close(g);
    free(copy);
    return ok;
}

/* Asserts b fails to parse with an error containing every non-NULL needle. */
static void expect_fail(const blob *b, const char *n1, const char *n2) {
    kv_error err = {{0}};
    cr_assert(!parses(b, &err), "parsed, expected an error containing '%s'", n1);
    cr_assert(strstr(err.msg, n1), "error '%s' lacks '%s'", err.msg, n1);
    if (n2) cr_assert(strstr(err.msg, n2), "error '%s' lacks '%s'", err.msg, n2);
}

/* A tiny GGUF writer for shapes the reference writer cannot make (empty arrays, no tensors). */
typedef struct builder {
    uint8_t p[1024];
    size_t len;
} builder;

static void b_u32(builder *b, uint32_t v) {
    memcpy(b->p + b->len, &v, 4);
    b->len += 4;
}
static void b_u64(builder *b, uint64_t v) {
    memcpy(b->p + b->len, &v, 8);
    b->len += 8;
}
static void b_str(builder *b, const char *s) {
    b_u64(b, strlen(s));
    memcpy(b->p + b->len, s, strlen(s));
    b->len += strlen(s);
}
static void b_header(builder *b, uint64_t n_tensors, uint64_t n_kv) {
    b->len = 0;
    memcpy(b->p, "GGUF", 4);
    b->len = 4;
    b_u32(b, 3);
    b_u64(b, n_tensors);
    b_u64(b, n_kv);
}

/* ---------------------------------------------------------------- fixture: values */

Test(gguf, fixture_header_and_scalars) {
    kv_error err = {{0}};
    gguf_file *g = gguf_open(ALL_TYPES, &err);
    cr_assert(g, "%s", err.msg);
    cr_assert_eq(gguf_version(g), 3);
    cr_assert_eq(gguf_kv_count(g), 30);
    cr_assert_eq(gguf_tensor_count(g), 13);
    cr_assert_eq(gguf_alignment(g), 64);
    cr_assert_str_eq(gguf_kv_key(g, 0), "general.architecture");
    cr_assert_eq(gguf_kv_type(g, 0), GGUF_VALUE_TYPE_STRING);
    cr_assert_str_eq(gguf_kv_key(g, 1), "general.alignment");
    cr_assert_null(gguf_kv_key(g, 30));
    cr_assert_null(gguf_kv_key(g, -1));

    const char *s;
    size_t len;
    cr_assert_eq(gguf_get_str(g, "general.architecture", &s, &len, &err), 0, "%s", err.msg);
    cr_assert(len == 8 && memcmp(s, "testarch", 8) == 0);

    static const struct {
        const char *key;
        gguf_value_type type;
        int64_t v;
    } ints[] = {
        {"general.alignment", GGUF_VALUE_TYPE_UINT32, 64},
        {"test.u8", GGUF_VALUE_TYPE_UINT8, 200},
        {"test.i8", GGUF_VALUE_TYPE_INT8, -100},
        {"test.u16", GGUF_VALUE_TYPE_UINT16, 60000},
        {"test.i16", GGUF_VALUE_TYPE_INT16, -30000},
        {"test.u32", GGUF_VALUE_TYPE_UINT32, 4000000000},
        {"test.i32", GGUF_VALUE_TYPE_INT32, -2000000000},
        {"test.u64", GGUF_VALUE_TYPE_UINT64, 12345678901234},
        {"test.i64", GGUF_VALUE_TYPE_INT64, -9000000000000000000},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        int64_t v = 0;
        cr_assert_eq(gguf_get_i64(g, ints[i].key, &v, &err), 0, "%s", err.msg);
        cr_assert_eq(v, ints[i].v, "%s: %lld", ints[i].key, (long long)v);
        int64_t k = -1;
        for (int64_t j = 0; j < gguf_kv_count(g); j++) {
            if (strcmp(gguf_kv_key(g, j), ints[i].key) == 0) k = j;
        }
        cr_assert_eq(gguf_kv_type(g, k), ints[i].type, "%s", ints[i].key);
    }

    double d;
    cr_assert_eq(gguf_get_f64(g, "test.f32", &d, &err), 0, "%s", err.msg);
    cr_assert_eq(d, 1.5);
    cr_assert_eq(gguf_get_f64(g, "test.f64", &d, &err), 0, "%s", err.msg);
    cr_assert_eq(d, 3.141592653589793);

    bool b = false;
    cr_assert_eq(gguf_get_bool(g, "test.bool_t", &b, &err), 0, "%s", err.msg);
    cr_assert(b);
    cr_assert_eq(gguf_get_bool(g, "test.bool_f", &b, &err), 0, "%s", err.msg);
    cr_assert(!b);

    cr_assert_eq(gguf_get_str(g, "test.str", &s, &len, &err), 0, "%s", err.msg);
    cr_assert(len == 11 && memcmp(s, "hello, gguf", 11) == 0);
    cr_assert_eq(gguf_get_str(g, "test.str_utf8", &s, &len, &err), 0, "%s", err.msg);
    cr_assert(len == 10 && memcmp(s, "h\xc3\xa9llo \xe2\x98\x83", 10) == 0);
    cr_assert_eq(gguf_get_str(g, "test.str_empty", &s, &len, &err), 0, "%s", err.msg);
    cr_assert_eq(len, 0);
    gguf_close(g);
}

Test(gguf, fixture_getter_errors) {
    kv_error err = {{0}};
    gguf_file *g = gguf_open(ALL_TYPES, &err);
    cr_assert(g, "%s", err.msg);
    int64_t v;
    double d;
    bool b;
    const char *s;
    size_t len;
    gguf_array a;

    cr_assert_eq(gguf_get_i64(g, "test.u64_max", &v, &err), -1);
    cr_assert(strstr(err.msg, "test.u64_max") && strstr(err.msg, "does not fit"), "%s", err.msg);
    cr_assert_eq(gguf_get_i64(g, "no.such.key", &v, &err), -1);
    cr_assert(strstr(err.msg, "'no.such.key' not found"), "%s", err.msg);
    cr_assert(!gguf_has_key(g, "no.such.key"));
    cr_assert(gguf_has_key(g, "test.u8"));

    cr_assert_eq(gguf_get_i64(g, "test.f32", &v, &err), -1);
    cr_assert(strstr(err.msg, "'test.f32' has type FLOAT32"), "%s", err.msg);
    cr_assert_eq(gguf_get_i64(g, "test.bool_t", &v, &err), -1);
    cr_assert(strstr(err.msg, "BOOL"), "%s", err.msg);
    cr_assert_eq(gguf_get_i64(g, "test.arr_str", &v, &err), -1);
    cr_assert(strstr(err.msg, "ARRAY of STRING"), "%s", err.msg);
    cr_assert_eq(gguf_get_f64(g, "test.u8", &d, &err), -1);
    cr_assert(strstr(err.msg, "'test.u8' has type UINT8"), "%s", err.msg);
    cr_assert_eq(gguf_get_bool(g, "test.u8", &b, &err), -1);
    cr_assert(strstr(err.msg, "expected BOOL"), "%s", err.msg);
    cr_assert_eq(gguf_get_str(g, "test.i32", &s, &len, &err), -1);
    cr_assert(strstr(err.msg, "'test.i32' has type INT32, expected STRING"), "%s", err.msg);
    cr_assert_eq(gguf_get_array(g, "test.str", &a, &err), -1);
    cr_assert(strstr(err.msg, "'test.str' has type STRING, expected ARRAY"), "%s", err.msg);
    cr_assert_eq(gguf_get_i64(g, NULL, &v, &err), -1);
    cr_assert_null(gguf_find_tensor(g, "nope"));
    cr_assert_null(gguf_find_tensor(g, NULL));
    cr_assert_null(gguf_tensor_at(g, 13));
    cr_assert_str_eq(gguf_value_type_name(GGUF_VALUE_TYPE_FLOAT64), "FLOAT64");
    cr_assert_str_eq(gguf_value_type_name((gguf_value_type)99), "unknown");
    gguf_close(g);
}

Test(gguf, fixture_arrays) {
    kv_error err = {{0}};
    gguf_file *g = gguf_open(ALL_TYPES, &err);
    cr_assert(g, "%s", err.msg);
    static const struct {
        const char *key;
        gguf_value_type type;
        uint64_t n;
        int64_t v[4];
    } ints[] = {
        {"test.arr_u8", GGUF_VALUE_TYPE_UINT8, 3, {1, 2, 255}},
        {"test.arr_i8", GGUF_VALUE_TYPE_INT8, 3, {-1, 2, -128}},
        {"test.arr_u16", GGUF_VALUE_TYPE_UINT16, 2, {0, 65535}},
        {"test.arr_i16", GGUF_VALUE_TYPE_INT16, 2, {-32768, 7}},
        {"test.arr_u32", GGUF_VALUE_TYPE_UINT32, 3, {1, 4000000000, 3}},
        {"test.arr_i32", GGUF_VALUE_TYPE_INT32, 4, {-5, 0, 5, 2147483647}},
        {"test.arr_u64", GGUF_VALUE_TYPE_UINT64, 2, {0, INT64_MAX}}, /* saturated */
        {"test.arr_i64", GGUF_VALUE_TYPE_INT64, 2, {INT64_MIN, 42}},
        {"test.arr_bool", GGUF_VALUE_TYPE_BOOL, 3, {1, 0, 1}},
    };
    gguf_array a;
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        cr_assert_eq(gguf_get_array(g, ints[i].key, &a, &err), 0, "%s", err.msg);
        cr_assert_eq(a.elem_type, ints[i].type, "%s", ints[i].key);
        cr_assert_eq(a.n, ints[i].n, "%s", ints[i].key);
        for (uint64_t j = 0; j < a.n; j++) {
            cr_assert_eq(gguf_array_i64(&a, j), ints[i].v[j], "%s[%llu]", ints[i].key,
                         (unsigned long long)j);
            if (ints[i].type != GGUF_VALUE_TYPE_UINT64) {
                cr_assert_eq(gguf_array_f64(&a, j), (double)ints[i].v[j]);
            }
        }
        cr_assert_eq(gguf_array_i64(&a, a.n), 0); /* out of range */
    }
    cr_assert_eq(gguf_get_array(g, "test.arr_u64", &a, &err), 0);
    cr_assert_eq(gguf_array_f64(&a, 1), 18446744073709551615.0);

    cr_assert_eq(gguf_get_array(g, "test.arr_f32", &a, &err), 0, "%s", err.msg);
    cr_assert(a.elem_type == GGUF_VALUE_TYPE_FLOAT32 && a.n == 3);
    cr_assert_eq(gguf_array_f64(&a, 0), 0.5);
    cr_assert_eq(gguf_array_f64(&a, 1), -1.25);
    cr_assert_eq(gguf_array_f64(&a, 2), 3.0);
    cr_assert_eq(gguf_array_i64(&a, 1), -1); /* truncated toward zero */
    cr_assert_eq(gguf_get_array(g, "test.arr_f64", &a, &err), 0, "%s", err.msg);
    cr_assert(a.elem_type == GGUF_VALUE_TYPE_FLOAT64 && a.n == 2);
    cr_assert_eq(gguf_array_f64(&a, 0), 1e300);
    cr_assert_eq(gguf_array_f64(&a, 1), -2.5);
    cr_assert_eq(gguf_array_i64(&a, 0), INT64_MAX); /* saturated */

    cr_assert_eq(gguf_get_array(g, "test.arr_str", &a, &err), 0, "%s", err.msg);
    cr_assert(a.elem_type == GGUF_VALUE_TYPE_STRING && a.n == 4);
    static const char *strs[] = {"a", "", "<|im_start|>", "h\xc3\xa9llo"};
    for (uint64_t j = 0; j < 4; j++) {
        const char *s;
        size_t len;
        gguf_array_str(&a, j, &s, &len);
        cr_assert(len == strlen(strs[j]) && memcmp(s, strs[j], len) == 0, "arr_str[%d]", (int)j);
    }
    const char *s;
    size_t len;
    gguf_array_str(&a, 4, &s, &len); /* out of range */
    cr_assert_eq(len, 0);
    gguf_close(g);
}

/* ---------------------------------------------------------------- fixture: tensors */

Test(gguf, fixture_tensors) {
    kv_error err = {{0}};
    gguf_file *g = gguf_open(ALL_TYPES, &err);
    cr_assert(g, "%s", err.msg);
    static const struct {
        const char *name;
        tensor_type type;
        int n_dims;
        int64_t ne[4];
        size_t size;
        int seed; /* pattern seed; -1 for F32/F16 values */
    } want[] = {
        {"w.f32_1d", TENSOR_TYPE_F32, 1, {8, 1, 1, 1}, 32, -1},
        {"w.f32_2d", TENSOR_TYPE_F32, 2, {8, 3, 1, 1}, 96, -1},
        {"w.f32_4d", TENSOR_TYPE_F32, 4, {2, 3, 4, 5}, 480, -1},
        {"w.f16", TENSOR_TYPE_F16, 2, {16, 2, 1, 1}, 64, -1},
        {"w.bf16", TENSOR_TYPE_BF16, 2, {8, 2, 1, 1}, 32, 0},
        {"w.q4_0", TENSOR_TYPE_Q4_0, 2, {32, 2, 1, 1}, 36, 1},
        {"w.q4_1", TENSOR_TYPE_Q4_1, 2, {64, 3, 1, 1}, 120, 2},
        {"w.q5_0", TENSOR_TYPE_Q5_0, 2, {32, 1, 1, 1}, 22, 3},
        {"w.q5_1", TENSOR_TYPE_Q5_1, 2, {32, 2, 1, 1}, 48, 4},
        {"w.q8_0", TENSOR_TYPE_Q8_0, 2, {64, 4, 1, 1}, 272, 5},
        {"w.q4_k", TENSOR_TYPE_Q4_K, 2, {256, 2, 1, 1}, 288, 6},
        {"w.q5_k", TENSOR_TYPE_Q5_K, 2, {256, 1, 1, 1}, 176, 7},
        {"w.q6_k", TENSOR_TYPE_Q6_K, 2, {256, 1, 1, 1}, 210, 8},
    };
    const uint8_t *base = gguf_data_base(g);
    uint64_t expect_off = 0; /* the writer packs tensors in order, each padded to 64 */
    for (int i = 0; i < 13; i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        cr_assert(t);
        cr_assert_str_eq(t->name, want[i].name);
        cr_assert_eq(gguf_find_tensor(g, want[i].name), t);
        cr_assert_eq(t->type, want[i].type, "%s", t->name);
        cr_assert_eq(t->n_dims, want[i].n_dims, "%s", t->name);
        for (int d = 0; d < 4; d++) cr_assert_eq(t->ne[d], want[i].ne[d], "%s ne[%d]", t->name, d);
        cr_assert_eq(t->size, want[i].size, "%s", t->name);
        cr_assert_eq(t->offset, expect_off, "%s", t->name);
        cr_assert_eq(t->data, base + t->offset);
        cr_assert_eq((uintptr_t)t->data % 64, 0, "%s data not aligned in the mapping", t->name);
        expect_off += (t->size + 63) / 64 * 64;

        const uint8_t *p = t->data;
        if (want[i].seed >= 0) {
            for (size_t k = 0; k < t->size; k++) {
                cr_assert_eq(p[k], pattern_byte(k, want[i].seed), "%s byte %zu", t->name, k);
            }
        }
    }
    cr_assert_eq(gguf_file_size(g), 4032);

    float f[120];
    memcpy(f, gguf_find_tensor(g, "w.f32_1d")->data, 8 * sizeof(float));
    for (int k = 0; k < 8; k++) cr_assert_eq(f[k], k * 0.5f - 1.0f);
    memcpy(f, gguf_find_tensor(g, "w.f32_2d")->data, 24 * sizeof(float));
    for (int r = 0; r < 3; r++) {
        for (int c = 0; c < 8; c++) cr_assert_eq(f[r * 8 + c], (float)(r * 10 + c));
    }
    memcpy(f, gguf_find_tensor(g, "w.f32_4d")->data, 120 * sizeof(float));
    for (int k = 0; k < 120; k++) cr_assert_eq(f[k], (float)k);
    uint16_t h[32];
    memcpy(h, gguf_find_tensor(g, "w.f16")->data, sizeof h);
    for (int k = 0; k < 32; k++) cr_assert_eq(half_to_float(h[k]), (k - 8) * 0.25f, "f16[%d]", k);
    gguf_close(g);
}

Test(gguf, data_section_offset) {
    blob b = blob_load(ALL_TYPES);
    kv_error err = {{0}};
    gguf_file *g = gguf_open_memory(b.p, b.len, &err);
    cr_assert(g, "%s", err.msg);
    cr_assert_eq((const uint8_t *)gguf_data_base(g) - b.p, 1792);
    gguf_close(g);
    free(b.p);
}

Test(gguf, small_default_alignment) {
    kv_error err = {{0}};
    gguf_file *g = gguf_open(FIXTURE_DIR "small.gguf", &err);
    cr_assert(g, "%s", err.msg);
    cr_assert_eq(gguf_alignment(g), 32);
    cr_assert(!gguf_has_key(g, "general.alignment"));
    cr_assert_eq(gguf_tensor_count(g), 2);
    const gguf_tensor *t = gguf_find_tensor(g, "b");
    cr_assert(t && t->type == TENSOR_TYPE_Q8_0 && t->ne[0] == 32 && t->ne[1] == 2);
    cr_assert_eq(t->offset, 32);
    const uint8_t *p = t->data;
    for (size_t k = 0; k < t->size; k++) cr_assert_eq(p[k], pattern_byte(k, 1));
    cr_assert_eq((uintptr_t)gguf_data_base(g) % 32, 0);
    walk(g);
    gguf_close(g);
}

Test(gguf, version2_same_layout) {
    blob b = blob_load(ALL_TYPES);
    put_u32(&b, 4, 2);
    kv_error err = {{0}};
    gguf_file *g = gguf_open_memory(b.p, b.len, &err);
    cr_assert(g, "%s", err.msg);
    cr_assert_eq(gguf_version(g), 2);
    cr_assert_eq(gguf_tensor_count(g), 13);
    walk(g);
    gguf_close(g);
    free(b.p);
}

/* ---------------------------------------------------------------- the real model */

Test(gguf, real_model) {
    kv_error err = {{0}};
    cr_assert(access(TEST_MODEL_PATH, R_OK) == 0, "%s missing: run `make model`", TEST_MODEL_PATH);
    gguf_file *g = gguf_open(TEST_MODEL_PATH, &err);
    cr_assert(g, "%s", err.msg);
    cr_assert_eq(gguf_version(g), 3);
    cr_assert_eq(gguf_tensor_count(g), 272);
    cr_assert_eq(gguf_kv_count(g), 33);
    cr_assert_eq(gguf_file_size(g), 98362432);

    int64_t v;
    cr_assert_eq(gguf_get_i64(g, "llama.block_count", &v, &err), 0, "%s", err.msg);
    cr_assert_eq(v, 30);
    cr_assert_eq(gguf_get_i64(g, "llama.embedding_length", &v, &err), 0, "%s", err.msg);
    cr_assert_eq(v, 576);
    const char *s;
    size_t len;
    cr_assert_eq(gguf_get_str(g, "general.architecture", &s, &len, &err), 0, "%s", err.msg);
    cr_assert(len == 5 && memcmp(s, "llama", 5) == 0);
    double d;
    cr_assert_eq(gguf_get_f64(g, "llama.rope.freq_base", &d, &err), 0, "%s", err.msg);
    cr_assert_eq(d, 100000.0);
    bool b;
    cr_assert_eq(gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b, &err), 0, "%s", err.msg);
    cr_assert(!b);

    const gguf_tensor *t = gguf_find_tensor(g, "token_embd.weight");
    cr_assert(t);
    cr_assert_eq(t->type, TENSOR_TYPE_Q8_0);
    cr_assert(t->n_dims == 2 && t->ne[0] == 576 && t->ne[1] == 49152);
    cr_assert_eq(t->offset, 0);
    cr_assert_eq(t->size, 30081024);
    t = gguf_find_tensor(g, "blk.0.ffn_down.weight");
    cr_assert(t && t->type == TENSOR_TYPE_Q4_1 && t->ne[0] == 1536 && t->ne[1] == 576);
    cr_assert_eq(t->offset, 30083328);
    t = gguf_find_tensor(g, "output_norm.weight");
    cr_assert(t && t->type == TENSOR_TYPE_F32 && t->n_dims == 1 && t->ne[0] == 576);
    cr_assert_eq(t->offset, 96574464);
    cr_assert_eq((const uint8_t *)t->data + t->size,
                 (const uint8_t *)gguf_data_base(g) + 96574464 + 2304);

    gguf_array a;
    cr_assert_eq(gguf_get_array(g, "tokenizer.ggml.tokens", &a, &err), 0, "%s", err.msg);
    cr_assert(a.elem_type == GGUF_VALUE_TYPE_STRING && a.n == 49152);
    gguf_array_str(&a, 0, &s, &len);
    cr_assert(len == 13 && memcmp(s, "<|endoftext|>", 13) == 0);
    gguf_array_str(&a, 1, &s, &len);
    cr_assert(len == 12 && memcmp(s, "<|im_start|>", 12) == 0);
    gguf_array_str(&a, 49151, &s, &len);
    cr_assert(len == 7 && memcmp(s, "ectable", 7) == 0);
    cr_assert_eq(gguf_get_array(g, "tokenizer.ggml.merges", &a, &err), 0, "%s", err.msg);
    cr_assert(a.elem_type == GGUF_VALUE_TYPE_STRING && a.n == 48900);
    gguf_array_str(&a, 0, &s, &len);
    cr_assert(len == 4 && memcmp(s, "\xc4\xa0 t", 4) == 0);
    cr_assert_eq(gguf_get_array(g, "tokenizer.ggml.token_type", &a, &err), 0, "%s", err.msg);
    cr_assert(a.elem_type == GGUF_VALUE_TYPE_INT32 && a.n == 49152);
    cr_assert_eq(gguf_array_i64(&a, 0), 3);
    cr_assert_eq(gguf_array_i64(&a, 100), 1);
    walk(g);
    gguf_close(g);
}

/* ---------------------------------------------------------------- hand-built files */

Test(gguf, minimal_file_no_tensors) {
    builder b;
    b_header(&b, 0, 0);
    kv_error err = {{0}};
    gguf_file *g = gguf_open_memory(b.p, b.len, &err);
    cr_assert(g, "%s", err.msg);
    cr_assert_eq(gguf_kv_count(g), 0);
    cr_assert_eq(gguf_tensor_count(g), 0);
    cr_assert_eq(gguf_data_base(g), b.p + b.len); /* no padding needed without tensors */
    gguf_close(g);
}

Test(gguf, empty_arrays) {
    builder b;
    b_header(&b, 0, 2);
    b_str(&b, "a.empty_u32");
    b_u32(&b, GGUF_VALUE_TYPE_ARRAY);
    b_u32(&b, GGUF_VALUE_TYPE_UINT32);
    b_u64(&b, 0);
    b_str(&b, "a.empty_str");
    b_u32(&b, GGUF_VALUE_TYPE_ARRAY);
    b_u32(&b, GGUF_VALUE_TYPE_STRING);
    b_u64(&b, 0);
    kv_error err = {{0}};
    gguf_file *g = gguf_open_memory(b.p, b.len, &err);
    cr_assert(g, "%s", err.msg);
    gguf_array a;
    cr_assert_eq(gguf_get_array(g, "a.empty_u32", &a, &err), 0);
    cr_assert(a.n == 0 && a.elem_type == GGUF_VALUE_TYPE_UINT32);
    cr_assert_eq(gguf_get_array(g, "a.empty_str", &a, &err), 0);
    cr_assert(a.n == 0 && a.elem_type == GGUF_VALUE_TYPE_STRING);
    const char *s;
    size_t len;
    gguf_array_str(&a, 0, &s, &len);
    cr_assert_eq(len, 0);
    gguf_close(g);
}

Test(gguf, nested_arrays_rejected) {
    builder bb;
    b_header(&bb, 0, 1);
    b_str(&bb, "a.nested");
    b_u32(&bb, GGUF_VALUE_TYPE_ARRAY);
    b_u32(&bb, GGUF_VALUE_TYPE_ARRAY);
    b_u64(&bb, 1);
    b_u32(&bb, GGUF_VALUE_TYPE_UINT8);
    b_u64(&bb, 1);
    bb.p[bb.len++] = 7;
    blob b = {bb.p, bb.len};
    expect_fail(&b, "arrays of arrays", "a.nested");

    b = blob_load(FIXTURE_DIR "nested_array.gguf"); /* as the reference writer makes them */
    expect_fail(&b, "arrays of arrays", "test.nested");
    free(b.p);
}

/* ---------------------------------------------------------------- corrupt files */

Test(gguf, truncated_everywhere) {
    blob full = blob_load(ALL_TYPES);
    /* The file's data ends with the last tensor's bytes (w.q6_k, 210 bytes at 1792 + 1984);
     * only the padding after them may be cut. */
    size_t data_end = 1792 + 1984 + 210;
    kv_error err;
    for (size_t cut = 0; cut < data_end; cut++) {
        blob b = {full.p, cut};
        err.msg[0] = '\0';
        cr_assert(!parses(&b, &err), "parsed when cut at %zu", cut);
        cr_assert(strstr(err.msg, "truncated"), "cut at %zu: '%s'", cut, err.msg);
    }
    for (size_t cut = data_end; cut <= full.len; cut++) {
        blob b = {full.p, cut};
        cr_assert(parses(&b, &err), "cut at %zu: %s", cut, err.msg);
    }
    /* One example of the message: where, and what was being read. */
    size_t in_info = after_str(&full, "w.q8_0") + 4;
    blob b = {full.p, in_info + 3};
    expect_fail(&b, "truncated at offset", "tensor info 9 'w.q8_0'");
    free(full.p);
}

Test(gguf, mutated_header_bytes_never_crash) {
    blob full = blob_load(ALL_TYPES);
    static const uint8_t values[] = {0x00, 0x01, 0x7f, 0x80, 0xff};
    kv_error err;
    for (size_t off = 0; off < 1792; off++) {
        uint8_t orig = full.p[off];
        for (size_t v = 0; v < sizeof values; v++) {
            full.p[off] = values[v];
            uint8_t *copy = malloc(full.len);
            memcpy(copy, full.p, full.len);
            gguf_file *g = gguf_open_memory(copy, full.len, &err);
            if (g) {
                walk(g);
                gguf_close(g);
            } else {
                cr_assert(err.msg[0], "error without a message at %zu", off);
            }
            free(copy);
        }
        full.p[off] = orig;
    }
    free(full.p);
}

Test(gguf, bad_magic_and_versions) {
    blob b = blob_load(ALL_TYPES);
    b.p[0] = 'X';
    expect_fail(&b, "not a GGUF file", NULL);
    b.p[0] = 'G';
    put_u32(&b, 4, 1);
    expect_fail(&b, "version 1 is not supported", NULL);
    put_u32(&b, 4, 4);
    expect_fail(&b, "unsupported GGUF version 4", NULL);
    put_u32(&b, 4, 0x03000000);
    expect_fail(&b, "big-endian", NULL);
    put_u32(&b, 4, 3);
    blob empty = {b.p, 0};
    expect_fail(&empty, "truncated at offset 0", "header");
    free(b.p);
}

Test(gguf, huge_counts) {
    blob b = blob_load(ALL_TYPES);
    put_u64(&b, 8, UINT64_MAX);
    expect_fail(&b, "tensor count", "truncated or corrupt");
    put_u64(&b, 8, 13);
    put_u64(&b, 16, (uint64_t)1 << 60);
    expect_fail(&b, "key-value count", "truncated or corrupt");
    /* Each count alone fits in the 4008 bytes after the header, both together do not. */
    put_u64(&b, 8, 100);
    put_u64(&b, 16, 250);
    expect_fail(&b, "250 key-values and 100 tensor infos cannot fit", "truncated or corrupt");
    put_u64(&b, 8, 13);
    put_u64(&b, 16, 30);

    size_t arr = after_str(&b, "test.arr_u32") + 4 + 4; /* type, element type, then count */
    put_u64(&b, arr, (uint64_t)1 << 62);
    expect_fail(&b, "array length", "test.arr_u32");
    put_u64(&b, arr, UINT64_MAX);
    expect_fail(&b, "array length", "test.arr_u32");
    put_u64(&b, arr, 3);

    size_t sarr = after_str(&b, "test.arr_str") + 4 + 4;
    put_u64(&b, sarr, (uint64_t)1 << 40);
    expect_fail(&b, "string array length", "test.arr_str");
    put_u64(&b, sarr, 4);
    free(b.p);
}

Test(gguf, huge_string_lengths) {
    blob b = blob_load(ALL_TYPES);
    size_t val = after_str(&b, "test.str") + 4; /* the value's length field */
    put_u64(&b, val, (uint64_t)1 << 63);
    expect_fail(&b, "truncated", "'test.str'");
    put_u64(&b, val, UINT64_MAX);
    expect_fail(&b, "truncated", "'test.str'");
    put_u64(&b, val, 11);

    size_t key = find_str(&b, "test.u8"); /* a key's own length */
    put_u64(&b, key, UINT64_MAX - 3);
    expect_fail(&b, "truncated", "key 2");
    put_u64(&b, key, 7);

    size_t name = find_str(&b, "w.f16"); /* a tensor name's length */
    put_u64(&b, name, (uint64_t)1 << 50);
    expect_fail(&b, "truncated", "name of tensor info 3");
    put_u64(&b, name, 5);

    size_t elem = find_str(&b, "<|im_start|>"); /* a string inside an array */
    put_u64(&b, elem, UINT64_MAX);
    expect_fail(&b, "truncated", "test.arr_str");
    free(b.p);
}

Test(gguf, bad_value_types) {
    blob b = blob_load(ALL_TYPES);
    size_t type = after_str(&b, "test.u8");
    put_u32(&b, type, 13);
    expect_fail(&b, "unknown value type 13", "test.u8");
    put_u32(&b, type, 0xffffffff);
    expect_fail(&b, "unknown value type", "test.u8");
    put_u32(&b, type, GGUF_VALUE_TYPE_UINT8);

    size_t elem = after_str(&b, "test.arr_u8") + 4;
    put_u32(&b, elem, 77);
    expect_fail(&b, "unknown element type 77", "test.arr_u8");
    free(b.p);
}

Test(gguf, nul_in_names) {
    blob b = blob_load(ALL_TYPES);
    size_t key = find_str(&b, "test.u16");
    b.p[key + 8 + 4] = '\0';
    expect_fail(&b, "NUL", "key 4");
    b.p[key + 8 + 4] = '.';
    size_t name = find_str(&b, "w.q4_k");
    b.p[name + 8 + 1] = '\0';
    expect_fail(&b, "NUL", "tensor info 10");
    free(b.p);
}

Test(gguf, duplicates) {
    blob b = blob_load(ALL_TYPES);
    size_t key = find_str(&b, "test.i8");
    b.p[key + 8 + 5] = 'u'; /* test.i8 -> test.u8 */
    expect_fail(&b, "duplicate key 'test.u8'", NULL);
    b.p[key + 8 + 5] = 'i';

    size_t name = find_str(&b, "w.q4_1");
    b.p[name + 8 + 5] = '0'; /* w.q4_1 -> w.q4_0 */
    expect_fail(&b, "duplicate tensor name 'w.q4_0'", NULL);
    free(b.p);
}

Test(gguf, tensor_dims) {
    blob b = blob_load(ALL_TYPES);
    size_t nd = after_str(&b, "w.f32_2d");
    put_u32(&b, nd, 0);
    expect_fail(&b, "n_dims is 0", "w.f32_2d");
    put_u32(&b, nd, 5);
    expect_fail(&b, "n_dims is 5", "w.f32_2d");
    put_u32(&b, nd, 2);

    size_t ne1 = nd + 4 + 8;
    put_u64(&b, ne1, 0);
    expect_fail(&b, "dimension 1 is 0", "w.f32_2d");
    put_u64(&b, ne1, (uint64_t)1 << 63);
    expect_fail(&b, "dimension 1", "w.f32_2d");
    put_u64(&b, nd + 4, (uint64_t)1 << 40);
    put_u64(&b, ne1, (uint64_t)1 << 40);
    expect_fail(&b, "element count overflows", "w.f32_2d");
    put_u64(&b, nd + 4, (uint64_t)1 << 31); /* 2^62 elements fit int64; 2^64 bytes do not */
    put_u64(&b, ne1, (uint64_t)1 << 31);
    expect_fail(&b, "byte size overflows", "w.f32_2d");
    put_u64(&b, nd + 4, 8);
    put_u64(&b, ne1, 3);

    size_t q8 = after_str(&b, "w.q8_0") + 4;
    put_u64(&b, q8, 33);
    expect_fail(&b, "not a multiple of the Q8_0 block size 32", "w.q8_0");
    put_u64(&b, q8, 64);
    kv_error err;
    cr_assert(parses(&b, &err), "%s", err.msg); /* everything restored */
    free(b.p);
}

Test(gguf, tensor_types) {
    blob b = blob_load(ALL_TYPES);
    size_t type = after_str(&b, "w.q4_1") + 4 + 2 * 8;
    cr_assert_eq(get_u32(&b, type), TENSOR_TYPE_Q4_1);
    put_u32(&b, type, 10);
    expect_fail(&b, "tensor 'w.q4_1': unsupported type 10 (Q2_K)", NULL);
    put_u32(&b, type, 4);
    expect_fail(&b, "unsupported type 4 (Q4_2)", NULL);
    put_u32(&b, type, 23);
    expect_fail(&b, "unsupported type 23 (IQ4_XS)", NULL);
    put_u32(&b, type, 99);
    expect_fail(&b, "tensor 'w.q4_1': unknown type 99", NULL);
    /* kvserve's own repacked layouts are never read from a file */
    put_u32(&b, type, TENSOR_TYPE_Q4_1_L16);
    expect_fail(&b, "tensor 'w.q4_1': unknown type 65", NULL);
    put_u32(&b, type, 0x80000000u);
    expect_fail(&b, "unknown type 2147483648", NULL);
    free(b.p);
}

Test(gguf, tensor_offsets) {
    blob b = blob_load(ALL_TYPES);
    size_t off = after_str(&b, "w.f16") + 4 + 2 * 8 + 4;
    cr_assert_eq(get_u32(&b, off), 704);
    put_u64(&b, off, 705);
    expect_fail(&b, "offset 705 is not a multiple of the alignment 64", "w.f16");
    put_u64(&b, off, 4032);
    expect_fail(&b, "extends past the end", "w.f16");
    put_u64(&b, off, UINT64_MAX - 63);
    expect_fail(&b, "extends past the end", "w.f16");
    /* Ends exactly at the end of the data section: allowed. */
    put_u64(&b, off, 4032 - 1792 - 64);
    kv_error err;
    cr_assert(parses(&b, &err), "%s", err.msg);
    put_u64(&b, off, 4032 - 1792 - 64 + 64);
    expect_fail(&b, "extends past the end", "w.f16");
    free(b.p);
}

Test(gguf, bad_alignment) {
    blob b = blob_load(ALL_TYPES);
    size_t type = after_str(&b, "general.alignment");
    put_u32(&b, type + 4, 0);
    expect_fail(&b, "general.alignment", "non-zero power of two");
    put_u32(&b, type + 4, 3);
    expect_fail(&b, "is 3, expected a non-zero power of two", NULL);
    put_u32(&b, type + 4, 0x80000000u); /* valid, but the data section starts past the end */
    expect_fail(&b, "truncated", NULL);
    put_u32(&b, type + 4, 64);
    put_u32(&b, type, GGUF_VALUE_TYPE_INT32);
    expect_fail(&b, "general.alignment' has type INT32, expected UINT32", NULL);
    put_u32(&b, type, GGUF_VALUE_TYPE_UINT32);
    /* A smaller alignment is valid: the data section then starts right after the tensor infos
     * (1744, not 1792) and every offset, a multiple of 64, is a multiple of 16 too. */
    put_u32(&b, type + 4, 16);
    kv_error err = {{0}};
    gguf_file *g = gguf_open_memory(b.p, b.len, &err);
    cr_assert(g, "%s", err.msg);
    cr_assert_eq(gguf_alignment(g), 16);
    cr_assert_eq((const uint8_t *)gguf_data_base(g) - b.p, 1744);
    gguf_close(g);
    free(b.p);
}

/* ---------------------------------------------------------------- gguf_open errors */

Test(gguf, open_errors) {
    kv_error err = {{0}};
    cr_assert_null(gguf_open("tests/golden/gguf/does_not_exist.gguf", &err));
    cr_assert(strstr(err.msg, "does_not_exist.gguf: cannot open"), "%s", err.msg);
    cr_assert_null(gguf_open("tests/golden/gguf", &err));
    cr_assert(strstr(err.msg, "not a regular file"), "%s", err.msg);

    char *dir = tmpdir_create("gguf_test_");
    char path[256];
    snprintf(path, sizeof path, "%s/empty.gguf", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    cr_assert(fd >= 0);
    cr_assert_null(gguf_open(path, &err));
    cr_assert(strstr(err.msg, "file is empty"), "%s", err.msg);
    cr_assert_eq(write(fd, "GGUF\x01\0\0\0", 8), 8);
    cr_assert_null(gguf_open(path, &err));
    cr_assert(strstr(err.msg, path) && strstr(err.msg, "version 1"), "%s", err.msg);
    close(fd);
    free(dir);
}
