/* The float kernels compiled for AVX512: see float_ops.inc. */
#define FLOAT_OPS_NAME cpu_float_ops_avx512
#include "kernels/cpu/float_ops.inc"
