/* The index of each row's largest value, as torch.argmax gives it (the first of equal maxima;
 * the first NaN where a row holds one).
 *
 * A greedy step reads the argmax of 262144 head scores per row. torch.argmax takes 0.2 ms for
 * one such row and 0.4 ms for four on a 2-core Zen 4 (its max alone: 0.01 ms), about 4% of a
 * whole decode step; this loop keeps a running maximum and its index per lane instead. */
#include <math.h>

#include "simd.h"

static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(x[i])) return i;
    return -1;
}

/* Four running maxima of 8 lanes each, so consecutive compares do not wait on each other:
 * accumulator a, lane j sees x[32 t + 8 a + j]; a strict > keeps each one's first maximum. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0, best = 0;
    float top = -INFINITY;
    if (n >= 32) {
        __m256 vmax[4], unordered = _mm256_setzero_ps();
        __m256i vidx[4], cur[4];
        const __m256i step = _mm256_set1_epi32(32);
        for (int a = 0; a < 4; a++) {
            vmax[a] = _mm256_loadu_ps(x + 8 * a);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(vmax[a], vmax[a], _CMP_UNORD_Q));
            vidx[a] = cur[a] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * a));
        }
        for (i = 32; i + 32 <= n; i += 32) {
            for (int a = 0; a < 4; a++) {
                const __m256 v = _mm256_loadu_ps(x + i + 8 * a);
                cur[a] = _mm256_add_epi32(cur[a], step);
                const __m256 gt = _mm256_cmp_ps(v, vmax[a], _CMP_GT_OQ);
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                vmax[a] = _mm256_blendv_ps(vmax[a], v, gt);
                vidx[a] = _mm256_castps_si256(
                    _mm256_blendv_ps(_mm256_castsi256_ps(vidx[a]), _mm256_castsi256_ps(cur[a]), gt));
            }
        }
        if (_mm256_movemask_ps(unordered)) return first_nan(x, n);
        best = n;
        for (int a = 0; a < 4; a++) {
            float m[8];
            int32_t at[8];
            _mm256_storeu_ps(m, vmax[a]);
            _mm256_storeu_si256((__m256i *)at, vidx[a]);
            for (int j = 0; j < 8; j++)
                if (m[j] > top || (m[j] == top && at[j] < best)) top = m[j], best = at[j];
        }
    }
    for (; i < n; i++) {
        if (isnan(x[i])) return first_nan(x, n);
        if (x[i] > top || (i == 0)) top = x[i], best = i;
    }
    return best;
}

/* x [M, n] float32 -> out [M] int64. Indices fit int32 lanes: n < 2^31. */
void argmax_rows(const float *x, int64_t M, int64_t n, int64_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 1)
    for (int64_t r = 0; r < M; r++) out[r] = argmax_row(x + r * n, n);
}
