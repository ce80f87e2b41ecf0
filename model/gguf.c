/* GGUF reader. Layout (ggml docs/gguf.md, versions 2 and 3 are identical on disk):
 *
 *   u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv x      { string key | u32 value_type | value }
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
 *   padding to general.alignment (default 32)
 *   tensor data; each tensor's offset is relative to the start of this section
 *
 * where string = u64 length + bytes (no NUL) and an array value = u32 elem_type + u64 n + elements.
 *
 * The file is untrusted: every length and count is checked against the bytes that remain before
 * it is used (so no allocation is ever larger than the file justifies), every sum and product is
 * overflow-checked, and nothing is read through a pointer that was not bounds-checked first.
 * Values in the mapping are unaligned (a u32 may follow a 5-byte string), so they are read with
 * memcpy, never through a cast pointer. */
#include "model/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* GGUF is little-endian on disk and the reader loads fields with memcpy. Big-endian hosts would
 * need byte swaps everywhere; kvserve targets x86-64 (and little-endian ARM) only. */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c assumes a little-endian host"
#endif

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_KEY_ALIGNMENT "general.alignment"
#define GGUF_MAX_DIMS 4

/* Smallest possible encodings, used to bound counts before allocating: a key-value pair is at
 * least an empty key (u64 length) + u32 type + a 1-byte value; a tensor info at least an empty
 * name + u32 n_dims + one u64 dimension + u32 type + u64 offset. */
#define GGUF_MIN_KV_BYTES (8 + 4 + 1)
#define GGUF_MIN_TENSOR_INFO_BYTES (8 + 4 + 8 + 4 + 8)

/* ---------------------------------------------------------------- types */

typedef struct gguf_kv {
    const char *key; /* NUL-terminated, in g->names */
    gguf_value_type type;
    size_t off;     /* scalars: the value bytes; strings: the u64 length field */
    gguf_array arr; /* arrays only */
} gguf_kv;

/* Open-addressing hash of names -> index, so duplicate checks and lookups stay O(1) even for a
 * hostile file with millions of tensors. slots[i] holds index + 1, 0 = empty. */
typedef struct name_index {
    int64_t *slots;
    size_t mask;
} name_index;

struct gguf_file {
    const uint8_t *buf; /* the whole file */
    size_t len;
    bool mapped; /* buf is our mmap (gguf_open), else the caller's buffer */
    uint32_t version;
    size_t alignment;
    size_t data_off; /* start of the tensor data section */

    int64_t n_kv;
    gguf_kv *kvs;       /* [n_kv] */
    size_t *kv_key_off; /* [n_kv] offset of each key in names */
    int64_t n_tensors;
    gguf_tensor *tensors;    /* [n_tensors] */
    size_t *tensor_name_off; /* [n_tensors] offset of each name in names */

    /* Every key and tensor name, NUL-terminated, back to back. It grows while parsing, so entries
     * refer to it by offset until parsing ends and the pointers are set. */
    char *names;
    size_t names_len, names_cap;

    name_index kv_index, tensor_index;
};

/* What the parser is reading, for error messages. Kept as fields and only formatted on error:
 * the real model has ~100k strings and formatting each context would dominate the parse. */
typedef enum parse_stage {
    PARSE_HEADER,
    PARSE_KEY,
    PARSE_VALUE,
    PARSE_TENSOR_NAME,
    PARSE_TENSOR_INFO,
} parse_stage;

typedef struct reader {
    const uint8_t *buf;
    size_t len;
    size_t pos;
    parse_stage stage;
    int64_t index;    /* key or tensor number */
    const char *name; /* key or tensor name once known (NUL-terminated), else NULL */
    kv_error *err;
} reader;

/* ---------------------------------------------------------------- names of things */

static const char *const VALUE_TYPE_NAMES[] = {
    [GGUF_VALUE_TYPE_UINT8] = "UINT8",     [GGUF_VALUE_TYPE_INT8] = "INT8",
    [GGUF_VALUE_TYPE_UINT16] = "UINT16",   [GGUF_VALUE_TYPE_INT16] = "INT16",
    [GGUF_VALUE_TYPE_UINT32] = "UINT32",   [GGUF_VALUE_TYPE_INT32] = "INT32",
    [GGUF_VALUE_TYPE_FLOAT32] = "FLOAT32", [GGUF_VALUE_TYPE_BOOL] = "BOOL",
    [GGUF_VALUE_TYPE_STRING] = "STRING",   [GGUF_VALUE_TYPE_ARRAY] = "ARRAY",
    [GGUF_VALUE_TYPE_UINT64] = "UINT64",   [GGUF_VALUE_TYPE_INT64] = "INT64",
    [GGUF_VALUE_TYPE_FLOAT64] = "FLOAT64",
};
#define VALUE_TYPE_COUNT (sizeof VALUE_TYPE_NAMES / sizeof VALUE_TYPE_NAMES[0])

