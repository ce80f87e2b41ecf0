/* The float kernels compiled for AVX2: see float_ops.inc. */
#define FLOAT_OPS_NAME cpu_float_ops_avx2
#include "kernels/cpu/float_ops.inc"
