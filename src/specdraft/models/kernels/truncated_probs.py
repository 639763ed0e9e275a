"""sampling.probabilities for top-k and top-p in one C call per batch of rows (truncated_probs.c).

At Gemma's chat settings (temperature 1, top-k 64, top-p 0.95) torch took ~1.1 ms a row of
Gemma 3's 262144 logits (topk, a V-wide tie count, mask and softmax), and a sampled
verification pays it for every row it scores; top-p alone ~4 ms a row. The kernel sorts only the
tokens near the cut. Rows it leaves (a tie across a cut, a NaN, a flat row whose nucleus is
wider than CANDIDATES) are computed by sampling.probabilities, as are requests without top-k or
top-p (a softmax alone) and tensors the kernels do not take.
"""

from __future__ import annotations

import torch

from specdraft.models.kernels.build import applies, library
from specdraft.sampling import MIN_SCALED_TEMPERATURE, SamplingParams, probabilities

# Tokens a row may sort before it goes to torch: top-k's k and the tokens sharing the k-th's bin,
# or a top-p nucleus and its bin; wider nuclei are flat rows, where torch's sort is as good.
CANDIDATES = 16384


def truncated_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """sampling.probabilities(logits, params): the same law, the sums in another order."""
    vocab = logits.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if (not top_k and params.top_p >= 1.0) or params.temperature < MIN_SCALED_TEMPERATURE or logits.numel() == 0:
        return probabilities(logits, params)
    # Temperature as sampling._scaled applies it (bfloat16 logits widened first, exactly).
    x = logits.float() if params.temperature == 1.0 else logits.float() / params.temperature
    if not applies(x):
        return probabilities(logits, params)
    flat = x.reshape(-1, vocab).contiguous()
    out = torch.empty_like(flat)
    left = torch.zeros(flat.shape[0], dtype=torch.uint8)
    library().truncated_probs(flat.data_ptr(), flat.shape[0], vocab, top_k, params.top_p, CANDIDATES,
                              out.data_ptr(), left.data_ptr(), torch.get_num_threads())
    if bool(left.any()):
        rows = left.bool()
        out[rows] = probabilities(logits.reshape(-1, vocab)[rows], params)
    return out.view(logits.shape)
