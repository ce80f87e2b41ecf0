/* Tensor-core matrix instructions of the CUDA backend (sm_80 and later: the Makefile builds sm_86
 * and sm_90), with the fragment layouts of the PTX ISA ("Matrix multiply-accumulate operation
 * using mma instruction", "Matrix fragments for mma.m16n8k16 / mma.m16n8k32", and ldmatrix).
 * Under nvcc each is one PTX instruction; under the emulator a warp-wide exchange (emu.h's
 * warp_gather) that computes the same result from the same registers, so a kernel that puts the
 * wrong element in a register gets the wrong answer in both builds. cuda_emu_test checks the
 * layouts below on both.
 *
 * Lane l of a warp is g = l / 4 (its group) and t = l % 4 (its place in the group). Every call is
 * warp-wide: all 32 lanes must execute it, converged.
 *
 * mma_s8_16x8x32: C[16x8] (s32) += A[16x32] (s8, row-major) B[32x8] (s8, column-major).
 *   a[0]: A[g][4t..4t+3]      a[1]: A[g+8][4t..4t+3]
 *   a[2]: A[g][16+4t..+3]     a[3]: A[g+8][16+4t..+3]   (byte j of a register: element +j)
 *   b[0]: B[4t..4t+3][g]      b[1]: B[16+4t..+3][g]
 *   c[0], c[1]: C[g][2t], C[g][2t+1]    c[2], c[3]: C[g+8][2t], C[g+8][2t+1]
 *   Sums wrap modulo 2^32 (no .satfinite).
 * mma_f16_16x8x16: C[16x8] (f32) += A[16x16] (f16, row-major) B[16x8] (f16, column-major).
 *   a[0]: A[g][2t..2t+1]      a[1]: A[g+8][2t..2t+1]
 *   a[2]: A[g][8+2t..+1]      a[3]: A[g+8][8+2t..+1]    (low half: the even element)
 *   b[0]: B[2t..2t+1][g]      b[1]: B[8+2t..+1][g]
 *   c as above, f32. Products are exact in f32; the order and rounding of the device's sum are
 *   not specified (the emulator sums in k order with fused multiply-adds), so kernels built on it
 *   are compared within a tolerance.
 * ldmatrix_x4(r, p) / ldmatrix_x4_trans: four 8x8 matrices of 16-bit elements from shared
 *   memory; lane l gives the address p of one 16-byte row: lanes 8i..8i+7 the rows 0-7 of
 *   matrix i. r[i] receives matrix i's row g, elements 2t and 2t+1 (.trans: the transpose's, i.e.
 *   elements [2t][g] and [2t+1][g]). */
#ifndef KVSERVE_CUDA_MMA_CUH
#define KVSERVE_CUDA_MMA_CUH

#include "kernels/cuda/cuda_rt.h"

namespace KV_CUDA_NS {

#ifdef KVSERVE_CUDA_EMU
/* The warp's registers: lane l's word i at w[l * GATHER_WORDS + i]. */
__device__ __forceinline__ uint32_t mma_word(const uint32_t *w, int lane, int i) {
    return w[lane * GATHER_WORDS + i];
}

/* An m16n8k(8 EPR) mma of EPR elements per register, as the tables above lay them out:
 * madd(sum, a's register, b's register, element) adds one product. */
template <int EPR, class Acc, class Madd>
__device__ __forceinline__ void mma_emu(Acc c[4], const uint32_t a[4], const uint32_t b[2],
                                        Madd madd) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    const uint32_t *w = emu::warp_gather(mine, 6);
    const int lane = emu::cur_thread->lane, g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; i++) {
        const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
        Acc s = c[i];
        for (int k = 0; k < 8 * EPR; k++) {
            const int hi = k / (4 * EPR), kt = (k % (4 * EPR)) / EPR, e = k % EPR;
            s = madd(s, mma_word(w, (row % 8) * 4 + kt, (row / 8) + 2 * hi),
                     mma_word(w, col * 4 + kt, 4 + hi), e);
        }
        c[i] = s;
    }
}
#endif

__device__ __forceinline__ void mma_s8_16x8x32(int c[4], const uint32_t a[4], const uint32_t b[2]) {
#ifdef KVSERVE_CUDA_EMU
    mma_emu<4>(c, a, b, [](int s, uint32_t x, uint32_t y, int e) {
        const int p = (int8_t)(x >> (8 * e)) * (int8_t)(y >> (8 * e));
        return (int)((uint32_t)s + (uint32_t)p); /* wraps, as the device's adds */
    });
#else
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, "
                 "%7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ void mma_f16_16x8x16(float c[4], const uint32_t a[4],
                                                const uint32_t b[2]) {
#ifdef KVSERVE_CUDA_EMU
    mma_emu<2>(c, a, b, [](float s, uint32_t x, uint32_t y, int e) {
        return std::fma(h2f((uint16_t)(x >> (16 * e))), h2f((uint16_t)(y >> (16 * e))), s);
    });
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, "
                 "%7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

#ifdef KVSERVE_CUDA_EMU
/* Matrix i's element [row][col] (16-bit) from the rows' addresses the warp gave. */
__device__ __forceinline__ uint32_t ldmatrix_elem(const uint32_t *w, int i, int row, int col) {
    const int lane = 8 * i + row;
    const uint64_t addr = (uint64_t)mma_word(w, lane, 0) | ((uint64_t)mma_word(w, lane, 1) << 32);
    uint16_t v;
    std::memcpy(&v, reinterpret_cast<const unsigned char *>((uintptr_t)addr) + 2 * col, 2);
    return v;
}
#endif

template <bool TRANS> __device__ __forceinline__ void ldmatrix_x4_as(uint32_t r[4], const void *p) {
#ifdef KVSERVE_CUDA_EMU
    const uint64_t addr = (uint64_t)(uintptr_t)p;
    const uint32_t mine[2] = {(uint32_t)addr, (uint32_t)(addr >> 32)};
    const uint32_t *w = emu::warp_gather(mine, 2);
    const int lane = emu::cur_thread->lane, g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; i++)
        r[i] = TRANS ? ldmatrix_elem(w, i, 2 * t, g) | ldmatrix_elem(w, i, 2 * t + 1, g) << 16
                     : ldmatrix_elem(w, i, g, 2 * t) | ldmatrix_elem(w, i, g, 2 * t + 1) << 16;
#else
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void *p) {
    ldmatrix_x4_as<false>(r, p);
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void *p) {
    ldmatrix_x4_as<true>(r, p);
}

} // namespace KV_CUDA_NS

#endif
