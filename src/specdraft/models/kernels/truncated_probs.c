/* Top-k and top-p probabilities of logit rows (sampling.probabilities' law) without a V-wide sort,
 * topk, mask or softmax: a chat request at Gemma's settings (top-k 64, top-p 0.95) paid ~1.1 ms a
 * row in torch over a 262144-token vocabulary, and a sampled verification pays it for every row.
 *
 * Only the tokens near the cut are sorted. Top-k finds them by a threshold read off a sample of
 * the row (or, where that misses, a histogram of every token's key: an unsigned integer that
 * orders as the floats do); top-p alone by a histogram of the keys of the tokens near the best,
 * each bin weighted by its softmax mass, walked best first until it holds more than top_p.
 * The law: top-k keeps the k best, then top-p keeps the shortest best-first prefix whose mass
 * before each token stays under top_p (masses from the softmax over what top-k kept, or over the
 * whole row), then the softmax over what is kept. Where a tie crosses a cut (which of equal logits
 * is kept would depend on a sort's order), a row holds a NaN or no finite best, or the candidates
 * would not fit `cap` (a flat row), the row is not written and its flag is set: the caller
 * computes it in torch. Sums run in another order than torch's softmax, the masses in float64:
 * the same law to a few float32 roundings. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define HIST_BITS 16
#define BINS (1 << HIST_BITS)

static inline uint32_t key_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

typedef struct {
    float value;
    int32_t index;
} Cand;

static int by_value_desc(const void *a, const void *b) {
    const float x = ((const Cand *)a)->value, y = ((const Cand *)b)->value;
    if (x != y) return x > y ? -1 : 1;
    const int32_t i = ((const Cand *)a)->index, j = ((const Cand *)b)->index;
    return (i > j) - (i < j);
}

/* e^x for x <= 0, and exactly 0 below -87.3: a -inf logit's mass is 0, as in torch's softmax. */
static inline __m256 exp8(__m256 x) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ), exp8_nonpositive(x));
}

static inline float exp1(float x) {
    float in[8] = {x, x, x, x, x, x, x, x}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

/* Softmax masses over candidates c[0..n) sorted best first: the k kept -> the number top-p keeps
 * (n if none dropped), or -1 where a tie crosses the cut. `z`: the normaliser (the sum over what
 * the masses are taken over), m the best logit. */
static int64_t nucleus(const Cand *c, int64_t n, float m, double z, float top_p) {
    if (top_p >= 1.0f) return n;
    double before = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (i > 0 && before >= top_p) { /* token i and every later one are dropped */
            return c[i].value == c[i - 1].value ? -1 : i;
        }
        before += (double)exp1(c[i].value - m) / z;
    }
    return n;
}

/* The row's largest logit; NaN if it holds one. */
static float row_max(const float *x, int64_t V) {
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(top, v), nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    int bad = _mm256_movemask_ps(nan);
    for (; i < V; i++) bad |= x[i] != x[i], m = x[i] > m ? x[i] : m;
    return bad ? NAN : m;
}

/* Every token whose logit is >= t into cand (any order): how many, or -1 past cap. One vector
 * compare a token; only the few above t are written. */
static int64_t at_least(const float *x, int64_t V, float t, Cand *cand, int64_t cap) {
    const __m256 tv = _mm256_set1_ps(t);
    int64_t n = 0, i = 0;
    for (; i + 8 <= V; i += 8) {
        int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), tv, _CMP_GE_OQ));
        while (hits) {
            const int j = __builtin_ctz(hits);
            hits &= hits - 1;
            if (n == cap) return -1;
            cand[n].value = x[i + j], cand[n].index = (int32_t)(i + j), n++;
        }
    }
    for (; i < V; i++)
        if (x[i] >= t) {
            if (n == cap) return -1;
            cand[n].value = x[i], cand[n].index = (int32_t)i, n++;
        }
    return n;
}

#define SAMPLES 2048

