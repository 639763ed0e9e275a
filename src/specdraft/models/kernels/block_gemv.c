/* y = x W^T for W stored as GGUF-style blocks: one int8 code per weight (or two 4-bit codes a
 * byte: block_gemv_packed, at the end), and per group of G inputs a float32 scale s and offset o
 * (offset may be absent), so that the weight is
 *
 *     w = fl(fl(s * c) - o)
 *
 * which is exactly how llama.cpp's Q8_0, Q5_0, Q6_K and Q4_K blocks dequantise to float32 (the
 * model's float32 weights ARE these numbers). The kernel widens each code, rebuilds w with the
 * same two roundings and accumulates w * x in float32: the products are the float32 model's, only
 * the order of the sum is the kernel's own.
 *
 * Row invariance: every (output, row) pair is summed in one fixed order (two 8-lane, or on
 * AVX-512 16-lane, accumulators for the even and the odd chunks, then a fixed horizontal sum), whatever the number of
 * rows M in the call and however outputs are tiled across threads. So a row's result never
 * depends on the rows computed beside it: a (K+1)-row verification gives each row the bits of a
 * one-row step.
 *
 * Built on first use with the system C compiler (models/formats/block_linear.py). OpenMP resolves to the
 * runtime torch has already loaded (the same soname), so the two share one thread pool.
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

/* Two accumulators per (output, row): the even and the odd 8-input (16 on AVX-512) chunks. Four gave no
 * gain on a 2-core AVX2 EPYC; a 4-row block reads each weight row once per 4 rows and measured
 * fastest against 2 and 3 (BENCHMARKS.md). */
#define ACCS 2
#define ROW_BLOCK 4

static inline __m256 widen8(const int8_t *codes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)codes)));
}

static inline float hsum(const __m256 *acc) {
    __m256 v = acc[0];
    for (int a = 1; a < ACCS; a++) v = _mm256_add_ps(v, acc[a]);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* 0+4, 1+5, 2+6, 3+7 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                         /* + the pair 2 away */
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));                                  /* + the next */
    return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
/* AVX-512: 16 lanes, two accumulators (the even and the odd 16-input chunks), then the
 * compiler's fixed reduction. A different order from the AVX2 loop below, but one order for
 * every row and every M, which is what row invariance needs. */
#define LANES 16
typedef __m512 vec;
static inline vec widen(const int8_t *codes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
}
static inline float vsum(const vec *acc) { return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])); }
#define VZERO _mm512_setzero_ps
#define VSET1 _mm512_set1_ps
#define VMUL _mm512_mul_ps
#define VSUB _mm512_sub_ps
#define VFMA _mm512_fmadd_ps
#define VLOAD _mm512_loadu_ps
#else
#define LANES 8
typedef __m256 vec;
static inline vec widen(const int8_t *codes) { return widen8(codes); }
static inline float vsum(const vec *acc) { return hsum(acc); }
#define VZERO _mm256_setzero_ps
#define VSET1 _mm256_set1_ps
#define VMUL _mm256_mul_ps
#define VSUB _mm256_sub_ps
#define VFMA _mm256_fmadd_ps
#define VLOAD _mm256_loadu_ps
#endif

/* One weight row (output n) against MB x rows (m0..), one function per MB so the accumulators
 * are a fixed-size array the compiler keeps in registers. K is a multiple of 16. */
