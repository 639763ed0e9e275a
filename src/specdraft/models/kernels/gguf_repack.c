/* GGUF blocks (Q8_0, Q4_K, Q6_K) -> q8_act_gemv.c's layouts, straight from the file's bytes.
 *
 * Loading a Gemma 4 GGUF is mostly this: every matrix's codes re-laid out so that one 64-byte
 * load holds 16 outputs' codes for 4 inputs. Done a super-block at a time in C (one block of 16
 * output rows a thread at a time), it runs at memory speed; through numpy (decode every code to a
 * byte, then permute) it took most of a load's time (BENCHMARKS.md).
 *
 * What is written is what models/formats/q8_act_linear.py would pack from the decoded blocks,
 * except that the code base is the format's own (Q8_0: -128, Q6_K: -32, Q4_K: 0) rather than the
 * matrix's smallest code: the kernel adds base * sum(q) back as an exact integer, so either base
 * gives the same sums and the same bits (the tests compare outputs).
 *
 * Layouts (per block of 16 outputs, o = 0..15, i = 0..3):
 * - bytes (Q8_0): [K/4 steps][16][4], u = c + 128; or, `signed_bytes` (AVX2 builds), c itself;
 *   scales fp16 [K/32][16] (the file's own d bits).
 * - nibbles (Q4_K): [K/8 step pairs][16][4], low nibble step 2j, high 2j + 1; two-level scales and
 *   offsets: int8 [K/32][16] (the 6-bit sc, mn), then fp16 [K/256][16] (d, dmin).
 * - six bits (Q6_K): [K/16 quads][192]: the nibbles of step pairs 0, 1 of the quad, then the 4 steps'
 *   high 2 bits (step s in bits 2s, 2s + 1); two-level scales: int8 [K/16][16], fp16 [K/256][16].
 */
#include <stdint.h>
#include <string.h>

enum { FMT_Q8_0 = 0, FMT_Q4_K = 1, FMT_Q6_K = 2 };
#define OUT_BLOCK 16
#define QK 256 /* values per K-quant super-block */

/* Where code k of output o goes in a block's bytes layout. */
static inline int64_t byte_at(int64_t k, int o) { return ((k >> 2) * OUT_BLOCK + o) * 4 + (k & 3); }

/* Code k of output o in the nibble layout: its byte, and whether it is the high nibble. */
static inline int64_t nibble_at(int64_t k, int o, int *high)
{
    *high = (k >> 2) & 1;
    return ((k >> 3) * OUT_BLOCK + o) * 4 + (k & 3);
}

static void q8_0_row(const uint8_t *row, int64_t K, int o, int signed_bytes, uint8_t *codes, uint16_t *scales)
{
    for (int64_t blk = 0; blk < K / 32; blk++) {
        const uint8_t *b = row + blk * 34;
        memcpy(&scales[blk * OUT_BLOCK + o], b, 2);
        for (int j = 0; j < 32; j++) {
            const int8_t c = (int8_t)b[2 + j];
            codes[byte_at(blk * 32 + j, o)] = signed_bytes ? (uint8_t)c : (uint8_t)(c + 128);
        }
    }
}

/* Q4_K's 12 bytes of 6-bit scales and mins -> sc[8], mn[8]. */
static void q4_k_scales(const uint8_t *p, uint8_t *sc, uint8_t *mn)
{
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63, mn[j] = p[4 + j] & 63;
        sc[4 + j] = (p[8 + j] & 15) | ((p[j] >> 2) & 0x30);
        mn[4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 2) & 0x30);
    }
}

static void q4_k_row(const uint8_t *row, int64_t K, int o, uint8_t *codes, int8_t *sm, uint16_t *sd, int8_t *om,
                     uint16_t *od)
{
    for (int64_t sb = 0; sb < K / QK; sb++) {
        const uint8_t *b = row + sb * 144, *qs = b + 16;
        uint8_t sc[8], mn[8];
        memcpy(&sd[sb * OUT_BLOCK + o], b, 2);
        memcpy(&od[sb * OUT_BLOCK + o], b + 2, 2);
        q4_k_scales(b + 4, sc, mn);
        for (int g = 0; g < 8; g++) {
            sm[(sb * 8 + g) * OUT_BLOCK + o] = (int8_t)sc[g];
            om[(sb * 8 + g) * OUT_BLOCK + o] = (int8_t)mn[g];
        }
        for (int j = 0; j < 4; j++) /* 64 values: 32 bytes' low nibbles, then their high ones */
            for (int l = 0; l < 32; l++) {
                const uint8_t byte = qs[32 * j + l];
                for (int h = 0; h < 2; h++) {
                    const int64_t k = sb * QK + 64 * j + 32 * h + l;
                    int high;
                    const int64_t at = nibble_at(k, o, &high);
                    codes[at] |= (uint8_t)(((byte >> (4 * h)) & 15) << (4 * high));
                }
            }
    }
}

