/* Attention of a few queries over the KV cache: scores, softmax and p.V in one call.
 *
 * For each query row (batch b, head h, query t) over keys 0..S-1 of KV head h / (H / Hkv):
 *
 *     s_j = scale * (q . k_j)                 (softcap: s_j = cap * tanh(s_j / cap))
 *     p_j = exp(s_j - max s) / sum exp(...)   over the keys the mask lets it see
 *     out = sum_j p_j v_j
 *
 * Work is split by KV head and by chunks of CHUNK keys at fixed offsets (keys 0..127, 128..255,
 * ...): a task takes up to QUERY_BLOCK of the queries that read its chunk (GQA: Gemma 3 270M's 4
 * query heads read one KV head; a verification adds its positions), loads each key and value once
 * for all of them, and keeps per query the chunk's maximum, sum of exponentials and weighted sum
 * of values; the chunks are then merged in key order (flash-decoding's split). Sharing each load
 * across queries, with both threads on different chunks, is what makes attention cheap on 2
 * cores, and a K+1-position verification's not much dearer than a step's.
 *
 * Masked keys are skipped (in the reference they add exact zeros) and a chunk with no visible
 * key is left out of the merge, so a row's result depends only on its own query, its visible keys
 * and the fixed chunk boundaries: not on how many queries, rows or heads share the call, nor on
 * how far past its last visible key the span reaches. A (K+1)-query verification gives each
 * query the bits of a one-query step.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define CHUNK 128
#define QUERY_BLOCK 4 /* query rows (heads x positions) that share each load of a key and a value */

/* Scores of NQ queries (qs[i], D floats each) against n keys: s[i * CHUNK + j] = q_i . k_j, each
 * summed exactly as dot_f32 sums it (two 8-lane accumulators over the even and odd 8-float
 * chunks, then hsum8). Two keys and NQ queries at a time: each key load serves NQ queries and each
 * query load two keys (a quarter of dot_f32's loads a multiply-add at NQ = 4), which is what
 * a verification's (heads x positions) queries need to be cheaper than one at a time. Keys no
 * query sees (see[j] == 0) are skipped; the others are scored for every query, visible or not
 * (the caller reads a query's visible ones only). D a multiple of 16. */
#define SCORE_TILE(NQ)                                                                              \
static void scores_##NQ(const float *const *qs, const float *k, const uint8_t *see, int64_t n, int64_t D, \
                        float *s) {                                                                 \
    int64_t j = 0;                                                                                  \
    for (; j + 2 <= n; j += 2) {                                                                    \
        if (see && !see[j] && !see[j + 1]) continue;                                                \
        const float *k0 = k + j * D, *k1 = k0 + D;                                                  \
        __m256 a[NQ][4];                                                                            \
        for (int q = 0; q < NQ; q++) a[q][0] = a[q][1] = a[q][2] = a[q][3] = _mm256_setzero_ps();   \
        for (int64_t i = 0; i < D; i += 16) {                                                       \
            const __m256 k0l = _mm256_loadu_ps(k0 + i), k0h = _mm256_loadu_ps(k0 + i + 8);          \
            const __m256 k1l = _mm256_loadu_ps(k1 + i), k1h = _mm256_loadu_ps(k1 + i + 8);          \
            for (int q = 0; q < NQ; q++) {                                                          \
                const __m256 ql = _mm256_loadu_ps(qs[q] + i), qh = _mm256_loadu_ps(qs[q] + i + 8);  \
                a[q][0] = _mm256_fmadd_ps(ql, k0l, a[q][0]);                                        \
                a[q][1] = _mm256_fmadd_ps(qh, k0h, a[q][1]);                                        \
                a[q][2] = _mm256_fmadd_ps(ql, k1l, a[q][2]);                                        \
                a[q][3] = _mm256_fmadd_ps(qh, k1h, a[q][3]);                                        \
            }                                                                                       \
        }                                                                                           \
        for (int q = 0; q < NQ; q++) {                                                              \
            s[q * CHUNK + j] = hsum8(_mm256_add_ps(a[q][0], a[q][1]));                              \
            s[q * CHUNK + j + 1] = hsum8(_mm256_add_ps(a[q][2], a[q][3]));                          \
        }                                                                                           \
    }                                                                                               \
    for (; j < n; j++)                                                                              \
        if (!see || see[j])                                                                         \
            for (int q = 0; q < NQ; q++) s[q * CHUNK + j] = dot_f32(qs[q], k + j * D, D);           \
}