const char *gguf_value_type_name(gguf_value_type t) {
    return (unsigned)t < VALUE_TYPE_COUNT ? VALUE_TYPE_NAMES[t] : "unknown";
}

/* GGML type ids (ggml.h enum ggml_type), including ones kvserve does not load, so that an error
 * can say "unsupported type 10 (Q2_K)" instead of a bare number. Gaps are ids ggml retired. */
static const char *const GGML_TYPE_NAMES[] = {
    [0] = "F32",     [1] = "F16",         [2] = "Q4_0",        [3] = "Q4_1",        [4] = "Q4_2",
    [5] = "Q4_3",    [6] = "Q5_0",        [7] = "Q5_1",        [8] = "Q8_0",        [9] = "Q8_1",
    [10] = "Q2_K",   [11] = "Q3_K",       [12] = "Q4_K",       [13] = "Q5_K",       [14] = "Q6_K",
    [15] = "Q8_K",   [16] = "IQ2_XXS",    [17] = "IQ2_XS",     [18] = "IQ3_XXS",    [19] = "IQ1_S",
    [20] = "IQ4_NL", [21] = "IQ3_S",      [22] = "IQ2_S",      [23] = "IQ4_XS",     [24] = "I8",
    [25] = "I16",    [26] = "I32",        [27] = "I64",        [28] = "F64",        [29] = "IQ1_M",
    [30] = "BF16",   [31] = "Q4_0_4_4",   [32] = "Q4_0_4_8",   [33] = "Q4_0_8_8",   [34] = "TQ1_0",
    [35] = "TQ2_0",  [36] = "IQ4_NL_4_4", [37] = "IQ4_NL_4_8", [38] = "IQ4_NL_8_8", [39] = "MXFP4",
    [40] = "NVFP4",  [41] = "Q1_0",
};
#define GGML_TYPE_NAME_COUNT (sizeof GGML_TYPE_NAMES / sizeof GGML_TYPE_NAMES[0])

static const char *ggml_type_name(uint32_t id) {
    return id < GGML_TYPE_NAME_COUNT && GGML_TYPE_NAMES[id] ? GGML_TYPE_NAMES[id] : NULL;
}

