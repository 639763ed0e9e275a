/* Vector helpers shared by the kernels: a fixed-order horizontal sum and a float32 dot product. */
#ifndef SPECDRAFT_SIMD_H
#define SPECDRAFT_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* Weight rows the matrix kernels fetch ahead of the one they multiply: the hardware prefetcher
 * alone left their loops waiting on memory (1.1-1.3x faster at 1 to 8 rows on a 2-core Zen 4,
 * BENCHMARKS.md). */
#define PREFETCH_AHEAD 4

/* Asks for the cache lines of `bytes` bytes from p: only a hint, no effect on any result. */
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Calls kind_1 .. kind_4 by the number of rows mb <= ROW_BLOCK: each tile has its row count fixed
 * at compile time, so its accumulators stay in registers. */
#define BY_ROWS(mb, kind, ...)                   \
    switch (mb) {                                \
    case 1: kind##_1(__VA_ARGS__); break;        \
    case 2: kind##_2(__VA_ARGS__); break;        \
    case 3: kind##_3(__VA_ARGS__); break;        \
    default: kind##_4(__VA_ARGS__); break;       \
    }

/* Lanes (0+4, 1+5, 2+6, 3+7), then the pair 2 away, then the next: one order, always. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}

/* a . b over n floats: two 8-lane accumulators (even and odd 8-float chunks), then the tail. */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* e^x in 8 lanes for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n;
 * within 2 ulp of expf, flushed to 0 below -87.3). Each lane depends on its own x only. */
static inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif
