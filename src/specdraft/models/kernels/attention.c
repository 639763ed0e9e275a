/* Attention of a few queries over the KV cache: scores, softmax and p.V in one call.
 *
 * For each query row (batch b, head h, query t) over keys 0..S-1 of KV head h / (H / Hkv):
 *
 *     s_j = scale * (q . k_j)                 (softcap: s_j = cap * tanh(s_j / cap))
 *     p_j = exp(s_j - max s) / sum exp(...)   over the keys the mask lets it see
 *     out = sum_j p_j v_j
 *
 * Masked keys are skipped (in the reference they add exact zeros). Every row is computed on its
 * own in one fixed order, so its result does not depend on how many queries, rows or heads share
 * the call: a (K+1)-query verification gives each query the bits of a one-query step.
 *
 * Eager PyTorch spends ~0.4 ms a layer on this for one query over 640 keys (two matmuls that
 * each wake the thread pool, a mask fill, a softmax, casts); here it is a few tens of us.
 */
#include <math.h>

#include "simd.h"

/* out[0..D) = sum_j w[j] v_j over the visible keys, in chunks of 64 outputs (8 registers). */
static void weighted_sum(const float *w, const uint8_t *visible, const float *v, int64_t S, int64_t D, float *out) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < S; j++) {
            if (visible && !visible[j]) continue;
            const __m256 p = _mm256_set1_ps(w[j]);
            const float *vj = v + j * D + d0;
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * i), acc[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + d0 + 8 * i, acc[i]);
    }
    for (int64_t d = d0; d < D; d++) { /* head sizes that are not a multiple of 64 */
        float acc = 0.0f;
        for (int64_t j = 0; j < S; j++)
            if (!visible || visible[j]) acc = fmaf(w[j], v[j * D + d], acc);
        out[d] = acc;
    }
}

static void attend_one(const float *q, const float *k, const float *v, const uint8_t *visible, float *out,
                       int64_t S, int64_t D, float scale, float softcap, float *s) {
    float top = -INFINITY;
    for (int64_t j = 0; j < S; j++) {
        if (visible && !visible[j]) continue;
        float x = dot_f32(q, k + j * D, D) * scale;
        if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
        s[j] = x;
        if (x > top) top = x;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < S; j++) {
        if (visible && !visible[j]) continue;
        s[j] = expf(s[j] - top);
        total += s[j];
    }
    const float inv = 1.0f / total; /* no visible key: 1/0, and NaN below, as softmax over -inf gives */
    for (int64_t j = 0; j < S; j++)
        if (!visible || visible[j]) s[j] *= inv;
    if (top == -INFINITY) {
        for (int64_t d = 0; d < D; d++) out[d] = NAN;
        return;
    }
    weighted_sum(s, visible, v, S, D, out);
}

/* q [B, H, T, D] (strides q_sb, q_sh, q_st; D contiguous), k and v [B, Hkv, S, D] (strides k_sb,
 * k_sh, v_sb, v_sh; keys contiguous), mask [B, 1, T, S] bool (strides m_sb, m_st; NULL: all
 * visible), out [B, T, H, D] contiguous (what the output projection reads), work [B*H*T, S]. */
void attend_rows(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st,
                 const float *k, const float *v, int64_t k_sb, int64_t k_sh, int64_t v_sb, int64_t v_sh,
                 const uint8_t *mask, int64_t m_sb, int64_t m_st, float *out,
                 int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 float scale, float softcap, float *work, int threads)
{
    const int64_t rows = B * H * T, group = H / Hkv;
    const int parallel = rows > 1 && rows * S * D >= (1 << 17); /* below that, waking threads costs more */
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / (H * T), h = (r / T) % H, t = r % T, hk = h / group;
        attend_one(q + b * q_sb + h * q_sh + t * q_st, k + b * k_sb + hk * k_sh, v + b * v_sb + hk * v_sh,
                   mask ? mask + b * m_sb + t * m_st : 0, out + ((b * T + t) * H + h) * D, S, D, scale, softcap,
                   work + r * S);
    }
}
