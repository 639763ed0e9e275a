/* A Gemma 4 decoder layer's weights as gemma4_layer.c takes them (Python twin: gemma4_layer.py). */
#ifndef SPECDRAFT_GEMMA4_LAYER_H
#define SPECDRAFT_GEMMA4_LAYER_H

#include "decoder_layer.h"

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, ple; /* ple: per-layer input width, 0 = none */
    int act; /* gated_act's kind */
    float eps, layer_scalar;
    const float *norm_in, *norm_post_attn, *norm_pre_mlp, *norm_post_mlp, *norm_ple; /* scales */
    const float *q_norm, *k_norm; /* scales; V is normed without one */
    /* k.weights NULL: a KV-shared layer (reads its producer's cache, writes nothing);
     * v.weights NULL: V is K's raw projection (attention_k_eq_v) */
    Linear q, k, v, o, gate, up, down, ple_gate, ple_proj;
} Gemma4Weights;

#endif