/* out_i[0..D) = sum_j p_i[j] v_j over the keys query i sees (vis[i] NULL: all), summed in key
 * order: each output a chain of multiply-adds as fmaf makes them (so the 8-lane loop and the
 * scalar tail give the same bits). 32 outputs and NQ queries at a time: each value load serves NQ
 * queries. p: the queries' weights at stride CHUNK. */
#define VALUE_TILE(NQ)                                                                              \
static void values_##NQ(const float *p, const uint8_t *const *vis, const float *v, int64_t n, int64_t D, \
                        float *const *out) {                                                        \
    int64_t d0 = 0;                                                                                 \
    for (; d0 + 32 <= D; d0 += 32) {                                                                \
        __m256 acc[NQ][4];                                                                          \
        for (int q = 0; q < NQ; q++) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = _mm256_setzero_ps(); \
        for (int64_t j = 0; j < n; j++) {                                                           \
            const float *vj = v + j * D + d0;                                                       \
            const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);                    \
            const __m256 v2 = _mm256_loadu_ps(vj + 16), v3 = _mm256_loadu_ps(vj + 24);              \
            for (int q = 0; q < NQ; q++) {                                                          \
                if (vis[q] && !vis[q][j]) continue;                                                 \
                const __m256 w = _mm256_set1_ps(p[q * CHUNK + j]);                                  \
                acc[q][0] = _mm256_fmadd_ps(w, v0, acc[q][0]);                                      \
                acc[q][1] = _mm256_fmadd_ps(w, v1, acc[q][1]);                                      \
                acc[q][2] = _mm256_fmadd_ps(w, v2, acc[q][2]);                                      \
                acc[q][3] = _mm256_fmadd_ps(w, v3, acc[q][3]);                                      \
            }                                                                                       \
        }                                                                                           \
        for (int q = 0; q < NQ; q++)                                                                \
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out[q] + d0 + 8 * i, acc[q][i]);           \
    }                                                                                               \
    for (int q = 0; q < NQ; q++)                                                                    \
        for (int64_t d = d0; d < D; d++) { /* head sizes that are not a multiple of 32 */           \
            float acc = 0.0f;                                                                       \
            for (int64_t j = 0; j < n; j++)                                                         \
                if (!vis[q] || vis[q][j]) acc = fmaf(p[q * CHUNK + j], v[j * D + d], acc);          \
            out[q][d] = acc;                                                                        \
        }                                                                                           \
}

SCORE_TILE(1)
SCORE_TILE(2)
SCORE_TILE(3)
SCORE_TILE(4)
VALUE_TILE(1)
VALUE_TILE(2)
VALUE_TILE(3)
VALUE_TILE(4)

/* One query's softmax over its visible scores s[0..n) in place (scaled, soft-capped, then
 * exp(s - max)); part[0] = the max (-inf when it sees no key of the chunk), part[1] = the sum. */
static void chunk_softmax(float *s, const uint8_t *visible, int64_t n, float scale, float softcap, float *part) {
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        if (visible && !visible[j]) continue;
        float x = s[j] * scale;
        if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
        s[j] = x;
        if (x > top) top = x;
    }
    part[0] = top;
    if (top == -INFINITY) return;
    float total = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        if (visible && !visible[j]) continue;
        s[j] = expf(s[j] - top);
        total += s[j];
    }
    part[1] = total;
}

/* nq <= QUERY_BLOCK queries over one chunk of n keys: part_i = [max, sum of exp, D weighted
 * values] (parts[i]), as one query alone would get them. s: QUERY_BLOCK * CHUNK floats. */
