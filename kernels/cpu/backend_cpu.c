/* The CPU backend: lifetime and the dense ops (matmul, RMSNorm, RoPE, SwiGLU). Attention and
 * the KV pool's copies are in attention.c. Every op splits its work over the thread pool; ops
 * too small to pay for a hand-off (a decode step's norms) run on the calling thread. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

/* Below this many elements an elementwise op runs on one thread. */
#define SERIAL_ELEMS 32768

/* ---------------------------------------------------------------- lifetime */

static const backend_ops cpu_backend_ops;

backend *backend_cpu_create(int n_threads, kv_error *err) {
    cpu_backend *b = calloc(1, sizeof *b);
    if (!b) {
        kv_fail(err, "out of memory creating the CPU backend");
        return NULL;
    }
    b->base.ops = &cpu_backend_ops;
    b->base.host_memory = true;
    b->n_threads = n_threads;
    b->tp = threadpool_create(n_threads, err);
    if (!b->tp) goto fail;
    b->attn_scratch = calloc((size_t)n_threads, sizeof *b->attn_scratch);
    b->wdq = calloc((size_t)n_threads, sizeof *b->wdq);
    if (!b->attn_scratch || !b->wdq) {
        kv_fail(err, "out of memory creating the CPU backend");
        goto fail;
    }
    log_debug("cpu backend: %d threads, SIMD %s", n_threads, simd_level_name(simd_level_get()));
    return &b->base;
fail:
    backend_destroy(&b->base);
    return NULL;
}

static void cpu_destroy(backend *bk) {
    cpu_backend *b = cpu_of(bk);
    threadpool_destroy(b->tp);
    if (b->attn_scratch)
        for (int i = 0; i < b->n_threads; i++) kv_aligned_free(b->attn_scratch[i]);
    free(b->attn_scratch);
    if (b->wdq)
        for (int i = 0; i < b->n_threads; i++) kv_aligned_free(b->wdq[i]);
    free(b->wdq);
    kv_aligned_free(b->act_buf);
    free(b);
}

static const char *cpu_name(const backend *b) {
    (void)b;
    return "cpu";
}

static int cpu_n_threads(const backend *b) { return ((const cpu_backend *)b)->n_threads; }

static void cpu_set_precision(backend *b, matmul_precision p) { cpu_of(b)->precision = p; }

int cpu_act_reserve(cpu_backend *b, size_t n) {
    if (n <= b->act_cap) return 0;
    void *p = kv_aligned_alloc(n);
    if (!p) return -1;
    kv_aligned_free(b->act_buf);
    b->act_buf = p;
    b->act_cap = n;
    return 0;
}

/* The activation buffer for the widest matmul at once (the other scratch grows with its first
 * use: attention's with the context, which no limit bounds). */
static int cpu_reserve(backend *bk, const backend_limits *lim, kv_error *err) {
    size_t row = tensor_row_size(TENSOR_TYPE_Q8_1, lim->max_n_in);
    size_t rowk = tensor_row_size(TENSOR_TYPE_Q8_K, lim->max_n_in);
    row = rowk > row ? rowk : row;
    if (cpu_act_reserve(cpu_of(bk), row * (size_t)lim->max_tokens) != 0)
        return kv_fail(err, "out of memory reserving matmul scratch for %d tokens",
                       lim->max_tokens);
    return 0;
}

/* ---------------------------------------------------------------- memory */

/* Backend memory is host memory: uploads and downloads are copies, streams and events are
 * placeholders (every op has finished when it returns). */
static void *cpu_alloc(backend *b, size_t bytes) {
    (void)b;
    return kv_aligned_alloc(bytes);
}

static void cpu_free(backend *b, void *p) {
    (void)b;
    kv_aligned_free(p);
}

static const void *cpu_weight_data(backend *b, const void *host, size_t bytes, kv_error *err) {
    (void)b, (void)bytes, (void)err;
    return host;
}

static void cpu_weight_release(backend *b, const void *host) { (void)b, (void)host; }

