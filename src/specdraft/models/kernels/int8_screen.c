/* The greedy head's screen on int8 blocks: approximate scores with a proven error bound.
 *
 * The table is int8 codes c with one float32 scale s per 32 inputs (a GGUF Q8_0 table is
 * exactly that). Each hidden row h is quantised the same way: per 32 inputs a scale
 * t = max|h| / 127 and codes q = round(h / t). A score is then
 *
 *     a = sum over groups g of (s_g * t_g) * I_g,   I_g = sum_i c_i q_i   (integers: exact)
 *
 * so a 262144 x 640 table is read as 1 byte a weight, and 32 products cost one AVX2
 * multiply-add of bytes (vpmaddubsw) instead of four float ones. The screen's callers bound
 * |w . h - a| with the residual r = h - t q that `q8_quantize_rows` reports (screened_head.py),
 * and rescore exactly the few tokens that can still win.
 *
 * Every (token, row) pair is summed in one fixed order whatever the number of rows M.
 */
#include <math.h>
#include <stdlib.h>

#include "simd.h"

#define GROUP 32
#define ROW_BLOCK 4 /* rows that share one read of a table row: 4 measured faster than 8 (registers) */

/* x [M, K] float32 -> q [M, K] int8, t [M, K/32] float32, and per row in float64 the norms
 * ||x - t q|| (residual) and ||t q||. */
void q8_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *q, float *t, double *residual, double *quantised,
                      int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        double rr = 0.0, qq = 0.0;
        for (int64_t g = 0; g < K / GROUP; g++) {
            const float *xg = x + m * K + g * GROUP;
            float top = 0.0f;
            for (int i = 0; i < GROUP; i++) top = fmaxf(top, fabsf(xg[i]));
            const float scale = top / 127.0f;
            t[m * (K / GROUP) + g] = scale;
            for (int i = 0; i < GROUP; i++) {
                float c = scale > 0.0f ? nearbyintf(xg[i] / scale) : 0.0f;
                c = fminf(127.0f, fmaxf(-127.0f, c));
                q[m * K + g * GROUP + i] = (int8_t)c;
                const double back = (double)scale * (double)c; /* exact: 24 x 8 bits */
                rr += (xg[i] - back) * (xg[i] - back);
                qq += back * back;
            }
        }
        residual[m] = sqrt(rr);
        quantised[m] = sqrt(qq);
    }
}

/* The hidden rows as the tiles read them: codes q and scales t (q8_quantize_rows), and for the
 * VNNI loop below q + 128 and the scales in pairs, prepared once per call. */
typedef struct {
    const int8_t *q;
    const float *t;
    int8_t *shifted;
    void *tpair;
} Rows;

/* One group's 32 byte products c * x summed in fours to 8 int32 lanes (exact): |c| as unsigned
 * bytes (-128 -> 128) times x with c's sign. */
static inline __m256i group_products(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                             _mm256_set1_epi16(1));
}

/* One table row n against MB rows from m0: per group, the products widened and accumulated with
 * the group's scale s * t in float32. */
#define TILE(MB)                                                                                       \
static void tile_##MB(const Rows *rows, const int8_t *codes, const float *scales, float *y,            \
                      int64_t n, int64_t m0, int64_t K, int64_t N) {                                  \
    const int8_t *q = rows->q;                                                                         \
    const float *t = rows->t;                                                                          \
    const int64_t G = K / GROUP;                                                                       \
    const int8_t *c = codes + n * K;                                                                   \
    const float *s = scales + n * G;                                                                   \
    __m256 acc[MB];                                                                                    \
    for (int r = 0; r < MB; r++) acc[r] = _mm256_setzero_ps();                                         \
    for (int64_t g = 0; g < G; g++) {                                                                  \
        const __m256i w = _mm256_loadu_si256((const __m256i *)(c + g * GROUP));                        \
        for (int r = 0; r < MB; r++) {                                                                 \
            const __m256i x = _mm256_loadu_si256((const __m256i *)(q + (m0 + r) * K + g * GROUP));     \
            const __m256i p = group_products(w, x);                                                    \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s[g] * t[(m0 + r) * G + g]), acc[r]); \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < MB; r++) y[(m0 + r) * N + n] = hsum8(acc[r]);                                  \
}

