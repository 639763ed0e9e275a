/* Attention over the KV cache: scores, softmax and p.V, for a few queries (attend_rows: decode,
 * verify, drafting) or a prompt's chunk (attend_prefill). K and V are float32 or fp16 (kv_half).
 *
 * For each query row (batch b, head h, query t) over keys 0..S-1 of KV head h / (H / Hkv):
 *
 *     s_j = scale * (q . k_j)                 (softcap: s_j = cap * tanh(s_j / cap))
 *     p_j = exp(s_j - max s) / sum exp(...)   over the keys the mask lets it see
 *     out = sum_j p_j v_j
 *
 * Keys are split into chunks of CHUNK at fixed offsets (keys 0..127, 128..255, ...). A task takes
 * one KV head's chunk against up to BLOCK_QUERIES of the queries that read it (GQA: Gemma 4 E2B's
 * 8 query heads per KV head, times the positions of a verification) and keeps per query the
 * chunk's maximum, sum of exponentials and weighted sum of values. The chunk's keys and values
 * come from memory once for all of those queries (tiles of up to QTILE queries then reread them
 * from the core's cache): on 2 cores a long context's step is bound by arithmetic on keys
 * already loaded, not by loading them once per head.
 *
 * Row invariance: each (query, key) score is one chain of 8-lane multiply-adds over the head
 * dimension in order, then hsum8; each output element one chain of multiply-adds over the chunk's
 * keys in order; keys a query does not see get weight 0 (a multiply-add of 0 leaves the sum
 * as it was), and a chunk with no visible key is left out of the merge. So a row's result depends
 * only on its own query, its visible keys and the fixed chunk boundaries: not on how many queries,
 * rows or heads share the call or a tile, nor on how far past its last visible key the span
 * reaches. A (K+1)-query verification gives each query the values of a one-query step.
 *
 * attend_prefill runs the same chunks for a prompt's queries, but merges each chunk into the
 * query's running result as it goes (flash attention's online softmax), so no per-chunk partials
 * and no [T, context] score matrix are ever kept.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define CHUNK 128
/* Keys ahead of the one being multiplied whose K (scores) or V (values) lines the tiles ask for:
 * spread through the loops, these loads overlap the arithmetic; one burst for the next chunk
 * stalled the core until it drained (a 32k context's step 1.3x slower, BENCHMARKS.md). */
#define FETCH_AHEAD 8
#define BLOCK_QUERIES 64 /* queries of one KV head a task serves: one load of the chunk for all of them */
#ifdef __AVX512VL__
#define QTILE 8 /* queries a score or value tile keeps in registers (32 of them with AVX-512VL) */
#else
#define QTILE 4
#endif

/* Asks for bytes [from, from + len) of a head's keys or values past `base`, clipped to the
 * `reach` bytes that exist there (0: none): only a hint, no result changes. */
static inline void fetch_ahead(const void *base, int64_t from, int64_t len, int64_t reach) {
    const int64_t end = from + len < reach ? from + len : reach;
    for (int64_t b = from & ~(int64_t)63; b < end; b += 64) _mm_prefetch((const char *)base + b, _MM_HINT_T1);
}

/* 8 keys' or values' elements at index i as float32: fp16 widens exactly. */
static inline __m256 load8(const void *base, int64_t i, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    return _mm256_loadu_ps((const float *)base + i);
}

static inline float load1(const void *base, int64_t i, int half) {
    return half ? _cvtsh_ss(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* q . k_j as every tile computes it: one 8-lane chain over D in order, hsum8, then the scalar
 * tail of a D that is not a multiple of 8. */
static inline float finish_score(__m256 acc, const float *q, const void *k, int64_t j, int64_t D, int half) {
    float s = hsum8(acc);
    for (int64_t i = D & ~(int64_t)7; i < D; i++) s += q[i] * load1(k, j * D + i, half);
    return s;
}

static void score_one(const float *const *qs, int nq, const void *k, int64_t j, int64_t D, int half, float *s) {
    for (int q = 0; q < nq; q++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i + 8 <= D; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qs[q] + i), load8(k, j * D + i, half), a);
        s[q * CHUNK + j] = finish_score(a, qs[q], k, j, D, half);
    }
}

/* Scores of NQ queries against keys [j0, j1), NK keys at a time: each key load serves NQ queries
 * and each query load NK keys. s[q * CHUNK + j]. */
