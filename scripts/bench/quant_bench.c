/* Microbenchmark of dot_tile (kernels/quant.h): GMAC/s on one thread, per weight type, tile
 * shape and SIMD level, on the matrix shapes of SmolLM2-135M.
 *
 *   make build/quant_bench && build/quant_bench            (all types)
 *   build/quant_bench Q4_1 Q8_0                             (some types)
 *   build/quant_bench --level avx512 Q4_1                   (one SIMD level)
 *
 * or without make:
 *   A2="-mavx2 -mfma -mf16c -mbmi2"; A5="$A2 -mavx512f -mavx512bw -mavx512vl -mavx512dq
 * -mavx512vnni" F="-std=c11 -O2 -D_GNU_SOURCE -pthread -I." gcc $F -c kernels/cpu/quant_avx2.c $A2
 * -o /tmp/qa2.o gcc $F -c kernels/cpu/quant_avx512.c $A5 -o /tmp/qa5.o
 *   gcc $F scripts/bench/quant_bench.c kernels/cpu/quant.c kernels/quant_traits.c util/util.c \
 *       /tmp/qa2.o /tmp/qa5.o -o /tmp/quant_bench -lm
 *
 * Tiles as a matmul uses them: "4x4" is prefill (64 activation rows; for each tile of 4 weight
 * rows, every tile of 4 activation rows, so the weight tile stays in L1 and the activations in
 * L2), "4x1" and "1x1" are decode (one activation row, the weights streamed once). Shapes are
 * n_in x n_out: 576x1536 (attention / FFN up, fits L2), 1536x576 (FFN down) and 576x49152 (the
 * tied output matrix, 28 MB in Q8_0, streamed from L3/DRAM); Q4_0 and Q4_1 add 2048x8192 (the
 * 1.1B shape's FFN up, 10 MB). The *_L16 rows are the same types repacked into the tiles' lane
 * order, as the CPU backend loads them (kernels/quant.h). Best of several runs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant.h"
#include "util/util.h"

#define M_PREFILL 64

static uint64_t rng = 0x243F6A8885A308D3ull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

/* Random blocks whose fp16 scales are small and finite. */
static void fill_weights(tensor_type t, uint8_t *w, size_t bytes) {
    const tensor_type_traits *tr = tensor_type_get((int)t);
    for (size_t k = 0; k < bytes; k++) w[k] = (uint8_t)rnd();
    if (tr->block_size == 1) {
        for (size_t k = 0; k < bytes / tr->type_size; k++) {
            float v = (float)((int)(rnd() % 2001) - 1000) * 1e-3f;
            if (t == TENSOR_TYPE_F32)
                memcpy(w + 4 * k, &v, 4);
            else {
                uint16_t h = fp32_to_fp16(v);
                memcpy(w + 2 * k, &h, 2);
            }
        }
        return;
    }
    const uint16_t d = fp32_to_fp16(0.01f);
    for (size_t b = 0; b < bytes / tr->type_size; b++) {
        uint8_t *blk = w + b * tr->type_size;
        if (t == TENSOR_TYPE_Q6_K)
            memcpy(blk + 208, &d, 2);
        else {
            memcpy(blk, &d, 2);
            if (t == TENSOR_TYPE_Q4_1 || t == TENSOR_TYPE_Q5_1 || t == TENSOR_TYPE_Q4_K ||
                t == TENSOR_TYPE_Q5_K)
                memcpy(blk + 2, &d, 2);
        }
    }
}

/* One pass over the whole matrix; returns seconds. */
static double run(tensor_type t, int64_t n_in, int64_t n_out, const uint8_t *w, size_t wrow,
                  const uint8_t *x, size_t xrow, int m, int nw, int nx, float *y) {
    const uint64_t t0 = clock_now_ns();
    for (int64_t i = 0; i < n_out; i += nw)
        for (int j = 0; j < m; j += nx)
            dot_tile(t, n_in, w + (size_t)i * wrow, wrow, nw, x + (size_t)j * xrow, xrow, nx,
                     y + (size_t)j * n_out + i, (size_t)n_out);
    return (double)(clock_now_ns() - t0) * 1e-9;
}