TILE(1)
TILE(2)
TILE(3)
TILE(4)

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* AVX-512 VNNI: one vpdpbusd multiplies 64 bytes (two groups) and sums them in fours to 16 int32
 * lanes, lanes 0-7 the even group, 8-15 the odd one. It takes unsigned x signed bytes, so the
 * rows arrive as q + 128 (`shifted`) and each lane takes back 128 x (the table row's four codes):
 * the same exact integers as above. Each lane then adds its group's I x (s t) as above; a row's
 * sum order is fixed (lanes across pairs, a last odd group on 8 lanes, the reductions), the
 * bound's gamma_(G+5) still covers its depth (screened_head.py). */
static inline __m512 pair_of(float even, float odd) {
    return _mm512_insertf32x8(_mm512_set1_ps(even), _mm256_set1_ps(odd), 1);
}

#define TILE512(MB)                                                                                   \
static void tile512_##MB(const Rows *rows, const int8_t *codes, const float *scales, float *y,         \
                         int64_t n, int64_t m0, int64_t K, int64_t N) {                                  \
    const int8_t *q = rows->q, *shifted = rows->shifted;                                              \
    const float *t = rows->t;                                                                         \
    const __m512 *tpair = rows->tpair;                                                                \
    const int64_t G = K / GROUP, P = G / 2;                                                           \
    const int8_t *c = codes + n * K;                                                                  \
    const float *s = scales + n * G;                                                                  \
    const __m512i excess = _mm512_set1_epi8((char)0x80);                                              \
    __m512 acc[MB];                                                                                   \
    for (int r = 0; r < MB; r++) acc[r] = _mm512_setzero_ps();                                        \
    for (int64_t p = 0; p < P; p++) {                                                                 \
        const __m512i w = _mm512_loadu_si512((const void *)(c + p * 64));                             \
        const __m512i back = _mm512_dpbusd_epi32(_mm512_setzero_si512(), excess, w);                  \
        const __m512 sv = pair_of(s[2 * p], s[2 * p + 1]);                                            \
        for (int r = 0; r < MB; r++) {                                                                \
            const __m512i x = _mm512_loadu_si512((const void *)(shifted + (m0 + r) * K + p * 64));    \
            const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x, w), back); \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, tpair[(m0 + r) * P + p]), acc[r]); \
        }                                                                                             \
    }                                                                                                 \
    for (int r = 0; r < MB; r++) {                                                                    \
        float sum = _mm512_reduce_add_ps(acc[r]);                                                     \
        if (G & 1) { /* the last group of an odd count, as the AVX2 loop does it */                  \
            const int64_t g = G - 1;                                                                  \
            const __m256i w = _mm256_loadu_si256((const __m256i *)(c + g * GROUP));                   \
            const __m256i x = _mm256_loadu_si256((const __m256i *)(q + (m0 + r) * K + g * GROUP));    \
            const __m256i prod = group_products(w, x);                                                \
            sum += hsum8(_mm256_mul_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(s[g] * t[(m0 + r) * G + g]))); \
        }                                                                                             \
        y[(m0 + r) * N + n] = sum;                                                                    \
    }                                                                                                 \
}

TILE512(1)
TILE512(2)
TILE512(3)
TILE512(4)

static Rows prepare_rows(const int8_t *q, const float *t, int64_t M, int64_t K) {
    const int64_t G = K / GROUP, P = G / 2;
    Rows rows = {q, t, malloc(M * K), aligned_alloc(64, sizeof(__m512) * (M * P + 1))};
    __m512 *tpair = rows.tpair;
    for (int64_t i = 0; i < M * K; i++) rows.shifted[i] = (int8_t)(q[i] ^ 0x80);
    for (int64_t m = 0; m < M; m++)
        for (int64_t p = 0; p < P; p++) tpair[m * P + p] = pair_of(t[m * G + 2 * p], t[m * G + 2 * p + 1]);
    return rows;
}
#define TILE_OF(MB) tile512_##MB
#else
static Rows prepare_rows(const int8_t *q, const float *t, int64_t M, int64_t K) {
    (void)M, (void)K;
    Rows rows = {q, t, 0, 0};
    return rows;
}
#define TILE_OF(MB) tile_##MB
#endif

/* q [M, K] int8 and t [M, K/32] (from q8_quantize_rows), codes [N, K] int8, scales [N, K/32]
 * float32 -> y [M, N] float32. K a multiple of 32. */
