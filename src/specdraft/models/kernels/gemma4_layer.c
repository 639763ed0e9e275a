/* A Gemma 4 decoder layer's short forward (decode, verify) in one call, and all layers in one.
 *
 *     h = norm_in(x);  q = q_proj(h);  k, v = k_proj(h), v_proj(h) (v = k's raw projection under
 *       attention_k_eq_v; KV-shared layers: neither, they read their producer's cache)
 *     q, k = rope(q_norm(q)), rope(k_norm(k));  v = v_norm(v) (no scale);  cache <- k, v
 *     x = x + norm_post_attn(o_proj(attention(q, cache)));  h = norm_pre_mlp(x)
 *     x = x + norm_post_mlp(down(act(gate(h)) * up(h)))
 *     x = x + norm_ple(ple_proj(act(ple_gate(x)) * per_layer_input))   (PLE)
 *     x = x * layer_scalar
 *
 * Eager PyTorch spends ~60 small ops and ~9 kernel calls from Python a layer on this; a 35-layer
 * E2B step made ~2,000 Python-level calls, about a fifth of its time above the memory floor
 * (BENCHMARKS.md). Here the step's layers are one call. Projections sharing an input (q, k, v;
 * gate, up) round it to int8 once (q8 activations). Every row is computed on its own in one fixed
 * order, so a row's bits do not depend on the rows beside it (a verify's rows equal one-row steps).
 */
#include <math.h>
#include <string.h>
#include <time.h>

#include "gemma4_layer.h"
#include "simd.h"

/* Where a step's time goes (`specdraft steps --breakdown`): seconds per op class, summed over
 * the calls since the last read, when switched on. Two clock reads an op, ~20 op a layer. */
enum { T_NORMS, T_QUANTIZE, T_ATTN_MATRICES, T_MLP_MATRICES, T_PLE_MATRICES, T_QKV_ROPE, T_ATTENTION, T_ACT,
       T_OPS };
static int timing;
static double spent[T_OPS];
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define TIMED(op, ...)                                          \
    do {                                                        \
        const double t0_ = timing ? now() : 0;                  \
        __VA_ARGS__;                                            \
        if (timing) spent[op] += now() - t0_;                   \
    } while (0)

/* Switch the timers on or off; out[T_OPS]: the seconds so far, then zeroed (out may be NULL). */
void gemma4_timers(int on, double *out) {
    for (int i = 0; i < T_OPS; i++) {
        if (out) out[i] = spent[i];
        spent[i] = 0;
    }
    timing = on;
}

/* Seconds one empty OpenMP parallel region of `threads` threads costs (fork, join, barrier), the
 * median-free mean of `reps`: what each matrix call pays to split its outputs across threads. */
double omp_region_seconds(int threads, int reps) {
    volatile int sink = 0;
    const double t0 = now();
    for (int r = 0; r < reps; r++) {
#pragma omp parallel num_threads(threads)
        { sink += 0; }
    }
    return (now() - t0) / reps;
}

/* r = 1 / sqrt(mean(x^2) + eps), as rms_norm.c and qk_rope.c compute it. */
static inline float inv_rms(const float *x, int64_t D, float eps) {
    return 1.0f / sqrtf(dot_f32(x, x, D) / (float)D + eps);
}

/* y = rope(norm(x)) for one head of D values (scale NULL: no scale; cos NULL: no rotation). */
static void head_norm_rope(const float *x, const float *scale, float eps, const float *cos, const float *sin,
                           int64_t D, float *out) {
    float y[1024]; /* head_dim <= 1024 (checked by the caller) */
    const float r = inv_rms(x, D, eps);
    for (int64_t i = 0; i < D; i++) y[i] = scale ? (x[i] * r) * scale[i] : x[i] * r;
    if (!cos) {
        memcpy(out, y, D * sizeof(float));
        return;
    }
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) {
        const float rolled = y[i < half ? i + half : i - half];
        const float a = y[i] * cos[i], b = rolled * sin[i];
        out[i] = a + b;
    }
}

/* One cached head of D values: float32 as is, or rounded to float16 (to nearest even, as
 * torch's .half() rounds) where the cache stores that. */
static void head_norm_rope_store(const float *x, const float *scale, float eps, const float *cos, const float *sin,
                                 int64_t D, void *cache, int64_t at, int half) {
    if (!half) {
        head_norm_rope(x, scale, eps, cos, sin, D, (float *)cache + at);
        return;
    }
    float y[1024];
    uint16_t *out = (uint16_t *)cache + at;
    head_norm_rope(x, scale, eps, cos, sin, D, y);
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(y + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < D; i++) out[i] = _cvtss_sh(y[i], _MM_FROUND_TO_NEAREST_INT);
}