static void q6_k_row(const uint8_t *row, int64_t K, int o, uint8_t *codes, int8_t *sm, uint16_t *sd)
{
    for (int64_t sb = 0; sb < K / QK; sb++) {
        const uint8_t *b = row + sb * 210, *ql = b, *qh = b + 128;
        const int8_t *scale = (const int8_t *)(b + 192);
        memcpy(&sd[sb * OUT_BLOCK + o], b + 208, 2);
        for (int g = 0; g < 16; g++) sm[(sb * 16 + g) * OUT_BLOCK + o] = scale[g];
        for (int c = 0; c < 2; c++) /* 128 values: 64 bytes' low nibbles, then their high ones */
            for (int l = 0; l < 64; l++)
                for (int h = 0; h < 2; h++) {
                    const int64_t v = 128 * c + 64 * h + l; /* the value within the super-block */
                    const int s = (int)(v % 128) / 32, low = (ql[64 * c + l] >> (4 * h)) & 15;
                    const int high = (qh[32 * c + (v % 32)] >> (2 * s)) & 3;
                    const int u = low | (high << 4); /* c + 32 */
                    const int64_t k = sb * QK + v, quad = k >> 4, step = (k >> 2) & 3, i = k & 3;
                    uint8_t *q = codes + quad * 192;
                    q[64 * (step >> 1) + o * 4 + i] |= (uint8_t)((u & 15) << (4 * (step & 1)));
                    q[128 + o * 4 + i] |= (uint8_t)((u >> 4) << (2 * step));
                }
    }
}

/* raw: the matrix's GGUF bytes, N rows of K values; codes, scales, offsets: the outputs as
 * described above, per block of 16 outputs one after another (offsets: Q4_K only). */
void gguf_repack(const uint8_t *raw, int fmt, int64_t N, int64_t K, int signed_bytes, uint8_t *codes, uint8_t *scales,
                 uint8_t *offsets, int threads)
{
    const int64_t row_bytes = fmt == FMT_Q8_0 ? K / 32 * 34 : fmt == FMT_Q4_K ? K / QK * 144 : K / QK * 210;
    const int64_t code_bytes = fmt == FMT_Q8_0 ? K * OUT_BLOCK : fmt == FMT_Q4_K ? K * OUT_BLOCK / 2 : K / 16 * 192;
    const int64_t group = fmt == FMT_Q6_K ? 16 : 32;
    const int64_t mult_bytes = K / group * OUT_BLOCK, factor_bytes = K / QK * OUT_BLOCK * 2;
    const int64_t scale_bytes = fmt == FMT_Q8_0 ? K / 32 * OUT_BLOCK * 2 : mult_bytes + factor_bytes;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t nb = 0; nb < N / OUT_BLOCK; nb++) {
        uint8_t *c = codes + nb * code_bytes, *s = scales + nb * scale_bytes;
        uint8_t *f = offsets ? offsets + nb * scale_bytes : 0;
        if (fmt != FMT_Q8_0) memset(c, 0, (size_t)code_bytes); /* nibbles and bit planes are or-ed in */
        for (int o = 0; o < OUT_BLOCK; o++) {
            const uint8_t *row = raw + (nb * OUT_BLOCK + o) * row_bytes;
            if (fmt == FMT_Q8_0)
                q8_0_row(row, K, o, signed_bytes, c, (uint16_t *)s);
            else if (fmt == FMT_Q4_K)
                q4_k_row(row, K, o, c, (int8_t *)s, (uint16_t *)(s + mult_bytes), (int8_t *)f,
                         (uint16_t *)(f + mult_bytes));
            else
                q6_k_row(row, K, o, c, (int8_t *)s, (uint16_t *)(s + mult_bytes));
        }
    }
}