#define SCORE_TILE(NQ, NK, HALF, SUF)                                                                \
static void scores_##NQ##SUF(const float *const *qs, const void *k, int64_t j0, int64_t j1, int64_t D, float *s, \
                             int64_t reach) {                                                        \
    const int64_t row = D * (HALF ? 2 : 4);                                                          \
    int64_t j = j0;                                                                                  \
    for (; j + NK <= j1; j += NK) {                                                                  \
        fetch_ahead(k, (j + FETCH_AHEAD) * row, NK * row, reach);                                    \
        __m256 a[NQ][NK];                                                                            \
        for (int q = 0; q < NQ; q++)                                                                 \
            for (int u = 0; u < NK; u++) a[q][u] = _mm256_setzero_ps();                              \
        for (int64_t i = 0; i + 8 <= D; i += 8) {                                                    \
            __m256 kk[NK];                                                                           \
            for (int u = 0; u < NK; u++) kk[u] = load8(k, (j + u) * D + i, HALF);                    \
            for (int q = 0; q < NQ; q++) {                                                           \
                const __m256 qq = _mm256_loadu_ps(qs[q] + i);                                        \
                for (int u = 0; u < NK; u++) a[q][u] = _mm256_fmadd_ps(qq, kk[u], a[q][u]);          \
            }                                                                                        \
        }                                                                                            \
        for (int q = 0; q < NQ; q++)                                                                 \
            for (int u = 0; u < NK; u++) s[q * CHUNK + j + u] = finish_score(a[q][u], qs[q], k, j + u, D, HALF); \
    }                                                                                                \
    for (; j < j1; j++) score_one(qs, NQ, k, j, D, HALF, s);                                         \
}

/* out_q[d] = sum_j p_q[j] v_j[d] over keys [j0, j1) in order, 16 outputs and NQ queries at a
 * time (each value load serves NQ queries); the scalar tail with fmaf, the same chain. Keys go
 * in runs of VALUE_RUN (16 KB of fp16 values at D = 512: they stay in L1 across the output
 * blocks), each output's sum kept in `out` between runs: the same chain of multiply-adds. */
#define VALUE_RUN 16
#define VALUE_TILE(NQ, HALF, SUF)                                                                    \
static void values_##NQ##SUF(const float *const *p, const void *v, int64_t j0, int64_t j1, int64_t D, float *const *out, \
                             int64_t reach) {                                                        \
    const int64_t row = D * (HALF ? 2 : 4);                                                          \
    for (int64_t r0 = j0; r0 < j1; r0 += VALUE_RUN) {                                                \
        const int64_t r1 = r0 + VALUE_RUN < j1 ? r0 + VALUE_RUN : j1;                                \
        fetch_ahead(v, (r0 + FETCH_AHEAD) * row, (r1 - r0) * row, reach);                            \
        int64_t d0 = 0;                                                                              \
        for (; d0 + 16 <= D; d0 += 16) {                                                             \
            __m256 acc[NQ][2];                                                                       \
            for (int q = 0; q < NQ; q++) {                                                           \
                acc[q][0] = r0 == j0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out[q] + d0);           \
                acc[q][1] = r0 == j0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out[q] + d0 + 8);       \
            }                                                                                        \
            for (int64_t j = r0; j < r1; j++) {                                                      \
                const __m256 v0 = load8(v, j * D + d0, HALF), v1 = load8(v, j * D + d0 + 8, HALF);   \
                for (int q = 0; q < NQ; q++) {                                                       \
                    const __m256 w = _mm256_broadcast_ss(p[q] + j);                                  \
                    acc[q][0] = _mm256_fmadd_ps(w, v0, acc[q][0]);                                   \
                    acc[q][1] = _mm256_fmadd_ps(w, v1, acc[q][1]);                                   \
                }                                                                                    \
            }                                                                                        \
            for (int q = 0; q < NQ; q++) {                                                           \
                _mm256_storeu_ps(out[q] + d0, acc[q][0]);                                            \
                _mm256_storeu_ps(out[q] + d0 + 8, acc[q][1]);                                        \
            }                                                                                        \
        }                                                                                            \
        for (int q = 0; q < NQ; q++)                                                                 \
            for (int64_t d = d0; d < D; d++) {                                                       \
                float acc = r0 == j0 ? 0.0f : out[q][d];                                             \
                for (int64_t j = r0; j < r1; j++) acc = fmaf(p[q][j], load1(v, j * D + d, HALF), acc); \
                out[q][d] = acc;                                                                     \
            }                                                                                        \
    }                                                                                                \
}

