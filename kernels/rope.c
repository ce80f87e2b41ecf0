/* RoPE (Su et al. 2021, "RoFormer", section 3.4) as GGML's "normal" rope applies it, which
 * llama-arch GGUF files are converted for: the pairs of adjacent dims (2i, 2i + 1) turned by
 * pos * inv_freq[i], any scaling already folded into inv_freq (model/llama.c). The CPU backend's
 * rope op and the CacheGen codec (which turns keys back before coding them and forward after
 * decoding) both rotate with these two functions. */
#include <math.h>

#include "kernels/rope.h"

#include <stddef.h>

void rope_angles(const rope_table *r, int64_t pos, float *cs) {
    for (int i = 0; i < r->n_rot / 2; i++) {
        double theta = (double)pos * (double)r->inv_freq[i]; /* rounded to f32 once */
        cs[2 * i] = (float)cos(theta);
        cs[2 * i + 1] = (float)sin(theta);
    }
}

void rope_rotate(float *x, int n_head, int head_dim, int n_rot, const float *cs, bool inverse) {
    /* Turning back is turning by the negated angle: the sine's sign, exact in f32. */
    const float sign = inverse ? -1.0f : 1.0f;
    for (int h = 0; h < n_head; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < n_rot / 2; i++) {
            float c = cs[2 * i], s = sign * cs[2 * i + 1], x0 = v[2 * i], x1 = v[2 * i + 1];
            v[2 * i] = x0 * c - x1 * s;
            v[2 * i + 1] = x0 * s + x1 * c;
        }
    }
}
