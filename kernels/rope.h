/* RoPE's frequencies and rotation (kernels/rope.c), shared by the backends and the CacheGen
 * codec. */
#ifndef KVSERVE_ROPE_H
#define KVSERVE_ROPE_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* RoPE frequencies: inv_freq[i] for the pair (2i, 2i+1) of the first n_rot dims of a head
 * (GGML's "normal" rope, as GGUF llama models need). Scaling is folded into inv_freq. */
typedef struct rope_table {
    int n_rot;       /* rotated dims per head (<= head_dim, even) */
    float *inv_freq; /* [n_rot / 2] */
} rope_table;

/* The rotation as plain host code (rope.c), shared by the CPU backend's rope op and the codec,
 * so a key turned by one and back by the other is turned by the same arithmetic.
 * rope_angles: cs[2i], cs[2i + 1] = cos, sin of pos * inv_freq[i] for each pair i < n_rot / 2
 * (the angle in double, rounded to f32 once). rope_rotate: turns, in place, the pairs of the
 * first n_rot dims of each of one token's n_head heads (x: [n_head][head_dim]) by those angles:
 * (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), or back by them when inverse. */
void rope_angles(const rope_table *r, int64_t pos, float *cs);
void rope_rotate(float *x, int n_head, int head_dim, int n_rot, const float *cs, bool inverse);

#ifdef __cplusplus
}
#endif

#endif
