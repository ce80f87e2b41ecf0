/* The CPU backend's float kernels (kernels/cpu/float_ops.inc: RMSNorm, SwiGLU, attention over
 * the paged pool) at every SIMD level the CPU runs, against float64 references written here
 * from the definitions. Each level is its own translation unit (vector types and instructions
 * differ), so each is checked on the same inputs: a prefill-sized sequence (split by query rows)
 * and a decode step whose keys are split across threads, with GQA, several pool blocks out of
 * order and a causal limit inside a block. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static double rng_unit(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static float rng_normal(void) {
    double u = rng_unit() + 1e-12, v = rng_unit();
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* The body once per SIMD level the CPU runs, with that level in use (restore_level after). */
#define EACH_LEVEL(l)                                                                              \
    for (simd_level l = SIMD_LEVEL_SCALAR; l <= simd_level_detect(); l++)                          \
        if (simd_level_set(l) == l)

static void restore_level(void) { simd_level_set(simd_level_detect()); }

Test(float_ops, rmsnorm_and_swiglu_match_float64_at_every_level) {
    kv_error err;
    backend *b = backend_cpu_create(2, &err);
    cr_assert_not_null(b, "%s", err.msg);
    enum { N_TOK = 3, DIM = 576 + 7 }; /* a tail past the 16-lane vectors */
    static float x[N_TOK * DIM], g[DIM], y[N_TOK * DIM], up[N_TOK * DIM], o[N_TOK * DIM];
    for (int i = 0; i < N_TOK * DIM; i++) x[i] = 3 * rng_normal(), up[i] = rng_normal();
    for (int i = 0; i < DIM; i++) g[i] = 1 + 0.1f * rng_normal();
    EACH_LEVEL(l) {
        backend_rmsnorm(b, x, g, y, N_TOK, DIM, 1e-5f);
        for (int t = 0; t < N_TOK; t++) {
            double ss = 0;
            for (int i = 0; i < DIM; i++) ss += (double)x[t * DIM + i] * x[t * DIM + i];
            double sc = 1 / sqrt(ss / DIM + 1e-5);
            for (int i = 0; i < DIM; i++) {
                double want = x[t * DIM + i] * sc * g[i];
                cr_assert(fabs(y[t * DIM + i] - want) <= 1e-5 * (1 + fabs(want)),
                          "level %s rmsnorm [%d][%d]: %g vs %g", simd_level_name(l), t, i,
                          y[t * DIM + i], want);
            }
        }
        backend_swiglu(b, x, up, o, N_TOK * DIM);
        for (int i = 0; i < N_TOK * DIM; i++) {
            double want = x[i] / (1 + exp(-(double)x[i])) * up[i];
            cr_assert(fabs(o[i] - want) <= 2e-6 * (1 + fabs(want)),
                      "level %s swiglu [%d]: %g vs %g", simd_level_name(l), i, o[i], want);
        }
    }
    restore_level();
    backend_destroy(b);
}

/* softmax(q k^T * scale) v over slots 0..q_slot, from the pool's own (f16-rounded) K and V. */
static void attention_ref(const float *q, const float *k, const float *v, int n_head, int n_kv_head,
                          int hd, int q_slot, float scale, double *out) {
    int gs = n_head / n_kv_head;
    for (int h = 0; h < n_head; h++) {
        int kh = h / gs;
        double m = -INFINITY, *w = malloc(sizeof(double) * (size_t)(q_slot + 1));
        for (int s = 0; s <= q_slot; s++) {
            double dot = 0;
            for (int d = 0; d < hd; d++)
                dot += (double)q[h * hd + d] * k[((size_t)s * n_kv_head + kh) * hd + d];
            w[s] = dot * scale;
            m = w[s] > m ? w[s] : m;
        }
        double sum = 0;
        for (int s = 0; s <= q_slot; s++) sum += w[s] = exp(w[s] - m);
        for (int d = 0; d < hd; d++) {
            double acc = 0;
            for (int s = 0; s <= q_slot; s++)
                acc += w[s] * v[((size_t)s * n_kv_head + kh) * hd + d];
            out[h * hd + d] = acc / sum;
        }
        free(w);
    }
}