/* Decode reads every weight once per token with one-row tiles, which pay alone for bringing a
 * GGUF row into the tiles' lane order; repacked once here, a tile only loads it (quant_bench
 * 4x1 on an AMD EPYC, Q4_1 1536x576: AVX2 36 -> 61 GMAC/s, AVX-512 49 -> 88). A row of one
 * block has nothing to repack. */
static int cpu_weight_repack(backend *b, const weight *host, weight *out, kv_error *err) {
    (void)b;
    const tensor_type lt = quant_lanes_type(host->type);
    if (lt == host->type || host->n_in < 2 * 32) return 0;
    const size_t bytes = host->row_bytes * (size_t)host->n_out;
    void *copy = kv_aligned_alloc(bytes);
    if (!copy)
        return kv_fail(err, "out of memory repacking a %lld x %lld weight (%zu bytes)",
                       (long long)host->n_in, (long long)host->n_out, bytes);
    if (quant_repack_lanes(host->type, host->data, copy, host->n_in, host->n_out,
                           host->row_bytes)) {
        kv_aligned_free(copy);
        return 0;
    }
    *out = *host;
    out->type = lt;
    out->data = copy;
    return 1;
}

static int cpu_copy(backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    if (dst != src) memmove(dst, src, bytes);
    return 0;
}

static int cpu_sync(backend *b) {
    (void)b;
    return 0;
}

struct backend_stream {
    int unused;
};
struct backend_event {
    int unused;
};

static backend_stream *cpu_stream_create(backend *b, kv_error *err) {
    (void)b;
    backend_stream *s = calloc(1, sizeof *s);
    if (!s) kv_fail(err, "out of memory for a stream");
    return s;
}

static void cpu_stream_destroy(backend *b, backend_stream *s) {
    (void)b;
    free(s);
}

static backend_event *cpu_event_create(backend *b, kv_error *err) {
    (void)b;
    backend_event *e = calloc(1, sizeof *e);
    if (!e) kv_fail(err, "out of memory for an event");
    return e;
}

static void cpu_event_destroy(backend *b, backend_event *e) {
    (void)b;
    free(e);
}

static int cpu_event_record(backend *b, backend_event *e, backend_stream *s) {
    (void)b, (void)e, (void)s;
    return 0;
}

static int cpu_stream_wait(backend *b, backend_stream *s, backend_event *e) {
    (void)b, (void)e, (void)s;
    return 0;
}

static int cpu_event_sync(backend *b, backend_event *e) {
    (void)b, (void)e;
    return 0;
}

/* ---------------------------------------------------------------- matmul */

typedef struct matmul_job {
    int n_w;
    const weight *const *w;
    float *const *y;
    const float *x;
    int n_tok;
    tensor_type act_type;
    uint8_t *xq; /* [n_tok][xq_stride] activations in act_type */
    size_t xq_stride;
    bool f32;             /* MATMUL_PRECISION_F32: xq is x itself */
    float **wdq;          /* per-thread [chunk_rows][n_in] dequantized weight rows */
    int chunk_rows;       /* weight rows per work item */
    int64_t chunk_end[8]; /* cumulative work items per weight */
    _Atomic int64_t next;
} matmul_job;

static void matmul_quantize_task(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    int64_t lo, hi;
    split_range(j->n_tok, ith, nth, &lo, &hi);
    int64_t n_in = j->w[0]->n_in;
    for (int64_t t = lo; t < hi; t++)
        quantize_row_act(j->act_type, j->x + t * n_in, j->xq + t * j->xq_stride, n_in);
}

/* How far ahead of the tile being read matmul asks for weight lines (see matmul_chunk). */
#define MATMUL_PREFETCH_AHEAD 4096

/* Rows [r0, r1) of weight k against every token, in 4x4 tiles: the chunk's weight rows stay in
 * L1 while the activations stream from L2. */
