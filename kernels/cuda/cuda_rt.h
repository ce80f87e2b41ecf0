/* What every .cu file of kernels/cuda/ includes first: the CUDA toolkit's headers under nvcc, the
 * emulator's (emu.h) in the emulation build (g++ -DKVSERVE_CUDA_EMU), and the few names that
 * differ between the two: the launch macro, dynamic shared memory, f16 conversions and the
 * namespace that keeps the two builds' symbols apart when both are linked into one program. */
#ifndef KVSERVE_CUDA_RT_H
#define KVSERVE_CUDA_RT_H

#include <stdint.h>

#ifdef KVSERVE_CUDA_EMU
#include "kernels/cuda/emu.h"
#define KV_CUDA_NS kvcuda_emu
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define KV_CUDA_NS kvcuda
#endif

#include "kernels/backend_impl.h"

/* KV_LAUNCH(kernel, grid, block, shared bytes, stream, args...): kernel<<<...>>>(args...) under
 * nvcc, the emulator otherwise. `kernel` is a name or a function pointer (a template kernel is
 * named through a pointer: commas inside <> would split the macro's arguments). */
#ifdef KVSERVE_CUDA_EMU
#define KV_LAUNCH(k, grid, block, smem, stream, ...)                                               \
    emu::launch_kernel(#k, grid, block, smem, stream, k, __VA_ARGS__)
#else
#define KV_LAUNCH(k, grid, block, smem, stream, ...) k<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif

/* Unrolls the next loop under nvcc (its trip count a compile-time constant: arrays indexed by it
 * stay in registers); g++ knows no such pragma. */
#ifdef KVSERVE_CUDA_EMU
#define KV_UNROLL
#else
#define KV_UNROLL _Pragma("unroll")
#endif

/* T *name: the launch's dynamic shared memory, 16-byte aligned. */
#ifdef KVSERVE_CUDA_EMU
#define KV_DYNAMIC_SMEM(T, name) T *name = reinterpret_cast<T *>(emu::cur_block->dyn_smem)
#else
#define KV_DYNAMIC_SMEM(T, name)                                                                   \
    extern __shared__ __align__(16) unsigned char kv_dynamic_smem_[];                              \
    T *name = reinterpret_cast<T *>(kv_dynamic_smem_)
#endif

namespace KV_CUDA_NS {

/* IEEE f16 bits <-> f32, round to nearest even: fp16_to_fp32 / fp32_to_fp16's results. */
__device__ __forceinline__ float h2f(uint16_t h) {
#ifdef KVSERVE_CUDA_EMU
    return fp16_to_fp32(h);
#else
    return __half2float(__ushort_as_half(h));
#endif
}

__device__ __forceinline__ uint16_t f2h(float f) {
#ifdef KVSERVE_CUDA_EMU
    return fp32_to_fp16(f);
#else
    return __half_as_ushort(__float2half_rn(f));
#endif
}

__device__ __forceinline__ float bf2f(uint16_t h) {
    return __int_as_float((int)((uint32_t)h << 16));
}

/* Sum and max over the 32 lanes of a warp (every lane gets the result). */
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sums V values over a warp's lanes (V a power of two <= 32): every lane ends with the total of
 * value vi(lane) (gemv_value). Each step halves the values a lane holds: lanes send the half
 * their partner keeps and add the half it sends back, so V values take V - 1 + log2(32 / V)
 * shuffles instead of 5 V. */
template <int V> __device__ __forceinline__ float warp_sum_scatter(float (&acc)[V], int lane) {
    int o = 16;
    KV_UNROLL
    for (int n = V; n > 1; n >>= 1, o >>= 1) {
        const bool upper = (lane & o) != 0;
        KV_UNROLL
        for (int i = 0; i < n / 2; i++) {
            const float send = upper ? acc[i] : acc[i + n / 2];
            const float keep = upper ? acc[i + n / 2] : acc[i];
            acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    float v = acc[0];
    for (; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Which value a lane holds after warp_sum_scatter<V>; lanes with lane % (32 / V) == 0 hold each
 * value once. */
template <int V> __device__ __forceinline__ int gemv_value(int lane) {
    int vi = 0, o = 16;
    for (int n = V; n > 1; n >>= 1, o >>= 1)
        if (lane & o) vi += n / 2;
    return vi;
}

} // namespace KV_CUDA_NS

#endif
