/* Per-type block geometry of GGML's tensor types (ggml/src/ggml-common.h block_* structs). */
#include "kernels/quant.h"

#define QK_K 256

/* Every 32-element weight type takes Q8_1 activations (GGML pairs Q4_0/Q5_0/Q8_0 with Q8_0): the
 * per-block sums Q8_1 carries let the CPU tiles multiply unsigned weight codes (q + 8, q + 16,
 * q + 128) with vpdpbusd and subtract the offset once per block (kernels/cpu/quant_impl.h). */
static const tensor_type_traits TRAITS[TENSOR_TYPE_COUNT] = {
    [TENSOR_TYPE_F32] = {"F32", 1, 4, true, TENSOR_TYPE_F32},
    [TENSOR_TYPE_F16] = {"F16", 1, 2, true, TENSOR_TYPE_F32},
    [TENSOR_TYPE_BF16] = {"BF16", 1, 2, true, TENSOR_TYPE_F32},
    /* half d; nibbles[16] */
    [TENSOR_TYPE_Q4_0] = {"Q4_0", 32, 2 + 16, true, TENSOR_TYPE_Q8_1},
    /* half d, m; nibbles[16] */
    [TENSOR_TYPE_Q4_1] = {"Q4_1", 32, 4 + 16, true, TENSOR_TYPE_Q8_1},
    /* half d; high bits u32; nibbles[16] */
    [TENSOR_TYPE_Q5_0] = {"Q5_0", 32, 2 + 4 + 16, true, TENSOR_TYPE_Q8_1},
    /* half d, m; high bits u32; nibbles[16] */
    [TENSOR_TYPE_Q5_1] = {"Q5_1", 32, 4 + 4 + 16, true, TENSOR_TYPE_Q8_1},
    /* half d; int8 qs[32] */
    [TENSOR_TYPE_Q8_0] = {"Q8_0", 32, 2 + 32, true, TENSOR_TYPE_Q8_1},
    /* half d, s (= d * sum qs); int8 qs[32] */
    [TENSOR_TYPE_Q8_1] = {"Q8_1", 32, 4 + 32, false, TENSOR_TYPE_Q8_1},
    /* half d, dmin; scales[12]; nibbles[128] */
    [TENSOR_TYPE_Q4_K] = {"Q4_K", QK_K, 4 + 12 + QK_K / 2, true, TENSOR_TYPE_Q8_K},
    /* half d, dmin; scales[12]; high bits[32]; nibbles[128] */
    [TENSOR_TYPE_Q5_K] = {"Q5_K", QK_K, 4 + 12 + QK_K / 8 + QK_K / 2, true, TENSOR_TYPE_Q8_K},
    /* ql[128]; qh[64]; int8 scales[16]; half d */
    [TENSOR_TYPE_Q6_K] = {"Q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2, true,
                          TENSOR_TYPE_Q8_K},
    /* float d; int8 qs[256]; int16 bsums[16] */
    [TENSOR_TYPE_Q8_K] = {"Q8_K", QK_K, 4 + QK_K + 2 * QK_K / 16, false, TENSOR_TYPE_Q8_K},
    /* Q4_0, Q4_1, Q8_0 repacked in lane order (kernels/quant.h): same block sizes */
    [TENSOR_TYPE_Q4_0_L16] = {"Q4_0_L16", 32, 2 + 16, true, TENSOR_TYPE_Q8_1, true},
    [TENSOR_TYPE_Q4_1_L16] = {"Q4_1_L16", 32, 4 + 16, true, TENSOR_TYPE_Q8_1, true},
    [TENSOR_TYPE_Q8_0_L16] = {"Q8_0_L16", 32, 2 + 32, true, TENSOR_TYPE_Q8_1, true},
};

const tensor_type_traits *tensor_type_get(int type_id) {
    if (type_id < 0 || type_id >= TENSOR_TYPE_COUNT) return NULL;
    const tensor_type_traits *t = &TRAITS[type_id];
    return t->name ? t : NULL;
}

size_t tensor_row_size(tensor_type t, int64_t n) {
    const tensor_type_traits *tr = tensor_type_get((int)t);
    if (!tr || n < 0 || n % tr->block_size != 0) return 0;
    return (size_t)(n / tr->block_size) * tr->type_size;
}