static void matmul_chunk(const matmul_job *j, int k, int64_t r0, int64_t r1, int ith) {
    const weight *w = j->w[k];
    float *y = j->y[k];
    const uint8_t *wd = w->data;
    tensor_type wt = w->type;
    size_t w_stride = w->row_bytes;
    int64_t row0 = 0; /* row of wd's first row */
    if (j->f32 && tensor_type_get((int)wt)->block_size > 1) {
        /* dequantize the item's rows once; every token's tiles reuse them */
        float *dq = j->wdq[ith];
        for (int64_t r = r0; r < r1; r++)
            dequantize_row(wt, wd + r * w->row_bytes, dq + (r - r0) * w->n_in, w->n_in);
        wd = (const uint8_t *)dq;
        row0 = r0;
        wt = TENSOR_TYPE_F32;
        w_stride = (size_t)w->n_in * sizeof(float);
    }
    /* Decode streams every weight from memory once, and the kernel alone reaches its lines a
     * few at a time: the item's lines are asked for into L2 (prefetcht1) MATMUL_PREFETCH_AHEAD
     * bytes before the tile that reads them, so that memory works while the kernel computes.
     * tg128 at 2 threads on an AMD EPYC (Zen 4), SmolLM2-135M: the tile's own lines into L1
     * just before it (this code's previous rule) 203 tok/s, nothing 215, a tile ahead 250,
     * 2 KiB ahead 235, 4 KiB 294, 8 KiB 286, 16 KiB 231; into L1 instead of L2 220 (a core
     * has few L1 miss buffers); at AVX2 167 -> 238. Prefill is unchanged (pp512 1036 / 1040):
     * its later token tiles find the rows in cache. Never the non-temporal hint: on an Intel
     * Xeon it left decode at half the read bandwidth (1.1B-shape tg32 at AVX2 14.6 -> 23.3
     * tok/s with prefetcht0); this rule has not been measured on Intel. */
    const uint8_t *pf = wd, *pf_end = wd + (r1 - row0) * (int64_t)w_stride;
    if (wt == TENSOR_TYPE_F32)
        pf = pf_end; /* dequantized rows: already in cache */
    else
        pf += (r0 - row0) * (int64_t)w_stride;
    for (int t = 0; t < j->n_tok; t += DOT_TILE_MAX_X) {
        int nx = j->n_tok - t < DOT_TILE_MAX_X ? j->n_tok - t : DOT_TILE_MAX_X;
        for (int64_t r = r0; r < r1; r += DOT_TILE_MAX_W) {
            int nw = r1 - r < DOT_TILE_MAX_W ? (int)(r1 - r) : DOT_TILE_MAX_W;
            const uint8_t *tile = wd + (r - row0) * (int64_t)w_stride;
            const uint8_t *want = tile + (size_t)nw * w_stride + MATMUL_PREFETCH_AHEAD;
            if (want > pf_end) want = pf_end;
            for (; pf < want; pf += 64) __builtin_prefetch(pf, 0, 2);
            dot_tile(wt, w->n_in, tile, w_stride, nw, j->xq + (size_t)t * j->xq_stride,
                     j->xq_stride, nx, y + (size_t)t * w->n_out + r, (size_t)w->n_out);
        }
    }
}

static void matmul_task(void *ctx, int ith, int nth) {
    (void)nth;
    matmul_job *j = ctx;
    int64_t total = j->chunk_end[j->n_w - 1];
    for (;;) {
        int64_t c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (c >= total) return;
        int k = 0;
        while (c >= j->chunk_end[k]) k++;
        int64_t first = k ? j->chunk_end[k - 1] : 0;
        int64_t r0 = (c - first) * j->chunk_rows;
        int64_t r1 = r0 + j->chunk_rows;
        if (r1 > j->w[k]->n_out) r1 = j->w[k]->n_out;
        matmul_chunk(j, k, r0, r1, ith);
    }
}

