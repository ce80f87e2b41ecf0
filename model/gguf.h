/* GGUF reader: versions 2 and 3, read through mmap, every offset and length checked.
 * Spec: ggml's docs/gguf.md. Strings in the file are not NUL-terminated; the reader returns
 * pointer + length into the mapping for values and NUL-terminated copies for keys/names. */
#ifndef KVSERVE_GGUF_H
#define KVSERVE_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/quant.h"
#include "util/util.h"

typedef enum gguf_value_type {
    GGUF_VALUE_TYPE_UINT8 = 0,
    GGUF_VALUE_TYPE_INT8 = 1,
    GGUF_VALUE_TYPE_UINT16 = 2,
    GGUF_VALUE_TYPE_INT16 = 3,
    GGUF_VALUE_TYPE_UINT32 = 4,
    GGUF_VALUE_TYPE_INT32 = 5,
    GGUF_VALUE_TYPE_FLOAT32 = 6,
    GGUF_VALUE_TYPE_BOOL = 7,
    GGUF_VALUE_TYPE_STRING = 8,
    GGUF_VALUE_TYPE_ARRAY = 9,
    GGUF_VALUE_TYPE_UINT64 = 10,
    GGUF_VALUE_TYPE_INT64 = 11,
    GGUF_VALUE_TYPE_FLOAT64 = 12,
} gguf_value_type;

/* An array value: n elements of elem_type. For numeric types `data` points at the packed
 * little-endian elements in the mapping; they may be unaligned, so read them with memcpy or
 * gguf_array_i64/f64, never through a cast pointer. For strings use gguf_array_str.
 * Arrays of arrays are rejected at open (llama.cpp rejects them too). */
typedef struct gguf_array {
    gguf_value_type elem_type;
    uint64_t n;
    const void *data;
    const uint64_t *str_offsets; /* strings only: [n] offsets of each string's length field */
    const uint8_t *base;         /* strings only: mapping base for str_offsets */
} gguf_array;

typedef struct gguf_tensor {
    const char *name; /* NUL-terminated copy */
    int n_dims;       /* 1..4 */
    int64_t ne[4];    /* ne[0] is the contiguous (row) dimension; unused dims are 1 */
    tensor_type type;
    uint64_t offset;  /* from the start of the data section */
    size_t size;      /* bytes */
    const void *data; /* in the mapping */
} gguf_tensor;

typedef struct gguf_file gguf_file;

gguf_file *gguf_open(const char *path, kv_error *err);
/* Parses a buffer the caller keeps alive (fuzzing, tests). */
gguf_file *gguf_open_memory(const void *buf, size_t len, kv_error *err);
void gguf_close(gguf_file *g);

uint32_t gguf_version(const gguf_file *g);
size_t gguf_file_size(const gguf_file *g);
const void *gguf_data_base(const gguf_file *g); /* start of the tensor data section */
/* The whole pages inside [p, p + len) of the mapping leave the resident set (a copy of the
 * tensors is used instead); they come back from the file if read again. Nothing for a caller's
 * buffer (gguf_open_memory). */
void gguf_release_pages(const gguf_file *g, const void *p, size_t len);
size_t gguf_alignment(const gguf_file *g);           /* general.alignment, default 32 */
const char *gguf_value_type_name(gguf_value_type t); /* "UINT32"; "unknown" out of range */

/* Metadata. Lookups return 0 on success, -1 (with err) when missing or of an incompatible
 * type. Integer getters accept any integer type whose value fits; float getters accept F32/F64. */
int64_t gguf_kv_count(const gguf_file *g);
const char *gguf_kv_key(const gguf_file *g, int64_t i);      /* NULL when i is out of range */
gguf_value_type gguf_kv_type(const gguf_file *g, int64_t i); /* (gguf_value_type)-1 then */
bool gguf_has_key(const gguf_file *g, const char *key);
int gguf_get_i64(const gguf_file *g, const char *key, int64_t *out, kv_error *err);
int gguf_get_f64(const gguf_file *g, const char *key, double *out, kv_error *err);
int gguf_get_bool(const gguf_file *g, const char *key, bool *out, kv_error *err);
int gguf_get_str(const gguf_file *g, const char *key, const char **s, size_t *len, kv_error *err);
int gguf_get_array(const gguf_file *g, const char *key, gguf_array *out, kv_error *err);
/* Element i of a string array (i < a->n, checked at parse time). Not NUL-terminated. Gives ""
 * for a non-string array or i >= n. */
void gguf_array_str(const gguf_array *a, uint64_t i, const char **s, size_t *len);
/* Element i of a numeric array converted to double / int64 (i < a->n). BOOL gives 0/1; i64
 * saturates (UINT64 above INT64_MAX, out-of-range floats) and truncates floats toward zero;
 * NaN, strings and i >= n give 0. */
double gguf_array_f64(const gguf_array *a, uint64_t i);
int64_t gguf_array_i64(const gguf_array *a, uint64_t i);

/* Tensors. */
int64_t gguf_tensor_count(const gguf_file *g);
const gguf_tensor *gguf_tensor_at(const gguf_file *g, int64_t i);
const gguf_tensor *gguf_find_tensor(const gguf_file *g, const char *name); /* NULL if absent */

#endif
