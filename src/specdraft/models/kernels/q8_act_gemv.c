/* y = x W^T with int8 activations against GGUF-block weights (`--weights gguf-q8`): AVX-512 VNNI
 * loops, and AVX2 loops below that give the same bits.
 *
 * The weights are the GGUF blocks of block_gemv.c, w = s * c - o per group of G inputs, kept as
 * unsigned codes u = c - base in an output-interleaved layout: for each block of 16 outputs and
 * each step of 4 inputs, 64 bytes hold the 16 outputs' 4 codes. One VNNI multiply-add (vpdpbusd)
 * takes those 64 codes against the same 4 int8 activations broadcast to all lanes: 64 products
 * an instruction into 16 int32 sums, one per output, with no sum across lanes. 4-bit codes (Q4_K,
 * Q4_0) take half the bytes: a byte's low nibble is step 2j's code and its high nibble step 2j + 1's.
 *
 * Each hidden row x is quantised as llama.cpp's Q8_0 does it: per 32 inputs a scale
 * t = max|x| / 127 and codes q = round(x / t). With the integer group sums
 * I_g = sum c q = sum u q + base * sum q (exact),
 *
 *     y = sum over groups g of  (s_g * I_g) * t_g  -  o_g * (t_g * sum q)
 *
 * in float32, in one fixed order. So this is not the float32 model's arithmetic (block_gemv.c
 * is), but llama.cpp's kind: activations rounded to 8 bits per 32 inputs (BENCHMARKS.md reports
 * what that costs against float32). What it buys: a row costs about a third of the float32
 * multiply-adds, so a verification of K + 1 positions costs little more than one step.
 *
 * Row invariance: every (output, row) pair is summed in one fixed order, whatever the number of
 * rows M in the call and however outputs are split across threads, so a (K+1)-row verification
 * gives each row the bits of a one-row step.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define ACT_GROUP 32 /* inputs per activation scale */
#define OUT_BLOCK 16 /* outputs interleaved per 64-byte step */
#define ROW_BLOCK 8 /* rows per pass over a block of outputs: at 8, 8 int32 + 8 float accumulators */

/* How the codes are kept (`layout`): unsigned u = c - base one a byte, two a byte (4-bit), or
 * (Q8_SIXBITS, codes of at most 6 bits: Q6_K, Q5_0/1) as a nibble plane and a 2-bit plane, or (AVX2
 * only) the signed codes c themselves, one a byte, for codes spanning more than 129 values. Plus
 * how the scales (and offsets) are kept: float32, fp16 (Q8_HALF_SCALES: each exactly its float32
 * value, as Q8_0's are in the file; 6% less for the head to read, BENCHMARKS.md), or two-level
 * (Q8_TWO_LEVEL: an int8 multiplier per group times an fp16 factor per 256 inputs, K-quants as the
 * file stores them; the product is exact in float32, so the same numbers in a quarter of the bytes).
 * Every form gives a group the same float32 scale, so the same bits. */
enum { Q8_BYTES = 0, Q8_NIBBLES = 1, Q8_SIGNED = 2, Q8_SIXBITS = 3, Q8_LAYOUT_MASK = 3, Q8_HALF_SCALES = 4,
       Q8_TWO_LEVEL = 8 };
enum { SCALES_F32 = 0, SCALES_F16 = 1, SCALES_TWO_LEVEL = 2 };
#define SUPER 256 /* inputs per fp16 factor of two-level scales */

/* Per block of 16 outputs, two-level values are int8 m[K/G][16], then fp16 d[K/SUPER][16]. */
static inline int64_t block_scale_bytes(int mode, int64_t K, int64_t G)
{
    const int64_t groups = K / G;
    return mode == SCALES_TWO_LEVEL ? groups * OUT_BLOCK + (K / SUPER) * OUT_BLOCK * 2
                                    : groups * OUT_BLOCK * (mode == SCALES_F16 ? 2 : 4);
}

/* The 8 float32 values of group g for outputs 8h..8h+7 of a block, in any of the three forms. */
static inline __m256 scales8(const void *s, int mode, int64_t g, int h, int64_t K, int64_t G)
{
    const int64_t i = g * OUT_BLOCK + 8 * h;
    if (mode == SCALES_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + i)));
    if (mode == SCALES_TWO_LEVEL) {
        const int8_t *m = (const int8_t *)s;
        const uint16_t *d = (const uint16_t *)(m + (K / G) * OUT_BLOCK) + (g * G / SUPER) * OUT_BLOCK + 8 * h;
        const __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(m + i))));
        return _mm256_mul_ps(mv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)));
    }
    return _mm256_loadu_ps((const float *)s + i);
}