/* q [M, Hq*D], k, v [M, Hkv*D] projections -> q_out [M, Hq, D] normed and rotated; k normed,
 * rotated and v normed into the cache (float32, or float16: half) at `positions` (k NULL: a
 * KV-shared layer, nothing written). */
static void qkv_write(const float *q, const float *k, const float *v, int64_t M, int64_t T, int64_t Hq, int64_t Hkv,
                      int64_t D, const float *q_scale, const float *k_scale, float eps, const float *cos,
                      const float *sin, const int64_t *positions, float *q_out, void *k_cache, void *v_cache,
                      int64_t sb, int64_t sh, int half) {
    const int64_t heads = Hq + (k ? 2 * Hkv : 0);
    for (int64_t task = 0; task < M * heads; task++) {
        const int64_t m = task / heads, h = task % heads, b = m / T;
        const float *c = cos + m * D, *s = sin + m * D;
        if (h < Hq) {
            head_norm_rope(q + (m * Hq + h) * D, q_scale, eps, c, s, D, q_out + (m * Hq + h) * D);
        } else if (h < Hq + Hkv) {
            const int64_t hk = h - Hq;
            head_norm_rope_store(k + (m * Hkv + hk) * D, k_scale, eps, c, s, D, k_cache, b * sb + hk * sh + positions[m] * D,
                                 half);
        } else {
            const int64_t hv = h - Hq - Hkv;
            head_norm_rope_store(v + (m * Hkv + hv) * D, 0, eps, 0, 0, D, v_cache, b * sb + hv * sh + positions[m] * D,
                                 half);
        }
    }
}

/* Projections of one input x [M, K]: y_i = x W_i^T for the n given (NULL entries skipped). Where
 * they all take int8 rows in the same groups, x is rounded once for all of them: the rounding
 * depends on x and the group only, so the bits are those of separate calls. */
static void linears(const Linear *const *W, float *const *y, const int64_t *N, int n, const float *x, int64_t M,
                    int64_t K, float *rows, int threads, int op) {
    int64_t group = -1;
    int shared = 1;
    for (int i = 0; i < n; i++) {
        if (!W[i]) continue;
        if (W[i]->kind < LINEAR_Q8_ACT || W[i]->bias || (group >= 0 && W[i]->group != group)) shared = 0;
        group = W[i]->group;
    }
    if (!shared) {
        for (int i = 0; i < n; i++)
            if (W[i]) TIMED(op, linear(W[i], x, y[i], M, N[i], K, rows, threads));
        return;
    }
    float *a = rows, *b = a + M * K / group;
    int32_t *sums = (int32_t *)(b + M * K / group);
    int8_t *q = (int8_t *)(sums + M * K / group);
    TIMED(T_QUANTIZE, q8_act_quantize(x, M, K, group, q, a, b, sums, threads));
    for (int i = 0; i < n; i++)
        if (W[i])
            TIMED(op, q8_act_gemv(q, a, b, sums, W[i]->weights, W[i]->kind - LINEAR_Q8_ACT, (int32_t)W[i]->base,
                                  (int32_t)W[i]->code_max, W[i]->scales, W[i]->offsets, y[i], M, N[i], K, W[i]->group,
                                  threads));
}