/* Bytes of one element of a fixed-size value type; 0 for strings, arrays and unknown types. */
static size_t value_type_size(uint32_t t) {
    switch (t) {
    case GGUF_VALUE_TYPE_UINT8:
    case GGUF_VALUE_TYPE_INT8:
    case GGUF_VALUE_TYPE_BOOL:
        return 1;
    case GGUF_VALUE_TYPE_UINT16:
    case GGUF_VALUE_TYPE_INT16:
        return 2;
    case GGUF_VALUE_TYPE_UINT32:
    case GGUF_VALUE_TYPE_INT32:
    case GGUF_VALUE_TYPE_FLOAT32:
        return 4;
    case GGUF_VALUE_TYPE_UINT64:
    case GGUF_VALUE_TYPE_INT64:
    case GGUF_VALUE_TYPE_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

/* ---------------------------------------------------------------- bounded reads */

static void reader_describe(const reader *r, char *out, size_t cap) {
    switch (r->stage) {
    case PARSE_HEADER:
        snprintf(out, cap, "the header");
        break;
    case PARSE_KEY:
        snprintf(out, cap, "key %lld", (long long)r->index);
        break;
    case PARSE_VALUE:
        snprintf(out, cap, "the value of key %lld '%.128s'", (long long)r->index, r->name);
        break;
    case PARSE_TENSOR_NAME:
        snprintf(out, cap, "the name of tensor info %lld", (long long)r->index);
        break;
    case PARSE_TENSOR_INFO:
        snprintf(out, cap, "tensor info %lld '%.128s'", (long long)r->index, r->name);
        break;
    }
}

/* Fails unless n more bytes are available. `what` says which field, for the message. */
static int reader_need(reader *r, uint64_t n, const char *what) {
    if (n <= r->len - r->pos) return 0;
    char ctx[200];
    reader_describe(r, ctx, sizeof ctx);
    return kv_fail(r->err,
                   "truncated at offset %zu while reading %s: %s needs %llu bytes at offset %zu",
                   r->len, ctx, what, (unsigned long long)n, r->pos);
}

static int reader_u32(reader *r, uint32_t *out, const char *what) {
    if (reader_need(r, 4, what)) return -1;
    memcpy(out, r->buf + r->pos, 4);
    r->pos += 4;
    return 0;
}

static int reader_u64(reader *r, uint64_t *out, const char *what) {
    if (reader_need(r, 8, what)) return -1;
    memcpy(out, r->buf + r->pos, 8);
    r->pos += 8;
    return 0;
}

/* A string's length field and bytes; *off is the offset of the length field. */
static int reader_string(reader *r, size_t *off, uint64_t *len, const char *what) {
    *off = r->pos;
    if (reader_u64(r, len, what)) return -1;
    if (reader_need(r, *len, what)) return -1;
    r->pos += (size_t)*len;
    return 0;
}

/* Fails unless n items of at least item_size bytes each can fit in what is left of the file.
 * Called before allocating anything sized by n. */
static int reader_check_count(reader *r, uint64_t n, size_t item_size, const char *what) {
    size_t left = r->len - r->pos;
    if (n <= left / item_size) return 0;
    char ctx[200];
    reader_describe(r, ctx, sizeof ctx);
    return kv_fail(r->err,
                   "%s %llu in %s needs at least %llu bytes but only %zu are left at offset %zu "
                   "(file truncated or corrupt)",
                   what, (unsigned long long)n, ctx,
                   n > UINT64_MAX / item_size ? UINT64_MAX : (unsigned long long)(n * item_size),
                   left, r->pos);
}

/* ---------------------------------------------------------------- names and their index */

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static int name_index_init(name_index *ix, int64_t n) {
    size_t cap = 8;
    while (cap / 2 < (size_t)n) {
        if (cap > SIZE_MAX / 4) return -1;
        cap *= 2;
    }
    ix->slots = calloc(cap, sizeof *ix->slots);
    ix->mask = cap - 1;
    return ix->slots ? 0 : -1;
}

/* Finds name; returns its index or -1. With insert_index >= 0, inserts it when absent. The
 * caller sized the table for every insert, so there is always an empty slot. */
static int64_t name_index_find(const name_index *ix, const char *names, const size_t *name_off,
                               const char *name, int64_t insert_index) {
    if (!ix->slots) return -1;
    size_t i = (size_t)name_hash(name) & ix->mask;
    for (;; i = (i + 1) & ix->mask) {
        int64_t e = ix->slots[i];
        if (e == 0) break;
        if (strcmp(names + name_off[e - 1], name) == 0) return e - 1;
    }
    if (insert_index >= 0) ix->slots[i] = insert_index + 1;
    return -1;
}

/* Copies a file string into g->names (NUL-terminated) and returns its offset there. Names are
 * handed out as C strings, so an embedded NUL would silently shorten them: rejected. */
static int names_add(gguf_file *g, reader *r, size_t str_off, uint64_t len, const char *what,
                     size_t *out) {
    const char *s = (const char *)r->buf + str_off + 8;
    if (memchr(s, '\0', (size_t)len)) {
        char ctx[200];
        reader_describe(r, ctx, sizeof ctx);
        return kv_fail(r->err, "%s contains a NUL byte (string at offset %zu)", ctx, str_off);
    }
    size_t need;
    if (size_add(g->names_len, (size_t)len + 1, &need)) goto oom;
    if (need > g->names_cap) {
        size_t cap = g->names_cap ? g->names_cap : 4096;
        while (cap < need) {
            if (cap > SIZE_MAX / 2) goto oom;
            cap *= 2;
        }
        char *p = realloc(g->names, cap);
        if (!p) goto oom;
        g->names = p;
        g->names_cap = cap;
    }
    memcpy(g->names + g->names_len, s, (size_t)len);
    g->names[g->names_len + len] = '\0';
    *out = g->names_len;
    g->names_len = need;
    return 0;
oom:
    return kv_fail(r->err, "out of memory copying %s", what);
}

/* ---------------------------------------------------------------- parsing: key-values */

static int parse_array(reader *r, gguf_kv *kv) {
    uint32_t elem_type;
    uint64_t n;
    if (reader_u32(r, &elem_type, "the array element type")) return -1;
    if (reader_u64(r, &n, "the array length")) return -1;
    kv->arr.elem_type = (gguf_value_type)elem_type;
    kv->arr.n = n;
    kv->arr.data = r->buf + r->pos;
    if (elem_type == GGUF_VALUE_TYPE_ARRAY) {
        /* llama.cpp rejects them too, so no model has them; gguf_array could not describe one. */
        return kv_fail(r->err, "key '%s': arrays of arrays are not supported", kv->key);
    }
    if (elem_type == GGUF_VALUE_TYPE_STRING) {
        /* Index every element's offset now, so gguf_array_str is O(1) (token tables). */
        if (reader_check_count(r, n, 8, "string array length")) return -1;
        if (n == 0) return 0;
        uint64_t *offs = malloc((size_t)n * sizeof *offs);
        if (!offs) {
            return kv_fail(r->err, "key '%s': out of memory for %llu strings", kv->key,
                           (unsigned long long)n);
        }
        kv->arr.str_offsets = offs;
        kv->arr.base = r->buf;
        for (uint64_t i = 0; i < n; i++) {
            size_t off;
            uint64_t len;
            if (reader_string(r, &off, &len, "an array string")) return -1;
            offs[i] = off;
        }
        return 0;
    }
    size_t esize = value_type_size(elem_type);
    if (esize == 0) {
        return kv_fail(r->err, "key '%s': array has unknown element type %u", kv->key, elem_type);
    }
    if (reader_check_count(r, n, esize, "array length")) return -1;
    r->pos += (size_t)n * esize;
    return 0;
}

static int parse_kv(gguf_file *g, reader *r, int64_t i) {
    gguf_kv *kv = &g->kvs[i];
    r->stage = PARSE_KEY;
    r->index = i;
    r->name = NULL;

    size_t str_off;
    uint64_t len;
    if (reader_string(r, &str_off, &len, "the key")) return -1;
    if (names_add(g, r, str_off, len, "key", &g->kv_key_off[i])) return -1;
    /* g->names may move while later names are added, so the pointer is only valid for now;
     * parse_file sets the final pointers once parsing ends. */
    kv->key = g->names + g->kv_key_off[i];
    r->name = kv->key;
    r->stage = PARSE_VALUE;

    int64_t prev = name_index_find(&g->kv_index, g->names, g->kv_key_off, kv->key, i);
    if (prev >= 0) {
        return kv_fail(r->err, "duplicate key '%s' (key %lld and key %lld)", kv->key,
                       (long long)prev, (long long)i);
    }

    uint32_t type;
    if (reader_u32(r, &type, "the value type")) return -1;
    kv->type = (gguf_value_type)type;
    kv->off = r->pos;
    if (type == GGUF_VALUE_TYPE_STRING) {
        size_t off;
        return reader_string(r, &off, &len, "the string value");
    }
    if (type == GGUF_VALUE_TYPE_ARRAY) return parse_array(r, kv);
    size_t size = value_type_size(type);
    if (size == 0) return kv_fail(r->err, "key '%s' has unknown value type %u", kv->key, type);
    if (reader_need(r, size, gguf_value_type_name(kv->type))) return -1;
    r->pos += size;
    return 0;
}

/* ---------------------------------------------------------------- parsing: tensor infos */

static int parse_tensor_info(gguf_file *g, reader *r, int64_t i) {
    gguf_tensor *t = &g->tensors[i];
    r->stage = PARSE_TENSOR_NAME;
    r->index = i;
    r->name = NULL;

    size_t str_off;
    uint64_t len;
    if (reader_string(r, &str_off, &len, "the name")) return -1;
    if (names_add(g, r, str_off, len, "tensor name", &g->tensor_name_off[i])) return -1;
    const char *name = g->names + g->tensor_name_off[i];
    t->name = name; /* provisional, as for keys */
    r->name = name;
    r->stage = PARSE_TENSOR_INFO;

    int64_t prev = name_index_find(&g->tensor_index, g->names, g->tensor_name_off, name, i);
    if (prev >= 0) {
        return kv_fail(r->err, "duplicate tensor name '%s' (tensor %lld and tensor %lld)", name,
                       (long long)prev, (long long)i);
    }

    uint32_t n_dims;
    if (reader_u32(r, &n_dims, "n_dims")) return -1;
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS) {
        return kv_fail(r->err, "tensor '%s': n_dims is %u, expected 1..%d", name, n_dims,
                       GGUF_MAX_DIMS);
    }
    t->n_dims = (int)n_dims;
    int64_t n_elem = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        uint64_t ne = 1;
        if ((uint32_t)d < n_dims && reader_u64(r, &ne, "a dimension")) return -1;
        /* ggml keeps ne as int64_t; a zero-sized tensor has no use in a model and would put
         * a division by zero or an empty loop in every consumer. */
        if (ne == 0 || ne > INT64_MAX) {
            return kv_fail(r->err, "tensor '%s': dimension %d is %lld, expected >= 1", name, d,
                           (long long)ne);
        }
        t->ne[d] = (int64_t)ne;
        if (__builtin_mul_overflow(n_elem, t->ne[d], &n_elem)) {
            return kv_fail(r->err, "tensor '%s': element count overflows int64", name);
        }
    }

    uint32_t type_id;
    if (reader_u32(r, &type_id, "the type")) return -1;
    const tensor_type_traits *tr = type_id <= INT_MAX ? tensor_type_get((int)type_id) : NULL;
    if (!tr || tr->internal) {
        const char *tn = ggml_type_name(type_id);
        if (tn) {
            return kv_fail(r->err, "tensor '%s': unsupported type %u (%s)", name, type_id, tn);
        }
        return kv_fail(r->err, "tensor '%s': unknown type %u", name, type_id);
    }
    t->type = (tensor_type)type_id;
    if (t->ne[0] % tr->block_size != 0) {
        return kv_fail(r->err,
                       "tensor '%s': row length %lld is not a multiple of the %s block size %d",
                       name, (long long)t->ne[0], tr->name, tr->block_size);
    }
    /* n_elem fits in int64, so rows fits too; the byte size may still overflow. */
    size_t row = tensor_row_size(t->type, t->ne[0]);
    size_t rows = (size_t)(n_elem / t->ne[0]);
    if (size_mul(row, rows, &t->size)) {
        return kv_fail(r->err, "tensor '%s': byte size overflows", name);
    }
    return reader_u64(r, &t->offset, "the data offset");
}