#if defined(__AVX512F__)
static inline __m512 scales16(const void *s, int mode, int64_t g, int64_t K, int64_t G)
{
    const int64_t i = g * OUT_BLOCK;
    if (mode == SCALES_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + i)));
    if (mode == SCALES_TWO_LEVEL) {
        const int8_t *m = (const int8_t *)s;
        const uint16_t *d = (const uint16_t *)(m + (K / G) * OUT_BLOCK) + (g * G / SUPER) * OUT_BLOCK;
        const __m512 mv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(m + i))));
        return _mm512_mul_ps(mv, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d)));
    }
    return _mm512_loadu_ps((const float *)s + i);
}
#endif

/* Six-bit codes, per block of 16 outputs and quad of 4 steps (16 inputs), 192 bytes: the two step
 * pairs' nibbles as Q8_NIBBLES keeps them (64 + 64), then 64 bytes whose bits 2j, 2j + 1 are step
 * j's high two bits for the same (output, input) slot. A 16-bit shift never brings a kept bit
 * across bytes: each result is masked to its own byte's bits 4-5. */
#define SIX_QUAD 192

/* One 32-input block of a row: its codes into qb, its scale t, and the sums of its two halves'
 * codes. q = round(x / t) to nearest even; |x / t| <= 127 up to a rounding, which rounds to 127. */
static inline float quantize_block(const float *xb, int8_t *qb, int sum[2])
{
#if defined(__AVX512F__)
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float t = top / 127.0f;
    if (t == 0.0f) {
        _mm256_storeu_si256((__m256i *)qb, _mm256_setzero_si256());
        sum[0] = sum[1] = 0;
        return t;
    }
    const __m512 tv = _mm512_set1_ps(t);
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, tv)), c1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, tv));
    _mm_storeu_si128((__m128i *)qb, _mm512_cvtsepi32_epi8(c0));
    _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtsepi32_epi8(c1));
    sum[0] = _mm512_reduce_add_epi32(c0);
    sum[1] = _mm512_reduce_add_epi32(c1);
    return t;
#else
    /* The same numbers with 8 lanes: the maximum of |x| is exact in any order, each code is
     * x / t correctly rounded then rounded to nearest even (cvtps_epi32, as nearbyintf), and the
     * narrowing saturates as the AVX-512 loop's does (|code| <= 127 anyway). Prompts quantise
     * every row of every linear: the scalar loop took ~8% of a long prompt's prefill. */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], top8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(xb + 8 * i);
        top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, x[i]));
    }
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    top4 = _mm_max_ss(top4, _mm_shuffle_ps(top4, top4, 0x55));
    const float t = _mm_cvtss_f32(top4) / 127.0f;
    if (t == 0.0f) {
        _mm256_storeu_si256((__m256i *)qb, _mm256_setzero_si256());
        sum[0] = sum[1] = 0;
        return t;
    }
    const __m256 tv = _mm256_set1_ps(t);
    __m256i c[4];
    for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_div_ps(x[i], tv));
    /* packs work within 128-bit lanes: 0-3 8-11 4-7 12-15 | 16-19 24-27 20-23 28-31 as words,
     * then bytes in the order 0-3 8-11 16-19 24-27 4-7 12-15 20-23 28-31; one permute restores it. */
    const __m256i words01 = _mm256_packs_epi32(c[0], c[1]), words23 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i bytes = _mm256_packs_epi16(words01, words23);
    _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i half0 = _mm256_add_epi32(c[0], c[1]), half1 = _mm256_add_epi32(c[2], c[3]);
    __m128i h0 = _mm_add_epi32(_mm256_castsi256_si128(half0), _mm256_extracti128_si256(half0, 1));
    __m128i h1 = _mm_add_epi32(_mm256_castsi256_si128(half1), _mm256_extracti128_si256(half1, 1));
    h0 = _mm_hadd_epi32(h0, h1);
    h0 = _mm_hadd_epi32(h0, h0); /* lanes: sum of inputs 0-15, sum of 16-31, ... */
    sum[0] = _mm_cvtsi128_si32(h0);
    sum[1] = _mm_extract_epi32(h0, 1);
    return t;
