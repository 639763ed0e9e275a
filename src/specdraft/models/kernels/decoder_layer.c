/* One decoder layer's short forward (decode, verify, drafting) in one call: fp16 or GGUF-block weights.
 *
 *     h = norm_in(x);  q, k, v = qkv(h);  q, k = rope(q_norm(q)), rope(k_norm(k));  cache <- k, v
 *     a = o(attention(q, cache))
 *     x = x + norm_post_attn(a)  (Gemma's sandwich; Llama: x + a);  h = norm_pre_mlp(x)
 *     m = down(act(gate(h)) * up(h));  x = x + norm_post_mlp(m)  (Llama: x + m)
 *
 * The MTP drafter's blocks are the same with query-only attention over the target's cache (no
 * K/V projection, nothing written) and a final per-layer factor.
 *
 * The same kernels, in the same order, as the per-op path of models/architectures/decoder.py takes with the C
 * kernels (so the same bits): this file only removes the ~40 Python-level calls a layer costs
 * there (a few ms a step on a 2-core CPU).
 */
#include "decoder_layer.h"

void linear(const Linear *W, const float *x, float *y, int64_t M, int64_t N, int64_t K, float *rows, int threads)
{
    if (W->kind == LINEAR_FP16) {
        fp16_gemv(x, W->weights, W->bias, y, M, N, K, threads);
        return;
    }
    if (W->kind >= LINEAR_Q8_ACT) {
        float *a = rows, *b = a + M * K / W->group;
        int32_t *sums = (int32_t *)(b + M * K / W->group);
        int8_t *q = (int8_t *)(sums + M * K / W->group);
        q8_act_quantize(x, M, K, W->group, q, a, b, sums, threads);
        q8_act_gemv(q, a, b, sums, W->weights, W->kind - LINEAR_Q8_ACT, (int32_t)W->base, (int32_t)W->code_max,
                    W->scales, W->offsets, y, M, N, K, W->group, threads);
    } else if (W->kind == LINEAR_PACKED_BLOCKS)
        block_gemv_packed(x, W->weights, W->scales, W->offsets, W->base, y, M, N, K, threads);
    else
        block_gemv(x, W->weights, W->scales, W->offsets, y, M, N, K, W->group, threads);
    if (W->bias)
        for (int64_t i = 0; i < M * N; i++) y[i] += W->bias[i % N];
}

/* Scratch floats decoder_layer needs for M = B*T rows over span_len keys. */
int64_t decoder_layer_scratch(const LayerWeights *L, int64_t M, int64_t span_len) {
    const int64_t qd = L->heads * L->head_dim;
    int64_t widest = L->hidden > qd ? L->hidden : qd;
    widest = L->inter > widest ? L->inter : widest;
    return M * ((L->heads + 2 * L->qkv_kv_heads) * L->head_dim + 2 * qd + 5 * L->hidden + 3 * L->inter)
           + attend_work(M, L->heads, 1, span_len, L->head_dim) /* its size: rows x heads x keys */
           + Q8_SCRATCH(M, widest);
}

/* x [M, hidden] -> out [M, hidden] (may not alias x). */
void decoder_layer(const LayerWeights *L, const LayerStep *S, const float *x, float *out, float *scratch, int threads)
{
    const int64_t M = S->B * S->T, H = L->hidden, D = L->head_dim, qd = L->heads * D;
    const int64_t width = (L->heads + 2 * L->qkv_kv_heads) * D;
    float *h = scratch, *qkv = h + M * H, *q = qkv + M * width, *att = q + M * qd, *a = att + M * qd;
    float *x_mid = a + M * H, *h2 = x_mid + M * H, *gu = h2 + M * H, *mm = gu + 2 * M * L->inter;
    float *d = mm + M * L->inter, *work = d + M * H;
    float *rows = work + attend_work(M, L->heads, 1, S->span_len, D); /* int8 rows (q8_act linears) */

    rms_norm_rows(x, L->norm_in, 0, h, M, H, L->eps, threads);
    linear(&L->qkv, h, qkv, M, width, H, rows, threads);
    qk_rope_write(qkv, M, S->T, L->heads, L->qkv_kv_heads, D, L->q_norm, L->k_norm, L->qk_eps, S->cos, S->sin,
                  S->positions, q, S->k_cache, S->cache_sb, S->cache_sh, S->v_cache, S->cache_sb, S->cache_sh,
                  threads);
    /* q [B, T, heads, D]: strides batch T*qd, head D, query qd; out [B, T, heads, D] */
    const int64_t el = S->kv_half ? 2 : 4; /* bytes a cached element takes */
    attend_rows_kv(q, S->T * qd, D, qd, (const char *)S->k_cache + S->span_lo * D * el,
                   (const char *)S->v_cache + S->span_lo * D * el, S->cache_sb, S->cache_sh, S->cache_sb, S->cache_sh,
                   (int)S->kv_half, S->mask, S->mask_sb, S->mask_st, att, S->B, L->heads, L->kv_heads, S->T,
                   S->span_len, D, L->scale, L->softcap, work, threads);
    linear(&L->o, att, a, M, H, qd, rows, threads);
    residual_norms(a, L->sandwich, L->norm_post_attn, x, L->norm_pre_mlp, x_mid, h2, M, H, L->eps, threads);
    linear(&L->gate_up, h2, gu, M, 2 * L->inter, H, rows, threads);
    gated_act(gu, M, L->inter, L->act, mm, threads);
    linear(&L->down, mm, d, M, H, L->inter, rows, threads);
    if (L->sandwich) {
        rms_norm_rows(d, L->norm_post_mlp, x_mid, out, M, H, L->eps, threads);
    } else {
        for (int64_t i = 0; i < M * H; i++) out[i] = x_mid[i] + d[i];
    }
    if (L->layer_scalar != 1.0f)
        for (int64_t i = 0; i < M * H; i++) out[i] *= L->layer_scalar;
}

/* Scratch floats decoder_stack needs: the largest layer's, and a hidden state between layers. */
int64_t decoder_stack_scratch(const LayerWeights *L, const LayerStep *S, int64_t n)
{
    int64_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t need = decoder_layer_scratch(&L[i], S[i].B * S[i].T, S[i].span_len);
        most = need > most ? need : most;
    }
    return most + S[0].B * S[0].T * L[0].hidden;
}

/* n layers, layer i with weights L[i] and step S[i], each one decoder_layer call (the same bits as
 * n calls from Python, without ~0.1 ms of Python between them). x [M, hidden] -> out [M, hidden]. */
void decoder_stack(const LayerWeights *L, const LayerStep *S, int64_t n, const float *x, float *out, float *scratch,
                   int threads)
{
    float *between = scratch, *work = scratch + S[0].B * S[0].T * L[0].hidden;
    const float *in = x;
    for (int64_t i = 0; i < n; i++) {
        float *dst = (n - 1 - i) % 2 == 0 ? out : between; /* the last layer writes out */
        decoder_layer(&L[i], &S[i], in, dst, work, threads);
        in = dst;
    }
}