/* Once the data section's start is known: place every tensor in it. */
static int place_tensors(gguf_file *g, kv_error *err) {
    size_t data_len = g->len - g->data_off;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        gguf_tensor *t = &g->tensors[i];
        if (t->offset % g->alignment != 0) {
            return kv_fail(err,
                           "tensor '%s': data offset %llu is not a multiple of the alignment %zu",
                           t->name, (unsigned long long)t->offset, g->alignment);
        }
        if (t->offset > data_len || t->size > data_len - t->offset) {
            return kv_fail(err,
                           "tensor '%s': data at offset %llu + %zu bytes extends past the end of "
                           "the data section (%zu bytes at file offset %zu; file truncated?)",
                           t->name, (unsigned long long)t->offset, t->size, data_len, g->data_off);
        }
        t->data = g->buf + g->data_off + t->offset;
    }
    return 0;
}

/* general.alignment: the spec says UINT32 and a non-zero power of two. */
static int read_alignment(gguf_file *g, kv_error *err) {
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = name_index_find(&g->kv_index, g->names, g->kv_key_off, GGUF_KEY_ALIGNMENT, -1);
    if (i < 0) return 0;
    const gguf_kv *kv = &g->kvs[i];
    if (kv->type != GGUF_VALUE_TYPE_UINT32) {
        return kv_fail(err, "key '%s' has type %s, expected UINT32", GGUF_KEY_ALIGNMENT,
                       gguf_value_type_name(kv->type));
    }
    uint32_t a;
    memcpy(&a, g->buf + kv->off, 4);
    if (a == 0 || (a & (a - 1)) != 0) {
        return kv_fail(err, "key '%s' is %u, expected a non-zero power of two", GGUF_KEY_ALIGNMENT,
                       a);
    }
    g->alignment = a;
    return 0;
}

