/* One MTP draft step in one call: the drafter network of drafters/mtp/network.py from the token to
 * its clustered head's inputs.
 *
 *     e      = table[token] (widened to float32) * embed_scale        the target's input embedding
 *              (or `embeds`, the rows the target's own lookup gave: a table kept in a GGUF file's
 *              blocks is dequantised by its own decoder, which this file does not duplicate)
 *     x      = pre([e, state]);  x = blocks(x)                        decoder_stack, query-only
 *     z      = norm(x);  state' = post(z)
 *     scores = centroids(z);  bonus = gate(z)                         (when the drafter has them)
 *
 * The same kernels in the same order as the step's per-module path with the C kernels (Q8ActLinear,
 * Fp16Linear, RMSNorm's rms_norm_rows, decoder_stack), so the same bits. What it removes is the
 * Python between them: seven module calls a step, ~0.4 ms of a ~1.1 ms greedy draft step on a
 * 2-core CPU, where the blocks themselves take ~0.3 ms (BENCHMARKS.md).
 */
#include <string.h>

#include "decoder_layer.h"
#include "simd.h"

typedef struct {
    int64_t hidden, backbone; /* the drafter's width h and the target's H */
    int64_t centroids, gate_out; /* outputs of `centroids` and `gate`; 0: the drafter has none */
    Linear pre, post, centroid, gate; /* pre: 2H -> h, post: h -> H, centroid: h -> C, gate: h -> gate_out */
    const float *norm; /* the final norm's scale (NULL: none) */
    float eps;
    const void *table; /* the target's token table [V, H]: fp16 bits (table_half) or float32; NULL: `embeds` */
    int table_half;
    float embed_scale;
} DraftNet;

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Scratch floats draft_step needs for N rows through n blocks. */
int64_t draft_step_scratch(const DraftNet *net, const LayerWeights *L, const LayerStep *S, int64_t n)
{
    const int64_t N = S[0].B * S[0].T, h = net->hidden, H = net->backbone;
    const int64_t rows = Q8_SCRATCH(N, max64(2 * H, h));
    return N * (2 * H + 2 * h) + rows + decoder_stack_scratch(L, S, n);
}

/* tokens [N] int64, state [N, H] -> z [N, h], state_out [N, H], scores [N, centroids] and bonus
 * [N, gate_out] (each written only when the drafter has it). embeds [N, H]: the tokens' scaled
 * input embeddings, read where the net has no table (else NULL). */
void draft_step(const DraftNet *net, const LayerWeights *L, const LayerStep *S, int64_t n, const int64_t *tokens,
                const float *embeds, const float *state, float *z, float *state_out, float *scores, float *bonus,
                float *scratch, int threads)
{
    const int64_t N = S[0].B * S[0].T, h = net->hidden, H = net->backbone;
    float *joined = scratch, *x = joined + N * 2 * H, *y = x + N * h, *rows = y + N * h;
    float *work = rows + Q8_SCRATCH(N, max64(2 * H, h));

    for (int64_t r = 0; r < N; r++) { /* [e, state]: e as models' embed() gives it */
        float *e = joined + r * 2 * H;
        if (!net->table) {
            memcpy(e, embeds + r * H, H * sizeof(float));
        } else if (net->table_half) {
            const uint16_t *row = (const uint16_t *)net->table + tokens[r] * H;
            for (int64_t i = 0; i < H; i++) e[i] = _cvtsh_ss(row[i]) * net->embed_scale;
        } else {
            const float *row = (const float *)net->table + tokens[r] * H;
            for (int64_t i = 0; i < H; i++) e[i] = row[i] * net->embed_scale;
        }
        memcpy(e + H, state + r * H, H * sizeof(float));
    }
    linear(&net->pre, joined, x, N, h, 2 * H, rows, threads);
    decoder_stack(L, S, n, x, y, work, threads);
    rms_norm_rows(y, net->norm, 0, z, N, h, net->eps, threads);
    linear(&net->post, z, state_out, N, H, h, rows, threads);
    if (net->centroids)
        linear(&net->centroid, z, scores, N, net->centroids, h, rows, threads);
    if (net->gate_out)
        linear(&net->gate, z, bonus, N, net->gate_out, h, rows, threads);
}