/* Tiles by query count: 4 keys at a time for 1-2 queries (enough independent chains to hide the
 * multiply-add latency), 3 for more (the accumulators fit the registers). */
#define TILES(HALF, SUF)                                                                             \
    SCORE_TILE(1, 4, HALF, SUF) SCORE_TILE(2, 4, HALF, SUF) SCORE_TILE(3, 3, HALF, SUF)              \
    SCORE_TILE(4, 3, HALF, SUF) SCORE_TILE(5, 3, HALF, SUF) SCORE_TILE(6, 3, HALF, SUF)              \
    SCORE_TILE(7, 3, HALF, SUF) SCORE_TILE(8, 3, HALF, SUF)                                          \
    VALUE_TILE(1, HALF, SUF) VALUE_TILE(2, HALF, SUF) VALUE_TILE(3, HALF, SUF) VALUE_TILE(4, HALF, SUF) \
    VALUE_TILE(5, HALF, SUF) VALUE_TILE(6, HALF, SUF) VALUE_TILE(7, HALF, SUF) VALUE_TILE(8, HALF, SUF)
TILES(0, _f32)
TILES(1, _f16)

#define BY_TILE(n, kind, SUF, ...)                                                                   \
    switch (n) {                                                                                     \
    case 1: kind##_1##SUF(__VA_ARGS__); break;                                                       \
    case 2: kind##_2##SUF(__VA_ARGS__); break;                                                       \
    case 3: kind##_3##SUF(__VA_ARGS__); break;                                                       \
    case 4: kind##_4##SUF(__VA_ARGS__); break;                                                       \
    case 5: kind##_5##SUF(__VA_ARGS__); break;                                                       \
    case 6: kind##_6##SUF(__VA_ARGS__); break;                                                       \
    case 7: kind##_7##SUF(__VA_ARGS__); break;                                                       \
    default: kind##_8##SUF(__VA_ARGS__); break;                                                      \
    }

static void score_tile(const float *const *qs, int nq, const void *k, int half, int64_t j0, int64_t j1, int64_t D,
                       float *s, int64_t reach) {
    if (half) {
        BY_TILE(nq, scores, _f16, qs, k, j0, j1, D, s, reach)
    } else {
        BY_TILE(nq, scores, _f32, qs, k, j0, j1, D, s, reach)
    }
}

static void value_tile(const float *const *p, int nq, const void *v, int half, int64_t j0, int64_t j1, int64_t D,
                       float *const *out, int64_t reach) {
    if (half) {
        BY_TILE(nq, values, _f16, p, v, j0, j1, D, out, reach)
    } else {
        BY_TILE(nq, values, _f32, p, v, j0, j1, D, out, reach)
    }
}

/* s[j] = e^(s[j] - top) for j in [j0, j1), 8 at a time; the tail through a buffer, the same lanes. */
static void exp_shifted(float *s, int64_t j0, int64_t j1, float top) {
    const __m256 t = _mm256_set1_ps(top);
    int64_t j = j0;
    for (; j + 8 <= j1; j += 8) _mm256_storeu_ps(s + j, exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), t)));
    if (j < j1) {
        float buf[8] = {0};
        memcpy(buf, s + j, sizeof(float) * (j1 - j));
        _mm256_storeu_ps(buf, exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(buf), t)));
        memcpy(s + j, buf, sizeof(float) * (j1 - j));
    }
}

/* One query's softmax over its visible scores in [j0, j1) in place (scaled, soft-capped, then
 * exp(s - max); 0 where it does not see the key); part[0] = the max (-inf when it sees no key of
 * the chunk), part[1] = the sum. */