#endif
}

/* x [M, K] float32 -> q [M, K] int8 (per 32 inputs t = max|x| / 127, q = round(x / t)), and per
 * group of G inputs (G = 16 or 32) a[g] = t of its 32-block, sums[g] = the sum of its q and
 * b[g] = t * sums[g]. */
void q8_act_quantize(const float *x, int64_t M, int64_t K, int64_t G, int8_t *q, float *a, float *b, int32_t *sums,
                     int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (M * K >= (1 << 15))
    for (int64_t m = 0; m < M; m++) {
        for (int64_t blk = 0; blk < K / ACT_GROUP; blk++) {
            int sum[2];
            const float t = quantize_block(x + m * K + blk * ACT_GROUP, q + m * K + blk * ACT_GROUP, sum);
            if (G == ACT_GROUP) {
                const int64_t g = m * (K / G) + blk;
                a[g] = t, sums[g] = sum[0] + sum[1], b[g] = t * (float)sums[g];
            } else { /* G = 16: two weight groups share this block's scale */
                for (int h = 0; h < 2; h++) {
                    const int64_t g = m * (K / G) + 2 * blk + h;
                    a[g] = t, sums[g] = sum[h], b[g] = t * (float)sum[h];
                }
            }
        }
    }
}

/* Asks for the lines the next block of 16 outputs reads at step st of group g (its codes lie 16 K
 * bytes further on, 8 K for nibbles, 12 K for six bits; a six-bit quad's 3 lines at its first
 * step pair). Only a hint: past the last block a prefetch of unmapped memory is dropped, never
 * faults. The AVX-512 loop asks into L2 from FETCH_ROWS rows, the AVX2 loop into L1 always. */
#define FETCH_NEXT_BLOCK(LAYOUT, codes, K, g, steps, st, HINT)                                        \
    do {                                                                                            \
        if (LAYOUT == Q8_SIXBITS) {                                                                 \
            if (st % 4 == 0) {                                                                      \
                const char *next = (const char *)(codes + 12 * K + (g * steps + st) / 4 * SIX_QUAD); \
                _mm_prefetch(next, HINT), _mm_prefetch(next + 64, HINT), _mm_prefetch(next + 128, HINT); \
            }                                                                                       \
        } else if (LAYOUT == Q8_NIBBLES) {                                                          \
            _mm_prefetch((const char *)(codes + 8 * K + (g * steps + st) * 32), HINT);             \
        } else {                                                                                    \
            _mm_prefetch((const char *)(codes + 16 * K + (g * steps + st) * 64), HINT);            \
            _mm_prefetch((const char *)(codes + 16 * K + (g * steps + st + 1) * 64), HINT);        \
        }                                                                                           \
    } while (0)

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
static inline __m512i bcast4(const int8_t *q) { return _mm512_set1_epi32(*(const int32_t *)q); }

/* Six-bit codes: step j of a quad (0-3) from its nibble (pair j / 2, low or high) and its 2 bits. */
static inline __m512i six_step(__m512i nib, __m512i two, int j)
{
    const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
    const __m512i n = (j & 1) ? _mm512_and_si512(_mm512_srli_epi16(nib, 4), low) : _mm512_and_si512(nib, low);
    const __m512i t = j == 0 ? _mm512_slli_epi16(two, 4) : j == 1 ? _mm512_slli_epi16(two, 2)
                    : j == 2 ? two : _mm512_srli_epi16(two, 2);
    return _mm512_or_si512(n, _mm512_and_si512(t, top));
}

/* From FETCH_ROWS rows a tile asks for the lines the next block of outputs will read at the same
 * step as it reads its own (into L2; into L1 it read slower). With several rows' multiply-adds
 * a line the hardware prefetcher alone fell behind: E2B's 4-token verify read its matrices at 24
 * GB/s where a step read 31, and fetching ahead made it 1.1-1.3x faster (BENCHMARKS.md). At one
 * row a Zen 4's prefetcher keeps up alone, an Intel Xeon's does not (one-row passes 1.2-1.4x
 * faster with the fetch, BENCHMARKS.md), so the build sets FETCH_ROWS 1 on Intel CPUs (build.py).
 * Below blocks of FETCH_MIN_BLOCK bytes (Gemma 3 270M's 5-8 KB blocks, 0.97x) the hardware
 * prefetcher keeps up on its own. */
