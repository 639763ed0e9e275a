/* The gated MLP's middle: out = act(gate) * up, from the fused gate/up projection's output.
 *
 * Both activations are written through one exponential, in the form that keeps full relative
 * precision (no 1 + tanh cancellation):
 *
 *     silu(x)      = x / (1 + exp(-x))
 *     gelu_tanh(x) = 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)),   y = sqrt(2/pi) (x + 0.044715 x^3)
 *
 * exp is evaluated 8 lanes at a time (Cody-Waite reduction by ln 2, a degree-6 polynomial; about
 * 1 ulp), so results agree with PyTorch's to a few float32 ulps rather than bit for bit. Each
 * element is computed on its own: a row's result does not depend on the rows beside it.
 */
#include <math.h>

#include "simd.h"

enum { SILU = 0, GELU_TANH = 1 };

static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, ln2 split in two so that n * hi is exact */
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 act8(__m256 x, int kind) {
    __m256 z = x;
    if (kind == GELU_TANH) { /* z = 2y = 2 sqrt(2/pi) (x + 0.044715 x^3) */
        const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f), _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), x3)));
    }
    const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)));
    return _mm256_div_ps(x, d);
}

static inline float act1(float x, int kind) {
    float z = kind == GELU_TANH ? 1.5957691216057308f * (x + 0.044715f * (x * x * x)) : x;
    return x / (1.0f + expf(-z));
}

/* out [M, I] = act(gate) * up, row m's gate at gate + m * gate_stride and its up at up + m *
 * up_stride: the fused decoder layers pass their separate gate and up projections (and Gemma 4's
 * per-layer inputs) in place, with no copy into [gate | up] rows. Threads split the rows from
 * 8192 elements on (a 4-token verify's 4 x 6144). */
void gated_act_rows(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int64_t M, int64_t I,
                    int kind, float *out, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 1 && M * I >= (1 << 13))
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate + m * gate_stride, *u = up + m * up_stride;
        float *o = out + m * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(act8(_mm256_loadu_ps(g + i), kind), _mm256_loadu_ps(u + i)));
        for (; i < I; i++) o[i] = act1(g[i], kind) * u[i];
    }
}

/* gate_up [M, 2I] (gate then up per row) -> out [M, I]. */
void gated_act(const float *gate_up, int64_t M, int64_t I, int kind, float *out, int threads)
{
    gated_act_rows(gate_up, 2 * I, gate_up + I, 2 * I, M, I, kind, out, threads);
}