static int cpu_matmul_multi(backend *bk, int n_w, const weight *const *w, const float *x, int n_tok,
                            float *const *y) {
    cpu_backend *b = cpu_of(bk);
    matmul_job j = {.n_w = n_w, .w = w, .y = y, .x = x, .n_tok = n_tok};
    j.f32 = b->precision == MATMUL_PRECISION_F32;
    if (j.f32) {
        /* every weight type then takes f32 activations: x as it is */
        j.act_type = TENSOR_TYPE_F32;
        j.xq_stride = (size_t)w[0]->n_in * sizeof(float);
        j.xq = (uint8_t *)(uintptr_t)x;
    } else {
        j.act_type = tensor_type_get((int)w[0]->type)->act_type;
        j.xq_stride = tensor_row_size(j.act_type, w[0]->n_in);
        /* The buffer grows to the largest batch seen once; a failure leaves y untouched. */
        if (cpu_act_reserve(b, j.xq_stride * (size_t)n_tok) != 0) {
            log_error("matmul: out of memory for %d activation rows", n_tok);
            return -1;
        }
        j.xq = b->act_buf;
        if (n_tok * w[0]->n_in < SERIAL_ELEMS)
            matmul_quantize_task(&j, 0, 1);
        else
            threadpool_run(b->tp, matmul_quantize_task, &j);
    }

    /* Work items: enough for dynamic balancing (a noisy machine slows one core), few enough that
     * the atomic counter stays cheap; multiples of the tile height. */
    int64_t rows = 0;
    for (int k = 0; k < n_w; k++) rows += w[k]->n_out;
    int64_t target = rows / ((int64_t)b->n_threads * 8);
    int cr = (int)(target < 4 ? 4 : target > 64 ? 64 : target);
    j.chunk_rows = (cr + DOT_TILE_MAX_W - 1) / DOT_TILE_MAX_W * DOT_TILE_MAX_W;
    int64_t acc = 0;
    for (int k = 0; k < n_w; k++) {
        acc += (w[k]->n_out + j.chunk_rows - 1) / j.chunk_rows;
        j.chunk_end[k] = acc;
    }
    if (j.f32) {
        size_t need = (size_t)j.chunk_rows * (size_t)w[0]->n_in;
        if (need > b->wdq_floats) {
            for (int t = 0; t < b->n_threads; t++) {
                kv_aligned_free(b->wdq[t]);
                if (!(b->wdq[t] = kv_aligned_alloc(need * sizeof(float)))) {
                    b->wdq_floats = 0;
                    log_error("matmul: out of memory for dequantized weight rows");
                    return -1;
                }
            }
            b->wdq_floats = need;
        }
        j.wdq = b->wdq;
    }
    atomic_store(&j.next, 0);
    threadpool_run(b->tp, matmul_task, &j);
    return 0;
}

/* ---------------------------------------------------------------- rows */

static int cpu_embed(backend *b, const weight *w, const int32_t *ids, int n, float *out) {
    (void)b;
    for (int t = 0; t < n; t++)
        dequantize_row(w->type, (const uint8_t *)w->data + (size_t)ids[t] * w->row_bytes,
                       out + (size_t)t * w->n_in, w->n_in);
    return 0;
}

static int cpu_gather_rows(backend *b, float *dst, const float *src, const int32_t *idx, int n,
                           int width) {
    (void)b;
    for (int t = 0; t < n; t++)
        memcpy(dst + (size_t)t * width, src + (size_t)idx[t] * width, sizeof(float) * width);
    return 0;
}

/* ---------------------------------------------------------------- RMSNorm */

typedef struct rows_job {
    const float *x;
    const float *g;
    float *y;
    int n_tok;
    int dim;
    float eps;
} rows_job;

static void rmsnorm_task(void *ctx, int ith, int nth) {
    rows_job *j = ctx;
    int64_t lo, hi;
    split_range(j->n_tok, ith, nth, &lo, &hi);
    const cpu_float_ops *ops = cpu_float_ops_get();
    for (int64_t t = lo; t < hi; t++)
        ops->rmsnorm_row(j->x + t * j->dim, j->g, j->y + t * j->dim, j->dim, j->eps);
}

static int cpu_rmsnorm(backend *b, const float *x, const float *gamma, float *y, int n_tok, int dim,
                       float eps) {
    rows_job j = {x, gamma, y, n_tok, dim, eps};
    if ((int64_t)n_tok * dim < SERIAL_ELEMS)
        rmsnorm_task(&j, 0, 1);
    else
        threadpool_run(cpu_of(b)->tp, rmsnorm_task, &j);
    return 0;
}

/* ---------------------------------------------------------------- RoPE */