#ifndef FETCH_ROWS
#define FETCH_ROWS 2
#endif
#define FETCH_MIN_BLOCK 8192

/* One block of 16 outputs against MB rows. Up to 4 rows, two int32 sums per row (even and odd
 * steps) keep enough dependency chains in flight; from 5 rows one per row does, in fewer
 * registers. Integer sums are exact, so the chains change no bit, and a group's epilogue is the
 * same either way. `codes` points at the block's steps: 64 bytes a step (bytes), 64 a step pair
 * (nibbles), SIX_QUAD a quad of steps (six bits); a pass of the inner loop takes PASS steps. */
#define TILE(MB, NAME, LAYOUT)                                                                       \
static void NAME##_##MB(const uint8_t *codes, int32_t base, const void *s, int smode, const void *o, \
                        const int8_t *q, const float *a, const float *b, const int32_t *sums,       \
                        float *y, int64_t m0, int64_t K, int64_t G, int64_t N, int64_t n0) {        \
    __m512 acc[MB];                                                                                 \
    for (int r = 0; r < MB; r++) acc[r] = _mm512_setzero_ps();                                     \
    const int64_t groups = K / G, steps = G / 4, pass = LAYOUT == Q8_SIXBITS ? 4 : 2;               \
    const int64_t block = LAYOUT == Q8_SIXBITS ? 12 * K : LAYOUT == Q8_NIBBLES ? 8 * K : 16 * K;    \
    const int fetch = MB >= FETCH_ROWS && block >= FETCH_MIN_BLOCK;                                 \
    for (int64_t g = 0; g < groups; g++) {                                                          \
        __m512i sum0[MB], sum1[MB];                                                                 \
        for (int r = 0; r < MB; r++) sum0[r] = sum1[r] = _mm512_setzero_si512();                    \
        for (int64_t st = 0; st < steps; st += pass) {                                              \
            const int64_t k = g * G + 4 * st;                                                       \
            __m512i w[4];                                                                           \
            if (LAYOUT == Q8_SIXBITS) {                                                             \
                const uint8_t *at = codes + (g * steps + st) / 4 * SIX_QUAD;                        \
                const __m512i n0 = _mm512_loadu_si512(at), n1 = _mm512_loadu_si512(at + 64);        \
                const __m512i two = _mm512_loadu_si512(at + 128);                                   \
                w[0] = six_step(n0, two, 0), w[1] = six_step(n0, two, 1);                           \
                w[2] = six_step(n1, two, 2), w[3] = six_step(n1, two, 3);                           \
            } else if (LAYOUT == Q8_NIBBLES) {                                                      \
                const __m512i byte = _mm512_loadu_si512(codes + (g * steps + st) * 32);             \
                const __m512i low = _mm512_set1_epi8(15);                                           \
                w[0] = _mm512_and_si512(byte, low);                                                 \
                w[1] = _mm512_and_si512(_mm512_srli_epi16(byte, 4), low);                           \
            } else {                                                                                \
                w[0] = _mm512_loadu_si512(codes + (g * steps + st) * 64);                           \
                w[1] = _mm512_loadu_si512(codes + (g * steps + st + 1) * 64);                       \
            }                                                                                       \
            if (fetch) FETCH_NEXT_BLOCK(LAYOUT, codes, K, g, steps, st, _MM_HINT_T1);               \
            for (int p = 0; p < pass; p += 2)                                                       \
                for (int r = 0; r < MB; r++) {                                                      \
                    const int8_t *qr = q + (m0 + r) * K + k + 4 * p;                                \
                    if (MB > 4) { /* rows enough to keep the unit busy: one chain each */           \
                        sum0[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum0[r], w[p], bcast4(qr)), w[p + 1], \
                                                      bcast4(qr + 4));                              \
                    } else {                                                                        \
                        sum0[r] = _mm512_dpbusd_epi32(sum0[r], w[p], bcast4(qr));                   \
                        sum1[r] = _mm512_dpbusd_epi32(sum1[r], w[p + 1], bcast4(qr + 4));           \
                    }                                                                               \
                }                                                                                   \
        }                                                                                           \
        const __m512 sg = scales16(s, smode, g, K, G);                                              \
        const __m512 og = o ? scales16(o, smode, g, K, G) : _mm512_setzero_ps();                    \
        for (int r = 0; r < MB; r++) {                                                              \
            const int64_t ag = (m0 + r) * groups + g;                                               \
            __m512i ig = MB > 4 ? sum0[r] : _mm512_add_epi32(sum0[r], sum1[r]); /* exact either way */ \
            if (base) ig = _mm512_add_epi32(ig, _mm512_set1_epi32(base * sums[ag])); /* sum c q */ \
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ig), sg), _mm512_set1_ps(a[ag]), acc[r]); \
            if (o) acc[r] = _mm512_fnmadd_ps(og, _mm512_set1_ps(b[ag]), acc[r]);                   \
        }                                                                                           \
    }                                                                                               \
    for (int r = 0; r < MB; r++) _mm512_storeu_ps(y + (m0 + r) * N + n0, acc[r]);                  \
}

