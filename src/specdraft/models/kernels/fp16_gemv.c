/* y = x W^T (+ bias) for fp16 weights and float32 rows: the decode and verify matmul of --weights fp16.
 *
 * Layout. W [N, K] is stored in tiles of 4 outputs: for each tile, K/8 blocks of 4 x 8 fp16
 * values (outputs n0..n0+3, inputs 8j..8j+7), 64 bytes, one cache line. A tile is one
 * contiguous stream, which the hardware prefetcher follows at full speed; four row-major weight
 * rows read side by side reached ~10-12 GB/s here against ~18 for this layout (2-core EPYC).
 *
 * Arithmetic. Each weight is widened exactly to float32 (F16C) and every (row, output) pair is
 * summed in one fixed order: one 8-lane float32 accumulator over the K/8 blocks, a fixed
 * horizontal sum, then the bias. So a row's result never depends on M or on the rows beside it
 * (speculative output equals plain output), and the bound of any float32 sum of K products
 * holds (the greedy head's screen relies on it).
 *
 * Rows are taken 3, 2 or 1 at a time against a tile (12 accumulators at most: a widened block
 * is used by every row of the tile); the tile stays in L1 while its rows pass over it, so the
 * weights stream from memory once per 24 rows (one pass for any decode or verify call). Prompts
 * go through the same code, a panel of 24 rows at a time: 1.1-1.4x FBGEMM's GEMM time for
 * Gemma 3 270M's layers at 2048 rows here, where widening W for MKL's float32 GEMM cost more.
 */
#include "simd.h"

#define OUTS 4 /* outputs per tile */

/* R rows from x against one tile: R x 4 accumulators, each block widened once for the R rows. */
#define TILE(R)                                                                                                \
static inline void tile_##R(const float *x, int64_t K, const uint16_t *tile, float *y, int64_t N, int64_t n0,   \
                            const float *bias) {                                                               \
    __m256 acc[R][OUTS];                                                                                       \
    for (int r = 0; r < R; r++)                                                                                \
        for (int o = 0; o < OUTS; o++) acc[r][o] = _mm256_setzero_ps();                                        \
    for (int64_t j = 0; j < K / 8; j++) {                                                                      \
        __m256 xr[R];                                                                                          \
        for (int r = 0; r < R; r++) xr[r] = _mm256_loadu_ps(x + r * K + 8 * j);                                \
        for (int o = 0; o < OUTS; o++) {                                                                       \
            const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + (j * OUTS + o) * 8)));   \
            for (int r = 0; r < R; r++) acc[r][o] = _mm256_fmadd_ps(xr[r], w, acc[r][o]);                       \
        }                                                                                                      \
    }                                                                                                          \
    for (int o = 0; o < OUTS && n0 + o < N; o++)                                                               \
        for (int r = 0; r < R; r++) {                                                                          \
            const float s = hsum8(acc[r][o]);                                                                  \
            y[r * N + n0 + o] = bias ? s + bias[n0 + o] : s;                                                   \
        }                                                                                                      \
}

TILE(1)
TILE(2)
TILE(3)

/* Rows per pass over the weights: a decode or verify call is one pass; a prompt's rows go a panel
 * at a time so that the panel stays in L2 while every tile meets it (24 x 2048 floats = 192 KB). */
#define PANEL 24

/* x [M, K] and y [M, N] contiguous, K a multiple of 8; tiles as above (N rounded up to a whole
 * tile, the extra outputs zero and not written); bias [N] or NULL. */
void fp16_gemv(const float *x, const uint16_t *tiles, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
               int threads)
{
    const int64_t count = (N + OUTS - 1) / OUTS;
    for (int64_t p = 0; p < M; p += PANEL) {
        const int64_t p1 = p + PANEL < M ? p + PANEL : M;
#pragma omp parallel for schedule(static) num_threads(threads) if (N * K >= (1 << 16))
        for (int64_t t = 0; t < count; t++) {
            const uint16_t *tile = tiles + t * OUTS * K;
            int64_t m = p;
            for (; m + 3 <= p1; m += 3) tile_3(x + m * K, K, tile, y + m * N, N, t * OUTS, bias);
            for (; m + 2 <= p1; m += 2) tile_2(x + m * K, K, tile, y + m * N, N, t * OUTS, bias);
            if (m < p1) tile_1(x + m * K, K, tile, y + m * N, N, t * OUTS, bias);
        }
    }
}
