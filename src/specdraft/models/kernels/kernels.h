/* The kernels decoder_layer.c strings together (each defined in its own file). */
#ifndef SPECDRAFT_KERNELS_H
#define SPECDRAFT_KERNELS_H

#include <stdint.h>

void fp16_gemv(const float *x, const uint16_t *tiles, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
               int threads);
void block_gemv(const float *x, const int8_t *codes, const float *scales, const float *offsets, float *y, int64_t M,
                int64_t N, int64_t K, int64_t G, int threads);
void block_gemv_packed(const float *x, const uint8_t *nibbles, const float *scales, const float *offsets,
                       int64_t base, float *y, int64_t M, int64_t N, int64_t K, int threads);
void q8_act_quantize(const float *x, int64_t M, int64_t K, int64_t G, int8_t *q, float *a, float *b, int32_t *sums,
                     int threads);
void q8_act_gemv(const int8_t *q, const float *a, const float *b, const int32_t *sums, const uint8_t *codes,
                 int layout, int32_t base, int32_t code_max, const void *s, const void *o, float *y, int64_t M,
                 int64_t N, int64_t K, int64_t G, int threads);
void rms_norm_rows(const float *x, const float *weight, const float *residual, float *out, int64_t N, int64_t D,
                   float eps, int threads);
void residual_norms(const float *a, int first, const float *first_weight, const float *x, const float *second_weight,
                    float *x_out, float *h, int64_t N, int64_t D, float eps, int threads);
void qk_rope_write(const float *qkv, int64_t M, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                   const float *q_scale, const float *k_scale, float eps, const float *cos, const float *sin,
                   const int64_t *positions, float *q_out, float *k_cache, int64_t k_sb, int64_t k_sh,
                   float *v_cache, int64_t v_sb, int64_t v_sh, int threads);
void attend_rows(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st,
                 const float *k, const float *v, int64_t k_sb, int64_t k_sh, int64_t v_sb, int64_t v_sh,
                 const uint8_t *mask, int64_t m_sb, int64_t m_st, float *out,
                 int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 float scale, float softcap, float *work, int threads);
void attend_rows_kv(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_st,
                    const void *k, const void *v, int64_t k_sb, int64_t k_sh, int64_t v_sb, int64_t v_sh, int kv_half,
                    const uint8_t *mask, int64_t m_sb, int64_t m_st, float *out,
                    int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                    float scale, float softcap, float *work, int threads);
int64_t attend_work(int64_t B, int64_t H, int64_t T, int64_t S, int64_t D);
void gated_act(const float *gate_up, int64_t M, int64_t I, int kind, float *out, int threads);
void gated_act_rows(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int64_t M, int64_t I,
                    int kind, float *out, int threads);

#endif