static void chunk_partials(const float *const *qs, const uint8_t *const *vis, const float *k, const float *v,
                           int nq, int64_t n, int64_t D, float scale, float softcap, float *s, float *const *parts) {
    uint8_t see[CHUNK]; /* keys some query of the block sees */
    const uint8_t *seen = 0;
    for (int q = 0; q < nq; q++)
        if (vis[q]) seen = see;
    if (seen)
        for (int64_t j = 0; j < n; j++) {
            see[j] = 0;
            for (int q = 0; q < nq; q++) see[j] |= !vis[q] || vis[q][j];
        }
    if (D % 16 == 0) {
        switch (nq) {
        case 1: scores_1(qs, k, seen, n, D, s); break;
        case 2: scores_2(qs, k, seen, n, D, s); break;
        case 3: scores_3(qs, k, seen, n, D, s); break;
        default: scores_4(qs, k, seen, n, D, s); break;
        }
    } else {
        for (int q = 0; q < nq; q++)
            for (int64_t j = 0; j < n; j++)
                if (!vis[q] || vis[q][j]) s[q * CHUNK + j] = dot_f32(qs[q], k + j * D, D);
    }
    const uint8_t *live_vis[QUERY_BLOCK]; /* the queries that see a key of this chunk, weights packed */
    float *live_out[QUERY_BLOCK];
    int m = 0;
    for (int q = 0; q < nq; q++) {
        chunk_softmax(s + q * CHUNK, vis[q], n, scale, softcap, parts[q]);
        if (parts[q][0] == -INFINITY) continue;
        if (m != q) memcpy(s + m * CHUNK, s + q * CHUNK, sizeof(float) * n);
        live_vis[m] = vis[q], live_out[m] = parts[q] + 2, m++;
    }
    switch (m) {
    case 0: break;
    case 1: values_1(s, live_vis, v, n, D, live_out); break;
    case 2: values_2(s, live_vis, v, n, D, live_out); break;
    case 3: values_3(s, live_vis, v, n, D, live_out); break;
    default: values_4(s, live_vis, v, n, D, live_out); break;
    }
}

/* Keys of a chunk of n some query sees (vis[q] NULL: all of them): the ones chunk_partials reads. */
static int64_t seen_keys(const uint8_t *const *vis, int nq, int64_t n) {
    int64_t seen = 0;
    for (int64_t j = 0; j < n; j++) {
        int any = 0;
        for (int q = 0; q < nq; q++) any |= !vis[q] || vis[q][j];
        seen += any;
    }
    return seen;
}

#define TASK_COST 8 /* a task's work beside its keys (the mask scan, the softmax's loops), in keys */

/* Floats of `work` attend_rows needs: the chunks' partial results and each task's scores (a
 * task's query block may run past the last query: QUERY_BLOCK - 1 more rows of scores per head). */
int64_t attend_work(int64_t B, int64_t H, int64_t T, int64_t S, int64_t D) {
    const int64_t chunks = (S + CHUNK - 1) / CHUNK;
    return B * H * T * chunks * (D + 2) + B * H * (T + QUERY_BLOCK - 1) * chunks * CHUNK;
}

/* q [B, H, T, D] (strides q_sb, q_sh, q_st; D contiguous), k and v [B, Hkv, S, D] (strides k_sb,
 * k_sh, v_sb, v_sh; keys contiguous), mask [B, 1, T, S] bool (strides m_sb, m_st; NULL: all
 * visible), out [B, T, H, D] contiguous (what the output projection reads), work: attend_work floats. */
