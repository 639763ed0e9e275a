"""The target's top-k next-token log-probabilities for many positions at once: the labels of
prefill distillation (corpus.py).

Decoding needs the head for a few rows; labelling needs it for every position of a text, and
there the head is most of the cost (262k x 640 for Gemma 3). On a CPU with bf16 units a bf16
GEMM over a bf16 copy of the head reads ~300 GFLOP/s on 2 cores, where the float32 table (or
the int8 decode kernel) reads 80-120: the labels' logits then carry bf16 products summed in
float32, an error far below what a top-k KL label resolves. Elsewhere (AVX2 CPUs, CUDA) the
model's own head is used.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from specdraft.models.architectures.layers import softcap

# Rows scored per call: a [rows, V] float32 block (400 MB at Gemma's 262k vocabulary).
ROWS_PER_CALL = 384


def labels_in_bf16(model: torch.nn.Module) -> bool:
    from specdraft.device import cpu_has_bf16_units

    return model.head_weight.device.type == "cpu" and cpu_has_bf16_units()


def label_head(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [N, H] -> float32 logits [N, V] for labels: a bf16 GEMM on a CPU with bf16 units,
    else `model.logits`."""
    if not labels_in_bf16(model):
        return model.logits
    table = model.head_weight.detach().to(torch.bfloat16)
    cap = model.config.final_softcap
    return lambda hidden: softcap(F.linear(hidden.to(torch.bfloat16), table).float(), cap)


def topk_log_probs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k next-token (ids, log-probabilities) for hidden [N, H]. The top-k of the logits
    minus their logsumexp: no [N, V] log-softmax is written."""
    ids, logp = [], []
    for start in range(0, hidden.shape[0], ROWS_PER_CALL):
        top_ids, top_logp = top_log_probs(head(hidden[start : start + ROWS_PER_CALL]), k)
        ids.append(top_ids)
        logp.append(top_logp)
    return torch.cat(ids), torch.cat(logp)


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> the top-k (ids, log-probabilities) [N, k], without writing [N, V]
    log-probabilities."""
    top = torch.topk(logits, k, dim=-1)
    return top.indices, top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