#define TILE(MB)                                                                                   \
static void tile_##MB(const int8_t *codes, const float *scales, const float *offsets,               \
                      const float *x, float *y, int64_t n, int64_t m0, int64_t K, int64_t N,       \
                      int log2g) {                                                                 \
    vec acc[MB][ACCS];                                                                             \
    for (int r = 0; r < MB; r++)                                                                   \
        for (int a = 0; a < ACCS; a++) acc[r][a] = VZERO();                                        \
    const int8_t *c = codes + n * K;                                                               \
    const float *s = scales + n * (K >> log2g), *o = offsets ? offsets + n * (K >> log2g) : 0;     \
    int64_t i = 0;                                                                                 \
    for (; i + LANES * ACCS <= K; i += LANES * ACCS) {                                             \
        for (int a = 0; a < ACCS; a++) {                                                           \
            const int64_t ia = i + LANES * a;                                                      \
            vec w = VMUL(VSET1(s[ia >> log2g]), widen(c + ia));                                    \
            if (o) w = VSUB(w, VSET1(o[ia >> log2g]));                                             \
            for (int r = 0; r < MB; r++)                                                           \
                acc[r][a] = VFMA(w, VLOAD(x + (m0 + r) * K + ia), acc[r][a]);                      \
        }                                                                                          \
    }                                                                                              \
    for (; i < K; i += LANES) { /* AVX-512 with K = 32j + 16 (groups of 16) */                    \
        vec w = VMUL(VSET1(s[i >> log2g]), widen(c + i));                                          \
        if (o) w = VSUB(w, VSET1(o[i >> log2g]));                                                  \
        for (int r = 0; r < MB; r++) acc[r][0] = VFMA(w, VLOAD(x + (m0 + r) * K + i), acc[r][0]);  \
    }                                                                                              \
    for (int r = 0; r < MB; r++) y[(m0 + r) * N + n] = vsum(acc[r]);                               \
}

TILE(1)
TILE(2)
TILE(3)
TILE(4)

/* x [M, K] float32, codes [N, K] int8, scales/offsets [N, K/G] float32 (offsets may be NULL),
 * y [M, N] float32. G is 16 or 32, K a multiple of G. threads: OpenMP threads for this call
 * (torch's count, passed in: a thread that torch did not configure has OpenMP's default). */
void block_gemv(const float *x, const int8_t *codes, const float *scales, const float *offsets,
                float *y, int64_t M, int64_t N, int64_t K, int64_t G, int threads)
{
    const int log2g = G == 16 ? 4 : 5; /* the only group sizes GGUF blocks have here */
    const int64_t chunk = 64; /* outputs per task: a multiple of every tile width */
    const int64_t tasks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t n0 = task * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int mb = (int)(M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK);
            for (int64_t n = n0; n < n1; n++) {
                if (m0 == 0 && n + PREFETCH_AHEAD < N) /* later row blocks find the chunk in L2 */
                    prefetch_bytes(codes + (n + PREFETCH_AHEAD) * K, K);
                BY_ROWS(mb, tile, codes, scales, offsets, x, y, n, m0, K, N, log2g)
            }
        }
    }
}

/* out [N, K] float32 = the weights, w = fl(fl(s * c) - o) exactly as above: prompts multiply by
 * them with a float32 GEMM. One pass over the codes, writing each float once. */
void block_dequantize(const int8_t *codes, const float *scales, const float *offsets, float *out,
                      int64_t N, int64_t K, int64_t G, int threads)
{
    const int log2g = G == 16 ? 4 : 5;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *c = codes + n * K;
        const float *s = scales + n * (K >> log2g), *o = offsets ? offsets + n * (K >> log2g) : 0;
        for (int64_t i = 0; i < K; i += 8) {
            __m256 w = _mm256_mul_ps(_mm256_set1_ps(s[i >> log2g]), widen8(c + i));
            if (o) w = _mm256_sub_ps(w, _mm256_set1_ps(o[i >> log2g]));
            _mm256_storeu_ps(out + n * K + i, w);
        }
    }
}

/* Packed 4-bit codes (the Q4_K, Q4_0 and Q4_1 blocks): a group of 32 codes c = u + base (u = 0..15)
 * takes 16 bytes, byte j holding u[j] in its low nibble and u[16 + j] in its high one: 0.75 bytes
 * a weight with the scale and offset, against 1.25 for int8 codes. A group's weights take at most
 * 16 values, so the AVX-512 kernel builds them once, table[u] = fl(fl(s * c) - o) (block_gemv's
 * two roundings), and picks each weight from the table with one permute: the same weights,
 * summed in block_gemv's order into its accumulators, so the same bits, from fewer bytes and
 * fewer instructions a weight (1.65x block_gemv at one row on a 2-core Zen 4, BENCHMARKS.md).
 * 5-bit codes gained nothing this way (two permutes a weight; they stay int8). Groups of 32, K a
 * multiple of 32. */