void attend_rows(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st,
                 const float *k, const float *v, int64_t k_sb, int64_t k_sh, int64_t v_sb, int64_t v_sh,
                 const uint8_t *mask, int64_t m_sb, int64_t m_st, float *out,
                 int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 float scale, float softcap, float *work, int threads)
{
    /* A task: one KV head's chunk of keys against a block of QUERY_BLOCK of the queries that read
     * that head (its group's heads at every position, position-major). Blocks are the fastest
     * index, so a thread's consecutive tasks read the same keys and values (from cache). */
    const int64_t group = H / Hkv, chunks = (S + CHUNK - 1) / CHUNK, queries = group * T,
                  blocks = (queries + QUERY_BLOCK - 1) / QUERY_BLOCK, tasks = B * Hkv * chunks * blocks;
    float *parts = work, *scores = work + B * H * T * chunks * (D + 2); /* parts [B, H, T, chunks, D + 2] */
    const int parallel = tasks > 1 && B * H * T * S * D >= (1 << 17); /* below that, waking threads costs more */
    /* A task's work is the keys its queries see (chunk_partials skips the rest), and each thread
     * takes a run of tasks holding about its share of that work, not of the tasks: over 300 keys
     * the last chunk holds 44, and an even split of 3 tasks gave one thread 256 keys' work and
     * the other 44; over 1000 keys a sliding layer's 512 visible ones lie in its last chunks.
     * Which thread runs a task changes nothing in it, so no bit. */
    int64_t *cost = parallel ? malloc(tasks * sizeof *cost) : NULL, total = 0;
    for (int64_t task = 0; cost && task < tasks; task++) {
        const int64_t qb = task % blocks, c = (task / blocks) % chunks, b = task / (blocks * chunks * Hkv);
        const int64_t j0 = c * CHUNK, n = S - j0 < CHUNK ? S - j0 : CHUNK;
        const uint8_t *vis[QUERY_BLOCK];
        int nq = 0;
        for (int64_t u = qb * QUERY_BLOCK; u < queries && nq < QUERY_BLOCK; u++, nq++)
            vis[nq] = mask ? mask + b * m_sb + (u / group) * m_st + j0 : 0;
        cost[task] = TASK_COST + seen_keys(vis, nq, n);
        total += cost[task];
    }
#pragma omp parallel num_threads(threads) if (parallel)
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t before = 0; /* work of the tasks before this one */
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t qb = task % blocks, c = (task / blocks) % chunks, hk = (task / (blocks * chunks)) % Hkv,
                          b = task / (blocks * chunks * Hkv);
            const int64_t j0 = c * CHUNK, n = S - j0 < CHUNK ? S - j0 : CHUNK;
            /* whose share the task's middle is in (no costs: one thread, or no memory for them) */
            const int64_t owner = cost ? (2 * before + cost[task]) * nth / (2 * total) : task * nth / tasks;
            before += cost ? cost[task] : 0;
            if (owner != me)
                continue;
            const float *qs[QUERY_BLOCK];
            const uint8_t *vis[QUERY_BLOCK];
            float *part[QUERY_BLOCK];
            int nq = 0;
            for (int64_t u = qb * QUERY_BLOCK; u < queries && nq < QUERY_BLOCK; u++, nq++) {
                const int64_t t = u / group, h = hk * group + u % group;
                qs[nq] = q + b * q_sb + h * q_sh + t * q_st;
                vis[nq] = mask ? mask + b * m_sb + t * m_st + j0 : 0;
                part[nq] = parts + (((b * H + h) * T + t) * chunks + c) * (D + 2);
            }
            chunk_partials(qs, vis, k + b * k_sb + hk * k_sh + j0 * D, v + b * v_sb + hk * v_sh + j0 * D, nq, n, D,
                           scale, softcap, scores + task * QUERY_BLOCK * CHUNK, part);
        }
    }
    free(cost);
    /* merge each row's chunks in key order */
#pragma omp parallel for schedule(static) num_threads(threads) if (B * H * T * chunks * D >= (1 << 16))
    for (int64_t r = 0; r < B * H * T; r++) {
        const int64_t b = r / (H * T), h = (r / T) % H, t = r % T;
        const float *p = parts + r * chunks * (D + 2);
        float *o = out + ((b * T + t) * H + h) * D;
        float top = -INFINITY;
        for (int64_t c = 0; c < chunks; c++)
            if (p[c * (D + 2)] > top) top = p[c * (D + 2)];
        if (top == -INFINITY) { /* no visible key: NaN, as softmax over -inf gives */
            for (int64_t d = 0; d < D; d++) o[d] = NAN;
            continue;
        }
        float total = 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *pc = p + c * (D + 2);
            if (pc[0] == -INFINITY) continue;
            const float f = expf(pc[0] - top);
            total += f * pc[1];
            for (int64_t d = 0; d < D; d++) o[d] += f * pc[2 + d];
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}