static void chunk_softmax(float *s, const uint8_t *visible, int64_t j0, int64_t j1, float scale, float softcap,
                          float *part) {
    float top = -INFINITY;
    for (int64_t j = j0; j < j1; j++) {
        if (visible && !visible[j]) continue;
        float x = s[j] * scale;
        if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
        s[j] = x;
        if (x > top) top = x;
    }
    part[0] = top;
    part[1] = 0.0f;
    if (top == -INFINITY) return;
    if (visible) /* unseen keys hold raw scores: no overflow in the exponentials, zeroed below */
        for (int64_t j = j0; j < j1; j++)
            if (!visible[j]) s[j] = top;
    exp_shifted(s, j0, j1, top);
    float total = 0.0f;
    for (int64_t j = j0; j < j1; j++) {
        if (visible && !visible[j]) {
            s[j] = 0.0f;
            continue;
        }
        total += s[j];
    }
    part[1] = total;
}

/* The keys [*j0, *j1) of a chunk of n that some of the nq queries sees (vis[q] NULL: all). */
static void seen_range(const uint8_t *const *vis, int nq, int64_t n, int64_t *j0, int64_t *j1) {
    int64_t lo = n, hi = 0;
    for (int q = 0; q < nq && (lo > 0 || hi < n); q++) {
        if (!vis[q]) {
            lo = 0, hi = n;
            break;
        }
        int64_t a = 0, b = n;
        while (a < lo && !vis[q][a]) a++;
        while (b > hi && !vis[q][b - 1]) b--;
        if (a < lo) lo = a;
        if (b > hi) hi = b;
    }
    *j0 = lo, *j1 = hi > lo ? hi : lo;
}

/* nq <= BLOCK_QUERIES queries over one chunk of n keys: parts[i] = [max, sum of exp, D weighted
 * values] as query i alone would get them. s: BLOCK_QUERIES * CHUNK floats. reach: bytes of the
 * head's keys (and of its values) from the chunk's start that its first tile fetches ahead in (0:
 * none; the later tiles find them in cache). */
static void chunk_partials(const float *const *qs, const uint8_t *const *vis, const void *k, const void *v, int half,
                           int nq, int64_t n, int64_t D, float scale, float softcap, float *s, float *const *parts,
                           int64_t reach) {
    int64_t j0, j1;
    seen_range(vis, nq, n, &j0, &j1);
    if (j0 == j1) {
        for (int q = 0; q < nq; q++) parts[q][0] = -INFINITY, parts[q][1] = 0.0f;
        return;
    }
    for (int q0 = 0; q0 < nq; q0 += QTILE) {
        const int m = nq - q0 < QTILE ? nq - q0 : QTILE;
        score_tile(qs + q0, m, k, half, j0, j1, D, s + q0 * CHUNK, q0 == 0 ? reach : 0);
    }
    const float *live_p[BLOCK_QUERIES]; /* the queries that see a key of this chunk */
    float *live_out[BLOCK_QUERIES];
    int m = 0;
    for (int q = 0; q < nq; q++) {
        chunk_softmax(s + q * CHUNK, vis[q], j0, j1, scale, softcap, parts[q]);
        if (parts[q][0] == -INFINITY) continue;
        live_p[m] = s + q * CHUNK, live_out[m] = parts[q] + 2, m++;
    }
    for (int q0 = 0; q0 < m; q0 += QTILE)
        value_tile(live_p + q0, m - q0 < QTILE ? m - q0 : QTILE, v, half, j0, j1, D, live_out + q0, q0 == 0 ? reach : 0);
}

#define TASK_COST 8 /* a task's work beside its keys (the mask scan, the softmax's loops), in keys */

/* Floats of `work` attend_rows needs: the chunks' partial results. */
int64_t attend_work(int64_t B, int64_t H, int64_t T, int64_t S, int64_t D) {
    const int64_t chunks = (S + CHUNK - 1) / CHUNK;
    return B * H * T * chunks * (D + 2);
}

/* The queries of task block qb of KV head hk (its group's heads at every position,
 * position-major): their vectors, masks over the chunk at j0, and count. */
static int block_queries(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st, const uint8_t *mask, int64_t m_sb,
                         int64_t m_st, int64_t b, int64_t hk, int64_t qb, int64_t group, int64_t T, int64_t j0,
                         const float **qs, const uint8_t **vis, int64_t *heads, int64_t *times) {
    int nq = 0;
    for (int64_t u = qb * BLOCK_QUERIES; u < group * T && nq < BLOCK_QUERIES; u++, nq++) {
        const int64_t t = u / group, h = hk * group + u % group;
        if (qs) qs[nq] = q + b * q_sb + h * q_sh + t * q_st;
        vis[nq] = mask ? mask + b * m_sb + t * m_st + j0 : 0;
        if (heads) heads[nq] = h, times[nq] = t;
    }
    return nq;
}