/* ---------------------------------------------------------------- open and close */

static int parse_header(gguf_file *g, reader *r) {
    r->stage = PARSE_HEADER;
    if (reader_need(r, 4, "the magic")) return -1;
    if (memcmp(r->buf, GGUF_MAGIC, 4) != 0) {
        const uint8_t *m = r->buf;
        return kv_fail(r->err, "not a GGUF file: magic is %02x %02x %02x %02x, expected \"GGUF\"",
                       m[0], m[1], m[2], m[3]);
    }
    r->pos = 4;
    if (reader_u32(r, &g->version, "the version")) return -1;
    if (g->version == 1) {
        /* v1 used 32-bit counts and lengths: a different layout, and long obsolete. */
        return kv_fail(r->err, "GGUF version 1 is not supported (only versions 2 and 3); "
                               "re-convert the model with a current llama.cpp");
    }
    if (g->version != 2 && g->version != 3) {
        uint32_t swapped = __builtin_bswap32(g->version);
        if (swapped >= 1 && swapped <= 3) {
            return kv_fail(r->err, "big-endian GGUF (version %u) is not supported", swapped);
        }
        return kv_fail(r->err, "unsupported GGUF version %u (only versions 2 and 3)", g->version);
    }
    uint64_t n_tensors, n_kv;
    if (reader_u64(r, &n_tensors, "the tensor count")) return -1;
    if (reader_u64(r, &n_kv, "the key-value count")) return -1;
    /* Both tables must fit in what follows: bound them before anything is sized by them. */
    if (reader_check_count(r, n_kv, GGUF_MIN_KV_BYTES, "key-value count")) return -1;
    if (reader_check_count(r, n_tensors, GGUF_MIN_TENSOR_INFO_BYTES, "tensor count")) return -1;
    size_t left = r->len - r->pos;
    if (n_tensors > (left - n_kv * GGUF_MIN_KV_BYTES) / GGUF_MIN_TENSOR_INFO_BYTES) {
        return kv_fail(r->err,
                       "%llu key-values and %llu tensor infos cannot fit in the %zu bytes after "
                       "the header (file truncated or corrupt)",
                       (unsigned long long)n_kv, (unsigned long long)n_tensors, left);
    }
    g->n_kv = (int64_t)n_kv;
    g->n_tensors = (int64_t)n_tensors;
    return 0;
}

