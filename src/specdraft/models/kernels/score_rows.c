/* Scores of vectors against gathered table rows: out[n, m] = x[n] . table[cand[n, m]].
 *
 * The MTP drafter's clustered head scores each draft against the ~4096 tokens of its top
 * clusters. PyTorch gathers those rows into a new tensor, widens them from fp16 and runs a
 * batched matmul (~4 ms a draft step on a 2-core AVX2 CPU); here each row is read once, widened
 * in registers (F16C) and dotted in place. Each score is summed in one fixed order.
 */
#include "simd.h"

static float dot_f16(const float *x, const uint16_t *w, int64_t d) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i))), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8),
                               _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i + 8))), acc1);
    }
    for (; i + 8 <= d; i += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i))), acc0);
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; i < d; i++) s += x[i] * _cvtsh_ss(w[i]);
    return s;
}

/* x [N, d] float32, table [V, d] (fp16 bits when half, else float32), cand [N, M] int64, out [N, M]. */
void score_rows(const float *x, const void *table, int half, const int64_t *cand, float *out, int64_t N, int64_t M,
                int64_t d, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (N * M * d >= (1 << 20))
    for (int64_t i = 0; i < N * M; i++) {
        const int64_t n = i / M, row = cand[i];
        out[i] = half ? dot_f16(x + n * d, (const uint16_t *)table + row * d, d)
                      : dot_f32(x + n * d, (const float *)table + row * d, d);
    }
}
