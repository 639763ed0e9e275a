/* Queries and keys for attention, from the fused q/k/v projection's output, in one call:
 *
 *     q, k = q_norm(q), k_norm(k)              (RMSNorm per head, where the model has them)
 *     q, k = q cos + roll(q, D/2) sin', same for k   (RoPE; sin' = sin with its first half negated)
 *     q -> q_out [M, Hq, D];  k, v -> the KV cache at each row's position
 *
 * Eager PyTorch spends ~15 small ops a layer on this (views, two norms, two RoPEs of four ops
 * each, two indexed cache writes). Each product and sum is rounded as PyTorch's ops round them
 * (no FMA contraction: x cos and roll(x) sin' are rounded, then added), and every row is
 * computed on its own.
 */
#include <math.h>
#include <string.h>

#include "simd.h"

/* out = rope(norm(x)) for one head of D values; scale NULL: no norm. */
static void norm_rope(const float *x, const float *scale, float eps, const float *cos, const float *sin, int64_t D,
                      float *out) {
    float y[1024]; /* head_dim <= 1024 (checked by the caller) */
    if (scale) {
        const float r = 1.0f / sqrtf(dot_f32(x, x, D) / (float)D + eps);
        for (int64_t i = 0; i < D; i++) y[i] = (x[i] * r) * scale[i];
    } else {
        memcpy(y, x, D * sizeof(float));
    }
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) {
        const float rolled = y[i < half ? i + half : i - half];
        const float a = y[i] * cos[i], b = rolled * sin[i];
        out[i] = a + b;
    }
}

/* qkv [M, (Hq + 2 Hkv) D] (row m = batch b * T + query t), cos and sin [M, D], positions [B, T];
 * q_out [M, Hq, D]; K/V cache [B, Hkv, capacity, D] with strides (batch, head) and D contiguous
 * per position. q_scale, k_scale [D] or NULL. */
void qk_rope_write(const float *qkv, int64_t M, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                   const float *q_scale, const float *k_scale, float eps, const float *cos, const float *sin,
                   const int64_t *positions, float *q_out, float *k_cache, int64_t k_sb, int64_t k_sh,
                   float *v_cache, int64_t v_sb, int64_t v_sh, int threads)
{
    const int64_t width = (Hq + 2 * Hkv) * D, heads = Hq + Hkv;
#pragma omp parallel for schedule(static) num_threads(threads) if (M * heads * D >= (1 << 16))
    for (int64_t task = 0; task < M * heads; task++) {
        const int64_t m = task / heads, h = task % heads, b = m / T;
        const float *row = qkv + m * width;
        const float *c = cos + m * D, *s = sin + m * D;
        if (h < Hq) {
            norm_rope(row + h * D, q_scale, eps, c, s, D, q_out + (m * Hq + h) * D);
            continue;
        }
        const int64_t hk = h - Hq, pos = positions[m];
        norm_rope(row + (Hq + hk) * D, k_scale, eps, c, s, D, k_cache + b * k_sb + hk * k_sh + pos * D);
        memcpy(v_cache + b * v_sb + hk * v_sh + pos * D, row + (Hq + Hkv + hk) * D, D * sizeof(float));
    }
}