static int parse_file(gguf_file *g, kv_error *err) {
    reader r = {.buf = g->buf, .len = g->len, .err = err};
    if (parse_header(g, &r)) return -1;

    g->kvs = calloc((size_t)g->n_kv + 1, sizeof *g->kvs);
    g->kv_key_off = calloc((size_t)g->n_kv + 1, sizeof *g->kv_key_off);
    g->tensors = calloc((size_t)g->n_tensors + 1, sizeof *g->tensors);
    g->tensor_name_off = calloc((size_t)g->n_tensors + 1, sizeof *g->tensor_name_off);
    if (!g->kvs || !g->kv_key_off || !g->tensors || !g->tensor_name_off ||
        name_index_init(&g->kv_index, g->n_kv) || name_index_init(&g->tensor_index, g->n_tensors)) {
        return kv_fail(err, "out of memory for %lld keys and %lld tensors", (long long)g->n_kv,
                       (long long)g->n_tensors);
    }

    for (int64_t i = 0; i < g->n_kv; i++) {
        if (parse_kv(g, &r, i)) return -1;
    }
    for (int64_t i = 0; i < g->n_tensors; i++) {
        if (parse_tensor_info(g, &r, i)) return -1;
    }

    /* Parsing is over and g->names will not move again: hand out the final pointers. */
    for (int64_t i = 0; i < g->n_kv; i++) g->kvs[i].key = g->names + g->kv_key_off[i];
    for (int64_t i = 0; i < g->n_tensors; i++) {
        g->tensors[i].name = g->names + g->tensor_name_off[i];
    }

    if (read_alignment(g, err)) return -1;
    size_t data_off;
    if (size_add(r.pos, g->alignment - 1, &data_off)) {
        return kv_fail(err, "data section offset overflows");
    }
    data_off &= ~(g->alignment - 1);
    if (data_off > g->len) {
        /* A file without tensors need not carry the padding; one with tensors must. */
        if (g->n_tensors > 0) {
            return kv_fail(err,
                           "truncated at offset %zu: the data section should start at offset %zu",
                           g->len, data_off);
        }
        data_off = g->len;
    }
    g->data_off = data_off;
    return place_tensors(g, err);
}

gguf_file *gguf_open_memory(const void *buf, size_t len, kv_error *err) {
    gguf_file *g = calloc(1, sizeof *g);
    if (!g) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    g->buf = buf;
    g->len = len;
    if (!buf && len > 0) {
        kv_fail(err, "NULL buffer");
        goto fail;
    }
    if (parse_file(g, err)) goto fail;
    return g;
fail:
    gguf_close(g);
    return NULL;
}

gguf_file *gguf_open(const char *path, kv_error *err) {
    void *map = MAP_FAILED;
    size_t len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        kv_fail(err, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        kv_fail(err, "%s: cannot stat: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        kv_fail(err, "%s: not a regular file", path);
        goto fail;
    }
    if (st.st_size == 0) {
        kv_fail(err, "%s: file is empty", path);
        goto fail;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        kv_fail(err, "%s: file too large to map", path);
        goto fail;
    }
    len = (size_t)st.st_size;
    /* Read-only and private: weights are used in place and never copied. (If another process
     * truncates the file while it is mapped, touching the lost pages raises SIGBUS; model files
     * are not expected to change under a running server.) */
    map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        kv_fail(err, "%s: cannot mmap %zu bytes: %s", path, len, strerror(errno));
        goto fail;
    }
    close(fd);
    fd = -1;

    gguf_file *g = gguf_open_memory(map, len, err);
    if (!g) {
        kv_fail_wrap(err, "%s", path);
        goto fail;
    }
    g->mapped = true;
    log_debug("gguf: %s: version %u, %lld keys, %lld tensors, alignment %zu, data at %zu", path,
              g->version, (long long)g->n_kv, (long long)g->n_tensors, g->alignment, g->data_off);
    return g;
fail:
    if (map != MAP_FAILED) munmap(map, len);
    if (fd >= 0) close(fd);
    return NULL;
}