#define TILES8(NAME, LAYOUT) TILE(1, NAME, LAYOUT) TILE(2, NAME, LAYOUT) TILE(3, NAME, LAYOUT) \
    TILE(4, NAME, LAYOUT) TILE(5, NAME, LAYOUT) TILE(6, NAME, LAYOUT) TILE(7, NAME, LAYOUT) TILE(8, NAME, LAYOUT)
TILES8(tile, Q8_BYTES)
TILES8(ntile, Q8_NIBBLES)
TILES8(xtile, Q8_SIXBITS)

/* kind_1 .. kind_8 by the number of rows mb <= ROW_BLOCK (row counts fixed at compile time). */
#define BY_ROWS8(mb, kind, ...)                  \
    switch (mb) {                                \
    case 1: kind##_1(__VA_ARGS__); break;        \
    case 2: kind##_2(__VA_ARGS__); break;        \
    case 3: kind##_3(__VA_ARGS__); break;        \
    case 4: kind##_4(__VA_ARGS__); break;        \
    case 5: kind##_5(__VA_ARGS__); break;        \
    case 6: kind##_6(__VA_ARGS__); break;        \
    case 7: kind##_7(__VA_ARGS__); break;        \
    default: kind##_8(__VA_ARGS__); break;       \
    }

#define ROWS_PER_PASS ROW_BLOCK
#define ROW_TILES(mb, layout, chain, ...) /* one multiply-add a step: no widening to save */        \
    if (layout == Q8_NIBBLES) { BY_ROWS8(mb, ntile, __VA_ARGS__) }                                 \
    else if (layout == Q8_SIXBITS) { BY_ROWS8(mb, xtile, __VA_ARGS__) }                            \
    else { BY_ROWS8(mb, tile, __VA_ARGS__) } /* vpdpbusd takes any unsigned byte: no Q8_SIGNED here */
#else
/* AVX2 (no VNNI): vpmaddubsw multiplies 32 unsigned codes by 32 int8 activations and adds
 * neighbours into 16-bit sums, which vpmaddwd by ones widens to int32: lane j of 32 bytes then
 * holds output j's 4 products, as vpdpbusd gives them, so the integer group sums I_g and the
 * float32 epilogue are the VNNI loop's, bit for bit. The 16-bit pair sums are exact while
 * 2 x u x 127 <= 32767, i.e. for codes spanning at most 129 values (Q6_K, Q5_0, Q4_K, Q4_0).
 * Wider codes (Q8_0, int8_blocks) come signed (layout Q8_SIGNED, base 0): |c| as unsigned bytes
 * times the activations with c's sign, 2 x 128 x 127 at most. A tile does each group of the
 * 16-output block as two halves of 8 in turn: one half's 4 rows of int32 sums then fit the 16
 * registers, beside the 2 x 4 float32 accumulators the compiler keeps on the stack (touched once
 * a group).
 *
 * Narrow codes need fewer widenings: with codes u <= code_max a pair sum is at most
 * 2 x 127 x code_max, so several add exactly in 16 bits (vpaddw) before one vpmaddwd widens
 * them: CHAIN step pairs (4 pair sums) a widening, 4 for 4-bit codes (a whole group of 32), 2 for
 * 5-bit, 1 for 6-bit, 0 = every pair sum widened (8-bit). The integers are the same, so are the
 * bits; what it saves is multiplier work: on AMD's Zen 1-3, vpmaddubsw and vpmaddwd go to the same
 * multiply pipes (on Zen 3 two of them, which also run the FMAs: 2 of either a cycle, alone or
 * mixed), and a widening per product pair is half of a wide call's time there. */