void q8_gemv(const int8_t *q, const float *t, const int8_t *codes, const float *scales, float *y, int64_t M,
             int64_t N, int64_t K, int threads)
{
    Rows rows = prepare_rows(q, t, M, K);
    const int64_t chunk = 64, tasks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t n0 = task * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int64_t mb = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
            for (int64_t n = n0; n < n1; n++) {
                if (m0 == 0 && n + PREFETCH_AHEAD < N) /* later row blocks find the chunk in L2 */
                    prefetch_bytes(codes + (n + PREFETCH_AHEAD) * K, K);
                switch (mb) { /* inlined tiles: a call through a pointer per row measured 10-25% slower */
                case 1: TILE_OF(1)(&rows, codes, scales, y, n, m0, K, N); break;
                case 2: TILE_OF(2)(&rows, codes, scales, y, n, m0, K, N); break;
                case 3: TILE_OF(3)(&rows, codes, scales, y, n, m0, K, N); break;
                default: TILE_OF(4)(&rows, codes, scales, y, n, m0, K, N); break;
                }
            }
        }
    }
    free(rows.shifted);
    free(rows.tpair);
}

/* The tokens whose screened score can still be the row's maximum: per row m of scores [M, N],
 * every n with scores[m, n] >= max_m - 2 bound[m] (float32, as `scores >= top - 2 * bound`
 * computes it), in increasing n, the first `cap` of them into tokens [M, cap]; counts[m] is how
 * many there are (past cap too: the caller screens a crowded row again). A row holding a NaN
 * gets count 0, as the comparison against a NaN maximum gives. Two passes over a row (its
 * maximum, then the candidates) instead of four full-vocabulary tensor ops. */
void screen_candidates(const float *scores, const float *bound, int64_t M, int64_t N, int64_t cap, int64_t *tokens,
                       int64_t *counts, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        const float *s = scores + m * N;
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t n = 0;
        for (; n + 8 <= N; n += 8) {
            const __m256 v = _mm256_loadu_ps(s + n);
            top = _mm256_max_ps(top, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float most = -INFINITY;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        float lanes[8];
        _mm256_storeu_ps(lanes, top);
        for (int i = 0; i < 8; i++) most = lanes[i] > most ? lanes[i] : most;
        for (; n < N; n++) {
            has_nan |= isnan(s[n]);
            most = s[n] > most ? s[n] : most;
        }
        if (has_nan) {
            counts[m] = 0;
            continue;
        }
        const float threshold = most - 2.0f * bound[m];
        const __m256 t = _mm256_set1_ps(threshold);
        int64_t count = 0;
        for (n = 0; n + 8 <= N; n += 8) {
            int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + n), t, _CMP_GE_OQ));
            while (mask) {
                const int i = __builtin_ctz(mask);
                if (count < cap) tokens[m * cap + count] = n + i;
                count++;
                mask &= mask - 1;
            }
        }
        for (; n < N; n++)
            if (s[n] >= threshold) {
                if (count < cap) tokens[m * cap + count] = n;
                count++;
            }
        counts[m] = count;
    }
}

/* Each row's argmax over its candidates (screen_candidates' tokens and counts) of the exact
 * scores w . h against the float32 table [N, K]: the products of two float32 numbers are exact in
 * float64 and are summed with Neumaier's compensation (an error near 2^-100 of the sum of their
 * magnitudes), the lowest token on a tie (tokens come in increasing order). choice[m] = -1 for
 * a row with no candidate (a NaN) or more than cap (a crowded row, screened again by the
 * caller). One call in place of a dozen small tensor ops a step. */
void rescore_candidates(const float *rows, const float *table, int64_t M, int64_t K, const int64_t *tokens,
                        const int64_t *counts, int64_t cap, int64_t *choice, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        const int64_t count = counts[m];
        if (count == 0 || count > cap) {
            choice[m] = -1;
            continue;
        }
        const float *h = rows + m * K;
        double best = 0.0;
        int64_t pick = -1;
        for (int64_t c = 0; c < count; c++) {
            const int64_t n = tokens[m * cap + c];
            const float *w = table + n * K;
            double sum = 0.0, comp = 0.0;
            for (int64_t k = 0; k < K; k++) {
                const double p = (double)w[k] * (double)h[k], t = sum + p;
                comp += fabs(sum) >= fabs(p) ? (sum - t) + p : (p - t) + sum;
                sum = t;
            }
            const double score = sum + comp;
            if (pick < 0 || score > best) {
                best = score;
                pick = n;
            }
        }
        choice[m] = pick;
    }
}