void gguf_release_pages(const gguf_file *g, const void *p, size_t len) {
    if (!g || !g->mapped || !p || !len) return;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t)p + page - 1) & ~(page - 1);
    const uintptr_t hi = ((uintptr_t)p + len) & ~(page - 1);
    /* a read-only private file mapping: dropped pages are read from the file again */
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void gguf_close(gguf_file *g) {
    if (!g) return;
    if (g->kvs) {
        for (int64_t i = 0; i < g->n_kv; i++) free((void *)g->kvs[i].arr.str_offsets);
    }
    free(g->kvs);
    free(g->kv_key_off);
    free(g->tensors);
    free(g->tensor_name_off);
    free(g->names);
    free(g->kv_index.slots);
    free(g->tensor_index.slots);
    if (g->mapped) munmap((void *)g->buf, g->len);
    free(g);
}

/* ---------------------------------------------------------------- file */

uint32_t gguf_version(const gguf_file *g) { return g->version; }
size_t gguf_file_size(const gguf_file *g) { return g->len; }
size_t gguf_alignment(const gguf_file *g) { return g->alignment; }
const void *gguf_data_base(const gguf_file *g) { return g->buf + g->data_off; }

/* ---------------------------------------------------------------- metadata */

int64_t gguf_kv_count(const gguf_file *g) { return g->n_kv; }

const char *gguf_kv_key(const gguf_file *g, int64_t i) {
    return i >= 0 && i < g->n_kv ? g->kvs[i].key : NULL;
}

gguf_value_type gguf_kv_type(const gguf_file *g, int64_t i) {
    return i >= 0 && i < g->n_kv ? g->kvs[i].type : (gguf_value_type)-1;
}

static const gguf_kv *kv_find(const gguf_file *g, const char *key) {
    if (!g || !key) return NULL;
    int64_t i = name_index_find(&g->kv_index, g->names, g->kv_key_off, key, -1);
    return i >= 0 ? &g->kvs[i] : NULL;
}

bool gguf_has_key(const gguf_file *g, const char *key) { return kv_find(g, key) != NULL; }

static const gguf_kv *kv_lookup(const gguf_file *g, const char *key, kv_error *err) {
    const gguf_kv *kv = kv_find(g, key);
    if (!kv) kv_fail(err, "key '%s' not found", key ? key : "(null)");
    return kv;
}

static int kv_wrong_type(const gguf_kv *kv, const char *expected, kv_error *err) {
    if (kv->type == GGUF_VALUE_TYPE_ARRAY) {
        return kv_fail(err, "key '%s' has type ARRAY of %s, expected %s", kv->key,
                       gguf_value_type_name(kv->arr.elem_type), expected);
    }
    return kv_fail(err, "key '%s' has type %s, expected %s", kv->key,
                   gguf_value_type_name(kv->type), expected);
}

/* Loads an integer value of type t from p (unaligned). Returns 0 with the value in *v; 1 for a
 * UINT64 above INT64_MAX, with *v saturated and the value in *u, so each caller decides what
 * "does not fit" means; -1 when t is not an integer type. */
static int load_int(const uint8_t *p, gguf_value_type t, int64_t *v, uint64_t *u) {
    bool is_signed;
    switch (t) {
    case GGUF_VALUE_TYPE_UINT8:
    case GGUF_VALUE_TYPE_UINT16:
    case GGUF_VALUE_TYPE_UINT32:
    case GGUF_VALUE_TYPE_UINT64:
        is_signed = false;
        break;
    case GGUF_VALUE_TYPE_INT8:
    case GGUF_VALUE_TYPE_INT16:
    case GGUF_VALUE_TYPE_INT32:
    case GGUF_VALUE_TYPE_INT64:
        is_signed = true;
        break;
    default:
        return -1;
    }
    size_t size = value_type_size(t);
    uint64_t raw = 0;
    memcpy(&raw, p, size); /* little-endian: the value lands in the low bytes */
    *u = raw;
    if (size == 8) {
        if (is_signed) {
            memcpy(v, &raw, 8);
            return 0;
        }
        *v = raw <= INT64_MAX ? (int64_t)raw : INT64_MAX;
        return raw > INT64_MAX;
    }
    if (is_signed) {
        /* Sign-extend without implementation-defined narrowing conversions. */
        uint64_t m = 1ull << (size * 8 - 1);
        *v = (int64_t)(raw ^ m) - (int64_t)m;
    } else {
        *v = (int64_t)raw;
    }
    return 0;
}

/* Loads a FLOAT32/FLOAT64 value from p (unaligned); -1 for any other type. */
static int load_float(const uint8_t *p, gguf_value_type t, double *out) {
    if (t == GGUF_VALUE_TYPE_FLOAT32) {
        float f;
        memcpy(&f, p, 4);
        *out = f;
        return 0;
    }
    if (t == GGUF_VALUE_TYPE_FLOAT64) {
        memcpy(out, p, 8);
        return 0;
    }
    return -1;
}