static inline __m256i bcast4(const int8_t *q) { return _mm256_set1_epi32(*(const int32_t *)q); }

/* Memory order: a tile reads a group's 64-byte lines twice, 32 bytes of each for outputs 0-7
 * (h = 0), then the other 32 for outputs 8-15, the second read from L1 right after the first.
 * (Halves outermost, the second pass re-read the whole block from L2 and nothing streamed from
 * memory meanwhile: at one row the head took its table's read time plus its multiplies, 12.2 ms
 * against 8.0 for a sum over its 168 MB on 2 Zen 1 cores.) Each step also fetches the lines the
 * next block's same step will read: from the first half on for 1-2 rows (little arithmetic a
 * line), from the second for more (the first half's demand loads keep memory busy then). Each
 * change alone, alternated in one process (BENCHMARKS.md): the prefetch 1.19x on the head at 1
 * row on Zen 1 and 1.02-1.16x on Zen 3's head and layers at 1-8 rows; groups outermost a further
 * 1.06-1.18x on Zen 3's head and 1.05-1.20x on its layers at 1-64 rows. The next block's lines are
 * the same step's (FETCH_NEXT_BLOCK). */

/* Six-bit codes, 32 of a half's lanes: step j of a quad from its nibble and its 2 bits. */
static inline __m256i six_step8(__m256i nib, __m256i two, int j)
{
    const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
    const __m256i n = (j & 1) ? _mm256_and_si256(_mm256_srli_epi16(nib, 4), low) : _mm256_and_si256(nib, low);
    const __m256i t = j == 0 ? _mm256_slli_epi16(two, 4) : j == 1 ? _mm256_slli_epi16(two, 2)
                    : j == 2 ? two : _mm256_srli_epi16(two, 2);
    return _mm256_or_si256(n, _mm256_and_si256(t, top));
}

