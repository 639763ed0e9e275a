"""What a weight format costs in quality, against the same model with unquantised weights.

Two measures: per-token KL(reference || format) of the next-token distributions over held-out
text (teacher-forced, every position), with top-1 agreement and the text's mean negative
log-likelihood under each; and the share of prompts whose greedy continuation is identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.speculative.engine import Engine

SCORE_ROWS = 8  # score a text in slices of a verify's width, as decoding would


@dataclass
class FormatQuality:
    weights: str
    tokens: int
    kl_mean: float
    kl_p95: float
    top1_agreement: float
    nll: float  # mean negative log-likelihood of the text under this format
    reference_nll: float
    greedy_identical: float  # share of prompts with the same greedy continuation
    prompts: int


@torch.inference_mode()
def _log_probs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(ids) + 1)
    hidden = model(torch.tensor([ids], device=cache.device), cache)[0]
    return torch.cat([torch.log_softmax(model.logits(hidden[i : i + SCORE_ROWS]), -1)
                      for i in range(0, hidden.shape[0], SCORE_ROWS)])


def compare(reference: torch.nn.Module, model: torch.nn.Module, weights: str, texts: list[list[int]],
            prompts: list[list[int]], max_new_tokens: int) -> FormatQuality:
    kls, agree, nll, ref_nll, n = [], [], 0.0, 0.0, 0
    for ids in texts:
        ref, got = _log_probs(reference, ids), _log_probs(model, ids)
        kls.append((ref.exp() * (ref - got)).sum(-1))
        agree.append((ref.argmax(-1) == got.argmax(-1)).float())
        target = torch.tensor(ids[1:], device=ref.device)[:, None]
        nll -= got[:-1].gather(1, target).sum().item()
        ref_nll -= ref[:-1].gather(1, target).sum().item()
        n += len(ids) - 1
    kl = torch.cat(kls).float()
    same = 0
    if prompts:
        a = Engine(reference).generate(prompts, max_new_tokens, eos_token_ids=[])
        b = Engine(model).generate(prompts, max_new_tokens, eos_token_ids=[])
        same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    return FormatQuality(weights, kl.numel(), kl.mean().item(), kl.quantile(0.95).item(),
                         torch.cat(agree).mean().item(), nll / max(n, 1), ref_nll / max(n, 1),
                         same / max(len(prompts), 1), len(prompts))