int gguf_get_i64(const gguf_file *g, const char *key, int64_t *out, kv_error *err) {
    const gguf_kv *kv = kv_lookup(g, key, err);
    if (!kv) return -1;
    int64_t v;
    uint64_t u;
    int r = load_int(g->buf + kv->off, kv->type, &v, &u);
    if (r < 0) return kv_wrong_type(kv, "an integer", err);
    if (r > 0) {
        return kv_fail(err, "key '%s': UINT64 value %llu does not fit in int64", key,
                       (unsigned long long)u);
    }
    *out = v;
    return 0;
}

int gguf_get_f64(const gguf_file *g, const char *key, double *out, kv_error *err) {
    const gguf_kv *kv = kv_lookup(g, key, err);
    if (!kv) return -1;
    if (load_float(g->buf + kv->off, kv->type, out)) {
        return kv_wrong_type(kv, "FLOAT32 or FLOAT64", err);
    }
    return 0;
}

int gguf_get_bool(const gguf_file *g, const char *key, bool *out, kv_error *err) {
    const gguf_kv *kv = kv_lookup(g, key, err);
    if (!kv) return -1;
    if (kv->type != GGUF_VALUE_TYPE_BOOL) return kv_wrong_type(kv, "BOOL", err);
    *out = g->buf[kv->off] != 0;
    return 0;
}

int gguf_get_str(const gguf_file *g, const char *key, const char **s, size_t *len, kv_error *err) {
    const gguf_kv *kv = kv_lookup(g, key, err);
    if (!kv) return -1;
    if (kv->type != GGUF_VALUE_TYPE_STRING) return kv_wrong_type(kv, "STRING", err);
    uint64_t n;
    memcpy(&n, g->buf + kv->off, 8);
    *s = (const char *)g->buf + kv->off + 8;
    *len = (size_t)n;
    return 0;
}

int gguf_get_array(const gguf_file *g, const char *key, gguf_array *out, kv_error *err) {
    const gguf_kv *kv = kv_lookup(g, key, err);
    if (!kv) return -1;
    if (kv->type != GGUF_VALUE_TYPE_ARRAY) return kv_wrong_type(kv, "ARRAY", err);
    *out = kv->arr;
    return 0;
}

void gguf_array_str(const gguf_array *a, uint64_t i, const char **s, size_t *len) {
    if (a->elem_type != GGUF_VALUE_TYPE_STRING || i >= a->n) {
        *s = "";
        *len = 0;
        return;
    }
    const uint8_t *p = a->base + a->str_offsets[i];
    uint64_t n;
    memcpy(&n, p, 8);
    *s = (const char *)p + 8;
    *len = (size_t)n;
}

double gguf_array_f64(const gguf_array *a, uint64_t i) {
    if (i >= a->n) return 0.0;
    const uint8_t *p = (const uint8_t *)a->data + i * value_type_size(a->elem_type);
    double d;
    if (load_float(p, a->elem_type, &d) == 0) return d;
    if (a->elem_type == GGUF_VALUE_TYPE_BOOL) return p[0] != 0;
    int64_t v;
    uint64_t u;
    int r = load_int(p, a->elem_type, &v, &u);
    return r < 0 ? 0.0 : r > 0 ? (double)u : (double)v;
}

int64_t gguf_array_i64(const gguf_array *a, uint64_t i) {
    if (i >= a->n) return 0;
    const uint8_t *p = (const uint8_t *)a->data + i * value_type_size(a->elem_type);
    double d;
    if (load_float(p, a->elem_type, &d) == 0) {
        /* Converting an out-of-range double to int64 is undefined behaviour: saturate. */
        if (d != d) return 0;
        if (d >= 9223372036854775807.0) return INT64_MAX;
        if (d <= -9223372036854775808.0) return INT64_MIN;
        return (int64_t)d;
    }
    if (a->elem_type == GGUF_VALUE_TYPE_BOOL) return p[0] != 0;
    int64_t v;
    uint64_t u;
    return load_int(p, a->elem_type, &v, &u) < 0 ? 0 : v;
}

/* ---------------------------------------------------------------- tensors */

int64_t gguf_tensor_count(const gguf_file *g) { return g->n_tensors; }

const gguf_tensor *gguf_tensor_at(const gguf_file *g, int64_t i) {
    return i >= 0 && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *g, const char *name) {
    if (!g || !name) return NULL;
    int64_t i = name_index_find(&g->tensor_index, g->names, g->tensor_name_off, name, -1);
    return i >= 0 ? &g->tensors[i] : NULL;
}