/* y = x W^T for one projection (see linears). */
static void linear1(const Linear *W, float *y, int64_t N, const float *x, int64_t M, int64_t K, float *rows,
                    int threads, int op) {
    const Linear *Ws[1] = {W};
    float *ys[1] = {y};
    const int64_t Ns[1] = {N};
    linears(Ws, ys, Ns, 1, x, M, K, rows, threads, op);
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Scratch floats gemma4_layer needs for M rows over span_len keys. */
int64_t gemma4_layer_scratch(const Gemma4Weights *L, int64_t M, int64_t span_len) {
    const int64_t H = L->hidden, qd = L->heads * L->head_dim, kvd = L->kv_heads * L->head_dim;
    const int64_t widest = max3(H, qd, L->inter > L->ple ? L->inter : L->ple);
    return M * (3 * qd + 2 * kvd + 6 * H + 2 * L->inter + 2 * L->ple) + attend_work(M, L->heads, 1, span_len, L->head_dim)
           + Q8_SCRATCH(M, widest) + 64;
}

/* x [M, hidden] -> out [M, hidden] (may not alias x); ple [M, ple] rows `ple_stride` apart. */
void gemma4_layer(const Gemma4Weights *L, const LayerStep *S, const float *x, const float *ple, int64_t ple_stride,
                  float *out, float *scratch, int threads) {
    const int64_t M = S->B * S->T, H = L->hidden, D = L->head_dim, qd = L->heads * D, kvd = L->kv_heads * D;
    const int64_t I = L->inter, P = L->ple;
    float *h = scratch, *q = h + M * H, *k = q + M * qd, *v = k + M * kvd, *qr = v + M * kvd, *att = qr + M * qd;
    float *a = att + M * qd, *x_mid = a + M * H, *g = x_mid + M * H, *u = g + M * I;
    float *d = u + M * I, *x_mlp = d + M * H, *pg = x_mlp + M * H, *pm = pg + M * P, *pp = pm + M * P;
    float *work = pp + M * H;
    float *rows = work + attend_work(M, L->heads, 1, S->span_len, D);
    const int shared = L->k.weights == 0;

    TIMED(T_NORMS, rms_norm_rows(x, L->norm_in, 0, h, M, H, L->eps, threads));
    {
        const Linear *W[3] = {&L->q, shared ? 0 : &L->k, shared || !L->v.weights ? 0 : &L->v};
        float *y[3] = {q, k, v};
        const int64_t N[3] = {qd, kvd, kvd};
        linears(W, y, N, 3, h, M, H, rows, threads, T_ATTN_MATRICES);
    }
    TIMED(T_QKV_ROPE, qkv_write(q, shared ? 0 : k, L->v.weights ? v : k, M, S->T, L->heads, L->kv_heads, D, L->q_norm,
                                L->k_norm, L->eps, S->cos, S->sin, S->positions, qr, S->k_cache, S->v_cache,
                                S->cache_sb, S->cache_sh, (int)S->kv_half));
    const int64_t el = S->kv_half ? 2 : 4; /* bytes a cached element takes */
    TIMED(T_ATTENTION, attend_rows_kv(qr, S->T * qd, D, qd, (const char *)S->k_cache + S->span_lo * D * el,
                                      (const char *)S->v_cache + S->span_lo * D * el, S->cache_sb, S->cache_sh,
                                      S->cache_sb, S->cache_sh, (int)S->kv_half, S->mask, S->mask_sb, S->mask_st, att,
                                      S->B, L->heads, L->kv_heads, S->T, S->span_len, D, 1.0f, 0.0f, work, threads));
    linear1(&L->o, a, H, att, M, qd, rows, threads, T_ATTN_MATRICES);
    TIMED(T_NORMS, residual_norms(a, 1, L->norm_post_attn, x, L->norm_pre_mlp, x_mid, h, M, H, L->eps, threads));
    {
        const Linear *W[2] = {&L->gate, &L->up};
        float *y[2] = {g, u};
        const int64_t N[2] = {I, I};
        linears(W, y, N, 2, h, M, H, rows, threads, T_MLP_MATRICES);
    }
    TIMED(T_ACT, gated_act_rows(g, I, u, I, M, I, L->act, g, threads)); /* in place: each element on its own */
    linear1(&L->down, d, H, g, M, I, rows, threads, T_MLP_MATRICES);
    float *y = P ? x_mlp : out;
    TIMED(T_NORMS, rms_norm_rows(d, L->norm_post_mlp, x_mid, y, M, H, L->eps, threads));
    if (P) {
        linear1(&L->ple_gate, pg, P, x_mlp, M, H, rows, threads, T_PLE_MATRICES);
        TIMED(T_ACT, gated_act_rows(pg, P, ple, ple_stride, M, P, L->act, pm, threads));
        linear1(&L->ple_proj, pp, H, pm, M, P, rows, threads, T_PLE_MATRICES);
        TIMED(T_NORMS, rms_norm_rows(pp, L->norm_ple, x_mlp, out, M, H, L->eps, threads));
    }
    if (L->layer_scalar != 1.0f)
        for (int64_t i = 0; i < M * H; i++) out[i] *= L->layer_scalar;
}

/* Scratch floats gemma4_stack needs: the largest layer's, and a hidden state between layers. */
int64_t gemma4_stack_scratch(const Gemma4Weights *L, const LayerStep *S, int64_t n) {
    int64_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t need = gemma4_layer_scratch(&L[i], S[i].B * S[i].T, S[i].span_len);
        most = need > most ? need : most;
    }
    return most + S[0].B * S[0].T * L[0].hidden;
}

/* n layers, layer i as gemma4_layer(L[i], S[i]) with per-layer inputs ple + i * ple_width (rows
 * ple_stride apart; ple NULL: no PLE). x [M, hidden] -> out [M, hidden]. */
void gemma4_stack(const Gemma4Weights *L, const LayerStep *S, int64_t n, const float *x, const float *ple,
                  int64_t ple_stride, float *out, float *scratch, int threads) {
    float *between = scratch, *work = scratch + S[0].B * S[0].T * L[0].hidden;
    const float *in = x;
    for (int64_t i = 0; i < n; i++) {
        float *dst = (n - 1 - i) % 2 == 0 ? out : between; /* the last layer writes out */
        gemma4_layer(&L[i], &S[i], in, ple ? ple + i * L[i].ple : 0, ple_stride, dst, work, threads);
        in = dst;
    }
}
