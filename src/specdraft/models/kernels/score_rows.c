/* Scores of vectors against gathered table rows: out[n, m] = x[n] . table[cand[n, m]].
 *
 * The MTP drafter's clustered head scores each draft against the ~4096 tokens of its top
 * clusters. PyTorch gathers those rows into a new tensor, widens them from fp16 and runs a
 * batched matmul (~4 ms a draft step on a 2-core AVX2 CPU); here each row is read once, widened
 * in registers (F16C) and dotted in place. Each score is summed in one fixed order.
 *
 * The rows lie scattered over a table of hundreds of MB and none is in cache at a draft step, so
 * the rows PREFETCH_AHEAD candidates on are asked for while this one is dotted: 0.6 instead of
 * 0.8 ms for 4096 fp16 rows of 640 on a 2-core Zen 4 (BENCHMARKS.md).
 *
 * draft_head is a draft step's whole clustered head after the centroid scores: the top clusters,
 * their tokens' scores, the copy gate's bonuses and, drafting greedily, the argmax and its
 * probability, in one call instead of a dozen tensor ops (each ~10-30 us, ~0.5 ms a step).
 */
#include <float.h>
#include <math.h>

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

/* x . table[row] for a table of fp16 bits (half) or float32. */
static inline float dot_row(const float *x, const void *table, int half, int64_t row, int64_t d) {
    return half ? dot_f16(x, (const uint16_t *)table + row * d, d) : dot_f32(x, (const float *)table + row * d, d);
}

static inline void prefetch_row(const void *table, int half, int64_t row, int64_t d) {
    const int64_t width = half ? 2 : 4;
    prefetch_bytes((const char *)table + row * d * width, d * width);
}

/* x [N, d] float32, table [V, d] (fp16 bits when half, else float32), cand [N, M] int64, out [N, M]. */
void score_rows(const float *x, const void *table, int half, const int64_t *cand, float *out, int64_t N, int64_t M,
                int64_t d, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (N * M * d >= (1 << 20))
    for (int64_t i = 0; i < N * M; i++) {
        if (i + PREFETCH_AHEAD < N * M) prefetch_row(table, half, cand[i + PREFETCH_AHEAD], d);
        out[i] = dot_row(x + (i / M) * d, table, half, cand[i], d);
    }
}

/* The indices of the k largest of s[0..C), largest first; ties to the lower index. */
static void top_indices(const float *s, int64_t C, int64_t k, int64_t *top) {
    int64_t n = 0;
    for (int64_t c = 0; c < C; c++) {
        if (n == k && !(s[c] > s[top[k - 1]])) continue;
        int64_t j = n < k ? n++ : k - 1;  /* insertion: shift the smaller ones down */
        while (j > 0 && s[c] > s[top[j - 1]]) {
            top[j] = top[j - 1];
            j--;
        }
        top[j] = c;
    }
}

/* A draft step's clustered head for N rows.
 *   x [N, d] float32 (the vector scored against the table), table [V, d], cscores [N, C] the
 *   centroid scores; clusters [C, S] int64 token ids; cluster_of / place [V] int32 (a token's
 *   cluster and its place in it); copies [N, 2] int64 (-1: none) and bonus [N, 2] float32, or
 *   NULL for a drafter without a copy gate.
 * Out: logits [N, W] and their tokens cands [N, W] (W = k * S, plus 2 with copies): the tokens of
 * the top k clusters (top [N, k], best first; ties to the lower cluster) then one column per
 * copy, as MTPDrafter.logits lays them out: each bonus added to its token's logit in copy order,
 * a copy outside the clusters scored in its own column, -inf in a copy column not used. When
 * token is not NULL: token [N] the argmax (the first of equals) and prob [N] its probability under
 * the softmax of the row's logits, for greedy drafting. */
void draft_head(const float *x, const void *table, int half, const float *cscores, int64_t C, int64_t k,
                const int64_t *clusters, int64_t S, const int32_t *cluster_of, const int32_t *place,
                const int64_t *copies, const float *bonus, float *logits, int64_t *cands, int64_t *top,
                int64_t *token, float *prob, int64_t N, int64_t d, int threads)
{
    const int64_t M = k * S, W = copies ? M + 2 : M;
    for (int64_t n = 0; n < N; n++) {
        top_indices(cscores + n * C, C, k, top + n * k);
        for (int64_t m = 0; m < M; m++) cands[n * W + m] = clusters[top[n * k + m / S] * S + m % S];
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (N * M * d >= (1 << 20))
    for (int64_t i = 0; i < N * M; i++) {
        const int64_t n = i / M, j = i + PREFETCH_AHEAD;
        if (j < N * M) prefetch_row(table, half, cands[(j / M) * W + j % M], d);
        logits[n * W + i % M] = dot_row(x + n * d, table, half, cands[n * W + i % M], d);
    }
    for (int64_t n = 0; n < N; n++) {
        float *l = logits + n * W;
        int64_t cols[2] = {-1, -1};
        for (int c = 0; copies && c < 2; c++) {
            const int64_t t = copies[n * 2 + c];
            l[M + c] = -INFINITY;
            cands[n * W + M + c] = t < 0 ? 0 : t;
            if (t < 0) continue;
            int64_t col = -1;
            for (int e = 0; e < c; e++)
                if (copies[n * 2 + e] == t) col = cols[e];
            for (int64_t r = 0; col < 0 && r < k; r++)
                if (top[n * k + r] == cluster_of[t]) col = r * S + place[t];
            if (col < 0) {  /* outside the clusters: a candidate of its own */
                col = M + c;
                l[col] = dot_row(x + n * d, table, half, t, d);
            }
            cols[c] = col;
            l[col] += bonus[n * 2 + c];
        }
        if (!token) continue;
        int64_t best = 0;
        for (int64_t m = 1; m < W; m++)
            if (l[m] > l[best]) best = m;
        float total = 0.0f;
        for (int64_t m = 0; m < W; m++) total += expf(l[m] - l[best]);
        prob[n] = 1.0f / total;
        token[n] = cands[n * W + best];
    }
}