/* q [B, H, T, D] float32 (strides q_sb, q_sh, q_st; D contiguous), k and v [B, Hkv, S, D] float32
 * or fp16 (kv_half; strides k_sb, k_sh, v_sb, v_sh in elements; keys contiguous), mask [B, 1, T,
 * S] bool (strides m_sb, m_st; NULL: all visible), out [B, T, H, D] contiguous (what the output
 * projection reads), work: attend_work floats. */
void attend_rows_kv(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st,
                    const void *k, const void *v, int64_t k_sb, int64_t k_sh, int64_t v_sb, int64_t v_sh, int kv_half,
                    const uint8_t *mask, int64_t m_sb, int64_t m_st, float *out,
                    int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                    float scale, float softcap, float *work, int threads)
{
    /* A task: one KV head's chunk against a block of the queries that read that head. Blocks are
     * the fastest index, so a thread's consecutive tasks read the same keys and values. */
    const int64_t group = H / Hkv, chunks = (S + CHUNK - 1) / CHUNK,
                  blocks = (group * T + BLOCK_QUERIES - 1) / BLOCK_QUERIES, tasks = B * Hkv * chunks * blocks;
    const int64_t el = kv_half ? 2 : 4;
    float *parts = work; /* [B, H, T, chunks, D + 2] */
    const int parallel = tasks > 1 && B * H * T * S * D >= (1 << 17); /* below that, waking threads costs more */
    /* Each thread takes a run of tasks holding about its share of the keys their queries see, not
     * of the tasks (over 300 keys the last chunk holds 44; over 1000 a sliding layer's visible
     * ones lie in its last chunks). Which thread runs a task changes nothing in it. */
    int64_t *cost = parallel ? malloc(tasks * sizeof *cost) : NULL, total = 0;
    for (int64_t task = 0; cost && task < tasks; task++) {
        const int64_t qb = task % blocks, c = (task / blocks) % chunks, b = task / (blocks * chunks * Hkv);
        const int64_t j0 = c * CHUNK, n = S - j0 < CHUNK ? S - j0 : CHUNK;
        const uint8_t *vis[BLOCK_QUERIES];
        const int nq = block_queries(q, q_sb, q_sh, q_st, mask, m_sb, m_st, b, 0, qb, group, T, j0, 0, vis, 0, 0);
        int64_t a, z;
        seen_range(vis, nq, n, &a, &z);
        cost[task] = TASK_COST + (z - a) * nq;
        total += cost[task];
    }
#pragma omp parallel num_threads(threads) if (parallel)
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        float *s = malloc(sizeof(float) * BLOCK_QUERIES * CHUNK);
        int64_t before = 0; /* work of the tasks before this one */
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t qb = task % blocks, c = (task / blocks) % chunks, hk = (task / (blocks * chunks)) % Hkv,
                          b = task / (blocks * chunks * Hkv);
            const int64_t j0 = c * CHUNK, n = S - j0 < CHUNK ? S - j0 : CHUNK;
            const int64_t owner = cost ? (2 * before + cost[task]) * nth / (2 * total) : task * nth / tasks;
            before += cost ? cost[task] : 0;
            if (owner != me)
                continue;
            const float *qs[BLOCK_QUERIES];
            const uint8_t *vis[BLOCK_QUERIES];
            int64_t heads[BLOCK_QUERIES], times[BLOCK_QUERIES];
            float *part[BLOCK_QUERIES];
            const int nq = block_queries(q, q_sb, q_sh, q_st, mask, m_sb, m_st, b, hk, qb, group, T, j0, qs, vis,
                                         heads, times);
            for (int i = 0; i < nq; i++) part[i] = parts + (((b * H + heads[i]) * T + times[i]) * chunks + c) * (D + 2);
            /* the first block fetches ahead (its keys past S are never read, nor asked for); the
             * chunk is still in cache when the next block of its queries runs */
            chunk_partials(qs, vis, (const char *)k + (b * k_sb + hk * k_sh + j0 * D) * el,
                           (const char *)v + (b * v_sb + hk * v_sh + j0 * D) * el, kv_half, nq, n, D, scale, softcap,
                           s, part, qb == 0 ? (S - j0) * D * el : 0);
        }
        free(s);
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

