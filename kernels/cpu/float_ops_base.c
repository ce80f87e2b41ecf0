/* The float kernels compiled for baseline x86-64: see float_ops.inc. */
#define FLOAT_OPS_NAME cpu_float_ops_base
#include "kernels/cpu/float_ops.inc"