/* Top-k's candidates by a threshold from a sample: every SAMPLES-th of the row's tokens, the
 * threshold a few times lower in the sample than the k-th best would sit; then every token at or
 * above it (so every token tied with the k-th best too). The count (-1: not between k and cap,
 * the histogram then decides). One compare pass where a histogram costs a scatter per token. */
static int64_t top_k_candidates(const float *x, int64_t V, int64_t k, Cand *cand, int64_t cap) {
    if (V < 8 * SAMPLES) return -1;
    const int64_t stride = V / SAMPLES, j = 4 * ((k * SAMPLES + V - 1) / V) + 8;
    if (j >= SAMPLES / 8) return -1;
    float best[SAMPLES / 8 + 1]; /* the sample's j + 1 largest, best first (insertion: most fall out at once) */
    int64_t have = 0;
    for (int64_t s = 0; s < SAMPLES; s++) {
        const float v = x[s * stride];
        if (have == j + 1 && !(v > best[j])) continue;
        int64_t at = have < j + 1 ? have++ : j;
        while (at > 0 && best[at - 1] < v) best[at] = best[at - 1], at--;
        best[at] = v;
    }
    const int64_t n = at_least(x, V, best[j], cand, cap);
    return n >= k ? n : -1;
}

static int finish(int64_t V, int64_t k, float top_p, float m, Cand *cand, int64_t n, double z_all, float *out);

#define NEAR 16.0f