static double bench(tensor_type t, int64_t n_in, int64_t n_out, int nw, int nx) {
    const tensor_type at = tensor_type_get((int)t)->act_type;
    const int m = nx == 4 ? M_PREFILL : 1;
    const size_t wrow = tensor_row_size(t, n_in), xrow = tensor_row_size(at, n_in);
    uint8_t *w = kv_aligned_alloc(wrow * (size_t)n_out);
    uint8_t *x = kv_aligned_alloc(xrow * (size_t)m);
    float *xf = malloc((size_t)n_in * sizeof(float));
    float *y = kv_aligned_alloc((size_t)m * (size_t)n_out * sizeof(float));
    /* a lane-order type: its GGUF type's blocks, repacked as the CPU backend does at load */
    fill_weights(quant_lanes_base(t), w, wrow * (size_t)n_out);
    if (quant_lanes_base(t) != t) {
        uint8_t *gguf = kv_aligned_alloc(wrow * (size_t)n_out);
        memcpy(gguf, w, wrow * (size_t)n_out);
        quant_repack_lanes(quant_lanes_base(t), gguf, w, n_in, n_out, wrow);
        kv_aligned_free(gguf);
    }
    for (int j = 0; j < m; j++) {
        for (int64_t e = 0; e < n_in; e++) xf[e] = (float)((int)(rnd() % 2001) - 1000) * 1e-3f;
        quantize_row_act(at, xf, x + (size_t)j * xrow, n_in);
    }
    /* Runs of ~4 ms (shorter than a scheduler slice on a busy machine), best of 15. */
    double once = run(t, n_in, n_out, w, wrow, x, xrow, m, nw, nx, y);
    int passes = once > 0.004 ? 1 : (int)(0.004 / (once + 1e-9)) + 1;
    double best = 1e30;
    for (int rep = 0; rep < 15; rep++) {
        double s = 0;
        for (int p = 0; p < passes; p++) s += run(t, n_in, n_out, w, wrow, x, xrow, m, nw, nx, y);
        if (s / passes < best) best = s / passes;
    }
    kv_aligned_free(w);
    kv_aligned_free(x);
    kv_aligned_free(y);
    free(xf);
    return (double)n_in * (double)n_out * m / best * 1e-9;
}

int main(int argc, char **argv) {
    static const tensor_type types[] = {
        TENSOR_TYPE_Q4_1,     TENSOR_TYPE_Q8_0,     TENSOR_TYPE_Q4_0, TENSOR_TYPE_Q5_0,
        TENSOR_TYPE_Q5_1,     TENSOR_TYPE_Q4_K,     TENSOR_TYPE_Q5_K, TENSOR_TYPE_Q6_K,
        TENSOR_TYPE_F16,      TENSOR_TYPE_BF16,     TENSOR_TYPE_F32,  TENSOR_TYPE_Q4_1_L16,
        TENSOR_TYPE_Q8_0_L16, TENSOR_TYPE_Q4_0_L16,
    };
    static const int tiles[][2] = {{4, 4}, {4, 1}, {1, 1}};
    const simd_level max = simd_level_detect();
    int lo = 0, hi = (int)max;
    if (argc > 2 && strcmp(argv[1], "--level") == 0) {
        for (int l = 0; l <= (int)max; l++)
            if (strcmp(argv[2], simd_level_name((simd_level)l)) == 0) lo = hi = l;
        argv += 2;
        argc -= 2;
    }
    printf("dot_tile GMAC/s, one thread (CPU supports %s)\n", simd_level_name(max));
    printf("%-8s %-10s %-5s", "type", "shape", "tile");
    for (int l = lo; l <= hi; l++) printf(" %8s", simd_level_name((simd_level)l));
    printf("\n");
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const tensor_type t = types[ti];
        const char *name = tensor_type_get((int)t)->name;
        if (argc > 1) {
            int want = 0;
            for (int a = 1; a < argc; a++) want |= strcmp(argv[a], name) == 0;
            if (!want) continue;
        }
        const int kq = tensor_type_get((int)t)->block_size == 256;
        /* K-quants need n_in % 256 == 0: 1536 and 2048 instead of 576. The third shape: Q8_0's
         * is SmolLM2's tied output matrix, Q4_0's and Q4_1's the 1.1B shape's FFN up (10 MB,
         * streamed from L3) */
        const tensor_type base = quant_lanes_base(t);
        const int q8 = base == TENSOR_TYPE_Q8_0,
                  q4 = base == TENSOR_TYPE_Q4_0 || base == TENSOR_TYPE_Q4_1;
        int64_t shapes[3][2] = {
            {kq ? 2048 : 576, 1536}, {1536, 576}, {q8 ? 576 : 2048, q8 ? 49152 : 8192}};
        const int n_shapes = q8 || q4 ? 3 : 2;
        for (int s = 0; s < n_shapes; s++)
            for (size_t k = 0; k < sizeof tiles / sizeof tiles[0]; k++) {
                if (s == 2 && tiles[k][1] == 4) continue; /* the output matrix: decode only */
                char shape[32];
                snprintf(shape, sizeof shape, "%lldx%lld", (long long)shapes[s][0],
                         (long long)shapes[s][1]);
                printf("%-8s %-10s %dx%d  ", name, shape, tiles[k][0], tiles[k][1]);
                for (int l = lo; l <= hi; l++) {
                    simd_level_set((simd_level)l);
                    printf(" %8.1f",
                           bench(t, shapes[s][0], shapes[s][1], tiles[k][0], tiles[k][1]));
                    fflush(stdout);
                }
                printf("\n");
            }
    }
    return 0;
}