#define TILE(MB, NAME, LAYOUT, CHAIN)                                                                 \
static void NAME##_##MB(const uint8_t *codes, int32_t base, const void *s, int smode, const void *o, \
                        const int8_t *q, const float *a, const float *b, const int32_t *sums,       \
                        float *y, int64_t m0, int64_t K, int64_t G, int64_t N, int64_t n0) {        \
    const int64_t groups = K / G, steps = G / 4, run = CHAIN ? CHAIN : 1;                           \
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                         \
    __m256 acc[2][MB]; /* [half][row] */                                                           \
    for (int h = 0; h < 2; h++) for (int r = 0; r < MB; r++) acc[h][r] = _mm256_setzero_ps();     \
    for (int64_t g = 0; g < groups; g++) {                                                          \
        for (int h = 0; h < 2; h++) {                                                               \
            __m256i sum[MB], part[MB];                                                              \
            for (int r = 0; r < MB; r++) sum[r] = _mm256_setzero_si256();                           \
            for (int64_t st0 = 0; st0 < steps; st0 += 2 * run) {                                    \
                for (int64_t c = 0; c < run; c++) {                                                 \
                    const int64_t st = st0 + 2 * c, k = g * G + 4 * st;                             \
                    __m256i w0, w1;                                                                 \
                    if (h >= (MB <= 2 ? 0 : 1)) /* see "Memory order" above */                      \
                        FETCH_NEXT_BLOCK(LAYOUT, codes, K, g, steps, st, _MM_HINT_T0);              \
                    if (LAYOUT == Q8_SIXBITS) { /* step pair st / 2 % 2 of its quad */               \
                        const uint8_t *at = codes + (g * steps + st) / 4 * SIX_QUAD + 32 * h;      \
                        const int j = (int)(st % 4);                                                \
                        const __m256i nib = _mm256_loadu_si256((const __m256i *)(at + 32 * j));     \
                        const __m256i two = _mm256_loadu_si256((const __m256i *)(at + 128));        \
                        w0 = six_step8(nib, two, j), w1 = six_step8(nib, two, j + 1);               \
                    } else if (LAYOUT == Q8_NIBBLES) {                                              \
                        const __m256i *at = (const __m256i *)(codes + (g * steps + st) * 32 + 32 * h); \
                        const __m256i byte = _mm256_loadu_si256(at);                                \
                        w0 = _mm256_and_si256(byte, low);                                           \
                        w1 = _mm256_and_si256(_mm256_srli_epi16(byte, 4), low);                     \
                    } else {                                                                        \
                        w0 = _mm256_loadu_si256((const __m256i *)(codes + (g * steps + st) * 64 + 32 * h)); \
                        w1 = _mm256_loadu_si256((const __m256i *)(codes + (g * steps + st + 1) * 64 + 32 * h)); \
                    }                                                                               \
                    /* signed codes: |c| (-128 -> 128 as an unsigned byte), the sign goes to the rows */ \
                    const __m256i u0 = LAYOUT == Q8_SIGNED ? _mm256_sign_epi8(w0, w0) : w0;        \
                    const __m256i u1 = LAYOUT == Q8_SIGNED ? _mm256_sign_epi8(w1, w1) : w1;        \
                    for (int r = 0; r < MB; r++) {                                                  \
                        const int8_t *qr = q + (m0 + r) * K + k;                                    \
                        __m256i x0 = bcast4(qr), x1 = bcast4(qr + 4);                               \
                        if (LAYOUT == Q8_SIGNED) x0 = _mm256_sign_epi8(x0, w0), x1 = _mm256_sign_epi8(x1, w1); \
                        const __m256i p0 = _mm256_maddubs_epi16(u0, x0), p1 = _mm256_maddubs_epi16(u1, x1); \
                        if (CHAIN == 0)                                                             \
                            sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_madd_epi16(p0, ones), \
                                                                               _mm256_madd_epi16(p1, ones))); \
                        else {                                                                      \
                            const __m256i p = _mm256_add_epi16(p0, p1);                             \
                            part[r] = c ? _mm256_add_epi16(part[r], p) : p;                         \
                        }                                                                           \
                    }                                                                               \
                }                                                                                   \
                if (CHAIN)                                                                          \
                    for (int r = 0; r < MB; r++) sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(part[r], ones)); \
            }                                                                                       \
            const __m256 sg = scales8(s, smode, g, h, K, G);                                        \
            const __m256 og = o ? scales8(o, smode, g, h, K, G) : _mm256_setzero_ps();              \
            for (int r = 0; r < MB; r++) {                                                          \
                const int64_t ag = (m0 + r) * groups + g;                                           \
                __m256i ig = sum[r];                                                                \
                if (base) ig = _mm256_add_epi32(ig, _mm256_set1_epi32(base * sums[ag])); /* sum c q */ \
                acc[h][r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(ig), sg), _mm256_set1_ps(a[ag]), acc[h][r]); \
                if (o) acc[h][r] = _mm256_fnmadd_ps(og, _mm256_set1_ps(b[ag]), acc[h][r]);          \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    for (int h = 0; h < 2; h++)                                                                     \
        for (int r = 0; r < MB; r++) _mm256_storeu_ps(y + (m0 + r) * N + n0 + 8 * h, acc[h][r]);  \
}

/* NAME_1 .. NAME_4, for the rows a pass takes (BY_ROWS). */
#define TILES(NAME, LAYOUT, CHAIN) TILE(1, NAME, LAYOUT, CHAIN) TILE(2, NAME, LAYOUT, CHAIN) \
    TILE(3, NAME, LAYOUT, CHAIN) TILE(4, NAME, LAYOUT, CHAIN)
TILES(tile, Q8_BYTES, 0)
TILES(tile1, Q8_BYTES, 1)
TILES(tile2, Q8_BYTES, 2)
TILES(tile4, Q8_BYTES, 4)
TILES(ntile2, Q8_NIBBLES, 2)
TILES(ntile4, Q8_NIBBLES, 4)
TILES(stile, Q8_SIGNED, 0)
TILES(xtile, Q8_SIXBITS, 1)