Test(float_ops, attention_matches_float64_at_every_level) {
    kv_error err;
    backend *b = backend_cpu_create(2, &err);
    cr_assert_not_null(b, "%s", err.msg);
    enum { N_HEAD = 6, N_KV = 2, HD = 64, BT = 16, N_SLOTS = 1000 + 5 };
    const int n_blocks = (N_SLOTS + BT - 1) / BT;
    kv_layout l = {.n_layer = 2,
                   .n_kv_head = N_KV,
                   .head_dim = HD,
                   .block_tokens = BT,
                   .n_blocks = n_blocks + 3};
    void *pool = backend_kv_alloc(b, &l);
    cr_assert_not_null(pool);
    int32_t *table = malloc(sizeof(int32_t) * n_blocks), *slots = malloc(sizeof(int32_t) * N_SLOTS);
    for (int i = 0; i < n_blocks; i++) table[i] = (int32_t)((i * 7 + 2) % (n_blocks + 3));
    for (int i = 0; i < n_blocks; i++) /* distinct blocks, out of order */
        for (int k = 0; k < i; k++) cr_assert_neq(table[i], table[k]);
    for (int s = 0; s < N_SLOTS; s++) slots[s] = s;
    size_t kv_n = (size_t)N_SLOTS * N_KV * HD;
    float *k = malloc(sizeof(float) * kv_n), *v = malloc(sizeof(float) * kv_n);
    for (size_t i = 0; i < kv_n; i++) k[i] = 2 * rng_normal(), v[i] = rng_normal();
    backend_kv_store(b, pool, &l, 1, table, slots, N_SLOTS, k, v);
    backend_kv_load(b, pool, &l, 1, 0, table, slots, N_SLOTS, k); /* the f16-rounded values */
    backend_kv_load(b, pool, &l, 1, 1, table, slots, N_SLOTS, v);

    /* a prefill of 37 rows ending at slot 900, and a decode row at the last slot */
    enum { NQ = 37 };
    int32_t q_slot[NQ + 1];
    for (int r = 0; r < NQ; r++) q_slot[r] = 900 - NQ + 1 + r;
    q_slot[NQ] = N_SLOTS - 1;
    size_t row = (size_t)N_HEAD * HD;
    float *q = malloc(sizeof(float) * row * (NQ + 1)),
          *out = malloc(sizeof(float) * row * (NQ + 1));
    double *want = malloc(sizeof(double) * row * (NQ + 1));
    for (size_t i = 0; i < row * (NQ + 1); i++) q[i] = 0.5f * rng_normal();
    const float scale = 1.0f / sqrtf((float)HD);
    for (int r = 0; r <= NQ; r++)
        attention_ref(q + r * row, k, v, N_HEAD, N_KV, HD, q_slot[r], scale, want + r * row);
    EACH_LEVEL(lv) {
        memset(out, 0, sizeof(float) * row * (NQ + 1));
        attn_seq seqs[2] = {
            {table, 901, NQ, q_slot, q, out, false},
            {table, N_SLOTS, 1, q_slot + NQ, q + NQ * row, out + NQ * row, true},
        };
        cr_assert_eq(backend_attention(b, pool, &l, 1, N_HEAD, scale, seqs, 2), 0);
        for (size_t i = 0; i < row * (NQ + 1); i++)
            cr_assert(fabs(out[i] - want[i]) <= 2e-5 * (1 + fabs(want[i])),
                      "level %s row %zu: %g vs %g", simd_level_name(lv), i / row, out[i], want[i]);
    }
    restore_level();
    free(q);
    free(out);
    free(want);
    free(k);
    free(v);
    free(table);
    free(slots);
    backend_kv_free(b, pool);
    backend_destroy(b);
}
