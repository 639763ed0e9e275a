/* Attention of a few queries over the KV cache: scores, softmax and p.V in one call.
 *
 * For each query row (batch b, head h, query t) over keys 0..S-1 of KV head h / (H / Hkv):
 *
 *     s_j = scale * (q . k_j)                 (softcap: s_j = cap * tanh(s_j / cap))
 *     p_j = exp(s_j - max s) / sum exp(...)   over the keys the mask lets it see
 *     out = sum_j p_j v_j
 *
 * Work is split by KV head and by chunks of CHUNK keys at fixed offsets (keys 0..127, 128..255,
 * ...): a task reads its chunk's keys and values once for every query head that shares them
 * (GQA: Gemma 3 270M's 4 query heads read one KV head), and keeps per head the chunk's maximum,
 * sum of exponentials and weighted sum of values; the chunks are then merged in key order
 * (flash-decoding's split). Reading each cached key once instead of once per query head, with
 * both threads on different chunks, is what makes a decode step's attention cheap on 2 cores.
 *
 * Masked keys are skipped (in the reference they add exact zeros) and a chunk with no visible
 * key is left out of the merge, so a row's result depends only on its own query, its visible keys
 * and the fixed chunk boundaries: not on how many queries, rows or heads share the call, nor on
 * how far past its last visible key the span reaches. A (K+1)-query verification gives each
 * query the bits of a one-query step.
 */
#include <math.h>

#include "simd.h"

#define CHUNK 128

/* acc[0..D) += sum_j w[j] v_j over the visible keys of a chunk, in chunks of 64 outputs (8 registers). */
static void weighted_sum(const float *w, const uint8_t *visible, const float *v, int64_t n, int64_t D, float *acc_out) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            if (visible && !visible[j]) continue;
            const __m256 p = _mm256_set1_ps(w[j]);
            const float *vj = v + j * D + d0;
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * i), acc[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc_out + d0 + 8 * i, acc[i]);
    }
    for (int64_t d = d0; d < D; d++) { /* head sizes that are not a multiple of 64 */
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j++)
            if (!visible || visible[j]) acc = fmaf(w[j], v[j * D + d], acc);
        acc_out[d] = acc;
    }
}

/* q . k0 and q . k1 (D a multiple of 16), each summed exactly as dot_f32 sums it: two keys at a
 * time give the core four independent chains of multiply-adds instead of two (~15% faster
 * attention at 1200 keys, the same bits). */
static inline void dot2_f32(const float *q, const float *k0, const float *k1, int64_t D, float *x0, float *x1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
        const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
        a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k0 + i + 8), a1);
        b0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k1 + i), b0);
        b1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k1 + i + 8), b1);
    }
    *x0 = hsum8(_mm256_add_ps(a0, a1));
    *x1 = hsum8(_mm256_add_ps(b0, b1));
}

/* One query head over one chunk of n keys: part = [max, sum of exp, D weighted values]; max is
 * -inf when no key of the chunk is visible. s: n floats of scratch. */
static void chunk_partial(const float *q, const float *k, const float *v, const uint8_t *visible, int64_t n,
                          int64_t D, float scale, float softcap, float *s, float *part) {
    for (int64_t j = 0; j < n; j++) {
        if (visible && !visible[j]) continue;
        if (D % 16 == 0 && j + 1 < n && (!visible || visible[j + 1])) {
            dot2_f32(q, k + j * D, k + (j + 1) * D, D, &s[j], &s[j + 1]);
            j++;
        } else {
            s[j] = dot_f32(q, k + j * D, D);
        }
    }
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        if (visible && !visible[j]) continue;
        float x = s[j] * scale;
        if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
        s[j] = x;
        if (x > top) top = x;
    }
    part[0] = top;
    if (top == -INFINITY) return;
    float total = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        if (visible && !visible[j]) continue;
        s[j] = expf(s[j] - top);
        total += s[j];
    }
    part[1] = total;
    weighted_sum(s, visible, v, n, D, part + 2);
}

/* Floats of `work` attend_rows needs. */
int64_t attend_work(int64_t B, int64_t H, int64_t T, int64_t S, int64_t D) {
    const int64_t chunks = (S + CHUNK - 1) / CHUNK;
    return B * H * T * chunks * (CHUNK + D + 2);
}

/* q [B, H, T, D] (strides q_sb, q_sh, q_st; D contiguous), k and v [B, Hkv, S, D] (strides k_sb,
 * k_sh, v_sb, v_sh; keys contiguous), mask [B, 1, T, S] bool (strides m_sb, m_st; NULL: all
 * visible), out [B, T, H, D] contiguous (what the output projection reads), work: attend_work floats. */
void attend_rows(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st,
                 const float *k, const float *v, int64_t k_sb, int64_t k_sh, int64_t v_sb, int64_t v_sh,
                 const uint8_t *mask, int64_t m_sb, int64_t m_st, float *out,
                 int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 float scale, float softcap, float *work, int threads)
{
    const int64_t group = H / Hkv, chunks = (S + CHUNK - 1) / CHUNK, tasks = B * Hkv * T * chunks;
    float *parts = work, *scores = work + B * H * T * chunks * (D + 2); /* parts [B, H, T, chunks, D + 2] */
    const int parallel = tasks > 1 && B * H * T * S * D >= (1 << 17); /* below that, waking threads costs more */
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t c = task % chunks, t = (task / chunks) % T, hk = (task / (chunks * T)) % Hkv,
                      b = task / (chunks * T * Hkv);
        const int64_t j0 = c * CHUNK, n = S - j0 < CHUNK ? S - j0 : CHUNK;
        const float *kc = k + b * k_sb + hk * k_sh + j0 * D, *vc = v + b * v_sb + hk * v_sh + j0 * D;
        const uint8_t *vis = mask ? mask + b * m_sb + t * m_st + j0 : 0;
        for (int64_t g = 0; g < group; g++) {
            const int64_t h = hk * group + g;
            chunk_partial(q + b * q_sb + h * q_sh + t * q_st, kc, vc, vis, n, D, scale, softcap,
                          scores + task * CHUNK, parts + (((b * H + h) * T + t) * chunks + c) * (D + 2));
        }
    }
    /* merge each row's chunks in key order */
#pragma omp parallel for schedule(static) num_threads(threads) if (B * H * T * chunks * D >= (1 << 16))
    for (int64_t r = 0; r < B * H * T; r++) {
        const int64_t b = r / (H * T), h = (r / T) % H, t = r % T;
        const float *p = parts + r * chunks * (D + 2);
        float *o = out + ((b * T + t) * H + h) * D;
        float top = -INFINITY;
        for (int64_t c = 0; c < chunks; c++)
            if (p[c * (D + 2)] > top) top = p[c * (D + 2)];
        if (top == -INFINITY) { /* no visible key: NaN, as softmax over -inf gives */
            for (int64_t d = 0; d < D; d++) o[d] = NAN;
            continue;
        }
        float total = 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *pc = p + c * (D + 2);
            if (pc[0] == -INFINITY) continue;
            const float f = expf(pc[0] - top);
            total += f * pc[1];
            for (int64_t d = 0; d < D; d++) o[d] += f * pc[2 + d];
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}