/* The float whose key is `key` (key_of's inverse). */
static inline float float_of(uint32_t key) {
    const uint32_t u = (key & 0x80000000u) ? key ^ 0x80000000u : ~key;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Top-p alone: the row's softmax normaliser in *z, and as candidates every token in the best
 * bins (by key) that together hold more than top_p of it (-1: the cut lies among tokens too
 * far below the best to be binned, a flat row; or more than cap candidates). Only tokens within
 * NEAR of the best are binned (each token below holds under e^-16 of the best's mass, all of
 * them under 3% of the row's at 262144 tokens): one vector pass for the normaliser, a scatter
 * only for the ~1000 near the top of a real row instead of every token. */
static int64_t top_p_candidates(const float *x, int64_t V, float m, float top_p, double *mass, Cand *cand,
                                int64_t cap, double *z) {
    const float low = m - NEAR;
    const uint32_t lo = key_of(low) >> (32 - HIST_BITS), hi = key_of(m) >> (32 - HIST_BITS);
    memset(mass + lo, 0, sizeof(double) * (hi - lo + 1));
    const __m256 mv = _mm256_set1_ps(m), lowv = _mm256_set1_ps(low);
    double total = 0.0;
    int64_t i = 0;
    float e[8];
    while (i + 8 <= V) {
        __m256 part = _mm256_setzero_ps(); /* float sums of at most 512 terms, each <= 1, then double */
        for (int64_t end = i + 4096 < V ? i + 4096 : V; i + 8 <= end; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i), ev = exp8(_mm256_sub_ps(v, mv));
            part = _mm256_add_ps(part, ev);
            int near = _mm256_movemask_ps(_mm256_cmp_ps(v, lowv, _CMP_GE_OQ));
            if (near) {
                _mm256_storeu_ps(e, ev);
                while (near) {
                    const int b = __builtin_ctz(near);
                    near &= near - 1;
                    mass[key_of(x[i + b]) >> (32 - HIST_BITS)] += e[b];
                }
            }
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, part);
        for (int j = 0; j < 8; j++) total += lanes[j];
    }
    for (; i < V; i++) {
        const float ei = exp1(x[i] - m);
        total += ei;
        if (x[i] >= low) mass[key_of(x[i]) >> (32 - HIST_BITS)] += ei;
    }
    *z = total;
    double before = 0.0;
    int64_t b = hi;
    for (; b >= (int64_t)lo; b--)
        if ((before += mass[b]) >= total * ((double)top_p + 1e-4)) break;
    if (b < (int64_t)lo) return -1;
    return at_least(x, V, b > (int64_t)lo ? float_of((uint32_t)b << (32 - HIST_BITS)) : low, cand, cap);
}

/* One row: 0 done, 1 left to the caller. hist: BINS counts; mass: BINS sums (top-p alone). */
static int row_probs(const float *x, int64_t V, int64_t k, float top_p, float *out, uint32_t *hist, double *mass,
                     Cand *cand, int64_t cap) {
    const float m = row_max(x, V);
    if (!isfinite(m)) return 1; /* NaN, or no finite logit */
    int64_t n = k > 0 && k < V ? top_k_candidates(x, V, k, cand, cap) : -1;
    if (n >= 0) return finish(V, k, top_p, m, cand, n, 0.0, out);
    if (k > 0 && k < V) { /* the sample missed: a histogram of every token's key finds the k-th's bin */
        memset(hist, 0, sizeof(uint32_t) * BINS);
        for (int64_t i = 0; i < V; i++) hist[key_of(x[i]) >> (32 - HIST_BITS)]++;
        int64_t seen = 0, lo_bin;
        for (lo_bin = BINS - 1; lo_bin > 0; lo_bin--)
            if ((seen += hist[lo_bin]) >= k) break;
        n = at_least(x, V, lo_bin > 0 ? float_of((uint32_t)lo_bin << (32 - HIST_BITS)) : -INFINITY, cand, cap);
        return n < 0 ? 1 : finish(V, k, top_p, m, cand, n, 0.0, out);
    }
    double z = 0.0;
    n = top_p_candidates(x, V, m, top_p, mass, cand, cap, &z);
    if (n < 0) return 1;
    return finish(V, k, top_p, m, cand, n, z, out);
}

/* The candidates c[0..n) (every token at or above some value, in any order) -> the row's
 * probabilities; 1 where the row is left to the caller. Top-p alone: z_all is the row's
 * normaliser, and the candidates hold more than top_p of it, so the cut falls inside them. */
static int finish(int64_t V, int64_t k, float top_p, float m, Cand *cand, int64_t n, double z_all, float *out) {
    qsort(cand, n, sizeof(Cand), by_value_desc);
    int64_t kept = n;
    double z;
    if (k > 0 && k < V) {
        if (n > k && cand[k].value == cand[k - 1].value) return 1; /* a tie at the k-th */
        kept = k;
        z = 0.0;
        for (int64_t i = 0; i < kept; i++) z += exp1(cand[i].value - m);
    } else {
        z = z_all;
    }
    kept = nucleus(cand, kept, m, z, top_p);
    if (kept < 0) return 1;
    double zk = 0.0;
    for (int64_t i = 0; i < kept; i++) zk += exp1(cand[i].value - m);
    memset(out, 0, sizeof(float) * V);
    const float inv = (float)(1.0 / zk);
    for (int64_t i = 0; i < kept; i++) out[cand[i].index] = exp1(cand[i].value - m) * inv;
    return 0;
}

/* Per thread, kept for the process: fresh buffers each call cost more in page faults (a few
 * hundred KB a row) than the row's own work. */
static __thread uint32_t *t_hist;
static __thread double *t_mass;
static __thread Cand *t_cand;
static __thread int64_t t_cap;

/* x [M, V] float32 logits (temperature applied), k (0: no top-k), top_p (1: none) -> out [M, V]
 * probabilities; left[r] = 1 where row r was not written (see above). cap: candidates a row may
 * sort before it is left to the caller. */
void truncated_probs(const float *x, int64_t M, int64_t V, int64_t k, float top_p, int64_t cap, float *out,
                     uint8_t *left, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 1)
    for (int64_t r = 0; r < M; r++) {
        if (!t_hist) t_hist = malloc(sizeof(uint32_t) * BINS), t_mass = malloc(sizeof(double) * BINS);
        if (t_cap < cap) free(t_cand), t_cand = malloc(sizeof(Cand) * (size_t)cap), t_cap = cap;
        left[r] = (!t_hist || !t_mass || !t_cand) ? 1
                  : (uint8_t)row_probs(x + r * V, V, k, top_p, out + r * V, t_hist, t_mass, t_cand, cap);
    }
}
