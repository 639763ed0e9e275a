/* A projection's weights, a decoder layer's weights and one forward's inputs as decoder_layer.c
 * takes them (their Python twins: models/kernels/decoder_layer.py), shared with draft_step.c. */
#ifndef SPECDRAFT_DECODER_LAYER_H
#define SPECDRAFT_DECODER_LAYER_H

#include "kernels.h"

/* LINEAR_Q8_ACT and up: LINEAR_Q8_ACT + q8_act_gemv's `layout` (bytes, nibbles or signed bytes, and
 * its fp16-scales flag) */
enum { LINEAR_FP16 = 0, LINEAR_BLOCKS = 1, LINEAR_PACKED_BLOCKS = 2, LINEAR_Q8_ACT = 3 };

/* A projection's weights as one of the kernels takes them. */
typedef struct {
    int kind;
    const void *weights; /* fp16_gemv tiles, block_gemv's int8 codes [N, K] or packed 4-bit codes [N, K/2],
                            q8_act_gemv's interleaved codes */
    const float *scales, *offsets; /* blocks: per group of `group` inputs (offsets may be NULL) */
    int64_t group;
    const float *bias; /* NULL: none */
    int64_t base; /* packed codes: the code of nibble 0; q8_act: the code of byte 0 */
    int64_t code_max; /* q8_act: the largest code as stored (unsigned; signed bytes: the largest |c|) */
} Linear;

/* Scratch floats `linear` needs for the int8 rows of a q8_act projection of M rows of K inputs. */
#define Q8_SCRATCH(M, K) ((M) * (K) / 4 + 3 * (M) * (K) / 16)

/* y [M, N] = x [M, K] W^T + bias, as the layer's per-op path computes it (Fp16Linear, BlockLinear,
 * Q8ActLinear). rows: Q8_SCRATCH(M, K) floats of scratch. */
void linear(const Linear *W, const float *x, float *y, int64_t M, int64_t N, int64_t K, float *rows, int threads);

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    int64_t qkv_kv_heads; /* K/V heads the qkv projection computes and the cache gets: kv_heads, or 0
                             for query-only attention over a cache others wrote (the MTP drafter) */
    int sandwich, act; /* act: gated_act's kind */
    float eps, qk_eps, scale, softcap, layer_scalar; /* layer_scalar: the output's factor (Gemma 4) */
    const float *norm_in, *norm_post_attn, *norm_pre_mlp, *norm_post_mlp; /* scales; NULL: none */
    const float *q_norm, *k_norm; /* NULL: no q/k norms */
    Linear qkv, o, gate_up, down;
} LayerWeights;

/* Everything a forward of B rows x T tokens needs besides the weights. */
typedef struct {
    int64_t B, T;
    const float *cos, *sin; /* [B*T, head_dim] */
    const int64_t *positions; /* [B, T] */
    float *k_cache, *v_cache; /* this layer's [B, kv_heads, capacity, head_dim] */
    int64_t cache_sb, cache_sh; /* their batch and head strides (the same for K and V) */
    int64_t span_lo, span_len; /* the keys attention reads */
    const uint8_t *mask; /* [B, 1, T, span_len] bool */
    int64_t mask_sb, mask_st;
    int64_t kv_half; /* the cache holds float16 (query-only attention: nothing written), else float32 */
} LayerStep;

int64_t decoder_stack_scratch(const LayerWeights *L, const LayerStep *S, int64_t n);
void decoder_stack(const LayerWeights *L, const LayerStep *S, int64_t n, const float *x, float *out, float *scratch,
                   int threads);

#endif