#define ROWS_PER_PASS 4
#define ROW_TILES(mb, layout, chain, ...)                                                             \
    if (layout == Q8_NIBBLES) {                                                                     \
        if (chain >= 4) { BY_ROWS(mb, ntile4, __VA_ARGS__) } else { BY_ROWS(mb, ntile2, __VA_ARGS__) } \
    } else if (layout == Q8_SIGNED) { BY_ROWS(mb, stile, __VA_ARGS__) }                            \
    else if (layout == Q8_SIXBITS) { BY_ROWS(mb, xtile, __VA_ARGS__) } /* 6-bit pair sums: chain 1 */ \
    else if (chain >= 4) { BY_ROWS(mb, tile4, __VA_ARGS__) }                                       \
    else if (chain == 2) { BY_ROWS(mb, tile2, __VA_ARGS__) }                                       \
    else if (chain == 1) { BY_ROWS(mb, tile1, __VA_ARGS__) }                                       \
    else { BY_ROWS(mb, tile, __VA_ARGS__) }
#endif

/* Step pairs whose 16-bit pair sums add exactly before a widening (the AVX2 loop's CHAIN): 4 pair
 * sums of at most 2 x 127 x code_max each per step pair, within a group (G / 8 step pairs). */
static int widen_chain(int32_t code_max, int64_t G)
{
    int chain = 0;
    for (int c = 1; c <= 4 && c <= G / 8; c *= 2)
        if (4 * c * 127 * code_max <= 32767) chain = c;
    return chain;
}

/* q, a, b, sums: the rows as q8_act_quantize gives them; codes u = c - base: [N/16, K/4, 16, 4] uint8
 * (layout Q8_NIBBLES: [N/16, K/8, 16, 4], low nibble step 2j, high step 2j + 1; Q8_SIXBITS:
 * [N/16, K/16, SIX_QUAD]; Q8_SIGNED, AVX2 builds only: the signed codes, base 0); code_max: the
 * largest u (or |c|) in the matrix, which bounds the AVX2 loop's 16-bit sums; s, o: per block of 16
 * outputs, [K/G, 16] float32, fp16 under Q8_HALF_SCALES, two-level under Q8_TWO_LEVEL (o may be
 * NULL: no offsets; o takes s's form); y [M, N]. N a multiple of 16, K of G and 32 (of 256 for
 * two-level scales, of 16 for six-bit codes). */
void q8_act_gemv(const int8_t *q, const float *a, const float *b, const int32_t *sums, const uint8_t *codes,
                 int layout, int32_t base, int32_t code_max, const void *s, const void *o, float *y, int64_t M,
                 int64_t N, int64_t K, int64_t G, int threads)
{
    /* Each thread reads its blocks as a few contiguous streams: guided chunks (half the blocks,
     * then half of what is left, ...) end a matrix with small ones, so a thread that read slower
     * does not keep the other waiting at the barrier for its whole half (static halves: 1.02-1.16x
     * slower over E2B-shaped Q4_K / Q8_0 matrices, BENCHMARKS.md). A block is one thread's work in
     * one fixed order either way: the same bits. The AVX-512 loop reads each line
     * once; at one row the hardware prefetcher keeps up (fetching the next block ahead, or 4-16
     * lines ahead, read the same or slower on a 2-core Zen 4), from 2 rows the tiles fetch the
     * next block ahead (FETCH_NEXT_BLOCK). The AVX2 loop reads each line in two passes and
     * fetches ahead always. */
    const int smode = (layout & Q8_TWO_LEVEL) ? SCALES_TWO_LEVEL : (layout & Q8_HALF_SCALES) ? SCALES_F16 : SCALES_F32;
    layout &= Q8_LAYOUT_MASK;
    const int64_t block_bytes = layout == Q8_NIBBLES ? K * OUT_BLOCK / 2
                              : layout == Q8_SIXBITS ? K / 16 * SIX_QUAD : K * OUT_BLOCK;
    const int64_t blocks = N / OUT_BLOCK, scale_bytes = block_scale_bytes(smode, K, G);
    const int chain = widen_chain(code_max, G); /* 0 for signed bytes (|c| up to 128): they never chain */
#pragma omp parallel for schedule(guided) num_threads(threads)
    for (int64_t nb = 0; nb < blocks; nb++) {
        const uint8_t *c = codes + nb * block_bytes;
        const char *sc = (const char *)s + nb * scale_bytes, *oc = o ? (const char *)o + nb * scale_bytes : 0;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
            const int mb = (int)(M - m0 < ROWS_PER_PASS ? M - m0 : ROWS_PER_PASS);
            ROW_TILES(mb, layout, chain, c, base, sc, smode, oc, q, a, b, sums, y, m0, K, G, N, nb * OUT_BLOCK)
        }
    }
}