/* attend_rows_kv over a float32 cache (the fused decoder layer's). */
void attend_rows(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st,
                 const float *k, const float *v, int64_t k_sb, int64_t k_sh, int64_t v_sb, int64_t v_sh,
                 const uint8_t *mask, int64_t m_sb, int64_t m_st, float *out,
                 int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 float scale, float softcap, float *work, int threads)
{
    attend_rows_kv(q, q_sb, q_sh, q_st, k, v, k_sb, k_sh, v_sb, v_sh, 0, mask, m_sb, m_st, out, B, H, Hkv, T, S, D,
                   scale, softcap, work, threads);
}

/* A prompt chunk's attention, arguments as attend_rows_kv's (no work buffer). Tasks are a KV
 * head's queries at BLOCK_QUERIES / group consecutive positions; each walks the chunks of keys
 * in order and folds each chunk's partial result into its queries' running ones:
 *     top' = max(top, m_c);  sum' = sum e^(top - top') + l_c e^(m_c - top');  acc likewise. */
void attend_prefill(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st,
                    const void *k, const void *v, int64_t k_sb, int64_t k_sh, int64_t v_sb, int64_t v_sh, int kv_half,
                    const uint8_t *mask, int64_t m_sb, int64_t m_st, float *out,
                    int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                    float scale, float softcap, int threads)
{
    const int64_t group = H / Hkv, chunks = (S + CHUNK - 1) / CHUNK,
                  blocks = (group * T + BLOCK_QUERIES - 1) / BLOCK_QUERIES, tasks = B * Hkv * blocks;
    const int64_t el = kv_half ? 2 : 4;
#pragma omp parallel num_threads(threads) if (tasks > 1)
    {
        float *s = malloc(sizeof(float) * BLOCK_QUERIES * CHUNK);
        float *parts = malloc(sizeof(float) * BLOCK_QUERIES * (D + 2)), *run = malloc(sizeof(float) * BLOCK_QUERIES * (D + 2));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t qb = task % blocks, hk = (task / blocks) % Hkv, b = task / (blocks * Hkv);
            const float *qs[BLOCK_QUERIES];
            const uint8_t *vis[BLOCK_QUERIES];
            int64_t heads[BLOCK_QUERIES], times[BLOCK_QUERIES];
            float *part[BLOCK_QUERIES];
            int nq = 0;
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t j0 = c * CHUNK, n = S - j0 < CHUNK ? S - j0 : CHUNK;
                nq = block_queries(q, q_sb, q_sh, q_st, mask, m_sb, m_st, b, hk, qb, group, T, j0, qs, vis, heads,
                                   times);
                for (int i = 0; i < nq; i++) part[i] = parts + i * (D + 2);
                if (c == 0)
                    for (int i = 0; i < nq; i++) run[i * (D + 2)] = -INFINITY, run[i * (D + 2) + 1] = 0.0f;
                chunk_partials(qs, vis, (const char *)k + (b * k_sb + hk * k_sh + j0 * D) * el,
                               (const char *)v + (b * v_sb + hk * v_sh + j0 * D) * el, kv_half, nq, n, D, scale,
                               softcap, s, part, (S - j0) * D * el);
                for (int i = 0; i < nq; i++) {
                    float *r = run + i * (D + 2);
                    const float *pc = part[i];
                    if (pc[0] == -INFINITY) continue;
                    if (r[0] == -INFINITY) {
                        memcpy(r, pc, sizeof(float) * (D + 2));
                        continue;
                    }
                    const float top = pc[0] > r[0] ? pc[0] : r[0], fr = expf(r[0] - top), fc = expf(pc[0] - top);
                    r[0] = top;
                    r[1] = r[1] * fr + pc[1] * fc;
                    for (int64_t d = 0; d < D; d++) r[2 + d] = r[2 + d] * fr + pc[2 + d] * fc;
                }
            }
            for (int i = 0; i < nq; i++) {
                const float *r = run + i * (D + 2);
                float *o = out + ((b * T + times[i]) * H + heads[i]) * D;
                const float inv = r[0] == -INFINITY ? NAN : 1.0f / r[1];
                for (int64_t d = 0; d < D; d++) o[d] = r[0] == -INFINITY ? NAN : r[2 + d] * inv;
            }
        }
        free(s);
        free(parts);
        free(run);
    }
}