typedef struct rope_job {
    float *x;
    const int32_t *pos; /* angles per token (backend_rope), or NULL: from cs */
    const float *cs;    /* [][n_rot] precomputed angles (backend_rope_cs, backend_rope_angles) */
    const int32_t *idx; /* cs row of each token, or NULL: its own */
    int n_tok;
    int n_head;
    int head_dim;
    int n_rot;
    const rope_table *rope;
} rope_job;

/* Each token's angles once, shared by its heads (kernels/rope.c). */
static void rope_task(void *ctx, int ith, int nth) {
    rope_job *j = ctx;
    float cs[512]; /* [n_rot / 2][2]; n_rot <= 512 is checked at model load */
    int64_t lo, hi;
    split_range(j->n_tok, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const float *a = cs;
        if (j->pos)
            rope_angles(j->rope, j->pos[t], cs);
        else
            a = j->cs + (size_t)(j->idx ? j->idx[t] : t) * j->n_rot;
        rope_rotate(j->x + (size_t)t * j->n_head * j->head_dim, j->n_head, j->head_dim, j->n_rot, a,
                    false);
    }
}

static int rope_run(backend *b, rope_job *j) {
    if (j->n_tok < 8)
        rope_task(j, 0, 1);
    else
        threadpool_run(cpu_of(b)->tp, rope_task, j);
    return 0;
}

static int cpu_rope(backend *b, float *x, const int32_t *pos, int n_tok, int n_head, int head_dim,
                    const rope_table *rope) {
    rope_job j = {.x = x,
                  .pos = pos,
                  .n_tok = n_tok,
                  .n_head = n_head,
                  .head_dim = head_dim,
                  .n_rot = rope->n_rot,
                  .rope = rope};
    return rope_run(b, &j);
}

static int cpu_rope_cs(backend *b, float *x, const float *cs, const int32_t *idx, int n_tok,
                       int n_head, int head_dim, int n_rot) {
    rope_job j = {.x = x,
                  .cs = cs,
                  .idx = idx,
                  .n_tok = n_tok,
                  .n_head = n_head,
                  .head_dim = head_dim,
                  .n_rot = n_rot};
    return rope_run(b, &j);
}

typedef struct angles_job {
    const rope_table *rope;
    const int32_t *pos;
    int n_tok;
    float *cs;
} angles_job;

static void angles_task(void *ctx, int ith, int nth) {
    angles_job *j = ctx;
    int64_t lo, hi;
    split_range(j->n_tok, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++)
        rope_angles(j->rope, j->pos[t], j->cs + (size_t)t * j->rope->n_rot);
}

static int cpu_rope_angles(backend *b, const rope_table *rope, const int32_t *pos, int n_tok,
                           float *cs) {
    angles_job j = {rope, pos, n_tok, cs};
    if (n_tok < 8)
        angles_task(&j, 0, 1);
    else
        threadpool_run(cpu_of(b)->tp, angles_task, &j);
    return 0;
}

/* ---------------------------------------------------------------- elementwise */

typedef struct ew_job {
    const float *a;
    const float *b;
    float *out;
    int64_t n;
} ew_job;

static void swiglu_task(void *ctx, int ith, int nth) {
    ew_job *j = ctx;
    int64_t lo, hi;
    split_range(j->n / 16, ith, nth, &lo, &hi);
    lo *= 16;
    hi = ith == nth - 1 ? j->n : hi * 16;
    cpu_float_ops_get()->swiglu_range(j->a + lo, j->b + lo, j->out + lo, hi - lo);
}

static int cpu_swiglu(backend *b, const float *gate, const float *up, float *out, int64_t n) {
    ew_job j = {gate, up, out, n};
    if (n < SERIAL_ELEMS)
        swiglu_task(&j, 0, 1);
    else
        threadpool_run(cpu_of(b)->tp, swiglu_task, &j);
    return 0;
}

static int cpu_add(backend *b, float *y, const float *x, int64_t n) {
    (void)b; /* memory-bound and short: one thread saturates it */
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
    return 0;
}

/* ---------------------------------------------------------------- sampling */

