/* RMSNorm of each row in one pass: out = residual + (x * r) * w, r = 1 / sqrt(mean(x^2) + eps).
 *
 * F.rms_norm runs as ~7 small ops on a CPU (~35 us each call here), and a Gemma 3 decode step
 * makes ~110 norms; one call of this is a few us. Each row is summed in one fixed order on its
 * own. `weight` may be NULL (no scale), `residual` NULL (no add). `residual_norms` does the two
 * norms between a layer's attention and its MLP in one call.
 */
#include <math.h>

#include "simd.h"

/* out = residual + (x r) w for one row of D values (w, residual may be NULL). */
static void norm_row(const float *x, const float *weight, const float *residual, float *out, int64_t D, float eps) {
    const float r = 1.0f / sqrtf(dot_f32(x, x, D) / (float)D + eps);
    for (int64_t i = 0; i < D; i++) {
        float y = x[i] * r;
        if (weight) y *= weight[i];
        out[i] = residual ? residual[i] + y : y;
    }
}

/* x, residual, out [N, D] contiguous (out may be x or residual), weight [D]. */
void rms_norm_rows(const float *x, const float *weight, const float *residual, float *out, int64_t N, int64_t D,
                   float eps, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (N * D >= (1 << 18))
    for (int64_t n = 0; n < N; n++)
        norm_row(x + n * D, weight, residual ? residual + n * D : 0, out + n * D, D, eps);
}

/* Between a layer's attention and its MLP, per row of [N, D]:
 *     x_out = x + norm1(a)   (Gemma's sandwich; first_weight NULL and plain: x_out = x + a)
 *     h     = norm2(x_out)   (the MLP's input)
 * first_weight and second_weight may be NULL (no scale) when `first` and `second` say a norm is there. */
void residual_norms(const float *a, int first, const float *first_weight, const float *x, const float *second_weight,
                    float *x_out, float *h, int64_t N, int64_t D, float eps, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (N * D >= (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        const float *an = a + n * D, *xn = x + n * D;
        float *xo = x_out + n * D;
        if (first) {
            norm_row(an, first_weight, xn, xo, D, eps);
        } else {
            for (int64_t i = 0; i < D; i++) xo[i] = xn[i] + an[i];
        }
        norm_row(xo, second_weight, 0, h + n * D, D, eps);
    }
}