#if defined(__AVX512F__)
#define PTILE(MB)                                                                                   \
static void ptile_##MB(const uint8_t *nibbles, const float *scales, const float *offsets, __m512 iota,\
                       const float *x, float *y, int64_t n, int64_t m0, int64_t K, int64_t N) {      \
    __m512 acc[MB][2];                                                                              \
    for (int r = 0; r < MB; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                       \
    const int64_t groups = K / 32;                                                                  \
    const uint8_t *c = nibbles + n * (K / 2);                                                       \
    const float *s = scales + n * groups, *o = offsets ? offsets + n * groups : 0;                  \
    for (int64_t g = 0; g < groups; g++) {                                                          \
        __m512 table = _mm512_mul_ps(_mm512_set1_ps(s[g]), iota);                                   \
        if (o) table = _mm512_sub_ps(table, _mm512_set1_ps(o[g]));                                  \
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * g)));   \
        /* permutexvar reads an index's low 4 bits: the low nibble needs no mask */                 \
        const __m512 w0 = _mm512_permutexvar_ps(b, table);                                          \
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);                    \
        for (int r = 0; r < MB; r++) {                                                              \
            const float *xr = x + (m0 + r) * K + 32 * g;                                            \
            acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);                        \
            acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);                   \
        }                                                                                           \
    }                                                                                               \
    for (int r = 0; r < MB; r++) y[(m0 + r) * N + n] = vsum(acc[r]);                                \
}

PTILE(1)
PTILE(2)
PTILE(3)
PTILE(4)

void block_gemv_packed(const float *x, const uint8_t *nibbles, const float *scales, const float *offsets,
                       int64_t base, float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    float values[16]; /* the codes u + base, u = 0..15, as floats (exact) */
    for (int u = 0; u < 16; u++) values[u] = (float)(u + base);
    const __m512 iota = _mm512_loadu_ps(values);
    const int64_t chunk = 64, tasks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t n0 = task * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int mb = (int)(M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK);
            for (int64_t n = n0; n < n1; n++) {
                if (m0 == 0 && n + PREFETCH_AHEAD < N)
                    prefetch_bytes(nibbles + (n + PREFETCH_AHEAD) * (K / 2), K / 2);
                BY_ROWS(mb, ptile, nibbles, scales, offsets, iota, x, y, n, m0, K, N)
            }
        }
    }
}
#else
/* The AVX2 build: no 16-float permute, so each group is unpacked to int8 codes and multiplied
 * as block_gemv's AVX2 loop does (the same bits). models/formats/block_linear.py packs codes only for
 * the AVX-512 build; this keeps the function whole for any other caller. */
void block_gemv_packed(const float *x, const uint8_t *nibbles, const float *scales, const float *offsets,
                       int64_t base, float *y, int64_t M, int64_t N, int64_t K, int threads)
{
    const int64_t groups = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int mb = (int)(M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK);
            __m256 acc[ROW_BLOCK][ACCS];
            for (int r = 0; r < mb; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *b = nibbles + n * (K / 2) + 16 * g;
                int8_t c[32];
                for (int j = 0; j < 16; j++) {
                    c[j] = (int8_t)((b[j] & 15) + base);
                    c[16 + j] = (int8_t)((b[j] >> 4) + base);
                }
                for (int q = 0; q < 4; q++) { /* 8-input chunks into alternating accumulators */
                    __m256 w = _mm256_mul_ps(_mm256_set1_ps(scales[n * groups + g]), widen8(c + 8 * q));
                    if (offsets) w = _mm256_sub_ps(w, _mm256_set1_ps(offsets[n * groups + g]));
                    for (int r = 0; r < mb; r++)
                        acc[r][q & 1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (m0 + r) * K + 32 * g + 8 * q),
                                                        acc[r][q & 1]);
                }
            }
            for (int r = 0; r < mb; r++) y[(m0 + r) * N + n] = hsum(acc[r]);
        }
}
#endif

/* The packed codes back to int8 codes c = u + base [N, K] (the prompts' weights, checks). */
void unpack_codes(const uint8_t *nibbles, int64_t base, int8_t *codes, int64_t N, int64_t K, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < K / 2; j++) {
            const int64_t g = j / 16, i = j % 16;
            const uint8_t b = nibbles[n * (K / 2) + j];
            codes[n * K + 32 * g + i] = (int8_t)((b & 15) + base);
            codes[n * K + 32 * g + 16 + i] = (int8_t)((b >> 4) + base);
        }
}