static int cpu_softmax(backend *b, float *x, int n_rows, int n) {
    (void)b;
    for (int r = 0; r < n_rows; r++) {
        float *v = x + (size_t)r * n, m = -INFINITY;
        for (int i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
        double sum = 0;
        for (int i = 0; i < n; i++) {
            v[i] = expf(v[i] - m);
            sum += v[i];
        }
        float inv = (float)(1.0 / sum);
        for (int i = 0; i < n; i++) v[i] *= inv;
    }
    return 0;
}

/* (a, ia) ranks above (b, ib): the larger value, NaN below everything, ties to the lower index. */
static inline bool topk_above(float a, int32_t ia, float b, int32_t ib) {
    if (isnan(b)) return !isnan(a) || ia < ib;
    if (isnan(a)) return false;
    return a > b || (a == b && ia < ib);
}

/* A min-heap of the k best so far (its root the worst kept), then sorted best first. */
static void topk_sift(float *hv, int32_t *hi, int k, int i) {
    for (;;) {
        int c = 2 * i + 1;
        if (c >= k) return;
        if (c + 1 < k && topk_above(hv[c], hi[c], hv[c + 1], hi[c + 1])) c++;
        if (!topk_above(hv[i], hi[i], hv[c], hi[c])) return;
        float tv = hv[i];
        int32_t ti = hi[i];
        hv[i] = hv[c], hi[i] = hi[c];
        hv[c] = tv, hi[c] = ti;
        i = c;
    }
}

static int cpu_topk(backend *b, const float *x, int n_rows, int n, int k, float *val,
                    int32_t *idx) {
    (void)b;
    for (int r = 0; r < n_rows; r++) {
        const float *v = x + (size_t)r * n;
        float *hv = val + (size_t)r * k;
        int32_t *hi = idx + (size_t)r * k;
        for (int i = 0; i < k; i++) hv[i] = v[i], hi[i] = i;
        for (int i = k / 2 - 1; i >= 0; i--) topk_sift(hv, hi, k, i);
        for (int i = k; i < n; i++)
            if (topk_above(v[i], i, hv[0], hi[0])) {
                hv[0] = v[i], hi[0] = i;
                topk_sift(hv, hi, k, 0);
            }
        /* heap sort: the worst goes to the end */
        for (int m = k - 1; m > 0; m--) {
            float tv = hv[0];
            int32_t ti = hi[0];
            hv[0] = hv[m], hi[0] = hi[m];
            hv[m] = tv, hi[m] = ti;
            topk_sift(hv, hi, m, 0);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- the table */

static const backend_ops cpu_backend_ops = {
    .destroy = cpu_destroy,
    .name = cpu_name,
    .n_threads = cpu_n_threads,
    .set_precision = cpu_set_precision,
    .reserve = cpu_reserve,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .weight_data = cpu_weight_data,
    .weight_repack = cpu_weight_repack,
    .weight_release = cpu_weight_release,
    .upload = cpu_copy,
    .download = cpu_copy,
    .sync = cpu_sync,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .stream_create = cpu_stream_create,
    .stream_destroy = cpu_stream_destroy,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .stream_wait = cpu_stream_wait,
    .event_sync = cpu_event_sync,
    .matmul_multi = cpu_matmul_multi,
    .embed = cpu_embed,
    .gather_rows = cpu_gather_rows,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .rope_angles = cpu_rope_angles,
    .rope_cs = cpu_rope_cs,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .softmax = cpu_softmax,
    .topk = cpu_topk,
    .kv_alloc = cpu_kv_alloc,
    .kv_free = cpu_kv_free,
    .kv_write = cpu_kv_write,
    .kv_store = cpu_kv_write, /* host memory is backend memory */
    .kv_store_serial = cpu_kv_store_serial,
    .kv_load = cpu_kv_load,
    .kv_rope = cpu_kv_rope,
    .kv_copy_block = cpu_kv_copy_block,
    .kv_read_blocks = cpu_kv_read_blocks,
    .kv_write_blocks = cpu_kv_write_blocks,
    .kv_read_rows = cpu_kv_read_rows,
    .kv_write_rows = cpu_kv_write_rows,
    .attention = cpu_attention,
};
