/* RMSNorm of each row in one pass: out = residual + (x * r) * w, r = 1 / sqrt(mean(x^2) + eps).
 *
 * F.rms_norm runs as ~7 small ops on a CPU (~35 us each call here), and a Gemma 3 decode step
 * makes ~110 norms; one call of this is a few us. Each row is summed in one fixed order on its
 * own. `weight` may be NULL (no scale), `residual` NULL (no add).
 */
#include <math.h>

#include "simd.h"

/* x, residual, out [N, D] contiguous (out may be x or residual), weight [D]. */
void rms_norm_rows(const float *x, const float *weight, const float *residual, float *out, int64_t N, int64_t D,
                   float eps, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (N * D >= (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * D;
        const float r = 1.0f / sqrtf(dot_f32(xr, xr, D) / (float)D + eps);
        float *o = out + n * D;
        const float *res = residual ? residual + n * D : 0;
        for (int64_t i = 0; i < D; i++) {
            float y = xr[i] * r;
            if (weight) y *= weight[i];
            o[i] = res ? res[i] + y : y;
        }
    }
}
